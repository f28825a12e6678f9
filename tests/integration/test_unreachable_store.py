"""A store that cannot be reached, or a bucket that does not exist, gives a prompt one-line StorageError: never
a hang, never a false report of corruption. TensorStore's own retry policy kept a request to a dead S3 endpoint
going for ~15 minutes, and a load whose endpoint went away used to call its objects corrupt and send the user to
fsck."""
from __future__ import annotations

import socket
import time
import uuid

import pytest
import torch
from support.helpers import run

import ckptrepo
import ckptrepo.loading._engine
import ckptrepo.maintenance._fsck
import ckptrepo.storage._arrays
from ckptrepo.errors import CorruptionError, StorageError
from ckptrepo.storage import open_store
from ckptrepo.storage._tensorstore import DEFAULT_STORE_RETRIES


def _closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def dead_endpoint(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("CKPTREPO_STORE_RETRIES", "2")


def test_the_cli_on_an_unreachable_endpoint_fails_within_seconds_saying_what_to_check(dead_endpoint):
    t0 = time.monotonic()
    r = run("log", repo="s3://no-such-bucket/repo")
    took = time.monotonic() - t0
    assert r.returncode == 2 and r.stdout == ""
    line = r.stderr.strip()
    assert "\n" not in line and "retry attempts failed" in line and "AWS_ENDPOINT_URL" in line, line
    assert "CKPTREPO_STORE_RETRIES" in line and "tensorstore_spec" not in line, line
    assert took < 30, f"{took:.1f}s: the retries were not bounded"


def test_an_endpoint_that_accepts_and_never_answers_is_given_up_on(tmp_path):
    """A hung proxy or stalled server (the connection accepted, no byte ever sent) held `ckptrepo log` for ~10
    minutes: each of the 9 tries waited out curl's 60-second stall limit. A request that gets no byte for
    STALLED_REQUEST_S (15 s; 2 s here) is given up. Run as a process of its own: TensorStore reads the limit
    when its HTTP transport starts."""
    import os
    import subprocess
    import sys
    import threading
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held = []

    def hold_connections():
        try:
            while True:
                held.append(server.accept()[0])   # read nothing, answer nothing
        except OSError:   # closed at the end of the test
            return
    threading.Thread(target=hold_connections, daemon=True).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TENSORSTORE_CURL_", "AWS_"))}
    env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_REGION="us-east-1",
               AWS_ENDPOINT_URL=f"http://127.0.0.1:{server.getsockname()[1]}", CKPTREPO_STORE_RETRIES="1",
               HOME=str(tmp_path))
    code = ("import sys, ckptrepo.storage._tensorstore as s; s.STALLED_REQUEST_S = 2\n"
            "sys.argv = ['ckptrepo', '--repo', 's3://bucket/r', 'log']\n"
            "from ckptrepo.cli.main import main; main()")
    t0 = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    finally:
        server.close()
    took = time.monotonic() - t0
    assert out.returncode == 2 and "Operation too slow" in out.stderr, out
    assert took < 30, f"{took:.1f}s: a stalled request was not given up"


def test_every_s3_and_gcs_request_gets_a_bounded_retry_policy(monkeypatch):
    """The default (no environment variable) and the override, as bound into the store's context."""
    monkeypatch.delenv("CKPTREPO_STORE_RETRIES", raising=False)
    for url, resource in (("s3://bucket-a/repo", "s3_request_retries"), ("gs://bucket-a/repo", "gcs_request_retries")):
        bound = open_store(url).context.spec.to_json()[resource]
        assert bound == {"max_retries": DEFAULT_STORE_RETRIES, "initial_delay": "500ms", "max_delay": "8s"}, bound
    assert DEFAULT_STORE_RETRIES <= 10   # at most 0.5+1+2+4+8*6 s of backoff before a dead endpoint is reported
    monkeypatch.setenv("CKPTREPO_STORE_RETRIES", "3")
    assert open_store("s3://bucket-a/repo").context.spec.to_json()["s3_request_retries"]["max_retries"] == 3
    monkeypatch.setenv("CKPTREPO_STORE_RETRIES", "soon")
    with pytest.raises(StorageError, match="CKPTREPO_STORE_RETRIES='soon' is not a whole number"):
        open_store("s3://bucket-a/repo")


class VanishingS3:
    """A moto server of the test's own on 127.0.0.1, and a way to stop it at the first array a read opens:
    just before that open, or just after it (before the bytes are read)."""

    def __init__(self, monkeypatch) -> None:
        import boto3
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        self.stopped = False
        host, port = self.server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        for k, v in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                     ("AWS_REGION", "us-east-1"), ("AWS_ENDPOINT_URL", endpoint), ("CKPTREPO_STORE_RETRIES", "2")):
            monkeypatch.setenv(k, v)
        monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        bucket = f"going-away-{uuid.uuid4().hex[:12]}"   # moto's buckets live in this process, across servers
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        self.url = f"s3://{bucket}/repo"
        self.monkeypatch = monkeypatch

    def stop(self) -> None:
        if not self.stopped:
            self.server.stop()
            self.stopped = True

    def stop_at_first_open(self, before: bool) -> None:
        original = ckptrepo.storage._arrays.open_array

        def open_then_stop(store, info):
            if before:
                self.stop()
            handle = original(store, info)
            self.stop()
            return handle

        # where it is called: the load engine and fsck each hold the name
        self.monkeypatch.setattr(ckptrepo.loading._engine, "open_array", open_then_stop)
        self.monkeypatch.setattr(ckptrepo.maintenance._fsck, "open_array", open_then_stop)


@pytest.fixture
def vanishing_s3(monkeypatch):
    pytest.importorskip("moto")
    s3 = VanishingS3(monkeypatch)
    try:
        yield s3
    finally:
        s3.stop()


def _assert_a_storage_failure(err: BaseException) -> None:
    msg = str(err)
    assert isinstance(err, StorageError) and not isinstance(err, CorruptionError), repr(err)
    assert "\n" not in msg and "fsck" not in msg and "corrupt" not in msg, msg
    assert "retry attempts failed" in msg and "CKPTREPO_STORE_RETRIES" in msg, msg


@pytest.mark.parametrize("path", ["whole", "resharding"])
@pytest.mark.parametrize("stop_before", ["open", "read"])
def test_a_load_whose_endpoint_goes_away_is_a_storage_error_not_corruption(vanishing_s3, path, stop_before):
    """Both read paths must say the store failed, naming nothing as damaged."""
    from support.dist_workers import SPLIT_RULES, split_state

    from ckptrepo.parallel.layout import ParallelLayout

    repo = ckptrepo.init(vanishing_s3.url)
    if path == "whole":
        vid = repo.snapshot({"w": torch.randn(300, 100)}, step=1).id
        load = lambda: repo.load(vid)  # noqa: E731
    else:
        layout = ParallelLayout(rules=SPLIT_RULES)
        vid = repo.snapshot({"model": split_state(5)}, step=1, parallel_layout=layout).id
        into = {"model": {"col.weight": torch.empty(4096, 256)}}
        load = lambda: repo.load(vid, parallel_layout=ParallelLayout(tp=2, rules=SPLIT_RULES),  # noqa: E731
                                 rank=0, into=into)
    repo.plumbing.manifest(vid)   # resolved while the server is up: what fails is the data
    vanishing_s3.stop_at_first_open(before=stop_before == "open")
    with pytest.raises(StorageError) as info:
        load()
    assert vanishing_s3.stopped
    _assert_a_storage_failure(info.value)


@pytest.mark.parametrize("stop_before", ["open", "read"])
def test_fsck_stops_with_a_storage_error_when_the_endpoint_goes_away(vanishing_s3, stop_before):
    """fsck reports damage and never raises for it; a store that stops answering is not damage."""
    repo = ckptrepo.init(vanishing_s3.url)
    repo.snapshot({"w": torch.randn(300, 100)}, step=1)
    vanishing_s3.stop_at_first_open(before=stop_before == "open")
    with pytest.raises(StorageError) as info:
        repo.fsck()
    assert vanishing_s3.stopped
    _assert_a_storage_failure(info.value)
    # after the open, fsck lists the array's shards before it reads one (declared sizes against stored ones)
    what = "opening array data/" if stop_before == "open" else "storage error while listing data/"
    assert str(info.value).startswith(what), str(info.value)   # where it stopped, not a later request


def test_init_in_a_bucket_that_does_not_exist_says_so(s3_endpoint):
    """TensorStore answers a conditional write into a missing bucket as a failed condition, which init took
    for an existing repository ("a repository already exists ... open it")."""
    url = f"s3://no-such-bucket-{uuid.uuid4().hex[:12]}/repo"
    with pytest.raises(StorageError) as info:
        ckptrepo.init(url)
    msg = str(info.value)
    assert "NoSuchBucket" in msg and "check that the bucket exists" in msg, msg
    assert "already exists" not in msg and "http_response_body" not in msg and "\n" not in msg, msg
    r = run("init", url)
    assert r.returncode == 2 and "NoSuchBucket" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_the_store_deadline_grows_with_the_bytes_an_operation_moves(s3_url, monkeypatch):
    """CKPTREPO_STORE_TIMEOUT bounds an S3 operation; one that moves a known number of bytes (a shard's write
    or ranged read) gets that much more time at MIN_STORE_RATE, so a large shard on a slow link still goes
    through while an answer that never comes is still given up."""
    import threading
    from concurrent.futures import Future

    from ckptrepo.storage import _tensorstore

    monkeypatch.setenv("CKPTREPO_STORE_TIMEOUT", "0.5")
    store = _tensorstore.TensorStoreStore.open(s3_url)

    timers: list[threading.Timer] = []

    def answered_after(seconds: float) -> Future:
        fut: Future = Future()
        timers.append(threading.Timer(seconds, lambda: fut.cancelled() or fut.set_result("done")))
        timers[-1].start()
        return fut

    assert store._wait(answered_after(1.0), nbytes=_tensorstore.MIN_STORE_RATE) == "done"   # 0.5 s + 1 s
    with pytest.raises(_tensorstore._TimedOut, match="CKPTREPO_STORE_TIMEOUT"):
        store._wait(answered_after(1.0))
    for t in timers:
        t.join()
