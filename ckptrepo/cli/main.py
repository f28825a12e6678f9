"""``ckptrepo`` commands. Each one parses, calls the library, and prints; no logic lives here."""
from __future__ import annotations

import json
import math
import os
import re
import sys
from datetime import datetime
from typing import Any, Iterable, Sequence

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn
from rich.table import Table
from rich.text import Text

import ckptrepo
from ckptrepo.errors import CkptRepoError
from ckptrepo.tools import _plot as plot
from ckptrepo.tools._graph import GraphRow
from ckptrepo.tools._graph import graph as graph_rows

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


NAME_WIDTH = 40   # a folded name column keeps at least this many characters per line


def _print_table(title: str, headers: Sequence[str], rows: Iterable[Sequence[str]], fold: int = 1) -> None:
    """Print a table without cutting any cell short, which rich does by default ("model/…", "0.03…").

    The first ``fold`` columns (names, values) fold onto more lines in a narrow terminal, keeping at least
    ``NAME_WIDTH`` characters; the other columns (numbers, sizes) never wrap. Output that is not a terminal
    (a pipe, a file) is as wide as its content instead of rich's 80 characters.
    """
    rows = [list(r) for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    # cells are Text, not markup: a name like "experts[0]" or a message "[wip]" is shown as it is (as markup it would be
    # cut, and "[/]" would stop the command with a MarkupError)
    table = Table(title=Text(title), title_justify="left")
    for i, h in enumerate(headers):
        if i < fold:
            widths[i] = min(NAME_WIDTH, widths[i])
            table.add_column(h, overflow="fold", min_width=widths[i])
        else:
            table.add_column(h, no_wrap=True)
    for r in rows:
        table.add_row(*(Text(printable(c)) for c in r))
    # rich lays a table out within the console's width, crushing columns to fit: give it the room it needs
    # (wider than a narrow terminal, whose lines then wrap, rather than cells cut short)
    need = sum(widths) + 3 * len(widths) + 1   # each cell padded by a space on both sides, plus the borders
    width = out.width
    out.width = max(width, need) if out.is_terminal else 1 << 16
    try:
        out.print(table)
    finally:
        out.width = width


def _repo(ctx: click.Context) -> ckptrepo.Repository:
    return ckptrepo.open(ctx.obj["url"])


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _when(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _metrics(m: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items())


def _log_line(v: ckptrepo.Version) -> str:
    """One version as ``log`` prints it (rich markup; what comes from the user is escaped, and of the message
    only its first line is shown, as ``git log --oneline`` does)."""
    refs = f" ({', '.join(v.refs)})" if v.refs else ""
    step = _step(v)
    size = "pruned" if v.pruned else _size(v.size)
    return (f"[yellow]{v.short_id}[/]{_literal(refs)}  {step}  {_when(v.time)}  {size}  "
            f"{_literal(_metrics(v.metrics))}  "
            f"{_literal(_first_line(v.message))}").rstrip()


def _step(v: ckptrepo.Version) -> str:
    return f"step {v.step}" if v.step is not None else "step -"


def _literal(text: str) -> str:
    """``text`` as rich markup that prints it as it is, without terminal control codes."""
    return escape(printable(text))


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
    click.echo(json.dumps(_finite(data), indent=2, default=str, allow_nan=False))


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
    if not err.is_terminal:
        return None
    return Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    console=err, transient=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--repo", "url", envvar="CKPTREPO_REPO", default=".", show_default="$CKPTREPO_REPO or .",
              help="Repository URL: a path, file://, memory://, s3://BUCKET/PREFIX or gs://BUCKET/PREFIX.")
@click.version_option(ckptrepo.__version__, prog_name="ckptrepo")
@click.pass_context
def cli(ctx: click.Context, url: str) -> None:
    """Git for training state: a versioned checkpoint repository."""
    ctx.obj = {"url": url}


@cli.command()
@click.argument("url", required=False)
@click.option("--exist-ok", is_flag=True, help="Succeed if a repository is already there.")
@click.pass_context
def init(ctx: click.Context, url: str | None, exist_ok: bool) -> None:
    """Create a repository at URL (default: --repo)."""
    try:
        repo = ckptrepo.init(url or ctx.obj["url"], exist_ok=exist_ok)
    except ckptrepo.RepositoryExistsError:
        raise ckptrepo.RepositoryExistsError(f"a repository already exists at {url or ctx.obj['url']}; use it with "
                                             f"--repo, or pass --exist-ok") from None
    existing = repo.log(all=True, limit=1) if exist_ok else []
    click.echo(f"{'reinitialised existing' if existing else 'initialised empty'} ckptrepo repository at {repo.url}")


@cli.command()
@click.argument("rev", required=False, default="HEAD")
@click.option("--all", "all_", is_flag=True, help="Versions reachable from any branch or tag.")
@click.option("-n", "--max-count", type=click.IntRange(min=1), default=None, help="Show at most N versions.")
@click.option("--since", type=int, default=None, help="Only versions with step >= SINCE.")
@click.option("--until", type=int, default=None, help="Only versions with step <= UNTIL.")
@click.option("--stats", "with_stats", is_flag=True, help="Capture statistics of each version.")
@click.option("--graph", is_flag=True, help="Draw forks and joins of the history (with --all: every branch).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def log(ctx: click.Context, rev: str, all_: bool, max_count: int | None, since: int | None, until: int | None,
        with_stats: bool, graph: bool, as_json: bool) -> None:
    """List versions, newest first (with --all, also snapshots that failed)."""
    if graph and (as_json or with_stats):
        raise click.UsageError("--graph cannot be combined with --json or --stats")
    repo = _repo(ctx)
    versions = repo.log(rev, all=all_, limit=max_count, since=since, until=until)
    failures = repo.failures() if all_ else []
    stats = {v.id: repo.capture_stats(v.id) for v in versions} if with_stats else {}
    if as_json:
        rows = [dict(v.to_json(), **({"stats": stats[v.id]} if with_stats else {})) for v in versions]
        _emit_json(rows + [dict(f, failed=True) for f in failures] if all_ else rows)
        return
    if not versions and not failures:
        click.echo("no versions match --since/--until" if since is not None or until is not None else "no versions yet")
    for row in graph_rows(versions) if graph else [GraphRow("", v) for v in versions]:
        if row.version is None:   # a line that only connects columns
            click.echo(row.prefix)
            continue
        out.print(_literal(row.prefix) + _log_line(row.version), markup=True)
        if with_stats:
            s = stats[row.version.id]
            click.echo("    " + (f"blocking {s['blocking_s'] * 1e3:.1f} ms  capture {s['capture_s'] * 1e3:.1f} ms  "
                                 f"flush {s['flush_s'] * 1e3:.1f} ms  total {s['total_s'] * 1e3:.1f} ms  "
                                 f"{s['gbps']:.2f} GB/s"
                                 + (f"  copied {s['copied_bytes'] / 1e6:.1f} MB" if "copied_bytes" in s else "")
                                 if s else "no statistics recorded"))
    for f in failures:
        out.print(f"[red]FAILED[/] {f['id'][:12]}  step {f.get('step')}  {_when(f.get('time', 0))}  "
                  f"{_literal(str(f.get('error')))}",
                  markup=True)


@cli.command()
@click.argument("rev", default="HEAD")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def show(ctx: click.Context, rev: str, as_json: bool) -> None:
    """Show one version: header, tensors (name, dtype, shape, bytes) and objects."""
    d = _repo(ctx).show(rev)
    if as_json:
        _emit_json({"version": d.version.to_json(), "layout": d.layout, "tensors": d.tensors,
                    "objects": [{"path": p, "value": v} for p, v in d.objects]})
        return
    v = d.version
    click.echo(f"version {v.id}")
    if v.refs:
        click.echo(f"refs    {', '.join(v.refs)}")
    click.echo(f"parents {' '.join(v.parents) or '-'}")
    size = "pruned: gc deleted its data (the tensors below are what was saved)" if v.pruned else _size(v.size)
    click.echo(f"step    {v.step if v.step is not None else '-'}\ntime    {_when(v.time)}\nsize    {size}")
    if d.layout.get("world_size", 1) > 1:
        degrees = " ".join(f"{k}={d.layout[k]}" for k in ("tp", "pp", "dp", "zero") if k in d.layout)
        click.echo(f"layout  {degrees + ', ' if degrees else ''}{d.layout['world_size']} ranks")
    if v.metrics:
        click.echo(f"metrics {_metrics(v.metrics)}")
    if v.message:
        click.echo("\n" + "\n".join(f"    {line}" for line in printable(v.message).splitlines()) + "\n")
    _print_table(f"{len(d.tensors)} tensors", ("tensor", "dtype", "shape", "bytes"),
                 ((t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "()", _size(t["bytes"]))
                  for t in d.tensors))
    if d.objects:
        _print_table(f"{len(d.objects)} objects", ("object", "value"), d.objects, fold=2)


@cli.command()
@click.argument("rev", required=False)
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
    if as_json:
        _emit_json([{"name": n, "version": vid, "current": n == current} for n, vid in sorted(refs.items())])
        return
    for n, vid in sorted(refs.items()):
        click.echo(f"{'*' if n == current else ' '} {n:20s} {vid[:12]}")


def _ref_command(kind: str, doc: str):
    """``branch`` and ``tag``: list with no NAME, create NAME at REV, or delete NAME with -d."""
    @cli.command(name=kind, help=doc)
    @click.argument("name", required=False)
    @click.argument("rev", required=False, default="HEAD")
    @click.option("-d", "--delete", "delete", is_flag=True, help=f"Delete {kind} NAME.")
    @click.option("--json", "as_json", is_flag=True, help="Machine-readable output (listing).")
    @click.pass_context
    def command(ctx: click.Context, name: str | None, rev: str, delete: bool, as_json: bool,
                force: bool = False) -> None:
        repo = _repo(ctx)
        if name is None:
            if delete or force:
                raise click.UsageError(f"name the {kind} to delete")
            refs = repo.branches() if kind == "branch" else repo.tags()
            for damage in repo.damaged_refs(kind):
                click.echo(f"warning: ignoring {damage}", err=True)
            _list_refs(refs, repo.current_branch() if kind == "branch" else None, as_json)
            return
        if delete or force:
            if rev != "HEAD":
                raise click.UsageError(f"-d takes one {kind} name, not a revision")
            was = repo.delete_branch(name, force=force) if kind == "branch" else repo.delete_tag(name)
            click.echo(f"deleted {kind} {name!r} (was {was[:12] or 'damaged'})")
            return
        v = (repo.branch if kind == "branch" else repo.tag)(name, rev)
        click.echo(f"created {kind} {name!r} at {v.short_id}")
    if kind == "branch":
        command = click.option("-D", "force", is_flag=True,
                               help="Delete branch NAME even if no other ref reaches its versions (gc may then "
                                    "collect them).")(command)
    return command


branch = _ref_command("branch", "List branches, create branch NAME at REV (default HEAD), or delete one (-d, -D).")
tag = _ref_command("tag", "List tags, create tag NAME at REV (default HEAD; tags never move), or delete one (-d).")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def fsck(ctx: click.Context, as_json: bool) -> None:
    """Read every object and verify every checksum and reference; exit 1 if anything is broken."""
    repo = _repo(ctx)
    progress = _progress()
    if progress is not None:
        with progress:
            task = progress.add_task("fsck", total=None)   # sized once fsck has read the manifests
            report = repo.fsck(on_bytes=lambda n: progress.advance(task, n),
                               on_total=lambda n: progress.update(task, total=n))
    else:
        report = repo.fsck()
    if as_json:
        _emit_json(report.to_json())
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
                   "0 can collect a snapshot being committed by another process).")
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
        click.echo(f"{v.short_id}  step {v.step if v.step is not None else '-':>8}  unique {_size(u.unique_bytes):>10}"
                   f"  shared {_size(u.shared_bytes):>10}" + ("  pruned" if v.pruned else ""))
    click.echo(f"total {_size(usage.stored_bytes)} stored ({_size(usage.total_bytes)} of tensors) for "
               f"{len(usage.versions)} versions (each array counted once)")


def _num(v: float | None) -> str:
    return "-" if v is None or v != v else f"{v:.4g}"


@cli.command()
@click.argument("a")
@click.argument("b")
@click.option("--stat", "summary", is_flag=True, help="One line per module prefix instead of per tensor.")
@click.option("--depth", default=2, show_default=True, help="Name components that make a prefix (--stat).")
@click.option("--sort", "sort_by", type=click.Choice(["name", "relative", "l2"]), default="name", show_default=True)
@click.option("--only-changed", is_flag=True, help="Hide unchanged tensors.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def diff(ctx: click.Context, a: str, b: str, summary: bool, depth: int, sort_by: str, only_changed: bool,
         as_json: bool) -> None:
    """Compare two versions tensor by tensor (streamed: memory stays bounded) and object by object."""
    d = _repo(ctx).diff(a, b)
    key = {"name": lambda r: r["name"] if "name" in r else r["prefix"],
           "relative": lambda r: -_sortable(r["relative"]),
           "l2": lambda r: -_sortable(r["l2"])}[sort_by]
    if as_json:   # the same rows as the table: --only-changed and --sort apply
        out_json = d.to_json()
        kept = (t for t in out_json["tensors"] if not (only_changed and t["status"] == "unchanged"))
        out_json["tensors"] = sorted(kept, key=key)
        _emit_json(dict(out_json, prefixes=sorted(d.by_prefix(depth), key=key)) if summary else out_json)
        return
    if summary:
        _print_table(f"{a} -> {b}", ("prefix", "tensors", "changed", "||B-A||", "rel. change"),
                     ((g["prefix"], str(g["tensors"]), str(g["changed"]), _num(g["l2"]), _num(g["relative"]))
                      for g in sorted(d.by_prefix(depth), key=key)))
    else:
        rows = [t.to_json() for t in d.tensors if not (only_changed and t.status == "unchanged")]
        _print_table(f"{a} -> {b}", ("tensor", "status", "||B-A||", "rel. change", "max |B-A|", "cosine"),
                     ((t["name"], t["status"], _num(t["l2"]), _num(t["relative"]), _num(t["max_abs"]),
                       _num(t["cosine"])) for t in sorted(rows, key=key)))
    for o in d.objects:
        click.echo(printable(f"object {o.path}: {o.status} {o.a or ''} -> {o.b or ''}".rstrip()))


@cli.command()
@click.argument("rev", default="HEAD")
@click.option("--pattern", default=None, help="Only tensors whose name matches this glob.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def stats(ctx: click.Context, rev: str, pattern: str | None, as_json: bool) -> None:
    """Per tensor norm, mean, std, min/max and NaN/Inf counts of REV (streamed)."""
    rows = _repo(ctx).stats(rev, pattern)
    if as_json:
        _emit_json([r.to_json() for r in rows])
        return
    _print_table(rev, ("tensor", "dtype", "norm", "mean", "std", "min", "max", "NaN", "Inf"),
                 ((r.name, r.dtype, _num(r.norm), _num(r.mean), _num(r.std), _num(r.min), _num(r.max), str(r.nan),
                   str(r.inf)) for r in rows))


SERIES_COLUMNS = ("first", "last", "min", "max", "trend")


def _series_row(name: str, values: list[float]) -> tuple[str, ...]:
    """A trajectory's or a metric's row: its name, then SERIES_COLUMNS."""
    ordered = [v for v in values if v == v]   # min() and max() of a series that starts with NaN are NaN
    lo, hi = (min(ordered), max(ordered)) if ordered else (math.nan, math.nan)
    return (name, _num(values[0]), _num(values[-1]), _num(lo), _num(hi), _sparkline(values))


_SPARK = "▁▂▃▄▅▆▇█"


def _sparkline(values: list[float]) -> str:
    finite = [v for v in values if v == v and abs(v) != float("inf")]
    if not finite:
        return ""
    lo, hi = min(finite), max(finite)
    span = (hi - lo) or 1.0
    return "".join(" " if v not in finite else _SPARK[min(7, int((v - lo) / span * 7.999))] for v in values)


@cli.command()
@click.argument("pattern")
@click.option("--metric", type=click.Choice(["norm", "delta", "relative-change"]), default="norm", show_default=True)
@click.option("--rev", default="HEAD", show_default=True, help="Walk the first-parent history of this revision.")
@click.option("--since", type=int, default=None, help="First step to include.")
@click.option("--until", type=int, default=None, help="Last step to include.")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None, help="Also write the rows as CSV.")
@click.option("--png", "png_path", type=click.Path(dir_okay=False), default=None,
              help="Also plot them to a PNG file (needs ckptrepo[plot]).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def trajectory(ctx: click.Context, pattern: str, metric: str, rev: str, since: int | None, until: int | None,
               csv_path: str | None, png_path: str | None, as_json: bool) -> None:
    """A metric of the tensors matching PATTERN (a glob) across versions, with a terminal sparkline."""
    if png_path:
        plot.require_matplotlib()
    points = _repo(ctx).trajectory(pattern, metric, rev, since, until)
    if png_path:
        plot.trajectory_png(points, png_path, metric, pattern)
    if csv_path:
        import csv
        with open(csv_path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["version", "step", "name", metric])
            for p in points:
                w.writerow([p.version, p.step, p.name, repr(p.value)])
    if as_json:
        _emit_json([p.to_json() for p in points])
        return
    series: dict[str, list[float]] = {}
    for p in points:
        series.setdefault(p.name, []).append(p.value)
    _print_table(f"{metric} of {pattern}", ("tensor",) + SERIES_COLUMNS,
                 (_series_row(name, v) for name, v in series.items()))


@cli.command()
@click.argument("rev", default="HEAD")
@click.option("--png", "png_path", type=click.Path(dir_okay=False), default=None,
              help="Also plot them to a PNG file, one panel per metric (needs ckptrepo[plot]).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def metrics(ctx: click.Context, rev: str, png_path: str | None, as_json: bool) -> None:
    """The recorded metrics (loss, lr, ...) along the first-parent history of REV, with a terminal sparkline."""
    if png_path:
        plot.require_matplotlib()
    rows = _repo(ctx).metrics(rev)
    if png_path:
        plot.metrics_png(rows, png_path, f"metrics of {rev}")
    if as_json:
        _emit_json(rows)
        return
    _print_table(f"metrics of {rev}", ("metric",) + SERIES_COLUMNS,
                 (_series_row(name, v) for name, (_, v) in plot.metric_series(rows).items()))


@cli.command()
@click.argument("rev")
@click.argument("out_path", metavar="OUT", type=click.Path())
@click.option("--format", "fmt", type=click.Choice(["torch", "safetensors", "dcp"]), default="torch", show_default=True,
              help="torch: OUT is a torch.save file; safetensors: OUT is a directory (model.safetensors + "
                   "objects.json); dcp: OUT is a torch.distributed.checkpoint directory.")
@click.pass_context
def export(ctx: click.Context, rev: str, out_path: str, fmt: str) -> None:
    """Write the full, unsharded state of REV to OUT in a plain checkpoint format."""
    v = _repo(ctx).export(rev, out_path, format=fmt)
    click.echo(f"exported {v.short_id} ({_step(v)}) to {out_path} as {fmt}")


@cli.command(name="import")
@click.argument("path", type=click.Path())
@click.option("--trust", is_flag=True,
              help="Allow full pickle (torch files with arbitrary objects, DCP): it can run code from the file.")
@click.option("--step", type=int, default=None, help="The training step to record.")
@click.option("-m", "--message", default=None, help="Version message (default: where it was imported from).")
@click.pass_context
def import_(ctx: click.Context, path: str, trust: bool, step: int | None, message: str | None) -> None:
    """Commit a torch.save file, a DCP checkpoint or a safetensors export as a new version on the current branch."""
    repo = _repo(ctx)
    v = repo.import_state(path, trust=trust, step=step, message=message)
    click.echo(f"imported {path} as {v.short_id} ({_step(v)}) on branch {repo.current_branch()!r}")


def main() -> None:
    """Entry point: run the CLI, turning every error into one line on stderr and a non-zero exit."""
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        err.print("aborted")
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except CkptRepoError as e:
        click.echo(f"ckptrepo: error: {e}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - the CLI never shows a traceback unless asked
        if os.environ.get("CKPTREPO_DEBUG"):
            raise
        click.echo(f"ckptrepo: error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                   f"(set CKPTREPO_DEBUG=1 for a traceback)", err=True)
        sys.exit(2)


__all__ = ["cli", "main"]

if __name__ == "__main__":
    main()
