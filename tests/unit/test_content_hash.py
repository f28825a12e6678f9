"""The content digests dedup compares: WORDSUM against an independent numpy reference, on every device."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ckptrepo.saving import _content_hash as ch
from ckptrepo.storage import _piece_digest as pd


def reference(t: torch.Tensor) -> bytes:
    """WORDSUM written out with numpy's unsigned, wrapping 64-bit arithmetic."""
    b = t.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    n = len(b)
    x = np.frombuffer(b + bytes(-n % 8), dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = x ^ (np.arange(len(x), dtype=np.uint64) * np.uint64(pd.POS))
        z = z * np.uint64(pd.M1)
        z ^= z >> np.uint64(29)
        z = z * np.uint64(pd.M2)
        z ^= z >> np.uint64(32)
        a = int(z.sum(dtype=np.uint64))
        z = z * np.uint64(pd.M3)
        z ^= z >> np.uint64(31)
        b2 = int(z.sum(dtype=np.uint64))
    return pd.finish_wordsum(a, b2, n)


def _tensors(device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = [torch.randn(1000, generator=g), torch.randn(7, 3, generator=g).t(), torch.tensor(3.5),
           torch.randint(0, 255, (13,), dtype=torch.uint8, generator=g), torch.randn(5, dtype=torch.complex64).conj(),
           torch.zeros(0), torch.randn(12345, generator=g).to(torch.bfloat16), torch.tensor([True, False, True]),
           torch.randn(33, generator=g, dtype=torch.float64), -torch.randn(9, 5, generator=g)[:, 1:4]]
    return [t.to(device) for t in out]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group_bytes", [ch.GROUP_BYTES, 256, 40, 16, 1])
def test_wordsum_equals_the_reference_however_the_tensors_are_grouped(device, group_bytes):
    ts = _tensors(device)
    assert ch.wordsum_digests(ts, group_bytes=group_bytes) == [reference(t) for t in ts]


def test_every_single_bit_flip_changes_the_digest_and_placement_does_not():
    x = torch.randn(4099)
    d0 = ch.wordsum_digests([x])[0]
    raw = x.view(torch.uint8)
    for byte in (0, 1, 7, 8, 4095, 4 * 4099 - 1):
        for bit in (0, 7):
            y = raw.clone()
            y[byte] ^= 1 << bit
            assert ch.wordsum_digests([y.view(torch.float32)])[0] != d0, (byte, bit)
    # the same values at an odd place in a larger storage, or as part of a list: the same digest
    host = torch.empty(4099 + 3)
    host[3:] = x
    assert ch.wordsum_digests([torch.zeros(5), host[3:]])[1] == d0
    # swapping two words (the same multiset of words) changes it
    y = x.clone()
    y[0], y[1] = x[2].item(), x[3].item()
    y[2], y[3] = x[0].item(), x[1].item()
    assert ch.wordsum_digests([y])[0] != d0


def test_trailing_zero_bytes_are_not_padding():
    assert len({ch.wordsum_digests([torch.zeros(n, dtype=torch.uint8)])[0] for n in range(0, 17)}) == 17


def test_digest_as_follows_the_stored_algorithm():
    x = torch.randn(100)
    assert ch.digest_as(ch.XXH3, x) == ch.xxh3_digest(x)
    assert ch.digest_as(ch.WORDSUM, x) == reference(x)
    assert ch.digest_as(99, x) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_and_cpu_digests_agree_on_large_tensors():
    g = torch.Generator().manual_seed(1)
    ts = [torch.randn(3_000_001, generator=g), torch.randn(1000, 999, generator=g).to(torch.bfloat16)]
    assert ch.wordsum_digests([t.cuda() for t in ts], group_bytes=1 << 20) == ch.wordsum_digests(ts)


def test_a_manifest_digest_of_another_algorithm_is_read_and_never_matched():
    from ckptrepo.core._schema_fields import FieldError, _digest
    future = bytes([7]) + bytes(32)   # an algorithm this release does not know, a 256-bit hash
    assert _digest(future, "a piece") == future
    assert ch.digest_as(future[0], torch.zeros(3)) is None
    for bad in (b"", b"\x01", "xx", 5, bytes(66)):
        with pytest.raises(FieldError):
            _digest(bad, "a piece")


@pytest.mark.parametrize("cut", [1, 3, 8, 13, 4096, 1 << 20])
def test_the_readers_check_recomputes_both_algorithms_from_bytes_fed_in_parts(cut):
    """What load and fsck check (storage/_piece_digest.py) is the digest capture recorded, XXH3 and WORDSUM
    alike, however the stored bytes arrive."""
    from ckptrepo.storage._piece_digest import PieceHasher, piece_digest
    for t in _tensors("cpu") + ([torch.randn(70001)] if cut >= 4096 else []):
        raw = t.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8).numpy()
        for algorithm, want in ((ch.XXH3, ch.xxh3_digest(t)), (ch.WORDSUM, reference(t))):
            h = PieceHasher(algorithm)
            for a in range(0, raw.nbytes, cut):
                h.update(raw[a:a + cut])
            assert h.digest() == want == piece_digest(algorithm, raw), (t.shape, t.dtype, algorithm)


@pytest.mark.parametrize("words_per_part", [1, 7, 512, 1 << 16])
def test_wordsum_parts_hashed_out_of_order_add_up_to_the_digest(words_per_part):
    """A direct load hashes each reader task's part of a large piece on its own thread, in whatever order the
    tasks finish (loading/_digest_check.py): the parts' lane sums, each hashed from its first word's position,
    add up to the piece's WORDSUM, a last part ending inside a word included."""
    import random

    from ckptrepo.storage._piece_digest import WORDSUM, PieceHasher, finish_wordsum
    for t in _tensors("cpu") + [torch.randn(70001), torch.randn(3001, dtype=torch.float16)]:
        raw = t.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8).numpy()
        cuts = list(range(0, raw.nbytes, words_per_part * 8)) + [raw.nbytes]
        parts = list(zip(cuts[:-1], cuts[1:]))
        random.Random(words_per_part).shuffle(parts)
        a = b = 0
        for lo, hi in parts:
            h = PieceHasher(WORDSUM, lo // 8)
            h.update(raw[lo:hi])
            pa, pb = h.lanes()
            a, b = (a + pa) % (1 << 64), (b + pb) % (1 << 64)
        assert finish_wordsum(a, b, raw.nbytes) == reference(t), (t.shape, t.dtype)
