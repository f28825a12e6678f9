"""A property-based state machine over the Repository's version-control operations, against a small model.

Hypothesis drives random sequences of snapshot, branch, tag, checkout (onto a branch, detached, ``-b``),
delete_branch (``-d`` and ``-D``), delete_tag, gc (with and without ``keep_last``, grace 0), fsck and load on
a fresh ``memory://`` repository, and mirrors each in a model that only knows which version every branch, tag
and HEAD points at, each version's parent, step and contents, and which versions gc pruned or collected.

Revisions are typed in every form a user may use (id, prefix, upper case, branch, tag, ``HEAD~N``, ``@STEP``,
``branch~N``, stray spaces), each chosen so that the model knows the version it must name.

After every step the repository must agree with the model: the branches, tags and HEAD; ``log`` of every
branch is the model's first-parent chain; every ref, ``HEAD~N`` and ``@STEP`` resolves to the model's
version; every reachable version that gc did not prune loads bit-exact, a pruned one refuses to load and a
collected one is gone; ``fsck`` finds no error. ``CKPTREPO_STATEFUL_SCALE=N`` runs N times the examples.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from support.helpers import assert_bit_exact

import ckptrepo
from ckptrepo import DetachedHeadError, RefError, RetentionError, RevisionError

BRANCH_NAMES = ("main", "b1", "b2", "feature/x", "t1")   # "t1" also a tag name: the clash must be refused
TAG_NAMES = ("t1", "t2", "v1.0", "b1")
STEPS = st.integers(0, 4)                              # few values: @STEP must pick the newest of repeats
SCALE = int(os.environ.get("CKPTREPO_STATEFUL_SCALE", "1"))


@dataclass
class MVersion:
    parent: str | None
    step: int
    state: dict[str, object]
    loss: float


@dataclass
class Model:
    """What the repository must hold: refs, versions (with parents and contents), gc's pruned and collected."""

    versions: dict[str, MVersion] = field(default_factory=dict)   # every version ever committed
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    head_branch: str | None = "main"
    detached: str | None = None
    pruned: set[str] = field(default_factory=set)
    collected: set[str] = field(default_factory=set)

    def head(self) -> str | None:
        return self.branches.get(self.head_branch) if self.head_branch else self.detached

    def chain(self, vid: str | None) -> list[str]:
        """The first-parent chain from ``vid``, newest first."""
        out = []
        while vid is not None:
            out.append(vid)
            vid = self.versions[vid].parent
        return out

    def ref_targets(self) -> list[str]:
        return list(self.branches.values()) + list(self.tags.values()) + ([self.detached] if self.detached else [])

    def reachable(self) -> set[str]:
        return {v for t in self.ref_targets() for v in self.chain(t)}

    def existing(self) -> list[str]:
        """The versions not collected, oldest first (creation order: ids are random, so sorting them would make
        Hypothesis's draws depend on chance)."""
        return [v for v in self.versions if v not in self.collected]

    def at_step(self, step: int) -> str | None:
        """What ``@STEP`` names: the newest version with ``step`` on HEAD's first-parent chain that gc did not
        prune, else the newest with it."""
        matches = [v for v in self.chain(self.head()) if self.versions[v].step == step]
        return next((v for v in matches if v not in self.pruned), matches[0] if matches else None)

    def names_for(self, vid: str) -> list[str]:
        """Revision strings that must resolve to ``vid``, in many forms."""
        forms = [vid, vid[:10], vid[:6].upper(), f" {vid} "]
        forms += [b for b, t in self.branches.items() if t == vid]
        forms += [t for t, v in self.tags.items() if v == vid]
        head = self.head()
        if head is not None:
            chain = self.chain(head)
            if vid in chain:
                n = chain.index(vid)
                forms += [f"HEAD~{n}", "HEAD" if n == 0 else f"HEAD{'~' * n}"]
                if self.at_step(self.versions[vid].step) == vid:
                    forms += [f"@{self.versions[vid].step}", f" @{self.versions[vid].step}~0 "]
        for b, tip in self.branches.items():
            chain = self.chain(tip)
            if vid in chain:
                forms.append(f"{b}~{chain.index(vid)}")
        return forms


def refused(call: Callable[[], object]) -> None:
    """Run ``call``, which must raise RefError (the name is taken), as git refuses an existing name."""
    with pytest.raises(RefError):
        call()


def loss_of(k: int) -> float:
    """A loss that goes up and down and is unique per snapshot (keep_best then has no ties to break by time)."""
    return (k * 7) % 11 + k / 1000


def make_state(k: int, step: int) -> dict[str, object]:
    """A tiny state whose bytes differ per snapshot: a float tensor, an int tensor and plain values."""
    return {"model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3) * (k + 1) - 0.5,
                      "b": torch.tensor([k, -k, step], dtype=torch.int64)},
            "step": step, "tag": f"snapshot {k}"}


class RepositoryMachine(RuleBasedStateMachine):
    """Random operation sequences on one repository, each checked against the model."""

    backend = "memory"

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="ckptrepo-sm-") if self.backend == "file" else None
        self.repo = ckptrepo.init(os.path.join(self.tmp, "repo") if self.tmp else f"memory://{uuid.uuid4().hex}")
        self.model = Model()
        self.counter = 0
        # versions loaded bit-exact since the last step that may delete data (gc, and the deletes, which must
        # not): a version's data cannot change otherwise, so they are not loaded again after every step
        self.verified: set[str] = set()
        self.wrote = True   # a step wrote to the repository: fsck it

    def teardown(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # ---- helpers --------------------------------------------------------------------
    def pick_version(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(self.model.existing()), label="version")

    def pick_rev(self, data: st.DataObject, vid: str) -> str:
        return data.draw(st.sampled_from(self.model.names_for(vid)), label="rev")

    def has_versions(self) -> bool:
        return bool(self.model.existing())

    # ---- rules ------------------------------------------------------------------------
    def attached(self) -> bool:
        return self.model.head_branch is not None

    @precondition(lambda self: not self.attached())
    @rule(step=STEPS)
    def snapshot_detached(self, step: int) -> None:
        """On a detached HEAD a snapshot is refused and commits nothing."""
        with pytest.raises(DetachedHeadError, match="create a branch"):
            self.repo.snapshot(make_state(-1, step), step=step)

    @precondition(attached)
    @rule(steps=st.lists(STEPS, min_size=1, max_size=3))
    def snapshot(self, steps: list[int]) -> None:
        """New versions on HEAD's branch, each the parent of the next (the first's parent is the branch tip, none
        on an empty branch). Up to three at once, so that histories grow long enough for ``keep_last`` to
        prune."""
        m = self.model
        self.wrote = True
        branch = m.head_branch
        assert branch is not None
        for step in steps:
            self.counter += 1
            state = make_state(self.counter, step)
            v = self.repo.snapshot(state, step=step, message=f"k={self.counter}",
                                   metrics={"loss": loss_of(self.counter)})
            parent = m.branches.get(branch)
            assert v.parents == ((parent,) if parent else ()) and v.step == step
            m.versions[v.id] = MVersion(parent, step, state, loss_of(self.counter))
            m.branches[branch] = v.id

    @precondition(has_versions)
    @rule(name=st.sampled_from(BRANCH_NAMES), data=st.data())
    def branch(self, name: str, data: st.DataObject) -> None:
        """A new branch at any revision; refused when the name is taken by a branch or a tag."""
        m = self.model
        self.wrote = True
        vid = self.pick_version(data)
        rev = self.pick_rev(data, vid)
        if name in m.branches or name in m.tags:
            refused(lambda: self.repo.branch(name, rev))
            return
        assert self.repo.branch(name, rev).id == vid
        m.branches[name] = vid

    @precondition(has_versions)
    @rule(name=st.sampled_from(TAG_NAMES), data=st.data())
    def tag(self, name: str, data: st.DataObject) -> None:
        """A new tag at any revision; refused when the name is taken (without force)."""
        m = self.model
        self.wrote = True
        vid = self.pick_version(data)
        rev = self.pick_rev(data, vid)
        if name in m.tags or name in m.branches:
            refused(lambda: self.repo.tag(name, rev))
            return
        assert self.repo.tag(name, rev).id == vid
        m.tags[name] = vid
        event("tag created")

    @precondition(has_versions)
    @rule(data=st.data())
    def checkout(self, data: st.DataObject) -> None:
        """Onto a branch when the revision is a branch name, a no-op for HEAD on a branch, else detached."""
        m = self.model
        self.wrote = True
        vid = self.pick_version(data)
        rev = self.pick_rev(data, vid)
        assert self.repo.checkout(rev).id == vid
        name = rev.strip()
        if name in m.branches:
            m.head_branch, m.detached = name, None
        elif name == "HEAD" and m.head_branch is not None:
            pass
        else:
            m.head_branch, m.detached = None, vid
        event("checkout attached" if m.head_branch else "checkout detached")

    @precondition(lambda self: bool(self.model.branches))
    @rule(data=st.data())
    def checkout_branch(self, data: st.DataObject) -> None:
        """``checkout NAME`` of an existing branch (often with stray spaces): HEAD attaches to it."""
        self.wrote = True
        name = data.draw(st.sampled_from(sorted(self.model.branches)), label="branch")
        rev = data.draw(st.sampled_from([name, f" {name}", f"{name} "]), label="rev")
        assert self.repo.checkout(rev).id == self.model.branches[name]
        self.model.head_branch, self.model.detached = name, None

    @precondition(has_versions)
    @rule(name=st.sampled_from(BRANCH_NAMES), data=st.data())
    def checkout_new_branch(self, name: str, data: st.DataObject) -> None:
        """``checkout REV -b NAME``: a new branch there, HEAD on it; nothing changes when the name is taken."""
        m = self.model
        self.wrote = True
        vid = self.pick_version(data)
        rev = self.pick_rev(data, vid)
        if name in m.branches or name in m.tags:
            refused(lambda: self.repo.checkout(rev, branch=name))
            return
        assert self.repo.checkout(rev, branch=name).id == vid
        m.branches[name] = vid
        m.head_branch, m.detached = name, None

    @precondition(lambda self: self.attached() and self.has_versions())
    @rule(name=st.sampled_from(("exp1", "exp2")), steps=st.lists(STEPS, min_size=1, max_size=2), data=st.data())
    def experiment(self, name: str, steps: list[int], data: st.DataObject) -> None:
        """A rollback experiment: ``checkout REV -b NAME``, snapshots there, then back onto the branch it left.
        Its versions are then reached by NAME alone, so deleting it (``-D``) and gc collect them."""
        m = self.model
        self.wrote = True
        back = m.head_branch
        assert back is not None
        vid = self.pick_version(data)
        if name in m.branches or name in m.tags:
            return
        self.repo.checkout(self.pick_rev(data, vid), branch=name)
        m.branches[name], m.head_branch = vid, name
        self.snapshot(steps)
        assert self.repo.checkout(back).id == m.branches[back]
        m.head_branch = back
        event("experiment")

    @rule(force=st.booleans(), data=st.data())
    def delete_branch(self, force: bool, data: st.DataObject) -> None:
        """Refused for the checked-out branch, a missing one, and (without force) one whose tip only it reaches."""
        m = self.model
        self.wrote = True
        self.verified.clear()
        name = data.draw(st.sampled_from(sorted(m.branches) + ["b2"]), label="branch")
        others = [t for b, t in m.branches.items() if b != name] + list(m.tags.values()) + \
            ([m.detached] if m.detached else [])
        guarded = name in m.branches and not any(m.branches[name] in m.chain(o) for o in others)
        if name == m.head_branch or name not in m.branches or (guarded and not force):
            with pytest.raises(RefError):
                self.repo.delete_branch(name, force=force)
            event("delete_branch refused")
            return
        event(f"delete_branch of a branch only it reaches (force={force})" if guarded else "delete_branch")
        assert self.repo.delete_branch(name, force=force) == m.branches.pop(name)

    @rule(data=st.data())
    def delete_tag(self, data: st.DataObject) -> None:
        """Deletes the tag and returns its version; a missing tag is a RefError."""
        m = self.model
        self.wrote = True
        self.verified.clear()
        name = data.draw(st.sampled_from(sorted(m.tags) + ["t2"]), label="tag")
        if name not in m.tags:
            with pytest.raises(RefError):
                self.repo.delete_tag(name)
            return
        assert self.repo.delete_tag(name) == m.tags.pop(name)
        event("tag deleted")

    @rule(keep_last=st.sampled_from([None, 1, 2]), keep_every=st.sampled_from([None, None, 2]),
          keep_best=st.sampled_from([None, None, 1, 2]))
    def gc(self, keep_last: int | None, keep_every: int | None, keep_best: int | None) -> None:
        """Grace 0: unreachable versions are collected. With a retention rule, reachable versions that are not
        among the newest keep_last of a branch's (or a detached HEAD's) first-parent line, whose step is not a
        multiple of keep_every, not among the keep_best lowest losses of the reachable versions that still have
        their data, and that are no branch head or tag, are pruned. A version pruned once stays pruned."""
        m = self.model
        self.wrote = True
        self.verified.clear()
        reachable = m.reachable()
        best = sorted(reachable - m.pruned, key=lambda v: m.versions[v].loss)[:keep_best or 0]
        if keep_best is not None and not best:   # every reachable version's data is gone: nothing to rank
            with pytest.raises(RetentionError, match="no version with data records metric 'loss'"):
                self.repo.gc(keep_best=keep_best, best_metric="loss", grace_period_s=0)
            return
        if keep_last is None and keep_every is None and keep_best is None:
            keep = set(reachable)
        else:
            keep = set(m.ref_targets())
            for tip in list(m.branches.values()) + ([m.detached] if m.detached else []):
                keep.update(m.chain(tip)[:keep_last or 0])
            keep.update(v for v in reachable if keep_every and m.versions[v].step % keep_every == 0)
            keep.update(best)
        newly_pruned = reachable - keep - m.pruned
        newly_collected = set(m.existing()) - reachable
        report = self.repo.gc(keep_last=keep_last, keep_every=keep_every, keep_best=keep_best,
                              best_metric="loss" if keep_best else None, grace_period_s=0)
        assert set(report.pruned) == newly_pruned
        assert set(report.collected) == newly_collected
        assert set(report.kept) == keep & reachable and not report.too_young
        event(f"gc pruned {min(len(newly_pruned), 2)}+, collected {min(len(newly_collected), 2)}+")
        m.pruned |= newly_pruned
        m.collected |= newly_collected
        m.pruned -= newly_collected

    @rule(data=st.data())
    def bad_revision(self, data: st.DataObject) -> None:
        """Revisions that name nothing (unknown names, too-short prefixes, past the root, a step not on HEAD's
        line, a collected id) are one-line RevisionErrors for load, checkout, ``checkout -b``, branch and tag,
        and change nothing (the invariants check the refs afterwards)."""
        m = self.model
        chain = m.chain(m.head())
        bad = ["nosuch", "abc", "@99", f"HEAD~{len(chain) + 1}" if chain else "HEAD~1"] + sorted(m.collected)[:1]
        rev = data.draw(st.sampled_from(bad), label="bad rev")
        call = data.draw(st.sampled_from([
            lambda: self.repo.load(rev), lambda: self.repo.checkout(rev), lambda: self.repo.checkout(rev, "nb"),
            lambda: self.repo.branch("nb", rev), lambda: self.repo.tag("nt", rev)]), label="call")
        with pytest.raises(RevisionError) as info:
            call()
        assert "\n" not in str(info.value)
        assert "nb" not in self.repo.branches() and "nt" not in self.repo.tags()

    @rule()
    def fsck(self) -> None:
        """fsck finds no error, and once gc has collected everything unreachable, no warning either."""
        report = self.repo.fsck()
        assert report.ok, report.errors
        if set(self.model.existing()) <= self.model.reachable():
            assert report.warnings == [], report.warnings
        assert report.versions == len(self.model.existing())

    @precondition(has_versions)
    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        """A version loads bit-exact through any revision form, unless gc pruned it: then one line says so."""
        vid = self.pick_version(data)
        rev = self.pick_rev(data, vid)
        if vid in self.model.pruned:
            with pytest.raises(RevisionError, match="was pruned by gc"):
                self.repo.load(rev)
            event("load of a pruned version refused")
        else:
            assert_bit_exact(self.repo.load(rev), self.model.versions[vid].state)
            event("load")

    # ---- invariants -------------------------------------------------------------------
    @invariant()
    def fsck_ok(self) -> None:
        """After every step that wrote to the repository, fsck finds no error."""
        if self.wrote:
            report = self.repo.fsck()
            assert report.ok, report.errors
            self.wrote = False

    @invariant()
    def refs_match(self) -> None:
        """Branches, tags and HEAD are the model's; each ref name resolves to its version."""
        m = self.model
        assert self.repo.branches() == m.branches
        assert self.repo.tags() == m.tags
        assert self.repo.current_branch() == m.head_branch
        assert self.repo.plumbing.head_version() == m.head()
        for name, vid in {**m.branches, **m.tags}.items():
            assert self.repo.resolve(name) == vid

    @invariant()
    def logs_are_first_parent_chains(self) -> None:
        """``log`` of each branch (and of HEAD) lists the model's first-parent chain, newest first, with the
        pruned flag of each version."""
        m = self.model
        for name, tip in m.branches.items():
            log = self.repo.log(name)
            assert [v.id for v in log] == m.chain(tip), name
            assert [v.pruned for v in log] == [v in m.pruned for v in m.chain(tip)], name
        chain = m.chain(m.head())
        assert [v.id for v in self.repo.log()] == chain
        assert [v.id for v in self.repo.log(limit=2)] == chain[:2]
        assert [v.id for v in self.repo.log(since=1, until=3)] == [v for v in chain if 1 <= m.versions[v].step <= 3]
        if chain:
            assert [row["version"] for row in self.repo.metrics()] == chain[::-1]
        assert {v.id for v in self.repo.log(all=True)} == m.reachable()

    @invariant()
    def versions_are_named_by_their_refs(self) -> None:
        """``log --all`` decorates each version with the refs at it, as git does: ``HEAD -> b`` for the
        checked-out branch, other branches by name, ``tag: t``, and ``HEAD`` for a detached HEAD."""
        m = self.model
        want: dict[str, set[str]] = {}
        for b, vid in m.branches.items():
            want.setdefault(vid, set()).add(f"HEAD -> {b}" if b == m.head_branch else b)
        for t, vid in m.tags.items():
            want.setdefault(vid, set()).add(f"tag: {t}")
        if m.detached:
            want.setdefault(m.detached, set()).add("HEAD")
        got = {v.id: set(v.refs) for v in self.repo.log(all=True) if v.refs}
        assert got == want
        if m.detached:
            assert self.repo.version("HEAD").refs[0] == "HEAD"

    @invariant()
    def head_relative_revisions(self) -> None:
        """``HEAD~N`` along the whole chain and ``@STEP`` for every step resolve as the model says; one past
        the root and a step not on the chain are RevisionErrors."""
        m = self.model
        chain = m.chain(m.head())
        for n, vid in enumerate(chain):
            assert self.repo.resolve(f"HEAD~{n}") == vid
        if chain:
            with pytest.raises(RevisionError, match="goes back"):
                self.repo.resolve(f"HEAD~{len(chain)}")
        for step in range(5):
            want = m.at_step(step)
            if want is None:
                with pytest.raises(RevisionError):
                    self.repo.resolve(f"@{step}")
            else:
                assert self.repo.resolve(f"@{step}") == want

    @invariant()
    def versions_load_or_are_gone(self) -> None:
        """Every reachable, unpruned version loads bit-exact (HEAD's after every step, the others once after each
        step that may delete data); a collected one no longer resolves; storage holds exactly the versions the
        model says exist."""
        m = self.model
        assert sorted(self.repo.plumbing.all_version_ids()) == sorted(m.existing())
        head = m.head()
        if head is not None and head not in m.pruned:
            assert_bit_exact(self.repo.load(), m.versions[head].state, "HEAD")
        for vid in sorted(m.reachable() - m.pruned - self.verified):
            assert_bit_exact(self.repo.load(vid), m.versions[vid].state, f"version {vid[:8]}")
            self.verified.add(vid)
        for vid in m.collected:
            with pytest.raises(RevisionError, match="unknown revision"):
                self.repo.resolve(vid)


class FileRepositoryMachine(RepositoryMachine):
    """The same on a local directory, where ``a/b`` refs are files in folders and deletes must tidy them up."""

    backend = "file"


HEALTH = [HealthCheck.too_slow, HealthCheck.filter_too_much]
RepositoryMachine.TestCase.settings = settings(max_examples=20 * SCALE, stateful_step_count=30, deadline=None,
                                               suppress_health_check=HEALTH)
FileRepositoryMachine.TestCase.settings = settings(max_examples=3 * SCALE, stateful_step_count=20, deadline=None,
                                                   suppress_health_check=HEALTH)
TestRepositoryStateMachine = RepositoryMachine.TestCase
TestFileRepositoryStateMachine = FileRepositoryMachine.TestCase


# ---- bugs the state machine found --------------------------------------------------------

OneVersion = tuple[ckptrepo.Repository, str]


@pytest.fixture
def one_version() -> OneVersion:
    repo = ckptrepo.init(f"memory://{uuid.uuid4().hex}")
    return repo, repo.snapshot({"w": torch.zeros(2)}, step=0).id


def test_creating_an_existing_branch_at_its_own_version_is_refused(one_version: OneVersion) -> None:
    """``branch main`` while main is at HEAD must say the branch exists (as it does when main is elsewhere)."""
    repo, _ = one_version
    with pytest.raises(RefError, match="already exists"):
        repo.branch("main")


def test_creating_an_existing_tag_at_its_own_version_is_refused(one_version: OneVersion) -> None:
    """A second ``tag v1`` at v1's own version must say the tag exists (as it does for another version)."""
    repo, vid = one_version
    repo.tag("v1")
    with pytest.raises(RefError, match="already exists"):
        repo.tag("v1", vid)


def test_checkout_b_of_an_existing_branch_is_refused(one_version: OneVersion) -> None:
    """``checkout REV -b exp`` when exp exists at REV must fail and leave HEAD where it was (git: "a branch named
    'exp' already exists"), not silently check exp out."""
    repo, vid = one_version
    repo.branch("exp")
    repo.checkout(vid)                       # detached
    with pytest.raises(RefError, match="already exists"):
        repo.checkout(vid, branch="exp")
    assert repo.current_branch() is None
