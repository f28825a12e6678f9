"""Training that never waits for S3: a local tier against snapshots straight to S3, and DCP plus an upload.

One GPT-style model (examples/tiny_gpt.py, as in training_overhead.py) with AdamW trains on random tokens
on the CPU; the same loop (same seed, same batches) runs once per mode, all in one process, against one
moto S3 server this script starts on 127.0.0.1:

* ``none``         no checkpoint (the baseline; run first and again at the end)
* ``local``        ``repo.snapshotter()`` on a local directory, nothing pushed: the local disk alone
* ``s3``           ``repo.snapshotter()`` on ``s3://bucket/direct``: straight to the object store
* ``tier``         ``repo.snapshotter(push_to="origin", local_keep_last=K)`` on a local directory whose
                   remote ``origin`` is ``s3://bucket/tier``: committed locally, pushed in the background
* ``dcp+upload``   ``dcp.async_save`` to a local directory, then, once it is written, its files uploaded
                   with boto3 ``upload_file`` by one background thread (the future of the previous save is
                   waited on before the next, as DCP's examples do)

The snapshotters have the optimizer attached (its step waits for capture). A checkpoint is taken after
every ``--every``-th step of ``--steps``; each mode first runs ``--warmup`` steps and one drained checkpoint.

Reported per mode:

* overhead/ckpt: (the loop's wall - the baseline's) / checkpoints, the loop ending at its last step (what
  the training loop pays; the tail of the last checkpoint is not in it)
* on remote/ckpt: from asking for a checkpoint until the remote holds it: the commit for ``s3``, the
  remote-tracking ref moving (polled every 5 ms) for ``tier``, the upload's end for ``dcp+upload``; for
  ``local``, until committed locally
* drain: after the loop, until every checkpoint is on the remote (committed, for ``local``)
* extra CPU/ckpt: this process's CPU seconds (all threads) beyond the baseline's during the loop, and
  moto's server's CPU seconds during the loop, per checkpoint. On a machine of few cores the server's CPU
  (which a real object store spends elsewhere) is taken from the training loop, and shows in its overhead

Then the upload throughput of the same bytes through the S3 API: ``repo.push`` of one version of the local
repository to a fresh prefix, and boto3 ``upload_file`` (default TransferConfig: multipart, 10 threads) of
that version's data files, one after the other. moto is slow; the ratio is what counts.

    python benchmarks/tiers.py                       # ~200 MB state, 12 steps, every 3
    python benchmarks/tiers.py --model-mb 300 --steps 16 --every 4 --json out.json
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import figure, report  # noqa: E402
from training_overhead import Trainer, choose_embd, dcp_setup, free_port  # noqa: E402

import ckptrepo  # noqa: E402

MODES = ("none", "local", "s3", "tier", "dcp+upload")
MB = 1e6


# ---------------------------------------------------------------- moto

def start_moto(niceness: int = 0) -> tuple[subprocess.Popen, str]:
    """moto's S3 server on 127.0.0.1 (a free port), in a process of its own so that it does not share this
    one's GIL with the training loop, and the environment ckptrepo and boto3 read. ``niceness`` > 0 models an
    object store on other machines: the server then runs on the CPU training leaves, not on training's."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              preexec_fn=(lambda: os.nice(niceness)) if niceness else None)
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.time() > deadline or server.poll() is not None:
                server.kill()
                raise RuntimeError("moto's server did not start (pip install 'moto[server]')") from None
            time.sleep(0.1)
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                      AWS_REGION="us-east-1", AWS_ENDPOINT_URL=endpoint)
    os.environ.pop("AWS_ENDPOINT_URL_S3", None)
    return server, endpoint


def s3_client(endpoint: str) -> Any:
    import boto3
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


def new_bucket(client: Any) -> str:
    bucket = f"bench-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    return bucket


def drop_bucket(client: Any, bucket: str) -> None:
    """Delete a bucket and its objects (moto holds them in memory)."""
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys})
    client.delete_bucket(Bucket=bucket)


# ---------------------------------------------------------------- modes

class Mode:
    """One way to checkpoint: ``checkpoint`` in the loop, ``drain`` until everything is on the remote."""

    name = "none"

    def __init__(self, trainer: Trainer, root: str, args: argparse.Namespace, endpoint: str) -> None:
        self.trainer, self.root, self.args, self.endpoint = trainer, root, args, endpoint
        self.asked: list[float] = []
        self.remote_at: list[float] = []

    def checkpoint(self, i: int) -> None:
        pass

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass

    def reset(self) -> None:
        self.asked.clear()
        self.remote_at.clear()

    def to_remote(self) -> list[float]:
        return [r - a for a, r in zip(self.asked, self.remote_at)]


class Snapshots(Mode):
    """A snapshotter on ``self.url()``; the time a version reaches the remote is its commit."""

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.repo = self.make_repo()
        self.snap = self.make_snapshotter()
        self.snap.attach(self.trainer.opt)
        self.handles: list[Any] = []

    def make_repo(self) -> ckptrepo.Repository:
        return ckptrepo.init(os.path.join(self.root, "repo"))

    def make_snapshotter(self) -> Any:
        return self.repo.snapshotter(host_memory=self.args.host_memory)

    def checkpoint(self, i: int) -> None:
        self.asked.append(time.perf_counter())
        self.handles.append(self.snap.snapshot({"model": self.trainer.model, "optimizer": self.trainer.opt},
                                               step=i))

    def drain(self) -> None:
        self.snap.wait(progress=False)

    def close(self) -> None:
        self.snap.close()

    def reset(self) -> None:
        super().reset()
        self.handles.clear()

    def to_remote(self) -> list[float]:
        return [h.stats.total_s for h in self.handles]


class Local(Snapshots):
    name = "local"


class DirectS3(Snapshots):
    name = "s3"

    def make_repo(self) -> ckptrepo.Repository:
        self.bucket = new_bucket(s3_client(self.endpoint))
        return ckptrepo.init(f"s3://{self.bucket}/direct")


class Tier(Snapshots):
    name = "tier"

    def make_repo(self) -> ckptrepo.Repository:
        self.bucket = new_bucket(s3_client(self.endpoint))
        repo = ckptrepo.init(os.path.join(self.root, "repo"))
        repo.remote_add("origin", f"s3://{self.bucket}/tier")
        self.arrived: dict[str, float] = {}
        self._stop = threading.Event()
        # a handle of its own: the snapshotter's threads use the repository's
        self._watch = threading.Thread(target=self._poll, args=(ckptrepo.open(repo.plumbing.url),), daemon=True)
        self._watch.start()
        return repo

    def make_snapshotter(self) -> Any:
        return self.repo.snapshotter(host_memory=self.args.host_memory, push_to="origin",
                                     local_keep_last=self.args.keep_last)

    def _poll(self, repo: ckptrepo.Repository) -> None:
        """When each version reaches the remote: the remote-tracking ref moving past it, read as a plain file
        every 5 ms (cheap: the loop's CPU is what is measured)."""
        ref = os.path.join(self.root, "repo", "refs", "remotes", "origin", "main")
        seen = None
        while not self._stop.is_set():
            try:
                with open(ref) as f:
                    tip: str | None = f.read().strip()
            except OSError:
                tip = None
            if tip and tip != seen:
                now = time.perf_counter()
                vid: str | None = tip
                while vid is not None and vid not in self.arrived:
                    self.arrived[vid] = now
                    parents = repo.plumbing.header(vid).parents
                    vid = parents[0] if parents else None
                seen = tip
            time.sleep(0.005)

    def drain(self) -> None:
        self.snap.wait(progress=False)   # the remote holds every version once it returns
        last = self.handles[-1].id if self.handles else None
        while last is not None and last not in self.arrived:
            time.sleep(0.005)

    def close(self) -> None:
        super().close()
        self._stop.set()
        self._watch.join()

    def to_remote(self) -> list[float]:
        return [self.arrived[h.id] - a for h, a in zip(self.handles, self.asked)]


class DcpUpload(Mode):
    name = "dcp+upload"

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.client = s3_client(self.endpoint)
        self.bucket = new_bucket(self.client)
        self.uploader = ThreadPoolExecutor(1)
        self.prev: Any = None
        self.uploads: list[Any] = []

    def checkpoint(self, i: int) -> None:
        import torch.distributed.checkpoint as dcp
        t0 = time.perf_counter()
        if self.prev is not None:
            self.prev.result()
        path = os.path.join(self.root, f"step{i:06d}")
        fut = dcp.async_save(self.trainer.state_dicts(), storage_writer=dcp.FileSystemWriter(path, sync_files=True))
        idx = len(self.asked)
        self.asked.append(t0)
        self.remote_at.append(float("nan"))
        done = threading.Event()

        def upload() -> None:
            done.wait()
            for name in sorted(os.listdir(path)):
                self.client.upload_file(os.path.join(path, name), self.bucket, f"dcp/step{i:06d}/{name}")
            self.remote_at[idx] = time.perf_counter()
        self.uploads.append(self.uploader.submit(upload))
        fut.add_done_callback(lambda _f: done.set())
        self.prev = fut

    def drain(self) -> None:
        if self.prev is not None:
            self.prev.result()
        for u in self.uploads:
            u.result()

    def close(self) -> None:
        self.uploader.shutdown()

    def reset(self) -> None:
        super().reset()
        self.uploads.clear()


MODE_CLASSES = {"none": Mode, "local": Local, "s3": DirectS3, "tier": Tier, "dcp+upload": DcpUpload}


# ---------------------------------------------------------------- running

def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used, from /proc (0 where there is none)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def run_mode(name: str, trainer: Trainer, args: argparse.Namespace, endpoint: str, moto_pid: int) -> dict[str, Any]:
    root = tempfile.mkdtemp(dir=args.dir, prefix=name.replace("+", "-") + "-")
    mode = MODE_CLASSES[name](trainer, root, args, endpoint)
    try:
        for _ in range(args.warmup):
            trainer.step()
        if name != "none":
            mode.checkpoint(0)
            mode.drain()
            mode.reset()
        t0 = time.perf_counter()
        cpu0, moto0 = proc_cpu_s(os.getpid()), proc_cpu_s(moto_pid)
        ckpts = 0
        for i in range(args.steps):
            trainer.step()
            if i % args.every == args.every - 1:
                mode.checkpoint(i + 1)
                ckpts += 1
        loop = time.perf_counter() - t0
        cpu, moto = proc_cpu_s(os.getpid()) - cpu0, proc_cpu_s(moto_pid) - moto0
        t1 = time.perf_counter()
        mode.drain()
        drain = time.perf_counter() - t1
        out = {"mode": name, "loop_s": loop, "drain_s": drain, "checkpoints": ckpts, "cpu_s": cpu, "moto_cpu_s": moto,
               "to_remote_s": mode.to_remote()}
        mode.close()
        if name == "tier":
            out["local_versions_with_data"] = len({k.split("/")[1] for k in mode.repo.plumbing.store.list("data/")})
        return out
    finally:
        if isinstance(mode, (DirectS3, Tier, DcpUpload)):
            drop_bucket(s3_client(endpoint), mode.bucket)
        shutil.rmtree(root, ignore_errors=True)


def upload_throughput(trainer: Trainer, args: argparse.Namespace, endpoint: str) -> dict[str, Any]:
    """``repo.push`` of one version to an empty remote, against boto3 ``upload_file`` of its data files."""
    root = tempfile.mkdtemp(dir=args.dir, prefix="upload-")
    client = s3_client(endpoint)
    try:
        repo = ckptrepo.init(os.path.join(root, "repo"))
        repo.snapshot({"model": trainer.model, "optimizer": trainer.opt}, step=0)
        vid = repo.plumbing.head_version()
        data = os.path.join(root, "repo", "data", vid)
        files = [os.path.join(d, f) for d, _, fs in os.walk(data) for f in fs]
        nbytes = sum(os.path.getsize(f) for f in files)
        out: dict[str, Any] = {"bytes": nbytes, "objects": len(files)}
        for turn in range(args.upload_repeat):
            bucket = new_bucket(client)
            repo.remote_add(f"r{turn}", f"s3://{bucket}/push")
            t0 = time.perf_counter()
            res = repo.push(f"r{turn}")
            out.setdefault("push_s", []).append(time.perf_counter() - t0)
            out["push_bytes"] = res.bytes
            drop_bucket(client, bucket)
            bucket = new_bucket(client)
            t0 = time.perf_counter()
            for f in files:
                client.upload_file(f, bucket, os.path.relpath(f, root))
            out.setdefault("boto3_s", []).append(time.perf_counter() - t0)
            drop_bucket(client, bucket)
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def summarize(results: list[dict[str, Any]], upload: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    base = min(r["loop_s"] for r in results if r["mode"] == "none")
    base_cpu = min(r["cpu_s"] for r in results if r["mode"] == "none")
    rows = []
    for r in results:
        if r["mode"] == "none":
            continue
        rows.append({"mode": r["mode"], "overhead_s": (r["loop_s"] - base) / r["checkpoints"],
                     "to_remote_s": statistics.mean(r["to_remote_s"]) if r["to_remote_s"] else float("nan"),
                     "drain_s": r["drain_s"], "checkpoints": r["checkpoints"],
                     "extra_cpu_s": (r["cpu_s"] - base_cpu) / r["checkpoints"],
                     "moto_cpu_s": r["moto_cpu_s"] / r["checkpoints"],
                     **({"local_versions_with_data": r["local_versions_with_data"]}
                        if "local_versions_with_data" in r else {})})
    push_s, boto_s = min(upload["push_s"]), min(upload["boto3_s"])
    return {"meta": meta, "baseline_loop_s": base, "rows": rows, "runs": results,
            "upload": {**upload, "push_MBps": upload["bytes"] / push_s / MB,
                       "boto3_MBps": upload["bytes"] / boto_s / MB}}


def print_table(s: dict[str, Any]) -> None:
    m = s["meta"]
    print(f"\nstate {m['state_mb']:.0f} MB, {m['steps']} steps, a checkpoint every {m['every']}, baseline loop "
          f"{s['baseline_loop_s']:.1f} s, local_keep_last={m['keep_last']}")
    print("| mode | overhead s/ckpt | on remote s/ckpt | drain s | extra CPU-s/ckpt | moto CPU-s/ckpt |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in s["rows"]:
        remote = figure(r["to_remote_s"]) + (" (local)" if r["mode"] == "local" else "")
        print(f"| {r['mode']} | {figure(r['overhead_s'])} | {remote} | {figure(r['drain_s'], '{:.2f}')} | "
              f"{figure(r['extra_cpu_s'])} | {figure(r['moto_cpu_s'])} |")
    rows = {r["mode"]: r for r in s["rows"]}
    if "tier" in rows and "local" in rows and rows["local"]["overhead_s"] > 0:
        print(f"\ntier overhead / local overhead: {rows['tier']['overhead_s'] / rows['local']['overhead_s']:.2f}")
    u = s["upload"]
    print(f"\nupload of {u['bytes'] / MB:.0f} MB in {u['objects']} objects: repo.push {u['push_MBps']:.0f} MB/s, "
          f"boto3 upload_file {u['boto3_MBps']:.0f} MB/s (ratio {u['push_MBps'] / u['boto3_MBps']:.2f})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12, help="timed training steps per mode")
    p.add_argument("--every", type=int, default=3, help="a checkpoint after every N-th step")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before each mode")
    p.add_argument("--modes", nargs="+", default=list(MODES[1:]), choices=MODES[1:])
    p.add_argument("--keep-last", type=int, default=2, help="the tier's local_keep_last")
    p.add_argument("--model-mb", type=float, default=200.0, help="params + AdamW moments, roughly")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--host-memory", default="2GiB", help="the snapshotters' staging pool bound")
    p.add_argument("--upload-repeat", type=int, default=2, help="turns of the upload comparison (fastest counts)")
    p.add_argument("--dir", default=None, help="where local checkpoints are written (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-nice", type=int, default=0,
                   help="run moto's server at this niceness (19: as if the object store were another machine)")
    p.add_argument("--json", metavar="OUT", help="write the figures as JSON")
    args = p.parse_args()
    args.device = "cpu"
    args.n_embd = choose_embd(args.model_mb, args.n_layer, args.vocab, args.block_size)
    torch.set_num_threads(os.cpu_count() or 1)
    server, endpoint = start_moto(args.server_nice)
    try:
        trainer = Trainer(args)
        dcp_setup(["dcp"] if "dcp+upload" in args.modes else [], args.dir or tempfile.gettempdir(), "auto")
        results = []
        for name in ["none", *args.modes, "none"]:
            results.append(run_mode(name, trainer, args, endpoint, server.pid))
            r = results[-1]
            print(f"{name}: loop {r['loop_s']:.2f} s, drain {r['drain_s']:.2f} s", flush=True)
        upload = upload_throughput(trainer, args, endpoint)
        meta = {"state_mb": trainer.state_bytes() / MB, "steps": args.steps, "every": args.every,
                "keep_last": args.keep_last, "n_embd": args.n_embd, "n_layer": args.n_layer}
        return report(summarize(results, upload, meta), print_table, args.json)
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    sys.exit(main())
