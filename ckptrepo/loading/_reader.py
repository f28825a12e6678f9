"""Plain loads: every tensor of a version read whole, each into its own buffer, through the read engine.

A tensor is one read of the flat array that holds it (see ``_engine``): the
engine coalesces neighbouring tensors into runs, so a state of many small
tensors costs a few large reads, and fills each tensor straight from storage
(the ``into`` tensor itself where the direct reader can write it, else a fresh
one; a TensorStore result is taken as it is, no copy).
"""
from __future__ import annotations

from typing import Callable

import torch

from ckptrepo.core.schema import TensorEntry
from ckptrepo.loading._engine import Engine, Read
from ckptrepo.state import TORCH_DTYPES
from ckptrepo.storage import ArrayInfo
from ckptrepo.storage.protocol import Store


class _TensorRead(Read):
    """A whole tensor: placed in ``into[i]`` where given (read straight into it when the direct reader can write
    it), else returned as a fresh tensor."""

    __slots__ = ("i", "entry", "into", "out", "target")

    def __init__(self, i: int, entry: TensorEntry, into: dict[int, torch.Tensor], out: dict[int, torch.Tensor]) -> None:
        assert entry.array is not None
        super().__init__(entry.array, entry.offset, entry.offset + entry.numel)
        self.i, self.entry, self.into, self.out = i, entry, into, out
        if len(entry.pieces) == 1:   # the read is the whole piece: its digest is checked (loading/_digest_check.py)
            self.digest, self.box = entry.pieces[0].digest, entry.pieces[0].box
        self.target: torch.Tensor | None = None

    def names(self) -> list[str]:
        return [self.entry.name]

    def direct_target(self, info: ArrayInfo) -> torch.Tensor:
        e, dest = self.entry, self.into.get(self.i)
        if dest is not None and dest.device.type == "cpu" and dest.dtype == TORCH_DTYPES[e.dtype] \
                and dest.is_contiguous() and not dest.requires_grad and not dest.is_conj() and not dest.is_neg():
            self.target = dest
        else:
            self.target = torch.empty(e.shape, dtype=TORCH_DTYPES[e.dtype])
        return self.target

    def direct_done(self) -> None:
        assert self.target is not None
        self._place(self.target)

    def fill(self, src: torch.Tensor) -> None:
        self._place(src.view(TORCH_DTYPES[self.entry.dtype]).view(self.entry.shape))

    def _place(self, t: torch.Tensor) -> None:
        self.target = None   # a staging tensor (for an ``into`` the reader cannot write) lives no longer
        dest = self.into.get(self.i)
        if dest is None:
            self.out[self.i] = t
            return
        if t.data_ptr() != dest.data_ptr():
            dest.copy_(t)
        self.out[self.i] = dest


def read_tensors(store: Store, arrays: dict[str, ArrayInfo], entries: list[TensorEntry], wanted: list[int],
                 into: dict[int, torch.Tensor] | None = None, on_bytes: Callable[[int], None] | None = None,
                 engine: Engine | None = None) -> dict[int, torch.Tensor]:
    """Read the ``wanted`` tensors; copy into ``into[i]`` where given, else return fresh CPU tensors.

    ``engine`` (on ``store`` and ``arrays``) keeps the arrays open between calls that read a few tensors each.
    """
    into = into or {}
    out: dict[int, torch.Tensor] = {}
    plan: list[Read] = []
    for i in wanted:
        e = entries[i]
        if e.numel == 0 or e.array is None:
            out[i] = into[i] if i in into else torch.empty(e.shape, dtype=TORCH_DTYPES[e.dtype])
        else:
            plan.append(_TensorRead(i, e, into, out))
    (engine or Engine(store, arrays)).execute(plan, on_bytes)
    return out
