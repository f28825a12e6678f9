"""Commits on object stores: the store check, and writes whose reply was lost.

A commit is a conditional PUT, as atomic as the server makes it. The store check refuses a server that
ignores the conditions (moto behind a proxy that strips them, as some gateways do) before anything is
written, and records a pass in the config so that later processes skip the probe. A write whose reply is
lost (the proxy forwards it, then drops the connection, and TensorStore retries) must not turn a success
into a conflict, nor a conflict into a success.
"""
from __future__ import annotations

import itertools
import json
import threading
from typing import Any, Callable

import pytest
import torch
from support.helpers import run
from support.s3proxy import Request, S3Proxy

import ckptrepo
from ckptrepo.core._manifest import CONFIG_KEY, update_config
from ckptrepo.core._plumbing import STORE_CHECK_FIELD
from ckptrepo.errors import CkptRepoError, ConflictError, SnapshotFailedError, StorageError
from ckptrepo.storage import open_store
from ckptrepo.storage._store_check import (
    CREATE_ONLY,
    RACING_CREATES,
    SCRATCH_PREFIX,
    STALE_SWAP,
    probe_conditional_writes,
    store_identity,
)

SMALL = 1 << 20


def _state(x: float) -> dict[str, Any]:
    return {"w": torch.full((4,), float(x))}


def _config(url: str) -> dict[str, Any]:
    raw = open_store(url).get(CONFIG_KEY)
    assert raw is not None
    return json.loads(raw)


def _probes(proxy: S3Proxy) -> int:
    """How many probes went through the proxy (each under a scratch key of its own, and its races under
    keys of theirs)."""
    return len({p for _, p in proxy.requests if SCRATCH_PREFIX in p and f"{SCRATCH_PREFIX}race-" not in p})


# ---- the store check ---------------------------------------------------------------------------------------

def _race_for_real(proxy: S3Proxy) -> None:
    """Hold each racing create's PUT until the other's has arrived, so both HEAD checks come first: a loaded
    machine may otherwise run one racer to the end before the other starts, and the round is no race."""
    both_sent = threading.Barrier(2, timeout=20)

    def line_up(req: Request) -> None:
        if req.method == "PUT" and f"{SCRATCH_PREFIX}race-" in req.path:
            both_sent.wait()
    proxy.before_forward = line_up


def test_the_probe_names_each_condition_a_server_ignores(s3_proxy, s3_url) -> None:
    store = open_store(s3_url)
    s3_proxy.mode = "strip"
    assert probe_conditional_writes(store) == [CREATE_ONLY, STALE_SWAP]
    # conditions honoured on HEAD, TensorStore's check before its PUT, and ignored on the PUT: writes made
    # one at a time cannot tell, racing ones can
    s3_proxy.mode = "strip-writes"
    _race_for_real(s3_proxy)
    assert probe_conditional_writes(store) == [RACING_CREATES]
    s3_proxy.before_forward = None
    s3_proxy.mode = "atomic"
    assert probe_conditional_writes(store) == []
    assert store.list(SCRATCH_PREFIX) == []   # its scratch keys are gone either way


def test_a_server_that_ignores_conditions_only_on_writes_is_refused(strip_s3_url, s3_proxy) -> None:
    repo = ckptrepo.init(strip_s3_url)
    s3_proxy.mode = "strip-writes"
    _race_for_real(s3_proxy)
    with pytest.raises(StorageError, match="racing create-only writes"):
        repo.snapshot(_state(0), step=0)
    assert repo.log() == [] and STORE_CHECK_FIELD not in _config(strip_s3_url)


def test_a_server_that_ignores_conditions_is_refused_before_anything_is_written(s3_endpoint, s3_proxy, s3_url,
                                                                                monkeypatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)   # a version written through moto, which honours them
    repo = ckptrepo.init(s3_url)
    first = repo.snapshot(_state(0), step=0)
    repo.branch("x")
    repo.tag("keep")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_proxy.endpoint)   # the same bucket through a gateway that does not
    s3_proxy.mode = "strip"
    repo = ckptrepo.open(s3_url)
    before = sorted(open_store(s3_url).list())
    attempts: list[Callable[[], Any]] = [
        lambda: repo.snapshot(_state(1), step=1), lambda: repo.snapshotter(host_memory=SMALL),
        lambda: repo.tag("t", first.id), lambda: repo.branch("b", first.id),
        lambda: repo.checkout(first.id, branch="c"), lambda: repo.checkout(first.id), lambda: repo.checkout("x"),
        lambda: repo.checkout_orphan("o"), lambda: repo.delete_branch("x", force=True),
        lambda: repo.delete_tag("keep")]
    for attempt in attempts:
        with pytest.raises(StorageError) as err:
            attempt()
        msg = str(err.value)
        assert "\n" not in msg and s3_url in msg and "does not honour conditional writes" in msg, msg
        assert CREATE_ONLY in msg and STALE_SWAP in msg and "AWS S3" in msg and "local repository" in msg, msg
    assert _probes(s3_proxy) == 1   # one per handle: it remembers the refusal
    assert sorted(open_store(s3_url).list()) == before   # nothing written, the probe's scratch key removed
    assert [v.id for v in ckptrepo.open(s3_url).log()] == [first.id]
    # a refusal is not recorded: what is recorded is moto's pass, which says nothing of the gateway
    assert _config(s3_url)[STORE_CHECK_FIELD]["server"] == f"s3 {s3_endpoint}"
    cli = run("tag", "t2", first.id, repo=s3_url)
    assert cli.returncode != 0 and "does not honour conditional writes" in cli.stderr
    assert ckptrepo.open(s3_url).tags() == {"keep": first.id}


@pytest.mark.parametrize("server", ["atomic proxy", "moto"])
def test_a_server_that_honours_conditions_is_probed_once_and_the_pass_recorded(server, s3_endpoint, s3_proxy,
                                                                               s3_url, monkeypatch) -> None:
    if server == "moto":
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    repo = ckptrepo.init(s3_url)
    assert STORE_CHECK_FIELD not in _config(s3_url)   # reading and init do not probe
    repo.snapshot(_state(0), step=0)
    verdict = _config(s3_url)[STORE_CHECK_FIELD]
    assert verdict["conditional_writes"] == "ok"
    assert verdict["server"] == store_identity(open_store(s3_url))
    assert isinstance(verdict["checked"], float)
    checked = verdict["checked"]
    repo.snapshot(_state(1), step=1)
    other = ckptrepo.open(s3_url)   # another process would read the same config
    other.snapshot(_state(2), step=2)
    other.tag("t")
    assert _config(s3_url)[STORE_CHECK_FIELD]["checked"] == checked
    if server == "atomic proxy":
        assert _probes(s3_proxy) == 1
    assert open_store(s3_url).list(SCRATCH_PREFIX) == []


def test_stores_whose_conditional_writes_are_atomic_are_not_probed(tmp_path) -> None:
    for url in (str(tmp_path / "repo"), "memory://store-check"):
        repo = ckptrepo.init(url)
        repo.snapshot(_state(0), step=0)
        repo.tag("t")
        assert STORE_CHECK_FIELD not in _config(url)


# ---- lost replies --------------------------------------------------------------------------------------------

def _lose_first_ref_write(proxy: S3Proxy, ref: str = "refs/heads/main") -> None:
    """Lose the reply of the next conditional PUT of ``ref`` (that one only)."""
    seen = itertools.count()

    def pick(req: Request) -> bool:
        return req.method == "PUT" and req.conditional and req.path.endswith("/" + ref) and next(seen) == 0

    proxy.lose_reply = pick


def _commit(snap: Any, x: float) -> Any:
    """The version a snapshotter's snapshot committed, or the error that says why it did not (raised by
    ``snapshot`` itself once the snapshotter knows the branch moved under it)."""
    try:
        return snap.snapshot(_state(x), step=int(x)).result()
    except SnapshotFailedError as err:
        return err.__cause__ or err
    except ConflictError as err:
        return err


def _close(*snaps: Any) -> None:
    for snap in snaps:
        try:
            snap.close()
        except CkptRepoError:   # the failures each test looked at already
            pass


@pytest.fixture
def two_writers(atomic_s3_url) -> tuple[str, str, Any, Any]:
    """A repository with one version, and two snapshotters (two handles) that both start from it."""
    base = ckptrepo.init(atomic_s3_url).snapshot(_state(0), step=0).id
    a = ckptrepo.open(atomic_s3_url).snapshotter(host_memory=SMALL, dedup=False)
    b = ckptrepo.open(atomic_s3_url).snapshotter(host_memory=SMALL, dedup=False)
    yield atomic_s3_url, base, a, b
    _close(a, b)


def test_a_winner_whose_reply_is_lost_commits_and_the_loser_conflicts(two_writers, s3_proxy) -> None:
    url, base, a, b = two_writers
    _lose_first_ref_write(s3_proxy)
    won = _commit(a, 1)
    assert len(s3_proxy.lost) == 1, "the reply was not lost"
    assert not isinstance(won, Exception), won
    lost = _commit(b, 2)
    assert isinstance(lost, ConflictError), lost
    repo = ckptrepo.open(url)
    assert [v.id for v in repo.log()] == [won.id, base]
    assert repo.fsck().ok


def test_a_winner_whose_reply_is_lost_and_built_upon_before_its_retry_still_commits(two_writers, s3_proxy) -> None:
    url, base, a, _ = two_writers
    on_top: list[str] = []

    def commit_on_top(_req: Request) -> None:   # before the retry: a third writer commits on top of a's version
        on_top.append(ckptrepo.open(url).snapshot(_state(9), step=9).id)

    s3_proxy.on_lost = commit_on_top
    _lose_first_ref_write(s3_proxy)
    won = _commit(a, 1)
    assert len(s3_proxy.lost) == 1 and len(on_top) == 1
    assert not isinstance(won, Exception), won
    repo = ckptrepo.open(url)
    assert [v.id for v in repo.log()] == [on_top[0], won.id, base]   # nothing lost
    # the branch moved on from a's version: a does not move it again from its stale generation
    later = _commit(a, 2)
    assert isinstance(later, ConflictError) and "moved on past" in str(later), later
    assert [v.id for v in ckptrepo.open(url).log()] == [on_top[0], won.id, base]
    assert repo.fsck().ok


def test_a_loser_whose_reply_is_lost_still_conflicts(two_writers, s3_proxy) -> None:
    """TensorStore checks the condition with a HEAD before its conditional PUT, so a loser's PUT reaches the
    server only when the winner's lands in between: here the winner commits while the loser's PUT waits."""
    url, base, a, b = two_writers
    won: list[Any] = []
    fired = itertools.count()

    def a_commits_first(req: Request) -> None:
        if req.method == "PUT" and req.conditional and req.path.endswith("/refs/heads/main") and next(fired) == 0:
            won.append(_commit(a, 1))

    s3_proxy.before_forward = a_commits_first
    _lose_first_ref_write(s3_proxy)
    lost = _commit(b, 2)
    assert len(won) == 1 and not isinstance(won[0], Exception), won
    assert len(s3_proxy.lost) == 1, "the reply was not lost"
    assert isinstance(lost, ConflictError), lost
    won = won[0]
    repo = ckptrepo.open(url)
    assert [v.id for v in repo.log()] == [won.id, base]
    assert repo.fsck().ok


def test_a_tag_whose_reply_is_lost_is_created(atomic_s3_url, s3_proxy) -> None:
    repo = ckptrepo.init(atomic_s3_url)
    v = repo.snapshot(_state(0), step=0)
    _lose_first_ref_write(s3_proxy, "refs/tags/t")
    repo.tag("t")
    assert len(s3_proxy.lost) == 1
    assert ckptrepo.open(atomic_s3_url).tags() == {"t": v.id}


def test_a_recorded_pass_is_kept_by_later_config_changes(atomic_s3_url) -> None:
    ckptrepo.init(atomic_s3_url).snapshot(_state(0), step=0)
    update_config(open_store(atomic_s3_url), {"other": 1})
    cfg = _config(atomic_s3_url)
    assert cfg["other"] == 1 and cfg[STORE_CHECK_FIELD]["conditional_writes"] == "ok"


def test_every_rank_checking_a_fresh_store_at_once_all_pass(atomic_s3_url) -> None:
    """Each rank of a job makes a committer, so each probes a fresh repository at the same moment; each records
    its pass with a time of its own, and a pass another rank recorded first must count, not read as a conflict."""
    import threading

    from ckptrepo.core._plumbing import Plumbing

    ckptrepo.init(atomic_s3_url)
    ranks = [Plumbing(open_store(atomic_s3_url)) for _ in range(16)]
    lined_up = threading.Barrier(len(ranks))
    errors: list[BaseException] = []

    def check(p: Plumbing) -> None:
        lined_up.wait()
        try:
            p.require_atomic_store()
        except BaseException as err:  # noqa: BLE001 - what the test counts
            errors.append(err)

    threads = [threading.Thread(target=check, args=(p,)) for p in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert _config(atomic_s3_url)[STORE_CHECK_FIELD]["conditional_writes"] == "ok"
    assert open_store(atomic_s3_url).list("store-check/") == []
