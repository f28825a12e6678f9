"""Trackers both ways: a snapshot records the active tracker runs in its header, and `ckptrepo metrics
--tensorboard DIR` writes the recorded metrics and capture statistics as TensorBoard scalars."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from support.helpers import run

import ckptrepo
from ckptrepo.saving._trackers import tracker_meta


def _snapshots(repo: ckptrepo.Repository, losses: list[float]) -> list[str]:
    ids = []
    with repo.snapshotter() as snap:
        for i, loss in enumerate(losses):
            ids.append(snap.snapshot({"w": torch.full((1000,), float(i))}, step=10 * (i + 1),
                                     metrics={"loss": loss, "lr": 0.1, "phase": "warmup"}).id)
    return ids


def test_metrics_and_capture_stats_become_tensorboard_scalars(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    repo = ckptrepo.init(tmp_path / "r")
    losses = [2.5, 1.75, 1.125]
    _snapshots(repo, losses)
    out = run("metrics", "--tensorboard", str(tmp_path / "tb"), repo=str(tmp_path / "r"))
    assert out.returncode == 0, out.stderr
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"ckptrepo/loss", "ckptrepo/lr", "ckptrepo/capture/blocking_s", "ckptrepo/capture/bytes"} <= tags
    assert "ckptrepo/phase" not in tags   # text metrics are not scalars
    loss = acc.Scalars("ckptrepo/loss")
    assert [e.step for e in loss] == [10, 20, 30]
    assert [e.value for e in loss] == [float(np.float32(x)) for x in losses]
    assert [e.value for e in acc.Scalars("ckptrepo/capture/bytes")] == [4000.0] * 3
    # the count printed is what was written: per version 2 metrics + 8 capture statistics
    assert "wrote 30 scalars" in out.stderr


def test_tensorboard_export_of_an_unknown_revision_is_one_line(tmp_path):
    ckptrepo.init(tmp_path / "r")
    out = run("metrics", "nope", "--tensorboard", str(tmp_path / "tb"), repo=str(tmp_path / "r"))
    assert out.returncode != 0 and out.stderr.count("\n") == 1 and "nope" in out.stderr


def test_tensorboard_scalars_are_never_written_inside_the_repository(tmp_path):
    """As --csv and --png files: an event file in the repository's folder could be taken for its objects."""
    pytest.importorskip("tensorboard")
    url = tmp_path / "r"
    repo = ckptrepo.init(url)
    _snapshots(repo, [1.0])
    before = sorted(p.relative_to(url) for p in url.rglob("*"))
    (tmp_path / "inside").symlink_to(url / "refs")
    for where in (url, url / "tb", url / "refs" / "heads" / "tb", tmp_path / "inside" / "tb"):
        out = run("metrics", "--tensorboard", str(where), repo=str(url))
        assert out.returncode == 2 and "inside the repository" in out.stderr and out.stderr.count("\n") == 1, out.stderr
        with pytest.raises(ckptrepo.errors.ExchangeError, match="inside the repository"):
            repo.metrics_to_tensorboard(where)
    assert sorted(p.relative_to(url) for p in url.rglob("*")) == before
    assert run("fsck", repo=str(url)).returncode == 0


def test_tensorboard_to_a_file_or_an_unknown_revision_writes_nothing(tmp_path):
    pytest.importorskip("tensorboard")
    repo = ckptrepo.init(tmp_path / "r")
    _snapshots(repo, [1.0])
    (tmp_path / "file").write_text("keep me")
    out = run("metrics", "--tensorboard", str(tmp_path / "file"), repo=str(tmp_path / "r"))
    assert out.returncode == 2 and "is a file, not a folder" in out.stderr and out.stderr.count("\n") == 1
    assert (tmp_path / "file").read_text() == "keep me"
    out = run("metrics", "nope", "--tensorboard", str(tmp_path / "tb"), repo=str(tmp_path / "r"))
    assert out.returncode != 0 and not (tmp_path / "tb").exists()


def test_meta_names_the_tensorboard_dir_and_callers_override_trackers(tmp_path):
    assert tracker_meta(tensorboard_dir="/runs/tb") == {"tensorboard.log_dir": "/runs/tb"} | tracker_meta()
    repo = ckptrepo.init(tmp_path / "r")
    v = repo.snapshot({"w": torch.ones(3)}, meta=tracker_meta(tensorboard_dir=str(tmp_path / "tb")))
    assert v.meta["tensorboard.log_dir"] == str(tmp_path / "tb")


def test_an_active_mlflow_run_is_recorded_with_each_snapshot(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")   # a local folder, no server
    mlflow.set_tracking_uri((tmp_path / "mlruns").as_uri())
    repo = ckptrepo.init(tmp_path / "r")
    with mlflow.start_run() as active:
        v = repo.snapshot({"w": torch.ones(3)}, step=1)
        pinned = repo.snapshot({"w": torch.ones(3)}, step=2, meta={"mlflow.run_id": "chosen"})
    after = repo.snapshot({"w": torch.ones(3)}, step=3)
    assert v.meta["mlflow.run_id"] == active.info.run_id
    assert v.meta["mlflow.experiment_id"] == active.info.experiment_id
    assert pinned.meta["mlflow.run_id"] == "chosen"   # what the caller passes wins
    assert "mlflow.run_id" not in after.meta            # no run active: nothing recorded


def test_an_active_wandb_run_is_recorded_with_each_snapshot(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "disabled")   # no service, no network
    run_ = wandb.init(project="p")
    try:
        v = ckptrepo.init(tmp_path / "r").snapshot({"w": torch.ones(3)}, step=1)
        assert v.meta.get("wandb.run_id") == run_.id
    finally:
        run_.finish()


def test_tracker_uris_lose_their_credentials():
    from ckptrepo.saving._trackers import without_credentials
    assert without_credentials("https://alice:s3cr3t@mlflow.example/?token=x#frag") == "https://mlflow.example/"
    assert without_credentials("https://mlflow.example:5000/api") == "https://mlflow.example:5000/api"
    assert without_credentials("file:///runs/mlruns") == "file:///runs/mlruns"
    assert without_credentials("databricks") == "databricks"
    assert without_credentials(None) is None
