"""The float8 tables diff and stats widen stored bytes with (tools/_float8.py) hold torch's values, code by code."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ckptrepo.tools._float8 import FLOAT8, float8_table, widen_float8


@pytest.mark.parametrize("dtype", sorted(FLOAT8))
def test_every_code_widens_to_torchs_float64(dtype):
    if not hasattr(torch, dtype):
        pytest.skip(f"this torch has no {dtype}")
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(getattr(torch, dtype)).to(torch.float64).numpy()
    got = widen_float8(codes.numpy(), dtype)
    assert got.dtype == np.float64
    assert np.array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    # bit for bit: signed zeros and infinities included
    assert np.array_equal(got[finite].view(np.uint64), want[finite].view(np.uint64))


def test_the_tables_are_shared_and_read_only():
    table = float8_table("float8_e4m3fn")
    assert table is float8_table("float8_e4m3fn") and not table.flags.writeable
