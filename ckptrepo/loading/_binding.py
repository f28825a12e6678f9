"""Loading into an existing state (``load(into=...)``), in the style of DCP.

Binding happens in two passes so that bad input changes nothing: first the
saved skeleton is matched against the caller's state and every shape and dtype
is checked (no mutation); only then are tensors read straight into the caller's
tensors, plain values assigned, and ``load_state_dict`` called on Stateful
objects.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np
import torch

from ckptrepo.core.schema import TensorEntry
from ckptrepo.errors import StateMismatchError
from ckptrepo.state import (
    DICT,
    DTYPE_NAMES,
    LIST,
    NDARRAY,
    NPGEN,
    ODICT,
    SCALAR,
    STATEFUL,
    TENSOR,
    TUPLE,
    holds_tensors,
    is_stateful,
    overlap_error,
    overlapping_elements,
    own_containers,
    torch_viewable,
)

Finalizer = Callable[[], Any]


def _p(path: tuple[Any, ...]) -> str:
    return "state" + "".join(f"[{k!r}]" for k in path)


class Binder:
    """Matches a skeleton to a target state, collecting destination tensors and deferred assignments."""

    def __init__(self, entries: list[TensorEntry], build: Callable[[Any], Any], version: str) -> None:
        self.entries = entries
        self.build = build          # builds a fresh value from a skeleton node (after tensors are read)
        self.version = version
        self.destinations: dict[int, torch.Tensor] = {}

    def bind(self, node: Any, target: Any, path: tuple[Any, ...] = ()) -> Finalizer:
        tag = node[0]
        if tag in (TENSOR, NDARRAY):
            return self._bind_tensor(node, target, path)
        if tag == STATEFUL:
            if is_stateful(target):
                return self._bind_stateful(node[2], target, path)
            return self.bind(node[2], target, path)
        if tag in (DICT, ODICT) and is_stateful(target):
            # saved as `model.state_dict()`, loaded into the model itself (what DCP users write): filled as if the
            # module had been saved, where replacing it with the dict would leave the caller's module untouched
            return self._bind_stateful(node, target, path)
        if tag == NPGEN and isinstance(target, np.random.Generator):
            if type(target.bit_generator).__name__ != node[1]:   # before anything is filled: set_state would refuse
                raise StateMismatchError(f"{_p(path)}: a numpy Generator over {type(target.bit_generator).__name__} "
                                         f"in `into` but over {node[1]} in version {self.version[:12]}; make it "
                                         f"with np.random.Generator(np.random.{node[1]}()) or load without into=")

            def set_state() -> Any:
                target.bit_generator.state = self.build(node).bit_generator.state
                return target
            return set_state
        if tag in (DICT, ODICT) and isinstance(target, dict):
            return self._bind_dict(node, target, path)
        if tag in (LIST, TUPLE) and isinstance(target, (list, tuple)):
            return self._bind_sequence(node, target, path)
        if isinstance(target, (torch.Tensor, np.ndarray)):
            raise StateMismatchError(f"{_p(path)}: `into` holds a tensor but version {self.version[:12]} "
                                     f"saved a {_kind(tag)} there; load without into= to see what was saved")
        if is_stateful(target):
            if node == [SCALAR, None]:
                return lambda: target   # nothing was saved for it (a scheduler enabled since): the live one stays
            # replacing a live optimizer or scheduler with a plain value would go unnoticed
            raise StateMismatchError(f"{_p(path)}: `into` holds a {type(target).__name__} but version "
                                     f"{self.version[:12]} saved a {_kind(tag)} there; load without into= to see "
                                     f"what was saved")
        return lambda: self.build(node)

    def _bind_stateful(self, node: Any, target: Any, path: tuple[Any, ...]) -> Finalizer:
        """Fill ``target.state_dict()`` from the saved dict ``node``, then hand it to ``target.load_state_dict``."""
        state = own_containers(target.state_dict())
        if isinstance(target, torch.optim.Optimizer) and node[0] in (DICT, ODICT):
            check_param_groups(node, state, path, self.version)
        if isinstance(target, torch.nn.Module) and node[0] in (DICT, ODICT):
            # a module takes exactly its own keys: a saved one it lacks would fail load_state_dict after the
            # other tensors were filled (an optimizer's empty state, by contrast, is filled from the saved one)
            unknown = [k for k in (self.build(knode) for knode, _ in node[1]) if k not in state]
            if unknown:
                raise StateMismatchError(f"{_p(path + (unknown[0],))}: saved in version {self.version[:12]} but not "
                                         f"in the {type(target).__name__} in `into`"
                                         f"{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''}; build "
                                         f"the model with the saved configuration, or load without into=")
        inner = self.bind(node, state, path)

        def load_stateful() -> Any:
            target.load_state_dict(inner())
            return target
        return load_stateful

    def _bind_tensor(self, node: Any, target: Any, path: tuple[Any, ...]) -> Finalizer:
        e = self.entries[node[1]]
        dest = target
        if isinstance(target, np.ndarray):
            if tuple(target.shape) != e.shape:
                raise StateMismatchError(f"{_p(path)}: shape {list(target.shape)} in `into` but {list(e.shape)} in "
                                         f"version {self.version[:12]}; build the state with the saved configuration")
            dest = fillable_array(target)
            if dest is None:   # replacing it in its container would leave every other reference to it unfilled
                raise StateMismatchError(f"{_p(path)}: the numpy array in `into` cannot be filled in place "
                                         f"(read-only, not C-contiguous or not native byte order); pass a writable "
                                         f"contiguous array (np.array(a)), or load without into=")
        if not isinstance(dest, torch.Tensor):
            if target is None:
                return lambda: self.build(node)
            raise StateMismatchError(f"{_p(path)}: version {self.version[:12]} saved a tensor there but `into` "
                                     f"holds {type(target).__name__}; pass a tensor of shape {list(e.shape)}")
        if dest.is_meta:
            raise meta_target_error(_p(path))
        if tuple(dest.shape) != e.shape:
            raise StateMismatchError(f"{_p(path)}: shape {list(dest.shape)} in `into` but {list(e.shape)} in version "
                                     f"{self.version[:12]}; build the state with the saved configuration")
        if DTYPE_NAMES.get(dest.dtype) != e.dtype:
            raise StateMismatchError(f"{_p(path)}: dtype {dest.dtype} in `into` but {e.dtype} in version "
                                     f"{self.version[:12]}; cast after loading, or load without into=")
        if overlapping_elements(dest):
            raise overlap_error(_p(path))
        # a parameter (requires_grad) is filled through a detached view of its storage: an in-place copy into the
        # leaf itself is refused by autograd, in the reader threads too (grad mode is per thread)
        self.destinations[node[1]] = dest.detach() if dest.requires_grad else dest
        return lambda: target

    def _bind_dict(self, node: Any, target: dict, path: tuple[Any, ...]) -> Finalizer:
        saved_keys = []
        finals: list[tuple[Any, Finalizer]] = []
        for knode, vnode in node[1]:
            key = self.build(knode)
            saved_keys.append(key)
            if key in target:
                finals.append((key, self.bind(vnode, target[key], path + (key,))))
            else:
                finals.append((key, functools.partial(self.build, vnode)))
        saved = set(saved_keys)
        extra = [k for k in target if k not in saved]
        if extra:
            raise StateMismatchError(f"{_p(path + (extra[0],))}: present in `into` but not saved in version "
                                     f"{self.version[:12]}; remove it from the state or load without into=")

        def assign() -> Any:
            for key, fin in finals:
                target[key] = fin()
            return target
        return assign

    def _bind_sequence(self, node: Any, target: list | tuple, path: tuple[Any, ...]) -> Finalizer:
        children = node[1]
        if len(children) != len(target) and not holds_tensors(node) and not _holds_arrays(target):
            # plain values only (a loss history, a sampler's remaining indices): replaced whole, whatever its length
            if isinstance(target, list) and node[0] == LIST:
                def replace() -> Any:
                    target[:] = self.build(node)
                    return target
                return replace
            return lambda: self.build(node)
        if len(children) != len(target):
            raise StateMismatchError(f"{_p(path)}: {len(target)} items in `into` but {len(children)} saved in version "
                                     f"{self.version[:12]}; build the state with the saved configuration, or load "
                                     f"without into=")
        finals = [self.bind(c, t, path + (i,)) for i, (c, t) in enumerate(zip(children, target))]
        if isinstance(target, list) and node[0] == LIST:
            def assign() -> Any:
                for i, fin in enumerate(finals):
                    target[i] = fin()
                return target
            return assign
        return lambda: (list if node[0] == LIST else tuple)(fin() for fin in finals)


def check_param_groups(node: Any, state: dict, path: tuple[Any, ...], version: str) -> None:
    """An optimizer built with other parameter groups than the saved one (``node``, its saved state_dict):
    refused before anything is filled (its ``load_state_dict`` would refuse it only after the model was
    overwritten, or, through a layout load, take the saved moments by index into the wrong parameters)."""
    saved = _saved_field(node, "param_groups")
    if saved is None or saved[0] != LIST or not isinstance(state.get("param_groups"), list):
        return
    sizes = []
    for group in saved[1]:
        params = _saved_field(group, "params")
        sizes.append(len(params[1]) if params is not None and params[0] in (LIST, TUPLE) else None)
    mine = [len(g["params"]) if isinstance(g, dict) and isinstance(g.get("params"), (list, tuple)) else None
            for g in state["param_groups"]]
    if sizes != mine:
        raise StateMismatchError(f"{_p(path + ('param_groups',))}: the optimizer in `into` has parameter groups "
                                 f"of {mine} parameters but version {version[:12]} saved groups of {sizes}; "
                                 f"build it with the saved groups, or load without into=")


def _saved_field(node: Any, key: str) -> Any:
    """The skeleton node saved under the str ``key`` of a saved dict node, or None (also for a node that is
    not a dict)."""
    if node[0] not in (DICT, ODICT):
        return None
    return next((v for k, v in node[1] if k == [SCALAR, key]), None)


def fillable_array(target: np.ndarray) -> torch.Tensor | None:
    """A tensor over the numpy array's own memory that a load can fill in place, or None if it cannot be one."""
    if not (target.flags.writeable and target.flags.c_contiguous and target.dtype.isnative):
        return None
    try:
        return torch.from_numpy(torch_viewable(target))
    except TypeError:
        return None


def _holds_arrays(obj: Any) -> bool:
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return True
    if isinstance(obj, dict):
        return any(_holds_arrays(v) for v in obj.values())
    return isinstance(obj, (list, tuple)) and any(_holds_arrays(v) for v in obj)


def meta_target_error(where: str) -> StateMismatchError:
    """A tensor of ``into`` on the meta device: copying into it does nothing and raises nothing, so a load
    would return the state untouched, as if restored."""
    return StateMismatchError(f"{where}: the tensor in `into` is on the meta device, with no memory to load into; "
                              f"materialise the model first (module.to_empty(device=...)), or load without into= "
                              f"and call load_state_dict(..., assign=True)")


def _kind(tag: str) -> str:
    return {DICT: "dict", ODICT: "dict", LIST: "list", TUPLE: "tuple", STATEFUL: "state dict",
            NPGEN: "numpy Generator"}.get(tag, "plain value")
