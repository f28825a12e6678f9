"""Run the damage matrix without pytest and print how many runs ended in each outcome.

    python -m tests.hostile.tally [-k SUBSTRING] [-v]
    python tests/hostile/tally.py [-k SUBSTRING] [-v]

The first line is in the form of issue 27's closing note (tried, clear error, leaked error, hang, crash,
changed); then the other outcomes, and the failing cases grouped by cause. ``-v`` prints each failing case's
runs. Exit status 1 if any case falls short of the target behaviour. ``HOSTILE_FRESH=1`` runs each command in
a fresh interpreter, ``HOSTILE_TIMEOUT`` sets the seconds a run may take (20), ``HOSTILE_WORKERS`` the cases run
at once (4).

Then the other hostile classes: each ``test_*.py`` beside this file that names a ``HOSTILE_CLASS`` (hostile remotes,
pointer files, the web page, ...) runs under pytest, and a table gives, per class, the cases that hold and those
that fall short. ``--classes`` runs only that table; ``--library DIR`` runs the classes' tests against the ckptrepo
of another checkout (an older commit's worktree, say), which is how a before/after table is made.
"""
from __future__ import annotations

import argparse
import ast
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from xml.etree import ElementTree

HERE = Path(__file__).resolve().parent
for entry in (str(HERE.parents[1]), str(HERE.parent)):   # the worktree (ckptrepo), tests/ (the hostile package)
    if entry not in sys.path:
        sys.path.insert(0, entry)

from hostile import _matrix as matrix  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", dest="pattern", default=None, help="Only cases whose id contains this.")
    parser.add_argument("-v", "--verbose", action="store_true", help="Print every failing case's runs.")
    parser.add_argument("--classes", action="store_true", help="Only the table of the other hostile classes.")
    parser.add_argument("--library", type=Path, default=None,
                        help="Run the classes' tests against the ckptrepo package under this checkout.")
    opts = parser.parse_args(argv)

    classes = class_files()
    if opts.classes:
        return print_class_table(run_classes(classes, opts.library, opts.pattern))
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
    short = print_class_table(run_classes(classes, opts.library, opts.pattern))
    return 1 if short or any(r.problems() for r in results.values()) else 0


def class_files() -> dict[str, list[Path]]:
    """The hostile classes beside this file, each with its test modules, read from ``HOSTILE_CLASS`` without
    importing the module (which would import ckptrepo into this process)."""
    found: dict[str, list[Path]] = collections.defaultdict(list)
    for path in sorted(HERE.glob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "HOSTILE_CLASS"
                                                     for t in node.targets)
                    and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
                found[node.value.value].append(path)
    return dict(found)


def run_classes(classes: dict[str, list[Path]], library: Path | None,
                pattern: str | None) -> dict[str, collections.Counter[str]]:
    """Each class's tests in one pytest child; the outcome counts per class, from its JUnit XML report."""
    counts: dict[str, collections.Counter[str]] = {}
    # the library under test first, tests/ for the helpers the tests import; ``-P`` keeps the working
    # directory (this worktree, whose ckptrepo would shadow another checkout's) off the path
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str((library or HERE.parents[1]).resolve()),
                                                       str(HERE.parent)]))
    with tempfile.TemporaryDirectory(prefix="ckptrepo-hostile-classes-") as tmp:
        for name, paths in sorted(classes.items()):
            report = Path(tmp) / "report.xml"
            command = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                       f"--junitxml={report}", *map(str, paths)] + (["-k", pattern] if pattern else [])
            subprocess.run(command, cwd=HERE.parents[1], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=1800)
            outcomes = junit_outcomes(report)
            # a module an older library cannot even import reports one error for all its cases: count them all
            # (as this worktree collects them) as falling short
            cases = collected(paths, pattern)
            outcomes["failed"] = max(0, cases - outcomes["held"] - outcomes["skipped"])
            outcomes["error"] = 0
            counts[name] = outcomes
    return counts


def collected(paths: list[Path], pattern: str | None) -> int:
    """How many cases pytest collects from ``paths`` with this worktree's ckptrepo."""
    command = [sys.executable, "-P", "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
               "-o", "addopts=", *map(str, paths)] + (["-k", pattern] if pattern else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parents[1]), str(HERE.parent)]))
    out = subprocess.run(command, cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=600)
    return sum(1 for line in out.stdout.splitlines() if "::" in line)


def junit_outcomes(report: Path) -> collections.Counter[str]:
    outcomes: collections.Counter[str] = collections.Counter()
    if not report.exists():
        outcomes["error"] += 1   # pytest could not even collect
        return outcomes
    for case in ElementTree.parse(report).iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = ("failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "held")
        outcomes[outcome] += 1
    return outcomes


def print_class_table(counts: dict[str, collections.Counter[str]]) -> int:
    """Print the per-class table; return the number of cases that fall short."""
    print("| hostile class | cases | held | fall short | skipped |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, c in counts.items():
        total = sum(c.values())
        print(f"| {name} | {total} | {c['held']} | {c['failed'] + c['error']} | {c['skipped']} |")
    return sum(c["failed"] + c["error"] for c in counts.values())


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
