"""A rank dies with several snapshots in flight: a survivor fails them all at once, not one commit timeout each.

Two gloo ranks commit two snapshots, then take ``IN_FLIGHT`` more; one rank's
commit thread dies (``os._exit``) before it publishes anything of the first of
them. The survivor learns that the group is broken at that snapshot's commit
timeout or from the next snapshot's meeting, whichever comes first, and then fails every
snapshot still in flight with the same cause: ``close()`` takes about one
timeout (or none), not one per snapshot. What was committed before stays
intact, and nothing half-written becomes a version.
"""
from __future__ import annotations

import io
import os
import queue
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from support.ckpt_workers import mp_context
from support.helpers import assert_bit_exact, reap
from support.megatron_ref import _worker

import ckptrepo
from ckptrepo import faults
from ckptrepo.parallel.layout import ParallelLayout

TIMEOUT_S = 5.0
IN_FLIGHT = 3
VICTIM_EXIT = 17


def _state(step: int) -> dict[str, Any]:
    """The same state on both ranks (data-parallel replicas), derived from the step alone."""
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(128, 64, generator=g), "b": torch.randn(64, generator=g)}}


def _outcome(handle: Any) -> str:
    try:
        handle.result(0)
    except ckptrepo.CkptRepoError as err:
        return str(err)
    return "committed"


def _die_with_snapshots_in_flight(rank: int, layout: ParallelLayout, url: str, victim: int, collective: bool,
                                  timeout_s: float) -> dict[str, Any]:
    """``victim`` dies once ``IN_FLIGHT`` snapshots are in flight; the survivor (``collective``: after one more
    snapshot call, whose collective meets the dead rank) closes its snapshotter and reports how long that took."""
    snap = ckptrepo.open(url).snapshotter(commit_timeout_s=timeout_s, max_in_flight=IN_FLIGHT + 1,
                                          host_memory=1 << 20)
    for step in (1, 2):
        snap.snapshot(_state(step), step=step)
    snap.wait()
    gate = threading.Event()
    if rank == victim:   # its commit thread dies before it publishes anything of the first snapshot in flight
        faults.set_hook("after_data", lambda _name: (gate.wait(), os._exit(VICTIM_EXIT)))
    handles = [snap.snapshot(_state(step), step=step) for step in range(3, 3 + IN_FLIGHT)]
    if rank == victim:
        gate.set()
        time.sleep(60)   # the commit thread ends the process
        return {}
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    if collective:
        try:
            snap.snapshot(_state(99), step=99)
            out["collective"] = "taken"
        except ckptrepo.CkptRepoError as err:
            out["collective"] = str(err)
    try:
        snap.close()
        out["close"] = "ok"
    except ckptrepo.CkptRepoError as err:
        out["close"] = str(err)
    out["elapsed"] = time.monotonic() - t0
    out["handles"] = [_outcome(h) for h in handles]
    return out


def _run(url: str, victim: int, collective: bool = False, timeout_s: float = TIMEOUT_S) -> \
        tuple[int | None, dict[str, Any]]:
    """Both ranks in worker processes; the victim's exit code and the survivor's report."""
    ckptrepo.init(url)
    lay = ParallelLayout(dp=2)
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    ctx = mp_context()
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, lay, store.port, results, _die_with_snapshots_in_flight,
                                               (url, victim, collective, timeout_s)), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue.Empty:
                codes = [p.exitcode for p in procs]
                assert time.monotonic() < deadline, f"the survivor sent nothing (exit codes {codes})"
                continue
            assert ok, f"rank {rank} failed:\n{payload}"
            if rank != victim:
                report = torch.load(io.BytesIO(payload), weights_only=False)
                break
        procs[victim].join(10)
    finally:
        reap(procs, 5)
    return procs[victim].exitcode, report


def _check_repository(url: str, report: dict[str, Any], recorded: bool = True) -> None:
    """Only the two snapshots before the death are versions, whole and bit-exact; the others are reported."""
    repo = ckptrepo.open(url)
    assert [v.step for v in repo.log()] == [2, 1]
    for v in repo.log():
        assert_bit_exact(repo.load(v.id), _state(v.step))
    assert repo.fsck().ok
    assert all("was not committed" in h for h in report["handles"]), report["handles"]
    assert all("process group is broken" in h for h in report["handles"][1:]), report["handles"]
    if recorded:   # rank 0 records the failures
        assert sorted(f["step"] for f in repo.failures()) == list(range(3, 3 + IN_FLIGHT))


def test_a_dead_rank_fails_every_snapshot_in_flight_at_its_first_timeout(tmp_path) -> None:
    url = str(tmp_path / "repo")
    code, report = _run(url, victim=1)
    assert code == VICTIM_EXIT, "rank 1 did not die where planned"
    # one commit timeout for the snapshot that finds rank 1 missing; the ones behind it fail at once
    assert report["elapsed"] < 1.6 * TIMEOUT_S, report
    assert "did not finish their part" in report["close"], report["close"]
    assert f"and {IN_FLIGHT - 1} more failed snapshot(s)" in report["close"], report["close"]
    assert "did not finish their part" in report["handles"][0]
    _check_repository(url, report)


def test_a_snapshot_that_meets_a_dead_rank_fails_with_every_snapshot_in_flight_in_one_timeout(tmp_path) -> None:
    url = str(tmp_path / "repo")
    code, report = _run(url, victim=1, collective=True)
    assert code == VICTIM_EXIT, "rank 1 did not die where planned"
    # the meeting of the next snapshot() names the rank it waited for, or the broken group that woke it
    assert "rank 1 did not" in report["collective"] or "process group is broken" in report["collective"], \
        report["collective"]
    # one deadline for all: the snapshot's meeting and the commits in flight fail together
    assert report["elapsed"] < 1.6 * TIMEOUT_S, report
    assert f"and {IN_FLIGHT - 1} more failed snapshot(s)" in report["close"], report["close"]
    _check_repository(url, report)


def test_rank_0_dead_fails_every_snapshot_in_flight_on_the_others_after_one_wait(tmp_path) -> None:
    """Rank 0 died before its verdict: rank 1 waits for it once (the commit timeout and its grace), then fails
    the snapshots behind it at once, publishing its failure instead of its part."""
    url = str(tmp_path / "repo")
    timeout_s = 3.0
    waited = timeout_s + 5.0   # Staging.wait_outcome's grace: at least 5 s
    code, report = _run(url, victim=0, timeout_s=timeout_s)
    assert code == VICTIM_EXIT, "rank 0 did not die where planned"
    assert report["elapsed"] < 1.5 * waited, report
    assert "rank 0 did not commit or abort" in report["handles"][0], report["handles"]
    assert f"and {IN_FLIGHT - 1} more failed snapshot(s)" in report["close"], report["close"]
    _check_repository(url, report, recorded=False)
