"""Places a new user running the README's examples got stuck (issue 40, "the front door"); the torchrun case
is in tests/distributed/test_front_door_ranks.py, Lightning's "last" in test_lightning_last.py."""
from __future__ import annotations

import pytest
import torch

import ckptrepo
from ckptrepo.errors import RevisionError


def test_going_back_past_the_first_version_says_how_many_there_are(tmp_path) -> None:
    """``HEAD~3`` on a repository of one version: one line with the count and the revisions that exist."""
    repo = ckptrepo.init(str(tmp_path / "repo"))
    repo.snapshot({"w": torch.zeros(2)}, step=1)
    with pytest.raises(RevisionError) as e:
        repo.tag("best", "HEAD~3")
    assert str(e.value) == ("'HEAD~3' goes back 3 versions but 'HEAD' has only 0 ancestors (1 version in its "
                            "history): name HEAD, or see `ckptrepo log`")
    repo.snapshot({"w": torch.ones(2)}, step=2)
    with pytest.raises(RevisionError, match=r"has only 1 ancestors \(2 versions in its history\): name one of "
                                            r"HEAD to HEAD~1, or see `ckptrepo log`$"):
        repo.load("HEAD~3")


def test_the_unpadded_state_an_unsharded_load_returns_snapshots_again_with_its_rules(tmp_path) -> None:
    """``repo.snapshot(full, parallel_layout=ParallelLayout(rules=...))`` of what ``repo.load`` returned (the
    vocabulary unpadded) round-trips bit-exact, and loads under tensor parallelism as the padded original."""
    rules = ckptrepo.rules.megatron_gpt(num_layers=1, vocab_size=10, make_vocab_size_divisible_by=4)
    g = torch.Generator().manual_seed(0)
    padded = {"embedding.word_embeddings.weight": torch.cat([torch.randn(10, 4, generator=g), torch.zeros(2, 4)]),
              "layers.0.mlp.fc1.weight": torch.randn(8, 4, generator=g),
              "head.weight": torch.cat([torch.randn(10, 4, generator=g), torch.zeros(2, 4)])}
    layout = ckptrepo.ParallelLayout(rules=rules)
    repo = ckptrepo.init(str(tmp_path / "repo"))
    repo.snapshot({"model": padded}, step=1, parallel_layout=layout)
    full = repo.load("@1")
    assert full["model"]["head.weight"].shape == (10, 4)
    repo.snapshot(full, step=2, parallel_layout=layout)
    again = repo.load("@2")
    assert all(torch.equal(again["model"][k], full["model"][k]) for k in full["model"])
    tp2 = ckptrepo.ParallelLayout(tp=2, rules=rules)
    for rank in (0, 1):
        a = repo.load("@1", parallel_layout=tp2, rank=rank)["model"]
        b = repo.load("@2", parallel_layout=tp2, rank=rank)["model"]
        assert all(torch.equal(a[k], b[k]) for k in a)



def test_the_dcp_writer_creates_the_repository_as_the_other_adapters_do(tmp_path) -> None:
    """``dcp.save(..., storage_writer=Writer(url))`` into a path with no repository yet: created, one version;
    eight writers made at once (every rank of a job does so) create one repository between them."""
    import threading

    import torch.distributed.checkpoint as dcp

    import ckptrepo.dcp
    url = str(tmp_path / "new")
    state = {"w": torch.arange(4.0)}
    dcp.save(state, storage_writer=ckptrepo.dcp.Writer(url, step=1), no_dist=True)
    assert [v.step for v in ckptrepo.open(url).log()] == [1]

    raced = str(tmp_path / "raced")
    start, errors = threading.Barrier(8), []

    def make() -> None:
        start.wait()
        try:
            ckptrepo.dcp.Writer(raced, step=2)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=make) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    dcp.save(state, storage_writer=ckptrepo.dcp.Writer(raced, step=2), no_dist=True)
    into = {"w": torch.zeros(4)}
    dcp.load(into, storage_reader=ckptrepo.dcp.Reader(raced), no_dist=True)
    assert torch.equal(into["w"], state["w"]) and ckptrepo.open(raced).current_branch() == "main"
