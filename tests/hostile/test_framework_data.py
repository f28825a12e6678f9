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


def _save(state, url, **kw):
    w = cdcp.Writer(url, **kw)
    dcp.save(state, storage_writer=w, no_dist=True)
    return w.version


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
