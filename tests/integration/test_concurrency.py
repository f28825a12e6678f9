"""Concurrent writers: refs move only by compare-and-swap, so races lose nothing and commit nothing twice.

Two worker processes advance the same branch, round after round. A barrier in
the "after_read_head" fault hook makes both read the same branch tip before
either writes, so every round is a genuine race: exactly one commits, the other
gets a ConflictError. Likewise two processes creating the same tag at once:
exactly one succeeds.
"""
from __future__ import annotations

import queue

import pytest
from support.ckpt_workers import BARRIER_TIMEOUT, assert_same, make_state, mp_context, race_writer, tag_racer
from support.helpers import reap

import ckptrepo

ROUNDS = 5


def _run_pair(target, args_for, n_results: int) -> list[tuple]:
    """Start two workers, collect ``n_results`` results from their queue, and join them."""
    ctx = mp_context()
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_for(who), results)) for who in (0, 1)]
    for p in procs:
        p.start()
    got = []
    try:
        while len(got) < n_results:
            try:
                item = results.get(timeout=BARRIER_TIMEOUT + 30)
            except queue.Empty:
                pytest.fail(f"workers stalled after {len(got)} results: {got}")
            assert item[2] != "error", f"worker {item[1]} failed: {item[3]}"
            got.append(item)
    finally:
        reap(procs, 30)
    assert [p.exitcode for p in procs] == [0, 0]
    return got


def test_two_writers_race_on_one_branch(tmp_path):
    url = str(tmp_path / "repo")
    ckptrepo.init(url)
    ctx = mp_context()
    start, after_read = ctx.Barrier(2), ctx.Barrier(2)
    got = _run_pair(race_writer, lambda who: (url, who, ROUNDS, start, after_read), 2 * ROUNDS)

    winners: list[tuple[int, str]] = []   # (writer, version id) per round
    parent = None
    for r in range(ROUNDS):
        outcome = sorted((g for g in got if g[0] == r), key=lambda g: g[2])
        assert [g[2] for g in outcome] == ["conflict", "won"], outcome
        (_, loser, _, message, loser_parent), (_, winner, _, vid, won_parent) = outcome
        # Both built on the same tip: the tip left by the previous round's winner.
        assert won_parent == loser_parent == parent
        assert "branch 'main' moved" in message and "was not committed" in message, message
        assert vid[:12] in message   # the loser is told which version now holds the branch
        winners.append((winner, vid))
        parent = vid

    repo = ckptrepo.open(url)
    log = list(reversed(repo.log()))
    assert [v.id for v in log] == [vid for _, vid in winners]      # one version per round, none lost
    assert [v.step for v in log] == list(range(ROUNDS))
    for r, ((who, _), v) in enumerate(zip(winners, log)):
        assert v.message == f"writer {who}"
        assert v.parents == ((log[r - 1].id,) if r else ())
        assert_same(repo.load(v.id), make_state(100 * r + who, big=False))

    report = repo.fsck()
    assert report.ok, report.errors
    # Each loser wrote a complete manifest that no ref reaches: harmless, reported as a warning.
    unreachable = [w for w in report.warnings if "not reachable" in w]
    assert len(unreachable) == ROUNDS, report.warnings
    assert len(repo.plumbing.all_version_ids()) == 2 * ROUNDS


def test_two_processes_create_the_same_tag(tmp_path):
    url = str(tmp_path / "repo")
    repo = ckptrepo.init(url)
    targets = [repo.snapshot(make_state(s, big=False), step=s).id for s in (0, 1)]
    start = mp_context().Barrier(2)
    got = _run_pair(tag_racer, lambda who: (url, who, targets[who], ROUNDS, start), 2 * ROUNDS)

    repo = ckptrepo.open(url)
    tags = repo.tags()
    for r in range(ROUNDS):
        outcome = sorted((g for g in got if g[0] == r), key=lambda g: g[2])
        assert [g[2] for g in outcome] == ["created", "refused"], outcome
        assert "already exists" in outcome[1][3], outcome[1][3]
        assert tags[f"race-{r}"] == outcome[0][3]      # the tag names the winner's target, intact
        assert repo.resolve(f"race-{r}") == outcome[0][3]
    assert len(tags) == ROUNDS
    report = repo.fsck()
    assert report.ok and not report.warnings, (report.errors, report.warnings)


def test_gc_and_fsck_while_another_writer_commits_lose_and_report_nothing(tmp_path, monkeypatch):
    """A commit landing between gc's listing of the manifests and its read of the refs made the new tip look
    like a dead end: its whole history was collected. fsck called the new tip missing."""
    import torch

    from ckptrepo.core._plumbing import Plumbing
    from ckptrepo.maintenance import _gc as gc_module
    url = str(tmp_path / "r")
    repo = ckptrepo.init(url)
    for step in range(3):
        repo.snapshot({"w": torch.full((4,), float(step))}, step=step)
    listing = gc_module._facts

    def listing_then_a_commit(r, known):
        out = listing(r, known)
        ckptrepo.open(url).snapshot({"w": torch.full((4,), 3.0)}, step=3)   # another writer, after the listing
        return out
    monkeypatch.setattr(gc_module, "_facts", listing_then_a_commit)
    report = ckptrepo.open(url).gc(grace_period_s=0)
    monkeypatch.undo()
    assert report.collected == [] and report.pruned == []
    fresh = ckptrepo.open(url)
    assert [v.step for v in fresh.log()] == [3, 2, 1, 0]
    assert all(fresh.load(f"@{s}")["w"][0] == s for s in range(4))

    ids = Plumbing.all_version_ids

    def ids_then_a_commit(self):
        out = ids(self)
        ckptrepo.open(url).snapshot({"w": torch.full((4,), 4.0)}, step=4)
        return out
    monkeypatch.setattr(Plumbing, "all_version_ids", ids_then_a_commit)
    report = ckptrepo.open(url).fsck()
    monkeypatch.undo()
    assert report.ok and report.versions == 5, report.errors
    assert not [w for w in report.warnings if "not reachable" in w], report.warnings
