"""``fsck --repair-config`` reads HEAD with the refs' own parser (core/_refs.head_target): the default branch it
records is the one snapshots go to, whatever bytes HEAD holds."""
from __future__ import annotations

import json
import uuid

import torch

import ckptrepo
from ckptrepo.core._config_repair import repair_config
from ckptrepo.core._manifest import CONFIG_KEY, HEAD_KEY


def _repo_with_branches(head: bytes) -> ckptrepo.Repository:
    repo = ckptrepo.init(f"memory://{uuid.uuid4().hex}")
    repo.snapshot({"w": torch.zeros(2)}, step=1)
    repo.branch("dev")
    repo.branch("zeta")
    store = repo.plumbing.store
    store.put(HEAD_KEY, head)
    store.put(CONFIG_KEY, b"{damaged")
    return repo


def test_a_head_written_with_a_final_newline_names_its_branch() -> None:
    """HEAD as `echo 'ref: refs/heads/dev' > HEAD` writes it: the repository is on dev, so dev is the default."""
    repo = _repo_with_branches(b"ref: refs/heads/dev\n")
    assert repo.current_branch() == "dev"
    done = repair_config(repo.plumbing.store)
    assert "default branch 'dev' (the branch HEAD is on)" in done
    assert json.loads(repo.plumbing.store.get(CONFIG_KEY))["default_branch"] == "dev"


def test_a_head_that_names_no_branch_is_not_recorded_as_one() -> None:
    """A HEAD naming 'a..b' (no ref name: the refs refuse it as damage) leaves the default to the branches."""
    repo = _repo_with_branches(b"ref: refs/heads/a..b")
    done = repair_config(repo.plumbing.store)
    assert "default branch 'main' (a branch of that name exists)" in done


def test_salvage_keeps_only_a_known_format_version_and_a_plausible_creation_time() -> None:
    """A bool is no format version nor time (Python counts True as 1); a version past this release's, or a
    time that is no epoch second, is dropped with it."""
    from ckptrepo.core._config_repair import _salvage
    from ckptrepo.core._manifest import FORMAT_VERSION

    def kept(**cfg: object) -> dict[str, object]:
        return _salvage(json.dumps(cfg).encode())

    assert kept(format_version=FORMAT_VERSION, created=1.7e9) == {"format_version": FORMAT_VERSION, "created": 1.7e9}
    assert kept(format_version=1, created=2) == {"format_version": 1, "created": 2.0}
    for bad in (True, 0, FORMAT_VERSION + 1, 1.0, "1"):
        assert "format_version" not in kept(format_version=bad)
    for bad_time in (True, 0, 1e12, "1"):
        assert "created" not in kept(created=bad_time)
