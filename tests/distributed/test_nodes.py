"""Two simulated nodes, each with its own local disk, in front of one shared remote.

Each job is two real torchrun agents (``--nnodes 2 --nproc-per-node 2``, c10d rendezvous on 127.0.0.1), each
given its own local directory; the shared remote is a third directory. Every rank runs
tests/support/node_workers.py: its node's local repository, a snapshotter that pushes to the remote, a load on
a restart. The c10d rendezvous gives node ranks as it likes, so a node's ranks are read from the workers'
reports, never assumed from the order the agents start in.

A node's local data must hold only the arrays of the ranks that ran on it (it wrote at local-disk speed), the
remote every version bit-exact once ``wait()`` returns; a job whose node dies mid-push ends on every node
within a bound, and a restart of both nodes, or one after a node's disk was wiped, loads the last version
bit-exact and goes on. Two agents sharing one local directory keep working as one node does.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support.helpers import assert_bit_exact
from support.node_workers import HOOK_NOT_FIRED, full_state

import ckptrepo

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "support" / "node_workers.py"
JOB_TIMEOUT_S = 180      # a whole job, both agents: far beyond a healthy one's
DEATH_BOUND_S = 90       # a survivor's exit after its peer node died: the commit timeout (20 s) and slack
NOISE = ("frame #", "<omitting python frames>", "Exception raised from")


@dataclass
class Agent:
    """One torchrun agent: its process (a session of its own, so that its workers die with it) and its output."""

    node: Path
    proc: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        """The tail of the agent's output, without the C++ stack frames c10d prints for a broken connection."""
        lines = [line for line in self.log.read_text(errors="replace").splitlines()
                 if not line.lstrip().startswith(NOISE)]
        return f"--- agent for {self.node.name} (exit {self.proc.returncode}) ---\n" + "\n".join(lines)[-6000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_job(tmp_path: Path, nodes: list[Path], remote: Path, run: str, *worker_args: str,
              per_node: dict[Path, list[str]] | None = None) -> list[Agent]:
    """Start one torchrun agent per node directory (two ranks each); ``per_node`` adds arguments to one's
    workers. Reports go to ``tmp_path/run``."""
    report = tmp_path / run
    report.mkdir()
    port, job = _free_port(), f"{run}-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    agents: list[Agent] = []
    try:
        for k, node in enumerate(nodes):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                   "--node-rank", str(k), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                   "--rdzv-id", job, "--max-restarts", "0", "--local-addr", "127.0.0.1",
                   str(WORKER), "--node-dir", str(node), "--remote", str(remote), "--report", str(report),
                   *worker_args, *(per_node or {}).get(node, [])]
            log = tmp_path / f"{run}-agent{k}.log"
            with open(log, "wb") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                        start_new_session=True)
            agents.append(Agent(node, proc, log))
    except BaseException:
        for a in agents:
            a.kill()
        raise
    return agents


def finish(agents: list[Agent], timeout_s: float = JOB_TIMEOUT_S) -> None:
    """Wait for every agent to exit (killing them all past ``timeout_s``); assert each succeeded."""
    deadline = time.monotonic() + timeout_s
    try:
        for a in agents:
            try:
                a.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the job did not end within {timeout_s} s\n"
                                     + "\n".join(b.output() for b in agents)) from None
    finally:
        for a in agents:
            a.kill()
    assert all(a.proc.returncode == 0 for a in agents), "\n".join(a.output() for a in agents)


def run_job(tmp_path: Path, nodes: list[Path], remote: Path, run: str, *worker_args: str) -> dict[int, dict[str, Any]]:
    """One job to its end; every rank's report, by global rank."""
    finish(start_job(tmp_path, nodes, remote, run, *worker_args))
    return reports(tmp_path / run)


def reports(folder: Path) -> dict[int, dict[str, Any]]:
    out = {}
    for f in folder.glob("rank*.json"):
        r = json.loads(f.read_text())
        out[r["rank"]] = r
    assert sorted(out) == [0, 1, 2, 3], f"reports from ranks {sorted(out)} only"
    return out


def ranks_by_node(reps: dict[int, dict[str, Any]]) -> dict[str, set[int]]:
    """The global ranks that ran with each node directory: two, of one torchrun node (GROUP_RANK)."""
    out: dict[str, set[int]] = {}
    for r, rep in reps.items():
        out.setdefault(rep["node"], set()).add(r)
    for node, ranks in out.items():
        groups = {reps[r]["group_rank"] for r in ranks}
        assert len(ranks) == 2 and len(groups) == 1, f"{node}: ranks {sorted(ranks)} of nodes {sorted(groups)}"
    return out


def data_ranks(node: Path) -> dict[str, set[int]]:
    """The ranks whose arrays a node's local repository holds, per version: ``data/<version>/<rank>/<dtype>``."""
    data = node / "data"
    if not data.is_dir():
        return {}
    return {v.name: {int(r.name) for r in v.iterdir() if r.is_dir()} for v in data.iterdir() if v.is_dir()}


def assert_holds_only(node: Path, ranks: set[int]) -> None:
    """Every version's local data on ``node`` is of ``ranks`` alone, and at least one version's of each."""
    held = data_ranks(node)
    assert held, f"{node} holds no data"
    strays = {v: sorted(rs - ranks) for v, rs in held.items() if rs - ranks}
    assert not strays, f"{node.name} (ranks {sorted(ranks)}) holds arrays of other ranks: {strays}"
    assert set().union(*held.values()) == ranks, f"{node.name}: arrays of ranks {held}, expected {sorted(ranks)}"


def assert_remote_holds(remote: Path, steps: list[int]) -> ckptrepo.Repository:
    """``main`` on the remote is exactly ``steps`` (oldest first), each loading whole and bit-exact."""
    repo = ckptrepo.open(str(remote))
    log = repo.log("main")
    assert [v.step for v in log] == steps[::-1]
    for v in log:
        assert_bit_exact(repo.load(v.id), full_state(v.step))
    return repo


def assert_loaded(reps: dict[int, dict[str, Any]], step: int) -> None:
    for r, rep in sorted(reps.items()):
        assert rep.get("loaded_step") == step and rep["load_error"] is None, (
            f"rank {r} loaded step {rep.get('loaded_step')}: {rep.get('load_error')}")


def _dirs(tmp_path: Path) -> tuple[Path, Path, Path]:
    return tmp_path / "node0", tmp_path / "node1", tmp_path / "remote"


def test_two_nodes_with_their_own_disks_commit_push_and_load(tmp_path):
    node0, node1, remote = _dirs(tmp_path)
    reps = run_job(tmp_path, [node0, node1], remote, "run1", "--steps", "1,2,3")
    placed = ranks_by_node(reps)
    repo = assert_remote_holds(remote, [1, 2, 3])
    tip = repo.resolve("main")
    for node in (node0, node1):   # each rank wrote its arrays on its own node's disk
        assert_holds_only(node, placed[str(node)])
        assert ckptrepo.open(str(node)).resolve("main") == tip
        report = ckptrepo.open(str(node)).fsck()   # the other nodes' arrays: checked on the remote
        assert report.ok, report.errors
    after_wait = {r: rep["main"] for r, rep in reps.items()}
    step3 = repo.log("main")[0].id
    for node in (node0, node1):   # the restart below finds each rank's step-3 arrays on its own disk
        assert data_ranks(node)[step3] == placed[str(node)]

    reps = run_job(tmp_path, [node0, node1], remote, "run2", "--load", "3", "--steps", "4")
    assert_loaded(reps, 3)
    assert_remote_holds(remote, [1, 2, 3, 4])
    for node, ranks in ranks_by_node(reps).items():
        assert_holds_only(Path(node), ranks | placed[node])
    # as in one shared repository: once wait() returns on a rank, its node's branch names what was committed
    stale = {r: vid[:12] for r, vid in after_wait.items() if vid != tip}
    assert not stale, f"after wait(), ranks' own repositories named another tip than {tip[:12]}: {stale}"


def test_a_node_killed_mid_push_then_both_restart(tmp_path):
    node0, node1, remote = _dirs(tmp_path)
    agents = start_job(tmp_path, [node0, node1], remote, "run1", "--steps", "1,2,3", "--wait-after", "2",
                       per_node={node1: ["--kill-before", "3"]})
    survivor, victim = agents
    try:
        try:   # the victim's ranks die at their first array pushed of step 3, and so its agent
            victim.proc.wait(JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError("the victim's agent never died\n" + victim.output() + survivor.output()) from None
        log = victim.log.read_text()   # torchrun's summary names the signal that ended a rank
        assert victim.proc.returncode != 0 and "(SIGKILL)" in log and f"exitcode  : {HOOK_NOT_FIRED}" not in log, (
            "the victim's ranks were not killed at push_after_array\n" + victim.output() + survivor.output())
        try:   # no distributed wait without a deadline: the surviving node ends too, and says it failed
            survivor.proc.wait(DEATH_BOUND_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the surviving agent still runs {DEATH_BOUND_S} s after its peer died\n"
                                 + survivor.output()) from None
        assert survivor.proc.returncode != 0, survivor.output()
    finally:
        for a in agents:
            a.kill()
    for node in (node0, node1):   # step 3 is committed on the nodes, not on the remote yet: no damage
        report = ckptrepo.open(str(node)).fsck()
        assert report.ok, report.errors
        assert any("not on remote 'origin' yet" in w for w in report.warnings), report.warnings

    reps = run_job(tmp_path, [node0, node1], remote, "run2", "--load", "3", "--steps", "4")
    assert_loaded(reps, 3)
    assert_remote_holds(remote, [1, 2, 3, 4])


def test_a_restart_after_one_node_disk_was_wiped(tmp_path):
    node0, node1, remote = _dirs(tmp_path)
    run_job(tmp_path, [node0, node1], remote, "run1", "--steps", "1,2")
    shutil.rmtree(node1)

    reps = run_job(tmp_path, [node0, node1], remote, "run2", "--load", "2", "--steps", "3")
    assert any(rep.get("created") for rep in reps.values() if rep["node"] == str(node1))
    assert_loaded(reps, 2)
    repo = assert_remote_holds(remote, [1, 2, 3])
    step3 = repo.log("main")[0].id
    on_node1 = ranks_by_node(reps)[str(node1)]
    assert_holds_only(node1, on_node1)
    assert data_ranks(node1)[step3] == on_node1


def test_each_node_evicts_its_own_pushed_data_and_every_version_still_loads(tmp_path):
    node0, node1, remote = _dirs(tmp_path)
    reps = run_job(tmp_path, [node0, node1], remote, "run1", "--steps", "1,2,3,4", "--wait-after", "1,2,3",
                   "--keep-last", "1")
    repo = assert_remote_holds(remote, [1, 2, 3, 4])
    newest = repo.log("main")[0].id
    for node, ranks in ranks_by_node(reps).items():   # older versions' arrays left each node once pushed
        assert data_ranks(Path(node)) == {newest: ranks}, (node, data_ranks(Path(node)))
        here = ckptrepo.open(node)
        for v in here.log("main"):   # what a node evicted, or never held, is read from the remote
            assert_bit_exact(here.load(v.id), full_state(v.step))


def test_two_agents_sharing_one_directory_still_work(tmp_path):
    shared, _, remote = _dirs(tmp_path)
    ckptrepo.init(str(shared)).remote_add("origin", str(remote))   # one shared filesystem, set up once
    reps = run_job(tmp_path, [shared, shared], remote, "run1", "--steps", "1,2")
    assert {r for r, rep in reps.items() if rep["node"] == str(shared)} == {0, 1, 2, 3}
    repo = assert_remote_holds(remote, [1, 2])
    assert ckptrepo.open(str(shared)).resolve("main") == repo.resolve("main")

    reps = run_job(tmp_path, [shared, shared], remote, "run2", "--load", "2", "--steps", "3")
    assert_loaded(reps, 2)
    repo = assert_remote_holds(remote, [1, 2, 3])
    assert ckptrepo.open(str(shared)).resolve("main") == repo.resolve("main")
