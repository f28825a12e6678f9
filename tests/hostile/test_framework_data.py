"""Framework data a repository holds that names code: DCP's pickled values and DeepSpeed's rebuilt types.

Loading never runs code from a repository (issue 39): a DCP byte item whose unpickling would run a callable
is refused unless the Reader is told to trust the repository, and a DeepSpeed state rebuilds only a fixed
list of DeepSpeed types, with a fixed list of attributes each."""
from __future__ import annotations

import io
import os
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from support.helpers import dcp_save

import ckptrepo
from ckptrepo.errors import CorruptionError, TrustRequiredError

pytestmark = [pytest.mark.hostile, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
HOSTILE_CLASS = "DCP and DeepSpeed data"

dcp = pytest.importorskip("torch.distributed.checkpoint")
cdcp = pytest.importorskip("ckptrepo.dcp")


class Planted:
    """A value whose unpickling makes the directory ``marker``: what a forged repository would run."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.mkdir, (self.marker,))


_save = dcp_save


def _refusal(into, reader) -> BaseException:
    """The error of ``dcp.load`` through ``reader``: ours, inside DCP's CheckpointException."""
    with pytest.raises(BaseException) as failed:
        dcp.load(into, storage_reader=reader, no_dist=True)
    failures = getattr(failed.value, "failures", None)
    return failures[0][0] if failures else failed.value


def test_a_dcp_pickle_that_runs_code_is_refused_without_trust(tmp_path: Path) -> None:
    url, marker = str(tmp_path / "repo"), tmp_path / "planted"
    ckptrepo.init(url)
    _save({"w": torch.arange(4.0), "extra": {"obj": Planted(str(marker))}}, url, step=1)
    assert not marker.exists()
    into = {"w": torch.zeros(4), "extra": {"obj": None}}
    err = _refusal(into, cdcp.Reader(url))
    assert isinstance(err, TrustRequiredError), err
    text = str(err)
    assert "\n" not in text and "'extra.obj'" in text and "trust=True" in text and "posix.mkdir" in text
    assert not marker.exists()
    # the same repository through a lazy clone, whose bytes are read from the origin on demand
    clone = ckptrepo.clone(url, tmp_path / "lazy", lazy=True)
    err = _refusal({"w": torch.zeros(4), "extra": {"obj": None}}, cdcp.Reader(clone.url))
    assert isinstance(err, TrustRequiredError) and not marker.exists()
    # the caller's opt-in: DCP's own full unpickling, as it would read its own files
    dcp.load(into, storage_reader=cdcp.Reader(url, trust=True), no_dist=True)
    assert marker.is_dir() and torch.equal(into["w"], torch.arange(4.0))


def test_byte_items_of_safe_types_load_without_trust(tmp_path: Path) -> None:
    url = str(tmp_path / "repo")
    ckptrepo.init(url)
    rng = np.random.RandomState(7).get_state()
    state = {"blob": io.BytesIO(b"raw bytes"), "pair": (torch.arange(3), "x"), "ids": {3, 4},
             "rng": rng, "arr": np.arange(5, dtype=np.int16), "half": np.float16(1.5), "frac": Fraction(1, 3)}
    _save(state, url, step=1)
    into = {"blob": io.BytesIO(), "pair": None, "ids": None, "rng": None, "arr": None, "half": None}
    dcp.load(into, storage_reader=cdcp.Reader(url), no_dist=True)   # "frac" is not asked for: never read
    assert into["blob"].getvalue() == b"raw bytes" and into["ids"] == {3, 4}
    assert torch.equal(into["pair"][0], torch.arange(3)) and into["pair"][1] == "x"
    assert into["rng"][0] == rng[0] and np.array_equal(into["rng"][1], rng[1]) and into["rng"][2:] == rng[2:]
    assert into["arr"].dtype == np.int16 and np.array_equal(into["arr"], np.arange(5))
    assert into["half"] == np.float16(1.5) and into["half"].dtype == np.float16
    err = _refusal({"frac": None}, cdcp.Reader(url))   # a class of no DCP state: the caller must allow it
    assert isinstance(err, TrustRequiredError) and "fractions.Fraction" in str(err) and "\n" not in str(err)
    with torch.serialization.safe_globals([Fraction]):   # allowed as torch.load allows it
        into = {"frac": None}
        dcp.load(into, storage_reader=cdcp.Reader(url), no_dist=True)
    assert into["frac"] == Fraction(1, 3)


def test_a_byte_item_that_is_no_pickle_is_damage(tmp_path: Path) -> None:
    url = str(tmp_path / "repo")
    repo = ckptrepo.init(url)
    junk = torch.frombuffer(bytearray(b"\x80\x02not a torch file at all"), dtype=torch.uint8)
    repo.snapshot({"w": torch.ones(2), "x@dcp-pickle": junk}, step=1)
    err = _refusal({"w": torch.zeros(2), "x@dcp-pickle": None}, cdcp.Reader(url))
    assert isinstance(err, CorruptionError) and "'x@dcp-pickle'" in str(err) and "\n" not in str(err)


# ---- DeepSpeed: a fixed list of types, with fixed fields and attributes -----------------------------------------

_FORGED_IN_CHILD = r"""
import json, sys
from ckptrepo.errors import CkptRepoError
from ckptrepo.integrations.deepspeed import TYPE_KEY, from_plain
nodes = [
    # a class another DeepSpeed module imports from torch, reachable by its attribute
    {TYPE_KEY: "enum", "class": "deepspeed.compile.partitioner.CheckpointPolicy", "name": "MUST_SAVE"},
    # any other DeepSpeed module: importing it would run its code
    {TYPE_KEY: "attrs", "class": "deepspeed.autotuning.autotuner.Autotuner", "attrs": {}},
    {TYPE_KEY: "dataclass", "class": "deepspeed.runtime.zero.stage3.IPGBucketZ3", "fields": {}},
    {TYPE_KEY: "enum", "class": "os.system", "name": "x"},
    {TYPE_KEY: "call", "class": "builtins.eval", "args": ["1"]},
]
out = []
for node in nodes:
    try:
        from_plain({"optimizer": node}, "mp_rank_00_model_states.pt")
        out.append("rebuilt")
    except CkptRepoError as err:
        out.append(type(err).__name__ + ": " + str(err))
print(json.dumps({"errors": out, "imported": sorted(m for m in sys.modules if m.split(".")[0] == "deepspeed")}))
"""


def test_deepspeed_values_naming_other_classes_import_nothing() -> None:
    import json
    import subprocess
    import sys
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", _FORGED_IN_CHILD], capture_output=True, text=True, timeout=60,
                          env=env)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["imported"] == []   # no DeepSpeed module was imported to look a name up
    for err in got["errors"]:
        assert err.startswith("CorruptionError: mp_rank_00_model_states.pt/optimizer: ") and "\n" not in err, err
        assert "fixed list" in err and "ckptrepo fsck" in err


def test_deepspeed_types_take_only_their_own_fields_and_attributes() -> None:
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.utils.tensor_fragment import fragment_address

    from ckptrepo.integrations.deepspeed import TYPE_KEY, from_plain, to_plain
    scaler = DynamicLossScaler(init_scale=2.0 ** 16, scale_window=10, min_scale=1, delayed_shift=2,
                               consecutive_hysteresis=False)
    node = to_plain(scaler)
    back = from_plain(node)
    assert type(back) is DynamicLossScaler and vars(back) == vars(scaler)
    where = "zero_pp_rank_0_mp_rank_00_optim_states.pt/loss_scaler"
    for attrs, words in [({**node["attrs"], "update_scale": 1}, "sets attributes it does not have (update_scale)"),
                         ({**node["attrs"], "__class__": 0}, "(__class__)"),
                         ({**node["attrs"], "cur_scale": {"a": 1}}, "malformed"),
                         ({**node["attrs"], "cur_scale": [TYPE_KEY]}, "malformed")]:
        with pytest.raises(CorruptionError, match=r"^zero_pp_rank") as failed:
            from_plain({**node, "attrs": attrs}, where)
        assert words in str(failed.value) and "\n" not in str(failed.value)
    frag = to_plain(fragment_address(numel=6, start=2))
    assert from_plain(frag) == fragment_address(numel=6, start=2)
    for fields in ({"numel": 6}, {"numel": 6, "start": 2, "extra": 1}, {"numel": "6", "start": 2},
                   {"numel": 6, "start": True}):
        with pytest.raises(CorruptionError, match="malformed"):
            from_plain({**frag, "fields": fields}, where)
    # a subclass of a listed scaler (a class of the caller's) is not on the list: the snapshot refuses it
    sub = type("MyScaler", (DynamicLossScaler,), {})(init_scale=2.0, scale_window=1, min_scale=1, delayed_shift=1,
                                                    consecutive_hysteresis=False)
    assert to_plain(sub) is sub
    scaler.planted = print   # an attribute a later DeepSpeed might add: refused at save, not at load
    with pytest.raises(ckptrepo.UnsupportedValueError, match=r"^f/loss_scaler: .*\(planted\)"):
        to_plain({"loss_scaler": scaler}, "f")


def test_a_forged_deepspeed_version_is_refused_by_the_engine(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    from ckptrepo.integrations.deepspeed import TYPE_KEY, CkptRepoCheckpointEngine, checkout
    url = str(tmp_path / "repo")
    repo = ckptrepo.init(url)
    forged = {TYPE_KEY: "attrs", "class": "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
              "attrs": {"cur_scale": 1.0, "step": 0}}   # would shadow a method with a stored value
    repo.snapshot({"mp_rank_00_model_states.pt": {"module": {"w": torch.ones(2)}, "loss_scaler": forged}}, step=1,
                  meta={"deepspeed.tag": "t"})
    [path] = checkout(url, tmp_path / "ckpt")
    eng = CkptRepoCheckpointEngine(url)
    try:
        with pytest.raises(CorruptionError, match=r"mp_rank_00_model_states.pt/loss_scaler: .*\(step\)") as failed:
            eng.load(path)
        assert "\n" not in str(failed.value)
    finally:
        eng.cleanup()


@pytest.mark.parametrize("tag, entry", [("t", "../../escape.pt"), ("t", "/abs/escape.pt"), ("../..", "m.pt"),
                                        ("t", "a/./b.pt"), ("t", "a\\..\\..\\b.pt")])
def test_deepspeed_checkout_writes_nothing_outside_save_dir(tmp_path: Path, tag: str, entry: str) -> None:
    from ckptrepo.integrations.deepspeed import checkout
    url = str(tmp_path / "repo")
    repo = ckptrepo.init(url)
    repo.snapshot({"ok.pt": {"w": torch.ones(1)}, entry: {"w": torch.ones(1)}}, step=1, meta={"deepspeed.tag": tag})
    save_dir = tmp_path / "a" / "b" / "ckpt"
    before = sorted(p for p in tmp_path.rglob("*") if "repo" not in p.parts)
    with pytest.raises(CorruptionError, match="no path below the checkpoint directory") as failed:
        checkout(url, save_dir)
    assert "\n" not in str(failed.value)
    assert sorted(p for p in tmp_path.rglob("*") if "repo" not in p.parts) == before   # nothing written at all
