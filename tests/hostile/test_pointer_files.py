"""Hostile pointer files at the paths a ``CkptRepoIO`` loads and removes (issue 39, item 2).

A pointer file is input like any other: whoever can write into the checkpoint directory can write one. The
plugin follows a pointer only into its own repository, prunes only a version saved for that very path, and
answers every bad pointer with one line. Each case: the plugin's repository holds one checkpoint
(``ck/keep.ckpt``), another repository one version; the hostile file goes to ``ck/evil.ckpt`` (or where it
says), then a load and a remove of it run; afterwards both repositories must be as they were, and
``keep.ckpt`` must load bit for bit.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

pytest.importorskip("lightning.pytorch")

import ckptrepo  # noqa: E402
from ckptrepo.errors import CkptRepoError, PointerError  # noqa: E402
from ckptrepo.integrations._checkpoint_files import read_pointer  # noqa: E402
from ckptrepo.integrations.lightning import CkptRepoIO  # noqa: E402

pytestmark = [pytest.mark.hostile,
              pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")]

HOSTILE_CLASS = "pointer files"

KEEP = {"state_dict": {"w": torch.arange(8.0)}, "global_step": 4}


class Scene:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.url, self.ck = root / "repo", root / "ck"
        self.io = CkptRepoIO(self.url)
        self.io.save_checkpoint(KEEP, self.ck / "keep.ckpt")
        self.io.teardown()
        self.keep = read_pointer(self.ck / "keep.ckpt")
        assert self.keep is not None
        self.other_url = root / "other"
        self.other = ckptrepo.init(self.other_url)
        self.other_vid = self.other.snapshot({"secret": torch.ones(3)}, tag="t").id
        self.before = self.state()

    def state(self) -> Any:
        repo, other = ckptrepo.open(self.url), ckptrepo.open(self.other_url)
        return ([(v.id, v.pruned) for v in repo.log()], repo.tags(), [(v.id, v.pruned) for v in other.log()],
                other.tags())

    def pointer(self, **fields: Any) -> dict[str, Any]:
        doc = {"kind": "ckptrepo-checkpoint", "format": 1, "repository": str(self.url), "version": self.keep.version,
               "tag": "evil.ckpt", "step": 4}
        doc.update(fields)
        return doc


@pytest.fixture
def scene(tmp_path: Path) -> Scene:
    return Scene(tmp_path)


def one_line(err: BaseException) -> str:
    text = str(err)
    assert text and "\n" not in text and "Traceback" not in text, text
    return text


def check_untouched(scene: Scene) -> None:
    assert scene.state() == scene.before
    loaded = scene.io.load_checkpoint(scene.ck / "keep.ckpt")
    assert torch.equal(loaded["state_dict"]["w"], KEEP["state_dict"]["w"])
    scene.io.teardown()


def write(path: Path, content: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        path.write_text(content)
    else:
        path.write_bytes(content)


REFUSED: dict[str, Callable[[Scene], dict[str, Any]]] = {
    "another repository": lambda s: s.pointer(repository=str(s.other_url), version=s.other_vid, tag="t"),
    "an S3 URL": lambda s: s.pointer(repository="s3://bucket/elsewhere"),
    "a path outside": lambda s: s.pointer(repository=str(s.url) + "/../../../etc"),
    "a relative path": lambda s: s.pointer(repository="repo"),
    "a revision for a version": lambda s: s.pointer(version="HEAD"),
    "a tag for a version": lambda s: s.pointer(version="keep.ckpt"),
    "a path for a version": lambda s: s.pointer(version="../../versions/" + s.keep.version),
    "a short id": lambda s: s.pointer(version=s.keep.version[:12]),
    "a version of the wrong type": lambda s: s.pointer(version=["a"]),
    "a bogus tag": lambda s: s.pointer(tag="../../refs/heads/main"),
    "a bogus previous": lambda s: s.pointer(previous="HEAD~1"),
    "no repository": lambda s: {k: v for k, v in s.pointer().items() if k != "repository"},
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_pointer_the_plugin_may_not_follow_is_refused_in_one_line(scene: Scene, case: str) -> None:
    write(scene.ck / "evil.ckpt", json.dumps(REFUSED[case](scene)))
    with pytest.raises(PointerError) as err:
        scene.io.load_checkpoint(scene.ck / "evil.ckpt")
    assert "evil.ckpt" in one_line(err.value)
    scene.io.remove_checkpoint(scene.ck / "evil.ckpt")   # the file goes, as Lightning asked; nothing else
    assert not (scene.ck / "evil.ckpt").exists()
    check_untouched(scene)


GARBAGE: dict[str, bytes] = {
    "cut short": b'{"kind": "ckptrepo-checkpoint", "format": 1, "repos',
    "oversized": b'{"kind": "ckptrepo-checkpoint", "pad": "' + b"x" * (1 << 20) + b'"}',
    "not UTF-8": b'{"kind": "ckptrepo-checkpoint", "repository": "\xff\xfe"}',
    "a list": b'["ckptrepo-checkpoint"]',
    "nested deep": b'{"kind": "ckptrepo-checkpoint", "x": ' + b"[" * 30000 + b"]" * 30000 + b"}",   # < 64 KiB
}


@pytest.mark.parametrize("case", sorted(GARBAGE))
def test_a_garbage_pointer_is_one_line(scene: Scene, case: str) -> None:
    write(scene.ck / "evil.ckpt", GARBAGE[case])
    with pytest.raises(CkptRepoError) as err:
        scene.io.load_checkpoint(scene.ck / "evil.ckpt")
    assert "evil.ckpt" in one_line(err.value)
    scene.io.remove_checkpoint(scene.ck / "evil.ckpt")
    assert not (scene.ck / "evil.ckpt").exists()
    check_untouched(scene)


def test_a_pointer_to_another_checkpoints_version_never_prunes_it(scene: Scene) -> None:
    """A pointer into the plugin's own repository loads what it names (as a copy of a pointer would), but a
    remove prunes only a version saved for that very path: not keep.ckpt's, whatever tag or path it claims."""
    cases = [(scene.ck / "evil.ckpt", scene.pointer()),
             (scene.root / "elsewhere" / "keep.ckpt", scene.pointer(tag="keep.ckpt")),   # keep's tag, a path of it
             (scene.ck / "evil.ckpt", scene.pointer(version="0" * 32, previous=scene.keep.version))]
    for path, doc in cases:
        write(path, json.dumps(doc))
        loaded = scene.io.load_checkpoint(path)
        assert torch.equal(loaded["state_dict"]["w"], KEEP["state_dict"]["w"])
        scene.io.remove_checkpoint(path)
        assert not path.exists()
        check_untouched(scene)


def test_a_pointer_saved_then_overwritten_by_a_hostile_one_prunes_nothing_else(scene: Scene) -> None:
    """The plugin saves over a hostile pointer at its path: the pointer names the new version, and the
    version the hostile one named (another checkpoint's, another repository's) stays."""
    for doc in (scene.pointer(), scene.pointer(repository=str(scene.other_url), version=scene.other_vid)):
        write(scene.ck / "evil.ckpt", json.dumps(doc))
        scene.io.save_checkpoint({"global_step": 9}, scene.ck / "evil.ckpt")
        scene.io.teardown()
        pointer = read_pointer(scene.ck / "evil.ckpt")
        assert pointer is not None and pointer.previous is None and pointer.repository == scene.io.url
        scene.io.remove_checkpoint(scene.ck / "evil.ckpt")
        scene.before = (scene.state()[0], scene.before[1], *scene.before[2:])   # the new version, pruned now
        check_untouched(scene)


@pytest.mark.parametrize("kind", ["a named pipe", "a link to a device"])
def test_a_checkpoint_path_that_is_no_regular_file_is_refused_without_blocking(scene: Scene, kind: str) -> None:
    import os
    import threading
    path = scene.ck / "evil.ckpt"
    if kind == "a named pipe":
        os.mkfifo(path)
    else:
        os.symlink("/dev/zero", path)
    failures: list[BaseException] = []

    def load() -> None:
        try:
            scene.io.load_checkpoint(path)
        except BaseException as err:  # noqa: BLE001 - checked below
            failures.append(err)
    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    loader.join(30)
    if loader.is_alive() and kind == "a named pipe":   # unblock it before failing
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    assert not loader.is_alive(), "the load blocked on the file"
    assert len(failures) == 1 and isinstance(failures[0], PointerError)
    assert "no regular file" in one_line(failures[0])
    scene.io.remove_checkpoint(path)
    assert not os.path.lexists(path)
    check_untouched(scene)
