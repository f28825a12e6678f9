"""A writer killed with SIGKILL at any point of a snapshot leaves the repository consistent.

A worker process commits a few versions, then begins one more snapshot and
kills itself from a fault hook (after the branch tip was read, after a data
shard, after all data, after the manifest, after the ref moved). Other workers
snapshot in a loop and are killed by the parent after a seeded random delay.
After every kill the repository opens, fsck finds no error, every committed
version loads bit-exact, the interrupted version is not in the log, and a new
snapshot can be taken.
"""
from __future__ import annotations

import random
import signal
import time

import pytest
from support.ckpt_workers import assert_same, crash_writer, loop_writer, make_state, mp_context, run_to_death

import ckptrepo

COMMITS = 3
JOIN_TIMEOUT = 60


def _check(url: str, steps: list[int]) -> tuple[ckptrepo.Repository, list]:
    """fsck is clean and the branch holds exactly ``steps`` (oldest first), each loading bit-exact."""
    repo = ckptrepo.open(url)
    report = repo.fsck()
    assert report.ok, report.errors
    log = repo.log()
    assert [v.step for v in reversed(log)] == steps
    for newer, older in zip(log, log[1:]):
        assert newer.parents == (older.id,)
    for v in log:
        assert_same(repo.load(v.id), make_state(v.step))
    return repo, report.warnings


@pytest.mark.parametrize("point,nth", [
    ("after_read_head", 1),
    ("after_shard_write", 1),
    ("after_shard_write", 5),
    ("after_data", 1),
    ("after_manifest", 1),
    ("after_ref", 1),
])
def test_kill_at_fault_point(tmp_path, point, nth):
    url = str(tmp_path / "repo")
    run_to_death(crash_writer, url, COMMITS, point, nth)

    committed = point == "after_ref"  # the ref moved before the kill: the version is in
    expected = list(range(COMMITS + 1 if committed else COMMITS))
    repo, warnings = _check(url, expected)
    assert any(v.message == "interrupted" for v in repo.log()) == committed

    # The kill happened where we asked: its leftovers are exactly what fsck warns about.
    orphans = [w for w in warnings if "has no manifest" in w]
    unreachable = [w for w in warnings if "not reachable" in w]
    if point in ("after_shard_write", "after_data"):
        assert len(orphans) == 1 and not unreachable, warnings
    elif point == "after_manifest":
        assert len(unreachable) == 1 and not orphans, warnings
        (vid,) = set(repo.plumbing.all_version_ids()) - {v.id for v in repo.log()}
        assert repo.version(vid).message == "interrupted"
        assert_same(repo.load(vid), make_state(COMMITS))  # complete, just never committed
    else:
        assert not warnings, warnings
    arrays = repo.plumbing.manifest(repo.plumbing.head_version()).arrays
    assert max(len(a.shards()) for a in arrays.values()) >= 5, \
        "the state should span several shards"

    # The repository keeps working: the next snapshot commits on top of the last committed one.
    head = repo.plumbing.head_version()
    v = repo.snapshot(make_state(99), step=99)
    assert v.parents == (head,)
    assert_same(repo.load(), make_state(99))
    assert ckptrepo.open(url).fsck().ok


def test_kill_at_random_times(tmp_path):
    """A writer snapshotting in a loop is killed at seeded random moments, four times over one repository.

    Each run is killed a random time after its first commit, so the kill lands anywhere in a later
    snapshot (or between two); the next run continues on the same repository from what survived.
    """
    url = str(tmp_path / "repo")
    ckptrepo.init(url)
    rng = random.Random(20240607)
    ctx = mp_context()
    last = -1
    for _ in range(4):
        ready = ctx.Event()
        started = ctx.RawValue("i", -1)      # no lock: the worker may die at any instant
        committed = ctx.RawValue("i", -1)
        p = ctx.Process(target=loop_writer, args=(url, ready, started, committed))
        p.start()
        assert ready.wait(JOIN_TIMEOUT), "the worker did not start"
        time.sleep(rng.uniform(0.0, 0.5))
        p.kill()
        p.join(JOIN_TIMEOUT)
        assert p.exitcode == -signal.SIGKILL

        repo = ckptrepo.open(url)
        head = repo.version().step if repo.plumbing.head_version() else -1
        # Everything the worker saw committed is there; nothing past the step it had begun.
        assert committed.value <= head <= started.value
        assert head >= last
        _check(url, list(range(head + 1)))
        last = head
    assert last >= 3  # each run commits at least once before the kill can come
