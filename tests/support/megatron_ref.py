"""A reference Megatron-style GPT, trained with real tensor, pipeline and data parallelism on gloo.

It is the oracle of the resharding tests: state saved under one parallel
layout (tp, pp, dp, ZeRO stage) and loaded under another must train on as if
nothing happened. So this module shards and reassembles the state on its own
(:func:`shard_full`, :func:`assemble`), never through ckptrepo's rules; it
shares with ckptrepo only the conventions of :mod:`ckptrepo.parallel.layout` (rank
order, ZeRO flat partitions, pipeline stage sizes), and its parameter names
are those :func:`ckptrepo.rules.megatron_gpt` describes.

The model is a tiny pre-LayerNorm GPT in fp32 without dropout, trained with a
hand-written element-wise Adam, so the per-parameter (ZeRO-0) and flat
partition (ZeRO-1 and 3) optimizers compute the same numbers, and batches derive
from the step number alone, so every layout sees the same data. Losses of
different layouts agree to float tolerance, not bit for bit: the reduction
order of the collectives differs.

One rank's state, the thing a test snapshots::

    {"model": {local name: tensor} (zero<3)         # tp/pp-local, vocabulary padded; the live parameters
              or one flat 1-D tensor (zero=3),      # this dp rank's partition of them, gathered at every step
     "optimizer": {"step": int,
                   "exp_avg": {local name: tensor} (zero=0) or one flat 1-D tensor (zero>=1),
                   "exp_avg_sq": same},
     "rng": {"seed": int, "torch": uint8 tensor}}   # a per-rank generator's state, advanced once per step
"""
from __future__ import annotations

import io
import math
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ckptrepo.parallel.layout import ParallelLayout, stage_layers, zero_partition
from support.ckpt_workers import mp_context

LR = 1e-2
BETAS = (0.9, 0.95)
EPS = 1e-8
DATA_SEED = 1234
RNG_SEED = 4321
LAUNCH_TIMEOUT = 120.0

State = dict[str, Any]
Tensors = dict[str, torch.Tensor]

LAYER_PARAMS = ("ln1.weight", "ln1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias",
                "ln2.weight", "ln2.bias", "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias")
FIRST_STAGE_PARAMS = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
LAST_STAGE_PARAMS = ("final_ln.weight", "final_ln.bias", "head.weight")


@dataclass(frozen=True)
class GPTConfig:
    """Model size; ``batch`` is the global batch (sequences per step), split evenly over data-parallel ranks."""

    vocab_size: int = 250
    hidden: int = 32
    heads: int = 4
    layers: int = 4
    seq: int = 16
    make_vocab_size_divisible_by: int = 8
    batch: int = 8

    def padded_vocab(self, tp: int) -> int:
        """Megatron's padded vocabulary: a multiple of ``make_vocab_size_divisible_by * tp`` rows."""
        m = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // m) * m


# ---- names and shapes ----------------------------------------------------------------------------------------

def global_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every global (unpadded) parameter name and shape, in model order."""
    h, v = cfg.hidden, cfg.vocab_size
    layer = {"ln1.weight": (h,), "ln1.bias": (h,), "attn.qkv.weight": (3 * h, h), "attn.qkv.bias": (3 * h,),
             "attn.proj.weight": (h, h), "attn.proj.bias": (h,), "ln2.weight": (h,), "ln2.bias": (h,),
             "mlp.fc1.weight": (4 * h, h), "mlp.fc1.bias": (4 * h,), "mlp.fc2.weight": (h, 4 * h),
             "mlp.fc2.bias": (h,)}
    shapes: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (v, h),
                                          "embedding.position_embeddings.weight": (cfg.seq, h)}
    for i in range(cfg.layers):
        shapes.update({f"layers.{i}.{k}": layer[k] for k in LAYER_PARAMS})
    shapes.update({"final_ln.weight": (h,), "final_ln.bias": (h,), "head.weight": (v, h)})
    return shapes


def stage_params(cfg: GPTConfig, pp: int, pp_rank: int) -> list[tuple[str, str]]:
    """``(local name, global name)`` of the parameters pipeline stage ``pp_rank`` holds, in local model order."""
    out = [(n, n) for n in FIRST_STAGE_PARAMS] if pp_rank == 0 else []
    layers = stage_layers(cfg.layers, pp, pp_rank)
    for i in layers:
        out += [(f"layers.{i - layers.start}.{k}", f"layers.{i}.{k}") for k in LAYER_PARAMS]
    if pp_rank == pp - 1:
        out += [(n, n) for n in LAST_STAGE_PARAMS]
    return out


def _kind(name: str) -> str:
    """How global parameter ``name`` is split over tensor-parallel ranks."""
    if name in ("embedding.word_embeddings.weight", "head.weight"):
        return "vocab"
    if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
        return "qkv"
    if name.endswith(("mlp.fc1.weight", "mlp.fc1.bias")):
        return "column"
    if name.endswith(("attn.proj.weight", "mlp.fc2.weight")):
        return "row"
    return "replicated"


def _shard(cfg: GPTConfig, name: str, full: torch.Tensor, tp: int, k: int) -> torch.Tensor:
    """Tensor-parallel rank ``k``'s own copy of its part of global tensor ``full``."""
    kind = _kind(name)
    if kind == "vocab":
        padded = full.new_zeros((cfg.padded_vocab(tp), *full.shape[1:]))
        padded[:full.shape[0]] = full
        return padded.chunk(tp, 0)[k].clone()
    if kind == "qkv":
        return torch.cat([part.chunk(tp, 0)[k] for part in full.chunk(3, 0)])
    if kind == "column":
        return full.chunk(tp, 0)[k].clone()
    if kind == "row":
        return full.chunk(tp, 1)[k].clone()
    return full.clone()


def local_shapes(cfg: GPTConfig, layout: ParallelLayout, rank: int) -> dict[str, tuple[int, ...]]:
    """Local name -> shape of the parameters rank ``rank`` holds, in model order (the order of ZeRO's flat buffers)."""
    return {local: _local_shape(cfg, name, layout.tp) for local, name in stage_params(cfg, layout.pp,
                                                                                       layout.coords(rank).pp)}


def _local_shape(cfg: GPTConfig, name: str, tp: int) -> tuple[int, ...]:
    """The shape a tensor-parallel rank holds of global parameter ``name``."""
    shape = list(global_shapes(cfg)[name])
    kind = _kind(name)
    if kind == "vocab":
        shape[0] = cfg.padded_vocab(tp) // tp
    elif kind in ("qkv", "column"):
        shape[0] //= tp
    elif kind == "row":
        shape[1] //= tp
    return tuple(shape)


def _unshard(cfg: GPTConfig, name: str, parts: list[torch.Tensor], where: str) -> torch.Tensor:
    """The global tensor from the parts of every tensor-parallel rank, in tp order (inverse of :func:`_shard`)."""
    kind = _kind(name)
    if kind == "vocab":
        padded = torch.cat(parts)
        if torch.any(padded[cfg.vocab_size:] != 0):
            raise AssertionError(f"{where}: vocabulary padding rows of {name} are not zero")
        return padded[:cfg.vocab_size].clone()
    if kind == "qkv":
        return torch.cat([torch.cat([p.chunk(3, 0)[j] for p in parts]) for j in range(3)])
    if kind == "column":
        return torch.cat(parts)
    if kind == "row":
        return torch.cat(parts, 1)
    for k, p in enumerate(parts[1:], 1):
        if not torch.equal(p, parts[0]):
            raise AssertionError(f"{where}: replicated {name} differs between tp ranks 0 and {k}")
    return parts[0].clone()


# ---- full state <-> per-rank states --------------------------------------------------------------------------

def init_full_params(cfg: GPTConfig, seed: int = 0) -> Tensors:
    """Deterministic global parameters: normal(0, 0.02) weights, zero biases, LayerNorm weights one."""
    g = torch.Generator().manual_seed(seed)
    out: Tensors = {}
    for name, shape in global_shapes(cfg).items():
        if name.endswith(("ln1.weight", "ln2.weight")) or name == "final_ln.weight":
            out[name] = torch.ones(shape)
        elif name.endswith(".bias"):
            out[name] = torch.zeros(shape)
        else:
            out[name] = torch.randn(shape, generator=g) * 0.02
    return out


def shard_full(cfg: GPTConfig, layout: ParallelLayout, rank: int, full_model: Tensors,
               full_optim: dict[str, Any] | None = None) -> State:
    """One rank's state from global tensors; ``full_optim`` ({"step", "exp_avg", "exp_avg_sq"}) defaults to zeros."""
    c = layout.coords(rank)
    names = stage_params(cfg, layout.pp, c.pp)
    model = {local: _shard(cfg, g, full_model[g], layout.tp, c.tp) for local, g in names}
    sections = {}
    for section in ("exp_avg", "exp_avg_sq"):
        local_state = ({local: _shard(cfg, g, full_optim[section][g], layout.tp, c.tp) for local, g in names}
                       if full_optim is not None else {local: torch.zeros_like(t) for local, t in model.items()})
        sections[section] = _partition(local_state, layout, c.dp) if layout.zero else local_state
    gen = torch.Generator().manual_seed(RNG_SEED + rank)
    return {"model": _partition(model, layout, c.dp) if layout.zero == 3 else model,
            "optimizer": {"step": int(full_optim["step"]) if full_optim is not None else 0, **sections},
            "rng": {"seed": RNG_SEED + rank, "torch": gen.get_state()}}


def _partition(tensors: Tensors, layout: ParallelLayout, dp_rank: int) -> torch.Tensor:
    """Data-parallel rank ``dp_rank``'s ZeRO partition of ``tensors`` back to back, its tail padded with zeros."""
    flat = torch.cat([t.reshape(-1) for t in tensors.values()])
    start, stop, size = zero_partition(flat.numel(), layout.dp, dp_rank)
    part = flat.new_zeros(size)
    part[:stop - start] = flat[start:stop]
    return part


def _views(flat: torch.Tensor, shapes: dict[str, tuple[int, ...]]) -> Tensors:
    """``flat`` cut into views of ``shapes``, in order: the layout of a ZeRO flat buffer."""
    out, offset = {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        out[name] = flat[offset:offset + n].view(shape)
        offset += n
    return out


def check_local_state(cfg: GPTConfig, layout: ParallelLayout, rank: int, state: State) -> None:
    """AssertionError unless rank ``rank``'s state has the local names, their order, shapes and dtype.

    The order matters beyond looks: ZeRO's flat buffers follow it, so a state
    loaded with its parameters reordered would train on scrambled optimizer
    state without this check.
    """
    names = stage_params(cfg, layout.pp, layout.coords(rank).pp)
    sections = [("model", state["model"])] if layout.zero < 3 else []
    if not layout.zero:
        sections += [(s, state["optimizer"][s]) for s in ("exp_avg", "exp_avg_sq")]
    for section, tensors in sections:
        if list(tensors) != [local for local, _ in names]:
            raise AssertionError(f"rank {rank}: {section} holds {list(tensors)}, "
                                 f"expected {[local for local, _ in names]} in that order")
        for local, name in names:
            t, want = tensors[local], _local_shape(cfg, name, layout.tp)
            if tuple(t.shape) != want or t.dtype != torch.float32:
                raise AssertionError(f"rank {rank}: {section} {local} is {t.dtype}{list(t.shape)}, "
                                     f"expected torch.float32{list(want)}")
    if layout.zero:
        total = sum(math.prod(s) for s in local_shapes(cfg, layout, rank).values())
        size = zero_partition(total, layout.dp, layout.coords(rank).dp)[2]
        flat = [("optimizer " + s, state["optimizer"][s]) for s in ("exp_avg", "exp_avg_sq")]
        for section, t in flat + ([("model", state["model"])] if layout.zero == 3 else []):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (size,) or t.dtype != torch.float32:
                got = f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise AssertionError(f"rank {rank}: flat {section} is {got}, expected torch.float32[{size}]")


def _local_section(cfg: GPTConfig, layout: ParallelLayout, states: dict[int, State], rank: int,
                   section: str) -> Tensors:
    """Rank ``rank``'s ``section`` ("model", "exp_avg", "exp_avg_sq") keyed by local name.

    A ZeRO flat partition is rebuilt from the partitions of the rank's dp group.
    """
    get = (lambda s: s["model"]) if section == "model" else (lambda s: s["optimizer"][section])
    if not layout.zero or (section == "model" and layout.zero < 3):
        return get(states[rank])
    shapes = local_shapes(cfg, layout, rank)
    total = sum(math.prod(s) for s in shapes.values())
    parts = []
    for d, r in enumerate(layout.group(rank, "dp")):
        start, stop, _ = zero_partition(total, layout.dp, d)
        part = get(states[r])
        if torch.any(part[stop - start:] != 0):
            raise AssertionError(f"rank {r}: the tail padding of {section} is not zero")
        parts.append(part[:stop - start])
    return _views(torch.cat(parts), shapes)


def assemble(cfg: GPTConfig, layout: ParallelLayout, states: dict[int, State]) -> dict[str, Any]:
    """Global unpadded tensors from the states of every rank; AssertionError on disagreeing replicas or padding.

    Returns ``{"model": {global name: tensor}, "optimizer": {"step", "exp_avg", "exp_avg_sq"}}``.
    """
    if sorted(states) != list(range(layout.world_size)):
        raise AssertionError(f"states of ranks {sorted(states)} given, layout {layout} has {layout.world_size}")
    for r, s in states.items():
        check_local_state(cfg, layout, r, s)
    steps = {r: s["optimizer"]["step"] for r, s in states.items()}
    if len(set(steps.values())) != 1:
        raise AssertionError(f"optimizer steps differ between ranks: {steps}")
    per_rank: dict[str, dict[int, Tensors]] = {sec: {r: _local_section(cfg, layout, states, r, sec) for r in states}
                                               for sec in ("model", "exp_avg", "exp_avg_sq")}
    out: dict[str, Tensors] = {}
    for section, tensors in per_rank.items():
        full: Tensors = {}
        for pp_rank in range(layout.pp):
            for local, name in stage_params(cfg, layout.pp, pp_rank):
                replicas = []
                for d in range(layout.dp):
                    ranks = [layout.rank_of(tp=k, pp=pp_rank, dp=d) for k in range(layout.tp)]
                    where = f"{section} of ranks {ranks}"
                    replicas.append(_unshard(cfg, name, [tensors[r][local] for r in ranks], where))
                for d, t in enumerate(replicas[1:], 1):
                    if not torch.equal(t, replicas[0]):
                        raise AssertionError(f"{section}: {name} differs between dp ranks 0 and {d} of stage {pp_rank}")
                full[name] = replicas[0]
        out[section] = full
    return {"model": out["model"],
            "optimizer": {"step": steps[0], "exp_avg": out["exp_avg"], "exp_avg_sq": out["exp_avg_sq"]}}


def assert_params_close(cfg: GPTConfig, actual: Tensors, expected: Tensors, steps: int, atol: float = 1e-5) -> None:
    """Assert global parameters trained ``steps`` steps under two layouts agree within ``atol``.

    Except the key part of each ``attn.qkv.bias``: adding a constant to every
    score of a query leaves its softmax unchanged, so that gradient is zero
    analytically and rounding noise (about 1e-12) alone drives it. Adam scales
    noise by 1/eps, so these elements move by a few 1e-6 a step, differently
    under each reduction order; they are only held to Adam's step bound,
    ``LR * steps``.
    """
    h = cfg.hidden
    if list(actual) != list(expected):
        raise AssertionError(f"parameter names differ: {sorted(set(actual) ^ set(expected))}")
    for name, want in expected.items():
        got = actual[name]
        if name.endswith("attn.qkv.bias"):
            torch.testing.assert_close(got[h:2 * h], want[h:2 * h], rtol=0, atol=LR * steps,
                                       msg=lambda m, name=name: f"{name} (keys): {m}")
            got, want = torch.cat([got[:h], got[2 * h:]]), torch.cat([want[:h], want[2 * h:]])
        torch.testing.assert_close(got, want, rtol=0, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


# ---- tensor-parallel collectives as autograd functions -------------------------------------------------------

class _CopyToTP(torch.autograd.Function):
    """Input of a column-parallel layer: identity forward, all-reduce of the input's gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Output of a row-parallel layer (or vocabulary-parallel lookup): all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """Vocabulary-parallel logits: all-gather along the last dim forward, this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.rank, ctx.width = dist.get_rank(group), x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, -1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad[..., ctx.rank * ctx.width:(ctx.rank + 1) * ctx.width].contiguous(), None


# ---- training ------------------------------------------------------------------------------------------------

def batch(cfg: GPTConfig, step: int, dp: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel rank ``dp_rank``'s (tokens, targets) of step ``step``; the global batch depends on ``step`` only.

    Sequences count up modulo the vocabulary from random starts, so the next
    token is learnable and the loss falls steadily (from about ln(vocab_size)
    to about 3 in 40 steps), unlike on random tokens.
    """
    if cfg.batch % dp:
        raise ValueError(f"global batch {cfg.batch} cannot be split evenly over dp={dp} ranks")
    g = torch.Generator().manual_seed(DATA_SEED + step)
    start = torch.randint(0, cfg.vocab_size, (cfg.batch, 1), generator=g)
    seqs = (start + torch.arange(cfg.seq + 1)) % cfg.vocab_size
    n = cfg.batch // dp
    mine = seqs[dp_rank * n:(dp_rank + 1) * n]
    return mine[:, :-1], mine[:, 1:]


def adam_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int) -> None:
    """One element-wise Adam update in place (bias-corrected with ``step``, no weight decay)."""
    b1, b2 = BETAS
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = (v / (1 - b2 ** step)).sqrt_().add_(EPS)
    p.addcdiv_(m, denom, value=-LR / (1 - b1 ** step))


def make_groups(layout: ParallelLayout, rank: int) -> dict[str, Any]:
    """This rank's tp, dp and pp process groups; every rank must call it, since ``new_group`` is collective."""
    mine = {}
    for axis in ("tp", "dp", "pp"):
        seen: set[tuple[int, ...]] = set()
        for r in range(layout.world_size):
            ranks = tuple(layout.group(r, axis))
            if ranks in seen:
                continue
            seen.add(ranks)
            group = dist.new_group(list(ranks))
            if rank in ranks:
                mine[axis] = group
    return mine


class Trainer:
    """Trains one rank of ``layout`` in place on the tensors of ``state`` (they are the live parameters).

    Every rank of the layout must construct its Trainer together (it creates
    the process groups) and call :meth:`step` together. The tensors are read
    from ``state`` at every step, so a test may load new values into them, or
    replace them, between steps.
    """

    def __init__(self, cfg: GPTConfig, layout: ParallelLayout, rank: int, state: State) -> None:
        check_local_state(cfg, layout, rank, state)
        self.cfg, self.layout, self.state = cfg, layout, state
        self.coords = layout.coords(rank)
        self.groups = make_groups(layout, rank)
        self.shapes = local_shapes(cfg, layout, rank)

    # -- forward pieces --

    def _embed(self, p: Tensors, tokens: torch.Tensor) -> torch.Tensor:
        w = p["embedding.word_embeddings.weight"]
        lo = self.coords.tp * w.shape[0]
        outside = (tokens < lo) | (tokens >= lo + w.shape[0])
        x = F.embedding((tokens - lo).masked_fill(outside, 0), w).masked_fill(outside.unsqueeze(-1), 0.0)
        return _ReduceFromTP.apply(x, self.groups["tp"]) + p["embedding.position_embeddings.weight"]

    def _layer(self, p: Tensors, pre: str, x: torch.Tensor) -> torch.Tensor:
        cfg, tp = self.cfg, self.groups["tp"]
        b, s, h = x.shape
        heads, head_dim = cfg.heads // self.layout.tp, cfg.hidden // cfg.heads
        y = _CopyToTP.apply(F.layer_norm(x, (h,), p[pre + "ln1.weight"], p[pre + "ln1.bias"]), tp)
        q, k, v = (t.reshape(b, s, heads, head_dim).transpose(1, 2)
                   for t in F.linear(y, p[pre + "attn.qkv.weight"], p[pre + "attn.qkv.bias"]).chunk(3, -1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, heads * head_dim)
        x = x + _ReduceFromTP.apply(F.linear(a, p[pre + "attn.proj.weight"]), tp) + p[pre + "attn.proj.bias"]
        y = _CopyToTP.apply(F.layer_norm(x, (h,), p[pre + "ln2.weight"], p[pre + "ln2.bias"]), tp)
        y = F.gelu(F.linear(y, p[pre + "mlp.fc1.weight"], p[pre + "mlp.fc1.bias"]))
        return x + _ReduceFromTP.apply(F.linear(y, p[pre + "mlp.fc2.weight"]), tp) + p[pre + "mlp.fc2.bias"]

    def _loss(self, p: Tensors, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy over the gathered vocabulary-parallel logits, the padding columns masked out."""
        tp = self.groups["tp"]
        x = _CopyToTP.apply(F.layer_norm(x, (x.shape[-1],), p["final_ln.weight"], p["final_ln.bias"]), tp)
        logits = _GatherFromTP.apply(F.linear(x, p["head.weight"]), tp)
        logits = logits.masked_fill(torch.arange(logits.shape[-1]) >= self.cfg.vocab_size, -math.inf)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def _forward_backward(self, p: Tensors, step_index: int) -> torch.Tensor | None:
        """One microbatch through the pipeline and back; the local loss on the last stage, else None."""
        c, lay = self.coords, self.layout
        tokens, targets = batch(self.cfg, step_index, lay.dp, c.dp)
        prev, nxt = lay.rank_of(tp=c.tp, pp=c.pp - 1, dp=c.dp), lay.rank_of(tp=c.tp, pp=c.pp + 1, dp=c.dp)
        if c.pp == 0:
            x = inp = self._embed(p, tokens)
        else:
            inp = torch.empty(*tokens.shape, self.cfg.hidden)
            dist.recv(inp, src=prev)
            x = inp.requires_grad_()
        for i in range(len(stage_layers(self.cfg.layers, lay.pp, c.pp))):
            x = self._layer(p, f"layers.{i}.", x)
        loss = None
        if c.pp == lay.pp - 1:
            loss = self._loss(p, x, targets)
            loss.backward()
        else:
            dist.send(x.detach(), dst=nxt)
            grad = torch.empty_like(x)
            dist.recv(grad, src=nxt)
            x.backward(grad)
        if c.pp > 0:
            dist.send(inp.grad, dst=prev)
        return loss

    # -- the step --

    def step(self, step_index: int) -> float:
        """Train on step ``step_index``'s batch; returns the global mean loss (the same on every rank)."""
        lay, c, opt = self.layout, self.coords, self.state["optimizer"]
        model = self._gather_model() if lay.zero == 3 else self.state["model"]
        params = {n: t.detach().requires_grad_() for n, t in model.items()}
        loss = self._forward_backward(params, step_index)

        flat_grad = torch.cat([params[n].grad.reshape(-1) for n in model])
        dist.all_reduce(flat_grad, group=self.groups["dp"])
        flat_grad /= lay.dp
        opt["step"] += 1
        if lay.zero == 3:   # Adam on this rank's partition of the parameters, which the next step gathers
            start, stop, _ = zero_partition(flat_grad.numel(), lay.dp, c.dp)
            k = stop - start
            adam_(self.state["model"][:k], flat_grad[start:stop], opt["exp_avg"][:k], opt["exp_avg_sq"][:k],
                  opt["step"])
        elif lay.zero:
            self._zero_update(flat_grad, opt["step"])
        else:
            for n, g in _views(flat_grad, self.shapes).items():
                adam_(model[n], g, opt["exp_avg"][n], opt["exp_avg_sq"][n], opt["step"])

        rng, gen = self.state["rng"], torch.Generator()
        gen.set_state(rng["torch"])
        torch.randint(0, 2, (16,), generator=gen)  # a stand-in for dropout masks: the rng advances every step
        rng["torch"].copy_(gen.get_state())

        result = torch.zeros(1)
        if loss is not None:
            result += loss.detach()
            dist.all_reduce(result, group=self.groups["dp"])
            result /= lay.dp
        dist.broadcast(result, src=lay.rank_of(tp=c.tp, pp=lay.pp - 1, dp=c.dp), group=self.groups["pp"])
        return result.item()

    def _zero_update(self, flat_grad: torch.Tensor, step: int) -> None:
        """ZeRO-1: Adam on this dp rank's partition of the flat parameters, then all-gather them over dp."""
        model, opt = self.state["model"], self.state["optimizer"]
        flat = torch.cat([t.reshape(-1) for t in model.values()])
        start, stop, size = zero_partition(flat.numel(), self.layout.dp, self.coords.dp)
        n = stop - start
        mine = flat.new_zeros(size)
        mine[:n] = flat[start:stop]
        adam_(mine[:n], flat_grad[start:stop], opt["exp_avg"][:n], opt["exp_avg_sq"][:n], step)
        parts = [torch.empty_like(mine) for _ in range(self.layout.dp)]
        dist.all_gather(parts, mine, group=self.groups["dp"])
        for n, updated in _views(torch.cat(parts), self.shapes).items():
            model[n].copy_(updated)

    def _gather_model(self) -> Tensors:
        """ZeRO-3: this rank's parameters, all-gathered from the flat partitions of its dp group."""
        own = self.state["model"]
        parts = [torch.empty_like(own) for _ in range(self.layout.dp)]
        dist.all_gather(parts, own, group=self.groups["dp"])
        return _views(torch.cat(parts), self.shapes)


# ---- processes -----------------------------------------------------------------------------------------------

def run_training(rank: int, layout: ParallelLayout, cfg: GPTConfig, steps: range,
                 init_state: Callable[[GPTConfig, ParallelLayout, int], State]) -> tuple[list[float], State]:
    """Worker body: build this rank's state with ``init_state``, train ``steps``; returns (losses, final state)."""
    state = init_state(cfg, layout, rank)
    trainer = Trainer(cfg, layout, rank, state)
    return [trainer.step(i) for i in steps], state


def _worker(rank: int, layout: ParallelLayout, port: int, results: Any, fn: Callable[..., Any],
            args: tuple[Any, ...]) -> None:
    """Join the gloo process group through the launcher's store, run ``fn``, and send back its torch-saved result."""
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, layout.world_size, is_master=False,
                              timeout=timedelta(seconds=LAUNCH_TIMEOUT))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=layout.world_size,
                                timeout=timedelta(seconds=LAUNCH_TIMEOUT))
        buf = io.BytesIO()
        torch.save(fn(rank, layout, *args), buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure goes to the parent, which stops the other ranks
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(layout: ParallelLayout, fn: Callable[..., Any], *args: Any, timeout: float = LAUNCH_TIMEOUT) -> list[Any]:
    """Run ``fn(rank, layout, *args)`` in one process per rank of ``layout``; returns the results in rank order.

    ``fn`` must be a module-level function (it is pickled to the workers).
    Workers start from the tests' forkserver (torch already imported) and meet
    at a TCPStore this process serves on a free port of 127.0.0.1, so there is
    no race for a port. Results come back torch-saved, not through shared
    memory, so a worker may exit as soon as it has sent them. The first
    failure stops every worker and raises with the worker's traceback.
    """
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    ctx = mp_context()
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, layout, store.port, results, fn, args), daemon=True)
             for r in range(layout.world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < layout.world_size:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue.Empty:
                silent = [r for r in range(layout.world_size) if r not in out]
                dead = [r for r in silent if procs[r].exitcode is not None]
                if dead or time.monotonic() > deadline:
                    raise AssertionError(f"{layout}: ranks {silent} sent nothing (exit codes "
                                         f"{[p.exitcode for p in procs]}, {timeout:.0f} s allowed)") from None
                continue
            if not ok:
                raise AssertionError(f"{layout}: rank {rank} failed:\n{payload}")
            out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(layout.world_size)]


__all__ = ["GPTConfig", "Trainer", "adam_", "assemble", "assert_params_close", "batch", "check_local_state",
           "global_shapes", "init_full_params", "launch", "make_groups", "run_training", "shard_full", "stage_params"]
