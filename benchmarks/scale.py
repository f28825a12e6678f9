"""Beyond one machine: the metadata paths whose cost grows with the rank count, simulated to 1,024 ranks.

Real multi-rank runs are bounded by the machine, so this drives the real code paths with synthetic
inputs: a Llama-70B-like state (80 decoder layers, hidden 8192, 64 heads and 8 KV heads, FFN 28672,
vocabulary 128256; bf16 parameters, fp32 Adam moments, ZeRO-1 over data-parallel ranks) under
TP=8 (8 ranks), TP=8 PP=8 (64), TP=8 PP=8 DP=4 (256) and TP=8 PP=8 DP=16 (1,024). No process group,
no storage, no tensor memory: every tensor is one element expanded to its shape (stride 0), which the
Sharder cuts like any other, and the load side builds its state on the meta device.

Per rank count it measures, each the median CPU time of ``--repeat`` runs:

1. ``assign_writers`` over every rank's piece metadata (every rank runs it at every snapshot), and the
   bytes of the ``all_gather_object`` payload a rank receives (the pickled metadata of every rank);
2. the plan-cache check: xxh3-128 of one rank's own pickled piece metadata;
3. rank 0's merge: ``check_replicas`` and ``merge_rank_manifests`` of every rank's ``RankPart``, built as
   the commit builds it, and the decoding of the staged parts rank 0 reads first, both with the collector
   paused as the commit runs them (and, for comparison, both with it on);
4. the manifest: its encoded size, ``decode_header`` (what ``log`` reads) and ``decode_manifest`` (with the
   collector paused, as ``load`` runs it);
5. one rank's load plan into TP=4 PP=16 (the same DP) from that manifest: the steps of
   ``loading/_layout_load.py`` up to its reads, the read spans of ``loading/_reshard.py`` and their runs.

    python benchmarks/scale.py [--ranks 8,64,256,1024] [--repeat 3] [--json out.json]

``--ranks`` also takes 4096 (TP=8 PP=8 DP=64), which shows where the growth goes next.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import math
import pickle
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import msgpack
import torch
import xxhash

from ckptrepo.core import Moments, check_coverage, collection_paused, new_version_id, volume
from ckptrepo.core.schema import (
    Manifest,
    Piece,
    RankPart,
    decode_header,
    decode_manifest,
    decode_rank_part,
    encode_manifest,
    encode_rank_part,
)
from ckptrepo.loading import _layout_load as layout_load
from ckptrepo.loading._engine import ReadStats, _coalesce
from ckptrepo.loading._reshard import _plan
from ckptrepo.parallel import Piece as LocalPiece
from ckptrepo.parallel import (
    ShardedState,
    Sharder,
    assign_writers,
    check_replicas,
    column_blocks,
    fingerprints,
    merge_rank_manifests,
)
from ckptrepo.parallel.layout import ParallelLayout, zero_partition
from ckptrepo.rules import Replicated, Rules, Split, VocabSplit
from ckptrepo.saving._commit import version_header
from ckptrepo.saving._content_hash import hasher_digest
from ckptrepo.saving._writer import make_plan
from ckptrepo.state import TensorRecord, flatten
from ckptrepo.storage import SHARD_BYTES, ArrayInfo

LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 80, 8192, 64, 8, 28672, 128256
KV = HIDDEN // HEADS * KV_HEADS   # 1024: the width of k and v under grouped-query attention
OPTIMIZER = ("optimizer/exp_avg", "optimizer/exp_avg_sq")
# ranks -> (tp, pp, dp); 4,096 (DP=64) on request only: it takes minutes and gigabytes
DEGREES = {8: (8, 1, 1), 64: (8, 8, 1), 256: (8, 8, 4), 1024: (8, 8, 16), 4096: (8, 8, 64)}
TARGET_TP, TARGET_PP = 4, 16
STEP = 1000


def param_shapes(layers: int = LAYERS) -> dict[str, tuple[int, ...]]:
    """Every parameter's global name and shape, in model order (Hugging Face Llama names)."""
    out: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"layers.{i}."
        out.update({p + "input_layernorm.weight": (HIDDEN,),
                    p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN), p + "self_attn.k_proj.weight": (KV, HIDDEN),
                    p + "self_attn.v_proj.weight": (KV, HIDDEN), p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                    p + "post_attention_layernorm.weight": (HIDDEN,),
                    p + "mlp.gate_proj.weight": (FFN, HIDDEN), p + "mlp.up_proj.weight": (FFN, HIDDEN),
                    p + "mlp.down_proj.weight": (HIDDEN, FFN)})
    out.update({"norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)})
    return out


def llama_rules(layers: int = LAYERS, with_shapes: bool = False) -> Rules:
    """Megatron-style splits of the Llama names: q/k/v and gate/up column parallel, o and down row parallel,
    the vocabulary split with its padding; embeddings on the first stage, the final norm and head on the last.
    ``with_shapes``: with ``param_shapes``, which a ZeRO-1 save does not need (the simulation builds each
    rank's state from them)."""
    vocab = VocabSplit(VOCAB)
    return Rules(params=[("embed_tokens.weight", vocab), ("lm_head.weight", vocab),
                         ("*.self_attn.[qkv]_proj.weight", Split(0)), ("*.self_attn.o_proj.weight", Split(1)),
                         ("*.mlp.gate_proj.weight", Split(0)), ("*.mlp.up_proj.weight", Split(0)),
                         ("*.mlp.down_proj.weight", Split(1)), ("*layernorm.weight", Replicated()),
                         ("norm.weight", Replicated())],
                 sections=("model",), optimizer_sections=OPTIMIZER, layer_prefix="layers.", num_layers=layers,
                 first_stage=("embed_tokens.*",), last_stage=("norm.*", "lm_head.*"),
                 param_shapes=param_shapes(layers) if with_shapes else None)


def source_layout(ranks: int, layers: int = LAYERS, degrees: tuple[int, int, int] | None = None) -> ParallelLayout:
    """The saving layout of ``ranks`` ranks (``DEGREES``, or ``degrees``: tp, pp, dp), ZeRO-1 where there is data
    parallelism."""
    tp, pp, dp = degrees or DEGREES[ranks]
    return ParallelLayout(tp=tp, pp=pp, dp=dp, zero=1 if dp > 1 else 0, rules=llama_rules(layers))


def target_layout(source: ParallelLayout) -> ParallelLayout:
    """The layout a load plans for: TP=4 PP=16 with the source's data parallelism, the version's rules."""
    return ParallelLayout(tp=TARGET_TP, pp=TARGET_PP, dp=source.dp, zero=source.zero)


def _no_memory(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` that holds one element: views of it cut like views of a real tensor."""
    return torch.zeros((), dtype=dtype).expand(*shape)   # zeros: replicas fingerprint alike


def rank_state(layout: ParallelLayout, rank: int, shaped: Rules) -> dict[str, Any]:
    """Rank ``rank``'s training state under ``layout``: its stage's parameters, its tensor-parallel slices,
    the Adam moments per parameter or (ZeRO-1) as this data-parallel rank's flat partitions."""
    c = layout.coords(rank)
    params = shaped.local_params(layout.tp, c.tp, layout.pp, c.pp)
    model = {local: _no_memory(shape, torch.bfloat16) for local, _, shape, _, _ in params}
    if layout.zero:
        size = zero_partition(sum(volume(shape) for _, _, shape, _, _ in params), layout.dp, c.dp)[2]
        moments: dict[str, Any] = {s.split("/")[1]: _no_memory((size,), torch.float32) for s in OPTIMIZER}
    else:
        moments = {s.split("/")[1]: {local: _no_memory(shape, torch.float32) for local, _, shape, _, _ in params}
                   for s in OPTIMIZER}
    return {"model": model, "optimizer": {**moments, "step": STEP}}


@dataclass
class RankInput:
    """One rank's side of a snapshot: its skeleton, its pieces (as ``Sharding.local_pieces`` cuts them) and
    the metadata it sends in the snapshot's collective."""

    rank: int
    skeleton: Any
    records: list[TensorRecord]
    sharded: ShardedState
    pieces: list[LocalPiece]
    meta: list[tuple[str, Any, int]] = field(default_factory=list)


def rank_input(layout: ParallelLayout, rank: int, shaped: Rules) -> RankInput:
    skeleton, records = flatten(rank_state(layout, rank, shaped))
    sharded = Sharder(layout, rank, rank).shard(records)
    pieces = column_blocks(sharded.pieces)
    meta = [(p.name, p.box, volume(p.box[1]) * p.view.element_size()) for p in pieces]   # Sharding.shard's
    return RankInput(rank, skeleton, records, sharded, pieces, meta)


def gathered(vid: str, inputs: Sequence[RankInput]) -> list[tuple[str, list[Any]]]:
    """What ``all_gather_object`` hands every rank: each rank's (proposed version id, piece metadata)."""
    return [(vid, inp.meta) for inp in inputs]


def payload_bytes(objs: Sequence[Any]) -> tuple[int, int]:
    """(sum, largest) of the pickled objects: a rank receives the sum; ``all_gather_object`` pads each rank's
    to the largest, so the wire carries ranks x largest."""
    sizes = [len(pickle.dumps(o)) for o in objs]
    return sum(sizes), max(sizes)


def plan_fingerprint(meta: Sequence[tuple[str, Any, int]]) -> bytes:
    """The plan-cache check: one rank's own piece metadata hashed (xxh3-128 of its pickle)."""
    return xxhash.xxh3_128(pickle.dumps(meta)).digest()


def rank_part(layout: ParallelLayout, vid: str, inp: RankInput, writes: Sequence[bool]) -> RankPart:
    """The rank's ``RankPart`` as ``Sharding.shard`` and ``Committer._commit_sharded`` build it: the pieces it
    writes, placed in its arrays ``data/<vid>/<rank>/<dtype>`` by the writer's plan, with a content digest
    and moments each, and fingerprints of its replicated pieces."""
    mine = [p for p, w in zip(inp.pieces, writes) if w]
    names: dict[str, list[Any]] = {}
    for p in inp.pieces:
        names.setdefault(p.name, [p.name, p.dtype, list(p.gshape)])
    for rec, name, gshape in zip(inp.records, inp.sharded.leaf_names, inp.sharded.gshapes):
        if rec.numel == 0 and gshape is not None:
            names.setdefault(name, [name, rec.dtype, list(gshape)])
    written = [TensorRecord(p.name, p.view, p.dtype, p.box[1]) for p in mine]
    plan = make_plan(written, SHARD_BYTES)
    by_dtype = {d: ArrayInfo(f"data/{vid}/{inp.rank}/{d}", d, n, s, i,
                           digest=xxhash.xxh3_64_intdigest(f"{vid}/{inp.rank}/{d}".encode()))
              for d, (n, s, i) in plan.streams.items()}
    tensors, moments = [], []
    for p, place in zip(mine, plan.placements):
        if not place.numel:
            continue
        digest = hasher_digest(xxhash.xxh3_128(repr((p.name, p.box)).encode()))
        tensors.append((p.name, (Piece((tuple(p.box[0]), tuple(p.box[1])), by_dtype[place.dtype].key, place.offset,
                                       digest),)))
        m = Moments()
        m.add(place.numel, 0.0, 0.02 * math.sqrt(place.numel), -0.1, 0.1)
        moments.append((p.name, m.to_raw()))
    replicas = [(p.name, p.box, p.view, p.replicated) for p in inp.sharded.pieces if p.replicated]
    return RankPart(rank=inp.rank, step=STEP, tree=inp.skeleton, leaf_names=tuple(inp.sharded.leaf_names),
                    names=tuple((n, d, tuple(s)) for n, d, s in names.values()),
                    coords=vars(layout.coords(inp.rank)), tensors=tuple(tensors),
                    arrays={a.key: a for a in by_dtype.values()},   # arrays_listed's: by key
                    fingerprints=tuple(fingerprints(replicas)), moments=tuple(moments))


def merge(parts: Sequence[RankPart], layout: ParallelLayout, vid: str) -> Manifest:
    """Rank 0's merge, as ``Committer._publish_merged`` runs it (with the collector paused): replicas checked,
    parts merged."""
    check_replicas(parts)
    header = version_header(vid, None, STEP, "scale simulation", {"loss": 1.5})
    return merge_rank_manifests(parts, layout, layout.world_size, header)


def _on_host(obj: Any) -> Any:
    """A built state with its meta tensors made host tensors of one element (``flatten`` refuses meta)."""
    if isinstance(obj, torch.Tensor):
        return _no_memory(obj.shape, obj.dtype)
    if isinstance(obj, dict):
        return {k: _on_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_host(v) for v in obj)
    return obj


@dataclass
class LoadPlan:
    """One rank's load plan: its target pieces, the read spans of saved pieces and their runs."""

    target: ParallelLayout
    rank: int
    pieces: list[LocalPiece]
    spans: list[Any]
    runs: list[Any]
    stats: ReadStats


def load_plan(manifest: Manifest, layout: ParallelLayout, rank: int) -> LoadPlan:
    """What ``load(version, parallel_layout=layout, rank=rank)`` decides before it reads: the steps of
    ``_load_layout`` (rules, template rank, the built state, its pieces, the per-rank state checks), then the
    read spans ``VersionReader.read`` plans and the runs the engine coalesces them into. The state is built
    on the meta device instead of in memory; nothing is read."""
    rules = layout.rules if layout.rules is not None else layout_load.saved_rules(manifest)
    assert rules is not None
    target = ParallelLayout(layout.tp, layout.pp, layout.dp, layout.zero, rules.for_pp(layout.pp))
    assert target.rules is not None
    layout_load.check_layer_count(target.rules, manifest)
    target = ParallelLayout(target.tp, target.pp, target.dp, target.zero,
                            layout_load.with_version_shapes(target.rules, manifest))
    target.coords(rank)
    tmpl, changed = layout_load.template_rank(manifest, target, rank)
    tree, leaf_names = layout_load.rank_tree(manifest, tmpl)
    shapes = {t.name: (t.shape, t.dtype) for t in manifest.tensors}
    built = layout_load._build(manifest, tree, leaf_names, target, rank, shapes, device="meta")
    _, records = flatten(_on_host(built))
    sharder = Sharder(target, rank, tmpl, gshape_of=lambda n: shapes[n][0] if n in shapes else None)
    sharded = sharder.shard(records)
    if changed:
        moved = sorted((layout_load._per_rank_tensor_paths(sharded.leaf_names)
                        | set(layout_load.per_rank_values(manifest))) & layout_load.per_rank_paths(manifest, tmpl))
        if moved:   # same_on_every_rank would read them: this state has none
            raise RuntimeError(f"per-rank state {moved[:3]} would be read to compare; the simulation has none")
    layout_load.unloaded_state(manifest, target.world_size)
    stats = ReadStats()
    spans = _plan(sharded.pieces, {t.name: t.pieces for t in manifest.tensors}, manifest.arrays, stats)
    return LoadPlan(target, rank, sharded.pieces, spans, _coalesce(spans, manifest.arrays), stats)


@dataclass
class Timing:
    """Median CPU and wall seconds of a call repeated, and its last result. CPU seconds are the figure: the
    machine is shared, and these paths run on one thread."""

    cpu: float
    wall: float
    result: Any = None


def timed(fn: Callable[[], Any], repeat: int, paused: bool = False) -> Timing:
    """``fn`` run ``repeat`` times; ``paused``: with the cyclic collector paused, as ``load`` runs its decode
    and plan and rank 0 its decoding and merge of the parts (core/_gcpause.py)."""
    cpus, walls, out = [], [], None
    for _ in range(repeat):
        out = None   # the last result is freed before the next run, as a process that repeats the call frees it
        with collection_paused() if paused else contextlib.nullcontext():
            c, w = time.process_time(), time.perf_counter()
            out = fn()
            cpus.append(time.process_time() - c)
            walls.append(time.perf_counter() - w)
    return Timing(statistics.median(cpus), statistics.median(walls), out)


def measure(ranks: int, repeat: int = 3, layers: int = LAYERS, load_rank: int = 0,
            degrees: tuple[int, int, int] | None = None) -> dict[str, Any]:
    """Every figure of one rank count (see the module docstring); ``layers`` shrinks the model for a test.

    Rank 0's steps are timed once the simulation's per-rank inputs are freed, with the collector on or
    paused as on the commit thread: a process holding every rank's pieces would make each full collection
    walk them."""
    layout = source_layout(ranks, layers, degrees)
    vid = new_version_id()
    figures, parts = every_rank(layout, vid, repeat, llama_rules(layers, with_shapes=True))
    figures["load_rank"] = load_rank
    staged = [encode_rank_part(p) for p in parts]
    gc.collect()
    figures.update(rank0(parts, staged, layout, vid, repeat, load_rank))
    return figures


def every_rank(layout: ParallelLayout, vid: str, repeat: int, shaped: Rules) -> tuple[dict[str, Any], list[RankPart]]:
    """Each rank's side of a snapshot: its pieces, the collective's payload, the writer assignment every rank
    computes, the plan-cache check, and the ``RankPart`` each rank stages."""
    t0 = time.perf_counter()
    inputs = [rank_input(layout, r, shaped) for r in range(layout.world_size)]
    setup_sharding = time.perf_counter() - t0
    one = inputs[0]
    own = timed(lambda: column_blocks(Sharder(layout, 0, 0).shard(one.records).pieces), repeat)
    objs = gathered(vid, inputs)
    metas = [m for _, m in objs]
    assign = timed(lambda: assign_writers(metas), repeat)
    received, largest = payload_bytes(objs)
    check = timed(lambda: plan_fingerprint(one.meta), max(repeat, 5))
    t0 = time.perf_counter()
    parts = [rank_part(layout, vid, inp, w) for inp, w in zip(inputs, assign.result)]
    setup_parts = time.perf_counter() - t0
    return {
        "ranks": layout.world_size, "layout": str(layout), "target": str(target_layout(layout)),
        "pieces_per_rank": statistics.median(len(i.pieces) for i in inputs),
        "pieces_total": sum(len(i.pieces) for i in inputs),
        "pieces_written": sum(len(ps) for p in parts for _, ps in p.tensors),
        "setup_s": {"sharding": setup_sharding, "rank_parts": setup_parts},
        "own_pieces_s": own.cpu, "assign_writers_s": assign.cpu, "assign_writers_wall_s": assign.wall,
        "gather_received_bytes": received, "gather_largest_bytes": largest,
        "plan_check_s": check.cpu, "plan_check_meta_bytes": len(pickle.dumps(one.meta)),
    }, parts


def decode_parts(staged: Sequence[bytes]) -> list[RankPart]:
    """The staged parts as rank 0 decodes them (``Staging.gather_ranks``, which pauses the collector)."""
    out = []
    for blob in staged:
        part = decode_rank_part(blob, "rank part")
        assert isinstance(part, RankPart), part
        out.append(part)
    return out


def rank0(parts: list[RankPart], staged: list[bytes], layout: ParallelLayout, vid: str, repeat: int,
          load_rank: int) -> dict[str, Any]:
    """Rank 0's merge and the manifest's figures, then one rank's load plan from the manifest."""
    decoded_parts = timed(lambda: decode_parts(staged), repeat, paused=True)
    merged = timed(lambda: merge(parts, layout, vid), repeat, paused=True)
    collecting = timed(lambda: merge(decode_parts(staged), layout, vid), repeat)
    manifest = merged.result
    coverage = {t.name: (t.shape, [p.box for p in t.pieces]) for t in manifest.tensors}
    cover = timed(lambda: check_coverage(coverage), repeat, paused=True)
    encode = timed(lambda: encode_manifest(manifest), repeat)
    blob = encode.result
    header = timed(lambda: decode_header(blob, vid), max(repeat, 5))
    decoded = timed(lambda: decode_manifest(blob, vid), repeat, paused=True)
    plan = timed(lambda: load_plan(decoded.result, target_layout(layout), load_rank), repeat, paused=True)
    lay = manifest.layout
    assert lay is not None
    trees = {msgpack.packb([r.tree, r.leaf_names]) for r in lay.ranks}
    return {
        "tensors": len(manifest.tensors), "arrays": len(manifest.arrays),
        "most_pieces_of_a_tensor": max(len(t.pieces) for t in manifest.tensors),
        "staged_parts_bytes": sum(len(b) for b in staged), "decode_parts_s": decoded_parts.cpu,
        "merge_s": merged.cpu, "merge_wall_s": merged.wall, "check_coverage_s": cover.cpu,
        "decode_and_merge_collecting_s": collecting.cpu,
        "manifest_bytes": len(blob), "layout_bytes": len(msgpack.packb(lay.to_raw())),
        "unique_rank_trees": len(trees), "unique_rank_trees_bytes": sum(map(len, trees)),
        "encode_s": encode.cpu, "decode_header_s": header.cpu, "header_step": header.result.step,
        "decode_manifest_s": decoded.cpu, "load_plan_s": plan.cpu, "load_plan_wall_s": plan.wall,
        "load_plan_pieces": len(plan.result.pieces), "load_plan_spans": len(plan.result.spans),
        "load_plan_runs": len(plan.result.runs), "load_plan_needed_bytes": plan.result.stats.needed_bytes,
        "load_plan_requested_bytes": plan.result.stats.requested_bytes,
    }


def exponents(points: Sequence[tuple[int, float]]) -> list[float]:
    """The order of growth between consecutive (ranks, figure) points: log(f2/f1) / log(n2/n1)."""
    out = []
    for (n1, f1), (n2, f2) in zip(points, points[1:]):
        out.append(math.log(f2 / f1) / math.log(n2 / n1) if f1 > 0 and f2 > 0 else math.nan)
    return out


def _ms(v: float) -> str:
    return f"{v * 1e3:,.2f} ms" if v < 0.01 else f"{v * 1e3:,.0f} ms"


def _mib(v: float) -> str:
    return f"{v / 2**20:,.2f} MiB"


def _count(v: float) -> str:
    return f"{v:,.0f}"


ROWS: list[tuple[str, str, Callable[[float], str]]] = [
    ("pieces per rank (median)", "pieces_per_rank", _count),
    ("one rank's pieces: `Sharder` + `column_blocks`", "own_pieces_s", _ms),
    ("pieces written (in the manifest)", "pieces_written", _count),
    ("most pieces of one tensor", "most_pieces_of_a_tensor", _count),
    ("1. `assign_writers` over every rank's metadata", "assign_writers_s", _ms),
    ("1. `all_gather_object` payload a rank receives", "gather_received_bytes", _mib),
    ("2. plan-cache check: xxh3-128 of a rank's own metadata", "plan_check_s", _ms),
    ("3. rank 0 decodes the staged parts (collector paused)", "decode_parts_s", _ms),
    ("3. rank 0 merge: `check_replicas` + `merge_rank_manifests` (paused)", "merge_s", _ms),
    ("3. ... of which `check_coverage`", "check_coverage_s", _ms),
    ("3. decode + merge with the collector on", "decode_and_merge_collecting_s", _ms),
    ("4. manifest size", "manifest_bytes", _mib),
    ("4. ... of which the layout (every rank's tree)", "layout_bytes", _mib),
    ("4. `encode_manifest`", "encode_s", _ms),
    ("4. `decode_header` (what `log` reads)", "decode_header_s", _ms),
    ("4. `decode_manifest` (collector paused, as `load`)", "decode_manifest_s", _ms),
    ("5. one rank's load plan into TP=4 PP=16", "load_plan_s", _ms),
    ("5. ... its read spans / runs", "load_plan_spans", _count),
]


def print_table(summary: dict[str, Any]) -> None:
    """The figures as a markdown table, one column per rank count; growth: the exponents between columns."""
    results = summary["results"]
    counts = [r["ranks"] for r in results]
    print(f"CPU seconds, median of {summary['repeat']}; growth: log(b/a) / log(ranks b / ranks a) between columns")
    print()
    print("| | " + " | ".join(f"{n:,} ranks" for n in counts) + " | growth |")
    print("| --- | " + " | ".join("---:" for _ in results) + " | --- |")
    print("| layout | " + " | ".join(r["layout"] for r in results) + " | |")
    for label, key, fmt in ROWS:
        vals = [r[key] for r in results]
        cells = [fmt(v) for v in vals]
        if key == "load_plan_spans":
            cells = [f"{r['load_plan_spans']:,} / {r['load_plan_runs']:,}" for r in results]
        growth = " / ".join("-" if math.isnan(e) else f"{e:.2f}" for e in exponents(list(zip(counts, vals))))
        print(f"| {label} | " + " | ".join(cells) + f" | {growth} |")
    print()
    for r in results:
        print(f"- {r['ranks']:,} ranks: {r['tensors']:,} tensors, {r['arrays']:,} arrays; "
              f"{r['unique_rank_trees']} distinct rank trees ({r['unique_rank_trees_bytes'] / 2**10:,.0f} KiB); "
              f"staged parts {r['staged_parts_bytes'] / 2**20:,.1f} MiB; all_gather_object pads every rank's "
              f"metadata to the largest ({r['gather_largest_bytes'] / 2**10:,.0f} KiB); rank {r['load_rank']} of "
              f"{r['target']} needs {r['load_plan_pieces']} pieces, "
              f"{r['load_plan_needed_bytes'] / 2**30:,.2f} GiB (reads "
              f"{r['load_plan_requested_bytes'] / 2**30:,.2f} GiB); walls: merge {r['merge_wall_s']:.2f} s, "
              f"load plan {r['load_plan_wall_s']:.3f} s; setup, untimed: {r['setup_s']['sharding']:.0f} s "
              f"sharding, {r['setup_s']['rank_parts']:.0f} s rank parts")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="8,64,256,1024",
                    help="comma-separated rank counts, of 8, 64, 256, 1024 and 4096")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per figure (the median is shown)")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.ranks.split(",") if x]
    unknown = [n for n in counts if n not in DEGREES]
    if unknown:
        ap.error(f"rank counts {unknown}: choose among {sorted(DEGREES)}")
    results = []
    for n in counts:
        t = time.perf_counter()
        results.append(measure(n, args.repeat))
        print(f"{n} ranks measured in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    from bench_common import report  # run as a script from benchmarks/
    return report({"repeat": args.repeat, "results": results}, print_table, args.json)


if __name__ == "__main__":
    sys.exit(main())
