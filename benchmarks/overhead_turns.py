"""Checkpoint overhead measured in turns: one training loop, the modes take turns (``training_overhead.py --turns``).

Separate runs per mode compare walls taken minutes apart, and on a shared VM
the machine's speed drifts by more than the effect measured: the same 60-step
baseline took 41 to 62 s within one session, ±0.6 s per checkpoint of noise
against ckptrepo's ~0.2 s. Here every mode, the no-checkpoint baseline
included, trains the *same* model in one loop, in turns of ``turn_steps``
steps (``every`` steps per checkpoint, so a turn holds ``turn_steps / every``
checkpoints), and the order of the modes rotates every round. A mode's turn
ends with its drain (every checkpoint of the turn durable), so its background
work is charged to its own turn and never leaks into the next mode's. Drift
then hits every mode alike, and each round gives a paired difference:

    overhead per checkpoint (round r) = (turn time of the mode - turn time of the baseline) / checkpoints per turn

reported as the mean over rounds with a 95 % confidence half-width
(1.96 x standard error of the paired differences). Between turns, untimed,
each mode deletes all but its newest checkpoint (ckptrepo: ``repo.gc(keep_last=1)``),
so a long run fits on disk.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable

from bench_common import figure, mean

CONFIDENCE_Z = 1.96


def run_turns(modes: list[str], every: int, args: argparse.Namespace,
              make_trainer: Callable[[argparse.Namespace], Any],
              mode_classes: dict[str, type]) -> dict[str, Any]:
    """Train one model with the modes taking turns; the turn times per mode and each mode's statistics."""
    gc.collect()
    trainer = make_trainer(args)
    names = ["none"] + [m for m in modes if m != "none"]
    per_turn = max(1, args.turn_steps // every)   # checkpoints per turn
    steps = per_turn * every
    objs, roots = {}, []
    for name in names:
        root = tempfile.mkdtemp(dir=args.dir, prefix="turns-" + name.replace(".", "_") + "-")
        roots.append(root)
        objs[name] = mode_classes[name](trainer, root, args)
    step_no = 0
    loss = None

    def turn(name: str) -> float:
        nonlocal step_no, loss
        mode = objs[name]
        t0 = time.perf_counter()
        for k in range(steps):
            loss = trainer.step()
            if name != "none" and k % every == 0:
                mode.checkpoint(step_no, loss)
            step_no += 1
        mode.drain()
        trainer.sync()
        return time.perf_counter() - t0

    try:
        for _ in range(args.warmup):
            loss = trainer.step()
        for name in names:             # one untimed turn each: first-touch, plan caches, imports
            turn(name)
            objs[name].prune(keep=1)
            objs[name].reset()
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                times[name].append(turn(name))
                objs[name].prune(keep=1)
                os.sync()
            print(f"  round {r + 1}/{args.rounds}: " + "  ".join(f"{n} {times[n][-1]:.2f}" for n in names), flush=True)
        stats = {}
        for name in names:
            mode = objs[name]
            mode.finish()
            stats[name] = {"blocking_s": list(mode.blocking), "durable_s": list(mode.durable),
                           "extra": {k: list(v) for k, v in mode.extra.items()}}
            if hasattr(mode, "close"):
                mode.close()
        return {"every": every, "per_turn": per_turn, "steps_per_turn": steps, "rounds": args.rounds,
                "turn_s": times, "stats": stats}
    finally:
        objs.clear()
        gc.collect()
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)


def summarize_turns(result: dict[str, Any]) -> dict[str, Any]:
    """Per mode: the paired overhead per checkpoint (mean ± 95 % half-width), blocking and durable means."""
    times, per_turn = result["turn_s"], result["per_turn"]
    base = times["none"]
    rows = []
    for name, ts in times.items():
        if name == "none":
            continue
        diffs = [(t - b) / per_turn for t, b in zip(ts, base)]
        half = CONFIDENCE_Z * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
        st = result["stats"][name]
        rows.append({"mode": name, "overhead_per_ckpt_s": statistics.mean(diffs), "half_width_s": half,
                     "overhead_median_s": statistics.median(diffs),
                     "blocking_per_ckpt_s": mean(st["blocking_s"]), "durable_per_ckpt_s": mean(st["durable_s"]),
                     "extra": {k: mean(v) for k, v in sorted(st["extra"].items())}})
    ratio: dict[str, Any] = {}
    peers = [r for r in rows if not r["mode"].startswith("ckptrepo")]
    mine = next((r for r in rows if r["mode"] == "ckptrepo"), None)
    if peers and mine is not None:
        best = min(peers, key=lambda r: r["overhead_per_ckpt_s"])
        ratio = {"best_peer": best["mode"], "best_peer_s": best["overhead_per_ckpt_s"],
                 "ckptrepo_s": mine["overhead_per_ckpt_s"]}
        if best["overhead_per_ckpt_s"] > 0:
            ratio["overhead_vs_best_peer"] = mine["overhead_per_ckpt_s"] / best["overhead_per_ckpt_s"]
            # the ratio's range when both figures sit at the ends of their 95 % intervals
            lo = ((mine["overhead_per_ckpt_s"] - mine["half_width_s"])
                  / (best["overhead_per_ckpt_s"] + best["half_width_s"]))
            hi_den = best["overhead_per_ckpt_s"] - best["half_width_s"]
            hi = (mine["overhead_per_ckpt_s"] + mine["half_width_s"]) / hi_den if hi_den > 0 else float("inf")
            ratio["ratio_range"] = [lo, hi]
        ts = next((r for r in rows if r["mode"] == "torch.save"), None)
        if ts is not None and ts["blocking_per_ckpt_s"]:
            ratio["blocking_vs_torch_save"] = mine["blocking_per_ckpt_s"] / ts["blocking_per_ckpt_s"]
    return {"every": result["every"], "per_turn": per_turn, "rounds": result["rounds"],
            "baseline_turn_s": statistics.median(base), "baseline_turns_s": base, "rows": rows, "ratio": ratio}


def print_turns(summaries: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """The turns table (rich), one section per ``every``, then the ratios."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    table = Table(title=f"Checkpoint cost measured in turns: {meta['state_mb']:.0f} MB state "
                        f"({meta['params_m']:.1f} M params + AdamW moments), {meta['threads']} torch threads, "
                        f"{meta['cpus']} CPUs, on {meta['device']}",
                  caption="One training loop; each round every mode (and the baseline) trains one turn, in rotating "
                          "order; a turn ends when its checkpoints are durable. overhead/ckpt: mean over rounds of "
                          "(mode's turn - baseline's turn in the same round) / checkpoints per turn, "
                          "± 95 % half-width. "
                          "Times in seconds.")
    for col in ("every", "mode", "ckpts/turn", "rounds", "baseline turn", "overhead/ckpt", "median",
                "blocking/ckpt", "durable/ckpt", "details"):
        table.add_column(col, justify="left" if col in ("mode", "details") else "right")
    for i, s in enumerate(summaries):
        if i:
            table.add_section()
        for r in s["rows"]:
            ex = r["extra"]
            details = ""
            if r["mode"].startswith("ckptrepo"):
                details = (f"capture {figure(ex.get('capture_s'))}, flush {figure(ex.get('flush_s'))}, "
                           f"{figure(ex.get('gbps'), '{:.2f}')} GB/s; "
                           f"copied {figure(ex.get('copied_mb'), '{:.1f}')} MB")
            elif r["mode"] == "dcp.async_save":
                details = f"call {figure(ex.get('call_s'))} + wait prev {figure(ex.get('wait_prev_s'))}"
            table.add_row(str(s["every"]), r["mode"], str(s["per_turn"]), str(s["rounds"]),
                          f"{s['baseline_turn_s']:.2f}", f"{r['overhead_per_ckpt_s']:.3f} ±{r['half_width_s']:.3f}",
                          figure(r["overhead_median_s"]), figure(r["blocking_per_ckpt_s"]),
                          figure(r["durable_per_ckpt_s"]), details)
    console.print(table)
    for s in summaries:
        ratio = s["ratio"]
        parts = []
        if "overhead_vs_best_peer" in ratio:
            lo, hi = ratio["ratio_range"]
            parts.append(f"ckptrepo overhead/ckpt ÷ best peer's ({ratio['best_peer']}) = {ratio['ckptrepo_s']:.3f} / "
                         f"{ratio['best_peer_s']:.3f} = {ratio['overhead_vs_best_peer']:.2f} "
                         f"(range at the 95 % ends: {lo:.2f} to {hi:.2f})")
        if "blocking_vs_torch_save" in ratio:
            parts.append(f"ckptrepo blocking ÷ torch.save blocking = {ratio['blocking_vs_torch_save']:.3f}")
        if parts:
            console.print(f"every={s['every']}: " + "; ".join(parts))


SHORT_REGIME = ["--model", "mlp", "--step-ms", "100", "--modes", "dcp.save", "dcp.async_save", "ckptrepo",
                "ckptrepo-nostats"]
LONG_REGIME = ["--every", "10", "--modes", "dcp.async_save", "ckptrepo"]


def both_regimes(run: Callable[[list[str]], int], rounds: int, long_rounds: int, extra: list[str]) -> int:
    """The short-step case (the MLP, a 0.1 s step, every 5) and the long-step one (the GPT, every 10), one
    after the other in this process through ``run`` (training_overhead.py's ``main``), each in turns against
    its peers; then one table of both, each row's overhead also as a multiple of its regime's best peer.
    ``extra``: arguments both runs share (``--dir``)."""
    from rich.console import Console
    from rich.table import Table

    out: list[tuple[str, dict[str, Any]]] = []
    for name, regime, r in (("short steps", SHORT_REGIME, rounds), ("long steps", LONG_REGIME, long_rounds)):
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            run([*regime, "--rounds", str(r), *extra, "--json", path])
            with open(path) as f:
                out.append((name, json.load(f)))
        finally:
            os.unlink(path)
    table = Table(title="Both regimes, each measured in turns against its peers (seconds per checkpoint)")
    for col in ("regime", "state", "baseline turn", "mode", "overhead/ckpt", "blocking/ckpt", "durable/ckpt",
                "÷ best peer"):
        table.add_column(col, justify="left" if col in ("regime", "mode", "state") else "right")
    for name, res in out:
        meta, summary = res["meta"], res["turns"][0]
        shape = f"{meta['state_mb']:.0f} MB {meta['model']}, every {summary['every']}"
        peers = [r["overhead_per_ckpt_s"] for r in summary["rows"] if not r["mode"].startswith("ckptrepo")]
        best = min(peers) if peers else None
        for r in summary["rows"]:
            ratio = r["overhead_per_ckpt_s"] / best if best and best > 0 else None
            table.add_row(name, shape, f"{summary['baseline_turn_s']:.2f}", r["mode"],
                          f"{r['overhead_per_ckpt_s']:.3f} ±{r['half_width_s']:.3f}",
                          figure(r["blocking_per_ckpt_s"]), figure(r["durable_per_ckpt_s"]),
                          figure(ratio, "{:.2f}"))
        table.add_section()
    Console(width=200).print(table)
    return 0
