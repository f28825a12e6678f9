"""The one step-range predicate of log, trajectory and bisect: a stepless version's place in a bounded range."""
from __future__ import annotations

import pytest

from ckptrepo.core import in_steps


@pytest.mark.parametrize("step, since, until, inside", [
    (5, None, None, True), (5, 5, 5, True), (4, 5, None, False), (6, None, 5, False), (5, 1, 9, True),
])
def test_a_step_is_inside_an_inclusive_range(step: int, since: int | None, until: int | None, inside: bool) -> None:
    assert in_steps(step, since, until) is inside
    assert in_steps(step, since, until, keep_stepless=True) is inside


def test_a_stepless_version_is_out_of_a_bounded_range_unless_kept() -> None:
    assert in_steps(None, None, None) and in_steps(None, None, None, keep_stepless=True)
    assert not in_steps(None, 1, None) and not in_steps(None, None, 9)
    assert in_steps(None, 1, 9, keep_stepless=True)
