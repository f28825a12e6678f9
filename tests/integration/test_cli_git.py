"""The CLI as a git user expects it (issue 27 §5-§7): no Python error texts, output files that never clobber,
output that fits the terminal, git's verbs and flags, a torch export that needs no trust, a config repair."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support.helpers import run

import ckptrepo
from ckptrepo.core._manifest import FAILURES_PREFIX, seal

ROOT = Path(__file__).resolve().parent.parent.parent
LONG = "optimizer/state/decoder.layers.{}.self_attention.linear_qkv.weight/exp_avg_sq"


@pytest.fixture
def history(tmp_path):
    """Four versions with long names, numbered names (2, 10, 1), long messages and several metrics."""
    url = str(tmp_path / "repo")
    repo = ckptrepo.init(url)
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        state = {"model": {f"layers.{i}.w": torch.randn(4, 3, generator=g) for i in (10, 2, 1)},
                 "optimizer": {LONG.format(i): torch.randn(8, generator=g) * 1e-5 for i in (2, 10)},
                 "step": step, "note": "n" * 120}
        repo.snapshot(state, step=step * 10, message=f"step {step}: " + "a rather long message " * 8,
                      metrics={"loss": 3.0 - step, "lr": 1e-4, "grad_norm": 1.2345, "tokens": 123456789})
    repo.tag("good", "@10")
    return url, repo


# ---- 1. no Python error texts --------------------------------------------------------------------------------
def _bad_inputs(tmp: Path, url: str) -> list[list[str]]:
    nul, mem = "\x00", "/proc/self/mem"
    return [["export", "HEAD", nul], ["import", nul], ["trajectory", "*", "--csv", nul], ["metrics", "--png", nul],
            ["trajectory", "*", "--csv", mem], ["trajectory", "*", "--csv", ""], ["export", "HEAD", ""],
            ["diff", "HEAD", "--stat", "--depth", "0"], ["diff", "HEAD", "--stat", "--depth", "-1"],
            ["stats", "--pattern", "["], ["trajectory", "[!"], ["trajectory", "*", "--since", "99999999999999999999"],
            ["log", "-n", "99999999999999999999999"], ["log", "-0"], ["log", "@99999999999999999999999"],
            ["diff", "@0"], ["show", "--stat", "HEAD~99999999999999999999"], ["status", "--json", "x"],
            ["import", str(tmp / "step.pt"), "--step", "99999999999999999999999"], ["fsck", "--repair-config", "x"],
            ["export", "HEAD", os.path.join(url, "HEAD")], ["trajectory", "*", "--png", str(tmp)]]


def test_bad_option_values_never_show_python_error_texts(history, tmp_path):
    url, _ = history
    torch.save({"w": torch.ones(1)}, tmp_path / "step.pt")
    for args in _bad_inputs(tmp_path, url):
        p = run(*args, repo=url)
        text = p.stdout + p.stderr
        assert "CKPTREPO_DEBUG" not in text and not re.search(r"\b\w+Error: ", text), (args, text)
        if p.returncode:
            assert p.stderr.strip() and (p.stderr.startswith("ckptrepo: error: ") or "Usage:" in p.stderr), (args, text)


def test_stats_and_trajectory_say_when_no_tensor_matches(history):
    url, _ = history
    for args in (["stats", "--pattern", "nothing*"], ["trajectory", "nothing*"]):
        p = run(*args, repo=url)
        assert p.returncode == 2 and "matches 'nothing*'" in p.stderr and p.stderr.count("\n") == 1, p.stderr


# ---- 2. output files ------------------------------------------------------------------------------------------
def test_csv_and_png_never_overwrite_without_force_nor_write_inside_the_repository(history, tmp_path):
    url, repo = history
    head = (Path(url) / "HEAD").read_bytes()
    for flag in ("--csv", "--png"):
        p = run("trajectory", "model/*", flag, os.path.join(url, "HEAD"), "--force", repo=url)
        assert p.returncode == 2 and "inside the repository" in p.stderr, p.stderr
    p = run("metrics", "--png", os.path.join(url, "refs", "heads", "new.png"), repo=url)
    assert p.returncode == 2 and "inside the repository" in p.stderr
    assert (Path(url) / "HEAD").read_bytes() == head and not (Path(url) / "refs" / "heads" / "new.png").exists()
    assert run("fsck", repo=url).returncode == 0

    csv = tmp_path / "t.csv"
    csv.write_text("keep me")
    # checked before anything is computed: the revision is never looked up
    p = run("trajectory", "model/*", "--rev", "nosuch", "--csv", str(csv), repo=url)
    assert p.returncode == 2 and "already exists; pass --force" in p.stderr and csv.read_text() == "keep me"
    p = run("trajectory", "model/*", "--csv", str(csv), "--force", repo=url)
    assert p.returncode == 0 and csv.read_text().startswith("version,step,name,norm")
    png = tmp_path / "m.png"
    png.write_bytes(b"x")
    assert run("metrics", "--png", str(png), repo=url).returncode == 2 and png.read_bytes() == b"x"
    assert run("metrics", "--png", str(png), "--force", repo=url).returncode == 0
    assert png.read_bytes().startswith(b"\x89PNG")


def test_export_refuses_the_repository_and_replaces_only_with_force(history, tmp_path):
    url, repo = history
    p = run("export", "HEAD", os.path.join(url, "x.pt"), repo=url)
    assert p.returncode == 2 and "inside the repository" in p.stderr and not (Path(url) / "x.pt").exists()
    out = tmp_path / "out.pt"
    out.write_bytes(b"old")
    assert run("export", "HEAD", str(out), repo=url).returncode == 2 and out.read_bytes() == b"old"
    assert run("export", "HEAD", str(out), "--force", repo=url).returncode == 0
    assert torch.load(out, weights_only=True)["step"] == 3
    st = tmp_path / "st"
    assert run("export", "@0", str(st), "--format", "safetensors", repo=url).returncode == 0
    assert run("export", "HEAD", str(st), "--format", "safetensors", "--force", repo=url).returncode == 0
    assert ckptrepo.open(url).import_state(st).step == 3   # the state of HEAD (its "step" key), not of @0
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("precious")
    p = run("export", "HEAD", str(other), "--format", "safetensors", "--force", repo=url)
    assert p.returncode == 2 and "holds no safetensors export" in p.stderr
    assert (other / "notes.txt").read_text() == "precious"


# ---- 3. width -------------------------------------------------------------------------------------------------
WIDE_COMMANDS = [["log"], ["log", "--oneline"], ["log", "-p", "-2"], ["log", "--stats"], ["log", "--graph", "--all"],
                 ["diff", "main"], ["diff", "@0", "main", "--stat"], ["show", "main"], ["show", "--stat", "main"],
                 ["stats", "main"],
                 ["trajectory", "*", "--rev", "main"], ["metrics", "main"], ["du"], ["status"], ["branch"]]


@pytest.mark.parametrize("columns", [80, 200])
def test_every_line_fits_the_width(history, monkeypatch, columns):
    url, repo = history
    repo.checkout("@10", branch="a-branch-with-a-long-name-" + "x" * 40)
    repo.snapshot({"w": torch.ones(1)}, step=11, message="m" * 300)
    monkeypatch.setenv("COLUMNS", str(columns))
    widest = 0
    for args in WIDE_COMMANDS:
        p = run(*args, repo=url)
        assert p.returncode == 0, (args, p.stderr)
        for line in p.stdout.splitlines():
            assert len(line) <= columns, (args, len(line), line)
            widest = max(widest, len(line))
    assert widest > 120 if columns == 200 else widest == 80   # a wide terminal is used, not left empty


def test_without_columns_a_pipe_gets_whole_lines(history, monkeypatch):
    url, _ = history
    monkeypatch.delenv("COLUMNS", raising=False)
    p = run("log", repo=url)
    assert "…" not in p.stdout and ("a rather long message " * 8).strip() in p.stdout


# ---- 4. verbs and flags ---------------------------------------------------------------------------------------
def test_status_counts_ranks_arrays_and_ignores_a_starts_probes(history):
    """A snapshot in flight whose data holds several ranks' arrays is a distributed one; a distributed start's
    probe objects (staging/<id>/probe-<rank>) are no snapshot at all."""
    url, repo = history
    store = repo.plumbing.store
    ranks, single, probe = "ef" * 10 + "0" * 12, "12" * 10 + "0" * 12, "34" * 10 + "0" * 12
    for r in (0, 1):
        store.put(f"data/{ranks}/{r}/float32/zarr.json", b"{}")
    store.put(f"data/{single}/0/float32/zarr.json", b"{}")
    store.put(f"staging/{probe}/probe-0", b"")
    flying = {u.id: u.distributed for u in repo.status().uncommitted}
    assert flying == {ranks: True, single: False}, flying


def test_status_names_head_and_snapshots_in_flight_or_failed(history):
    url, repo = history
    p = run("status", repo=url)
    assert p.returncode == 0 and p.stdout.startswith(f"On branch main at {repo.resolve('HEAD')[:12]} (step 30")
    assert "no snapshots in flight, none failed" in p.stdout
    store = repo.plumbing.store
    flying, failed = "ab" * 10 + "0" * 12, "cd" * 10 + "0" * 12
    store.put(f"data/{flying}/zarr.json", b"{}")
    store.put(f"staging/{flying}/rank-1", b"x")
    store.put(FAILURES_PREFIX + failed, seal({"id": failed, "step": 99, "time": 1.0, "error": "disk full"}))
    repo.checkout("@10")
    p = run("status", repo=url)
    assert "HEAD detached at" in p.stdout and "(step 10" in p.stdout
    assert "1 snapshot(s) in flight" in p.stdout and f"{flying[:12]}  started" in p.stdout and "distributed" in p.stdout
    assert "1 failed snapshot(s)" in p.stdout and "step 99" in p.stdout and "disk full" in p.stdout
    data = json.loads(run("status", "--json", repo=url).stdout)
    assert data["branch"] is None and [u["id"] for u in data["uncommitted"]] == [flying]


def test_diff_of_one_revision_is_against_its_parent(history):
    url, repo = history
    one = json.loads(run("diff", "HEAD", "--json", repo=url).stdout)
    two = json.loads(run("diff", "HEAD~1", "HEAD", "--json", repo=url).stdout)
    assert one == two
    p = run("diff", "@0", repo=url)
    assert p.returncode == 2 and "root version" in p.stderr and "diff A B" in p.stderr


def test_show_stat_log_oneline_log_n_and_log_p(history):
    url, repo = history
    p = run("show", "--stat", repo=url)
    assert p.returncode == 0 and "prefix" in p.stdout and "model.layers" in p.stdout and "exp_avg_sq" not in p.stdout
    assert json.loads(run("show", "--stat", "--json", "@0", repo=url).stdout)["stat"] is None

    lines = run("log", "--oneline", repo=url).stdout.splitlines()
    assert len(lines) == 4 and lines[0].startswith(repo.resolve("HEAD")[:12] + " (HEAD -> main) step 30  step 3:")
    assert "loss=" not in lines[0]
    assert len(run("log", "-1", repo=url).stdout.splitlines()) == 1
    assert len(run("log", "-3", "--oneline", repo=url).stdout.splitlines()) == 3
    assert [v["step"] for v in json.loads(run("log", "--since", "-5", "-2", "--json", repo=url).stdout)] == [30, 20]

    p = run("log", "-p", "-2", repo=url)
    lines = p.stdout.splitlines()
    assert lines[1] == "    M model/layers.1.w" + lines[1][len("    M model/layers.1.w"):]
    assert [ln.split()[1] for ln in lines[1:4]] == ["model/layers.1.w", "model/layers.2.w", "model/layers.10.w"]
    assert "    M step: 2 -> 3" in lines and "    5 of 5 tensors changed" in lines
    assert run("log", "-p", "@0", repo=url).stdout.splitlines()[1] == "    root version: no parent to compare with"
    data = json.loads(run("log", "-p", "-1", "--json", repo=url).stdout)
    assert {t["status"] for t in data[0]["changes"]["tensors"]} == {"changed"}


def test_revisions_complete_in_the_shell(history, monkeypatch):
    url, repo = history
    repo.branch("feature")
    vid = repo.resolve("@10")

    def complete(words: str) -> list[str]:
        monkeypatch.setenv("_CKPTREPO_COMPLETE", "bash_complete")
        monkeypatch.setenv("COMP_WORDS", words)
        monkeypatch.setenv("COMP_CWORD", str(len(words.split()) - (0 if words.endswith(" ") else 1)))
        p = run()
        monkeypatch.delenv("_CKPTREPO_COMPLETE")
        lines = [line for line in p.stdout.splitlines() if line]
        assert p.returncode == 0 and all(line.startswith("plain,") for line in lines), (words, p.stdout)
        return [line.split(",", 1)[1] for line in lines]
    assert complete(f"ckptrepo --repo {url} show ") == ["HEAD", "feature", "main", "good"]
    assert complete(f"ckptrepo --repo {url} diff HEAD f") == ["feature"]
    assert complete(f"ckptrepo --repo {url} checkout {vid[:5]}") == [vid[:12]]
    assert complete(f"ckptrepo --repo {url} branch -d ") == ["feature", "main"]
    assert complete(f"ckptrepo --repo {url}x log ") == []   # no repository: nothing, and no error


# ---- 5. small fixes -------------------------------------------------------------------------------------------
def test_init_of_a_memory_repository_is_refused(tmp_path):
    for args in (["init", "memory://x"], ["--repo", "memory://x", "init"]):
        p = run(*args)
        assert p.returncode == 2 and "lives only in the process" in p.stderr and p.stderr.count("\n") == 1
    p = run("log", repo="memory://x")
    assert p.returncode == 2 and "lives only in the process" in p.stderr and "ckptrepo init" not in p.stderr


def test_help_texts_natural_order_only_changed_and_binary_units(history):
    url, repo = history
    assert "relative change" in run("diff", "--help").stdout
    assert "||v - previous||" in run("trajectory", "--help").stdout.replace("\n", " ").replace("  ", " ") or \
        "previous" in run("trajectory", "--help").stdout
    names = [ln.split()[0] for ln in run("diff", "@0", "@10", repo=url).stdout.splitlines()[3:6]]
    assert names == ["model/layers.1.w", "model/layers.2.w", "model/layers.10.w"]
    for b in ("v10", "v2", "v1"):
        repo.branch(b, "@0")
    assert [ln.split()[0] for ln in run("branch", repo=url).stdout.splitlines() if "v" in ln.split()[0][:1]] == \
        ["v1", "v2", "v10"]
    repo.snapshot({"w": torch.ones(2)}, step=40)
    repo.snapshot({"w": torch.ones(2)}, step=50)
    p = run("diff", "HEAD", "--only-changed", repo=url)
    assert p.returncode == 0 and "no tensor changed between" in p.stdout and "||B-A||" not in p.stdout
    stats_line = run("log", "--stats", "-1", repo=url).stdout.splitlines()[1]
    assert re.search(r"\d (B|KiB|MiB|GiB)/s", stats_line) and "GB/s" not in stats_line and " MB" not in stats_line


def test_import_records_the_step_the_state_holds(history, tmp_path):
    url, repo = history
    torch.save({"w": torch.ones(2), "step": 1234}, tmp_path / "a.pt")
    p = run("import", str(tmp_path / "a.pt"), repo=url)
    assert p.returncode == 0 and "(step 1234)" in p.stdout and repo.version("HEAD").step == 1234
    torch.save({"w": torch.ones(2), "step": torch.tensor(77)}, tmp_path / "b.pt")
    assert repo.import_state(tmp_path / "b.pt").step == 77
    assert repo.import_state(tmp_path / "b.pt", step=5).step == 5   # told otherwise
    torch.save({"w": torch.ones(2), "step": 1.5}, tmp_path / "c.pt")
    assert repo.import_state(tmp_path / "c.pt").step is None


@pytest.mark.slow   # two runs of the example
def test_resume_of_a_branch_continues_on_that_branch(tmp_path):
    repo_path = tmp_path / "r"
    script = ROOT / "examples" / "train_gpt.py"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    base = [sys.executable, str(script), "--repo", str(repo_path), "--n-embd", "8", "--block-size", "8"]
    subprocess.run(base + ["--steps", "3"], check=True, env=env, capture_output=True, timeout=300)
    repo = ckptrepo.open(str(repo_path))
    repo.checkout("@2", branch="retry")
    repo.checkout("main")
    p = subprocess.run(base + ["--steps", "4", "--resume", "retry"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert "on branch 'retry'" in p.stdout
    repo = ckptrepo.open(str(repo_path))
    assert repo.current_branch() == "retry" and set(repo.branches()) == {"main", "retry"}
    assert [v.step for v in repo.log("retry")] == [4, 3, 2, 1]


# ---- 6. the torch export --------------------------------------------------------------------------------------
def test_a_torch_export_loads_with_weights_only_and_imports_without_trust(tmp_path):
    url = str(tmp_path / "repo")
    repo = ckptrepo.init(url)
    rng = np.random.default_rng(5)
    rng.random()
    repo.snapshot({"w": torch.ones(2), "arr": np.arange(6, dtype=np.int32).reshape(2, 3), "lr": np.float32(0.5),
                   "n": np.int64(7), "rng": rng, "step": 3}, step=3)
    p = run("export", "HEAD", str(tmp_path / "out.pt"), repo=url)
    assert p.returncode == 0, p.stderr
    state = torch.load(tmp_path / "out.pt", weights_only=True)
    assert torch.equal(state["arr"], torch.arange(6, dtype=torch.int32).reshape(2, 3))
    assert (state["lr"], type(state["lr"]), state["n"], type(state["n"])) == (0.5, float, 7, int)
    assert state["rng"] == rng.bit_generator.state
    p = run("import", str(tmp_path / "out.pt"), repo=url)
    assert p.returncode == 0 and "(step 3)" in p.stdout, p.stderr


# ---- 7. a damaged config --------------------------------------------------------------------------------------
def test_fsck_repair_config_rebuilds_a_damaged_config(history):
    url, repo = history
    config = Path(url) / "ckptrepo.json"
    assert "nothing to repair" in run("fsck", "--repair-config", repo=url).stdout
    repo.checkout("@10", branch="side")
    oldest = repo.log(all=True)[-1]
    config.write_bytes(b'{"format": "ckptrepo", "format_vers')
    p = run("log", repo=url)
    assert p.returncode == 2 and "ckptrepo fsck --repair-config" in p.stderr and p.stderr.count("\n") == 1
    p = run("fsck", "--repair-config", repo=url)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "repair: ckptrepo.json was damaged; rebuilt it" in p.stdout
    assert "default branch 'side' (the branch HEAD is on)" in p.stdout and "the time of the oldest version" in p.stdout
    cfg = json.loads(config.read_text())
    assert cfg["format"] == "ckptrepo" and cfg["default_branch"] == "side"
    assert abs(cfg["created"] - oldest.time) < 1.0
    assert run("log", repo=url).returncode == 0

    config.write_text(json.dumps({"format": "ckpt", "created": 12345.0, "default_branch": "main", "extra": 1}))
    assert "kept from the damaged file" in run("fsck", "--repair-config", repo=url).stdout
    assert json.loads(config.read_text())["created"] == 12345.0 and json.loads(config.read_text())["extra"] == 1
    config.unlink()
    assert "ckptrepo.json was missing" in run("fsck", "--repair-config", repo=url).stdout


def test_repair_config_never_makes_a_repository_of_another_folder(tmp_path):
    (tmp_path / "photos").mkdir()
    p = run("fsck", "--repair-config", repo=str(tmp_path / "photos"))
    assert p.returncode == 2 and "no ckptrepo repository" in p.stderr
    assert list((tmp_path / "photos").iterdir()) == []
