"""PNG plots of trajectories and recorded metrics over steps (``trajectory --png``, ``metrics --png``).

matplotlib is an optional extra (``pip install 'ckptrepo[plot]'``): a
checkpoint library should not pull a plotting stack into every training job.
Figures are drawn with matplotlib's object API (``Figure``, Agg), never pyplot,
so nothing depends on a display or on global pyplot state.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Sequence

from ckptrepo.errors import MissingDependencyError

if TYPE_CHECKING:   # inspect needs torch; `ckptrepo metrics` does not
    from ckptrepo.tools._trajectory import TrajectoryPoint

Series = dict[str, tuple[list[float], list[float]]]   # label -> (x, y)


def require_matplotlib() -> None:
    """Fail early, with the install command, when matplotlib is missing (before any expensive computation)."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        raise MissingDependencyError("writing a PNG needs matplotlib; install it with: pip install 'ckptrepo[plot]'") \
            from None


def metric_series(rows: Sequence[dict[str, Any]]) -> Series:
    """The numeric metrics of ``Repository.metrics()`` rows as one series per name over the step.

    Versions without a step are placed by their position in the history;
    string and boolean metrics are left out (they have no axis).
    """
    use_steps = all(r["step"] is not None for r in rows)
    series: Series = {}
    for i, r in enumerate(rows):
        for name, value in r.items():
            if name in ("version", "step") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            xs, ys = series.setdefault(name, ([], []))
            xs.append(r["step"] if use_steps else i)
            ys.append(float(value))
    return series


def trajectory_png(points: Sequence[TrajectoryPoint], path: str | os.PathLike[str], metric: str, pattern: str) -> None:
    """One line per tensor of ``Repository.trajectory`` points, the metric over the step, in one panel."""
    use_steps = all(p.step is not None for p in points)
    order = {vid: i for i, vid in enumerate(dict.fromkeys(p.version for p in points))}
    series: Series = {}
    for p in points:
        xs, ys = series.setdefault(p.name, ([], []))
        xs.append(p.step if use_steps and p.step is not None else order[p.version])
        ys.append(p.value)
    _save(path, [(metric, series)], f"{metric} of {pattern}", "step" if use_steps else "version (oldest first)")


def metrics_png(rows: Sequence[dict[str, Any]], path: str | os.PathLike[str], title: str) -> None:
    """One panel per numeric metric (they have different scales: loss vs learning rate) over the step."""
    series = metric_series(rows)
    use_steps = all(r["step"] is not None for r in rows)
    _save(path, [(name, {name: xy}) for name, xy in series.items()], title,
          "step" if use_steps else "version (oldest first)")


_MAX_LEGEND = 12   # beyond this a legend hides the plot


def _save(path: str | os.PathLike[str], panels: list[tuple[str, Series]], title: str, xlabel: str) -> None:
    require_matplotlib()
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator
    panels = panels or [("", {})]
    fig = Figure(figsize=(8, 2.2 + 2.3 * len(panels)), dpi=100, layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (ylabel, series) in zip(axes, panels, strict=True):
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, marker=".", label=label)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if 0 < len(series) <= _MAX_LEGEND and list(series) != [ylabel]:
            ax.legend(fontsize="small")
    axes[0].set_title(title)
    axes[-1].set_xlabel(xlabel)
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))   # steps and positions are whole numbers
    fig.savefig(path, format="png")
