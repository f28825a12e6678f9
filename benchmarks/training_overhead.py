"""What checkpointing costs a training loop: ckptrepo's snapshotter versus torch.save and DCP.

One GPT-style model (examples/tiny_gpt.py) with AdamW trains on random tokens
on the CPU for a fixed number of steps; the same loop (same seed, same batches)
runs once per mode, all in one process. With ``--model mlp`` the model is
instead an MLP of ``--n-layer`` square layers (about ``--model-mb`` of
parameters and Adam moments, 230 MB by default) whose batch is chosen so that
a step takes about ``--step-ms`` (100 ms by default), checkpointed every 5
steps: the regime where a step is shorter than a checkpoint's write. The modes:

* ``none``            no checkpoint (the baseline; run first and again at the end)
* ``torch.save``      ``torch.save({model, optimizer state_dicts})`` to a new file, then fsync of the
                      file and its directory; fully blocking
* ``dcp.save``        ``torch.distributed.checkpoint.save`` (FileSystemWriter, sync_files=True) to a new
                      directory; fully blocking
* ``dcp.async_save``  ``torch.distributed.checkpoint.async_save`` (thread executor, default stager:
                      staging copy inside the call, write in a background thread); the future of the
                      previous checkpoint is waited on before the next call, and at the end
* ``ckptrepo``        ``repo.snapshotter(host_memory=...)`` with ``attach(optimizer)``; ``snapshot()``
                      returns at once, ``optimizer.step()`` waits for the capture of the previous snapshot
* ``ckptrepo-nostats`` the same without the per-tensor statistics capture takes (``tensor_stats=False``);
                      not run unless named in ``--modes``

A checkpoint is taken after loop step ``i`` whenever ``i % every == 0`` (so after the first timed
step, then every ``every`` steps). Each mode writes every checkpoint it takes (nothing is
overwritten: ckptrepo keeps every version too) under its own directory in ``--dir``, deleted
after the mode. Before timing, every mode runs ``--warmup`` steps and one checkpoint (drained), so
one-time costs (first-touch of staging buffers, planning caches, imports) stay out of the figures.

Reported per mode, for each ``every``:

* wall: the timed loop, including the final drain (every checkpoint durable at the end)
* overhead/ckpt: (wall - baseline wall) / checkpoints
* blocking/ckpt: time the training thread was held: the checkpoint call itself; plus, for
  async_save, waiting on the previous future; plus, for ckptrepo, the optimizer pre-step waits
  (``h.stats.blocking_s`` covers the ``snapshot()`` call and those waits)
* durable/ckpt: from the moment the loop asked for the checkpoint until it was durable: the call
  itself for the blocking modes; until the future completed for async_save (counting from before
  the wait on the previous one); ``h.stats.total_s`` (until committed) for ckptrepo
* within-run (every >= 4): (wall - steps x the run's own median step time over the second half of
  each interval between checkpoints) / checkpoints; immune to drift between runs (the baseline of
  this 2-vCPU VM varied by 10-30 % from run to run)
* extra CPU/ckpt: process CPU time (user+sys, all threads) beyond the baseline's, per checkpoint; for
  ckptrepo the details also give its own threads' CPU per checkpoint (the rest of the extra CPU is
  what the training threads lost to sharing the cores: OpenMP barrier spinning, caches)

With ``--repeat R`` every mode runs R times (alternating the order) and its fastest run counts, as
does the fastest baseline: load from elsewhere only ever adds time. Each run also records how much
CPU other processes and kernel threads (including writeback) used meanwhile.

    python benchmarks/training_overhead.py                              # ~400 MB state, every=10
    python benchmarks/training_overhead.py --every 1 10 --steps 30 --json out.json
    python benchmarks/training_overhead.py --model-mb 2000 --every 10   # ~2 GB of params+moments
    python benchmarks/training_overhead.py --rounds 12 --every 10 1     # one loop, the modes take turns
    python benchmarks/training_overhead.py --model mlp --step-ms 100 --rounds 8   # short steps (issue 31)
    python benchmarks/training_overhead.py --regimes --rounds 8 --long-rounds 4  # short and long, one table

With ``--rounds R`` the modes are measured in turns instead (see overhead_turns.py): one training
loop in which every mode, the baseline included, trains ``--turn-steps`` steps at a time in rotating
order, R rounds; the overhead per checkpoint is the mean of the paired differences with the
baseline's turn in the same round, with a 95 % confidence half-width, so drift of the machine's speed
cancels and what noise remains is shown rather than hidden.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import figure, fsync_dir, mean  # noqa: E402
from overhead_turns import both_regimes, print_turns, run_turns, summarize_turns  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from tiny_gpt import GPTConfig, TinyGPT  # noqa: E402

import ckptrepo  # noqa: E402

MODES = ("none", "torch.save", "dcp.save", "dcp.async_save", "ckptrepo", "ckptrepo-nostats", "ckptrepo-zstd")
MB = 1e6


# ---------------------------------------------------------------- model and loop

def device_name(device: str) -> str:
    """The device in words, for the table's header (a GPU's model name)."""
    return torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu"


def gpt_numel(n_layer: int, n_embd: int, vocab: int, block: int) -> int:
    """Parameters of TinyGPT (head tied to the token embedding)."""
    per_layer = 2 * 2 * n_embd + (3 * n_embd * n_embd + 3 * n_embd) + (n_embd * n_embd + n_embd) \
        + (4 * n_embd * n_embd + 4 * n_embd) + (4 * n_embd * n_embd + n_embd)
    return vocab * n_embd + block * n_embd + n_layer * per_layer + 2 * n_embd


def choose_embd(target_mb: float, n_layer: int, vocab: int, block: int, multiple: int = 64) -> int:
    """The n_embd (a multiple of ``multiple``) whose params + AdamW moments come closest to ``target_mb``."""
    best = min(range(multiple, 16385, multiple),
               key=lambda d: abs(gpt_numel(n_layer, d, vocab, block) * 12 - target_mb * MB))
    return best


def mlp(width: int, layers: int) -> torch.nn.Module:
    """``layers`` square Linear layers with GELUs between them: few big tensors, a step that is mostly GEMMs."""
    mods: list[torch.nn.Module] = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width))
        if i < layers - 1:
            mods.append(torch.nn.GELU())
    return torch.nn.Sequential(*mods)


def mlp_numel(width: int, layers: int) -> int:
    return layers * (width * width + width)


def choose_width(target_mb: float, layers: int, multiple: int = 64) -> int:
    """The MLP width (a multiple of ``multiple``) whose params + Adam moments come closest to ``target_mb``."""
    return min(range(multiple, 32769, multiple), key=lambda w: abs(mlp_numel(w, layers) * 12 - target_mb * MB))


def calibrate_batch(args: argparse.Namespace, target_s: float) -> tuple[int, float]:
    """The batch size whose training step takes about ``target_s`` here (and the step time measured with it).

    The step time is taken as linear in the batch (a fixed optimizer step plus GEMMs), fitted on two
    batch sizes, then checked once; a target below the optimizer step alone gives batch 1.
    """
    def median_step(batch: int) -> float:
        args.batch_size = batch
        t = Trainer(args)
        for _ in range(3):
            t.step()
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            t.step()
            t.sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    lo, hi = 16, 128
    t_lo, t_hi = median_step(lo), median_step(hi)
    slope = max(1e-9, (t_hi - t_lo) / (hi - lo))
    batch = max(1, round(lo + (target_s - t_lo) / slope))
    return batch, median_step(batch)


class Trainer:
    """The model, its optimizer and the batch stream; identical for every mode (fixed seeds).

    ``--model gpt`` (the default): TinyGPT with AdamW on random tokens. ``--model mlp``: an MLP of
    ``--n-layer`` square layers of ``--width`` with Adam on random inputs, regressing random targets: the
    short-step regime, where a step is shorter than a checkpoint's write.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        torch.manual_seed(args.seed)
        self.device = torch.device(args.device)
        self.kind = getattr(args, "model", "gpt")
        if self.kind == "mlp":
            self.model = mlp(args.width, args.n_layer).to(self.device)
            self.opt: torch.optim.Optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        else:
            cfg = GPTConfig(vocab_size=args.vocab, block_size=args.block_size, n_layer=args.n_layer,
                            n_head=args.n_head, n_embd=args.n_embd, dropout=0.0)
            self.model = TinyGPT(cfg).to(self.device)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
        self.gen = torch.Generator(device=self.device).manual_seed(args.seed + 1)
        self.args = args

    def step(self) -> torch.Tensor:
        a = self.args
        if self.kind == "mlp":
            x = torch.randn((a.batch_size, a.width), generator=self.gen, device=self.device)
            y = torch.randn((a.batch_size, a.width), generator=self.gen, device=self.device)
            loss = torch.nn.functional.mse_loss(self.model(x), y)
        else:
            x = torch.randint(0, a.vocab, (a.batch_size, a.block_size), generator=self.gen, device=self.device)
            y = torch.randint(0, a.vocab, (a.batch_size, a.block_size), generator=self.gen, device=self.device)
            _, loss = self.model(x, y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return loss

    def sync(self) -> None:
        """Wait for the GPU's queued steps, so that a host clock read after it counts them."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def state_dicts(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}

    def state_bytes(self) -> int:
        n = sum(p.numel() * p.element_size() for p in self.model.parameters())
        for st in self.opt.state.values():
            n += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
        return n


# ---------------------------------------------------------------- checkpoint modes


class Mode:
    """One way to checkpoint. ``checkpoint`` is called by the loop; ``drain`` makes everything durable."""

    name = "none"

    def __init__(self, trainer: Trainer, root: str, args: argparse.Namespace) -> None:
        self.trainer, self.root, self.args = trainer, root, args
        self.blocking: list[float] = []
        self.durable: list[float] = []
        self.extra: dict[str, list[float]] = {}

    def checkpoint(self, i: int, loss: torch.Tensor) -> None:
        pass

    def drain(self) -> None:
        pass

    def finish(self) -> None:
        """After the timed loop and drain: collect late statistics, release resources."""

    def reset(self) -> None:
        self.blocking.clear()
        self.durable.clear()
        self.extra.clear()

    def prune(self, keep: int) -> None:
        """Delete all but the newest ``keep`` checkpoints (untimed, between turns: see overhead_turns.py)."""
        names = sorted(os.listdir(self.root))
        for name in names[:max(0, len(names) - keep)]:
            path = os.path.join(self.root, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)


class TorchSave(Mode):
    name = "torch.save"

    def checkpoint(self, i: int, loss: torch.Tensor) -> None:
        t0 = time.perf_counter()
        path = os.path.join(self.root, f"step{i:06d}.pt")
        with open(path, "wb") as f:
            torch.save(self.trainer.state_dicts(), f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.root)
        dt = time.perf_counter() - t0
        self.blocking.append(dt)
        self.durable.append(dt)


class DcpSave(Mode):
    name = "dcp.save"

    def checkpoint(self, i: int, loss: torch.Tensor) -> None:
        import torch.distributed.checkpoint as dcp
        t0 = time.perf_counter()
        dcp.save(self.trainer.state_dicts(),
                 storage_writer=dcp.FileSystemWriter(os.path.join(self.root, f"step{i:06d}"), sync_files=True))
        dt = time.perf_counter() - t0
        self.blocking.append(dt)
        self.durable.append(dt)


class DcpAsyncSave(Mode):
    name = "dcp.async_save"

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.prev: Any = None
        self.prev_t0 = 0.0
        self.done_at: list[float] = []
        self.asked_at: list[float] = []

    def _wait_prev(self) -> None:
        if self.prev is not None:
            self.prev.result()
            self.prev = None

    def checkpoint(self, i: int, loss: torch.Tensor) -> None:
        import torch.distributed.checkpoint as dcp
        t0 = time.perf_counter()
        self._wait_prev()
        t1 = time.perf_counter()
        fut = dcp.async_save(self.trainer.state_dicts(), storage_writer=dcp.FileSystemWriter(
            os.path.join(self.root, f"step{i:06d}"), sync_files=True,
            cache_staged_state_dict=self.args.dcp_cache_staged))
        t2 = time.perf_counter()
        idx = len(self.asked_at)
        self.asked_at.append(t0)
        self.done_at.append(float("nan"))

        def done(_f: Any, idx: int = idx) -> None:
            self.done_at[idx] = time.perf_counter()
        fut.add_done_callback(done)
        self.prev = fut
        self.blocking.append(t2 - t0)
        self.extra.setdefault("wait_prev_s", []).append(t1 - t0)
        self.extra.setdefault("call_s", []).append(t2 - t1)

    def drain(self) -> None:
        self._wait_prev()

    def finish(self) -> None:
        self.durable[:] = [d - a for a, d in zip(self.asked_at, self.done_at)]

    def reset(self) -> None:
        super().reset()
        self.asked_at.clear()
        self.done_at.clear()


class CkptRepo(Mode):
    name = "ckptrepo"
    options: dict[str, Any] = {}

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.repo = ckptrepo.init(os.path.join(self.root, "repo"))
        self.snap = self.repo.snapshotter(host_memory=self.args.host_memory, **self.options)
        self.snap.attach(self.trainer.opt)
        self.handles: list[Any] = []
        self.call_s: list[float] = []

    def checkpoint(self, i: int, loss: torch.Tensor) -> None:
        t0 = time.perf_counter()
        state = {"model": self.trainer.model, "optimizer": self.trainer.opt}
        h = self.snap.snapshot(state, step=i, metrics={"loss": loss.item()})
        self.call_s.append(time.perf_counter() - t0)
        self.handles.append(h)

    def drain(self) -> None:
        self.snap.wait(progress=False)

    def finish(self) -> None:
        for h in self.handles:
            h.result()
            s = h.stats
            self.blocking.append(s.blocking_s)
            self.durable.append(s.total_s)
            for k in ("capture_s", "flush_s", "gbps"):
                self.extra.setdefault(k, []).append(getattr(s, k))
            self.extra.setdefault("copied_mb", []).append(s.copied_bytes / 1e6)
        self.extra["call_s"] = list(self.call_s)
        self.extra["prestep_wait_s"] = [max(0.0, b - c) for b, c in zip(self.blocking, self.call_s)]

    def close(self) -> None:
        self.snap.close()

    def prune(self, keep: int) -> None:
        self.repo.gc(keep_last=keep)

    def reset(self) -> None:
        super().reset()
        self.handles.clear()
        self.call_s.clear()


class CkptRepoNoStats(CkptRepo):
    """ckptrepo without the per-tensor statistics capture takes (``tensor_stats=False``): what they cost."""

    name = "ckptrepo-nostats"
    options = {"tensor_stats": False}


class CkptRepoZstd(CkptRepo):
    """ckptrepo with its arrays compressed (``compression="zstd"``): what compressing costs the loop."""

    name = "ckptrepo-zstd"
    options = {"compression": "zstd"}


MODE_CLASSES = {"none": Mode, "torch.save": TorchSave, "dcp.save": DcpSave, "dcp.async_save": DcpAsyncSave,
                "ckptrepo": CkptRepo, "ckptrepo-nostats": CkptRepoNoStats, "ckptrepo-zstd": CkptRepoZstd}


# ---------------------------------------------------------------- process group for DCP

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dcp_setup(modes: list[str], root: str, policy: str) -> str:
    """Check that DCP save/async_save work without a process group; else init a 1-rank gloo group."""
    if not any(m.startswith("dcp") for m in modes):
        return "not needed"
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    def probe() -> None:
        sd = {"w": torch.arange(10.0), "nested": {"x": torch.ones(3)}, "n": 3}
        d = tempfile.mkdtemp(dir=root, prefix="dcp-probe-")
        try:
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(os.path.join(d, "a")))
            dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(os.path.join(d, "b"))).result()
        finally:
            shutil.rmtree(d, ignore_errors=True)

    if policy != "always":
        try:
            probe()
            return "none (DCP runs single-process without init_process_group)"
        except Exception as err:
            if policy == "never":
                raise
            print(f"DCP without a process group failed ({type(err).__name__}: {err}); using a 1-rank gloo group",
                  file=sys.stderr)
    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    probe()
    return f"gloo, world_size=1, tcp://127.0.0.1:{port}"


# ---------------------------------------------------------------- running

def cpu_time() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def system_busy() -> float:
    """CPU-seconds every CPU of the machine has spent busy (all processes), from /proc/stat; 0 if unknown."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    return (sum(v[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def library_threads_cpu() -> float:
    """CPU-seconds (user+sys) of ckptrepo's own threads (capture, flush, write, commit) so far; 0 off Linux.

    Set beside the process's extra CPU, it splits a checkpoint's CPU cost into the background work
    itself and what the training threads lost to sharing the cores with it.
    """
    total = 0.0
    tck = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for t in threading.enumerate():
        if not t.name.startswith("ckptrepo-") or t.native_id is None:
            continue
        try:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tck
    return total


def run_mode(mode_name: str, every: int, args: argparse.Namespace) -> dict[str, Any]:
    gc.collect()
    trainer = Trainer(args)
    root = tempfile.mkdtemp(dir=args.dir, prefix=mode_name.replace(".", "_") + "-")
    mode = MODE_CLASSES[mode_name](trainer, root, args)
    try:
        loss = None
        for _ in range(args.warmup):
            loss = trainer.step()
        if mode_name != "none" and args.warmup_checkpoint:
            mode.checkpoint(-1, loss if loss is not None else torch.zeros(()))
            mode.drain()
            mode.finish()
        mode.reset()
        os.sync()
        c0, s0, t0, b0 = cpu_time(), system_busy(), time.perf_counter(), library_threads_cpu()
        n_ckpt = 0
        step_times = []
        for i in range(args.steps):
            ts = time.perf_counter()
            loss = trainer.step()
            trainer.sync()
            step_times.append(time.perf_counter() - ts)
            if mode_name != "none" and i % every == 0:
                mode.checkpoint(i, loss)
                n_ckpt += 1
        t_loop = time.perf_counter() - t0
        mode.drain()
        trainer.sync()
        wall = time.perf_counter() - t0
        cpu = cpu_time() - c0
        foreign = max(0.0, system_busy() - s0 - cpu)  # other processes, and kernel threads (writeback)
        mode.finish()
        if isinstance(mode, CkptRepo):  # also CkptRepoNice
            mode.extra["threads_cpu_s"] = [(library_threads_cpu() - b0) / max(1, n_ckpt)]
            mode.close()
        return {"mode": mode_name, "every": every if mode_name != "none" else None, "checkpoints": n_ckpt,
                "wall_s": wall, "loop_s": t_loop, "drain_s": wall - t_loop, "cpu_s": cpu,
                "foreign_cpu_s": foreign, "foreign_load": foreign / wall if wall > 0 else 0.0,
                "step_s_median": statistics.median(step_times), "step_s": step_times,
                "blocking_s": mode.blocking, "durable_s": mode.durable, "extra": mode.extra,
                "disk_bytes": du(root)}
    finally:
        del mode, trainer
        gc.collect()
        shutil.rmtree(root, ignore_errors=True)


def du(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(dirpath, f))
    return total


def summarize(results: list[dict[str, Any]], everys: list[int]) -> dict[str, Any]:
    """Per mode, the fastest of its runs (contention from elsewhere only ever adds time).

    The baseline is the fastest baseline run; every per-checkpoint figure of a mode comes from its
    fastest run. The noise estimate is the spread (max - min) of the baseline runs.
    """
    base = [r for r in results if r["mode"] == "none"]
    best_base = min(base, key=lambda r: r["wall_s"])
    base_wall, base_cpu = best_base["wall_s"], best_base["cpu_s"]
    quiet_base = [r for r in base if r["foreign_load"] < 0.1]
    quiet_base = quiet_base if len(quiet_base) >= 2 else base
    base_spread = max(r["wall_s"] for r in quiet_base) - min(r["wall_s"] for r in quiet_base)
    rows = []
    for every in everys:
        for name in MODES[1:]:
            runs = [r for r in results if r["mode"] == name and r["every"] == every]
            if not runs:
                continue
            r = min(runs, key=lambda r: r["wall_s"])
            n = r["checkpoints"]
            # Within-run estimate, immune to drift between runs: the steps in the second half of each
            # interval between checkpoints, far from the checkpoint, give this run's own clean step time.
            within = None
            if every >= 4:
                quiet = [t for i, t in enumerate(r["step_s"]) if i % every >= every // 2]
                within = (r["wall_s"] - len(r["step_s"]) * statistics.median(quiet)) / n
            rows.append({
                "mode": name, "every": every, "checkpoints": n, "wall_s": r["wall_s"], "runs": len(runs),
                "walls_s": [x["wall_s"] for x in runs], "drain_s": r["drain_s"],
                "overhead_per_ckpt_s": (r["wall_s"] - base_wall) / n,
                "noise_per_ckpt_s": base_spread / n, "overhead_within_run_per_ckpt_s": within,
                "blocking_per_ckpt_s": mean(r["blocking_s"]), "durable_per_ckpt_s": mean(r["durable_s"]),
                "durable_max_s": max(r["durable_s"]) if r["durable_s"] else None,
                "extra_cpu_per_ckpt_s": (r["cpu_s"] - base_cpu) / n,
                "foreign_load": r["foreign_load"],
                "extra": {k: mean(v) for k, v in sorted(r["extra"].items())},
            })
    ratios = {}
    for every in everys:
        by = {r["mode"]: r for r in rows if r["every"] == every}
        if "ckptrepo" not in by:
            continue
        peers = [r for m, r in by.items() if not m.startswith("ckptrepo")]
        best = min(peers, key=lambda r: r["overhead_per_ckpt_s"]) if peers else None
        ratio = {}
        if best is not None:
            ratio["best_peer"] = best["mode"]
            ratio["best_peer_overhead_s"] = best["overhead_per_ckpt_s"]
            ratio["ckptrepo_overhead_s"] = by["ckptrepo"]["overhead_per_ckpt_s"]
            if best["overhead_per_ckpt_s"] > 0:
                ratio["overhead_vs_best_peer"] = by["ckptrepo"]["overhead_per_ckpt_s"] / best["overhead_per_ckpt_s"]
        wpeers = [r for r in peers if r["overhead_within_run_per_ckpt_s"] is not None]
        if wpeers and by["ckptrepo"]["overhead_within_run_per_ckpt_s"] is not None:
            wbest = min(wpeers, key=lambda r: r["overhead_within_run_per_ckpt_s"])
            ratio["within_run_best_peer"] = wbest["mode"]
            ratio["within_run_best_peer_s"] = wbest["overhead_within_run_per_ckpt_s"]
            ratio["within_run_ckptrepo_s"] = by["ckptrepo"]["overhead_within_run_per_ckpt_s"]
            if wbest["overhead_within_run_per_ckpt_s"] > 0:
                ratio["within_run_vs_best_peer"] = (ratio["within_run_ckptrepo_s"]
                                                    / wbest["overhead_within_run_per_ckpt_s"])
        if "torch.save" in by and by["torch.save"]["blocking_per_ckpt_s"]:
            ratio["blocking_vs_torch_save"] = (by["ckptrepo"]["blocking_per_ckpt_s"]
                                               / by["torch.save"]["blocking_per_ckpt_s"])
        ratios[str(every)] = ratio
    foreign = [r["foreign_load"] for r in results]
    return {"foreign_load_max": max(foreign), "foreign_load_mean": sum(foreign) / len(foreign),
            "baseline_wall_s": base_wall, "baseline_spread_s": base_spread,
            "baseline_walls_s": [r["wall_s"] for r in base],
            "baseline_step_s_median": best_base["step_s_median"],
            "baseline_cpu_s": base_cpu, "rows": rows, "ratios": ratios}


def print_table(summary: dict[str, Any], meta: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    f = figure
    console = Console(width=200)
    table = Table(title=f"Training-loop cost of checkpointing: {meta['state_mb']:.0f} MB state "
                        f"({meta['params_m']:.1f} M params + moments, {meta['model']}), {meta['steps']} steps, "
                        f"{meta['threads']} torch threads, {meta['cpus']} CPUs, on {meta['device']}",
                  caption=f"baseline (no checkpoint): wall {summary['baseline_wall_s']:.2f} s (fastest of runs: "
                          + ", ".join(f"{w:.2f}" for w in summary["baseline_walls_s"])
                          + f"), median step {summary['baseline_step_s_median']:.3f} s. "
                          f"Times in seconds, per checkpoint. Wall includes the final drain. "
                          f"± = spread (max - min) of the baseline runs that had the machine to themselves "
                          f"/ checkpoints, "
                          f"a noise estimate. within-run: (wall - steps x this run's median step time in the "
                          f"second half of each interval between checkpoints) / checkpoints (every >= 4 only). "
                          f"Other processes and kernel threads used "
                          f"{summary['foreign_load_mean']:.2f} CPUs on average during the runs "
                          f"(max {summary['foreign_load_max']:.2f}).")
    for col in ("every", "mode", "ckpts", "wall", "drain", "overhead/ckpt", "within-run", "blocking/ckpt",
                "durable/ckpt", "durable max", "extra CPU/ckpt", "details"):
        table.add_column(col, justify="left" if col in ("mode", "details") else "right")
    last_every = None
    for r in summary["rows"]:
        if last_every is not None and r["every"] != last_every:
            table.add_section()
        last_every = r["every"]
        ex = r["extra"]
        if r["mode"].startswith("ckptrepo"):
            details = (f"call {f(ex.get('call_s'))} + pre-step wait {f(ex.get('prestep_wait_s'))}; "
                       f"capture {f(ex.get('capture_s'))}, flush {f(ex.get('flush_s'))}, "
                       f"{f(ex.get('gbps'), '{:.2f}')} GB/s; copied {f(ex.get('copied_mb'), '{:.1f}')} MB; "
                       f"its threads {f(ex.get('threads_cpu_s'))} CPU-s")
        elif r["mode"] == "dcp.async_save":
            details = f"call {f(ex.get('call_s'))} + wait prev {f(ex.get('wait_prev_s'))}"
        else:
            details = ""
        if r["runs"] > 1:
            details = (details + "; " if details else "") + "walls " + ", ".join(f"{w:.1f}" for w in r["walls_s"])
        table.add_row(str(r["every"]), r["mode"], str(r["checkpoints"]), f(r["wall_s"], "{:.2f}"),
                      f(r["drain_s"], "{:.2f}"),
                      f"{r['overhead_per_ckpt_s']:.3f} ±{r['noise_per_ckpt_s']:.3f}",
                      f(r["overhead_within_run_per_ckpt_s"]), f(r["blocking_per_ckpt_s"]),
                      f(r["durable_per_ckpt_s"]), f(r["durable_max_s"]), f(r["extra_cpu_per_ckpt_s"]), details)
    console.print(table)
    for every, ratio in summary["ratios"].items():
        parts = []
        if "overhead_vs_best_peer" in ratio:
            parts.append(f"ckptrepo overhead/ckpt ÷ best peer's ({ratio['best_peer']}) = "
                         f"{ratio['ckptrepo_overhead_s']:.3f} / {ratio['best_peer_overhead_s']:.3f} = "
                         f"{ratio['overhead_vs_best_peer']:.2f}")
        elif "best_peer" in ratio:
            parts.append(f"best peer's overhead/ckpt ({ratio['best_peer']}) is {ratio['best_peer_overhead_s']:.3f} s "
                         f"(not positive: within noise), ckptrepo's {ratio['ckptrepo_overhead_s']:.3f} s")
        if "within_run_vs_best_peer" in ratio:
            parts.append(f"within-run: ckptrepo ÷ best peer's ({ratio['within_run_best_peer']}) = "
                         f"{ratio['within_run_ckptrepo_s']:.3f} / {ratio['within_run_best_peer_s']:.3f} = "
                         f"{ratio['within_run_vs_best_peer']:.2f}")
        if "blocking_vs_torch_save" in ratio:
            parts.append(f"ckptrepo blocking ÷ torch.save blocking = {ratio['blocking_vs_torch_save']:.3f}")
        if parts:
            console.print(f"every={every}: " + "; ".join(parts))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="timed training steps per mode (default: 30 for gpt, "
                   "60 for mlp)")
    p.add_argument("--every", type=int, nargs="+", default=None,
                   help="checkpoint every N steps (several values allowed; default: 10 for gpt, 5 for mlp)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before each mode")
    p.add_argument("--rounds", type=int, default=0,
                   help="measure in turns instead (overhead_turns.py): one loop, the modes take turns, "
                        "this many rounds")
    p.add_argument("--turn-steps", type=int, default=10, help="with --rounds: training steps per turn")
    p.add_argument("--no-warmup-checkpoint", dest="warmup_checkpoint", action="store_false",
                   help="do not take (and drain) one untimed checkpoint during warm-up")
    p.add_argument("--modes", nargs="+", default=list(MODES[1:-2]), choices=MODES[1:],
                   help="checkpoint modes to run")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every mode this many times (alternating the order); the fastest run of each counts")
    p.add_argument("--model", choices=("gpt", "mlp"), default="gpt",
                   help="gpt: TinyGPT with AdamW (steps longer than a checkpoint's write); mlp: square Linear "
                        "layers with Adam, sized by --model-mb, the batch chosen for --step-ms (short steps)")
    p.add_argument("--step-ms", type=float, default=None,
                   help="mlp: choose the batch size so that a training step takes about this long "
                        "(default: 100 ms, unless --batch-size is given)")
    p.add_argument("--width", type=int, default=None, help="mlp: layer width (overrides --model-mb)")
    p.add_argument("--model-mb", type=float, default=None,
                   help="target size of params + optimizer moments in MB (chooses --n-embd or --width unless "
                        "given; default 400 for gpt, 230 for mlp)")
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=None, help="hidden size (overrides --model-mb)")
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--block-size", type=int, default=64, help="sequence length")
    p.add_argument("--batch-size", type=int, default=None, help="default: 4 for gpt; for mlp, from --step-ms")
    p.add_argument("--device", default="cpu", help="where the model trains: cpu, or cuda (the GPU path: pinned "
                   "staging, side-stream copies)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch.set_num_threads")
    p.add_argument("--host-memory", default="8GiB", help="ckptrepo staging pool bound")
    p.add_argument("--dcp-cache-staged", action="store_true",
                   help="FileSystemWriter(cache_staged_state_dict=True) for async_save (reuse staging memory)")
    p.add_argument("--process-group", choices=("auto", "always", "never"), default="auto",
                   help="DCP: 'auto' uses no process group when that works, else a 1-rank gloo group")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a new temp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="write the raw results and the summary as JSON")
    p.add_argument("--regimes", action="store_true",
                   help="run both regimes in turns and print them side by side: the short-step case (--model mlp "
                        "--step-ms 100, --rounds rounds) and the long-step one (the GPT every 10, --long-rounds)")
    p.add_argument("--long-rounds", type=int, default=4, help="with --regimes: rounds of the long-step case")
    args = p.parse_args(argv)
    if args.regimes:
        return both_regimes(main, args.rounds or 8, args.long_rounds, [] if args.dir is None else ["--dir", args.dir])

    torch.set_num_threads(args.threads)
    short = args.model == "mlp"
    args.steps = args.steps if args.steps is not None else (60 if short else 30)
    args.every = args.every if args.every is not None else ([5] if short else [10])
    args.model_mb = args.model_mb if args.model_mb is not None else (230.0 if short else 400.0)
    calibrated = None
    if short:
        if args.width is None:
            args.width = choose_width(args.model_mb, args.n_layer)
        if args.batch_size is None:
            args.batch_size, calibrated = calibrate_batch(args, (args.step_ms or 100.0) / 1e3)
    else:
        args.batch_size = args.batch_size if args.batch_size is not None else 4
        if args.n_embd is None:
            args.n_embd = choose_embd(args.model_mb, args.n_layer, args.vocab, args.block_size)
    made_dir = args.dir is None
    args.dir = tempfile.mkdtemp(prefix="training-overhead-") if made_dir else args.dir
    os.makedirs(args.dir, exist_ok=True)
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled, unavailable or uninitialized.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed.checkpoint")
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed.checkpoint")

    probe = Trainer(args)
    numel = sum(p.numel() for p in probe.model.parameters())
    probe.step()
    state_b = probe.state_bytes()
    del probe
    meta = {"model": args.model, "width": args.width, "step_ms_target": args.step_ms,
            "calibrated_step_s": calibrated, "steps": args.steps,
            "every": args.every, "threads": args.threads, "cpus": os.cpu_count(),
            "params_m": numel / 1e6, "state_mb": state_b / MB, "n_layer": args.n_layer, "n_embd": args.n_embd,
            "n_head": args.n_head, "vocab": args.vocab, "block_size": args.block_size,
            "batch_size": args.batch_size, "device": device_name(args.device), "host_memory": args.host_memory,
            "torch": torch.__version__,
            "ckptrepo": ckptrepo.__version__, "dir": args.dir, "warmup": args.warmup,
            "warmup_checkpoint": args.warmup_checkpoint, "dcp_cache_staged": args.dcp_cache_staged,
            "loadavg_start": os.getloadavg()}
    try:
        meta["process_group"] = dcp_setup(args.modes, args.dir, args.process_group)
        plan = (f"{args.rounds} rounds of {args.turn_steps}-step turns" if args.rounds
                else f"{args.steps} steps")
        shape = (f"MLP width={args.width}, batch {args.batch_size}" if short else f"n_embd={args.n_embd}")
        print(f"state {state_b / MB:.0f} MB ({numel / 1e6:.1f} M params, n_layer={args.n_layer}, "
              f"{shape}); {plan}, every {args.every}, {args.threads} threads; "
              f"on {meta['device']}; DCP process group: {meta['process_group']}; dir {args.dir}", flush=True)
        if args.rounds:
            summaries = []
            for every in args.every:
                print(f"every={every}: {args.rounds} rounds of turns", flush=True)
                summaries.append(summarize_turns(run_turns(args.modes, every, args, Trainer, MODE_CLASSES)))
            print_turns(summaries, meta)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"meta": meta, "turns": summaries}, f, indent=1)
            return 0
        results = []

        def go(mode: str, every: int) -> None:
            r = run_mode(mode, every, args)
            results.append(r)
            print(f"  {mode:15s} every={every if mode != 'none' else '-':>3}  wall {r['wall_s']:7.2f} s  "
                  f"drain {r['drain_s']:6.2f} s  cpu {r['cpu_s']:7.2f} s  ckpts {r['checkpoints']}  "
                  f"other CPU use {r['foreign_load']:.2f} CPUs", flush=True)

        for rep in range(args.repeat):
            for every in args.every:
                go("none", 0)
                for mode in (args.modes if rep % 2 == 0 else args.modes[::-1]):
                    go(mode, every)
        go("none", 0)
        meta["loadavg_end"] = os.getloadavg()
        summary = summarize(results, args.every)
        print_table(summary, meta)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "summary": summary, "runs": results}, f, indent=1)
    finally:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        if made_dir:
            shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
