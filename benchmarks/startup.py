"""Start-up of the data commands: `diff`, `show --stat`, `log -p` and `stats` on a small repository, against
`log`, `show` and `status`, timed end to end as a user runs them (a new process each, start-up included).

The repository is about 16 MiB: four versions of a ~4 MiB state (twelve 256x256 float32 weights, four bfloat16
ones, an int64 buffer), every float tensor changed at each step; the newest version is saved without
capture-time statistics, so `stats HEAD` reads its data while `stats HEAD~1` answers from the records. Each
command runs ``--repeat`` times per checkout, the checkouts alternating command by command (``--code DIR``,
repeatable: e.g. the starting commit's checkout and this one); best and median walls are printed, and whether
the command imported torch.

    python benchmarks/startup.py --repeat 5 --code /path/to/base --code .
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = {
    "python -c pass": None,
    "log -n 10": ["log", "-n", "10"],
    "status": ["status"],
    "show HEAD": ["show", "HEAD"],
    "show --stat HEAD": ["show", "--stat", "HEAD"],
    "diff HEAD~1 HEAD": ["diff", "HEAD~1", "HEAD"],
    "log -p": ["log", "-p"],
    "stats HEAD (reads data)": ["stats", "HEAD"],
    "stats HEAD~1 (recorded)": ["stats", "HEAD~1"],
}
# runs the CLI as `python -m ckptrepo.cli` does, then says on stderr whether torch was imported
_RUN = ("import runpy, sys\n"
        "sys.argv = ['ckptrepo'] + sys.argv[1:]\n"
        "try:\n    runpy.run_module('ckptrepo.cli', run_name='__main__')\n"
        "finally:\n    sys.stderr.write('\\nTORCH=%d\\n' % ('torch' in sys.modules))\n")


def build(path: Path) -> None:
    import torch

    import ckptrepo
    repo = ckptrepo.init(str(path))
    g = torch.Generator().manual_seed(0)
    state = {"model": {f"layers.{i}.weight": torch.randn(256, 256, generator=g) for i in range(12)},
             "half": {f"layers.{i}.weight": torch.randn(256, 256, generator=g).to(torch.bfloat16) for i in range(4)},
             "buffers": {"count": torch.arange(1000)}, "lr": 1e-3}
    for step in range(4):
        for t in list(state["model"].values()) + list(state["half"].values()):
            t.add_(0.01)
        state["lr"] = 1e-3 / (step + 1)
        with repo.snapshotter(tensor_stats=step < 3) as snap:
            snap.snapshot(state, step=step, metrics={"loss": 1.0 / (step + 1)})


def timed(args: list[str] | None, repo: Path, code: Path) -> tuple[float, bool]:
    """One run's wall and whether it imported torch."""
    env = dict(os.environ, PYTHONPATH=str(code.resolve()), CKPTREPO_REPO=str(repo), COLUMNS="120")
    cmd = [sys.executable, "-c", "pass"] if args is None else [sys.executable, "-c", _RUN, *args]
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(repo.parent))
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"{args} failed under {code}: {p.stderr.strip()[-2000:]}")
    return wall, "TORCH=1" in p.stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5, help="Runs of each command per checkout.")
    ap.add_argument("--code", type=Path, action="append", default=None,
                    help="A checkout whose CLI to time (repeatable; default: this one).")
    ap.add_argument("--only", nargs="*", default=None, help="Only these commands (names as printed).")
    a = ap.parse_args()
    codes = [c.resolve() for c in a.code or [ROOT]]
    names = [n for n in COMMANDS if a.only is None or n in a.only]
    with tempfile.TemporaryDirectory(prefix="ckptrepo-startup-") as tmp:
        repo = Path(tmp) / "repo"
        build(repo)
        size = sum(f.stat().st_size for f in repo.rglob("*") if f.is_file())
        print(f"repository: {size / 2**20:.1f} MiB, 4 versions; {a.repeat} runs per command and checkout")
        walls: dict[tuple[str, int], list[float]] = {}
        torch_in: dict[tuple[str, int], bool] = {}
        for _ in range(a.repeat):
            for name in names:
                for k, code in enumerate(codes):   # alternating: drift of the machine falls on every checkout
                    wall, used = timed(COMMANDS[name], repo, code)
                    walls.setdefault((name, k), []).append(wall)
                    torch_in[name, k] = used
    head = ["command"] + [f"{c.name or c}: best / median s (torch)" for c in codes]
    if len(codes) > 1:
        head.append(f"best {codes[-1].name} / {codes[0].name}")
    print("| " + " | ".join(head) + " |")
    print("| --- |" + " ---: |" * (len(head) - 1))
    for name in names:
        cells = [f"`{name}`"]
        for k in range(len(codes)):
            w = walls[name, k]
            flag = "" if COMMANDS[name] is None else (" (torch)" if torch_in[name, k] else " (no torch)")
            cells.append(f"{min(w):.3f} / {statistics.median(w):.3f}{flag}")
        if len(codes) > 1:
            cells.append(f"{min(walls[name, len(codes) - 1]) / min(walls[name, 0]):.2f}x")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
