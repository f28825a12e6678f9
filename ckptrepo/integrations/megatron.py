"""Megatron-core ``dist_checkpointing`` strategies that save into, and load from, a ckptrepo repository.

Megatron describes every tensor of a sharded state dict as a ``ShardedTensor``: a box (``global_offset``,
local shape, ``prepend_axis_num`` leading axes of size 1) of a global tensor named by its ``key``, held by
several ranks when ``replica_id`` is not all zeros. That is exactly a ckptrepo piece, so a save writes each
rank's main-replica boxes (``saving._pieces``) and rank 0 commits them as one version whose tensors carry
Megatron's global keys and shapes; a load reads each rank's boxes back, whatever world size or tensor
parallel split saved them.

``dist_checkpointing.save`` needs a local directory (it writes ``metadata.json`` and the common state there),
so the directory stays what Megatron-LM tracks per iteration and the tensors go to the repository::

    save(sharded_sd, "ckpts/iter_0000100", sharded_strategy=CkptRepoSaveStrategy(url))
    load(sharded_sd, "ckpts/iter_0000100")          # the backend is registered when this module is imported

The directory gets ``ckptrepo.json`` (the repository url and the version id) next to Megatron's own files.
The version holds everything without pickle: ``sharded/<key>`` (every ShardedTensor, global),
``objects/<unique key>`` (ShardedObjects) and ``common`` (the non-sharded state Megatron writes to
``common.pt``, read back with ``weights_only`` and stored through the skeleton). See
docs/decisions/029-megatron-strategy.md.
"""
from __future__ import annotations

import io
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ckptrepo.core import new_version_id
from ckptrepo.errors import (
    CkptRepoError,
    MissingDependencyError,
    SnapshotFailedError,
    StateMismatchError,
    UnsupportedValueError,
    first_line,
)
from ckptrepo.parallel import process_group_rank
from ckptrepo.repository import open as open_repo
from ckptrepo.saving import (
    GlobalChunk,
    commit_chunks,
    read_branch_base,
    read_chunks,
    tensor_order,
    write_rank_chunks,
)
from ckptrepo.state import DICT, NDARRAY, SCALAR, TENSOR, TORCH_DTYPES, flatten, key_value, unflatten
from ckptrepo.storage import replace_file

try:
    from megatron.core.dist_checkpointing.dict_utils import (  # type: ignore[import-untyped]
        dict_list_map_inplace,
        nested_values,
    )
    from megatron.core.dist_checkpointing.mapping import (  # type: ignore[import-untyped]
        ShardedObject,
        ShardedTensor,
        is_main_replica,
    )
    from megatron.core.dist_checkpointing.strategies.base import (  # type: ignore[import-untyped]
        LoadCommonStrategy,
        LoadShardedStrategy,
        SaveShardedStrategy,
        StrategyAction,
        register_default_strategy,
    )
except ImportError as _err:   # the adapter is useless without the framework: say how to get it
    raise MissingDependencyError(f"the Megatron-core integration needs megatron-core ({first_line(_err)}); "
                                 f"install it with: pip install 'ckptrepo[megatron]'") from None

log = logging.getLogger("ckptrepo")

BACKEND = "ckptrepo"          # the sharded backend recorded in metadata.json
BACKEND_VERSION = 1
POINTER_FILE = "ckptrepo.json"
COMMON_FILE = "common.pt"     # where Megatron's torch common strategy writes the non-sharded state
SHARDED, OBJECTS, COMMON = "sharded", "objects", "common"   # the version's top-level tree keys
_ITER_DIR = re.compile(r"iter_(\d+)$")


# ---- ShardedTensor <-> pieces ----------------------------------------------------------------------

def _box_sizes(st: Any) -> tuple[int, ...]:
    """The extent of a ShardedTensor's box in global coordinates (prepended axes have size 1)."""
    return (1,) * st.prepend_axis_num + tuple(st.local_shape)


def _check_plain(st: Any) -> None:
    """Refuse what a box cannot describe: a distributed optimizer's flat slice of a box."""
    if getattr(st, "flattened_range", None) is not None:
        raise UnsupportedValueError(f"ShardedTensor {st.key!r} has a flattened_range (a 1-D slice of its box); "
                                    f"save the distributed optimizer in a model-space format "
                                    f"(sharding_type='fully_sharded_model_space')")


def _chunk(st: Any, tensor: torch.Tensor) -> Any:
    """A GlobalChunk over ``tensor``, the data of ``st`` viewed with the box's rank."""
    return GlobalChunk(name=f"{SHARDED}/{st.key}", gshape=tuple(st.global_shape), offsets=tuple(st.global_offset),
                       tensor=tensor.reshape(_box_sizes(st)))


def _save_chunks(sharded: Sequence[Any]) -> list[Any]:
    """This rank's pieces: the main replica of each ShardedTensor it holds (another rank writes the rest)."""
    chunks = []
    for st in sharded:
        _check_plain(st)
        if not is_main_replica(st.replica_id):
            continue
        if st.data is None:
            raise UnsupportedValueError(f"ShardedTensor {st.key!r} holds no data to save")
        chunks.append(_chunk(st, st.data.detach()))
    return chunks


def step_from_dir(checkpoint_dir: str | os.PathLike[str]) -> int | None:
    """The iteration Megatron-LM puts in a checkpoint directory's name (``iter_0000100`` -> 100), if any."""
    found = _ITER_DIR.search(os.path.basename(os.path.normpath(str(checkpoint_dir))))
    return int(found.group(1)) if found else None


# ---- the pointer file ------------------------------------------------------------------------------

def write_pointer(checkpoint_dir: str | os.PathLike[str], url: str, version: str) -> None:
    """Record in a checkpoint directory which repository and version hold its tensors (written atomically)."""
    path = os.path.join(str(checkpoint_dir), POINTER_FILE)
    replace_file(path, json.dumps({"url": url, "version": version}))


def read_pointer(checkpoint_dir: str | os.PathLike[str]) -> tuple[str, str]:
    """(url, version) a checkpoint directory's pointer file names."""
    path = os.path.join(str(checkpoint_dir), POINTER_FILE)
    try:
        with open(path) as f:
            record = json.load(f)
        return str(record["url"]), str(record["version"])
    except FileNotFoundError:
        raise CkptRepoError(f"{checkpoint_dir} has no {POINTER_FILE}: it was not saved with CkptRepoSaveStrategy; "
                            f"pass the repository and revision: CkptRepoLoadStrategy(url, rev)") from None
    except (ValueError, KeyError, TypeError) as err:
        raise CkptRepoError(f"{path} is damaged ({first_line(err)}); pass the repository and revision: "
                            f"CkptRepoLoadStrategy(url, rev)") from None


def _url_for_pointer(url: str) -> str:
    """A local repository path made absolute, so the pointer works from any working directory."""
    return url if "://" in url else os.path.abspath(url)


# ---- collectives ----------------------------------------------------------------------------------

def _broadcast(value: Any, world: int) -> Any:
    """Rank 0's ``value`` on every rank."""
    if world == 1:
        return value
    import torch.distributed as dist
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(value: Any, world: int) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank."""
    if world == 1:
        return [value]
    import torch.distributed as dist
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value)
    return out


class _RankError:
    """A rank's failure, sent in place of its write so that every rank raises the same error."""

    def __init__(self, rank: int, err: BaseException) -> None:
        self.text = f"rank {rank}: {type(err).__name__}: {first_line(err)}"


# ---- what each rank sends to rank 0 ---------------------------------------------------------------

@dataclass
class _RankPart:
    """One rank's share of a save: what it wrote, and the skeletons of its objects and (rank 0) of the common
    state, whose tensor leaves index this rank's lists of their stored names."""

    write: Any
    objects: Any                 # dict node: unique key -> {"value": data} or {"bytesio": bytes}
    common: Any                  # the common state's node, or None
    object_names: list[str]      # the stored name of each tensor leaf of ``objects`` (index = the leaf's)
    common_names: list[str]      # the same for ``common``


def _objects_of(values: Sequence[Any]) -> dict[str, Any]:
    """The main-replica ShardedObjects this rank saves, by unique key; a BytesIO (Transformer Engine's extra
    state) as its bytes, tagged so that it loads as a BytesIO again."""
    out: dict[str, Any] = {}
    for obj in values:
        if isinstance(obj, ShardedObject) and is_main_replica(obj.replica_id):
            data = obj.data
            out[obj.unique_key] = {"bytesio": data.getvalue()} if isinstance(data, io.BytesIO) else {"value": data}
    return out


def _read_common(checkpoint_dir: str) -> dict[str, Any] | None:
    """The common state Megatron has just written to ``common.pt``, when the restricted (``weights_only``)
    unpickler reads it; otherwise the version keeps none and Megatron's file stays its only copy."""
    path = os.path.join(checkpoint_dir, COMMON_FILE)
    if not os.path.exists(path):
        return None
    try:
        common = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:   # noqa: BLE001 - whatever the restricted unpickler refuses
        log.warning("ckptrepo: %s holds values only pickle can store (%s); the version keeps no common state, "
                    "which then loads from that file", path, first_line(err))
        return None
    return common if isinstance(common, dict) else None


def _write_rank(plumbing: Any, vid: str, rank: int, values: Sequence[Any], common: dict[str, Any] | None
                ) -> _RankPart:
    """Write this rank's main-replica boxes, its objects' tensors and (rank 0) the common state's tensors."""
    chunks = _save_chunks([v for v in values if isinstance(v, ShardedTensor)])
    objects, object_records = flatten(_objects_of(values))
    common_node: Any = None
    common_records: list[Any] = []
    if common is not None:
        try:
            common_node, common_records = flatten(common)
        except UnsupportedValueError as err:
            log.warning("ckptrepo: the common state cannot be stored without pickle (%s); the version keeps "
                        "none, which then loads from %s", first_line(err), COMMON_FILE)
    object_names = [f"{OBJECTS}/{r.name}" for r in object_records]
    common_names = [f"{COMMON}/{r.name}" for r in common_records]
    for name, r in zip(object_names + common_names, object_records + common_records):   # held whole
        chunks.append(GlobalChunk(name, r.shape, (0,) * len(r.shape), r.tensor))
    return _RankPart(write_rank_chunks(plumbing, vid, rank, chunks), objects, common_node, object_names,
                     common_names)


def _reindex(node: Any, index: dict[int, int]) -> Any:
    """A skeleton with each tensor leaf's local index replaced by its index in the version's tensor table."""
    if isinstance(node, list):
        if len(node) == 2 and node[0] in (TENSOR, NDARRAY) and isinstance(node[1], int):
            return [node[0], index[node[1]]]
        return [_reindex(c, index) for c in node]
    return node


def _version_tree(parts: Sequence[_RankPart]) -> Any:
    """The version's skeleton: ``{"sharded": {key: tensor}, "objects": {...}, "common": {...}}``."""
    order = {name: i for i, name in enumerate(tensor_order([p.write for p in parts]))}
    prefix = f"{SHARDED}/"
    sharded = [[[SCALAR, n[len(prefix):]], [TENSOR, i]] for n, i in order.items() if n.startswith(prefix)]
    objects: list[Any] = []
    common = None
    for p in parts:
        objects += _reindex(p.objects, {i: order[n] for i, n in enumerate(p.object_names)})[1]
        if p.common is not None:
            common = _reindex(p.common, {i: order[n] for i, n in enumerate(p.common_names)})
    top = [[[SCALAR, SHARDED], [DICT, sharded]], [[SCALAR, OBJECTS], [DICT, objects]]]
    if common is not None:
        top.append([[SCALAR, COMMON], common])
    return [DICT, top]


# ---- reading a version -----------------------------------------------------------------------------

class VersionSource:
    """One version of a repository as Megatron's load strategies need it: boxes, objects, common state."""

    def __init__(self, url: str, rev: str) -> None:
        self.url = url
        self.plumbing = open_repo(url).plumbing
        self.manifest = self.plumbing.manifest(self.plumbing.resolve(rev))
        self.entries = {t.name: t for t in self.manifest.tensors}
        self.tree = {key_value(k): v for k, v in self.manifest.tree[1]} if self.manifest.tree[0] == DICT else {}

    def fill(self, sharded: Sequence[Any]) -> None:
        """Read every ShardedTensor's box into its data (allocated on the CPU when it has none); a tensor of
        another dtype or device than the saved one is read into a buffer and copied (a cast)."""
        wants, copies = [], []
        for st in sharded:
            _check_plain(st)
            entry = self.entries.get(f"{SHARDED}/{st.key}")
            if entry is None:
                raise StateMismatchError(f"version {self.manifest.id[:12]} in {self.url} has no ShardedTensor "
                                         f"{st.key!r}; load with strict=False or from a version that has it")
            if st.data is None:
                st.init_data("cpu")
            saved = TORCH_DTYPES[entry.dtype]
            target = st.data.detach().reshape(_box_sizes(st)) if st.data.is_contiguous() else None
            if target is None or target.dtype != saved or target.device.type != "cpu" or \
                    target.data_ptr() != st.data.data_ptr():
                buf = torch.empty(_box_sizes(st), dtype=saved)
                copies.append((st, buf))
                target = buf
            wants.append(GlobalChunk(entry.name, tuple(st.global_shape), tuple(st.global_offset), target))
        read_chunks(self.plumbing, self.manifest, wants)
        for st, buf in copies:   # parameters included: a load is not a step to differentiate
            st.data.detach().copy_(buf.reshape(st.data.shape))

    def fill_objects(self, objects: Sequence[Any]) -> None:
        """Set every ShardedObject's data to the saved one."""
        saved = self._node(OBJECTS)
        stored = {key_value(k): v for k, v in saved[1]} if saved is not None else {}
        for obj in objects:
            node = stored.get(obj.unique_key)
            if node is None:
                raise StateMismatchError(f"version {self.manifest.id[:12]} in {self.url} has no ShardedObject "
                                         f"{obj.unique_key!r}; load with strict=False or from a version that has it")
            value = self._build(node)
            obj.data = io.BytesIO(value["bytesio"]) if "bytesio" in value else value["value"]

    def common(self) -> dict[str, Any]:
        node = self._node(COMMON)
        if node is None:
            raise CkptRepoError(f"version {self.manifest.id[:12]} in {self.url} holds no common state (it could "
                                f"not be stored without pickle); load it with Megatron's default common strategy")
        value = self._build(node)
        return value if isinstance(value, dict) else {}

    def tensors_metadata(self) -> dict[str, Any]:
        """Each saved ShardedTensor as Megatron's metadata loaders give it: whole, without data."""
        prefix = f"{SHARDED}/"
        return {e.name[len(prefix):]: ShardedTensor.from_rank_offsets(
                    e.name[len(prefix):], torch.empty(e.shape, dtype=TORCH_DTYPES[e.dtype], device="meta")
                ).without_data()
                for e in self.manifest.tensors if e.name.startswith(prefix)}

    def objects_metadata(self) -> dict[str, Any]:
        saved = self._node(OBJECTS)
        keys = [key_value(k) for k, _ in saved[1]] if saved is not None else []
        return {k: ShardedObject.empty_from_unique_key(k) for k in keys}

    def _node(self, key: str) -> Any:
        return self.tree.get(key)

    def _build(self, node: Any) -> Any:
        """A stored subtree as values, its tensors read whole."""
        table = self.manifest.tensors

        def tensor(i: int, as_numpy: bool) -> Any:
            e = table[i]
            t = torch.empty(e.shape, dtype=TORCH_DTYPES[e.dtype])
            read_chunks(self.plumbing, self.manifest, [GlobalChunk(e.name, tuple(e.shape), (0,) * len(e.shape), t)])
            return t.numpy() if as_numpy else t

        return unflatten(node, tensor)


def open_version(checkpoint_dir: str | os.PathLike[str], url: str | None, rev: str | None) -> VersionSource:
    """The version a load reads: ``url``/``rev`` when given, else what the directory's pointer file names."""
    if url is None:
        url, saved = read_pointer(checkpoint_dir)
        return VersionSource(url, rev if rev is not None else saved)
    return VersionSource(url, rev if rev is not None else "HEAD")


# ---- strategies ------------------------------------------------------------------------------------

class CkptRepoSaveStrategy(SaveShardedStrategy):
    """Saves a Megatron sharded state dict as one version of the repository at ``url``, on its current branch.

    ``step`` defaults to the iteration in the checkpoint directory's name (``iter_0000100``); ``message``,
    ``metrics`` and ``meta`` go to the version's header. They are attributes: change them between saves.
    ``last_version`` is the id the last save committed.
    """

    def __init__(self, url: str | os.PathLike[str], *, step: int | None = None, message: str | None = None,
                 metrics: dict[str, Any] | None = None, meta: dict[str, str] | None = None) -> None:
        super().__init__(BACKEND, BACKEND_VERSION)
        self.url = os.fspath(url)
        self.step, self.message, self.metrics, self.meta = step, message, metrics, meta
        self.last_version: str | None = None

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True   # objects go into the version's tree, not into a pickle file each

    def save(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | os.PathLike[str]) -> None:
        """Write this rank's main replicas, then commit every rank's as one version: a collective, like
        Megatron's own save; every rank returns, or raises the same SnapshotFailedError."""
        checkpoint_dir = os.fspath(checkpoint_dir)
        rank, world = process_group_rank()
        values = list(nested_values(sharded_state_dict))
        vid = self._save(values, checkpoint_dir, rank, world)
        self.last_version = vid
        if rank == 0:   # before Megatron's metadata.json, which marks the directory complete
            write_pointer(checkpoint_dir, _url_for_pointer(self.url), vid)

    def _save(self, values: list[Any], checkpoint_dir: str, rank: int, world: int) -> str:
        vid = _broadcast(new_version_id() if rank == 0 else None, world)
        plumbing = base = None
        part: _RankPart | _RankError
        try:
            plumbing = open_repo(self.url).plumbing
            if rank == 0:   # the tip the version goes on: a branch moved during the save is a conflict
                base = read_branch_base(plumbing)
            part = _write_rank(plumbing, vid, rank, values, _read_common(checkpoint_dir) if rank == 0 else None)
        except Exception as err:   # noqa: BLE001 - sent to every rank, raised there
            part = _RankError(rank, err)
        parts = _gather(part, world)
        outcome: str | _RankError | None = None
        if rank == 0:
            outcome = self._commit(plumbing, vid, parts, base, checkpoint_dir, world)
        outcome = _broadcast(outcome, world)
        if isinstance(outcome, _RankError):
            raise SnapshotFailedError(f"Megatron save into {self.url} failed, nothing committed: {outcome.text}")
        return str(outcome)

    def _commit(self, plumbing: Any, vid: str, parts: list[Any], base: Any, checkpoint_dir: str, world: int
                ) -> str | _RankError:
        failed = [p for p in parts if isinstance(p, _RankError)]
        if failed:
            return failed[0]
        try:
            step = self.step if self.step is not None else step_from_dir(checkpoint_dir)
            message = self.message if self.message is not None else \
                f"megatron save {os.path.basename(os.path.normpath(checkpoint_dir))}"
            version = commit_chunks(plumbing, vid, [p.write for p in parts], _version_tree(parts), world,
                                    step=step, message=message, metrics=self.metrics, meta=self.meta, base=base)
            return str(version.id)
        except Exception as err:   # noqa: BLE001 - sent to every rank
            return _RankError(0, err)


class _FromVersion:
    """What both load strategies share: the version they read. Without ``url``/``rev``, the checkpoint
    directory's ``ckptrepo.json`` names it (what the save wrote); ``rev`` alone picks another version of that
    repository. Sharded objects are in the version too, so the strategies handle them."""

    def __init__(self, url: str | os.PathLike[str] | None = None, rev: str | None = None) -> None:
        super().__init__()
        self.url = os.fspath(url) if url is not None else None
        self.rev = rev

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True


class CkptRepoLoadStrategy(_FromVersion, LoadShardedStrategy):
    """Loads each rank's boxes of a Megatron sharded state dict from a ckptrepo version (see ``_FromVersion``)."""

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise StateMismatchError(f"the checkpoint's sharded backend is {loaded_backend!r}, not {BACKEND!r}; "
                                     f"load it with Megatron's own strategy (leave sharded_strategy out)")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != BACKEND_VERSION:
            raise StateMismatchError(f"the checkpoint's {BACKEND} backend version is {loaded_version}, this "
                                     f"ckptrepo reads {BACKEND_VERSION}; upgrade ckptrepo")

    def load(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
        """Fill every ShardedTensor's data (allocated on the CPU when it has none) and every ShardedObject."""
        source = open_version(checkpoint_dir, self.url, self.rev)
        values = list(nested_values(sharded_state_dict))
        source.fill([v for v in values if isinstance(v, ShardedTensor)])
        source.fill_objects([v for v in values if isinstance(v, ShardedObject)])
        return dict_list_map_inplace(lambda v: v.data if isinstance(v, (ShardedTensor, ShardedObject)) else v,
                                     sharded_state_dict)

    def load_tensors_metadata(self, checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
        """Every saved ShardedTensor, whole and without data: its key, global shape and dtype."""
        return open_version(checkpoint_dir, self.url, self.rev).tensors_metadata()

    def load_sharded_metadata(self, checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
        """The saved ShardedTensors (as load_tensors_metadata) and ShardedObjects, by key."""
        source = open_version(checkpoint_dir, self.url, self.rev)
        return {**source.objects_metadata(), **source.tensors_metadata()}


class CkptRepoLoadCommonStrategy(_FromVersion, LoadCommonStrategy):
    """Loads the common (non-sharded) state from the version instead of the directory's ``common.pt`` pickle."""

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        pass   # metadata.json names Megatron's torch common backend: this strategy reads the same state

    def check_version_compatibility(self, loaded_version: int) -> None:
        pass

    def load_common(self, checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
        return open_version(checkpoint_dir, self.url, self.rev).common()

    def load_sharded_objects(self, sharded_objects_state_dict: dict[str, Any],
                             checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
        source = open_version(checkpoint_dir, self.url, self.rev)
        source.fill_objects([v for v in nested_values(sharded_objects_state_dict) if isinstance(v, ShardedObject)])
        return dict_list_map_inplace(lambda v: v.data if isinstance(v, ShardedObject) else v,
                                     sharded_objects_state_dict)

    def load_sharded_metadata(self, checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
        return open_version(checkpoint_dir, self.url, self.rev).objects_metadata()


def register() -> None:
    """Make ``dist_checkpointing.load(sd, dir)`` find the load strategy of a directory saved by ckptrepo."""
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, BACKEND_VERSION, CkptRepoLoadStrategy())


register()

__all__ = ["BACKEND", "CkptRepoLoadCommonStrategy", "CkptRepoLoadStrategy", "CkptRepoSaveStrategy", "read_pointer",
           "register", "step_from_dir", "write_pointer"]
