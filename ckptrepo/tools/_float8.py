"""The float8 formats numpy lacks, widened to float64 by a table of their 256 values.

``diff`` and ``stats`` reduce stored bytes in numpy without importing torch (a data command's start-up would
be torch's import). Every float8 value is exact in float64, so ``table[raw]`` gives the same numbers as
torch's ``.to(torch.float64)``; tests/unit/test_float8.py compares each table with torch, byte by byte.

A format is (exponent bits, mantissa bits, bias, how its top codes are spent):

* ``fn`` (finite, NaN): no infinities; the all-ones exponent and mantissa is NaN (e4m3fn).
* ``ieee``: the all-ones exponent is Inf (zero mantissa) or NaN, as IEEE 754 (e5m2).
* ``fnuz`` (finite, NaN, unsigned zero): no infinities and no negative zero; the code ``0x80`` is the NaN.
* ``e8m0fnu``: an unsigned power of two, ``2 ** (code - 127)``; the code ``0xff`` is the NaN.
"""
from __future__ import annotations

import functools

import numpy as np

_FORMATS: dict[str, tuple[int, int, int, str]] = {
    "float8_e4m3fn": (4, 3, 7, "fn"),
    "float8_e5m2": (5, 2, 15, "ieee"),
    "float8_e4m3fnuz": (4, 3, 8, "fnuz"),
    "float8_e5m2fnuz": (5, 2, 16, "fnuz"),
}
FLOAT8 = frozenset(_FORMATS) | {"float8_e8m0fnu"}


@functools.lru_cache(maxsize=None)
def float8_table(dtype: str) -> np.ndarray:
    """The float64 value of each of the 256 codes of float8 format ``dtype`` (a name in ``FLOAT8``)."""
    codes = np.arange(256, dtype=np.int64)
    if dtype == "float8_e8m0fnu":
        values = np.ldexp(1.0, codes - 127)
        values[255] = np.nan
        values.flags.writeable = False
        return values
    ebits, mbits, bias, kind = _FORMATS[dtype]
    sign = np.where(codes >> 7, -1.0, 1.0)
    exp = (codes >> mbits) & ((1 << ebits) - 1)
    man = codes & ((1 << mbits) - 1)
    normal = np.ldexp(1.0 + man / (1 << mbits), exp - bias)
    subnormal = np.ldexp(man / (1 << mbits), 1 - bias)
    values = sign * np.where(exp == 0, subnormal, normal)
    top = (1 << ebits) - 1
    if kind == "fn":
        values[(exp == top) & (man == (1 << mbits) - 1)] = np.nan
    elif kind == "ieee":
        values[exp == top] = np.where(man[exp == top] == 0, sign[exp == top] * np.inf, np.nan)
    else:   # fnuz: the code of negative zero is the NaN
        values[0x80] = np.nan
    values.flags.writeable = False
    return values


def widen_float8(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Stored float8 bytes (numpy uint8) as float64 values."""
    return float8_table(dtype)[raw]
