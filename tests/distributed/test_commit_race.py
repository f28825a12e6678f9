"""The two-phase distributed commit races a single-process writer on one branch of an atomic S3 server.

Two gloo ranks snapshot on main round after round (rank 0 merges the ranks' parts, writes the manifest and
moves the branch); a writer in this process snapshots on main too. Rank 0 and the writer meet at a barrier
before each round and again right before their compare-and-swaps (the ``after_manifest`` fault hook), so
every round is a race at the server: exactly one wins, the other is told, and nothing committed is lost.
"""
from __future__ import annotations

import os
import threading
import time

from support.ckpt_workers import mp_context
from support.megatron_ref import launch
from support.race_workers import BARRIER_TIMEOUT, distributed_racer, race_state

import ckptrepo
from ckptrepo import faults
from ckptrepo.errors import ConflictError
from ckptrepo.parallel.layout import ParallelLayout

ROUNDS = 50


def test_the_distributed_commit_racing_a_single_writer_has_one_winner_and_loses_nothing(atomic_s3_url,
                                                                                         s3_proxy) -> None:
    url = atomic_s3_url
    base = ckptrepo.init(url).snapshot(race_state(-1, 1), step=0)   # the store check's pass is recorded here
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    line_up = mp_context().Barrier(2, timeout=BARRIER_TIMEOUT)
    single: list[str | None] = []
    errors: list[BaseException] = []
    writer = ckptrepo.open(url)
    writer.host_memory = 1 << 20

    def compete() -> None:
        try:
            for r in range(ROUNDS):
                line_up.wait()
                try:
                    single.append(writer.snapshot(race_state(r, 1), step=r + 1).id)
                except ConflictError:
                    single.append(None)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)
            line_up.abort()

    faults.set_hook("after_manifest", lambda _name: line_up.wait())
    t0 = time.monotonic()
    thread = threading.Thread(target=compete, name="competing-writer")
    thread.start()
    try:
        ranks = launch(ParallelLayout(dp=2), distributed_racer, url, env, ROUNDS, line_up, timeout=600)
    finally:
        line_up.abort()   # frees the writer if the ranks failed
        thread.join(BARRIER_TIMEOUT)
        faults.set_hook("after_manifest", None)
    elapsed = time.monotonic() - t0
    assert errors == [], errors
    dist_ids = [v for v, _ in ranks[0]]
    assert [v for v, _ in ranks[1]] == dist_ids   # rank 1 hears of each outcome as rank 0 had it
    winners = [(d is not None) + (s is not None) for d, s in zip(dist_ids, single)]
    committed = {v for v in dist_ids + single if v is not None}
    history = [v.id for v in ckptrepo.open(url).log()]
    lost = committed - set(history)
    puts = sum(n for path, n in s3_proxy.conditional_puts.items() if path.endswith("/refs/heads/main"))
    print(f"\n2 gloo ranks vs 1 writer: {ROUNDS} rounds, winners per round {sorted(set(winners))}, "
          f"{sum(d is not None for d in dist_ids)} won by the ranks, {len(lost)} committed version(s) lost, "
          f"{puts / ROUNDS:.1f} conditional PUTs of the branch per round reached the server, {elapsed:.1f} s")
    assert winners == [1] * ROUNDS
    assert lost == set() and history[-1] == base.id and len(history) == ROUNDS + 1
    assert all("not committed" in msg for v, msg in ranks[1] if v is None), ranks[1]
    assert ckptrepo.open(url).fsck().ok
