"""Parallel layouts: which rank holds which part of the training state.

A :class:`ParallelLayout` names the degrees of tensor (``tp``), pipeline
(``pp``) and data (``dp``) parallelism, the ZeRO stage, and the rules that say
how each parameter is split (see :mod:`ckptrepo.rules`). Ranks are ordered as
in Megatron-LM: the tensor-parallel index varies fastest, then data-parallel,
then pipeline stage, so ``rank = (pp_rank * dp + dp_rank) * tp + tp_rank``.

The module also holds the two conventions a training framework must share
with the checkpoint for ZeRO flat partitions (``zero_partition``) and pipeline
stages (``stage_layers``), so the reference model and the loader cannot
disagree about them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from ckptrepo.errors import LayoutError

if TYPE_CHECKING:
    from ckptrepo.parallel.rules import Rules


# The most ranks a layout may have: far beyond any job's, and small enough that every count a layout derives
# (ranks, coordinates, partitions) stays an ordinary integer in a manifest.
MAX_WORLD_SIZE = 1 << 24


@dataclass(frozen=True)
class Coords:
    """One rank's position in the layout."""

    tp: int
    pp: int
    dp: int


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees of parallelism and the rules that shard the state.

    ``zero`` is the ZeRO stage (0: optimizer state replicated over data
    parallel ranks; 1 and 2: every optimizer section is one flat partition per
    data-parallel rank over the rank's parameters, see :func:`zero_partition`;
    3: the model section too, in the order of the rules' ``param_shapes``).
    Gradients are not training state, so stages 1 and 2 save alike.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 0
    rules: "Rules | None" = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_WORLD_SIZE:
                raise LayoutError(f"ParallelLayout({name}={v!r}): each degree must be a whole number from 1 to "
                                  f"{MAX_WORLD_SIZE}")
        if self.world_size > MAX_WORLD_SIZE:
            raise LayoutError(f"ParallelLayout(tp={self.tp}, pp={self.pp}, dp={self.dp}) has {self.world_size} ranks; "
                              f"a layout has {MAX_WORLD_SIZE} at most")
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise LayoutError(f"ParallelLayout(zero={self.zero!r}): the ZeRO stage is 0, 1, 2 or 3; "
                              f"for FSDP2 leave it 0 and save DTensor state dicts, which need no rules")
        # told by what it does: rules.py imports this module, so this one cannot import Rules
        if self.rules is not None and not all(callable(getattr(self.rules, a, None)) for a in ("spec", "to_json")):
            raise LayoutError(f"ParallelLayout(rules=...) takes ckptrepo.rules.Rules (e.g. megatron_gpt(...)) or "
                              f"None, not {type(self.rules).__name__}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> Coords:
        """The (tp, pp, dp) position of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside this layout of {self.world_size} ranks "
                              f"(tp={self.tp}, pp={self.pp}, dp={self.dp}); "
                               f"pass rank= between 0 and {self.world_size - 1}")
        return Coords(tp=rank % self.tp, dp=(rank // self.tp) % self.dp, pp=rank // (self.tp * self.dp))

    def rank_of(self, tp: int = 0, pp: int = 0, dp: int = 0) -> int:
        """The rank at position (tp, pp, dp)."""
        return (pp * self.dp + dp) * self.tp + tp

    def group(self, rank: int, axis: str) -> list[int]:
        """The ranks that differ from ``rank`` only along ``axis`` ("tp", "pp" or "dp"), in index order."""
        c = self.coords(rank)
        size = getattr(self, axis)
        out = []
        for i in range(size):
            pos = {"tp": c.tp, "pp": c.pp, "dp": c.dp, axis: i}
            out.append(self.rank_of(**pos))
        return out

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"tp": self.tp, "pp": self.pp, "dp": self.dp, "zero": self.zero,
                             "world_size": self.world_size}
        if self.rules is not None:
            d["rules"] = self.rules.to_json()
        return d

    def __str__(self) -> str:
        return f"tp={self.tp} pp={self.pp} dp={self.dp} zero={self.zero}"


def zero_partition(total: int, dp: int, dp_rank: int) -> tuple[int, int, int]:
    """ZeRO's flat partition: ``(start, stop, size)`` of data-parallel rank ``dp_rank``.

    The flat buffer is the rank's parameters back to back (in the order of its
    model section), ``total`` elements; every rank gets ``size = ceil(total /
    dp)`` elements, the last one padded at its end. ``stop - start`` real
    elements start at ``start``.
    """
    size = -(-total // dp) if total else 0
    start = min(total, dp_rank * size)
    return start, min(total, start + size), size


def stage_layers(num_layers: int, pp: int, pp_rank: int, explicit: Sequence[int] | None = None) -> range:
    """The global layer indices pipeline stage ``pp_rank`` holds: an even split, or ``explicit`` counts per stage."""
    if explicit is not None:
        if len(explicit) != pp or sum(explicit) != num_layers:
            raise LayoutError(f"stage layer counts {list(explicit)} must be {pp} numbers adding up to {num_layers}")
        first = sum(explicit[:pp_rank])
        return range(first, first + explicit[pp_rank])
    if num_layers % pp:
        raise LayoutError(f"{num_layers} layers cannot be split evenly over pp={pp} stages; "
                          f"pass explicit stage sizes to the rules (stage_sizes=[...])")
    per = num_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


__all__ = ["MAX_WORLD_SIZE", "Coords", "ParallelLayout", "stage_layers", "zero_partition"]
