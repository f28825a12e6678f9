"""WORDSUM, the content digest of tensors on their own device (saving/_content_hash.py says what it is and why).

Torch ops only, so it runs on any device: the capture thread hashes CUDA tensors before copying them, and a
GPU load checks the pieces it filled on the device, where the bytes are (loading/_device_load.py). The same
sums over host bytes are storage/_piece_digest.py's, in numpy.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ckptrepo.storage import M1 as _M1
from ckptrepo.storage import M2 as _M2
from ckptrepo.storage import M3 as _M3
from ckptrepo.storage import POS as _POS
from ckptrepo.storage import U64 as _U64
from ckptrepo.storage import finish_wordsum

GROUP_BYTES = 64 << 20   # bytes of tensors hashed together: bounds the device temporaries (~5x this)
_ALIGN = 16              # every tensor's slot in a group starts here, so any dtype can be viewed there



def _s64(u: int) -> int:
    """An unsigned 64-bit constant as the signed int torch's int64 arithmetic takes."""
    return u - (1 << 64) if u >= 1 << 63 else u


def _lsr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical shift right of int64 words (torch's ``>>`` is arithmetic)."""
    return (z >> s).bitwise_and_((1 << (64 - s)) - 1)


class _Group:
    """Tensors (or element ranges of them) hashed in one pass: their bytes laid out in a zeroed buffer, each
    slot starting on ``_ALIGN``, then mixed and summed per owning tensor."""

    def __init__(self) -> None:
        self.parts: list[tuple[int, torch.Tensor, int, int]] = []   # (owner, source, slot byte start, first word)
        self.nbytes = 0

    def add(self, owner: int, source: torch.Tensor, first_word: int) -> None:
        start = -(-self.nbytes // _ALIGN) * _ALIGN
        self.parts.append((owner, source, start, first_word))
        self.nbytes = start + source.numel() * source.element_size()


def _groups(tensors: Sequence[torch.Tensor], group_bytes: int) -> list[_Group]:
    """Pack the tensors into groups of at most ``group_bytes`` (a larger tensor is cut into element ranges that
    each start on a whole word, so the words of a tensor are the same whatever the cut)."""
    groups = [_Group()]
    for owner, t in enumerate(tensors):
        n, size = t.numel(), t.element_size()
        if n == 0:
            continue
        flat = t.reshape(-1) if n * size > group_bytes else t
        step = max(8, (group_bytes // size) // 8 * 8)   # elements per cut: a multiple of 8 elements is whole words
        for e in range(0, n, step):
            count = min(step, n - e)
            part = flat if count == n else flat[e:e + count]
            g = groups[-1]
            if g.parts and -(-g.nbytes // _ALIGN) * _ALIGN + count * size > group_bytes:
                g = _Group()
                groups.append(g)
            g.add(owner, part, e * size // 8)
    return [g for g in groups if g.parts]


def wordsum_digests(tensors: Sequence[torch.Tensor], group_bytes: int = GROUP_BYTES) -> list[bytes]:
    """The WORDSUM digest of each tensor, computed on the tensors' device (all on one device), in the current
    stream. Returns once the sums are on the host (one synchronisation of that stream, not of the device)."""
    if not tensors:
        return []
    device = tensors[0].device
    lanes = torch.zeros((2, len(tensors)), dtype=torch.int64, device=device)
    for g in _groups(tensors, group_bytes):
        words = -(-g.nbytes // 8)
        buf = torch.zeros(words, dtype=torch.int64, device=device)
        raw = buf.view(torch.uint8)
        dst = [raw[s:s + src.numel() * src.element_size()].view(src.dtype).view(src.shape)
               for _, src, s, _ in g.parts]
        # resolved first: a CUDA _foreach_copy_ can take a fast path that ignores the conjugate and negative bits,
        # and the digest must cover the values as stored (a lazy view's copy is made only for such views)
        torch._foreach_copy_(dst, [src.detach().resolve_conj().resolve_neg() for _, src, _, _ in g.parts])
        # per word, what turns its index in the buffer into its index in its tensor's words (the padding
        # between slots belongs to no tensor); per slot, its words [lo, hi) and its tensor
        offset, repeat, lo, hi, owner = [], [], [], [], []
        for k, (o, src, start, first) in enumerate(g.parts):
            n = -(-(src.numel() * src.element_size()) // 8)
            offset += [start // 8 - first, 0]
            repeat += [n, _gap(g, k)]
            lo.append(start // 8)
            hi.append(start // 8 + n)
            owner.append(o)
        meta = torch.tensor([offset, repeat], dtype=torch.int64).to(device)
        slots = torch.tensor([lo, hi, owner], dtype=torch.int64).to(device)
        base = torch.repeat_interleave(meta[0], meta[1], output_size=words)
        z = torch.arange(words, dtype=torch.int64, device=device).sub_(base).mul_(_s64(_POS)).bitwise_xor_(buf)
        del buf, raw, dst, base
        z.mul_(_s64(_M1))
        z.bitwise_xor_(_lsr(z, 29))
        z.mul_(_s64(_M2))
        z.bitwise_xor_(_lsr(z, 32))
        lanes[0].index_add_(0, slots[2], _slot_sums(z, slots))
        z.mul_(_s64(_M3))
        z.bitwise_xor_(_lsr(z, 31))
        lanes[1].index_add_(0, slots[2], _slot_sums(z, slots))
    sums = lanes.cpu().tolist()
    return [finish_wordsum(a & _U64, b & _U64, t.numel() * t.element_size())
            for a, b, t in zip(sums[0], sums[1], tensors)]


def _slot_sums(z: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The sum (mod 2**64) of each slot's words, from one prefix sum: a scan reads each word once, where an
    ``index_add_`` into a few hundred sums would serialise millions of atomic adds on the same addresses."""
    cs = torch.cumsum(z, 0)
    lo, hi = slots[0], slots[1]
    return cs.index_select(0, hi - 1) - cs.index_select(0, (lo - 1).clamp_(min=0)) * (lo > 0)


def _gap(g: _Group, k: int) -> int:
    """Words of padding after slot ``k`` of group ``g`` (before the next slot, or to the buffer's end)."""
    _, src, start, _ = g.parts[k]
    end = -(-(start + src.numel() * src.element_size()) // 8)
    nxt = g.parts[k + 1][2] // 8 if k + 1 < len(g.parts) else -(-g.nbytes // 8)
    return nxt - end



__all__ = ["GROUP_BYTES", "wordsum_digests"]
