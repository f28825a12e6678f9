"""The damage matrix: a small repository, every kind of object in it damaged in every way, every command run on
the damaged copy, and each run judged.

A case is one (object kind, damage) pair applied to a fresh copy of the pristine repository; on that copy the
commands run in a fixed order: the read-only ones (``log``, ``show HEAD``, ``fsck``, a ``load("HEAD")`` through
the Python API), then ``gc`` and ``gc --grace 0``. Each run ends in one outcome:

- ``ok``: exit 0 (for ``load``: the tip's state, bit for bit);
- ``error``: a non-zero exit that says what is wrong in ckptrepo's own words;
- ``leaked``: a traceback or a Python exception's text in the output;
- ``wrong``: ``load`` returned without an error but with data other than the tip's;
- ``hang``: still running at the timeout (then killed);
- ``crash``: killed by a signal (a segfault, an abort from ``std::bad_alloc``).

and separately it may have ``changed`` the repository: a read-only command that changed anything, or a gc that
deleted or rewrote a file it was not allowed to (see ``Case.harmless``).

Commands run in child processes, as a user runs them. By default the children are forked from a server that has
imported torch and ckptrepo once (multiprocessing's forkserver), which makes a run cost milliseconds instead of
seconds; ``HOSTILE_FRESH=1`` runs each in a fresh interpreter instead (``python -m ckptrepo.cli ...`` and
``python -c ...``), slower and exactly what a user runs. Each child's address space is capped, so that a read
of ``/dev/zero`` ends in MemoryError instead of taking the machine's memory.
"""
from __future__ import annotations

import builtins
import dataclasses
import multiprocessing
import multiprocessing.forkserver as forkserver
import os
import re
import resource
import shutil
import stat
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable

ROOT = Path(__file__).resolve().parents[2]   # the worktree whose ckptrepo is under test
TIMEOUT_S = float(os.environ.get("HOSTILE_TIMEOUT", "20"))
HEADROOM = 1 << 30   # bytes of address space a child may add to what the imports took (the /dev/zero cap)

TIP_STEP = 4
INJECTED = "injected by the hostile suite's builder"   # the failed snapshots' cause, which fsck quotes

# The training state of each step, shared by the builder and by the load check. ``b`` comes first in the float32
# array and ``w`` is long enough that ``b``'s piece moved 1,024 elements further stays inside the array; ``b``'s
# length differs per step, so each version's zarr.json differs from its parent's.
STATE_CODE = '''
import torch


def make_state(step):
    g = torch.Generator().manual_seed(step)
    return {"b": torch.randn(8 + step, generator=g), "w": torch.randn(2048, generator=g),
            "i": torch.arange(5, dtype=torch.int64) + step, "step": step}
'''

# What the ``load`` command runs (``python -c LOAD_CODE REPO``): load HEAD and compare with the tip's state. A
# ckptrepo error is reported the way the CLI reports it; any other exception escapes as a traceback (a leak).
LOAD_CODE = STATE_CODE + f'''
import sys

import ckptrepo
from ckptrepo.errors import CkptRepoError

try:
    state = ckptrepo.open(sys.argv[1]).load("HEAD")
except CkptRepoError as err:
    print(f"ckptrepo: error: {{err}}", file=sys.stderr)
    sys.exit(2)
expected = make_state({TIP_STEP})


def same(a, b):
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and bool(torch.equal(a, b)))
    return type(a) is type(b) and a == b


if not isinstance(state, dict) or set(state) != set(expected) or not all(same(state[k], v)
                                                                          for k, v in expected.items()):
    print("WRONG DATA: load('HEAD') returned something other than the tip's state")
    sys.exit(3)
print("loaded the tip's state")
'''


def make_state(step: int) -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    exec(compile(STATE_CODE, "<state>", "exec"), namespace)
    return namespace["make_state"](step)


# ---- the pristine repository ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Pristine:
    """The undamaged repository every case copies, and the facts the cases need about it."""

    path: Path
    ids: tuple[str, ...]           # versions by step: 1 (pruned by gc), 2 (tagged "good"), 3, 4 (tip of main)
    failures: tuple[str, ...]      # ids of the two failed background snapshots (records under failures/)
    gc_deletes: frozenset[str]     # what `gc --grace 0` deletes from the intact repository (the failed snapshots')

    @property
    def tip(self) -> str:
        return self.ids[3]

    @property
    def older(self) -> str:   # the tip's parent: intact, untagged, not pruned
        return self.ids[2]

    @property
    def tagged(self) -> str:
        return self.ids[1]

    @property
    def pruned(self) -> str:
        return self.ids[0]


def build_pristine(path: Path) -> tuple[Path, tuple[str, ...], tuple[str, ...]]:
    """Through the real API: four versions on main, a tag, two failed background snapshots, and the oldest
    version pruned by gc (so that a pruned marker exists). Returns (path, version ids, failed ids)."""
    import ckptrepo
    from ckptrepo import faults
    from ckptrepo.errors import CkptRepoError

    repo = ckptrepo.init(str(path))
    ids = tuple(repo.snapshot(make_state(step), step=step, message=f"step {step}", metrics={"loss": 1.0 / step}).id
                for step in range(1, TIP_STEP + 1))
    repo.tag("good", ids[1])

    def fail(_name: str) -> None:
        raise OSError(INJECTED)

    faults.set_hook("before_shard_write", fail)
    try:
        for step in (TIP_STEP + 1, TIP_STEP + 2):
            try:
                with repo.snapshotter(dedup=False) as snap:
                    snap.snapshot(make_state(step), step=step)
                    snap.wait()
            except CkptRepoError:
                pass
    finally:
        faults.set_hook("before_shard_write", None)
    repo.gc(keep_last=2)   # keeps the tip and its parent, and the tagged version: prunes the first
    failed = tuple(sorted(p.name for p in (path / "failures").iterdir()))
    return path, ids, failed


def prepare(path: Path, runner: Runner) -> Pristine:
    """Build the pristine repository at ``path`` and check what the cases take for granted: fsck and load pass,
    and the only things gc deletes are the failed snapshots' leftovers."""
    path, ids, failed = build_pristine(path)
    assert len(failed) == 2, f"the builder made {len(failed)} failure records, not 2"
    assert (path / "pruned" / ids[0]).exists(), "gc did not prune the first version"
    scratch = path.with_name(path.name + "-baseline")
    shutil.copytree(path, scratch, symlinks=True)
    try:
        for args in (["fsck"], ["gc"]):
            before = listing(scratch)
            run = runner.cli(scratch, args)
            assert run.rc == 0 and not leaked(run.output), f"{args} on the pristine repository: {run.output}"
            assert listing(scratch) == before, f"{args} changed the pristine repository"
        run = runner.load(scratch)
        assert run.rc == 0, f"load of the pristine repository: {run.output}"
        before = listing(scratch)
        run = runner.cli(scratch, ["gc", "--grace", "0"])
        assert run.rc == 0, f"gc --grace 0 on the pristine repository: {run.output}"
        gone = {k for k, v in before.items() if v[0] != "d" and listing(scratch).get(k) != v}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    unexpected = {k for k in gone if not k.startswith(("failures/", "data/"))}
    assert not unexpected, f"gc --grace 0 deletes {sorted(unexpected)} from the pristine repository"
    return Pristine(path, ids, failed, frozenset(gone))


# ---- objects, damage, cases -------------------------------------------------------------------------------------

# object kind -> (its key, the key of another version's object of the same kind, or None where there is none)
KINDS: dict[str, Callable[[Pristine], tuple[str, str | None]]] = {
    "HEAD": lambda p: ("HEAD", None),
    "config": lambda p: ("ckptrepo.json", None),
    "branch": lambda p: ("refs/heads/main", None),
    "tag": lambda p: ("refs/tags/good", None),
    "manifest_tip": lambda p: (f"versions/{p.tip}", f"versions/{p.older}"),
    "manifest_older": lambda p: (f"versions/{p.older}", f"versions/{p.tagged}"),
    "zarr_json": lambda p: (f"data/{p.tip}/0/float32/zarr.json", f"data/{p.older}/0/float32/zarr.json"),
    "shard": lambda p: (f"data/{p.tip}/0/float32/c/0", f"data/{p.older}/0/float32/c/0"),
    "pruned_marker": lambda p: (f"pruned/{p.pruned}", None),
    "failure_record": lambda p: (f"failures/{p.failures[0]}", f"failures/{p.failures[1]}"),
}
MANIFESTS = ("manifest_tip", "manifest_older")

BASIC_DAMAGE = ("fifo", "devzero", "folder", "truncate", "swap", "delete")

# A manifest re-sealed (a valid crc32c trailer) after one field is changed. ``m`` is the decoded map, ``vid`` the
# version, ``other`` another version's id, ``repo`` the damaged copy's path.
RESEALS: dict[str, Callable[[dict[str, Any], str, str, Path], None]] = {
    "parents_int": lambda m, vid, other, repo: m.update(parents=[5]),
    "time_str": lambda m, vid, other, repo: m.update(time="now"),
    "time_huge": lambda m, vid, other, repo: m.update(time=1e300),
    "metrics_list": lambda m, vid, other, repo: m.update(metrics=[1, 2]),
    "message_int": lambda m, vid, other, repo: m.update(message=12345),
    "no_time": lambda m, vid, other, repo: m.pop("time"),
    "piece_shift": lambda m, vid, other, repo: _shift_piece(m, "b", 1024),
    # tip: a parent of itself; older: the tip as its parent, so that tip -> older -> tip
    "parent_cycle": lambda m, vid, other, repo: m.update(parents=[other]),
    "key_dotdot": lambda m, vid, other, repo: _rename_array(m, "float32", f"data/{vid}/../{other}/0/float32"),
    "key_absolute": lambda m, vid, other, repo: _rename_array(m, "float32", f"{repo}/data/{other}/0/float32"),
}

# Damage only some kinds can take (beyond the matrix): each names a failure the issue reports.
EXTRA_DAMAGE: dict[str, tuple[str, ...]] = {
    "HEAD": ("dangling",),                         # HEAD names a branch that does not exist (one bit flipped)
    "pruned_marker": ("stray_tip", "stray_tag"),   # an empty marker that names the branch tip / a tagged version
}


def _shift_piece(m: dict[str, Any], tensor: str, by: int) -> None:
    (t,) = [t for t in m["tensors"] if t["name"] == tensor]
    t["pieces"][0]["offset"] += by


def _rename_array(m: dict[str, Any], dtype: str, new_key: str) -> None:
    (old,) = [k for k in m["arrays"] if k.endswith("/" + dtype)]
    m["arrays"][new_key] = m["arrays"].pop(old)
    for t in m["tensors"]:
        for piece in t["pieces"]:
            if piece["array"] == old:
                piece["array"] = new_key


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str
    damage: str

    @property
    def id(self) -> str:
        return f"{self.kind}/{self.damage}"

    @property
    def harmless(self) -> bool:
        """Damage the repository may survive by design: fsck may pass, and gc may do what it does to the intact
        repository. Everything else is damage fsck must report and gc must refuse to act on."""
        if self.kind == "failure_record":
            # a failure record only reports a snapshot that never committed: no version, ref or data depends on
            # it, fsck shows it as a warning, and gc deletes it once it is older than the grace period
            return True
        if self.kind == "pruned_marker" and self.damage in ("fifo", "devzero"):
            # a marker's presence is the whole record (it is empty and never read): something else under its
            # name still says "pruned"
            return True
        if self.kind == "pruned_marker" and self.damage in ("delete", "folder"):
            # the version's data was deleted by gc on purpose; without the marker fsck may either report the
            # data as missing or accept a version no ref needs to load: both are defensible
            return True
        if self.kind == "tag" and self.damage == "delete":
            return True   # the state `ckptrepo tag -d good` leaves; the tagged version stays reachable from main
        return False

    @property
    def gc_may_collect(self) -> bool:
        """Whether gc may still delete what it deletes from the intact repository (the failed snapshots'
        record and leftover data, which no manifest names). Always where the damage is harmless; and where the
        damage is to a data object (zarr.json, shard): gc reads manifests and refs, never data, so it cannot see
        that damage, and what it collects is provably unreachable whatever a shard holds. Damage to a ref or a
        manifest is another matter: gc reads those, and then it cannot tell a lost manifest's data from a failed
        snapshot's, so it must stop before deleting anything."""
        return self.harmless or self.kind in ("zarr_json", "shard")

    def apply(self, repo: Path, p: Pristine) -> list[str]:
        """Damage the copy at ``repo``; returns the keys damaged (gc may delete or rewrite those)."""
        key, other = KINDS[self.kind](p)
        target = repo / key
        if self.damage == "fifo":
            target.unlink()
            os.mkfifo(target)
        elif self.damage == "devzero":
            target.unlink()
            target.symlink_to("/dev/zero")
        elif self.damage == "folder":
            target.unlink()
            target.mkdir()
        elif self.damage == "truncate":
            blob = target.read_bytes()
            target.write_bytes(blob[:len(blob) // 2])
        elif self.damage == "swap":
            assert other is not None, self.id
            a, b = target.read_bytes(), (repo / other).read_bytes()
            assert a != b, f"{self.id}: the two objects are identical, a swap would change nothing"
            target.write_bytes(b)
            (repo / other).write_bytes(a)
            return [key, other]
        elif self.damage == "delete":
            target.unlink()
        elif self.damage.startswith("reseal_"):
            self._reseal(repo, p, key)
        elif self.damage == "dangling":
            target.write_text(target.read_text().replace("main", "mbin"))
        elif self.damage in ("stray_tip", "stray_tag"):
            key = f"pruned/{p.tip if self.damage == 'stray_tip' else p.tagged}"
            (repo / key).write_bytes(b"")
        else:
            raise AssertionError(f"unknown damage {self.damage}")
        return [key]

    def _reseal(self, repo: Path, p: Pristine, key: str) -> None:
        from ckptrepo.core._manifest import seal, unseal

        vid = key.split("/", 1)[1]
        other = p.older if vid == p.tip else p.tagged
        if self.damage == "reseal_parent_cycle":
            other = p.tip
        m = unseal((repo / key).read_bytes(), key)
        RESEALS[self.damage[len("reseal_"):]](m, vid, other, repo)
        (repo / key).write_bytes(seal(m))


def cases() -> list[Case]:
    """Every case of the matrix. Left out, as they make no sense:

    - swap for HEAD and ckptrepo.json: a repository has one of each, there is nothing of the same kind to swap;
    - swap for a branch or a tag: two refs that trade targets are a valid repository (refs moved on purpose
      look the same), and there is one branch and one tag;
    - truncate and swap for a pruned marker: markers are empty, so both change nothing;
    - re-sealing for anything but a version manifest (the brief's scope; failure records are sealed too, but
      only reported).
    """
    out = []
    for kind in KINDS:
        for damage in BASIC_DAMAGE:
            if damage == "swap" and kind in ("HEAD", "config", "branch", "tag", "pruned_marker"):
                continue
            if damage == "truncate" and kind == "pruned_marker":
                continue
            out.append(Case(kind, damage))
        if kind in MANIFESTS:
            out.extend(Case(kind, f"reseal_{name}") for name in RESEALS)
        out.extend(Case(kind, damage) for damage in EXTRA_DAMAGE.get(kind, ()))
    return out


# ---- running commands -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Run:
    rc: int | None           # exit status; None if it timed out or died of a signal
    signal: int | None       # the signal that killed it (not our timeout's)
    timed_out: bool
    output: str              # stdout and stderr, interleaved
    seconds: float


class Runner:
    """Runs a CLI command or the load check in a child process, with a timeout and a capped address space."""

    def cli(self, repo: Path, args: list[str]) -> Run:
        raise NotImplementedError

    def load(self, repo: Path) -> Run:
        raise NotImplementedError

    def close(self) -> None:
        pass


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTREPO_")}   # no CKPTREPO_DEBUG tracebacks
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


class FreshRunner(Runner):
    """Each run in a fresh interpreter: ``python -m ckptrepo.cli --repo REPO ...`` or ``python -c LOAD_CODE``."""

    def cli(self, repo: Path, args: list[str]) -> Run:
        return self._run([sys.executable, "-m", "ckptrepo.cli", "--repo", str(repo), *args])

    def load(self, repo: Path) -> Run:
        return self._run([sys.executable, "-c", LOAD_CODE, str(repo)])

    @staticmethod
    def _run(argv: list[str]) -> Run:
        t0 = time.monotonic()
        limit = 3 << 30   # a fresh interpreter with torch and TensorStore maps about 1.2 GiB

        def cap() -> None:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

        try:
            done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=TIMEOUT_S,
                                  env=child_env(), cwd=ROOT, preexec_fn=cap, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exp:
            out = exp.output.decode(errors="replace") if exp.output else ""
            return Run(None, None, True, out, time.monotonic() - t0)
        out = done.stdout.decode(errors="replace")
        if done.returncode < 0:
            return Run(None, -done.returncode, False, out, time.monotonic() - t0)
        return Run(done.returncode, None, False, out, time.monotonic() - t0)


def _child(mode: str, args: list[str], out_path: str) -> None:
    """A forked child: output into ``out_path``, address space capped, then the CLI or the load check."""
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    import ckptrepo
    if not Path(ckptrepo.__file__).resolve().is_relative_to(ROOT):
        print(f"hostile suite: ckptrepo comes from {ckptrepo.__file__}, not from {ROOT}")
        os._exit(99)
    for k in [k for k in os.environ if k.startswith("CKPTREPO_")]:
        del os.environ[k]
    size = int(re.search(r"VmSize:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024  # type: ignore[union-attr]
    resource.setrlimit(resource.RLIMIT_AS, (size + HEADROOM, size + HEADROOM))
    if mode == "cli":
        sys.argv = ["ckptrepo", *args]
        from ckptrepo.cli.main import main
        main()
    else:
        sys.argv = ["-c", *args]
        exec(compile(LOAD_CODE, "<string>", "exec"), {"__name__": "__main__"})


class ForkRunner(Runner):
    """Each run forked from a server that imported torch and ckptrepo once (what makes the matrix fast)."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(["torch", "tensorstore", "ckptrepo.cli.main", "hostile._matrix"])
        # the server imports its preloads with the sys.path of a fresh `python -c`, which PYTHONPATH sets: this
        # worktree's ckptrepo, not an installed one, and tests/ for this module
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")] + ([saved] if saved else []))
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved
        self._n = 0
        self._lock = threading.Lock()

    def cli(self, repo: Path, args: list[str]) -> Run:
        return self._run("cli", ["--repo", str(repo), *args])

    def load(self, repo: Path) -> Run:
        return self._run("load", [str(repo)])

    def _run(self, mode: str, args: list[str]) -> Run:
        with self._lock:
            self._n += 1
            out_path = self.scratch / f"run-{self._n}.out"
        t0 = time.monotonic()
        proc = self.ctx.Process(target=_child, args=(mode, args, str(out_path)))
        proc.start()
        proc.join(TIMEOUT_S)
        timed_out = proc.exitcode is None
        if timed_out:
            proc.kill()
            proc.join()
        seconds = time.monotonic() - t0
        out = out_path.read_text(errors="replace") if out_path.exists() else ""
        out_path.unlink(missing_ok=True)
        code = proc.exitcode
        proc.close()
        if timed_out:
            return Run(None, None, True, out, seconds)
        assert code is not None
        if code < 0:
            return Run(None, -code, False, out, seconds)
        return Run(code, None, False, out, seconds)


def make_runner(scratch: Path) -> Runner:
    if os.environ.get("HOSTILE_FRESH"):
        return FreshRunner()
    scratch.mkdir(parents=True, exist_ok=True)
    return ForkRunner(scratch)


# ---- judging ----------------------------------------------------------------------------------------------------

_EXCEPTION_NAMES = sorted(n for n in dir(builtins) if isinstance(getattr(builtins, n), type)
                          and issubclass(getattr(builtins, n), BaseException) and n not in ("Exception", "Warning"))
_LEAK = re.compile("|".join([
    r"Traceback \(most recent call last\)",
    r"CKPTREPO_DEBUG=1 for a traceback",          # the CLI's last-resort handler: an exception it did not expect
    r"\b(?:" + "|".join(_EXCEPTION_NAMES) + r")\b",
    r"\b[A-Z]\w*(?:Error|Exception)\b: ",          # "SomeError: ..." as a traceback's last line prints it
    r"std::bad_alloc|terminate called|Segmentation fault|core dumped",
    # CPython's own messages, as str(err) of a TypeError/KeyError/IndexError/ValueError shows them
    r"object is not subscriptable|object has no attribute|object is not iterable|unsupported operand type",
    r"not supported between instances|positional argument|unhashable type|index out of range",
    r"invalid literal for int|can't multiply sequence|must be real number|is not JSON serializable",
    r"object of type '\w+' has no len|object cannot be interpreted as an integer|math range error",
]))


def leaked(output: str) -> str | None:
    """The first piece of Python's own error text in ``output``, or None (the builder's injected failure, quoted
    in whatever form the failure record keeps it, is not a leak)."""
    match = _LEAK.search("\n".join(line for line in output.splitlines() if INJECTED not in line))
    return match.group(0) if match else None


def outcome(command: str, run: Run) -> str:
    if run.timed_out:
        return "hang"
    if run.signal is not None:
        return "crash"
    if leaked(run.output):
        return "leaked"
    if command == "load" and run.rc == 3:
        return "wrong"
    return "ok" if run.rc == 0 else "error"


Entry = tuple   # ("d",) a folder, ("f", size, crc32) a file, ("l", target) a symlink, ("p",) a FIFO, ("?",) other


def listing(root: Path) -> dict[str, Entry]:
    """Every path under ``root`` with what it is and, for files, size and crc32 (contents are never read from
    anything but a regular file, and links are not followed)."""
    out: dict[str, Entry] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            mode = os.lstat(full).st_mode
            if stat.S_ISLNK(mode):
                out[rel] = ("l", os.readlink(full))
            elif stat.S_ISDIR(mode):
                out[rel] = ("d",)
            elif stat.S_ISREG(mode):
                blob = Path(full).read_bytes()
                out[rel] = ("f", len(blob), zlib.crc32(blob))
            elif stat.S_ISFIFO(mode):
                out[rel] = ("p",)
            else:
                out[rel] = ("?",)
    return out


def _under(key: str, roots: Iterable[str]) -> bool:
    return any(key == r or key.startswith(r + "/") for r in roots)


def gc_losses(before: dict[str, Entry], after: dict[str, Entry], allowed: Iterable[str]) -> list[str]:
    """Files (not folders) that vanished or changed, other than under ``allowed``."""
    allowed = list(allowed)
    return sorted(k for k, v in before.items() if v[0] != "d" and after.get(k) != v and not _under(k, allowed))


# (name, CLI arguments or None for the load check, whether it must leave the repository as it was)
COMMANDS: tuple[tuple[str, list[str] | None, bool], ...] = (
    ("log", ["log"], True),
    ("show", ["show", "HEAD"], True),
    ("fsck", ["fsck"], True),
    ("load", None, True),
    ("gc", ["gc"], False),
    ("gc0", ["gc", "--grace", "0"], False),
)


@dataclasses.dataclass
class CommandResult:
    command: str
    outcome: str
    changed: list[str]   # files the command changed that it must not have
    run: Run


@dataclasses.dataclass
class CaseResult:
    case: Case
    results: list[CommandResult]
    fsck_must_fail: bool
    garbage: frozenset[str]   # what gc deletes from the intact repository

    def problems(self) -> list[tuple[str, str]]:
        """(cause, detail) for each way this case falls short of the target behaviour."""
        out = []
        for r in self.results:
            if r.outcome in ("hang", "crash", "leaked", "wrong"):
                detail = leaked(r.run.output) if r.outcome == "leaked" else _last_line(r.run.output)
                if r.outcome == "crash":
                    detail = f"signal {r.run.signal}: {detail}"
                out.append((f"{r.outcome} in {r.command}", str(detail)))
            if r.changed and not r.command.startswith("gc"):
                out.append((f"{r.command} changed the repository", ", ".join(r.changed[:4])))
            elif r.changed:
                live = [k for k in r.changed if k not in self.garbage]
                what = "deleted live data" if live else "collected garbage despite the damage"
                out.append((f"{r.command} {what}", ", ".join((live or r.changed)[:4])))
            if r.command == "fsck" and self.fsck_must_fail and r.outcome == "ok":
                out.append(("fsck exit 0 on damage", _last_line(r.run.output)))
        return out

    def report(self) -> str:
        lines = [f"{self.case.id}:"]
        for cause, detail in self.problems():
            lines.append(f"  {cause}: {detail}")
        for r in self.results:
            lines.append(f"  --- {r.command} ({r.outcome}, rc={r.run.rc}, {r.run.seconds:.1f}s): "
                         + " | ".join(r.run.output.strip().splitlines()[-4:])[:600])
        return "\n".join(lines)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "(no output)"


def run_case(case: Case, p: Pristine, runner: Runner, workdir: Path) -> CaseResult:
    """Copy the pristine repository, damage it, run every command on the copy and judge each run."""
    repo = workdir / case.id.replace("/", "--")
    shutil.rmtree(repo, ignore_errors=True)
    shutil.copytree(p.path, repo, symlinks=True)
    try:
        damaged = case.apply(repo, p)
        allowed = damaged + (sorted(p.gc_deletes) if case.gc_may_collect else [])
        results = []
        for name, args, read_only in COMMANDS:
            before = listing(repo)
            run = runner.load(repo) if args is None else runner.cli(repo, args)
            after = listing(repo)
            if read_only:
                changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
            else:
                changed = gc_losses(before, after, allowed)
            results.append(CommandResult(name, outcome(name, run), changed, run))
        return CaseResult(case, results, fsck_must_fail=not case.harmless, garbage=p.gc_deletes)
    finally:
        shutil.rmtree(repo, ignore_errors=True)


def run_matrix(selected: list[Case], p: Pristine, runner: Runner, workdir: Path,
               workers: int | None = None, on_result: Callable[[CaseResult], None] | None = None
               ) -> dict[str, CaseResult]:
    """Run ``selected`` cases, several at once (a hung run waits in the kernel, not on a core)."""
    workers = workers or int(os.environ.get("HOSTILE_WORKERS", "4"))
    out: dict[str, CaseResult] = {}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for result in pool.map(lambda c: run_case(c, p, runner, workdir), selected):
            out[result.case.id] = result
            if on_result is not None:
                on_result(result)
    return out
