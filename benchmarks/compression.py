"""Lossless compression (``compression="zstd"``) against none: ratio, save and load throughput, per dtype.

No model weights ship with the installed packages, so the state is a tiny GPT (examples/tiny_gpt.py)
trained ``--steps`` steps with AdamW on a learnable synthetic sequence; its trained weights and Adam moments
are the data. Per dtype group, side by side in one run:

* ``bf16 weights``: the parameters cast to bfloat16 (how mixed-precision runs keep a model copy);
* ``fp32 Adam moments``: ``exp_avg`` and ``exp_avg_sq`` of every parameter;
* ``fp16 weights``: the parameters cast to float16;
* ``fp32 weights``: the master parameters.

Each group is tiled ``--copies`` times (distinct tensors of the same bytes: compression works per 64 KiB
chunk, so copies change the size, not the ratio) and saved with ``repo.snapshot`` (durable on return)
into a new local repository, without and with compression, then loaded (``repo.load``): cold (page cache
evicted first with posix_fadvise), then warm (the files just read, in the page cache). Best of ``--repeat``
(saves) and of ``--repeat`` x ``--loads`` (loads). ``load x`` is the compressed load's time over the plain
one's, cold and warm.

"pays below" is the store bandwidth under which compressing saves time on a save: writing S bytes
plain takes S/B, compressed about S/C + S/(r·B), where C is the measured compressed save throughput (a
local save: compression plus a local write) and r the ratio; so it pays while B < C·(1 - 1/r).

    nice python benchmarks/compression.py                 # ~30 MB per group, 200 training steps
    nice python benchmarks/compression.py --copies 4 --steps 300 --json out.json
    python benchmarks/compression.py --steps 50 --repeat 1 --loads 3    # mostly loads: quicker
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import report  # noqa: E402
from save_load import evict  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from tiny_gpt import GPTConfig, TinyGPT  # noqa: E402

import ckptrepo  # noqa: E402

MB = 1e6


def train(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer, float]:
    """A tiny GPT trained on a noisy periodic token sequence (learnable, so the weights move off their init)."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=64, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd,
                    dropout=0.0)
    model = TinyGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    period = torch.randint(0, args.vocab, (97,), generator=g)
    loss = torch.zeros(())
    for _ in range(args.steps):
        start = torch.randint(0, 97, (16, 1), generator=g)
        idx = period[(start + torch.arange(65)) % 97]
        noise = torch.rand(idx.shape, generator=g) < 0.1
        idx = torch.where(noise, torch.randint(0, args.vocab, idx.shape, generator=g), idx)
        _, loss = model(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model, opt, float(loss.detach())


def groups(model: torch.nn.Module, opt: torch.optim.Optimizer, copies: int) -> dict[str, dict[str, torch.Tensor]]:
    params = {n: p.detach() for n, p in model.named_parameters()}
    moments = {f"{n}.{k}": opt.state[p][k] for n, p in model.named_parameters() for k in ("exp_avg", "exp_avg_sq")}
    base = {"bf16 weights": {n: t.to(torch.bfloat16) for n, t in params.items()},
            "fp32 Adam moments": moments,
            "fp16 weights": {n: t.half() for n, t in params.items()},
            "fp32 weights": {n: t.clone() for n, t in params.items()}}
    return {g: {f"{c}/{n}": t.clone() for c in range(copies) for n, t in ts.items()} for g, ts in base.items()}


def data_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(root, "data")) for f in fs)


def measure(state: dict[str, torch.Tensor], compression: str, tmp: str, repeat: int, rounds: int) -> dict[str, Any]:
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    saves, loads, warm, stored = [], [], [], 0
    for k in range(repeat):
        root = os.path.join(tmp, f"{compression}-{k}")
        repo = ckptrepo.init(root, compression=compression)
        gc.collect()
        t0 = time.perf_counter()
        repo.snapshot(state, step=0)
        saves.append(time.perf_counter() - t0)
        stored = data_bytes(root)
        for _ in range(rounds):
            for cold, times in ((True, loads), (False, warm)):
                if cold:
                    evict(os.path.join(root, "data"))
                fresh = ckptrepo.open(root)
                t0 = time.perf_counter()
                back = fresh.load()
                times.append(time.perf_counter() - t0)
                assert all(torch.equal(back[n].view(torch.uint8), t.view(torch.uint8)) for n, t in state.items())
                del back
        shutil.rmtree(root)
    return {"compression": compression, "bytes": nbytes, "stored_bytes": stored, "ratio": nbytes / stored,
            "save_s": min(saves), "load_s": min(loads), "save_mbps": nbytes / MB / min(saves),
            "load_mbps": nbytes / MB / min(loads), "warm_load_s": min(warm), "warm_load_mbps": nbytes / MB / min(warm)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    model, opt, loss = train(args)
    train_s = time.perf_counter() - t0
    rows = []
    tmp = tempfile.mkdtemp(prefix="ckptrepo-compression-", dir=args.dir)
    try:
        for group, state in groups(model, opt, args.copies).items():
            for compression in ("none", "zstd"):
                rows.append({"group": group, **measure(state, compression, tmp, args.repeat, args.loads)})
            plain, zstd = rows[-2], rows[-1]
            zstd["load_x"] = zstd["load_s"] / plain["load_s"]
            zstd["warm_load_x"] = zstd["warm_load_s"] / plain["warm_load_s"]
            r = zstd["ratio"] / plain["ratio"]
            zstd["pays_below_mbps"] = zstd["save_mbps"] * (1 - 1 / r) if r > 1 else 0.0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"model": {"n_layer": args.n_layer, "n_embd": args.n_embd, "vocab": args.vocab, "steps": args.steps,
                      "final_loss": loss, "train_s": train_s, "copies": args.copies}, "rows": rows}


def print_table(summary: dict[str, Any]) -> None:
    m = summary["model"]
    print(f"tiny GPT {m['n_layer']}x{m['n_embd']}, vocab {m['vocab']}, {m['steps']} AdamW steps "
          f"(loss {m['final_loss']:.2f}), x{m['copies']} copies")
    print(f"{'dtype group':<18} {'comp':<5} {'MB':>7} {'ratio':>6} {'save MB/s':>10} {'load MB/s':>10} "
          f"{'warm MB/s':>10} {'load x':>7} {'warm x':>7} {'pays below MB/s':>16}")
    for r in summary["rows"]:
        pays = f"{r['pays_below_mbps']:.0f}" if "pays_below_mbps" in r else ""
        cold_x = f"{r['load_x']:.2f}" if "load_x" in r else ""
        warm_x = f"{r['warm_load_x']:.2f}" if "warm_load_x" in r else ""
        print(f"{r['group']:<18} {r['compression']:<5} {r['bytes'] / MB:>7.1f} {r['ratio']:>6.2f} "
              f"{r['save_mbps']:>10.0f} {r['load_mbps']:>10.0f} {r['warm_load_mbps']:>10.0f} {cold_x:>7} "
              f"{warm_x:>7} {pays:>16}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="training steps before the state is taken")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--copies", type=int, default=2, help="each group tiled this many times")
    p.add_argument("--repeat", type=int, default=2, help="best of this many saves and loads")
    p.add_argument("--loads", type=int, default=1, help="cold and warm loads per save")
    p.add_argument("--dir", default=None, help="where the repositories go (default: the temp directory)")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    return report(run(args), print_table, args.json)


if __name__ == "__main__":
    sys.exit(main())
