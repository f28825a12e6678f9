"""torch.distributed.checkpoint (DCP) storage over a repository: ``dcp.save`` makes a version, ``dcp.load``
reads any version.

    dcp.save(state, storage_writer=ckptrepo.dcp.Writer(url, step=1000, message="..."))
    dcp.load(state, storage_reader=ckptrepo.dcp.Reader(url, "@1000"))

**Saving.** DCP's planners decide what each rank writes and DCP gathers the plans and the write results to
its coordinator; that gather is the commit protocol (docs/decisions/025-dcp-backend.md). The coordinator's
``prepare_global_plan`` reads the branch tip and draws the version id, which reach every rank in its plan;
each rank's ``write_data`` writes its tensor chunks into arrays of its own (saving/_pieces.py), pointing a
chunk whose bytes the tip holds under the same name and box at them instead, and reports each chunk's
moments; the coordinator's ``finish`` builds the manifest (with the merged statistics) from every rank's
results and commits it (manifest create-only, then the branch's compare-and-swap); see
docs/decisions/056-dcp-dedup-and-statistics.md. Tensors are stored under the path DCP flattened them from
(``model/layers.0.weight``), with their global shapes, so ``repo.load`` returns the nesting given to
``dcp.save``. A non-tensor value DCP would pickle is recorded in the manifest's tree as plain data when it is
plain data (ints, floats, strings, lists, tuples and dicts of them); anything else is kept as DCP's own
pickle, a uint8 tensor named ``<path>@dcp-pickle`` that ``repo.load`` returns as bytes. ``dcp.load`` unpickles
it (DCP's ``load_bytes``) only as torch's restricted unpickler rebuilt it, unless the Reader is told to trust
the repository (``integrations/_dcp_pickles.py``).

**Loading.** ``read_metadata`` describes any version (saved by DCP, by ``repo.snapshot``, by one rank or
several): each tensor as one chunk covering it whole (a read can cut any box out of the stored pieces), each
other value as a byte item that ``read_data`` serialises from the manifest's plain data with ``torch.save``.
The FQNs are DCP's own flattening of the version's tree. ``read_data`` fills every tensor item of a load
plan with one ranged read of the bytes it needs.
"""
from __future__ import annotations

import collections
import dataclasses
import io
import os
from typing import Any, Callable, Sequence

import torch
from torch.distributed.checkpoint import StorageReader, StorageWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

import ckptrepo
from ckptrepo.arguments import checked_meta, checked_step
from ckptrepo.core import Plumbing, check_ref_name, collection_paused, new_version_id, plain_metrics
from ckptrepo.core.schema import Manifest
from ckptrepo.errors import (
    ArgumentError,
    CkptRepoError,
    CorruptionError,
    RefError,
    UnsupportedValueError,
    first_line,
    warn,
)
from ckptrepo.integrations._dcp_pickles import safe_bytes
from ckptrepo.loading import ReadStats
from ckptrepo.saving import (
    BranchBase,
    GlobalChunk,
    RankWrite,
    commit_chunks,
    read_branch_base,
    read_chunks,
    tensor_order,
    write_rank_chunks,
)
from ckptrepo.state import (
    DICT,
    LIST,
    NPGEN,
    SCALAR,
    STATEFUL,
    TENSOR,
    TORCH_DTYPES,
    flatten,
    unflatten,
)

__all__ = ["PICKLED_SUFFIX", "Reader", "Writer"]

PICKLED_SUFFIX = "@dcp-pickle"   # a value DCP pickled, kept as its bytes (a uint8 tensor)


@dataclasses.dataclass(frozen=True)
class _Item:
    """What a rank reports of one written item: ``kind`` "tensor", "plain" (``value``: its skeleton) or
    "pickle"; the rank's first item carries everything the rank wrote."""

    kind: str
    value: Any = None
    rank_write: RankWrite | None = None


def _plain_skeleton(obj: Any) -> Any | None:
    """The skeleton of a value made of plain data only (no tensors, arrays, Stateful objects or numpy
    Generators), which the manifest's tree records as it is; None for anything else."""
    try:
        skeleton, records = flatten(obj)
    except CkptRepoError:
        return None
    if records or _has_tag(skeleton, (STATEFUL, NPGEN)):
        return None
    return skeleton


def _has_tag(node: Any, tags: tuple[str, ...]) -> bool:
    if isinstance(node, list):
        if node and isinstance(node[0], str) and node[0] in tags:
            return True
        return any(_has_tag(c, tags) for c in node)
    return False


class Writer(StorageWriter):
    """A DCP ``StorageWriter`` that makes each ``dcp.save`` (or ``dcp.async_save``) one version of the
    repository at ``url`` (created if there is none), on ``branch`` (default: HEAD's), with ``step``,
    ``message``, ``metrics`` and ``meta`` (free text in the manifest header); ``tag`` names the version once
    committed (``force_tag`` moves an existing tag of that name to it).

    ``version`` is the committed Version on the coordinator once the save returned (None elsewhere).
    """

    def __init__(self, url: str | os.PathLike[str], step: int | None = None, message: str = "",
                 metrics: dict[str, Any] | None = None, branch: str | None = None, *, tag: str | None = None,
                 force_tag: bool = False, meta: dict[str, str] | None = None) -> None:
        super().__init__()
        self.url = str(url)
        # checked now, as snapshot() checks them, not when the coordinator writes the manifest after the data
        self.step, self.message, self.branch = checked_step(step), message, branch
        self.metrics, self.meta = plain_metrics(metrics), checked_meta(meta)
        self.tag, self.force_tag = tag, force_tag
        if not isinstance(message, str):
            raise UnsupportedValueError(f"message must be text, not {type(message).__name__}")
        if tag is not None:
            check_ref_name(tag, "tag")   # a bad name is refused now, not after the data is written
        # created where there is none, as the other adapters do; every rank may do so at once (init with
        # exist_ok writes the configuration and HEAD only where absent)
        self._plumbing: Plumbing = ckptrepo.init(self.url, exist_ok=True).plumbing
        self.is_coordinator = True
        self.rank = 0
        self._base: BranchBase | None = None
        self._vid: str | None = None
        self.version: ckptrepo.Version | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Picklable for ``dcp.async_save(..., async_checkpointer_type=PROCESS)``: the repository handle (locks,
        open stores) is not sent; the other process opens its own."""
        return {k: v for k, v in self.__dict__.items() if k != "_plumbing"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._plumbing = ckptrepo.open(self.url).plumbing

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None and str(checkpoint_id) != self.url:
            self.url = str(checkpoint_id)
            self._plumbing = ckptrepo.init(self.url, exist_ok=True).plumbing
        self._base, self._vid = None, None
        self.version = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            # without them every rank would commit a version of its own pieces alone
            raise ArgumentError("ckptrepo.dcp.Writer needs DCP's collectives (one version from every rank's "
                                "pieces); call dcp.save without use_collectives=False")
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.url)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: read the branch the version goes on and draw its id, which every rank's plan carries with
        the branch's tip (the parent whose unchanged pieces the ranks point at rather than write again)."""
        self._base = read_branch_base(self._plumbing, self.branch)
        if self.tag is not None and not self.force_tag and self._plumbing.tag_target(self.tag) is not None:
            raise RefError(f"tag {self.tag!r} already exists; pass force_tag=True to move it to the new version, "
                           f"or pick another name")
        self._vid = new_version_id()
        return [dataclasses.replace(p, storage_data=(self._vid, self._base.tip)) for p in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items of the version its plan names, each chunk whose bytes the parent holds as a
        piece pointing there instead; report each item's kind and this rank's pieces with their moments."""
        vid, parent = plan.storage_data
        chunks: list[GlobalChunk] = []
        kinds: list[_Item] = []
        for item in plan.items:
            kind = self._chunk_of(item, planner, chunks)
            kinds.append(kind)
        rank_write = write_rank_chunks(self._plumbing, vid, self.rank, chunks, dedup=True, parent=parent,
                                       names=_stored_names(planner, kinds, plan.items), stats=True)
        results = []
        for i, (item, kind) in enumerate(zip(plan.items, kinds)):
            data = dataclasses.replace(kind, rank_write=rank_write) if i == 0 else kind
            size = item.tensor_storage_size() or 0
            results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=data))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    @staticmethod
    def _chunk_of(item: WriteItem, planner: SavePlanner, chunks: list[GlobalChunk]) -> _Item:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            lookup: Callable[[MetadataIndex], Any] | None = getattr(planner, "lookup_object", None)
            skeleton = _plain_skeleton(lookup(item.index)) if lookup is not None else None
            if skeleton is not None:
                return _Item("plain", skeleton)
            raw = planner.resolve_data(item)
            assert isinstance(raw, io.BytesIO)
            data = raw.getvalue()
            tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
            chunks.append(GlobalChunk(fqn, (tensor.numel(),), (0,), tensor))
            return _Item("pickle")
        td = item.tensor_data
        assert td is not None
        value = planner.resolve_data(item)
        assert isinstance(value, torch.Tensor)
        chunks.append(GlobalChunk(fqn, tuple(td.size), tuple(td.chunk.offsets), value.detach()))
        return _Item("tensor")

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: build the version's manifest from every rank's results and commit it."""
        mappings = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        # in the order the state was flattened (the planners' mappings), so the tree keeps the user's key order
        fqns = [f for f in mappings if f in metadata.state_dict_metadata]
        fqns += [f for f in metadata.state_dict_metadata if f not in mappings]
        paths = {fqn: tuple(mappings.get(fqn, (fqn,))) for fqn in fqns}
        names = _unique_names(paths)
        writes: list[RankWrite] = []
        kinds: dict[str, _Item] = {}
        for rank_results in results:
            for r in rank_results:
                data: _Item = r.storage_data
                kinds[r.index.fqn] = data
                if data.rank_write is not None:
                    writes.append(data.rank_write)
        def stored(fqn: str) -> str:
            return _kept_as(names[fqn], kinds[fqn])

        renamed = [dataclasses.replace(w, chunks=tuple(dataclasses.replace(c, name=stored(c.name)) for c in w.chunks),
                                       moments=None if w.moments is None else
                                       tuple((stored(n), raw) for n, raw in w.moments)) for w in writes]
        order = {n: i for i, n in enumerate(tensor_order(renamed))}
        leaves: dict[tuple[Any, ...], Any] = {}
        for fqn, path in paths.items():
            kind = kinds.get(fqn)
            if kind is None:   # an item no rank wrote (DCP writes every item once): nothing to record
                continue
            if kind.kind == "plain":
                leaves[path] = kind.value
            else:
                leaves[path] = [TENSOR, order[stored(fqn)]]
        assert self._vid is not None, "finish runs on the coordinator, after prepare_global_plan"
        self.version = commit_chunks(self._plumbing, self._vid, renamed, _tree(leaves), len(results), step=self.step,
                                     message=self.message, metrics=self.metrics, meta=self.meta, base=self._base)
        if self.tag is not None:
            try:
                self.version = ckptrepo.open(self.url).tag(self.tag, self._vid, force=self.force_tag)
            except CkptRepoError as err:   # the version is committed: a failed save here would be retried twice
                warn(f"version {self._vid[:12]} was committed, but tag {self.tag!r} was not set: "
                     f"{first_line(err)}; tag it with `ckptrepo tag {self.tag} {self._vid[:12]}`")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False   # never inferred from a checkpoint_id: pass storage_writer=Writer(url)


def _stored_names(planner: SavePlanner, kinds: Sequence[_Item], items: Sequence[WriteItem]) -> dict[str, str]:
    """What ``finish`` names each written item (by FQN), as far as this rank can tell: its path joined, from the
    planner's flattening; names that join alike (told apart only at the commit) are left out, so that their
    chunks are written rather than pointed at another tensor's piece."""
    mappings = getattr(planner, "mappings", None)
    if not isinstance(mappings, dict):
        return {}
    counts = collections.Counter(_name(path) for path in mappings.values())
    out = {}
    for item, kind in zip(items, kinds):
        fqn = item.index.fqn
        name = _name(mappings.get(fqn, (fqn,)))
        if counts[name] == 1:
            out[fqn] = _kept_as(name, kind)
    return out


def _kept_as(name: str, kind: _Item) -> str:
    """The name an item is stored under: DCP's pickles apart from the tensors and plain values."""
    return name + (PICKLED_SUFFIX if kind.kind == "pickle" else "")


def _name(path: Sequence[Any]) -> str:
    """A tensor's stored name: its path joined by ``/``, as a snapshot names it (``model/layers.0.weight``)."""
    return "/".join(str(p) for p in path)


def _unique_names(paths: dict[str, tuple[Any, ...]]) -> dict[str, str]:
    """Each FQN's stored name; two paths that join alike (the key ``"a/b"`` and ``{"a": {"b": ...}}``) are told
    apart as a snapshot tells them (``a/b``, ``a/b#2``), in the state's order."""
    out: dict[str, str] = {}
    taken: set[str] = set()
    for fqn, path in paths.items():
        base = name = _name(path)
        n = 1
        while name in taken:
            n += 1
            name = f"{base}#{n}"
        taken.add(name)
        out[fqn] = name
    return out


class _Leaf:
    """A leaf's skeleton inside the nesting ``_tree`` rebuilds (so that it is never taken for a container)."""

    def __init__(self, skeleton: Any) -> None:
        self.skeleton = skeleton


def _tree(leaves: dict[tuple[Any, ...], Any]) -> Any:
    """The skeleton of the nesting DCP flattened: dicts for str path items, lists for int ones (as DCP's own
    ``set_element`` rebuilds it), with the given skeleton at each leaf."""
    root: dict[Any, Any] = {}
    for path, leaf in leaves.items():
        node: Any = root
        for key, nxt in zip(path, path[1:] + (None,)):
            child: Any = _Leaf(leaf) if nxt is None else ([] if isinstance(nxt, int) else {})
            if isinstance(node, list):
                node.extend([None] * (key + 1 - len(node)))
                if node[key] is None or nxt is None:
                    node[key] = child
            elif key not in node or nxt is None:
                node[key] = child
            node = node[key]
    return _skeleton(root)


def _skeleton(node: Any) -> Any:
    if isinstance(node, _Leaf):
        return node.skeleton
    if isinstance(node, dict):
        return [DICT, [[[SCALAR, k], _skeleton(v)] for k, v in node.items()]]
    if node is None:   # a list position no item filled
        return [SCALAR, None]
    return [LIST, [_skeleton(v) for v in node]]


# ---- loading --------------------------------------------------------------------------------------


class _ArrayLeaf:
    """A numpy-array leaf of a version's tree where DCP's flattening sees it: a value, not a tensor."""

    def __init__(self, index: int) -> None:
        self.index = index


class Reader(StorageReader):
    """A DCP ``StorageReader`` that serves version ``rev`` of the repository at ``url`` to ``dcp.load``.

    The revision is resolved once, here: an unknown one, or a url that is no repository, raises at once.
    ``stats`` counts the bytes the loads through this reader needed and asked storage for.

    ``trust``: hand DCP's pickled values (``<path>@dcp-pickle``) to ``dcp.load`` as stored, for its full
    unpickling, which can run arbitrary code. Without it they pass torch's restricted unpickler first
    (``integrations/_dcp_pickles.py``), and one that names other code is refused with TrustRequiredError.
    """

    def __init__(self, url: str | os.PathLike[str], rev: str = "HEAD", *, trust: bool = False) -> None:
        super().__init__()
        self.url, self.rev = str(url), rev
        self.trust = bool(trust)
        self.stats = ReadStats()
        self._open()

    def _open(self) -> None:
        repo = ckptrepo.open(self.url)
        self._plumbing = repo.plumbing
        self.vid = repo.resolve(self.rev)
        self._manifest: Manifest = self._plumbing.manifest(self.vid)
        self._plumbing.require_data(self.vid, self._manifest)
        self._where: dict[str, Any] | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None and str(checkpoint_id) != self.url:
            self.url = str(checkpoint_id)
            self._open()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's description of the version: each tensor one whole chunk, every other value a byte item."""
        if kwargs.get("rank") is not None:
            raise CkptRepoError("a version has one global description; there is no per-rank metadata")
        shadow, mappings, where = self._shadow()
        md: dict[str, Any] = {}
        for fqn in shadow:
            index = where.get(fqn)
            if isinstance(index, int):
                t = self._manifest.tensors[index]
                size = torch.Size(t.shape)
                md[fqn] = TensorStorageMetadata(TensorProperties(dtype=TORCH_DTYPES[t.dtype]), size,
                                                [ChunkStorageMetadata(torch.Size([0] * len(size)), size)])
            else:
                md[fqn] = BytesStorageMetadata()
        return Metadata(state_dict_metadata=md, planner_data=mappings,
                        storage_meta=StorageMeta(checkpoint_id=self.url, load_id=self.vid))

    def _shadow(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """The version's state as DCP flattens it, tensors as meta tensors, and for each FQN the tensor index
        (an int) or the value to serialise."""
        m = self._manifest
        indices: dict[int, int] = {}

        def leaf(i: int, as_numpy: bool) -> Any:
            if as_numpy:
                return _ArrayLeaf(i)
            t = m.tensors[i]
            meta = torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype], device="meta")
            indices[id(meta)] = i
            return meta

        state = unflatten(m.tree, leaf)
        if not isinstance(state, dict):
            raise UnsupportedValueError(f"version {self.vid[:12]} holds a {type(state).__name__}, not a dict: DCP "
                                        f"loads dicts only")
        flat, mappings = flatten_state_dict(state)
        where: dict[str, Any] = {}
        for fqn, value in flat.items():
            if isinstance(value, torch.Tensor) and id(value) in indices:
                i = indices[id(value)]
                where[fqn] = ("pickle", i) if m.tensors[i].name.endswith(PICKLED_SUFFIX) else i
            else:
                where[fqn] = ("value", value)
        self._indices = indices
        self._where = where
        return flat, mappings, where

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._where is None:
            self._shadow()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Fill every tensor item with one grouped ranged read of just the bytes it needs; hand every byte
        item to the planner as ``torch.save`` bytes of its plain value (or DCP's own pickle).

        The cyclic collector is paused for the call, as for every load (docs/decisions/008-gc-pause.md): the
        reads' short-lived objects would otherwise be promoted and bring on a full collection in DCP's next
        gather."""
        with collection_paused(), torch.no_grad():
            self._read(plan, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        where = self._where if self._where is not None else self._shadow()[2]
        m = self._manifest
        wants: list[GlobalChunk] = []
        tensor_reqs: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
        byte_reqs = []
        for req in plan.items:
            found = where.get(req.storage_index.fqn)
            if found is None:
                raise CorruptionError(f"{req.storage_index.fqn}: not in version {self.vid[:12]}")
            if req.type == LoadItemType.BYTE_IO:
                byte_reqs.append((req, found))
                continue
            t = m.tensors[found]
            target = planner.resolve_tensor(req).detach()
            direct = target.device.type == "cpu" and target.dtype == TORCH_DTYPES[t.dtype]
            into = target if direct else torch.empty(tuple(req.lengths), dtype=TORCH_DTYPES[t.dtype])
            wants.append(GlobalChunk(t.name, tuple(t.shape), tuple(req.storage_offsets), into))
            tensor_reqs.append((req, target, into))
        if wants:
            read_chunks(self._plumbing, m, wants, self.stats)
        for req, target, into in tensor_reqs:
            if into is not target:
                target.copy_(into)
            planner.commit_tensor(req, target)
        for req, found in byte_reqs:
            planner.load_bytes(req, io.BytesIO(self._bytes_of(req.storage_index.fqn, found)))

    def _bytes_of(self, fqn: str, found: Any) -> bytes:
        """A byte item's bytes: DCP's pickle (as stored with ``trust``, else rebuilt by torch's restricted
        unpickler), or ``torch.save`` of a plain value (its tensors read)."""
        out = io.BytesIO()
        if isinstance(found, int):   # a tensor asked for as bytes: the tensor, as DCP would have pickled it
            torch.save(self._read_whole([found])[found], out)
            return out.getvalue()
        kind, value = found
        if kind == "pickle":
            stored = bytes(self._read_whole([value])[value].numpy().tobytes())
            return stored if self.trust else safe_bytes(stored, fqn, self.vid)
        needed: list[int] = []
        _collect(value, self._indices, needed)
        torch.save(_replace(value, self._indices, self._read_whole(needed)), out)
        return out.getvalue()

    def _read_whole(self, indices: Sequence[int]) -> dict[int, torch.Tensor]:
        m = self._manifest
        out = {i: torch.empty(m.tensors[i].shape, dtype=TORCH_DTYPES[m.tensors[i].dtype]) for i in indices}
        if out:
            read_chunks(self._plumbing, m, [GlobalChunk(m.tensors[i].name, tuple(m.tensors[i].shape),
                                                        (0,) * len(m.tensors[i].shape), t) for i, t in out.items()],
                        self.stats)
        return out

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False   # never inferred from a checkpoint_id: pass storage_reader=Reader(url, rev)


def _collect(value: Any, indices: dict[int, int], out: list[int]) -> None:
    """The tensor indices of the placeholders inside a byte item's value (a tuple of tensors, an array)."""
    if isinstance(value, _ArrayLeaf):
        out.append(value.index)
    elif isinstance(value, torch.Tensor) and id(value) in indices:
        out.append(indices[id(value)])
    elif isinstance(value, dict):
        for v in value.values():
            _collect(v, indices, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect(v, indices, out)


def _replace(value: Any, indices: dict[int, int], got: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, _ArrayLeaf):
        return got[value.index].numpy()
    if isinstance(value, torch.Tensor) and id(value) in indices:
        return got[indices[id(value)]]
    if isinstance(value, dict):
        return type(value)((k, _replace(v, indices, got)) for k, v in value.items())
    if isinstance(value, list):
        return [_replace(v, indices, got) for v in value]
    if isinstance(value, tuple):
        return tuple(_replace(v, indices, got) for v in value)
    return value
