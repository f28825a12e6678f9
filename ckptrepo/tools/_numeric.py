"""Which tensors the numeric views (``diff``'s norms, ``trajectory``, ``bisect``, the page's heatmap) count.

A training state holds tensors that are data, not values: RNG states (uint8 bytes), integer buffers and
masks, and optimizer step counters. Their norms swamp a model's (an RNG state's ||B-A|| is thousands where a
layer's is a fraction) and top a shared colour scale, and a "change" of a counter says only that training
went on. Those views leave them out by default and count them with ``include_nonfloat=True``; a view that
lists tensors still lists them, changed or unchanged (docs/decisions/050-non-float-tensors-out-of-numbers.md).

Left out: every dtype that is not a float or complex type (integers, unsigned bytes, bool), and a step
counter: a tensor of at most one element whose last name component is ``step``. torch's Adam, AdamW, SGD
with momentum and the like keep ``state/<i>/step`` as a float32 0-d tensor, numerically a counter.
"""
from __future__ import annotations

import re

_FLOATING = ("float", "bfloat", "complex")   # the stored dtype names of float, bfloat16, float8 and complex tensors
_SEPARATORS = re.compile(r"[./]")


def is_numeric(name: str, dtype: str, numel: int) -> bool:
    """Whether the numeric views count tensor ``name`` of ``dtype`` and ``numel`` elements by default."""
    if not dtype.startswith(_FLOATING):
        return False
    return not (numel <= 1 and _SEPARATORS.split(name)[-1] == "step")


NONFLOAT_HINT = "include_nonfloat=True (--include-nonfloat) counts them"
