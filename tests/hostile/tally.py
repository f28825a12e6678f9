"""Run the damage matrix without pytest and print how many runs ended in each outcome.

    python -m tests.hostile.tally [-k SUBSTRING] [-v]
    python tests/hostile/tally.py [-k SUBSTRING] [-v]

The first line is in the form of issue 27's closing note (tried, clear error, leaked error, hang, crash,
changed); then the other outcomes, and the failing cases grouped by cause. ``-v`` prints each failing case's
runs. Exit status 1 if any case falls short of the target behaviour. ``HOSTILE_FRESH=1`` runs each command in
a fresh interpreter, ``HOSTILE_TIMEOUT`` sets the seconds a run may take (20), ``HOSTILE_WORKERS`` the cases run
at once (4).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for entry in (str(HERE.parents[1]), str(HERE.parent)):   # the worktree (ckptrepo), tests/ (the hostile package)
    if entry not in sys.path:
        sys.path.insert(0, entry)

from hostile import _matrix as matrix  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", dest="pattern", default=None, help="Only cases whose id contains this.")
    parser.add_argument("-v", "--verbose", action="store_true", help="Print every failing case's runs.")
    opts = parser.parse_args(argv)

    selected = [c for c in matrix.cases() if opts.pattern is None or opts.pattern in c.id]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ckptrepo-hostile-") as tmp:
        runner = matrix.make_runner(Path(tmp) / "runs")
        pristine = matrix.prepare(Path(tmp) / "pristine", runner)
        done = [0]

        def progress(result: matrix.CaseResult) -> None:
            done[0] += 1
            mark = "FAIL" if result.problems() else "ok"
            print(f"[{done[0]:3}/{len(selected)}] {mark:4} {result.case.id}", file=sys.stderr, flush=True)

        results = matrix.run_matrix(selected, pristine, runner, Path(tmp) / "cases", on_result=progress)
        runner.close()
    print_tally(list(results.values()), time.monotonic() - t0, opts.verbose)
    return 1 if any(r.problems() for r in results.values()) else 0


def print_tally(results: list[matrix.CaseResult], seconds: float, verbose: bool) -> None:
    runs = [r for case in results for r in case.results]
    outcomes = collections.Counter(r.outcome for r in runs)
    changed = sum(1 for r in runs if r.changed)
    must_fail = [c for c in results if c.fsck_must_fail]
    fsck_missed = sum(1 for c in must_fail for r in c.results if r.command == "fsck" and r.outcome == "ok")
    runner = "fresh interpreters" if os.environ.get("HOSTILE_FRESH") else "forked children"
    print(f"hostile matrix: {len(results)} damaged repositories x {len(matrix.COMMANDS)} commands, "
          f"ckptrepo at {matrix.ROOT}, {runner}, timeout {matrix.TIMEOUT_S:g} s, {seconds:.0f} s in all")
    print(f"tried {len(runs)}, clear error {outcomes['error']}, leaked error {outcomes['leaked']}, "
          f"hang {outcomes['hang']}, crash {outcomes['crash']}, changed {changed}")
    print(f"also: succeeded {outcomes['ok']}, load returned wrong data {outcomes['wrong']}, "
          f"fsck exit 0 on damage {fsck_missed} (of {len(must_fail)} cases where it must fail)")
    by_cause: dict[str, list[str]] = collections.defaultdict(list)
    for case in results:
        for cause, _detail in case.problems():
            by_cause[cause].append(case.case.id)
    failing = sum(1 for c in results if c.problems())
    print(f"{failing} of {len(results)} cases fall short" + (":" if failing else ""))
    for cause, ids in sorted(by_cause.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        print(f"  {cause} ({len(ids)}): {', '.join(sorted(set(ids)))}")
    if verbose:
        for case in results:
            if case.problems():
                print(case.report())


if __name__ == "__main__":
    sys.exit(main())
