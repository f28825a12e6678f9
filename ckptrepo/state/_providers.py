"""State providers: turn a training state into a skeleton plus tensor records.

The skeleton is a msgpack-friendly tree that records every container and plain
value exactly (dict key types, list vs tuple, OrderedDict, big ints, numpy
scalars), with tensors replaced by indices into a tensor table. Loading walks
the skeleton back; nothing is ever unpickled, and only the handful of types
named below can be rebuilt, so a repository can never make us run its code.
"""
from __future__ import annotations

import collections
import contextlib
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ckptrepo.core import msgpack_int
from ckptrepo.errors import CkptRepoError, CorruptionError, StateMismatchError, UnsupportedValueError, first_line
from ckptrepo.state._skeleton import (  # noqa: F401
    BIGINT,
    DICT,
    DTYPE,
    LIST,
    NDARRAY,
    NPGEN,
    NPSCALAR,
    ODICT,
    SCALAR,
    SIZE,
    STATEFUL,
    TENSOR,
    TUPLE,
    bigint_text,
    bigint_value,
    key_value,
    numel,
)

# Containers nested deeper than this are refused at flatten, naming the path: the manifest's msgpack stops at
# 511 levels (three a dict), which would fail the commit after the data is written; a container that holds
# itself would end in a bare RecursionError.
MAX_DEPTH = 100

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bool: "bool", torch.uint8: "uint8", torch.int8: "int8", torch.int16: "int16", torch.int32: "int32",
    torch.int64: "int64", torch.uint16: "uint16", torch.uint32: "uint32", torch.uint64: "uint64",
    torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64",
    torch.complex64: "complex64", torch.complex128: "complex128",
    torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2",
}
# the other float8 formats torch and TensorStore (zarr v3 through ml_dtypes) share: the AMD "fnuz" pair and the
# power-of-two scale type of MX formats; looked up by name, as older torch builds lack some of them
DTYPE_NAMES.update({getattr(torch, name): name for name in ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
                    if hasattr(torch, name)})
TORCH_DTYPES: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}


@dataclass
class TensorRecord:
    """One tensor of the state: where it sits in the tree and its value."""

    name: str              # layout-independent logical name, e.g. "model/layers.0.weight"
    tensor: torch.Tensor   # the live tensor (not copied here)
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return numel(self.shape)


def is_stateful(obj: Any) -> bool:
    """The torch.distributed.checkpoint Stateful protocol: state_dict() and load_state_dict()."""
    return (not isinstance(obj, (dict, list, tuple, torch.Tensor))
            and callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)))


def own_containers(obj: Any) -> Any:
    """``obj`` with every dict, list and tuple copied (tensors and other leaves shared): what a load fills from
    ``target.state_dict()``. Schedulers hand back their live lists there (SequentialLR's ``_last_lr`` is also
    its first scheduler's), so writing into those would change the object before ``load_state_dict`` runs."""
    if isinstance(obj, dict):
        items = [(k, own_containers(v)) for k, v in obj.items()]
        return collections.OrderedDict(items) if isinstance(obj, collections.OrderedDict) else dict(items)
    if isinstance(obj, list):
        return [own_containers(v) for v in obj]
    if type(obj) is tuple:
        return tuple(own_containers(v) for v in obj)
    return obj


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor; no DTensor exists until torch.distributed.tensor is imported, so do not pay
    for that slow import to find out."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _check_tensor_type(t: torch.Tensor, path: tuple[Any, ...]) -> None:
    """Refuse tensor subclasses other than Parameter and DTensor: stored as plain tensors, they would come back
    without what the subclass adds (a scale, a tag), silently."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return
    where = path_str(path)   # only here: formatting every tensor's path would add up in snapshot() of a big state
    if torch.nn.parameter.is_lazy(t):
        raise UnsupportedValueError(f"{where}: an uninitialised lazy parameter or buffer has no shape or data yet; "
                                    f"run one forward pass (or module.initialize_parameters()) before saving")
    if isinstance(t, torch.nn.Parameter) and type(t).__torch_dispatch__ is torch.Tensor.__torch_dispatch__:
        return   # a Parameter subclass over plain data (FSDP's FlatParameter)
    if is_dtensor(t):
        return
    raise UnsupportedValueError(f"{where}: a {type(t).__module__}.{type(t).__qualname__} (a tensor subclass) would "
                                f"load as a plain tensor, without what the subclass adds; save its component "
                                f"tensors, or t.as_subclass(torch.Tensor) if its data is all there is")


def overlapping_elements(t: torch.Tensor) -> bool:
    """Whether two of ``t``'s elements share memory (an expanded view, an overlapping ``as_strided``): a load
    into it would leave whichever value landed last in each shared place, so ``into=`` refuses it.

    Exact for the views indexing makes (slices, steps, transposes, permutes): each dimension, by increasing
    stride, must step past all the elements the smaller ones reach. A hand-made ``as_strided`` whose dimensions
    interleave without overlapping is refused too (t.clone() is the way out either way)."""
    if t.numel() == 0:
        return False
    reach = 0   # the furthest element offset the dimensions seen so far reach
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def overlap_error(where: str) -> StateMismatchError:
    return StateMismatchError(f"{where}: the tensor in `into` is a view whose elements share memory (expanded or "
                              f"as_strided); give it memory of its own (t.clone()), or load without into=")


def torch_viewable(arr: np.ndarray) -> np.ndarray:
    """``arr`` with its dtype spelt the way torch takes it: ``np.ulonglong`` ('Q') is uint64 ('L') to everyone
    but ``torch.from_numpy``, which refused it as "uint64 is not supported"."""
    canonical = np.dtype(arr.dtype.str)
    return arr if canonical.char == arr.dtype.char else arr.view(canonical)


def key_str(key: Any) -> str:
    return key if isinstance(key, str) else repr(key)


def path_str(path: tuple[Any, ...]) -> str:
    return "state" + "".join(f"[{k!r}]" for k in path)


def flatten(state: Any) -> tuple[Any, list[TensorRecord]]:
    """Return ``(skeleton, tensors)`` for ``state``; raise naming the key path of anything unsupported."""
    tensors: list[TensorRecord] = []
    names: set[str] = set()

    def add_tensor(t: torch.Tensor, path: tuple[Any, ...]) -> int:
        _check_tensor_type(t, path)
        if t.is_nested:   # a strided-layout nested tensor too, which has no sizes to read
            raise UnsupportedValueError(f"{path_str(path)}: nested tensors are not supported; save their "
                                        f"components (t.unbind()) or a padded tensor (t.to_padded_tensor(0))")
        if t.layout != torch.strided:
            raise UnsupportedValueError(f"{path_str(path)}: {t.layout} tensors are not supported; "
                                        f"convert with .to_dense()")
        if t.is_quantized:
            raise UnsupportedValueError(f"{path_str(path)}: quantized tensors cannot be saved")
        if t.device.type == "meta":   # flattened to save, and to load into (a layout load's `into`)
            raise UnsupportedValueError(f"{path_str(path)}: a meta tensor holds no data, to save or to load into; "
                                        f"materialise the model first (module.to_empty(device=...))")
        if t.dtype not in DTYPE_NAMES:
            raise UnsupportedValueError(f"{path_str(path)}: dtype {t.dtype} is not supported")
        name = "/".join([k if type(k) is str else key_str(k) for k in path]) or "<root>"
        base, n = name, 1
        while name in names:
            n += 1
            name = f"{base}#{n}"
        names.add(name)
        # detach only what autograd tracks: for a DTensor even a no-op detach is a costly dispatch
        tensors.append(TensorRecord(name=name, tensor=t.detach() if t.requires_grad else t, dtype=DTYPE_NAMES[t.dtype],
                                    shape=tuple(t.shape)))
        return len(tensors) - 1

    def key_node(key: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(key, tuple):
            return [TUPLE, [key_node(k, path) for k in key]]
        if key is None or (isinstance(key, (str, bool, int, float, bytes)) and not isinstance(key, np.generic)):
            return walk(key, path)   # (np.float64 subclasses float, but a numpy scalar key is refused like np.int64)
        raise UnsupportedValueError(f"{path_str(path)}: dict key {key!r} of type {type(key).__name__} "
                                    f"is not supported")

    def walk(obj: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(obj, np.generic):  # before float/int: np.float64 subclasses float
            if obj.dtype.kind not in "biufc":
                raise UnsupportedValueError(f"{path_str(path)}: numpy scalar of dtype {obj.dtype} is not supported")
            return [NPSCALAR, obj.dtype.str, obj.tobytes()]
        if isinstance(obj, str):
            try:
                obj.encode("utf-8")
            except UnicodeEncodeError as err:   # a lone surrogate: msgpack could not write the manifest
                raise UnsupportedValueError(f"{path_str(path)}: text with a character UTF-8 cannot encode "
                                            f"({err.reason}, at {err.start}); store it as bytes "
                                            f"(s.encode('utf-8', 'surrogatepass'))") from None
            return [SCALAR, obj]
        if obj is None or isinstance(obj, (bool, bytes, float)):
            return [SCALAR, obj]
        if isinstance(obj, int):
            obj = int(obj)  # IntEnum and friends are stored as their value
            return [SCALAR, obj] if msgpack_int(obj) else [BIGINT, bigint_text(obj)]
        if isinstance(obj, torch.Tensor):
            return [TENSOR, add_tensor(obj, path)]
        if isinstance(obj, np.ndarray):
            if type(obj) is not np.ndarray and not isinstance(obj, np.memmap):
                raise UnsupportedValueError(f"{path_str(path)}: a {type(obj).__module__}.{type(obj).__qualname__} "
                                            f"(an ndarray subclass) would load as a plain array, without what the "
                                            f"subclass adds (a mask); save its parts as plain arrays")
            if obj.dtype.kind not in "biufc":
                raise UnsupportedValueError(f"{path_str(path)}: numpy dtype {obj.dtype} is not supported")
            if not obj.dtype.isnative:   # big-endian data: its values, in this machine's byte order
                obj = obj.astype(obj.dtype.newbyteorder("="))
            obj = torch_viewable(obj)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:   # np.require keeps a 0-d array 0-d (np.ascontiguousarray makes it 1-d)
                    t = torch.from_numpy(np.require(obj, requirements="C"))
                except TypeError:   # float128 and other types torch has no dtype for
                    raise UnsupportedValueError(f"{path_str(path)}: numpy dtype {obj.dtype} is not supported") \
                        from None
            return [NDARRAY, add_tensor(t, path)]
        if _is_numpy_generator(obj):
            bg = obj.bit_generator
            node = [NPGEN, type(bg).__name__, walk(bg.state, path)]
            seed = _seed_sequence(bg)
            return node if seed is None else node + [walk(seed, path)]
        if isinstance(obj, torch.dtype):
            if obj not in DTYPE_NAMES:
                raise UnsupportedValueError(f"{path_str(path)}: dtype {obj} is not supported")
            return [DTYPE, DTYPE_NAMES[obj]]
        if isinstance(obj, torch.Size):
            return [SIZE, list(obj)]
        if isinstance(obj, (dict, list, tuple)) and len(path) >= MAX_DEPTH:
            raise UnsupportedValueError(f"{path_str(path[:6])}...: containers nested more than {MAX_DEPTH} deep (or "
                                        f"one that holds itself); flatten the structure, e.g. with joined keys")
        if isinstance(obj, dict):
            tag = ODICT if isinstance(obj, collections.OrderedDict) else DICT  # other dict subclasses load as dict
            return [tag, [[key_node(k, path + (k,)), walk(v, path + (k,))] for k, v in obj.items()]]
        if isinstance(obj, (list, tuple)):  # named tuples load as plain tuples
            return [LIST if isinstance(obj, list) else TUPLE, [walk(v, path + (i,)) for i, v in enumerate(obj)]]
        if is_stateful(obj):
            cls = f"{type(obj).__module__}.{type(obj).__qualname__}"
            return [STATEFUL, cls, walk(obj.state_dict(), path)]
        raise UnsupportedValueError(
            f"{path_str(path)}: values of type {type(obj).__module__}.{type(obj).__qualname__} cannot be saved "
            f"without pickle; store tensors, numpy arrays, plain Python data, "
            f"or an object with state_dict()/load_state_dict()")

    try:
        return walk(state, ()), tensors
    finally:
        # the nested functions refer to each other through their closure cells: a reference cycle that only the
        # cyclic GC would free, with every record (and tensor object) of the state in it; a snapshot per step
        # would then feed the full collections, each a long pause with a big model loaded
        walk = key_node = add_tensor = None  # type: ignore[assignment]  # noqa: F841


def unflatten(skeleton: Any, get_tensor: Callable[[int, bool], Any]) -> Any:
    """Rebuild the state from ``skeleton``; ``get_tensor(index, as_numpy)`` supplies tensor values.

    Stateful objects come back as their state dicts (we never construct user
    classes); numpy Generators are rebuilt only for numpy's own bit generators.

    A skeleton the crc32c vouches for may still be malformed (a re-sealed manifest, a hand-edited export):
    a node of the wrong shape or a tensor index past the table is a CorruptionError, never a bare Python error.
    """
    with malformed_skeleton():
        return _build(skeleton, get_tensor)


@contextlib.contextmanager
def malformed_skeleton() -> Iterator[None]:
    """Around a walk of a stored skeleton: the Python errors a malformed one raises become a CorruptionError
    (ckptrepo's own errors, a state that does not match ``into=`` among them, pass through)."""
    try:
        yield
    except CkptRepoError:
        raise
    except (IndexError, KeyError, TypeError, AttributeError, ValueError) as err:
        raise CorruptionError(f"the state's skeleton is malformed ({type(err).__name__}: {first_line(err)}): the "
                              f"manifest or export is damaged; run `ckptrepo fsck`") from None


def _build(node: Any, get_tensor: Callable[[int, bool], Any]) -> Any:
    """unflatten's recursion, at module level: a nested function that calls itself is a reference cycle
    (function -> closure cell -> function), which would leave objects of every load to the cyclic collector."""
    tag = node[0]
    if tag == SCALAR:
        return node[1]
    if tag == BIGINT:
        return bigint_value(node[1])
    if tag in (DICT, ODICT):
        items = [(key_value(k), _build(v, get_tensor)) for k, v in node[1]]
        return collections.OrderedDict(items) if tag == ODICT else dict(items)
    if tag == LIST:
        return [_build(v, get_tensor) for v in node[1]]
    if tag == TUPLE:
        return tuple(_build(v, get_tensor) for v in node[1])
    if tag in (TENSOR, NDARRAY):
        return get_tensor(node[1], tag == NDARRAY)
    if tag == NPSCALAR:
        return np.frombuffer(node[2], dtype=np.dtype(node[1]))[0]
    if tag == NPGEN:
        return make_numpy_generator(node[1], _build(node[2], get_tensor),
                                    _build(node[3], get_tensor) if len(node) > 3 else None)
    if tag == DTYPE:
        return TORCH_DTYPES[node[1]]
    if tag == SIZE:
        return torch.Size(node[1])
    if tag == STATEFUL:
        return _build(node[2], get_tensor)
    raise UnsupportedValueError(f"unknown skeleton node {tag!r}; the repository was written by a newer ckptrepo")


def _is_numpy_generator(obj: Any) -> bool:
    """Whether ``obj`` is a ``numpy.random.Generator``, without importing ``numpy.random`` to find out.

    ``np.random`` is imported lazily, and importing it is not free (it pulls in
    ``secrets`` and ``hmac``): it would be paid on the first save or load of every
    process by this one check. No object can be a Generator while nothing has imported
    the module.
    """
    random = sys.modules.get("numpy.random")
    return random is not None and isinstance(obj, random.Generator)


_NUMPY_BITGENS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")


def _seed_sequence(bg: Any) -> dict[str, Any] | None:
    """What rebuilds a bit generator's SeedSequence, from which ``Generator.spawn()`` draws its children (the
    state alone gives a resumed run other children than the saved generator's); None if it has none."""
    seq = getattr(bg, "seed_seq", None)
    if not isinstance(seq, np.random.SeedSequence):
        return None
    entropy = seq.entropy
    return {"entropy": entropy if entropy is None or isinstance(entropy, int) else [int(x) for x in entropy],
            "spawn_key": [int(k) for k in seq.spawn_key], "pool_size": int(seq.pool_size),
            "n_children_spawned": int(seq.n_children_spawned)}


def make_numpy_generator(bitgen: str, state: dict[str, Any], seed: dict[str, Any] | None = None
                         ) -> np.random.Generator:
    """Rebuild a numpy Generator from its bit generator's name, state and SeedSequence (numpy's own classes)."""
    if bitgen not in _NUMPY_BITGENS:
        raise UnsupportedValueError(f"numpy bit generator {bitgen!r} is not one of numpy's own {_NUMPY_BITGENS}")
    if seed is None:
        bg = getattr(np.random, bitgen)()
    else:
        try:
            seq = np.random.SeedSequence(seed["entropy"], spawn_key=tuple(seed["spawn_key"]),
                                         pool_size=seed["pool_size"], n_children_spawned=seed["n_children_spawned"])
        except (KeyError, TypeError, ValueError) as err:
            raise UnsupportedValueError(f"numpy SeedSequence {seed!r} cannot be rebuilt: {err}") from None
        bg = getattr(np.random, bitgen)(seq)
    bg.state = state
    return np.random.Generator(bg)
