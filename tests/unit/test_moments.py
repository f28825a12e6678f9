"""The one Chan merge of count, mean and spread (core/_moments.py), as capture's Moments and the inspection
partials (tools/_inspect.py) use it: merged over any split, it gives numpy's moments of the whole."""
from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptrepo.core._moments import Moments, merge_moments
from ckptrepo.tools._inspect import _merge_moments, _Moments, _pairwise

values = st.lists(st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False), min_size=1, max_size=200)
offsets = st.sampled_from([0.0, 1.0, -3e4, 1e8])   # a mean that dwarfs the spread: where E[x^2]-E[x]^2 cancels


def _parts(xs: np.ndarray, cuts: list[int]) -> list[np.ndarray]:
    return np.split(xs, sorted({c % (len(xs) + 1) for c in cuts}))   # empty parts included


def _own(x: np.ndarray) -> tuple[int, float, float]:
    """numpy's count, mean and root of summed squared deviations, scaled: squares of 1e-288 underflow."""
    if not x.size:
        return 0, 0.0, 0.0
    mean = float(np.mean(x))
    scale = float(np.max(np.abs(x))) or 1.0
    d = (x - mean) / scale
    return x.size, mean, scale * float(np.sqrt(np.sum(d * d)))


def _check(n: int, mean: float, dev: float, xs: np.ndarray) -> None:
    _, ref_mean, ref_dev = _own(xs)
    scale = float(np.max(np.abs(xs)))
    assert n == xs.size
    assert math.isclose(mean, ref_mean, rel_tol=1e-12, abs_tol=1e-13 * scale)
    assert math.isclose(dev, ref_dev, rel_tol=1e-9, abs_tol=1e-12 * scale * math.sqrt(xs.size))


@settings(max_examples=300, deadline=None)
@given(values, st.lists(st.integers(0, 10_000), max_size=12), offsets)
def test_merged_moments_equal_numpys_over_the_concatenation(raw, cuts, offset):
    xs = np.array(raw) + offset
    parts = [_own(p) for p in _parts(xs, cuts)]

    n, mean, dev = 0, 0.0, 0.0   # one part after another, as capture feeds a tensor's chunks
    for part in parts:
        n, mean, dev = merge_moments(n, mean, dev, *part)
    _check(n, mean, dev, xs)

    m = Moments()   # capture's and the ranks' record, merged part by part
    for k, pm, pd in parts:
        m.add(k, pm, pd, -math.inf, math.inf)
    _check(m.n, m.mean, m.dev, xs)

    # stats' partials, merged as a balanced tree in element order
    tree = _pairwise([_Moments(k, pm, pd, 0.0) for k, pm, pd in parts], _merge_moments)
    _check(tree.count, tree.mean, tree.dev, xs)


def test_an_empty_part_changes_nothing():
    assert merge_moments(0, 0.0, 0.0, 3, 2.5, 1.25) == (3, 2.5, 1.25)
    assert merge_moments(3, 2.5, 1.25, 0, 0.0, 0.0) == (3, 2.5, 1.25)
    assert merge_moments(0, 0.0, 0.0, 0, 0.0, 0.0) == (0, 0.0, 0.0)


def test_extremes_neither_overflow_nor_underflow():
    for big in (1e200, 1e-200):
        n, mean, dev = merge_moments(1, -big, 0.0, 1, big, 0.0)
        assert (n, mean) == (2, 0.0) and math.isclose(dev, big * math.sqrt(2), rel_tol=1e-15)
