"""A snapshotter's options as values (saving/_options.py): checked once when made, the same checks and
messages as ``repo.snapshotter``'s keywords, and ``options=`` as the other spelling of those keywords."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import ckptrepo
from ckptrepo.errors import ArgumentError, LayoutError, RetentionError
from ckptrepo.saving._options import LocalTier, SnapshotterOptions


def test_the_options_are_exported_frozen_values():
    assert ckptrepo.SnapshotterOptions is SnapshotterOptions and ckptrepo.LocalTier is LocalTier
    opts = SnapshotterOptions(max_in_flight=2, tier=LocalTier("origin", keep_last=3))
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.max_in_flight = 3   # type: ignore[misc]
    assert opts == SnapshotterOptions.of(max_in_flight=2, push_to="origin", local_keep_last=3)


@pytest.mark.parametrize("kwargs, error, fragment", [
    (dict(max_in_flight=0), ArgumentError, "max_in_flight must be a whole number"),
    (dict(commit_timeout_s=float("nan")), ArgumentError, "commit_timeout_s must be a number of seconds above 0"),
    (dict(dedup="yes"), ArgumentError, "dedup must be True or False, not 'yes'"),
    (dict(pin_memory=1), ArgumentError, "pin_memory must be True or False"),
    (dict(single_process=None), ArgumentError, "single_process must be True or False"),
    (dict(retention=3), RetentionError, "retention must be a ckptrepo.RetentionPolicy"),
    (dict(parallel_layout="dp=2"), LayoutError, "parallel_layout must be a ckptrepo.ParallelLayout"),
    (dict(host_memory="lots"), ArgumentError, "host_memory 'lots' is not a size"),
    (dict(compression="lz4"), ArgumentError, "compression must be"),
    (dict(tier="origin"), ArgumentError, "tier must be a ckptrepo.LocalTier"),
])
def test_a_bad_option_is_refused_when_the_options_are_made(kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        SnapshotterOptions(**kwargs)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(push_to=3), "push_to must be the name of a remote"),
    (dict(push_to="origin", keep_last=0), "local_keep_last must be a whole number of at least 1"),
    (dict(push_to="origin", on_full="drop"), "on_full must be 'wait' or 'skip'"),
    (dict(push_to="origin", max_bytes="huge"), "local_max_bytes 'huge' is not a size"),
])
def test_a_bad_tier_is_refused_when_it_is_made(kwargs, fragment):
    with pytest.raises(ArgumentError, match=fragment):
        LocalTier(**kwargs)


def test_tier_bounds_without_a_remote_are_refused_from_keywords():
    with pytest.raises(ArgumentError, match="pass push_to='origin'"):
        SnapshotterOptions.of(local_max_bytes="1GiB")
    with pytest.raises(ArgumentError, match="on_full must be"):   # checked even without a tier
        SnapshotterOptions.of(on_full="drop")
    assert SnapshotterOptions.of(push_to="o", local_max_bytes="1KiB").tier.max_bytes_parsed == 1024


def test_options_and_keywords_are_two_spellings_of_one_call(tmp_path):
    repo = ckptrepo.init(tmp_path / "r")
    opts = SnapshotterOptions(dedup=False, max_in_flight=1, host_memory="64MiB")
    with repo.snapshotter(options=opts) as snap:
        assert snap.options == opts and snap.max_in_flight == 1 and snap.host_memory == 64 << 20
        snap.snapshot({"w": torch.ones(3)}, step=1)
    assert [v.step for v in repo.log()] == [1]
    with pytest.raises(ArgumentError, match=r"options= with dedup, max_in_flight"):
        repo.snapshotter(options=opts, dedup=False, max_in_flight=2)
    with pytest.raises(ArgumentError, match="options must be a ckptrepo.SnapshotterOptions"):
        repo.snapshotter(options={"dedup": False})


def test_the_repository_host_memory_applies_unless_the_options_name_one(tmp_path):
    repo = ckptrepo.init(tmp_path / "r")
    repo.host_memory = "32MiB"
    with repo.snapshotter(options=SnapshotterOptions()) as snap:
        assert snap.host_memory == 32 << 20
    with repo.snapshotter(options=SnapshotterOptions(host_memory="48MiB")) as snap:
        assert snap.host_memory == 48 << 20
    with repo.snapshotter(host_memory=0) as snap:   # a falsy keyword: the repository's, as before options
        assert snap.host_memory == 32 << 20
