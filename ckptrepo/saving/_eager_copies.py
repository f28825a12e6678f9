"""What ``snapshot()`` copies at once instead of leaving live: tensors that forward may change in place.

Everything else is captured lazily, while forward and backward run; these few cannot wait, because
the training loop changes them before the optimizer step the capture waits for.
"""
from __future__ import annotations

from typing import Any

import torch

from ckptrepo.saving._writer import LIVE_ALIGN, aligned_empty, written_from_memory
from ckptrepo.state import TensorRecord, is_stateful
from ckptrepo.storage import INNER_BYTES

EAGER_COPY_BYTES = 64 << 10   # tensors this small are copied at snapshot(): see the Snapshotter contract
# with an optimizer attached, tensors it does not own are copied up to this size: the parameters are known, so
# only buffers and frozen weights are left, and a BatchNorm of 32768 channels has 128 KiB statistics
EAGER_COPY_BYTES_ATTACHED = 16 << 20


def step_owned(optimizers: list[Any]) -> set[int]:
    """Addresses of the tensors only the attached optimizers' step changes (their parameters and state, from
    weak references to them), which capture may leave live however small: the step waits for capture."""
    owned: set[int] = set()
    for ref in optimizers:
        opt = ref()
        if opt is None:
            continue
        for group in opt.param_groups:
            owned.update(p.data_ptr() for p in group["params"])
        for st in opt.state.values():
            owned.update(v.data_ptr() for v in st.values() if isinstance(v, torch.Tensor))
    return owned


def copy_what_forward_may_change(state: Any, records: list[TensorRecord], step_owned: set[int],
                                  last: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """Copy now the buffers of modules in ``state`` (forward changes BatchNorm statistics in place), also of modules
    held by a Stateful object in it (DCP's ``AppState(model, optimizer)``), and every tensor no attached optimizer
    owns (``step_owned``) of at most EAGER_COPY_BYTES (EAGER_COPY_BYTES_ATTACHED with an optimizer attached): a
    ``model.state_dict()`` hands over the same buffers as bare tensors. Parameters and optimizer state stay live:
    only the step changes them, and it waits for capture (copying them, hundreds of small tensors in a GPT,
    would lengthen every snapshot). Parameters of the modules in the state are never copied (a frozen base is
    not the step's, but forward does not change it either). Nor is a bare tensor over EAGER_COPY_BYTES whose
    address and version counter are those it had at the previous snapshot (``last``, by name): nothing changed
    it in a whole step, so it is frozen (otherwise a ``base.state_dict()`` is copied whole every snapshot),
    where BatchNorm statistics change at every forward. Returns this snapshot's (address, version) of those
    tensors, for the next."""
    ptrs: set[int] = set()
    params: set[int] = set()   # forward never changes a parameter in place: a frozen base stays live too
    stack, seen = [state], set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            ptrs.update(b.data_ptr() for b in obj.buffers())
            params.update(p.data_ptr() for p in obj.parameters())
        elif isinstance(obj, dict):
            stack.extend(v for v in obj.values() if not isinstance(v, (torch.Tensor, str, int, float)))
        elif isinstance(obj, (list, tuple)):
            stack.extend(v for v in obj if not isinstance(v, (torch.Tensor, str, int, float)))
        elif is_stateful(obj) and hasattr(obj, "__dict__"):
            stack.extend(v for v in vars(obj).values() if isinstance(v, torch.nn.Module))
    limit = EAGER_COPY_BYTES_ATTACHED if step_owned else EAGER_COPY_BYTES
    versions: dict[str, tuple[int, int]] = {}
    for r in records:
        t = r.tensor
        if not r.numel or type(t) is not torch.Tensor:   # a DTensor: its local shard is what a rank writes
            continue
        if ptrs and t.data_ptr() in ptrs:
            r.tensor = page_aligned_copy(t)
            continue
        nbytes = t.numel() * t.element_size()
        if nbytes > limit or t.data_ptr() in step_owned or t.data_ptr() in params:
            continue
        if nbytes > EAGER_COPY_BYTES:
            versions[r.name] = seen_as = (t.data_ptr(), t._version)
            if last.get(r.name) == seen_as:
                continue   # unchanged for a whole step: frozen, stays live
        r.tensor = page_aligned_copy(t)
    return versions


def page_aligned_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` that starts on a page (CPU): a new address every snapshot, but always the same
    offset within a page, so the write plan (``live_residues``) stays the same and is not made again.
    A tensor too small to be written from its memory needs no page."""
    if t.device.type != "cpu" or not written_from_memory(t.numel() * t.element_size(), INNER_BYTES):
        return t.clone(memory_format=torch.contiguous_format)
    out = aligned_empty(t.numel() * t.element_size(), LIVE_ALIGN).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


__all__ = ["EAGER_COPY_BYTES", "EAGER_COPY_BYTES_ATTACHED", "copy_what_forward_may_change", "page_aligned_copy"]
