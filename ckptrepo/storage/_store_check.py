"""The store check: does a store's server honour the conditions of its conditional writes?

Commits and ref updates are compare-and-swaps (docs/decisions/012). On S3 and GCS TensorStore sends the
condition (``If-None-Match: *``, ``If-Match: ETAG``) on the PUT itself, so a commit is exactly as atomic
as the server's conditional PUT. A server or gateway that ignores the condition accepts every such write:
two writers on one branch both "win" and one version is lost without an error. Such a server cannot be
told from a good one by its URL, only by what it does, so before the first ref write a repository probes
it once (``probe_conditional_writes``) under scratch keys of its own, which it removes again.

TensorStore first checks the condition with a HEAD request and sends the PUT only if it holds. A server
that honours conditions on HEAD (as HTTP caches have long asked of servers) and ignores them on PUT
passes any probe made of one write at a time: the HEAD answers for it. Only writes that race past their
HEADs together reach the PUT's condition, so the probe also races two create-only writes of one new
object, a few times: a server that honours the condition lets exactly one of them win, every time.
"""
from __future__ import annotations

import os
import threading
from typing import Any

from ckptrepo.errors import CkptRepoError, StorageError
from ckptrepo.storage.protocol import NO_VALUE, Store

SCRATCH_PREFIX = "store-check/"   # one key per probe, deleted when it ends
_FIRST, _SECOND, _MOVED, _STALE = (b"store check: " + w for w in (b"first", b"second", b"moved", b"stale"))

CREATE_ONLY = "a create-only write (If-None-Match: *) replaced an object that exists"
STALE_SWAP = "a compare-and-swap with a stale generation (If-Match) replaced the object"
RACING_CREATES = "two racing create-only writes (If-None-Match: *) of one new object both succeeded"
# Races of two create-only writes, and how many of them may have two winners before the server is refused:
# one such round can be a server's rare race between its check and its write (moto's, about one in some
# hundreds), while a server that ignores the condition gives two winners nearly every round.
RACE_ROUNDS, RACES_LOST_MAX = 3, 1


def needs_check(store: Store) -> bool:
    """Whether ``store`` must be probed before it is trusted with commits: its capabilities do not promise
    atomic conditional writes (a file or memory store does; an object store's server decides)."""
    return not store.capabilities.atomic_conditional_writes


def store_identity(store: Store) -> str:
    """What a verdict is about: the server a store's requests go to (driver and endpoint). The same bucket
    reached through another endpoint (a gateway) may not honour conditions, so a verdict counts only for
    the server it was reached through."""
    spec: dict[str, Any] = store.child_spec("")
    return f"{spec.get('driver')} {spec.get('endpoint') or 'default endpoint'}"


def probe_conditional_writes(store: Store) -> list[str]:
    """Probe ``store`` under a fresh scratch key: the conditions it failed to honour (empty: none).

    A create-only write of an object that exists must fail, and a compare-and-swap with a generation the
    object has moved past must fail, each leaving the value as it was. A write whose reply was lost and
    which the store retried reads back as written (the value is ours), so it does not fail the probe.
    """
    key = f"{SCRATCH_PREFIX}{os.urandom(8).hex()}"
    failed = []
    try:
        _write(store, key, _FIRST, NO_VALUE)
        if store.put_if_absent(key, _SECOND) or store.get(key) != _FIRST:
            failed.append(CREATE_ONLY)
        stale = store.get_with_generation(key)[1]
        _write(store, key, _MOVED, stale)   # a value unlike the one before: an ETag is the content's hash
        if store.compare_and_swap(key, _STALE, stale) is not None or store.get(key) != _MOVED:
            failed.append(STALE_SWAP)
    finally:
        _delete(store, key)
    if not failed and sum(_racing_creates(store) > 1 for _ in range(RACE_ROUNDS)) > RACES_LOST_MAX:
        failed.append(RACING_CREATES)
    return failed


def _racing_creates(store: Store, racers: int = 2) -> int:
    """How many of ``racers`` create-only writes of one new scratch key, sent at once, succeeded."""
    key = f"{SCRATCH_PREFIX}race-{os.urandom(8).hex()}"
    line_up = threading.Barrier(racers)
    wins: list[int] = []
    errors: list[CkptRepoError] = []

    def race(i: int) -> None:
        try:
            line_up.wait()
            if store.put_if_absent(key, b"store check: racer %d" % i):
                wins.append(i)
        except CkptRepoError as err:
            errors.append(err)

    threads = [threading.Thread(target=race, args=(i,), name=f"ckptrepo-store-check-{i}") for i in range(racers)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        _delete(store, key)
    if errors:
        raise errors[0]
    return len(wins)


def _delete(store: Store, key: str) -> None:
    try:
        store.delete(key)
    except CkptRepoError as err:   # the verdict stands; a scratch key left behind is harmless
        import logging  # here: opening a repository (every command) never needs it otherwise
        logging.getLogger("ckptrepo").warning("ckptrepo: could not delete the store check's scratch key %s: %s",
                                              key, err)


def _write(store: Store, key: str, value: bytes, expected: bytes) -> None:
    """A conditional write the probe needs to succeed (its condition holds)."""
    if store.compare_and_swap(key, value, expected) is None:   # a lost reply, retried: the value is ours
        if store.get(key) != value:
            raise StorageError(f"{store.url}: the store check could not write its scratch key {key} (a "
                               f"conditional write whose condition held failed); check the store and run again")


def refusal(store: Store, failed: list[str]) -> StorageError:
    """The one-line error of a store that failed the probe: what failed, why it matters, what to do."""
    return StorageError(f"{store.url} does not honour conditional writes ({'; '.join(failed)}), so concurrent "
                        f"commits there could be lost without an error; use a store whose server honours "
                        f"If-None-Match/If-Match on PUT (AWS S3, GCS), or snapshot to a local repository")
