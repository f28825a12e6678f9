"""``load(version, parallel_layout=..., rank=...)``: build or fill one rank's state in any layout.

The target state is either given (``into=``: plain tensors, DTensors, flat
ZeRO partitions, filled in place) or built here from a *template*: the saved
tree of the rank whose per-rank objects this rank gets, with every parameter
section regenerated for the target layout (this rank's pipeline stage, its
tensor-parallel slice, vocabulary padding, or a flat ZeRO partition). Either
way the state is flattened, mapped to pieces of global tensors
(:mod:`ckptrepo.parallel._sharding`) and filled by :func:`ckptrepo.loading._reshard.read_pieces`,
which reads only the bytes those pieces need (pieces on a GPU through pinned buffers and a copy stream:
:mod:`ckptrepo.loading._device_load`).

Per-rank objects (RNG states and anything no rule or placement shards) come
from the saved rank with the same number when the layout is unchanged; when it
changed, from saved rank ``rank % saved_world_size``, with a warning naming
them, because their meaning (whose random stream?) depends on the layout.
An unsharded load (no layout given) takes saved rank 0's, without a warning.
Per-rank state held only by saved ranks that no target rank takes from (a
loss scaler on the last pipeline stage, loaded into one process) is dropped,
with a warning either way.
"""
from __future__ import annotations

import functools
import operator
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch

from ckptrepo.core import volume
from ckptrepo.core.schema import Manifest, RankRecord
from ckptrepo.errors import LayoutError, StateMismatchError, warn
from ckptrepo.loading._binding import check_param_groups, fillable_array
from ckptrepo.loading._device_load import read_pieces_to
from ckptrepo.loading._engine import ReadStats
from ckptrepo.loading._reader import read_tensors
from ckptrepo.parallel import Sharder, process_group_rank, rank_name, rank_path
from ckptrepo.parallel.layout import ParallelLayout, zero_partition
from ckptrepo.parallel.rules import Fused, LocalParam, Rules
from ckptrepo.state import (
    DICT,
    DTYPE_NAMES,
    LIST,
    NDARRAY,
    ODICT,
    STATEFUL,
    TENSOR,
    TORCH_DTYPES,
    TUPLE,
    flatten,
    holds_tensors,
    is_dtensor,
    is_stateful,
    key_str,
    key_value,
    overlap_error,
    overlapping_elements,
    own_containers,
    path_str,
    unflatten,
)
from ckptrepo.storage.protocol import Store


def saved_world(manifest: Manifest) -> int:
    return int(manifest.layout.world_size) if manifest.layout is not None else 1


def _saved_ranks(manifest: Manifest) -> tuple[RankRecord, ...]:
    return manifest.layout.ranks if manifest.layout is not None else ()


def rank_tree(manifest: Manifest, rank: int) -> tuple[Any, Sequence[str]]:
    """The saved tree of ``rank`` and the stored name of each of its tensor leaves."""
    if saved_world(manifest) > 1:
        r = _saved_ranks(manifest)[rank]
        return r.tree, r.leaf_names or ()
    return manifest.tree, [t.name for t in manifest.tensors]


def saved_rules(manifest: Manifest) -> Rules | None:
    d = manifest.layout.rules if manifest.layout is not None else None
    return Rules.from_json(d) if d else None


def full_rules(rules: Rules | None) -> Rules | None:
    """The rules of an unsharded load: the same sections, every parameter whole and unpadded."""
    if rules is None:
        return None
    return rules.replaced(params=[], stage_sizes=None)


def with_version_shapes(rules: Rules, manifest: Manifest) -> Rules:
    """``rules`` with ``param_shapes`` when they have none: the saved rules', else the version's tensor table's.

    The table lists the model's tensors in rank order, pipeline stages in
    order and each rank's in its own order: the model order that the flat
    partitions of a version saved under ZeRO-1 followed.
    """
    if rules.param_shapes is not None:
        return rules
    saved = saved_rules(manifest)
    if saved is not None and saved.param_shapes is not None:
        return rules.with_param_shapes(saved.param_shapes)
    prefix = rules.model_section + "/"
    return rules.with_param_shapes([(t.name[len(prefix):], list(t.shape)) for t in manifest.tensors
                                    if t.name.startswith(prefix)])


def _check_dtypes(pieces: list[Any], shapes: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """Refuse a tensor of ``into`` whose dtype is not the saved one, as the plain load does: the copy would cast,
    silently and lossily (float32 into int32 truncated)."""
    for p in pieces:
        saved = shapes.get(p.name, (None, None))[1]
        if saved is not None and DTYPE_NAMES.get(p.view.dtype) != saved:
            raise StateMismatchError(f"{p.name}: dtype {p.view.dtype} in `into` but {saved} in the version; cast "
                                     f"after loading, or load without into=")


def per_rank_values(manifest: Manifest) -> list[str]:
    """Paths of the plain values (not tensors) that differ between the saved ranks: seeds, a numpy Generator's
    or ``random.getstate()``'s state. A load whose layout changed gives them to a rank from another saved rank's
    tree, just like per-rank tensors, so they are named in the same warning."""
    if saved_world(manifest) < 2:   # one saved tree (a single process's ranks list names no trees)
        return []
    trees = [dict(_values(r.tree, "")) for r in _saved_ranks(manifest)]
    if len(trees) < 2:
        return []
    paths = set().union(*trees)
    return sorted(p for p in paths if len({t.get(p) for t in trees}) > 1)


SAME_CHECK_MAX_BYTES = 64 << 10   # per-rank tensors up to this size are compared across the saved ranks


def same_on_every_rank(store: Store, manifest: Manifest, paths: Sequence[str]) -> set[str]:
    """The ``paths`` of per-rank tensors that hold the same bytes on every saved rank (Adam's ``step`` under
    FSDP2, a step counter kept as a tensor): whichever saved rank a load takes them from, it gets the same
    value, so a changed layout moves nothing there. Small tensors only (``SAME_CHECK_MAX_BYTES``): read whole
    from every rank, in one batch; bigger ones, and plain values (``per_rank_values`` already leaves out the
    equal ones), are not looked at."""
    world = saved_world(manifest)
    if world < 2 or not paths:
        return set()
    index = {t.name: i for i, t in enumerate(manifest.tensors)}
    groups: dict[str, list[int]] = {}
    for p in paths:
        found = [index.get(rank_name(p, r)) for r in range(world)]
        if any(i is None for i in found):
            continue
        entries = [manifest.tensors[i] for i in found if i is not None]
        first = entries[0]
        if any((e.dtype, e.shape) != (first.dtype, first.shape) for e in entries) or \
                first.numel * TORCH_DTYPES[first.dtype].itemsize > SAME_CHECK_MAX_BYTES:
            continue
        groups[p] = [i for i in found if i is not None]
    if not groups:
        return set()
    wanted = sorted({i for g in groups.values() for i in g})
    values = read_tensors(store, manifest.arrays, list(manifest.tensors), wanted)
    return {p for p, ids in groups.items()
            if all(_same_bytes(values[ids[0]], values[i]) for i in ids[1:])}


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN equal to itself, -0.0 not to 0.0): what a load would put in place."""
    return a.shape == b.shape and bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def per_rank_paths(manifest: Manifest, rank: int) -> set[str]:
    """The paths of saved ``rank``'s per-rank state: its plain values and its tensors stored per rank."""
    tree, leaf_names = rank_tree(manifest, rank)
    return {p for p, _ in _values(tree, "")} | _per_rank_tensor_paths(leaf_names)


def _per_rank_tensor_paths(leaf_names: Sequence[str]) -> set[str]:
    return {p for p in map(rank_path, leaf_names) if p is not None}


def unloaded_state(manifest: Manifest, target_world: int) -> tuple[list[int], list[str]]:
    """The saved ranks no rank of a ``target_world``-rank load takes per-rank state from (rank r takes saved
    rank ``r % saved world``), and the paths only they hold: state such a load drops, e.g. a loss scaler kept
    on the last pipeline stage alone, loaded into fewer stages."""
    world = saved_world(manifest)
    if world < 2 or target_world >= world:
        return [], []
    used = set().union(*(per_rank_paths(manifest, r) for r in range(target_world)))
    skipped = list(range(target_world, world))
    return skipped, sorted(set().union(*(per_rank_paths(manifest, r) for r in skipped)) - used)


def _values(node: Any, path: str) -> Iterator[tuple[str, str]]:
    """(path, text) of each value under the dicts of a skeleton, tensors left out: a list, tuple or numpy
    Generator is one value (``random.getstate()`` is named once, not 625 times); the text compares (NaN too)."""
    tag = node[0]
    if tag in (DICT, ODICT):
        for k, v in node[1]:
            key = str(key_value(k))
            yield from _values(v, f"{path}/{key}" if path else key)
    elif tag == STATEFUL:
        yield from _values(node[2], path)
    elif tag not in (TENSOR, NDARRAY):
        yield path or "<root>", repr(_without_tensors(node))


def _without_tensors(node: Any) -> Any:
    if isinstance(node, list) and node and node[0] in (TENSOR, NDARRAY):
        return node[0]
    return [_without_tensors(c) for c in node] if isinstance(node, list) else node


def default_rank(layout: ParallelLayout) -> int:
    """This process's rank of ``layout`` when no ``rank=`` was given: its torch.distributed rank, when the
    process group has exactly the layout's ranks (otherwise part of the layout would silently go unloaded)."""
    if layout.world_size == 1:
        return 0
    pg_rank, pg_world = process_group_rank()
    if pg_world == 1:
        raise LayoutError(f"the layout ({layout}) has {layout.world_size} ranks: pass rank= (0 to "
                          f"{layout.world_size - 1}), or load in each process of a torch.distributed group of that "
                          f"size")
    if pg_world != layout.world_size:
        raise LayoutError(f"the layout ({layout}) has {layout.world_size} ranks but torch.distributed has {pg_world}; "
                          f"pass rank= to load one rank of another layout")
    return pg_rank


def checked_rank(rank: Any) -> int:
    """``rank`` as an int; a float, string or bool is refused in one line (not a TypeError from deep inside)."""
    try:
        if isinstance(rank, bool):
            raise TypeError
        return operator.index(rank)
    except TypeError:
        raise LayoutError(f"rank={rank!r} is not a rank; pass an int") from None


def check_layer_count(rules: Rules, manifest: Manifest) -> None:
    """Refuse rules whose ``num_layers`` is not the version's: the load would silently drop the layers past it,
    or place layers on the wrong pipeline stages."""
    if rules.num_layers is None:
        return
    prefix = rules.model_section + "/"
    found = {i for t in manifest.tensors if t.name.startswith(prefix)
             for i in [rules.layer_index(t.name[len(prefix):])] if i is not None}
    if found and max(found) + 1 != rules.num_layers:
        raise LayoutError(f"the rules say num_layers={rules.num_layers} but this version's model has "
                          f"{max(found) + 1} layers ({rules.layer_prefix}0 to {rules.layer_prefix}{max(found)}); "
                          f"load with rules for the saved model")


def needs_layout_load(manifest: Manifest, layout: ParallelLayout | None, into: Any) -> bool:
    """Whether a load must go through pieces: a sharded version, a target layout, or DTensors to fill.

    A single process that named a layout at save time also stores tensors in
    several pieces (column blocks), which only the piece-wise path assembles.
    """
    return layout is not None or saved_world(manifest) > 1 or _has_dtensor(into) \
        or any(len(t.pieces) > 1 for t in manifest.tensors)


def _has_dtensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return is_dtensor(obj)
    if isinstance(obj, dict):
        return any(_has_dtensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_dtensor(v) for v in obj)
    return False


def template_rank(manifest: Manifest, layout: ParallelLayout, rank: int) -> tuple[int, bool]:
    """The saved rank whose per-rank objects ``rank`` gets, and whether the layout changed."""
    world = saved_world(manifest)
    if world == 1:   # one saved rank: every rank of a larger layout gets its per-rank state
        return 0, layout.world_size > 1
    saved = manifest.layout
    assert saved is not None   # a world of several ranks is a saved layout's
    same = (_or(saved.tp, 1), _or(saved.pp, 1), _or(saved.dp, world), _or(saved.zero, 0)) == \
        (layout.tp, layout.pp, layout.dp, layout.zero) and layout.world_size == world
    return (rank if same else rank % world), not same


def load_layout(store: Store, manifest: Manifest, layout: ParallelLayout | None, rank: int | None,
                into: Any = None, device: Any = None, stats: ReadStats | None = None) -> Any:
    """Build (or fill ``into``) rank ``rank``'s state of ``layout`` from the version ``manifest``.

    ``into`` without a layout is first taken as the unsharded state (the documented load of a sharded
    version into one process). When it is not, and this process is one of a torch.distributed group of as
    many ranks as saved the version under a ParallelLayout, it is taken as this rank's state of that saved
    layout, as DCP reads the layout from the state it fills. Either refusal happens before anything is read
    or changed, so the second try starts from the state the caller gave.
    """
    try:
        return _load_layout(store, manifest, layout, rank, into, device, stats)
    except StateMismatchError as e:
        if layout is not None or into is None or _has_dtensor(into):
            raise
        saved = manifest.layout
        if saved is None or saved.tp is None or saved.world_size == 1:   # one saved rank: unsharded is its own
            raise
        degrees = f"tp={saved.tp}, pp={saved.pp}, dp={saved.dp}, zero={_or(saved.zero, 0)}"
        if process_group_rank()[1] != saved.world_size:
            raise StateMismatchError(f"{e}; `into` is not the unsharded state, and version {manifest.id[:12]} was "
                                     f"saved by {saved.world_size} ranks: to fill one rank's state pass "
                                     f"parallel_layout=ckptrepo.ParallelLayout({degrees}) and its rank=") from None
        ranks_layout = ParallelLayout(_or(saved.tp, 1), _or(saved.pp, 1), _or(saved.dp, 1), _or(saved.zero, 0))
        return _load_layout(store, manifest, ranks_layout, rank, into, device, stats)


def _load_layout(store: Store, manifest: Manifest, layout: ParallelLayout | None, rank: int | None,
                 into: Any, device: Any, stats: ReadStats | None) -> Any:
    world = saved_world(manifest)
    rules = layout.rules if layout is not None and layout.rules is not None else saved_rules(manifest)
    if layout is None:
        # DTensors to fill under torch.distributed: every process is its own rank, so per-rank state
        # comes from the saved rank with its number (or rank % saved world size when that changed)
        pg_world = process_group_rank()[1] if _has_dtensor(into) else 1
        target = ParallelLayout(dp=pg_world, rules=full_rules(rules))
    elif layout.rules is None and rules is not None:
        target = ParallelLayout(layout.tp, layout.pp, layout.dp, layout.zero, rules.for_pp(layout.pp))
    else:
        target = layout
    if layout is not None and layout.rules is not None and rules is not None:
        _warn_fused_changes(layout.rules, saved_rules(manifest), manifest, layout.tp)
    if target.rules is not None:
        check_layer_count(target.rules, manifest)
        target = ParallelLayout(target.tp, target.pp, target.dp, target.zero,
                                with_version_shapes(target.rules, manifest))
    rank = default_rank(target) if rank is None else checked_rank(rank)
    target.coords(rank)   # a rank outside the layout: its one-line error, before the saved trees are indexed
    tmpl, changed = template_rank(manifest, target, rank)
    tree, leaf_names = rank_tree(manifest, tmpl)
    shapes = {t.name: (t.shape, t.dtype) for t in manifest.tensors}
    fresh = into is None
    if fresh:
        # on the target device from the start: the reads are copied there as they come (loading/_device_load.py)
        into = _build(manifest, tree, leaf_names, target, rank, shapes, device=device)
    else:
        _check_arrays(into, ())
    _, records = flatten(into)
    if not fresh:
        if not changed:   # the same ranks: each optimizer's groups as saved (a new pipeline split regroups them)
            _check_optimizers(tree, into, (), manifest.id)
        _check_into_tensors(manifest, tree, leaf_names, target, rank, shapes, records, into)
    # a save with a layout (its degrees recorded) stores per-rank tensors as <path>@rank<r>, a single process's
    # too; a plain version stores them under their path
    per_rank = tmpl if world > 1 or (manifest.layout is not None and manifest.layout.tp is not None) else None
    sharder = Sharder(target, rank, per_rank, gshape_of=lambda n: shapes[n][0] if n in shapes else None)
    sharded = sharder.shard(records)
    if not fresh:
        _check_dtypes(sharded.pieces, shapes)
    # an unsharded load (no layout) takes saved rank 0's, as documented; DTensors under a process group do not
    pg_rank, pg_world = process_group_rank()
    unsharded_elsewhere = layout is None and target.world_size == 1 and pg_rank > 0   # e.g. every torchrun rank
    if changed and (layout is not None or target.world_size > 1 or unsharded_elsewhere):
        moved = sorted((_per_rank_tensor_paths(sharded.leaf_names) | set(per_rank_values(manifest)))
                       & per_rank_paths(manifest, tmpl))
        same = same_on_every_rank(store, manifest, moved)   # reads those tensors: once, not per path
        moved = [p for p in moved if p not in same]
        if moved and unsharded_elsewhere:
            warn(f"this process is rank {pg_rank} of {pg_world}, but a load without a layout gives every "
                 f"process saved rank 0's per-rank state ({_some(moved)}); pass parallel_layout= (or "
                 f"into= a state of DTensors) to get this rank's")
        elif moved:
            warn(f"layout changed ({_layout_str(manifest)} -> {target}): per-rank state "
                 f"{_some(moved)} of rank {rank} comes from saved rank {tmpl}; re-seed it if it must differ "
                 f"per rank")
    skipped, dropped = unloaded_state(manifest, target.world_size)
    if dropped:   # not silent, an unsharded load's either
        many = len(skipped) > 1
        warn(f"saved rank{'s' if many else ''} {', '.join(map(str, skipped))} of {_layout_str(manifest)} "
             f"hold{'' if many else 's'} per-rank state {_some(dropped)} that no rank of {target} "
             f"loads (rank r takes saved rank r % {world}'s); load with the saved layout and rank= to get "
             f"it")
    for i in sharded.partial:          # padding rows and ZeRO tail padding load as zeros
        records[i].tensor.zero_()
    read_pieces_to(store, manifest, sharded.pieces, stats)
    if not fresh:
        _merge_plain(tree, into)
        return into
    return _to_device(into, device) if device is not None else into


def _warn_fused_changes(given: Rules, saved: Rules | None, manifest: Manifest, tp: int) -> None:
    """Warn where the load's rules cut a fused tensor into other parts than the saved rules record: the
    parts say how the global tensor is composed (grouped-query attention's q, k, v sizes), so other parts
    give every rank the wrong slices of the same bytes, without an error (the local shape is the same).
    A tensor fused on one side and not on the other is cut otherwise as soon as either side has several
    tensor-parallel ranks (Fused(3) saved, Split(0) given at tp=2: rank 0 got q and half of k)."""
    if saved is None:
        return
    cut = tp > 1 or (manifest.layout is not None and _or(manifest.layout.tp, 1) > 1)
    prefix = given.model_section + "/"
    changed = []
    for t in manifest.tensors:
        if not t.name.startswith(prefix):
            continue
        param = t.name[len(prefix):]
        mine, theirs = given.spec(param), saved.spec(param)
        if isinstance(mine, Fused) and isinstance(theirs, Fused):
            size = t.shape[theirs.dim]
            try:
                differ = mine.dim != theirs.dim or mine.sizes(size) != theirs.sizes(size)
            except LayoutError:
                differ = True
            if differ:
                changed.append(f"{param} ({theirs.parts} saved, {mine.parts} given)")
        elif cut and isinstance(mine, Fused) != isinstance(theirs, Fused):
            changed.append(f"{param} ({_spec_str(theirs)} saved, {_spec_str(mine)} given)")
    if changed:
        warn(f"the rules cut fused tensors into other parts than the version's rules: "
             f"{', '.join(changed[:3])}{' ...' if len(changed) > 3 else ''}; each rank gets other "
             f"slices than the model that saved them held; load without rules to use the saved ones")


def _spec_str(spec: Any) -> str:
    return f"{type(spec).__name__}({spec.parts})" if isinstance(spec, Fused) else type(spec).__name__


def _some(paths: list[str], shown: int = 4) -> str:
    return ", ".join(paths[:shown]) + (" ..." if len(paths) > shown else "")


def _layout_str(manifest: Manifest) -> str:
    lay = manifest.layout
    if lay is not None and lay.tp is not None:
        return f"tp={lay.tp} pp={lay.pp} dp={lay.dp} zero={_or(lay.zero, 0)}"
    return f"world_size={saved_world(manifest)}"


def _or(value: int | None, default: int) -> int:
    """A saved layout's degree, or ``default`` where the version does not record it."""
    return default if value is None else value


def _check_arrays(obj: Any, path: tuple[Any, ...]) -> None:
    """Refuse a numpy array in a layout load's ``into`` that the load cannot fill in place: read-only (writing
    it crashed the process), strided or of another byte order (it filled a copy and left the array as it was)."""
    if isinstance(obj, np.ndarray):
        if fillable_array(obj) is None:
            raise StateMismatchError(f"{path_str(path)}: the numpy array in `into` cannot be filled in place "
                                     f"(read-only, not C-contiguous or not native byte order); pass a writable "
                                     f"contiguous array (np.array(a)), or load without into=")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _check_arrays(v, path + (k,))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_arrays(v, path + (i,))


def _check_optimizers(node: Any, target: Any, path: tuple[Any, ...], version: str) -> None:
    """``binding.check_param_groups`` for every optimizer in ``into`` where the saved tree has its state."""
    tag = node[0]
    if isinstance(target, torch.optim.Optimizer) and tag in (STATEFUL, DICT, ODICT):
        check_param_groups(node[2] if tag == STATEFUL else node, own_containers(target.state_dict()), path, version)
        return
    if tag == STATEFUL:
        _check_optimizers(node[2], target, path, version)
    elif tag in (DICT, ODICT) and isinstance(target, dict):
        for k, v in node[1]:
            key = unflatten(k, lambda i, n: None)
            if key in target:
                _check_optimizers(v, target[key], path + (key,), version)
    elif tag in (LIST, TUPLE) and isinstance(target, (list, tuple)):
        for i, (v, t) in enumerate(zip(node[1], target)):
            _check_optimizers(v, t, path + (i,), version)


def _stateful_names(obj: Any, path: tuple[Any, ...]) -> list[str]:
    """The flattened names (``flatten``'s) of the modules and optimizers in ``obj``, outermost only."""
    if is_stateful(obj):
        return ["/".join(k if type(k) is str else key_str(k) for k in path)]
    if isinstance(obj, dict):
        return [n for k, v in obj.items() for n in _stateful_names(v, path + (k,))]
    if isinstance(obj, (list, tuple)):
        return [n for i, v in enumerate(obj) for n in _stateful_names(v, path + (i,))]
    return []


def _check_into_tensors(manifest: Manifest, tree: Any, leaf_names: Sequence[str], layout: ParallelLayout,
                        rank: int, shapes: dict[str, tuple[tuple[int, ...], str]], records: list[Any],
                        into: Any) -> None:
    """Refuse an ``into`` whose tensors are not the ones this rank of ``layout`` holds in the version, before
    anything is changed: a tensor of a module or optimizer that the version has and ``into`` lacks was
    silently left out (an optimizer that had not stepped yet kept no moments), and one ``into`` has that the
    version lacks kept its values. A plain dict may leave tensors out: they are not loaded.
    The reference is the state a fresh load would build (its structure only: tensors of no elements)."""
    expected = _build(manifest, tree, leaf_names, layout, rank, shapes, empty=True)
    want = [r.name for r in flatten(expected)[1]]
    have = {r.name for r in records}
    # a plain dict may hold only the tensors a caller wants; a module or optimizer takes its whole state
    owners = _stateful_names(into, ())
    missing = [n for n in want if n not in have and any(n == o or n.startswith(o + "/") or not o for o in owners)]
    extra = sorted(have - set(want))
    vid = manifest.id[:12]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise StateMismatchError(f"{missing[0]}{more}: version {vid} holds it for rank {rank} but `into` has no "
                                 f"tensor there (an optimizer that has not stepped has no state yet); load "
                                 f"without into= and pass the result to load_state_dict, or give `into` that state")
    for r in records:
        if overlapping_elements(r.tensor.to_local() if is_dtensor(r.tensor) else r.tensor):
            raise overlap_error(r.name)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise StateMismatchError(f"{extra[0]}{more}: `into` has a tensor there that version {vid} does not hold "
                                 f"for rank {rank}; remove it, or load the version it belongs to")


def _build(manifest: Manifest, tree: Any, leaf_names: Sequence[str], layout: ParallelLayout, rank: int,
           shapes: dict[str, tuple[tuple[int, ...], str]], empty: bool = False, device: Any = None) -> Any:
    """A fresh state for ``rank`` of ``layout``: the template's structure, parameter sections regenerated.

    ``empty``: the structure only, every tensor without elements (what ``_check_into_tensors`` compares).
    ``device``: where its tensors are made (numpy leaves stay on the host)."""
    def zeros(shape: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(0, dtype=dtype) if empty else torch.zeros(shape, dtype=dtype, device=device)

    rules = layout.rules
    sections = set(rules.all_sections()) if rules is not None else set()
    built: dict[str, Any] = {}

    @functools.cache
    def local_params() -> list[LocalParam]:
        """This rank's parameters in model order, which every parameter section holds."""
        assert rules is not None
        c = layout.coords(rank)
        return rules.local_params(layout.tp, c.tp, layout.pp, c.pp)

    def section(name: str) -> Any:
        if name in built:
            return built[name]
        assert rules is not None
        c = layout.coords(rank)
        params = local_params()
        if (layout.zero == 3 and name == rules.model_section) or (layout.zero and name in rules.optimizer_sections):
            total = sum(volume(shape) for _, _, shape, _, _ in params)
            dtypes = sorted({shapes[n][1] for n in shapes if n.startswith(name + "/")})
            if len(dtypes) > 1 and not empty:   # a flat partition has one dtype: a cast lost precision unsaid
                raise LayoutError(f"{name}: the version's tensors there have dtypes {', '.join(dtypes)}, which no "
                                  f"flat ZeRO partition of one dtype holds; load with zero=0, or into= partitions "
                                  f"you build")
            dtype = dtypes[0] if dtypes else "float32"
            value: Any = zeros(zero_partition(total, layout.dp, c.dp)[2], TORCH_DTYPES[dtype])
        else:
            value = {}
            for local, gparam, shape, _, _ in params:
                stored = shapes.get(f"{name}/{gparam}")
                if stored is not None:
                    value[local] = zeros(shape, TORCH_DTYPES[stored[1]])
            if not value and name == rules.model_section:
                raise LayoutError(f"the version has no tensors under {name}/ for rank {rank} of {layout}; "
                                  f"check the rules' sections and param_shapes")
        built[name] = value
        return value

    def tensor(i: int, numpy: bool) -> torch.Tensor:
        name = leaf_names[i]
        if name not in shapes:
            plain = rank_path(name)
            if plain is None or plain not in shapes:
                raise StateMismatchError(f"{name}: not in the version's tensor table; run `ckptrepo fsck`")
            name = plain
        shape, dtype = shapes[name]
        return torch.empty(0 if empty else shape, dtype=TORCH_DTYPES[dtype], device=None if numpy else device)

    def build(node: Any, path: str) -> Any:
        if path in sections:
            return section(path)
        tag = node[0]
        if tag in (DICT, ODICT):
            out = {}
            for k, v in node[1]:
                key = unflatten(k, lambda i, n: None)
                out[key] = build(v, f"{path}/{key_str(key)}" if path else key_str(key))
            return out
        if tag in (LIST, TUPLE):
            items = [build(v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(node[1])]
            return items if tag == LIST else tuple(items)
        if tag == STATEFUL:
            return build(node[2], path)
        if tag in (TENSOR, NDARRAY):
            t = tensor(node[1], tag == NDARRAY)
            return t.numpy() if tag == NDARRAY else t
        return unflatten(node, lambda i, n: None)

    try:
        return build(tree, "")
    finally:
        build = None  # type: ignore[assignment]  # noqa: F841 - it calls itself through its closure cell: a cycle


def _merge_plain(node: Any, target: Any) -> bool:
    """Set the template's plain values (step counters, seeds, learning rates) into ``target``'s matching dicts
    and lists; returns whether it set any. Tensors were filled in place already.

    A stateful object (module, optimizer) stays where it is: its ``state_dict()`` takes the plain values and
    goes back through ``load_state_dict``, as a load without a layout does (an optimizer's learning rate
    lives only there). A module whose state holds nothing plain is not reloaded: its tensors are its own.
    """
    tag = node[0]
    if is_stateful(target) and tag in (STATEFUL, DICT, ODICT):
        state = own_containers(target.state_dict())
        if _merge_plain(node[2] if tag == STATEFUL else node, state) or not isinstance(target, torch.nn.Module):
            target.load_state_dict(state)
        return False
    if tag == STATEFUL:
        return _merge_plain(node[2], target)
    changed = False
    items: Iterable[tuple[Any, Any]]
    if tag in (DICT, ODICT) and isinstance(target, dict):
        items = ((unflatten(k, lambda i, n: None), v) for k, v in node[1])
    elif tag == LIST and isinstance(target, list) and len(target) == len(node[1]):
        items = enumerate(node[1])
    else:
        return False
    for key, v in items:
        if isinstance(target, dict) and key not in target:
            if not holds_tensors(v):   # a saved plain value `into` lacks is added, as the plain load does
                target[key] = unflatten(v, lambda i, n: None)
                changed = True
            continue
        if v[0] in (TENSOR, NDARRAY):
            continue
        value = target[key]
        if is_stateful(value) or (isinstance(value, (dict, list)) and v[0] in (DICT, ODICT, LIST, STATEFUL)):
            changed |= _merge_plain(v, value)
        elif not isinstance(value, (torch.Tensor, tuple)):
            target[key] = unflatten(v, lambda i, n: None)
            changed = True
    return changed


def _to_device(obj: Any, device: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_device(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_device(v, device) for v in obj)
    return obj


__all__ = ["load_layout", "needs_layout_load", "rank_tree", "saved_rules", "saved_world", "template_rank"]
