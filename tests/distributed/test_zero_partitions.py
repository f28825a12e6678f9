"""ZeRO-3 flat parameter partitions with rules, in one process (the multi-rank matrix is in test_distributed).

A ZeRO-3 rank holds its parameters as one flat partition, so which
parameters it covers comes from the rules' ``param_shapes``; these tests pin
that convention (stored under the parameters' own names, loaded back into any
partition) and the errors a user gets when the rules or the state do not fit.
"""
from __future__ import annotations

import pytest
import torch

import ckptrepo
from ckptrepo.errors import LayoutError, StateMismatchError
from ckptrepo.parallel.layout import ParallelLayout, zero_partition
from ckptrepo.rules import Rules, Split

SHAPES = {"embed.weight": (10, 4), "layers.0.w": (6, 4), "layers.1.w": (6, 4), "head.bias": (3,)}
OPT = ("optimizer/exp_avg",)


def _rules(param_shapes: dict | None = SHAPES) -> Rules:
    return Rules([("layers.*.w", Split(0))], optimizer_sections=OPT, param_shapes=param_shapes)


def _full(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _flat(tensors: dict[str, torch.Tensor], dp: int, dp_rank: int) -> torch.Tensor:
    flat = torch.cat([t.reshape(-1) for t in tensors.values()])
    start, stop, size = zero_partition(flat.numel(), dp, dp_rank)
    part = flat.new_zeros(size)
    part[:stop - start] = flat[start:stop]
    return part


def test_a_zero3_state_is_stored_per_parameter_and_loads_into_other_partitions(tmp_path) -> None:
    model, moment = _full(1), _full(2)
    repo = ckptrepo.init(str(tmp_path / "repo"))
    lay = ParallelLayout(zero=3, rules=_rules())
    repo.snapshot({"model": _flat(model, 1, 0), "optimizer": {"exp_avg": _flat(moment, 1, 0), "step": 3}},
                  step=3, parallel_layout=lay)
    plain = repo.load("HEAD")   # no layout: every parameter whole, under its own name
    assert list(plain["model"]) == list(SHAPES)
    assert all(torch.equal(plain["model"][n], model[n]) for n in SHAPES)
    assert all(torch.equal(plain["optimizer"]["exp_avg"][n], moment[n]) for n in SHAPES)
    assert plain["optimizer"]["step"] == 3
    # three data-parallel partitions (the last one padded), built by ckptrepo; no rules given: the saved ones
    for r in range(3):
        got = repo.load("HEAD", parallel_layout=ParallelLayout(dp=3, zero=3), rank=r)
        assert torch.equal(got["model"], _flat(model, 3, r))
        assert torch.equal(got["optimizer"]["exp_avg"], _flat(moment, 3, r))
    # tensor-parallel ranks under ZeRO-3: each partition covers that rank's halves of the split weights
    for r in range(2):
        local = {n: t.chunk(2)[r] if n.startswith("layers.") else t for n, t in model.items()}
        into = {"model": torch.full((zero_partition(sum(t.numel() for t in local.values()), 1, 0)[2],), -1.0)}
        repo.load("HEAD", parallel_layout=ParallelLayout(tp=2, zero=3, rules=_rules()), rank=r, into=into)
        assert torch.equal(into["model"], _flat(local, 1, 0))


def test_a_version_saved_without_param_shapes_loads_into_zero3_in_its_saved_order(tmp_path) -> None:
    """ZeRO-1 saves need no param_shapes; the version's tensor table gives the model order instead."""
    model, moment = _full(3), _full(4)
    repo = ckptrepo.init(str(tmp_path / "repo"))
    repo.snapshot({"model": model, "optimizer": {"exp_avg": _flat(moment, 1, 0)}}, step=1,
                  parallel_layout=ParallelLayout(zero=1, rules=_rules(None)))
    for r in range(2):
        got = repo.load("HEAD", parallel_layout=ParallelLayout(dp=2, zero=3), rank=r)
        assert torch.equal(got["model"], _flat(model, 2, r))
        assert torch.equal(got["optimizer"]["exp_avg"], _flat(moment, 2, r))


def test_zero3_without_param_shapes_is_refused_before_anything_is_written(tmp_path) -> None:
    repo = ckptrepo.init(str(tmp_path / "repo"))
    with pytest.raises(LayoutError, match="param_shapes="):
        repo.snapshot({"model": torch.zeros(91), "optimizer": {"exp_avg": torch.zeros(91)}}, step=1,
                      parallel_layout=ParallelLayout(zero=3, rules=_rules(None)))
    assert repo.log() == []


def test_zero3_with_a_tensor_per_parameter_is_refused(tmp_path) -> None:
    repo = ckptrepo.init(str(tmp_path / "repo"))
    with pytest.raises(LayoutError, match="one flat 1-D tensor"):
        repo.snapshot({"model": _full(1), "optimizer": {"exp_avg": torch.zeros(91)}}, step=1,
                      parallel_layout=ParallelLayout(zero=3, rules=_rules()))


def test_param_shapes_that_disagree_with_the_version_name_the_parameter(tmp_path) -> None:
    repo = ckptrepo.init(str(tmp_path / "repo"))
    repo.snapshot({"model": _flat(_full(1), 1, 0), "optimizer": {"exp_avg": torch.zeros(91)}}, step=1,
                  parallel_layout=ParallelLayout(zero=3, rules=_rules()))
    wrong = _rules({**SHAPES, "layers.1.w": (8, 4)})
    with pytest.raises(StateMismatchError, match=r"model/layers.1.w: global shape \[8, 4\] here but \[6, 4\]"):
        repo.load("HEAD", parallel_layout=ParallelLayout(zero=3, rules=wrong), into={"model": torch.zeros(99)})


def test_each_zero3_partition_reads_only_its_bytes(tmp_path) -> None:
    """A partition cuts across tensors: per tensor it is one contiguous run, read within the issue's bound
    (1.1x what the rank receives, plus the chunks at the run's ends and the shard index)."""
    from ckptrepo.loading._engine import ReadStats, kvstore_bytes_read
    from ckptrepo.storage._arrays import INNER_BYTES
    shapes = {"a": (1024, 1024), "b": (512, 1024), "c": (1000,)}    # 6 MiB of fp32
    g = torch.Generator().manual_seed(5)
    model = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    rules = Rules(param_shapes=shapes)
    repo = ckptrepo.init(str(tmp_path / "repo"))
    repo.snapshot({"model": _flat(model, 1, 0)}, step=1, parallel_layout=ParallelLayout(zero=3, rules=rules))
    total = 0
    for r in range(4):
        stats = ReadStats()
        before = kvstore_bytes_read()
        got = repo.load("HEAD", parallel_layout=ParallelLayout(dp=4, zero=3), rank=r, read_stats=stats)
        read = kvstore_bytes_read() - before
        assert torch.equal(got["model"], _flat(model, 4, r))
        start, stop, _ = zero_partition(sum(t.numel() for t in model.values()), 4, r)
        assert stats.needed_bytes == (stop - start) * 4
        assert read <= 1.1 * stats.needed_bytes + stats.runs * 2 * INNER_BYTES + (64 << 10), (r, read, stats)
        total += stats.needed_bytes
    assert total == sum(t.numel() for t in model.values()) * 4
