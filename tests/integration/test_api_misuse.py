"""Misusing the Python API gets ckptrepo's own exceptions, one line each, before anything is read or written.

Each case was a leak (AttributeError, TypeError, RuntimeError from deep inside), a silent no-op (``into=5``, a
read-only array in ``into``), or a failure deferred to a background thread (a RetentionPolicy without a
metric failed every commit's gc pass). Paths are accepted as ``os.PathLike``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

import ckptrepo
from ckptrepo.errors import (
    ArgumentError,
    CkptRepoError,
    ExchangeError,
    LayoutError,
    RefError,
    RetentionError,
    RevisionError,
    StateMismatchError,
    UnsupportedValueError,
)
from ckptrepo.parallel.layout import ParallelLayout
from ckptrepo.rules import Fused, Rules, Split, VocabSplit, megatron_gpt


@pytest.fixture
def repo(tmp_path) -> ckptrepo.Repository:
    r = ckptrepo.init(str(tmp_path / "repo"))
    for step in range(2):
        r.snapshot({"w": torch.full((3,), float(step)), "a": np.zeros(3)}, step=step, metrics={"loss": 1.0 - step})
    return r


def _readonly_into() -> dict[str, Any]:
    a = np.zeros(3)
    a.setflags(write=False)
    return {"w": torch.zeros(3), "a": a}


def _snapshotter(call: Callable[[Any], Any]) -> Callable[[ckptrepo.Repository], Any]:
    def run(repo: ckptrepo.Repository) -> Any:
        with repo.snapshotter() as snap:
            return call(snap)
    return run


# (case, call on the repository, exception, what its message says)
CASES: list[tuple[str, Callable[[ckptrepo.Repository], Any], type[CkptRepoError], str]] = [
    ("open(5)", lambda r: ckptrepo.open(5), ArgumentError, "a repository is a path or URL .*not int 5"),
    ("open(None)", lambda r: ckptrepo.open(None), ArgumentError, "not NoneType None"),
    ("init(5)", lambda r: ckptrepo.init(5), ArgumentError, "a repository is a path or URL"),
    ("load(5)", lambda r: r.load(5), RevisionError, r"a revision is text \(HEAD, .*\), not int 5"),
    ("load(None)", lambda r: r.load(None), RevisionError, "a revision is text"),
    ("version(5)", lambda r: r.version(5), RevisionError, "a revision is text"),
    ("log(5)", lambda r: r.log(5), RevisionError, "a revision is text"),
    ("log(limit=-1)", lambda r: r.log(limit=-1), ArgumentError, "limit must be a whole number of at least 0"),
    ("log(since='x')", lambda r: r.log(since="x"), ArgumentError, "since must be a whole number"),
    ("show(5)", lambda r: r.show(5), RevisionError, "a revision is text"),
    ("checkout(5)", lambda r: r.checkout(5), RevisionError, "a revision is text"),
    ("checkout(branch=5)", lambda r: r.checkout("HEAD", branch=5), RefError, "a branch name is text, not int 5"),
    ("branch(5)", lambda r: r.branch(5), RefError, "a branch name is text"),
    ("tag(5)", lambda r: r.tag(5), RefError, "a tag name is text"),
    ("delete_branch(5)", lambda r: r.delete_branch(5), RefError, "a branch name is text"),
    ("delete_tag(5)", lambda r: r.delete_tag(5), RefError, "a tag name is text"),
    ("diff(5, HEAD)", lambda r: r.diff(5, "HEAD"), RevisionError, "a revision is text"),
    ("diff(pattern=5)", lambda r: r.diff("HEAD~1", "HEAD", pattern=5), ArgumentError, "a tensor name pattern is text"),
    ("stats(5)", lambda r: r.stats(5), RevisionError, "a revision is text"),
    ("metrics(5)", lambda r: r.metrics(5), RevisionError, "a revision is text"),
    ("trajectory(metric='bogus')", lambda r: r.trajectory("w", metric="bogus"), ArgumentError,
     "unknown metric 'bogus'; use one of norm, mean, std, min, max, absmax, nan, inf, delta, relative-change"),
    ("trajectory(5)", lambda r: r.trajectory(5), ArgumentError, "a tensor name pattern is text"),
    ("capture_stats(5)", lambda r: r.capture_stats(5), RevisionError, "a revision is text"),
    ("load(into=5)", lambda r: r.load(into=5), StateMismatchError,
     r"into= takes the state to fill in place .*not int 5; leave it out to get a new state"),
    ("load(into='s')", lambda r: r.load(into="s"), StateMismatchError, "into= takes the state to fill in place"),
    ("load(into=read-only array)", lambda r: r.load(into=_readonly_into()), StateMismatchError,
     r"state\['a'\]: the numpy array in `into` cannot be filled in place \(read-only"),
    ("load(parallel_layout='x')", lambda r: r.load(parallel_layout="x"), LayoutError,
     "parallel_layout must be a ckptrepo.ParallelLayout or None, not str 'x'"),
    ("load(device='bogus')", lambda r: r.load(device="bogus"), ArgumentError, "device 'bogus' is not a device"),
    ("load(on_bytes=5)", lambda r: r.load(on_bytes=5), ArgumentError, "on_bytes must be a function or None"),
    ("fsck(on_total=5)", lambda r: r.fsck(on_total=5), ArgumentError, "on_total must be a function or None"),
    ("snapshot(parallel_layout='x')", lambda r: r.snapshot({"w": torch.ones(2)}, parallel_layout="x"), LayoutError,
     "parallel_layout must be a ckptrepo.ParallelLayout"),
    ("snapshot(metric tensor of 3)", lambda r: r.snapshot({"w": torch.ones(2)}, metrics={"m": torch.ones(3)}),
     UnsupportedValueError, r"metric 'm' is a tensor of 3 elements, not one number; pass one \(e.g. loss.item\(\)"),
    ("snapshotter metric tensor of 3", _snapshotter(lambda s: s.snapshot({"w": torch.ones(2)},
                                                                           metrics={"m": torch.ones(3)})),
     UnsupportedValueError, "metric 'm' is a tensor of 3 elements"),
    ("attach(42)", _snapshotter(lambda s: s.attach(42)), ArgumentError,
     "attach\\(\\) takes a torch.optim.Optimizer, whose step\\(\\) then waits for capture, not int 42"),
    ("snapshotter(max_in_flight=0)", lambda r: r.snapshotter(max_in_flight=0), ArgumentError,
     "max_in_flight must be a whole number of at least 1, not 0"),
    ("snapshotter(host_memory='x')", lambda r: r.snapshotter(host_memory="x"), ArgumentError,
     "host_memory 'x' is not a size"),
    ("snapshotter(commit_timeout_s=-1)", lambda r: r.snapshotter(commit_timeout_s=-1), ArgumentError,
     "commit_timeout_s must be a number of seconds above 0"),
    ("snapshotter(commit_timeout_s='x')", lambda r: r.snapshotter(commit_timeout_s="x"), ArgumentError,
     "commit_timeout_s must be a number of seconds above 0"),
    ("snapshotter(dedup='yes')", lambda r: r.snapshotter(dedup="yes"), ArgumentError, "dedup must be True or False"),
    ("snapshotter(retention='x')", lambda r: r.snapshotter(retention="x"), RetentionError,
     "retention must be a ckptrepo.RetentionPolicy or None"),
    ("snapshotter(parallel_layout='x')", lambda r: r.snapshotter(parallel_layout="x"), LayoutError,
     "parallel_layout must be a ckptrepo.ParallelLayout"),
    ("RetentionPolicy(keep_best=2)", lambda r: ckptrepo.RetentionPolicy(keep_best=2), RetentionError,
     "keeping the best 2 versions needs a metric to rank them by"),
    ("RetentionPolicy(best_mode='avg')", lambda r: ckptrepo.RetentionPolicy(keep_best=2, best_metric="loss",
                                                                           best_mode="avg"), RetentionError,
     "best_mode must be a mode of min or max"),
    ("RetentionPolicy(best_metric=5)", lambda r: ckptrepo.RetentionPolicy(keep_best=2, best_metric=5), RetentionError,
     "best_metric is the name of a metric"),
    ("RetentionPolicy(best_metric only)", lambda r: ckptrepo.RetentionPolicy(best_metric="loss"), RetentionError,
     "ranks versions only for keep_best"),
    ("RetentionPolicy(keep_tagged='no')", lambda r: ckptrepo.RetentionPolicy(keep_tagged="no"), RetentionError,
     "keep_tagged=...\\) is True or False"),
    ("gc(best_mode='avg')", lambda r: r.gc(best_mode="avg"), RetentionError, "best_mode must be a mode of min or max"),
    ("ParallelLayout(tp=2**70)", lambda r: ParallelLayout(tp=2**70), LayoutError,
     "each degree must be a whole number from 1 to"),
    ("ParallelLayout(tp=True)", lambda r: ParallelLayout(tp=True), LayoutError, "each degree must be a whole number"),
    ("ParallelLayout(too many ranks)", lambda r: ParallelLayout(tp=1 << 13, pp=1 << 13), LayoutError,
     "has 67108864 ranks; a layout has 16777216 at most"),
    ("ParallelLayout(zero=True)", lambda r: ParallelLayout(zero=True), LayoutError, "the ZeRO stage is 0, 1, 2 or 3"),
    ("ParallelLayout(rules='x')", lambda r: ParallelLayout(rules="x"), LayoutError,
     r"ParallelLayout\(rules=...\) takes ckptrepo.rules.Rules"),
    ("megatron_gpt(num_layers=-1)", lambda r: megatron_gpt(num_layers=-1, vocab_size=16), LayoutError,
     "num_layers must be a whole number of at least 0"),
    ("megatron_gpt(num_layers='2')", lambda r: megatron_gpt(num_layers="2", vocab_size=16), LayoutError,
     "num_layers must be a whole number"),
    ("Rules(stage_sizes=[-1, 3])", lambda r: Rules(num_layers=2, stage_sizes=[-1, 3]), LayoutError,
     "stage_sizes must be the layer count of each pipeline stage"),
    ("Rules(sections=())", lambda r: Rules(sections=()), LayoutError, "sections must name at least one section"),
    ("Rules(sections='model')", lambda r: Rules(sections="model"), LayoutError,
     r"Rules\(sections=...\) is a list, not str 'model'"),
    ("Rules(stage_sizes=5)", lambda r: Rules(num_layers=2, stage_sizes=5), LayoutError,
     r"Rules\(stage_sizes=...\) is a list, not int 5"),
    ("Rules(params=[('w', 0)])", lambda r: Rules(params=[("w", 0)]), LayoutError, "each rule is \\(a name pattern"),
    ("Split('0')", lambda r: Split("0"), LayoutError, "the dimension to split is a whole number"),
    ("VocabSplit('16')", lambda r: VocabSplit("16"), LayoutError, "the vocabulary size and the padding multiple"),
    ("Fused('3')", lambda r: Fused("3"), LayoutError, "give a count of at least 1 equal parts"),
    ("export(HEAD, 5)", lambda r: r.export("HEAD", 5), ExchangeError, "the export's output is a path"),
    ("import_state(5)", lambda r: r.import_state(5), ExchangeError, "the checkpoint to import is a path"),
]


@pytest.mark.parametrize("call, exc, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_misuse_raises_ckptrepo_s_own_one_line_error(repo, call, exc, fragment):
    before = sorted(repo.plumbing.store.list(""))
    with pytest.raises(exc, match=fragment) as info:
        call(repo)
    assert "\n" not in str(info.value)
    assert sorted(repo.plumbing.store.list("")) == before   # refused before anything was written


def test_value_errors_stay_value_errors():
    """ArgumentError is a ValueError too, as the checks it replaces raised: callers catching that still do."""
    assert issubclass(ArgumentError, ValueError) and issubclass(ArgumentError, CkptRepoError)


def test_paths_are_accepted_as_path_objects(tmp_path):
    repo = ckptrepo.init(tmp_path / "repo")
    repo.snapshot({"w": torch.ones(2)}, step=1)
    assert ckptrepo.open(tmp_path / "repo").version().step == 1
    assert torch.equal(ckptrepo.load(Path(tmp_path / "repo"))["w"], torch.ones(2))
    assert ckptrepo.init(tmp_path / "repo", exist_ok=True).url == repo.url


def test_a_read_only_array_in_into_is_refused_with_nothing_filled(repo):
    into = _readonly_into()
    with pytest.raises(StateMismatchError):
        repo.load(into=into)
    assert torch.equal(into["w"], torch.zeros(3))   # nothing filled: checked before any read
    fresh = {"w": torch.zeros(3), "a": np.ones(3)}
    assert repo.load(into=fresh) is fresh and np.array_equal(fresh["a"], np.zeros(3)) and fresh["w"][0] == 1.0


def test_a_valid_best_rule_in_the_background_commits_without_failures(repo):
    """The policy is checked when made; a valid one runs after every commit and close() reports nothing."""
    policy = ckptrepo.RetentionPolicy(keep_best=1, best_metric="loss", grace_period_s=0)
    with repo.snapshotter(retention=policy) as snap:
        for step in range(2, 4):
            snap.snapshot({"w": torch.full((3,), float(step)), "a": np.zeros(3)}, step=step,
                          metrics={"loss": float(step)})
            snap.wait()
    assert [v.step for v in repo.log()][:2] == [3, 2]
    assert repo.failures() == []
