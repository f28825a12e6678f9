"""What a snapshot cost the training loop (``lost_s``): recorded with the version, shown by ``log --stats``."""
from __future__ import annotations

import time

import pytest
import torch
from support.helpers import run

import ckptrepo
from ckptrepo import faults
from ckptrepo.saving._step_clock import StepClock


@pytest.fixture(autouse=True)
def _no_fault_hooks():
    yield
    faults.clear()


def _train(repo, snapshot_at, steps=8, hook=None):
    """A small loop with an attached optimizer; returns (handles, when each optimizer.step() began)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 256)
    handles, began = [], []
    # a global pre-hook runs before every optimizer's own, so before the snapshotter's wait
    first = register_optimizer_step_pre_hook(lambda *_: began.append(time.perf_counter()))
    try:
        with repo.snapshotter() as snap:
            snap.attach(opt)
            for step in range(steps):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
                if step in snapshot_at:
                    if hook is not None:
                        faults.set_hook("before_capture", hook)
                    handles.append(snap.snapshot({"model": model, "opt": opt}, step=step))
    finally:
        first.remove()
    return handles, began


def test_the_recorded_loss_includes_the_wait_before_the_next_optimizer_step(tmp_path):
    """A slow capture holds the next optimizer step; the version records at least that wait as lost."""
    slept: list[float] = []

    def slow_capture(_name: str) -> None:   # the capture thread, before it reads the state
        slept.append(time.perf_counter())
        time.sleep(0.3)
        slept.append(time.perf_counter())

    repo = ckptrepo.init(tmp_path / "r")
    handles, began = _train(repo, snapshot_at={4}, hook=slow_capture)
    faults.clear()
    # the step after the snapshot began, and could not go on before the capture had slept: it waited at least
    # from the later of the two to the sleep's end
    waited = slept[1] - max(began[5], slept[0])
    recorded = repo.capture_stats(handles[0].id)
    assert waited > 0
    assert recorded["lost_s"] >= recorded["blocking_s"] >= waited


def test_log_stats_shows_the_lost_time_and_older_records_still_display(tmp_path):
    repo = ckptrepo.init(tmp_path / "r")
    _train(repo, snapshot_at={2, 5})
    for v in repo.log():
        s = repo.capture_stats(v.id)
        assert s["lost_s"] >= s["blocking_s"] >= 0
    out = run("log", "--stats", repo=repo.url).stdout
    assert out.count("lost ") == 2 and out.count("blocking ") == 2
    # a version an older ckptrepo wrote has no lost_s: its line shows what it has
    from ckptrepo.cli.history import _capture_stats_line
    older = {k: v for k, v in repo.capture_stats().items() if k != "lost_s"}
    assert "lost" not in _capture_stats_line(older) and "blocking" in _capture_stats_line(older)


def test_without_steps_or_a_clean_step_the_loss_is_the_blocking_time():
    clock = StepClock()
    from ckptrepo.saving._snapshot_job import SnapshotStats
    stats = SnapshotStats(blocking_s=0.25)
    stats.watch_steps(clock, time.perf_counter())
    assert stats.lost_s == 0.25   # no optimizer step seen: nothing to compare with
    for _ in range(3):   # steps, all inside the snapshot's window: none ran clear of it
        with clock.step():
            pass
    stats.steps_over()
    assert stats.lost_s == 0.25
    assert stats.to_json()["lost_s"] == 0.25


def test_slow_steps_inside_the_window_count_against_the_clean_ones():
    """Intervals are compared by what the clock recorded (no sleeps timed): a window's intervals minus the
    median clean interval, never below the blocking time."""
    clock = StepClock()
    from ckptrepo.saving._snapshot_job import SnapshotStats
    clock._intervals.extend([(0.0, 1.0), (1.0, 2.0), (2.0, 3.0), (3.0, 6.0), (6.0, 7.0)])
    clock._last = 7.0
    stats = SnapshotStats(blocking_s=0.5)
    stats._clock, stats._window = clock, clock.opened(2.5)
    clock._windows[stats._window][1] = 5.5   # committed before the interval (6, 7)
    assert stats.lost_s == pytest.approx(3.0 - 1.0)   # (3, 6) against the clean median of 1
    stats.blocking_s = 2.5
    assert stats.lost_s == 2.5


def test_the_commit_waits_for_the_step_running_unless_something_waits_for_it():
    """``hold`` (before the commit records lost_s) returns at the next step's end, or at once when released."""
    import threading
    clock = StepClock()
    now = time.perf_counter()
    clock._intervals.extend([(now - 4.5, now - 3.0), (now - 3.0, now - 1.5), (now - 1.5, now)])   # typical 1.5 s
    clock._last = now
    for finish in ("step", "release"):
        key = clock.opened(time.perf_counter())
        held = threading.Thread(target=clock.hold, args=(key,))
        held.start()
        held.join(0.2)
        assert held.is_alive()   # the step running now has not ended (its deadline is seconds away)
        if finish == "step":
            with clock.step():
                pass
        else:
            clock.release(key)
        held.join(10)
        assert not held.is_alive()
        clock.closed(key)
        clock._intervals.append((clock._intervals[-1][1], time.perf_counter()))
        clock._last = time.perf_counter()


def test_a_wait_after_the_commit_leaves_nothing_behind():
    """``wait()`` on a committed snapshot releases a window that is already closed: nothing is kept for it."""
    clock = StepClock()
    key = clock.opened(time.perf_counter())
    clock.closed(key)
    for _ in range(3):
        clock.release(key)
    assert not clock._released
