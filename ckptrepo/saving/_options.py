"""A snapshotter's options: frozen values, checked once when they are made.

``repo.snapshotter(**keywords)`` builds them from its keywords (``SnapshotterOptions.of``), and a caller may
build them itself and pass ``repo.snapshotter(options=...)``; either way the checks below run once, in
``__post_init__``, before any thread or file exists. Found later, a bad value would fail in a background
thread, once per snapshot (a retention policy of the wrong type would make every commit's gc pass fail, and
``close()`` report it as failed snapshots that were in fact committed).

What can only be checked against the repository or the process group (an unknown remote, a layout of the
wrong world size, a detached HEAD) is checked by the ``Snapshotter`` it configures.
"""
from __future__ import annotations

import inspect
import shutil
from dataclasses import dataclass
from typing import Any

from ckptrepo.arguments import check_flag, check_whole, cut
from ckptrepo.core import COMPRESSION_SETTING, CONFIG_KEY, Plumbing
from ckptrepo.errors import ArgumentError, FormatVersionError, LayoutError, RetentionError
from ckptrepo.maintenance import RetentionPolicy
from ckptrepo.parallel.layout import ParallelLayout
from ckptrepo.saving._host_memory import parse_size
from ckptrepo.storage import COMPRESSIONS, check_compression

ON_FULL = ("wait", "skip")


def _check_on_full(on_full: Any) -> None:
    if on_full not in ON_FULL:
        raise ArgumentError(f"on_full must be 'wait' or 'skip', not {on_full!r:.40}")


def _same(value: Any, default: Any) -> bool:
    return value is default or (type(value) is type(default) and value == default)


@dataclass(frozen=True)
class LocalTier:
    """The repository as a local tier in front of remote ``push_to``: each version is committed here, then
    pushed in the background. ``keep_last``: once pushed, only the branch's newest N versions keep their data
    here. ``max_bytes`` ("20GiB"; None: half the free disk) bounds the data here the remote lacks; a snapshot
    that would pass it waits for the pusher (``on_full="wait"``) or is skipped (``"skip"``).

    The messages name the keywords of ``repo.snapshotter`` (``local_keep_last``...), the spelling most
    callers use."""

    push_to: str
    keep_last: int | None = None
    max_bytes: int | str | None = None
    on_full: str = "wait"

    def __post_init__(self) -> None:
        if not isinstance(self.push_to, str):
            raise ArgumentError(f"push_to must be the name of a remote (text, e.g. 'origin') or None, not "
                                f"{self.push_to!r:.40}")
        check_whole(self.keep_last, "local_keep_last", 1, optional=True)
        _check_on_full(self.on_full)
        parse_size(self.max_bytes, "local_max_bytes")

    @property
    def max_bytes_parsed(self) -> int | None:
        """``max_bytes`` in bytes (None: the default, half the free disk)."""
        return parse_size(self.max_bytes, "local_max_bytes")


@dataclass(frozen=True)
class SnapshotterOptions:
    """Everything ``repo.snapshotter()`` takes, as one value (see its docstring for each option); ``tier``
    holds ``push_to``, ``local_keep_last``, ``local_max_bytes`` and ``on_full``."""

    host_memory: int | str | None = None
    pin_memory: bool | None = None
    parallel_layout: ParallelLayout | None = None
    group: Any = None
    commit_timeout_s: float = 600.0
    dedup: bool = True
    retention: RetentionPolicy | None = None
    max_in_flight: int = 4
    tier: LocalTier | None = None
    single_process: bool = False
    tensor_stats: bool = True
    compression: str | bool | None = None

    def __post_init__(self) -> None:
        check_flag(self.single_process, "single_process", show=cut)
        check_flag(self.tensor_stats, "tensor_stats", show=cut)
        if self.compression is not None:
            check_compression(self.compression)
        if self.tier is not None and not isinstance(self.tier, LocalTier):
            raise ArgumentError(f"tier must be a ckptrepo.LocalTier or None, not {type(self.tier).__name__} "
                                f"{self.tier!r:.40}")
        mif = self.max_in_flight
        check_whole(mif, "max_in_flight", 1)
        timeout = self.commit_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:   # NaN too
            raise ArgumentError(f"commit_timeout_s must be a number of seconds above 0, not {timeout!r}")
        check_flag(self.dedup, "dedup")
        check_flag(self.pin_memory, "pin_memory", optional=True)
        if self.retention is not None and not isinstance(self.retention, RetentionPolicy):
            raise RetentionError(f"retention must be a ckptrepo.RetentionPolicy or None, not "
                                 f"{type(self.retention).__name__} {self.retention!r:.40}")
        if self.parallel_layout is not None and not isinstance(self.parallel_layout, ParallelLayout):
            raise LayoutError(f"parallel_layout must be a ckptrepo.ParallelLayout or None, not "
                              f"{type(self.parallel_layout).__name__} {self.parallel_layout!r:.40}")
        parse_size(self.host_memory)

    @classmethod
    def of(cls, host_memory: int | str | None = None, pin_memory: bool | None = None,
           parallel_layout: ParallelLayout | None = None, group: Any = None, commit_timeout_s: float = 600.0,
           dedup: bool = True, retention: RetentionPolicy | None = None, max_in_flight: int = 4,
           push_to: str | None = None, local_keep_last: int | None = None,
           local_max_bytes: int | str | None = None, on_full: str = "wait", single_process: bool = False,
           tensor_stats: bool = True, compression: str | bool | None = None) -> SnapshotterOptions:
        """The options ``repo.snapshotter``'s keywords name: the tier's four make a ``LocalTier`` when
        ``push_to`` is given; without it, bounds of a tier are refused (they would bound nothing)."""
        tier = None
        if push_to is not None:
            tier = LocalTier(push_to, local_keep_last, local_max_bytes, on_full)
        else:
            check_whole(local_keep_last, "local_keep_last", 1, optional=True)
            _check_on_full(on_full)
            if local_keep_last is not None or local_max_bytes is not None:
                raise ArgumentError("local_keep_last and local_max_bytes bound a local tier that pushes to a remote: "
                                    "pass push_to='origin' (a remote added with repo.remote_add) as well")
        return cls(host_memory=host_memory, pin_memory=pin_memory, parallel_layout=parallel_layout, group=group,
                   commit_timeout_s=commit_timeout_s, dedup=dedup, retention=retention,
                   max_in_flight=max_in_flight, tier=tier, single_process=single_process,
                   tensor_stats=tensor_stats, compression=compression)

    @classmethod
    def given(cls, options: Any, keywords: dict[str, Any]) -> SnapshotterOptions:
        """The options a caller gave: ``options`` if not None (then every keyword must be left at its
        default: two spellings of one option could disagree), else those the keywords name."""
        if options is None:
            return cls.of(**keywords)
        if not isinstance(options, SnapshotterOptions):
            raise ArgumentError(f"options must be a ckptrepo.SnapshotterOptions or None, not "
                                f"{type(options).__name__} {options!r:.40}")
        defaults = inspect.signature(cls.of).parameters
        also = [k for k, v in keywords.items() if k not in defaults or not _same(v, defaults[k].default)]
        if also:
            raise ArgumentError(f"pass the snapshotter's options either as options= or as keywords, not both "
                                f"(options= with {', '.join(also)})")
        return options

    def check_world(self, world_size: int) -> None:
        """Refuse a layout that does not fit the ranks the snapshotter runs on (``world_size``: torch.distributed's,
        or one for ``single_process``)."""
        layout = self.parallel_layout
        if layout is None:
            return
        if self.single_process and layout.world_size > 1:
            raise LayoutError(f"a single_process snapshotter saves the whole state from this process alone, so it "
                              f"takes no layout of several ranks ({layout}); leave single_process off to "
                              f"snapshot from every rank")
        if layout.world_size != world_size:
            raise LayoutError(f"the layout ({layout}) has {layout.world_size} ranks but "
                              f"torch.distributed has {world_size}; initialise the process group first "
                              f"(torchrun) or pass the layout that matches it")

    @property
    def host_bytes(self) -> int | None:
        """``host_memory`` in bytes (None: the default)."""
        return parse_size(self.host_memory)


def snapshot_compression(plumbing: Plumbing, compression: Any) -> str | None:
    """The compression a snapshotter's arrays get: ``compression`` ("zstd", or "none"/False: off), or for None
    the repository's setting (``ckptrepo.init(url, compression=...)``)."""
    if compression is not None:
        return check_compression(compression)
    setting = plumbing.config.get(COMPRESSION_SETTING)
    if setting is None or setting in COMPRESSIONS:
        return setting
    raise FormatVersionError(f"{plumbing.url}: {CONFIG_KEY} asks for compression {str(setting)[:20]!r}, which this "
                             f"ckptrepo does not write; upgrade ckptrepo, or pass compression='none'")


def default_local_max_bytes(store: Any) -> int | None:
    """The default bound of a local tier's unpushed data: half the space free on its file system when the
    snapshotter starts, so that a remote falling behind holds the run up instead of filling the disk; None
    (no bound) for a store that is not a local directory."""
    root = store.capabilities.local_root
    if root is None:
        return None
    try:
        return max(1, shutil.disk_usage(root).free // 2)
    except OSError:
        return None


__all__ = ["LocalTier", "SnapshotterOptions", "default_local_max_bytes", "snapshot_compression"]
