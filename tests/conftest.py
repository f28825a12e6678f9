"""Shared fixtures: repositories on every backend, including S3 through moto's server on 127.0.0.1; the suite's
time limits, and what pytest-xdist's workers need to run tests as one process does."""
from __future__ import annotations

import multiprocessing
import os
import signal
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

import ckptrepo

# A run started in the background (`pytest &`, nohup) inherits SIGINT ignored, and Python then installs no
# KeyboardInterrupt handler, nor do the processes the tests start. The tests of Ctrl-C need what a terminal gives.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 API: moto's threaded server on 127.0.0.1 (a free port), stopped at the end."""
    pytest.importorskip("moto")
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                            "AWS_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")}
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                      AWS_REGION="us-east-1", AWS_ENDPOINT_URL=endpoint)
    os.environ.pop("AWS_ENDPOINT_URL_S3", None)
    try:
        yield endpoint
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_url(s3_endpoint):
    """A fresh bucket on the moto server; returns the repository URL inside it."""
    import boto3

    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    return f"s3://{bucket}/repo"


@pytest.fixture
def s3_proxy(s3_endpoint, monkeypatch):
    """A proxy in front of the moto server (tests/support/s3proxy.py), in ``"atomic"`` mode until a test sets another;
    AWS_ENDPOINT_URL points at it for the test, so every store opened meanwhile goes through it."""
    from support.s3proxy import S3Proxy

    proxy = S3Proxy(s3_endpoint, mode="atomic").start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture
def atomic_s3_url(s3_proxy, s3_url):
    """A repository URL on an S3 server whose conditional writes are atomic, as AWS promises: moto behind
    the proxy that serialises writes per key."""
    s3_proxy.mode = "atomic"
    return s3_url


@pytest.fixture
def strip_s3_url(s3_proxy, s3_url):
    """A repository URL on an S3 server that ignores If-Match/If-None-Match: moto behind the proxy that strips
    them, as some S3-compatible gateways do."""
    s3_proxy.mode = "strip"
    return s3_url


@pytest.fixture(params=["file", "memory", "s3"])
def repo_url(request, tmp_path):
    """A URL for a new repository on each backend."""
    if request.param == "file":
        return str(tmp_path / "repo")
    if request.param == "memory":
        return f"memory://{uuid.uuid4().hex}"
    return request.getfixturevalue("s3_url")


@pytest.fixture
def repo(tmp_path) -> ckptrepo.Repository:
    """A fresh local-directory repository."""
    return ckptrepo.init(str(tmp_path / "repo"))


DISTRIBUTED = Path(__file__).resolve().parent / "distributed"
DISTRIBUTED_TIMEOUT = 600   # seconds per test under tests/distributed/; the others get pyproject.toml's `timeout`


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/distributed/ starts processes (gloo ranks, torchrun) and takes most of the suite's
    time: it is marked ``slow`` so that ``-m "not slow"`` gives a quick run, and gets a longer timeout than the
    rest, which a test's own ``timeout`` mark overrides."""
    for item in items:
        if item.path.is_relative_to(DISTRIBUTED):
            item.add_marker(pytest.mark.slow)
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(DISTRIBUTED_TIMEOUT))


def xdist_scope(nodeid: str) -> str:
    """The unit of work a pytest-xdist worker takes whole: tests/distributed/ as one (each of its tests fills
    the cores with its ranks, so they run one at a time, beside the rest), else a test's file (its module
    fixtures are built once; the damage matrix runs every case the session collected in its first test)."""
    path = nodeid.split("::", 1)[0]   # relative to the rootdir, which need not be the repository's root
    return "tests/distributed" if "distributed" in path.split("/")[:-1] else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``-n``, units of work by ``xdist_scope``, handed out in collection order (tests/distributed/,
    the longest, first) rather than largest count first."""
    if config.getvalue("dist") != "load":   # what `-n` alone gives; another `--dist` is the caller's choice
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ScopeScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    config.option.loadscopereorder = False
    return ScopeScheduling(config, log)


@pytest.fixture(autouse=True)
def _no_stray_processes() -> Iterator[None]:
    """Kill the worker processes a test leaves running: a test failed by its timeout stops before it joins
    them, and a live non-daemon child would hold the interpreter's exit (and so CI) until it ends."""
    before = set(multiprocessing.active_children())
    yield
    for proc in multiprocessing.active_children():
        if proc not in before:
            proc.kill()
            proc.join(30)


TERMINAL_VARIABLES = ("COLUMNS", "LINES")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """pytest-xdist's controller: hand each worker the terminal variables as ``os.environ`` has them here.
    Importing readline (pdb does) writes COLUMNS and LINES into the C environment, which workers inherit,
    and not into ``os.environ``: a worker would cut the CLI's output to 80 columns where one process does
    not."""
    node.workerinput["terminal_env"] = {name: os.environ.get(name) for name in TERMINAL_VARIABLES}


def pytest_configure(config: pytest.Config) -> None:
    """In a pytest-xdist worker: the controller's terminal variables, and torch's intra-op threads cut to
    this worker's share of the cores (OpenMP threads of several workers spinning on the same cores slow
    every one of them down)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return
    for name, value in workerinput.get("terminal_env", {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workerinput["workercount"])))
