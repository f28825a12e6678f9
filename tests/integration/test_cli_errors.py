"""The CLI's errors over paths the OS refuses, and over arguments with control characters (issue 39): each is one
line on stderr that says what to do, with no traceback, no Python exception text (``[Errno N]``) and no raw
control character that would ring, move the cursor or rewrite the line on the user's terminal."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from support.helpers import run

import ckptrepo

CONTROL = "\a\b\r\x1b[2J\x7f"   # bell, backspace, carriage return, "clear the screen", delete
LONG = "n" * 300                # longer than a file name may be
RAW_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")


@pytest.fixture(scope="module")
def place(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository ``repo`` with one version, a file ``afile``, an empty file ``empty``, a link ``loop`` that
    points at itself."""
    root = tmp_path_factory.mktemp("errors")
    ckptrepo.init(root / "repo").snapshot({"w": torch.ones(3)}, step=1)
    (root / "afile").write_text("not a folder")
    (root / "empty").write_bytes(b"")
    (root / "loop").symlink_to("loop")
    return root


# (case, --repo or None, arguments); "{d}" is the fixture's folder
CASES = [
    ("init on a file", "{d}/afile", ["init"]),
    ("init under a file", "{d}/afile/x", ["init"]),
    ("init in a link loop", "{d}/loop", ["init"]),
    ("init with a name too long", f"{{d}}/{LONG}", ["init"]),
    ("clone into a file", None, ["clone", "{d}/repo", "{d}/afile"]),
    ("clone under a file", None, ["clone", "{d}/repo", "{d}/afile/x"]),
    ("clone into a link loop", None, ["clone", "{d}/repo", "{d}/loop"]),
    ("clone with a name too long", None, ["clone", "{d}/repo", f"{{d}}/{LONG}"]),
    ("import an empty file", "{d}/repo", ["import", "{d}/empty"]),
    ("import a file that cannot be read", "{d}/repo", ["import", "/proc/self/mem"]),
    ("import a name too long", "{d}/repo", ["import", f"{{d}}/{LONG}.pt"]),
    ("export into a link loop", "{d}/repo", ["export", "HEAD", "{d}/loop/x.pt"]),
    ("export with a name too long", "{d}/repo", ["export", "HEAD", f"{{d}}/{LONG}.pt"]),
    ("csv into a link loop", "{d}/repo", ["trajectory", "*", "--csv", "{d}/loop/x.csv"]),
    ("csv with a name too long", "{d}/repo", ["trajectory", "*", "--csv", f"{{d}}/{LONG}.csv"]),
    ("png with a name too long", "{d}/repo", ["metrics", "--png", f"{{d}}/{LONG}.png"]),
    ("png where no file can be made", "{d}/repo", ["metrics", "--png", "/proc/x.png"]),
    ("tensorboard into a link loop", "{d}/repo", ["metrics", "--tensorboard", "{d}/loop"]),
    ("tensorboard where no folder can be made", "{d}/repo", ["metrics", "--tensorboard", "/proc/tb"]),
    ("tensorboard with a name too long", "{d}/repo", ["metrics", "--tensorboard", f"{{d}}/{LONG}"]),
    ("control characters in a revision", "{d}/repo", ["log", f"x{CONTROL}"]),
    ("control characters in a path", "{d}/repo", ["export", "HEAD", f"{{d}}/afile/{CONTROL}.pt"]),
    ("control characters in a branch name", "{d}/repo", ["branch", f"b{CONTROL}"]),
    ("a newline in a revision", "{d}/repo", ["show", "a\nb"]),
]


@pytest.mark.parametrize("repo, args", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_error_is_one_escaped_line_that_says_what_to_do(place: Path, repo: str | None, args: list[str]) -> None:
    p = run(*(a.format(d=place) for a in args), repo=None if repo is None else repo.format(d=place))
    assert p.returncode != 0
    err = p.stderr
    assert err.startswith("ckptrepo: error: ") and err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err and "Errno" not in err and "os_error_code" not in err, err
    assert not RAW_CONTROL.search(err), ascii(err)
    assert re.search(r"; |: use ", err), err   # the clause after it says what to do
    if any(CONTROL in a or "\n" in a for a in args):
        assert "\\x07" in err or "\\a" in err or "\\n" in err, ascii(err)


def test_click_usage_errors_are_escaped_too(place: Path) -> None:
    p = run("log", "HEAD", f"extra{CONTROL}", repo=str(place / "repo"))   # click quotes an extra argument as it is
    assert p.returncode == 2 and "Usage:" in p.stderr and not RAW_CONTROL.search(p.stderr), ascii(p.stderr)
    assert "\\x07" in p.stderr
