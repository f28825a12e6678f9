"""Racing writers on S3: exactly one commit wins each round, and no committed version is lost.

moto's conditional PUT checks and then writes without a lock, so racing writers can both win on moto
alone; AWS S3 promises that they cannot. The races run against moto behind the proxy that serialises
writes per key (tests/support/s3proxy.py, ``"atomic"``), which is what AWS promises. Writers are threads, each with
a handle of its own, lined up by a barrier in the ``after_manifest`` fault hook so that every round's
compare-and-swaps go out together; the same repository and threads serve every round. Against the proxy
that strips the conditions (with the store check's verdict planted), the same race loses versions: the
tests can fail.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch

import ckptrepo
from ckptrepo import faults
from ckptrepo.core._manifest import VERSIONS_PREFIX, update_config
from ckptrepo.core._plumbing import STORE_CHECK_FIELD
from ckptrepo.errors import ConflictError, RefError
from ckptrepo.storage import open_store
from ckptrepo.storage._store_check import store_identity

pytestmark = pytest.mark.slow

ROUNDS = 50
BARRIER_TIMEOUT = 60.0
SMALL = 1 << 20


def _state(x: int) -> dict[str, Any]:
    return {"w": torch.full((4,), float(x))}


@dataclass
class Race:
    """What a race came to: per round, each racer's committed version id (None: refused)."""

    outcomes: list[list[str | None]]
    elapsed: float
    errors: list[BaseException] = field(default_factory=list)

    def winners(self) -> list[int]:
        return [sum(v is not None for v in row) for row in self.outcomes]

    def committed(self) -> set[str]:
        return {v for row in self.outcomes for v in row if v is not None}


def _race(racers: int, rounds: int, attempt: Callable[[int, int], str | None],
          line_up: threading.Barrier) -> Race:
    """``racers`` threads; each round every one waits at ``line_up`` and then calls ``attempt(round, racer)``
    (which may wait at ``line_up`` again, as the fault hook does)."""
    outcomes: list[list[str | None]] = [[None] * racers for _ in range(rounds)]
    errors: list[BaseException] = []

    def racer(i: int) -> None:
        try:
            for r in range(rounds):
                line_up.wait()   # every racer starts the round from what the last one left
                outcomes[r][i] = attempt(r, i)
        except BaseException as err:  # noqa: BLE001 - reported by the caller's assertion
            errors.append(err)
            line_up.abort()

    t0 = time.monotonic()
    threads = [threading.Thread(target=racer, args=(i,), name=f"racer-{i}") for i in range(racers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return Race(outcomes, time.monotonic() - t0, errors)


def _branch_race(url: str, writers: int, rounds: int) -> tuple[Race, list[str]]:
    """``writers`` handles snapshot on main, ``rounds`` times, compare-and-swaps lined up; the race and the
    branch's history afterwards (newest first)."""
    ckptrepo.open(url).snapshot(_state(-1), step=0)
    handles = [ckptrepo.open(url) for _ in range(writers)]
    for h in handles:
        h.host_memory = SMALL
    line_up = threading.Barrier(writers, timeout=BARRIER_TIMEOUT)

    def attempt(r: int, i: int) -> str | None:
        try:
            return handles[i].snapshot(_state(r * writers + i), step=r + 1, message=f"writer {i}").id
        except ConflictError:
            return None

    faults.set_hook("after_manifest", lambda _name: line_up.wait())
    try:
        race = _race(writers, rounds, attempt, line_up)
    finally:
        faults.set_hook("after_manifest", None)
    assert race.errors == [], race.errors
    return race, [v.id for v in ckptrepo.open(url).log()]


def _refs_to_missing_versions(url: str) -> list[str]:
    repo, store = ckptrepo.open(url), open_store(url)
    targets = {**repo.branches(), **{f"tag {t}": v for t, v in repo.tags().items()}}
    return [name for name, vid in targets.items() if not store.exists(VERSIONS_PREFIX + vid)]


def _report(what: str, race: Race, lost: str, proxy: Any, ref: str) -> None:
    """The race's figures, shown with ``pytest -s``."""
    puts = sum(n for path, n in proxy.conditional_puts.items() if ref in path)
    print(f"\n{what}: {len(race.outcomes)} rounds, winners per round {sorted(set(race.winners()))}, {lost}, "
          f"{puts / len(race.outcomes):.1f} conditional PUTs of {ref} per round reached the server, "
          f"{race.elapsed:.1f} s")


@pytest.mark.parametrize("writers", [2, 4])
def test_racing_writers_on_one_branch_have_one_winner_and_lose_nothing(writers, atomic_s3_url, s3_proxy) -> None:
    ckptrepo.init(atomic_s3_url)
    race, history = _branch_race(atomic_s3_url, writers, ROUNDS)
    lost = race.committed() - set(history)
    _report(f"{writers} writers on one branch", race, f"{len(lost)} committed version(s) lost", s3_proxy,
            "refs/heads/main")
    assert race.winners() == [1] * ROUNDS
    assert lost == set()
    assert len(history) == ROUNDS + 1   # each round's winner, on top of the last
    assert _refs_to_missing_versions(atomic_s3_url) == []
    assert ckptrepo.open(atomic_s3_url).fsck().ok


def test_against_a_server_that_ignores_conditions_the_same_race_loses_versions(strip_s3_url, s3_proxy) -> None:
    """The store check refuses such a server; planted, its verdict lets the race run, and the race tells."""
    ckptrepo.init(strip_s3_url)
    store = open_store(strip_s3_url)
    update_config(store, {STORE_CHECK_FIELD: {"conditional_writes": "ok", "server": store_identity(store),
                                              "checked": time.time()}})
    rounds = 10
    race, history = _branch_race(strip_s3_url, 2, rounds)
    lost = race.committed() - set(history)
    _report("2 writers, conditions ignored", race, f"{len(lost)} committed version(s) lost", s3_proxy,
            "refs/heads/main")
    assert max(race.winners()) == 2
    assert lost


def test_racing_creators_of_one_tag_have_one_winner(atomic_s3_url, s3_proxy) -> None:
    creators = 4
    repo = ckptrepo.init(atomic_s3_url)
    repo.host_memory = SMALL
    targets = [repo.snapshot(_state(i), step=i).id for i in range(creators)]
    handles = [ckptrepo.open(atomic_s3_url) for _ in range(creators)]
    line_up = threading.Barrier(creators, timeout=BARRIER_TIMEOUT)

    def attempt(r: int, i: int) -> str | None:
        try:   # the refs' own create, as `tag` makes it (without resolving a revision or listing every tag after)
            handles[i].plumbing.refs.create_tag(f"race-{r}", targets[i])
            return targets[i]
        except RefError:
            return None

    race = _race(creators, ROUNDS, attempt, line_up)
    assert race.errors == [], race.errors
    tags = ckptrepo.open(atomic_s3_url).tags()
    wrong = [r for r, row in enumerate(race.outcomes) if tags.get(f"race-{r}") not in row]
    _report(f"{creators} tag creators", race, f"{len(wrong)} tag(s) not at their winner's version", s3_proxy,
            "refs/tags/")
    assert race.winners() == [1] * ROUNDS
    assert wrong == []   # each tag points at its one winner's version
    assert _refs_to_missing_versions(atomic_s3_url) == []
    assert ckptrepo.open(atomic_s3_url).fsck().ok
