"""Fixtures of the damage matrix: the pristine repository, built once, and the results of every selected case,
run together (several at once) the first time a test asks for one."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from hostile import _matrix as matrix


@pytest.fixture(scope="session")
def hostile_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hostile")


@pytest.fixture(scope="session")
def hostile_runner(hostile_dir: Path) -> Iterator[matrix.Runner]:
    runner = matrix.make_runner(hostile_dir / "runs")
    yield runner
    runner.close()


@pytest.fixture(scope="session")
def pristine(hostile_dir: Path, hostile_runner: matrix.Runner) -> matrix.Pristine:
    return matrix.prepare(hostile_dir / "pristine", hostile_runner)


@pytest.fixture(scope="session")
def matrix_results(request: pytest.FixtureRequest, hostile_dir: Path, hostile_runner: matrix.Runner,
                   pristine: matrix.Pristine) -> dict[str, matrix.CaseResult]:
    """The results of the cases this session selected (``-k`` included), run in parallel once."""
    wanted = {item.callspec.params["case"] for item in request.session.items
              if hasattr(item, "callspec") and "case" in item.callspec.params}
    selected = [c for c in matrix.cases() if c.id in wanted]
    return matrix.run_matrix(selected, pristine, hostile_runner, hostile_dir / "cases")
