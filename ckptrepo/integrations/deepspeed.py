"""DeepSpeed: a ``CheckpointEngine`` that saves each checkpoint tag as one ckptrepo version.

``DeepSpeedEngine.save_checkpoint(save_dir, tag)`` runs on every rank and calls
its checkpoint engine as ``create(info)``, then ``save(state_dict, path)`` once
per file this rank writes (``<save_dir>/<tag>/mp_rank_00_model_states.pt`` on
data-parallel rank 0, ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` on
every ZeRO rank), then ``commit(info)``, then writes ``<save_dir>/latest``
itself with ``open()``. Here ``save`` only keeps the state dict; ``commit``
snapshots every rank's files as one distributed version (each file's state
under its name, a per-rank entry of the rank that saved it), tags it with the
DeepSpeed tag (moving the tag when DeepSpeed saves the same tag again, as its
files would be overwritten) and returns once the snapshot is started: the
tensors are written while training goes on, and the optimizer's next
``step()`` waits only until they are captured.

DeepSpeed finds checkpoint files with ``glob`` and ``os.path.exists`` before
it asks the engine to load them, so each file's path holds a small JSON *stub*
naming the repository, the version and the entry; ``load`` reads the stub and
returns that entry of that version. A stub is rewritten only once its version
is committed, so a save of a tag that fails leaves the earlier save's stubs
naming its version, which the tag still names. The directories, the
stubs and ``latest`` are all that is on disk; the data is in the repository.

DeepSpeed picks its engine from the config with no registry
(``create_checkpoint_engine``), so the engine is swapped in after
``deepspeed.initialize`` with :func:`install`. No pickle: the few DeepSpeed
types in its state dicts (loss scalers, ``ZeroStageEnum``, the ZeRO
``fragment_address`` records) and ``argparse.Namespace`` and sets are stored as
plain data and rebuilt on load from a fixed list of types and attributes
(``_deepspeed_plain.py``); anything else that is not plain data, a tensor or a
numpy array is refused, naming the file and key. See
docs/decisions/028-deepspeed-engine.md and 044-untrusted-framework-data.md.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from typing import Any

import torch

from ckptrepo.errors import (
    ArgumentError,
    CkptRepoError,
    CorruptionError,
    RevisionError,
    StateMismatchError,
    StorageError,
    first_line,
)
from ckptrepo.integrations._deepspeed_plain import TYPE_KEY, from_plain, to_plain
from ckptrepo.repository import Repository, init, repo_url
from ckptrepo.storage import replace_file

ENGINE_NAME = "CkptRepoCheckpointEngine"
STUB_FORMAT = "ckptrepo-deepspeed-stub/1"
STUB_MAX_BYTES = 64 << 10
_registered = threading.Lock()
log = logging.getLogger("ckptrepo")


# ---- stubs: what DeepSpeed's glob and os.path.exists find ----------------------------------------------------------

def write_stub(path: str, url: str, vid: str, tag: str, entry: str, sync: bool = True) -> None:
    """Leave at ``path`` the stub of ``entry`` of version ``vid`` (replaced whole: a reader never sees half).

    ``sync=False`` skips the fsyncs: the training thread's placeholder stub, which the commit thread
    rewrites durably once the version commits (decision 041: no fsync on the training thread)."""
    text = json.dumps({"format": STUB_FORMAT, "repository": url, "version": vid, "tag": tag, "entry": entry})
    replace_file(path, text + "\n", sync=sync)


def read_stub(path: str) -> dict[str, str]:
    """The stub at ``path``; one line saying what is wrong when there is none or it is not one of ours."""
    try:
        with open(path, "rb") as f:
            raw = f.read(STUB_MAX_BYTES + 1)
    except OSError as err:
        raise StateMismatchError(f"{path}: cannot read the checkpoint stub ({err.strerror or err}); save the tag "
                                 f"with the ckptrepo engine first, or write the stubs with "
                                 f"ckptrepo.integrations.deepspeed.checkout()") from None
    try:
        stub = json.loads(raw) if len(raw) <= STUB_MAX_BYTES else None
    except ValueError:
        stub = None
    if not isinstance(stub, dict) or stub.get("format") != STUB_FORMAT \
            or not all(isinstance(stub.get(k), str) for k in ("version", "tag", "entry")):
        raise StateMismatchError(f"{path} is not a ckptrepo stub (a file DeepSpeed's own engine wrote?); load it "
                                 f"with DeepSpeed's default checkpoint engine")
    return stub


# ---- the engine -------------------------------------------------------------------------------------------------

class CkptRepoCheckpointEngine:
    """A DeepSpeed ``CheckpointEngine`` over the repository at ``url`` (created if there is none).

    ``wait``: ``commit`` returns once the version is committed (as the default engine returns once its files
    are written) instead of once the snapshot is started. ``snapshotter``: keyword arguments of
    ``repo.snapshotter`` (``host_memory``, ``retention``, ``push_to``, ...). Swap it in with :func:`install`,
    which also makes the optimizer's step wait for capture.
    """

    def __init__(self, url: str | os.PathLike[str], *, wait: bool = False,
                 snapshotter: dict[str, Any] | None = None, config_params: Any = None) -> None:
        _register_with_deepspeed()
        self.name = ENGINE_NAME
        self.url = repo_url(url)
        self.repo: Repository = init(self.url, exist_ok=True)
        self.wait = bool(wait)
        self._snapshotter_args = dict(snapshotter or {})
        self._snap: Any = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._info: Any = None                 # the CheckpointCommitInfo of the tag being saved
        self._files: dict[str, Any] = {}       # entry (path under <save_dir>/<tag>) -> its state, this rank
        self._paths: dict[str, str] = {}       # entry -> the path DeepSpeed gave
        self.last_handle: Any = None           # the SnapshotHandle of the last tag committed
        self._lock = threading.Lock()
        self._errors: list[CkptRepoError] = []   # stubs the commit thread could not write, raised by the next call

    def __repr__(self) -> str:
        return f"{ENGINE_NAME}({self.url!r})"

    # -- the optimizer whose step waits for capture
    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step()`` wait until the tensors of every started snapshot are captured."""
        self._optimizers.append(optimizer)
        if self._snap is not None:
            self._snap.attach(optimizer)

    def snapshotter(self) -> Any:
        """The snapshotter this engine commits through (made on first use, under torch.distributed's group)."""
        if self._snap is None:
            self._snap = self.repo.snapshotter(**self._snapshotter_args)
            for opt in self._optimizers:
                self._snap.attach(opt)
        return self._snap

    # -- CheckpointEngine
    def create(self, info: Any) -> None:
        """A tag's save starts: the files saved until ``commit`` make its version."""
        self._info = info
        self._files.clear()
        self._paths.clear()

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """Real directories: DeepSpeed writes ``latest`` and its recovery script there, and the stubs go there."""
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        """Keep ``state_dict`` for the tag's version; a file outside ``<save_dir>/<tag>/`` (``save_16bit_model``'s
        export for other tools) is written with ``torch.save`` as DeepSpeed's own engine would."""
        entry = self._entry(path)
        if entry is None:
            torch.save(state_dict, path)
            return
        if entry in self._files:
            raise ArgumentError(f"DeepSpeed saved {path} twice in one checkpoint; give each file its own path")
        self._files[entry] = to_plain(state_dict, entry)
        self._paths[entry] = path

    def commit(self, info: Any) -> bool:
        """Snapshot every rank's files of the tag as one version (collective: every rank calls it) and tag it;
        the stubs at the files' paths name it once it is committed (see ``_write_stubs``). A stub the commit
        thread could not write is raised by ``load`` or ``cleanup``, not here: one rank raising before the
        collective snapshot would leave the others waiting for it."""
        if self._info is None:
            return True
        files, paths, self._info = dict(self._files), dict(self._paths), None
        self._files.clear()
        self._paths.clear()
        step, count = self._agree(files)
        if count == 0:   # save_16bit_model: its one file is a plain torch file, and no rank kept anything
            return True
        tag = str(info.tag)
        snap = self.snapshotter()
        handle = snap.snapshot(files, step=step, message=f"DeepSpeed checkpoint {tag}", tag=tag, force_tag=True,
                               meta={"deepspeed.tag": tag, "deepspeed.save_dir": str(info.save_dir)})
        self.last_handle = handle
        # a path with no stub yet gets one now: DeepSpeed's glob must find it for load to say, in one line, that
        # the version never committed should the run stop first. A stub already there names an earlier save of
        # the tag, intact until this one commits, so it is replaced only then
        for entry, path in paths.items():
            if not os.path.lexists(path):
                write_stub(path, self.url, handle.id, tag, entry, sync=False)
        stubs_written = threading.Event()
        handle.add_done_callback(lambda h: self._write_stubs(h, paths, tag, stubs_written))
        if self.wait:
            stubs_written.wait()
            handle.result()
            self._raise_failures()
        return True

    def _write_stubs(self, handle: Any, paths: dict[str, str], tag: str, written: threading.Event) -> None:
        """Commit thread: point the stubs at the committed version. After a failure the stubs stay as they are:
        those of an earlier save of the tag name its version, which the tag still names."""
        try:
            try:
                version = handle.result()
            except CkptRepoError:
                return   # the snapshotter raises it from the next call
            for entry, path in paths.items():
                write_stub(path, self.url, version.id, tag, entry)
        except Exception as err:  # noqa: BLE001 - the commit thread goes on; the next call raises it
            failure = StorageError(f"version {handle.id[:12]} of DeepSpeed tag {tag!r} is committed, but its stubs "
                                   f"were not written: {first_line(err)}; write them with "
                                   f"ckptrepo.integrations.deepspeed.checkout()")
            log.error("ckptrepo: %s", failure)
            with self._lock:
                self._errors.append(failure)
        finally:
            written.set()

    def _raise_failures(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def load(self, path: str, map_location: Any = None) -> Any:
        """The state saved under ``path``: the entry its stub names, of the version its stub names."""
        if self._snap is not None:
            self._snap.wait()   # a tag saved by this process loads once committed and its stubs are written
        self._raise_failures()
        stub = read_stub(path)
        vid = stub["version"]
        try:
            vid = self.repo.resolve(vid)
        except RevisionError:
            raise RevisionError(f"{path}: version {vid[:12]} of DeepSpeed tag {stub['tag']!r} is not in {self.url} "
                                f"(its snapshot did not commit: the run stopped first?); load an earlier tag") \
                from None
        from ckptrepo.loading import load_entry
        state = from_plain(load_entry(self.repo.plumbing, vid, stub["entry"]), f"{path}: {stub['entry']}")
        device = _device(map_location)
        return state if device is None else _to(state, device)

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        """Data-parallel rank 0 writes the model file, as DeepSpeed's own engine decides (DeepSpeed asked its
        first engine at initialize; the answer must not change)."""
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        """False: DeepSpeed calls ``commit`` inside ``save_checkpoint``; the snapshot is asynchronous anyway."""
        return False

    def set_commit_info(self, info: Any) -> None:
        pass

    def get_commit_info(self) -> Any:
        return None

    def cleanup(self) -> None:
        """Wait for the pending snapshots and stop the snapshotter's threads."""
        if self._snap is not None:
            snap, self._snap = self._snap, None
            snap.close()
        self._raise_failures()

    close = cleanup

    def preserves_storage_sharing(self) -> bool:
        """False: DeepSpeed need not clone views before ``save`` (for torch.save, which would write the whole
        storage behind a view); a snapshot stores each tensor's own elements only."""
        return False

    # -- helpers
    def _entry(self, path: str) -> str | None:
        """The entry ``path`` is saved under: its path below ``<save_dir>/<tag>/``, or None outside one."""
        if self._info is None:
            return None
        root = os.path.abspath(os.path.join(str(self._info.save_dir), str(self._info.tag)))
        full = os.path.abspath(path)
        if not full.startswith(root + os.sep):
            return None
        return os.path.relpath(full, root).replace(os.sep, "/")

    def _agree(self, files: dict[str, Any]) -> tuple[int | None, int]:
        """The step every rank records (DeepSpeed's ``global_steps``, which only the model file's rank holds)
        and the number of files saved on all ranks: one exchange, so that every rank snapshots or none does."""
        steps = [v["global_steps"] for v in files.values() if isinstance(v, dict)
                 and isinstance(v.get("global_steps"), int)]
        mine = (max(steps) if steps else None, len(files))
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return mine
        from ckptrepo.parallel import all_gather
        every = all_gather(mine)
        known = [s for s, _ in every if s is not None]
        return (max(known) if known else None), sum(n for _, n in every)


def _device(map_location: Any) -> torch.device | None:
    """Where ``load`` puts the tensors: a device DeepSpeed names; None (the CPU, where they are read) for a
    ``map_location`` function (``lambda storage, loc: storage`` keeps them where they are)."""
    if map_location is None or callable(map_location):
        return None
    if isinstance(map_location, dict):
        return None
    dev = torch.device(map_location)
    return None if dev.type == "cpu" else dev


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        items = [(k, _to(v, device)) for k, v in obj.items()]
        return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
    if isinstance(obj, list):
        return [_to(v, device) for v in obj]
    if type(obj) is tuple:
        return tuple(_to(v, device) for v in obj)
    return obj


def _register_with_deepspeed() -> None:
    """Make the engine an ``isinstance`` of DeepSpeed's ``CheckpointEngine`` ABC (DeepSpeed itself only calls
    its methods), without importing DeepSpeed before an engine is made."""
    with _registered:
        from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (  # type: ignore[import-untyped]
            CheckpointEngine,
        )
        if not issubclass(CkptRepoCheckpointEngine, CheckpointEngine):
            CheckpointEngine.register(CkptRepoCheckpointEngine)


def checkout(url: str | os.PathLike[str], save_dir: str | os.PathLike[str], rev: str = "HEAD",
             tag: str | None = None) -> list[str]:
    """Write what DeepSpeed's ``load_checkpoint(save_dir)`` needs on disk for version ``rev`` of the repository
    at ``url``: a stub per file under ``<save_dir>/<tag>/`` and ``<save_dir>/latest`` naming ``tag``.

    For a machine that has the repository (a clone, a remote) but not the directory that saved it. ``tag``
    defaults to the DeepSpeed tag the version recorded. Returns the stub paths. Needs no DeepSpeed.
    """
    from ckptrepo.loading import entry_keys
    from ckptrepo.repository import open as open_repo
    repo = open_repo(url)
    vid = repo.resolve(rev)
    version = repo.version(vid)
    tag = tag or version.meta.get("deepspeed.tag")
    if not tag:
        raise ArgumentError(f"version {vid[:12]} was not saved by the DeepSpeed engine (it records no DeepSpeed "
                            f"tag); pass tag= to name the directory")
    _below(vid, tag, "DeepSpeed tag")
    entries = [str(e) for e in entry_keys(repo.plumbing.manifest(vid))]
    for entry in entries:   # all checked before anything is written
        _below(vid, entry, "file")
    root = os.path.join(os.fspath(save_dir), tag)
    paths = []
    for entry in entries:
        path = os.path.join(root, *entry.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_stub(path, repo.url, vid, tag, str(entry))
        paths.append(path)
    replace_file(os.path.join(os.fspath(save_dir), "latest"), tag)
    return paths


def _below(vid: str, name: str, what: str) -> None:
    """Refuse a tag or file name of a version that would put a stub outside ``<save_dir>/<tag>/``: the names
    come from the repository, which must never choose where ckptrepo writes."""
    parts = name.split("/")
    if any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts) or os.path.isabs(name):
        raise CorruptionError(f"version {vid[:12]} names the {what} {name[:80]!r}, which is no path below the "
                              f"checkpoint directory (the DeepSpeed engine never saves one); checkout writes "
                              f"nothing outside save_dir: load it with repo.load instead")


# ---- swapping the engine in -------------------------------------------------------------------------------------

def step_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizer whose ``step`` changes the saved tensors in place, under DeepSpeed's wrappers (ZeRO's
    ``DeepSpeedZeroOptimizer``, ``FP16_Optimizer``, ``BF16_Optimizer`` each hold it as ``.optimizer``)."""
    found: list[torch.optim.Optimizer] = []
    seen: set[int] = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        if isinstance(optimizer, torch.optim.Optimizer):
            found = [optimizer]   # the innermost wins: a wrapper's step calls it
        optimizer = getattr(optimizer, "optimizer", None)
    return found


def install(engine: Any, url: str | os.PathLike[str], **kwargs: Any) -> CkptRepoCheckpointEngine:
    """Make the DeepSpeed ``engine`` (from ``deepspeed.initialize``) save and load its checkpoints through the
    repository at ``url``; keyword arguments go to :class:`CkptRepoCheckpointEngine`.

    DeepSpeed keeps its checkpoint engine in one attribute, ``engine.checkpoint_engine`` (a ``PipelineEngine``
    too; the ZeRO optimizers hold none), which this replaces. The optimizer under DeepSpeed's wrappers is
    attached, so its step waits until a started snapshot has captured the tensors it changes.
    """
    if not hasattr(engine, "checkpoint_engine"):
        raise ArgumentError(f"install() takes the DeepSpeed engine deepspeed.initialize returned, not "
                            f"{type(engine).__name__}")
    ours = CkptRepoCheckpointEngine(url, **kwargs)
    for opt in step_optimizers(getattr(engine, "optimizer", None)):
        ours.attach(opt)
    old = engine.checkpoint_engine
    if old is not None and getattr(old, "is_decoupled", lambda: False)():
        old.cleanup()   # a decoupled engine holds a save not committed yet
    engine.checkpoint_engine = ours
    return ours


__all__ = ["CkptRepoCheckpointEngine", "ENGINE_NAME", "TYPE_KEY", "checkout", "from_plain", "install", "read_stub",
           "step_optimizers", "to_plain", "write_stub"]
