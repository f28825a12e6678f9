"""Helpers shared by the benchmark scripts (run them as `python benchmarks/NAME.py`)."""
from __future__ import annotations

import json
import math
import os
import resource
from typing import Any, Callable


def cpu_s() -> float:
    """CPU seconds (user + system, all threads) this process has used."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def fsync_dir(path: str) -> None:
    """Make a directory entry (a new file in it) durable, as the peers' saves must be for a fair timing."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def report(summary: dict[str, Any], print_table: Callable[[dict[str, Any]], None], json_path: str | None) -> int:
    """Print a benchmark's table and, if asked, write its figures as JSON; the script's exit status."""
    print_table(summary)
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(summary, fh, indent=2)
        print(f"figures written to {json_path}")
    return 0


def mean(xs: list[float]) -> float | None:
    """The mean of the figures that are numbers (NaN: not measured), or None if there are none."""
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else None


def figure(x: float | None, fmt: str = "{:.3f}") -> str:
    """A table cell: the figure formatted, or "-" where it was not measured."""
    return "-" if x is None else fmt.format(x)
