"""``storage/_atomic_file.replace_file``: the one write-then-rename of the adapters' small files.

A failure between the write and the rename (or during the write) leaves the old file whole and no
temporary file; every adapter that replaces a file goes through it.
"""
from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from ckptrepo.integrations import _pointer_files, deepspeed, megatron
from ckptrepo.storage import _atomic_file
from ckptrepo.storage._atomic_file import replace_file

INTEGRATIONS = Path(deepspeed.__file__).parent


def test_replaces_the_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "latest"
    replace_file(path, "old")
    replace_file(path, b"new bytes")
    assert path.read_bytes() == b"new bytes" and os.listdir(tmp_path) == ["latest"]


@pytest.mark.parametrize("fail", ["os.replace", "os.fsync"])
def test_a_failure_before_the_rename_leaves_the_old_file_and_no_temporary(tmp_path: Path, fail: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "latest"
    replace_file(path, "old")

    def broken(*_args: object) -> None:
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(_atomic_file.os, fail.split(".")[1], broken)
    with pytest.raises(OSError, match="No space left"):
        replace_file(path, "new")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["latest"]


def test_the_adapters_files_go_through_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No other module of ckptrepo/integrations renames a file; each adapter's writer, its rename failing,
    leaves the old file as it was."""
    for module in INTEGRATIONS.glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os":
                assert node.attr not in ("replace", "rename"), f"{module.name}: os.{node.attr}; use replace_file"
    from ckptrepo.integrations._pointer_files import Pointer
    writers = {
        "pointer": lambda p: _pointer_files.write_pointer(p, Pointer(str(tmp_path / "repo"), "a" * 32, "t", 1)),
        "stub": lambda p: deepspeed.write_stub(str(p), "/repo", "a" * 32, "t", "mp_rank_00_model_states.pt"),
        "megatron": lambda p: megatron.write_pointer(p, "/repo", "a" * 32),
    }
    for name, write in writers.items():
        folder = tmp_path / name
        folder.mkdir()
        target = folder / "ckptrepo.json" if name == "megatron" else folder / "file"
        target.write_text("old")
        with monkeypatch.context() as m:
            def broken(*_args: object) -> None:
                raise OSError(28, "No space left on device")
            m.setattr(_atomic_file.os, "replace", broken)
            with pytest.raises(OSError, match="No space left"):
                write(folder if name == "megatron" else target)
        assert target.read_text() == "old" and os.listdir(folder) == [target.name], name
        write(folder if name == "megatron" else target)
        assert target.read_text() != "old", name
