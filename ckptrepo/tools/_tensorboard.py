"""Write a history's recorded metrics and capture statistics as TensorBoard scalars.

Each version contributes its metrics (``loss``, ``lr``, ...) under ``ckptrepo/<metric>`` and its capture
statistics (blocking, capture, flush and total seconds; bytes; GB/s) under ``ckptrepo/capture/<stat>``, at
the version's step, so that they sit next to the run's own curves when TensorBoard is pointed at the same
directory. Only headers are read: no tensor data.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable, Sequence

from ckptrepo.arguments import is_number
from ckptrepo.errors import ArgumentError, ExchangeError, os_error_line
from ckptrepo.tools._paths import output_folder

if TYPE_CHECKING:
    from ckptrepo.core.schema import ManifestHeader


def write_scalars(log_dir: str | os.PathLike[str], history: Callable[[], Sequence[tuple[str, ManifestHeader]]],
                  repo_root: str | None = None) -> int:
    """Write each version's step, metrics and capture statistics (``history()``: (id, header), oldest first) to
    an event file in ``log_dir``; returns the number of scalars written. Versions without a step are placed
    at their position in the history (0, 1, ...), as a plot of them would. ``log_dir`` is checked first, and
    the history read before the folder is made, so a bad folder or revision leaves nothing behind; a folder
    inside the repository at ``repo_root`` is refused, as ``--csv`` and ``--png`` files are."""
    folder = output_folder(log_dir, repo_root, "TensorBoard scalars")
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise ArgumentError(f"writing TensorBoard scalars needs the tensorboard package ({err}); "
                            f"pip install \"ckptrepo[tensorboard]\"") from None
    headers = [h for _, h in history()]
    written = 0
    try:
        writer = SummaryWriter(log_dir=os.fspath(folder))
    except OSError as err:   # a link loop or a folder the OS will not make: what os.makedirs met, and what to do
        raise ExchangeError(f"cannot write TensorBoard scalars to {folder}: {os_error_line(err)}") from None
    try:
        for position, h in enumerate(headers):
            at = position if h.step is None else h.step
            for name, value in h.metrics.items():
                if is_number(value):
                    writer.add_scalar(f"ckptrepo/{name}", value, global_step=at)
                    written += 1
            for name, value in (h.stats or {}).items():
                writer.add_scalar(f"ckptrepo/capture/{name}", value, global_step=at)
                written += 1
    finally:
        writer.close()
    return written
