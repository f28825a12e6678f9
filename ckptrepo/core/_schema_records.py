"""The records a version manifest's bulky fields decode into: the tensor table (``TensorEntry``, ``Piece``),
the layout (``LayoutRecord``, ``RankRecord``) and the capture-time statistics (``TensorStatsRecord``).

ckptrepo.core.schema is their public home; they live apart from it so that the field checks that build them
(core/_schema_fields.py) and the schema's decoder that calls those checks import them without a cycle.

The records of a version's tensor table are NamedTuples: a load decodes thousands of them, and a NamedTuple
is built by ``tuple.__new__``, where a frozen dataclass sets each field through ``object.__setattr__``,
several times slower. Tuples and lists encode alike, so records hold tuples.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

from ckptrepo.core._boxes import Box, volume

Tree = Any   # a state skeleton: an opaque msgpack node (docs/format.md, state/_skeleton.py)


class Piece(NamedTuple):
    """A part of a tensor: the elements of ``box`` (global coordinates), stored contiguous and row-major in
    array ``array`` from element ``offset`` on. ``digest``: the content digest of those bytes (an algorithm
    byte and 16 bytes, saving/_content_hash.py), which a later snapshot compares to reuse them; None where
    they were not hashed."""

    box: Box
    array: str
    offset: int
    digest: bytes | None = None

    def to_raw(self) -> dict[str, Any]:
        raw = {"box": self.box, "array": self.array, "offset": self.offset}
        if self.digest is not None:
            raw["digest"] = self.digest
        return raw


DIGEST_BYTES = 17   # what this release writes; a reader takes any algorithm byte and hash up to 64 bytes


class TensorEntry(NamedTuple):
    """A tensor of a version: its logical name, dtype name, global shape, and the pieces that cover it exactly
    once (none for a zero-element tensor)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return volume(self.shape)

    @property
    def array(self) -> str | None:
        """The array of a tensor stored whole (one piece), as a single-process snapshot stores every tensor;
        None for a zero-element tensor."""
        return self.pieces[0].array if self.pieces else None

    @property
    def offset(self) -> int:
        """The element offset of a tensor stored whole (see ``array``); 0 for a zero-element tensor."""
        return self.pieces[0].offset if self.pieces else 0

    def to_raw(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": self.shape,
                "pieces": [p.to_raw() for p in self.pieces]}


@dataclass(frozen=True, slots=True)
class RankRecord:
    """One saved rank of a version's layout. A single-process version's only record is ``{rank: 0}``
    (``leaf_names`` None); a distributed one keeps each rank's coordinates, tree and tensor leaves' names."""

    rank: int
    coords: dict[str, int] | None = None   # {tp, pp, dp}; None when saved without a ParallelLayout
    tree: Tree = None
    leaf_names: tuple[str, ...] | None = None   # the stored name of each of ``tree``'s tensor leaves

    def to_raw(self) -> dict[str, Any]:
        if self.leaf_names is None:
            return {"rank": self.rank}
        return {"rank": self.rank, "coords": self.coords, "tree": self.tree, "leaf_names": self.leaf_names}


@dataclass(frozen=True, slots=True)
class LayoutRecord:
    """The layout a version was saved from: its world size and ranks, and for a ParallelLayout its degrees
    and rules (``Rules.to_json()``); ``tp`` is None for a version saved without one."""

    world_size: int
    ranks: tuple[RankRecord, ...]
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    zero: int | None = None
    rules: dict[str, Any] | None = None

    def to_raw(self) -> dict[str, Any]:
        ranks = [r.to_raw() for r in self.ranks]
        if self.tp is None:
            return {"world_size": self.world_size, "ranks": ranks}
        d: dict[str, Any] = {"tp": self.tp, "pp": self.pp, "dp": self.dp, "zero": self.zero,
                             "world_size": self.world_size}
        if self.rules is not None:
            d["rules"] = self.rules
        d["ranks"] = ranks
        return d


SINGLE_PROCESS_LAYOUT = LayoutRecord(1, (RankRecord(0),))


# The per-tensor statistics a snapshot records while it captures (``Manifest.tensor_stats``): the
# summary of its values, then the change from the parent version (NaN where it was not measured).
STAT_COLUMNS = ("norm", "mean", "std", "min", "max", "absmax", "nan", "inf", "delta", "relative-change")


@dataclass(frozen=True, slots=True)
class TensorStatsRecord:
    """Statistics of a version's tensors taken at capture time: one row of ``columns`` per name, as
    little-endian float64 (``values``). NaN marks a value that was not measured. Names are repeated here,
    apart from the tensor table, so a trajectory over thousands of versions decodes only this field."""

    names: tuple[str, ...]
    columns: tuple[str, ...]
    values: bytes

    def to_raw(self) -> dict[str, Any]:
        return {"columns": list(self.columns), "names": list(self.names), "values": self.values}

    def column(self, name: str) -> list[float]:
        """Every tensor's value of column ``name`` (all NaN when this record has no such column)."""
        if name not in self.columns:
            return [math.nan] * len(self.names)
        k, width = self.columns.index(name), len(self.columns)
        return list(struct.unpack_from(f"<{len(self.names) * width}d", self.values)[k::width])

    def rows(self) -> dict[str, dict[str, float]]:
        """Per tensor name: its recorded columns."""
        flat = struct.unpack_from(f"<{len(self.names) * len(self.columns)}d", self.values)
        width = len(self.columns)
        return {n: dict(zip(self.columns, flat[i * width:(i + 1) * width])) for i, n in enumerate(self.names)}

    @classmethod
    def of_rows(cls, names: list[str], rows: list[tuple[float, ...]],
                columns: tuple[str, ...] = STAT_COLUMNS) -> "TensorStatsRecord":
        flat = [v for r in rows for v in r]
        return cls(tuple(names), columns, struct.pack(f"<{len(flat)}d", *flat))
