"""The skeleton format: node tags, and what can be read from a skeleton without torch.

A version's ``tree`` is the state's containers and plain values with tensors
replaced by indices into the tensor table (``state._providers`` builds it and turns
it back into a state). The history tools (``show``, ``log``) read plain
values from it; they live here so that a ``ckptrepo`` command that only
reads manifests never imports torch.
"""
from __future__ import annotations

from typing import Any, Iterator

from ckptrepo.core import volume as numel  # elements of a tensor of a given shape (1 for a zero-dim tensor)
from ckptrepo.errors import UnsupportedValueError

# Skeleton tags (the first element of every node).
SCALAR, BIGINT, DICT, ODICT, LIST, TUPLE, TENSOR, NDARRAY, STATEFUL, NPGEN, NPSCALAR, DTYPE, SIZE = (
    "n", "I", "d", "o", "l", "t", "T", "A", "S", "G", "s", "D", "Z")


def key_value(node: Any) -> Any:
    """The dict key a key node stands for (keys are plain scalars, big ints or tuples of them)."""
    tag = node[0]
    if tag == SCALAR:
        return node[1]
    if tag == BIGINT:
        return bigint_value(node[1])
    if tag == TUPLE:
        return tuple(key_value(k) for k in node[1])
    raise UnsupportedValueError(f"unknown dict key node {tag!r}; the repository was written by a newer ckptrepo")


def bigint_text(value: int) -> str:
    """An int outside 64 bits as stored: hexadecimal, which Python converts at any size (a decimal string of
    over 4300 digits is refused by ``int()`` and ``str()`` since Python 3.11)."""
    return hex(value)


def bigint_value(text: str) -> int:
    """The int a BIGINT node holds: hexadecimal (``-0x..`` too), or decimal, which existing repositories may hold."""
    return int(text, 0)


def plain_values(tree: Any, path: str = "", summarize_after: int | None = None) -> Iterator[tuple[str, Any]]:
    """(path, value) of each plain value in a skeleton, tensors skipped.

    Values are the stored Python values. With
    ``summarize_after``, a list or tuple of more plain values than that is
    reported once as e.g. "tuple of 625 values" (``random.getstate()``).
    """
    tag = tree[0]
    here = path or "<root>"
    if tag in (TENSOR, NDARRAY):
        return
    if tag in (SCALAR, BIGINT):
        yield here, tree[1] if tag == SCALAR else bigint_value(tree[1])
    elif tag in (STATEFUL, NPGEN):     # a numpy Generator: its bit generator's state, which differs per seed
        yield from plain_values(tree[2], path, summarize_after)
    elif tag in (DICT, ODICT):
        for k, v in tree[1]:
            key = key_value(k)
            yield from plain_values(v, f"{path}/{key}" if path else str(key), summarize_after)
    elif tag in (LIST, TUPLE):
        kids = tree[1]
        if summarize_after is not None and len(kids) > summarize_after and all(c[0] in (SCALAR, BIGINT) for c in kids):
            yield here, Shown(f"{'list' if tag == LIST else 'tuple'} of {len(kids)} values")
            return
        for i, c in enumerate(kids):
            yield from plain_values(c, f"{path}/{i}" if path else str(i), summarize_after)
    elif tag == NPSCALAR:
        import numpy as np
        yield here, np.frombuffer(tree[2], dtype=np.dtype(tree[1]))[0]
    elif tag == DTYPE:
        yield here, Shown(f"torch.{tree[1]}")
    elif tag == SIZE:
        yield here, Shown(f"torch.Size({list(tree[1])})")
    else:
        yield here, Shown(f"<unknown node {tag!r}>")


def holds_tensors(node: Any) -> bool:
    """Whether a skeleton node has a tensor or array anywhere inside it."""
    if isinstance(node, list) and node and node[0] in (TENSOR, NDARRAY):
        return True
    return isinstance(node, list) and any(holds_tensors(c) for c in node)


class Shown(str):
    """A value ``show`` and ``diff`` print as its text, without quotes (``torch.float32``, ``torch.Size([2])``);
    equal when the text is: the value is not rebuilt, so reading a manifest never needs torch."""

    def __repr__(self) -> str:
        return str(self)


__all__ = ["BIGINT", "DICT", "DTYPE", "LIST", "NDARRAY", "NPGEN", "NPSCALAR", "ODICT", "SCALAR", "SIZE", "STATEFUL",
           "Shown", "TENSOR", "TUPLE", "bigint_text", "bigint_value", "holds_tensors", "key_value", "numel",
           "plain_values"]
