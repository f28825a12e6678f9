"""export to torch.save / safetensors / DCP and import back: bit-exact, and pickles only with --trust."""
from __future__ import annotations

import collections
import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from support.helpers import assert_bit_exact, run

from ckptrepo.errors import ExchangeError, TrustRequiredError


class Counter:
    """A Stateful object: pickled whole by torch.save, so its file needs full pickle to load."""

    def __init__(self, n: int) -> None:
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


def sample_state() -> dict:
    """Every plain type the restricted unpickler accepts, next to tensors of several dtypes and shapes."""
    g = torch.Generator().manual_seed(0)
    return {
        "model": collections.OrderedDict([("layers.0.weight", torch.randn(5, 3, generator=g)),
                                          ("layers.0.bias", torch.randn(3, generator=g).to(torch.bfloat16))]),
        "optimizer": {"state": {0: {"step": torch.tensor(4.0), "exp_avg": torch.randn(5, 3, generator=g)}},
                      "param_groups": [{"lr": 0.01, "betas": (0.9, 0.95), "params": [0]}]},
        "counts": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "step": 12, "big": 1 << 70, "loss": float("nan"), "name": "run-1", "none": None, "raw": b"\x00\xffab",
    }


def blank(obj):
    """The same structure with zeroed tensors and no plain values: what DCP must fill in."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return type(obj)((k, blank(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [blank(v) for v in obj]
    return None


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_export_in_each_format_equals_the_version(repo, tmp_path):
    repo.snapshot(sample_state(), step=12)
    saved = repo.load("HEAD")
    names = [t.name for t in repo.plumbing.manifest(repo.resolve("HEAD")).tensors]

    v = repo.export("HEAD", tmp_path / "state.pt", format="torch")
    assert v.step == 12
    assert_bit_exact(torch.load(tmp_path / "state.pt", weights_only=True), saved)

    repo.export("HEAD", tmp_path / "st", format="safetensors")
    tensors = load_file(str(tmp_path / "st" / "model.safetensors"))
    assert sorted(tensors) == sorted(names) and "optimizer/state/0/exp_avg" in tensors
    assert_bit_exact(tensors["model/layers.0.bias"], saved["model"]["layers.0.bias"])
    assert_bit_exact(tensors["optimizer/state/0/exp_avg"], saved["optimizer"]["state"][0]["exp_avg"])
    objects = json.loads((tmp_path / "st" / "objects.json").read_text(),
                         parse_constant=lambda c: pytest.fail(f"objects.json is not strict JSON: {c}"))
    assert objects["format"] == "ckptrepo-objects" and objects["tensors"] == names
    assert ["n", {"bytes": "AP9hYg=="}] in [kv[1] for kv in objects["tree"][1]]
    assert ["n", {"float": "nan"}] in [kv[1] for kv in objects["tree"][1]]

    repo.export("HEAD", tmp_path / "dcp", format="dcp")
    target = blank(saved)
    dcp.load(target, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert_bit_exact(target, saved)


def test_safetensors_and_dcp_exports_import_back_bit_exact(repo, tmp_path):
    state = sample_state()
    del state["optimizer"]   # DCP names keys by strings: int keys come back as "0"
    repo.snapshot(state, step=1)
    repo.export("HEAD", tmp_path / "st", format="safetensors")
    repo.export("HEAD", tmp_path / "dcp", format="dcp")
    v = repo.import_state(tmp_path / "st", step=2)
    assert v.message == f"imported from {tmp_path / 'st'} (safetensors)"
    assert_bit_exact(repo.load(v.id), state)
    v = repo.import_state(tmp_path / "dcp", trust=True, step=3, message="from dcp")
    assert (v.step, v.message) == (3, "from dcp")
    got = repo.load(v.id)
    assert_bit_exact(got, {**state, "model": dict(state["model"])})   # DCP returns plain dicts


def test_import_torch_file_then_export_round_trip(repo, tmp_path):
    state = sample_state()
    torch.save(state, tmp_path / "in.pt")
    v = repo.import_state(tmp_path / "in.pt", step=12, message="warm start")
    assert (v.step, v.message, repo.log()[0].id) == (12, "warm start", v.id)
    repo.export(v.id, tmp_path / "out.pt")
    assert_bit_exact(torch.load(tmp_path / "out.pt", weights_only=True), state)


def test_full_pickle_and_dcp_are_refused_without_trust(repo, tmp_path):
    torch.save({"w": torch.ones(2), "counter": Counter(3)}, tmp_path / "custom.pt")
    with pytest.raises(TrustRequiredError) as info:
        repo.import_state(tmp_path / "custom.pt")
    msg = str(info.value)
    assert "arbitrary code" in msg and "--trust" in msg and "Counter" in msg and "\n" not in msg
    assert repo.log() == []
    torch.save({"counter": Counter(3)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(TrustRequiredError, match="Counter"):   # the pre-zip format is refused just the same
        repo.import_state(tmp_path / "legacy.pt")

    p = run("import", str(tmp_path / "custom.pt"), repo=str(tmp_path / "repo"))
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "--trust" in p.stderr and repo.log() == []
    p = run("import", str(tmp_path / "custom.pt"), "--trust", "--step", "9", repo=str(tmp_path / "repo"))
    assert p.returncode == 0, p.stderr
    assert_bit_exact(repo.load("HEAD"), {"w": torch.ones(2), "counter": {"n": 3}})   # Stateful: its state dict

    repo.export("HEAD", tmp_path / "dcp", format="dcp")
    before = len(repo.log())
    with pytest.raises(TrustRequiredError, match=r"DCP checkpoint: its \.metadata file .* can run arbitrary code"):
        repo.import_state(tmp_path / "dcp")
    assert len(repo.log()) == before


def test_bad_paths_and_outputs_are_one_line_errors(repo, tmp_path):
    repo.snapshot({"z": torch.zeros(2, dtype=torch.complex128), "w": torch.ones(1)}, step=0)
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    for path, fragment in [(tmp_path / "missing", "does not exist"), (tmp_path / "empty", "neither a DCP"),
                           (tmp_path / "junk.pt", "cannot read")]:
        with pytest.raises(ExchangeError, match=fragment):
            repo.import_state(path)
    with pytest.raises(ExchangeError, match="already exists; pass --force"):
        repo.export("HEAD", tmp_path / "junk.pt")
    with pytest.raises(ExchangeError, match=r"cannot write .*: .*junk.pt is not a folder; write to another path"):
        repo.export("HEAD", tmp_path / "junk.pt" / "model.pt")   # a file where a folder should be
    with pytest.raises(ExchangeError, match="safetensors cannot store tensor 'z' of dtype complex128"):
        repo.export("HEAD", tmp_path / "st", format="safetensors")
    assert len(repo.log()) == 1
    for url in ("s3://bucket/x", "gs://b/y.pt"):   # written to ./s3:/bucket/x, with a success message
        with pytest.raises(ExchangeError, match=r"exports and imports are local files and folders"):
            repo.export("HEAD", url)
        with pytest.raises(ExchangeError, match=r"exports and imports are local files and folders"):
            repo.import_state(url)
    # the header's reserved key: the export succeeded and no reader, import_state included, could open it
    repo.snapshot({"__metadata__": torch.ones(2)}, step=1)
    with pytest.raises(ExchangeError, match="safetensors reserves the name '__metadata__'"):
        repo.export("HEAD", tmp_path / "st", format="safetensors")
    assert not (tmp_path / "st").exists()


def test_cli_export_and_import(repo, tmp_path):
    url = str(tmp_path / "repo")
    repo.snapshot({"w": torch.randn(3), "step": 1}, step=1)
    p = run("export", "HEAD", str(tmp_path / "st"), "--format", "safetensors", repo=url)
    assert p.returncode == 0 and "as safetensors" in p.stdout
    p = run("import", str(tmp_path / "st"), "-m", "again", repo=url)
    assert p.returncode == 0 and "on branch 'main'" in p.stdout
    assert repo.log()[0].message == "again"
    assert_bit_exact(repo.load("HEAD"), repo.load("HEAD~1"))
    p = run("export", "HEAD", str(tmp_path / "st"), repo=url)
    assert p.returncode == 2 and "already exists" in p.stderr and p.stderr.count("\n") == 1


def test_a_torch_export_that_fails_midway_leaves_nothing_behind(repo, tmp_path, monkeypatch):
    """A full disk left a truncated file, with a cryptic error, which the next export refused to overwrite."""
    from ckptrepo.tools import _exchange as exchange
    repo.snapshot({"w": torch.randn(1000)}, step=1)
    save = torch.save

    def disk_full(obj, f):
        save(obj, f)
        with open(f, "r+b") as fh:
            fh.truncate(100)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 263296 vs 263184")
    monkeypatch.setattr(exchange.torch, "save", disk_full)
    out = tmp_path / "out" / "model.pt"
    with pytest.raises(ExchangeError,
                       match=r"could not write .*model.pt: RuntimeError: \[enforce fail.*nothing was left there"):
        repo.export("HEAD", out)
    assert not out.exists() and list(out.parent.iterdir()) == []
    monkeypatch.undo()
    repo.export("HEAD", out)
    assert torch.equal(torch.load(out, weights_only=True)["w"], repo.load("HEAD")["w"])


@pytest.mark.parametrize("fmt", ["dcp", "safetensors"])
def test_a_directory_export_that_fails_midway_leaves_nothing_behind(repo, tmp_path, monkeypatch, fmt):
    """A full disk left a truncated DCP checkpoint (which blocked the retry) or an empty directory."""
    from ckptrepo.tools import _exchange as exchange
    repo.snapshot({"w": torch.randn(1000)}, step=1)
    real = exchange._save_dcp if fmt == "dcp" else exchange._save_safetensors

    def disk_full(state, path, *rest):
        real(state, path, *rest)
        raise OSError(27, "File too large")
    monkeypatch.setattr(exchange, "_save_dcp" if fmt == "dcp" else "_save_safetensors", disk_full)
    out = tmp_path / "exports" / "out"
    with pytest.raises(ExchangeError, match=r"could not write .*out: File too large; the file is too large for the "
                                            r"file system; write elsewhere; nothing was left there"):
        repo.export("HEAD", out, format=fmt)
    assert list((tmp_path / "exports").iterdir()) == []
    monkeypatch.undo()
    repo.export("HEAD", out, format=fmt)   # the retry is not blocked by leftovers
    repo.import_state(out, trust=True)
    assert torch.equal(repo.load("HEAD")["w"], repo.load("@1")["w"])


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names an fsynced descriptor through /proc")
@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_an_export_is_durable_before_and_after_its_rename(repo, tmp_path, monkeypatch, fmt):
    """An export (and hf's checkpoint_folder, through the same write_then_rename) is a folder or file the user
    keeps: each file written is fsynced before the rename, and the folder that holds it after."""
    repo.snapshot({"w": torch.randn(1000)}, step=1)
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    out = tmp_path / "out" / ("model.pt" if fmt == "torch" else "st")
    repo.export("HEAD", out, format=fmt)
    names = {os.path.basename(p) for p in synced}   # a torch file is fsynced under its temporary name
    written = {f".model.pt.{os.getpid()}.tmp"} if fmt == "torch" else {"model.safetensors", "objects.json"}
    assert written <= names, synced
    assert synced[-1] == str(out.parent), synced
