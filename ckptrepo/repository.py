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

import heapq
import os
import time
import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

from ckptrepo.core._gcpause import collection_paused
from ckptrepo.core._manifest import (
    COMPRESSION_SETTING,
    CONFIG_KEY,
    CONFIG_MAX_BYTES,
    HEADS_PREFIX,
    Version,
    encode_config,
    update_config,
)
from ckptrepo.core._manifest_reads import HEADER_BATCH, HeaderWalk, find_cycle, parent_cycle_error
from ckptrepo.core._plumbing import Plumbing
from ckptrepo.core._refs import init_head
from ckptrepo.core._remotes import (
    add_remote,
    check_remote_name,
    evicted_ids,
    remotes,
    remove_remote,
    tracking_refs,
)
from ckptrepo.core._whereabouts import durability, require_data_somewhere, version_durability
from ckptrepo.core.schema import Manifest, ManifestHeader, version_from_manifest
from ckptrepo.errors import (
    ArgumentError,
    CkptRepoError,
    CorruptionError,
    ExchangeError,
    LayoutError,
    RefError,
    RepositoryExistsError,
    RevisionError,
    SnapshotFailedError,
    StateMismatchError,
    StorageError,
    first_line,
)
from ckptrepo.maintenance._lost import header_unless_lost
from ckptrepo.remotes._remote import REPOSITORY_ID
from ckptrepo.state._skeleton import plain_values, short_text
from ckptrepo.storage import Store, open_store
from ckptrepo.storage._arrays import check_compression, itemsize

if TYPE_CHECKING:
    import torch

    from ckptrepo.loading._engine import ReadStats
    from ckptrepo.maintenance._fsck import FsckReport
    from ckptrepo.maintenance._gc import GcReport, RetentionPolicy
    from ckptrepo.maintenance._usage import DiskUsage
    from ckptrepo.parallel.layout import ParallelLayout
    from ckptrepo.remotes._evict import EvictReport
    from ckptrepo.remotes._sync import SyncResult
    from ckptrepo.remotes._transfer import Progress
    from ckptrepo.saving._capture import Snapshotter
    from ckptrepo.saving._options import SnapshotterOptions
    from ckptrepo.tools._bisect import BisectResult
    from ckptrepo.tools._inspect import VersionDiff
    from ckptrepo.tools._recorded import TensorStats
    from ckptrepo.tools._status import RepoStatus
    from ckptrepo.tools._trajectory import StatMatrix, TrajectoryPoint

DEFAULT_BRANCH = "main"


# ---- argument checks of the public API ----------------------------------------------------------------------
# Each names the argument and what it takes, with ckptrepo's own exception, before anything is read or
# written: a wrong type would otherwise surface as an AttributeError deep inside (``5.strip()``), or, for
# ``into=5``, be ignored without a word.

def _shown(value: Any) -> str:
    return f"{type(value).__name__} {short_text(value, 40)}"


def repo_url(url: Any) -> str:
    """A repository's path or URL as text: a ``str``, or an ``os.PathLike`` such as ``pathlib.Path``."""
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str):
        raise ArgumentError(f"a repository is a path or URL (a str or pathlib.Path), not {_shown(url)}")
    return url


def _rev(rev: Any) -> str:
    if not isinstance(rev, str):
        raise RevisionError(f"a revision is text (HEAD, a branch, a tag, an id, @STEP or REV~N), not {_shown(rev)}")
    return rev


def _ref_name(name: Any, kind: str) -> str:
    if not isinstance(name, str):
        raise RefError(f"a {kind} name is text, not {_shown(name)}")
    return name


def _whole(value: Any, name: str, least: int | None = None) -> None:
    """``value`` must be None or an int (not a bool), at least ``least`` when given."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or (least is not None and value < least)):
        bound = "" if least is None else f" of at least {least}"
        raise ArgumentError(f"{name} must be a whole number{bound} or None, not {_shown(value)}")


def _flag(value: Any, name: str) -> None:
    if not isinstance(value, bool):
        raise ArgumentError(f"{name} must be True or False, not {_shown(value)}")


def _pattern(pattern: Any, required: bool = False) -> None:
    if not isinstance(pattern, str) and (required or pattern is not None):
        raise ArgumentError(f"a tensor name pattern is text (a glob such as 'model/*'), not {_shown(pattern)}")


def _callback(fn: Any, name: str) -> None:
    if fn is not None and not callable(fn):
        raise ArgumentError(f"{name} must be a function or None, not {_shown(fn)}")


def _layout(layout: Any) -> None:
    from ckptrepo.parallel.layout import ParallelLayout
    if layout is not None and not isinstance(layout, ParallelLayout):
        raise LayoutError(f"parallel_layout must be a ckptrepo.ParallelLayout or None, not {_shown(layout)}")


def _into(into: Any) -> None:
    """``load(into=...)`` takes the state to fill in place; a value that cannot hold one is refused, where it was
    ignored (the load returned a new state and the caller's was left as it was)."""
    import numpy as np
    import torch

    from ckptrepo.state._providers import is_stateful
    if into is None or isinstance(into, (dict, list, tuple, torch.Tensor, np.ndarray, np.random.Generator)) \
            or is_stateful(into):
        return
    raise StateMismatchError(f"into= takes the state to fill in place (a dict, list, module, optimizer or tensor), "
                             f"not {_shown(into)}; leave it out to get a new state")


def _path(path: Any, what: str) -> None:
    if not isinstance(path, (str, os.PathLike)):
        raise ExchangeError(f"the {what} is a path (a str or pathlib.Path), not {_shown(path)}")


def init(url: str | os.PathLike[str], exist_ok: bool = False, options: dict[str, Any] | None = None,
         compression: str | bool | None = None) -> "Repository":
    """Create a repository at ``url`` (a path, file://, memory://, s3:// or gs:// URL) and open it.

    ``compression="zstd"`` stores the tensors of its versions compressed losslessly (zarr's blosc codec: zstd
    after a byte shuffle), which pays where storage is slower than compressing (a remote store), not on a
    local NVMe disk; a snapshotter may override it (``repo.snapshotter(compression=...)``). With
    ``exist_ok``, a compression named here becomes the existing repository's setting for later snapshots.
    """
    chosen = check_compression(compression)
    url = repo_url(url)
    store = open_store(url, options, create=True)
    settings: dict[str, Any] = {"created": time.time(), "default_branch": DEFAULT_BRANCH,
                                REPOSITORY_ID: uuid.uuid4().hex}
    if chosen is not None:
        settings[COMPRESSION_SETTING] = chosen
    if not store.put_if_absent(CONFIG_KEY, encode_config(settings)):
        if store.get(CONFIG_KEY, CONFIG_MAX_BYTES) is None:
            # nothing there and nothing written: TensorStore's S3 driver answers a conditional write into a
            # bucket that does not exist as a failed condition; listing says why (NoSuchBucket, ...)
            try:
                store.list()
                reason = "the store did not take the write"
            except StorageError as err:
                reason = str(err)
            raise StorageError(f"could not create a repository at {url} ({reason}); check that the bucket exists "
                               f"and is writable")
        if not exist_ok:
            raise RepositoryExistsError(f"a repository already exists at {url}; open it with ckptrepo.open, "
                                        f"or pass exist_ok=True")
        init_head(store, DEFAULT_BRANCH)   # only if absent: an init killed before it wrote HEAD is finished
        if compression is not None:
            update_config(store, {COMPRESSION_SETTING: chosen})
        return Repository(store)
    init_head(store, DEFAULT_BRANCH)
    return Repository(store)


def clone(url: str | os.PathLike[str], directory: str | os.PathLike[str], depth: int | None = None,
          lazy: bool = False, remote: str = "origin", progress: "Progress | None" = None) -> "Repository":
    """Clone the repository at ``url`` into ``directory`` (a new repository there, with ``url`` as ``remote``),
    its HEAD on the remote HEAD's branch. ``lazy``: manifests and refs only, tensor bytes read from the remote
    on demand (only the ranges a load needs); ``depth``: data copied for the newest ``depth`` versions of each
    branch, the rest read lazily. Every version loads either way. A damaged source is refused before anything
    is written; a clone killed midway is finished by the same call again (ckptrepo/remotes/_clone.py)."""
    from ckptrepo.remotes._clone import clone as clone_into
    if depth is not None:
        _whole(depth, "depth", least=1)
    local = clone_into(repo_url(url), repo_url(directory), DEFAULT_BRANCH, depth=depth, lazy=lazy, remote=remote,
                       progress=progress)
    return Repository(local.store)


def open(url: str | os.PathLike[str], options: dict[str, Any] | None = None  # noqa: A001 - the public API
         ) -> "Repository":
    """Open the repository at ``url`` (a path, ``pathlib.Path`` or URL); NotARepositoryError when there is none."""
    return Repository(open_store(repo_url(url), options))


def load_device(spec: Any) -> "torch.device | None":
    """The device a load puts fresh tensors on (``None``: where they are read, the CPU), checked before any read.

    Why here: torch only complains at the first ``.to()``, after the reads, and on a CPU-only build
    with an ``AssertionError`` ("Torch not compiled with CUDA enabled").
    """
    if spec is None:
        return None
    import torch
    try:
        dev = torch.device(spec)
    except (TypeError, RuntimeError, ValueError):
        raise ArgumentError(f"device {spec!r} is not a device; pass 'cpu', 'cuda', 'cuda:1' or a torch.device "
                         f"(a map_location dict or function is not supported)") from None
    try:
        torch.empty(0, device=dev)
    except (AssertionError, RuntimeError) as e:
        raise ArgumentError(f"cannot load onto device {str(dev)!r} in this process ({first_line(e)}); "
                         f"load with device='cpu' or pick an available device") from None
    return dev


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
        vid = p.resolve(_rev(rev))
        return self._described(vid, p.header(vid))

    def _described(self, vid: str, header: ManifestHeader) -> Version:
        """One version as ``log`` describes it: its refs, and where its data is durable (see ``log``)."""
        p = self._plumbing
        pruned, evicted, held = version_durability(p, header)
        return version_from_manifest(header, p.ref_names().get(vid, ()), pruned, evicted, held)

    def resolve(self, rev: str) -> str:
        """The full id of the version ``rev`` names (see ckptrepo.core._revisions for the syntax)."""
        return self._plumbing.resolve(_rev(rev))

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
        from ckptrepo.saving._capture import Snapshotter
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
        torch.distributed every rank makes the same ``snapshot`` calls; the
        layout's rules (or the DTensors' placements) name what each rank holds.
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
        from ckptrepo.saving._capture import Snapshotter
        from ckptrepo.saving._options import SnapshotterOptions
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
        _rev(rev)
        _into(into)
        _layout(parallel_layout)
        _callback(on_bytes, "on_bytes")
        target = load_device(device if device is not None else map_location)
        # no_grad: a load builds no graph (filling parameters in place is not a step to differentiate), and a
        # DTensor's to_local() is then its local tensor instead of an autograd Function call (a cost per tensor)
        with collection_paused(), torch.no_grad():
            return self._load(rev, into, target, on_bytes, parallel_layout, rank, read_stats)

    def _load(self, rev: str, into: Any, target_device: "torch.device | None", on_bytes: Callable[[int], None] | None,
              parallel_layout: "ParallelLayout | None", rank: int | None, read_stats: "ReadStats | None") -> Any:
        vid = self.resolve(rev)
        m = self._plumbing.manifest(vid)
        self._plumbing.require_data(vid, m)
        try:
            return self._load_data(vid, m, into, target_device, on_bytes, parallel_layout, rank, read_stats)
        except CorruptionError:
            # pruned by a gc while it was read, here or on the remote: say so, not "corrupt; run fsck"
            require_data_somewhere(self._plumbing, vid, m)
            raise

    def _load_data(self, vid: str, m: Manifest, into: Any, target_device: "torch.device | None",
                   on_bytes: Callable[[int], None] | None, parallel_layout: "ParallelLayout | None",
                   rank: int | None, read_stats: "ReadStats | None") -> Any:
        from ckptrepo.loading._binding import Binder
        from ckptrepo.loading._device_load import ndarray_leaves, read_tensors_to
        from ckptrepo.loading._layout_load import load_layout, needs_layout_load
        from ckptrepo.state._providers import malformed_skeleton, unflatten
        store = self._plumbing.data_store(m)
        if needs_layout_load(m, parallel_layout, into):
            return load_layout(store, m, parallel_layout, rank, into, target_device, read_stats)
        entries = list(m.tensors)
        arrays = m.arrays
        fresh: dict[int, torch.Tensor] = {}

        def get_tensor(i: int, as_numpy: bool) -> Any:
            t = fresh[i]
            if as_numpy:
                return t.numpy()
            return t.to(target_device) if target_device is not None else t

        def build(node: Any) -> Any:
            return unflatten(node, get_tensor)

        if into is None:
            # onto a GPU: read through pinned buffers and copied as read (loading/_device_load.py)
            fresh.update(read_tensors_to(store, arrays, entries, list(range(len(entries))), device=target_device,
                                         on_host=ndarray_leaves(m.tree), on_bytes=on_bytes))
            return unflatten(m.tree, get_tensor)
        binder = Binder(entries, build, vid)
        with malformed_skeleton():
            finalize = binder.bind(m.tree, into)
        wanted = list(range(len(entries)))
        got = read_tensors_to(store, arrays, entries, wanted, into=binder.destinations, on_bytes=on_bytes)
        fresh.update({i: t for i, t in got.items() if i not in binder.destinations})
        return finalize()

    # ---- history and refs -----------------------------------------------
    def log(self, rev: str = "HEAD", all: bool = False, limit: int | None = None,  # noqa: A002
            since: int | None = None, until: int | None = None) -> list[Version]:
        """Versions reachable from ``rev`` (or from every ref with ``all``, remote-tracking refs included), newest
        first.

        ``since``/``until`` keep only versions whose step lies in that range (inclusive). Each version says
        where it is durable: ``local`` (its data is here: not pruned, not evicted to a remote) and ``remotes``
        (those whose remote-tracking refs reach it, read back only as far as the versions listed).
        """
        _rev(rev)
        _whole(limit, "limit", 0)
        _whole(since, "since")
        _whole(until, "until")
        starts: list[str] = []
        if all:
            # a damaged ref is left out, as git's "ignoring broken ref" (fsck names it; gc stops at it)
            refs = self._plumbing.refs
            starts = list(refs.branches(strict=False).values()) + list(refs.tags(strict=False).values())
            starts += tracking_refs(self._plumbing.store).values()   # as git's --all: origin/main too
            head = self._plumbing.head_version()
            if head:
                starts.append(head)
        else:
            if rev == "HEAD" and self._plumbing.head_version() is None:
                return []
            starts = [self.resolve(rev)]
        # newest first, as git does: pop the newest version reached so far, then reach its parents; a
        # version is never newer than its children, so the walk stops once `limit` versions are listed
        seen: set[str] = set()
        frontier: list[tuple[float, str, ManifestHeader]] = []
        found: list[ManifestHeader] = []
        expanded: dict[str, tuple[str, ...]] = {}   # the versions whose parents the walk reached: checked for a cycle
        # a long log reads its headers in batches from the start; a short one (`log -n 5`) never lists versions/
        walk = HeaderWalk(self._plumbing.reads, batch=limit is None or limit > HEADER_BATCH)

        def reach(vid: str) -> None:
            if vid not in seen:
                seen.add(vid)
                h = header_unless_lost(walk, self._plumbing, vid)   # None: fsck --repair marked it lost
                if h is not None:
                    heapq.heappush(frontier, (-h.time, vid, h))
        for vid in starts:
            if vid:
                reach(vid)
        while frontier and (limit is None or len(found) < limit):
            _, popped, h = heapq.heappop(frontier)
            step = h.step
            if (since is None and until is None) or (step is not None and (since is None or step >= since)
                                                     and (until is None or step <= until)):
                found.append(h)
                if limit is not None and len(found) >= limit:
                    break   # its parents are not listed: do not read them
            expanded[popped] = h.parents
            for p in h.parents:
                reach(p)
        # the `seen` set stops a walk that goes round, which would then list a damaged history as if whole
        cycle = find_cycle(expanded)
        if cycle is not None:
            raise parent_cycle_error(cycle)
        names = self._plumbing.ref_names()
        evicted = evicted_ids(self._plumbing.store) if found else set()
        pruned, held = durability(self._plumbing, found, walk, self._plumbing.pruned_ids(), evicted)
        return [version_from_manifest(h, names.get(h.id, ()), h.id in pruned, h.id in evicted, held.get(h.id, ()))
                for h in found]

    def checkout(self, rev: str, branch: str | None = None) -> Version:
        """Move HEAD to ``rev``: onto a branch if ``rev`` is one, else detached; ``branch`` creates one there."""
        if branch is not None:
            _ref_name(branch, "branch")
        refs = self._plumbing.refs
        head = refs.head(for_update=True)
        vid = self.resolve(rev)
        rev = rev.strip()   # as resolve() reads it: " main" resolved to main's tip, then detached there
        if branch is not None:
            refs.create_branch(branch, vid)
            refs.set_head(branch, None, head.generation)
        elif rev == "HEAD" and head.branch is not None:
            pass   # already there, on its branch: git's `checkout HEAD` is a no-op, not a detach
        elif refs.branch_tip(rev) is not None:
            refs.set_head(rev, None, head.generation)
        else:
            refs.set_head(None, vid, head.generation)
        return self.version(vid)

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
        _ref_name(name, "branch")
        self._plumbing.refs.create_branch(name, vid)
        return self.version(vid)

    def tag(self, name: str, rev: str = "HEAD", force: bool = False) -> Version:
        """Create tag ``name`` at ``rev``. A tag does not move by itself; ``force`` moves an existing one to
        ``rev`` (``git tag -f``), as a framework re-using one file name (``last.ckpt``) needs."""
        vid = self.resolve(rev)
        _ref_name(name, "tag")
        _flag(force, "force")
        self._plumbing.refs.set_tag(name, vid, force=force)
        return self.version(vid)

    def prune(self, rev: str) -> int:
        """Delete the data of one version now, as gc's retention prunes it: its header stays in ``log`` (marked
        pruned), arrays other versions still use stay, and a load of it then says it was pruned. Refused for a
        version a tag, a branch tip, HEAD or a remote-tracking ref names (untag it first). Returns the bytes
        freed. What a framework's "delete this checkpoint" maps to, where the version sits inside a history."""
        from ckptrepo.maintenance._gc import prune_version
        return prune_version(self._plumbing, self.resolve(rev))

    def delete_branch(self, name: str, force: bool = False) -> str:
        """Delete branch ``name`` (``git branch -d``); returns the version it pointed at.

        Refused for the branch HEAD is on, and, unless ``force``, when its tip is reachable from no other
        branch, tag or a detached HEAD: its versions would then be left to gc. The versions themselves stay
        until gc finds them unreferenced (and older than its grace period).
        """
        from ckptrepo.maintenance._gc import reaches
        _ref_name(name, "branch")
        refs, store = self._plumbing.refs, self._plumbing.store
        head = refs.head()
        if head.branch == name:
            raise RefError(f"branch {name!r} is checked out; check out another branch or version first")
        try:
            tip, gen = refs.branch_tip_with_generation(name)   # deleted only if still there after the check
        except CorruptionError:
            if not force:
                raise
            tip, gen = "", store.get_with_generation(HEADS_PREFIX + name)[1]   # damaged: -D is the repair
        if tip and not force:
            others = [v for b, v in refs.branches(strict=False).items() if b != name] + \
                list(refs.tags(strict=False).values())
            if head.version:
                others.append(head.version)
            if not reaches(self._plumbing, others, tip):
                raise RefError(f"no other branch, tag or HEAD reaches {name!r}'s tip {tip[:12]}, so gc would delete "
                               f"the versions only it holds; tag it to keep them, or delete anyway (`branch -D`)")
        return refs.delete("branch", name, seen=(tip, gen))

    def delete_tag(self, name: str) -> str:
        """Delete tag ``name`` (``git tag -d``); returns the version it pointed at, which gc may then collect."""
        return self._plumbing.refs.delete("tag", _ref_name(name, "tag"))

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
        from ckptrepo.tools._inspect import diff_versions
        _rev(a)
        if b is None:
            v = self.version(a)
            if not v.parents:
                raise RevisionError(f"{a!r} ({v.short_id}) is a root version, with no parent to compare with; "
                                    f"name two revisions: ckptrepo diff A B")
            a, b = v.parents[0], v.id
        _rev(b)
        _pattern(pattern)
        _callback(on_bytes, "on_bytes")
        _flag(include_nonfloat, "include_nonfloat")
        return diff_versions(self._plumbing, a, b, pattern, on_bytes, include_nonfloat)

    def stats(self, rev: str = "HEAD", pattern: str | None = None,
              on_bytes: Callable[[int], None] | None = None) -> list[TensorStats]:
        """Per tensor: norm, mean, std, min, max, absmax, NaN and Inf counts.

        Answered from the statistics the version recorded at capture, without reading its data; a version
        written without them is read (streamed)."""
        from ckptrepo.tools._recorded import recorded_tensor_stats
        _rev(rev)
        _pattern(pattern)
        _callback(on_bytes, "on_bytes")
        vid = self._plumbing.resolve(rev)
        recorded = recorded_tensor_stats(self._plumbing, vid, pattern)
        if recorded is not None:
            return recorded
        from ckptrepo.tools._inspect import tensor_stats
        return tensor_stats(self._plumbing, vid, pattern, on_bytes)

    def trajectory(self, pattern: str, metric: str = "norm", rev: str = "HEAD", since: int | None = None,
                   until: int | None = None, include_nonfloat: bool = False) -> list[TrajectoryPoint]:
        """A statistic (``METRICS`` of tools/_trajectory.py: norm, mean, std, min, max, absmax, nan, inf, delta,
        relative-change) of tensors matching ``pattern`` over the first-parent history of ``rev``, oldest first;
        non-float tensors and step counters only with ``include_nonfloat``."""
        from ckptrepo.tools._trajectory import trajectory
        _pattern(pattern, required=True)
        _rev(rev)
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
        from ckptrepo.tools._trajectory import stat_matrix
        _pattern(pattern)
        _rev(rev)
        _whole(since, "since")
        _whole(until, "until")
        _flag(include_nonfloat, "include_nonfloat")
        if max_versions is not None and (type(max_versions) is not int or max_versions < 1):
            raise ArgumentError(f"max_versions must be a positive int or None, not {max_versions!r}")
        return stat_matrix(self._plumbing, pattern, stat, rev, since, until, max_versions, include_nonfloat)

    def metrics(self, rev: str = "HEAD") -> list[dict[str, Any]]:
        """The recorded metrics (loss, lr, ...) per version along the first-parent history of ``rev``, oldest first."""
        return [{"version": vid, "step": h.step, **h.metrics} for vid, h in self._first_parent_headers(rev)]

    def _first_parent_headers(self, rev: str) -> list[tuple[str, ManifestHeader]]:
        """(id, header) along the first-parent history of ``rev``, oldest first: headers only, no tensor data."""
        return list(HeaderWalk(self._plumbing.reads).chain(self.resolve(rev)))[::-1]

    def metrics_to_tensorboard(self, log_dir: str | os.PathLike[str], rev: str = "HEAD") -> int:
        """Write the metrics and capture statistics along the first-parent history of ``rev`` as TensorBoard scalars
        to the folder ``log_dir``, outside the repository; returns how many. Needs ``ckptrepo[tensorboard]``."""
        from ckptrepo.tools._tensorboard import write_scalars
        _path(log_dir, "TensorBoard log directory")
        root = self._plumbing.store.capabilities.local_root
        return write_scalars(log_dir, lambda: self._first_parent_headers(rev), root)

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
        from ckptrepo.tools import _bisect
        _rev(rev)
        _pattern(tensor)
        _flag(nonfinite, "nonfinite")
        _flag(include_nonfloat, "include_nonfloat")
        _whole(since, "since")
        _whole(until, "until")
        if nonfinite:
            if when is not None or metric is not None:
                raise ArgumentError("nonfinite=True takes no condition and no metric: it looks for NaN and Inf "
                                    "elements of tensors (narrow them with tensor=GLOB)")
            pattern = tensor or "*"
            nan = self._bisect_matrix(pattern, "nan", rev, since, until, include_nonfloat)
            inf = self._bisect_matrix(pattern, "inf", rev, since, until, include_nonfloat)
            return _bisect.first_nonfinite(nan.versions, nan.steps, nan.names, nan.values, inf.values)
        if (metric is None) == (tensor is None):
            raise ArgumentError("bisect needs one of metric= (a recorded metric) or tensor= (a glob, with stat=), "
                                "or nonfinite=True")
        if when is None:
            raise ArgumentError(f"bisect needs a condition (when=): one of {_bisect.ACCEPTED}")
        cond = _bisect.parse_condition(when)
        if metric is not None:
            rows = self.metrics(rev)
            recorded = sorted({k for r in rows for k in r} - {"version", "step"})
            if metric not in recorded:
                raise ArgumentError(f"no version in the history of {rev} records metric {metric!r}; recorded: "
                                    f"{', '.join(recorded) or 'none'}")
            return _bisect.first_metric_match([r for r in rows if _bisect.in_range(r["step"], since, until)],
                                              metric, cond)
        if cond.kind == "nan":
            raise ArgumentError("'is nan' is for metrics: a tensor statistic is NaN where the tensor is absent; "
                                "find NaN elements with nonfinite=True (--nonfinite)")
        assert tensor is not None
        m = self._bisect_matrix(tensor, stat, rev, since, until, include_nonfloat)
        return _bisect.first_tensor_match(m.versions, m.steps, m.names, m.values, stat, cond)

    def _bisect_matrix(self, pattern: str, stat: str, rev: str, since: int | None, until: int | None,
                       include_nonfloat: bool) -> StatMatrix:
        """``stat_matrix`` of ``pattern``, refused in one line when no tensor matches."""
        m = self.stat_matrix(pattern, stat, rev, since, until, include_nonfloat=include_nonfloat)
        if not m.names:
            where = " in the --since/--until range" if since is not None or until is not None else ""
            raise ArgumentError(f"no tensor matches {pattern!r} in the history of {rev}{where}; "
                                f"`ckptrepo show {rev}` lists the names")
        return m

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
        from ckptrepo.maintenance._gc import DEFAULT_GRACE_S, collect
        return collect(self._plumbing, keep_last, keep_every, keep_tagged, keep_branch_heads,
                       DEFAULT_GRACE_S if grace_period_s is None else grace_period_s, dry_run,
                       keep_best=keep_best, best_metric=best_metric, best_mode=best_mode)

    def fsck(self, on_bytes: Callable[[int], None] | None = None,
             on_total: Callable[[int], None] | None = None) -> FsckReport:
        """Read every object and verify every checksum and reference."""
        from ckptrepo.maintenance._fsck import fsck
        _callback(on_bytes, "on_bytes")
        _callback(on_total, "on_total")
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
        from ckptrepo.maintenance._usage import disk_usage
        return disk_usage(self._plumbing, self.log(all=True))

    def export(self, rev: str, out: str | os.PathLike[str], format: str = "torch",  # noqa: A002
               force: bool = False, max_shard_size: int | str | None = None) -> Version:
        """Write the full, unsharded state of ``rev`` as ``format`` (torch, safetensors, dcp or hf) to ``out``
        (outside the repository; an existing export there is replaced only with ``force``). ``hf``: the model
        under the state's ``model`` as an HF model folder, in files of at most ``max_shard_size`` ("5GB")."""
        from ckptrepo.tools._exchange import export_target, write_export
        _path(out, "export's output")
        # refused before the version is resolved and loaded
        path = export_target(out, format, force=force, repo_root=self._plumbing.store.capabilities.local_root,
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
        from ckptrepo.tools._exchange import read_checkpoint, state_step
        _path(path, "checkpoint to import")
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
        from ckptrepo.remotes._sync import push
        return push(self._plumbing, check_remote_name(remote), branches, tags or (), progress)

    def evict(self, remote: str = "origin", keep_last: int = 1, branch: str | None = None) -> "EvictReport":
        """Delete here the tensor data of ``branch``'s versions (default: the current one) beyond its newest
        ``keep_last`` that ``remote`` holds (as pushed or fetched); they still load, diff and fsck, reading from
        the remote. Never a version the remote lacks, nor an array a kept version points into (dedup)."""
        from ckptrepo.remotes._evict import evict
        if branch is not None:
            _ref_name(branch, "branch")
        return evict(self._plumbing, check_remote_name(remote), keep_last, branch)

    def fetch(self, remote: str = "origin", lazy: bool = False, progress: "Progress | None" = None) -> "SyncResult":
        """Copy the versions ``remote``'s branches and tags reach that are not here (``lazy``: manifests only,
        tensor data read from the remote when loaded), and record where its branches are (``REMOTE/BRANCH``)."""
        from ckptrepo.remotes._sync import fetch
        return fetch(self._plumbing, check_remote_name(remote), lazy=lazy, progress=progress)

    def pull(self, remote: str = "origin", lazy: bool = False, progress: "Progress | None" = None) -> "SyncResult":
        """Fetch ``remote``, then fast-forward the current branch to its branch of the same name."""
        from ckptrepo.remotes._sync import pull
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
        from ckptrepo.tools._status import repo_status
        return repo_status(self._plumbing)

    def revision_names(self, incomplete: str = "") -> list[str]:
        """What a revision starting with ``incomplete`` may be (shell completion): HEAD, branches, tags, and
        short ids once ``incomplete`` is a hex prefix long enough to name one."""
        from ckptrepo.tools._status import revision_names
        return revision_names(self._plumbing, incomplete)

    def tracking_refs(self) -> dict[str, str]:
        """Remote-tracking refs (``origin/main``) -> the version each records, as the last fetch or push left
        them; a damaged one is left out."""
        return tracking_refs(self._plumbing.store)

    def repair_lost(self) -> list[str]:
        """Mark the versions whose manifest a gc collected while a ref came to name them lost, tag what may
        have preceded each and move a branch that names one back (``fsck --repair``); deletes nothing.
        One line per thing done; running it again does nothing more."""
        from ckptrepo.maintenance._lost import repair_lost
        return repair_lost(self._plumbing)

    @staticmethod
    def repair_config(url: str | os.PathLike[str]) -> list[str]:
        """Rebuild a damaged or missing ``ckptrepo.json`` of the repository at ``url`` from what it holds
        (``fsck --repair-config``), one line per thing done; done on the store, as a repository whose config
        is damaged cannot be opened. An intact config is left as it is."""
        from ckptrepo.core._manifest import repair_config
        return repair_config(open_store(repo_url(url)))
    # --- end porcelain for the CLI ---


__all__ = ["DEFAULT_BRANCH", "Repository", "VersionDetails", "clone", "init", "load", "load_device", "open"]
