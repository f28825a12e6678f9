"""Bad input gets a clear one-line error and leaves the repository and the caller's state unchanged."""
from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch

import ckptrepo
from ckptrepo.errors import StateMismatchError, UnsupportedValueError


def listing(path):
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


class Opaque:
    class Sub(torch.Tensor):
        """A tensor subclass: loading it as a plain tensor would drop what it adds."""

    @staticmethod
    def deep(depth):
        state = {"w": torch.ones(1)}
        for _ in range(depth):
            state = {"k": state}
        return state

    @staticmethod
    def cycle():
        state = {}
        state["x"] = state
        return state


@pytest.mark.parametrize("value, where, what", [
    ({"a": {"b": [1, Opaque()]}}, "state['a']['b'][1]", "Opaque"),
    ({"f": lambda x: x}, "state['f']", "function"),
    ({"s": {1, 2}}, "state['s']", "set"),
    ({"t": torch.zeros(3).to_sparse()}, "state['t']", "sparse"),
    ({"k": {object(): 1}}, "state['k']", "dict key"),
    # each of these was accepted and then failed the commit after the data was written, or loaded as something else
    ({"c": {"cursor": "abc\udcff"}}, "state['c']['cursor']", "UTF-8 cannot encode"),
    ({"d": {"m": np.ma.masked_array([1.0, 2.0], mask=[0, 1])}}, "state['d']['m']", "numpy.ma.MaskedArray"),
    ({"w": torch.ones(2).as_subclass(Opaque.Sub)}, "state['w']", "tensor subclass"),
    ({"lazy": torch.nn.LazyLinear(2).weight}, "state['lazy']", "uninitialised lazy"),
    (Opaque.deep(150), "state['k']['k']", "nested more than 100 deep"),
    (Opaque.cycle(), "state['x']['x']", "nested more than 100 deep"),
])
def test_unsupported_values_are_refused_naming_the_key_path(repo, tmp_path, value, where, what):
    repo.snapshot({"ok": torch.ones(2)}, step=0)
    before = listing(tmp_path / "repo")
    with pytest.raises(UnsupportedValueError) as info:
        repo.snapshot(value, step=1)
    msg = str(info.value)
    assert where in msg and what in msg and "\n" not in msg
    assert listing(tmp_path / "repo") == before, "a refused snapshot must write nothing"
    assert len(repo.log()) == 1


def test_into_with_wrong_shapes_changes_nothing(repo):
    repo.snapshot({"a": torch.ones(2, 3), "b": torch.ones(4)}, step=0)
    a, b = torch.zeros(2, 3), torch.zeros(5)
    with pytest.raises(StateMismatchError, match=r"state\['b'\]: shape \[5\] in `into` but \[4\]"):
        repo.load("HEAD", into={"a": a, "b": b})
    assert a.sum() == 0, "nothing is loaded when any tensor mismatches"
    with pytest.raises(StateMismatchError, match="dtype torch.float16"):
        repo.load("HEAD", into={"a": torch.zeros(2, 3, dtype=torch.float16), "b": torch.zeros(4)})
    with pytest.raises(StateMismatchError, match=r"state\['c'\]: present in `into` but not saved"):
        repo.load("HEAD", into={"a": a, "b": torch.zeros(4), "c": torch.zeros(1)})
    with pytest.raises(StateMismatchError, match="holds int"):
        repo.load("HEAD", into={"a": 3, "b": torch.zeros(4)})


def test_into_with_another_dtype_is_refused_on_the_layout_path_too(repo):
    """The piece-wise load cast silently, float32 into int32 truncating, where the plain load refuses."""
    from support.dist_workers import SPLIT_RULES
    state = {"col.weight": torch.randn(8, 4), "row.weight": torch.randn(4, 8), "norm.weight": torch.randn(4)}
    repo.snapshot({"model": state}, step=1, parallel_layout=ckptrepo.ParallelLayout(rules=SPLIT_RULES))
    lay = ckptrepo.ParallelLayout(tp=2, rules=SPLIT_RULES)
    into = {"model": {"col.weight": torch.zeros(4, 4, dtype=torch.int32), "row.weight": torch.zeros(4, 4),
                      "norm.weight": torch.zeros(4)}}
    with pytest.raises(StateMismatchError, match=r"model/col.weight: dtype torch.int32 in `into` but float32 in the "
                                                 r"version; cast after loading"):
        repo.load("HEAD", parallel_layout=lay, rank=0, into=into)
    assert not into["model"]["row.weight"].any(), "nothing is loaded when any tensor mismatches"
    into["model"]["col.weight"] = torch.zeros(4, 4)
    repo.snapshot({"model": state, "step": 7}, step=2, parallel_layout=ckptrepo.ParallelLayout(rules=SPLIT_RULES))
    out = repo.load("HEAD", parallel_layout=lay, rank=1, into=into)
    assert torch.equal(into["model"]["col.weight"], state["col.weight"][4:])
    assert out["step"] == 7, "a saved plain value into lacks is added, as by the plain load"


def test_model_with_wrong_architecture(repo):
    repo.snapshot({"model": torch.nn.Linear(4, 8)}, step=0)
    other = torch.nn.Linear(4, 9)
    w = other.weight.detach().clone()
    with pytest.raises(StateMismatchError,
                       match=r"state\['model'\]\['weight'\]: shape \[9, 4\] in `into` but \[8, 4\]"):
        repo.load("HEAD", into={"model": other})
    assert torch.equal(other.weight, w)


def test_loading_never_unpickles(repo, tmp_path, monkeypatch):
    """Even a state holding pickle-looking bytes loads as bytes; pickle is never called."""
    payload = pickle.dumps({"x": 1})
    repo.snapshot({"blob": payload}, step=0)
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: (_ for _ in ()).throw(AssertionError("pickle used")))
    monkeypatch.setattr(pickle, "load", lambda *a, **k: (_ for _ in ()).throw(AssertionError("pickle used")))
    assert repo.load("HEAD") == {"blob": payload}


def test_a_cause_is_quoted_by_its_first_line_or_its_type():
    """Errors that quote a cause (a TensorStore or OS error) stay one line, and a cause without a message
    (which ``str(err).splitlines()[0]`` turned into an IndexError) is named by its type."""
    from ckptrepo.errors import first_line
    assert first_line(ValueError("bad chunk\n  at offset 4096")) == "bad chunk"
    assert first_line(OSError()) == "OSError"
    assert first_line(RuntimeError("  \n")) == "RuntimeError"


@pytest.mark.parametrize("path", ["plain", "layout"])
def test_loading_into_meta_tensors_is_refused_not_silently_skipped(repo, path):
    """Copying into a meta tensor does nothing and raises nothing: a load into a model built on the meta device
    returned it untouched, as if restored."""
    from ckptrepo.errors import CkptRepoError
    from ckptrepo.parallel.layout import ParallelLayout

    layout = ParallelLayout() if path == "layout" else None
    repo.snapshot({"model": torch.nn.Linear(4, 3).state_dict()}, step=1, parallel_layout=layout)
    with torch.device("meta"):
        model = torch.nn.Linear(4, 3)
    with pytest.raises(CkptRepoError) as info:
        repo.load("HEAD", into={"model": model}, parallel_layout=layout)
    msg = str(info.value)
    assert "['model']['weight']" in msg and "meta" in msg and "to_empty" in msg and "\n" not in msg, msg


def test_retention_counts_must_be_whole_numbers_of_at_least_one(repo):
    """`keep_last=-1` or `keep_every=0` switched retention on and pruned all but the branch heads."""
    from ckptrepo.errors import RetentionError
    from ckptrepo.maintenance._gc import RetentionPolicy

    for step in range(3):
        repo.snapshot({"x": torch.full((2,), float(step))}, step=step)
    for rule in ({"keep_last": -1}, {"keep_every": 0}, {"keep_last": 2.5}, {"keep_last": True},
                 {"keep_last": 1, "grace_period_s": -1}):
        with pytest.raises(RetentionError) as info:
            repo.gc(**rule)
        assert "\n" not in str(info.value)
    with pytest.raises(RetentionError, match="ranks versions only for keep_best"):
        repo.gc(keep_last=1, best_metric="loss")          # was silently ignored
    with pytest.raises(RetentionError, match="every_commits must be a whole number"):
        RetentionPolicy(keep_last=2, every_commits=0)
    assert not any(v.pruned for v in repo.log())


@pytest.mark.parametrize("value, what", [
    ({np.float64(0.5): 1}, "dict key np.float64(0.5)"),                 # was saved, then unreadable
    ({"m": {"ld": np.ones(2, dtype=np.longdouble)}}, "state['m']['ld']: numpy dtype float128"),
])
def test_numpy_values_torch_cannot_hold_are_refused_at_snapshot(repo, value, what):
    with pytest.raises(UnsupportedValueError) as info:
        repo.snapshot(value, step=1)
    assert what in str(info.value) and repo.log() == []


def test_into_problems_found_late_are_refused_before_anything_is_filled(repo):
    """An optimizer with other parameter groups (torch's error after the model was overwritten), a live optimizer
    where the version saved a plain value (silently replaced by a list), and an expanded target (torch's error
    midway) are one-line StateMismatchErrors naming the key, with `into` untouched."""
    model = torch.nn.Linear(2, 2)
    repo.snapshot({"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "plain": [1, 2]}, step=1)

    def fresh():
        m = torch.nn.Linear(2, 2)
        torch.nn.init.zeros_(m.weight)
        return m
    m = fresh()
    two_groups = torch.optim.SGD([{"params": [m.weight]}, {"params": [m.bias]}], lr=0.1)
    with pytest.raises(StateMismatchError, match=r"\['opt'\]\['param_groups'\]: the optimizer in `into` has "
                                                 r"parameter groups of \[1, 1\] parameters .* saved groups of \[2\]"):
        repo.load("HEAD", into={"model": m, "opt": two_groups, "plain": [1, 2]})
    assert not m.weight.any()
    m = fresh()
    with pytest.raises(StateMismatchError, match=r"\['plain'\]: `into` holds a SGD but version .* saved a list"):
        repo.load("HEAD", into={"model": m, "opt": torch.optim.SGD(m.parameters(), lr=0.1),
                                "plain": torch.optim.SGD(m.parameters(), lr=0.1)})
    assert not m.weight.any()
    repo.snapshot({"model": model, "sched": None}, step=3)   # a scheduler enabled since: the live one stays
    m = fresh()
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(m.parameters(), lr=0.1), 1)
    into = {"model": m, "sched": sched}
    repo.load("HEAD", into=into)
    assert into["sched"] is sched and torch.equal(m.weight, model.weight)
    repo.snapshot({"a": torch.ones(3), "b": torch.ones(2, 3)}, step=2)
    a = torch.zeros(3)
    for b in (torch.zeros(3).expand(2, 3), torch.zeros(5).as_strided((2, 3), (2, 1))):   # b[0, 2] is b[1, 0]
        with pytest.raises(StateMismatchError, match=r"\['b'\]: the tensor in `into` is a view whose elements "
                                                     r"share memory"):
            repo.load("HEAD", into={"a": a, "b": b})
    assert not a.any()


def test_mismatches_found_only_by_load_state_dict_or_set_state_are_refused_before_anything_is_filled(repo):
    """A module lacking saved keys (torch's multi-line error, after the other tensors were filled) and a numpy
    Generator over another bit generator (a ValueError, likewise late) are one-line StateMismatchErrors,
    raised while `into` is still untouched."""
    repo.snapshot({"model": torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)), "x": torch.ones(2),
                   "g": np.random.Generator(np.random.PCG64DXSM(1))}, step=1)
    small = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    del small[1]
    before = small[0].weight.clone()
    x = torch.zeros(2)
    with pytest.raises(StateMismatchError, match=r"\['model'\]\['1.weight'\]: saved in version .* \(and 1 more\)"):
        repo.load("HEAD", into={"model": small, "x": x, "g": np.random.Generator(np.random.PCG64DXSM(2))})
    assert torch.equal(x, torch.zeros(2)) and torch.equal(small[0].weight, before)
    with pytest.raises(StateMismatchError, match=r"\['g'\]: a numpy Generator over PCG64 in `into` but over PCG64DXSM"):
        repo.load("HEAD", into={"model": torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)), "x": x,
                                "g": np.random.default_rng(2)})
    assert torch.equal(x, torch.zeros(2))


@pytest.mark.parametrize("path", ["plain", "layout"])
def test_an_unavailable_or_bogus_device_is_refused_before_any_read(repo, path, monkeypatch):
    """torch would fail only at the first .to(), after the reads, with an AssertionError on a CPU-only build."""
    from ckptrepo.loading import _device_load as device_load
    from ckptrepo.loading import _layout_load as layout_load
    layout = ckptrepo.ParallelLayout() if path == "layout" else None
    repo.snapshot({"w": torch.ones(3)}, step=1)
    reads = []
    monkeypatch.setattr(device_load, "read_tensors_to", lambda *a, **k: reads.append(1))
    monkeypatch.setattr(layout_load, "read_pieces_to", lambda *a, **k: reads.append(1))
    bad = "cuda:99" if torch.cuda.is_available() else "cuda"
    with pytest.raises(ValueError, match=r"cannot load onto device 'cuda(:99)?'.*load with device='cpu'"):
        repo.load("HEAD", device=bad, parallel_layout=layout)
    with pytest.raises(ValueError, match=r"is not a device; pass 'cpu'"):
        repo.load("HEAD", map_location={"cuda:0": "cpu"}, parallel_layout=layout)
    assert not reads
    monkeypatch.undo()
    assert torch.equal(repo.load("HEAD", device="cpu", parallel_layout=layout)["w"], torch.ones(3))


def test_rules_with_another_layer_count_than_the_model_are_refused(repo):
    """Loading with num_layers below the saved model's dropped its last layers without a word; above it, layers
    went to the wrong pipeline stages. Saving with too few layers in the rules is refused too."""
    from support.megatron_ref import GPTConfig, init_full_params, shard_full

    from ckptrepo.errors import LayoutError
    from ckptrepo.rules import megatron_gpt
    cfg = GPTConfig()
    state = shard_full(cfg, ckptrepo.ParallelLayout(), 0, init_full_params(cfg))

    def rules(n):
        return megatron_gpt(n, cfg.vocab_size, cfg.make_vocab_size_divisible_by)
    with pytest.raises(LayoutError, match=rf"layers.{cfg.layers - 1}.*the rules say num_layers={cfg.layers - 1}"):
        repo.snapshot(state, step=1, parallel_layout=ckptrepo.ParallelLayout(rules=rules(cfg.layers - 1)))
    repo.snapshot(state, step=1, parallel_layout=ckptrepo.ParallelLayout(rules=rules(cfg.layers)))
    for n, pp in ((cfg.layers - 1, 1), (cfg.layers + 2, 2)):
        with pytest.raises(LayoutError, match=rf"the rules say num_layers={n} but this version's model has "
                                              rf"{cfg.layers} layers \(layers.0 to layers.{cfg.layers - 1}\)"):
            repo.load("HEAD", parallel_layout=ckptrepo.ParallelLayout(pp=pp, rules=rules(n)), rank=0)
    with pytest.warns(UserWarning, match="layout changed .* per-rank state rng"):   # one saved rank's RNG state
        out = repo.load("HEAD", parallel_layout=ckptrepo.ParallelLayout(pp=2, rules=rules(cfg.layers)), rank=1)
    assert torch.equal(out["model"]["layers.0.mlp.fc1.weight"],
                       state["model"][f"layers.{cfg.layers // 2}.mlp.fc1.weight"])


def test_a_multi_rank_layout_needs_a_rank_that_is_an_int(repo):
    """Without rank= and without a process group of the layout's size, a load silently gave rank 0's slice
    (or this process's rank of a smaller group), leaving the rest of the layout unloaded."""
    from support.dist_workers import SPLIT_RULES

    from ckptrepo.errors import LayoutError
    state = {"col.weight": torch.randn(8, 4), "row.weight": torch.randn(4, 8), "norm.weight": torch.randn(4)}
    repo.snapshot({"model": state}, step=1, parallel_layout=ckptrepo.ParallelLayout(rules=SPLIT_RULES))
    lay = ckptrepo.ParallelLayout(tp=2, rules=SPLIT_RULES)
    with pytest.raises(LayoutError, match=r"the layout \(tp=2 pp=1 dp=1 zero=0\) has 2 ranks: pass rank= \(0 to 1\)"):
        repo.load("HEAD", parallel_layout=lay)
    for bad in (1.0, "1", True):
        with pytest.raises(LayoutError, match=rf"rank={bad!r} is not a rank; pass an int"):
            repo.load("HEAD", parallel_layout=lay, rank=bad)
    out = repo.load("HEAD", parallel_layout=lay, rank=np.int64(1))
    assert torch.equal(out["model"]["col.weight"], state["col.weight"][4:])
    assert torch.equal(repo.load("HEAD", parallel_layout=ckptrepo.ParallelLayout(rules=SPLIT_RULES))["model"]
                       ["row.weight"], state["row.weight"])   # one rank: no rank= needed


@pytest.mark.parametrize("kwargs,fragment", [
    ({"step": 1 << 64}, "step 18446744073709551616 does not fit in 64 bits"),
    ({"step": 1.7}, "step must be an int or None, not float 1.7"),
    ({"step": "3"}, "step must be an int or None, not str '3'"),
    ({"message": 123}, "message must be a str, not int"),
    ({"message": "\ud800"}, "message is not valid text (surrogates not allowed at position 0)"),
    ({"metrics": "loss=1"}, "metrics must be a dict of numbers and strings, not str"),
    ({"metrics": {"n": 1 << 64}}, "metric 'n' = 18446744073709551616 does not fit in 64 bits"),
    ({"metrics": {"x": object()}}, "metric 'x' must be a number or string, not object"),
])
def test_header_fields_the_manifest_cannot_hold_are_refused_at_snapshot(repo, kwargs, fragment):
    """They were accepted, then failed the background commit; the failure record failed the same way, which
    killed the commit thread: later snapshots never committed and wait() and exit hung (or, for a message
    that is not a str, the version committed and `ckptrepo log` failed on it for good)."""
    with repo.snapshotter() as snap:
        with pytest.raises(UnsupportedValueError) as info:
            snap.snapshot({"w": torch.ones(2)}, **kwargs)
        assert fragment in str(info.value)
        h = snap.snapshot({"w": torch.ones(2)}, step=np.int64(2), message=None)   # numpy ints and None are fine
        snap.wait()
    assert h.result().step == 2 and [v.step for v in repo.log()] == [2]


def test_the_commit_thread_outlives_a_failure_it_cannot_record(repo, monkeypatch):
    """An exception outside the library's own (here from the failure record itself) killed the commit thread."""
    from ckptrepo.errors import SnapshotFailedError
    from ckptrepo.saving import _commit as commit

    def broken_record(self, job, cause):
        raise TypeError("cannot serialise")
    monkeypatch.setattr(commit.Committer, "record_failure", broken_record)
    with repo.snapshotter() as snap:
        monkeypatch.setattr(commit.Committer, "commit", lambda self, job: (_ for _ in ()).throw(OSError("disk")))
        snap.snapshot({"w": torch.ones(2)}, step=1)
        with pytest.raises(SnapshotFailedError, match="disk"):
            snap.wait()
        monkeypatch.undo()
        snap.snapshot({"w": torch.ones(2)}, step=2)
        snap.wait()
    assert [v.step for v in repo.log()] == [2]


@pytest.mark.parametrize("size", ["-1", "0", "abc", "1e3", " ", 1.5, -5, True])
def test_a_host_memory_that_is_not_a_size_is_refused(repo, size):
    """"-1" gave a pool of two 64 KiB buffers, "0" the default, "abc" a raw int() error, 1.5 an AttributeError."""
    with pytest.raises(ValueError, match=r"host_memory .* is not a size; pass bytes \(an int > 0\) or a string like"):
        repo.snapshotter(host_memory=size)
    assert repo.snapshotter(host_memory="1.5 MiB").host_memory == 3 << 19


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_a_nested_tensor_is_refused_naming_its_key(repo):
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])   # strided layout: torch has no sizes for it
    with pytest.raises(UnsupportedValueError, match=r"state\['n'\]: nested tensors are not supported; save their "
                                                    r"components"):
        repo.snapshot({"n": nested}, step=1)


def _layout_version(tmp_path):
    """A version that loads through the piece-wise path (a layout named at save), of a model, its Adam state
    after one step, and a numpy array."""
    from ckptrepo.parallel.layout import ParallelLayout
    from ckptrepo.rules import Rules
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    repo = ckptrepo.init(str(tmp_path / "repo"))
    layout = ParallelLayout(rules=Rules([]))
    repo.snapshot({"model": model, "optim": opt, "arr": np.arange(1 << 14, dtype=np.float32)}, step=1,
                  parallel_layout=layout)
    return repo, layout, model


def _fresh(groups=None):
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    params = list(m.parameters())
    opt = torch.optim.Adam(params if groups is None else [{"params": params[:groups]}, {"params": params[groups:]}],
                           lr=0.1)
    m(torch.randn(3, 4)).sum().backward()
    opt.step()   # state of the same structure as the saved one
    return m, opt


@pytest.mark.parametrize("case", ["read-only array", "strided array", "unstepped optimizer", "module lacks a key",
                                  "extra tensor", "expanded view", "overlapping view", "other param groups"])
def test_a_layout_load_into_refuses_what_the_plain_load_refuses_before_changing_anything(tmp_path, case) -> None:
    """The piece-wise path (every multi-rank version, any load with a layout) filled `into` with none of the
    plain load's checks: a read-only numpy array was written into (a segfault for a read-only memory map), a
    strided one filled a copy, an optimizer that had not stepped silently got no moments, extra or missing
    module keys and an optimizer with other parameter groups loaded. Each is refused, with nothing changed."""
    repo, layout, _ = _layout_version(tmp_path)
    m, opt = _fresh(groups=2 if case == "other param groups" else None)
    arr = np.zeros(1 << 14, dtype=np.float32)
    into = {"model": m, "optim": opt, "arr": arr}
    if case == "read-only array":
        path = str(tmp_path / "a.npy")
        np.save(path, arr)
        into["arr"] = np.load(path, mmap_mode="r")
    elif case == "strided array":
        into["arr"] = np.zeros(2 << 14, dtype=np.float32)[::2]
    elif case == "unstepped optimizer":
        into["optim"] = torch.optim.Adam(m.parameters(), lr=0.1)
    elif case == "module lacks a key":
        m[1].bias = None
    elif case == "extra tensor":
        m.register_buffer("extra", torch.zeros(3))
    elif case == "expanded view":
        m[0].weight = torch.nn.Parameter(torch.zeros(1, 4).expand(4, 4))
    elif case == "overlapping view":
        m[0].weight = torch.nn.Parameter(torch.zeros(10).as_strided((4, 4), (2, 1)))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    arr_before = np.array(into["arr"])
    with pytest.raises(StateMismatchError) as err:
        repo.load("HEAD", parallel_layout=layout, rank=0, into=into)
    assert "\n" not in str(err.value)
    assert all(torch.equal(m.state_dict()[k], v) for k, v in before.items())
    assert np.array_equal(into["arr"], arr_before)
    if case == "unstepped optimizer":
        assert "has not stepped" in str(err.value) and into["optim"].state_dict()["state"] == {}


def test_a_layout_load_into_a_plain_dict_may_take_only_some_tensors(tmp_path) -> None:
    """A plain dict (not a module or optimizer) in `into` may hold only the tensors the caller wants."""
    repo, layout, saved_model = _layout_version(tmp_path)
    into = {"model": {"0.weight": torch.zeros(4, 4)}}
    repo.load("HEAD", parallel_layout=layout, rank=0, into=into)
    assert torch.equal(into["model"]["0.weight"], saved_model[0].weight.detach())


def test_a_fresh_zero_build_of_mixed_dtypes_is_refused_not_cast(tmp_path) -> None:
    """A flat ZeRO partition has one dtype: built from bf16 and fp64 tensors it was cast to bf16, silently."""
    from ckptrepo.errors import LayoutError
    from ckptrepo.parallel.layout import ParallelLayout
    from ckptrepo.rules import Rules
    repo = ckptrepo.init(str(tmp_path / "repo"))
    rules = Rules([], optimizer_sections=("optimizer/exp_avg",))
    mom = {"a": torch.ones(8, 4, dtype=torch.bfloat16), "b": torch.full((16, 4), 1.0001, dtype=torch.float64)}
    repo.snapshot({"model": {k: v.clone() for k, v in mom.items()}, "optimizer": {"exp_avg": mom}}, step=1,
                  parallel_layout=ParallelLayout(rules=rules))
    with pytest.raises(LayoutError, match="bfloat16, float64"):
        repo.load("HEAD", parallel_layout=ParallelLayout(dp=2, zero=1, rules=rules), rank=1)
    into = {"model": {k: torch.zeros_like(v) for k, v in mom.items()},
            "optimizer": {"exp_avg": torch.zeros(48, dtype=torch.float64)}}   # rank 1's partition: all fp64
    repo.load("HEAD", parallel_layout=ParallelLayout(dp=2, zero=1, rules=rules), rank=1, into=into)
    assert torch.equal(into["optimizer"]["exp_avg"], mom["b"].reshape(-1)[16:])


def test_a_single_process_version_loaded_into_more_ranks_warns_about_its_per_rank_state(tmp_path) -> None:
    """Every rank of the new layout gets the one saved rank's RNG state: said, as for a multi-rank version."""
    from ckptrepo.parallel.layout import ParallelLayout
    from ckptrepo.rules import Rules, Split
    repo = ckptrepo.init(str(tmp_path / "repo"))
    rules = Rules([("w", Split(0))])
    repo.snapshot({"model": {"w": torch.randn(4, 4)}, "rng": torch.get_rng_state()}, step=1,
                  parallel_layout=ParallelLayout(rules=rules))
    with pytest.warns(UserWarning, match="per-rank state rng of rank 1 comes from saved rank 0"):
        repo.load("HEAD", parallel_layout=ParallelLayout(tp=2, rules=rules), rank=1)


def test_a_split_dimension_out_of_range_is_a_one_line_layout_error() -> None:
    from ckptrepo.errors import LayoutError
    from ckptrepo.rules import Split, local_shape
    assert local_shape(Split(-1), (4, 6), 2) == (4, 3)
    with pytest.raises(LayoutError, match="rule splits dim -3 but the tensor has shape"):
        local_shape(Split(-3), (4, 6), 2)


def test_an_unpadded_vocabulary_snapshotted_with_its_rules_is_taken_as_it_is() -> None:
    """An unsharded load returns the vocabulary unpadded; one rank (tp=1) snapshotting it again with the same
    rules stores its rows as the global rows, as it would the padded tensor."""
    from ckptrepo.errors import LayoutError
    from ckptrepo.rules import VocabSplit, global_shape
    spec = VocabSplit(dim=0, size=250, multiple=8)
    assert global_shape(spec, (256, 4), 1) == (250, 4)
    assert global_shape(spec, (250, 4), 1) == (250, 4)
    with pytest.raises(LayoutError, match="check the rules"):
        global_shape(spec, (100, 4), 1)


def test_load_rules_that_cut_a_fused_tensor_into_other_parts_than_the_saved_ones_warn(tmp_path) -> None:
    """Grouped-query QKV saved as parts (32, 8, 8), loaded with Fused(3) or with Split(0): each rank got other
    rows of the same bytes, with the same local shape, and no word."""
    from ckptrepo.parallel.layout import ParallelLayout
    from ckptrepo.rules import Fused, Rules
    repo = ckptrepo.init(str(tmp_path / "repo"))
    repo.snapshot({"model": {"qkv": torch.randn(48, 4)}}, step=1,
                  parallel_layout=ParallelLayout(rules=Rules([("qkv", Fused((32, 8, 8)))])))
    with pytest.warns(UserWarning, match=r"qkv \(\(32, 8, 8\) saved, 3 given\)"):
        repo.load("HEAD", parallel_layout=ParallelLayout(tp=2, rules=Rules([("qkv", Fused(3))])), rank=0)
    # fused on one side only: Split(0) at tp=2 gave rank 0 q and half of k, without a word
    from ckptrepo.rules import Split
    with pytest.warns(UserWarning, match=r"qkv \(Fused\(\(32, 8, 8\)\) saved, Split given\)"):
        repo.load("HEAD", parallel_layout=ParallelLayout(tp=2, rules=Rules([("qkv", Split(0))])), rank=0)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the saved parts given again, or nothing cut on either side: no warning
        repo.load("HEAD", parallel_layout=ParallelLayout(tp=2, rules=Rules([("qkv", Fused((32, 8, 8)))])), rank=0)
        repo.load("HEAD", parallel_layout=ParallelLayout(rules=Rules([("qkv", Split(0))])))


def test_zero_optimizer_partitions_load_into_without_the_model_section(tmp_path) -> None:
    """The parameters a flat partition covers came from `into`'s model section: without one, the partition
    was refused as covering 0 parameter elements. They come from the rules and the version, as for a
    fresh build."""
    from ckptrepo.parallel.layout import ParallelLayout, zero_partition
    from ckptrepo.rules import Rules
    repo = ckptrepo.init(str(tmp_path / "repo"))
    rules = Rules([], optimizer_sections=("optimizer/exp_avg",))
    model = {"a": torch.randn(8, 4), "b": torch.randn(5)}
    repo.snapshot({"model": model, "optimizer": {"exp_avg": {k: v * 10 for k, v in model.items()}}}, step=1,
                  parallel_layout=ParallelLayout(rules=rules))
    layout = ParallelLayout(dp=2, zero=1, rules=rules)
    fresh = repo.load("HEAD", parallel_layout=layout, rank=1)["optimizer"]["exp_avg"]
    into = {"optimizer": {"exp_avg": torch.zeros(zero_partition(37, 2, 1)[2])}}
    repo.load("HEAD", parallel_layout=layout, rank=1, into=into)
    assert torch.equal(into["optimizer"]["exp_avg"], fresh) and fresh.abs().sum() > 0


def test_overlapping_elements_matches_brute_force_over_random_views() -> None:
    """Every view indexing makes (slices with steps, transposes, permutes) has elements of its own; a random
    as_strided layout whose element offsets collide (counted one by one) is always caught."""
    from ckptrepo.state._providers import overlapping_elements
    g = torch.Generator().manual_seed(0)
    base = torch.zeros(2, 3, 4, 5)
    for _ in range(300):
        dims = torch.randperm(4, generator=g).tolist()
        v = base.permute(dims)
        for d in range(4):
            n = v.shape[d]
            lo = int(torch.randint(0, n, (1,), generator=g))
            step = int(torch.randint(1, 3, (1,), generator=g))
            v = v.narrow(d, lo, n - lo)[(slice(None),) * d + (slice(None, None, step),)]
        assert not overlapping_elements(v), (v.shape, v.stride())
        shape = [int(x) for x in torch.randint(1, 4, (3,), generator=g)]
        strides = [int(x) for x in torch.randint(0, 7, (3,), generator=g)]
        offsets = [sum(i * st for i, st in zip(idx, strides)) for idx in np.ndindex(*shape)]
        if len(set(offsets)) < len(offsets):
            assert overlapping_elements(torch.zeros(200).as_strided(shape, strides)), (shape, strides)
