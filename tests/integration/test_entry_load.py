"""Loading one top-level entry of a version (loading/_entry.py), as the DeepSpeed engine loads one file.

The multi-rank case (an entry only rank 1 saved) runs in tests/distributed/test_deepspeed.py.
"""
from __future__ import annotations

import pytest
import torch

from ckptrepo.errors import StateMismatchError
from ckptrepo.loading._entry import entry_keys, load_entry


def test_one_entry_loads_with_its_tensors_and_values_only(repo) -> None:
    state = {"a.pt": {"w": torch.arange(4.0), "meta": {"step": 3, "shape": torch.Size([2, 2])}},
             "b.pt": {"v": [torch.ones(2, dtype=torch.bfloat16), (1, "x")]}, "empty.pt": {}}
    v = repo.snapshot(state, step=3)
    m = repo.plumbing.manifest(v.id)
    assert entry_keys(m) == {"a.pt": 0, "b.pt": 0, "empty.pt": 0}
    got = load_entry(repo.plumbing, v.id, "b.pt")
    assert torch.equal(got["v"][0], state["b.pt"]["v"][0]) and got["v"][1] == (1, "x")
    a = load_entry(repo.plumbing, v.id, "a.pt")
    assert torch.equal(a["w"], torch.arange(4.0)) and a["meta"] == {"step": 3, "shape": torch.Size([2, 2])}
    assert load_entry(repo.plumbing, v.id, "empty.pt") == {}
    with pytest.raises(StateMismatchError, match=r"holds no 'c.pt' \(it holds: a.pt, b.pt, empty.pt\)"):
        load_entry(repo.plumbing, v.id, "c.pt")
