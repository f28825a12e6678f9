"""The test suite's own settings (pyproject.toml, tests/conftest.py): a hung test fails alone and the run goes
on; a test stuck where the timeout's signal cannot reach it ends the process instead of hanging CI; the
multi-process tests get their longer timeout and run as one unit of work under pytest-xdist."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "pyproject.toml")


def pytest_in(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m pytest`` with the project's settings (``-c pyproject.toml``) on files in ``tmp_path``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-c", CONFIG, "--rootdir", str(tmp_path), "-q",
                           "-p", "no:cacheprovider", "-n", "0", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_a_hung_test_fails_with_timeout_and_the_run_goes_on(tmp_path: Path) -> None:
    (tmp_path / "test_hang.py").write_text("import time\n\n\ndef test_hangs():\n    time.sleep(60)\n\n\n"
                                           "def test_after():\n    pass\n")
    done = pytest_in(tmp_path, "-o", "timeout=1", "test_hang.py")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Timeout (>1.0s) from pytest-timeout" in done.stdout, done.stdout
    assert "1 failed, 1 passed" in done.stdout, done.stdout


def test_a_test_the_signal_cannot_reach_ends_the_process(tmp_path: Path) -> None:
    """SIGALRM blocked, as in a C call that never returns to Python: faulthandler's backstop dumps the
    stacks and exits, so that the run fails instead of waiting for its hung test."""
    (tmp_path / "test_stuck.py").write_text("import signal\nimport time\n\n\ndef test_stuck():\n"
                                            "    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})\n"
                                            "    time.sleep(60)\n")
    done = pytest_in(tmp_path, "-o", "timeout=1", "-o", "faulthandler_timeout=2", "test_stuck.py", timeout=50)
    assert done.returncode not in (0, 5), done.stdout + done.stderr
    assert "Timeout (0:00:02)!" in done.stderr and "test_stuck" in done.stderr, done.stderr


def test_the_distributed_tests_get_their_timeout(tmp_path: Path) -> None:
    (tmp_path / "show_marks.py").write_text(
        "def pytest_collection_finish(session):\n"
        "    for item in session.items:\n"
        "        print('TIMEOUT', item.name, item.get_closest_marker('timeout').args[0], flush=True)\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                           "-p", "show_marks", "tests/distributed/test_torchrun.py"], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path),
                                                                            os.environ.get("PYTHONPATH", "")])},
                          capture_output=True, text=True, timeout=120)
    timeouts = [line.split()[2] for line in done.stdout.splitlines() if line.startswith("TIMEOUT")]
    from conftest import DISTRIBUTED_TIMEOUT
    assert timeouts and set(timeouts) == {str(DISTRIBUTED_TIMEOUT)}, done.stdout + done.stderr


def test_xdist_hands_out_the_distributed_tests_as_one_unit_and_the_others_by_file() -> None:
    from conftest import xdist_scope
    assert xdist_scope("tests/distributed/test_dcp.py::test_a") == xdist_scope("tests/distributed/test_fsdp2.py::b")
    assert xdist_scope("tests/unit/test_x.py::test_a[1]") == xdist_scope("tests/unit/test_x.py::C::test_b")
    assert xdist_scope("tests/unit/test_x.py::test_a") != xdist_scope("tests/unit/test_y.py::test_a")
    assert xdist_scope("tests/unit/test_x.py::test_a") != xdist_scope("tests/distributed/test_x.py::test_a")


def test_the_project_settings_are_the_ones_tested(pytestconfig: pytest.Config) -> None:
    assert pytestconfig.getini("timeout_method") == "signal"
    from conftest import DISTRIBUTED_TIMEOUT
    backstop = float(pytestconfig.getini("faulthandler_timeout"))
    assert 0 < float(pytestconfig.getini("timeout")) < DISTRIBUTED_TIMEOUT < backstop
    assert pytestconfig.getini("faulthandler_exit_on_timeout") is True
