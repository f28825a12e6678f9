"""Load one top-level entry of a version: the state one rank saved under one key, and nothing else.

An adapter that maps files onto a version (DeepSpeed's checkpoint engine: one
key per file a rank saved) loads one file at a time, on any rank, whichever
rank saved it. A whole-state load would build every rank's state (or the
unsharded view, which keeps only rank 0's per-rank values) and read every
tensor; this reads the saving rank's tree under that key and only its
tensors.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ckptrepo.core import Plumbing
from ckptrepo.core.schema import Manifest
from ckptrepo.errors import CorruptionError, StateMismatchError
from ckptrepo.loading._layout_load import rank_tree, saved_world
from ckptrepo.loading._reshard import read_pieces
from ckptrepo.parallel import Piece
from ckptrepo.state import DICT, LIST, NDARRAY, ODICT, STATEFUL, TENSOR, TORCH_DTYPES, TUPLE, key_value, unflatten


def entry_keys(manifest: Manifest) -> dict[Any, int]:
    """Each top-level key of the version's state (a dict on every saved rank), and the saved rank that holds
    it (the lowest, where several do)."""
    out: dict[Any, int] = {}
    for rank in range(saved_world(manifest)):
        tree, _ = rank_tree(manifest, rank)
        for key, _node in _items(tree):
            out.setdefault(key, rank)
    return out


def load_entry(plumbing: Plumbing, vid: str, key: Any) -> Any:
    """The value saved under top-level ``key`` of version ``vid``, with its tensors read (on the CPU).

    StateMismatchError when no saved rank holds ``key``; the message lists the keys there are.
    """
    m = plumbing.manifest(vid)
    plumbing.require_data(vid, m)
    held = entry_keys(m)
    if key not in held:
        some = ", ".join(sorted(map(str, held))[:8]) or "none"
        raise StateMismatchError(f"version {vid[:12]} holds no {key!r} (it holds: {some})")
    tree, leaf_names = rank_tree(m, held[key])
    node = next(n for k, n in _items(tree) if k == key)
    return _read_node(plumbing, m, node, leaf_names)


def _items(tree: Any) -> list[tuple[Any, Any]]:
    """The (key, node) pairs of a state's top-level dict; none when the state is not a dict."""
    if tree[0] == STATEFUL:
        tree = tree[2]
    if tree[0] not in (DICT, ODICT):
        return []
    return [(key_value(k), v) for k, v in tree[1]]


def _leaves(node: Any, out: list[int]) -> list[int]:
    """The tensor-table indices of ``node``'s tensor leaves."""
    tag = node[0]
    if tag in (TENSOR, NDARRAY):
        out.append(node[1])
    elif tag in (DICT, ODICT):
        for _k, v in node[1]:
            _leaves(v, out)
    elif tag == STATEFUL:
        _leaves(node[2], out)
    elif tag in (LIST, TUPLE):
        for v in node[1]:
            _leaves(v, out)
    return out


def _read_node(plumbing: Plumbing, m: Manifest, node: Any, leaf_names: Sequence[str]) -> Any:
    """``node`` rebuilt, its tensors read whole through the piece reader (a per-rank tensor may be stored in
    several pieces, as any tensor of a sharded version may)."""
    index = {t.name: i for i, t in enumerate(m.tensors)}
    fresh: dict[int, torch.Tensor] = {}
    pieces: list[Piece] = []
    for leaf in _leaves(node, []):
        if leaf >= len(leaf_names) or leaf_names[leaf] not in index:
            raise CorruptionError(f"version {m.id[:12]}: a tensor leaf of the saved tree names no tensor of the "
                                  f"version; the manifest is damaged, run `ckptrepo fsck`")
        entry = m.tensors[index[leaf_names[leaf]]]
        t = torch.empty(entry.shape, dtype=TORCH_DTYPES[entry.dtype])
        fresh[leaf] = t
        if t.numel():
            pieces.append(Piece(entry.name, entry.dtype, tuple(entry.shape),
                                ((0,) * len(entry.shape), tuple(entry.shape)), t))
    if pieces:
        read_pieces(plumbing.data_store(m), m, pieces)

    def get_tensor(i: int, as_numpy: bool) -> Any:
        return fresh[i].numpy() if as_numpy else fresh[i]
    return unflatten(node, get_tensor)


__all__ = ["entry_keys", "load_entry"]
