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
would be paid in switch intervals. WORDSUM's torch code is state/_wordsum.py (a GPU load checks pieces with
it too), its numpy twin over host bytes storage/_piece_digest.py.
"""
from __future__ import annotations

from typing import Any

import torch
import xxhash

from ckptrepo.state import GROUP_BYTES, wordsum_digests
from ckptrepo.storage import WORDSUM, XXH3


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


def digest_as(algorithm: int, t: torch.Tensor) -> bytes | None:
    """``t``'s digest by ``algorithm`` (that of a stored digest it is compared with); None for an unknown one."""
    if algorithm == XXH3 and t.device.type == "cpu":
        return xxh3_digest(t)
    if algorithm == WORDSUM:
        return wordsum_digests([t])[0]
    return None


__all__ = ["GROUP_BYTES", "WORDSUM", "XXH3", "digest_as", "hasher_digest", "wordsum_digests", "xxh3_digest"]
