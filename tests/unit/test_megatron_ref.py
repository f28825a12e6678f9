"""The reference Megatron GPT is a trustworthy oracle: sharding round-trips, and layouts train alike.

The resharding tests compare training under one layout with training resumed
under another, so the reference must itself (1) split and reassemble state
exactly, (2) follow the naming and shapes of ``ckptrepo.rules.megatron_gpt``,
and (3) train the same model whatever the layout, up to float reduction order.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist
from support.helpers import assert_bit_exact
from support.megatron_ref import (
    GPTConfig,
    assemble,
    assert_params_close,
    global_shapes,
    init_full_params,
    launch,
    local_shapes,
    run_training,
    shard_full,
    stage_params,
)

from ckptrepo.parallel.layout import ParallelLayout, zero_partition
from ckptrepo.rules import local_shape, megatron_gpt

CFG = GPTConfig()
LAYOUTS = [(2, 2, 2, 0), (1, 1, 4, 0), (4, 1, 1, 0), (2, 1, 2, 1), (1, 2, 2, 0), (2, 2, 2, 3)]
STEPS = range(3)


def _full_optim(cfg: GPTConfig) -> dict:
    g = torch.Generator().manual_seed(7)
    full = init_full_params(cfg)
    return {"step": 5, "exp_avg": {n: torch.randn(t.shape, generator=g) for n, t in full.items()},
            "exp_avg_sq": {n: torch.rand(t.shape, generator=g) for n, t in full.items()}}


@pytest.mark.parametrize("tp,pp,dp,zero", LAYOUTS)
def test_shard_then_assemble_is_bit_exact(tp, pp, dp, zero):
    layout = ParallelLayout(tp=tp, pp=pp, dp=dp, zero=zero)
    full, optim = init_full_params(CFG), _full_optim(CFG)
    states = {r: shard_full(CFG, layout, r, full, optim) for r in range(layout.world_size)}
    for r, s in states.items():
        if zero:
            total = sum(math.prod(shape) for shape in local_shapes(CFG, layout, r).values())
            size = zero_partition(total, dp, layout.coords(r).dp)[2]
            assert s["optimizer"]["exp_avg"].shape == (size,)
            assert zero < 3 or s["model"].shape == (size,)
        else:
            assert list(s["optimizer"]["exp_avg"]) == list(s["model"])
    out = assemble(CFG, layout, states)
    assert_bit_exact(out["model"], full)
    assert_bit_exact(out["optimizer"], optim)


@pytest.mark.parametrize("tp,pp,dp,zero", LAYOUTS)
def test_names_and_shapes_follow_the_rules(tp, pp, dp, zero):
    rules = megatron_gpt(CFG.layers, CFG.vocab_size, CFG.make_vocab_size_divisible_by)
    full = init_full_params(CFG)
    layout = ParallelLayout(tp=tp, pp=pp, dp=dp)    # the model section per parameter, whatever the ZeRO stage
    for r in range(layout.world_size):
        c = layout.coords(r)
        model = shard_full(CFG, layout, r, full)["model"]
        assert [rules.to_global(n, pp, c.pp) for n in model] == [g for _, g in stage_params(CFG, pp, c.pp)]
        expected = [n for n in full if rules.to_local(n, pp, c.pp) is not None]
        assert [rules.to_global(n, pp, c.pp) for n in model] == expected
        for n, t in model.items():
            g = rules.to_global(n, pp, c.pp)
            assert tuple(t.shape) == local_shape(rules.spec(g), full[g].shape, tp, g)


@pytest.mark.parametrize("tp,pp,dp,zero", LAYOUTS)
def test_zero_partitions_cover_the_parameters_in_the_order_of_the_rules(tp, pp, dp, zero):
    """ckptrepo's ZeRO-3 convention (``Rules.local_params``) is the one the reference trains with."""
    rules = megatron_gpt(CFG.layers, CFG.vocab_size, CFG.make_vocab_size_divisible_by,
                         param_shapes=global_shapes(CFG))
    layout = ParallelLayout(tp=tp, pp=pp, dp=dp, zero=zero)
    for r in range(layout.world_size):
        c = layout.coords(r)
        ours = [(local, shape) for local, _, shape, _, _ in rules.local_params(tp, c.tp, pp, c.pp)]
        assert ours == list(local_shapes(CFG, layout, r).items())


def test_assemble_rejects_diverged_replicas_and_dirty_padding():
    layout = ParallelLayout(tp=2, pp=1, dp=2)
    full = init_full_params(CFG)
    states = {r: shard_full(CFG, layout, r, full) for r in range(layout.world_size)}
    states[3]["model"]["layers.0.ln1.weight"][0] += 1
    with pytest.raises(AssertionError, match="differs between"):
        assemble(CFG, layout, states)
    states[3]["model"]["layers.0.ln1.weight"][0] -= 1
    states[1]["model"]["head.weight"][-1, 0] = 1.0
    with pytest.raises(AssertionError, match="padding"):
        assemble(CFG, layout, states)
    states[1]["model"]["head.weight"][-1, 0] = 0.0
    states[2]["model"]["layers.0.mlp.fc1.weight"] = full["layers.0.mlp.fc1.weight"]
    with pytest.raises(AssertionError, match=r"expected torch.float32\[64, 32\]"):
        assemble(CFG, layout, states)


def _train(dims: tuple[int, int, int, int], steps: range, init: functools.partial) -> tuple[list[float], dict]:
    """Train ``steps`` under layout ``dims`` from ``init``; (losses, assembled final state)."""
    layout = ParallelLayout(*dims)
    results = launch(layout, run_training, CFG, steps, init)
    losses = {tuple(lo) for lo, _ in results}
    assert len(losses) == 1, f"{layout}: ranks report different losses {losses}"
    return results[0][0], assemble(CFG, layout, {r: s for r, (_, s) in enumerate(results)})


@pytest.fixture(scope="module")
def trained() -> dict[str, tuple[list[float], dict]]:
    """3 steps from the same initial parameters: in one process, under tp, pp, dp and ZeRO-1 at once, under ZeRO-3,
    and resharded.

    "resharded" trains step 0 under (tp=1, pp=2, dp=2), reassembles the full
    state and continues with steps 1 and 2 under (tp=2, pp=1, dp=2, ZeRO-1),
    the very thing the resharding tests do through ckptrepo.
    """
    init = functools.partial(shard_full, full_model=init_full_params(CFG))
    first, mid = _train((1, 2, 2, 0), STEPS[:1], init)
    rest, final = _train((2, 1, 2, 1), STEPS[1:],
                         functools.partial(shard_full, full_model=mid["model"], full_optim=mid["optimizer"]))
    return {"single": _train((1, 1, 1, 0), STEPS, init), "all axes": _train((2, 2, 2, 1), STEPS, init),
            "zero-3": _train((2, 1, 2, 3), STEPS, init), "resharded": (first + rest, final)}


def test_training_reduces_the_loss(trained):
    losses, final = trained["single"]
    assert losses[-1] < losses[0]
    assert final["optimizer"]["step"] == len(STEPS)
    assert not torch.equal(final["model"]["head.weight"], init_full_params(CFG)["head.weight"])


@pytest.mark.parametrize("run", ["all axes", "zero-3", "resharded"])
def test_layouts_train_alike(trained, run):
    ref_losses, ref = trained["single"]
    losses, final = trained[run]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert final["optimizer"]["step"] == ref["optimizer"]["step"]
    assert_params_close(CFG, final["model"], ref["model"], len(STEPS))
    for key in ("exp_avg", "exp_avg_sq"):
        for name, t in ref["optimizer"][key].items():
            torch.testing.assert_close(final["optimizer"][key][name], t, rtol=1e-3, atol=1e-6,
                                       msg=lambda m, key=key, name=name: f"{key} {name}: {m}")


def _fail_on_rank_1(rank: int, layout: ParallelLayout) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 gives up")
    dist.barrier()   # rank 0 waits for rank 1 forever: launch must stop it


def test_launch_reports_a_failing_rank_and_stops_the_others():
    with pytest.raises(AssertionError, match="rank 1 failed(.|\n)*rank 1 gives up"):
        launch(ParallelLayout(dp=2), _fail_on_rank_1)
