"""Dedup per rank on gloo: each rank's unchanged pieces point at the bytes stored before, across a restart."""
from __future__ import annotations

from support.dedup_workers import ranks_snapshot, result
from support.dtensor_workers import run_ranks
from support.helpers import assert_bit_exact

import ckptrepo


def test_two_ranks_write_only_what_changed_also_after_a_restart(tmp_path):
    url = str(tmp_path / "repo")
    ckptrepo.init(url)
    out = tmp_path / "out"
    out.mkdir()
    run_ranks(ranks_snapshot, 2, url, [0, 1, 2], "first", str(out))
    run_ranks(ranks_snapshot, 2, url, [3, 4], "second", str(out))   # new processes: compare with the tip
    ranks = [result(str(out), tag, r) for tag in ("first", "second") for r in (0, 1)]
    # without a layout each rank's state is its own (stored as name@rank<r>): a version holds both ranks'
    changed = ranks[0]["changed"] + ranks[1]["changed"]
    sizes = ranks[0]["sizes"] + ranks[2]["sizes"]
    assert sizes[0] > 10 * changed
    for size in sizes[1:]:
        assert changed <= size <= 1.1 * changed, (sizes, changed)
    for i in range(1, 3):   # what each rank wrote: its share of the changed bytes, no frozen piece
        per_rank = [ranks[0]["written"][i], ranks[1]["written"][i]]
        assert all(w > 0 for w in per_rank) and sum(per_rank) == sizes[i], (per_rank, sizes[i])
    repo = ckptrepo.open(url)
    assert repo.fsck().ok
    v3, v4 = repo.load("@3"), repo.load("@4")
    frozen = [k for k in v3["model"] if ".base." in k]
    assert frozen and all(v3["model"][k].equal(v4["model"][k]) for k in frozen)
    assert_bit_exact(dict(repo.load("@0")["model"])[frozen[0]], v4["model"][frozen[0]])
