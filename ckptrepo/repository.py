"""The Repository: init/open, snapshot (commit), load, log, refs and revisions.

Commit protocol (see docs/architecture.md, "The commit protocol"): data
arrays are written and made durable first, then the version manifest
(write-if-absent), and only then is the branch ref moved by compare-and-swap. A crash before the ref moves leaves the
repository exactly as it was, apart from unreferenced objects that ``gc``
removes; a lost compare-and-swap is a ConflictError and commits nothing.

``Repository`` is the porcelain: the commands users call. A handle's internals
(store, refs, manifest reads and caches) are a ``core._plumbing.Plumbing``,
which the layers below work with so that none of them imports this module.
"""
from __future__ import annotations

import functools
import os
import time
import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

from ckptrepo.arguments import (
    check_callback,
    check_flag,
    check_path,
    check_pattern,
    check_ref_type,
    check_rev,
    check_whole,
    repo_url,
    short_text,
    shown,
)
from ckptrepo.core import (
    COMPRESSION_SETTING,
    Plumbing,
    Version,
    add_remote,
    check_remote_name,
    collection_paused,
    create_store,
    every_ref_target,
    first_parent_headers,
    log_versions,
    metric_rows,
    remotes,
    remove_remote,
    tracking_refs,
    update_config,
    version_durability,
)
from ckptrepo.core.schema import ManifestHeader, version_from_manifest
from ckptrepo.errors import (
    CkptRepoError,
    LayoutError,
    RevisionError,
    SnapshotFailedError,
)
from ckptrepo.loading import check_into, load_device
from ckptrepo.remotes import REPOSITORY_ID
from ckptrepo.state import plain_values
from ckptrepo.storage import Store, check_compression, itemsize, open_store

if TYPE_CHECKING:

    from ckptrepo.loading import ReadStats
    from ckptrepo.maintenance import DiskUsage, FsckReport, GcReport, RetentionPolicy
    from ckptrepo.parallel.layout import ParallelLayout
    from ckptrepo.remotes import EvictReport, Progress, SyncResult
    from ckptrepo.saving import Snapshotter, SnapshotterOptions
    from ckptrepo.tools import BisectResult, RepoStatus, StatMatrix, TensorStats, TrajectoryPoint, VersionDiff

DEFAULT_BRANCH = "main"


# ---- argument checks of the public API ----------------------------------------------------------------------
# The shared ones are in ckptrepo/arguments.py; these two need the layers above it (torch, layouts).

_whole = functools.partial(check_whole, optional=True, show=shown)
_flag = functools.partial(check_flag, show=shown)


def _layout(layout: Any) -> None:
    from ckptrepo.parallel.layout import ParallelLayout
    if layout is not None and not isinstance(layout, ParallelLayout):
        raise LayoutError(f"parallel_layout must be a ckptrepo.ParallelLayout or None, not {shown(layout)}")


def init(url: str | os.PathLike[str], exist_ok: bool = False, options: dict[str, Any] | None = None,
         compression: str | bool | None = None) -> "Repository":
    """Create a repository at ``url`` (a path, file://, memory://, s3:// or gs:// URL) and open it.

    ``compression="zstd"`` stores the tensors of its versions compressed losslessly (zarr's blosc codec: zstd
    after a byte shuffle), which pays where storage is slower than compressing (a remote store), not on a
    local NVMe disk; a snapshotter may override it (``repo.snapshotter(compression=...)``). With
    ``exist_ok``, a compression named here becomes the existing repository's setting for later snapshots.
    """
    chosen = check_compression(compression)
    settings: dict[str, Any] = {"created": time.time(), "default_branch": DEFAULT_BRANCH,
                                REPOSITORY_ID: uuid.uuid4().hex}
    if chosen is not None:
        settings[COMPRESSION_SETTING] = chosen
    existing = None if compression is None else {COMPRESSION_SETTING: chosen}
    return Repository(create_store(repo_url(url), options, exist_ok, settings, DEFAULT_BRANCH, existing))


def clone(url: str | os.PathLike[str], directory: str | os.PathLike[str], depth: int | None = None,
          lazy: bool = False, remote: str = "origin", progress: "Progress | None" = None) -> "Repository":
    """Clone the repository at ``url`` into ``directory`` (a new repository there, with ``url`` as ``remote``),
    its HEAD on the remote HEAD's branch. ``lazy``: manifests and refs only, tensor bytes read from the remote
    on demand (only the ranges a load needs); ``depth``: data copied for the newest ``depth`` versions of each
    branch, the rest read lazily. Every version loads either way. A damaged source is refused before anything
    is written; a clone killed midway is finished by the same call again (ckptrepo/remotes/_clone.py)."""
    from ckptrepo.remotes import clone as clone_into
    if depth is not None:
        _whole(depth, "depth", least=1)
    local = clone_into(repo_url(url), repo_url(directory), DEFAULT_BRANCH, depth=depth, lazy=lazy, remote=remote,
                       progress=progress)
    return Repository(local.store)


def open(url: str | os.PathLike[str], options: dict[str, Any] | None = None  # noqa: A001 - the public API
         ) -> "Repository":
    """Open the repository at ``url`` (a path, ``pathlib.Path`` or URL); NotARepositoryError when there is none."""
    return Repository(open_store(repo_url(url), options))


def load(url: str | os.PathLike[str], rev: str = "HEAD", parallel_layout: "ParallelLayout | None" = None,
         rank: int | None = None, into: Any = None, options: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """``open(url).load(rev, ...)``: the rank defaults to this process's torch.distributed rank."""
    return open(url, options).load(rev, into=into, parallel_layout=parallel_layout, rank=rank, **kwargs)


@dataclass
class VersionDetails:
    """Everything ``show`` prints: the header, each tensor and each plain value."""

    version: Version
    layout: dict[str, Any]
    tensors: list[dict[str, Any]]
    objects: list[tuple[str, str]]


class Repository:
    """A versioned checkpoint repository in a key-value store."""

    def __init__(self, store: Store) -> None:
        self._plumbing = Plumbing(store)   # NotARepositoryError when the store holds no repository
        self.url = store.url
        self.host_memory: int | str | None = None  # default staging bound of this handle's snapshots

    def __repr__(self) -> str:
        return f"Repository({self.url!r})"

    @property
    def plumbing(self) -> Plumbing:
        """This handle's internals: its store, refs, manifest reads and caches (see ckptrepo.core._plumbing).

        For the library's own layers, tests and tools that need a version's raw manifest; not a stable API.
        """
        return self._plumbing

    def version(self, rev: str = "HEAD") -> Version:
        """The header of the version ``rev`` names."""
        p = self._plumbing
        vid = p.resolve(check_rev(rev))
        return self._described(vid, p.header(vid))

    def _described(self, vid: str, header: ManifestHeader) -> Version:
        """One version as ``log`` describes it: its refs, and where its data is durable (see ``log``)."""
        p = self._plumbing
        pruned, evicted, held = version_durability(p, header)
        return version_from_manifest(header, p.ref_names().get(vid, ()), pruned, evicted, held)

    def resolve(self, rev: str) -> str:
        """The full id of the version ``rev`` names (see ckptrepo.core._revisions for the syntax)."""
        return self._plumbing.resolve(check_rev(rev))

    # ---- snapshot -------------------------------------------------------
    def snapshot(self, state: Any, step: int | None = None, message: str = "",
                 metrics: dict[str, Any] | None = None, parallel_layout: "ParallelLayout | None" = None, *,
                 tag: str | None = None, force_tag: bool = False, meta: dict[str, str] | None = None) -> Version:
        """Save ``state`` as a new version on the current branch and return it.

        ``tag`` names the new version (``force_tag`` moves an existing tag of that name to it); ``meta`` records
        text key/values in its header (``Version.meta``).

        Synchronous: returns once the version is durable and the branch points
        at it (the same pipeline as :meth:`snapshotter`, waited on). Raises
        DetachedHeadError on a detached HEAD and ConflictError if another writer
        moved the branch meanwhile (then nothing is committed).
        """
        from ckptrepo.saving import Snapshotter
        _layout(parallel_layout)
        with Snapshotter(self._plumbing, host_memory=self.host_memory, record_failures=False,
                         parallel_layout=parallel_layout) as snap:   # dedup compares with the parent version
            handle = snap.snapshot(state, step=step, message=message, metrics=metrics, tag=tag, force_tag=force_tag,
                                   meta=meta)
            try:
                version = handle.result()
            except SnapshotFailedError as err:
                raise (err.__cause__ if isinstance(err.__cause__, CkptRepoError) else err) from None
        # closed: a tag that could not be set was raised there; the version as log lists it, with that tag
        return self.version(version.id) if tag is not None else version

    def snapshotter(self, host_memory: int | str | None = None, pin_memory: bool | None = None,
                    parallel_layout: "ParallelLayout | None" = None, group: Any = None,
                    commit_timeout_s: float = 600.0, dedup: bool = True,
                    retention: "RetentionPolicy | None" = None, max_in_flight: int = 4,
                    push_to: str | None = None, local_keep_last: int | None = None,
                    local_max_bytes: int | str | None = None, on_full: str = "wait",
                    single_process: bool = False, tensor_stats: bool = True,
                    compression: str | bool | None = None,
                    options: "SnapshotterOptions | None" = None) -> "Snapshotter":
        """An asynchronous snapshot hook for the training loop; see :class:`ckptrepo.saving._capture.Snapshotter`.

        ``host_memory`` bounds the staging pool ("8GiB"; default: ``repo.host_memory``
        if set, else a quarter of the available memory, at most 8 GiB). Under
        torch.distributed every rank makes its snapshotter and the same ``snapshot`` calls, in the same order; the
        layout's rules (or the DTensors' placements) name what each rank holds. The ranks coordinate through the
        default process group's key-value store (``group`` is accepted and not needed); ``commit_timeout_s`` is
        the deadline of every wait between them. With ``push_to``, each node may have a repository of its own
        on its local disk in front of one remote (README, "Running on a cluster").
        ``dedup``: a tensor whose bytes are unchanged since the parent version (whoever
        wrote it) is not written again; its piece points at the stored bytes.
        ``retention``: a :class:`ckptrepo.RetentionPolicy` applied in the
        background after commits (what ``repo.gc(...)`` does by hand).
        ``max_in_flight``: snapshots not yet committed, at most; one more waits in ``snapshot()`` for the oldest.
        ``push_to``: a remote's name; each version is committed here, then pushed there in the background (a
        local tier). ``local_keep_last``: once pushed, only the newest N versions keep their data here (older
        ones load from the remote). ``local_max_bytes`` ("20GiB"; default: half the free disk) bounds the data
        here not pushed yet; a snapshot that would pass it waits (``on_full="wait"``) or is skipped
        (``"skip"``), with a ``BackpressureWarning``. ``single_process``: this process holds the whole state and
        snapshots it alone, whatever torch.distributed says (a framework that saves on rank 0 only under DDP).
        ``tensor_stats``: record each tensor's statistics while capturing (norm, mean, std, min, max, absmax,
        NaN and Inf counts), which ``trajectory``, ``stats``, ``bisect`` and the web page read instead of the
        data; False saves the capture thread that pass over the bytes.
        ``compression``: "zstd" or "none" (False) for this snapshotter's versions; None follows the repository's
        setting (``ckptrepo.init(url, compression=...)``).
        ``options``: all of the above as one :class:`ckptrepo.SnapshotterOptions` (the local tier's four as a
        :class:`ckptrepo.LocalTier`), in place of the keywords: a value to build once and pass to several
        snapshotters, checked when it is made.
        """
        from ckptrepo.saving import Snapshotter, SnapshotterOptions
        keywords = dict(host_memory=host_memory or None, pin_memory=pin_memory, parallel_layout=parallel_layout,
                        group=group, commit_timeout_s=commit_timeout_s, dedup=dedup, retention=retention,
                        max_in_flight=max_in_flight, push_to=push_to, local_keep_last=local_keep_last,
                        local_max_bytes=local_max_bytes, on_full=on_full, single_process=single_process,
                        tensor_stats=tensor_stats, compression=compression)
        options = SnapshotterOptions.given(options, keywords)
        if options.host_memory is None and self.host_memory:   # the repository's bound, unless the options name one
            options = replace(options, host_memory=self.host_memory)
        return Snapshotter(self._plumbing, options)

    # ---- load -----------------------------------------------------------
    def load(self, rev: str = "HEAD", into: Any = None, map_location: Any = None, device: Any = None,
             on_bytes: Callable[[int], None] | None = None, parallel_layout: "ParallelLayout | None" = None,
             rank: int | None = None, read_stats: "ReadStats | None" = None) -> Any:
        """Load version ``rev``: a new state with the saved nesting, or in place ``into`` an existing one.

        Tensors come back on the CPU unless ``map_location``/``device`` says
        otherwise. With ``into``, shapes and dtypes are checked before anything
        is changed; tensors are filled in place and Stateful objects get
        ``load_state_dict``. Only the skeleton's own types are ever built: no pickle.

        ``parallel_layout`` (and ``rank``, default: this process's rank in a process group of the layout's size) loads
        the state one rank of that layout holds, whatever layout saved it,
        reading only the bytes that rank needs (``read_stats`` counts them);
        ``into`` may then hold DTensors, whose placements say what to read. A
        version saved by several ranks loads unsharded when no layout is given.
        """
        import torch

        from ckptrepo.loading import load_version
        check_rev(rev)
        check_into(into)
        _layout(parallel_layout)
        check_callback(on_bytes, "on_bytes")
        target = load_device(device if device is not None else map_location)
        # no_grad: a load builds no graph (filling parameters in place is not a step to differentiate), and a
        # DTensor's to_local() is then its local tensor instead of an autograd Function call (a cost per tensor)
        with collection_paused(), torch.no_grad():
            return load_version(self._plumbing, self.resolve(rev), into, target, on_bytes, parallel_layout, rank,
                                read_stats)

    # ---- history and refs -----------------------------------------------
    def log(self, rev: str = "HEAD", all: bool = False, limit: int | None = None,  # noqa: A002
            since: int | None = None, until: int | None = None) -> list[Version]:
        """Versions reachable from ``rev`` (or from every ref with ``all``, remote-tracking refs included), newest
        first.

        ``since``/``until`` keep only versions whose step lies in that range (inclusive). Each version says
        where it is durable: ``local`` (its data is here: not pruned, not evicted to a remote) and ``remotes``
        (those whose remote-tracking refs reach it, read back only as far as the versions listed).
        """
        check_rev(rev)
        _whole(limit, "limit", 0)
        _whole(since, "since")
        _whole(until, "until")
        if all:
            starts = every_ref_target(self._plumbing)
        elif rev == "HEAD" and self._plumbing.head_version() is None:
            return []
        else:
            starts = [self.resolve(rev)]
        return log_versions(self._plumbing, starts, limit, since, until)

    def checkout(self, rev: str, branch: str | None = None) -> Version:
        """Move HEAD to ``rev``: onto a branch if ``rev`` is one, else detached; ``branch`` creates one there."""
        if branch is not None:
            check_ref_type(branch, "branch")
        return self.version(self._plumbing.refs.checkout(rev, branch, self.resolve))

    def checkout_orphan(self, name: str) -> None:
        """``git checkout --orphan NAME``: put HEAD on a new branch ``name`` that has no versions yet; the next
        snapshot creates it with no parent, a new history beside the others (which stay as they are).

        In a repository that has versions, a snapshot that would start a new root is refused unless HEAD was
        put there this way: a HEAD on a branch that does not exist is otherwise a lost ref or damage.
        """
        self._plumbing.refs.start_orphan(name)

    def branch(self, name: str, rev: str = "HEAD") -> Version:
        """Create branch ``name`` at ``rev`` (HEAD does not move)."""
        vid = self.resolve(rev)
        check_ref_type(name, "branch")
        self._plumbing.refs.create_branch(name, vid)
        return self.version(vid)

    def tag(self, name: str, rev: str = "HEAD", force: bool = False) -> Version:
        """Create tag ``name`` at ``rev``. A tag does not move by itself; ``force`` moves an existing one to
        ``rev`` (``git tag -f``), as a framework re-using one file name (``last.ckpt``) needs."""
        vid = self.resolve(rev)
        check_ref_type(name, "tag")
        _flag(force, "force")
        self._plumbing.refs.set_tag(name, vid, force=force)
        return self.version(vid)

    def prune(self, rev: str) -> int:
        """Delete the data of one version now, as gc's retention prunes it: its header stays in ``log`` (marked
        pruned), arrays other versions still use stay, and a load of it then says it was pruned. Refused for a
        version a tag, a branch tip, HEAD or a remote-tracking ref names (untag it first). Returns the bytes
        freed. What a framework's "delete this checkpoint" maps to, where the version sits inside a history."""
        from ckptrepo.maintenance import prune_version
        return prune_version(self._plumbing, self.resolve(rev))

    def delete_branch(self, name: str, force: bool = False) -> str:
        """Delete branch ``name`` (``git branch -d``); returns the version it pointed at.

        Refused for the branch HEAD is on, and, unless ``force``, when its tip is reachable from no other
        branch, tag or a detached HEAD: its versions would then be left to gc. The versions themselves stay
        until gc finds them unreferenced (and older than its grace period).
        """
        check_ref_type(name, "branch")
        return self._plumbing.refs.delete_branch(name, force, lambda v: self._plumbing.header(v).parents)

    def delete_tag(self, name: str) -> str:
        """Delete tag ``name`` (``git tag -d``); returns the version it pointed at, which gc may then collect."""
        return self._plumbing.refs.delete("tag", check_ref_type(name, "tag"))

    def branches(self) -> dict[str, str]:
        """Branch name -> version id; a damaged branch ref is left out (``damaged_refs`` says what is wrong)."""
        return self._plumbing.refs.branches(strict=False)

    def tags(self) -> dict[str, str]:
        """Tag name -> version id; a damaged tag ref is left out (``damaged_refs`` says what is wrong)."""
        return self._plumbing.refs.tags(strict=False)

    def damaged_refs(self, kind: str | None = None) -> list[str]:
        """One line per damaged ref of ``kind`` ("branch", "tag"; None: both), saying what to do (as git warns
        "ignoring broken ref")."""
        return self._plumbing.refs.damaged(kind)

    def current_branch(self) -> str | None:
        """The branch HEAD is on, or None when detached."""
        return self._plumbing.refs.head().branch

    # ---- inspection -----------------------------------------------------
    def show(self, rev: str = "HEAD") -> VersionDetails:
        """The version's header, tensors (name, dtype, shape, bytes) and plain values."""
        vid = self.resolve(rev)
        m = self._plumbing.manifest(vid)
        tensors = [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.numel * itemsize(t.dtype)}
                   for t in m.tensors]
        saved = {} if m.layout is None else m.layout.to_raw()
        layout = {k: v for k, v in saved.items() if k not in ("ranks", "rules")}  # summary only
        return VersionDetails(self._described(vid, self._plumbing.header(vid)), layout,
                              tensors, [(p, short_text(v, 80)) for p, v in plain_values(m.tree, summarize_after=8)])

    def diff(self, a: str, b: str | None = None, pattern: str | None = None,
             on_bytes: Callable[[int], None] | None = None, include_nonfloat: bool = False) -> VersionDiff:
        """Per tensor: changed or not, ||B-A||, ||B-A||/||A||, max |B-A|, cosine; objects: what changed.
        Without ``b``, version ``a`` against its first parent (as ``git show`` does): the parent is A then.
        Non-float tensors and step counters (RNG states, integer buffers) are listed changed or unchanged
        with their numbers NaN, unless ``include_nonfloat`` (see ckptrepo.tools._numeric).

        Only the tensors ``pattern`` matches are read, on every core, in bounded memory; see
        ckptrepo.tools._inspect.
        """
        from ckptrepo.tools import diff_versions
        check_rev(a)
        if b is None:
            v = self.version(a)
            if not v.parents:
                raise RevisionError(f"{a!r} ({v.short_id}) is a root version, with no parent to compare with; "
                                    f"name two revisions: ckptrepo diff A B")
            a, b = v.parents[0], v.id
        check_rev(b)
        check_pattern(pattern)
        check_callback(on_bytes, "on_bytes")
        _flag(include_nonfloat, "include_nonfloat")
        return diff_versions(self._plumbing, a, b, pattern, on_bytes, include_nonfloat)

    def stats(self, rev: str = "HEAD", pattern: str | None = None,
              on_bytes: Callable[[int], None] | None = None) -> list[TensorStats]:
        """Per tensor: norm, mean, std, min, max, absmax, NaN and Inf counts.

        Answered from the statistics the version recorded at capture, without reading its data; a version
        written without them is read (streamed)."""
        from ckptrepo.tools import recorded_tensor_stats
        check_rev(rev)
        check_pattern(pattern)
        check_callback(on_bytes, "on_bytes")
        vid = self._plumbing.resolve(rev)
        recorded = recorded_tensor_stats(self._plumbing, vid, pattern)
        if recorded is not None:
            return recorded
        from ckptrepo.tools import tensor_stats
        return tensor_stats(self._plumbing, vid, pattern, on_bytes)

    def trajectory(self, pattern: str, metric: str = "norm", rev: str = "HEAD", since: int | None = None,
                   until: int | None = None, include_nonfloat: bool = False) -> list[TrajectoryPoint]:
        """A statistic (``METRICS`` of tools/_trajectory.py: norm, mean, std, min, max, absmax, nan, inf, delta,
        relative-change) of tensors matching ``pattern`` over the first-parent history of ``rev``, oldest first;
        non-float tensors and step counters only with ``include_nonfloat``."""
        from ckptrepo.tools import trajectory
        check_pattern(pattern, required=True)
        check_rev(rev)
        _whole(since, "since")
        _whole(until, "until")
        _flag(include_nonfloat, "include_nonfloat")
        return trajectory(self._plumbing, pattern, metric, rev, since, until, include_nonfloat)

    def stat_matrix(self, pattern: str | None = None, stat: str = "norm", rev: str = "HEAD",
                    since: int | None = None, until: int | None = None,
                    max_versions: int | None = None, include_nonfloat: bool = False) -> StatMatrix:
        """``stat`` of tensors matching ``pattern`` (all: None) over the first-parent history of ``rev``, as a
        tensors x versions matrix; ``max_versions`` samples the history evenly (the newest kept) and reads only
        the sampled versions; non-float tensors and step counters only with ``include_nonfloat``. See
        ckptrepo.tools._trajectory.StatMatrix."""
        from ckptrepo.tools import stat_matrix
        check_pattern(pattern)
        check_rev(rev)
        _whole(since, "since")
        _whole(until, "until")
        _flag(include_nonfloat, "include_nonfloat")
        _whole(max_versions, "max_versions", 1)
        return stat_matrix(self._plumbing, pattern, stat, rev, since, until, max_versions, include_nonfloat)

    def metrics(self, rev: str = "HEAD") -> list[dict[str, Any]]:
        """The recorded metrics (loss, lr, ...) per version along the first-parent history of ``rev``, oldest first."""
        return metric_rows(self._plumbing, self.resolve(rev))

    def metrics_to_tensorboard(self, log_dir: str | os.PathLike[str], rev: str = "HEAD") -> int:
        """Write the metrics and capture statistics along the first-parent history of ``rev`` as TensorBoard scalars
        to the folder ``log_dir``, outside the repository; returns how many. Needs ``ckptrepo[tensorboard]``."""
        from ckptrepo.tools import write_scalars
        check_path(log_dir, "TensorBoard log directory")
        root = self.local_root
        return write_scalars(log_dir, lambda: first_parent_headers(self._plumbing, self.resolve(rev)), root)

    def bisect(self, when: str | None = None, metric: str | None = None, tensor: str | None = None,
               stat: str = "norm", nonfinite: bool = False, rev: str = "HEAD", since: int | None = None,
               until: int | None = None, include_nonfloat: bool = False) -> BisectResult | None:
        """The first version, oldest first along the first-parent history of ``rev`` (steps in [since, until]),
        where a recorded ``metric``, or the statistic ``stat`` of a tensor matching the glob ``tensor``, meets
        the condition ``when`` ("rises above 3.0", "> 100", "changes by more than 50%": see
        ckptrepo.tools._bisect); ``nonfinite``: the first version where a tensor (matching ``tensor``, default
        all) holds a NaN or an Inf. None when no version matches. Tensors are non-float ones and step counters
        too only with ``include_nonfloat``.

        Answered from headers and capture-time statistics by a linear scan, which finds the exact first match
        of any condition; a binary search would need a condition that stays true once true (see _bisect).
        """
        from ckptrepo.tools import bisect
        check_rev(rev)
        check_pattern(tensor)
        _flag(nonfinite, "nonfinite")
        _flag(include_nonfloat, "include_nonfloat")
        _whole(since, "since")
        _whole(until, "until")
        return bisect(self._plumbing, when, metric, tensor, stat, nonfinite, rev, since, until, include_nonfloat)

    def gc(self, keep_last: int | None = None, keep_every: int | None = None, keep_tagged: bool = True,
           keep_branch_heads: bool = True, grace_period_s: float | None = None, dry_run: bool = False,
           keep_best: int | None = None, best_metric: str | None = None, best_mode: str = "min") -> GcReport:
        """Apply retention rules and collect unreachable objects.

        Versions no rule keeps are pruned (data deleted, manifest and history
        kept); objects no ref reaches are deleted once older than the grace
        period (default one hour), so a concurrent writer is never harmed.
        ``keep_best=N, best_metric="loss", best_mode="min"`` also keeps the N
        versions with the lowest loss (the metrics given to ``snapshot``).
        """
        from ckptrepo.maintenance import DEFAULT_GRACE_S, collect
        return collect(self._plumbing, keep_last, keep_every, keep_tagged, keep_branch_heads,
                       DEFAULT_GRACE_S if grace_period_s is None else grace_period_s, dry_run,
                       keep_best=keep_best, best_metric=best_metric, best_mode=best_mode)

    def fsck(self, on_bytes: Callable[[int], None] | None = None,
             on_total: Callable[[int], None] | None = None) -> FsckReport:
        """Read every object and verify every checksum and reference."""
        from ckptrepo.maintenance import fsck
        check_callback(on_bytes, "on_bytes")
        check_callback(on_total, "on_total")
        return fsck(self._plumbing, on_bytes=on_bytes, on_total=on_total)

    def failures(self) -> list[dict[str, Any]]:
        """Records of background snapshots that failed (id, step, time, branch, message, error), newest first."""
        return self._plumbing.failures()

    def capture_stats(self, rev: str = "HEAD") -> dict[str, Any]:
        """The capture statistics recorded with a version (blocking, capture, flush, total seconds; bytes; GB/s)."""
        return dict(self._plumbing.manifest(self.resolve(rev)).stats or {})

    def du(self) -> DiskUsage:
        """Per reachable version (newest first) the bytes only it references and those it shares, and the total
        stored with each array counted once."""
        from ckptrepo.maintenance import disk_usage
        return disk_usage(self._plumbing, self.log(all=True))

    def export(self, rev: str, out: str | os.PathLike[str], format: str = "torch",  # noqa: A002
               force: bool = False, max_shard_size: int | str | None = None) -> Version:
        """Write the full, unsharded state of ``rev`` as ``format`` (torch, safetensors, dcp or hf) to ``out``
        (outside the repository; an existing export there is replaced only with ``force``). ``hf``: the model
        under the state's ``model`` as an HF model folder, in files of at most ``max_shard_size`` ("5GB")."""
        from ckptrepo.tools import export_target, write_export
        check_path(out, "export's output")
        # refused before the version is resolved and loaded
        path = export_target(out, format, force=force, repo_root=self.local_root,
                             max_shard_size=max_shard_size)
        vid = self.resolve(rev)
        write_export(self.load(vid), vid, path, format, max_shard_size)
        return self.version(vid)

    def import_state(self, path: str | os.PathLike[str], trust: bool = False, step: int | None = None,
                     message: str | None = None) -> Version:
        """Commit a torch.save file, DCP checkpoint, safetensors export or HF model folder (its weights under
        ``model``, its config.json under ``hf_config``) as a new version on the current branch.

        Pickles (torch files that need more than the restricted unpickler, DCP
        metadata) can run code, so they are refused unless ``trust`` is set.
        """
        from ckptrepo.tools import read_checkpoint, state_step
        check_path(path, "checkpoint to import")
        state, source = read_checkpoint(path, trust)
        step = state_step(state) if step is None else step   # the step the state holds, unless told otherwise
        return self.snapshot(state, step=step, message=f"imported from {source}" if message is None else message)

    # ---- remotes ----------------------------------------------------------
    def remote_add(self, name: str, url: str | os.PathLike[str]) -> None:
        """Record remote ``name`` at ``url`` (any repository URL), as ``git remote add``; nothing is contacted."""
        check_remote_name(name)
        url = repo_url(url)
        if not self._plumbing.config.get(REPOSITORY_ID):   # made before repositories had one: give it one now
            self._plumbing.config = update_config(self._plumbing.store, {REPOSITORY_ID: uuid.uuid4().hex})
        add_remote(self._plumbing.store, name, url)

    def remote_remove(self, name: str) -> None:
        """Forget remote ``name`` and its remote-tracking refs (``git remote remove``)."""
        remove_remote(self._plumbing.store, check_remote_name(name))

    def remotes(self) -> dict[str, str]:
        """Remote name -> URL."""
        return remotes(self._plumbing.store)

    def push(self, remote: str = "origin", branches: list[str] | None = None, tags: list[str] | None = None,
             progress: "Progress | None" = None) -> "SyncResult":
        """Copy what ``branches`` (default: the current one) and ``tags`` reach to ``remote`` and move its refs
        there, as a fast-forward only (PushRejectedError otherwise: fetch first). See ckptrepo.remotes._sync."""
        from ckptrepo.remotes import push
        return push(self._plumbing, check_remote_name(remote), branches, tags or (), progress)

    def evict(self, remote: str = "origin", keep_last: int = 1, branch: str | None = None) -> "EvictReport":
        """Delete here the tensor data of ``branch``'s versions (default: the current one) beyond its newest
        ``keep_last`` that ``remote`` holds (as pushed or fetched); they still load, diff and fsck, reading from
        the remote. Never a version the remote lacks, nor an array a kept version points into (dedup)."""
        from ckptrepo.remotes import evict
        if branch is not None:
            check_ref_type(branch, "branch")
        return evict(self._plumbing, check_remote_name(remote), keep_last, branch)

    def fetch(self, remote: str = "origin", lazy: bool = False, progress: "Progress | None" = None) -> "SyncResult":
        """Copy the versions ``remote``'s branches and tags reach that are not here (``lazy``: manifests only,
        tensor data read from the remote when loaded), and record where its branches are (``REMOTE/BRANCH``)."""
        from ckptrepo.remotes import fetch
        return fetch(self._plumbing, check_remote_name(remote), lazy=lazy, progress=progress)

    def pull(self, remote: str = "origin", lazy: bool = False, progress: "Progress | None" = None) -> "SyncResult":
        """Fetch ``remote``, then fast-forward the current branch to its branch of the same name."""
        from ckptrepo.remotes import pull
        return pull(self._plumbing, check_remote_name(remote), lazy=lazy, progress=progress)

    # --- porcelain for the CLI (issue 40) ---
    # What the command line asks of a repository beyond the commands above, so that it never reaches into
    # ``plumbing`` (not a stable API) nor into a subpackage's private modules.
    @property
    def local_root(self) -> str | None:
        """The folder of a local repository, None for an object store: no output file may go inside it (it
        could replace HEAD or a ref)."""
        return self._plumbing.store.capabilities.local_root

    def head_version(self) -> str | None:
        """HEAD's version id; None on a branch without versions (a new repository, an orphan checkout)."""
        return self._plumbing.head_version()

    def version_count(self) -> int:
        """The number of version manifests in storage, reachable or not."""
        return len(self._plumbing.all_version_ids())

    def status(self) -> "RepoStatus":
        """Where HEAD is, the snapshots in flight or abandoned, and the failed ones (``ckptrepo status``);
        damage to HEAD is reported in it, not raised."""
        from ckptrepo.tools import repo_status
        return repo_status(self._plumbing)

    def revision_names(self, incomplete: str = "") -> list[str]:
        """What a revision starting with ``incomplete`` may be (shell completion): HEAD, branches, tags, and
        short ids once ``incomplete`` is a hex prefix long enough to name one."""
        from ckptrepo.tools import revision_names
        return revision_names(self._plumbing, incomplete)

    def tracking_refs(self) -> dict[str, str]:
        """Remote-tracking refs (``origin/main``) -> the version each records, as the last fetch or push left
        them; a damaged one is left out."""
        return tracking_refs(self._plumbing.store)

    def repair_lost(self) -> list[str]:
        """Mark the versions whose manifest a gc collected while a ref came to name them lost, tag what may
        have preceded each and move a branch that names one back (``fsck --repair``); deletes nothing.
        One line per thing done; running it again does nothing more."""
        from ckptrepo.maintenance import repair_lost
        return repair_lost(self._plumbing)

    @staticmethod
    def repair_config(url: str | os.PathLike[str]) -> list[str]:
        """Rebuild a damaged or missing ``ckptrepo.json`` of the repository at ``url`` from what it holds
        (``fsck --repair-config``), one line per thing done; done on the store, as a repository whose config
        is damaged cannot be opened. An intact config is left as it is."""
        from ckptrepo.core import repair_config
        return repair_config(open_store(repo_url(url)))
    # --- end porcelain for the CLI ---


__all__ = ["DEFAULT_BRANCH", "Repository", "VersionDetails", "clone", "init", "load", "open"]
