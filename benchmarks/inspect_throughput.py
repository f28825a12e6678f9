"""Throughput of ``stats`` and ``diff`` over tensor data, against reading and checksumming the same bytes.

Builds (once, under ``--dir``) a repository with two versions of an LLM-like
state of about ``--size-gb`` GB: fp32 weights of GPT-like shapes and a bf16 copy
of them. Version B is version A with every tensor slightly changed. With the
page cache warm (every figure is the best of ``--repeat``), it times

* the floor: the library's read path (verified ``preadv`` reads, crc32c of every
  inner chunk) over the bytes of version A, into a reused buffer, with nothing
  computed on them;
* ``stats A`` over the data (``tools._inspect.tensor_stats``: what ``repo.stats`` reads for a version
  without capture-time statistics): every tensor's norm, mean, std, min, max, absmax, NaN and Inf;
* ``repo.diff(A, B)``: every tensor of both versions (twice the bytes of the floor).

and prints GB/s (bytes read from the version(s) per second), CPU seconds per GB
(all threads), the cores that kept busy on average (CPU seconds over wall seconds:
below the machine's count where other processes took cores, or where the work
did not spread) and the ratio to the floor's rate. ``--profile`` adds where the
CPU time goes, with the jobs run one after another (cProfile sees one thread).

    python benchmarks/inspect_throughput.py                       # ~1.5 GB per version
    python benchmarks/inspect_throughput.py --size-gb 0.3 --repeat 2 --profile
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import sys
import tempfile
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import cpu_s, report  # noqa: E402

import ckptrepo  # noqa: E402
from ckptrepo.loading._engine import Engine, Read  # noqa: E402
from ckptrepo.tools import _inspect as inspect  # noqa: E402

GB = 1e9


def gpt_shapes(d: int, layers: int, vocab: int = 50304) -> list[tuple[str, tuple[int, ...]]]:
    shapes: list[tuple[str, tuple[int, ...]]] = [("wte.weight", (vocab, d)), ("wpe.weight", (1024, d))]
    for i in range(layers):
        p = f"h.{i}."
        shapes += [(p + "ln_1.weight", (d,)), (p + "attn.c_attn.weight", (3 * d, d)),
                   (p + "attn.c_attn.bias", (3 * d,)), (p + "attn.c_proj.weight", (d, d)), (p + "ln_2.weight", (d,)),
                   (p + "mlp.c_fc.weight", (4 * d, d)), (p + "mlp.c_proj.weight", (d, 4 * d))]
    return shapes + [("ln_f.weight", (d,))]


def build(path: str, size_gb: float) -> tuple[ckptrepo.Repository, int]:
    """The repository with versions @1 (A) and @2 (B), made once; returns it and the bytes of one version."""
    layers = 16
    # fp32 weights and a bf16 copy: 6 bytes a parameter
    d = min(range(256, 8193, 128), key=lambda d: abs(sum(_numel(s) for _, s in gpt_shapes(d, layers)) * 6
                                                      - size_gb * GB))
    if os.path.exists(os.path.join(path, "done")):
        return ckptrepo.open(path), int(open(os.path.join(path, "done")).read())
    shutil.rmtree(path, ignore_errors=True)
    repo = ckptrepo.init(path)
    g = torch.Generator().manual_seed(0)
    state: dict[str, Any] = {"model": {}, "ema": {}}
    for name, shape in gpt_shapes(d, layers):
        w = torch.randn(shape, generator=g) * 0.02
        state["model"][name] = w
        state["ema"][name] = w.to(torch.bfloat16)
    nbytes = sum(t.numel() * t.element_size() for part in state.values() for t in part.values())
    repo.snapshot(state, step=1)
    for part in state.values():
        for t in part.values():
            t.add_(torch.randn(t.shape, generator=g).to(t.dtype), alpha=1e-3)
    repo.snapshot(state, step=2)
    with open(os.path.join(path, "done"), "w") as fh:
        fh.write(str(nbytes))
    return repo, nbytes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class _Discard(Read):
    """A range of an array read (and verified) by the direct reader, its bytes dropped: the floor."""

    __slots__ = ()

    def names(self) -> list[str]:
        return []

    def direct_target(self, info: Any) -> Any:
        return self

    def scatter(self, src: Any, a: int, b: int) -> None:
        pass

    def fill(self, src: torch.Tensor) -> None:
        pass


def read_floor(repo: ckptrepo.Repository, rev: str) -> None:
    """Read every tensor's bytes of ``rev`` through the read engine, verified, keeping none of them."""
    plumbing = repo._plumbing
    m = plumbing.manifest(plumbing.resolve(rev))
    plan = [_Discard(p.array, p.offset, p.offset + _numel(p.box[1])) for t in m.tensors for p in t.pieces]
    Engine(plumbing.data_store(m), dict(m.arrays)).execute(plan)


def profile(repo: ckptrepo.Repository, rows: int) -> None:
    """cProfile of ``stats`` and ``diff`` with their jobs run one after another on this thread (the worker
    threads are invisible to cProfile): the share of reading, converting and reducing."""
    real = inspect._run_jobs

    def serial(jobs: Any, work: Any, on_bytes: Any) -> dict[int, list[tuple[int, Any]]]:
        out: dict[int, list[tuple[int, Any]]] = {}
        for job in jobs:
            for row, start, part in inspect._quietly(work, job):
                out.setdefault(row, []).append((start, part))
        return out

    inspect._run_jobs = serial
    try:
        for what, fn in (("stats A", lambda: inspect.tensor_stats(repo.plumbing, "@1")),
                         ("diff A B", lambda: repo.diff("@1", "@2"))):
            prof = cProfile.Profile()
            t = cpu_s()
            prof.runcall(fn)
            print(f"--- {what}, jobs run serially: {cpu_s() - t:.2f} CPU-s")
            pstats.Stats(prof).sort_stats("tottime").print_stats(rows)
    finally:
        inspect._run_jobs = real


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, float]:
    """Best wall seconds of ``repeat`` runs, and the CPU seconds of that run."""
    best = (float("inf"), 0.0)
    for _ in range(repeat):
        t, c = time.perf_counter(), cpu_s()
        fn()
        best = min(best, (time.perf_counter() - t, cpu_s() - c))
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.5, help="bytes of one version")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "ckptrepo-inspect-bench"),
                    help="where the repository is built (kept between runs; delete it to rebuild)")
    ap.add_argument("--profile", action="store_true",
                    help="also print where the CPU time of one stats and one diff goes (jobs run serially)")
    ap.add_argument("--profile-rows", type=int, default=12)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    path = os.path.join(args.dir, f"{args.size_gb:g}gb")
    repo, nbytes = build(path, args.size_gb)
    read_floor(repo, "@1")   # warm the page cache
    read_floor(repo, "@2")
    rows = {
        "read + crc32c (floor)": (timed(lambda: read_floor(repo, "@1"), args.repeat), nbytes),
        "stats A": (timed(lambda: inspect.tensor_stats(repo.plumbing, "@1"), args.repeat), nbytes),
        "diff A B": (timed(lambda: repo.diff("@1", "@2"), args.repeat), 2 * nbytes),
    }
    floor = nbytes / rows["read + crc32c (floor)"][0][0]
    summary = {"bytes_per_version": nbytes, "cpus": len(os.sched_getaffinity(0)),
               "rows": {k: {"seconds": w, "cpu_s": c, "gb_s": b / w / GB, "cpu_s_per_gb": c / (b / GB),
                            "vs_floor": b / w / floor} for k, ((w, c), b) in rows.items()}}
    if args.profile:
        profile(repo, args.profile_rows)

    def table(s: dict[str, Any]) -> None:
        print(f"one version: {s['bytes_per_version'] / GB:.2f} GB, {s['cpus']} CPUs, page cache warm, "
              f"best of {args.repeat}")
        print("| what | seconds | GB/s | CPU-s/GB | cores busy | vs floor |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for k, r in s["rows"].items():
            print(f"| {k} | {r['seconds']:.2f} | {r['gb_s']:.2f} | {r['cpu_s_per_gb']:.2f} "
                  f"| {r['cpu_s'] / r['seconds']:.2f} | {r['vs_floor']:.2f}x |")

    return report(summary, table, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
