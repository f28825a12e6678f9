"""Hugging Face: the Trainer callback and an exact resume from a version; export to and import from an HF
model folder that from_pretrained loads with the same weights. Tiny random-init models, nothing downloaded."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from support.helpers import assert_bit_exact, run  # noqa: E402

from ckptrepo.errors import ArgumentError, ExchangeError  # noqa: E402
from ckptrepo.integrations.hf import CkptRepoCallback, checkpoint_folder  # noqa: E402
from ckptrepo.saving._capture import unwrapped_optimizer  # noqa: E402

STEPS = 20
BATCH = 4


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: a tiny model's steps are then milliseconds even on a busy 2-core machine (two
    threads contending with other processes made each step take a second)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def tiny_config(**kw) -> transformers.GPT2Config:
    return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=16, bos_token_id=0,
                                   eos_token_id=0, **kw)


def tiny_model(seed: int = 0, **kw) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(tiny_config(**kw))


def dataset() -> list[dict[str, torch.Tensor]]:
    """STEPS batches of random token windows: one epoch, so a resume at step 10 skips into its middle."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 97, (STEPS * BATCH, 16), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


class Losses(transformers.TrainerCallback):
    """The loss the Trainer logs at each step (logging_steps=1)."""

    def __init__(self) -> None:
        self.by_step: dict[int, float] = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.by_step[state.global_step] = logs["loss"]


class OptimizerProbe(transformers.TrainerCallback):
    """The optimizer the Trainer steps, and the step pre-hooks of the torch optimizer inside it."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []
        self.optimizer = None

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self.optimizer = optimizer
        seen = (type(optimizer).__name__, len(unwrapped_optimizer(optimizer)._optimizer_step_pre_hooks))
        if seen not in self.seen:
            self.seen.append(seen)


def train(tmp_path, name: str, model, callbacks=(), resume: str | None = None, **options) -> dict[int, float]:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / name), max_steps=STEPS, per_device_train_batch_size=BATCH, logging_steps=1,
        save_strategy="no", report_to=[], seed=3, disable_tqdm=True, learning_rate=3e-3,
        warmup_steps=3, dataloader_num_workers=0, dataloader_pin_memory=False, **{"use_cpu": True, **options})
    losses = Losses()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset(),
                                   callbacks=[losses, *callbacks])
    trainer.train(resume_from_checkpoint=resume)
    return losses.by_step


def test_resume_from_a_version_continues_bit_for_bit(tmp_path):
    plain = tiny_model()
    expected = train(tmp_path, "plain", plain)
    assert sorted(expected) == list(range(1, STEPS + 1))

    url = str(tmp_path / "repo")
    probe = OptimizerProbe()
    snapshotted = train(tmp_path, "snap", tiny_model(), [CkptRepoCallback(url, every_n_steps=1), probe])
    assert snapshotted == expected   # snapshots never change the run
    # the trial's failure: accelerate's AcceleratedOptimizer.step() runs no hook registered on itself, so the
    # callback waits for capture in the torch optimizer inside it
    assert probe.seen == [("AcceleratedOptimizer", 1)] and unwrapped_optimizer(probe.optimizer) is not probe.optimizer

    import ckptrepo
    repo = ckptrepo.open(url)
    assert [v.step for v in repo.log()] == list(range(STEPS, 0, -1))
    v10 = repo.version("@10")
    assert v10.metrics["loss"] == expected[10] and "learning_rate" in v10.metrics

    folder = checkpoint_folder(url, "@10")   # a private folder of this process, removed at exit
    assert json.loads(open(os.path.join(folder, "trainer_state.json")).read())["global_step"] == 10
    resumed_model = tiny_model(seed=99)   # other weights: the resume must bring the version's
    resumed = train(tmp_path, "resumed", resumed_model, resume=folder)
    assert sorted(resumed) == list(range(11, STEPS + 1))
    assert resumed == {s: expected[s] for s in range(11, STEPS + 1)}
    assert_bit_exact(resumed_model.state_dict(), plain.state_dict())


def test_checkpoint_folder_refuses_a_version_the_callback_did_not_save(repo, tmp_path):
    repo.snapshot({"model": tiny_model().state_dict()}, step=1)
    with pytest.raises(ExchangeError, match="not saved by CkptRepoCallback"):
        checkpoint_folder(repo, "HEAD", out=tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def trainer_like_state(rng) -> dict:
    """A state with what CkptRepoCallback saves, the RNG states given."""
    from ckptrepo.integrations.hf import hf_config
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters())
    return {"model": model, "optimizer": opt, "scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
            "trainer_state": {"global_step": 3}, "hf_config": hf_config(model), "rng": rng}


def test_checkpoint_folder_writes_each_ranks_rng_file_for_a_ddp_version(repo, tmp_path):
    from ckptrepo.integrations.hf import rng_states
    torch.manual_seed(1)
    ranks = [rng_states()]
    torch.manual_seed(2)
    ranks.append(rng_states())
    repo.snapshot(trainer_like_state(ranks), step=3)
    folder = checkpoint_folder(repo, "HEAD", out=tmp_path / "ckpt")
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("rng_state"))
    assert files == ["rng_state_0.pth", "rng_state_1.pth"]   # what Trainer._load_rng_state reads per process
    for rank, states in enumerate(ranks):
        saved = torch.load(os.path.join(folder, f"rng_state_{rank}.pth"), weights_only=False)
        assert torch.equal(saved["cpu"], states["cpu"]) and saved["python"] == states["python"]

    repo.snapshot(trainer_like_state(rng_states()), step=4)   # one process: the one file, as before
    one = checkpoint_folder(repo, "HEAD")
    assert sorted(p.name for p in Path(one).iterdir() if p.name.startswith("rng_state")) == ["rng_state.pth"]


@pytest.mark.parametrize("options", [{"fsdp": "full_shard"}, {"deepspeed": {"zero_optimization": {"stage": 3}}}])
def test_callback_refuses_sharded_training(tmp_path, options):
    from types import SimpleNamespace
    args = SimpleNamespace(**{"world_size": 2, "process_index": 0, "fsdp": None, "deepspeed": None, **options})
    callback = CkptRepoCallback(str(tmp_path / "repo"))
    with pytest.raises(ArgumentError, match="ckptrepo.dcp .* DeepSpeed engine"):
        callback.on_train_begin(args, None, None, model=tiny_model(), optimizer=None)
    assert not (tmp_path / "repo").exists()   # refused before the repository is made


# ---- export --format hf and import --------------------------------------------------------------------------
def hf_state(model) -> dict:
    """What the callback stores of the model: the module itself, and its config as plain data."""
    from ckptrepo.integrations.hf import hf_config
    return {"model": model, "hf_config": hf_config(model), "step": 5}


def loaded(out):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert info["missing_keys"] == set() or not info["missing_keys"], info
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_export_hf_loads_with_from_pretrained_bit_for_bit(repo, tmp_path, shard):
    model = tiny_model()
    repo.snapshot(hf_state(model), step=5)
    out = tmp_path / "hf"
    args = ["export", "HEAD", str(out), "--format", "hf"] + (["--max-shard-size", shard] if shard else [])
    r = run(*args, repo=repo.url)
    assert r.returncode == 0, r.stderr
    files = sorted(p.name for p in out.iterdir())
    if shard is None:
        assert files == ["config.json", "model.safetensors"]
    else:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 2 and files == sorted(["config.json", "model.safetensors.index.json", *shards])
        for s in shards:   # none above the size, unless one tensor is larger on its own
            assert (out / s).stat().st_size < 20_000 + 2_000 or len(
                [n for n, f in index["weight_map"].items() if f == s]) == 1
    from safetensors import safe_open
    names = set()
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            names |= set(fh.keys())
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names   # the tied copy is dropped
    assert not any("/" in n for n in names)
    assert_bit_exact(loaded(out).state_dict(), model.state_dict())

    # and back: the folder imports as a version an export writes again
    r = run("import", str(out), repo=repo.url)
    assert r.returncode == 0, r.stderr
    back = repo.load("HEAD")
    assert set(back) == {"model", "hf_config"} and set(back["model"]) == names
    again = tmp_path / "again"
    repo.export("HEAD", again, format="hf")
    assert_bit_exact(loaded(again).state_dict(), model.state_dict())


def test_export_hf_untied_model_keeps_both(repo, tmp_path):
    model = tiny_model(tie_word_embeddings=False)
    repo.snapshot(hf_state(model))
    repo.export("HEAD", tmp_path / "hf", format="hf")
    assert_bit_exact(loaded(tmp_path / "hf").state_dict(), model.state_dict())


def test_export_hf_refuses_names_the_model_does_not_have(repo, tmp_path):
    model = tiny_model()
    config = hf_state(model)["hf_config"]
    # the trial's failure: names under a prefix that from_pretrained would not match, leaving every weight random
    repo.snapshot({"model": {f"model/{k}": v for k, v in model.state_dict().items()}, "hf_config": config})
    with pytest.raises(ExchangeError, match="path in the state"):
        repo.export("HEAD", tmp_path / "a", format="hf")
    repo.snapshot({"model": {f"module.{k}": v for k, v in model.state_dict().items()}, "hf_config": config})
    with pytest.raises(ExchangeError, match="do not match the GPT2LMHeadModel"):
        repo.export("HEAD", tmp_path / "b", format="hf")
    repo.snapshot({"model": {k: v for k, v in model.state_dict().items() if ".h.1." not in k}, "hf_config": config})
    r = run("export", "HEAD", str(tmp_path / "c"), "--format", "hf", repo=repo.url)
    assert r.returncode != 0 and "12 missing ('transformer.h.1." in r.stderr
    assert not any(tmp_path.glob("[abc]")) and not any(tmp_path.glob(".*tmp"))   # nothing left behind


def test_export_hf_refuses_a_bad_shard_size_before_loading(repo, tmp_path):
    repo.snapshot(hf_state(tiny_model()))
    with pytest.raises(ExchangeError, match="not a size"):
        repo.export("HEAD", tmp_path / "x", format="hf", max_shard_size="lots")
    with pytest.raises(ExchangeError, match="hf format only"):
        repo.export("HEAD", tmp_path / "y", format="safetensors", max_shard_size="1GB")


def test_ckptrepo_and_the_resume_helper_never_import_transformers():
    import subprocess
    import sys
    code = ("import sys, ckptrepo, ckptrepo.cli.main; from ckptrepo.integrations.hf import checkpoint_folder; "
            "assert 'transformers' not in sys.modules, 'imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-500:]
