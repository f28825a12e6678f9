"""The second level of a local tier: a snapshotter's versions pushed to a remote in the background.

With ``push_to``, a snapshotter commits each version locally (local-durable: the training loop never waits for
the remote), then announces the commit to this pusher. Its thread pushes the branch (remotes/_sync.py:
only what the remote lacks, refs last), so one push covers every commit announced before it started: pushes
coalesce when the remote falls behind. After each successful push, local retention (remotes/_evict.py)
deletes here the data of the versions beyond the newest ``keep_last`` that the remote now holds.

The pusher also keeps the account that bounds local disk use: the bytes of the snapshots in flight and of
the versions committed but not pushed yet. ``make_room`` is the backpressure a snapshot meets when they
would pass ``max_bytes``: it waits for the pusher, or tells the snapshotter to skip the snapshot
(docs/decisions/024-local-tier.md).

A failed push never raises here: it is handed to ``on_error`` (the snapshotter raises it at its next call),
recorded where ``log --all`` and fsck show it (core/_remotes.py), and the next commit pushes again. The
versions stay local, and local retention never evicts what the remote does not hold.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Iterable

from ckptrepo.arguments import checked_step
from ckptrepo.core import (
    Plumbing,
    check_not_itself,
    new_version_id,
    record_push_failure,
    refuse_if_same_store,
    remote_url,
)
from ckptrepo.errors import (
    ArgumentError,
    BackpressureWarning,
    CkptRepoError,
    RemoteError,
    SnapshotFailedError,
    first_line,
    warn,
)
from ckptrepo.remotes import evict, push
from ckptrepo.saving._options import LocalTier
from ckptrepo.saving._snapshot_job import SnapshotHandle
from ckptrepo.storage import open_store

log = logging.getLogger("ckptrepo")

# The pusher's niceness: above the training loop's, so that where cores are few the upload takes what training
# leaves instead of slowing its steps. Threads inherit it from the thread that starts them, so the copy workers,
# and TensorStore's HTTP threads when this thread's push is the process's first request to the remote, run at it.
PUSH_NICENESS = 10


def _yield_to_training() -> None:
    """Lower this thread's scheduling priority (Linux: niceness is per thread); nothing where that is not
    possible."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PUSH_NICENESS)
    except (AttributeError, OSError):
        pass


def check_push_target(plumbing: Plumbing, remote: str) -> None:
    """Refuse, when a snapshotter starts, a ``push_to`` that is not a remote here or that is this repository
    itself (its config may have been edited by hand since ``remote add``): each push would find it up to date
    and local retention would delete the only copy. A remote in a local directory is probed too, which costs
    no round trip; an object store is probed by each push (remotes/_remote.py), so a remote that is down does
    not stop training from starting."""
    url = remote_url(plumbing.store, remote)
    check_not_itself(plumbing.store.url, remote, url)
    there = open_store(url)   # not the handle's cached store: the snapshotter's handle outlives remote changes
    if there.capabilities.local_root is not None:
        refuse_if_same_store(plumbing.store, there, remote)


class BackgroundPusher:
    """Pushes ``branch`` of ``plumbing`` to ``remote`` after each announced commit (see the module docstring)."""

    def __init__(self, plumbing: Plumbing, remote: str, branch: str, keep_last: int | None,
                 max_bytes: int | None, on_error: Callable[[CkptRepoError], None],
                 protect: Callable[[], Iterable[str]],
                 before_push: Callable[[Plumbing], str | None] | None = None) -> None:
        # a handle of its own: this thread reads manifests and refs beside the commit thread, which keeps the
        # snapshotter's handle and its caches to itself
        self.plumbing = Plumbing(plumbing.store)
        self.remote, self.branch = remote, branch
        self.keep_last, self.max_bytes = keep_last, max_bytes
        self._on_error, self._protect = on_error, protect
        # on node-local tiers: the wait for the other nodes' arrays, which says the branch's version it checked
        # (given here: the thread starts pushing at once, what an earlier run left)
        self.before_push = before_push
        self.last_error: str | None = None   # the last push's failure, None once one succeeds
        self.ranks_here = 1   # ranks writing into this repository: the bytes it accounts are this rank's times that
        self._cond = threading.Condition()
        # pushes asked for and the last one an attempt covered: a commit asks for one; an attempt covers
        # every ask made before it began
        self._asked = 1 if self.plumbing.branch_tip(branch) else 0   # resume what a crash left unpushed
        self._covered = 0
        self._failures = 0
        self._pending: dict[str, int] = {}       # version -> bytes here that the remote lacks (in flight too)
        self._committed: dict[str, int] = {}     # version -> the ask its commit made
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="ckptrepo-push", daemon=True)
        self._thread.start()

    # ---- the snapshotter's side -------------------------------------------------------
    def reserve(self, vid: str, nbytes: int) -> None:
        """A snapshot is in flight: its bytes count against ``max_bytes`` until pushed (or failed)."""
        with self._cond:
            self._pending[vid] = nbytes * self.ranks_here

    def committed(self, vid: str, nbytes: int) -> None:
        """Version ``vid`` is committed here with ``nbytes`` of its own data: push it."""
        with self._cond:
            if vid in self._pending:
                self._pending[vid] = nbytes * self.ranks_here
            self._asked += 1
            self._committed[vid] = self._asked
            self._cond.notify_all()

    def dropped(self, vid: str) -> None:
        """Snapshot ``vid`` failed: nothing of it is to push."""
        with self._cond:
            self._pending.pop(vid, None)
            self._cond.notify_all()

    def unpushed(self) -> list[str]:
        """The versions committed or in flight that the remote does not hold yet."""
        with self._cond:
            return list(self._pending)

    def unpushed_bytes(self) -> int:
        with self._cond:
            return sum(self._pending.values())

    def make_room(self, nbytes: int, wait: bool, warn: Callable[[int], None]) -> bool:
        """Whether a snapshot of ``nbytes`` may start: at once while what is unpushed stays within
        ``max_bytes`` (or nothing is unpushed: a snapshot larger than the bound alone still goes); otherwise,
        after ``warn(unpushed bytes)``, once pushes have made room (``wait``) or never (False: skip it). A push
        that fails meanwhile ends the wait (True): the snapshotter raises its error."""
        with self._cond:
            if not self._over(nbytes):
                return True
            warn(sum(self._pending.values()))
            if not wait:
                return False
            failures = self._failures
            while self._over(nbytes) and self._failures == failures and not self._stop:
                if self._covered >= self._asked and self._committed:   # idle, with committed versions left
                    self._asked += 1   # after a failed push: try again
                    self._cond.notify_all()
                self._cond.wait()
            return True

    def admit(self, nbytes: int, step: int | None, on_full: str) -> bool:
        """``make_room`` for a snapshot of ``nbytes`` at ``step`` (this rank's: times ``ranks_here``), with the
        ``BackpressureWarning`` that says why it waits (``on_full="wait"``) or is skipped; called by
        ``Snapshotter.snapshot`` (the warning names the line that called the snapshotter)."""
        nbytes *= self.ranks_here
        def warn_full(unpushed: int) -> None:
            assert self.max_bytes is not None
            what = "waits for the push" if on_full == "wait" else "is skipped"
            at = "" if step is None else f" at step {step}"
            warn(f"ckptrepo: the local tier holds {_size(unpushed)} not pushed to {self.remote!r} yet; "
                 f"the snapshot{at} ({_size(nbytes)}) would pass local_max_bytes={_size(self.max_bytes)}, "
                 f"so it {what} (on_full={on_full!r}); the remote is slower than the snapshots: "
                 f"snapshot less often or raise local_max_bytes", BackpressureWarning)
        return self.make_room(nbytes, on_full == "wait", warn_full)

    def _over(self, nbytes: int) -> bool:
        unpushed = sum(self._pending.values())
        return self.max_bytes is not None and unpushed > 0 and unpushed + nbytes > self.max_bytes

    def wait(self) -> None:
        """Block until a push has covered every commit announced so far (pushed, or failed: see on_error). When
        the last push failed and left versions unpushed, one more is tried: after ``wait`` they are on the
        remote, or a failure says why not."""
        with self._cond:
            if self._committed and self._covered >= self._asked:
                self._asked += 1
                self._cond.notify_all()
            target = self._asked
            while self._covered < target and self._thread.is_alive():
                self._cond.wait()

    def close(self) -> None:
        """Finish the pushes asked for, then stop the thread."""
        self.wait()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()

    # ---- the pusher thread ------------------------------------------------------------
    def _loop(self) -> None:
        _yield_to_training()
        while True:
            with self._cond:
                while not self._stop and self._covered >= self._asked:
                    self._cond.wait()
                if self._covered >= self._asked:
                    return
                target = self._asked
            ok = self._push_once()
            if ok:
                self.last_error = None
            if ok and self.keep_last is not None:   # before the push counts as done: wait() covers it too
                self._evict()
            with self._cond:
                self._covered = target
                if ok:
                    done = [v for v, ask in self._committed.items() if ask <= target]
                    for v in done:
                        del self._committed[v]
                        self._pending.pop(v, None)
                else:
                    self._failures += 1
                self._cond.notify_all()

    def _push_once(self) -> bool:
        try:
            self._send()
        except Exception as err:  # noqa: BLE001 - never kills the pusher; raised by the snapshotter's next call
            failure = RemoteError(f"background push of branch {self.branch!r} to {self.remote!r} failed: "
                                  f"{first_line(err)}; the versions are committed here, and the next snapshot "
                                  f"pushes them again (or run `ckptrepo push {self.remote}`)")
            failure.__cause__ = err
            self._fail(failure)
            try:
                tip = self.plumbing.branch_tip(self.branch)
                step = self.plumbing.header(tip).step if tip else None
                record_push_failure(self.plumbing.store, self.remote, self.branch, tip, step, first_line(err))
            except Exception as record_err:  # noqa: BLE001 - the local store may be what failed
                log.error("ckptrepo: could not record the failed push: %s", first_line(record_err))
            return False
        return True

    def _send(self) -> None:
        """One push: the branch's versions the remote lacks, then its ref (``before_push`` first: on node-local
        tiers, the wait for the other nodes' arrays)."""
        at = None if self.before_push is None else self.before_push(self.plumbing)
        push(self.plumbing, self.remote, [self.branch], at=None if at is None else {self.branch: at})

    def _evict(self) -> None:
        assert self.keep_last is not None
        try:
            evict(self.plumbing, self.remote, self.keep_last, self.branch, protect=set(self._protect()))
        except Exception as err:  # noqa: BLE001 - as a failed push
            failure = RemoteError(f"local retention after a push to {self.remote!r} failed: {first_line(err)}; "
                                  f"nothing the remote lacks was deleted here; run `ckptrepo fsck`")
            failure.__cause__ = err
            self._fail(failure)

    def _fail(self, failure: CkptRepoError) -> None:
        self.last_error = first_line(failure)
        log.error("ckptrepo: %s", failure)
        self._on_error(failure)


def check_tier(plumbing: Plumbing, tier: LocalTier, world_size: int) -> None:
    """What a snapshotter's tier needs, checked when it starts: a remote that is not this repository, and
    ``on_full="wait"`` under torch.distributed."""
    check_push_target(plumbing, tier.push_to)   # an unknown remote, or this repository itself: one line
    if tier.on_full == "skip" and world_size > 1:
        raise ArgumentError("on_full='skip' needs a single process (every rank would have to skip the same "
                            "snapshot); use on_full='wait'")


def skipped_handle(step: int | None, remote: str, t0: float) -> SnapshotHandle:
    """The handle of a snapshot not taken (``on_full="skip"``): done at once, ``skipped`` set."""
    handle = SnapshotHandle(new_version_id(), checked_step(step))
    reason = SnapshotFailedError(f"the snapshot{'' if step is None else f' at step {step}'} was skipped: the "
                                 f"local tier was full (local_max_bytes) while the push to {remote!r} "
                                 f"caught up (on_full='skip')")
    handle._skip(reason)
    handle.stats.blocking_s = time.perf_counter() - t0
    return handle


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


__all__ = ["BackgroundPusher", "check_push_target", "check_tier", "skipped_handle"]
