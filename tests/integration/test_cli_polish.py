"""The CLI as a git user tries it: decorations, narrow terminals, a closed pipe, and what gc would do."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from support.helpers import run

import ckptrepo
from ckptrepo.core._manifest import new_version_id

ENV = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(ckptrepo.__file__))))
LONG = "model.encoder.layers.10.self_attention.query_key_value.weight"


@pytest.fixture
def history(tmp_path):
    url = str(tmp_path / "repo")
    repo = ckptrepo.init(url)
    for step in range(4):
        repo.snapshot({"model": {LONG: torch.full((64,), float(step)), "bias": torch.zeros(3) + step}},
                      step=step * 10, message=f"m{step}",
                      metrics={"loss": 3.25 - step, "accuracy": 0.5 + step / 10})
    return url, repo


def test_log_and_show_decorate_remote_tracking_refs_in_gits_order(history, tmp_path):
    url, repo = history
    remote = str(tmp_path / "remote")
    ckptrepo.init(remote)
    repo.remote_add("origin", remote)
    repo.push("origin")
    repo.tag("v1")
    first = run("log", "-1", repo=url).stdout.splitlines()[0]
    assert "(HEAD -> main, origin/main, tag: v1)" in first, first
    assert "(HEAD -> main, origin/main, tag: v1)" in run("log", "--oneline", "-1", repo=url).stdout
    assert "refs    HEAD -> main, origin/main, tag: v1" in run("show", repo=url).stdout


def test_log_and_show_list_no_tracking_refs_without_a_remote(tmp_path, monkeypatch):
    """With no remote configured there are no tracking refs to decorate with: neither command lists
    refs/remotes/ (a LIST request on an object store) beyond what the library's own call does."""
    from click.testing import CliRunner

    from ckptrepo.cli.main import cli
    repo = ckptrepo.init(str(tmp_path / "repo"))
    repo.snapshot({"w": torch.zeros(2)}, step=0)
    listed: list[str] = []
    store_type = type(repo.plumbing.store)
    real_list = store_type.list

    def recording_list(self, prefix="", *args, **kwargs):
        listed.append(prefix)
        return real_list(self, prefix, *args, **kwargs)
    monkeypatch.setattr(store_type, "list", recording_list)

    def tracking_listings() -> int:
        found = sum(p.startswith("refs/remotes") for p in listed)
        listed.clear()
        return found
    library = {"log": lambda: ckptrepo.open(repo.url).log(), "show": lambda: ckptrepo.open(repo.url).show("HEAD")}
    for command in (["log"], ["log", "--oneline"], ["show"]):
        listed.clear()
        res = CliRunner().invoke(cli, ["--repo", repo.url, *command])
        assert res.exit_code == 0, res.output
        count = tracking_listings()
        library[command[0]]()
        assert count == tracking_listings(), command


def test_log_oneline_marks_pruned_versions_as_the_long_form_does(history):
    url, repo = history
    pruned = repo.resolve("@10")
    repo.prune(pruned)
    long = [line for line in run("log", repo=url).stdout.splitlines() if line.startswith(pruned[:12])]
    short = [line for line in run("log", "--oneline", repo=url).stdout.splitlines() if line.startswith(pruned[:12])]
    assert "pruned" in long[0] and "pruned" in short[0], (long, short)
    others = [line for line in run("log", "--oneline", repo=url).stdout.splitlines() if pruned[:12] not in line]
    assert others and not any("pruned" in line for line in others)


def test_log_at_80_columns_keeps_the_metrics_and_shortens_the_time(history, monkeypatch):
    url, repo = history
    monkeypatch.setenv("COLUMNS", "80")
    lines = run("log", repo=url).stdout.splitlines()
    assert len(lines) == 4
    for line in lines:
        assert len(line) <= 80, line
        assert "loss=" in line and "accuracy=0." in line, line
    monkeypatch.setenv("COLUMNS", "200")
    assert all(line.count(":") >= 2 for line in run("log", repo=url).stdout.splitlines())   # HH:MM:SS when it fits


def test_diff_at_80_columns_never_breaks_a_tensor_name(history, monkeypatch):
    url, _ = history
    monkeypatch.setenv("COLUMNS", "80")
    for args in (["diff", "@0", "@30"], ["diff", "@30", "--sort", "l2"]):
        out = run(*args, repo=url).stdout
        assert f"model/{LONG}" in out, out
        assert all(len(line) <= 80 for line in out.splitlines()), out
    monkeypatch.setenv("COLUMNS", "40")   # a name wider than the whole line: its middle gives way, on one line
    out = run("diff", "@0", "@30", repo=url).stdout
    name = next(line for line in out.splitlines() if line.startswith("model/model.encoder"))
    assert name.endswith("key_value.weight") and "…" in name and len(name) <= 40, out


def test_show_stat_and_diff_stat_print_the_same_summary(history):
    url, repo = history
    shown = run("show", "--stat", "@20", repo=url).stdout.splitlines()
    diffed = run("diff", "--stat", "@20", repo=url).stdout.splitlines()
    table = shown[shown.index(next(line for line in shown if line.startswith(repo.resolve("@10")[:12]))):]
    assert table[1:] == diffed[1:] and any(line.startswith("model") for line in table), (table, diffed)


def test_log_into_a_pipe_its_reader_closes_exits_0_quietly(tmp_path):
    url = str(tmp_path / "repo")
    repo = ckptrepo.init(url)
    with repo.snapshotter() as snap:   # 300 KiB of log: far more than a pipe holds once `head` has gone
        for step in range(10):
            snap.snapshot({"w": torch.zeros(2)}, step=step, message="x" * 30000)
    log = subprocess.Popen([sys.executable, "-m", "ckptrepo.cli", "--repo", url, "log"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, env=ENV)
    head = subprocess.Popen(["head", "-1"], stdin=log.stdout, stdout=subprocess.PIPE)
    assert log.stdout is not None and log.stderr is not None
    log.stdout.close()   # only `head` reads it now
    first, _ = head.communicate(timeout=120)
    err = log.stderr.read().decode()
    assert log.wait(timeout=120) == 0 and err == "", err
    assert first.decode().startswith(repo.resolve("HEAD")[:12])


def test_a_broken_pipe_that_is_not_stdouts_is_an_error(capsys, monkeypatch):
    """Only stdout's reader leaving is a quiet exit 0: a command whose own pipe (a FIFO it writes) breaks
    while stdout is fine fails with the error on stderr."""
    import click

    from ckptrepo.cli.main import cli, main

    @click.command("write-to-a-closed-pipe")
    def write_to_a_closed_pipe() -> None:
        click.echo("started")
        read, write = os.pipe()
        os.close(read)
        try:
            os.write(write, b"x")   # EPIPE: the pipe has no reader
        finally:
            os.close(write)
    cli.add_command(write_to_a_closed_pipe)
    monkeypatch.setattr(sys, "argv", ["ckptrepo", "write-to-a-closed-pipe"])
    try:
        with pytest.raises(SystemExit) as exit_:
            main()
    finally:
        cli.commands.pop("write-to-a-closed-pipe")
    captured = capsys.readouterr()
    assert exit_.value.code == 2 and captured.out == "started\n"
    assert captured.err.startswith("ckptrepo: error:") and "Broken pipe" in captured.err, captured.err


def test_gc_dry_run_lists_oldest_first_with_steps_and_real_sizes(history):
    url, repo = history
    head = repo.resolve("HEAD")
    leftover = new_version_id()   # data a snapshot wrote before its process died: no manifest
    shutil.copytree(os.path.join(url, "data", head), os.path.join(url, "data", leftover))
    r = run("gc", "--keep-last", "1", "--grace", "0", "--dry-run", repo=url)
    lines = r.stdout.splitlines()
    would = [line for line in lines if line.startswith("would ")]
    assert [line.split()[2] for line in would[:3]] == [repo.resolve(f"@{s}")[:12] for s in (0, 10, 20)], would
    assert ["step 0", "step 10", "step 20"] == [line.split("  ")[1].strip() for line in would[:3]], would
    gone = next(line for line in would if leftover[:12] in line)
    assert gone.startswith("would delete leftover data of") and not gone.endswith(" 0 B"), gone
    assert all(line.split()[-1] in ("B", "KiB", "MiB") and not line.endswith(" 0 B") for line in would), would
    assert "would free 0 B" not in r.stdout
    data = ckptrepo.open(url).gc(keep_last=1, grace_period_s=0, dry_run=True)
    assert list(data.details)[-1] == leftover and data.details[leftover]["stored_bytes"] > 0
    assert os.path.isdir(os.path.join(url, "data", leftover))   # a dry run deletes nothing
