"""torchtitan: a checkpoint manager that keeps torchtitan's training state in a ckptrepo repository.

torchtitan builds its checkpointer from ``config.checkpoint`` (a ``Configurable.Config`` whose owner class
``build()`` constructs), and every manager implements ``BaseCheckpointManager``. Its DCP manager calls
``dcp.save(state, checkpoint_id=folder/step-N)`` with no way to pass a storage writer, finds the step to
resume by listing ``step-N`` folders and purges old ones with ``rmtree``; so this is a manager of its own,
on the snapshotter rather than on DCP: each save is one version (step = torchtitan's step), committed in
the background while training goes on (the optimizers' next step waits only for capture), old versions
are pruned by a retention policy (``keep_latest_k``), and a load fills the same Stateful objects in place
(model parts, optimizers, LR schedulers, dataloader, the trainer's own state; DTensors of FSDP2 and tensor
parallelism as ckptrepo loads them, into any mesh).

    config.checkpoint = ckptrepo.integrations.torchtitan.checkpoint_config("/data/run1", interval=100)

torchtitan is imported only when :func:`checkpoint_config` is called.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from ckptrepo.errors import ArgumentError


def checkpoint_config(url: str, **options: Any) -> Any:
    """torchtitan's ``config.checkpoint`` for a manager over the repository at ``url`` (created if absent);
    ``options`` are ``BaseCheckpointManager.Config`` fields (``interval``, ``keep_latest_k``, ``load_step``,
    ``exclude_from_loading``, ...). ``enable`` defaults to True."""
    if not isinstance(url, str) or not url:
        raise ArgumentError(f"checkpoint_config() takes the repository's path or URL as text, not {url!r}")
    options.setdefault("enable", True)
    return manager_class().Config(url=url, **options)


@functools.cache
def manager_class() -> Any:
    """The ``BaseCheckpointManager`` subclass, made on first use (it subclasses a torchtitan class)."""
    from torchtitan.components.checkpointer import (  # type: ignore[import-not-found,unused-ignore]
        DATALOADER,
        LR_SCHEDULER,
        MODEL,
        OPTIMIZER,
        BaseCheckpointManager,
        ModelWrapper,
    )

    import ckptrepo
    from ckptrepo.maintenance import RetentionPolicy

    class CkptRepoCheckpointManager(BaseCheckpointManager):  # type: ignore[misc,valid-type,unused-ignore]
        """torchtitan's checkpointing as ckptrepo versions (see the module docstring)."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseCheckpointManager.Config):  # type: ignore[misc,valid-type,name-defined,unused-ignore]
            url: str = ""
            """The repository's path or URL."""

        def __init__(self, config: Any, *, dataloader: Any, model_parts: list[Any], optimizers: Any,
                     lr_schedulers: Any, states: dict[str, Any], sd_adapter: Any = None,
                     base_folder: str = "") -> None:
            self.enable = config.enable
            self.save_future = None
            if not self.enable:
                return
            if not config.url:
                raise ArgumentError("the ckptrepo checkpoint config needs url= (the repository's path or URL)")
            self.config = config
            self.states = dict(states)
            self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers,
                                LR_SCHEDULER: lr_schedulers})
            if dataloader is not None:
                self.states[DATALOADER] = dataloader
            self.repo = ckptrepo.init(config.url, exist_ok=True)
            keep = config.keep_latest_k
            self.snap = self.repo.snapshotter(retention=RetentionPolicy(keep_last=keep) if keep > 0 else None)
            for opt in getattr(optimizers, "optimizers", [optimizers]):   # the container's step calls each
                self.snap.attach(opt)

        def _should_save(self, step: int, last_step: bool) -> bool:
            c = self.config
            return not c.load_only and (last_step or step % c.interval == 0
                                        or (step == 1 and c.enable_first_step_checkpoint))

        def _save(self, curr_step: int, last_step: bool = False) -> bool:
            if not self._should_save(curr_step, last_step):
                return False
            self.snap.snapshot(self.states, step=curr_step, message=f"torchtitan step {curr_step}")
            if last_step:
                self.snap.wait()   # the run ends: its last version is committed before the trainer returns
            return True

        def _load(self, step: int = -1) -> bool:
            self.snap.wait()
            if step == -1 and not self.repo.log(limit=1):
                return False   # a fresh start
            states = {k: v for k, v in self.states.items() if k not in self.config.exclude_from_loading}
            self.repo.load("HEAD" if step == -1 else f"@{step}", into=states)
            return True

        def _wait_for_saving(self) -> None:
            self.snap.wait()

        def _maybe_wait_for_staging(self) -> None:
            self.snap.wait_captured()

        def _close(self) -> None:
            self.snap.close()

    return CkptRepoCheckpointManager


__all__ = ["checkpoint_config", "manager_class"]
