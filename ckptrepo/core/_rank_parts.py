"""The per-rank parts of a distributed snapshot: ``RankPart`` (what a rank wrote) and ``RankFailure`` (why it
wrote nothing), sealed and set in the ranks' key-value store, and merged by rank 0 into the version manifest
(parallel/_distributed.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptrepo.core._manifest import seal, unseal
from ckptrepo.core._moments import Moments
from ckptrepo.core._schema_fields import _digest, arrays_problem
from ckptrepo.core._schema_records import Piece, Tree
from ckptrepo.errors import CorruptionError
from ckptrepo.storage import ArrayInfo


def _piece(p: dict[str, Any]) -> Piece:
    offs, sizes = p["box"]
    return Piece((tuple(offs), tuple(sizes)), p["array"], p["offset"], _digest(p.get("digest"), "a piece"))


@dataclass(frozen=True, slots=True)
class RankPart:
    """One rank's part of a distributed snapshot (parallel/_distributed.py): set in the ranks' key-value store
    once its data is durable, merged by rank 0 into the version manifest."""

    rank: int
    step: int | None
    tree: Tree                                          # this rank's skeleton
    leaf_names: tuple[str, ...]                         # the stored name of each of its tensor leaves
    names: tuple[tuple[str, str, tuple[int, ...]], ...]   # (name, dtype, global shape) of each tensor it holds
    coords: dict[str, int] | None                       # {tp, pp, dp}; None without a ParallelLayout
    tensors: tuple[tuple[str, tuple[Piece, ...]], ...]  # (name, the pieces this rank wrote of it)
    arrays: dict[str, ArrayInfo]                        # the arrays it wrote
    fingerprints: tuple[Any, ...]                       # its replicated pieces' (parallel/_replicas.py)
    # (name, Moments.to_raw()) of each piece it wrote: its values' statistics, which rank 0 merges per tensor
    moments: tuple[tuple[str, Any], ...] | None = None

    def to_raw(self) -> dict[str, Any]:
        raw = {"rank": self.rank, "step": self.step, "tree": self.tree, "leaf_names": self.leaf_names,
               "names": self.names, "coords": self.coords,
               "tensors": [{"name": n, "pieces": [p.to_raw() for p in ps]} for n, ps in self.tensors],
               "arrays": {k: a.to_json() for k, a in self.arrays.items()}, "fingerprints": self.fingerprints}
        if self.moments is not None:
            raw["moments"] = [[n, m] for n, m in self.moments]
        return raw

    @classmethod
    def from_raw(cls, d: dict[str, Any]) -> "RankPart":
        part = cls(d["rank"], d.get("step"), d["tree"], tuple(d["leaf_names"]),
                   tuple((n, dtype, tuple(shape)) for n, dtype, shape in d["names"]), d.get("coords"),
                   tuple((t["name"], tuple(map(_piece, t["pieces"]))) for t in d["tensors"]),
                   {k: ArrayInfo.from_json(k, a) for k, a in d["arrays"].items()}, tuple(d.get("fingerprints", ())),
                   None if d.get("moments") is None else tuple((n, Moments.from_raw(m).to_raw())
                                                                for n, m in d["moments"]))
        problem = arrays_problem(part.arrays) or next(
            (f"a piece of {n} points into {p.array!r}, which the part does not list"
             for n, ps in part.tensors for p in ps if p.array not in part.arrays), None)
        if problem:   # merged, it would commit a version no reader accepts
            raise ValueError(problem)
        return part


@dataclass(frozen=True, slots=True)
class RankFailure:
    """What a rank that failed its part of a distributed snapshot stages instead of its ``RankPart``."""

    rank: int
    error: str

    def to_raw(self) -> dict[str, Any]:
        return {"rank": self.rank, "error": self.error}


def encode_rank_part(part: RankPart | RankFailure) -> bytes:
    """The sealed staging object of a rank's part or failure."""
    return seal(part.to_raw())


def decode_rank_part(blob: bytes, what: str) -> RankPart | RankFailure:
    """A staged rank part, or the failure a rank staged instead; ``what`` names the object in errors."""
    d = unseal(blob, what)
    try:
        if d.get("error"):
            return RankFailure(d.get("rank", -1), d["error"])
        return RankPart.from_raw(d)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CorruptionError(f"{what} is not a rank's part of a snapshot ({type(err).__name__}: {err})") from None
