"""A local tier whose remote does not hold what its tracking ref says (issue 39).

Two ways the data of versions evicted here can end up nowhere: the remote is this repository itself under
another name (a push finds it "up to date", eviction then deletes the only copy), or the remote's own gc
pruned versions after they were evicted here. The remote is refused in every spelling, at ``remote add``,
when a snapshotter starts, at each push and right before eviction deletes; eviction deletes only what the
remote is seen to hold; and ``log``, ``show``, ``load`` and ``fsck`` say when a version's data is gone.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from support.ckpt_workers import make_state
from support.helpers import assert_bit_exact, run

import ckptrepo
from ckptrepo.core._manifest import update_config
from ckptrepo.core._remotes import evicted_ids
from ckptrepo.errors import RemoteError, RevisionError

SPELLINGS = ["path", "symlink", "file_url", "trailing_slash", "relative", "subdirectory"]
STEPS = 6


def spell(local: Path, how: str) -> str:
    """Repository ``local`` as a remote URL, spelt ``how``."""
    if how == "symlink":
        link = local.parent / "link-to-local"
        link.symlink_to(local)
        return str(link)
    return {"path": str(local), "file_url": f"file://{local}", "trailing_slash": f"{local}/",
            "relative": os.path.relpath(local), "subdirectory": str(local / "backup")}[how]


def _data_dirs(repo: ckptrepo.Repository) -> set[str]:
    return {k.split("/")[1] for k in repo.plumbing.store.list("data/")}


def _all_load(repo: ckptrepo.Repository) -> None:
    log = repo.log()
    assert len(log) == STEPS
    for v in log:
        assert_bit_exact(repo.load(v.id), make_state(v.step, big=False))


@pytest.mark.parametrize("how", SPELLINGS)
def test_remote_add_refuses_the_repository_itself(tmp_path, how):
    local = tmp_path / "local"
    repo = ckptrepo.init(str(local))
    url = spell(local, how)
    with pytest.raises(RemoteError, match="cannot be its own remote") as err:
        repo.remote_add("origin", url)
    assert "\n" not in str(err.value)
    r = run("remote", "add", "origin", url, repo=str(local))
    assert r.returncode != 0 and "cannot be its own remote" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert repo.remotes() == {}


@pytest.mark.parametrize("how", SPELLINGS)
def test_a_config_edited_to_name_itself_loses_no_version(tmp_path, how):
    """The issue's run: a snapshotter with push_to and local_keep_last=2, six snapshots. The remote is written
    into ckptrepo.json by hand (past remote add): the snapshotter refuses to start, and so does each push, so
    every version keeps its data."""
    local = tmp_path / "local"
    repo = ckptrepo.init(str(local))
    update_config(repo.plumbing.store, {"remotes": {"origin": {"url": spell(local, how)}}})
    with pytest.raises(RemoteError, match="cannot be its own remote"):
        repo.snapshotter(push_to="origin", local_keep_last=2)
    for step in range(STEPS):
        repo.snapshot(make_state(step, big=False), step=step)
    with pytest.raises(RemoteError, match="cannot be its own remote"):
        repo.push("origin")
    with pytest.raises(RemoteError, match="cannot be its own remote"):
        repo.fetch("origin")
    assert not evicted_ids(repo.plumbing.store) and len(_data_dirs(repo)) == STEPS
    _all_load(repo)
    assert repo.fsck().ok


@pytest.mark.parametrize("how", ["symlink", "config"])
def test_a_remote_that_becomes_the_repository_later_loses_nothing(tmp_path, how):
    """Added as a symlink to another directory, which is then pointed at the repository itself while the
    snapshotter runs (or its URL edited by hand in ckptrepo.json): each push from then on fails, and eviction
    by hand refuses before deleting."""
    local, elsewhere, link = tmp_path / "local", tmp_path / "remote", tmp_path / "link"
    repo = ckptrepo.init(str(local))
    elsewhere.mkdir()
    link.symlink_to(elsewhere)
    repo.remote_add("origin", str(link))
    snap = repo.snapshotter(push_to="origin", local_keep_last=2)
    for step in range(2):
        snap.snapshot(make_state(step, big=False), step=step)
        snap.wait()
    if how == "symlink":
        link.unlink()
        link.symlink_to(local)
    else:
        update_config(repo.plumbing.store, {"remotes": {"origin": {"url": f"file://{local}"}}})
    for step in range(2, STEPS):
        snap.snapshot(make_state(step, big=False), step=step)
        with pytest.raises(RemoteError, match="cannot be its own remote"):
            snap.wait()
    with pytest.raises(RemoteError):
        snap.close()
    with pytest.raises(RemoteError, match="cannot be its own remote"):
        repo.evict("origin", keep_last=1)
    assert not evicted_ids(repo.plumbing.store) and len(_data_dirs(repo)) == STEPS
    _all_load(repo)
    assert repo.fsck().ok


def test_eviction_keeps_what_the_remote_lacks(tmp_path):
    """The tracking ref says the remote holds steps 0 to 3; by hand, one array object of step 0 and the whole
    of step 1 are deleted there since. Eviction keeps those here: every version still loads."""
    repo = ckptrepo.init(str(tmp_path / "local"))
    repo.remote_add("origin", str(tmp_path / "remote"))
    for step in range(4):
        repo.snapshot(make_state(step, big=False), step=step)
    repo.push("origin")
    log = repo.log()
    there = ckptrepo.open(str(tmp_path / "remote")).plumbing.store
    shard = next(k for k in there.list(f"data/{log[3].id}/") if not k.endswith("zarr.json"))
    there.delete(shard)
    there.delete(f"versions/{log[2].id}")
    there.delete_prefix(f"data/{log[2].id}/")
    report = repo.evict("origin", keep_last=1)
    assert report.kept == [shard.rsplit("/", 2)[0]] or report.kept == [shard.rsplit("/", 3)[0]], report.kept
    assert repo.plumbing.store.exists(shard) and shard.startswith(report.kept[0] + "/")
    assert sorted(report.evicted) == sorted([log[3].id, log[1].id])   # step 1 is not there: not evicted
    assert _data_dirs(repo) == {log[0].id, log[2].id, log[3].id}
    for v in log:
        assert_bit_exact(repo.load(v.id), make_state(v.step, big=False))


def test_versions_the_remote_pruned_read_as_gone_everywhere(tmp_path):
    """Six snapshots, the newest two kept here; the remote's own gc keeps the newest three. Steps 0 to 2 are
    then nowhere: log and show say so, a load says so in one line, fsck fails naming each; once pruned here by
    hand, fsck passes."""
    repo = ckptrepo.init(str(tmp_path / "local"))
    repo.remote_add("origin", str(tmp_path / "remote"))
    with repo.snapshotter(push_to="origin", local_keep_last=2) as snap:
        for step in range(STEPS):
            snap.snapshot(make_state(step, big=False), step=step)
    ckptrepo.open(str(tmp_path / "remote")).gc(keep_last=3, grace_period_s=0)
    log = repo.log()
    assert [(v.step, v.local, v.remotes, v.pruned) for v in log] == [
        (5, True, ("origin",), False), (4, True, ("origin",), False), (3, False, ("origin",), False),
        (2, False, (), True), (1, False, (), True), (0, False, (), True)]
    out = run("log", "--oneline", repo=repo.url).stdout.splitlines()
    assert [re.search(r"\[[^]]*\]", line).group() for line in out] == \
        ["[local origin]", "[local origin]", "[origin]", "[-]", "[-]", "[-]"]
    assert "durable -" in run("show", "@1", repo=repo.url).stdout
    assert repo.version("@1").pruned and not repo.version("@3").pruned
    for v in log[:3]:
        assert_bit_exact(repo.load(v.id), make_state(v.step, big=False))
    for v in log[3:]:
        with pytest.raises(RevisionError, match=r"has its data nowhere: .* remote 'origin' pruned it") as err:
            repo.load(v.id)
        assert "\n" not in str(err.value)
    report = repo.fsck()
    assert not report.ok
    gone = [e for e in report.errors if "its data exists nowhere" in e and "pruned it" in e]
    assert sorted(e.split()[1] for e in gone) == sorted(v.short_id for v in log[3:]), report.errors
    r = run("fsck", repo=repo.url)
    assert r.returncode == 1 and "exists nowhere" in r.stdout + r.stderr
    for v in log[3:]:   # what fsck says to do when no other copy exists
        repo.prune(v.id)
    assert repo.fsck().ok


def test_fsck_names_a_version_the_remote_lost_and_warns_when_it_cannot_look(tmp_path, s3_url, monkeypatch):
    repo = ckptrepo.init(str(tmp_path / "local"))
    repo.remote_add("origin", s3_url)
    for step in range(3):
        repo.snapshot(make_state(step, big=False), step=step)
    repo.push("origin")
    repo.evict("origin", keep_last=1)
    oldest = repo.log()[-1]
    assert repo.fsck().ok
    there = ckptrepo.open(s3_url).plumbing.store
    there.delete(f"versions/{oldest.id}")   # lost there by hand: its data is nowhere
    report = repo.fsck()
    assert any(f"version {oldest.short_id}" in e and "does not hold it" in e for e in report.errors), report.errors
    # the endpoint gone: a warning that says the evicted versions went unchecked, not an error
    with socket_closed() as port:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("CKPTREPO_STORE_RETRIES", "1")
        report = ckptrepo.open(repo.url).fsck()
    assert report.ok, report.errors
    assert any("could not be reached" in w and "not checked" in w for w in report.warnings), report.warnings


class socket_closed:
    """A port on 127.0.0.1 nothing listens on."""

    def __enter__(self) -> int:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        pass


def test_a_remote_directory_that_is_gone_is_an_error_naming_its_url(tmp_path):
    repo = ckptrepo.init(str(tmp_path / "local"))
    repo.remote_add("origin", str(tmp_path / "remote"))
    for step in range(3):
        repo.snapshot(make_state(step, big=False), step=step)
    repo.push("origin")
    repo.evict("origin", keep_last=1)
    shutil.rmtree(tmp_path / "remote")
    report = repo.fsck()
    assert sum("holds no repository" in e for e in report.errors) == 2, report.errors


def test_an_s3_remote_at_the_repository_itself_is_refused(s3_url, s3_endpoint, s3_proxy):
    """The same bucket and prefix, spelt with a trailing slash, is refused at remote add and, written by hand,
    at push; reached through another endpoint (a proxy in front of the same server), only the probe sees it."""
    from ckptrepo.core._same_store import probe_same_store
    from ckptrepo.storage import open_store
    repo = ckptrepo.init(s3_url)
    repo.snapshot(make_state(0, big=False), step=0)
    with pytest.raises(RemoteError, match="cannot be its own remote"):
        repo.remote_add("origin", s3_url + "/")
    update_config(repo.plumbing.store, {"remotes": {"origin": {"url": s3_url}}})
    with pytest.raises(RemoteError, match="cannot be its own remote"):
        repo.push("origin")
    direct = open_store(s3_url, {"endpoint": s3_endpoint})
    assert probe_same_store(direct, open_store(s3_url))   # through the proxy (AWS_ENDPOINT_URL)
    assert not probe_same_store(direct, open_store(s3_url + "-other"))
    assert direct.list("pushes/") == []
    assert_bit_exact(repo.load("HEAD"), make_state(0, big=False))
