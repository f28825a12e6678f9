"""Resharding loads: a tensor-parallel state saved on one mesh, loaded on another, ckptrepo against torch DCP.

The state is a stack of ``--layers`` MLP blocks parallelised with
``parallelize_module`` (``up``: ColwiseParallel, so its weight is split by
rows; ``down``: RowwiseParallel, its weight split by columns and its bias
replicated; a LayerNorm whose parameters are replicated DTensors) plus an
Adam-like optimizer state (``exp_avg``/``exp_avg_sq`` DTensors with each
parameter's placements, a step counter): fp32 throughout, about ``--size-mb``
MiB in all. Values are a function of each element's global index, so every
rank can check what it loaded without a collective.

Each mesh size saves the state once with each method (every rank calls
``repo.snapshot(state)``; ``dcp.save(state)``), then, for each layout change
(``--cases``, default 2->4, 2->1, 4->2), fresh target processes (a new set
per method and repetition, so neither method warms anything up for the
other) load it into zero-filled state of their own mesh (DTensors; plain full
tensors in a single process without a process group):
``repo.load("HEAD", into=state)`` or ``dcp.load(state)``. Repetitions
alternate the order of the methods; the fastest load of each is reported.

Measured, per method and layout change:

* cold s: wall time of the load call, the maximum over ranks (they start together after a barrier);
  the page cache of the checkpoint's files is dropped first (fsync + ``posix_fadvise(DONTNEED)``);
* warm s: the same with the checkpoint's files read into the page cache first (CPU cost, not the disk's);
* disk floor s: the bytes needed at this disk's cold read rate, measured on the saved files (evicted,
  read by 4 threads with 1 MiB preads): no cold load can be faster. When both methods read about the
  needed bytes, a cold load time ratio below 0.5 is out of reach of any reader once DCP is within 2x
  of the floor;
* bytes needed: the bytes of every rank's local shards (replicas included: each rank fills its own);
* bytes read: the sum over ranks of the ``rchar`` delta of ``/proc/self/io`` around the load call,
  i.e. every byte the process got from read()/pread()/preadv() system calls (all threads, page cache
  hits included; the few KB of DCP's collectives over gloo sockets included too). Both methods are
  counted this way. For ckptrepo also TensorStore's own kvstore counters
  (``ckptrepo.loading._engine.kvstore_bytes_read()``), which count the same file reads from the inside.

Every load is checked bit-exact against the expected values.

What to expect: DCP reads every saved chunk it needs any part of, whole.
ckptrepo reads byte ranges, in units of verified 64 KiB inner chunks (each
carries a crc32c); pieces split along a non-leading dimension (the
RowwiseParallel weights and their moments) are saved as column blocks, so a
load with more tensor-parallel ranks reads whole contiguous blocks instead of
short runs out of every row.

``--lazy-narrow`` measures another case instead, in one process: weights with narrow rows (``--narrow-cols``
fp32 columns, 1 KiB rows by default) saved by one process that names its layout, a row-parallel split (dim 1)
and, as the peer, a column split (dim 0) of the same shapes, read from a lazy clone (the remote a local
directory, counted by TensorStore's kvstore metrics: what would cross the network) by every rank of tp=2 and
tp=4 in turn, then whole by one process (rows put back together from column blocks, warm). Bytes read over
bytes needed, and the fastest of ``--repeat`` for the times.

Run it as

    python benchmarks/reshard.py                       # ~256 MiB state, 2 repetitions (~2 min on 2 cores)
    python benchmarks/reshard.py --size-mb 32 --repeat 1 --json out.json
    python benchmarks/reshard.py --lazy-narrow --size-mb 64 --repeat 3
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any

import torch
from bench_common import report  # noqa: E402 - run as a script from benchmarks/

MiB = 1 << 20
TARGET_READ_RATIO = 1.1     # bytes read <= 1.1x the bytes needed
TARGET_TIME_RATIO = 0.5     # ckptrepo load time <= 0.5x DCP's
METHODS = ("dcp", "ckptrepo")
METHOD_NAMES = {"dcp": "torch DCP", "ckptrepo": "ckptrepo"}

# ---------------------------------------------------------------- the state


def hidden_size(size_mb: float, layers: int) -> int:
    """The hidden size (a multiple of 32) whose params + two Adam moments (fp32) come closest to ``size_mb``."""
    best = None
    for d in range(32, 16385, 32):
        nbytes = 3 * 4 * layers * (8 * d * d + 8 * d)
        err = abs(nbytes - size_mb * MiB)
        if best is None or err < best[0]:
            best = (err, d)
    return best[1]


def values(seed: int, gshape: tuple[int, ...], box: tuple[tuple[int, ...], tuple[int, ...]]) -> torch.Tensor:
    """The expected float32 values of ``box`` of global tensor ``seed``: exact, from each element's global index."""
    offs, sizes = box
    idx = torch.zeros((), dtype=torch.int64)
    stride = 1
    for d in range(len(gshape) - 1, -1, -1):
        ax = torch.arange(offs[d], offs[d] + sizes[d], dtype=torch.int64) * stride
        idx = ax.view([-1] + [1] * (len(gshape) - 1 - d)) + idx
        stride *= gshape[d]
    idx = idx.reshape(sizes)
    return ((idx * 2654435761 + seed * 40503) % (1 << 24)).to(torch.float32).div_(1 << 24).sub_(0.5)


def build_model(d: int, layers: int) -> torch.nn.Module:
    from torch import nn
    blocks = nn.ModuleList()
    for _ in range(layers):
        blocks.append(nn.ModuleDict({"up": nn.Linear(d, 4 * d), "down": nn.Linear(4 * d, d), "norm": nn.LayerNorm(d)}))
    return blocks


def parallel_state(mesh: Any, d: int, layers: int, fill: bool) -> dict[str, Any]:
    """The model parallelised over ``mesh`` and its Adam-like state; expected values if ``fill``, else zeros."""
    from torch import nn
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    with torch.device("meta"):
        model = build_model(d, layers)
    model = model.to_empty(device="cpu")
    plan = {}
    for i in range(layers):
        plan[f"{i}.up"] = ColwiseParallel()
        plan[f"{i}.down"] = RowwiseParallel()
    parallelize_module(model, mesh, plan, src_data_rank=None)   # every rank keeps its own chunk: no traffic
    for blk in model:
        norm = blk["norm"]
        for name, p in list(norm.named_parameters()):
            setattr(norm, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()], src_data_rank=None)))
    msd = model.state_dict()
    state: dict[str, Any] = {"model": msd, "optim": {"state": {}, "step": 1000 if fill else 0}}
    for k, (name, p) in enumerate(msd.items()):
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        box = (tuple(offset), tuple(shape))
        moments = {}
        for j, what in enumerate(("param", "exp_avg", "exp_avg_sq")):
            local = values(3 * k + j, tuple(p.shape), box) if fill else torch.zeros(shape)
            if what == "param":
                with torch.no_grad():
                    p.to_local().copy_(local)
            else:
                moments[what] = DTensor.from_local(local, mesh, p.placements, run_check=False, shape=p.shape,
                                                   stride=p.stride())
        state["optim"]["state"][name] = moments
    return state


def plain_state(d: int, layers: int) -> dict[str, Any]:
    """The full state as plain tensors (zeros), for a single process."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in build_model(d, layers).state_dict().items()}
    msd = {k: torch.zeros(s) for k, s in shapes.items()}
    return {"model": msd, "optim": {"state": {k: {"exp_avg": torch.zeros(v.shape), "exp_avg_sq": torch.zeros(v.shape)}
                                              for k, v in msd.items()}, "step": 0}}


def check(state: dict[str, Any]) -> int:
    """Assert every local shard holds the expected values; return the bytes this rank holds."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    nbytes = 0
    for k, name in enumerate(state["model"]):
        for j, t in enumerate((state["model"][name], state["optim"]["state"][name]["exp_avg"],
                               state["optim"]["state"][name]["exp_avg_sq"])):
            if isinstance(t, DTensor):
                shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
                local = t.to_local()
            else:
                shape, offset, local = tuple(t.shape), (0,) * t.dim(), t
            want = values(3 * k + j, tuple(t.shape), (tuple(offset), tuple(shape)))
            if not torch.equal(local, want):
                raise AssertionError(f"{name} (moment {j}): loaded values differ from the saved ones")
            nbytes += local.numel() * local.element_size()
    assert state["optim"]["step"] == 1000, state["optim"]["step"]
    return nbytes


# ---------------------------------------------------------------- measurement helpers


def rchar() -> int:
    """Bytes this process (all threads) got from read-type system calls so far (/proc/self/io)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def evict(path: str) -> int:
    """fsync and drop from the page cache every file under ``path``; return their total size."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


def _files(path: str) -> list[str]:
    return sorted(os.path.join(root, f) for root, _, files in os.walk(path) for f in files)


def warm(path: str) -> int:
    """Read every file under ``path`` once, so that it sits in the page cache; return their total size."""
    total = 0
    for name in _files(path):
        with open(name, "rb") as f:
            while chunk := f.read(8 << 20):
                total += len(chunk)
    return total


def disk_read_gbps(path: str, threads: int = 4, block: int = 1 << 20) -> float:
    """This disk's cold read throughput (GB/s) on the files under ``path``: evicted, then read whole by
    ``threads`` threads with ``block``-byte preads (the best of a few settings tried on the test machine)."""
    from concurrent.futures import ThreadPoolExecutor
    evict(path)
    jobs = []
    for name in _files(path):
        size = os.path.getsize(name)
        jobs.extend((name, off, min(block, size - off)) for off in range(0, size, block))

    def read(job: tuple[str, int, int]) -> int:
        fd = os.open(job[0], os.O_RDONLY)
        try:
            return len(os.pread(fd, job[2], job[1]))
        finally:
            os.close(fd)

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        total = sum(ex.map(read, jobs))
    return total / (time.perf_counter() - t) / 1e9


def read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


# ---------------------------------------------------------------- workers


def _init(rank: int, world: int, port: int) -> Any:
    torch.set_num_threads(1)
    if world == 1:
        return None
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    return init_device_mesh("cpu", (world,))


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist
        dist.barrier()


def _result(out: str, name: str, obj: Any) -> None:
    with open(os.path.join(out, name), "w") as f:
        json.dump(obj, f)


def save_worker(rank: int, world: int, port: int, work: str, d: int, layers: int, out: str) -> None:
    try:
        import torch.distributed.checkpoint as dcp

        import ckptrepo
        mesh = _init(rank, world, port)
        state = parallel_state(mesh, d, layers, fill=True)
        res: dict[str, Any] = {}
        _barrier(world)
        t = time.perf_counter()
        ckptrepo.open(os.path.join(work, f"ckptrepo-{world}")).snapshot(state, step=1000)
        res["ckptrepo_save_s"] = time.perf_counter() - t
        _barrier(world)
        t = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=os.path.join(work, f"dcp-{world}"))
        res["dcp_save_s"] = time.perf_counter() - t
        _barrier(world)
        _result(out, f"save-{world}-{rank}.json", res)
        if world > 1:
            import torch.distributed as dist
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        _result(out, f"error-save-{world}-{rank}.json", {"error": traceback.format_exc()})
        os._exit(1)


def load_worker(rank: int, world: int, port: int, work: str, src: int, method: str, cold: bool, d: int, layers: int,
                out: str) -> None:
    """Load the version saved from ``src`` ranks with ``method`` (fresh processes per method: no shared warm-up).

    ``cold``: the checkpoint's files are dropped from the page cache first; else they are read into it first.
    """
    try:
        import torch.distributed.checkpoint as dcp

        import ckptrepo

        # ckptrepo imports its load machinery at the first load (so `import ckptrepo` stays light for the CLI);
        # import it here, as the line above imports DCP's, so that neither timed call pays for imports. Where
        # no .pyc can be cached (PYTHONDONTWRITEBYTECODE, as on our machines) that is 35-55 ms of compiling.
        import ckptrepo.loading._binding  # noqa: F401
        import ckptrepo.loading._layout_load  # noqa: F401
        import ckptrepo.loading._reader  # noqa: F401
        import ckptrepo.loading._reshard  # noqa: F401
        from ckptrepo.loading._engine import ReadStats, kvstore_bytes_read
        mesh = _init(rank, world, port)
        path = os.path.join(work, f"{method}-{src}")
        state = parallel_state(mesh, d, layers, fill=False) if world > 1 else plain_state(d, layers)
        _barrier(world)
        if rank == 0:
            evict(path) if cold else warm(path)
        _barrier(world)
        stats = ReadStats()
        c0, k0, t0 = rchar(), kvstore_bytes_read(), time.perf_counter()
        if method == "ckptrepo":
            ckptrepo.open(path).load("HEAD", into=state, read_stats=stats)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(state, checkpoint_id=path)
        t1, c1, k1 = time.perf_counter(), rchar(), kvstore_bytes_read()
        _barrier(world)
        needed = check(state)
        _result(out, f"load-{src}-{world}-{method}-{int(cold)}-{rank}.json", {
            "load_s": t1 - t0, "rchar": c1 - c0, "kvstore": k1 - k0, "needed": needed,
            "needed_ckptrepo": stats.needed_bytes, "requested_ckptrepo": stats.requested_bytes})
        if world > 1:
            import torch.distributed as dist
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        _result(out, f"error-load-{src}-{world}-{method}-{int(cold)}-{rank}.json", {"error": traceback.format_exc()})
        os._exit(1)


# ---------------------------------------------------------------- driver


def _context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", "torch", "torch.distributed.checkpoint",
                                "torch.distributed.tensor.parallel", "ckptrepo", "ckptrepo.saving._capture",
                                "ckptrepo.loading._layout_load"])
    return ctx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(ctx: Any, target: Any, world: int, *args: Any, timeout: float = 600.0) -> None:
    port = _free_port()
    out = args[-1]
    procs = [ctx.Process(target=target, args=(r, world, port) + args) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if any(p.exitcode != 0 for p in procs):
        errs = [read_json(os.path.join(out, f))["error"] for f in sorted(os.listdir(out)) if f.startswith("error-")]
        raise RuntimeError(f"{target.__name__} over {world} ranks failed: exit codes {[p.exitcode for p in procs]}\n"
                           + "\n".join(errs))


def parse_cases(text: str) -> list[tuple[int, int]]:
    cases = []
    for part in text.split(","):
        a, b = part.split("->")
        cases.append((int(a), int(b)))
    for a, _ in cases:
        if a < 2:
            raise SystemExit(f"--cases: the saving mesh needs at least 2 ranks (got {a})")
    return cases


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ckptrepo
    cases = parse_cases(args.cases)
    d = hidden_size(args.size_mb, args.layers)
    nbytes = 3 * 4 * args.layers * (8 * d * d + 8 * d)
    print(f"state: {args.layers} MLP blocks, d={d} (up {4 * d}x{d} colwise, down {d}x{4 * d} rowwise, LayerNorm "
          f"replicated) + exp_avg/exp_avg_sq: {nbytes / MiB:.1f} MiB fp32", flush=True)
    base = args.dir or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix="ckptrepo-reshard-", dir=base)
    out = os.path.join(work, "results")
    os.makedirs(out)
    ctx = _context()
    summary: dict[str, Any] = {"state_bytes": nbytes, "d": d, "layers": args.layers, "cpus": os.cpu_count(),
                               "torch": torch.__version__, "saves": {}, "cases": []}
    t_start = time.perf_counter()
    try:
        for src in sorted({a for a, _ in cases}):
            ckptrepo.init(os.path.join(work, f"ckptrepo-{src}"))
            t = time.perf_counter()
            run_ranks(ctx, save_worker, src, work, d, args.layers, out)
            res = [read_json(os.path.join(out, f"save-{src}-{r}.json")) for r in range(src)]
            summary["saves"][src] = {m: {"save_s": max(r[f"{m}_save_s"] for r in res),
                                         "on_disk_bytes": dir_bytes(os.path.join(work, f"{m}-{src}"))}
                                     for m in METHODS}
            s = summary["saves"][src]
            print(f"  saved from {src} ranks in {time.perf_counter() - t:.1f}s: "
                  + ", ".join(f"{METHOD_NAMES[m]} {s[m]['save_s']:.2f}s {s[m]['on_disk_bytes'] / MiB:.1f} MiB on disk"
                              for m in METHODS), flush=True)
        summary["disk_gbps"] = max(disk_read_gbps(os.path.join(work, f"ckptrepo-{src}"))
                                   for src in sorted({a for a, _ in cases}) for _ in range(2))
        print(f"  this disk reads {summary['disk_gbps']:.2f} GB/s cold (4 threads, 1 MiB preads)", flush=True)
        for src, dst in cases:
            best: dict[str, dict[str, Any]] = {}
            for rep in range(args.repeat):
                secs = {}
                for m in (METHODS if rep % 2 == 0 else METHODS[::-1]):
                    for cold in (True, False):
                        run_ranks(ctx, load_worker, dst, work, src, m, cold, d, args.layers, out)
                        res = [read_json(os.path.join(out, f"load-{src}-{dst}-{m}-{int(cold)}-{r}.json"))
                               for r in range(dst)]
                        secs[m, cold] = load_s = max(r["load_s"] for r in res)
                        if not cold:
                            best[m]["warm_s"] = min(best[m].get("warm_s", load_s), load_s)
                            continue
                        row = {"load_s": load_s,
                               "needed": sum(r["needed"] for r in res),
                               "read": sum(r["rchar"] for r in res),
                               "kvstore": sum(r["kvstore"] for r in res) if m == "ckptrepo" else None,
                               "requested": sum(r["requested_ckptrepo"] for r in res) if m == "ckptrepo" else None,
                               "per_rank_s": [r["load_s"] for r in res]}
                        if m == "ckptrepo":
                            assert row["needed"] == sum(r["needed_ckptrepo"] for r in res), "ReadStats disagrees"
                        if m not in best or row["load_s"] < best[m]["load_s"]:
                            best[m] = {**row, **({"warm_s": best[m]["warm_s"]} if m in best else {})}
                print(f"  {src}->{dst} rep {rep + 1}/{args.repeat}: "
                      + ", ".join(f"{METHOD_NAMES[m]} {secs[m, True]:.2f}s cold {secs[m, False]:.2f}s warm"
                                  for m in METHODS) + " (bit-exact)", flush=True)
            needed = best["ckptrepo"]["needed"]
            summary["cases"].append({"src": src, "dst": dst, "methods": best,
                                     "disk_floor_s": needed / (summary["disk_gbps"] * 1e9),
                                     "time_ratio": best["ckptrepo"]["load_s"] / best["dcp"]["load_s"],
                                     "warm_time_ratio": best["ckptrepo"]["warm_s"] / best["dcp"]["warm_s"]})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary["wall_s"] = time.perf_counter() - t_start
    return summary


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:.1f}"


def lazy_narrow(args: argparse.Namespace) -> dict[str, Any]:
    """Narrow-row weights from a lazy clone: bytes each tensor-parallel rank reads, row split against column split."""
    import ckptrepo
    from ckptrepo.loading._engine import kvstore_bytes_read
    from ckptrepo.parallel.layout import ParallelLayout
    from ckptrepo.rules import Rules, Split
    cols = args.narrow_cols
    rows = max(1024, int(args.size_mb * MiB / 8 / (cols * 4)) // 1024 * 1024)   # 4 row-split + 4 column-split
    g = torch.Generator().manual_seed(0)
    names = {"row": [f"l{i}.row.weight" for i in range(4)], "col": [f"l{i}.col.weight" for i in range(4)]}
    full = {n: torch.randn(rows, cols, generator=g) for ns in names.values() for n in ns}
    rules = Rules([("*.row.weight", Split(1)), ("*.col.weight", Split(0))])
    work = tempfile.mkdtemp(prefix="ckptrepo-narrow-", dir=args.dir)
    try:
        ckptrepo.init(os.path.join(work, "src")).snapshot({"model": full}, step=1,
                                                          parallel_layout=ParallelLayout(rules=rules))
        lazy = ckptrepo.clone(os.path.join(work, "src"), os.path.join(work, "lazy"), lazy=True)
        out: dict[str, Any] = {"rows": rows, "cols": cols, "nbytes": sum(t.nbytes for t in full.values()), "cases": []}
        for split, dim in (("row", 1), ("col", 0)):
            for tp in (2, 4):
                read = needed = 0
                best = float("inf")
                for k in range(args.repeat):
                    t_all = 0.0
                    for rank in range(tp):
                        want = {n: full[n].chunk(tp, dim=dim)[rank] for n in names[split]}
                        into = {"model": {n: torch.empty_like(w) for n, w in want.items()}}
                        before = kvstore_bytes_read()
                        t = time.perf_counter()
                        lazy.load("HEAD", parallel_layout=ParallelLayout(tp=tp, rules=rules), rank=rank, into=into)
                        t_all += time.perf_counter() - t
                        if k == 0:
                            read += kvstore_bytes_read() - before
                            needed += sum(w.nbytes for w in want.values())
                        assert all(torch.equal(into["model"][n], w) for n, w in want.items())
                    best = min(best, t_all)
                out["cases"].append({"split": split, "tp": tp, "read": read, "needed": needed, "load_s": best})
        best = float("inf")
        for _ in range(args.repeat):
            t = time.perf_counter()
            back = lazy.load("HEAD")["model"]
            best = min(best, time.perf_counter() - t)
            assert all(torch.equal(back[n], v) for n, v in full.items())
        out["whole_s"] = best
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def print_narrow(summary: dict[str, Any]) -> None:
    print(f"lazy clone, 4 row-split + 4 column-split fp32 weights of {summary['rows']}x{summary['cols']} "
          f"({summary['cols'] * 4} B rows), {summary['nbytes'] / MiB:.0f} MiB in all")
    print(f"{'split':<8} {'tp':>3} {'needed MiB':>11} {'read MiB':>9} {'read/needed':>12} {'all ranks s':>12}")
    for c in summary["cases"]:
        print(f"{c['split']:<8} {c['tp']:>3} {c['needed'] / MiB:>11.1f} {c['read'] / MiB:>9.1f} "
              f"{c['read'] / c['needed']:>12.2f} {c['load_s']:>12.3f}")
    print(f"whole state into one process (rows from column blocks, warm): {summary['whole_s']:.3f} s")


def print_table(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title=f"resharding loads of a {summary['state_bytes'] / MiB:.0f} MiB tensor-parallel state "
                        f"({summary['layers']} MLP blocks, d={summary['d']}, params + Adam moments, fp32)",
                  caption=f"cold s: wall time of the load call, max over ranks, page cache dropped before the load; "
                          f"warm s: the same with the files in the page cache. disk floor: the needed bytes at this "
                          f"disk's cold read rate ({summary['disk_gbps']:.2f} GB/s, 4 threads x 1 MiB preads), the "
                          f"least any cold load can take. needed: every rank's local shards (replicas included). "
                          f"read: sum over ranks of the rchar delta in /proc/self/io around the cold load (read "
                          f"syscalls, all threads); TS counters: TensorStore's kvstore bytes_read plus the direct "
                          f"path's. MiB = 2^20 bytes. {summary['cpus']} CPUs, torch {summary['torch']}. Targets: "
                          f"read/needed <= {TARGET_READ_RATIO}, ckptrepo/DCP load time <= {TARGET_TIME_RATIO}.")
    for col in ("layout change", "method", "cold s", "warm s", "disk floor s", "needed MiB", "read MiB",
                "read / needed", "TS counters MiB", "ckptrepo / DCP cold", "ckptrepo / DCP warm"):
        table.add_column(col, justify="left" if col in ("layout change", "method") else "right")
    for case in summary["cases"]:
        change = f"tp={case['src']} -> " + (f"tp={case['dst']}" if case["dst"] > 1 else "1 process")
        for m in METHODS:
            r = case["methods"][m]
            ratio = r["read"] / r["needed"]
            mark = "" if m != "ckptrepo" else (" ok" if ratio <= TARGET_READ_RATIO else " MISS")
            cold = warm = ""
            if m == "ckptrepo":
                cold = f"{case['time_ratio']:.2f}" + (" ok" if case["time_ratio"] <= TARGET_TIME_RATIO else " MISS")
                warm = f"{case['warm_time_ratio']:.2f}" + (" ok" if case["warm_time_ratio"] <= TARGET_TIME_RATIO
                                                          else " MISS")
            table.add_row(change if m == METHODS[0] else "", METHOD_NAMES[m], f"{r['load_s']:.2f}",
                          f"{r['warm_s']:.2f}", f"{case['disk_floor_s']:.2f}" if m == METHODS[0] else "",
                          _mib(r["needed"]), _mib(r["read"]), f"{ratio:.2f}{mark}", _mib(r["kvstore"]), cold, warm)
    Console(width=190).print(table)
    print(f"targets: bytes read <= {TARGET_READ_RATIO}x bytes needed; ckptrepo load time <= {TARGET_TIME_RATIO}x DCP's")
    print(f"total run time {summary['wall_s']:.0f}s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=float, default=256, help="state size in MiB (params + 2 Adam moments, fp32)")
    p.add_argument("--layers", type=int, default=8, help="MLP blocks")
    p.add_argument("--cases", default="2->4,2->1,4->2", help="comma-separated SRC->DST mesh sizes (DST 1: one process)")
    p.add_argument("--repeat", type=int, default=2, help="loads per case and method; the fastest is reported")
    p.add_argument("--dir", default=None, help="where to write (a temp dir is made under it); default: the temp dir")
    p.add_argument("--json", default=None, metavar="OUT", help="write the figures as JSON to OUT")
    p.add_argument("--lazy-narrow", action="store_true",
                   help="measure narrow-row weights read from a lazy clone instead (one process; see above)")
    p.add_argument("--narrow-cols", type=int, default=256, help="--lazy-narrow: columns of each weight (fp32)")
    args = p.parse_args(argv)
    if args.lazy_narrow:
        return report(lazy_narrow(args), print_narrow, args.json)
    return report(run(args), print_table, args.json)


if __name__ == "__main__":
    sys.exit(main())
