"""Every kind of value a training state holds round-trips bit-exact, on every backend."""
from __future__ import annotations

import collections
import random

import numpy as np
import pytest
import torch
from support.helpers import assert_bit_exact

import ckptrepo

ALL_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
              torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64,
              torch.complex128, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
              torch.float8_e8m0fnu]


def training_objects(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        model(torch.randn(5, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, opt, sched


def typed_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out = {}
    for dt in ALL_DTYPES:
        base = torch.randn(7, 5, generator=g) * 50
        if dt == torch.bool:
            t = base > 0
        elif dt.is_complex:
            t = torch.complex(base, -base).to(dt)
        elif dt in (torch.uint16, torch.uint32, torch.uint64):
            t = base.abs().to(torch.int64).to(dt)
        else:
            t = base.to(dt)
        out[str(dt).removeprefix("torch.")] = t
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45, 3.4e38])
    special_bits = special.view(torch.int32).clone()
    special_bits[0] = 0x7FC12345  # a NaN with a payload must survive
    out["specials"] = special_bits.view(torch.float32)
    return out


def full_state():
    model, opt, sched = training_objects()
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    npgen = np.random.default_rng(1234)
    npgen.standard_normal(7)
    py_random = random.Random(99)
    state = {
        "model": model, "optimizer": opt, "scheduler": sched,
        "tensors": typed_tensors(),
        "shapes": {
            "zero_dim": torch.tensor(3.25), "zero_dim_int": torch.tensor(7, dtype=torch.int64),
            "empty": torch.empty(0, 3), "one": torch.ones(1),
            "transposed": base.t(), "strided": base[:, ::3], "view": base[2:4],
            "expanded": torch.arange(3).expand(4, 3),
            "conj": torch.complex(base, base).conj(),
        },
        "numpy": {
            "f32": np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32),
            "i16": np.arange(-5, 5, dtype=np.int16), "bool": np.array([True, False, True]),
            "c128": np.array([1 + 2j, -3j]), "noncontig": np.arange(20.0).reshape(4, 5)[:, ::2],
            "u64": np.array([2**64 - 1, 0], dtype=np.uint64), "scalar0d": np.array(2.5),
        },
        "rng": {
            "torch": torch.get_rng_state(), "python": py_random.getstate(), "numpy_state": npgen.bit_generator.state,
            "numpy_generator": npgen, "global_python": random.getstate(),
        },
        "plain": {
            "int": 3, "neg": -(2**63), "u64max": 2**64 - 1, "bigint": 2**200 + 1, "negbig": -(3**90),
            "float": 0.1, "nan": float("nan"), "inf": float("-inf"), "bool": True, "none": None,
            "str": "héllo ✓", "bytes": b"\x00\xffraw", "tuple": (1, (2.0, "x"), []), "list": [1, [2, [3]]],
            "int_keys": {0: "a", 1: {2: "b"}}, "tuple_keys": {(1, 2): "pair"}, "mixed_keys": {1: "int", "1": "str"},
            "ordered": collections.OrderedDict([("z", 1), ("a", 2)]), "np_scalars": [np.float32(1.5), np.int64(-3)],
            "dtype": torch.bfloat16, "size": torch.Size([2, 3]),
        },
        "step": 1000,
    }
    return state


def expected_plain(state):
    """What load() without into= returns: Stateful objects become their state dicts."""
    out = dict(state)
    out["model"] = state["model"].state_dict()
    out["optimizer"] = state["optimizer"].state_dict()
    out["scheduler"] = state["scheduler"].state_dict()
    shapes = dict(state["shapes"])
    out["shapes"] = {k: v.resolve_conj().contiguous() for k, v in shapes.items()}
    out["numpy"] = {k: np.require(v, requirements="C") for k, v in state["numpy"].items()}
    return out


def test_full_state_round_trips_bit_exact_on_every_backend(repo_url):
    repo = ckptrepo.init(repo_url)
    state = full_state()
    v = repo.snapshot(state, step=12, message="warmup done", metrics={"loss": 2.31, "lr": torch.tensor(0.5)})
    assert v.step == 12 and v.metrics == {"loss": 2.31, "lr": 0.5} and v.message == "warmup done"
    loaded = ckptrepo.open(repo_url).load("HEAD")
    assert_bit_exact(expected_plain(state), loaded)
    assert ckptrepo.open(repo_url).log()[0].id == v.id


def test_load_into_restores_live_objects(repo_url):
    repo = ckptrepo.init(repo_url)
    state = full_state()
    repo.snapshot(state, step=1)
    model2, opt2, sched2 = training_objects(seed=5)
    fresh_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(),
                                      torch.nn.Linear(16, 4), torch.nn.BatchNorm1d(4))
    fresh_opt = torch.optim.AdamW(fresh_model.parameters(), lr=1.0)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=2, gamma=0.5)
    weight_storage = fresh_model[0].weight.data_ptr()
    rng = np.random.default_rng(0)
    target = {"model": fresh_model, "optimizer": fresh_opt, "scheduler": fresh_sched,
              "rng": {"numpy_generator": rng}, "step": 0}
    result = repo.load("HEAD", into=target)
    assert result is target
    assert fresh_model[0].weight.data_ptr() == weight_storage, "parameters must be filled in place"
    assert_bit_exact(state["model"].state_dict(), fresh_model.state_dict())
    assert_bit_exact(state["optimizer"].state_dict(), fresh_opt.state_dict())
    assert_bit_exact(state["scheduler"].state_dict(), fresh_sched.state_dict())
    assert rng.bit_generator.state == state["rng"]["numpy_generator"].bit_generator.state
    assert target["step"] == 1000 and "tensors" in target
    # the restored optimizer continues exactly like the original
    x = torch.randn(5, 8)
    for m, o in ((state["model"], state["optimizer"]), (fresh_model, fresh_opt)):
        m(x).pow(2).mean().backward()
        o.step()
    assert_bit_exact(state["model"].state_dict(), fresh_model.state_dict())


def test_in_place_tensors_and_map_location(repo):
    w = torch.randn(4, 4)
    repo.snapshot({"w": w, "n": np.arange(4.0)}, step=1)
    dest = {"w": torch.zeros(4, 4).t(), "n": np.zeros(4)}  # a non-contiguous destination is filled too
    repo.load("@1", into=dest)
    assert torch.equal(dest["w"], w) and np.array_equal(dest["n"], np.arange(4.0))
    out = repo.load("HEAD", map_location="cpu")
    assert out["w"].device.type == "cpu" and isinstance(out["n"], np.ndarray)


def test_large_multi_shard_state_round_trips(repo, monkeypatch):
    """Tensors spanning shard boundaries and several streams per dtype still round-trip."""
    from ckptrepo.saving import _writer as writer
    original = writer.make_plan
    monkeypatch.setattr(writer, "make_plan", lambda records, shard_bytes=None, residues=None:
                        original(records, shard_bytes=1 << 20, residues=residues))
    repo.plumbing.plans = writer.PlanCache()
    g = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(int(1000 + 37_000 * (i % 5)), generator=g) for i in range(20)}
    state["bf"] = torch.randn(700_000, generator=g).to(torch.bfloat16)
    repo.snapshot(state, step=1)
    m = repo.plumbing.manifest(repo.resolve("HEAD"))
    assert len(m.arrays) == 2
    assert any(a.numel > a.shard_elems for a in m.arrays.values()), "the test must span several shards"
    assert_bit_exact(state, repo.load("HEAD"))


def test_data_is_a_few_large_zarr_v3_arrays_readable_by_zarr_python(repo, tmp_path):
    import zarr
    state = {f"layer{i}.weight": torch.randn(64, 64) for i in range(50)}
    state["embed"] = torch.randn(100, 64).to(torch.float16)
    repo.snapshot(state, step=1)
    vid = repo.resolve("HEAD")
    m = repo.plumbing.manifest(vid)
    assert sorted(m.arrays) == [f"data/{vid}/0/float16", f"data/{vid}/0/float32"]
    keys = repo.plumbing.store.list(f"data/{vid}/")
    # per array: its zarr.json, its one shard and its chunk table: not one object per tensor
    assert len(keys) == 6, keys
    arr = zarr.open_array(str(tmp_path / "repo" / "data" / vid / "0" / "float32"), mode="r")
    flat = torch.cat([state[f"layer{i}.weight"].reshape(-1) for i in range(50)])
    assert np.array_equal(arr[:], flat.numpy())


def test_plan_is_reused_for_the_same_structure(repo):
    state = {"a": torch.randn(10), "b": torch.randn(3, 3)}
    for step in range(3):
        state["a"] += 1
        state["b"] += 1   # every tensor changes: dedup would plan the changing part apart
        repo.snapshot(state, step=step)
    assert repo.plumbing.plans.misses == 1
    assert_bit_exact(state, repo.load("HEAD"))


def test_a_file_url_is_percent_decoded_and_names_the_same_repository_as_the_path(tmp_path):
    """``file:///runs/my%20run`` is the directory ``/runs/my run`` (RFC 8089), as a plain path would name it."""
    path = tmp_path / "my run" / "repo"
    url = "file://" + str(path).replace(" ", "%20")
    v = ckptrepo.init(url).snapshot({"x": torch.arange(6.0)}, step=3)
    assert (tmp_path / "my run" / "repo").is_dir() and not (tmp_path / "my%20run").exists()
    assert ckptrepo.open(str(path)).log()[0].id == v.id
    assert torch.equal(ckptrepo.open(url).load("HEAD")["x"], torch.arange(6.0))


def _trained_pair(lr: float):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    opt.param_groups[0]["lr"] = lr
    return model, opt


@pytest.mark.parametrize("saved_as", ["objects", "state_dicts"])
@pytest.mark.parametrize("path", ["plain", "layout"])
def test_into_modules_and_optimizers_fills_them_in_place_however_they_were_saved(repo, saved_as, path):
    """`into={"model": model, "optim": opt}` fills that module and optimizer (weights, moments, learning rate,
    buffers) and leaves them in the returned dict, whether the version holds the objects or their
    `state_dict()`s (DCP's habit), with or without a parallel layout. The layout path used to lose the learning
    rate and put a dict of Nones in the module's place; the plain path replaced a module with the saved dict."""
    from ckptrepo.parallel.layout import ParallelLayout

    model, opt = _trained_pair(lr=0.123)
    saved = {"model": model, "optim": opt} if saved_as == "objects" else \
        {"model": model.state_dict(), "optim": opt.state_dict()}
    layout = ParallelLayout() if path == "layout" else None
    repo.snapshot({**saved, "step": 7}, step=7, parallel_layout=layout)
    model2, opt2 = _trained_pair(lr=0.5)
    into = {"model": model2, "optim": opt2, "step": 0}
    out = repo.load("HEAD", into=into, parallel_layout=layout)
    assert out["model"] is model2 and out["optim"] is opt2 and out["step"] == 7
    for k, v in model.state_dict().items():
        assert torch.equal(model2.state_dict()[k], v), k
    assert opt2.param_groups[0]["lr"] == 0.123
    for p, p2 in zip(model.parameters(), model2.parameters()):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt2.state[p2][k], opt.state[p][k]), k


def test_numpy_zero_dim_and_big_endian_arrays_round_trip(repo):
    state = {"scalar": np.array(2.5), "be": np.arange(4, dtype=">i4"), "strided": np.arange(12.0).reshape(3, 4)[:, ::2]}
    repo.snapshot(state, step=1)
    out = repo.load("HEAD")
    assert out["scalar"].shape == () and out["scalar"] == 2.5        # was (1,), and unloadable into itself
    assert out["be"].tolist() == [0, 1, 2, 3] and out["be"].dtype == np.dtype("int32")
    assert np.array_equal(out["strided"], state["strided"])
    into = {"scalar": np.array(0.0), "be": np.zeros(4, dtype=np.int32), "strided": np.zeros((3, 2))}
    repo.load("HEAD", into=into)
    assert into["scalar"] == 2.5 and into["be"].tolist() == [0, 1, 2, 3]


def test_values_python_and_numpy_convert_lossily_round_trip(repo):
    """An int of over 4300 digits (str() refuses it: the snapshot failed, or its version failed every load and
    `show`), numpy's ulonglong ('Q') arrays (refused as "uint64 is not supported"), and a numpy Generator's seed
    sequence (spawn() gave other children after every load)."""
    huge = -(7 ** 9000)
    gen = np.random.default_rng(1234)
    gen.spawn(2)
    q = np.array([1, 2**64 - 1], dtype=np.ulonglong)
    repo.snapshot({"huge": huge, "q": q, "gen": gen}, step=1)
    out = repo.load("HEAD")
    assert out["huge"] == huge
    assert out["q"].dtype == np.uint64 and out["q"].tolist() == q.tolist()
    assert [c.integers(1 << 30) for c in out["gen"].spawn(2)] == [c.integers(1 << 30) for c in gen.spawn(2)]
    into = {"huge": 0, "q": np.zeros(2, dtype=np.ulonglong), "gen": np.random.default_rng(0)}
    repo.load("HEAD", into=into)
    assert into["q"].tolist() == q.tolist() and into["huge"] == huge
    shown = dict(repo.show("HEAD").objects)
    assert shown["huge"].endswith(f"({huge.bit_length()} bits)") and len(shown["huge"]) <= 80, shown


@pytest.mark.parametrize("path", ["plain", "layout"])
def test_into_parameters_and_schedulers(repo, path):
    """Parameters (requires_grad) are filled in place, where autograd refused the copy halfway through a load;
    a scheduler's live lists are not written before its load_state_dict (SequentialLR's _last_lr is shared
    with its first scheduler, and came back wrong)."""
    from torch.optim.lr_scheduler import ExponentialLR, LinearLR, SequentialLR

    from ckptrepo.parallel.layout import ParallelLayout

    def pair():
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, opt, SequentialLR(opt, [LinearLR(opt, 0.1, total_iters=2), ExponentialLR(opt, 0.9)],
                                        milestones=[2])

    model, opt, sched = pair()
    for _ in range(3):
        opt.step()
        sched.step()
    layout = ParallelLayout() if path == "layout" else None
    repo.snapshot({"params": dict(model.named_parameters()), "sched": sched, "opt": opt}, step=3,
                  parallel_layout=layout)
    model2, opt2, sched2 = pair()
    params = dict(model2.named_parameters())
    out = repo.load("HEAD", into={"params": params, "sched": sched2, "opt": opt2}, parallel_layout=layout)
    assert out["params"]["weight"] is model2.weight and model2.weight.requires_grad
    assert torch.equal(model2.weight, model.weight) and torch.equal(model2.bias, model.bias)
    assert sched2.get_last_lr() == sched.get_last_lr() and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


@pytest.mark.parametrize("url,clean", [("s3://bkt/x/../y", "s3://bkt/y"), ("gs://bkt/./runs/a", "gs://bkt/runs/a")])
def test_dot_segments_in_an_object_store_prefix_are_refused(url, clean):
    """Object stores normalised them on reads and writes but not in listings: the repository saw none of its
    own versions and fsck said ok. No request is made: the URL is refused as it is parsed."""
    from ckptrepo.errors import StorageError
    with pytest.raises(StorageError, match=rf"'\.' and '\.\.' are not allowed in an object store prefix; write it "
                                           rf"out: {clean}$"):
        ckptrepo.init(url)


def test_into_with_a_plain_list_of_another_length_is_replaced(repo):
    """A loss history or a sampler's remaining indices grows: a fresh object's empty list was refused
    ("0 items in `into` but 2 saved"), where DCP restores it. Lists holding tensors must still match."""
    class History:
        def __init__(self):
            self.losses = []

        def state_dict(self):
            return {"losses": list(self.losses)}

        def load_state_dict(self, sd):
            self.losses = list(sd["losses"])
    h = History()
    h.losses += [1.0, 0.5]
    repo.snapshot({"hist": h, "order": [3, 1, 2], "ts": [torch.ones(2)]}, step=1)
    fresh, order = History(), []
    repo.load("@1", into={"hist": fresh, "order": order, "ts": [torch.zeros(2)]})
    assert fresh.losses == [1.0, 0.5] and order == [3, 1, 2]
    with pytest.raises(ckptrepo.errors.StateMismatchError, match=r"state\['ts'\]: 0 items in `into` but 1 saved"):
        repo.load("@1", into={"hist": History(), "order": [], "ts": []})
