"""Write a history's recorded metrics and capture statistics as TensorBoard scalars.

Each version contributes its metrics (``loss``, ``lr``, ...) under ``ckptrepo/<metric>`` and its capture
statistics (blocking, capture, flush and total seconds; bytes; GB/s) under ``ckptrepo/capture/<stat>``, at
the version's step, so that they sit next to the run's own curves when TensorBoard is pointed at the same
directory. Only headers are read: no tensor data.
"""
from __future__ import annotations

import os
from typing import Any, Iterable

from ckptrepo.errors import ArgumentError


def write_scalars(log_dir: str | os.PathLike[str], rows: Iterable[tuple[int | None, dict[str, Any],
                                                                           dict[str, Any] | None]]) -> int:
    """Write ``(step, metrics, capture stats)`` per version, oldest first, to an event file in ``log_dir``;
    returns the number of scalars written. Versions without a step are placed at their position in the
    history (0, 1, ...), as a plot of them would."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise ArgumentError(f"writing TensorBoard scalars needs the tensorboard package ({err}); "
                            f"pip install \"ckptrepo[tensorboard]\"") from None
    written = 0
    writer = SummaryWriter(log_dir=os.fspath(log_dir))
    try:
        for position, (step, metrics, stats) in enumerate(rows):
            at = position if step is None else step
            for name, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    writer.add_scalar(f"ckptrepo/{name}", value, global_step=at)
                    written += 1
            for name, value in (stats or {}).items():
                writer.add_scalar(f"ckptrepo/capture/{name}", value, global_step=at)
                written += 1
    finally:
        writer.close()
    return written
