"""The switch interval a CUDA capture shortens is restored, whatever the nesting and concurrency."""
from __future__ import annotations

import sys
import threading

import pytest

from ckptrepo.saving._gil import quick_gil_handoffs


def test_shortened_while_any_capture_runs_and_restored_after_the_last():
    before = sys.getswitchinterval()
    with quick_gil_handoffs(1e-4):
        assert sys.getswitchinterval() == pytest.approx(1e-4)
        inner_done = threading.Event()

        def other() -> None:
            with quick_gil_handoffs(1e-4):
                inner_done.set()

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert inner_done.is_set()
        assert sys.getswitchinterval() == pytest.approx(1e-4), "another capture's end keeps it short"
    assert sys.getswitchinterval() == before


def test_a_shorter_interval_is_kept_and_one_set_meanwhile_is_not_overwritten():
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(1e-5)
        with quick_gil_handoffs(1e-4):
            assert sys.getswitchinterval() == pytest.approx(1e-5), "never lengthened"
        assert sys.getswitchinterval() == pytest.approx(1e-5)
        sys.setswitchinterval(before)
        with quick_gil_handoffs(1e-4):
            sys.setswitchinterval(3e-3)   # the user's own choice, made during the capture
        assert sys.getswitchinterval() == pytest.approx(3e-3)
    finally:
        sys.setswitchinterval(before)
