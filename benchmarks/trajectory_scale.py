"""Trajectory questions over long histories: `trajectory`, `stats`, `diff` and `bisect` at 100, 1,000 and
10,000 versions, timed end to end as a user runs them (a new process, start-up included).

The state is the one of issue 30's report: a 64x64 weight and a bias per layer, a snapshot per step, a
loss metric. Each command runs ``--repeat`` times; the median is printed. ``--code DIR`` runs the CLI of
another checkout on the same repositories (e.g. the release before capture statistics, which reads data
for every question; a command it does not have is shown as "-").

    python benchmarks/trajectory_scale.py --versions 100 1000 10000
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


def build(path: Path, versions: int, layers: int) -> None:
    import torch

    import ckptrepo
    repo = ckptrepo.init(path)
    g = torch.Generator().manual_seed(0)
    state = {f"m.layers.{i}.{k}": torch.randn(*shape, generator=g)
             for i in range(layers) for k, shape in (("w", (64, 64)), ("b", (64,)))}
    with repo.snapshotter() as snap:
        for step in range(versions):
            for t in state.values():
                t.mul_(1.001).add_(0.001)
            if step == int(versions * 0.7):
                state["m.layers.0.w"][0, 0] = 1e4      # a blow-up for bisect to find
            snap.snapshot(state, step=step, metrics={"loss": 4.0 - 3.0 * step / versions})
            if step % 64 == 63:
                snap.wait()


def timed(args: list[str], repo: Path, repeat: int, code: Path) -> float | None:
    env = dict(os.environ, PYTHONPATH=str(code), CKPTREPO_REPO=str(repo))
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "ckptrepo.cli", *args], env=env, capture_output=True, text=True,
                           cwd=code)   # -m puts the working directory first on sys.path
        times.append(time.perf_counter() - t)
        if p.returncode == 2 and ("No such command" in p.stderr or "Invalid value" in p.stderr):
            return None
        if p.returncode not in (0, 1):
            raise SystemExit(f"{args} failed: {p.stderr.strip()}")
    return statistics.median(times)


COMMANDS = {
    "log -n 10": ["log", "-n", "10"],
    "trajectory 'm.*' --json": ["trajectory", "m.*", "--json"],
    "trajectory 'm.*' --metric absmax": ["trajectory", "m.*", "--metric", "absmax"],
    "stats HEAD": ["stats", "HEAD"],
    "diff HEAD~1 HEAD": ["diff", "HEAD~1", "HEAD"],
    "bisect --metric loss": ["bisect", "--metric", "loss", "--when", "below 2.0"],
    "bisect --tensor --stat absmax": ["bisect", "--tensor", "m.*", "--stat", "absmax", "--when", "above 100"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", type=int, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--code", default=str(ROOT), help="The checkout whose CLI runs (default: this one).")
    ap.add_argument("--dir", default=None, help="Where to build the repositories (default: a temporary folder).")
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="ckptrepo-traj-"))
    results: dict[int, dict[str, float | None]] = {}
    for n in args.versions:
        repo = base / f"r{n}"
        if not repo.exists():
            t = time.perf_counter()
            build(repo, n, args.layers)
            print(f"built {n} versions in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        results[n] = {name: timed(cmd, repo, args.repeat, Path(args.code)) for name, cmd in COMMANDS.items()}
    print(f"| command | {' | '.join(f'{n:,} versions' for n in args.versions)} |")
    print(f"|---|{'---:|' * len(args.versions)}")
    for name in COMMANDS:
        cells = ["-" if results[n][name] is None else f"{results[n][name]:.2f} s" for n in args.versions]
        print(f"| `{name}` | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
