"""The shared argument checks (ckptrepo/arguments.py): one wording, the caller's exception and quoting."""
from __future__ import annotations

import pytest

from ckptrepo.arguments import check_flag, check_whole, checked_meta, checked_step, cut, is_number, is_whole, shown
from ckptrepo.errors import ArgumentError, RetentionError, UnsupportedValueError


def test_whole_numbers_refuse_bools_floats_and_values_below_the_bound() -> None:
    assert is_whole(3) and not is_whole(True) and not is_whole(3.0)
    assert is_number(2.5) and is_number(2) and not is_number(False) and not is_number("1")
    check_whole(1, "n", 1)
    check_whole(None, "n", 1, optional=True)
    with pytest.raises(ArgumentError, match=r"^n must be a whole number of at least 1, not 0$"):
        check_whole(0, "n", 1)
    with pytest.raises(ArgumentError, match=r"^n must be a whole number or None, not bool True$"):
        check_whole(True, "n", optional=True, show=shown)
    with pytest.raises(RetentionError, match=r"^k must be a whole number of at least 1, not -1; leave it out"):
        check_whole(-1, "k", 1, error=RetentionError, hint="; leave it out")


def test_flags_take_only_true_or_false() -> None:
    check_flag(False, "f")
    check_flag(None, "f", optional=True)
    with pytest.raises(ArgumentError, match=r"^f must be True or False, not 'yes'$"):
        check_flag("yes", "f")
    with pytest.raises(ArgumentError, match=r"^f must be True or False, not None$"):
        check_flag(None, "f")
    with pytest.raises(ArgumentError, match=r"not 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx$"):
        check_flag("x" * 100, "f", show=cut)


def test_steps_and_meta() -> None:
    assert checked_step(None) is None and checked_step(7) == 7
    with pytest.raises(UnsupportedValueError, match="step must be an int or None, not float 1.5"):
        checked_step(1.5)
    with pytest.raises(UnsupportedValueError, match="does not fit in 64 bits"):
        checked_step(1 << 64)
    assert checked_meta({}) is None and checked_meta({"run": "abc"}) == {"run": "abc"}
    with pytest.raises(UnsupportedValueError, match="is not text"):
        checked_meta({"run": 1})
