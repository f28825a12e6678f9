"""Export a version as a plain checkpoint (torch.save, safetensors, DCP, an HF model folder) and import one as a
new version (the HF folder's code: tools/_hf_export.py).

``Repository.export`` loads through ``Repository.load`` and hands the state to
``write_export``, so it writes the full, unsharded state whatever layout it was
saved from. ``Repository.import_state`` reads one of those formats with
``read_checkpoint`` and commits it with ``Repository.snapshot``, so an imported
version is an ordinary one. This module only reads and writes files: it never
sees a repository.

Trust: a ``torch.save`` file is a pickle and a DCP checkpoint's ``.metadata`` (and
its non-tensor values) are pickles, and unpickling can run arbitrary code.
torch files are therefore read with torch's restricted unpickler
(``weights_only=True``) unless the caller passes ``trust=True``, and DCP
checkpoints are refused without it. The safetensors export (``model.safetensors``
plus ``objects.json``, see docs/format.md) contains no pickle and needs no trust:
its objects are rebuilt from the same skeleton types a version stores.
"""
from __future__ import annotations

import base64
import collections
import json
import logging
import math
import os
import pickle
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from ckptrepo.arguments import is_whole
from ckptrepo.errors import ExchangeError, TrustRequiredError, first_line, os_error_line
from ckptrepo.state import flatten, unflatten
from ckptrepo.storage import fsync_path
from ckptrepo.tools._hf_export import (
    INDEX_FILE,
    is_model_folder,
    load_model_folder,
    looks_like_model_folder,
    save_model_folder,
    shard_bytes,
)
from ckptrepo.tools._paths import check_parent, local_path, refuse_inside

FORMATS = ("torch", "safetensors", "dcp", "hf")
SAFETENSORS_FILE = "model.safetensors"
OBJECTS_FILE = "objects.json"
OBJECTS_FORMAT = "ckptrepo-objects"
OBJECTS_FORMAT_VERSION = 1
DCP_METADATA = ".metadata"
_SAFETENSORS_UNSUPPORTED = ("complex128",)   # safetensors has no 128-bit complex type
_NO_PG_WARNING = "torch.distributed is disabled"   # DCP's notice that it runs in one process, which we intend


def export_target(out: str | os.PathLike[str], format: str, force: bool = False,  # noqa: A002
                  repo_root: str | None = None, max_shard_size: int | str | None = None) -> Path:
    """The local path an export of ``format`` writes, checked before the version is loaded: ``torch`` writes a
    file, ``safetensors``, ``dcp`` and ``hf`` a directory, created if missing. An existing file, or a non-empty
    directory, is an error unless ``force``; even then a directory is replaced only if it holds an export of
    that format (``--force`` must never empty a folder of other files). Nothing is written inside the
    repository at ``repo_root`` (a local repository's folder). ``max_shard_size`` (``hf`` only) is checked here
    too."""
    if format not in FORMATS:
        raise ExchangeError(f"unknown export format {format!r}; use one of {', '.join(FORMATS)}")
    if max_shard_size is not None:
        if format != "hf":
            raise ExchangeError(f"a max shard size applies to the hf format only, not {format}")
        shard_bytes(max_shard_size)
    path = local_path(out, "export to")
    refuse_inside(path, repo_root, "export to")
    _check_free(path, directory=format != "torch", force=force, format=format)
    return path


def write_export(state: Any, vid: str, path: Path, format: str,  # noqa: A002
                 max_shard_size: int | str | None = None) -> None:
    """Write ``state``, the full state of version ``vid``, to ``path`` (from ``export_target``) as ``format``;
    ``max_shard_size``: the largest safetensors file of an ``hf`` export (tools/_hf_export.py)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:   # a file where a folder of the path should be, no permission, ...
        raise ExchangeError(f"cannot make the folder {path.parent} ({first_line(err)}); export to another "
                            f"path") from None
    if format == "torch":
        plain = weights_only_state(state)
        write_then_rename(path, lambda tmp: torch.save(plain, tmp))
    elif format == "safetensors":
        write_then_rename(path, lambda tmp: _save_safetensors(state, tmp, vid))
    elif format == "hf":
        write_then_rename(path, lambda tmp: save_model_folder(state, tmp, max_shard_size))
    else:
        write_then_rename(path, lambda tmp: _save_dcp(state, tmp))


def write_then_rename(path: Path, write: Callable[[Path], None]) -> None:
    """``write`` a file or directory under a temporary name beside ``path``, renamed into place once complete;
    on failure the temporary is removed and the error says so. Written in place, a full disk would leave a
    truncated torch file, or a DCP checkpoint directory, at ``path``, which the next export would refuse to
    overwrite. What was written is made durable before the rename and the rename after it: a machine that
    loses power finds the old ``path`` or the whole new one, never a name without its bytes."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")

    def discard() -> None:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
    try:
        write(tmp)
        _sync_tree(tmp)
        if path.is_dir():         # an empty directory, or an export --force replaces (see _check_free)
            shutil.rmtree(path)
        os.replace(tmp, path)
        fsync_path(path.parent)       # the folder's entry: the rename itself
    except ExchangeError:         # refused before anything was written (a dtype safetensors lacks, ...)
        discard()
        raise
    except BaseException as err:  # DCP's CheckpointException derives from BaseException, over many lines
        discard()
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        raise ExchangeError(f"could not write {path}: {_dcp_cause(err)}; nothing was left there") from None


def _sync_tree(path: Path) -> None:
    """fsync the file at ``path`` or, for a folder, every file in it and every folder's entries."""
    if not path.is_dir():
        fsync_path(path)
        return
    for root, _, files in os.walk(path):
        for name in files:
            fsync_path(Path(root, name))
        fsync_path(Path(root))


def read_checkpoint(path: str | os.PathLike[str], trust: bool = False) -> tuple[Any, str]:
    """The state in the checkpoint at ``path`` and where it came from ("PATH (FORMAT)", for the version's
    message). The format is detected from the path (see :func:`detect_format`); a read that fails, or is
    refused for lack of ``trust``, raises before anything is committed."""
    p = local_path(path, "import from")
    kind = detect_format(p)
    if kind == "torch":
        state = _load_torch(p, trust)
    elif kind == "dcp":
        state = _load_dcp(p, trust)
    elif kind == "hf":
        state = load_model_folder(p)
    else:
        state = _load_safetensors(p)
    return state, f"{p} ({kind})"


def detect_format(path: Path) -> str:
    """The format at ``path``: ``dcp`` (a directory with ``.metadata``), ``hf`` (an HF model folder:
    ``config.json`` and ``model.safetensors``, or a sharded one's index), ``safetensors`` (a directory with
    ``model.safetensors``) or ``torch`` (a file)."""
    if path.is_dir():
        if (path / DCP_METADATA).is_file():
            return "dcp"
        if not (path / OBJECTS_FILE).is_file() and looks_like_model_folder(path):
            return "hf"
        if (path / SAFETENSORS_FILE).is_file():
            return "safetensors"
        raise ExchangeError(f"{path} is a directory but neither a DCP checkpoint (no {DCP_METADATA}), a safetensors "
                            f"export nor an HF model folder (no {SAFETENSORS_FILE} or {INDEX_FILE})")
    if path.is_file():
        return "torch"
    raise ExchangeError(f"{path} does not exist; import a torch.save file, a DCP checkpoint directory or a "
                        f"safetensors export directory")


def _check_free(path: Path, directory: bool, force: bool = False, format: str = "torch") -> None:  # noqa: A002
    if path.is_symlink() and not path.exists():
        raise ExchangeError(f"{path} is a broken link; export to a new path")
    if not path.exists():
        check_parent(path)
        return
    if directory and path.is_dir() and not any(path.iterdir()):
        return
    if not force:
        raise ExchangeError(f"{path} already exists; pass --force to overwrite it, or export to a new path")
    if directory and path.is_dir() and _is_export(path, format):
        return
    if not directory and path.is_file():
        return
    kind = "folder" if path.is_dir() else "file" if path.is_file() else "special file"
    raise ExchangeError(f"{path} is a {kind} that holds no {format} export, so --force does not replace it; "
                        f"export to a new path")


def _is_export(path: Path, format: str) -> bool:  # noqa: A002
    """Whether the folder ``path`` holds a ``format`` export and nothing else: what --force may replace."""
    names = {p.name for p in path.iterdir()}
    if format == "safetensors":
        return names <= {SAFETENSORS_FILE, OBJECTS_FILE} and SAFETENSORS_FILE in names
    if format == "hf":
        return is_model_folder(names)
    return DCP_METADATA in names and all(n == DCP_METADATA or n.endswith(".distcp") for n in names)


# ---- torch.save --------------------------------------------------------------------------------------------------
def weights_only_state(state: Any, path: str = "state") -> Any:
    """``state`` with every value torch's restricted unpickler (``torch.load(weights_only=True)``) refuses made
    into one it accepts: a numpy array becomes a tensor, a numpy scalar a Python number, and a numpy Generator
    its bit generator's state (a dict of ints). So a torch export loads, and imports back, without trust."""
    import numpy as np
    if isinstance(state, dict):
        items = ((k, weights_only_state(v, f"{path}[{k!r}]")) for k, v in state.items())
        return collections.OrderedDict(items) if isinstance(state, collections.OrderedDict) else dict(items)
    if isinstance(state, (list, tuple)):
        values = [weights_only_state(v, f"{path}[{i}]") for i, v in enumerate(state)]
        return values if isinstance(state, list) else tuple(values)
    if isinstance(state, np.ndarray):
        try:
            return torch.from_numpy(np.ascontiguousarray(state).copy())
        except (TypeError, RuntimeError):
            raise ExchangeError(f"{path} is a numpy array of dtype {state.dtype}, which a torch export cannot hold "
                                f"as a tensor; export with --format safetensors") from None
    if isinstance(state, np.generic):
        value = state.item()
        if not isinstance(value, (bool, int, float, complex, str, bytes)):
            raise ExchangeError(f"{path} is a numpy {state.dtype} value, which a torch export cannot hold as a "
                                f"plain value; export with --format safetensors")
        return value
    random = sys.modules.get("numpy.random")   # no Generator exists unless something imported numpy.random
    if random is not None and isinstance(state, random.Generator):
        return weights_only_state(state.bit_generator.state, path)
    return state


def state_step(state: Any) -> int | None:
    """The training step a checkpoint holds: an int under the key ``step`` at its top (as most training loops
    save it, and as ckptrepo's examples do), or None. ``import`` records it as the version's step."""
    step = state.get("step") if isinstance(state, dict) else None
    if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_floating_point():
        step = step.item()
    return step if is_whole(step) and -(1 << 63) <= step < (1 << 63) else None


def _load_torch(path: Path, trust: bool) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=not trust)
    except pickle.UnpicklingError as err:
        unsafe = [] if trust else _unsafe_globals(path, err)
        if unsafe:
            named = ", ".join(unsafe[:3]) + (", ..." if len(unsafe) > 3 else "")
            raise TrustRequiredError(
                f"{path} can only be loaded with full pickle (it names {named}), which can run arbitrary code; "
                f"import it with --trust (trust=True) only if you trust where it came from") from None
        # torch's restricted-unpickler message is a wall of advice about trusting the file; it is not the problem here
        detail = f": {first_line(err)}" if trust else ""
        raise ExchangeError(f"cannot read {path} as a torch.save file (it is not one, or it is damaged){detail}") \
            from None
    except Exception as err:  # noqa: BLE001 - torch raises many types for a file that is not a checkpoint
        raise ExchangeError(f"cannot read {path} as a torch.save file: {cause(err)}") from None


def _unsafe_globals(path: Path, err: pickle.UnpicklingError) -> list[str]:
    """The globals the restricted unpickler refuses: torch lists them all for zip-format files; for older files
    its error names the first one."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # noqa: BLE001 - not a zip-format checkpoint
        return re.findall(r"GLOBAL ([\w.]+)", str(err))


# ---- DCP ---------------------------------------------------------------------------------------------------------
def _save_dcp(state: Any, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    if not isinstance(state, dict):
        raise ExchangeError(f"DCP stores a dict at the top of the state, not {type(state).__name__}; "
                            f"export with --format torch or safetensors")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_PG_WARNING)
        dcp.save(state, checkpoint_id=str(path), no_dist=True)   # its failures: see write_then_rename


def _dcp_cause(err: BaseException) -> str:
    """The first rank's own error inside DCP's CheckpointException (whose message is only "ranks:[0]")."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        err = next(iter(failures.values()))
        if isinstance(err, tuple):   # some versions keep (exception, traceback) per rank
            err = err[0]
    return cause(err)


def cause(err: BaseException) -> str:
    """The cause of a failed read or write, for a one-line error: an OS error in words, with what to do; a
    file that ends too soon as such (EOFError has no message); any other error with its type's name."""
    if isinstance(err, OSError) and err.strerror:
        return os_error_line(err)
    if isinstance(err, EOFError):
        return "it ends too soon (empty, or cut short); import a file that was written to the end"
    return f"{type(err).__name__}: {first_line(err)}"


def _load_dcp(path: Path, trust: bool) -> dict[str, Any]:
    """Read every value of a DCP checkpoint without a target state.

    This is what ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``
    does, minus the detour through a second file on disk.
    """
    if not trust:
        raise TrustRequiredError(f"{path} is a DCP checkpoint: its {DCP_METADATA} file and non-tensor values are "
                                 f"pickles, and loading them can run arbitrary code; import it with --trust "
                                 f"(trust=True) only if you trust where it came from")
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    state: dict[str, Any] = {}
    # DCP's loader logs each failed metadata read with its whole traceback, on the root logger; the cause is
    # raised below in one line, so while it runs those records are dropped (only records from DCP's own files)
    quiet = _DropRecordsFrom("torch/distributed/checkpoint/")
    logging.getLogger().addFilter(quiet)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_PG_WARNING)
            _load_state_dict(state, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(),
                             no_dist=True)
    except BaseException as err:   # DCP wraps per-rank failures in CheckpointException, a BaseException
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        raise ExchangeError(f"cannot read DCP checkpoint {path}: {_dcp_cause(err)}") from None
    finally:
        logging.getLogger().removeFilter(quiet)
    return state


class _DropRecordsFrom(logging.Filter):
    def __init__(self, path_part: str) -> None:
        super().__init__()
        self.path_part = path_part

    def filter(self, record: logging.LogRecord) -> bool:
        return self.path_part not in record.pathname.replace(os.sep, "/")


# ---- safetensors export ------------------------------------------------------------------------------------------
def _save_safetensors(state: Any, path: Path, vid: str) -> None:
    """``model.safetensors`` with every tensor under its logical name, ``objects.json`` with the skeleton.

    The skeleton is the one a version stores (providers.flatten), so loading
    needs no code from the export: only the skeleton's own types are rebuilt.
    """
    from safetensors.torch import save_file
    skeleton, records = flatten(state)
    for r in records:
        if r.name == "__metadata__":   # the header's reserved key: every reader would refuse the file
            raise ExchangeError("safetensors reserves the name '__metadata__', which this state uses for a tensor; "
                                "export with --format torch or dcp")
        if r.dtype in _SAFETENSORS_UNSUPPORTED:
            raise ExchangeError(f"safetensors cannot store tensor {r.name!r} of dtype {r.dtype}; "
                                f"export with --format torch or dcp")
    path.mkdir(parents=True)
    save_file({r.name: r.tensor.contiguous() for r in records}, str(path / SAFETENSORS_FILE), metadata={"format": "pt"})
    objects = {"format": OBJECTS_FORMAT, "format_version": OBJECTS_FORMAT_VERSION, "version": vid,
               "tensors": [r.name for r in records], "tree": _to_json(skeleton)}
    (path / OBJECTS_FILE).write_text(json.dumps(objects, allow_nan=False))


def _load_safetensors(path: Path) -> Any:
    """The state of a safetensors export; without ``objects.json``, a flat dict of the file's tensors."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        tensors = load_file(str(path / SAFETENSORS_FILE), device="cpu")
    except (SafetensorError, OSError) as err:
        raise ExchangeError(f"cannot read {path / SAFETENSORS_FILE}: {first_line(err)}") from None
    objects_path = path / OBJECTS_FILE
    if not objects_path.is_file():
        return tensors
    try:
        doc = json.loads(objects_path.read_text())
        if doc.get("format") != OBJECTS_FORMAT:
            raise ValueError(f"format is {doc.get('format')!r}, not {OBJECTS_FORMAT!r}")
        if doc.get("format_version", 0) > OBJECTS_FORMAT_VERSION:
            raise ValueError(f"format_version {doc['format_version']} is newer than this ckptrepo reads; upgrade")
        names = doc["tensors"]
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ValueError(f"tensor {missing[0]!r} is not in {SAFETENSORS_FILE}")

        def get_tensor(i: int, as_numpy: bool) -> Any:
            t = tensors[names[i]]
            return t.numpy() if as_numpy else t

        return unflatten(_from_json(doc["tree"]), get_tensor)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as err:
        raise ExchangeError(f"{objects_path} is not a valid ckptrepo objects file: {first_line(err)}") from None


def _to_json(node: Any) -> Any:
    """A skeleton node as JSON: bytes become {"bytes": base64}, non-finite floats {"float": "nan"|"inf"|"-inf"}."""
    if isinstance(node, list):
        return [_to_json(x) for x in node]
    if isinstance(node, bytes):
        return {"bytes": base64.b64encode(node).decode("ascii")}
    if isinstance(node, float) and not math.isfinite(node):
        return {"float": repr(node)}
    return node


def _from_json(node: Any) -> Any:
    if isinstance(node, list):
        return [_from_json(x) for x in node]
    if isinstance(node, dict):
        if set(node) == {"bytes"}:
            return base64.b64decode(node["bytes"], validate=True)
        if set(node) == {"float"} and node["float"] in ("nan", "inf", "-inf"):
            return float(node["float"])
        raise ValueError(f"unknown encoded value {node!r}")
    return node
