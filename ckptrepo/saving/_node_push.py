"""Node-local tiers: each node pushes the arrays its disk holds, and rank 0 pushes the version once all are there.

On a node-local tier (saving/_startup.py) a version's arrays are spread over the nodes' disks: each rank's
are on its node. Each node's leader runs a ``NodePusher``: after every commit it copies to the remote the
arrays its disk holds of the versions the remote lacks, then tells rank 0 through the ranks' key-value store
(``pushed/<node>/<version>``). Rank 0's pusher is the usual one (remotes/_sync.py), with a gate before each
push: for a version with arrays neither here nor on the remote, it waits for every other node's word (as
long as their uploads make progress), by where the arrays are rather than by which node their rank is on
now, since a restart may place ranks on other nodes. Its push then finds them there and copies only its
own, then the manifests, then moves the remote branch last: a version is remote-durable only once every
rank's arrays and its manifest are there.

Each node's pusher keeps its own account of what its disk holds unpushed (backpressure) and evicts its own
arrays (``local_keep_last``) once the remote's branch, which it reads after each push, holds their version.
"""
from __future__ import annotations

from typing import Callable, Iterable

from ckptrepo.core import CONFIG_KEY, Plumbing, remote_url, set_tracking_ref
from ckptrepo.errors import CkptRepoError, SnapshotFailedError
from ckptrepo.parallel import DeadlineError, ranks_text
from ckptrepo.remotes import VersionCopier, open_remote
from ckptrepo.saving._options import LocalTier, default_local_max_bytes
from ckptrepo.saving._pusher import BackgroundPusher, check_tier
from ckptrepo.saving._startup import Cluster, unpushed_versions
from ckptrepo.storage import open_store

REMOTE_READY = "remote-ready"   # rank 0 made the remote a repository: the nodes may write into it


def pushed_key(node: int, vid: str) -> str:
    return f"pushed/{node}/{vid}"


def progress_key(node: int) -> str:
    """A count of the objects ``node`` has uploaded: while it grows, rank 0 keeps waiting for the node."""
    return f"progress/{node}"


class RemoteGate:
    """Rank 0's wait, before each push, for the other nodes' arrays (see the module docstring)."""

    def __init__(self, cluster: Cluster, remote: str, branch: str, timeout_s: float) -> None:
        self.kv = cluster.kv.connection()   # the pusher thread's own: its waits hold up no other thread
        self.cluster, self.remote, self.branch, self.timeout_s = cluster, remote, branch, timeout_s
        self._ready = False

    def __call__(self, plumbing: Plumbing) -> str | None:
        """Wait for the other nodes' arrays of the branch's unpushed versions; return the tip they are of (the
        push goes no further: a version committed meanwhile waits for the next one)."""
        there = open_remote(plumbing, self.remote, create_with_branch=self.branch)
        if not self._ready:
            self.kv.set(REMOTE_READY, b"1")
            self._ready = True
        tip = plumbing.branch_tip(self.branch)
        others = [n for n in range(len(self.cluster.nodes)) if n != self.cluster.node]

        def held(key: str) -> bool:
            return plumbing.store.exists(f"{key}/zarr.json") or there.store.exists(f"{key}/zarr.json")
        for vid in unpushed_versions(plumbing, self.remote, self.branch, tip):
            # by where the arrays are, not by which node their rank is on now: a restart may place a rank elsewhere
            missing = [k for k in plumbing.manifest(vid).arrays if k.split("/")[1] == vid and not held(k)]
            if not missing:   # the nodes' words are not needed: they go, so the store does not grow with versions
                for node in others:
                    self.kv.delete(pushed_key(node, vid))
                continue
            for node in others:
                self._await_node(node, vid)
            lost = [k for k in missing if not there.store.exists(f"{k}/zarr.json")]
            if lost:
                raise SnapshotFailedError(
                    f"version {vid[:12]} cannot reach the remote: no node holds its array {lost[0]} (a node's disk "
                    f"was lost before it was pushed), so that version is lost. Resume from the remote's branch: "
                    f"on each node, `ckptrepo --repo DIR checkout origin/BRANCH -b BRANCH2`, or move the node "
                    f"directories aside")
        return tip

    def _await_node(self, node: int, vid: str) -> None:
        """Wait for ``node``'s arrays of ``vid``: as long as its upload makes progress, each ``timeout_s`` of
        silence at most (an upload may take longer than a commit)."""
        ranks = ranks_text(list(self.cluster.nodes[node]))
        seen = -1
        while True:
            try:
                self.kv.wait([pushed_key(node, vid)], self.timeout_s,
                             lambda: f"the node of {ranks} did not push its arrays of version {vid[:12]}")
                break
            except DeadlineError:
                moved = self.kv.add(progress_key(node), 0)
                if moved == seen:
                    raise
                seen = moved
        self.kv.delete(pushed_key(node, vid))


class NodePusher(BackgroundPusher):
    """The pusher of a node other than rank 0's: its own ranks' arrays only (see the module docstring)."""

    def __init__(self, plumbing: Plumbing, remote: str, branch: str, keep_last: int | None, max_bytes: int | None,
                 on_error: Callable[[CkptRepoError], None], protect: Callable[[], Iterable[str]],
                 cluster: Cluster, timeout_s: float) -> None:
        self.kv = cluster.kv.connection()
        self.cluster, self.timeout_s = cluster, timeout_s
        super().__init__(plumbing, remote, branch, keep_last, max_bytes, on_error, protect)

    def _send(self) -> None:
        """This node's arrays of the versions the remote lacks (see the module docstring)."""
        store = self.plumbing.store
        dst = open_store(remote_url(store, self.remote))
        if not dst.exists(CONFIG_KEY):   # rank 0's first push makes it a repository: nothing goes in before
            self.kv.wait([REMOTE_READY], self.timeout_s, lambda: "rank 0 did not make the remote a repository")
        node = self.cluster.node
        def uploaded(_done: int, _total: int) -> None:
            self.kv.add(progress_key(node), 1)
        copier = VersionCopier(store, dst, uploaded)
        for vid in unpushed_versions(self.plumbing, self.remote, self.branch):
            m = self.plumbing.manifest(vid)
            # the arrays this disk holds, whichever rank wrote them (ranks may change nodes between runs)
            copier.copy_arrays(m, keys=[k for k in m.arrays if k.split("/")[1] == vid
                                        and store.exists(f"{k}/zarr.json")])
            self.kv.set(pushed_key(node, vid), b"1")
        there = Plumbing(dst)
        tip = there.branch_tip(self.branch)
        if tip is not None and store.exists(f"versions/{tip}"):   # what the remote holds, as far as rank 0 pushed
            set_tracking_ref(store, self.remote, self.branch, tip)


def node_pusher(plumbing: Plumbing, remote: str, branch: str, keep_last: int | None, max_bytes: int | None,
                on_error: Callable[[CkptRepoError], None], protect: Callable[[], Iterable[str]], cluster: Cluster,
                timeout_s: float) -> BackgroundPusher:
    """A node leader's pusher on a node-local tier: rank 0's, gated on the other nodes; or a ``NodePusher``."""
    if cluster.kv.rank == 0:
        return BackgroundPusher(plumbing, remote, branch, keep_last, max_bytes, on_error, protect,
                                RemoteGate(cluster, remote, branch, timeout_s))
    return NodePusher(plumbing, remote, branch, keep_last, max_bytes, on_error, protect, cluster, timeout_s)


def finish_leftover(cluster: Cluster, pusher: BackgroundPusher | None, timeout_s: float) -> None:
    """At the start of a node-local tier: every node pushes what the last run left, and rank 0 the versions,
    before any rank loads (a rank's pieces may be on another node's disk, so on the remote or nowhere it can
    read). A failure fails every rank's start: the remote must be reachable to resume."""
    error = None
    if pusher is not None:
        pusher.wait()
        error = pusher.last_error
    _, refused = cluster.kv.arrive("leftover", timeout_s, {"error": error}, False, error is not None,
                                   "the push of what the last run left")
    if refused:
        rank, why = next((r, p["error"]) for r, p in enumerate(cluster.kv.payloads("leftover")) if p["error"])
        raise SnapshotFailedError(f"the versions the last run left unpushed could not be pushed (rank {rank}: "
                                  f"{why}); the remote must be reachable to resume a node-local tier")
    cluster.kv.forget("leftover", own_only=True)


def tier_pusher(plumbing: Plumbing, tier: LocalTier, branch: str, rank: int, world_size: int,
                on_error: Callable[[CkptRepoError], None], protect: Callable[[], Iterable[str]],
                cluster: Cluster | None = None, timeout_s: float = 600.0) -> BackgroundPusher | None:
    """A snapshotter's pusher for ``tier`` on ``branch``, once its remote is checked (``check_tier``, done by
    the cluster's start under torch.distributed). One pusher per repository: rank 0's pushes the versions;
    on node-local tiers, each other node's leader pushes its node's arrays (saving/_node_push.py); the other
    ranks have none."""
    if cluster is None:
        check_tier(plumbing, tier, world_size)
    max_bytes = tier.max_bytes_parsed or default_local_max_bytes(plumbing.store)
    pusher: BackgroundPusher | None
    if cluster is not None and cluster.multi_node and cluster.leader:
        pusher = node_pusher(plumbing, tier.push_to, branch, tier.keep_last, max_bytes, on_error, protect,
                             cluster, timeout_s)
    elif rank == 0:
        pusher = BackgroundPusher(plumbing, tier.push_to, branch, tier.keep_last, max_bytes, on_error, protect)
    else:
        return None
    if cluster is not None:   # the node's other ranks write about as much as its leader: the disk holds it all
        pusher.ranks_here = len(cluster.nodes[cluster.node])
    return pusher


__all__ = ["NodePusher", "RemoteGate", "finish_leftover", "node_pusher", "tier_pusher"]
