"""``ckptrepo`` commands. Each one parses, calls the library, and prints; no logic lives here.

What a command needs beyond click is imported inside it (the library's modules, rich for progress bars and
colour on a terminal), so that a quick command such as ``log -n 10`` starts without loading torch, numpy,
TensorStore or rich: tests/integration/test_startup.py holds ``log`` to that.
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
import textwrap
from datetime import datetime
from functools import cache
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import click

import ckptrepo
from ckptrepo.cli import _errors as errors
from ckptrepo.errors import ArgumentError, CkptRepoError, ExchangeError
from ckptrepo.tools import _plot as plot
from ckptrepo.tools._graph import GraphRow
from ckptrepo.tools._graph import graph as graph_rows
from ckptrepo.tools._width import fit, keep_last, natural_key, table_lines, terminal_width

if TYPE_CHECKING:
    from click.shell_completion import CompletionItem
    from rich.console import Console
    from rich.progress import Progress


@cache
def _err() -> Console:
    """The console on stderr (progress bars, "aborted")."""
    from rich.console import Console
    return Console(stderr=True, highlight=False, soft_wrap=True)


def _width() -> int | None:
    """The columns stdout may use now (COLUMNS, else the terminal's; None for a pipe or a file)."""
    return terminal_width(sys.stdout)


def _out() -> Console:
    """A console on the current stdout (tests and pipes swap it), colouring only a terminal; lines are laid
    out by the commands to ``_width()``, so rich never wraps them again."""
    from rich.console import Console
    return Console(file=sys.stdout, highlight=False, soft_wrap=True)


def _may_colour() -> bool:
    """Whether stdout may get colour: a terminal, or FORCE_COLOR or TTY_COMPATIBLE=1 set, as rich decides (rich
    then also honours NO_COLOR and TERM=dumb). Otherwise text is printed as it is, without loading rich."""
    return sys.stdout.isatty() or bool(os.environ.get("FORCE_COLOR")) or os.environ.get("TTY_COMPATIBLE") == "1"


def _print_marked(line: str, start: int, end: int, style: str) -> None:
    """``line`` (printable, already fitted) with ``line[start:end]`` in ``style`` where stdout takes colour."""
    if not _may_colour():
        click.echo(line)
        return
    from rich.markup import escape
    if end > start:
        _out().print(escape(line[:start]) + f"[{style}]{escape(line[start:end])}[/]" + escape(line[end:]), markup=True)
    else:
        _out().print(escape(line), markup=True)


def _echo_fit(text: str) -> None:
    """One line of output, cut to the width with an ellipsis (as git's and rich's truncation)."""
    click.echo(fit(text, _width()))


def _print_table(title: str, headers: Sequence[str], rows: Iterable[Sequence[str]], fold: int = 1) -> None:
    """Print a table that fits the width: the first ``fold`` columns (names, values) fold onto more lines
    first, the others (numbers, sizes) only if nothing else fits. Piped output with no COLUMNS keeps every
    cell on one line, whole (see ckptrepo.tools._width)."""
    width = _width()
    click.echo(fit(printable(title), width))
    for line in table_lines(headers, [[printable(c) for c in r] for r in rows], width, fold=fold):
        click.echo(line)


MEMORY_ONLY = ("a memory:// repository lives only in the process that creates it, so `ckptrepo {0}` cannot "
               "reach one; use a path, or an s3:// or gs:// URL")


def _repo(ctx: click.Context) -> ckptrepo.Repository:
    url = ctx.obj["url"]
    if url.startswith("memory://"):
        raise CkptRepoError(MEMORY_ONLY.format(ctx.info_name))
    return ckptrepo.open(url)


def _local_root(repo: ckptrepo.Repository) -> str | None:
    """The folder of a local repository, where no output file may go (it could replace HEAD or a ref)."""
    return repo.plumbing.store.capabilities.local_root


def _output(repo: ckptrepo.Repository, path: str | None, force: bool, what: str) -> str | None:
    """``path`` checked as a file to write (before any computation); None when not asked for."""
    if path is None:
        return None
    from ckptrepo.tools._paths import output_file
    return str(output_file(path, force=force, repo_root=_local_root(repo), what=what))


def _size(n: float) -> str:
    """A size in binary units (KiB, MiB, GiB: powers of 1024), as everywhere in ckptrepo's output."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _when(t: float) -> str:
    try:
        return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):   # a time no calendar holds: shown as the number it is
        return f"time {t!r}"


def _metrics(m: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items())


def _failed_what(record: dict[str, Any]) -> str:
    """What a failure record is about, before its version id: nothing for a snapshot (most are), ``push of
    BRANCH to REMOTE at`` for a local tier's background push."""
    if record.get("remote"):
        return f"push of {record.get('branch')} to {record.get('remote')} at "
    return ""


def _durability(v: ckptrepo.Version) -> str:
    """Where a version's data is durable, as ``log`` marks it: ``[local origin]`` (here, and on remote origin),
    ``[origin]`` (evicted here, or cloned lazily: read from origin), ``[local]`` (not pushed yet), ``[-]``
    (pruned, and on no remote)."""
    return f"[{' '.join((['local'] if v.local else []) + list(v.remotes)) or '-'}]"


def _print_log_line(prefix: str, v: ckptrepo.Version, oneline: bool, durable: bool = False) -> None:
    """One version as ``log`` prints it, cut to the width: the id (coloured on a terminal), its refs, where it
    is durable (``durable``: in a repository with remotes), then ``--oneline``: the step and the message's first
    line; otherwise also the time, the size and the metrics. What comes from the repository is shown as text,
    never as markup or terminal codes."""
    refs = f" ({', '.join(v.refs)})" if v.refs else ""
    if durable:
        refs += f" {_durability(v)}"
    if oneline:
        rest = f"{refs} {_step(v)}  {_first_line(v.message)}"
    else:
        size = "pruned" if v.pruned else _size(v.size)
        rest = f"{refs}  {_step(v)}  {_when(v.time)}  {size}  {_metrics(v.metrics)}  {_first_line(v.message)}"
    plain = fit(printable(prefix + v.short_id + rest).rstrip(), _width())
    start, end = len(printable(prefix)), len(printable(prefix)) + len(v.short_id)
    if plain[start:end] != v.short_id:   # a width too narrow for the id: no colour
        start = end = 0
    _print_marked(plain, start, end, "yellow")


def _step(v: ckptrepo.Version) -> str:
    return f"step {v.step}" if v.step is not None else "step -"


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with every terminal control code (ESC included: a message could clear the screen, hide text
    or set the window title; rich's strip_control_codes leaves ESC) shown as ``\\xNN``; tabs and newlines kept."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""


def _sortable(value: Any) -> float:
    """A number to sort by: no value (an added or reshaped tensor) and NaN sort below every number."""
    return value if isinstance(value, (int, float)) and value == value else -1.0


def _emit_json(data: Any) -> None:
    """Strict JSON: NaN and infinities (a diverged loss, a relative change from zero) are null, as ``jq`` and
    other parsers reject Python's NaN and Infinity."""
    data = _finite(data)
    if isinstance(data, list) and len(data) > 1 and all(_flat_record(r) for r in data):
        # a long list of flat records (a trajectory of 10,000 versions): one record per line, each encoded by
        # json's C encoder, which an indented dump never uses; still one JSON document
        lines = [json.dumps(r, default=str, allow_nan=False) for r in data]
        click.echo("[\n  " + ",\n  ".join(lines) + "\n]")
        return
    click.echo(json.dumps(data, indent=2, default=str, allow_nan=False))


def _flat_record(r: Any) -> bool:
    return isinstance(r, dict) and not any(isinstance(v, (dict, list, tuple)) for v in r.values())


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _progress() -> Progress | None:
    """A byte progress bar, only when stderr is a terminal."""
    if not _err().is_terminal:
        return None
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn
    return Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    console=_err(), transient=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--repo", "url", envvar="CKPTREPO_REPO", default=".", show_default="$CKPTREPO_REPO or .",
              help="Repository URL: a path, file://, memory://, s3://BUCKET/PREFIX or gs://BUCKET/PREFIX.")
@click.version_option(ckptrepo.__version__, prog_name="ckptrepo")
@click.pass_context
def cli(ctx: click.Context, url: str) -> None:
    """Git for training state: a versioned checkpoint repository."""
    ctx.obj = {"url": url}


def _complete_revision(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """Shell completion of a revision: HEAD, branches, tags, and short ids once a hex prefix is typed (see the
    README's "Shell completion"). A repository that cannot be opened completes nothing, silently."""
    url = ctx.find_root().params.get("url") or os.environ.get("CKPTREPO_REPO") or "."
    from click.shell_completion import CompletionItem
    try:
        from ckptrepo.tools._status import revision_names
        return [CompletionItem(name) for name in revision_names(ckptrepo.open(url).plumbing, incomplete)]
    except Exception:  # noqa: BLE001 - a completion must never print an error into the shell's prompt
        return []


def _complete_ref(kind: str):
    """Shell completion of an existing branch or tag name (``branch -d``, ``tag -d``)."""
    def complete(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
        from click.shell_completion import CompletionItem
        url = ctx.find_root().params.get("url") or os.environ.get("CKPTREPO_REPO") or "."
        try:
            repo = ckptrepo.open(url)
            names = repo.branches() if kind == "branch" else repo.tags()
        except Exception:  # noqa: BLE001 - as _complete_revision
            return []
        return [CompletionItem(n) for n in sorted(names, key=natural_key) if n.startswith(incomplete)]
    return complete


@cli.command()
@click.argument("url", required=False)
@click.option("--exist-ok", is_flag=True, help="Succeed if a repository is already there.")
@click.option("--compression", type=click.Choice(["zstd", "none"]), default=None,
              help="Store tensors compressed losslessly (zstd after a byte shuffle); pays on slow remote stores.")
@click.pass_context
def init(ctx: click.Context, url: str | None, exist_ok: bool, compression: str | None) -> None:
    """Create a repository at URL (default: --repo)."""
    where = url or ctx.obj["url"]
    if where.startswith("memory://"):   # it would be gone when this command exits, after a "success"
        raise CkptRepoError("a memory:// repository lives only in the process that creates it, so one made by "
                            "`ckptrepo init` is gone when the command ends; create it with ckptrepo.init() in "
                            "your program, or init a path, or an s3:// or gs:// URL")
    try:
        repo = ckptrepo.init(where, exist_ok=exist_ok, compression=compression)
    except ckptrepo.RepositoryExistsError:
        raise ckptrepo.RepositoryExistsError(f"a repository already exists at {where}; use it with "
                                             f"--repo, or pass --exist-ok") from None
    existing = repo.log(all=True, limit=1) if exist_ok else []
    click.echo(f"{'reinitialised existing' if existing else 'initialised empty'} ckptrepo repository at {repo.url}")


_COUNT = re.compile(r"-\d+")
_LOG_VALUE_OPTIONS = frozenset({"-n", "--max-count", "--since", "--until"})


class _LogCommand(click.Command):
    """``log`` takes git's ``-<n>`` for ``-n <n>`` (``log -1``); a number given as an option's value
    (``--since -5``) and anything after ``--`` are left as they are."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        rewritten: list[str] = []
        options_end = False
        for i, arg in enumerate(args):
            if not options_end and _COUNT.fullmatch(arg) and (i == 0 or args[i - 1] not in _LOG_VALUE_OPTIONS):
                rewritten.append(f"--max-count={arg[1:]}")
            else:
                rewritten.append(arg)
            options_end = options_end or arg == "--"
        return super().parse_args(ctx, rewritten)


@cli.command(cls=_LogCommand)
@click.argument("rev", required=False, default="HEAD", shell_complete=_complete_revision)
@click.option("--all", "all_", is_flag=True,
              help="Versions reachable from any branch, tag or remote-tracking ref (origin/main).")
@click.option("-n", "--max-count", type=click.IntRange(min=1), default=None,
              help="Show at most N versions (git's -N works too: log -1).")
@click.option("--since", type=int, default=None, help="Only versions with step >= SINCE.")
@click.option("--until", type=int, default=None, help="Only versions with step <= UNTIL.")
@click.option("--oneline", is_flag=True, help="Only the id, refs, step and message's first line of each version.")
@click.option("-p", "--patch", "patch", is_flag=True,
              help="Under each version, what changed since its parent: M (changed), A (added), D (removed), "
                   "R (reshaped or retyped) per tensor and object (reads the data, streamed).")
@click.option("--stats", "with_stats", is_flag=True, help="Capture statistics of each version.")
@click.option("--graph", is_flag=True, help="Draw forks and joins of the history (with --all: every branch).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def log(ctx: click.Context, rev: str, all_: bool, max_count: int | None, since: int | None, until: int | None,
        oneline: bool, patch: bool, with_stats: bool, graph: bool, as_json: bool) -> None:
    """List versions, newest first (with --all, also snapshots that failed). In a repository with remotes, each
    version says where its data is durable: [local origin] here and on origin, [origin] only there (evicted
    after a push, or cloned lazily), [local] not pushed yet."""
    if graph and (as_json or with_stats or patch):
        raise click.UsageError("--graph cannot be combined with --json, --stats or -p")
    if oneline and as_json:
        raise click.UsageError("--oneline cannot be combined with --json")
    repo = _repo(ctx)
    versions = repo.log(rev, all=all_, limit=max_count, since=since, until=until)
    failures = repo.failures() if all_ else []
    stats = {v.id: repo.capture_stats(v.id) for v in versions} if with_stats else {}
    if as_json:
        rows = [dict(v.to_json(), **({"stats": stats[v.id]} if with_stats else {}),
                     **({"changes": _changes_json(repo, v)} if patch else {})) for v in versions]
        _emit_json(rows + [dict(f, failed=True) for f in failures] if all_ else rows)
        return
    if not versions and not failures:
        click.echo("no versions match --since/--until" if since is not None or until is not None else "no versions yet")
    durable = bool(repo.remotes()) or any(v.remotes or (not v.local and not v.pruned) for v in versions)
    for row in graph_rows(versions) if graph else [GraphRow("", v) for v in versions]:
        if row.version is None:   # a line that only connects columns
            _echo_fit(row.prefix)
            continue
        _print_log_line(row.prefix, row.version, oneline, durable)
        if with_stats:
            _echo_fit("    " + _capture_stats_line(stats[row.version.id]))
        if patch:
            for line in _change_lines(repo, row.version):
                _echo_fit("    " + line)
    for f in failures:
        line = fit(printable(f"FAILED {_failed_what(f)}{str(f.get('id'))[:12]}  step {f.get('step')}  "
                             f"{_when(_number(f.get('time')))}  {f.get('error')}"), _width())
        _print_marked(line, 0, 6 if line.startswith("FAILED") else 0, "red")


def _number(value: Any) -> float:
    """A time from a failure record, which is whatever a damaged record holds: 0 when it is not a number."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _capture_stats_line(s: dict[str, Any]) -> str:
    if not s:
        return "no statistics recorded"
    rate = s.get("bytes", 0) / s["total_s"] if s.get("total_s") else 0.0
    return (f"blocking {s['blocking_s'] * 1e3:.1f} ms  capture {s['capture_s'] * 1e3:.1f} ms  "
            f"flush {s['flush_s'] * 1e3:.1f} ms  total {s['total_s'] * 1e3:.1f} ms  {_size(rate)}/s"
            + (f"  copied {_size(s['copied_bytes'])}" if "copied_bytes" in s else ""))


_LETTER = {"changed": "M", "added": "A", "removed": "D", "reshaped": "R", "retyped": "R"}


def _change_lines(repo: ckptrepo.Repository, v: ckptrepo.Version) -> list[str]:
    """What changed in ``v`` since its first parent, a line per changed tensor or object (``log -p``)."""
    if not v.parents:
        return ["root version: no parent to compare with"]
    try:
        d = repo.diff(v.parents[0], v.id)
    except CkptRepoError as e:   # a pruned side has no data: say so and go on with the log
        return [f"no changes shown: {e}"]
    lines = []
    for t in sorted(d.tensors, key=lambda t: natural_key(t.name)):
        if t.status == "unchanged":
            continue
        detail = f"  rel. change {_num(t.relative)}" if t.status == "changed" else f"  ({t.status})"
        lines.append(printable(f"{_LETTER.get(t.status, '?')} {t.name}{detail}"))
    for o in d.objects:
        lines.append(printable(f"{_LETTER.get(o.status, '?')} {o.path}: {o.a or ''} -> {o.b or ''}".rstrip()))
    unchanged = sum(t.status == "unchanged" for t in d.tensors)
    lines.append(f"{len(d.tensors) - unchanged} of {len(d.tensors)} tensors changed")
    return lines


def _changes_json(repo: ckptrepo.Repository, v: ckptrepo.Version) -> Any:
    if not v.parents:
        return None
    try:
        return repo.diff(v.parents[0], v.id).to_json()
    except CkptRepoError as e:
        return {"error": str(e)}


@cli.command()
@click.argument("rev", default="HEAD", shell_complete=_complete_revision)
@click.option("--stat", "with_stat", is_flag=True,
              help="After the header, what changed since the parent, one line per module prefix (as diff --stat), "
                   "instead of the tensors and objects.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def show(ctx: click.Context, rev: str, with_stat: bool, as_json: bool) -> None:
    """Show one version: header, tensors (name, dtype, shape, bytes) and objects."""
    repo = _repo(ctx)
    d = repo.show(rev)
    v = d.version
    if as_json:
        data: dict[str, Any] = {"version": v.to_json(), "layout": d.layout}
        if with_stat:
            data["stat"] = sorted(repo.diff(v.parents[0], v.id).by_prefix(), key=lambda g: natural_key(g["prefix"])) \
                if v.parents else None
        else:
            data.update(tensors=d.tensors, objects=[{"path": p, "value": val} for p, val in d.objects])
        _emit_json(data)
        return
    width = _width()
    click.echo(f"version {v.id}")
    if v.refs:
        _echo_fit(printable(f"refs    {', '.join(v.refs)}"))
    _echo_fit(f"parents {' '.join(v.parents) or '-'}")
    size = "pruned: gc deleted its data (the tensors below are what was saved)" if v.pruned else _size(v.size)
    click.echo(f"step    {v.step if v.step is not None else '-'}\ntime    {_when(v.time)}")
    _echo_fit(f"size    {size}")
    if repo.remotes() or v.remotes or not (v.local or v.pruned):
        _echo_fit(printable(f"durable {_durability(v)[1:-1]}"))
    if d.layout.get("world_size", 1) > 1:
        degrees = " ".join(f"{k}={d.layout[k]}" for k in ("tp", "pp", "dp", "zero") if k in d.layout)
        _echo_fit(f"layout  {degrees + ', ' if degrees else ''}{d.layout['world_size']} ranks")
    if v.metrics:
        _echo_fit(printable(f"metrics {_metrics(v.metrics)}"))
    for key, text in v.meta.items():   # a tracker's run id and URL: each whole on its line, to copy
        click.echo(printable(f"meta    {key}={text}"))
    if v.message:
        click.echo("")
        for line in printable(v.message).splitlines():   # folded as text: git leaves this to the pager
            for piece in textwrap.wrap(line, width - 4) if width and line.strip() else [line]:
                click.echo(f"    {piece}".rstrip())
        click.echo("")
    if with_stat:
        _print_stat(repo, v)
        return
    _print_table(f"{len(d.tensors)} tensors", ("tensor", "dtype", "shape", "bytes"),
                 ((t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "()", _size(t["bytes"]))
                  for t in d.tensors), fold=3)
    if d.objects:
        _print_table(f"{len(d.objects)} objects", ("object", "value"), d.objects, fold=2)


def _print_stat(repo: ckptrepo.Repository, v: ckptrepo.Version) -> None:
    """``show --stat``: the module prefixes that changed since the first parent, as ``diff --stat`` prints."""
    if not v.parents:
        click.echo("root version: no parent to compare with")
        return
    d = repo.diff(v.parents[0], v.id)
    _print_table(f"{v.parents[0][:12]} -> {v.short_id}", ("prefix", "tensors", "changed", "||B-A||", "rel. change"),
                 ((g["prefix"], str(g["tensors"]), str(g["changed"]), _num(g["l2"]), _num(g["relative"]))
                  for g in sorted(d.by_prefix(), key=lambda g: natural_key(g["prefix"]))))
    for o in d.objects:
        _echo_fit(printable(f"object {o.path}: {o.status} {o.a or ''} -> {o.b or ''}".rstrip()))


@cli.command()
@click.argument("rev", required=False, shell_complete=_complete_revision)
@click.option("-b", "branch", default=None, help="Create branch NAME at REV and switch to it.")
@click.option("--orphan", "orphan", default=None, metavar="NAME",
              help="Switch to a new branch NAME with no versions: its first snapshot starts a new history (no "
                   "parent). Takes no REV.")
@click.pass_context
def checkout(ctx: click.Context, rev: str | None, branch: str | None, orphan: str | None) -> None:
    """Move HEAD to REV (roll back); with -b, start a new branch there; with --orphan, a new history."""
    repo = _repo(ctx)
    if orphan is not None:
        if rev is not None or branch is not None:
            raise click.UsageError("--orphan NAME takes no REV and no -b: the new branch starts with no versions")
        repo.checkout_orphan(orphan)
        click.echo(f"HEAD is now on new branch {orphan!r}, with no versions yet: its first snapshot starts a new "
                   f"history (no parent)")
        return
    if rev is None:
        raise click.UsageError("name the revision to check out (or --orphan NAME for a new history)")
    v = repo.checkout(rev, branch=branch)
    where = repo.current_branch()
    if where:
        click.echo(f"HEAD is now on branch {where!r} at {v.short_id} ({_step(v)})")
    else:
        click.echo(f"HEAD is now detached at {v.short_id} ({_step(v)}); "
                   f"to take snapshots from here: ckptrepo checkout {v.short_id} -b NAME")


def _list_refs(refs: dict[str, str], current: str | None, as_json: bool) -> None:
    names = sorted(refs, key=natural_key)   # v2 before v10
    if as_json:
        _emit_json([{"name": n, "version": refs[n], "current": n == current} for n in names])
        return
    for n in names:
        _echo_fit(f"{'*' if n == current else ' '} {n:20s} {refs[n][:12]}")


def _ref_command(kind: str, doc: str):
    """``branch`` and ``tag``: list with no NAME, create NAME at REV, or delete NAME with -d."""
    @cli.command(name=kind, help=doc)
    @click.argument("name", required=False, shell_complete=_complete_ref(kind))
    @click.argument("rev", required=False, default="HEAD", shell_complete=_complete_revision)
    @click.option("-d", "--delete", "delete", is_flag=True, help=f"Delete {kind} NAME.")
    @click.option("--json", "as_json", is_flag=True, help="Machine-readable output (listing).")
    @click.pass_context
    def command(ctx: click.Context, name: str | None, rev: str, delete: bool, as_json: bool,
                force: bool = False, move: bool = False) -> None:
        repo = _repo(ctx)
        if name is None:
            if delete or force:
                raise click.UsageError(f"name the {kind} to delete")
            refs = repo.branches() if kind == "branch" else repo.tags()
            for damage in repo.damaged_refs(kind):
                click.echo(f"warning: ignoring {damage}", err=True)
            _list_refs(refs, repo.current_branch() if kind == "branch" else None, as_json)
            return
        if move and delete:
            raise click.UsageError("-f moves a tag; -d deletes one: give one of them")
        if delete or force:
            if rev != "HEAD":
                raise click.UsageError(f"-d takes one {kind} name, not a revision")
            was = repo.delete_branch(name, force=force) if kind == "branch" else repo.delete_tag(name)
            click.echo(f"deleted {kind} {name!r} (was {was[:12] or 'damaged'})")
            return
        v = repo.branch(name, rev) if kind == "branch" else repo.tag(name, rev, force=move)
        click.echo(f"{'set' if move else 'created'} {kind} {name!r} at {v.short_id}")
    if kind == "branch":
        command = click.option("-D", "force", is_flag=True,
                               help="Delete branch NAME even if no other ref reaches its versions (gc may then "
                                    "collect them).")(command)
    else:
        command = click.option("-f", "--force", "move", is_flag=True,
                               help="Move tag NAME to REV if it exists (git tag -f).")(command)
    return command


branch = _ref_command("branch", "List branches, create branch NAME at REV (default HEAD), or delete one (-d, -D).")
tag = _ref_command("tag", "List tags, create tag NAME at REV (default HEAD; a tag moves only with -f), or delete "
                          "one (-d).")


@cli.command()
@click.argument("rev", shell_complete=_complete_revision)
@click.pass_context
def prune(ctx: click.Context, rev: str) -> None:
    """Delete the data of version REV now (its place in the history stays, as gc's pruning leaves it)."""
    repo = _repo(ctx)
    vid = repo.resolve(rev)
    freed = repo.prune(vid)
    click.echo(f"pruned {vid[:12]}: " + (f"{_size(freed)} freed" if freed else "nothing of its own to free"))


@cli.command()
@click.option("--repair-config", is_flag=True,
              help="First rebuild a damaged or missing ckptrepo.json from what the repository holds (format "
                   "version, default branch, creation time), saying what it did; an intact one is left as it is.")
@click.option("--repair", is_flag=True,
              help="First mark versions whose manifest a gc collected while a ref came to name them (`gc --grace 0` "
                   "beside a writer) lost, so that gc runs again: tag the versions that may have preceded each "
                   "lost/ID, and move a branch that names one back to the newest of them. Deletes nothing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def fsck(ctx: click.Context, repair_config: bool, repair: bool, as_json: bool) -> None:
    """Read every object and verify every checksum and reference; exit 1 if anything is broken."""
    repaired: list[str] = _repair_config(ctx) if repair_config else []
    repo = _repo(ctx)
    if repair:
        from ckptrepo.maintenance._lost import repair_lost
        repaired += repair_lost(repo.plumbing)
    if not as_json:
        for line in repaired:
            click.echo(f"repair: {line}")
    progress = _progress()
    if progress is not None:
        with progress:
            task = progress.add_task("fsck", total=None)   # sized once fsck has read the manifests
            report = repo.fsck(on_bytes=lambda n: progress.advance(task, n),
                               on_total=lambda n: progress.update(task, total=n))
    else:
        report = repo.fsck()
    if as_json:
        _emit_json(dict(report.to_json(), **({"repaired": repaired} if repair_config or repair else {})))
    else:
        for w in report.warnings:
            click.echo(f"warning: {w}")
        for e in report.errors:
            click.echo(f"error: {e}")
        status = "ok" if report.ok else f"{len(report.errors)} problem(s) found"
        click.echo(f"checked {report.versions} versions, {report.objects} data objects, {_size(report.bytes)}: "
                   f"{status}")
    if not report.ok:
        sys.exit(1)


def _repair_config(ctx: click.Context) -> list[str]:
    """Rebuild ckptrepo.json (see core._config_repair.repair_config): done on the store, as a repository whose
    config is damaged cannot be opened."""
    from ckptrepo.core._config_repair import repair_config
    from ckptrepo.storage import open_store
    url = ctx.obj["url"]
    if url.startswith("memory://"):
        raise CkptRepoError(MEMORY_ONLY.format("fsck"))
    return repair_config(open_store(url))


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Where HEAD is, and the snapshots in flight (or abandoned) and failed."""
    from ckptrepo.tools._status import age, repo_status
    repo = _repo(ctx)
    st = repo_status(repo.plumbing)
    if as_json:
        _emit_json(st.to_json())
        return
    if st.damage is not None:
        _echo_fit(printable(f"HEAD is damaged: {st.damage}"))
    elif st.head is None:
        _echo_fit(printable(f"On branch {st.branch}, which has no versions yet"))
    else:
        where = f"On branch {st.branch}" if st.branch else "HEAD detached"
        step = f"step {st.head_step}" if st.head_step is not None else "step -"
        _echo_fit(printable(f"{where} at {st.head[:12]} ({step}, {age(st.head_time)} ago)"))
    _echo_fit(f"{st.versions} version(s) in the repository")
    if st.uncommitted:
        click.echo(f"\n{len(st.uncommitted)} snapshot(s) in flight, or abandoned (data written, no version yet; gc "
                   f"deletes abandoned ones after its grace period):")
        for u in st.uncommitted:
            _echo_fit(f"  {u.id[:12]}  started {age(u.started)} ago" + ("  (distributed)" if u.distributed else ""))
    if st.failures:
        click.echo(f"\n{len(st.failures)} failed snapshot(s) or push(es) (see `ckptrepo log --all`):")
        for f in st.failures:
            when = age(_number(f.get("time")) or None)
            _echo_fit(printable(f"  {_failed_what(f)}{str(f.get('id'))[:12]}  step {f.get('step')}  {when} ago  "
                                f"{f.get('error')}"))
    if not st.uncommitted and not st.failures:
        click.echo("no snapshots in flight, none failed")


@cli.command()
@click.option("--keep-last", type=int, default=None, help="Keep the N newest versions of each branch.")
@click.option("--keep-every", type=int, default=None, help="Keep versions whose step is a multiple of K.")
@click.option("--keep-best", type=int, default=None, help="Keep the N versions with the best --metric.")
@click.option("--metric", "best_metric", default=None, help="The metric --keep-best ranks by (e.g. loss).")
@click.option("--mode", "best_mode", type=click.Choice(["min", "max"]), default="min", show_default=True,
              help="Whether the best --metric is the lowest or the highest.")
@click.option("--keep-tagged/--no-keep-tagged", default=True, show_default=True, help="Never prune tagged versions.")
@click.option("--keep-branch-heads/--no-keep-branch-heads", default=True, show_default=True,
              help="Never prune branch tips and HEAD.")
@click.option("--grace", "grace_s", type=float, default=3600.0, show_default=True,
              help="Seconds an unreferenced object must have existed before it is collected (protects writers: "
                   "0 can make snapshots that another process is committing fail).")
@click.option("--dry-run", is_flag=True, help="List what would be pruned and deleted; delete nothing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def gc(ctx: click.Context, keep_last: int | None, keep_every: int | None, keep_best: int | None,
       best_metric: str | None, best_mode: str, keep_tagged: bool, keep_branch_heads: bool, grace_s: float,
       dry_run: bool, as_json: bool) -> None:
    """Prune versions no retention rule keeps (history stays) and delete what no ref reaches."""
    r = _repo(ctx).gc(keep_last=keep_last, keep_every=keep_every, keep_tagged=keep_tagged,
                      keep_branch_heads=keep_branch_heads, grace_period_s=grace_s, dry_run=dry_run,
                      keep_best=keep_best, best_metric=best_metric, best_mode=best_mode)
    if as_json:
        _emit_json(r.to_json())
        return
    if dry_run:   # what would go, one line each, so that a gc can be checked before it deletes anything
        for what, vids in (("prune", r.pruned), ("collect", r.collected), ("delete leftover data of", r.orphan_data)):
            for vid in vids:
                click.echo(f"would {what} {vid[:12]}")
    verb = "would free" if dry_run else "freed"
    click.echo(f"kept {len(r.kept)} versions, pruned {len(r.pruned)}, collected {len(r.collected)} unreachable and "
               f"{len(r.orphan_data)} leftover data sets; {verb} {_size(r.stored_bytes_freed)} "
               f"({_size(r.bytes_freed)} of tensors)"
               + (f"; {len(r.too_young)} unreferenced objects are younger than the grace period"
                  if r.too_young else ""))


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def du(ctx: click.Context, as_json: bool) -> None:
    """Bytes of tensor data per version: unique to it, and shared with other versions (per stored array); the
    total as stored, and as tensor bytes."""
    usage = _repo(ctx).du()
    if as_json:
        _emit_json(usage.to_json())
        return
    for u in usage.versions:
        v = u.version
        _echo_fit(f"{v.short_id}  step {v.step if v.step is not None else '-':>8}  unique {_size(u.unique_bytes):>10}"
                  f"  shared {_size(u.shared_bytes):>10}" + ("  pruned" if v.pruned else ""))
    _echo_fit(f"total {_size(usage.stored_bytes)} stored ({_size(usage.total_bytes)} of tensors), "
              f"{len(usage.versions)} versions, each array once")


def _num(v: float | None) -> str:
    return "-" if v is None or v != v else f"{v:.4g}"


@cli.command()
@click.argument("a", shell_complete=_complete_revision)
@click.argument("b", required=False, shell_complete=_complete_revision)
@click.option("--against-parent", is_flag=True,
              help="Compare A with its first parent (what one revision alone does, as git show does).")
@click.option("--pattern", default=None, help="Only tensors whose name matches this glob (*, ?, [seq]): only "
                                               "their bytes are read.")
@click.option("--stat", "summary", is_flag=True, help="One line per module prefix instead of per tensor.")
@click.option("--depth", type=click.IntRange(min=1), default=2, show_default=True,
              help="Name components that make a prefix (--stat).")
@click.option("--sort", "sort_by", type=click.Choice(["name", "relative", "l2"]), default="name", show_default=True,
              help="Order of the rows: by name (numbers inside names by value: layers.2 before layers.10), or "
                   "largest first by relative change ||B-A||/||A|| or by ||B-A||.")
@click.option("--only-changed", is_flag=True, help="Hide unchanged tensors.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def diff(ctx: click.Context, a: str, b: str | None, against_parent: bool, pattern: str | None, summary: bool,
         depth: int, sort_by: str, only_changed: bool, as_json: bool) -> None:
    """Compare version A with B tensor by tensor and object by object; without B (or with --against-parent),
    compare A's first parent with A, as git show does. Reads the tensors on every core, in bounded memory."""
    if b is not None and against_parent:
        # one line, as every ckptrepo error (click's usage errors print three)
        raise ArgumentError("give B or --against-parent, not both: --against-parent compares A with its parent")
    repo = _repo(ctx)
    d = repo.diff(a, b, pattern)
    if b is None:
        a, b = d.a[:12], a   # the parent, then A
    if pattern is not None and not d.tensors:
        raise CkptRepoError(f"no tensor of {a} or {b} matches {pattern!r}; `ckptrepo show {b}` lists the names")
    title = f"{a} -> {b}"
    key = _row_key(sort_by)
    if as_json:   # the same rows as the table: --only-changed and --sort apply
        out_json = d.to_json()
        kept = (t for t in out_json["tensors"] if not (only_changed and t["status"] == "unchanged"))
        out_json["tensors"] = sorted(kept, key=key)
        _emit_json(dict(out_json, prefixes=sorted(d.by_prefix(depth), key=key)) if summary else out_json)
        return
    if only_changed and all(t.status == "unchanged" for t in d.tensors):
        click.echo(f"no tensor changed between {printable(a)} and {printable(b)}"
                   f"{'' if d.objects else ', and no object'}")
    elif summary:
        _print_table(title, ("prefix", "tensors", "changed", "||B-A||", "rel. change"),
                     ((g["prefix"], str(g["tensors"]), str(g["changed"]), _num(g["l2"]), _num(g["relative"]))
                      for g in sorted(d.by_prefix(depth), key=key)))
    else:
        rows = [t.to_json() for t in d.tensors if not (only_changed and t.status == "unchanged")]
        _print_table(title, ("tensor", "status", "||B-A||", "rel. change", "max |B-A|", "cosine"),
                     ((t["name"], t["status"], _num(t["l2"]), _num(t["relative"]), _num(t["max_abs"]),
                       _num(t["cosine"])) for t in sorted(rows, key=key)))
    for o in d.objects:
        _echo_fit(printable(f"object {o.path}: {o.status} {o.a or ''} -> {o.b or ''}".rstrip()))


def _row_key(sort_by: str) -> Callable[[dict[str, Any]], Any]:
    """How ``diff --sort`` orders its rows (per tensor, or per prefix with --stat)."""
    if sort_by == "name":
        return lambda r: natural_key(r["name"] if "name" in r else r["prefix"])
    return lambda r: -_sortable(r[sort_by])


@cli.command()
@click.argument("rev", default="HEAD", shell_complete=_complete_revision)
@click.option("--pattern", default=None, help="Only tensors whose name matches this glob (*, ?, [seq]).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def stats(ctx: click.Context, rev: str, pattern: str | None, as_json: bool) -> None:
    """Per tensor norm, mean, std, min/max, max |x| and NaN/Inf counts of REV.

    From the statistics REV recorded while it was captured; a version written without them is read."""
    rows = _repo(ctx).stats(rev, pattern)
    if as_json:
        _emit_json([r.to_json() for r in rows])
        return
    if pattern is not None and not rows:
        raise CkptRepoError(f"no tensor of {rev} matches {pattern!r}; `ckptrepo show {rev}` lists the names")
    _print_table(rev, ("tensor", "dtype", "norm", "mean", "std", "min", "max", "max |x|", "NaN", "Inf"),
                 ((r.name, r.dtype, _num(r.norm), _num(r.mean), _num(r.std), _num(r.min), _num(r.max),
                   _num(r.absmax), str(r.nan), str(r.inf)) for r in rows))


SERIES_COLUMNS = ("first", "last", "min", "max", "trend")
# tools/_trajectory.py's METRICS, spelled out so that parsing the command line imports no numpy
TENSOR_METRICS = ("norm", "mean", "std", "min", "max", "absmax", "nan", "inf", "delta", "relative-change")
CHANGES = ("delta", "relative-change")


def _series_row(name: str, values: list[float], spark: int | None) -> tuple[str, ...]:
    """A trajectory's or a metric's row: its name, then SERIES_COLUMNS (the sparkline's newest ``spark``
    values where the width allows no more)."""
    ordered = [v for v in values if v == v]   # min() and max() of a series that starts with NaN are NaN
    lo, hi = (min(ordered), max(ordered)) if ordered else (math.nan, math.nan)
    return (name, _num(values[0]), _num(values[-1]), _num(lo), _num(hi), keep_last(_sparkline(values), spark))


def _spark_width() -> int | None:
    """Cells a sparkline may take: a quarter of the width, at least 10 (None: no limit)."""
    width = _width()
    return None if width is None else max(10, width // 4)


_SPARK = "▁▂▃▄▅▆▇█"


def _sparkline(values: list[float]) -> str:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return ""
    lo, hi = min(finite), max(finite)
    span = (hi - lo) or 1.0
    return "".join(_SPARK[min(7, int((v - lo) / span * 7.999))] if math.isfinite(v) else " " for v in values)


def _write_csv(path: str, rows: Iterable[Sequence[Any]]) -> None:
    import csv
    try:
        with open(path, "w", newline="") as f:
            csv.writer(f).writerows(rows)
    except OSError as e:
        raise ExchangeError(f"could not write {path}: {errors.message(e)}") from None


def _write_png(path: str, draw: Any) -> None:
    try:
        draw()
    except OSError as e:
        raise ExchangeError(f"could not write {path}: {errors.message(e)}") from None


@cli.command()
@click.argument("pattern")
@click.option("--metric", type=click.Choice(TENSOR_METRICS), default="norm", show_default=True,
              help="What to follow: norm ||v||, mean, std, min, max, absmax max |v|, nan and inf counts (recorded "
                   "at capture); delta ||v - previous||; relative-change ||v - previous|| / ||previous|| "
                   "(previous: the version before in the range; none for the first).")
@click.option("--rev", default="HEAD", show_default=True, shell_complete=_complete_revision,
              help="Walk the first-parent history of this revision.")
@click.option("--since", type=int, default=None, help="First step to include.")
@click.option("--until", type=int, default=None, help="Last step to include.")
@click.option("--csv", "csv_path", metavar="FILE", default=None, help="Also write the rows as CSV.")
@click.option("--png", "png_path", metavar="FILE", default=None,
              help="Also plot them to a PNG file (needs ckptrepo[plot]).")
@click.option("--force", is_flag=True, help="Overwrite the --csv and --png files if they exist.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def trajectory(ctx: click.Context, pattern: str, metric: str, rev: str, since: int | None, until: int | None,
               csv_path: str | None, png_path: str | None, force: bool, as_json: bool) -> None:
    """A metric of the tensors matching PATTERN (a glob) across versions, with a terminal sparkline."""
    if png_path:
        plot.require_matplotlib()
    repo = _repo(ctx)
    png_path = _output(repo, png_path, force, "the plot")   # checked before the history is read
    csv_path = _output(repo, csv_path, force, "the CSV")
    if png_path is not None and png_path == csv_path:
        raise ExchangeError(f"--csv and --png both name {png_path}; give them two paths")
    points = repo.trajectory(pattern, metric, rev, since, until)
    if not points and not as_json:
        raise CkptRepoError(f"no {metric} values: no tensor matches {pattern!r} in the versions of {rev}"
                            f"{' in the --since/--until range' if since is not None or until is not None else ''}"
                            f"{' (delta and relative-change need two versions)' if metric in CHANGES else ''}")
    if png_path:
        _write_png(png_path, lambda: plot.trajectory_png(points, png_path, metric, pattern))
    if csv_path:
        _write_csv(csv_path, [["version", "step", "name", metric]] +
                   [[p.version, p.step, p.name, repr(p.value)] for p in points])
    if as_json:
        _emit_json([p.to_json() for p in points])
        return
    series: dict[str, list[float]] = {}
    for p in points:
        series.setdefault(p.name, []).append(p.value)
    spark = _spark_width()
    _print_table(f"{metric} of {pattern}", ("tensor",) + SERIES_COLUMNS,
                 (_series_row(name, v, spark) for name, v in series.items()))


@cli.command()
@click.option("--metric", default=None, help="A metric recorded with the versions (loss, lr, ...).")
@click.option("--tensor", "pattern", metavar="GLOB", default=None,
              help="Tensors whose name matches this glob; --stat says which statistic (with --nonfinite: where to "
                   "look for NaN and Inf).")
@click.option("--stat", default=None, metavar="STAT",
              help="The statistic of --tensor: norm (default), mean, std, min, max, absmax, nan, inf, delta or "
                   "relative-change.")
@click.option("--when", "condition", metavar="CONDITION", default=None,
              help="'above X' ('exceeds X', '> X'), 'below X' ('< X'), '>= X', '<= X', '== X', '!= X', "
                   "'rises above X', 'falls below X' (a crossing from the previous version), 'changes by more than "
                   "X' or 'X%', 'is nan', 'is inf', 'is not finite'.")
@click.option("--nonfinite", is_flag=True, help="The first version where a tensor holds a NaN or an Inf.")
@click.option("--rev", default="HEAD", show_default=True, shell_complete=_complete_revision,
              help="Walk the first-parent history of this revision.")
@click.option("--since", type=int, default=None, help="First step to include.")
@click.option("--until", type=int, default=None, help="Last step to include.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def bisect(ctx: click.Context, metric: str | None, pattern: str | None, stat: str | None, condition: str | None,
           nonfinite: bool, rev: str, since: int | None, until: int | None, as_json: bool) -> None:
    """The first version, oldest first along the history of --rev, where --metric or a --tensor statistic meets
    --when (or, with --nonfinite, that holds a NaN or an Inf), from the recorded metrics and capture-time
    statistics (the data of versions saved before those existed is read). Exit status 0 when one is found, 1 when
    no version matches, 2 for a usage error."""
    if nonfinite and (metric is not None or condition is not None or stat is not None):
        raise click.UsageError("--nonfinite takes no --metric, --stat or --when (narrow it with --tensor GLOB)")
    if not nonfinite:
        if (metric is None) == (pattern is None):
            raise click.UsageError("give one of --metric NAME, --tensor GLOB [--stat STAT], or --nonfinite")
        if metric is not None and stat is not None:
            raise click.UsageError("--stat goes with --tensor; a --metric is compared as recorded")
        if condition is None:
            raise click.UsageError("say what to look for with --when, e.g. --when 'rises above 3.0'")
    found = _repo(ctx).bisect(condition, metric=metric, tensor=pattern, stat=stat or "norm", nonfinite=nonfinite,
                              rev=rev, since=since, until=until)
    if nonfinite:
        what = f"a tensor{'' if pattern is None else ' matching ' + repr(pattern)} holds NaN or Inf"
    else:
        subject = metric if metric is not None else f"{stat or 'norm'} of {pattern}"
        what = f"{subject} {condition}"
    if found is None:
        if as_json:
            _emit_json({"found": False})
        else:
            in_range = " in the --since/--until range" if since is not None or until is not None else ""
            click.echo(printable(f"no version matches: {what}, along the first-parent history of {rev}{in_range}"))
        sys.exit(1)
    if as_json:
        _emit_json(found.to_json())
        return
    click.echo(printable(f"{found.version[:12]}  {_step_of(found.step)}  first version where {what}"))
    click.echo(f"version {found.version}")
    before = "" if found.previous is None else \
        f" (previous {_num(found.previous)} at {(found.previous_version or '-')[:12]})"
    label = "NaN+Inf elements" if nonfinite else found.what
    if found.tensor is None:
        _echo_fit(printable(f"{label} {_num(found.value)}{before}"))
        return
    _echo_fit(printable(f"tensor  {found.tensor}: {label} {_num(found.value)}{before}"))
    others = [n for n in found.tensors if n != found.tensor]
    if others:
        _echo_fit(printable(f"also    {len(others)} more at this version: {', '.join(others)}"))


def _step_of(step: int | None) -> str:
    return f"step {step}" if step is not None else "step -"


@cli.command()
@click.argument("rev", default="HEAD", shell_complete=_complete_revision)
@click.option("--png", "png_path", metavar="FILE", default=None,
              help="Also plot them to a PNG file, one panel per metric (needs ckptrepo[plot]).")
@click.option("--force", is_flag=True, help="Overwrite the --png file if it exists.")
@click.option("--tensorboard", "tb_dir", metavar="DIR", default=None,
              help="Also write them, with the capture statistics, as TensorBoard scalars to DIR "
                   "(needs ckptrepo[tensorboard]).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def metrics(ctx: click.Context, rev: str, png_path: str | None, force: bool, tb_dir: str | None,
            as_json: bool) -> None:
    """The recorded metrics (loss, lr, ...) along the first-parent history of REV, with a terminal sparkline."""
    if png_path:
        plot.require_matplotlib()
    repo = _repo(ctx)
    png_path = _output(repo, png_path, force, "the plot")
    if tb_dir:
        n = repo.metrics_to_tensorboard(tb_dir, rev)
        if not as_json:
            click.echo(f"wrote {n} scalars to {tb_dir}", err=True)
    rows = repo.metrics(rev)
    if png_path:
        _write_png(png_path, lambda: plot.metrics_png(rows, png_path, f"metrics of {rev}"))
    if as_json:
        _emit_json(rows)
        return
    spark = _spark_width()
    _print_table(f"metrics of {rev}", ("metric",) + SERIES_COLUMNS,
                 (_series_row(name, v, spark) for name, (_, v) in plot.metric_series(rows).items()))


@cli.command()
@click.option("--port", type=click.IntRange(0, 65535), default=8765, show_default=True,
              help="Port on 127.0.0.1 to serve on (0: any free port).")
@click.option("--rev", default="HEAD", show_default=True, shell_complete=_complete_revision,
              help="Whose first-parent history the metrics and the heatmap follow (the page can change it).")
@click.pass_context
def ui(ctx: click.Context, port: int, rev: str) -> None:
    """Serve a web page of the history on 127.0.0.1 (read-only, until Ctrl-C): the version graph, metric
    curves, a heatmap of a per-tensor statistic over the steps, and each version's tensors and diff."""
    from ckptrepo.ui import serve
    repo = _repo(ctx)
    if not (rev == "HEAD" and repo.plumbing.head_version() is None):   # an empty repository shows an empty page
        repo.resolve(rev)   # a revision that names nothing fails here, before the port is taken

    def ready(server: Any) -> None:
        click.echo(f"serving {repo.url} at {server.url} (read-only; Ctrl-C to stop)")

    serve(repo, port, rev, ready)


@cli.command()
@click.argument("rev", shell_complete=_complete_revision)
@click.argument("out_path", metavar="OUT")
@click.option("--format", "fmt", type=click.Choice(["torch", "safetensors", "dcp", "hf"]), default="torch",
              show_default=True,
              help="torch: OUT is a torch.save file that torch.load(weights_only=True) reads (numpy values become "
                   "tensors and plain numbers); safetensors: OUT is a directory (model.safetensors + "
                   "objects.json); dcp: OUT is a torch.distributed.checkpoint directory; hf: OUT is a Hugging Face "
                   "model folder (config.json + model.safetensors) of the state's 'model'.")
@click.option("--max-shard-size", default=None, metavar="SIZE",
              help="hf: the largest safetensors file, as HF counts ('5GB' = 5*10^9 bytes, the default; '500MB').")
@click.option("--force", is_flag=True, help="Replace OUT if it exists (a folder only if it holds an export).")
@click.pass_context
def export(ctx: click.Context, rev: str, out_path: str, fmt: str, max_shard_size: str | None, force: bool) -> None:
    """Write the full, unsharded state of REV to OUT in a plain checkpoint format."""
    v = _repo(ctx).export(rev, out_path, format=fmt, force=force, max_shard_size=max_shard_size)
    click.echo(f"exported {v.short_id} ({_step(v)}) to {out_path} as {fmt}")


@cli.command(name="import")
@click.argument("path")
@click.option("--trust", is_flag=True,
              help="Allow full pickle (torch files with arbitrary objects, DCP): it can run code from the file.")
@click.option("--step", type=int, default=None,
              help="The training step to record (default: the int under the state's 'step' key, if any).")
@click.option("-m", "--message", default=None, help="Version message (default: where it was imported from).")
@click.pass_context
def import_(ctx: click.Context, path: str, trust: bool, step: int | None, message: str | None) -> None:
    """Commit a torch.save file, a DCP checkpoint, a safetensors export or an HF model folder as a new version on
    the current branch."""
    repo = _repo(ctx)
    v = repo.import_state(path, trust=trust, step=step, message=message)
    click.echo(f"imported {path} as {v.short_id} ({_step(v)}) on branch {repo.current_branch()!r}")


# ---- remotes ---------------------------------------------------------------------------------------------------
def _location(url: str) -> str:
    """A repository URL as a remote records it: a local path made absolute, so that the remote is the same
    wherever the command runs from."""
    if url.startswith("memory://"):
        raise CkptRepoError("a memory:// repository lives only in the process that creates it, so the CLI cannot "
                            "reach one as a remote; use a path, or an s3:// or gs:// URL")
    return url if "://" in url or url.startswith("file:") else os.path.abspath(url)


@cli.group(invoke_without_command=True)
@click.option("-v", "--verbose", is_flag=True, help="Show each remote's URL.")
@click.pass_context
def remote(ctx: click.Context, verbose: bool) -> None:
    """Remotes: other repositories (usually on an object store) to push versions to and fetch them from, as
    git's. With no subcommand, list their names (-v: with URLs)."""
    if ctx.invoked_subcommand is None:
        _list_remotes(_repo(ctx), verbose, False)


def _list_remotes(repo: ckptrepo.Repository, verbose: bool, as_json: bool) -> None:
    found = repo.remotes()
    if as_json:
        _emit_json([{"name": n, "url": found[n]} for n in sorted(found)])
        return
    for name in sorted(found):
        _echo_fit(printable(f"{name}\t{found[name]}" if verbose else name))


@remote.command(name="list")
@click.option("-v", "--verbose", is_flag=True, help="Show each remote's URL.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (names and URLs).")
@click.pass_context
def remote_list(ctx: click.Context, verbose: bool, as_json: bool) -> None:
    """List the remotes (-v: with their URLs)."""
    _list_remotes(_repo(ctx), verbose or bool(ctx.parent and ctx.parent.params.get("verbose")), as_json)


@remote.command(name="add")
@click.argument("name")
@click.argument("url")
@click.pass_context
def remote_add(ctx: click.Context, name: str, url: str) -> None:
    """Add remote NAME at URL (a path, s3://BUCKET/PREFIX or gs://BUCKET/PREFIX); nothing is contacted yet."""
    repo = _repo(ctx)
    repo.remote_add(name, _location(url))
    _echo_fit(printable(f"added remote {name!r} at {repo.remotes()[name]}"))


@remote.command(name="remove")
@click.argument("name")
@click.pass_context
def remote_remove(ctx: click.Context, name: str) -> None:
    """Forget remote NAME and its remote-tracking refs (NAME/BRANCH); nothing there is deleted."""
    _repo(ctx).remote_remove(name)
    _echo_fit(printable(f"removed remote {name!r}"))


def _transfer(what: str, call: Callable[[Callable[[int, int], None] | None], Any]) -> Any:
    """``call(progress)``: with a byte progress bar on a terminal (stderr), quietly otherwise."""
    bar = _progress()
    if bar is None:
        return call(None)
    with bar:
        task = bar.add_task(what, total=None)
        return call(lambda done, total: bar.update(task, completed=done, total=total or None))


def _push_refs(repo: ckptrepo.Repository, names: Sequence[str]) -> tuple[list[str] | None, list[str]]:
    """The branches and tags ``push`` was given (refs/heads/NAME and refs/tags/NAME say which where a branch and
    a tag share a name); no names: the current branch."""
    if not names:
        return None, []
    branches, tags = repo.branches(), repo.tags()
    out_branches: list[str] = []
    out_tags: list[str] = []
    for name in names:
        if name.startswith("refs/heads/"):
            out_branches.append(name[len("refs/heads/"):])
        elif name.startswith("refs/tags/"):
            out_tags.append(name[len("refs/tags/"):])
        elif name in branches and name in tags:
            raise CkptRepoError(f"both a branch and a tag are named {name!r}; push refs/heads/{name} or "
                                f"refs/tags/{name}")
        elif name in branches:
            out_branches.append(name)
        elif name in tags:
            out_tags.append(name)
        else:
            raise ckptrepo.RefError(f"no branch or tag named {name!r} here; list them with `ckptrepo branch` and "
                                    f"`ckptrepo tag`")
    return out_branches, out_tags


def _ref_lines(refs: Iterable[Any]) -> list[str]:
    """The refs a push or fetch moved (its RefUpdates), as git prints them: ``* [new branch]  main -> main``,
    ``abc..def  main -> origin/main``; refs already up to date are left out, as git does."""
    rows = []
    for u in refs:
        parts = u.ref.split("/")
        if u.status == "up to date" or len(parts) < 3:
            continue
        if parts[1] == "remotes":   # fetch: the remote's branch -> its remote-tracking ref
            src, dst = "/".join(parts[3:]), "/".join(parts[2:])
        else:
            src = dst = "/".join(parts[2:])
        if u.status == "created":
            summary, flag = f"[new {'tag' if parts[1] == 'tags' else 'branch'}]", "*"
        elif u.status == "fast-forward" and u.old:
            summary, flag = f"{u.old[:12]}..{u.new[:12]}", " "
        else:
            summary, flag = f"[{u.status}]", " "
        rows.append((flag, summary, src, dst))
    width = max((len(r[1]) for r in rows), default=0)
    return [printable(f" {flag} {summary:<{width}}  {src} -> {dst}") for flag, summary, src, dst in rows]


def _copied(result: Any, verb: str) -> str:
    n, arrays = len(result.versions), result.arrays
    return f"{verb} {n} version{'s' * (n != 1)}, {arrays} array{'s' * (arrays != 1)}, {_size(result.bytes)}"


@cli.command()
@click.argument("remote_name", metavar="[REMOTE]", required=False, default="origin")
@click.argument("refs", metavar="[REF]...", nargs=-1)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def push(ctx: click.Context, remote_name: str, refs: tuple[str, ...], as_json: bool) -> None:
    """Copy the versions that branches and tags REF (default: the current branch) reach to REMOTE (default
    origin), what it lacks only, then move its branches, as a fast-forward only: a remote branch that has
    versions this repository lacks rejects the push (fetch first)."""
    repo = _repo(ctx)
    branches, tags = _push_refs(repo, refs)
    result = _transfer(f"push to {remote_name}", lambda p: repo.push(remote_name, branches, tags, progress=p))
    if as_json:
        _emit_json(result.to_json())
        return
    lines = _ref_lines(result.refs)
    _echo_fit(printable(f"To {result.url}"))
    for line in lines or ["Everything up-to-date"]:
        _echo_fit(line)
    if result.versions:
        _echo_fit(_copied(result, "pushed"))


@cli.command()
@click.argument("remote_name", metavar="[REMOTE]", required=False, default="origin")
@click.option("--lazy", is_flag=True, help="Copy manifests and refs only: tensor data is read from REMOTE when a "
                                           "version is loaded (only the byte ranges the load needs).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def fetch(ctx: click.Context, remote_name: str, lazy: bool, as_json: bool) -> None:
    """Copy the versions REMOTE's (default origin) branches and tags reach that are not here, and record where
    its branches are (REMOTE/BRANCH, a revision like any other); local branches do not move."""
    repo = _repo(ctx)
    result = _transfer(f"fetch {remote_name}", lambda p: repo.fetch(remote_name, lazy=lazy, progress=p))
    if as_json:
        _emit_json(result.to_json())
        return
    _print_fetched(result, lazy)


def _print_fetched(result: Any, lazy: bool) -> None:
    lines = _ref_lines(u for u in result.refs if not u.ref.startswith("refs/heads/"))   # pull's own: below
    if lines:
        _echo_fit(printable(f"From {result.url}"))
        for line in lines:
            _echo_fit(line)
    if result.versions:
        _echo_fit(_copied(result, "fetched") + (" (manifests only: tensor data is read from "
                                                f"{result.remote} when loaded)" if lazy else ""))


@cli.command()
@click.argument("remote_name", metavar="[REMOTE]", required=False, default="origin")
@click.option("--lazy", is_flag=True, help="Fetch manifests and refs only (see fetch --lazy).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def pull(ctx: click.Context, remote_name: str, lazy: bool, as_json: bool) -> None:
    """Fetch REMOTE (default origin), then fast-forward the current branch to REMOTE's branch of the same name;
    branches that have diverged are left as they are, with what to do."""
    repo = _repo(ctx)
    result = _transfer(f"fetch {remote_name}", lambda p: repo.pull(remote_name, lazy=lazy, progress=p))
    if as_json:
        _emit_json(result.to_json())
        return
    _print_fetched(result, lazy)
    mine = next((u for u in result.refs if u.ref.startswith("refs/heads/")), None)
    if mine is None or mine.status == "up to date":
        click.echo("Already up to date.")
    else:
        click.echo(f"Updating {(mine.old or '')[:12] or '(no versions)'}..{mine.new[:12]}\nFast-forward")


@cli.command()
@click.argument("url")
@click.argument("directory")
@click.option("--depth", type=click.IntRange(min=1), default=None,
              help="Copy tensor data for the newest N versions of each branch only; every manifest is copied, "
                   "and older versions read their data from the remote when loaded.")
@click.option("--lazy", is_flag=True, help="Copy manifests and refs only: tensor data is read from the remote when "
                                           "a version is loaded (only the byte ranges the load needs).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def clone(url: str, directory: str, depth: int | None, lazy: bool, as_json: bool) -> None:
    """Clone the repository at URL into the new directory DIRECTORY, with URL as remote origin and HEAD on the
    remote HEAD's branch."""
    url = _location(url)
    if directory.startswith("memory://"):
        raise CkptRepoError(MEMORY_ONLY.format("clone"))
    copied = [0]

    def run_clone(progress: Callable[[int, int], None] | None) -> ckptrepo.Repository:
        def counted(done: int, total: int) -> None:
            copied[0] = done
            if progress is not None:
                progress(done, total)
        return ckptrepo.clone(url, directory, depth=depth, lazy=lazy, progress=counted)
    repo = _transfer(f"clone {url}", run_clone)
    branch = repo.current_branch()
    head = repo.plumbing.head_version()
    versions = len(repo.plumbing.ids_with_prefix(""))
    if as_json:
        _emit_json({"url": url, "directory": repo.url, "remote": "origin", "branch": branch, "head": head,
                    "versions": versions, "bytes": copied[0], "lazy": lazy, "depth": depth})
        return
    at = f"at {head[:12]}" if head else "with no versions yet"
    how = (" (manifests only: tensor data is read from origin when loaded)" if lazy else
           f" (tensor data of the newest {depth} versions of each branch; older ones read from origin when "
           f"loaded)" if depth else "")
    _echo_fit(printable(f"cloned {url} into {directory}: {versions} version{'s' * (versions != 1)}, "
                        f"{_size(copied[0])}, branch "
                        f"{branch!r} {at}{how}"))


def main() -> None:
    """Entry point: run the CLI, turning every error into one line on stderr and a non-zero exit."""
    try:
        # named, not guessed from how Python was started: completion reads _CKPTREPO_COMPLETE under any launcher
        cli.main(standalone_mode=False, prog_name="ckptrepo")
    except click.exceptions.Abort:
        _err().print("aborted")
        sys.exit(130)
    except click.ClickException as e:
        errors.show_usage_error(e)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - the CLI never shows a traceback unless asked
        if errors.debugging() and not isinstance(e, CkptRepoError):
            raise
        errors.report(e)
        sys.exit(2)


__all__ = ["cli", "main"]

if __name__ == "__main__":
    main()
