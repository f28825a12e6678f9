"""Sharding rules (``ckptrepo.rules``): shapes, regions and errors of Split, VocabSplit, Fused and Replicated.

A version is stored under global shapes and loaded under any tensor-parallel degree, so for every spec and
``tp`` in 1..4: ``global_shape(local_shape(g)) == g``; the regions of all ranks tile the (unpadded) global
tensor exactly once; and placing each rank's regions into a local tensor gives exactly the shard Megatron
would hold, built here independently with ``torch.chunk`` (padding rows of a vocabulary split are zeros).
Specs that cannot describe a tensor are refused with a LayoutError naming the tensor.
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptrepo import LayoutError
from ckptrepo.rules import (
    Fused,
    Replicated,
    Rules,
    Spec,
    Split,
    VocabSplit,
    global_shape,
    local_shape,
    megatron_gpt,
    regions,
)

TPS = (1, 2, 3, 4)
FAST = settings(max_examples=60, deadline=None)


def reference_shard(spec: Spec, g: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """What rank ``rank`` of ``tp`` holds of global tensor ``g`` under ``spec``, computed the Megatron way."""
    if isinstance(spec, Replicated):
        return g.clone()
    d = spec.dim % g.dim()
    if isinstance(spec, Split):
        return torch.chunk(g, tp, dim=d)[rank].clone() if g.shape[d] else g.clone()
    if isinstance(spec, VocabSplit):
        pad_shape = list(g.shape)
        pad_shape[d] = spec.padded(tp) - g.shape[d]
        padded = torch.cat([g, torch.zeros(pad_shape, dtype=g.dtype)], dim=d)
        return torch.chunk(padded, tp, dim=d)[rank].clone()
    parts = torch.split(g, list(spec.sizes(g.shape[d])), dim=d)
    return torch.cat([torch.chunk(p, tp, dim=d)[rank] for p in parts], dim=d)


def assemble(spec: Spec, g: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s local tensor built only from ``regions``: zeros, then each global box copied to its local box."""
    local = torch.zeros(local_shape(spec, tuple(g.shape), tp), dtype=g.dtype)
    for loff, goff, sizes in regions(spec, tuple(g.shape), tp, rank):
        assert all(o + s <= n for o, s, n in zip(loff, sizes, local.shape)), "local box outside the local tensor"
        local[tuple(slice(o, o + s) for o, s in zip(loff, sizes))] = \
            g[tuple(slice(o, o + s) for o, s in zip(goff, sizes))]
    return local


def coverage(spec: Spec, gshape: tuple[int, ...], tp: int) -> torch.Tensor:
    """How many ranks' regions hold each element of the global tensor."""
    count = torch.zeros(gshape, dtype=torch.int64)
    for rank in range(tp):
        for _, goff, sizes in regions(spec, gshape, tp, rank):
            count[tuple(slice(o, o + s) for o, s in zip(goff, sizes))] += 1
    return count


def check_spec(spec: Spec, gshape: tuple[int, ...], tp: int) -> None:
    """Round trip of shapes, exact-once coverage (every rank's whole copy for Replicated), Megatron's shards."""
    local = local_shape(spec, gshape, tp)
    assert global_shape(spec, local, tp) == gshape
    g = torch.arange(1, 1 + torch.Size(gshape).numel(), dtype=torch.int64).reshape(gshape)
    count = coverage(spec, gshape, tp)
    assert torch.equal(count, torch.full(gshape, tp if isinstance(spec, Replicated) else 1, dtype=torch.int64))
    for rank in range(tp):
        assert torch.equal(assemble(spec, g, tp, rank), reference_shard(spec, g, tp, rank)), f"rank {rank}"


# ---- Split ------------------------------------------------------------------------

@FAST
@given(st.sampled_from(TPS), st.lists(st.integers(1, 4), min_size=1, max_size=3), st.data())
def test_split_round_trips_and_tiles(tp: int, dims: list[int], data: st.DataObject) -> None:
    """Split along any dimension (negative too) whose size is a multiple of tp."""
    d = data.draw(st.integers(-len(dims), len(dims) - 1))
    dims[d] *= tp
    check_spec(Split(d), tuple(dims), tp)


def test_split_exact_shapes() -> None:
    """Column- and row-parallel shapes of a (6, 8) weight over tp=2 and 4, and the regions of rank 1."""
    assert local_shape(Split(0), (6, 8), 2) == (3, 8) and local_shape(Split(1), (6, 8), 4) == (6, 2)
    assert global_shape(Split(1), (6, 2), 4) == (6, 8) and local_shape(Split(-1), (6, 8), 2) == (6, 4)
    assert regions(Split(0), (6, 8), 2, 1) == [((0, 0), (3, 0), (3, 8))]
    assert regions(Split(1), (6, 8), 4, 3) == [((0, 0), (0, 6), (6, 2))]


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_split_of_an_indivisible_size_is_refused(tp: int) -> None:
    """A size tp does not divide cannot be split evenly: the error names the tensor, the size and tp."""
    with pytest.raises(LayoutError, match=rf"^w: size 7 cannot be split evenly over tp={tp} ranks"):
        local_shape(Split(1), (2, 7), tp, "w")


@pytest.mark.parametrize("spec, shape", [(Split(2), (4, 4)), (Split(-3), (4, 4)), (Split(0), ()),
                                         (VocabSplit(4, 1, 1), (4,)), (Fused(2, 1), (4,))])
def test_a_rule_for_a_missing_dimension_is_refused(spec: Spec, shape: tuple[int, ...]) -> None:
    """A rule that splits a dimension the tensor does not have is refused both ways."""
    with pytest.raises(LayoutError, match=r"^w: rule splits dim -?\d but the tensor has shape"):
        local_shape(spec, shape, 2, "w")
    with pytest.raises(LayoutError, match=r"^w: rule splits dim -?\d but the tensor has shape"):
        global_shape(spec, shape, 2, "w")


# ---- VocabSplit -------------------------------------------------------------------

@pytest.mark.parametrize("size, multiple, tp, padded", [
    (50257, 128, 1, 50304), (50257, 128, 2, 50432), (50257, 128, 3, 50304), (50257, 128, 4, 50688),
    (10, 1, 3, 12), (12, 4, 3, 12), (13, 4, 3, 24), (1, 8, 4, 32),
])
def test_vocab_padding(size: int, multiple: int, tp: int, padded: int) -> None:
    """Rows are padded to the next multiple of ``multiple * tp`` (Megatron's make-vocab-size-divisible-by)."""
    spec = VocabSplit(size, multiple)
    assert spec.padded(tp) == padded
    assert local_shape(spec, (size, 3), tp) == (padded // tp, 3)
    assert global_shape(spec, (padded // tp, 3), tp) == (size, 3)


@FAST
@given(st.sampled_from(TPS), st.integers(1, 20), st.integers(1, 6), st.integers(1, 3), st.booleans())
def test_vocab_split_round_trips_and_tiles(tp: int, size: int, multiple: int, width: int, rows_last: bool) -> None:
    """The padding is dropped on save: the ranks' regions tile the unpadded rows once, and a rank whose rows
    are all padding holds no region."""
    spec = VocabSplit(size, multiple, 1 if rows_last else 0)
    check_spec(spec, (width, size) if rows_last else (size, width), tp)


def test_vocab_split_regions_of_padding_only_ranks() -> None:
    """10 rows, multiple 4, tp=4: padded to 16, 4 rows each; rank 2 holds rows 8-9 only, rank 3 nothing."""
    spec = VocabSplit(10, 4)
    assert [regions(spec, (10, 2), 4, r) for r in range(4)] == [
        [((0, 0), (0, 0), (4, 2))], [((0, 0), (4, 0), (4, 2))], [((0, 0), (8, 0), (2, 2))], []]


def test_vocab_split_errors_say_what_is_wrong() -> None:
    """A saved row count other than the vocabulary size, and a local tensor that is not padded, are refused;
    a local tensor split from the unpadded vocabulary gets the hint of the padded row count per rank."""
    spec = VocabSplit(10, 4)
    with pytest.raises(LayoutError, match=r"^emb: 12 rows saved but the rules say the vocabulary has 10$"):
        local_shape(spec, (12, 2), 2, "emb")
    with pytest.raises(LayoutError, match=r"^emb: 5 local rows x tp=2 is not the padded vocabulary 16 "
                                          r"\(size 10, multiple 4\); each rank holds 8 rows: the vocabulary "
                                          r"padded with zero rows to 16, split over tp=2 ranks$"):
        global_shape(spec, (5, 2), 2, "emb")
    with pytest.raises(LayoutError, match=r"^emb: 7 local rows x tp=2 is not the padded vocabulary 16 .*; "
                                          r"check the rules$"):
        global_shape(spec, (7, 2), 2, "emb")


# ---- Fused ------------------------------------------------------------------------

@FAST
@given(st.sampled_from(TPS), st.lists(st.integers(1, 3), min_size=1, max_size=4), st.integers(1, 3),
       st.booleans())
def test_fused_parts_of_unequal_sizes(tp: int, units: list[int], width: int, along_rows: bool) -> None:
    """Grouped-query QKV: parts of different sizes, each a multiple of tp, each split on its own, so a rank
    holds ``[q_r; k_r; v_r]``, not a contiguous block of the fused tensor."""
    parts = tuple(u * tp for u in units)
    spec = Fused(parts, 0 if along_rows else 1)
    total = sum(parts)
    check_spec(spec, (total, width) if along_rows else (width, total), tp)


@pytest.mark.parametrize("tp", TPS)
def test_fused_equal_parts_by_count(tp: int) -> None:
    """``Fused(3)`` (QKV) on 12*tp rows: three parts of 4*tp; local rows 12, and rank r's q, k, v rows."""
    spec = Fused(3)
    check_spec(spec, (12 * tp, 2), tp)
    assert local_shape(spec, (12 * tp, 2), tp) == (12, 2)
    assert regions(spec, (12 * tp, 2), tp, tp - 1) == [
        ((0, 0), ((tp - 1) * 4, 0), (4, 2)), ((4, 0), (4 * tp + (tp - 1) * 4, 0), (4, 2)),
        ((8, 0), (8 * tp + (tp - 1) * 4, 0), (4, 2))]


def test_fused_exact_regions_of_unequal_parts() -> None:
    """Parts (8, 4, 4) over tp=2: rank 1 holds global rows 4-7, 10-11 and 14-15 at local rows 0, 4 and 6."""
    assert regions(Fused((8, 4, 4)), (16, 3), 2, 1) == [
        ((0, 0), (4, 0), (4, 3)), ((4, 0), (10, 0), (2, 3)), ((6, 0), (14, 0), (2, 3))]
    assert local_shape(Fused((8, 4, 4)), (16, 3), 2) == (8, 3)


@pytest.mark.parametrize("spec, shape, tp, fragment", [
    (Fused(3), (10, 2), 1, "size 10 cannot be cut into 3 equal fused parts"),
    (Fused((4, 4)), (10, 2), 1, r"fused parts \[4, 4\] do not add up to size 10"),
    (Fused((6, 3, 3)), (12, 2), 2, "w: size 3 cannot be split evenly over tp=2 ranks"),
    (Fused(2), (6, 2), 2, "w: size 3 cannot be split evenly over tp=2 ranks"),
])
def test_fused_specs_that_do_not_fit_are_refused(spec: Spec, shape: tuple[int, ...], tp: int, fragment: str) -> None:
    """Parts that do not add up, or that tp does not divide, are a LayoutError, not a silently wrong shard."""
    with pytest.raises(LayoutError, match=fragment):
        local_shape(spec, shape, tp, "w")


# ---- Replicated -------------------------------------------------------------------

@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("shape", [(5,), (2, 3), (2, 1, 3), ()])
def test_replicated_is_whole_on_every_rank(tp: int, shape: tuple[int, ...]) -> None:
    """Every rank holds the whole tensor (a zero-dim one included) at local and global offset 0."""
    check_spec(Replicated(), shape, tp)
    zeros = (0,) * len(shape)
    assert all(regions(Replicated(), shape, tp, r) == [(zeros, zeros, shape)] for r in range(tp))


@pytest.mark.parametrize("spec", [Replicated(), Split(0)])
def test_empty_tensors_have_no_regions(spec: Spec) -> None:
    """A tensor with a zero-size dimension has nothing to read or write on any rank."""
    assert all(regions(spec, (0, 4), 2, r) == [] for r in range(2))
    assert local_shape(spec, (0, 4), 2) == (0, 4)


# ---- serialisation and rule lookup ------------------------------------------------

def test_rules_json_round_trip_and_unknown_kind() -> None:
    """Rules saved with a version come back equal (specs, sections, pipeline); an unknown spec kind is refused."""
    rules = megatron_gpt(num_layers=4, vocab_size=100, qkv_parts=(4, 2, 2), stage_sizes=(1, 3),
                         param_shapes={"layers.0.mlp.fc1.weight": (8, 4)})
    back = Rules.from_json(rules.to_json())
    assert back.to_json() == rules.to_json()
    assert back.params == rules.params and back.param_shapes == {"layers.0.mlp.fc1.weight": (8, 4)}
    from ckptrepo.parallel.rules import spec_from_json
    with pytest.raises(LayoutError, match=r"^unknown sharding rule 'diagonal'; .*newer ckptrepo$"):
        spec_from_json(["diagonal", 0])


def test_megatron_gpt_specs_and_pipeline_names() -> None:
    """Which spec each Megatron parameter gets, and stage-local names under pp=2 with stage sizes (1, 3)."""
    rules = megatron_gpt(num_layers=4, vocab_size=100, stage_sizes=(1, 3))
    assert rules.spec("embedding.word_embeddings.weight") == VocabSplit(100, 128, 0)
    assert rules.spec("layers.2.attn.qkv.weight") == Fused(3, 0)
    assert rules.spec("layers.2.attn.proj.weight") == Split(1)
    assert rules.spec("layers.2.attn.proj.bias") == Replicated()
    assert rules.spec("layers.0.mlp.fc1.bias") == Split(0)
    assert rules.spec("final_ln.weight") == Replicated()
    assert rules.to_global("layers.1.mlp.fc2.weight", 2, 1) == "layers.2.mlp.fc2.weight"
    assert rules.to_local("layers.2.mlp.fc2.weight", 2, 1) == "layers.1.mlp.fc2.weight"
    assert rules.to_local("layers.2.mlp.fc2.weight", 2, 0) is None
    assert rules.to_local("embedding.word_embeddings.weight", 2, 1) is None
    assert rules.to_local("head.weight", 2, 0) is None and rules.to_local("head.weight", 2, 1) == "head.weight"
    with pytest.raises(LayoutError, match="pipeline stage 0 holds 1 layers, not layer 1"):
        rules.to_global("layers.1.ln1.weight", 2, 0)


# ---- specs that cannot describe a tensor are refused when made ---------------------------

@pytest.mark.parametrize("make", [lambda: Fused(0), lambda: Fused(-2), lambda: Fused((8, -4)), lambda: Fused(()),
                                  lambda: VocabSplit(10, 0), lambda: VocabSplit(10, -4), lambda: VocabSplit(0),
                                  lambda: megatron_gpt(2, 10, make_vocab_size_divisible_by=0)])
def test_a_spec_with_a_zero_or_negative_count_is_a_layout_error(make: Callable[[], object]) -> None:
    """``Fused(0)`` divided by zero; ``Fused(-2)`` on 4 rows gave local shape (0, 2) and no regions (the tensor
    was never saved), ``Fused((8, -4))`` regions outside the tensor, and ``VocabSplit(10, -4)`` over tp=2
    padded 10 rows down to 8 (rows 8-9 in no rank's region). Each is a mistake in the rules: a LayoutError
    that names the spec, when the rules are made."""
    with pytest.raises(LayoutError, match="at least 1"):
        make()
