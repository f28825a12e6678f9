"""benchmarks/scale.py at 8 ranks: the simulation drives the real save, merge, manifest and load-plan paths, and
what they produce is a version a reader accepts and a plan that reads only what the target rank holds."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ckptrepo.core import intersect, new_version_id, volume
from ckptrepo.core.schema import decode_header, decode_manifest, encode_manifest, table_problem
from ckptrepo.parallel import assign_writers
from ckptrepo.parallel.layout import stage_layers
from ckptrepo.rules import regions

ROOT = Path(__file__).resolve().parents[2]
LAYERS = 16   # divisible by every pipeline degree used here (the benchmark's model has 80)


def _load_scale() -> ModuleType:
    """The script as a module, without putting benchmarks/ on sys.path (its other scripts' names would shadow)."""
    spec = importlib.util.spec_from_file_location("ckptrepo_scale_benchmark", ROOT / "benchmarks" / "scale.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


scale = _load_scale()


def _version(degrees: tuple[int, int, int]) -> tuple[Any, list[Any], Any, str]:
    """(layout, each rank's input, the merged manifest, its id) of 8 ranks under ``degrees``."""
    layout = scale.source_layout(8, LAYERS, degrees)
    shaped = scale.llama_rules(LAYERS, with_shapes=True)
    vid = new_version_id()
    inputs = [scale.rank_input(layout, r, shaped) for r in range(layout.world_size)]
    writes = assign_writers([i.meta for i in inputs])
    parts = [scale.rank_part(layout, vid, i, w) for i, w in zip(inputs, writes)]
    return layout, inputs, scale.merge(parts, layout, vid), vid


@pytest.mark.parametrize("degrees", [(8, 1, 1), (2, 2, 2)], ids=["tp8", "tp2-pp2-dp2-zero1"])
def test_the_merged_manifest_covers_every_tensor_once_and_reads_back(degrees: tuple[int, int, int]) -> None:
    layout, inputs, manifest, vid = _version(degrees)
    shapes = scale.param_shapes(LAYERS)
    want = {f"{section}/{name}": shape for section in ("model", *scale.OPTIMIZER) for name, shape in shapes.items()}
    assert {t.name: t.shape for t in manifest.tensors} == want
    for t in manifest.tensors:
        assert t.dtype == ("bfloat16" if t.name.startswith("model/") else "float32"), t.name
        assert sum(volume(p.box[1]) for p in t.pieces) == volume(t.shape), t.name
    assert table_problem(manifest) is None
    # every array is a rank's own, named as the planner names them, and every rank wrote some
    ranks = {a.split("/")[2] for a in manifest.arrays}
    assert all(a.startswith(f"data/{vid}/") and a.rsplit("/", 1)[1] in ("bfloat16", "float32")
               for a in manifest.arrays)
    assert ranks == {str(r) for r in range(layout.world_size)}
    # replicas (norms over tensor-parallel ranks, the model over data-parallel ranks) are written once
    held = sum(len(i.pieces) for i in inputs)
    written = sum(len(t.pieces) for t in manifest.tensors)
    assert written < held
    blob = encode_manifest(manifest)
    assert decode_header(blob, vid).step == scale.STEP
    back = decode_manifest(blob, vid)
    assert back.tensors == manifest.tensors and back.layout == manifest.layout


@pytest.mark.parametrize("degrees", [(8, 1, 1), (2, 2, 2)], ids=["tp8", "tp2-pp2-dp2-zero1"])
def test_a_rank_s_load_plan_reads_only_its_own_boxes(degrees: tuple[int, int, int]) -> None:
    layout, _, manifest, vid = _version(degrees)
    decoded = decode_manifest(encode_manifest(manifest), vid)
    target = scale.target_layout(layout)
    rank = target.rank_of(tp=1, pp=3, dp=target.dp - 1)
    plan = scale.load_plan(decoded, target, rank)
    c = target.coords(rank)
    stage = stage_layers(LAYERS, target.pp, c.pp)
    rules = scale.llama_rules(LAYERS)
    shapes = scale.param_shapes(LAYERS)
    names = {p.name for p in plan.pieces}
    # this stage's layers, and nothing else (no embedding or head: stage 3 is neither first nor last)
    assert {n.split("/")[-1].split(".")[1] for n in names} == {str(i) for i in stage}
    assert {n.rsplit("/", 1)[0] for n in names} == {"model", *scale.OPTIMIZER}
    for p in plan.pieces:
        if p.name.startswith("model/"):   # its tensor-parallel slice of the parameter, exactly
            param = p.name[len("model/"):]
            assert [(g, s) for _, g, s in regions(rules.spec(param), shapes[param], target.tp, c.tp)] == [p.box]
    saved = {t.name: set(t.pieces) for t in decoded.tensors}
    for span in plan.spans:
        for target_piece, sbox, part, *_ in span.jobs:
            assert part == intersect(sbox, target_piece.box)   # only what both hold
            assert any(sp.box == sbox and sp.array == span.array for sp in saved[target_piece.name])
    assert plan.stats.needed_bytes == sum(volume(p.box[1]) * p.view.element_size() for p in plan.pieces)
    assert plan.stats.requested_bytes == plan.stats.needed_bytes
    assert sum(len(r.reads) for r in plan.runs) == len(plan.spans)


def test_the_plan_cache_check_tells_a_changed_plan_from_the_same_one() -> None:
    layout = scale.source_layout(8, LAYERS, (2, 2, 2))
    shaped = scale.llama_rules(LAYERS, with_shapes=True)
    a, again = (scale.rank_input(layout, 0, shaped) for _ in range(2))
    other = scale.rank_input(scale.source_layout(8, LAYERS, (2, 4, 1)), 0, shaped)
    assert scale.plan_fingerprint(a.meta) == scale.plan_fingerprint(again.meta)
    assert scale.plan_fingerprint(a.meta) != scale.plan_fingerprint(other.meta)


def test_measure_and_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    figures = scale.measure(8, repeat=1, layers=LAYERS)
    assert figures["header_step"] == scale.STEP
    assert figures["pieces_written"] < figures["pieces_total"]   # the replicated norms are written once
    assert 0 < figures["load_plan_needed_bytes"] == figures["load_plan_requested_bytes"]
    assert figures["layout_bytes"] < figures["manifest_bytes"]
    scale.print_table({"repeat": 1, "results": [figures]})
    out = capsys.readouterr().out
    assert out.count("\n| ") == len(scale.ROWS) + 3 and "`assign_writers`" in out and "8 ranks" in out
