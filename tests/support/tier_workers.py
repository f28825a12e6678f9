"""Worker bodies of the local-tier tests (run in forkserver children, see ckpt_workers.mp_context)."""
from __future__ import annotations

import os

from support.ckpt_workers import _kill_self, make_state


def push_crash_writer(local: str, remote: str, point: str) -> None:
    """Make a local tier pushing to ``remote``, commit and push step 0, then commit step 1 and SIGKILL this process
    at the first ``point`` of its background push."""
    import ckptrepo
    from ckptrepo import faults
    repo = ckptrepo.init(local)
    repo.remote_add("origin", remote)
    with repo.snapshotter(push_to="origin") as snap:
        snap.snapshot(make_state(0), step=0)
        snap.wait()
        faults.set_hook(point, _kill_self)
        snap.snapshot(make_state(1), step=1)
        snap.wait()
    os._exit(3)   # the hook did not fire: the parent sees exit code 3 instead of -SIGKILL
