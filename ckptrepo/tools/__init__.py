"""Looking at history: diff, statistics and trajectories, the log graph, plots, export and import.

The names below are what the command line and the web page use to lay out what they print. Each is imported
on first use (PEP 562), so that importing ``ckptrepo.tools`` loads nothing, and ``ckptrepo log`` loads only
the light modules it lays its lines out with (never torch nor numpy).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckptrepo.tools._graph import GraphRow, graph
    from ckptrepo.tools._paths import output_file
    from ckptrepo.tools._plot import metric_series, metrics_png, require_matplotlib, trajectory_png
    from ckptrepo.tools._stat import diff_stat, row_key
    from ckptrepo.tools._status import RepoStatus, Uncommitted, age
    from ckptrepo.tools._width import fit, fit_middle, keep_last, natural_key, table_lines, terminal_width

_WHERE = {
    "GraphRow": "_graph", "graph": "_graph",
    "output_file": "_paths",
    "metric_series": "_plot", "metrics_png": "_plot", "require_matplotlib": "_plot", "trajectory_png": "_plot",
    "diff_stat": "_stat", "row_key": "_stat",
    "RepoStatus": "_status", "Uncommitted": "_status", "age": "_status",
    "fit": "_width", "fit_middle": "_width", "keep_last": "_width", "natural_key": "_width",
    "table_lines": "_width", "terminal_width": "_width",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_WHERE))


__all__ = ["GraphRow", "RepoStatus", "Uncommitted", "age", "diff_stat", "fit", "fit_middle", "graph", "keep_last",
           "metric_series", "metrics_png", "natural_key", "output_file", "require_matplotlib", "row_key",
           "table_lines", "terminal_width", "trajectory_png"]
