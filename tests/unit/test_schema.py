"""The typed manifest schema (ckptrepo.core.schema) reads and writes the very bytes of the format.

A manifest decoded into the schema's records and encoded again must give back the stored object byte for
byte, for both writers' key orders (a single-process snapshot's and a merged distributed one's): readers of
older releases, and the crc32c of every stored manifest, depend on it.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import ckptrepo
from ckptrepo.core._manifest import VERSIONS_PREFIX, seal, unseal
from ckptrepo.core.schema import (
    MERGED_ORDER,
    LayoutRecord,
    Manifest,
    ManifestHeader,
    Piece,
    TensorEntry,
    decode_header,
    decode_manifest,
    encode_manifest,
)
from ckptrepo.errors import CorruptionError
from ckptrepo.storage._arrays import ArrayInfo

FIXTURE = Path(__file__).parent.parent / "fixtures" / "format1_repo" / "versions"
FIXTURE_FILES = sorted(FIXTURE.iterdir())


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=[p.name[:12] for p in FIXTURE_FILES])
def test_every_fixture_manifest_decodes_and_encodes_to_the_same_bytes(path):
    blob = path.read_bytes()
    m = decode_manifest(blob, path.name)
    assert isinstance(m, Manifest) and m.id == path.name
    assert encode_manifest(m) == blob
    header = decode_header(blob, path.name)
    assert header == m.header() and not isinstance(header, Manifest)


def test_the_fixture_holds_both_writers_key_orders():
    """One merged (distributed-layout) manifest among single-process ones: both orders are covered above."""
    orders = {decode_manifest(p.read_bytes(), p.name).key_order[:len(MERGED_ORDER)] for p in FIXTURE_FILES}
    assert tuple(MERGED_ORDER) in orders and len(orders) == 2


def test_a_fresh_snapshot_decodes_to_the_manifest_it_was_built_from(tmp_path):
    repo = ckptrepo.init(str(tmp_path / "repo"))
    state = {"model": {"w": torch.randn(4, 3), "b": torch.zeros(0), "h": torch.ones(5, dtype=torch.float16)},
             "step": 7, "big": 2**70}
    v = repo.snapshot(state, step=7, message="m", metrics={"loss": 0.5})
    blob = (tmp_path / "repo" / "versions" / v.id).read_bytes()
    m = decode_manifest(blob, v.id)
    assert encode_manifest(m) == blob
    assert m == ckptrepo.open(str(tmp_path / "repo")).plumbing.manifest(v.id)
    assert m.stats is not None and m.step == 7 and m.metrics == {"loss": 0.5} and m.parents == ()
    assert m.layout == LayoutRecord(1, m.layout.ranks) and m.layout.ranks[0].rank == 0
    w = next(t for t in m.tensors if t.name == "model/w")
    assert isinstance(w, TensorEntry) and w.shape == (4, 3) and w.dtype == "float32"
    (p,) = w.pieces
    assert isinstance(p, Piece) and p.box == ((0, 0), (4, 3)) and isinstance(m.arrays[p.array], ArrayInfo)
    assert next(t for t in m.tensors if t.name == "model/b").pieces == ()
    # the raw map the writer produced: the documented single-process key order, stats last
    raw = unseal(blob, "test")
    assert list(raw) == [*m.key_order] and list(raw)[0] == "format_version" and list(raw)[-1] == "stats"


def test_a_distributed_layout_snapshot_round_trips(tmp_path):
    from ckptrepo.rules import Rules, Split
    repo = ckptrepo.init(str(tmp_path / "repo"))
    layout = ckptrepo.ParallelLayout(rules=Rules([("w", Split(1))]))
    v = repo.snapshot({"model": {"w": torch.randn(8, 2048)}}, step=1, parallel_layout=layout)
    blob = (tmp_path / "repo" / "versions" / v.id).read_bytes()
    m = decode_manifest(blob, v.id)
    assert m.key_order[:len(MERGED_ORDER)] == MERGED_ORDER and m.layout is not None and m.layout.tp == 1
    assert m.layout.rules is not None and m.layout.ranks[0].leaf_names is not None
    assert encode_manifest(m) == blob


def test_unknown_keys_are_kept_in_place():
    """A field a later release adds survives a decode and encode by this one, in its position."""
    blob = FIXTURE_FILES[0].read_bytes()
    raw = unseal(blob, "test")
    items = list(raw.items())
    items.insert(3, ("future", {"x": [1, 2]}))
    edited = seal(dict(items))
    m = decode_manifest(edited, FIXTURE_FILES[0].name)
    assert m.extra == {"future": {"x": [1, 2]}}
    assert encode_manifest(m) == edited


def test_a_header_without_stats_is_read():
    raw = unseal(FIXTURE_FILES[0].read_bytes(), "test")
    del raw["stats"]
    m = decode_manifest(seal(raw), raw["id"])
    assert m.stats is None and "stats" not in m.key_order
    assert encode_manifest(m) == seal(raw)
    with_stats = m.with_stats({"bytes": 1})
    assert with_stats.key_order[-1] == "stats" and unseal(encode_manifest(with_stats), "t")["stats"] == {"bytes": 1}


@pytest.mark.parametrize("damage, fragment", [("no arrays", "field 'arrays' is missing"),
                                              ("piece not a map", "a piece of tensor .* is int 5, not a map"),
                                              ("no header field", "field 'parents' is missing")])
def test_a_malformed_manifest_is_a_corruption_error_naming_the_field(damage, fragment):
    raw = unseal(FIXTURE_FILES[0].read_bytes(), "test")
    vid = raw["id"]
    if damage == "no arrays":
        del raw["arrays"]
    elif damage == "piece not a map":
        next(t for t in raw["tensors"] if t["pieces"])["pieces"][0] = 5
    else:
        del raw["parents"]
    with pytest.raises(CorruptionError, match=rf"manifest {VERSIONS_PREFIX}{vid}: {fragment}; the manifest is "
                                              rf"damaged, run `ckptrepo fsck`"):
        decode_manifest(seal(raw), vid)


def test_a_header_is_what_a_handle_caches_of_its_commits(tmp_path):
    repo = ckptrepo.init(str(tmp_path / "repo"))
    v = repo.snapshot({"w": torch.randn(3)}, step=1)
    h = repo.plumbing.header(v.id)
    assert type(h) is ManifestHeader and h == repo.plumbing.manifest(v.id).header()
    assert dataclasses.replace(h, step=2) != h


def test_a_rank_part_and_a_rank_failure_round_trip_through_staging():
    from ckptrepo.core.schema import RankFailure, RankPart, decode_rank_part, encode_rank_part
    info = ArrayInfo("data/" + "ab" * 16 + "/1/float32", "float32", 32, 32, 32)
    part = RankPart(rank=1, step=3, tree=["T", 0], leaf_names=("model/w",), names=(("model/w", "float32", (8, 4)),),
                    coords={"tp": 1, "pp": 0, "dp": 0},
                    tensors=(("model/w", (Piece(((0, 0), (8, 4)), info.key, 0),)),),
                    arrays={info.key: info}, fingerprints=(["model/w", [[0, 0], [8, 4]], 7, "rules"],))
    blob = encode_rank_part(part)
    assert decode_rank_part(blob, "staging/v/rank-1") == part
    assert list(unseal(blob, "t")) == ["rank", "step", "tree", "leaf_names", "names", "coords", "tensors", "arrays",
                                       "fingerprints"]
    assert decode_rank_part(encode_rank_part(RankFailure(2, "boom")), "k") == RankFailure(2, "boom")
    with pytest.raises(CorruptionError, match="staging/v/rank-1 is not a rank's part"):
        decode_rank_part(seal({"rank": 1}), "staging/v/rank-1")
