"""A distributed snapshotter's start: every rank checks the others' setup, learns which ranks share its
repository, and, on node-local tiers, every node's branch is made to agree with rank 0's.

The ranks meet through their key-value store (parallel/_kv.py) when each makes its snapshotter, so that a
misconfigured job fails on every rank within seconds with one line, before any data is written: ranks on
different repositories, on different branches, pushing to different remotes, with different layouts, or
one whose own checks failed (a layout that does not fit the world size, a detached HEAD, an unknown remote).

**Which ranks share a local store** is learnt from the stores themselves, never from host names (simulated
nodes share one): each rank writes a probe object ``staging/<nonce>/probe-<rank>`` into its repository, and
lists the others' there. Ranks that see each other's probes share a store: a *node*, whose lowest rank is its
leader. Without ``push_to`` every rank must see every other (one shared repository). With it, each node may
have its own local repository in front of the same remote (docs/decisions/053-node-local-tiers.md).

**One history for all nodes.** Rank 0's repository decides: its branch tip is the version every node's
branch is set to at the start. A node whose repository is empty (a new node, or a wiped disk) first takes
what the remote holds, lazily (manifests and refs; tensor data read from the remote). Versions rank 0
committed but had not pushed reach a node that lacks them through the key-value store.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar, cast

from ckptrepo.core import (
    CONFIG_KEY,
    VERSIONS_PREFIX,
    Plumbing,
    evicted_ids,
    first_parent_chain,
    mark_evicted,
    new_version_id,
    remote_url,
    tracking_tip,
    update_config,
)
from ckptrepo.core.schema import decode_manifest
from ckptrepo.errors import CkptRepoError, LayoutError, RefError, SnapshotFailedError, first_line
from ckptrepo.parallel import GroupStore, ranks_text
from ckptrepo.parallel.layout import ParallelLayout
from ckptrepo.remotes import REPOSITORY_ID, fetch

T = TypeVar("T")
PROBE_PREFIX = "staging/"   # + a version-like id (gc removes stale ones as an interrupted handshake's) + /probe-
# versions rank 0 hands a node that lacks them at the start: those committed but not pushed, which the
# local tier's backpressure keeps few; older ones are on the remote
MAX_HANDED = 256


@dataclass(frozen=True)
class Cluster:
    """The ranks of a distributed snapshotter, grouped by the repository each writes to."""

    kv: GroupStore
    nodes: tuple[tuple[int, ...], ...]   # the ranks sharing each local repository, lowest first
    node: int                            # this rank's node
    remote: str | None                   # push_to: the remote every node pushes to
    node_of: dict[int, int] = field(default_factory=dict)

    @property
    def multi_node(self) -> bool:
        return len(self.nodes) > 1

    @property
    def leader(self) -> bool:
        """Whether this rank is its node's lowest: the one that commits and pushes for its node."""
        return self.kv.rank == self.nodes[self.node][0]


def _layout_text(layout: ParallelLayout | None) -> str | None:
    return None if layout is None else str(layout)


def start_cluster(plumbing: Plumbing, rank: int, world_size: int, layout: ParallelLayout | None,
                  branch: str | None, remote: str | None, timeout_s: float,
                  failure: CkptRepoError | None) -> Cluster:
    """Meet the other ranks (see the module docstring); raise the same one-line error on every rank when the
    setup is wrong, ``failure`` (this rank's own) on this rank."""
    kv = GroupStore.of_default_group(rank, world_size)
    local = plumbing.store.capabilities.local_root is not None
    mine = {"id": plumbing.config.get(REPOSITORY_ID), "url": plumbing.store.url, "branch": branch,
            "remote": remote_url(plumbing.store, remote) if remote is not None and failure is None else None,
            "layout": _layout_text(layout), "local": local, "nonce": new_version_id(),
            "error": None if failure is None else f"{type(failure).__name__}: {first_line(failure)}"}
    kv.arrive("start", timeout_s, mine, False, failure is not None, "the start of their snapshotter (every rank "
              "must make one, in the same order)")
    every = kv.payloads("start")
    _check_setup(every, failure)
    nodes = _probe(plumbing, kv, every, timeout_s) if any(p["local"] for p in every) else \
        (tuple(range(world_size)),)
    if len(nodes) > 1 and remote is None:
        raise SnapshotFailedError(
            f"the ranks write to {len(nodes)} different repositories with the same id (rank 0's is "
            f"{every[0]['url']}; {ranks_text(list(nodes[1]))} see another): without push_to every rank must "
            f"snapshot into one shared repository (a shared directory or an object store); for node-local disks, "
            f"give each node its own repository and push_to the same remote")
    node_of = {r: i for i, ranks in enumerate(nodes) for r in ranks}
    cluster = Cluster(kv, nodes, node_of[rank], remote, node_of)
    if cluster.multi_node and branch is not None and remote is not None:
        _agree_on_history(plumbing, cluster, branch, remote, timeout_s)
    # every rank has read every key of the meetings above once all reach this one: they may go
    kv.arrive("ready", timeout_s, {}, False, False, "the end of the snapshotter's start")
    for name in ("start", "probed", "seen", "views", "took", "history"):
        kv.forget(name, own_only=rank != 0)
    return cluster


def _check_setup(every: list[dict[str, Any]], failure: CkptRepoError | None) -> None:
    """The same verdict on every rank from every rank's setup."""
    failed = next(((r, p["error"]) for r, p in enumerate(every) if p["error"]), None)
    if failed is not None:
        if failure is not None:
            raise failure
        raise SnapshotFailedError(f"rank {failed[0]} could not start its snapshotter ({failed[1]}); fix it there")
    first = every[0]
    for what, key, fix in (("parallel layouts", "layout", "give every rank the same parallel_layout"),
                           ("branches", "branch", "check out the same branch on every rank"),
                           ("push_to remotes", "remote", "give every rank the same remote URL")):
        other = next((r for r, p in enumerate(every) if p[key] != first[key]), None)
        if other is not None:
            raise (LayoutError if key == "layout" else SnapshotFailedError)(
                f"the ranks' {what} differ: rank 0 has {first[key]!r}, rank {other} {every[other][key]!r}; {fix}")
    if first["remote"] is None:
        other = next((r for r, p in enumerate(every) if p["id"] != first["id"]), None)
        if other is not None:
            raise SnapshotFailedError(
                f"the ranks snapshot into different repositories: rank 0 into {first['url']} (id "
                f"{str(first['id'])[:12]}), rank {other} into {every[other]['url']} (id "
                f"{str(every[other]['id'])[:12]}); give every rank the same repository, or give each node its own "
                f"and push_to one remote")


def together(kv: GroupStore, name: str, timeout_s: float, what: str, step: Callable[[], T]) -> T:
    """Run this rank's ``step`` of a start phase, then meet the others at ``name``: a rank whose step failed
    (storage, a remote) fails every rank now, with its error, instead of leaving them to their deadline."""
    result: Any = None
    error = None
    try:
        result = step()
    except CkptRepoError as err:
        error = f"{type(err).__name__}: {first_line(err)}"
    _, refused = kv.arrive(name, timeout_s, {"error": error}, False, error is not None, what)
    if refused:
        rank, why = next((r, p["error"]) for r, p in enumerate(kv.payloads(name)) if p["error"])
        raise SnapshotFailedError(f"rank {rank} failed in {what} ({why}); fix it there and start again")
    return cast(T, result)


def _probe(plumbing: Plumbing, kv: GroupStore, every: list[dict[str, Any]],
           timeout_s: float) -> tuple[tuple[int, ...], ...]:
    """The ranks that share each local store, learnt from probe objects (see the module docstring)."""
    prefix = f"{PROBE_PREFIX}{every[0]['nonce']}/probe-"
    key = f"{prefix}{kv.rank}"
    try:
        together(kv, "probed", timeout_s, "the repository probe", lambda: plumbing.store.put(key, b""))
        seen = together(kv, "seen", timeout_s, "the repository probe", lambda: sorted(
            int(k[len(prefix):]) for k in plumbing.store.list(prefix) if k[len(prefix):].isdigit()))
        kv.arrive("views", timeout_s, {"seen": seen}, False, False, "the repository probe")
        views = [tuple(p["seen"]) for p in kv.payloads("views")]
    finally:
        try:
            plumbing.store.delete(key)
        except CkptRepoError:   # gc removes a probe left behind, as an interrupted handshake's
            pass
    nodes = sorted(set(views))
    for r, view in enumerate(views):
        if r not in view or any(views[o] != view for o in view):
            raise SnapshotFailedError(f"rank {r} sees the probes of {ranks_text(list(view))}, which do not all "
                                      f"see the same: the ranks' repositories overlap in a way no node layout "
                                      f"explains; check each rank's repository path")
    return tuple(nodes)


def _agree_on_history(plumbing: Plumbing, cluster: Cluster, branch: str, remote: str, timeout_s: float) -> None:
    """Make every node's ``branch`` name rank 0's tip (see the module docstring)."""
    kv = cluster.kv
    together(kv, "took", timeout_s, "taking the remote's history into an empty node repository",
             lambda: _take_from_remote(plumbing, remote, branch)
             if cluster.leader and plumbing.branch_tip(branch) is None else None)
    if kv.rank == 0:
        tip = plumbing.branch_tip(branch)
        kv.set("history/tip", (tip or "").encode())
        handed = unpushed_versions(plumbing, remote, branch, tip)[-MAX_HANDED:]   # oldest first: parents first
        for i, vid in enumerate(handed):
            raw = plumbing.store.get(VERSIONS_PREFIX + vid)   # sealed as stored: each node checks it
            if raw is None:
                raise SnapshotFailedError(f"version {vid[:12]} on rank 0's branch has no manifest; run `ckptrepo "
                                          f"fsck` on rank 0's repository")
            kv.set(f"history/v{i}", vid.encode() + b"\n" + raw)
        kv.set("history/count", str(len(handed)).encode())
    kv.wait(["history/count"], timeout_s, lambda: "rank 0 did not say where its branch is")

    def follow_rank_0() -> None:
        tip = kv.get("history/tip").decode() or None
        count = int(kv.get("history/count"))
        for i in range(count):
            named, raw = kv.get(f"history/v{i}").split(b"\n", 1)
            m = decode_manifest(raw, named.decode())   # checked before it is written: sealed, and of that id
            mark_evicted(plumbing.store, m.id, remote, spread=True)   # the other nodes' arrays: on the remote
            plumbing.store.put_if_absent(VERSIONS_PREFIX + m.id, raw)
        _mark_unmarked(plumbing, tip, remote)
        _set_branch(plumbing, branch, tip, remote)
    together(kv, "history", timeout_s, "the agreement on the branch",
             follow_rank_0 if cluster.leader and kv.rank != 0 else lambda: None)
    if kv.rank == 0:
        count = int(kv.get("history/count"))
        for k in ["history/tip", "history/count", *(f"history/v{i}" for i in range(count))]:
            kv.delete(k)


def unpushed_versions(plumbing: Plumbing, remote: str, branch: str, tip: str | None = None) -> list[str]:
    """The versions of ``branch`` (from ``tip``, default its tip) past what the remote was last known to
    hold (its remote-tracking ref), oldest first."""
    on_remote = tracking_tip(plumbing.store, f"{remote}/{branch}")
    out = []
    for vid in first_parent_chain(tip or plumbing.branch_tip(branch), plumbing.first_parent):
        if vid == on_remote:
            break
        out.append(vid)
    return out[::-1]


def _mark_unmarked(plumbing: Plumbing, tip: str | None, remote: str) -> None:
    """Mark the versions on ``tip``'s first-parent chain that a commit here recorded without its eviction
    marker (interrupted between the two), newest first, down to one that has it: the other nodes' arrays of
    each are read from the remote."""
    marked = evicted_ids(plumbing.store)
    for vid in first_parent_chain(tip, plumbing.first_parent) if tip else ():
        if vid in marked or not plumbing.store.exists(VERSIONS_PREFIX + vid):
            return
        mark_evicted(plumbing.store, vid, remote, spread=True)


def _take_from_remote(plumbing: Plumbing, remote: str, branch: str) -> None:
    """An empty node repository: what the remote holds, lazily. It takes the remote's identity first (it holds
    no version of its own), so that the remote is not refused as another repository."""
    store = plumbing.remote_store(remote)   # untrusted: its reads bounded, its links not followed
    if not store.exists(CONFIG_KEY):
        return   # nothing pushed yet: a new job
    there = Plumbing(store)
    theirs = there.config.get(REPOSITORY_ID)
    if theirs and not plumbing.all_version_ids() and plumbing.config.get(REPOSITORY_ID) != theirs:
        plumbing.config = update_config(plumbing.store, {REPOSITORY_ID: theirs})
    fetch(plumbing, remote, lazy=True)
    tip = tracking_tip(plumbing.store, f"{remote}/{branch}")
    if tip is not None:
        _set_branch(plumbing, branch, tip, remote)


def _set_branch(plumbing: Plumbing, branch: str, tip: str | None, remote: str) -> None:
    """Point this node's ``branch`` at ``tip`` (rank 0's), whether it is behind (a commit rank 0 made before
    this node recorded it) or ahead (one it recorded that rank 0 never committed)."""
    now, generation = plumbing.refs.branch_tip_with_generation(branch)
    if now == tip:
        return
    if tip is None:
        raise RefError(f"this node's branch {branch!r} is at {now[:12] if now else None}, but rank 0's has no "
                       f"versions: rank 0's repository is not this job's; check its path")
    if not plumbing.store.exists(VERSIONS_PREFIX + tip):
        raise SnapshotFailedError(f"rank 0's branch {branch!r} is at version {tip[:12]}, which this node's "
                                  f"repository lacks and remote {remote!r} does not hold; resume from rank 0's "
                                  f"node, or from the remote's branch on every node")
    if now is None:
        plumbing.refs.create_branch(branch, tip)
    elif plumbing.refs.move_branch(branch, tip, generation, now, plumbing.first_parent) is None:
        raise CkptRepoError(f"branch {branch!r} moved while this node took rank 0's tip; start again")


__all__ = ["Cluster", "start_cluster", "unpushed_versions"]
