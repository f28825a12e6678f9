"""Save/load throughput of ckptrepo versus torch.save, torch.distributed.checkpoint and the raw disk.

Builds a deterministic GPT-like training state (fp32 parameters, AdamW exp_avg /
exp_avg_sq and step tensors, a bf16 EMA copy of the weights: hundreds of tensors,
random content) of about ``--size-gb`` GB and measures, best of ``--repeat``:

* ``dd``: the same number of bytes written by the ``dd`` tool (``/dev/zero``, ``--dd-bs`` blocks) to a file in
  the same directory, once with ``oflag=direct`` and once buffered with ``conv=fsync`` (each followed by an fsync of
  the directory, deleted after): the disk's durable write rate as the system's own tool gets it, which the
  "save / dd" column compares every save with (the better of the two, per run; these rows have no load);
* disk ceiling: one file of the same size written with 64 MiB writes + fsync, and read back
  sequentially with 64 MiB reads into a reused buffer (the ceiling the ratios use); also
  "disk -> fresh memory": the same read into newly allocated buffers, what any load that
  returns new tensors pays for page faults on top;
* ckptrepo: ``repo.snapshot(state)`` (durable on return) and ``repo.load("HEAD")`` (fresh tensors);
* torch.save (followed by fsync of the file and its directory) and torch.load(weights_only=True);
* torch.distributed.checkpoint save/load in one process without a process group
  (FileSystemWriter defaults: sync_files=True, thread_count=1); the load fills tensors allocated
  inside the timed region, like the others return fresh tensors.

Before every load, the page cache of every file the load reads is evicted with
``posix_fadvise(DONTNEED)`` (after fsync), and residency is checked with mincore,
so reads are cold as far as this guest's page cache goes (a hypervisor cache below
a virtual disk cannot be controlled from here).

    python benchmarks/save_load.py                       # ~2 GB state, 2 repetitions
    python benchmarks/save_load.py --size-gb 0.3 --repeat 1 --json out.json
    python benchmarks/save_load.py --size-gb 0.5 --repeat 3 --ts-reads   # also ckptrepo without direct reads

CPU seconds per GB (all threads of this process) are reported too: on a shared
or small machine they are a steadier figure than throughput.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import cpu_s, fsync_dir, report  # noqa: E402

import ckptrepo

GB = 1e9
IO_CHUNK = 64 << 20

# ---------------------------------------------------------------- the state


def _gpt_shapes(d: int, layers: int, vocab: int = 50304, ctx: int = 1024) -> list[tuple[str, tuple[int, ...]]]:
    shapes: list[tuple[str, tuple[int, ...]]] = [("wte.weight", (vocab, d)), ("wpe.weight", (ctx, d))]
    for i in range(layers):
        p = f"h.{i}."
        shapes += [
            (p + "ln_1.weight", (d,)), (p + "ln_1.bias", (d,)),
            (p + "attn.c_attn.weight", (3 * d, d)), (p + "attn.c_attn.bias", (3 * d,)),
            (p + "attn.c_proj.weight", (d, d)), (p + "attn.c_proj.bias", (d,)),
            (p + "ln_2.weight", (d,)), (p + "ln_2.bias", (d,)),
            (p + "mlp.c_fc.weight", (4 * d, d)), (p + "mlp.c_fc.bias", (4 * d,)),
            (p + "mlp.c_proj.weight", (d, 4 * d)), (p + "mlp.c_proj.bias", (d,)),
        ]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    return shapes


BYTES_PER_PARAM = 4 + 4 + 4 + 2  # fp32 param, fp32 exp_avg, fp32 exp_avg_sq, bf16 EMA


def choose_model(target_bytes: float, layers: int = 12) -> tuple[int, int]:
    """The hidden size (a multiple of 32) whose state comes closest to ``target_bytes``."""
    best = None
    for d in range(32, 8193, 32):
        numel = sum(_numel(s) for _, s in _gpt_shapes(d, layers))
        err = abs(numel * BYTES_PER_PARAM - target_bytes)
        if best is None or err < best[0]:
            best = (err, d)
    return best[1], layers


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def build_state(size_gb: float, seed: int = 0) -> dict[str, Any]:
    """A deterministic GPT-like training state of about ``size_gb`` GB (random content)."""
    d, layers = choose_model(size_gb * GB)
    g = torch.Generator().manual_seed(seed)
    model: dict[str, torch.Tensor] = {}
    ema: dict[str, torch.Tensor] = {}
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    for i, (name, shape) in enumerate(_gpt_shapes(d, layers)):
        w = torch.randn(shape, generator=g) * 0.02
        model[name] = w
        ema[name] = (w + torch.randn(shape, generator=g) * 1e-3).to(torch.bfloat16)
        opt_state[i] = {
            "step": torch.tensor(1000.0),
            "exp_avg": torch.randn(shape, generator=g) * 1e-3,
            "exp_avg_sq": torch.rand(shape, generator=g) * 1e-6,
        }
    n = len(model)
    return {
        "model": model,
        "ema": ema,
        "optimizer": {"state": opt_state, "param_groups": [{
            "lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
            "params": list(range(n))}]},
        "step": 1000,
        "config": {"d_model": d, "n_layer": layers},
    }


def tensors_of(obj: Any, path: str = "") -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in tensors_of(v, f"{path}/{k}")]
    if isinstance(obj, (list, tuple)):
        return [x for i, v in enumerate(obj) for x in tensors_of(v, f"{path}/{i}")]
    return []


def state_bytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors_of(state))


def assert_equal_states(a: Any, b: Any) -> int:
    ta, tb = tensors_of(a), tensors_of(b)
    assert [p for p, _ in ta] == [p for p, _ in tb], "tensor paths differ"
    for (p, x), (_, y) in zip(ta, tb):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), f"tensor {p} differs"
    return len(ta)


def empty_like_state(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return torch.empty_like(obj)
    if isinstance(obj, dict):
        return {k: empty_like_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [empty_like_state(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(empty_like_state(v) for v in obj)
    return obj

# ---------------------------------------------------------------- page cache


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def files_under(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]


def evict(path: str) -> None:
    """fsync and drop from the page cache every file under ``path``."""
    for f in files_under(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(path: str) -> float:
    """Fraction of the bytes under ``path`` that sit in the page cache (mincore)."""
    page = mmap.PAGESIZE
    total = resident = 0
    for f in files_under(path):
        size = os.path.getsize(f)
        if size == 0:
            continue
        fd = os.open(f, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return float("nan")
            try:
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                if _libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                    return float("nan")
                resident += sum(v & 1 for v in vec) * page
                total += pages * page
            finally:
                _libc.munmap(ctypes.c_void_p(addr), size)
        finally:
            os.close(fd)
    return resident / total if total else 0.0


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"




# ---------------------------------------------------------------- methods


class Method:
    name = ""
    key = ""
    note = ""
    loads = True   # False: a write-only reference (the dd rows)

    def save(self, state: Any, target: str) -> None: ...
    def load(self, target: str, template: Any) -> Any: ...


class Disk(Method):
    name = "disk ceiling"
    key = "disk"
    note = "one file, 64 MiB os.write calls + fsync; 64 MiB readinto a reused buffer"

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.buf = bytearray(os.urandom(1 << 20) * (IO_CHUNK >> 20))

    def save(self, state: Any, target: str) -> None:
        os.makedirs(target)
        path = os.path.join(target, "blob")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left, view, n = self.nbytes, memoryview(self.buf), 0
            while left:
                view[:8] = n.to_bytes(8, "little")  # every chunk distinct
                n += 1
                k = min(left, IO_CHUNK)
                written = 0
                while written < k:
                    written += os.write(fd, view[written:k])
                left -= k
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(target)

    def load(self, target: str, template: Any) -> Any:
        buf = memoryview(bytearray(IO_CHUNK))
        read_blob(os.path.join(target, "blob"), lambda: buf, self.nbytes)
        return None


class DD(Method):
    """The ``dd`` tool writing the state's size durably: the reference a save's rate is compared with."""

    loads = False

    def __init__(self, nbytes: int, block: str, direct: bool) -> None:
        self.block = block
        self.bs = _parse_size(block)
        self.count = max(1, round(nbytes / self.bs))
        self.flag = "oflag=direct" if direct else "conv=fsync"
        self.key = "dd-direct" if direct else "dd-fsync"
        self.name = "dd, O_DIRECT" if direct else "dd, buffered + fsync"
        self.note = (f"dd if=/dev/zero bs={block} count={self.count} {self.flag}, then fsync of the directory "
                     f"({self.count * self.bs / GB:.3f} GB)")

    def save(self, state: Any, target: str) -> None:
        os.makedirs(target)
        subprocess.run(["dd", "if=/dev/zero", f"of={os.path.join(target, 'dd')}", f"bs={self.block}",
                        f"count={self.count}", self.flag, "status=none"], check=True)
        fsync_dir(target)


def _parse_size(text: str) -> int:
    """Bytes in a dd block size such as ``4M`` or ``65536`` (K, M, G: powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def read_blob(path: str, next_buffer: Any, nbytes: int) -> None:
    """Read ``path`` sequentially in IO_CHUNK pieces, each into the buffer ``next_buffer()`` returns."""
    total = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(next_buffer())
            if not n:
                break
            total += n
    assert total == nbytes


class DiskFresh(Disk):
    name = "disk -> fresh memory"
    key = "disk-fresh"
    note = ("as disk ceiling, but each 64 MiB read lands in newly allocated memory that is kept until the end "
            "(page faults included), like a load that returns new tensors; a second ceiling, not the one ratios use")

    def load(self, target: str, template: Any) -> Any:
        kept: list[Any] = []

        def fresh() -> memoryview:
            kept.append(torch.empty(IO_CHUNK, dtype=torch.uint8).numpy())
            return memoryview(kept[-1])
        read_blob(os.path.join(target, "blob"), fresh, self.nbytes)
        return kept


class CkptRepo(Method):
    name = "ckptrepo"
    key = "ckptrepo"
    note = "repo.snapshot (durable on return) / repo.load('HEAD') into fresh tensors"

    def save(self, state: Any, target: str) -> None:
        repo = ckptrepo.init(target)
        repo.snapshot(state, step=1000)

    def load(self, target: str, template: Any) -> Any:
        return ckptrepo.open(target).load("HEAD")


class CkptRepoTensorStoreReads(CkptRepo):
    name = "ckptrepo, TS reads"
    key = "ckptrepo-ts"
    note = "as ckptrepo, but loads through TensorStore only (ckptrepo.loading._engine.DIRECT_READS = False)"

    def load(self, target: str, template: Any) -> Any:
        from ckptrepo.loading import _engine as engine
        saved, engine.DIRECT_READS = engine.DIRECT_READS, False
        try:
            return super().load(target, template)
        finally:
            engine.DIRECT_READS = saved


class TorchSave(Method):
    name = "torch.save"
    key = "torch.save"
    note = "torch.save to one file + fsync(file, dir) / torch.load(weights_only=True)"

    def save(self, state: Any, target: str) -> None:
        os.makedirs(target)
        path = os.path.join(target, "state.pt")
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(target)

    def load(self, target: str, template: Any) -> Any:
        return torch.load(os.path.join(target, "state.pt"), weights_only=True, map_location="cpu")


class DCP(Method):
    name = "torch DCP"
    key = "dcp"
    note = "torch.distributed.checkpoint.save/load, no process group (sync_files=True, thread_count=1)"

    def save(self, state: Any, target: str) -> None:
        import torch.distributed.checkpoint as dcp
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=target)

    def load(self, target: str, template: Any) -> Any:
        import torch.distributed.checkpoint as dcp
        out = empty_like_state(template)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(out, checkpoint_id=target)
        return out

# ---------------------------------------------------------------- driver


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    state = build_state(args.size_gb, args.seed)
    nbytes = state_bytes(state)
    ntensors = len(tensors_of(state))
    print(f"state: {ntensors} tensors, {nbytes / GB:.3f} GB "
          f"(d_model={state['config']['d_model']}, {state['config']['n_layer']} layers; "
          f"built in {time.perf_counter() - t0:.1f}s)", flush=True)

    import torch.distributed.checkpoint  # noqa: F401 - imported here so no timed call pays for the import

    base = args.dir or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix="ckptrepo-bench-", dir=base)
    methods: list[Method] = [Disk(nbytes)]
    if not args.no_fresh_ceiling:
        methods.append(DiskFresh(nbytes))
    dd: list[Method] = [] if args.no_dd else [DD(nbytes, args.dd_bs, True), DD(nbytes, args.dd_bs, False)]
    methods.append(CkptRepo())
    if args.ts_reads:
        methods.append(CkptRepoTensorStoreReads())
    methods += [TorchSave(), DCP()]
    if args.only:
        only = set(args.only.split(","))
        methods = [m for m in methods if m.key in only]
    methods = dd + methods   # the references of every run, whatever --only selects
    results: dict[str, dict[str, Any]] = {m.name: {"save_s": [], "load_s": [], "resident": [], "note": m.note,
                                                   "on_disk_bytes": None, "save_cpu_s": [], "load_cpu_s": []}
                                          for m in methods}
    loadavg: list[float] = []
    verified = False
    try:
        for rep in range(args.repeat):
            for m in methods:
                target = os.path.join(work, f"{m.key}-{rep}")
                gc.collect()
                os.sync()
                loadavg.append(os.getloadavg()[0])
                c = cpu_s()
                t = time.perf_counter()
                m.save(state, target)
                save_s = time.perf_counter() - t
                save_cpu = cpu_s() - c
                results[m.name]["on_disk_bytes"] = sum(os.path.getsize(f) for f in files_under(target))
                if not m.loads:
                    written = m.count * m.bs if isinstance(m, DD) else nbytes
                    results[m.name]["save_s"].append(save_s * nbytes / written)   # as if it wrote the state's size
                    print(f"  rep {rep + 1}/{args.repeat} {m.name:20s} save {save_s:6.2f}s "
                          f"{written / save_s / GB:6.3f} GB/s", flush=True)
                    shutil.rmtree(target, ignore_errors=True)
                    os.sync()
                    time.sleep(args.settle)
                    continue
                if args.warm:
                    res = resident_fraction(target)
                else:
                    evict(target)
                    res = resident_fraction(target)
                gc.collect()
                c = cpu_s()
                t = time.perf_counter()
                loaded = m.load(target, state)
                load_s = time.perf_counter() - t
                load_cpu = cpu_s() - c
                if isinstance(m, CkptRepo) and not verified:
                    n = assert_equal_states(state, loaded)
                    verified = True
                    print(f"  ckptrepo round trip bit-exact: {n} tensors torch.equal", flush=True)
                del loaded
                r = results[m.name]
                r["save_s"].append(save_s)
                r["load_s"].append(load_s)
                r["resident"].append(res)
                r["save_cpu_s"].append(save_cpu)
                r["load_cpu_s"].append(load_cpu)
                print(f"  rep {rep + 1}/{args.repeat} {m.name:20s} save {save_s:6.2f}s {nbytes / save_s / GB:6.3f} GB/s"
                      f" ({save_cpu / (nbytes / GB):4.2f} cpu-s/GB)"
                      f"   load {load_s:6.2f}s {nbytes / load_s / GB:6.3f} GB/s"
                      f" ({load_cpu / (nbytes / GB):4.2f} cpu-s/GB; {res:.0%} of files in page cache before)"
                      f"   load avg {os.getloadavg()[0]:.1f}", flush=True)
                shutil.rmtree(target, ignore_errors=True)
                os.sync()  # let the deletion (and any discard it causes) settle before the next method
                time.sleep(args.settle)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    summary: dict[str, Any] = {
        "size_bytes": nbytes, "tensors": ntensors, "repeat": args.repeat, "dir": base,
        "cache": "warm" if args.warm else "cold (posix_fadvise DONTNEED after fsync)",
        "ckptrepo_bit_exact": verified, "methods": {}, "cpus": os.cpu_count(),
        "versions": {"torch": torch.__version__, "tensorstore": _version("tensorstore"),
                     "python": sys.version.split()[0]},
        "load_average_during_run": {"min": min(loadavg, default=0.0), "max": max(loadavg, default=0.0)},
    }
    for name, r in results.items():
        best_save, best_load = min(r["save_s"]), min(r["load_s"], default=None)
        summary["methods"][name] = {
            "save_gbps": nbytes / best_save / GB, "load_gbps": None if best_load is None else nbytes / best_load / GB,
            "save_s": r["save_s"], "load_s": r["load_s"], "resident_before_load": r["resident"],
            "on_disk_bytes": r["on_disk_bytes"], "note": r["note"],
            # dd's CPU is another process's: not counted
            "save_cpu_s_per_gb": min(r["save_cpu_s"]) / (nbytes / GB) if r["save_cpu_s"] else None,
            "load_cpu_s_per_gb": min(r["load_cpu_s"]) / (nbytes / GB) if r["load_cpu_s"] else None,
        }
    disk = summary["methods"].get(Disk.name)
    ref = summary["methods"].get("ckptrepo")
    if disk:
        # Both disk rows write the same file the same way: the save ceiling is the best of all those writes.
        writes = [s["save_gbps"] for n, s in summary["methods"].items() if n in (Disk.name, DiskFresh.name)]
        summary["ceiling"] = {"save_gbps": max(writes), "load_gbps": disk["load_gbps"]}
    dd_best = max((summary["methods"][m.name]["save_gbps"] for m in dd), default=None)
    summary["dd_save_gbps"] = dd_best
    for _name, s in summary["methods"].items():
        loaded = s["load_gbps"] is not None
        s["save_vs_dd"] = s["save_gbps"] / dd_best if dd_best else None
        s["save_vs_disk"] = s["save_gbps"] / summary["ceiling"]["save_gbps"] if disk else None
        s["load_vs_disk"] = s["load_gbps"] / summary["ceiling"]["load_gbps"] if disk and loaded else None
        s["save_vs_ckptrepo"] = s["save_gbps"] / ref["save_gbps"] if ref else None
        s["load_vs_ckptrepo"] = s["load_gbps"] / ref["load_gbps"] if ref and loaded else None
    return summary


def print_table(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    def f(x: float | None, fmt: str = "{:.2f}") -> str:
        return "-" if x is None else fmt.format(x)

    worst_res = max((max(s["resident_before_load"]) for s in summary["methods"].values() if s["resident_before_load"]),
                    default=0.0)
    cache = summary["cache"] + (f"; at most {worst_res:.0%} of any method's files resident before a load"
                                if not summary["cache"].startswith("warm") else "")
    table = Table(title=f"save/load of a {summary['size_bytes'] / GB:.2f} GB state, {summary['tensors']} tensors "
                        f"(best of {summary['repeat']})",
                  caption=f"reads: {cache}. All saves durable: ckptrepo/TensorStore and DCP fsync their files; "
                          f"torch.save is followed by fsync of the file and its directory. GB = 1e9 bytes. "
                          f"save / dd: against the better dd row (O_DIRECT or buffered + fsync) of this run. "
                          f"Ratios / disk: save against the best disk write of either disk row, load against the "
                          f"disk ceiling's read. cpu-s/GB: CPU seconds (all threads) per GB, best repetition. "
                          f"{summary['cpus']} CPUs; 1-min load average during the run "
                          f"{summary['load_average_during_run']['min']:.1f}-{summary['load_average_during_run']['max']:.1f}.")
    for col in ("method", "save GB/s", "load GB/s", "save / dd", "save / disk", "load / disk", "save / ckptrepo",
                "load / ckptrepo", "save cpu-s/GB", "load cpu-s/GB"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for name, s in summary["methods"].items():
        table.add_row(name, f(s["save_gbps"], "{:.3f}"), f(s["load_gbps"], "{:.3f}"), f(s["save_vs_dd"]),
                      f(s["save_vs_disk"]),
                      f(s["load_vs_disk"]), f(s["save_vs_ckptrepo"]), f(s["load_vs_ckptrepo"]),
                      f(s["save_cpu_s_per_gb"]), f(s["load_cpu_s_per_gb"]))
    Console(width=160).print(table)
    for name, s in summary["methods"].items():
        print(f"  {name}: {s['note']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gb", type=float, default=2.0, help="approximate state size in GB (1e9 bytes)")
    p.add_argument("--repeat", type=int, default=2, help="repetitions per method; the best is reported")
    p.add_argument("--dir", default=None, help="where to write (a temp dir is made under it); default: the temp dir")
    p.add_argument("--json", default=None, metavar="OUT", help="write the figures as JSON to OUT")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--settle", type=float, default=1.0, help="seconds to wait after deleting each method's files")
    p.add_argument("--warm", action="store_true", help="do not evict the page cache before loads")
    p.add_argument("--only", default=None,
                   help="comma-separated subset of: disk,disk-fresh,ckptrepo,ckptrepo-ts,torch.save,dcp")
    p.add_argument("--no-fresh-ceiling", action="store_true",
                   help="skip the 'disk -> fresh memory' row (reads into newly allocated buffers)")
    p.add_argument("--no-dd", action="store_true", help="skip the two dd rows (run whatever --only selects)")
    p.add_argument("--dd-bs", default="4M",
                   help="dd's block size (default 4M: the size of the direct writer's O_DIRECT requests)")
    p.add_argument("--ts-reads", action="store_true",
                   help="add a row for ckptrepo loading through TensorStore only (no direct local-file reads)")
    args = p.parse_args(argv)
    return report(run(args), print_table, args.json)


if __name__ == "__main__":
    sys.exit(main())
