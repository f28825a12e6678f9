"""A group found broken by one thread ends the other threads' waits at once (parallel/_distributed.py).

Rank 0 of two, alone: its commit thread waits for rank 1's part (deadline 2 s) while its training thread waits
at a snapshot's meeting (deadline 60 s). When the commit's deadline passes, the group is broken, and the
meeting ends then, naming the cause, not 58 s later. The two waits are on different store connections, so the
wake goes through a connection of its own: set through the meeting's own, it would queue behind its wait.
"""
from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from ckptrepo.errors import SnapshotFailedError
from ckptrepo.parallel import GroupHealth, GroupStore, Staging
from ckptrepo.saving._prepare import Sharding


def test_a_commit_that_finds_a_rank_missing_ends_the_meeting_in_progress() -> None:
    server = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=60))
    kv = GroupStore(server, "ckptrepo/1/", 0, 2)
    health = GroupHealth(kv.connection())
    failures: list[str] = []

    def commit() -> None:
        try:
            Staging(kv.connection(), "v" * 32, 2, 2.0, health).gather_ranks()
        except SnapshotFailedError as err:
            failures.append(str(err))
    thread = threading.Thread(target=commit)
    t0 = time.monotonic()
    thread.start()
    with pytest.raises(SnapshotFailedError) as met:
        Sharding(None, 0, 2, kv, 60.0, health).exchange([("w", [[0], [4]], 16)], 1)
    elapsed = time.monotonic() - t0
    thread.join()
    assert "1 did not finish their part" in failures[0], failures
    assert "process group is broken" in str(met.value) and "rank 1" in str(met.value), str(met.value)
    assert elapsed < 30, f"the meeting waited {elapsed:.0f} s: it was not woken"
