"""Damaged objects are detected and named: by load, by fsck and by the ``ckptrepo fsck`` CLI.

Never silently wrong data: a flipped byte, a truncated or a deleted shard, or a
damaged manifest is a CorruptionError that names the storage object (and, for
data, the tensors living in it).
"""
from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.ckpt_workers import SMALL_HOST_MEMORY, assert_same, make_state

import ckptrepo
from ckptrepo.errors import CorruptionError, StateMismatchError
from ckptrepo.storage._arrays import INNER_BYTES

INNER = INNER_BYTES // 4  # float32 elements per inner chunk


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "layer1.weight": torch.randn(INNER, generator=g),      # inner chunk 0 of the float32 array
        "layer2.weight": torch.randn(INNER, generator=g),      # inner chunk 1
        "layer2.bias": torch.randn(1000, generator=g),          # inner chunk 2
        "steps": torch.arange(10, dtype=torch.int64) + seed,   # differs: no version shares another's bytes (dedup)
        "epoch": seed,
    }


@pytest.fixture
def repo_dir(tmp_path):
    """A repository with two versions; returns (path, id of the first, id of the second)."""
    path = tmp_path / "repo"
    repo = ckptrepo.init(str(path))
    v1 = repo.snapshot(_state(1), step=1)
    v2 = repo.snapshot(_state(2), step=2)
    return path, v1.id, v2.id


def _shard_file(path: Path, vid: str, index: int = 0) -> tuple[Path, str]:
    key = f"data/{vid}/0/float32/c/{index}"
    return path / key, key


def _chunk_extent(blob: bytes, n_inner: int, chunk: int) -> tuple[int, int]:
    """(offset, nbytes) of inner chunk ``chunk`` from the shard index at the end of the object.

    The index is n_inner (offset, nbytes) little-endian uint64 pairs followed by its crc32c.
    """
    index = blob[-(16 * n_inner + 4):-4]
    return struct.unpack_from("<QQ", index, 16 * chunk)


def _flip(file: Path, offset: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x5A
    file.write_bytes(bytes(data))


def _assert_load_fails_naming(path: Path, vid: str, key: str, tensor: str, kind: str) -> None:
    repo = ckptrepo.open(str(path))
    with pytest.raises(CorruptionError) as info:
        repo.load(vid)
    msg = str(info.value)
    assert key in msg and tensor in msg and kind in msg, msg


def _assert_fsck_names(path: Path, *needles: str) -> list[str]:
    report = ckptrepo.open(str(path)).fsck()
    assert not report.ok
    hits = [e for e in report.errors if all(n in e for n in needles)]
    assert hits, report.errors
    return report.errors


@pytest.mark.parametrize("where", ["data-middle", "index"])
def test_flipped_byte_in_shard(repo_dir, where):
    path, vid, other = repo_dir
    file, key = _shard_file(path, vid)
    blob = file.read_bytes()
    n_inner = 3
    offset, nbytes = _chunk_extent(blob, n_inner, 1)
    assert nbytes == INNER * 4 + 4  # the data of layer2.weight plus its crc32c
    # Flip a byte in the middle of layer2.weight's bytes, or inside the shard index.
    _flip(file, offset + nbytes // 2 if where == "data-middle" else len(blob) - 20)

    _assert_load_fails_naming(path, vid, key, "layer2.weight", "corrupt")
    errors = _assert_fsck_names(path, key, "layer2.weight")
    assert len(errors) == 1, errors
    # The damage stays local: the other version is untouched and loads bit-exact.
    assert_same(ckptrepo.open(str(path)).load(other), _state(2))


def test_a_flipped_byte_deep_inside_a_long_read_is_caught(tmp_path):
    """The direct reader reads a run a megabyte at a time and checks each batch as it lands: damage in a
    later batch of one read task (chunk 37 of a 2.5 MiB tensor) fails the load too, naming the tensor."""
    path = tmp_path / "repo"
    big = torch.arange(40 * INNER + 123, dtype=torch.float32)
    vid = ckptrepo.init(str(path)).snapshot({"big": big, "small": torch.ones(3)}, step=1).id
    file, key = _shard_file(path, vid)
    blob = file.read_bytes()
    meta = ckptrepo.open(str(path)).plumbing.manifest(vid).arrays[f"data/{vid}/0/float32"]
    per_shard = meta.shard_elems // meta.inner_elems
    offset, nbytes = _chunk_extent(blob, per_shard, 37)
    assert nbytes == INNER_BYTES + 4
    _flip(file, offset + 1000)
    _assert_load_fails_naming(path, vid, key, "big", "corrupt")


def test_truncated_shard(repo_dir):
    path, vid, _ = repo_dir
    file, key = _shard_file(path, vid)
    blob = file.read_bytes()
    file.write_bytes(blob[: len(blob) // 2])
    _assert_load_fails_naming(path, vid, key, "layer1.weight", "corrupt")
    _assert_fsck_names(path, key, "layer1.weight")


def test_deleted_shard_is_an_error_not_zeros(repo_dir):
    path, vid, other = repo_dir
    file, key = _shard_file(path, vid)
    file.unlink()
    _assert_load_fails_naming(path, vid, key, "layer2.bias", "missing")
    _assert_fsck_names(path, key, "layer2.bias", "missing")
    assert_same(ckptrepo.open(str(path)).load(other), _state(2))


def test_deleted_middle_shard_of_multi_shard_array(tmp_path):
    """With several shards per array, exactly the lost one is named, with the tensors inside it."""
    path = tmp_path / "repo"
    repo = ckptrepo.init(str(path))
    with repo.snapshotter(host_memory=SMALL_HOST_MEMORY) as snap:   # 512 KiB shards
        vid = snap.snapshot(make_state(7), step=7).result().id
    info = repo.plumbing.manifest(vid).arrays[f"data/{vid}/0/float32"]
    assert info.numel > 3 * info.shard_elems
    file, key = _shard_file(path, vid, 1)   # model/w1 fills the first 2 MiB of the float32 array
    file.unlink()
    _assert_load_fails_naming(path, vid, key, "w1", "missing")
    errors = _assert_fsck_names(path, key, "w1")
    assert len(errors) == 1 and f"data/{vid}/0/float32/c/0 " not in errors[0], errors


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_resharding_load_names_the_damaged_object_and_its_tensors(tmp_path, damage, capfd):
    """The piece-wise path (a version saved with a layout, loaded into a tensor-parallel rank) reports damage
    with the same one-line error as whole-tensor loads, whether its direct reader or TensorStore meets it,
    and only that: the reader's tasks cancelled after the failure printed a traceback each to stderr."""
    from support.dist_workers import SPLIT_RULES, split_state

    from ckptrepo.parallel.layout import ParallelLayout

    path = tmp_path / "repo"
    repo = ckptrepo.init(str(path))
    vid = repo.snapshot({"model": split_state(5)}, step=1, parallel_layout=ParallelLayout(rules=SPLIT_RULES)).id
    file, key = _shard_file(path, vid)
    if damage == "flip":
        _flip(file, 1000)   # inside the first inner chunk: col.weight's first rows
    elif damage == "truncate":
        file.write_bytes(file.read_bytes()[:1 << 20])
    else:
        file.unlink()
    into = {"model": {"col.weight": torch.empty(4096, 256)}}
    with pytest.raises(CorruptionError) as info:
        ckptrepo.open(str(path)).load(vid, parallel_layout=ParallelLayout(tp=2, rules=SPLIT_RULES), rank=0, into=into)
    msg = str(info.value)
    kind = "missing" if damage == "delete" else "corrupt"
    assert key in msg and "col.weight" in msg and f"is {kind}" in msg and "ckptrepo fsck" in msg, msg
    assert "\n" not in msg
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_manifest(repo_dir, damage):
    path, vid, other = repo_dir
    file = path / "versions" / vid
    key = f"versions/{vid}"
    ckptrepo.open(str(path)).tag("first", vid)
    if damage == "flip":
        _flip(file, file.stat().st_size // 2)
    elif damage == "truncate":
        file.write_bytes(file.read_bytes()[:3])
    else:
        file.unlink()
    # Through a ref (a deleted manifest is simply an unknown id when named by its id).
    for rev in ("first", "HEAD~1") + ((vid,) if damage != "delete" else ()):
        with pytest.raises(CorruptionError) as info:
            ckptrepo.open(str(path)).load(rev)
        assert key in str(info.value), (rev, str(info.value))
    # The log of the newer version walks through the damaged parent: a clear error, too.
    with pytest.raises(CorruptionError, match=key):
        ckptrepo.open(str(path)).log(other)
    # gc and du cannot go on without every manifest: the same error, and gc deletes nothing
    files = sorted(p for p in path.rglob("*") if p.is_file())
    with pytest.raises(CorruptionError, match=key):
        ckptrepo.open(str(path)).gc(keep_last=1, grace_period_s=0)
    with pytest.raises(CorruptionError, match=key):
        ckptrepo.open(str(path)).du()
    assert sorted(p for p in path.rglob("*") if p.is_file()) == files
    _assert_fsck_names(path, key)
    if damage == "delete":   # its data is not an interrupted snapshot's leftover that gc would remove
        notes = " ".join(ckptrepo.open(str(path)).fsck().warnings)
        assert f"data/{vid}/ is the data of version {vid[:12]}, whose manifest is missing" in notes, notes
        assert "interrupted snapshot" not in notes and "gc will remove" not in notes, notes


def test_a_manifest_under_another_versions_key_is_corruption_not_that_version(repo_dir):
    """Its crc32c is fine: only the id inside says whose it is. Accepted, `load` of the tag returned the other
    version's data, `log` listed a version twice, and gc collected the real version as unreachable."""
    path, vid, other = repo_dir
    ckptrepo.open(str(path)).tag("first", vid)
    (path / "versions" / vid).write_bytes((path / "versions" / other).read_bytes())
    key = f"versions/{vid}"
    for call in (lambda r: r.load("first"), lambda r: r.log(), lambda r: r.gc(grace_period_s=0)):
        with pytest.raises(CorruptionError, match=rf"manifest {key} holds the manifest of version {other[:12]}, "
                                                  rf"not its own; run `ckptrepo fsck`"):
            call(ckptrepo.open(str(path)))
    _assert_fsck_names(path, key, "not its own")
    assert (path / "data" / vid).is_dir(), "gc deleted nothing"


def test_cli_fsck_reports_corruption(repo_dir):
    path, vid, _ = repo_dir
    file, key = _shard_file(path, vid)
    offset, nbytes = _chunk_extent(file.read_bytes(), 3, 1)
    _flip(file, offset + nbytes // 2)
    proc = subprocess.run([sys.executable, "-m", "ckptrepo.cli.main", "--repo", str(path), "fsck"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CKPTREPO_DEBUG": "", "COLUMNS": "400"})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if key in line]
    assert lines and "layer2.weight" in lines[0] and lines[0].startswith("error:"), output
    assert "1 problem(s) found" in output, output


def test_deleted_array_metadata(repo_dir):
    path, vid, other = repo_dir
    (path / "data" / vid / "0" / "int64" / "zarr.json").unlink()
    repo = ckptrepo.open(str(path))
    with pytest.raises(CorruptionError, match=f"data/{vid}/0/int64"):
        repo.load(vid)
    _assert_fsck_names(path, f"data/{vid}/0/int64")
    assert_same(ckptrepo.open(str(path)).load(other), _state(2))


def test_stats_diff_and_trajectory_name_a_missing_object_like_load(repo_dir):
    """They read through their own chunked path and quoted TensorStore's raw error (with a kilobyte of spec).
    Statistics recorded at capture answer without the data; reading it is what names the loss."""
    import shutil

    from ckptrepo.tools._inspect import tensor_stats

    path, vid, other = repo_dir
    shutil.rmtree(path / "data" / vid)
    repo = ckptrepo.open(str(path))
    assert {s.name for s in repo.stats(vid)}    # from the records: no data read
    for call in (lambda: tensor_stats(repo.plumbing, vid), lambda: repo.diff(vid, other),
                 lambda: repo.trajectory("*", "delta")):
        with pytest.raises(CorruptionError) as info:
            call()
        msg = str(info.value)
        assert (f"data/{vid}/" in msg and "is missing" in msg and "ckptrepo fsck" in msg
                and "tensorstore_spec" not in msg)


@pytest.mark.parametrize("ref,content", [("refs/heads/main", b""), ("refs/tags/t", b"\xff\xfe"),
                                         ("HEAD", b"ref: refs/(eads/main"), ("HEAD", b"")])
def test_a_damaged_ref_is_named_not_taken_for_an_absent_one(repo_dir, ref, content):
    """An empty branch ref read as an unborn branch (the next snapshot started a new root history and fsck
    called the real history abandoned); bytes that are not UTF-8 failed every command, fsck included, with a
    bare UnicodeDecodeError; a HEAD naming no branch made the next snapshot create one."""
    path, vid, other = repo_dir
    ckptrepo.open(str(path)).tag("t", vid)
    (path / ref).write_bytes(content)
    calls = [lambda r: r.gc(grace_period_s=0)]
    if "tags" not in ref:    # a snapshot and log read HEAD and its branch; a damaged tag only drops out of names
        calls += [lambda r: r.log(), lambda r: r.snapshot({"w": torch.ones(2)}, step=3)]
    for call in calls:
        with pytest.raises(CorruptionError, match=rf"(ref )?{ref} is damaged") as info:
            call(ckptrepo.open(str(path)))
        assert "\n" not in str(info.value)
    report = ckptrepo.open(str(path)).fsck()
    assert [e for e in report.errors if f"{ref} is damaged" in e], report.errors
    assert sorted(p.name for p in (path / "versions").iterdir()) == sorted([vid, other])   # nothing new, nothing lost


def test_stray_files_and_damaged_refs_block_only_what_needs_them(repo_dir):
    """A Finder `.DS_Store` in refs/heads, refs/tags, versions/ or data/ made log, show, branch and gc fail
    ("ref ... is damaged"), and a damaged branch or tag could not be deleted by the commands that name the
    repair: as git ignores names that are not refs and deletes broken ones. gc still stops at a damaged ref."""
    path, vid, other = repo_dir
    repo = ckptrepo.open(str(path))
    repo.tag("t", vid)
    for folder in ("refs/heads", "refs/tags", "versions", "data"):
        (path / folder / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    assert [v.id for v in repo.log()] == [other, vid] and "tag: t" in repo.version(vid).refs
    assert set(repo.branches()) == {"main"} and set(repo.tags()) == {"t"}
    assert repo.fsck().ok
    report = repo.gc(grace_period_s=0)
    assert report.collected == [] and report.orphan_data == []
    assert (path / "data" / ".DS_Store").exists()          # not ours to delete
    (path / "refs/heads/junk").write_bytes(b"garbage")
    (path / "refs/tags/bad").write_bytes(b"")
    repo = ckptrepo.open(str(path))
    assert [v.id for v in repo.log()] == [other, vid] and set(repo.tags()) == {"t"}
    assert [v.id for v in repo.log(all=True)] == [other, vid]
    assert len(repo.damaged_refs()) == 2 and all("is damaged" in d for d in repo.damaged_refs())
    with pytest.raises(CorruptionError, match="refs/heads/junk is damaged"):
        repo.gc(grace_period_s=0)
    with pytest.raises(CorruptionError, match="refs/heads/junk is damaged"):
        repo.delete_branch("junk")                          # -d cannot tell what it would leave to gc
    assert repo.delete_branch("junk", force=True) == "" and repo.delete_tag("bad") == ""
    assert repo.damaged_refs() == [] and repo.fsck().ok
    # a name earlier versions allowed (a folder starting with '.'), refused for new refs, is still a ref:
    # skipped as a stray file, gc collected the history only it reached
    hidden = repo.snapshot({"w": torch.ones(1)}, step=9)
    (path / "refs/heads/exp").mkdir()
    (path / "refs/heads/exp/.hidden").write_text(hidden.id)
    with pytest.raises(ckptrepo.errors.RefError, match="invalid branch name"):
        repo.branch("exp/.other", vid)
    assert repo.branches()["exp/.hidden"] == hidden.id
    assert hidden.id not in repo.gc(grace_period_s=0).collected and repo.fsck().ok
    assert torch.equal(repo.load("exp/.hidden")["w"], torch.ones(1))


def test_an_init_killed_before_head_is_finished_by_init_exist_ok(tmp_path):
    path = tmp_path / "r"
    ckptrepo.init(str(path))
    (path / "HEAD").unlink()
    with pytest.raises(CorruptionError, match="HEAD is missing .*`ckptrepo init --exist-ok` writes it again"):
        ckptrepo.open(str(path)).snapshot({"w": torch.ones(2)}, step=1)
    ckptrepo.init(str(path), exist_ok=True).snapshot({"w": torch.ones(2)}, step=1)
    assert [v.step for v in ckptrepo.open(str(path)).log()] == [1]


def test_a_failing_strided_load_with_reads_still_queued_prints_nothing_but_its_error(tmp_path, capfd, caplog):
    """Column slices of a plain version: every span is scattered once its tasks are done; after the first
    chunk fails its checksum the reader cancels the queued tasks, whose callbacks printed a traceback each."""
    from ckptrepo.parallel.layout import ParallelLayout
    from ckptrepo.rules import Rules, Split
    path = tmp_path / "repo"
    repo = ckptrepo.init(str(path))
    vid = repo.snapshot({"model": {"w": torch.randn(400, 40_000)}}, step=1).id   # 64 MB: tasks queued
    file, key = _shard_file(path, vid)
    _flip(file, 100)
    with pytest.raises(CorruptionError, match="is corrupt"):
        ckptrepo.open(str(path)).load(vid, parallel_layout=ParallelLayout(tp=2, rules=Rules([("w", Split(1))])),
                                      rank=0)
    assert "Traceback" not in capfd.readouterr().err
    assert not [r for r in caplog.records if "exception calling callback" in r.getMessage()]   # futures' logger


@pytest.mark.parametrize("edit", ["dtype", "offset", "no pieces", "piece twice"])
def test_a_resealed_manifest_whose_tensor_table_does_not_fit_its_arrays_is_refused(tmp_path, edit):
    """A manifest whose crc32c checks out can still disagree with itself (a writer's bug, a hand edit sealed
    again): a float32 array read as float64 loaded uninitialised memory on the direct path, a piece past
    its array's end an IndexError, and fsck said ok. Reading the manifest now checks its tensor table."""
    from ckptrepo.core._manifest import seal, unseal
    path = tmp_path / "repo"
    repo = ckptrepo.init(str(path))
    vid = repo.snapshot({"model": {"a": torch.randn(1000), "c": torch.randn(4000)}}, step=1).id
    file = path / "versions" / vid
    m = unseal(file.read_bytes(), "test")
    c = next(t for t in m["tensors"] if t["name"] == "model/c")
    if edit == "dtype":
        c["dtype"] = "float64"
    elif edit == "offset":
        c["pieces"][0]["offset"] = -5
    elif edit == "no pieces":
        c["pieces"] = []
    else:
        c["pieces"].append(dict(c["pieces"][0]))
    file.write_bytes(seal(m))
    with pytest.raises(CorruptionError, match=f"manifest versions/{vid}: .*model/c.*run `ckptrepo fsck`"):
        ckptrepo.open(str(path)).load(vid)
    assert [e for e in ckptrepo.open(str(path)).fsck().errors if vid in e]


def test_a_damaged_ref_of_heads_branch_blocks_only_what_reads_heads_version(repo_dir):
    """Reading HEAD read its branch's tip, so every command that only looks at HEAD's branch name failed
    with the damage: `show ID`, `log good`, `export good`, and the repair the message implies,
    `checkout good -b fix` (then `branch -D main`). Only what needs HEAD's version fails now."""
    path, vid, other = repo_dir
    ckptrepo.open(str(path)).tag("good", vid)
    (path / "refs/heads/main").write_bytes(b"zzz\n")
    repo = ckptrepo.open(str(path))
    for call in (lambda: repo.load("HEAD"), lambda: repo.log(), lambda: repo.snapshot({"w": torch.ones(2)}, step=3)):
        with pytest.raises(CorruptionError, match="refs/heads/main is damaged"):
            call()
    assert "tag: good" in repo.version(vid).refs and [v.id for v in repo.log("good")] == [vid]
    assert repo.load("good") is not None
    repo.checkout("good", branch="fix")
    assert repo.delete_branch("main", force=True) == "" and repo.fsck().ok
    assert [v.id for v in repo.log()] == [vid]


def test_a_folder_in_place_of_head_is_named_with_a_repair_that_works(repo_dir):
    """It read as a missing HEAD, and the repair named (`init --exist-ok`) then failed on the folder."""
    import shutil
    path, vid, other = repo_dir
    (path / "HEAD").unlink()
    (path / "HEAD").mkdir()
    with pytest.raises(CorruptionError, match="HEAD is a folder, not a ref; move it away"):
        ckptrepo.open(str(path)).log()
    shutil.rmtree(path / "HEAD")
    ckptrepo.init(str(path), exist_ok=True)
    assert ckptrepo.open(str(path)).log()[0].id == other


@pytest.mark.parametrize("bad", [["T", 999], ["T", "x"], ["d", 5], ["l", None]])
@pytest.mark.parametrize("into", [False, True])
def test_a_malformed_skeleton_is_corruption_not_a_python_error(tmp_path, bad, into):
    """A re-sealed manifest's tree is vouched for by its crc32c: a tensor index past the table or a node of the
    wrong shape gave IndexError, KeyError or TypeError on load."""
    import msgpack

    from ckptrepo.core._manifest import seal
    repo = ckptrepo.init(str(tmp_path / "r"))
    vid = repo.snapshot({"w": torch.randn(3), "b": torch.randn(2)}, step=1).id
    path = tmp_path / "r" / "versions" / vid
    raw = msgpack.unpackb(path.read_bytes()[:-4], raw=False, strict_map_key=False)
    raw["tree"][1][1][1] = bad   # the value of "b"
    path.write_bytes(seal(raw))
    kwargs = {"into": {"w": torch.zeros(3), "b": torch.zeros(2)}} if into else {}
    with pytest.raises((CorruptionError, StateMismatchError), match="skeleton is malformed|saved a"):
        ckptrepo.open(str(tmp_path / "r")).load("HEAD", **kwargs)
