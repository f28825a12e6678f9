"""Looking at history: diff, statistics and trajectories, the log graph, plots, export and import.

The names below are what the command line and the web page use to lay out what they print. Each is imported
on first use (PEP 562), so that importing ``ckptrepo.tools`` loads nothing, and ``ckptrepo log`` loads only
the light modules it lays its lines out with (never torch nor numpy).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ckptrepo._lazy import lazy_exports

# Facade: the names other layers import from this package, read from their modules when asked for (PEP 562)
# so that importing the package stays cheap. Its TYPE_CHECKING imports and _LAZY name the same (test_facades.py).
if TYPE_CHECKING:
    from ckptrepo.tools._bisect import BisectResult, bisect
    from ckptrepo.tools._exchange import export_target, read_checkpoint, state_step, write_export, write_then_rename
    from ckptrepo.tools._graph import GraphRow, graph
    from ckptrepo.tools._hf_export import (
        CONFIG_KEY,
        MODEL_KEY,
        OPTIMIZER_KEY,
        RNG_KEY,
        SCHEDULER_KEY,
        TRAINER_STATE_KEY,
        save_trainer_checkpoint,
    )
    from ckptrepo.tools._inspect import VersionDiff, diff_versions, tensor_stats
    from ckptrepo.tools._paths import output_file
    from ckptrepo.tools._plot import metric_series, metrics_png, require_matplotlib, trajectory_png
    from ckptrepo.tools._recorded import TensorStats, recorded_tensor_stats
    from ckptrepo.tools._stat import SORTS, diff_stat, row_key
    from ckptrepo.tools._status import RepoStatus, Uncommitted, age, repo_status, revision_names
    from ckptrepo.tools._tensorboard import write_scalars
    from ckptrepo.tools._trajectory import METRICS, StatMatrix, TrajectoryPoint, stat_matrix, trajectory
    from ckptrepo.tools._width import fit, keep_last, natural_key, table_lines, terminal_width

_LAZY = {
    "ckptrepo.tools._bisect": ("BisectResult", "bisect"),
    "ckptrepo.tools._exchange": ("export_target", "read_checkpoint", "state_step", "write_export", "write_then_rename"),
    "ckptrepo.tools._graph": ("GraphRow", "graph"),
    "ckptrepo.tools._hf_export": ("CONFIG_KEY", "MODEL_KEY", "OPTIMIZER_KEY", "RNG_KEY", "SCHEDULER_KEY",
                                  "TRAINER_STATE_KEY", "save_trainer_checkpoint"),
    "ckptrepo.tools._inspect": ("VersionDiff", "diff_versions", "tensor_stats"),
    "ckptrepo.tools._paths": ("output_file",),
    "ckptrepo.tools._plot": ("metric_series", "metrics_png", "require_matplotlib", "trajectory_png"),
    "ckptrepo.tools._recorded": ("TensorStats", "recorded_tensor_stats"),
    "ckptrepo.tools._stat": ("SORTS", "diff_stat", "row_key"),
    "ckptrepo.tools._status": ("RepoStatus", "Uncommitted", "age", "repo_status", "revision_names"),
    "ckptrepo.tools._tensorboard": ("write_scalars",),
    "ckptrepo.tools._trajectory": ("METRICS", "StatMatrix", "TrajectoryPoint", "stat_matrix", "trajectory"),
    "ckptrepo.tools._width": ("fit", "keep_last", "natural_key", "table_lines", "terminal_width"),
}
if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = ["BisectResult", "CONFIG_KEY", "GraphRow", "METRICS", "MODEL_KEY", "OPTIMIZER_KEY", "RNG_KEY", "RepoStatus",
           "SCHEDULER_KEY", "SORTS", "StatMatrix", "TRAINER_STATE_KEY", "TensorStats", "TrajectoryPoint", "Uncommitted",
           "VersionDiff", "age", "bisect", "diff_stat", "diff_versions", "export_target", "fit", "graph", "keep_last",
           "metric_series", "metrics_png", "natural_key", "output_file", "read_checkpoint", "recorded_tensor_stats",
           "repo_status", "require_matplotlib", "revision_names", "row_key", "save_trainer_checkpoint", "stat_matrix",
           "state_step", "table_lines", "tensor_stats", "terminal_width", "trajectory", "trajectory_png",
           "write_export", "write_scalars", "write_then_rename"]
# End of facade.
