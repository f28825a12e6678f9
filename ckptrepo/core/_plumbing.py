"""One repository handle's internals: its store, refs, config, manifest reads and their caches.

``Repository`` (the porcelain users call) holds one ``Plumbing`` and keeps to
commands; the layers below it (saving, maintenance, tools) work with this
object instead, so none of them imports the porcelain and each sees only the
typed operations it uses. ``resolve`` walks revisions through ``_WalkingSource``,
which answers refs and prefixes from this object and first-parent steps from one
shared ``HeaderWalk``.
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from ckptrepo.core import _revisions as revisions
from ckptrepo.core._manifest import (
    CONFIG_KEY,
    CONFIG_MAX_BYTES,
    FAILURES_PREFIX,
    LOST_PREFIX,
    PRUNED_PREFIX,
    decode_config,
    is_version_id,
    read_config,
    unseal,
    update_config,
)
from ckptrepo.core._manifest_reads import HeaderWalk, ManifestReads
from ckptrepo.core._refs import Refs, lost_head_branch
from ckptrepo.core._remotes import evicted_remote, interrupted_clone, remote_url, tracking_tip
from ckptrepo.core.schema import Manifest, ManifestHeader
from ckptrepo.errors import CkptRepoError, CorruptionError, NotARepositoryError, RevisionError, StorageError
from ckptrepo.storage import TieredStore, needs_check, probe_conditional_writes, refusal, store_identity
from ckptrepo.storage.protocol import Store

if TYPE_CHECKING:   # the saving layer makes the cache; this handle only keeps it between snapshotters
    from ckptrepo.saving import PlanCache

# The config field that holds a passed store check (docs/format.md): which server, when. Only a pass is kept.
STORE_CHECK_FIELD = "store_check"


def store_check_passed(config: dict[str, Any], server: str) -> bool:
    """Whether ``config`` records a passed store check of ``server`` (see ``storage._store_check``)."""
    verdict = config.get(STORE_CHECK_FIELD)
    return isinstance(verdict, dict) and verdict.get("conditional_writes") == "ok" and verdict.get("server") == server


class Plumbing:
    """The store, refs and manifest reads of one open repository, and the operations the library builds on.

    Not a stable API: ``Repository`` is. Manifests never change, so what this
    handle decodes is cached for as long as it lives (see ``ManifestReads``).
    """

    def __init__(self, store: Store) -> None:
        raw = read_config(store)
        if raw is None:
            raise NotARepositoryError(f"{store.url} is not a ckptrepo repository; create one with "
                                      f"`ckptrepo init {store.url}` or pass --repo URL")
        self.config = decode_config(raw, store.url)
        self.store = store
        self.url = store.url
        self.refs = Refs(store, before_write=self.require_atomic_store)
        self.reads = ManifestReads(store)
        # write plans of this handle's snapshots, made by the first snapshotter (history tools never import
        # torch, which the saving layer needs) and shared by the next ones, so an unchanged state plans once
        self.plans: PlanCache | None = None
        self._remote_stores: dict[str, Store] = {}
        self._store_trusted = False
        self._store_refusal: StorageError | None = None
        self._store_check_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Plumbing({self.url!r})"

    # ---- the store check ---------------------------------------------------
    def require_atomic_store(self) -> None:
        """Refuse to commit or move a ref on a store whose server ignores the conditions of conditional writes
        (there, of two racing commits both would "win" and one would be lost without a word).

        Called before every commit and ref write. A store whose capabilities promise atomic conditional
        writes is trusted as it is; another is probed once (``storage._store_check``), unless the config
        records a pass for its server, and a pass is recorded there so that later processes skip the probe.
        A failure is not recorded: the next writer probes again (the server may be fixed, or the failure a
        fluke). One probe per handle at most: this handle remembers its verdict either way.
        """
        if self._store_trusted:
            return
        with self._store_check_lock:
            if self._store_refusal is None and not self._store_trusted and needs_check(self.store):
                self._check_store()
            if self._store_refusal is not None:
                raise StorageError(str(self._store_refusal))
            self._store_trusted = True

    def _check_store(self) -> None:
        server = store_identity(self.store)
        if store_check_passed(self.config, server):
            return
        raw = self.store.get(CONFIG_KEY, CONFIG_MAX_BYTES)   # another process may have checked since this opened
        if raw is not None and store_check_passed(decode_config(raw, self.url), server):
            return
        failed = probe_conditional_writes(self.store)
        if failed:
            self._store_refusal = refusal(self.store, failed)
            return
        # every rank of a job may probe at once: a pass another one recorded meanwhile is as good as this one
        self.config = update_config(self.store, {STORE_CHECK_FIELD: {
            "conditional_writes": "ok", "server": server, "checked": time.time()}},
            settled=lambda cfg: store_check_passed(cfg, server))

    # ---- manifests ---------------------------------------------------------
    def manifest(self, vid: str) -> Manifest:
        """The decoded manifest of version ``vid`` (cached: manifests never change)."""
        return self.reads.manifest(vid)

    def header(self, vid: str) -> ManifestHeader:
        """The small fields of version ``vid``'s manifest: all that history walks need (cached)."""
        return self.reads.header(vid)

    def iter_manifests(self, vids: Sequence[str]) -> Iterator[tuple[str, Manifest | CkptRepoError]]:
        """Each version's decoded manifest, or the error reading it gave, in order (batched on object stores)."""
        return self.reads.iter_manifests(vids)

    def each_manifest(self, vids: Sequence[str]) -> Iterator[tuple[str, Manifest]]:
        """Each version's decoded manifest in order; the first version that cannot be read raises."""
        return self.reads.each_manifest(vids)

    def remember_header(self, manifest: Manifest) -> None:
        """Cache the header of a manifest this process just committed (see ManifestReads.remember_header)."""
        self.reads.remember_header(manifest)

    def all_version_ids(self) -> list[str]:
        """Every version manifest in storage, reachable or not."""
        return self.reads.all_version_ids()

    def require_data(self, vid: str, manifest: Manifest) -> None:
        """Refuse, in one line, to read the tensors of a version gc pruned (its history stays, its data is gone):
        every reader (load, diff, stats) says so instead of failing on the first missing object."""
        if any(t.pieces for t in manifest.tensors) and self.is_pruned(vid):
            raise RevisionError(f"version {vid[:12]} (step {manifest.step}) was pruned by gc: its tensor data is "
                                f"deleted; pick a kept version from `ckptrepo log`")

    def data_store(self, manifest: Manifest) -> Store:
        """The store to read ``manifest``'s arrays from: this repository's, or, where a version whose arrays it
        points into was evicted here after a push or cloned lazily, one that reads what is missing here from the
        remote the eviction marker names (see core/_remotes.py)."""
        # the version's own marker too: a lazy fetch marks each version it fetches, not the (pruned, or
        # unreachable) versions whose arrays it reuses through dedup
        owners = {key.split("/")[1] for key in manifest.arrays if key.count("/") >= 1} | {manifest.id}
        remote = next((r for r in (evicted_remote(self.store, vid) for vid in sorted(owners)) if r), None)
        if remote is None:
            return self.store
        return TieredStore(self.store, self.remote_store(remote))

    def remote_store(self, name: str) -> Store:
        """The store of remote ``name`` (opened once per handle and URL: a remote removed and added again, or
        its config edited by hand, is read where it now points)."""
        url = remote_url(self.store, name)
        if name not in self._remote_stores or self._remote_stores[name].url != url:
            from ckptrepo.storage import TensorStoreStore, untrusted
            # a remote is not this user's: its links are never followed, its reads bounded before they download
            self._remote_stores[name] = untrusted(TensorStoreStore.open(url))
        return self._remote_stores[name]

    def failures(self) -> list[dict[str, Any]]:
        """Records of background snapshots that failed (id, step, time, branch, message, error), newest first."""
        out = []
        for key in self.store.list(FAILURES_PREFIX):
            try:
                raw = self.store.get(key)
                if raw is not None:
                    out.append(unseal(raw, key))
            except CkptRepoError as err:   # damaged, or no file at all (a FIFO): named, not fatal to fsck
                out.append({"id": key[len(FAILURES_PREFIX):], "step": None, "time": 0.0, "error": str(err)})
        return sorted(out, key=lambda f: f.get("time", 0.0), reverse=True)

    # ---- refs and revisions (the RevisionSource protocol) --------------------
    def resolve(self, rev: str) -> str:
        """The full id of the version ``rev`` names (see ckptrepo.core._revisions for the syntax)."""
        return revisions.resolve(_WalkingSource(self), rev)

    def ref_names(self) -> dict[str, tuple[str, ...]]:
        """Version id -> the names ``log`` shows beside it ("HEAD -> main", "tag: best", a detached "HEAD")."""
        names: dict[str, list[str]] = {}
        head = self.refs.head()
        for b, vid in self.refs.branches(strict=False).items():
            names.setdefault(vid, []).append(f"HEAD -> {b}" if b == head.branch else b)
        for t, vid in self.refs.tags(strict=False).items():
            names.setdefault(vid, []).append(f"tag: {t}")
        if head.branch is None and head.version:
            names.setdefault(head.version, []).insert(0, "HEAD")
        return {k: tuple(v) for k, v in names.items()}

    def pruned_ids(self) -> set[str]:
        """Versions whose data gc deleted (their markers); here, so that ``log`` need not load gc to ask."""
        return {k[len(PRUNED_PREFIX):] for k in self.store.list(PRUNED_PREFIX)}

    def is_pruned(self, vid: str) -> bool:
        """Whether gc deleted ``vid``'s data (its marker exists): one lookup, where ``pruned_ids`` lists them all."""
        return self.store.exists(PRUNED_PREFIX + vid)

    def lost_ids(self) -> set[str]:
        """Versions ``fsck --repair`` marked lost (maintenance/_lost.py); here, so that gc and fsck share it."""
        return {vid for k in self.store.list(LOST_PREFIX) for vid in [k[len(LOST_PREFIX):]] if is_version_id(vid)}

    def head_version(self) -> str | None:
        """HEAD's version; None on a branch without versions (a new repository, an orphan checkout), unless
        its ref was lost or replaced while the repository has versions (see ``lost_head_branch``), which is
        damage to name, not an empty branch to report."""
        h = self.refs.head()
        if h.damage is not None:
            raise CorruptionError(h.damage)
        lost = lost_head_branch(self.store, h)
        if lost is not None:
            raise CorruptionError(interrupted_clone(self.config, self.url) or lost)
        return h.version

    def head_description(self) -> str:
        """HEAD as an error message names it: its branch, or the version it is detached at."""
        h = self.refs.head()
        return f"branch {h.branch!r}" if h.branch else f"detached HEAD {str(h.version)[:12]}"

    def branch_tip(self, name: str) -> str | None:
        """The version branch ``name`` points at; None when there is no such branch."""
        return self.refs.branch_tip(name)

    def tag_target(self, name: str) -> str | None:
        """The version tag ``name`` points at; None when there is no such tag."""
        return self.refs.tag_target(name)

    def ids_with_prefix(self, prefix: str) -> list[str]:
        """The ids of the versions in storage that start with ``prefix``."""
        return self.reads.all_version_ids(prefix)

    def first_parent(self, vid: str) -> str | None:
        """The version ``vid`` was committed on top of; None for a root version."""
        parents = self.header(vid).parents
        return parents[0] if parents else None



class _WalkingSource:
    """A handle as a revision source whose first-parent steps (``HEAD~N``, ``@STEP``) share one HeaderWalk, so
    a walk back over many versions reads their headers in batches."""

    def __init__(self, plumbing: Plumbing) -> None:
        self._plumbing = plumbing
        self._walk = HeaderWalk(plumbing.reads)

    def head_version(self) -> str | None:
        return self._plumbing.head_version()

    def head_description(self) -> str:
        return self._plumbing.head_description()

    def branch_tip(self, name: str) -> str | None:
        tip = self._plumbing.branch_tip(name)
        if tip is None and "/" in name:   # REMOTE/BRANCH, as git resolves origin/main: the remote-tracking ref
            tip = tracking_tip(self._plumbing.store, name)
        return tip

    def tag_target(self, name: str) -> str | None:
        return self._plumbing.tag_target(name)

    def ids_with_prefix(self, prefix: str) -> list[str]:
        return self._plumbing.ids_with_prefix(prefix)

    def first_parent(self, vid: str) -> str | None:
        parents = self._walk(vid).parents
        return parents[0] if parents else None

    def step_of(self, vid: str) -> int | None:
        return self._walk(vid).step

    def is_pruned(self, vid: str) -> bool:
        return self._plumbing.is_pruned(vid)
