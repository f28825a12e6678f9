"""The data of versions: ``diff``, ``stats``, ``trajectory``, ``bisect`` and ``metrics``."""
from __future__ import annotations

import math
import sys
from typing import Any, Iterable, Sequence

import click

from ckptrepo import tools
from ckptrepo.cli import _errors as errors
from ckptrepo.cli import _output as out
from ckptrepo.cli._context import complete_revision, open_repo, output_path
from ckptrepo.cli.history import print_objects, print_stat
from ckptrepo.errors import ArgumentError, CkptRepoError, ExchangeError
from ckptrepo.tools import SORTS, keep_last, row_key

_INCLUDE_NONFLOAT = click.option(
    "--include-nonfloat", is_flag=True,
    help="Also put numbers on non-float tensors and step counters (RNG states, integer buffers), which are left "
         "out of the numeric views by default.")


@click.command()
@click.argument("a", shell_complete=complete_revision)
@click.argument("b", required=False, shell_complete=complete_revision)
@click.option("--against-parent", is_flag=True,
              help="Compare A with its first parent (what one revision alone does, as git show does).")
@click.option("--pattern", default=None, help="Only tensors whose name matches this glob (*, ?, [seq]): only "
                                               "their bytes are read.")
@click.option("--stat", "summary", is_flag=True, help="One line per module prefix instead of per tensor.")
@click.option("--depth", type=click.IntRange(min=1), default=2, show_default=True,
              help="Name components that make a prefix (--stat).")
@click.option("--sort", "sort_by", type=click.Choice(SORTS), default="name", show_default=True,
              help="Order of the rows: by name (numbers inside names by value: layers.2 before layers.10), or "
                   "largest first by relative change ||B-A||/||A|| or by ||B-A||.")
@click.option("--only-changed", is_flag=True, help="Hide unchanged tensors.")
@_INCLUDE_NONFLOAT
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def diff(ctx: click.Context, a: str, b: str | None, against_parent: bool, pattern: str | None, summary: bool,
         depth: int, sort_by: str, only_changed: bool, include_nonfloat: bool, as_json: bool) -> None:
    """Compare version A with B tensor by tensor and object by object; without B (or with --against-parent),
    compare A's first parent with A, as git show does. Reads the tensors on every core, in bounded memory."""
    if b is not None and against_parent:
        # one line, as every ckptrepo error (click's usage errors print three)
        raise ArgumentError("give B or --against-parent, not both: --against-parent compares A with its parent")
    repo = open_repo(ctx)
    d = repo.diff(a, b, pattern, include_nonfloat=include_nonfloat)
    if b is None:
        a, b = d.a[:12], a   # the parent, then A
    if pattern is not None and not d.tensors:
        raise CkptRepoError(f"no tensor of {a} or {b} matches {pattern!r}; `ckptrepo show {b}` lists the names")
    title = f"{a} -> {b}"
    key = row_key(sort_by)
    if as_json:   # the same rows as the table: --only-changed and --sort apply
        out_json = d.to_json()
        kept = (t for t in out_json["tensors"] if not (only_changed and t["status"] == "unchanged"))
        out_json["tensors"] = sorted(kept, key=key)
        out.emit_json(dict(out_json, prefixes=tools.diff_stat(d, depth, sort_by)) if summary else out_json)
        return
    if only_changed and all(t.status == "unchanged" for t in d.tensors):
        click.echo(f"no tensor changed between {out.printable(a)} and {out.printable(b)}"
                   f"{'' if d.objects else ', and no object'}")
        print_objects(d)
    elif summary:
        print_stat(d, title, depth, sort_by)
    else:
        rows = [t.to_json() for t in d.tensors if not (only_changed and t.status == "unchanged")]
        out.print_table(title, ("tensor", "status", "||B-A||", "rel. change", "max |B-A|", "cosine"),
                        ((t["name"], t["status"], out.num(t["l2"]), out.num(t["relative"]), out.num(t["max_abs"]),
                          out.num(t["cosine"])) for t in sorted(rows, key=key)), whole_names=True)
        print_objects(d)


@click.command()
@click.argument("rev", default="HEAD", shell_complete=complete_revision)
@click.option("--pattern", default=None, help="Only tensors whose name matches this glob (*, ?, [seq]).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def stats(ctx: click.Context, rev: str, pattern: str | None, as_json: bool) -> None:
    """Per tensor norm, mean, std, min/max, max |x| and NaN/Inf counts of REV.

    From the statistics REV recorded while it was captured; a version written without them is read."""
    rows = open_repo(ctx).stats(rev, pattern)
    if as_json:
        out.emit_json([r.to_json() for r in rows])
        return
    if pattern is not None and not rows:
        raise CkptRepoError(f"no tensor of {rev} matches {pattern!r}; `ckptrepo show {rev}` lists the names")
    num = out.num
    out.print_table(rev, ("tensor", "dtype", "norm", "mean", "std", "min", "max", "max |x|", "NaN", "Inf"),
                    ((r.name, r.dtype, num(r.norm), num(r.mean), num(r.std), num(r.min), num(r.max),
                      num(r.absmax), str(r.nan), str(r.inf)) for r in rows))


SERIES_COLUMNS = ("first", "last", "min", "max", "trend")
# tools/_trajectory.py's METRICS, spelled out so that parsing the command line imports no numpy
TENSOR_METRICS = ("norm", "mean", "std", "min", "max", "absmax", "nan", "inf", "delta", "relative-change")
CHANGES = ("delta", "relative-change")


def _series_row(name: str, values: list[float], spark: int | None) -> tuple[str, ...]:
    """A trajectory's or a metric's row: its name, then SERIES_COLUMNS (the sparkline's newest ``spark``
    values where the width allows no more)."""
    ordered = [v for v in values if v == v]   # min() and max() of a series that starts with NaN are NaN
    lo, hi = (min(ordered), max(ordered)) if ordered else (math.nan, math.nan)
    return (name, out.num(values[0]), out.num(values[-1]), out.num(lo), out.num(hi),
            keep_last(_sparkline(values), spark))


def _spark_width() -> int | None:
    """Cells a sparkline may take: a quarter of the width, at least 10 (None: no limit)."""
    width = out.width()
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


@click.command()
@click.argument("pattern")
@click.option("--metric", type=click.Choice(TENSOR_METRICS), default="norm", show_default=True,
              help="What to follow: norm ||v||, mean, std, min, max, absmax max |v|, nan and inf counts (recorded "
                   "at capture); delta ||v - previous||; relative-change ||v - previous|| / ||previous|| "
                   "(previous: the version before in the range; none for the first).")
@click.option("--rev", default="HEAD", show_default=True, shell_complete=complete_revision,
              help="Walk the first-parent history of this revision.")
@click.option("--since", type=int, default=None, help="First step to include.")
@click.option("--until", type=int, default=None, help="Last step to include.")
@click.option("--csv", "csv_path", metavar="FILE", default=None, help="Also write the rows as CSV.")
@click.option("--png", "png_path", metavar="FILE", default=None,
              help="Also plot them to a PNG file (needs ckptrepo[plot]).")
@click.option("--force", is_flag=True, help="Overwrite the --csv and --png files if they exist.")
@_INCLUDE_NONFLOAT
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def trajectory(ctx: click.Context, pattern: str, metric: str, rev: str, since: int | None, until: int | None,
               csv_path: str | None, png_path: str | None, force: bool, include_nonfloat: bool, as_json: bool) -> None:
    """A metric of the tensors matching PATTERN (a glob) across versions, with a terminal sparkline."""
    if png_path:
        tools.require_matplotlib()
    repo = open_repo(ctx)
    png_path = output_path(repo, png_path, force, "the plot")   # checked before the history is read
    csv_path = output_path(repo, csv_path, force, "the CSV")
    if png_path is not None and png_path == csv_path:
        raise ExchangeError(f"--csv and --png both name {png_path}; give them two paths")
    points = repo.trajectory(pattern, metric, rev, since, until, include_nonfloat=include_nonfloat)
    if not points and not as_json:
        raise CkptRepoError(f"no {metric} values: no tensor matches {pattern!r} in the versions of {rev}"
                            f"{' in the --since/--until range' if since is not None or until is not None else ''}"
                            f"{' (delta and relative-change need two versions)' if metric in CHANGES else ''}")
    if png_path:
        _write_png(png_path, lambda: tools.trajectory_png(points, png_path, metric, pattern))
    if csv_path:
        _write_csv(csv_path, [["version", "step", "name", metric]] +
                   [[p.version, p.step, p.name, repr(p.value)] for p in points])
    if as_json:
        out.emit_json([p.to_json() for p in points])
        return
    series: dict[str, list[float]] = {}
    for p in points:
        series.setdefault(p.name, []).append(p.value)
    spark = _spark_width()
    out.print_table(f"{metric} of {pattern}", ("tensor",) + SERIES_COLUMNS,
                    (_series_row(name, v, spark) for name, v in series.items()))


@click.command()
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
@click.option("--rev", default="HEAD", show_default=True, shell_complete=complete_revision,
              help="Walk the first-parent history of this revision.")
@click.option("--since", type=int, default=None, help="First step to include.")
@click.option("--until", type=int, default=None, help="Last step to include.")
@_INCLUDE_NONFLOAT
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def bisect(ctx: click.Context, metric: str | None, pattern: str | None, stat: str | None, condition: str | None,
           nonfinite: bool, rev: str, since: int | None, until: int | None, include_nonfloat: bool,
           as_json: bool) -> None:
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
    found = open_repo(ctx).bisect(condition, metric=metric, tensor=pattern, stat=stat or "norm", nonfinite=nonfinite,
                                  rev=rev, since=since, until=until,
                                  include_nonfloat=include_nonfloat)
    if nonfinite:
        what = f"a tensor{'' if pattern is None else ' matching ' + repr(pattern)} holds NaN or Inf"
    else:
        subject = metric if metric is not None else f"{stat or 'norm'} of {pattern}"
        what = f"{subject} {condition}"
    if found is None:
        if as_json:
            out.emit_json({"found": False})
        else:
            in_range = " in the --since/--until range" if since is not None or until is not None else ""
            click.echo(out.printable(f"no version matches: {what}, along the first-parent history of {rev}{in_range}"))
        sys.exit(1)
    if as_json:
        out.emit_json(found.to_json())
        return
    click.echo(out.printable(f"{found.version[:12]}  {out.step_of(found.step)}  first version where {what}"))
    click.echo(f"version {found.version}")
    before = "" if found.previous is None else \
        f" (previous {out.num(found.previous)} at {(found.previous_version or '-')[:12]})"
    label = "NaN+Inf elements" if nonfinite else found.what
    if found.tensor is None:
        out.echo_fit(out.printable(f"{label} {out.num(found.value)}{before}"))
        return
    out.echo_fit(out.printable(f"tensor  {found.tensor}: {label} {out.num(found.value)}{before}"))
    others = [n for n in found.tensors if n != found.tensor]
    if others:
        out.echo_fit(out.printable(f"also    {len(others)} more at this version: {', '.join(others)}"))


@click.command()
@click.argument("rev", default="HEAD", shell_complete=complete_revision)
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
        tools.require_matplotlib()
    repo = open_repo(ctx)
    png_path = output_path(repo, png_path, force, "the plot")
    if tb_dir:
        n = repo.metrics_to_tensorboard(tb_dir, rev)
        if not as_json:
            click.echo(f"wrote {n} scalars to {tb_dir}", err=True)
    rows = repo.metrics(rev)
    if png_path:
        _write_png(png_path, lambda: tools.metrics_png(rows, png_path, f"metrics of {rev}"))
    if as_json:
        out.emit_json(rows)
        return
    spark = _spark_width()
    out.print_table(f"metrics of {rev}", ("metric",) + SERIES_COLUMNS,
                    (_series_row(name, v, spark) for name, (_, v) in tools.metric_series(rows).items()))


COMMANDS = (diff, stats, trajectory, bisect, metrics)
