"""Replica fingerprints: catching a tensor the layout calls replicated that the ranks hold different values of.

A distributed snapshot writes a replicated tensor once (from one of the ranks
holding it) and every load hands that copy to every rank. If the ranks' copies
differ, the others are lost, silently: the version loads and passes fsck. The
usual cause is a missing rule: the rules replicate every parameter no rule
matches, so a tensor-parallel weight whose name the rules do not know (a
custom column-parallel layer, a renamed module) is saved as rank 0's shard
alone. DCP has the same hole for DTensors whose local copies disagree.

The same goes for a DTensor whose placements replicate it (``Replicate()`` on
a mesh dimension of several ranks), e.g. a sequence-parallel LayerNorm whose
gradients are not all-reduced: its copies drift apart, step by step.

So each rank fingerprints its copy of every tensor the rules replicate over
tensor-parallel ranks (explicitly or by default), and of every replicated
DTensor, and sends the fingerprints
with its part of the manifest; rank 0 compares them before it commits, and a
disagreement fails the snapshot on every rank, naming the tensor and the
ranks. A fingerprint hashes the tensor's size and three windows of its bytes
(start, middle, end), so it costs the same small read for any tensor size:
shards of one weight differ everywhere, and a few KiB tell them apart. It is
not a check that replicas agree to the last bit (that would read every
replicated byte on every rank at every snapshot).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import xxhash

from ckptrepo.core.schema import RankPart
from ckptrepo.errors import LayoutError

WINDOW_ELEMS = 1024   # elements per sampled window; three windows per tensor

# who replicates a piece (sharding.Piece.replicated), which says what to do when the copies differ
RULES = "rules"            # the layout's rules, over tensor-parallel ranks
PLACEMENT = "placement"    # a DTensor's Replicate() placement


def sample(view: torch.Tensor) -> torch.Tensor:
    """The elements a fingerprint hashes, on the tensor's own device: all of them for a small tensor, else
    three windows of ``WINDOW_ELEMS`` at the start, the middle and the end of its row-major order."""
    flat = view.reshape(-1)
    n = flat.numel()
    if n <= 3 * WINDOW_ELEMS:
        return flat
    mid = (n - WINDOW_ELEMS) // 2
    return torch.cat([flat[:WINDOW_ELEMS], flat[mid:mid + WINDOW_ELEMS], flat[n - WINDOW_ELEMS:]])


def fingerprint(view: torch.Tensor) -> int:
    """xxh3-64 of the tensor's element count and sampled bytes (a CUDA tensor's sample is copied to the host:
    call it where the tensor is known to be ready, e.g. on a stream that waited for the training stream)."""
    s = sample(view).detach().cpu().contiguous()
    h = xxhash.xxh3_64()
    h.update(view.numel().to_bytes(8, "little"))
    if s.numel():
        h.update(s.view(torch.uint8).numpy().data)   # sample() is 1-D
    return h.intdigest()


def fingerprints(replicas: Sequence[tuple[str, Any, torch.Tensor, str]]) -> list[list[Any]]:
    """``[name, box, fingerprint, by]`` of each replicated piece ``(name, box, view, by)``; a box is
    (offsets, sizes), ``by`` RULES or PLACEMENT."""
    return [[name, [list(box[0]), list(box[1])], fingerprint(view), by] for name, box, view, by in replicas]


def check_replicas(ranks: Sequence[RankPart]) -> None:
    """Rank 0, before committing: every rank holding a replicated piece holds the same values, by fingerprint.

    ``ranks`` are the ranks' manifest parts, each with its ``fingerprints`` (see :func:`fingerprints`).
    Raises LayoutError for the first piece the ranks disagree about.
    """
    seen: dict[tuple[Any, ...], tuple[int, int]] = {}   # piece -> (first rank, its fingerprint)
    for part in ranks:
        # the same box on several ranks: ZeRO partitions may cut one tensor at other places on other ranks
        for name, box, fp, *by in part.fingerprints:
            key = (name, tuple(box[0]), tuple(box[1]))
            first = seen.setdefault(key, (part.rank, fp))
            if first[1] != fp and by == [PLACEMENT]:
                raise LayoutError(
                    f"{name}: ranks {first[0]} and {part.rank} hold different values of it, but it is a DTensor "
                    f"whose placements replicate it (Replicate()), so one copy would be saved and the other lost; "
                    f"make the copies equal (all-reduce what changes them, e.g. a sequence-parallel norm's "
                    f"gradients), or shard it (Shard(d)) if each rank's part is its own")
            if first[1] != fp:
                raise LayoutError(
                    f"{name}: ranks {first[0]} and {part.rank} hold different values of it, but the layout's rules "
                    f"replicate it over tensor-parallel ranks (a Replicated rule, or no rule matched its name), so "
                    f"one copy would be saved and the other lost; add the rule that splits it (Split(0) for a "
                    f"column-parallel weight, Split(1) for a row-parallel one), or make the copies equal")
