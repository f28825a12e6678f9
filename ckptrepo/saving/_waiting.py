"""Waiting on the caller's side: a progress bar while snapshots commit, and Ctrl-C held over steps that
must happen together."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any

from ckptrepo.saving._snapshot_job import SnapshotJob


def stderr_is_terminal() -> bool:
    try:
        return os.isatty(2)
    except OSError:
        return False


@contextlib.contextmanager
def interrupts_deferred() -> Any:
    """Hold a Ctrl-C (SIGINT with Python's default handler, in the main thread) until the block is done, then
    raise it: for the few steps that must happen together or not at all. Elsewhere, a no-op."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            raise KeyboardInterrupt


def wait_with_progress(jobs: list[SnapshotJob]) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn
    # on stderr, which is the terminal this was chosen for (rich's default console is stdout)
    with Progress(TextColumn("ckptrepo: committing snapshots"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), transient=True,
                  console=Console(stderr=True)) as progress:
        task = progress.add_task("wait", total=len(jobs))
        for job in jobs:
            job.handle._done.wait()
            progress.advance(task)


__all__ = ["interrupts_deferred", "stderr_is_terminal", "wait_with_progress"]
