"""The CLI end to end: real `ckptrepo` processes, one-line errors, no tracebacks, --json output."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from support.helpers import run

import ckptrepo

# the checkout's root, where `python -m ckptrepo.cli` runs
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_console_script_runs_as_a_real_process(tmp_path):
    """The installed `ckptrepo` executable itself: one-line error, exit 2, no traceback."""
    p = subprocess.run(["ckptrepo", "--repo", str(tmp_path / "none"), "log"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().endswith("or pass --repo URL") and p.stderr.count("\n") == 1
    p = subprocess.run(["ckptrepo", "init", str(tmp_path / "r")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


@pytest.fixture
def populated(tmp_path):
    url = str(tmp_path / "repo")
    repo = ckptrepo.init(url)
    for step in range(3):
        repo.snapshot({"model": {"w": torch.randn(4, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}, "step": step,
                       "note": "hello"}, step=step * 10, message=f"m{step}", metrics={"loss": 3.0 - step})
    repo.tag("good", "@10")
    return url, repo


def test_init_log_show_json(tmp_path, populated):
    url, repo = populated
    p = run("init", str(tmp_path / "new"))
    assert p.returncode == 0 and "initialised" in p.stdout
    p = run("init", str(tmp_path / "new"))
    assert p.returncode != 0 and p.stderr.strip().count("\n") == 0 and "already exists" in p.stderr

    p = run("log", repo=url)
    lines = p.stdout.strip().splitlines()
    assert p.returncode == 0 and len(lines) == 3
    assert "HEAD -> main" in lines[0] and "step 20" in lines[0] and "loss=1" in lines[0] and "m2" in lines[0]
    assert "tag: good" in lines[1]
    data = json.loads(run("log", "--json", repo=url).stdout)
    assert [v["step"] for v in data] == [20, 10, 0] and data[0]["metrics"] == {"loss": 1.0}
    assert [v["step"] for v in json.loads(run("log", "--since", "5", "--json", repo=url).stdout)] == [20, 10]

    shown = json.loads(run("show", "good", "--json", repo=url).stdout)
    assert shown["version"]["step"] == 10
    assert {(t["name"], t["dtype"], tuple(t["shape"]), t["bytes"]) for t in shown["tensors"]} == {
        ("model/w", "float32", (4, 3), 48), ("model/b", "bfloat16", (3,), 6)}
    assert {o["path"]: o["value"] for o in shown["objects"]} == {"step": "1", "note": "'hello'"}
    p = run("show", "HEAD~1", repo=url)
    assert p.returncode == 0 and "model/w" in p.stdout and "float32" in p.stdout and "4x3" in p.stdout


def test_repo_from_environment_and_cwd(populated):
    url, _ = populated
    assert len(json.loads(run("log", "--json", env_repo=url).stdout)) == 3
    assert len(json.loads(run("log", "--json", cwd=url).stdout)) == 3


def test_checkout_branch_tag_du_fsck(populated):
    url, repo = populated
    p = run("checkout", "@10", "-b", "retry", repo=url)
    assert p.returncode == 0 and "retry" in p.stdout
    branches = json.loads(run("branch", "--json", repo=url).stdout)
    assert {b["name"]: b["current"] for b in branches} == {"main": False, "retry": True}
    assert run("branch", "side", "@0", repo=url).returncode == 0
    assert ckptrepo.open(url).branches()["side"] == repo.resolve("@0")
    p = run("checkout", "good", repo=url)
    assert p.returncode == 0 and "detached" in p.stdout
    assert run("tag", "v2", "main", repo=url).returncode == 0
    assert set(json.loads(run("tag", "--json", repo=url).stdout)[i]["name"] for i in range(2)) == {"good", "v2"}
    du = json.loads(run("du", "--json", repo=url).stdout)
    # model/b is the same zeros in every version: stored once (dedup), shared by all three
    assert len(du["versions"]) == 3 and du["total_bytes"] == 3 * 48 + 6
    assert all((r["bytes"], r["unique_bytes"], r["shared_bytes"]) == (54, 48, 6) for r in du["versions"])
    p = run("du", repo=url)
    assert p.returncode == 0 and "unique" in p.stdout
    total = p.stdout.splitlines()[-1]
    assert total.startswith("total ") and "stored (150 B of tensors), 3 versions" in total, total
    p = run("fsck", repo=url)
    assert p.returncode == 0 and "ok" in p.stdout


def test_gc_keeps_the_best_versions_by_a_metric(populated):
    url, _ = populated   # losses 3, 2, 1 at steps 0, 10, 20; step 10 tagged
    p = run("gc", "--keep-best", "1", "--metric", "loss", "--mode", "max", "--grace", "0", "--json", repo=url)
    assert p.returncode == 0, p.stderr
    assert {ckptrepo.open(url).version(v).step for v in json.loads(p.stdout)["kept"]} == {0, 10, 20}
    assert [v.pruned for v in ckptrepo.open(url).log()] == [False, False, False]
    p = run("gc", "--keep-best", "1", "--metric", "loss", "--no-keep-tagged", "--grace", "0", repo=url)
    assert p.returncode == 0 and "pruned 2" in p.stdout, p.stdout   # the lowest loss is the head's: 0 and 10 go


def test_branch_and_tag_deletion(populated):
    url, repo = populated
    assert run("branch", "retry", "@0", repo=url).returncode == 0     # a tip main's history reaches
    p = run("branch", "-d", "retry", repo=url)
    assert p.returncode == 0 and p.stdout.strip() == f"deleted branch 'retry' (was {repo.resolve('@0')[:12]})"
    repo.checkout("@0", branch="exp")
    repo.snapshot({"w": torch.ones(2)}, step=5)
    repo.checkout("main")
    p = run("branch", "-d", "exp", repo=url)
    assert p.returncode == 2 and "`branch -D`" in p.stderr and p.stderr.count("\n") == 1
    assert run("branch", "-D", "exp", repo=url).returncode == 0 and set(repo.branches()) == {"main"}
    p = run("branch", "-d", "main", repo=url)
    assert p.returncode == 2 and "is checked out" in p.stderr
    assert run("tag", "-d", "good", repo=url).returncode == 0 and repo.tags() == {}
    assert run("branch", "-d", repo=url).returncode == 2 and run("branch", "-d", "x", "@0", repo=url).returncode == 2


@pytest.mark.parametrize("args, fragment", [
    (["log"], "is not a ckptrepo repository"),
    (["show", "nope"], "unknown revision 'nope'"),
    (["checkout", "@99"], "no version with step 99"),
    (["tag", "bad name"], "invalid tag name"),
    (["gc", "--keep-best", "1", "--metric", "accuracy"],
     "no version with data records metric 'accuracy'; recorded: loss"),
])
def test_errors_are_one_line(tmp_path, populated, args, fragment):
    url, _ = populated
    p = run(*args, repo=str(tmp_path / "empty") if args == ["log"] else url)
    assert p.returncode == 2
    assert p.stderr.startswith("ckptrepo: error:") and fragment in p.stderr and p.stderr.count("\n") == 1


def test_diff_stats_trajectory_commands(populated, tmp_path):
    url, _ = populated
    d = json.loads(run("diff", "@0", "@20", "--json", repo=url).stdout)
    assert {t["name"]: t["status"] for t in d["tensors"]} == {"model/w": "changed", "model/b": "unchanged"}
    assert {o["path"] for o in d["objects"]} == {"step"}
    p = run("diff", "@0", "@20", "--stat", "--sort", "relative", repo=url)
    assert p.returncode == 0 and "model" in p.stdout
    s = json.loads(run("stats", "HEAD", "--json", repo=url).stdout)
    assert {r["name"]: r["nan"] for r in s} == {"model/w": 0, "model/b": 0}
    csv_path = tmp_path / "t.csv"
    p = run("trajectory", "model/*", "--metric", "delta", "--csv", str(csv_path), repo=url)
    assert p.returncode == 0 and "model/w" in p.stdout
    assert (csv_path.read_text().splitlines()[0] == "version,step,name,delta"
            and len(csv_path.read_text().splitlines()) == 5)


def test_tables_never_cut_cells_short(tmp_path):
    """Piped output (not a terminal) holds every tensor name and number whole: rich cut them to fit 80 columns
    ("optimizer/…", "-0.00050…"), which made `ckptrepo stats > file` useless."""
    url = str(tmp_path / "r")
    repo = ckptrepo.init(url)
    names = [f"optimizer/state/decoder.layers.{i}.self_attention.linear_qkv.weight/exp_avg_sq" for i in range(3)]
    g = torch.Generator().manual_seed(0)
    for step in range(2):
        repo.snapshot({"optimizer": {"state": {n.split("/")[2]: {"exp_avg_sq": torch.randn(8, generator=g) * 1e-5}
                                                for n in names}}}, step=step)
    for args in (["stats"], ["show"], ["diff", "@0", "@1"]):
        p = run(*args, repo=url)
        assert p.returncode == 0, p.stderr
        assert all(n in p.stdout for n in names), (args, p.stdout)
        assert "…" not in p.stdout, (args, p.stdout)


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_trajectory_and_metrics_png(populated, tmp_path):
    url, _ = populated
    p = run("trajectory", "model/*", "--png", str(tmp_path / "t.png"), repo=url)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "t.png").read_bytes().startswith(PNG_MAGIC)
    p = run("metrics", "--png", str(tmp_path / "m.png"), repo=url)
    assert p.returncode == 0 and "loss" in p.stdout
    assert (tmp_path / "m.png").read_bytes().startswith(PNG_MAGIC)
    assert [r["loss"] for r in json.loads(run("metrics", "--json", repo=url).stdout)] == [3.0, 2.0, 1.0]


def test_png_without_matplotlib_is_one_line(populated, tmp_path, monkeypatch):
    url, _ = populated
    for name in ("matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)   # makes their import raise ImportError
    p = run("trajectory", "model/*", "--png", str(tmp_path / "t.png"), repo=url)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "pip install 'ckptrepo[plot]'" in p.stderr
    assert not (tmp_path / "t.png").exists()


def test_history_commands_do_not_import_torch(populated):
    """log, show, tag, branch, checkout, du, gc, metrics and fsck read refs, manifests and raw objects only: a fresh
    `ckptrepo` process must not pay for importing torch (2-3 s on a small VM, most of a history command's time)."""
    url, _ = populated
    probe = ("import sys, runpy; sys.argv = ['ckptrepo', '--repo', sys.argv[1]] + sys.argv[2:]\n"
             "try:\n    runpy.run_module('ckptrepo.cli.main', run_name='__main__')\n"
             "except SystemExit as e:\n    assert not e.code, e.code\n"
             "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    for args in (["log"], ["log", "--all", "--graph"], ["log", "--stats"], ["show", "good"], ["tag"], ["branch"],
                 ["log", "--json", "-n", "1"], ["show", "--json", "HEAD"], ["tag", "t1", "@10"], ["branch", "side"],
                 ["checkout", "side"], ["du"], ["gc", "--dry-run"], ["metrics"], ["fsck"], ["status"],
                 ["log", "--oneline", "-1"], ["fsck", "--repair-config"]) + \
            ((["metrics", "--png", os.path.join(os.path.dirname(url), "m.png")],)
             if importlib.util.find_spec("matplotlib") else ()):
        p = subprocess.run([sys.executable, "-c", probe, url, *args], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, (args, p.stderr)
        assert p.stdout.strip().splitlines()[-1] == "NO-TORCH", (args, p.stdout[-300:])


def test_user_text_is_printed_as_it_is_and_json_is_strict(tmp_path):
    """Found by a CLI probe: brackets in names, messages and metrics were read as rich markup (cut, or a
    MarkupError for "[/]"); a NaN loss or an infinite relative change made --json output that jq rejects;
    `diff --sort relative` crashed on an added tensor; a pruned version showed its old size."""
    url = str(tmp_path / "r")
    repo = ckptrepo.init(url)
    repo.snapshot({"m": {"experts[0].w": torch.zeros(2), "x[/]": torch.ones(2)}, "cfg": "see [docs/x]"}, step=1,
                  message="[wip] lr 3e-4\nsecond line", metrics={"loss[train]": float("nan")})
    repo.snapshot({"m": {"experts[0].w": torch.ones(2), "x[/]": torch.ones(2), "new": torch.ones(3)},
                   "cfg": "see [docs/x]"}, step=2, message="[/] done", metrics={"loss[train]": 1.0})
    log = run("log", repo=url)
    assert log.returncode == 0 and "[wip] lr 3e-4" in log.stdout and "[/] done" in log.stdout, log.stdout
    assert "loss[train]=nan" in log.stdout and "second line" not in log.stdout
    show = run("show", "@1", repo=url)
    assert show.returncode == 0 and "experts[0].w" in show.stdout and "x[/]" in show.stdout, show.stderr
    for args in (["log", "--json"], ["metrics", "--json"], ["diff", "@1", "@2", "--json"],
                 ["trajectory", "m/*", "--metric", "relative-change", "--json"]):
        p = run(*args, repo=url)
        assert p.returncode == 0, (args, p.stderr)
        json.loads(p.stdout, parse_constant=lambda c, args=args: pytest.fail(f"{args}: {c} is not JSON"))
    for order in ("relative", "l2"):
        p = run("diff", "@1", "@2", "--sort", order, repo=url)
        assert p.returncode == 0 and "new" in p.stdout, p.stderr
    changed = json.loads(run("diff", "@1", "@2", "--only-changed", "--json", repo=url).stdout)["tensors"]
    assert sorted(t["name"] for t in changed) == ["m/experts[0].w", "m/new"]
    assert run("checkout", "HEAD", repo=url).stdout.startswith("HEAD is now on branch 'main'")
    repo.snapshot({"m": {"experts[0].w": torch.ones(2)}}, step=3)
    repo.gc(keep_last=1, grace_period_s=0)
    assert "size    pruned" in run("show", "@1", repo=url).stdout
    assert json.loads(run("show", "@1", "--json", repo=url).stdout)["version"]["pruned"] is True


def test_dcp_exchange_failures_are_one_line(populated, tmp_path):
    url, _ = populated
    (tmp_path / "afile").write_text("x")
    p = run("export", "HEAD", str(tmp_path / "afile" / "x"), "--format", "dcp", repo=url)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "afile is not a folder" in p.stderr \
        and "write to another path" in p.stderr, p.stderr
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / ".metadata").write_text("garbage")
    p = run("import", str(bad), "--trust", repo=url)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "cannot read DCP checkpoint" in p.stderr, p.stderr


def test_cli_on_s3_prints_nothing_on_stderr(s3_url, tmp_path):
    """With credentials in the environment and no ~/.aws files, the AWS runtime logged ~5 error lines per
    command to the terminal's stderr (the whole default credential chain was built)."""
    ckptrepo.init(s3_url).snapshot({"w": torch.ones(2)}, step=1)
    env = dict(os.environ, HOME=str(tmp_path))   # no ~/.aws/config, no ~/.aws/credentials
    out = subprocess.run([sys.executable, "-m", "ckptrepo.cli", "--repo", s3_url, "log"], capture_output=True,
                         text=True, env=env, cwd=REPO_ROOT, timeout=120)
    assert out.returncode == 0 and "step 1" in out.stdout, out
    assert out.stderr == "", out.stderr


def test_s3_credentials_from_the_shared_credentials_file(s3_url, tmp_path):
    """`aws configure`'s ~/.aws/credentials, which boto3 uses, was not found: 3-5 AWS runtime lines and
    "PERMISSION_DENIED: Unknown". A process with no credentials in its environment now finds them there."""
    ckptrepo.init(s3_url).snapshot({"w": torch.ones(2)}, step=1)
    (tmp_path / ".aws").mkdir()
    (tmp_path / ".aws" / "credentials").write_text("[default]\naws_access_key_id = testing\n"
                                                   "aws_secret_access_key = testing\n")
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    env.update(HOME=str(tmp_path), AWS_EC2_METADATA_DISABLED="true")
    out = subprocess.run([sys.executable, "-m", "ckptrepo.cli", "--repo", s3_url, "log"], capture_output=True,
                         text=True, env=env, cwd=REPO_ROOT, timeout=120)
    assert out.returncode == 0 and "step 1" in out.stdout and out.stderr == "", out


def test_a_credentials_file_without_the_profile_leaves_the_default_chain(tmp_path, monkeypatch):
    """Named as a profile provider whenever the file existed, a file holding only other profiles stopped every
    S3 repository from opening on a machine whose credentials come from an instance role (review finding)."""
    from ckptrepo.storage._tensorstore import _aws_credentials
    (tmp_path / "credentials").write_text("[other]\naws_access_key_id = a\naws_secret_access_key = b\n")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    assert _aws_credentials() is None
    monkeypatch.setenv("AWS_PROFILE", "other")
    assert _aws_credentials()["profile"] == "other"


def test_terminal_control_codes_from_a_repository_never_reach_the_terminal(tmp_path):
    """A message or name holding ESC sequences (clear the screen, hide text, set the window title) went to the
    terminal as they were through log, show and diff: rich's strip_control_codes leaves ESC. Shown as \\xNN."""
    url = str(tmp_path / "r")
    repo = ckptrepo.init(url)
    repo.snapshot({"k\x1b[8m": 1, "w": torch.zeros(1)}, step=1, message="fix\x1b[2J\nmore\x1b]0;pwned\x07")
    repo.snapshot({"k\x1b[8m": 2, "w": torch.zeros(1)}, step=2)
    outputs = [run(*args, repo=url) for args in (["log"], ["show", "@1"], ["diff", "@1", "@2"])]
    for p in outputs:
        assert p.returncode == 0 and "\x1b" not in p.stdout and "\x07" not in p.stdout, p.stdout
    assert "fix\\x1b[2J" in outputs[0].stdout
    assert "    fix\\x1b[2J\n    more\\x1b]0;pwned\\x07" in outputs[1].stdout and "k\\x1b[8m" in outputs[1].stdout
    assert "object k\\x1b[8m: changed 1 -> 2" in outputs[2].stdout


def test_metric_series_with_a_leading_nan_and_a_nan_grace_period(tmp_path):
    """min()/max() of a series that starts with NaN are NaN: `metrics` showed '-' for both. `gc --grace nan`
    compared as 0 and collected versions seconds old."""
    url = str(tmp_path / "r")
    repo = ckptrepo.init(url)
    for step, loss in enumerate([float("nan"), 3.0, 1.0, 2.0]):
        repo.snapshot({"w": torch.zeros(1)}, step=step, metrics={"loss": loss})
    row = next(line for line in run("metrics", repo=url).stdout.splitlines() if "loss" in line)
    assert row.split()[:5] == ["loss", "-", "2", "1", "3"], row
    p = run("gc", "--grace", "nan", repo=url)
    assert p.returncode == 2 and "grace period must be a number of seconds of at least 0" in p.stderr


def test_file_urls_with_a_host_or_without_slashes_name_the_absolute_path(tmp_path, monkeypatch):
    """RFC 8089: file://localhost/ABS and file:/ABS are /ABS; they made ./localhost/ABS and ./file:/ABS."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "runs" / "r"
    v = ckptrepo.init(f"file://localhost{path}").snapshot({"x": torch.ones(2)}, step=1)
    assert ckptrepo.open(f"file:{path}").log()[0].id == v.id == ckptrepo.open(str(path)).log()[0].id
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    for url in ("file://otherhost/data", "file://localhost"):   # the second was the root directory
        p = run("log", repo=url)
        assert p.returncode == 2 and "and no path on this machine" in p.stderr and "\n" not in p.stderr.strip()
