"""The ranks' key-value store: torch.distributed's own c10d ``Store``, scoped to one snapshotter.

Every coordination of a distributed snapshotter goes through the store the process group was made with (the
``TCPStore`` torchrun's rendezvous serves), not through the object store and not through collectives on the
training loop's group: its ``wait`` blocks on the server with a deadline instead of polling, its values stay
in memory, and a rank that never arrives is named from the keys it did not set. What must survive a crash
(data, manifests, refs) stays in the repository's store.

A ``TCPStore`` client runs one request at a time, so a wait in one thread would hold up every other thread's
requests on the same client: each thread that waits (the training thread, the commit thread, a pusher) gets
a connection of its own (``connection``).
"""
from __future__ import annotations

import datetime
from typing import Any, Callable, Sequence

import msgpack

from ckptrepo.errors import SnapshotFailedError, first_line

# the counts an arrival adds to one counter key, packed so that one ``add`` carries them all
_ARRIVED = 1
_CHANGED = 1 << 20
_REFUSED = 1 << 40
_MASK = (1 << 20) - 1

_sessions = 0   # snapshotters made in this process under torch.distributed: every rank makes them in one order


class DeadlineError(SnapshotFailedError):
    """A distributed wait passed its deadline; the message names the ranks it waited for."""


def _default_store() -> Any:
    import torch.distributed as dist
    return dist.distributed_c10d._get_default_store()


def ranks_text(ranks: Sequence[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:16])
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}{', …' if len(ranks) > 16 else ''}"


class GroupStore:
    """One snapshotter's view of the c10d store: keys under its own prefix, a deadline on every wait."""

    def __init__(self, store: Any, prefix: str, rank: int, world_size: int) -> None:
        self._store, self.prefix = store, prefix
        self.rank, self.world_size = rank, world_size

    @classmethod
    def of_default_group(cls, rank: int, world_size: int) -> "GroupStore":
        """A new snapshotter's scope in the default group's store (``ckptrepo/<n>/``: the ranks make their
        snapshotters in the same order, so the n-th of each rank shares one scope)."""
        global _sessions
        _sessions += 1
        return cls(_default_store(), f"ckptrepo/{_sessions}/", rank, world_size)

    def connection(self) -> "GroupStore":
        """The same scope through a connection of the calling thread's own (``Store.clone``: see the module
        docstring); a store that cannot clone serves every thread on one."""
        try:
            store = self._store.clone()
        except Exception:  # noqa: BLE001 - HashStore and third-party stores: shared, as before
            store = self._store
        return GroupStore(store, self.prefix, self.rank, self.world_size)

    # ---- plain operations: a store that went away (its host process ended) is one SnapshotFailedError ------
    def _call(self, what: str, op: Callable[[], Any]) -> Any:
        try:
            return op()
        except Exception as err:  # noqa: BLE001 - DistNetworkError, DistStoreError: c10d's RuntimeErrors
            raise SnapshotFailedError(f"the ranks' store failed ({what}: {first_line(err)}); a rank's process "
                                      f"that served it may have ended: restart every rank and resume from the "
                                      f"last committed version") from err

    def set(self, key: str, value: bytes) -> None:
        self._call(f"set {key}", lambda: self._store.set(self.prefix + key, value))

    def get(self, key: str) -> bytes:
        return bytes(self._call(f"get {key}", lambda: self._store.get(self.prefix + key)))

    def get_many(self, keys: Sequence[str]) -> list[bytes]:
        return [bytes(v) for v in self._call(f"get {len(keys)} keys",
                                             lambda: self._store.multi_get([self.prefix + k for k in keys]))]

    def add(self, key: str, n: int) -> int:
        return int(self._call(f"add {key}", lambda: self._store.add(self.prefix + key, n)))

    def first(self, key: str, value: bytes) -> bytes:
        """``value`` if this is the first rank to set ``key``, else what the first one set."""
        return bytes(self._call(f"set {key}", lambda: self._store.compare_set(self.prefix + key, b"", value)))

    def has(self, key: str) -> bool:
        return bool(self._call(f"check {key}", lambda: self._store.check([self.prefix + key])))

    def delete(self, key: str) -> None:
        try:
            self._store.delete_key(self.prefix + key)
        except Exception:  # noqa: BLE001 - a store without deletes (FileStore) keeps the few bytes
            pass

    def wait(self, keys: Sequence[str], timeout_s: float, missing: Callable[[], str], fix: str = "") -> None:
        """Wait until every key is set; past ``timeout_s``, DeadlineError saying ``missing()`` (which names what
        did not arrive), the deadline, then ``fix``."""
        try:
            self._store.wait([self.prefix + k for k in keys], datetime.timedelta(seconds=max(0.001, timeout_s)))
        except Exception as err:  # noqa: BLE001 - DistStoreError (timeout) or a store that went away
            if "timeout" not in str(err).lower() and "timed out" not in str(err).lower():
                raise DeadlineError(f"the ranks' store failed while waiting ({missing()}): {err}; restart every "
                                    f"rank and resume from the last committed version") from err
            raise DeadlineError(f"{missing()} within {timeout_s:.0f} s{fix}") from None

    def absent(self, keys: Sequence[str]) -> list[int]:
        """The indexes of ``keys`` not set (one request each: only on an error path)."""
        return [i for i, k in enumerate(keys) if not self.has(k)]

    # ---- a barrier that also counts ------------------------------------------------------
    def arrive(self, name: str, timeout_s: float, payload: dict[str, Any], changed: bool, refused: bool,
               what: str, fix: str = "; a rank died or is stuck, or the ranks' code differs") -> tuple[int, int]:
        """Every rank's arrival at ``name``: each sets its ``payload`` (read only to explain a failure) and adds
        its counts to one counter; the last to arrive opens the gate. Returns (ranks that changed, ranks that
        refused), the same on every rank. A constant number of requests per rank, whatever the world size."""
        self.set(f"{name}/r{self.rank}", msgpack.packb(payload))
        total = self.add(f"{name}/n", _ARRIVED + (_CHANGED if changed else 0) + (_REFUSED if refused else 0))
        if total & _MASK == self.world_size:
            self.set(f"{name}/open", b"1")

        def missing() -> str:
            late = self.absent([f"{name}/r{r}" for r in range(self.world_size)])
            return f"{ranks_text(late)} did not reach {what}" if late else f"the ranks did not all reach {what}"
        self.wait([f"{name}/open"], timeout_s, missing, fix)
        total = self.add(f"{name}/n", 0)
        if total & _MASK != self.world_size:   # opened by a rank that knows the group is broken: not all are here
            raise DeadlineError(f"{missing()}: the process group is broken; restart every rank and resume from the "
                                f"last committed version")
        return (total >> 20) & _MASK, total >> 40

    def payloads(self, name: str) -> list[dict[str, Any]]:
        """Every rank's payload at ``name`` (after ``arrive``: all are set)."""
        return [msgpack.unpackb(v) for v in self.get_many([f"{name}/r{r}" for r in range(self.world_size)])]

    def forget(self, name: str, own_only: bool = False) -> None:
        """Delete this rank's payload at ``name`` and, unless ``own_only``, the shared keys (rank 0 does that
        once every rank has read them)."""
        self.delete(f"{name}/r{self.rank}")
        if not own_only:
            for k in ("n", "open"):
                self.delete(f"{name}/{k}")


__all__ = ["DeadlineError", "GroupStore", "ranks_text"]
