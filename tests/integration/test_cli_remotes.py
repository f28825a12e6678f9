"""Git-style remotes from the CLI (issue 28 §3): remote add/remove/list, push, fetch, pull and clone, on a file
remote and on S3 (moto on 127.0.0.1); the durability `log` shows; and the one-line errors, each saying what to do
and losing nothing: an unreachable remote, wrong credentials, a bucket that does not exist, a remote holding
another repository, a rejected push, a clone into a non-empty directory, a remote name taken or unknown."""
from __future__ import annotations

import io
import json
import os
import socket
from pathlib import Path

import pytest
import torch
from support.helpers import assert_bit_exact, count_manifest_reads, run

import ckptrepo


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}, "step": step}


def _history(url: str, steps: range) -> ckptrepo.Repository:
    repo = ckptrepo.init(url)
    for step in steps:
        repo.snapshot(_state(step), step=step, message=f"step {step}")
    return repo


def _one_line_error(r, *needles: str) -> str:
    """The error as the CLI gives it: exit 2, one line on stderr, nothing on stdout, each needle in it."""
    line = r.stderr.strip()
    assert r.returncode == 2 and r.stdout == "" and "\n" not in line and line.startswith("ckptrepo: error: "), \
        (r.returncode, r.stdout, r.stderr)
    for needle in needles:
        assert needle in line, (needle, line)
    return line


def _tips(url: str) -> dict[str, str]:
    return ckptrepo.open(url).branches()


@pytest.fixture
def pushed(tmp_path):
    """A repository with three versions and a tag, pushed to a file remote ``origin``."""
    a = str(tmp_path / "a")
    _history(a, range(3)).tag("v1")
    remote = str(tmp_path / "remote")
    assert run("remote", "add", "origin", remote, repo=a).returncode == 0
    assert run("push", "origin", "main", "v1", repo=a).returncode == 0   # tags go only where named, as in git
    return a, remote


# ---- remote add / remove / list ----------------------------------------------------------------------------------
def test_remote_add_list_and_remove_as_git(tmp_path):
    a = str(tmp_path / "a")
    _history(a, range(1))
    assert run("remote", repo=a).stdout == ""
    r = run("remote", "add", "origin", "relative/remote", cwd=tmp_path, repo=a)
    where = str(tmp_path / "relative" / "remote")   # a path is recorded absolute: the same from any directory
    assert r.returncode == 0 and where in r.stdout
    assert run("remote", "add", "backup", "s3://bucket/run1", repo=a).returncode == 0
    assert run("remote", repo=a).stdout.split() == ["backup", "origin"]
    assert run("remote", "-v", repo=a).stdout.splitlines() == ["backup\ts3://bucket/run1", f"origin\t{where}"]
    assert run("remote", "list", "-v", repo=a).stdout == run("remote", "-v", repo=a).stdout
    listed = json.loads(run("remote", "list", "--json", repo=a).stdout)
    assert listed == [{"name": "backup", "url": "s3://bucket/run1"}, {"name": "origin", "url": where}]
    assert run("remote", "remove", "backup", repo=a).returncode == 0
    assert run("remote", repo=a).stdout.split() == ["origin"]


def test_remote_add_of_a_taken_name_and_an_unknown_remote_say_what_to_do(pushed):
    a, remote = pushed
    _one_line_error(run("remote", "add", "origin", "/elsewhere", repo=a), "remote 'origin' exists",
                    "ckptrepo remote remove origin")
    assert ckptrepo.open(a).remotes() == {"origin": remote}   # the first one is kept
    for args in (["push", "upstream"], ["fetch", "upstream"], ["pull", "upstream"], ["remote", "remove", "upstream"]):
        _one_line_error(run(*args, repo=a), "no remote named 'upstream' (remotes: origin)",
                        "ckptrepo remote add upstream URL")
    _one_line_error(run("remote", "add", "bad/name", "/x", repo=a), "is not a remote name")


# ---- push, fetch, pull, clone: a file remote ---------------------------------------------------------------------
def test_push_prints_what_moved_as_git_and_json_for_scripts(tmp_path):
    a = str(tmp_path / "a")
    repo = _history(a, range(2))
    remote = str(tmp_path / "remote")
    run("remote", "add", "origin", remote, repo=a)
    r = run("push", repo=a)
    assert r.returncode == 0 and r.stderr == "", r.stderr   # no progress bar off a terminal
    lines = r.stdout.splitlines()
    assert lines[:2] == [f"To {remote}", " * [new branch]  main -> main"] and len(lines) == 3, lines
    assert lines[2].startswith("pushed 2 versions, 2 arrays, "), lines
    assert run("push", repo=a).stdout.splitlines() == [f"To {remote}", "Everything up-to-date"]
    old = repo.resolve("main")
    new = repo.snapshot(_state(2), step=2).id
    repo.tag("best")
    r = run("push", "--json", "origin", "main", "best", repo=a)
    data = json.loads(r.stdout)
    assert data["remote"] == "origin" and data["url"] == remote and data["versions"] == [new]
    assert data["refs"] == [{"ref": "refs/heads/main", "old": old, "new": new, "status": "fast-forward"},
                            {"ref": "refs/tags/best", "old": None, "new": new, "status": "created"}]
    assert data["arrays"] == 1 and data["bytes"] > 64 * 32 * 4
    assert ckptrepo.open(remote).tags() == {"best": new} and _tips(remote) == {"main": new}
    _one_line_error(run("push", "origin", "nothing", repo=a), "no branch or tag named 'nothing'", "ckptrepo branch")


def test_lazy_clone_loads_bit_exact_pushes_back_and_the_other_side_pulls(pushed, tmp_path):
    a, remote = pushed
    c = str(tmp_path / "c")
    r = run("clone", remote, c, "--lazy")
    assert r.returncode == 0 and "3 versions" in r.stdout and "read from origin when loaded" in r.stdout, r.stdout
    clone = ckptrepo.open(c)
    assert clone.current_branch() == "main" and clone.tags() == ckptrepo.open(a).tags()
    assert not list(Path(c).glob("data/*")), "a lazy clone copies no tensor data"
    for step in range(3):
        assert_bit_exact(clone.load(f"@{step}"), _state(step))
    clone.snapshot(_state(3), step=3)
    before = _tips(remote)["main"]
    r = run("push", repo=c)
    assert r.returncode == 0 and f"   {before[:12]}..{clone.resolve('main')[:12]}  main -> main" in r.stdout, r.stdout
    r = run("fetch", repo=a)
    assert r.stdout.splitlines()[:2] == [f"From {remote}", f"   {before[:12]}..{clone.resolve('main')[:12]}  main -> "
                                                          f"origin/main"], r.stdout
    assert ckptrepo.open(a).resolve("main") == before   # fetch moves no local branch
    r = run("pull", repo=a)
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "Fast-forward", r.stdout
    assert ckptrepo.open(a).resolve("main") == clone.resolve("main")
    assert_bit_exact(ckptrepo.open(a).load("HEAD"), _state(3))
    assert run("pull", repo=a).stdout.strip() == "Already up to date."


def test_fetch_pull_and_clone_json(pushed, tmp_path):
    a, remote = pushed
    c = str(tmp_path / "c")
    data = json.loads(run("clone", "--json", "--depth", "1", remote, c).stdout)
    head = ckptrepo.open(a).resolve("main")
    assert data == {"url": remote, "directory": c, "remote": "origin", "branch": "main", "head": head, "versions": 3,
                    "bytes": data["bytes"], "lazy": False, "depth": 1}
    assert 64 * 32 * 4 < data["bytes"] < 2 * 64 * 32 * 4   # the newest version's data only
    assert_bit_exact(ckptrepo.open(c).load("@0"), _state(0))   # an older one reads its data from origin
    new = ckptrepo.open(a).snapshot(_state(5), step=5).id
    run("push", repo=a)
    fetched = json.loads(run("fetch", "--json", repo=c).stdout)
    assert fetched["versions"] == [new] and fetched["refs"][0] == {
        "ref": "refs/remotes/origin/main", "old": head, "new": new, "status": "fast-forward"}
    pulled = json.loads(run("pull", "--json", "origin", repo=c).stdout)
    assert pulled["versions"] == [] and pulled["refs"][-1] == {"ref": "refs/heads/main", "old": head, "new": new,
                                                                "status": "fast-forward"}


def test_progress_bars_on_a_terminal_only(pushed, tmp_path, monkeypatch):
    from rich.console import Console

    from ckptrepo.cli import _output
    a, remote = pushed
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=100)
    monkeypatch.setattr(_output, "err_console", lambda: console)
    ckptrepo.open(a).snapshot(_state(9), step=9)
    assert run("push", repo=a).returncode == 0
    assert "push to origin" in screen.getvalue()
    assert run("clone", remote, str(tmp_path / "c")).returncode == 0
    assert "clone " in screen.getvalue()


# ---- push rejected, pull diverged ---------------------------------------------------------------------------------
def test_a_push_that_is_not_a_fast_forward_is_rejected_saying_fetch_first(pushed, tmp_path):
    a, remote = pushed
    c = str(tmp_path / "c")
    run("clone", remote, c)
    theirs = ckptrepo.open(c).snapshot(_state(10), step=10).id
    assert run("push", repo=c).returncode == 0
    mine = ckptrepo.open(a).snapshot(_state(20), step=20).id
    _one_line_error(run("push", repo=a), "push to origin rejected", "not a fast-forward", "fetch first",
                    "ckptrepo pull origin")
    assert _tips(remote) == {"main": theirs}   # nothing lost on either side
    assert ckptrepo.open(a).resolve("main") == mine
    _one_line_error(run("pull", repo=a), "have diverged", "ckptrepo checkout origin/main -b NAME")
    assert ckptrepo.open(a).resolve("main") == mine and ckptrepo.open(a).resolve("origin/main") == theirs
    assert run("checkout", "origin/main", "-b", "theirs", repo=a).returncode == 0   # the hint works
    assert ckptrepo.open(a).resolve("theirs") == theirs


def test_a_remote_holding_another_repository_is_refused(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _history(a, range(2))
    _history(b, range(1))
    run("remote", "add", "other", b, repo=a)
    _one_line_error(run("push", "other", repo=a), "remote 'other'", "holds another repository", "check the URL")
    _one_line_error(run("fetch", "other", repo=a), "holds another repository")
    assert len(ckptrepo.open(b).log()) == 1 and len(ckptrepo.open(a).log()) == 2
    assert ckptrepo.open(a).log(all=True) == ckptrepo.open(a).log()


def test_clone_into_a_non_empty_directory_is_refused(pushed, tmp_path):
    _, remote = pushed
    target = tmp_path / "busy"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    _one_line_error(run("clone", remote, str(target)), "is not empty", "clone into a new directory")
    assert [p.name for p in target.iterdir()] == ["notes.txt"] and (target / "notes.txt").read_text() == "mine"
    _one_line_error(run("clone", str(tmp_path / "nothing"), str(tmp_path / "c")), "no ckptrepo repository there",
                    "check the URL")


# ---- durability in log ---------------------------------------------------------------------------------------------
def test_log_shows_where_each_version_is_durable(pushed, tmp_path):
    a, remote = pushed
    repo = ckptrepo.open(a)
    repo.snapshot(_state(3), step=3)
    lines = run("log", "--oneline", repo=a).stdout.splitlines()
    assert "[local] step 3" in lines[0] and all("[local origin] step" in line for line in lines[1:]), lines
    rows = json.loads(run("log", "--json", repo=a).stdout)
    assert [(r["step"], r["local"], r["remotes"]) for r in rows] == [
        (3, True, []), (2, True, ["origin"]), (1, True, ["origin"]), (0, True, ["origin"])]
    c = str(tmp_path / "c")
    run("clone", "--lazy", remote, c)
    assert [(r["local"], r["remotes"]) for r in json.loads(run("log", "--json", repo=c).stdout)] == \
        [(False, ["origin"])] * 3
    assert "[origin]  step 2" in run("log", repo=c).stdout
    assert "durable origin" in run("show", repo=c).stdout
    v = ckptrepo.open(c).version("HEAD~1")
    assert (v.local, v.remotes) == (False, ("origin",))


def test_log_without_remotes_shows_no_durability_marker(tmp_path):
    a = str(tmp_path / "a")
    _history(a, range(2))
    assert "[local" not in run("log", repo=a).stdout and "durable" not in run("show", repo=a).stdout


def test_log_n_reads_about_the_headers_it_lists_however_long_the_pushed_history(tmp_path, monkeypatch):
    """Remote durability walks back from each remote-tracking tip only as far as the oldest version listed."""
    from ckptrepo.core._remotes import set_tracking_ref
    a = str(tmp_path / "a")
    repo = _history(a, range(120))
    repo.remote_add("origin", str(tmp_path / "remote"))
    set_tracking_ref(repo.plumbing.store, "origin", "main", repo.resolve("main"))
    set_tracking_ref(repo.plumbing.store, "origin", "old", repo.resolve("@60"))
    fresh = ckptrepo.open(a)
    reads = count_manifest_reads(monkeypatch, fresh.plumbing.store)
    shown = fresh.log(limit=10)
    assert [v.remotes for v in shown] == [("origin",)] * 10
    assert sum(reads.values()) <= 12, sum(reads.values())


# ---- faults: unreachable remote, wrong credentials, no bucket; an S3 round trip -----------------------------------
def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_s3_remote_round_trip(s3_url, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTREPO_STORE_RETRIES", "1")
    a = str(tmp_path / "a")
    _history(a, range(3))
    run("remote", "add", "origin", s3_url, repo=a)
    r = run("push", repo=a)
    assert r.returncode == 0 and r.stdout.startswith(f"To {s3_url}\n * [new branch]  main -> main"), r.stdout
    c = str(tmp_path / "c")
    assert run("clone", "--lazy", s3_url, c).returncode == 0
    for step in range(3):
        assert_bit_exact(ckptrepo.open(c).load(f"@{step}"), _state(step))
    ckptrepo.open(c).snapshot(_state(3), step=3)
    assert run("push", repo=c).returncode == 0
    assert run("pull", repo=a).stdout.splitlines()[-1] == "Fast-forward"
    assert_bit_exact(ckptrepo.open(a).load("HEAD"), _state(3))
    assert [r["remotes"] for r in json.loads(run("log", "--json", repo=a).stdout)] == [["origin"]] * 4
    d = str(tmp_path / "d")
    assert json.loads(run("clone", "--json", "--depth", "1", s3_url, d).stdout)["versions"] == 4
    assert_bit_exact(ckptrepo.open(d).load("@1"), _state(1))


def test_an_unreachable_remote_fails_in_one_line_and_loses_nothing(pushed, tmp_path, monkeypatch):
    a, _ = pushed
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("CKPTREPO_STORE_RETRIES", "1")
    run("remote", "add", "far", "s3://bucket/run", repo=a)
    before = [v.id for v in ckptrepo.open(a).log(all=True)]
    for args in (["push", "far"], ["fetch", "far"], ["pull", "far"]):
        _one_line_error(run(*args, repo=a), "remote 'far' (s3://bucket/run)", "AWS_ENDPOINT_URL")
    _one_line_error(run("clone", "s3://bucket/run", str(tmp_path / "c")), "cannot clone s3://bucket/run",
                    "AWS_ENDPOINT_URL")
    assert not (tmp_path / "c").exists()
    assert [v.id for v in ckptrepo.open(a).log(all=True)] == before


def test_wrong_credentials_say_to_check_them(s3_url, tmp_path, monkeypatch):
    """moto accepts any key unless told to check them; told to, it refuses the test's made-up key, as AWS does."""
    import moto.settings
    monkeypatch.setenv("CKPTREPO_STORE_RETRIES", "1")
    a = str(tmp_path / "a")
    _history(a, range(1))
    run("remote", "add", "origin", s3_url, repo=a)
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    for args in (["push"], ["fetch"]):
        _one_line_error(run(*args, repo=a), f"remote 'origin' ({s3_url}): access denied", "InvalidAccessKeyId",
                        "check the credentials", "AWS_SECRET_ACCESS_KEY")
    _one_line_error(run("clone", s3_url, str(tmp_path / "c")), "access denied", "check the credentials")
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", float("inf"))
    assert run("push", repo=a).returncode == 0   # nothing was lost: the same push goes through


def test_a_bucket_that_does_not_exist_is_named(s3_endpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTREPO_STORE_RETRIES", "1")
    a = str(tmp_path / "a")
    _history(a, range(1))
    url = "s3://no-such-bucket-ckptrepo/run"
    run("remote", "add", "origin", url, repo=a)
    for args in (["push"], ["fetch"]):
        _one_line_error(run(*args, repo=a), f"remote 'origin' ({url}): the bucket does not exist",
                        "create it, or fix the URL", "ckptrepo remote remove origin")
    _one_line_error(run("clone", url, str(tmp_path / "c")), "the bucket does not exist", "check the URL")
    assert not os.path.exists(tmp_path / "c") and len(ckptrepo.open(a).log()) == 1
