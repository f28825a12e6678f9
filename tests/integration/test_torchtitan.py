"""torchtitan's checkpoint manager over a repository, with torchtitan's own optimizer and LR scheduler
containers on CPU (no process group: one process). Skipped where torchtitan is not installed: it is not a
test extra (its dependencies, torchdata, datasets, wandb and others, are not ckptrepo's)."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from ckptrepo.errors import RevisionError

pytest.importorskip("torchtitan")


class TrainState:
    """The trainer's own Stateful state, as torchtitan passes it (``states={"train_state": trainer}``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]


def _build(url: str, seed: int, **options: Any) -> tuple[Any, Any, Any, Any, TrainState]:
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from ckptrepo.integrations.torchtitan import checkpoint_config
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt_cfg = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
        implementation="for-loop")
    opts = opt_cfg.build(model_parts=[model])
    scheds = LRSchedulersContainer(opts, lambda step: 1.0 / (1 + step))
    train_state = TrainState()
    manager = checkpoint_config(url, interval=2, keep_latest_k=3, **options).build(
        dataloader=None, model_parts=[model], optimizers=opts, lr_schedulers=scheds,
        states={"train_state": train_state}, sd_adapter=None)
    return model, opts, scheds, manager, train_state


def _train(model: Any, opts: Any, scheds: Any, manager: Any, ts: TrainState, last: int) -> list[float]:
    losses = []
    while ts.step < last:
        ts.step += 1
        g = torch.Generator().manual_seed(ts.step)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opts.step()
        opts.zero_grad()
        scheds.step()
        losses.append(loss.item())
        manager.save(ts.step, last_step=ts.step == 10)
    return losses


def test_a_resumed_torchtitan_run_repeats_the_losses(tmp_path) -> None:
    url = str(tmp_path / "repo")
    model, opts, scheds, manager, ts = _build(url, seed=0)
    assert manager.load() is False   # a fresh start
    losses = _train(model, opts, scheds, manager, ts, 10)
    manager.close()
    import ckptrepo
    repo = ckptrepo.open(url)
    assert [v.step for v in repo.log()] == [10, 8, 6, 4, 2]   # every save a version; history stays whole
    assert [v.step for v in repo.log() if v.local] == [10, 8, 6]   # keep_latest_k=3: the rest pruned
    model2, opts2, scheds2, manager2, ts2 = _build(url, seed=1)
    with pytest.raises(RevisionError, match="pruned"):
        manager2.load(step=4)
    assert manager2.load(step=6) is True and ts2.step == 6
    assert _train(model2, opts2, scheds2, manager2, ts2, 10) == losses[6:]
    manager2.close()
