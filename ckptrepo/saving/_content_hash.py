"""Content digests of tensors: what dedup compares to decide that stored bytes can be pointed at again.

A digest is 17 bytes: an algorithm byte, then a 128-bit hash of the tensor's bytes in row-major order.

* ``XXH3`` (1): xxh3-128, for CPU tensors. The capture thread feeds it the bytes it stages, so a written
  tensor's digest costs no extra pass.
* ``WORDSUM`` (2): a sum of mixed 64-bit words, for CUDA tensors, computed by torch ops on the tensor's own
  device, so that an unchanged GPU tensor is recognised before its bytes cross PCIe. Each word, tagged with
  its position in the tensor, goes through a bijective mixer (multiply by odd constants, xor-shift right),
  and two differently mixed lanes are summed modulo 2**64. A sum is order-free, so one prefix sum per
  group of tensors reduces every tensor of the group at once, and integer sums give the same bits on every
  device and in every reduction order: the same function runs on CPU tensors, which is how CI checks it. A
  single changed word always changes both lanes (the mixer is a bijection); several changes collide only if
  their position-tagged words keep the same multiset (words moved to where their tags swap) or cancel in
  both sums at once, which accidental changes do not do; like xxh3 it is not cryptographic.

The number of torch calls per group is fixed, not per tensor: a capture thread that needs the GIL from a
training thread running Python gets it once per switch interval, so a per-tensor loop of kernel launches
would be paid in switch intervals.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import xxhash

from ckptrepo.storage._piece_digest import M1 as _M1
from ckptrepo.storage._piece_digest import M2 as _M2
from ckptrepo.storage._piece_digest import M3 as _M3
from ckptrepo.storage._piece_digest import POS as _POS
from ckptrepo.storage._piece_digest import WORDSUM, XXH3, finish_wordsum

GROUP_BYTES = 64 << 20   # bytes of tensors hashed together: bounds the device temporaries (~5x this)
_ALIGN = 16              # every tensor's slot in a group starts here, so any dtype can be viewed there

_U64 = (1 << 64) - 1


def _s64(u: int) -> int:
    """An unsigned 64-bit constant as the signed int torch's int64 arithmetic takes."""
    return u - (1 << 64) if u >= 1 << 63 else u


def xxh3_digest(t: torch.Tensor) -> bytes:
    """The XXH3 digest of a CPU tensor's logical values, row-major (no copy when contiguous).

    ``contiguous()`` after ``reshape``: a strided 1-D view (``x[::2]``) reshapes without a copy but cannot be
    viewed as bytes.
    """
    flat = t.detach().resolve_conj().resolve_neg().reshape(-1).contiguous()
    return bytes([XXH3]) + xxhash.xxh3_128_digest(flat.view(torch.uint8).numpy().data)


def hasher_digest(hasher: Any) -> bytes:
    """The XXH3 digest of what an ``xxhash.xxh3_128`` was fed (the bytes staged for a tensor)."""
    return bytes([XXH3]) + hasher.digest()


def _lsr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical shift right of int64 words (torch's ``>>`` is arithmetic)."""
    return (z >> s).bitwise_and_((1 << (64 - s)) - 1)


def _finish(a: int, b: int, nbytes: int) -> bytes:
    """The digest from the two lane sums (the readers' check computes the same, storage/_piece_digest.py)."""
    return finish_wordsum(a, b, nbytes)


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
    return [_finish(a & _U64, b & _U64, t.numel() * t.element_size()) for a, b, t in zip(sums[0], sums[1], tensors)]


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


def digest_as(algorithm: int, t: torch.Tensor) -> bytes | None:
    """``t``'s digest by ``algorithm`` (that of a stored digest it is compared with); None for an unknown one."""
    if algorithm == XXH3 and t.device.type == "cpu":
        return xxh3_digest(t)
    if algorithm == WORDSUM:
        return wordsum_digests([t])[0]
    return None
