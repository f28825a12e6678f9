"""Decoding a manifest checks every field once, in the schema (ckptrepo.core.schema).

The crc32c proves a manifest is as sealed, not that a writer of this format sealed it. Each case here takes a
real version's manifest (the format-1 fixture), changes one field, re-seals it with a valid trailer, and
expects a CorruptionError naming the version and the field: from both decoders (``decode_header``, which `log`
uses, and ``decode_manifest``), from `log`/`show`/`load` as one line, and from fsck as a failed check.
"""
from __future__ import annotations

import itertools
import math
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
from support.helpers import run

import ckptrepo
from ckptrepo.core._boxes import intersect
from ckptrepo.core._manifest import VERSIONS_PREFIX, seal, unseal
from ckptrepo.core._schema_fields import overlapping_pieces
from ckptrepo.core.schema import decode_header, decode_manifest, encode_manifest
from ckptrepo.errors import CorruptionError

FIXTURE = Path(__file__).parent.parent / "fixtures" / "format1_repo"
SINGLE = "028c213327b6ff3e2a7e01a21a329661"   # a single-process version (main's second-newest)
MERGED = "b26318dd2749e5c613fc01a21a329795"   # main's tip, saved with a ParallelLayout: tensors in several pieces
MISSING = object()


def _raw(vid: str) -> dict[str, Any]:
    return unseal((FIXTURE / "versions" / vid).read_bytes(), "test")


def _set(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(d: dict[str, Any]) -> None:
        if value is MISSING:
            del d[field]
        else:
            d[field] = value
    return change


# (case id, change to the map, what the error says): header fields, which both decoders check
HEADER_CASES = [
    ("parents=[5]", _set("parents", [5]), r"field 'parents' holds 5, not a version id"),
    ("parents not hex", _set("parents", ["g" * 32]), r"field 'parents' holds 'g+', not a version id"),
    ("parents a string", _set("parents", "9d787de4f16be7cb1fb701a21a329639"), r"field 'parents' is str"),
    ("parents twice", _set("parents", ["9d787de4f16be7cb1fb701a21a329639"] * 2),
     r"field 'parents' names a version twice"),
    ("time='now'", _set("time", "now"), r"field 'time' is 'now', not a unix time"),
    ("time=1e300", _set("time", 1e300), r"field 'time' is 1e\+300, not a unix time"),
    ("time=nan", _set("time", math.nan), r"field 'time' is nan"),
    ("time=inf", _set("time", math.inf), r"field 'time' is inf"),
    ("time<0", _set("time", -1.0), r"field 'time' is -1.0"),
    ("time=True", _set("time", True), r"field 'time' is True"),
    ("step='3'", _set("step", "3"), r"field 'step' is '3', not a 64-bit whole number"),
    ("step=1.5", _set("step", 1.5), r"field 'step' is 1.5"),
    ("step=2**63", _set("step", 2**63), r"field 'step' is 9223372036854775808"),
    ("message=12345", _set("message", 12345), r"field 'message' is int 12345, not text"),
    ("metrics=[1,2]", _set("metrics", [1, 2]), r"field 'metrics' is list \[1, 2\], not a map"),
    ("metric a list", _set("metrics", {"loss": [1]}), r"metric 'loss' is list \[1\], not a number or text"),
    ("metric name not text", _set("metrics", {1: 2.0}), r"field 'metrics' has the name 1, not text"),
    ("host=5", _set("host", 5), r"field 'host' is int 5, not text"),
    ("size=-1", _set("size", -1), r"field 'size' is -1, not a whole number of at least 0"),
    ("size='1'", _set("size", "1"), r"field 'size' is '1'"),
    ("stats a list", _set("stats", [1]), r"field 'stats' is \[1\], not a map of names to numbers"),
    ("format_version='1'", _set("format_version", "1"), r"field 'format_version' is '1'"),
    *[(f"no {f}", _set(f, MISSING), rf"field '{f}' is missing")
      for f in ("parents", "step", "time", "message", "metrics", "size")],
]


def _piece(t: str, i: int) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def find(d: dict[str, Any]) -> dict[str, Any]:
        return next(x for x in d["tensors"] if x["name"] == t)["pieces"][i]
    return find


QKV = "model/layers.0.attn.qkv.weight"   # in MERGED: rows [0:8], [8:16], [16:24] of a [24, 8] tensor


def _tensor(d: dict[str, Any], name: str) -> dict[str, Any]:
    return next(x for x in d["tensors"] if x["name"] == name)


# (case id, version, change, what the error says): the tensor table, layout and arrays, which decode_manifest checks
TABLE_CASES = [
    ("name=5", MERGED, lambda d: _tensor(d, QKV).update(name=5), r"tensor \d+ of the table has the name 5, not text"),
    ("unknown dtype", MERGED, lambda d: _tensor(d, QKV).update(dtype="float33"),
     rf"tensor {QKV} has the data type 'float33', not one this release knows"),
    ("negative dim", MERGED, lambda d: _tensor(d, QKV).update(shape=[-24, 8]),
     rf"tensor {QKV} has the shape \[-24, 8\], not whole numbers of at least 0"),
    ("float dim", MERGED, lambda d: _tensor(d, QKV).update(shape=[24.0, 8]), rf"tensor {QKV} has the shape"),
    ("shape a string", MERGED, lambda d: _tensor(d, QKV).update(shape="24x8"), rf"tensor {QKV} has the shape '24x8'"),
    ("box of another rank", MERGED, lambda d: _piece(QKV, 0)(d).update(box=[[0], [8]]),
     rf"a piece of tensor {QKV} has the box \[\[0\], \[8\]\], not 2 offsets and sizes"),
    ("box outside the shape", MERGED, lambda d: _piece(QKV, 2)(d).update(box=[[20, 0], [8, 8]]),
     rf"a piece of tensor {QKV}, \[20:28, 0:8\], lies outside its shape \[24, 8\]"),
    ("box a number", MERGED, lambda d: _piece(QKV, 0)(d).update(box=5), rf"a piece of tensor {QKV} has the box 5"),
    ("negative offset", MERGED, lambda d: _piece(QKV, 0)(d).update(offset=-1),
     rf"a piece of tensor {QKV} starts at offset -1"),
    ("array=5", MERGED, lambda d: _piece(QKV, 0)(d).update(array=5), rf"a piece of tensor {QKV} names the array 5"),
    ("pieces a map", MERGED, lambda d: _tensor(d, QKV).update(pieces={}), rf"tensor {QKV} has the pieces \{{\}}"),
    ("a name twice", MERGED, lambda d: d["tensors"].append(dict(d["tensors"][0])),
     r"tensor model/embedding.word_embeddings.weight is listed twice"),
    ("tensors a map", MERGED, _set("tensors", {}), r"field 'tensors' is dict, not a list"),
    ("no tensors", MERGED, _set("tensors", MISSING), r"field 'tensors' is missing"),
    ("arrays a list", MERGED, _set("arrays", []), r"field 'arrays' is list, not a map"),
    ("array dtype", SINGLE, lambda d: next(iter(d["arrays"].values())).update(dtype="f4"),
     r"array data/\S+ has the data type 'f4', not one this release knows"),
    ("layout a list", SINGLE, _set("layout", [1]), r"field 'layout' is list \[1\], not a map"),
    ("world size 0", SINGLE, lambda d: d["layout"].update(world_size=0), r"the layout's world size is 0"),
    ("rank outside the world", SINGLE, lambda d: d["layout"]["ranks"][0].update(rank=3),
     r"the layout records rank 3, not a rank of its 1"),
    ("tp a string", MERGED, lambda d: d["layout"].update(tp="1"), r"the layout's tp is '1', not a whole number"),
    ("coords not ints", MERGED, lambda d: d["layout"]["ranks"][0].update(coords={"tp": "0"}),
     r"rank 0 of the layout has the coordinates"),
    ("leaf names not text", MERGED, lambda d: d["layout"]["ranks"][0].update(leaf_names=[1]),
     r"rank 0 of the layout has leaf names that are not a list of text"),
    # the total volume is right (3 x 64 rows of elements), but rows 12:16 are in no piece and 4:8 in two
    ("overlapping pieces", MERGED, lambda d: _piece(QKV, 1)(d).update(box=[[4, 0], [8, 8]]),
     rf"pieces \[0:8, 0:8\] and \[4:12, 0:8\] of tensor {QKV} overlap"),
    ("overlapping 1-d pieces", MERGED,
     lambda d: _piece("model/layers.1.attn.qkv.bias", 2)(d).update(box=[[15], [8]]) or
     _piece("model/layers.1.attn.qkv.bias", 1)(d).update(box=[[7], [8]]),
     r"pieces \[0:8\] and \[7:15\] of tensor model/layers.1.attn.qkv.bias overlap"),
]


def _resealed(vid: str, change: Callable[[dict[str, Any]], Any]) -> bytes:
    d = _raw(vid)
    change(d)
    return seal(d)


def _message(vid: str, fragment: str) -> str:
    return rf"^manifest {VERSIONS_PREFIX}{vid}: {fragment}.*; the manifest is damaged, run `ckptrepo fsck`$"


@pytest.mark.parametrize("change, fragment", [c[1:] for c in HEADER_CASES], ids=[c[0] for c in HEADER_CASES])
def test_a_header_field_of_the_wrong_type_is_named_by_both_decoders(change, fragment):
    blob = _resealed(SINGLE, change)
    with pytest.raises(CorruptionError, match=_message(SINGLE, fragment)):
        decode_header(blob, SINGLE)
    with pytest.raises(CorruptionError, match=_message(SINGLE, fragment)):
        decode_manifest(blob, SINGLE)


@pytest.mark.parametrize("vid, change, fragment", [c[1:] for c in TABLE_CASES], ids=[c[0] for c in TABLE_CASES])
def test_a_table_or_layout_field_of_the_wrong_type_is_named(vid, change, fragment):
    blob = _resealed(vid, change)
    with pytest.raises(CorruptionError, match=_message(vid, fragment)):
        decode_manifest(blob, vid)
    decode_header(blob, vid)   # `log` reads the header only: the bulky fields are not its to judge


@pytest.mark.parametrize("field, value", [("time", 1700000000), ("step", None), ("step", -5), ("host", None),
                                          ("host", MISSING), ("stats", MISSING), ("format_version", MISSING),
                                          ("metrics", {"loss": math.nan, "ok": True, "tag": "x", "none": None,
                                                       "n": 2**63}), ("message", "")])
def test_what_the_writers_may_write_still_decodes(field, value):
    blob = _resealed(SINGLE, _set(field, value))
    m = decode_manifest(blob, SINGLE)
    assert encode_manifest(m) == blob
    assert repr(decode_header(blob, SINGLE)) == repr(m.header())   # repr: a NaN metric equals no NaN


def test_empty_pieces_and_scalars_are_no_overlap():
    assert overlapping_pieces([((0, 0), (0, 8)), ((0, 0), (4, 8)), ((4, 0), (4, 8))]) is None
    assert overlapping_pieces([((), ()), ((), ())]) == (((), ()), ((), ()))
    assert overlapping_pieces([((0,), (8,))]) is None


def _brute_force(boxes: list) -> bool:
    live = [b for b in boxes if all(b[1])]
    return any(intersect(a, b) is not None for a, b in itertools.combinations(live, 2))


def test_the_overlap_sweep_agrees_with_comparing_every_pair():
    rng = random.Random(27)
    for _ in range(3000):
        rank = rng.randint(1, 3)
        boxes = [(tuple(rng.randint(0, 6) for _ in range(rank)), tuple(rng.randint(0, 4) for _ in range(rank)))
                 for _ in range(rng.randint(2, 6))]
        pair = overlapping_pieces(boxes)
        assert (pair is not None) == _brute_force(boxes), boxes
        if pair is not None:
            assert intersect(*pair) is not None


def test_a_tiling_of_many_pieces_is_checked_without_comparing_every_pair():
    """Column blocks and row slabs of a thousand pieces each: a sweep, not a million comparisons."""
    cols = [((0, k * 4), (64, 4)) for k in range(1000)]
    rows = [((k * 4, 0), (4, 64)) for k in range(1000)]
    assert overlapping_pieces(cols) is None and overlapping_pieces(rows) is None
    assert overlapping_pieces([*cols[:500], ((0, 1998), (64, 4)), *cols[500:]]) is not None


# ---- through the repository: the CLI, load and fsck --------------------------------------------------------

@pytest.fixture
def damaged(tmp_path):
    """A copy of the fixture repository and a function that re-seals one of its manifests with a change."""
    root = tmp_path / "repo"
    shutil.copytree(FIXTURE, root)

    def damage(vid: str, change: Callable[[dict[str, Any]], Any]) -> None:
        (root / "versions" / vid).write_bytes(_resealed(vid, change))
    return root, damage


# the header damage the issue reports `log` and `show` leaking Python errors for, and fsck passing
HEADER_CLI_CASES = {"parents=[5]": "'parents'", "time='now'": "'time'", "time=1e300": "'time'",
                    "metrics=[1,2]": "'metrics'", "message=12345": "'message'", "no time": "'time' is missing"}


@pytest.mark.parametrize("case", list(HEADER_CLI_CASES))
def test_log_show_and_fsck_name_a_damaged_header(damaged, case):
    root, damage = damaged
    change = next(c[1] for c in HEADER_CASES if c[0] == case)
    damage(MERGED, change)   # main's tip: every log of HEAD meets it
    named = f"manifest {VERSIONS_PREFIX}{MERGED}: field {HEADER_CLI_CASES[case]}"
    for args in (["log"], ["log", "--all"], ["show", "HEAD"], ["show", "v1"]):
        r = run(*args, repo=str(root))
        if args == ["show", "v1"]:   # another version: still shown
            assert r.returncode == 0, r.stderr
            continue
        assert r.returncode != 0, (args, r.stdout)
        assert named in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = run("fsck", repo=str(root))
    assert r.returncode != 0 and named in r.stdout + r.stderr, r.stdout + r.stderr


def test_a_load_of_overlapping_pieces_is_refused_not_returned_uninitialised(damaged):
    root, damage = damaged
    repo = ckptrepo.open(str(root))
    whole = repo.load("HEAD")
    assert whole["model"]["layers.0.attn.qkv.weight"].shape == (24, 8)
    damage(MERGED, lambda d: _piece(QKV, 1)(d).update(box=[[4, 0], [8, 8]]))
    with pytest.raises(CorruptionError, match=rf"pieces \[0:8, 0:8\] and \[4:12, 0:8\] of tensor {QKV} overlap"):
        ckptrepo.open(str(root)).load("HEAD")
    report = ckptrepo.open(str(root)).fsck()
    assert not report.ok and any("overlap" in e for e in report.errors), report.errors
    r = run("fsck", repo=str(root))
    assert r.returncode != 0
