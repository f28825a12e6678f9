"""Helpers shared by the crash-safety, corruption and concurrency tests.

Deterministic training states (derived from a seed alone, so a parent process
can rebuild exactly what a child committed), a bit-exact comparison, and the
bodies of the worker processes. Workers run under the multiprocessing
"forkserver" start method: like "spawn", every worker is a fresh process that
never inherits the (multi-threaded) pytest process, but the server imports
torch, TensorStore and ckptrepo once, so each worker starts in milliseconds
instead of paying the multi-second import every time.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from typing import Any

import numpy as np
import torch

from support.helpers import assert_bit_exact as assert_same  # noqa: F401 - re-exported for the tests

# Shards are 64 MiB by default, and the shard size follows the snapshotter's staging
# memory (half of ``host_memory``, at least one inner chunk). Workers give every
# snapshot 1 MiB of staging memory, so a few MiB of state spans many 512 KiB shards
# and capture runs at most 2 buffers ahead of the writes.
SMALL_HOST_MEMORY = 1 << 20
BARRIER_TIMEOUT = 60.0

_ctx: Any = None
_ctx_lock = threading.Lock()


DEATH_TIMEOUT_S = 60


def run_to_death(target: Any, *args: Any) -> None:
    """Run ``target(*args)`` in a fresh process and insist it dies by SIGKILL (a fault hook's doing) within a
    minute; a worker that finishes, fails otherwise or hangs fails the test."""
    import signal

    import pytest
    p = mp_context().Process(target=target, args=args)
    p.start()
    p.join(DEATH_TIMEOUT_S)
    if p.is_alive():
        p.kill()
        p.join()
        pytest.fail("the worker neither finished nor died")
    assert p.exitcode == -signal.SIGKILL, f"worker exit code {p.exitcode}, expected death by SIGKILL"


def mp_context() -> Any:
    """The forkserver context, with ckptrepo (and so torch and TensorStore) preloaded in the server."""
    global _ctx
    with _ctx_lock:
        if _ctx is None:
            ctx = multiprocessing.get_context("forkserver")
            # one forkserver serves every multi-process test: preload what all their workers import
            ctx.set_forkserver_preload(["ckptrepo", "ckptrepo.saving._capture", "ckptrepo.faults",
                                        "support.ckpt_workers", "support.dtensor_workers", "support.dist_workers",
                                        "torch.distributed.tensor.parallel", "torch.distributed.checkpoint.state_dict"])
            _ctx = ctx
    return _ctx


def make_state(seed: int, big: bool = True) -> dict[str, Any]:
    """A training-like state that depends only on ``seed``; ``big`` spans several 256 KiB shards."""
    g = torch.Generator().manual_seed(1000 + seed)
    rows = 512 if big else 8
    return {
        "model": {
            "w1": torch.randn(rows, 1024, generator=g),                  # 2 MiB float32 with big
            "b1": torch.randn(1024, generator=g),
            "emb": torch.randn(rows // 2, 256, generator=g).to(torch.bfloat16),
        },
        "optim": {
            "step": seed,
            "exp_avg": torch.randn(rows, 256, generator=g),
            "counts": torch.randint(-2**40, 2**40, (rows * 8,), generator=g, dtype=torch.int64),
        },
        "rng": torch.randint(0, 255, (64,), generator=g, dtype=torch.uint8),
        "extra": [seed, float(seed) / 3, "text", (1, 2)],
        "np": np.arange(seed, seed + 100, dtype=np.float64),
    }


def use_small_shards(repo: Any, host_memory: int = SMALL_HOST_MEMORY) -> None:
    """Make every ``repo.snapshot`` of this repository object stage through ``host_memory`` bytes."""
    repo.host_memory = host_memory


def _kill_self(_point: str = "") -> None:
    os.kill(os.getpid(), signal.SIGKILL)


# ---- worker bodies (run in forkserver children) -------------------------------------------------

def crash_writer(url: str, commits: int, point: str, nth: int) -> None:
    """Create a repository, commit ``commits`` versions, then SIGKILL itself at the ``nth`` ``point``."""
    import ckptrepo
    from ckptrepo import faults
    repo = ckptrepo.init(url)
    use_small_shards(repo)
    for step in range(commits):
        repo.snapshot(make_state(step), step=step, message=f"step {step}")
    seen = 0

    def hook(name: str) -> None:
        nonlocal seen
        seen += 1
        if seen >= nth:
            _kill_self(name)

    faults.set_hook(point, hook)
    repo.snapshot(make_state(commits), step=commits, message="interrupted")
    os._exit(3)  # the hook did not fire: the parent sees exit code 3 instead of -SIGKILL


def loop_writer(url: str, ready: Any, started: Any, committed: Any) -> None:
    """Snapshot the next step forever, recording the step begun and the last step committed."""
    import ckptrepo
    repo = ckptrepo.open(url)
    use_small_shards(repo)
    step = repo.version().step + 1 if repo.plumbing.head_version() else 0
    while True:
        started.value = step
        repo.snapshot(make_state(step), step=step, message=f"loop {step}")
        committed.value = step
        ready.set()  # after the first commit: every run makes progress, however slow the machine
        step += 1


def race_writer(url: str, who: int, rounds: int, start: Any, after_read: Any, results: Any) -> None:
    """Each round: meet the other writer, read the branch tip, meet again, then try to commit."""
    import ckptrepo
    from ckptrepo import faults
    from ckptrepo.errors import ConflictError
    repo = ckptrepo.open(url)
    use_small_shards(repo)
    faults.set_hook("after_read_head", lambda _name: after_read.wait(BARRIER_TIMEOUT))
    try:
        for r in range(rounds):
            start.wait(BARRIER_TIMEOUT)
            parent = repo.plumbing.head_version()
            try:
                v = repo.snapshot(make_state(100 * r + who, big=False), step=r, message=f"writer {who}")
            except ConflictError as err:
                results.put((r, who, "conflict", str(err), parent))
            else:
                results.put((r, who, "won", v.id, v.parents[0] if v.parents else None))
    except BaseException as err:  # noqa: BLE001 - report anything else to the parent, then stop
        results.put((-1, who, "error", f"{type(err).__name__}: {err}", None))
        for b in (start, after_read):
            b.abort()


def tag_racer(url: str, who: int, target: str, rounds: int, start: Any, results: Any) -> None:
    """Each round: meet the other process, then try to create tag ``race-<round>`` at ``target``."""
    import ckptrepo
    from ckptrepo.errors import RefError
    repo = ckptrepo.open(url)
    try:
        for r in range(rounds):
            start.wait(BARRIER_TIMEOUT)
            try:
                repo.tag(f"race-{r}", target)
            except RefError as err:
                results.put((r, who, "refused", str(err)))
            else:
                results.put((r, who, "created", target))
    except BaseException as err:  # noqa: BLE001
        results.put((-1, who, "error", f"{type(err).__name__}: {err}"))
        start.abort()
