"""Hugging Face folders: a version's model as an HF model folder, such a folder read back, and a Trainer
checkpoint folder that ``Trainer.train(resume_from_checkpoint=...)`` resumes from.

The state holds the model's ``state_dict()`` under ``model`` and, when it came
from a transformers model, ``model.config.to_dict()`` under ``hf_config``
(``ckptrepo.integrations.hf.CkptRepoCallback`` saves it so; an imported HF
folder is stored the same way). An export writes those tensors under the names
``model.state_dict()`` uses, with the copies of tied weights dropped (as
``save_pretrained`` does), sharded above a size with HF's index file.

An export ``from_pretrained`` would load with random weights is the failure to
avoid: its loader only warns about missing names. So when transformers is
installed, the names are checked against the model ``config.json`` describes,
built on the meta device (no memory, no download), and any missing or foreign
name refuses the export. Nothing here needs transformers otherwise.
"""
from __future__ import annotations

import collections
import importlib.util
import json
import logging
import re
from pathlib import Path
from typing import Any, Iterator

import torch

from ckptrepo.errors import ArgumentError, ExchangeError, first_line, some_names
from ckptrepo.saving import parse_size

MODEL_KEY = "model"
CONFIG_KEY = "hf_config"
OPTIMIZER_KEY = "optimizer"
SCHEDULER_KEY = "scheduler"
RNG_KEY = "rng"
TRAINER_STATE_KEY = "trainer_state"

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
DEFAULT_MAX_SHARD_SIZE = "5GB"
# the files of a Trainer checkpoint folder (transformers.trainer's names)
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng_state.pth"
RANK_RNG_FILE = "rng_state_{}.pth"   # one per process of a multi-process run, by its process index
TRAINER_STATE_FILE = "trainer_state.json"

# HF's size units: "5GB" is 5 * 10**9 bytes, "5GiB" 5 * 2**30 (transformers' and huggingface_hub's parse)


def shard_bytes(size: int | str | None) -> int:
    """The largest shard an export writes, in bytes: an int, or text with HF's units (``"5GB"`` is 5 * 10**9
    bytes, ``"5GiB"`` 5 * 2**30); None: HF's default, 5GB."""
    try:
        n = parse_size(DEFAULT_MAX_SHARD_SIZE if size is None else size, "max shard size")
    except ArgumentError:
        raise ExchangeError(f"max shard size {size!r} is not a size; pass bytes (an int > 0) or text like '5GB' "
                            f"or '500MB'") from None
    assert n is not None
    return n


# ---- the model in a state -------------------------------------------------------------------------------------
def model_weights(state: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The model's tensors by their ``state_dict()`` names, and its HF config if the state holds one.

    The weights are ``state["model"]``; a state that is itself a dict of tensors (``repo.snapshot(
    model.state_dict())``) is taken whole."""
    if not isinstance(state, dict):
        raise ExchangeError(f"an hf export takes a state that is a dict with the model's state_dict under "
                            f"{MODEL_KEY!r}, not a {type(state).__name__}; export with --format torch or safetensors")
    config = state.get(CONFIG_KEY)
    if config is not None and not isinstance(config, dict):
        raise ExchangeError(f"the state's {CONFIG_KEY!r} is a {type(config).__name__}, not the dict "
                            f"model.config.to_dict() gives")
    if MODEL_KEY in state:
        weights, where = state[MODEL_KEY], f"state[{MODEL_KEY!r}]"
    elif state and all(isinstance(v, torch.Tensor) for v in state.values()):
        weights, where = state, "the state"
    else:
        raise ExchangeError(f"the state holds no model weights: no {MODEL_KEY!r} key and not a dict of tensors; "
                            f"snapshot {{{MODEL_KEY!r}: model, ...}} (CkptRepoCallback does) or export with "
                            f"--format safetensors")
    if not isinstance(weights, dict) or not weights:
        raise ExchangeError(f"{where} is not a model's state_dict (a dict of name -> tensor); export with "
                            f"--format safetensors")
    for name, value in weights.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise ExchangeError(f"{where} holds {type(value).__name__} under {name!r}, but a model's state_dict "
                                f"maps names to tensors; export with --format safetensors")
    return dict(weights), config


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def _ties_by_name(weights: dict[str, torch.Tensor], config: dict[str, Any] | None) -> dict[str, str]:
    """Without transformers to ask: with a config that ties the word embeddings (HF's default), an
    ``lm_head.weight`` whose bytes equal another tensor's is that tensor's tied copy."""
    if config is None or not config.get("tie_word_embeddings", True):
        return {}
    ties = {}
    for name, t in weights.items():
        if name.endswith("lm_head.weight"):
            source = next((n for n, u in weights.items() if n != name and _same_bytes(t, u)), None)
            if source is not None:
                ties[name] = source
    return ties


class ModelNames:
    """What the model ``config.json`` describes holds: each tensor's name and shape, and its tied weights
    (``{copy: source}``, the copies that ``save_pretrained`` leaves out)."""

    def __init__(self, cls: str, shapes: dict[str, tuple[int, ...]], ties: dict[str, str]) -> None:
        self.cls = cls
        self.shapes = shapes
        self.ties = ties


def model_names(folder: Path) -> ModelNames | None:
    """The model the ``config.json`` in ``folder`` describes, built on the meta device; None when transformers
    is not installed (the names are then not checked)."""
    if importlib.util.find_spec("transformers") is None:
        return None
    import transformers
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)   # config notes (token ids past a tiny vocabulary, ...) are not this export's
    try:
        config = transformers.AutoConfig.from_pretrained(str(folder))
        arch = (getattr(config, "architectures", None) or [None])[0]
        cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
        with torch.device("meta"):
            model = cls(config) if cls is not None else transformers.AutoModelForCausalLM.from_config(config)
    except Exception as err:  # noqa: BLE001 - transformers raises many types for a config it cannot build
        raise ExchangeError(f"transformers cannot build the model config.json describes ({type(err).__name__}: "
                            f"{first_line(err)}), so the export's names cannot be checked; fix the state's "
                            f"{CONFIG_KEY!r}") from None
    finally:
        quiet.setLevel(level)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    ties = dict(getattr(model, "all_tied_weights_keys", None) or {})
    return ModelNames(type(model).__name__, shapes, ties)


def untied(weights: dict[str, torch.Tensor], config: dict[str, Any] | None,
           model: ModelNames | None) -> dict[str, torch.Tensor]:
    """``weights`` without the copies of tied weights; with ``model``, refused unless the names and shapes are
    exactly the model's (a missing one would be initialised at random by ``from_pretrained``, a foreign one
    dropped, each with only a warning)."""
    ties = _ties_by_name(weights, config) if model is None else model.ties
    out = dict(weights)
    for copy, source in ties.items():
        if copy in out and source in out:
            if not _same_bytes(out[copy], out[source]):
                raise ExchangeError(f"the config ties {copy!r} to {source!r} but their values differ, so "
                                    f"from_pretrained would load {copy!r} as {source!r}; set tie_word_embeddings "
                                    f"in the state's {CONFIG_KEY!r} to match the model")
            del out[copy]
    if model is None:
        return out
    missing = [n for n in model.shapes if n not in out and n not in model.ties]
    foreign = [n for n in out if n not in model.shapes]
    if missing or foreign:
        counts = [_some(names, what) for names, what in ((missing, "missing"), (foreign, "not its own")) if names]
        raise ExchangeError(f"the weights do not match the {model.cls} that config.json describes: "
                            f"{', '.join(counts)}; from_pretrained would "
                            f"initialise the missing ones at random, so nothing was exported (snapshot the model "
                            f"itself, or its state_dict(), under {MODEL_KEY!r})")
    wrong = [n for n in out if tuple(out[n].shape) != model.shapes[n]]
    if wrong:
        n = wrong[0]
        raise ExchangeError(f"{n!r} has shape {list(out[n].shape)} but the {model.cls} config.json describes has "
                            f"{list(model.shapes[n])} ({len(wrong)} such); the state's {CONFIG_KEY!r} is not this "
                            f"model's config")
    return out


def _some(names: list[str], what: str) -> str:
    shown = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
    return f"{len(names)} {what}" + (f" ({shown})" if names else "")


# ---- writing a model folder -----------------------------------------------------------------------------------
def shards(weights: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """The names of each shard, in order, as ``save_pretrained`` splits them: a shard is filled until the
    next tensor would pass ``max_bytes``; a tensor larger than that has a shard of its own."""
    out: list[list[str]] = [[]]
    size = 0
    for name, t in weights.items():
        n = t.numel() * t.element_size()
        if out[-1] and size + n > max_bytes:
            out.append([])
            size = 0
        out[-1].append(name)
        size += n
    return out


def save_model_folder(state: Any, path: Path, max_shard_size: int | str | None = None) -> None:
    """Write the model of ``state`` to the new folder ``path`` as ``save_pretrained`` would: ``config.json``
    (when the state holds the config), ``model.safetensors``, or shards and ``model.safetensors.index.json``
    above ``max_shard_size``."""
    from safetensors.torch import save_file
    max_bytes = shard_bytes(max_shard_size)
    weights, config = model_weights(state)
    slashed = next((n for n in weights if "/" in n), None)
    if slashed is not None:
        raise ExchangeError(f"{slashed!r} is a path in the state, not a parameter name of a model's state_dict; "
                            f"snapshot the model (or model.state_dict()) under {MODEL_KEY!r}")
    path.mkdir(parents=True)
    if config is not None:
        try:
            text = json.dumps(config, indent=2, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise ExchangeError(f"the state's {CONFIG_KEY!r} cannot be written as config.json: {first_line(err)}") \
                from None
        (path / CONFIG_FILE).write_text(text + "\n")
    weights = untied(weights, config, model_names(path) if config is not None else None)
    groups = shards(weights, max_bytes)
    meta = {"format": "pt"}   # from_pretrained refuses a safetensors file without it
    if len(groups) == 1:
        save_file({n: weights[n].contiguous() for n in groups[0]}, str(path / WEIGHTS_FILE), metadata=meta)
        return
    weight_map = {}
    for i, names in enumerate(groups, 1):
        file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: weights[n].contiguous() for n in names}, str(path / file), metadata=meta)
        weight_map.update(dict.fromkeys(names, file))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def is_model_folder(names: set[str]) -> bool:
    """Whether the files ``names`` are an hf export and nothing else: what ``export --force`` may replace."""
    ours = {CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE}
    return bool(names) and all(n in ours or SHARD_RE.match(n) for n in names) \
        and (WEIGHTS_FILE in names or INDEX_FILE in names)


def looks_like_model_folder(path: Path) -> bool:
    """Whether the folder ``path`` is an HF model folder: sharded (an index file), or ``model.safetensors``
    beside a ``config.json``. (``model.safetensors`` alone is a safetensors export's.)"""
    return (path / INDEX_FILE).is_file() or ((path / WEIGHTS_FILE).is_file() and (path / CONFIG_FILE).is_file())


# ---- reading a model folder -----------------------------------------------------------------------------------
def load_model_folder(path: Path) -> dict[str, Any]:
    """The state of an HF model folder: its tensors under ``model`` (by their names in the files), its
    ``config.json`` under ``hf_config`` when there is one: the layout an export reads back."""
    state: dict[str, Any] = {MODEL_KEY: collections.OrderedDict(_read_weights(path))}
    config_path = path / CONFIG_FILE
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise ExchangeError(f"cannot read {config_path}: {first_line(err)}") from None
        if not isinstance(config, dict):
            raise ExchangeError(f"{config_path} holds a {type(config).__name__}, not a model config (an object)")
        state[CONFIG_KEY] = config
    return state


def _read_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    index_path = path / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise ValueError("weight_map is not an object of file names")
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
            raise ExchangeError(f"{index_path} is not a safetensors index: {first_line(err)}") from None
        files = list(dict.fromkeys(weight_map.values()))
    else:
        weight_map, files = {}, [WEIGHTS_FILE]
    found: dict[str, torch.Tensor] = {}
    for file in files:
        if "/" in file or "\\" in file or file.startswith("."):
            raise ExchangeError(f"{index_path} names {file!r}, which is not a file beside it")
        try:
            found.update(load_file(str(path / file), device="cpu"))
        except (SafetensorError, OSError) as err:
            raise ExchangeError(f"cannot read {path / file}: {first_line(err)}") from None
    missing = [n for n in weight_map if n not in found]
    if missing:
        raise ExchangeError(f"{index_path} lists {some_names([repr(n) for n in missing], 3)}, which its files "
                            f"lack; the folder is incomplete")
    names = list(weight_map) if weight_map else list(found)
    return iter([(n, found[n]) for n in names])


# ---- a Trainer checkpoint folder ------------------------------------------------------------------------------
def rng_files(rng: Any) -> list[tuple[str, Any]]:
    """The RNG files of a Trainer checkpoint and what each holds: ``rng_state.pth`` for one process's states (a
    dict), ``rng_state_{rank}.pth`` per rank for a multi-process run's (a list in rank order), which is
    where ``Trainer._load_rng_state`` looks when ``world_size > 1``."""
    if rng is None:
        return []
    if isinstance(rng, dict):
        return [(RNG_FILE, rng)]
    if isinstance(rng, (list, tuple)) and all(isinstance(r, dict) for r in rng):
        return [(RNG_FILE, rng[0])] if len(rng) == 1 else [(RANK_RNG_FILE.format(i), r) for i, r in enumerate(rng)]
    raise ExchangeError(f"the state's {RNG_KEY!r} is a {type(rng).__name__}, not one process's RNG states (a "
                        f"dict) or a list of them per rank")


def save_trainer_checkpoint(state: Any, path: Path) -> None:
    """Write the state ``CkptRepoCallback`` saved to the new folder ``path`` in the files ``Trainer`` reads
    when it resumes: the model folder, ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth`` (or, for a
    multi-process run's list of RNG states, ``rng_state_{rank}.pth`` per rank) and ``trainer_state.json`` (as
    ``Trainer._save_checkpoint`` writes them)."""
    if not isinstance(state, dict):
        raise ExchangeError(f"a Trainer checkpoint is made from a state saved by CkptRepoCallback (a dict), not a "
                            f"{type(state).__name__}")
    # Trainer loads the optimizer only when scheduler.pt is there too: without it, a resume would go on silently
    # with a fresh optimizer
    lacking = [k for k in (MODEL_KEY, OPTIMIZER_KEY, SCHEDULER_KEY, TRAINER_STATE_KEY) if state.get(k) is None]
    if lacking:
        raise ExchangeError(f"the state holds no {', '.join(map(repr, lacking))}: it was not saved by "
                            f"CkptRepoCallback, so Trainer cannot resume from it; load it with repo.load instead")
    trainer_state = state[TRAINER_STATE_KEY]
    if not isinstance(trainer_state, dict):
        raise ExchangeError(f"the state's {TRAINER_STATE_KEY!r} is a {type(trainer_state).__name__}, not the "
                            f"dict of TrainerState's fields")
    save_model_folder(state, path, max_shard_size=None)
    torch.save(state[OPTIMIZER_KEY], path / OPTIMIZER_FILE)
    torch.save(state[SCHEDULER_KEY], path / SCHEDULER_FILE)
    for name, rng in rng_files(state.get(RNG_KEY)):
        torch.save(rng, path / name)
    # as TrainerState.save_to_json writes it
    (path / TRAINER_STATE_FILE).write_text(json.dumps(trainer_state, indent=2, sort_keys=True) + "\n")


__all__ = ["CONFIG_KEY", "MODEL_KEY", "OPTIMIZER_KEY", "RNG_KEY", "SCHEDULER_KEY", "TRAINER_STATE_KEY",
           "DEFAULT_MAX_SHARD_SIZE", "is_model_folder", "load_model_folder", "looks_like_model_folder",
           "model_weights", "rng_files", "save_model_folder", "save_trainer_checkpoint", "shard_bytes", "shards",
           "untied"]
