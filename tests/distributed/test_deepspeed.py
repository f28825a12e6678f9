"""DeepSpeed's checkpoint engine over a repository: real DeepSpeed engines on the CPU accelerator, gloo.

One process and two processes train a tiny model under ZeRO stages 0, 2 and 3 (see RUNS), save a
tag through ``CkptRepoCheckpointEngine``, train on, and a fresh engine (other initial weights) loads the tag
through it (no tag given: DeepSpeed reads its ``latest`` file) and trains the same steps: the losses must be
equal bit for bit. The engine's own pieces (the call order create -> save -> commit, stubs, the conversion of
DeepSpeed's types to plain data, the errors) are tested in this process without a DeepSpeed engine.
"""
from __future__ import annotations

import importlib.util
import json
import os
import threading
import time
from typing import Any

import pytest
import torch
from support.ckpt_workers import mp_context
from support.deepspeed_workers import worker
from support.dtensor_workers import free_port

import ckptrepo
from ckptrepo.errors import CorruptionError, RevisionError, StateMismatchError, UnsupportedValueError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")

RUNS = {1: [2], 2: [0, 3]}   # world size -> ZeRO stages (2 ranks at stage 0: rank 1 saves no file)


def _launch(runs: dict[int, list[int]], out_dir: str, timeout: float = 240.0) -> dict[int, list[dict]]:
    """Run every world of ``runs`` at once (their imports overlap), each into its repository ``repo-<world>``;
    each rank's results, per world."""
    ctx = mp_context()
    procs = []
    for world, stages in runs.items():
        port = free_port()
        url = os.path.join(out_dir, f"repo-{world}")
        procs += [ctx.Process(target=worker, args=(r, world, port, stages, url, out_dir)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = [open(os.path.join(out_dir, n)).read() for n in sorted(os.listdir(out_dir)) if n.startswith("error-")]
    assert all(p.exitcode == 0 for p in procs) and not errors, "\n".join(errors) or "a worker hung"
    return {w: [json.load(open(os.path.join(out_dir, f"result-{w}-{r}.json"))) for r in range(w)] for w in runs}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = str(tmp_path_factory.mktemp("deepspeed"))
    return {"out": out, "results": _launch(RUNS, out)}


def test_a_resumed_run_repeats_the_uninterrupted_losses_bit_for_bit(trained: dict[str, Any]) -> None:
    for world, ranks in trained["results"].items():
        for res in ranks:
            for stage in map(str, RUNS[world]):
                r = res[stage]
                assert r["resumed"] == r["after"], f"world {world}, ZeRO {stage}"
                assert r["client"] == {"note": "mine", "stage": int(stage)}   # client_state comes back
                assert r["global_steps"] == 6 and r["attached"] == 1


def test_each_tag_is_one_version_tagged_with_the_tag(trained: dict[str, Any]) -> None:
    for world, ranks in trained["results"].items():
        repo = ckptrepo.open(os.path.join(trained["out"], f"repo-{world}"))
        for stage in map(str, RUNS[world]):
            vids = {res[stage]["vid"] for res in ranks}
            assert len(vids) == 1   # every rank's files went into one version
            v = repo.version(vids.pop())
            assert v.step == 3
            m = repo.plumbing.manifest(v.id)
            assert (m.layout.world_size if m.layout else 1) == world
            files = ranks[0][stage]["files"]
            from ckptrepo.loading._entry import entry_keys
            assert sorted(map(str, entry_keys(m))) == files   # one entry per file DeepSpeed saved, on any rank
            assert repo.tags()[f"stage{stage}"] == v.id
            assert v.meta.get("deepspeed.tag") == f"stage{stage}"
        assert repo.fsck().ok


def test_on_disk_there_are_only_stubs_and_latest(trained: dict[str, Any]) -> None:
    from ckptrepo.integrations.deepspeed import read_stub
    save_dir = os.path.join(trained["out"], "ckpt-2")
    with open(os.path.join(save_dir, "latest")) as f:
        assert f.read().strip() == "stage3"   # the last tag saved
    last = trained["results"][2][0]["3"]
    assert len(last["files"]) == 4   # ZeRO-3: each rank's model and optimizer partitions
    for name in last["files"]:
        path = os.path.join(save_dir, "stage3", name)
        assert os.path.getsize(path) < 1024
        stub = read_stub(path)
        assert (stub["entry"], stub["tag"], stub["version"]) == (name, "stage3", last["vid"])


# ---- the engine's pieces, in this process ---------------------------------------------------------------------

def _info(tag: str, save_dir: str) -> Any:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo
    return CheckpointCommitInfo(tag=tag, save_dir=save_dir, save_latest=True)


def test_create_save_commit_load_in_one_process(tmp_path) -> None:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from ckptrepo.integrations.deepspeed import TYPE_KEY, CkptRepoCheckpointEngine
    eng = CkptRepoCheckpointEngine(tmp_path / "repo", wait=True)
    assert isinstance(eng, CheckpointEngine)
    save_dir = str(tmp_path / "ckpt")
    scaler = DynamicLossScaler(init_scale=2.0 ** 16, scale_window=10, min_scale=1, delayed_shift=2,
                               consecutive_hysteresis=False)
    scaler.cur_scale, scaler.cur_iter = 512.0, 7
    import argparse
    sd = {"module": {"w": torch.arange(6.0).reshape(2, 3)}, "global_steps": 12,
          "optimizer_state_dict": {"loss_scaler": scaler, "zero_stage": ZeroStageEnum.gradients,
                                   "param_slice_mappings": [{"w": fragment_address(numel=6, start=0)}]},
          "args": argparse.Namespace(lr=0.1, layers=[1, 2]), "names": {"a", "b"},
          "user": {TYPE_KEY: "set", "items": [1, 2]}}   # a dict of the user's that holds the marker key
    eng.create(_info("t1", save_dir))
    eng.makedirs(os.path.join(save_dir, "t1"), exist_ok=True)
    path = os.path.join(save_dir, "t1", "mp_rank_00_model_states.pt")
    eng.save(state_dict=sd, path=path)
    eng.commit(_info("t1", save_dir))
    repo = ckptrepo.open(tmp_path / "repo")
    assert repo.version("HEAD").step == 12
    got = eng.load(path, map_location=lambda storage, loc: storage)
    assert torch.equal(got["module"]["w"], sd["module"]["w"])
    opt = got["optimizer_state_dict"]
    assert type(opt["loss_scaler"]) is DynamicLossScaler and vars(opt["loss_scaler"]) == vars(scaler)
    assert opt["zero_stage"] is ZeroStageEnum.gradients
    assert opt["param_slice_mappings"] == [{"w": fragment_address(numel=6, start=0)}]
    assert got["args"] == sd["args"] and got["names"] == {"a", "b"}
    assert got["user"] == {TYPE_KEY: "set", "items": [1, 2]}   # comes back as the dict it was, not a set
    # another machine, with the repository but not the directory: checkout writes the stubs and `latest`
    from ckptrepo.integrations.deepspeed import checkout
    assert checkout(tmp_path / "repo", tmp_path / "elsewhere") == [str(tmp_path / "elsewhere" / "t1" /
                                                                       "mp_rank_00_model_states.pt")]
    assert (tmp_path / "elsewhere" / "latest").read_text() == "t1"
    again = eng.load(str(tmp_path / "elsewhere" / "t1" / "mp_rank_00_model_states.pt"), map_location="cpu")
    assert torch.equal(again["module"]["w"], sd["module"]["w"])
    # a file outside <save_dir>/<tag>/ (save_16bit_model's export) is a plain torch file, and no version
    eng.create(_info("global_step12", str(tmp_path)))
    eng.save({"w": torch.ones(2)}, str(tmp_path / "pytorch_model.bin"))
    eng.commit(_info("global_step12", str(tmp_path)))
    assert torch.equal(torch.load(tmp_path / "pytorch_model.bin")["w"], torch.ones(2))
    assert len(repo.log()) == 1
    eng.cleanup()


def test_what_cannot_be_stored_or_loaded_is_named(tmp_path) -> None:
    from ckptrepo.integrations.deepspeed import TYPE_KEY, CkptRepoCheckpointEngine, from_plain
    eng = CkptRepoCheckpointEngine(str(tmp_path / "repo"), wait=True)
    save_dir = str(tmp_path / "ckpt")
    os.makedirs(os.path.join(save_dir, "t"))
    eng.create(_info("t", save_dir))
    eng.save({"fn": print}, os.path.join(save_dir, "t", "mp_rank_00_model_states.pt"))
    with pytest.raises(UnsupportedValueError, match=r"mp_rank_00_model_states.pt.*'fn'.*without pickle"):
        eng.commit(_info("t", save_dir))
    # a file DeepSpeed's own engine wrote, and a stub of a version the repository does not hold
    torch.save({"w": torch.ones(1)}, os.path.join(save_dir, "t", "real.pt"))
    with pytest.raises(StateMismatchError, match="not a ckptrepo stub"):
        eng.load(os.path.join(save_dir, "t", "real.pt"))
    with open(os.path.join(save_dir, "t", "lost.pt"), "w") as f:
        json.dump({"format": "ckptrepo-deepspeed-stub/1", "version": "ab" * 16, "tag": "t", "entry": "lost.pt"}, f)
    with pytest.raises(RevisionError, match="did not commit"):
        eng.load(os.path.join(save_dir, "t", "lost.pt"))
    # a stored value may name only DeepSpeed's own checkpoint classes to rebuild
    with pytest.raises(CorruptionError, match="not one that kind rebuilds"):
        from_plain({TYPE_KEY: "attrs", "class": "os.system", "attrs": {}})
    eng.cleanup()


def test_malformed_stored_values_are_corruption_naming_the_place() -> None:
    from collections import OrderedDict

    from ckptrepo.integrations.deepspeed import TYPE_KEY, from_plain, to_plain
    damaged = [{TYPE_KEY: "set"}, {TYPE_KEY: "set", "items": [[1]]}, {TYPE_KEY: "frozenset", "items": 3},
               {TYPE_KEY: "namespace"}, {TYPE_KEY: "dict", "items": [1]},
               {TYPE_KEY: "enum", "class": "deepspeed.runtime.zero.config.ZeroStageEnum", "name": "nope"},
               {TYPE_KEY: "dataclass", "class": "deepspeed.utils.tensor_fragment.fragment_address", "fields": {"x": 1}}]
    for node in damaged:
        with pytest.raises(CorruptionError, match=r"^mp_rank_00_model_states.pt/opt/0: .*malformed.*ckptrepo fsck"):
            from_plain({"opt": [node]}, "mp_rank_00_model_states.pt")
    # the user's own dicts that hold the marker key round-trip exactly, nested and ordered ones too
    user = {"a": {TYPE_KEY: "set", "items": [1, 2]},
            "b": OrderedDict([(TYPE_KEY, {TYPE_KEY: "enum", "x": {3}}), ("z", [{TYPE_KEY: 1}])]), TYPE_KEY: 0}
    back = from_plain(to_plain(user))
    assert back == user and type(back["b"]) is OrderedDict and list(back["b"]) == [TYPE_KEY, "z"]
    assert back["b"][TYPE_KEY]["x"] == {3}


def test_stubs_name_a_version_only_once_it_is_committed(tmp_path) -> None:
    from ckptrepo import faults
    from ckptrepo.errors import SnapshotFailedError
    from ckptrepo.integrations.deepspeed import CkptRepoCheckpointEngine, read_stub
    eng = CkptRepoCheckpointEngine(tmp_path / "repo")   # commit returns once the snapshot is started
    repo = ckptrepo.open(tmp_path / "repo")
    save_dir = str(tmp_path / "ckpt")

    def save(tag: str, val: float) -> str:
        eng.create(_info(tag, save_dir))
        eng.makedirs(os.path.join(save_dir, tag), exist_ok=True)
        path = os.path.join(save_dir, tag, "mp_rank_00_model_states.pt")
        eng.save({"module": {"w": torch.full((4,), val)}, "global_steps": int(val)}, path)
        eng.commit(_info(tag, save_dir))
        return path

    path = save("best", 1.0)
    eng.snapshotter().wait()
    first = read_stub(path)["version"]
    assert repo.tags()["best"] == first

    def boom(_name: str) -> None:
        raise OSError("disk gone")
    gate = threading.Event()
    try:
        # a save of the tag again whose commit fails (or that a crash cuts short) leaves the stubs as they were
        faults.set_hook("after_data", boom)
        save("best", 2.0)
        with pytest.raises(SnapshotFailedError, match="disk gone"):
            eng.snapshotter().wait()
        assert read_stub(path)["version"] == first == repo.tags()["best"]
        assert torch.equal(eng.load(path)["module"]["w"], torch.ones(4))
        fresh = save("fresh", 3.0)   # a tag never saved before gets its stub at once, naming the pending version
        with pytest.raises(SnapshotFailedError, match="disk gone"):
            eng.snapshotter().wait()
        # while a save of the tag is in flight, the stub still names the committed version
        faults.set_hook("after_data", lambda _name: gate.wait(30))
        save("best", 4.0)
        assert read_stub(path)["version"] == first == repo.tags()["best"]
    finally:
        gate.set()
        faults.clear()
    eng.snapshotter().wait()
    assert read_stub(path)["version"] == repo.tags()["best"] != first   # committed: the stubs follow the tag
    assert torch.equal(eng.load(path)["module"]["w"], torch.full((4,), 4.0))
    with pytest.raises(RevisionError, match=r"^.*mp_rank_00_model_states.pt: version \w+ of DeepSpeed tag 'fresh' "
                                            r"is not in .*did not commit"):
        eng.load(fresh)
    eng.cleanup()


def test_the_placeholder_stub_costs_the_training_thread_no_fsync(tmp_path, monkeypatch) -> None:
    """Decision 041: the stub ``commit`` leaves for a new path is renamed without fsync on the training
    thread; the commit thread rewrites it durably once the version commits."""
    from ckptrepo import faults
    from ckptrepo.integrations.deepspeed import CkptRepoCheckpointEngine, read_stub
    eng = CkptRepoCheckpointEngine(tmp_path / "repo")
    save_dir = str(tmp_path / "ckpt")
    eng.create(_info("t1", save_dir))
    eng.makedirs(os.path.join(save_dir, "t1"), exist_ok=True)
    path = os.path.join(save_dir, "t1", "mp_rank_00_model_states.pt")
    eng.save({"module": {"w": torch.ones(4)}, "global_steps": 1}, path)
    training, real_fsync, on_training = threading.current_thread(), os.fsync, []

    def fsync(fd: int) -> None:
        if threading.current_thread() is training:
            on_training.append(fd)
        real_fsync(fd)
    gate = threading.Event()
    monkeypatch.setattr(os, "fsync", fsync)
    try:
        faults.set_hook("after_data", lambda _name: gate.wait(30))   # the commit thread waits
        eng.commit(_info("t1", save_dir))
        assert read_stub(path)["tag"] == "t1" and on_training == []
    finally:
        gate.set()
        faults.clear()
    eng.snapshotter().wait()
    assert read_stub(path)["version"] == ckptrepo.open(tmp_path / "repo").tags()["t1"]
    eng.cleanup()
