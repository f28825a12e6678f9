"""A repository written by the release before the restructuring still opens, verifies and loads bit-exact."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from support.helpers import assert_bit_exact

import ckptrepo

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
from format1_states import gpt_rules, layout_state, plain_state  # noqa: E402


@pytest.fixture
def old_repo(tmp_path: Path) -> ckptrepo.Repository:
    """A copy of the fixture (loads must not need to write, but gc and fsck tests may)."""
    shutil.copytree(FIXTURES / "format1_repo", tmp_path / "repo")
    return ckptrepo.open(str(tmp_path / "repo"))


def test_the_old_history_reads_as_it_was_written(old_repo: ckptrepo.Repository) -> None:
    assert [v.step for v in old_repo.log()] == [4, 2, 1, 0]
    assert [v.step for v in old_repo.log("side")] == [3, 1, 0]
    assert [v.message for v in old_repo.log()] == ["stored for tensor parallelism", "third", "second", "first"]
    assert old_repo.log()[1].metrics == {"loss": 2.0}
    assert old_repo.tags() == {"v1": old_repo.resolve("@1")}
    assert set(old_repo.branches()) == {"main", "side"}
    assert old_repo.fsck().ok


@pytest.mark.parametrize("step", [0, 1, 2])
def test_every_old_version_loads_bit_exact(old_repo: ckptrepo.Repository, step: int) -> None:
    assert_bit_exact(plain_state(step), old_repo.load(f"@{step}"))


def test_a_version_on_another_branch_and_a_tag_load_bit_exact(old_repo: ckptrepo.Repository) -> None:
    assert_bit_exact(plain_state(3), old_repo.load("side"))
    assert_bit_exact(plain_state(1), old_repo.load("v1"))


def test_an_old_version_loads_in_place(old_repo: ckptrepo.Repository) -> None:
    into = plain_state(0)
    old_repo.load("@2", into=into)
    assert_bit_exact(plain_state(2)["model"], into["model"])


def test_an_old_layout_version_loads_unsharded_and_under_tensor_parallelism(old_repo: ckptrepo.Repository) -> None:
    full = layout_state()
    assert_bit_exact(full, old_repo.load("@4"))
    rules = gpt_rules()
    for rank in range(2):
        part = old_repo.load("@4", parallel_layout=ckptrepo.ParallelLayout(tp=2, rules=rules), rank=rank)
        qkv = part["model"]["layers.1.attn.qkv.weight"]
        # fused q, k, v: each rank holds its half of each of the three parts
        want = torch.cat([p.chunk(2, 0)[rank] for p in full["model"]["layers.1.attn.qkv.weight"].chunk(3, 0)])
        assert torch.equal(qkv, want)
        proj = part["model"]["layers.0.attn.proj.weight"]
        assert torch.equal(proj, full["model"]["layers.0.attn.proj.weight"].chunk(2, 1)[rank])
