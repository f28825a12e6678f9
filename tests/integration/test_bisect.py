"""bisect: the first version where a recorded metric or a tensor statistic meets a condition, or holds NaN/Inf."""
from __future__ import annotations

import json
import math
import random

import pytest
import torch
from support.helpers import run

import ckptrepo
from ckptrepo.errors import ArgumentError
from ckptrepo.tools import _bisect
from ckptrepo.tools._bisect import first_metric_match, first_tensor_match, parse_condition

LOSS = [5.0, 4.0, 2.5, 2.0, 3.5, 2.8, 3.2, math.nan]


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    """Eight versions (steps 0..7): the loss dips below 3, rises above it at step 4, falls, rises again at 6 and is
    NaN at 7; layers.1.attn.w blows up (absmax 150) at step 4; layers.0.mlp.w holds a NaN from step 6; head.w
    appears at step 3, already large."""
    url = str(tmp_path_factory.mktemp("bisect") / "repo")
    repo = ckptrepo.init(url)
    ids = []
    for step, loss in enumerate(LOSS):
        state = {f"layers.{i}.{part}.w": torch.full((4, 4), 0.1 * (step + 1))
                 for i in (0, 1) for part in ("attn", "mlp")}
        if step >= 4:
            state["layers.1.attn.w"][0, 0] = 150.0
        if step >= 6:
            state["layers.0.mlp.w"][1, 1] = math.nan
        if step >= 3:
            state["head.w"] = torch.full((2,), 50.0)
        ids.append(repo.snapshot(state, step=step, metrics={"loss": loss, "lr": 0.1}).id)
    return url, ids


@pytest.mark.parametrize("when, step, previous", [
    ("above 3.0", 0, None),            # already above at the first version: a level, not a crossing
    ("rises above 3.0", 4, 2.0),       # the first crossing, not the first version above
    ("  Rises   ABOVE 3 ", 4, 2.0),    # case and spacing are free
    ("falls below 3", 2, 4.0),
    ("changes by more than 50%", 4, 2.0),
    ("changes by more than 1.2", 2, 4.0),
    ("< 2.5", 3, 2.5),
    ("<= 2.5", 2, 4.0),
    ("== 2.8", 5, 3.5),
    ("is nan", 7, 3.2),
    ("is not finite", 7, 3.2),
])
def test_metric_conditions_find_the_first_match(history, when, step, previous):
    url, ids = history
    found = ckptrepo.open(url).bisect(when, metric="loss")
    assert found is not None and (found.version, found.step) == (ids[step], step)
    assert found.previous == previous and found.what == "loss" and found.checked == step + 1
    assert (found.value != found.value) if math.isnan(LOSS[step]) else found.value == LOSS[step]


def test_since_until_bound_the_scan_and_a_crossing_needs_a_previous_value_in_range(history):
    url, ids = history
    repo = ckptrepo.open(url)
    found = repo.bisect("rises above 3.0", metric="loss", since=5)   # step 4 is out of range; 5 has no previous
    assert found is not None and found.step == 6 and found.previous == 2.8 and found.previous_version == ids[5]
    assert repo.bisect("rises above 3.0", metric="loss", until=3) is None
    assert repo.bisect("above 3.0", metric="loss", rev=ids[3], since=1) is not None   # --rev: its history only
    assert repo.bisect("is nan", metric="loss", rev=ids[6]) is None


def test_tensor_statistic_reports_the_tensor_that_crossed(history):
    url, ids = history
    repo = ckptrepo.open(url)
    found = repo.bisect("exceeds 100", tensor="layers.*.attn.*", stat="absmax")
    assert found is not None and found.version == ids[4] and found.tensor == "layers.1.attn.w"
    assert found.tensors == ["layers.1.attn.w"] and found.value == 150.0
    assert found.previous == pytest.approx(0.4) and found.previous_version == ids[3]
    # head.w appears at step 3 above 10: a crossing needs a previous value, so only a level matches there
    assert repo.bisect("above 10", tensor="head.*", stat="absmax").step == 3
    assert repo.bisect("rises above 10", tensor="head.*", stat="absmax") is None
    wide = repo.bisect("> 0.3", tensor="layers.*", stat="max")   # every layer at once: all are named
    assert wide.step == 2 and wide.tensor == "layers.0.attn.w" and len(wide.tensors) == 4


def test_nonfinite_finds_the_first_nan_or_inf(history):
    url, ids = history
    repo = ckptrepo.open(url)
    found = repo.bisect(nonfinite=True)
    assert found is not None and found.version == ids[6] and found.tensor == "layers.0.mlp.w" and found.value == 1
    assert found.previous == 0
    assert repo.bisect(nonfinite=True, tensor="layers.*.attn.*") is None


def test_library_refuses_bad_arguments_in_one_line(history):
    url, _ = history
    repo = ckptrepo.open(url)
    for call, fragment in [
        (lambda: repo.bisect("above 1", metric="accuracy"), "records metric 'accuracy'; recorded: loss, lr"),
        (lambda: repo.bisect("goes up", metric="loss"), "cannot read the condition 'goes up'"),
        (lambda: repo.bisect("above 1", tensor="nothing.*"), "no tensor matches 'nothing.*'"),
        (lambda: repo.bisect("is nan", tensor="layers.*"), "nonfinite"),
        (lambda: repo.bisect(metric="loss"), "needs a condition"),
        (lambda: repo.bisect("above 1"), "one of metric="),
        (lambda: repo.bisect("above 1", metric="loss", nonfinite=True), "no condition"),
    ]:
        with pytest.raises(ArgumentError) as e:
            call()
        assert fragment in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("text", ["goes up", "above", "above three", "rises 3", "changes by more than -5%", ""])
def test_unreadable_conditions_list_the_accepted_forms(text):
    with pytest.raises(ArgumentError, match="rises above X") as e:
        parse_condition(text)
    assert "\n" not in str(e.value)


def test_scan_is_linear_where_a_binary_search_would_miss():
    # above 3 holds at versions 1 and 4 only: a bisection between a false first and a true last version lands
    # on 4 (or misses it), the scan finds 1
    rows = [{"version": f"v{i}", "step": i, "loss": x} for i, x in enumerate([1.0, 4.0, 1.0, 1.0, 4.0])]
    assert first_metric_match(rows, "loss", parse_condition("above 3")).version == "v1"
    rows[2]["loss"] = "n/a"   # not a number: skipped, and no one's previous value
    assert first_metric_match(rows, "loss", parse_condition("falls below 2")).version == "v3"
    m = first_tensor_match(["a", "b", "c"], [0, 1, 2], ["t"], [[math.nan, 5.0, 7.0]], "norm",
                           parse_condition("changes by more than 10%"))
    assert m is not None and m.version == "c" and m.previous == 5.0 and m.previous_version == "b"


def _plain_first_match(names, values, cond):
    """The first (version, tensors, value, previous column) by a plain loop: what the block scan must give."""
    last: dict[int, int] = {}
    for v in range(len(values[0])):
        hits = []
        for t in range(len(names)):
            x = values[t][v]
            if x != x:
                continue
            p = last.get(t)
            if cond.holds(x, None if p is None else values[t][p]):
                hits.append((t, p))
            last[t] = v
        if hits:
            return v, [names[t] for t, _ in hits], values[hits[0][0]][v], hits[0][1]
    return None


@pytest.mark.parametrize("block", [1, 3, 512])
def test_block_scan_of_a_matrix_equals_a_plain_loop(monkeypatch, block):
    monkeypatch.setattr(_bisect, "_BLOCK", block)   # previous values carried across block edges
    rng = random.Random(block)
    conditions = [parse_condition(c) for c in ("above 1", "rises above 1", "falls below 1", "!= 0", "== 2",
                                                "changes by more than 50%", "changes by more than 2", "is inf")]
    for _ in range(80):
        n, m = rng.randint(1, 4), rng.randint(1, 10)
        names = [f"t{i}" for i in range(n)]
        versions = [f"v{j}" for j in range(m)]
        values = [[rng.choice([math.nan, math.nan, 0.0, 1.0, 2.0, 5.0, -3.0, math.inf]) for _ in range(m)]
                  for _ in range(n)]
        for cond in conditions:
            got = first_tensor_match(versions, list(range(m)), names, values, "s", cond)
            want = _plain_first_match(names, values, cond)
            if want is None:
                assert got is None, (values, cond)
                continue
            column, tensors, value, previous = want
            assert got is not None and got.version == versions[column] and got.tensors == tensors, (values, cond)
            assert got.value == value and got.checked == column + 1
            assert got.previous_version == (None if previous is None else versions[previous])


def test_cli_reports_and_exits_0_1_2(history):
    url, ids = history
    p = run("bisect", "--metric", "loss", "--when", "rises above 3.0", repo=url)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0].startswith(f"{ids[4][:12]}  step 4  first version where loss rises above 3.0")
    assert f"version {ids[4]}" in p.stdout and f"loss 3.5 (previous 2 at {ids[3][:12]})" in p.stdout
    p = run("bisect", "--tensor", "layers.*.attn.*", "--stat", "absmax", "--when", "exceeds 100", "--json", repo=url)
    assert p.returncode == 0
    data = json.loads(p.stdout)
    assert data["found"] and data["version"] == ids[4] and data["tensor"] == "layers.1.attn.w" and data["step"] == 4
    p = run("bisect", "--nonfinite", repo=url)
    assert p.returncode == 0 and "tensor  layers.0.mlp.w: NaN+Inf elements 1" in p.stdout
    p = run("bisect", "--metric", "loss", "--when", "above 100", repo=url)
    assert p.returncode == 1 and p.stdout.startswith("no version matches: loss above 100")
    p = run("bisect", "--metric", "loss", "--when", "above 100", "--json", repo=url)
    assert p.returncode == 1 and json.loads(p.stdout) == {"found": False}
    is_nan = run("bisect", "--metric", "loss", "--when", "is nan", "--json", repo=url)
    assert is_nan.returncode == 0 and json.loads(is_nan.stdout)["value"] is None   # strict JSON: NaN is null


@pytest.mark.parametrize("args, fragment", [
    (["--metric", "loss", "--when", "goes up"], "cannot read the condition"),
    (["--metric", "accuracy", "--when", "above 1"], "recorded: loss, lr"),
    (["--tensor", "nothing.*", "--when", "above 1"], "no tensor matches"),
    (["--metric", "loss"], "--when"),
    (["--when", "above 1"], "one of --metric"),
    (["--metric", "loss", "--tensor", "x", "--when", "above 1"], "one of --metric"),
    (["--nonfinite", "--when", "above 1"], "--nonfinite takes no"),
    (["--metric", "loss", "--stat", "norm", "--when", "above 1"], "--stat goes with --tensor"),
])
def test_cli_usage_errors_are_one_line_exit_2(history, args, fragment):
    url, _ = history
    p = run("bisect", *args, repo=url)
    assert p.returncode == 2 and fragment in p.stderr, p.stderr
    assert len([line for line in p.stderr.splitlines() if line.strip()]) <= 3   # click's usage lines at most
