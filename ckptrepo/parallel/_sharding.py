"""Map a rank's local state to pieces of layout-independent global tensors, and back.

Saving and loading use the same mapping: every local tensor becomes a list of
:class:`Piece` s, each a box of a global tensor plus a view of the local
tensor holding exactly that box. On save the views are the sources; on load
they are the destinations, so loading into any layout is "fill each piece".

Where the mapping comes from, per tensor of the state:

* a ``DTensor``: its device mesh and placements (``Shard(d)``/``Replicate()``);
* a tensor in a parameter section of the layout's rules (``model/...``, or an
  optimizer section keyed like it): the rule for its global parameter name
  (pipeline layer renumbering, tensor-parallel split, vocabulary padding,
  fused sub-parameters);
* an optimizer section that is one flat 1-D tensor (ZeRO-1/2/3), or at ZeRO-3
  the model section itself: the data-parallel partition of the rank's
  parameters back to back (in the order of its model section, or at ZeRO-3 of
  the rules' ``param_shapes``);
* anything else: a per-rank tensor, stored whole under ``<path>@rank<r>`` when
  the state comes from several ranks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ckptrepo.core import Box, flat_boxes, intersect, slices, volume
from ckptrepo.errors import LayoutError, StateMismatchError
from ckptrepo.parallel._replicas import PLACEMENT, RULES
from ckptrepo.parallel.layout import ParallelLayout, zero_partition
from ckptrepo.parallel.rules import Region, Replicated, Rules, Spec, global_shape, local_shape, regions
from ckptrepo.state import DTYPE_NAMES, TensorRecord, is_dtensor


@dataclass
class Piece:
    """A box of global tensor ``name`` and the local view that holds it (shape == box sizes)."""

    name: str
    dtype: str
    gshape: tuple[int, ...]
    box: Box
    view: torch.Tensor
    cut_dim: int | None = None   # a dimension other layouts slice across rows (see column_blocks)
    # who replicates it over ranks, so that the ranks' copies are fingerprinted (parallel/_replicas.py): RULES (the
    # rules, over tensor-parallel ranks) or PLACEMENT (a DTensor's Replicate() over a mesh dimension of several
    # ranks); "": nobody
    replicated: str = ""


@dataclass
class ShardedState:
    """A rank's pieces, and for each state record the name it is stored under."""

    pieces: list[Piece] = field(default_factory=list)
    leaf_names: list[str] = field(default_factory=list)
    partial: list[int] = field(default_factory=list)   # records that pieces do not fully cover (padding)
    # per record, the global shape of the tensor it is stored as (None: a ZeRO flat partition, which holds
    # pieces of other tensors): how a tensor this rank holds none of, or that has no elements, is still listed
    gshapes: list[tuple[int, ...] | None] = field(default_factory=list)


def rank_name(path: str, rank: int) -> str:
    """The stored name of a per-rank tensor."""
    return f"{path}@rank{rank}"


def rank_path(name: str) -> str | None:
    """The state path of a per-rank tensor's stored name (``rank_name``'s inverse); None for a global name."""
    return name.rsplit("@rank", 1)[0] if "@rank" in name else None


BLOCKS_PER_PIECE = 8            # a saved piece is cut into this many column blocks at most...
MIN_BLOCK_BYTES = 64 << 10      # ...each at least this big...
MIN_BLOCK_ROW_BYTES = 1 << 10   # ...with rows at least this long (see column_blocks)...
NARROW_BLOCKS = 4               # ...except that narrow rows still get this many blocks...
MIN_NARROW_ROW_BYTES = 128      # ...down to rows this long
_POWERS_OF_TWO = [1 << i for i in range(BLOCKS_PER_PIECE.bit_length() - 1, 0, -1)]   # 8, 4, 2


def column_blocks(pieces: Sequence[Piece]) -> list[Piece]:
    """Cut each piece that has a ``cut_dim`` into column blocks along it, for storage.

    A row-parallel weight (split along dim 1) is stored row-major, so a layout
    with more tensor-parallel ranks needs a short run out of every row of the
    saved piece; reads are verified inner chunks (64 KiB), so a narrow slice
    would read about the whole piece. Stored as up to ``BLOCKS_PER_PIECE`` blocks of whole
    columns, each block is contiguous, and such a load reads exactly the blocks
    it needs (tp growth up to 8x when the sizes divide evenly: the block count
    is the largest power of two up to 8 that divides the size). Loads that
    want whole rows read every block whole and scatter it, at the cost of one
    strided copy. That copy is why a block's rows are at least
    ``MIN_BLOCK_ROW_BYTES`` long: numpy's strided copy into wider rows is much
    slower for rows of a few hundred bytes than for whole rows, and close to
    whole-row speed from about 1 KiB, and a load into fewer tensor-parallel
    ranks (tp 4->2 in benchmarks/reshard.py) copies every row of every block
    that way. Pieces with rows under 8 KiB get fewer blocks, but never fewer than
    ``NARROW_BLOCKS`` while rows of ``MIN_NARROW_ROW_BYTES`` allow it: a narrow-row
    weight (1 KiB rows) stored whole would make every rank of a tp=4 load read
    every chunk of it, four times its part, which on a lazy clone crosses the
    network; the strided copy of 128 to 512-byte rows costs a load into whole rows
    far less than that (docs/decisions/059). Only the save path cuts; the load
    path reads whatever pieces a version has.
    """
    out: list[Piece] = []
    for p in pieces:
        d = p.cut_dim
        sizes = p.box[1]
        if d is None or d >= len(sizes) or volume(sizes[:d]) <= 1:
            out.append(p)
            continue
        item = p.view.element_size()
        row = volume(sizes[d:]) * item
        limit = min(BLOCKS_PER_PIECE, sizes[d], volume(sizes) * item // MIN_BLOCK_BYTES,
                    max(row // MIN_BLOCK_ROW_BYTES, min(NARROW_BLOCKS, row // MIN_NARROW_ROW_BYTES)))
        # a power of two that divides the size evenly keeps block edges on the edges of other tp splits
        k = next((n for n in _POWERS_OF_TWO if n <= limit and sizes[d] % n == 0), limit)
        if k < 2:
            out.append(p)
            continue
        for i in range(k):
            a, b = i * sizes[d] // k, (i + 1) * sizes[d] // k
            offs, szs = list(p.box[0]), list(sizes)
            offs[d] += a
            szs[d] = b - a
            out.append(Piece(p.name, p.dtype, p.gshape, (tuple(offs), tuple(szs)), p.view.narrow(d, a, b - a)))
    return out


def _cut_dim(dim: int | None) -> int | None:
    return dim if dim is not None and dim > 0 else None


def _check_placements(placements: Sequence[Any], mesh: Any) -> None:
    """Refuse placements whose local shard is not one box of the global tensor.

    Shard and Replicate are boxes. A ``_StridedShard(d, split_factor=f)`` is what FSDP2 puts on its mesh
    dimension when it shards a tensor-parallel DTensor again on dim d (2-D FSDP2 + TP): alone it would
    interleave f pieces, but with later ``Shard(d)`` mesh dimensions of f ranks in all it is one box, which
    torch's ``compute_local_shape_and_global_offset`` gives (checked against ``full_tensor()``, uneven too).
    Partial (a pending reduction) holds no value to save.
    """
    from torch.distributed.tensor import Replicate, Shard
    for a, p in enumerate(placements):
        if type(p) in (Shard, Replicate):
            continue
        if type(p).__name__ == "_StridedShard":
            later = [b for b in range(a + 1, len(placements))
                     if type(placements[b]) is Shard and placements[b].dim == p.dim]
            if later and math.prod(mesh.size(b) for b in later) == p.split_factor:
                continue
        raise LayoutError(f"DTensor placement {p} is not supported; redistribute to Shard/Replicate before saving")


def dtensor_box(t: Any, boxes: dict[Any, Any] | None = None) -> tuple[Box, torch.Tensor]:
    """The global box a DTensor's local shard covers, and the local tensor.

    ``boxes`` remembers the box per (global shape, placements, mesh) within one call over a state: a model's
    tensors share a few of them (every layer's weight and its two moments), and torch is slow to work each out.
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    key = (tuple(t.shape), tuple(t.placements), id(t.device_mesh))
    got = boxes.get(key) if boxes is not None else None
    if got is None:
        _check_placements(t.placements, t.device_mesh)
        got = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        if boxes is not None:
            boxes[key] = got
    shape, offset = got
    local = t.to_local()
    if tuple(local.shape) != tuple(shape):
        raise LayoutError(f"DTensor local shard has shape {list(local.shape)} but its placements say {list(shape)}")
    return (tuple(offset), tuple(shape)), local


def _replicated_by_rules(spec: Spec, tp: int) -> str:
    """``Piece.replicated`` of a piece of a rule section: RULES where the rules replicate it over several
    tensor-parallel ranks (a parameter's or its ZeRO partition's part alike), else ""."""
    return RULES if isinstance(spec, Replicated) and tp > 1 else ""


def _replicated_over_ranks(t: Any) -> bool:
    """Whether a DTensor's placements replicate its local tensor over several ranks (Replicate() on a mesh
    dimension of more than one): the copies must agree, one is saved."""
    from torch.distributed.tensor import Replicate
    return any(type(p) is Replicate and t.device_mesh.size(d) > 1 for d, p in enumerate(t.placements))


def _dtensor_cut_dim(t: Any) -> int | None:
    from torch.distributed.tensor import Shard
    return _cut_dim(max((p.dim for p in t.placements if isinstance(p, Shard)), default=None))


def _spec_cut_dim(spec: Spec) -> int | None:
    return _cut_dim(getattr(spec, "dim", None))


class Sharder:
    """Turns one rank's flattened state into pieces (see the module docstring).

    ``gshape_of`` is given when loading: the global shape of a stored tensor by
    name (None when the version does not have it). ``per_rank`` is the rank
    whose per-rank tensors are meant (None: a single-process version, where
    per-rank tensors are stored under their plain path).
    """

    def __init__(self, layout: ParallelLayout | None, rank: int, per_rank: int | None,
                 gshape_of: Callable[[str], tuple[int, ...] | None] | None = None) -> None:
        self.layout = layout or ParallelLayout()
        self.rules: Rules | None = self.layout.rules
        self.coords = self.layout.coords(rank)
        self.per_rank = per_rank
        self.gshape_of = gshape_of

    def shard(self, records: Sequence[TensorRecord]) -> ShardedState:
        out = ShardedState(leaf_names=[""] * len(records), gshapes=[None] * len(records))
        params: list[tuple[str, tuple[int, ...], Spec, tuple[int, ...]]] = []
        flat: list[tuple[int, str]] = []
        flat_sections = self._flat_sections()
        boxes: dict[Any, Any] = {}
        for i, rec in enumerate(records):
            t = rec.tensor
            if is_dtensor(t):
                box, local = dtensor_box(t, boxes)
                out.leaf_names[i] = rec.name
                out.gshapes[i] = tuple(t.shape)
                self._check_known(rec.name, tuple(t.shape))
                if volume(box[1]):
                    out.pieces.append(Piece(rec.name, rec.dtype, tuple(t.shape), box, local, _dtensor_cut_dim(t),
                                            PLACEMENT if _replicated_over_ranks(t) else ""))
                continue
            where = self.rules.section_of(rec.name) if self.rules else None
            if where is not None:
                section, param = where
                gparam, spec, gshape = self._param(section, param, t)
                name = f"{section}/{gparam}"
                out.leaf_names[i] = name
                out.gshapes[i] = tuple(gshape)
                if self.rules is not None and section == self.rules.model_section:
                    params.append((gparam, tuple(t.shape), spec, gshape))
                regs = regions(spec, gshape, self.layout.tp, self.coords.tp)
                replicated = _replicated_by_rules(spec, self.layout.tp)
                for lo, go, sz in regs:
                    out.pieces.append(Piece(name, rec.dtype, gshape, (go, sz), t[slices(lo, sz)], _spec_cut_dim(spec),
                                            replicated))
                if sum(volume(sz) for _, _, sz in regs) != t.numel():
                    out.partial.append(i)
                continue
            if rec.name in flat_sections:
                out.leaf_names[i] = rec.name
                flat.append((i, rec.name))
                out.partial.append(i)
                continue
            name = rec.name if self.per_rank is None else rank_name(rec.name, self.per_rank)
            if self.gshape_of is not None and self.gshape_of(name) is None and self.gshape_of(rec.name) is not None:
                name = rec.name  # a global tensor (saved from DTensors) loaded whole
            out.leaf_names[i] = name
            out.gshapes[i] = tuple(rec.shape)
            self._check_known(name, rec.shape)
            if rec.numel:
                out.pieces.append(Piece(name, rec.dtype, rec.shape, ((0,) * len(rec.shape), rec.shape), t))
        # ZeRO-3 holds no per-parameter model tensors; a load into optimizer partitions alone neither: the
        # rules (with the version's shapes) say which parameters the partitions cover, as a fresh build does
        if flat and (self.layout.zero == 3 or (not params and self.gshape_of is not None)):
            params = self._zero3_params()
        for i, section in flat:
            out.pieces.extend(self._flat_pieces(section, records[i].tensor, params))
        return out

    def _flat_sections(self) -> tuple[str, ...]:
        """The sections a rank holds as one flat ZeRO partition: optimizer states from stage 1, the model at 3."""
        if self.rules is None or not self.layout.zero:
            return ()
        model = (self.rules.model_section,) if self.layout.zero == 3 else ()
        return model + self.rules.optimizer_sections

    def _zero3_params(self) -> list[tuple[str, tuple[int, ...], Spec, tuple[int, ...]]]:
        """The parameters a rank's flat partitions cover, from the rules (checked against the version)."""
        assert self.rules is not None
        lay, c = self.layout, self.coords
        out = []
        for _, gparam, shape, spec, gshape in self.rules.local_params(lay.tp, c.tp, lay.pp, c.pp):
            self._check_known(f"{self.rules.model_section}/{gparam}", gshape)
            out.append((gparam, shape, spec, gshape))
        return out

    def _check_known(self, name: str, shape: tuple[int, ...]) -> None:
        if self.gshape_of is None:
            return
        saved = self.gshape_of(name)
        if saved is None:
            raise StateMismatchError(f"{name}: not in this version; load without into= to see what was saved")
        if tuple(saved) != tuple(shape):
            raise StateMismatchError(f"{name}: global shape {list(shape)} here but {list(saved)} in the version; "
                                     f"build the state with the saved configuration")

    def _param(self, section: str, param: str, t: torch.Tensor) -> tuple[str, Spec, tuple[int, ...]]:
        assert self.rules is not None
        lay, c = self.layout, self.coords
        if lay.zero == 3 and section == self.rules.model_section:
            raise LayoutError(f"{section}/{param}: under zero=3 the {section} section must be one flat 1-D tensor "
                              f"(this rank's ZeRO partition), not a tensor per parameter; or save with zero=1")
        gparam = self.rules.to_global(param, lay.pp, c.pp)
        spec = self.rules.spec(gparam)
        what = f"{section}/{gparam}"
        if self.gshape_of is None:
            return gparam, spec, global_shape(spec, tuple(t.shape), lay.tp, what)
        gshape = self.gshape_of(what)
        if gshape is None:
            raise StateMismatchError(f"{what}: not in this version (layout {lay}); check the rules and the layout")
        want = local_shape(spec, gshape, lay.tp, what)
        if tuple(t.shape) != want:
            raise StateMismatchError(f"{section}/{param}: shape {list(t.shape)} here but {list(want)} expected for "
                                     f"{what} {list(gshape)} under {lay}; build the state for this layout")
        return gparam, spec, tuple(gshape)

    def _flat_pieces(self, section: str, flat: torch.Tensor,
                     params: list[tuple[str, tuple[int, ...], Spec, tuple[int, ...]]]) -> list[Piece]:
        """Pieces of a ZeRO flat partition over the rank's parameters, ``(name, local shape, spec, global shape)``."""
        lay, c = self.layout, self.coords
        if flat.dim() != 1:
            raise LayoutError(f"{section}: a ZeRO (zero={lay.zero}) partition must be one flat 1-D tensor")
        total = sum(volume(shape) for _, shape, _, _ in params)
        start, stop, size = zero_partition(total, lay.dp, c.dp)
        if flat.numel() != size:
            raise StateMismatchError(f"{section}: {flat.numel()} elements here but the ZeRO partition of dp rank "
                                     f"{c.dp} over {total} parameter elements has {size}; check the layout")
        dtype = DTYPE_NAMES[flat.dtype]
        out: list[Piece] = []
        base = 0
        for gparam, shape, spec, gshape in params:
            n = volume(shape)
            lo, hi = max(start, base), min(stop, base + n)
            if lo < hi:
                regs: list[Region] = regions(spec, gshape, lay.tp, c.tp)
                replicated = _replicated_by_rules(spec, lay.tp)
                for fstart, box in flat_boxes(shape, lo - base, hi - base):
                    at = base + fstart - start
                    boxview = flat[at:at + volume(box[1])].view(box[1])
                    for rlo, rgo, rsz in regs:
                        part = intersect(box, (rlo, rsz))
                        if part is None:
                            continue
                        rel = tuple(p - b for p, b in zip(part[0], box[0]))
                        gbox = (tuple(g + p - r for g, p, r in zip(rgo, part[0], rlo)), part[1])
                        out.append(Piece(f"{section}/{gparam}", dtype, gshape, gbox, boxview[slices(rel, part[1])],
                                         _spec_cut_dim(spec), replicated))
            base += n
        return out


__all__ = ["Piece", "ShardedState", "Sharder", "column_blocks", "dtensor_box", "is_dtensor", "rank_name",
           "rank_path"]
