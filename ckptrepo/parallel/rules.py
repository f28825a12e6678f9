"""Sharding rules: how each parameter of a model is split over tensor and pipeline ranks.

A rule maps a *global* parameter name pattern (``fnmatch``; pipeline-local
layer indices are renumbered to global ones first) to a split:

* :class:`Replicated` - every tensor-parallel rank holds the whole tensor (norms, row-parallel biases);
* :class:`Split` - split evenly along ``dim`` (column-parallel: dim 0 of a weight; row-parallel: dim 1);
* :class:`VocabSplit` - a vocabulary-parallel embedding: stored unpadded with ``size`` rows, held
  padded to a multiple of ``multiple * tp`` rows (the padding rows are dropped on save and come back
  as zeros on load);
* :class:`Fused` - sub-parameters concatenated along ``dim`` (QKV, gate/up), each split on its own,
  so a rank holds ``[q_k; k_k; v_k]``.

A ``Rules`` object also names the *sections* of the state that hold
parameters keyed by name (the model, and each optimizer state keyed like the
model), and the pipeline structure: a layer prefix (``layers.<i>.``), the
number of layers, optional per-stage counts, and which non-layer parameters
live only on the first or last stage.

For ZeRO-3 the rules also list every parameter's global name and shape in
model order (``param_shapes``): a rank then holds its parameters as one flat
partition, and nothing in its state says which parameters that partition
covers. DeepSpeed stores the same list (``param_shapes``) beside its ZeRO-3
partitions for the same reason.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Iterable, Mapping, Sequence, Union

from ckptrepo.arguments import is_whole
from ckptrepo.errors import LayoutError
from ckptrepo.parallel.layout import stage_layers

Region = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]   # (local offsets, global offsets, sizes)
ParamShapes = Union[Mapping[str, Sequence[int]], Iterable[Sequence[Any]]]   # {name: shape} or [(name, shape), ...]


@dataclass(frozen=True)
class Replicated:
    """The whole tensor on every tensor-parallel rank."""

    def to_json(self) -> list[Any]:
        return ["replicated"]


@dataclass(frozen=True)
class Split:
    """Split evenly along ``dim`` over the tensor-parallel ranks."""

    dim: int

    def __post_init__(self) -> None:
        if not is_whole(self.dim):
            raise LayoutError(f"Split(dim={self.dim!r}): the dimension to split is a whole number")

    def to_json(self) -> list[Any]:
        return ["split", self.dim]


@dataclass(frozen=True)
class VocabSplit:
    """A vocabulary-parallel tensor: ``size`` real rows, padded to a multiple of ``multiple * tp``, split along
    ``dim``."""

    size: int
    multiple: int = 128
    dim: int = 0

    def __post_init__(self) -> None:
        # a zero multiple divides by zero when padding; a negative one pads the rows away
        if not all(is_whole(v) for v in (self.size, self.multiple, self.dim)) or self.size < 1 or self.multiple < 1:
            raise LayoutError(f"VocabSplit(size={self.size}, multiple={self.multiple}): the vocabulary size and "
                              f"the padding multiple (make_vocab_size_divisible_by) must be at least 1")

    def padded(self, tp: int) -> int:
        m = self.multiple * tp
        return -(-self.size // m) * m

    def to_json(self) -> list[Any]:
        return ["vocab", self.size, self.multiple, self.dim]


@dataclass(frozen=True)
class Fused:
    """Sub-parameters of global sizes ``parts`` concatenated along ``dim``; each split on its own.

    ``parts`` may be a count of equal parts (3 for QKV) or the list of sizes (grouped-query attention).
    """

    parts: Union[int, tuple[int, ...]]
    dim: int = 0

    def __post_init__(self) -> None:
        # a zero count divides by zero; negative counts or sizes give regions outside the tensor, or none
        counts = (self.parts,) if isinstance(self.parts, int) else self.parts
        if not isinstance(counts, (tuple, list)) or not counts or not all(is_whole(c) and c >= 1 for c in counts) \
                or not is_whole(self.dim):
            raise LayoutError(f"Fused({self.parts!r}): give a count of at least 1 equal parts, or part sizes "
                              f"of at least 1 each")

    def sizes(self, global_size: int) -> tuple[int, ...]:
        if isinstance(self.parts, int):
            if global_size % self.parts:
                raise LayoutError(f"size {global_size} cannot be cut into {self.parts} equal fused parts")
            return (global_size // self.parts,) * self.parts
        if sum(self.parts) != global_size:
            raise LayoutError(f"fused parts {list(self.parts)} do not add up to size {global_size}")
        return tuple(self.parts)

    def to_json(self) -> list[Any]:
        return ["fused", self.parts if isinstance(self.parts, int) else list(self.parts), self.dim]


Spec = Union[Replicated, Split, VocabSplit, Fused]
# (local name, global name, local shape, spec, global shape) of a parameter a rank holds
LocalParam = tuple[str, str, tuple[int, ...], Spec, tuple[int, ...]]


def spec_from_json(d: Sequence[Any]) -> Spec:
    kind = d[0]
    if kind == "replicated":
        return Replicated()
    if kind == "split":
        return Split(int(d[1]))
    if kind == "vocab":
        return VocabSplit(int(d[1]), int(d[2]), int(d[3]))
    if kind == "fused":
        return Fused(d[1] if isinstance(d[1], int) else tuple(d[1]), int(d[2]))
    raise LayoutError(f"unknown sharding rule {kind!r}; the repository was written by a newer ckptrepo")


def _divide(size: int, tp: int, what: str) -> int:
    if size % tp:
        raise LayoutError(f"{what}: size {size} cannot be split evenly over tp={tp} ranks; choose a tp that divides it")
    return size // tp


def _split_dim(spec: Spec, shape: Sequence[int], what: str) -> int | None:
    """The dimension ``spec`` splits (None for a replicated tensor), checked against ``shape``."""
    if isinstance(spec, Replicated):
        return None
    if not -len(shape) <= spec.dim < len(shape):
        raise LayoutError(f"{what}: rule splits dim {spec.dim} but the tensor has shape {list(shape)}")
    return spec.dim


def local_shape(spec: Spec, global_shape: Sequence[int], tp: int, what: str = "tensor") -> tuple[int, ...]:
    """The shape a tensor-parallel rank holds for a tensor of ``global_shape``."""
    shape = list(global_shape)
    d = _split_dim(spec, shape, what)
    if d is None:
        return tuple(shape)
    if isinstance(spec, Split):
        shape[d] = _divide(shape[d], tp, what)
    elif isinstance(spec, VocabSplit):
        if shape[d] != spec.size:
            raise LayoutError(f"{what}: {shape[d]} rows saved but the rules say the vocabulary has {spec.size}")
        shape[d] = spec.padded(tp) // tp
    else:
        assert isinstance(spec, Fused), spec   # Replicated has no split dimension: returned above
        shape[d] = sum(_divide(s, tp, what) for s in spec.sizes(shape[d]))
    return tuple(shape)


def global_shape(spec: Spec, local: Sequence[int], tp: int, what: str = "tensor") -> tuple[int, ...]:
    """The global (unpadded) shape of a tensor a tensor-parallel rank holds with shape ``local``."""
    shape = list(local)
    d = _split_dim(spec, shape, what)
    if d is None:
        return tuple(shape)
    if isinstance(spec, VocabSplit):
        # one rank holding the whole vocabulary may hold it unpadded, as an unsharded load returns it: its
        # rows are then the global rows, and the padding a tensor-parallel load adds is zeros either way
        unpadded = tp == 1 and shape[d] == spec.size
        if shape[d] * tp != spec.padded(tp) and not unpadded:
            hint = (f"; each rank holds {spec.padded(tp) // tp} rows: the vocabulary padded with zero rows to "
                    f"{spec.padded(tp)}, split over tp={tp} ranks" if shape[d] * tp == spec.size
                    else "; check the rules")
            raise LayoutError(f"{what}: {shape[d]} local rows x tp={tp} is not the padded vocabulary "
                              f"{spec.padded(tp)} (size {spec.size}, multiple {spec.multiple}){hint}")
        shape[d] = spec.size
    else:
        shape[d] *= tp
    return tuple(shape)


def regions(spec: Spec, gshape: Sequence[int], tp: int, tp_rank: int) -> list[Region]:
    """The boxes of the global tensor that tensor-parallel rank ``tp_rank`` holds, and where they sit locally."""
    gshape = tuple(gshape)
    zeros = (0,) * len(gshape)
    if isinstance(spec, Replicated):
        return [(zeros, zeros, gshape)] if all(gshape) or not gshape else []
    d = spec.dim

    def along(local_off: int, global_off: int, size: int) -> Region:
        lo, go, sz = list(zeros), list(zeros), list(gshape)
        lo[d], go[d], sz[d] = local_off, global_off, size
        return tuple(lo), tuple(go), tuple(sz)

    if isinstance(spec, Split):
        n = gshape[d] // tp
        return [along(0, tp_rank * n, n)] if n else []
    if isinstance(spec, VocabSplit):
        n = spec.padded(tp) // tp
        start = tp_rank * n
        real = max(0, min(spec.size, start + n) - start)
        return [along(0, start, real)] if real else []
    out = []
    local_off = global_off = 0
    for size in spec.sizes(gshape[d]):
        n = size // tp
        if n:
            out.append(along(local_off, global_off + tp_rank * n, n))
        local_off += n
        global_off += size
    return out


def _whole(value: Any) -> bool:
    return is_whole(value) and value >= 0


def _seq(value: Any, name: str) -> Any:
    """``value`` if it is a list-like argument (text is not: it would be read as a list of letters)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise LayoutError(f"Rules({name}=...) is a list, not {type(value).__name__} {value!r:.40}")
    return value


def _check_structure(params: Any, sections: Any, layer_prefix: Any, num_layers: Any, stage_sizes: Any) -> None:
    """Refuse rules that cannot describe a model, when they are made: a negative layer count would make every
    stage empty, and a wrong type would fail deep inside a snapshot or load."""
    if num_layers is not None and not _whole(num_layers):
        raise LayoutError(f"num_layers must be a whole number of at least 0 (the model's layer count), "
                          f"not {num_layers!r}")
    if stage_sizes is not None and not all(_whole(n) for n in stage_sizes):
        raise LayoutError(f"stage_sizes must be the layer count of each pipeline stage, whole numbers of at least 0, "
                          f"not {stage_sizes!r}")
    if not isinstance(layer_prefix, str):
        raise LayoutError(f"layer_prefix must be text (e.g. 'layers.'), not {layer_prefix!r}")
    if not sections or not all(isinstance(x, str) for x in sections):
        raise LayoutError(f"sections must name at least one section of the state (e.g. ('model',)), not {sections!r}")
    for rule in params:
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)
                and isinstance(rule[1], (Replicated, Split, VocabSplit, Fused))):
            raise LayoutError(f"each rule is (a name pattern, Replicated() / Split(dim) / VocabSplit(...) / "
                              f"Fused(...)), not {rule!r}")


class Rules:
    """Parameter split rules plus the pipeline structure of a model (see the module docstring)."""

    def __init__(self, params: Sequence[tuple[str, Spec]] = (), sections: Sequence[str] = ("model",),
                 optimizer_sections: Sequence[str] = (), layer_prefix: str = "layers.",
                 num_layers: int | None = None, stage_sizes: Sequence[int] | None = None,
                 first_stage: Sequence[str] = (), last_stage: Sequence[str] = (),
                 param_shapes: ParamShapes | None = None) -> None:
        params, sections = list(_seq(params, "params")), tuple(_seq(sections, "sections"))
        stage_sizes = tuple(_seq(stage_sizes, "stage_sizes")) if stage_sizes is not None else None
        _check_structure(params, sections, layer_prefix, num_layers, stage_sizes)
        self.params = params
        self.sections = sections                    # sections keyed by parameter name
        self.optimizer_sections = tuple(optimizer_sections)  # flat ZeRO partitions when zero >= 1
        self.layer_prefix = layer_prefix
        self.num_layers = num_layers
        self.stage_sizes = stage_sizes
        self.first_stage = tuple(first_stage)
        self.last_stage = tuple(last_stage)
        self._layer_re = re.compile(rf"^{re.escape(layer_prefix)}(\d+)(\..*)?$")
        items: Iterable[tuple[Any, Any]] | None = (
            param_shapes.items() if isinstance(param_shapes, Mapping) else param_shapes)   # type: ignore[assignment]
        # global parameter name -> global shape, in model order (the order of a ZeRO-3 flat partition)
        self.param_shapes: dict[str, tuple[int, ...]] | None = (
            None if items is None else {str(n): tuple(int(d) for d in shape) for n, shape in items})

    def replaced(self, **changes: Any) -> "Rules":
        """A copy with the constructor arguments in ``changes`` replaced (``stage_sizes=None``, ...)."""
        args: dict[str, Any] = {"params": self.params, "sections": self.sections,
                                "optimizer_sections": self.optimizer_sections,
                "layer_prefix": self.layer_prefix, "num_layers": self.num_layers, "stage_sizes": self.stage_sizes,
                "first_stage": self.first_stage, "last_stage": self.last_stage, "param_shapes": self.param_shapes}
        args.update(changes)
        return Rules(**args)

    def with_param_shapes(self, param_shapes: ParamShapes) -> "Rules":
        """The same rules with ``param_shapes`` (a loader fills them in from a version's tensor table)."""
        return self.replaced(param_shapes=param_shapes)

    def for_pp(self, pp: int) -> "Rules":
        """These rules for ``pp`` pipeline stages: explicit stage sizes made for another stage count (a
        version's saved rules, loaded under a new layout) give way to the even split."""
        if self.stage_sizes is None or len(self.stage_sizes) == pp:
            return self
        return self.replaced(stage_sizes=None)

    def local_params(self, tp: int, tp_rank: int, pp: int, pp_rank: int) -> list[LocalParam]:
        """The parameters a rank holds, in model order: the layout of its ZeRO flat partitions.

        Needs ``param_shapes``; each entry is ``(local name, global name, local shape, spec, global shape)``.
        """
        if self.param_shapes is None:
            raise LayoutError("ZeRO-3 keeps parameters as flat partitions, so the rules must list every parameter's "
                              "global shape in model order: pass param_shapes= to Rules (or megatron_gpt)")
        out = []
        for gparam, gshape in self.param_shapes.items():
            local = self.to_local(gparam, pp, pp_rank)
            if local is not None:
                spec = self.spec(gparam)
                out.append((local, gparam, local_shape(spec, gshape, tp, gparam), spec, gshape))
        return out

    @property
    def model_section(self) -> str:
        return self.sections[0]

    def all_sections(self) -> tuple[str, ...]:
        return self.sections + tuple(s for s in self.optimizer_sections if s not in self.sections)

    def spec(self, param: str) -> Spec:
        """The split of global parameter ``param`` (first matching rule; replicated when none matches)."""
        for pattern, spec in self.params:
            if fnmatchcase(param, pattern):
                return spec
        return Replicated()

    def _layers(self, pp: int, pp_rank: int) -> range:
        if self.num_layers is None:
            if pp > 1:
                raise LayoutError("pipeline parallel layouts need the rules to know num_layers")
            return range(0, 1 << 62)
        return stage_layers(self.num_layers, pp, pp_rank, self.stage_sizes)

    def layer_index(self, param: str) -> int | None:
        """The layer number in ``param`` (``layers.<i>.…``), or None outside the layers."""
        m = self._layer_re.match(param)
        return int(m.group(1)) if m is not None else None

    def to_global(self, param: str, pp: int, pp_rank: int) -> str:
        """Global name of a stage-local parameter name (local layer i -> first layer of the stage + i)."""
        m = self._layer_re.match(param)
        if m is not None and pp == 1 and self.num_layers is not None and int(m.group(1)) >= self.num_layers:
            raise LayoutError(f"{param}: the rules say num_layers={self.num_layers}; give the rules the model's "
                              f"layer count")
        if m is None or pp == 1:
            return param
        layers = self._layers(pp, pp_rank)
        i = int(m.group(1))
        if i >= len(layers):
            raise LayoutError(f"{param}: pipeline stage {pp_rank} holds {len(layers)} layers, not layer {i}")
        return f"{self.layer_prefix}{layers.start + i}{m.group(2) or ''}"

    def to_local(self, param: str, pp: int, pp_rank: int) -> str | None:
        """Stage-local name of global parameter ``param``, or None when stage ``pp_rank`` does not hold it."""
        m = self._layer_re.match(param)
        if m is not None:
            layers = self._layers(pp, pp_rank)
            i = int(m.group(1))
            if i not in layers:
                return None
            return f"{self.layer_prefix}{i - layers.start}{m.group(2) or ''}" if pp > 1 else param
        if any(fnmatchcase(param, p) for p in self.first_stage) and pp_rank != 0:
            return None
        if any(fnmatchcase(param, p) for p in self.last_stage) and pp_rank != pp - 1:
            return None
        return param

    def section_of(self, path: str) -> tuple[str, str] | None:
        """``(section, parameter)`` for a key path inside a parameter section, else None."""
        for s in self.all_sections():
            if path.startswith(s + "/"):
                return s, path[len(s) + 1:]
        return None

    def to_json(self) -> dict[str, Any]:
        return {"params": [[p, s.to_json()] for p, s in self.params], "sections": list(self.sections),
                "optimizer_sections": list(self.optimizer_sections), "layer_prefix": self.layer_prefix,
                "num_layers": self.num_layers, "stage_sizes": list(self.stage_sizes) if self.stage_sizes else None,
                "first_stage": list(self.first_stage), "last_stage": list(self.last_stage),
                **({"param_shapes": [[n, list(s)] for n, s in self.param_shapes.items()]}
                   if self.param_shapes is not None else {})}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Rules":
        return cls([(p, spec_from_json(s)) for p, s in d["params"]], d["sections"], d["optimizer_sections"],
                   d["layer_prefix"], d["num_layers"], d["stage_sizes"], d["first_stage"], d["last_stage"],
                   d.get("param_shapes"))


def megatron_gpt(num_layers: int, vocab_size: int, make_vocab_size_divisible_by: int = 128,
                 stage_sizes: Sequence[int] | None = None, qkv_parts: Union[int, Sequence[int]] = 3,
                 optimizer_sections: Sequence[str] = ("optimizer/exp_avg", "optimizer/exp_avg_sq"),
                 param_shapes: ParamShapes | None = None) -> Rules:
    """Rules for a Megatron-style GPT, whose parameter names the README's table under "Distributed: save under
    one layout, load under any other" lists.

    ``embedding.word_embeddings.weight`` and ``head.weight`` are vocabulary
    parallel; ``attn.qkv`` is column parallel with fused q, k, v; ``mlp.fc1``
    column parallel; ``attn.proj`` and ``mlp.fc2`` weights row parallel (their
    biases, the layer norms and the position embeddings are replicated). The
    embeddings live on the first pipeline stage, the final norm and the head on
    the last. The optimizer's state sections are keyed like the model.
    ``param_shapes`` (global names and shapes in model order) is needed to save
    under ZeRO-3 only.
    """
    vocab = VocabSplit(vocab_size, make_vocab_size_divisible_by, 0)
    qkv = Fused(qkv_parts if isinstance(qkv_parts, int) else tuple(qkv_parts), 0)
    return Rules(
        params=[("embedding.word_embeddings.weight", vocab), ("head.weight", vocab),
                ("*.attn.qkv.weight", qkv), ("*.attn.qkv.bias", qkv),
                ("*.attn.proj.weight", Split(1)), ("*.mlp.fc1.weight", Split(0)), ("*.mlp.fc1.bias", Split(0)),
                ("*.mlp.fc2.weight", Split(1))],
        sections=("model",), optimizer_sections=tuple(optimizer_sections), layer_prefix="layers.",
        num_layers=num_layers, stage_sizes=stage_sizes,
        first_stage=("embedding.*",), last_stage=("final_ln.*", "head.*"), param_shapes=param_shapes)


__all__ = ["Fused", "LocalParam", "ParamShapes", "Region", "Replicated", "Rules", "Spec", "Split", "VocabSplit",
           "global_shape", "local_shape",
           "megatron_gpt", "regions"]
