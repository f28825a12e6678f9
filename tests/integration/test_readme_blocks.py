"""Every code block of README.md runs, each reported by its line number (``README.md:LINE``).

A Python block runs in a subprocess in a fresh temporary directory, after a preamble that defines the
placeholders the README names (small random-init stand-ins: ``model``, ``opt``, ``state``, ``url``, ...). The
comment on the line before a block picks the preamble (``<!-- test-with: NAME ... -->``; ``torchrun`` among
the names runs it under ``torchrun --nproc-per-node 2`` on gloo, on 127.0.0.1), or says why the block is not
run (``<!-- no-test: REASON -->``). A shell block runs through bash and the real ``ckptrepo`` command, in a
temporary directory holding the checkout's ``examples/``; ``repo=PATH`` makes a repository with a few
versions at PATH first. Absolute paths under ``/tmp``, ``/data``, ``/nvme`` and ``/scratch`` are placed inside
the temporary directory, and ``s3://bucket/`` is a bucket of its own on the tests' moto server.

The Megatron parameter names the README documents are checked against ``ckptrepo.rules.megatron_gpt``.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import ckptrepo

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
TESTS = ROOT / "tests"
MARK = re.compile(r"<!--\s*(no-test|test-with):\s*(.*?)\s*-->")
PLACES = ("/tmp/", "/data/", "/nvme/", "/scratch/")
BLOCK_TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    line: int            # of the opening fence
    lang: str
    code: str
    skip: str | None     # the no-test reason
    setups: tuple[str, ...]


def readme_blocks(text: str) -> list[Block]:
    """The fenced ``python`` and ``bash`` blocks of ``text``, with the marker on the line before each."""
    lines = text.splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        fence = re.fullmatch(r"```(\w+)\s*", lines[i])
        if fence is None:
            i += 1
            continue
        end = lines.index("```", i + 1)
        mark = MARK.fullmatch(lines[i - 1].strip()) if i > 0 else None
        skip = mark.group(2) if mark and mark.group(1) == "no-test" else None
        setups = tuple(mark.group(2).split()) if mark and mark.group(1) == "test-with" else ()
        out.append(Block(i + 1, fence.group(1), "\n".join(lines[i + 1:end]) + "\n", skip, setups))
        i = end + 1
    return out


BLOCKS = readme_blocks(README.read_text())


def test_the_readme_has_its_blocks_and_few_go_unrun() -> None:
    assert len(BLOCKS) >= 16 and {b.lang for b in BLOCKS} == {"python", "bash"}
    assert len([b for b in BLOCKS if b.skip]) <= 2


PREAMBLES = {
    "base": """
import os, sys
import numpy as np
import torch
import ckptrepo
torch.manual_seed(0)
url = os.path.abspath("run.repo")
""",
    "model": """
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(2, 8)).sum().backward(); opt.step()
sched = torch.optim.lr_scheduler.StepLR(opt, 1)
np_rng = np.random.default_rng(0)
torch.save(model.state_dict(), "pretrained.pt")
""",
    "loop": """
from types import SimpleNamespace
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)
    def forward(self, batch):
        return SimpleNamespace(loss=self.net(batch).pow(2).mean())
model = Model()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = [torch.randn(4, 8) for _ in range(3)]
state = {"model": model, "optimizer": optimizer}
repo = ckptrepo.init(url)
""",
    "megatron-ranks": """
import torch.distributed as dist
sys.path.insert(0, TESTS)
from support.megatron_ref import GPTConfig, init_full_params, shard_full
from ckptrepo.parallel.layout import ParallelLayout
dist.init_process_group("gloo")
cfg = GPTConfig(vocab_size=50257, layers=8, hidden=8, heads=2, make_vocab_size_divisible_by=128)
state = shard_full(cfg, ParallelLayout(tp=2), dist.get_rank(), init_full_params(cfg))
repo = ckptrepo.init(url, exist_ok=True)
""",
    "megatron-version": """
sys.path.insert(0, TESTS)
from support.megatron_ref import GPTConfig, init_full_params, shard_full
from ckptrepo.parallel.layout import ParallelLayout
cfg = GPTConfig(vocab_size=50257, layers=8, hidden=8, heads=2, make_vocab_size_divisible_by=128)
rules = ckptrepo.rules.megatron_gpt(num_layers=8, vocab_size=50257)
repo = ckptrepo.init(url)
repo.snapshot(shard_full(cfg, ParallelLayout(), 0, init_full_params(cfg)), step=1000,
              parallel_layout=ckptrepo.ParallelLayout(rules=rules))
""",
    "dcp": """
step = 1000
state = {"model": torch.nn.Linear(8, 4).state_dict(), "step": step}
""",
    "hf": """
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
args = TrainingArguments(output_dir="out", max_steps=100, per_device_train_batch_size=2, report_to=[],
                         save_strategy="no", logging_steps=50, use_cpu=True, disable_tqdm=True)
g = torch.Generator().manual_seed(0)
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (16, 16), generator=g)]
""",
    "lightning": """
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset
class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)
    def training_step(self, batch, _i):
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
    def validation_step(self, batch, _i):
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=8)
    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 8), torch.randn(8, 1)), batch_size=8)
model = Model()
""",
    "deepspeed": """
import deepspeed, deepspeed.ops
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False   # gloo does the collectives
deepspeed.init_distributed(dist_backend="gloo")
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-2,
          "torch_adam": True}}, "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 6}
""",
    "megatron": """
import torch.distributed as dist
sys.path.insert(0, TESTS)
from support.megatron_workers import gpt_model
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT)
dist.init_process_group("gloo", rank=0, world_size=1)
model = gpt_model(tp=1, seed=0)
ckptrepo.init(url)
""",
}


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _placed(code: str, tmp: Path, bucket: str | None) -> str:
    for place in PLACES:
        code = code.replace(place, f"{tmp}{place}")
    return code.replace("s3://bucket/", f"s3://{bucket}/") if bucket else code


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env.update(COLUMNS="100", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return env


def _make_repository(path: Path) -> None:
    repo = ckptrepo.init(str(path), exist_ok=True)
    for step in range(1, 4):
        repo.snapshot({"model": {"w": torch.full((4, 4), float(step))}}, step=step, metrics={"loss": 1.0 / step})


def _run(block: Block, tmp: Path, bucket: str | None) -> subprocess.CompletedProcess[str]:
    for place in PLACES:
        (tmp / place.strip("/")).mkdir(exist_ok=True)
    code = _placed(block.code, tmp, bucket)
    if block.lang == "bash":
        (tmp / "examples").symlink_to(ROOT / "examples")
        for setup in block.setups:
            if setup.startswith("repo="):
                where = (tmp / _placed(setup[len("repo="):], tmp, bucket)).resolve()
                assert where.is_relative_to(tmp.resolve()), f"README.md:{block.line}: {setup} is outside the test"
                _make_repository(where)
        cmd = ["bash", "-e", "-o", "pipefail", "-c", code]
    else:
        names = ["base", *(s for s in block.setups if s in PREAMBLES)]
        preamble = f"TESTS = {str(TESTS)!r}\nPORT = {_free_port()!r}\n" + "".join(PREAMBLES[n] for n in names)
        script = tmp / f"readme_{block.line}.py"
        script.write_text(f"{preamble}\n# ---- README.md:{block.line}\n{code}")
        cmd = [sys.executable, str(script)]
        if "torchrun" in block.setups:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                   "127.0.0.1", "--master-port", _free_port(), str(script)]
    return subprocess.run(cmd, cwd=tmp, env=_env(), capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)


@pytest.mark.parametrize("block", BLOCKS, ids=[f"README.md:{b.line}" for b in BLOCKS])
def test_readme_block_runs(block: Block, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if block.skip:
        pytest.skip(f"README.md:{block.line}: {block.skip}")
    bucket = None
    if "s3://" in block.code:
        endpoint = request.getfixturevalue("s3_endpoint")
        import boto3
        bucket = f"readme-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    done = _run(block, tmp_path, bucket)
    assert done.returncode == 0, (f"README.md:{block.line} ({block.lang}) exited {done.returncode}\n"
                                  f"--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-6000:]}")


# ---- the Megatron parameter names ----------------------------------------------------------------------------

def _documented_megatron_names() -> dict[str, str]:
    """name -> the spec the README's table gives it (``Split(0)``, ``VocabSplit``, ...), with ``N`` as 0."""
    text = README.read_text()
    table = text[text.index("| Megatron parameter |"):]
    table = table[:table.index("\n\n")]
    out = {}
    for row in table.splitlines()[2:]:
        names, spec = row.strip("|").split("|")[:2]
        kind = re.search(r"`(Split\(\d\)|VocabSplit|Fused|Replicated)`", spec)
        assert kind is not None, row
        for name in re.findall(r"`([^`]+)`", names):
            out[name.replace("layers.N.", "layers.0.")] = kind.group(1)
    return out


def test_the_documented_megatron_names_are_the_rules_names() -> None:
    from support.megatron_ref import FIRST_STAGE_PARAMS, LAST_STAGE_PARAMS, LAYER_PARAMS

    from ckptrepo.rules import Fused, Replicated, Split, VocabSplit
    documented = _documented_megatron_names()
    rules = ckptrepo.rules.megatron_gpt(num_layers=1, vocab_size=100)
    assert set(documented) == {*FIRST_STAGE_PARAMS, *(f"layers.0.{p}" for p in LAYER_PARAMS), *LAST_STAGE_PARAMS}
    for name, kind in documented.items():
        spec = rules.spec(name)
        shown = {Split: lambda s: f"Split({s.dim})", VocabSplit: lambda s: "VocabSplit",
                 Fused: lambda s: "Fused", Replicated: lambda s: "Replicated"}[type(spec)](spec)
        assert shown == kind, f"{name}: the README says {kind}, megatron_gpt gives {spec}"
    # every pattern of the rules names some documented parameter: none is left undocumented
    import fnmatch
    for pattern, _spec in rules.params:
        assert any(fnmatch.fnmatchcase(n, pattern) for n in documented), pattern

