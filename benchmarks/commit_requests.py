"""What a distributed commit costs as the ranks grow: object-store requests per commit, and the training thread's
blocking per snapshot.

Each figure comes from N gloo ranks (forkserver children, ``init_method`` on 127.0.0.1), each with
``repo.snapshotter(parallel_layout=ParallelLayout(dp=N))`` over the same replicated state, so the writer
assignment spreads the tensors over the ranks and each rank writes distinct pieces.

A. Requests per commit. The repository is ``s3://BUCKET/repo`` on moto's S3 server (its own process, niced),
   reached by each rank through a counting proxy of its own (tests/support/s3proxy.py, "atomic" mode, as the
   tests use it), so each request is known by rank. After a warm-up snapshot, ``--commits`` snapshots each
   followed by ``wait()`` and a barrier (the state changes before each, so every commit writes data); the
   requests between the barriers are one commit's. Reported per commit (mean over the commits):

   * by method: PUT, GET, LIST (a GET with ``list-type``), HEAD, DELETE; writes = PUT + POST + DELETE;
   * by key under the repository: data/, staging/ (the commit handshake), versions/, refs/, other;
   * reads (GET, LIST, HEAD) by rank 0 and by all the other ranks together;
   * polling repeats: a GET or LIST that the same rank already made of the same key (a LIST: of the same
     prefix) within the same commit.

B. Blocking per snapshot on a local-directory repository: ``--blocking-warmup`` snapshots, then
   ``--blocking-reps`` more, each after a barrier and followed by ``wait()``, of a state of ``--tensors``
   small tensors (metadata dominates). Reported: the median of ``handle.stats.blocking_s`` on rank 0 and on
   the slowest rank, the median wall time of the ``snapshot()`` call, and, as the yardstick of what one
   small collective costs on this machine at this rank count, an ``all_gather_object`` of one integer.

Each rank count runs under ``--timeout`` seconds; whatever is still running then is killed, and the row says
so. Run it niced on a shared machine:

    nice python benchmarks/commit_requests.py
    nice python benchmarks/commit_requests.py --ranks 2,4,8 --blocking-ranks 2,4,8,16 --json out.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections import Counter
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, unquote

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from bench_common import report  # noqa: E402
from support.s3proxy import Request, S3Proxy  # noqa: E402

PREFIXES = ("data/", "staging/", "versions/", "refs/")
READS = ("GET", "LIST", "HEAD")
POLLS = ("GET", "LIST")
WRITES = ("PUT", "POST", "DELETE")
ROOT = "repo"
GROUP_TIMEOUT_S = 120.0
COMMIT_TIMEOUT_S = 120.0


# ---------------------------------------------------------------- the object store and its proxies

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_moto() -> tuple[subprocess.Popen, str]:
    """moto's S3 server on 127.0.0.1, niced, in a process of its own (its GIL not the proxies')."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              preexec_fn=lambda: os.nice(5))
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, f"http://127.0.0.1:{port}"
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                stop_process(server)
                raise RuntimeError("moto's S3 server did not start") from None
            time.sleep(0.2)


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class CountingProxy(S3Proxy):
    """The tests' proxy, also logging each request's arrival time and query (the LIST prefix is in it)."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream, mode="atomic")
        self.log: list[tuple[float, str, str, str]] = []

    def record(self, req: Request) -> bool:
        with self._lock:
            self.log.append((time.time(), req.method, req.path, req.query))
        return super().record(req)


def classify(method: str, path: str, query: str, bucket: str) -> tuple[str, str]:
    """(kind, key under the repository) of one request; a LIST's key is its prefix."""
    q = parse_qs(query, keep_blank_values=True)
    if method == "GET" and "list-type" in q:
        kind, key = "LIST", q.get("prefix", [""])[0]
    else:
        kind, key = method, unquote(path).lstrip("/")
        key = key[len(bucket) + 1:] if key.startswith(bucket + "/") else key
    key = key[len(ROOT) + 1:] if key.startswith(ROOT + "/") else key
    return kind, key


def area(key: str) -> str:
    return next((p for p in PREFIXES if key.startswith(p)), "other")


def tally(logs: list[list[tuple[float, str, str, str]]], start: float, end: float, bucket: str) -> dict[str, Any]:
    """The requests of every rank that arrived in ``(start, end]``, counted by kind, area and rank."""
    kinds: Counter[str] = Counter()
    areas: Counter[str] = Counter()
    reads_by_rank = [0] * len(logs)
    repeats = [0] * len(logs)
    seen_all: list[str] = []
    for r, log in enumerate(logs):
        seen: set[tuple[str, str]] = set()
        for t, method, path, query in log:
            if not start < t <= end:
                continue
            kind, key = classify(method, path, query, bucket)
            seen_all.append(f"{r} {kind} {key}")
            kinds[kind] += 1
            areas[area(key)] += 1
            if kind in READS:
                reads_by_rank[r] += 1
                if kind in POLLS and (kind, key) in seen:
                    repeats[r] += 1
                seen.add((kind, key))
    return {"total": sum(kinds.values()), "writes": sum(kinds[k] for k in WRITES), "kinds": dict(kinds),
            "areas": dict(areas), "reads_by_rank": reads_by_rank, "repeats_by_rank": repeats,
            "requests": seen_all}


# ---------------------------------------------------------------- rank processes

def _join(rank: int, world: int, port: int) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))


def _write(out: str, name: str, obj: Any) -> None:
    with open(os.path.join(out, name + ".tmp"), "w") as fh:
        json.dump(obj, fh)
    os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))


def _state(n: int, numel: int, seed: int) -> dict[str, Any]:
    import torch
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"layers.{i}.weight": torch.randn(numel, generator=g) for i in range(n)}, "step": 0}


def _bump(state: dict[str, Any]) -> None:
    import torch
    with torch.no_grad():
        for t in state["model"].values():
            t.add_(1.0)
    state["step"] += 1


def count_worker(rank: int, world: int, port: int, endpoints: list[str], url: str, commits: int, tensors: int,
                 out: str) -> None:
    """Warm up, then ``commits`` snapshots, each waited for and closed by a barrier; rank 0 writes the times."""
    try:
        os.environ["AWS_ENDPOINT_URL"] = endpoints[rank]   # this rank's own proxy
        import torch.distributed as dist

        import ckptrepo
        from ckptrepo.parallel.layout import ParallelLayout
        _join(rank, world, port)
        state = _state(tensors, 16384, 0)
        repo = ckptrepo.open(url)
        marks = []
        with repo.snapshotter(parallel_layout=ParallelLayout(dp=world), host_memory=64 << 20,
                              commit_timeout_s=COMMIT_TIMEOUT_S) as snap:
            snap.snapshot(state, step=0)
            snap.wait()
            dist.barrier()
            marks.append(time.time())
            for i in range(commits):
                _bump(state)
                snap.snapshot(state, step=i + 1)
                snap.wait()
                dist.barrier()
                marks.append(time.time())
        _write(out, f"count-{rank}.json", {"marks": marks})
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which stops the other ranks
        _write(out, f"error-{rank}.json", {"error": traceback.format_exc()})
        os._exit(1)


def blocking_worker(rank: int, world: int, port: int, url: str, warmup: int, reps: int, tensors: int,
                    out: str) -> None:
    """Snapshots of a small state, each after a barrier and waited for; this rank's timings of the measured ones."""
    try:
        import torch.distributed as dist

        import ckptrepo
        from ckptrepo.parallel.layout import ParallelLayout
        _join(rank, world, port)
        state = _state(tensors, 64, 0)
        repo = ckptrepo.open(url)
        rows = []
        with repo.snapshotter(parallel_layout=ParallelLayout(dp=world), host_memory=64 << 20,
                              commit_timeout_s=COMMIT_TIMEOUT_S) as snap:
            for i in range(warmup + reps):
                _bump(state)
                dist.barrier()
                t = time.perf_counter()   # the yardstick: one small collective on the same group
                dist.all_gather_object([None] * world, i)
                small = time.perf_counter() - t
                dist.barrier()
                t = time.perf_counter()
                handle = snap.snapshot(state, step=i)
                call = time.perf_counter() - t
                snap.wait()
                if i >= warmup:
                    rows.append({"blocking_s": handle.stats.blocking_s, "call_s": call,
                                 "total_s": handle.stats.total_s, "collective_s": small})
        _write(out, f"blocking-{rank}.json", {"rows": rows})
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        _write(out, f"error-{rank}.json", {"error": traceback.format_exc()})
        os._exit(1)


def run_ranks(ctx: Any, target: Any, world: int, args: tuple[Any, ...], out: str, timeout: float) -> str | None:
    """Run ``target(rank, world, port, *args, out)`` on ``world`` ranks; None, or why they failed. Every rank
    still alive at the deadline, or once one has failed, is killed."""
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, out), daemon=True) for r in range(world)]
    timed_out = False
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in procs) and not any(p.exitcode not in (None, 0) for p in procs):
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    if timed_out:
        return f"timed out after {timeout:.0f} s; every rank killed"
    # the first rank to fail is the cause; the others' errors are its consequences
    errors = sorted((os.path.getmtime(os.path.join(out, f)), f) for f in os.listdir(out) if f.startswith("error-"))
    if errors:
        with open(os.path.join(out, errors[0][1])) as fh:
            return f"{errors[0][1][:-5]}: {json.load(fh)['error'].strip().splitlines()[-1]}"
    if any(p.exitcode != 0 for p in procs):
        return f"exit codes {[p.exitcode for p in procs]}"
    return None


def context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", "torch", "torch.distributed", "ckptrepo", "ckptrepo.saving._capture",
                                "ckptrepo.parallel.layout"])
    return ctx


# ---------------------------------------------------------------- the two measurements

def measure_requests(ctx: Any, moto: str, world: int, commits: int, tensors: int, timeout: float) -> dict[str, Any]:
    import boto3

    import ckptrepo
    bucket = f"count-{world}-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=moto, region_name="us-east-1").create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/{ROOT}"
    ckptrepo.init(url)   # straight to moto: not counted
    proxies = [CountingProxy(moto) for _ in range(world)]
    try:
        for p in proxies:
            p.start()
        with tempfile.TemporaryDirectory(prefix="count-") as out:
            failed = run_ranks(ctx, count_worker, world, ([p.endpoint for p in proxies], url, commits, tensors),
                               out, timeout)
            if failed:
                return {"ranks": world, "error": failed}
            with open(os.path.join(out, "count-0.json")) as fh:
                marks = json.load(fh)["marks"]
    finally:
        for p in proxies:
            p.stop()
    logs = [list(p.log) for p in proxies]
    per_commit = [tally(logs, marks[k], marks[k + 1], bucket) for k in range(commits)]
    return {"ranks": world, "commits": commits, "tensors": tensors, "per_commit": per_commit,
            "commit_s": [marks[k + 1] - marks[k] for k in range(commits)],
            "after_last": tally(logs, marks[-1], float("inf"), bucket)["total"]}


def measure_blocking(ctx: Any, world: int, warmup: int, reps: int, tensors: int, timeout: float) -> dict[str, Any]:
    import ckptrepo
    with tempfile.TemporaryDirectory(prefix="blocking-") as work:
        url = os.path.join(work, "repo")
        ckptrepo.init(url)
        out = os.path.join(work, "out")
        os.mkdir(out)
        failed = run_ranks(ctx, blocking_worker, world, (url, warmup, reps, tensors), out, timeout)
        if failed:
            return {"ranks": world, "error": failed}
        rows = []
        for r in range(world):
            with open(os.path.join(out, f"blocking-{r}.json")) as fh:
                rows.append(json.load(fh)["rows"])
    med = [statistics.median(x["blocking_s"] for x in rank_rows) for rank_rows in rows]
    return {"ranks": world, "tensors": tensors, "reps": reps, "rows": rows,
            "blocking_s_rank0": med[0], "blocking_s_slowest": max(med),
            "call_s_rank0": statistics.median(x["call_s"] for x in rows[0]),
            "collective_s_rank0": statistics.median(x["collective_s"] for x in rows[0]),
            "commit_s_rank0": statistics.median(x["total_s"] for x in rows[0])}


# ---------------------------------------------------------------- tables

def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def requests_row(res: dict[str, Any]) -> list[str]:
    if "error" in res:
        return [str(res["ranks"]), f"failed: {res['error']}"]
    pc = res["per_commit"]

    def m(f: Any) -> str:
        return f"{_mean([f(c) for c in pc]):.1f}"
    return [str(res["ranks"]), m(lambda c: c["total"]), m(lambda c: c["writes"]),
            *(m(lambda c, k=k: c["kinds"].get(k, 0)) for k in ("PUT", "GET", "LIST", "HEAD", "DELETE")),
            *(m(lambda c, a=a: c["areas"].get(a, 0)) for a in (*PREFIXES, "other")),
            m(lambda c: c["reads_by_rank"][0]), m(lambda c: sum(c["reads_by_rank"][1:])),
            m(lambda c: sum(c["repeats_by_rank"])), m(lambda c: sum(c["repeats_by_rank"][1:])),
            f"{_mean(res['commit_s']):.2f}"]


def blocking_row(res: dict[str, Any]) -> list[str]:
    if "error" in res:
        return [str(res["ranks"]), f"failed: {res['error']}"]
    return [str(res["ranks"]), f"{res['blocking_s_rank0'] * 1e3:.1f}", f"{res['blocking_s_slowest'] * 1e3:.1f}",
            f"{res['call_s_rank0'] * 1e3:.1f}", f"{res['collective_s_rank0'] * 1e3:.1f}",
            f"{res['commit_s_rank0']:.2f}"]


def table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def print_tables(summary: dict[str, Any]) -> None:
    if summary["requests"]:
        c = summary["config"]
        print(f"\nA. Object-store requests per commit (mean of {c['commits']} commits; dp=N, {c['tensors']} tensors of "
              f"64 KiB replicated, moto behind one counting proxy per rank)\n")
        print(table(["ranks", "total", "writes", "PUT", "GET", "LIST", "HEAD", "DELETE", "data/", "staging/",
                     "versions/", "refs/", "other", "rank 0 reads", "other ranks' reads", "polling repeats",
                     "of them other ranks'", "commit s"],
                    [requests_row(r) for r in summary["requests"]]))
    if summary["blocking"]:
        c = summary["config"]
        print(f"\nB. Blocking per snapshot, local directory (median of {c['blocking_reps']} after "
              f"{c['blocking_warmup']} warm-up; dp=N, {c['blocking_tensors']} tensors of 256 B)\n")
        print(table(["ranks", "blocking ms, rank 0", "blocking ms, slowest rank", "snapshot() call ms, rank 0",
                     "one small all_gather_object ms, rank 0", "commit s, rank 0"],
                    [blocking_row(r) for r in summary["blocking"]]))


def ranks_list(text: str) -> list[int]:
    out = [int(x) for x in text.split(",") if x.strip()] if text.strip() else []
    if any(n < 2 for n in out):
        raise argparse.ArgumentTypeError("each rank count is at least 2")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=ranks_list, default=[2, 4, 8], help="rank counts of A (empty: skip A)")
    ap.add_argument("--blocking-ranks", type=ranks_list, default=[2, 4, 8, 16], help="rank counts of B")
    ap.add_argument("--commits", type=int, default=3, help="A: commits counted after the warm-up")
    ap.add_argument("--tensors", type=int, default=16, help="A: tensors in the state (64 KiB each)")
    ap.add_argument("--blocking-warmup", type=int, default=2)
    ap.add_argument("--blocking-reps", type=int, default=5)
    ap.add_argument("--blocking-tensors", type=int, default=100)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds each rank count may take")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the finally clauses kill the ranks and the server
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                      AWS_REGION="us-east-1")
    for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        os.environ.pop(k, None)
    ctx = context()
    summary: dict[str, Any] = {"config": {k: getattr(args, k) for k in (
        "commits", "tensors", "blocking_warmup", "blocking_reps", "blocking_tensors", "timeout")},
        "requests": [], "blocking": []}
    import ckptrepo
    summary["config"]["ckptrepo"] = os.path.dirname(os.path.abspath(ckptrepo.__file__))
    if args.ranks:
        server, moto = start_moto()
        os.environ["AWS_ENDPOINT_URL"] = moto   # the parent's own calls (init) go straight to moto
        try:
            for n in args.ranks:
                print(f"requests: {n} ranks ...", file=sys.stderr, flush=True)
                summary["requests"].append(measure_requests(ctx, moto, n, args.commits, args.tensors, args.timeout))
        finally:
            stop_process(server)
            os.environ.pop("AWS_ENDPOINT_URL", None)
    for n in args.blocking_ranks:
        print(f"blocking: {n} ranks ...", file=sys.stderr, flush=True)
        summary["blocking"].append(measure_blocking(ctx, n, args.blocking_warmup, args.blocking_reps,
                                                    args.blocking_tensors, args.timeout))
    return report(summary, print_tables, args.json)


if __name__ == "__main__":
    sys.exit(main())
