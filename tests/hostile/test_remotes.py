"""Hostile remotes: a repository cloned, fetched or pushed to that lies, redirects, links out of itself, or is
served by an endpoint that stalls or floods.

Each case builds a small sound repository, makes it hostile by hand, and checks that ckptrepo neither reads nor
writes outside the places the user named, keeps its memory bounded, ends in bounded time, and says what is wrong
in one line.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

import ckptrepo
from ckptrepo.errors import CkptRepoError

pytestmark = pytest.mark.hostile
HOSTILE_CLASS = "hostile remotes"

ROOT = Path(ckptrepo.__file__).resolve().parents[1]   # the checkout under test: children import the same library


def _source(path: Path | str, steps: int = 2) -> ckptrepo.Repository:
    repo = ckptrepo.init(path)
    for step in range(steps):
        repo.snapshot({"w": torch.arange(64, dtype=torch.float32) + step}, step=step)
    return repo


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "ckptrepo.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _one_line(err: BaseException | str) -> str:
    text = str(err).strip()
    assert "\n" not in text and "Traceback" not in text, text
    return text


def _set_config(path: Path, **fields: object) -> None:
    cfg = json.loads((path / "ckptrepo.json").read_bytes())
    cfg.update(fields)
    (path / "ckptrepo.json").write_text(json.dumps(cfg))


# ---- a remote's own remotes ------------------------------------------------------------------------------------

def test_clone_never_follows_the_remotes_a_remote_names(tmp_path: Path) -> None:
    src = _source(tmp_path / "src")
    tip = src.log()[0].id
    elsewhere = tmp_path / "elsewhere"   # a place the user never named, holding the data the remote points at
    shutil.copytree(tmp_path / "src", elsewhere)
    shutil.rmtree(tmp_path / "src" / "data" / tip)
    (tmp_path / "src" / "evicted").mkdir(exist_ok=True)
    (tmp_path / "src" / "evicted" / tip).write_text(json.dumps({"remote": "evil"}))
    _set_config(tmp_path / "src", remotes={"evil": {"url": str(elsewhere)}})

    with pytest.raises(CkptRepoError) as err:
        ckptrepo.clone(tmp_path / "src", tmp_path / "c")
    msg = _one_line(err.value)
    assert tip[:12] in msg and "evil" in msg
    assert not (tmp_path / "c" / "data" / tip).exists()
    assert str(elsewhere) not in json.dumps(json.loads((tmp_path / "c" / "ckptrepo.json").read_bytes()))


# ---- unbounded copies ----------------------------------------------------------------------------------------

def _array_dir(repo_path: Path, vid: str) -> Path:
    return repo_path / "data" / vid / "0" / "float32"


def test_clone_copies_only_the_objects_the_manifests_name(tmp_path: Path) -> None:
    src = _source(tmp_path / "src")
    tip = src.log()[0].id
    folder = _array_dir(tmp_path / "src", tip)
    for name in ("junk", "c/7"):   # not in the manifest's geometry: one shard of 64 elements, index 0 only
        with open(folder / name, "wb") as f:
            f.truncate(64 << 20)   # sparse: costs nothing here, and everything in a copy that reads it
    c = ckptrepo.clone(tmp_path / "src", tmp_path / "c")
    assert sorted(p.name for p in _array_dir(tmp_path / "c", tip).rglob("*")) == ["0", "c", "crc32c", "zarr.json"]
    assert torch.equal(c.load(tip)["w"], torch.arange(64, dtype=torch.float32) + 1)
    assert c.fsck().ok


def test_clone_refuses_a_shard_bigger_than_its_declared_geometry(tmp_path: Path) -> None:
    src = _source(tmp_path / "src")
    tip = src.log()[0].id
    with open(_array_dir(tmp_path / "src", tip) / "c" / "0", "r+b") as f:
        f.truncate(1 << 30)
    with pytest.raises(CkptRepoError) as err:
        ckptrepo.clone(tmp_path / "src", tmp_path / "c")
    msg = _one_line(err.value)
    assert "c/0" in msg and "bytes" in msg
    assert not (_array_dir(tmp_path / "c", tip) / "c" / "0").exists()



class FakeS3:
    """A hostile S3 endpoint on 127.0.0.1, served from a thread of the test: ``huge`` answers every object with a
    20 GiB body (honouring byte ranges, streaming zeros otherwise), ``silent`` accepts requests and never answers,
    ``trickle`` answers one byte every few seconds."""

    SIZE = 20 << 30

    def __init__(self, mode: str, trickle_s: float = 5.0) -> None:
        self.mode, self.trickle_s = mode, trickle_s
        self.stopped = threading.Event()
        self.streamed = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _drain(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                if n:
                    self.rfile.read(n)

            def do_PUT(self) -> None:
                self._drain()
                self.send_response(200)
                self.send_header("ETag", '"e"')
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_HEAD(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(fake.SIZE))
                self.send_header("ETag", '"e"')
                self.end_headers()

            def do_GET(self) -> None:
                if fake.mode == "silent":
                    fake.stopped.wait()
                    return
                if fake.mode == "trickle":
                    try:
                        for byte in b"HTTP/1.1 200 OK\r\n":
                            if fake.stopped.wait(fake.trickle_s):
                                return
                            self.wfile.write(bytes([byte]))
                            self.wfile.flush()
                    except OSError:   # the client gave up
                        pass
                    return
                if "list-type" in self.path:
                    body = b'<?xml version="1.0"?><ListBucketResult><IsTruncated>false</IsTruncated></ListBucketResult>'
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                ranged = self.headers.get("Range", "")
                if ranged.startswith("bytes="):
                    first, _, last = ranged[len("bytes="):].partition("-")
                    lo, hi = int(first), min(int(last) if last else fake.SIZE - 1, fake.SIZE - 1)
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {lo}-{hi}/{fake.SIZE}")
                    self.send_header("Content-Length", str(hi - lo + 1))
                    self.send_header("ETag", '"e"')
                    self.end_headers()
                    self.wfile.write(bytes(hi - lo + 1))
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(fake.SIZE))
                self.send_header("ETag", '"e"')
                self.end_headers()
                chunk = bytes(1 << 20)
                try:
                    while fake.streamed < fake.SIZE and not fake.stopped.is_set():
                        self.wfile.write(chunk)
                        fake.streamed += len(chunk)
                except OSError:
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeS3":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.server.shutdown()
        self.server.server_close()


# the child a fake endpoint is tried from: its address space capped, so a read that would take the machine's
# memory fails there instead; it prints its error (one line, or the traceback) and its peak resident memory
CLONE_CHILD = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
import ckptrepo
from ckptrepo.errors import CkptRepoError
t = time.monotonic()
try:
    ckptrepo.clone(sys.argv[1], sys.argv[2])
    print("cloned")
except CkptRepoError as err:
    print("error:", err)
print("seconds:", round(time.monotonic() - t, 1))
print("maxrss_mib:", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
"""


def _clone_from(endpoint: str, target: Path, timeout: float, **env: str) -> tuple[str, dict[str, float]]:
    environ = dict(os.environ, PYTHONPATH=str(ROOT), AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing",
                   AWS_SECRET_ACCESS_KEY="testing", AWS_REGION="us-east-1", **env)
    environ.pop("AWS_ENDPOINT_URL_S3", None)
    proc = subprocess.run([sys.executable, "-c", CLONE_CHILD, "s3://hostile-bucket/repo", str(target)],
                          capture_output=True, text=True, timeout=timeout, env=environ)
    figures = {}
    for line in proc.stdout.splitlines():
        name, _, value = line.partition(": ")
        if name in ("seconds", "maxrss_mib"):
            figures[name] = float(value)
    return proc.stdout + proc.stderr, figures


def test_clone_from_an_endpoint_that_answers_with_a_huge_body_stays_small(tmp_path: Path) -> None:
    with FakeS3("huge") as fake:
        out, figures = _clone_from(fake.endpoint, tmp_path / "c", timeout=120)
    assert "error:" in out and "Traceback" not in out, out
    assert "ckptrepo.json" in out and "hostile" in out, out
    assert figures["maxrss_mib"] < 1024, out
    assert fake.streamed < 1 << 30


# ---- symbolic links in a local remote ----------------------------------------------------------------------

@pytest.mark.parametrize("folder", ["data", "versions"])
def test_push_never_writes_through_a_link_in_the_remote(tmp_path: Path, folder: str) -> None:
    a = _source(tmp_path / "a", steps=1)
    a.remote_add("origin", str(tmp_path / "remote"))
    a.push()
    outside = tmp_path / "outside"
    shutil.move(tmp_path / "remote" / folder, outside)
    os.symlink(outside, tmp_path / "remote" / folder)
    before = sorted(p.relative_to(outside) for p in outside.rglob("*"))
    a.snapshot({"w": torch.zeros(64)}, step=9)

    with pytest.raises(CkptRepoError) as err:
        a.push()
    msg = _one_line(err.value)
    assert folder in msg and "symbolic link" in msg
    assert sorted(p.relative_to(outside) for p in outside.rglob("*")) == before


def test_clone_never_reads_a_file_through_a_link_in_the_source(tmp_path: Path) -> None:
    src = _source(tmp_path / "src")
    tip = src.log()[0].id
    secret = tmp_path / "secret"
    shard = _array_dir(tmp_path / "src", tip) / "c" / "0"
    secret.write_bytes(b"not the remote's: " + bytes(shard.stat().st_size - 18))
    shard.unlink()
    os.symlink(secret, shard)

    with pytest.raises(CkptRepoError) as err:
        ckptrepo.clone(tmp_path / "src", tmp_path / "c")
    msg = _one_line(err.value)
    assert "c/0" in msg and "symbolic link" in msg
    assert not any(b"not the remote's" in p.read_bytes() for p in (tmp_path / "c").rglob("*") if p.is_file())


# ---- damaged remotes -----------------------------------------------------------------------------------------

def _damage(src: Path, how: str, ids: list[str]) -> None:
    missing = "0" * 16 + ids[0][16:]   # a well-formed id the source does not hold
    if how == "branch at a missing version":
        (src / "refs" / "heads" / "ghost").write_text(missing)
    elif how == "detached HEAD at a missing version":
        (src / "HEAD").write_text(missing)
    elif how == "cyclic parents":
        from ckptrepo.core._manifest import VERSIONS_PREFIX, seal, unseal
        key = src / (VERSIONS_PREFIX + ids[-1])   # the root names the tip as its parent
        body = unseal(key.read_bytes(), VERSIONS_PREFIX + ids[-1])
        body["parents"] = [ids[0]]
        key.write_bytes(seal(body))


@pytest.mark.parametrize("how", ["branch at a missing version", "detached HEAD at a missing version",
                                 "cyclic parents"])
def test_clone_refuses_a_damaged_source_and_writes_nothing(tmp_path: Path, how: str) -> None:
    src = _source(tmp_path / "src", steps=3)
    _damage(tmp_path / "src", how, [v.id for v in src.log()])
    proc = _cli("clone", str(tmp_path / "src"), str(tmp_path / "c"))
    assert proc.returncode != 0
    msg = _one_line(proc.stderr)
    assert "is damaged" in msg and "fsck" in msg, msg
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_clone_refuses_refs_that_are_folders_of_each_other(s3_url: str, tmp_path: Path) -> None:
    from ckptrepo.storage import open_store
    src = _source(s3_url, steps=1)
    tip = src.log()[0].id
    store = open_store(s3_url)
    store.put("refs/heads/a", tip.encode())
    store.put("refs/heads/a/b", tip.encode())
    with pytest.raises(CkptRepoError) as err:
        ckptrepo.clone(s3_url, tmp_path / "c")
    msg = _one_line(err.value)
    assert "'a'" in msg and "'a/b'" in msg and "is damaged" in msg
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


# ---- interrupted clones ---------------------------------------------------------------------------------------

KILLED_CLONE = """
import os, signal, sys
import ckptrepo
from ckptrepo import faults
faults.set_hook("push_after_manifest", lambda _: os.kill(os.getpid(), signal.SIGKILL))
ckptrepo.clone(sys.argv[1], sys.argv[2])
"""


def test_a_killed_clone_is_named_by_fsck_and_finished_by_the_same_clone(tmp_path: Path) -> None:
    src = _source(tmp_path / "src", steps=3)
    target = tmp_path / "c"
    proc = subprocess.run([sys.executable, "-c", KILLED_CLONE, str(tmp_path / "src"), str(target)],
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120, capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    assert (target / "versions").is_dir()

    for args in (("fsck",), ("log",)):
        out = _cli("--repo", str(target), *args)
        assert out.returncode != 0
        assert "Traceback" not in out.stdout + out.stderr
        lines = [line for line in (out.stdout + out.stderr).splitlines() if "interrupted clone" in line]
        assert len(lines) == 1 and f"ckptrepo clone {tmp_path / 'src'} {target}" in lines[0], out
        assert "does not exist" not in out.stdout + out.stderr   # not called a lost HEAD branch

    again = _cli("clone", str(tmp_path / "src"), str(target))
    assert again.returncode == 0, again.stderr
    c = ckptrepo.open(target)
    assert [v.id for v in c.log()] == [v.id for v in src.log()]
    assert c.current_branch() == "main" and c.fsck().ok
    assert torch.equal(c.load("HEAD")["w"], torch.arange(64, dtype=torch.float32) + 2)
    assert _cli("clone", str(tmp_path / "src"), str(target)).returncode != 0   # done: a clone again is refused


# ---- the config's size -----------------------------------------------------------------------------------------

def test_remote_add_refuses_a_url_that_would_outgrow_the_config(tmp_path: Path) -> None:
    _source(tmp_path / "a", steps=1)
    before = (tmp_path / "a" / "ckptrepo.json").read_bytes()
    out = _cli("--repo", str(tmp_path / "a"), "remote", "add", "origin", "/" + "x" * (70 << 10))
    assert out.returncode != 0
    assert "URL" in _one_line(out.stderr)
    assert (tmp_path / "a" / "ckptrepo.json").read_bytes() == before
    assert _cli("--repo", str(tmp_path / "a"), "log").returncode == 0


def test_repair_config_shrinks_an_oversized_config(tmp_path: Path) -> None:
    a = _source(tmp_path / "a", steps=1)
    a.remote_add("origin", str(tmp_path / "remote"))
    _set_config(tmp_path / "a", remotes={"origin": {"url": str(tmp_path / "remote")},
                                         "huge": {"url": "/" + "x" * (70 << 10)}})
    broken = _cli("--repo", str(tmp_path / "a"), "log")
    assert broken.returncode != 0 and "--repair-config" in _one_line(broken.stderr)

    out = _cli("--repo", str(tmp_path / "a"), "fsck", "--repair-config")
    assert "intact" not in out.stdout and "huge" in out.stdout, out
    assert (tmp_path / "a" / "ckptrepo.json").stat().st_size < 64 << 10
    fixed = ckptrepo.open(tmp_path / "a")
    assert fixed.remotes() == {"origin": str(tmp_path / "remote")}
    assert len(fixed.log()) == 1 and fixed.fsck().ok


# ---- endpoints that stall --------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["silent", "trickle"])
def test_clone_from_a_stalling_endpoint_ends_at_the_store_timeout(tmp_path: Path, mode: str) -> None:
    with FakeS3(mode, trickle_s=1.0) as fake:
        out, figures = _clone_from(fake.endpoint, tmp_path / "c", timeout=60, CKPTREPO_STORE_TIMEOUT="3")
    assert "error:" in out and "Traceback" not in out, out
    assert "CKPTREPO_STORE_TIMEOUT" in out, out
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


# ---- keys that are no object names ----------------------------------------------------------------------------

def test_clone_leaves_dot_dot_keys_on_an_s3_source_alone(s3_url: str, tmp_path: Path) -> None:
    import boto3
    src = _source(s3_url, steps=1)
    tip = src.log()[0].id
    bucket, _, prefix = s3_url[len("s3://"):].partition("/")
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")
    for rest in ("..", "c/..", "../float32/c/0", "c/../0"):
        client.put_object(Bucket=bucket, Key=f"{prefix}/data/{tip}/0/float32/{rest}", Body=b"hostile")
    c = ckptrepo.clone(s3_url, tmp_path / "c")
    assert torch.equal(c.load(tip)["w"], torch.arange(64, dtype=torch.float32))
    assert not any(b"hostile" in p.read_bytes() for p in (tmp_path / "c").rglob("*") if p.is_file())
    assert c.fsck().ok


def test_clone_never_downloads_an_oversized_object_whole(s3_proxy, s3_url: str, tmp_path: Path) -> None:
    from ckptrepo.storage import open_store
    src = _source(s3_url, steps=1)
    open_store(s3_url).put("refs/heads/big", src.log()[0].id.encode() + bytes(1 << 20))
    reads: list[dict[str, str]] = []
    s3_proxy.before_forward = lambda r: reads.append(r.headers) if r.method == "GET" and r.path.endswith(
        "/refs/heads/big") else None
    with pytest.raises(CkptRepoError) as err:
        ckptrepo.clone(s3_url, tmp_path / "c")
    assert "refs/heads/big" in _one_line(err.value)
    assert reads and all("range" in h for h in reads), reads   # asked for a byte past the bound, never the whole
