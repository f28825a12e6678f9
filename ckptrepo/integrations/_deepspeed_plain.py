"""DeepSpeed's values as plain data, and back: the few DeepSpeed types its state dicts hold, from a fixed list.

DeepSpeed's checkpoint files are pickles; a version holds plain data only, so the DeepSpeed objects in its
state dicts are stored as ``{TYPE_KEY: ...}`` dicts and rebuilt on load. What a stored value may rebuild is
fixed here, by full class path, with the fields or attributes each may carry: a repository is data from
wherever it came from, and a name it holds must never choose a module to import, a class to build or an
attribute to set (docs/decisions/044-untrusted-framework-data.md). A DeepSpeed release that adds a type
or an attribute to its state dicts is refused at save, naming it, rather than stored and then refused at
load.
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
from collections import OrderedDict
from typing import Any

import torch

from ckptrepo.errors import CorruptionError, UnsupportedValueError, first_line

TYPE_KEY = "__ckptrepo_type__"   # the key of a dict that stands for a value of another type (see to_plain)

# the DeepSpeed types of its checkpoint state dicts (ZeRO 0-3, fp16 and bf16 optimizers), by kind
ENUMS = frozenset({"deepspeed.runtime.zero.config.ZeroStageEnum"})
DATACLASSES: dict[str, dict[str, type]] = {
    "deepspeed.utils.tensor_fragment.fragment_address": {"numel": int, "start": int},
}
_SCALER_ATTRS = frozenset({"cur_scale", "dynamic", "dtype"})
LOSS_SCALERS: dict[str, frozenset[str]] = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": _SCALER_ATTRS,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": _SCALER_ATTRS | {
        "cur_iter", "last_overflow_iter", "scale_factor", "scale_window", "min_scale", "delayed_shift",
        "cur_hysteresis", "consecutive_hysteresis", "raise_error_at_min_scale"},
}
_SCALAR = (bool, int, float, type(None), torch.dtype)   # what a loss scaler's attributes hold


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def to_plain(obj: Any, where: str = "") -> Any:
    """``obj`` with each value the skeleton cannot hold as such replaced by a ``{TYPE_KEY: ...}`` dict of plain
    data: enum members (``ZeroStageEnum`` would otherwise load as a bare int), dataclass instances and loss
    scalers of the lists above, ``argparse.Namespace`` (Megatron-DeepSpeed's ``args``), sets. A dict of the
    caller's own that holds ``TYPE_KEY`` is wrapped in a node of its own, so it never reads as one of
    these. Tensors and containers are shared or rebuilt, never copied. Anything else is left for the snapshot
    to refuse; a loss scaler with attributes beyond its list is refused here (``where``: the file's entry)."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, dict):
        items = [(k, to_plain(v, f"{where}/{k}")) for k, v in obj.items()]
        plain = OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
        if TYPE_KEY in obj:
            return {TYPE_KEY: "dict", "ordered": isinstance(obj, OrderedDict), "items": dict(items)}
        return plain
    if isinstance(obj, list):
        return [to_plain(v, f"{where}/{i}") for i, v in enumerate(obj)]
    if type(obj) is tuple:
        return tuple(to_plain(v, f"{where}/{i}") for i, v in enumerate(obj))
    path = _class_path(type(obj))
    if isinstance(obj, enum.Enum) and path in ENUMS:
        return {TYPE_KEY: "enum", "class": path, "name": obj.name}
    if isinstance(obj, (set, frozenset)):
        return {TYPE_KEY: type(obj).__name__, "items": [to_plain(v, where) for v in sorted(obj, key=repr)]}
    if isinstance(obj, argparse.Namespace):
        return {TYPE_KEY: "namespace", "attrs": to_plain(vars(obj), where)}
    if path in DATACLASSES and dataclasses.is_dataclass(obj):
        return {TYPE_KEY: "dataclass", "class": path,
                "fields": {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}
    if path in LOSS_SCALERS:
        extra = sorted(set(vars(obj)) - LOSS_SCALERS[path])
        if extra:
            raise UnsupportedValueError(f"{where or 'a DeepSpeed state'}: this DeepSpeed's {type(obj).__name__} "
                                        f"holds attributes ckptrepo does not store ({', '.join(extra)}); save "
                                        f"with DeepSpeed's default checkpoint engine, or a DeepSpeed release "
                                        f"whose loss scaler ckptrepo knows")
        return {TYPE_KEY: "attrs", "class": path, "attrs": to_plain(vars(obj), where)}
    return obj


def from_plain(obj: Any, where: str = "") -> Any:
    """``to_plain``'s inverse: rebuilds the values it replaced. Only the types of the lists above are rebuilt
    (and ``argparse.Namespace`` and sets), with their listed fields or attributes only, so a repository never
    names code to run. ``where`` (the file's entry) names the place of a malformed or forged node in the
    CorruptionError it raises."""
    if isinstance(obj, dict):
        if TYPE_KEY in obj:
            return _revive(obj, where)
        items = [(k, from_plain(v, f"{where}/{k}")) for k, v in obj.items()]
        return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
    if isinstance(obj, list):
        return [from_plain(v, f"{where}/{i}") for i, v in enumerate(obj)]
    if type(obj) is tuple:
        return tuple(from_plain(v, f"{where}/{i}") for i, v in enumerate(obj))
    return obj


def _refused(where: str, what: str) -> CorruptionError:
    return CorruptionError(f"{where or 'a DeepSpeed state'}: {what} (only DeepSpeed's own checkpoint types are "
                           f"rebuilt, from a fixed list); run `ckptrepo fsck` on the repository, or load an "
                           f"earlier tag")


def _deepspeed_class(path: Any, known: Any, where: str) -> Any:
    """The class ``path`` names when ``known`` (one of the lists above) holds it: imported from its own
    module, and only if it is that very class (not a name another module's class is imported under)."""
    if not isinstance(path, str) or path not in known:
        raise _refused(where, f"a stored DeepSpeed value names class {str(path)[:120]!r}, which is not one that "
                              f"kind rebuilds")
    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise UnsupportedValueError(f"the checkpoint holds a {path} that this DeepSpeed does not have; load it "
                                    f"with the DeepSpeed version that saved it") from None
    if not isinstance(cls, type) or _class_path(cls) != path:
        raise UnsupportedValueError(f"this DeepSpeed's {path} is not the class the checkpoint names; load it "
                                    f"with the DeepSpeed version that saved it")
    return cls


def _revive(node: dict[str, Any], where: str) -> Any:
    """The value ``node`` stands for; damage (a field missing or of the wrong type, a member the class does not
    have) is a CorruptionError naming the place, never a KeyError or TypeError from deep inside."""
    kind = node.get(TYPE_KEY)
    try:
        return _rebuild(kind, node, where)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        detail = f"{type(err).__name__}: {first_line(err)}"
        raise CorruptionError(f"{where or 'a DeepSpeed state'}: the stored DeepSpeed value of kind {kind!r} is "
                              f"malformed ({detail}); run `ckptrepo fsck` on the repository, or load an "
                              f"earlier tag") from None


def _rebuild(kind: Any, node: dict[str, Any], where: str) -> Any:
    if kind == "dict":   # a dict of the caller's that holds TYPE_KEY itself: its items are taken as they are
        items = [(k, from_plain(v, f"{where}/{k}")) for k, v in node["items"].items()]
        return OrderedDict(items) if node["ordered"] is True else dict(items)
    if kind in ("set", "frozenset"):
        items = [from_plain(v, f"{where}/{i}") for i, v in enumerate(node["items"])]
        return set(items) if kind == "set" else frozenset(items)
    if kind == "namespace":
        return argparse.Namespace(**from_plain(node["attrs"], where))
    if kind == "enum":
        cls = _deepspeed_class(node.get("class"), ENUMS, where)
        name = node["name"]
        if not isinstance(name, str) or name not in cls.__members__:
            raise ValueError(f"{cls.__name__} has no member {str(name)[:60]!r}")
        return cls.__members__[name]
    if kind == "dataclass":
        cls = _deepspeed_class(node.get("class"), DATACLASSES, where)
        fields, spec = node["fields"], DATACLASSES[_class_path(cls)]
        if not isinstance(fields, dict) or set(fields) != set(spec) \
                or not all(type(fields[k]) is t for k, t in spec.items()):
            raise ValueError(f"{cls.__name__} takes the fields {', '.join(spec)} as "
                             f"{', '.join(t.__name__ for t in spec.values())}")
        return cls(**fields)
    if kind == "attrs":
        cls = _deepspeed_class(node.get("class"), LOSS_SCALERS, where)
        attrs = node["attrs"]
        if not isinstance(attrs, dict):
            raise TypeError("its attributes are no dict")
        extra = sorted(str(k)[:40] for k in set(attrs) - LOSS_SCALERS[_class_path(cls)])
        if extra:
            raise _refused(where, f"a stored {cls.__name__} sets attributes it does not have ({', '.join(extra)})")
        odd = sorted(k for k, v in attrs.items() if not isinstance(v, _SCALAR))
        if odd:
            raise ValueError(f"attributes {', '.join(odd)} of a {cls.__name__} hold no number, flag or dtype")
        obj = cls.__new__(cls)   # its attributes as saved; __init__ would reset the scale it reached
        vars(obj).update(attrs)
        return obj
    raise _refused(where, f"a stored DeepSpeed value is of kind {str(kind)[:40]!r}, which is none ckptrepo "
                          f"rebuilds")
