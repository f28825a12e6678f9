"""Hugging Face ``Trainer``: snapshots through a callback, and resuming from any version.

    from ckptrepo.integrations.hf import CkptRepoCallback, checkpoint_folder
    trainer = Trainer(..., callbacks=[CkptRepoCallback("/data/run-repo", every_n_steps=100)])
    trainer.train()
    trainer.train(resume_from_checkpoint=checkpoint_folder("/data/run-repo", "@1000"))

``CkptRepoCallback`` takes a snapshot where ``Trainer._save_checkpoint`` would
save (after the step and its log), through one asynchronous snapshotter whose
wait runs only before the next optimizer step; under DDP on rank 0 alone, with
every rank's RNG states gathered. ``checkpoint_folder`` writes a
version as the checkpoint folder ``resume_from_checkpoint`` reads, because that
argument, a folder path, is the one public way in: the data skip, the RNG
restore and the optimizer load all key off it (docs/decisions/026-hf-integration.md).

transformers is imported only when ``CkptRepoCallback`` is first used (it must
subclass ``TrainerCallback``); ``checkpoint_folder`` never imports it.
"""
from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import random
import shutil
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ckptrepo.arguments import check_whole, is_number
from ckptrepo.errors import ArgumentError, ExchangeError
from ckptrepo.parallel import all_gather
from ckptrepo.repository import Repository, init, repo_url
from ckptrepo.repository import open as open_repo
from ckptrepo.saving import unwrapped_optimizer
from ckptrepo.tools import (
    CONFIG_KEY,
    MODEL_KEY,
    OPTIMIZER_KEY,
    RNG_KEY,
    SCHEDULER_KEY,
    TRAINER_STATE_KEY,
    save_trainer_checkpoint,
)

if TYPE_CHECKING:
    from ckptrepo.saving import SnapshotHandle, Snapshotter


def rng_states(distributed: bool = False) -> dict[str, Any]:
    """This process's RNG states as ``Trainer._save_rng_state`` saves them, under its keys: under DDP
    (``distributed``) the CUDA states of all devices, as it saves them then."""
    states: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                              "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.random.get_rng_state_all() if distributed else torch.cuda.random.get_rng_state()
    return states


def gathered_rng_states() -> list[dict[str, Any]]:
    """Every rank's RNG states, in rank order, on every rank: ``Trainer`` resumes each process from its own
    ``rng_state_{process_index}.pth``. A collective: every rank calls it at the same step."""
    return all_gather(rng_states(distributed=True))


def unsupported_parallelism(args: Any) -> str | None:
    """What in ``TrainingArguments`` shards the model or optimizer over the processes (which a snapshot of
    rank 0's replica would not hold whole), or None for one process or plain DDP."""
    if getattr(args, "deepspeed", None):
        return "DeepSpeed"
    if getattr(args, "fsdp", None):
        return "FSDP"
    config = getattr(args, "parallelism_config", None)
    if config is not None and any((getattr(config, f"{k}_size", 1) or 1) > 1 for k in ("dp_shard", "tp", "cp")):
        return "a parallelism_config that shards (dp_shard/tp/cp)"
    return None


def hf_config(model: Any) -> dict[str, Any] | None:
    """``model.config.to_dict()`` with the architecture named (as ``save_pretrained`` records it), or None for a
    model without an HF config."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "to_dict", None)):
        return None
    out = dict(config.to_dict())
    if not out.get("architectures"):
        out["architectures"] = [type(model).__name__]
    return out


def _repository(repo: Repository | str | os.PathLike[str]) -> Repository:
    return repo if isinstance(repo, Repository) else init(repo_url(repo), exist_ok=True)


class _Hooks:
    """The work of ``CkptRepoCallback``, apart from transformers' base class (see ``_callback_class``)."""

    def __init__(self, repo: Repository | str | os.PathLike[str], every_n_steps: int = 500, *,
                 save_final: bool = True, message: str = "hf step {step}", **snapshotter_options: Any) -> None:
        check_whole(every_n_steps, "every_n_steps", 1)
        if not isinstance(message, str):
            raise ArgumentError(f"message must be text (with {{step}} for the step), not {message!r:.40}")
        self._repo_arg = repo if isinstance(repo, Repository) else repo_url(repo)
        self._repo: Repository | None = None
        self.every_n_steps = every_n_steps
        self.save_final = save_final
        self.message = message
        self.snapshotter_options = snapshotter_options
        self.snapshotter: Snapshotter | None = None
        self.handles: list[SnapshotHandle] = []   # one per snapshot taken, oldest first
        self._objects: dict[str, Any] = {}
        self._config: dict[str, Any] | None = None
        self._pending: int | None = None   # the step whose snapshot waits for that step's log
        self._world_size = 1

    @property
    def repo(self) -> Repository:
        """The repository, opened (created if missing) on first use: under DDP only rank 0 opens it."""
        if self._repo is None:
            self._repo = _repository(self._repo_arg)
        return self._repo

    # ---- Trainer events -------------------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        sharded = unsupported_parallelism(args)
        if sharded is not None:
            raise ArgumentError(f"CkptRepoCallback snapshots a single process or plain DDP, not {sharded} inside "
                                f"Trainer; save sharded states through ckptrepo.dcp (FSDP) or the DeepSpeed engine "
                                f"(ckptrepo.integrations.deepspeed)")
        world_size = int(getattr(args, "world_size", 1) or 1)
        if world_size > 1 and not _distributed_ready(world_size):
            raise ArgumentError(f"the Trainer runs {world_size} processes but torch.distributed has no default "
                                f"group of that size; launch with torchrun (or accelerate launch)")
        if model is None or optimizer is None:
            raise ArgumentError("the Trainer passed no model or optimizer to CkptRepoCallback.on_train_begin")
        self.close()   # a second train() on the same Trainer: the first one's snapshots are finished first
        inner = unwrapped_optimizer(optimizer)   # what the state holds, and what attach() hooks into
        self._objects = {MODEL_KEY: model, OPTIMIZER_KEY: inner, SCHEDULER_KEY: lr_scheduler}
        self._config = hf_config(model)
        self._world_size = world_size
        self._pending = None
        if getattr(args, "process_index", 0) != 0:
            return   # under DDP each rank holds the whole state: rank 0 alone snapshots it
        options = dict(self.snapshotter_options)
        if world_size > 1:   # rank 0 writes whole versions on its own, whatever the other ranks do
            options["single_process"] = True
        self.snapshotter = self.repo.snapshotter(**options)
        self.snapshotter.attach(inner)   # the loop waits for capture only before the parameters change

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._due(state):
            return
        if control.should_log:   # the step's log comes next, before anything changes the state
            self._pending = state.global_step
        else:
            self._take(state, control, None)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        if self._pending == state.global_step:
            self._take(state, control, logs)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._pending is not None:   # a log that never came: before the next step, the state is still the step's
            self._take(state, control, None)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._pending is not None:
            self._take(state, control, None)
        self.close()

    # ---- the rest -------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for every snapshot to commit and stop the snapshotter; a failed snapshot is raised here."""
        snap, self.snapshotter = self.snapshotter, None
        if snap is not None:
            snap.close()

    def _due(self, state: Any) -> bool:
        step = state.global_step
        return step % self.every_n_steps == 0 or (self.save_final and bool(state.max_steps)
                                                  and step >= state.max_steps)

    def _take(self, state: Any, control: Any, logs: dict[str, Any] | None) -> None:
        self._pending = None
        if not self._objects:
            return   # not training (on_train_begin has not run)
        # every rank reaches each save point at the same step, so the gather's collective is safe here
        rng: Any = gathered_rng_states() if self._world_size > 1 else rng_states()
        if self.snapshotter is None:
            return
        snapshot: dict[str, Any] = dict(self._objects)
        snapshot[RNG_KEY] = rng
        snapshot[TRAINER_STATE_KEY] = trainer_state(state, control)
        if self._config is not None:
            snapshot[CONFIG_KEY] = self._config
        metrics = {k: v for k, v in (logs or {}).items() if is_number(v)}
        step = state.global_step
        self.handles.append(self.snapshotter.snapshot(snapshot, step=step, message=self.message.format(step=step),
                                                      metrics=metrics))


def _distributed_ready(world_size: int) -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size


def trainer_state(state: Any, control: Any) -> dict[str, Any]:
    """``TrainerState`` as the plain data ``trainer_state.json`` holds, the control's flags recorded as
    ``Trainer._save_checkpoint`` records them."""
    out = dataclasses.asdict(state)
    callbacks = out.get("stateful_callbacks")
    if isinstance(callbacks, dict) and callable(getattr(control, "state", None)):
        callbacks[type(control).__name__] = control.state()
    return out


@functools.cache
def _callback_class() -> type:
    from transformers import TrainerCallback

    class CkptRepoCallback(_Hooks, TrainerCallback):
        """A ``TrainerCallback`` that snapshots the training state into a ckptrepo repository, asynchronously,
        every ``every_n_steps`` optimizer steps (and at the last step, unless ``save_final=False``).

        Each version holds the model, the optimizer, the LR scheduler, the RNG states (Python, numpy, torch; CUDA
        when present), ``TrainerState`` as plain data and the model's config (``hf_config``); its metrics are
        those the Trainer logs at that step. ``repo`` is a ``Repository`` or a path/URL (created if missing);
        other keywords go to ``repo.snapshotter()``. Resume with ``checkpoint_folder``.

        Under DDP (torchrun, every rank a full replica) rank 0 alone opens the repository and snapshots the
        whole state (``single_process=True``); every rank's RNG states are gathered at each save point and
        stored as a list in rank order. FSDP, DeepSpeed and other sharding inside Trainer are refused.
        """

    CkptRepoCallback.__module__ = __name__
    return CkptRepoCallback


def __getattr__(name: str) -> Any:
    if name == "CkptRepoCallback":
        return _callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:
    CkptRepoCallback = _Hooks


def checkpoint_folder(repo: Repository | str | os.PathLike[str], rev: str = "HEAD",
                      out: str | os.PathLike[str] | None = None) -> str:
    """Write version ``rev`` (saved by ``CkptRepoCallback``) as a Trainer checkpoint folder and return its path,
    for ``trainer.train(resume_from_checkpoint=checkpoint_folder(url, "@1000"))``: the run goes on exactly as
    from the Trainer's own checkpoint of that step.

    ``out``: the folder to write (new, or empty), the caller's to keep. Default: a new folder of this process
    in the temp directory, private to the user (mode 0700: it holds the optimizer and RNG states), removed
    when the process exits. Under DDP every rank calls it and writes its own."""
    from ckptrepo.tools import export_target, write_then_rename
    r = repo if isinstance(repo, Repository) else open_repo(repo_url(repo))
    vid = r.resolve(rev)
    if out is not None:
        path = export_target(out, "hf", repo_root=r.local_root)
        state = r.load(vid)
        try:
            write_then_rename(path, lambda tmp: save_trainer_checkpoint(state, tmp))
        except ExchangeError as err:
            raise ExchangeError(f"version {vid[:12]}: {err}") from None
        return str(path)
    return str(_write_private(vid, r.version(vid).step, r.load(vid)))


_made: list[str] = []   # the private folders this process made, removed at exit
_made_lock = threading.Lock()


def _write_private(vid: str, step: int | None, state: Any) -> Path:
    """Write the checkpoint folder inside a new private folder of the temp directory: ``mkdtemp`` makes it
    under a name nobody can have made before, mode 0700 and owned by this user, so no folder another user
    planted (or could read) is ever used. Removed at exit: Trainer reads it when ``train()`` starts."""
    base = Path(tempfile.mkdtemp(prefix=f"ckptrepo-hf-{vid[:12]}-"))
    with _made_lock:
        if not _made:
            atexit.register(_remove_made, os.getpid())
        _made.append(str(base))
    path = base / f"checkpoint-{step}"
    try:
        save_trainer_checkpoint(state, path)
        os.chmod(path, 0o700)
    except ExchangeError as err:
        shutil.rmtree(base, ignore_errors=True)
        raise ExchangeError(f"version {vid[:12]}: {err}") from None
    except OSError as err:
        shutil.rmtree(base, ignore_errors=True)
        raise ExchangeError(f"could not write {path}: {err.strerror or err}; nothing was left there") from None
    return path


def _remove_made(pid: int) -> None:
    if os.getpid() != pid:   # a forked child inherits the list, not the folders
        return
    with _made_lock:
        made, _made[:] = list(_made), []
    for folder in made:
        shutil.rmtree(folder, ignore_errors=True)


__all__ = ["CkptRepoCallback", "checkpoint_folder", "hf_config", "rng_states", "trainer_state"]
