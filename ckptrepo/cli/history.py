"""History: ``log``, ``show`` and ``status``."""
from __future__ import annotations

import re
import textwrap
from typing import Any

import click

import ckptrepo
from ckptrepo.cli import _output as out
from ckptrepo.cli._context import complete_revision, open_repo
from ckptrepo.errors import CkptRepoError
from ckptrepo.tools import GraphRow, diff_stat, fit, natural_key
from ckptrepo.tools import graph as graph_rows

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


@click.command(cls=_LogCommand)
@click.argument("rev", required=False, default="HEAD", shell_complete=complete_revision)
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
    repo = open_repo(ctx)
    versions = repo.log(rev, all=all_, limit=max_count, since=since, until=until)
    failures = repo.failures() if all_ else []
    stats = {v.id: repo.capture_stats(v.id) for v in versions} if with_stats else {}
    if as_json:
        rows = [dict(v.to_json(), **({"stats": stats[v.id]} if with_stats else {}),
                     **({"changes": _changes_json(repo, v)} if patch else {})) for v in versions]
        out.emit_json(rows + [dict(f, failed=True) for f in failures] if all_ else rows)
        return
    if not versions and not failures:
        click.echo("no versions match --since/--until" if since is not None or until is not None else "no versions yet")
    has_remotes = bool(repo.remotes())   # the config, read anyway: no listing of refs/remotes/ without one
    durable = has_remotes or any(v.remotes or (not v.local and not v.pruned) for v in versions)
    tracking = _tracking_names(repo) if has_remotes else {}
    for row in graph_rows(versions) if graph else [GraphRow("", v) for v in versions]:
        if row.version is None:   # a line that only connects columns
            out.echo_fit(row.prefix)
            continue
        _print_log_line(row.prefix, row.version, oneline, durable, tracking.get(row.version.id, ()))
        if with_stats:
            out.echo_fit("    " + _capture_stats_line(stats[row.version.id]))
        if patch:
            for line in _change_lines(repo, row.version):
                out.echo_fit("    " + line)
    for f in failures:
        line = fit(out.printable(f"FAILED {out.failed_what(f)}{str(f.get('id'))[:12]}  step {f.get('step')}  "
                                 f"{out.when(out.number(f.get('time')))}  {f.get('error')}"), out.width())
        out.print_marked(line, 0, 6 if line.startswith("FAILED") else 0, "red")


def _tracking_names(repo: ckptrepo.Repository) -> dict[str, tuple[str, ...]]:
    """Version id -> the remote-tracking refs (``origin/main``) that name it, in name order."""
    names: dict[str, list[str]] = {}
    for name, vid in sorted(repo.tracking_refs().items(), key=lambda kv: natural_key(kv[0])):
        names.setdefault(vid, []).append(name)
    return {vid: tuple(n) for vid, n in names.items()}


def decorations(v: ckptrepo.Version, tracking: tuple[str, ...]) -> list[str]:
    """The names shown beside a version, in git's order: HEAD and branches, then remote-tracking refs, then
    tags (``HEAD -> main, origin/main, tag: v1``)."""
    refs = list(v.refs)
    at = next((i for i, r in enumerate(refs) if r.startswith("tag: ")), len(refs))
    return refs[:at] + list(tracking) + refs[at:]


def _print_log_line(prefix: str, v: ckptrepo.Version, oneline: bool, durable: bool = False,
                    tracking: tuple[str, ...] = ()) -> None:
    """One version as ``log`` prints it, cut to the width: the id (coloured on a terminal), its refs, where it
    is durable (``durable``: in a repository with remotes), then ``--oneline``: the step, ``pruned`` for a
    version whose data gc deleted, and the message's first line; otherwise also the time, the size and the
    metrics. Where the line is too wide, the time is shortened (to the minute, then without the year, then left
    out) before anything is cut, so that the metrics stay. What comes from the repository is shown as text,
    never as markup or terminal codes."""
    names = decorations(v, tracking)
    refs = f" ({', '.join(names)})" if names else ""
    if durable:
        refs += f" {out.durability(v)}"
    width = out.width()
    if oneline:
        pruned = "  pruned" if v.pruned else ""
        line = prefix + v.short_id + f"{refs} {out.step(v)}{pruned}  {out.first_line(v.message)}"
    else:
        size = "pruned" if v.pruned else out.size(v.size)
        minute = out.when(v.time, seconds=False)
        times = [out.when(v.time)] + ([minute, minute[5:]] if minute[:1].isdigit() else []) + [""]
        for when in times:
            line = (prefix + v.short_id + f"{refs}  {out.step(v)}  {when + '  ' if when else ''}{size}  "
                    f"{out.metrics_text(v.metrics)}  {out.first_line(v.message)}")
            if width is None or len(out.printable(line).rstrip()) - len(out.first_line(v.message)) <= width:
                break
    plain = fit(out.printable(line).rstrip(), width)
    start, end = len(out.printable(prefix)), len(out.printable(prefix)) + len(v.short_id)
    if plain[start:end] != v.short_id:   # a width too narrow for the id: no colour
        start = end = 0
    out.print_marked(plain, start, end, "yellow")


def _capture_stats_line(s: dict[str, Any]) -> str:
    if not s:
        return "no statistics recorded"
    rate = s.get("bytes", 0) / s["total_s"] if s.get("total_s") else 0.0
    # lost: blocking plus the slowdown of the steps the snapshot overlapped (absent from older versions)
    lost = f"lost {s['lost_s'] * 1e3:.1f} ms  " if "lost_s" in s else ""
    return (f"{lost}blocking {s['blocking_s'] * 1e3:.1f} ms  capture {s['capture_s'] * 1e3:.1f} ms  "
            f"flush {s['flush_s'] * 1e3:.1f} ms  total {s['total_s'] * 1e3:.1f} ms  {out.size(rate)}/s"
            + (f"  copied {out.size(s['copied_bytes'])}" if "copied_bytes" in s else ""))


_LETTER = {"changed": "M", "added": "A", "removed": "D", "reshaped": "R", "retyped": "R"}


def _change_lines(repo: ckptrepo.Repository, v: ckptrepo.Version) -> list[str]:
    """What changed in ``v`` since its first parent, a line per changed tensor or object (``log -p``)."""
    if not v.parents:
        return ["root version: no parent to compare with"]
    try:
        d = repo.diff(v.id)
    except CkptRepoError as e:   # a pruned side has no data: say so and go on with the log
        return [f"no changes shown: {e}"]
    lines = []
    for t in sorted(d.tensors, key=lambda t: natural_key(t.name)):
        if t.status == "unchanged":
            continue
        detail = f"  rel. change {out.num(t.relative)}" if t.status == "changed" else f"  ({t.status})"
        lines.append(out.printable(f"{_LETTER.get(t.status, '?')} {t.name}{detail}"))
    for o in d.objects:
        lines.append(out.printable(f"{_LETTER.get(o.status, '?')} {o.path}: {o.a or ''} -> {o.b or ''}".rstrip()))
    unchanged = sum(t.status == "unchanged" for t in d.tensors)
    lines.append(f"{len(d.tensors) - unchanged} of {len(d.tensors)} tensors changed")
    return lines


def _changes_json(repo: ckptrepo.Repository, v: ckptrepo.Version) -> Any:
    if not v.parents:
        return None
    try:
        return repo.diff(v.id).to_json()
    except CkptRepoError as e:
        return {"error": str(e)}


@click.command()
@click.argument("rev", default="HEAD", shell_complete=complete_revision)
@click.option("--stat", "with_stat", is_flag=True,
              help="After the header, what changed since the parent, one line per module prefix (as diff --stat), "
                   "instead of the tensors and objects.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def show(ctx: click.Context, rev: str, with_stat: bool, as_json: bool) -> None:
    """Show one version: header, tensors (name, dtype, shape, bytes) and objects."""
    repo = open_repo(ctx)
    d = repo.show(rev)
    v = d.version
    if as_json:
        data: dict[str, Any] = {"version": v.to_json(), "layout": d.layout}
        if with_stat:
            data["stat"] = diff_stat(repo.diff(v.id)) if v.parents else None
        else:
            data.update(tensors=d.tensors, objects=[{"path": p, "value": val} for p, val in d.objects])
        out.emit_json(data)
        return
    width = out.width()
    click.echo(f"version {v.id}")
    has_remotes = bool(repo.remotes())   # no listing of refs/remotes/ without one
    names = decorations(v, _tracking_names(repo).get(v.id, ()) if has_remotes else ())
    if names:
        out.echo_fit(out.printable(f"refs    {', '.join(names)}"))
    out.echo_fit(f"parents {' '.join(v.parents) or '-'}")
    size = "pruned: gc deleted its data (the tensors below are what was saved)" if v.pruned else out.size(v.size)
    click.echo(f"step    {v.step if v.step is not None else '-'}\ntime    {out.when(v.time)}")
    out.echo_fit(f"size    {size}")
    if has_remotes or v.remotes or not (v.local or v.pruned):
        out.echo_fit(out.printable(f"durable {out.durability(v)[1:-1]}"))
    if d.layout.get("world_size", 1) > 1:
        degrees = " ".join(f"{k}={d.layout[k]}" for k in ("tp", "pp", "dp", "zero") if k in d.layout)
        out.echo_fit(f"layout  {degrees + ', ' if degrees else ''}{d.layout['world_size']} ranks")
    if v.metrics:
        out.echo_fit(out.printable(f"metrics {out.metrics_text(v.metrics)}"))
    for key, text in v.meta.items():   # a tracker's run id and URL: each whole on its line, to copy
        click.echo(out.printable(f"meta    {key}={text}"))
    if v.message:
        click.echo("")
        for line in out.printable(v.message).splitlines():   # folded as text: git leaves this to the pager
            for piece in textwrap.wrap(line, width - 4) if width and line.strip() else [line]:
                click.echo(f"    {piece}".rstrip())
        click.echo("")
    if with_stat:
        if not v.parents:
            click.echo("root version: no parent to compare with")
            return
        print_stat(repo.diff(v.id), f"{v.parents[0][:12]} -> {v.short_id}")
        return
    out.print_table(f"{len(d.tensors)} tensors", ("tensor", "dtype", "shape", "bytes"),
                    ((t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "()", out.size(t["bytes"]))
                     for t in d.tensors), fold=3)
    if d.objects:
        out.print_table(f"{len(d.objects)} objects", ("object", "value"), d.objects, fold=2)


def print_stat(d: Any, title: str, depth: int = 2, sort_by: str = "name") -> None:
    """A diff's summary per module prefix (``show --stat``, ``diff --stat``), then its objects."""
    out.print_table(title, ("prefix", "tensors", "changed", "||B-A||", "rel. change"),
                    ((g["prefix"], str(g["tensors"]), str(g["changed"]), out.num(g["l2"]), out.num(g["relative"]))
                     for g in diff_stat(d, depth, sort_by)), whole_names=True)
    print_objects(d)


def print_objects(d: Any) -> None:
    for o in d.objects:
        out.echo_fit(out.printable(f"object {o.path}: {o.status} {o.a or ''} -> {o.b or ''}".rstrip()))


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Where HEAD is, and the snapshots in flight (or abandoned) and failed."""
    from ckptrepo.tools import age
    st = open_repo(ctx).status()
    if as_json:
        out.emit_json(st.to_json())
        return
    if st.damage is not None:
        out.echo_fit(out.printable(f"HEAD is damaged: {st.damage}"))
    elif st.head is None:
        out.echo_fit(out.printable(f"On branch {st.branch}, which has no versions yet"))
    else:
        where = f"On branch {st.branch}" if st.branch else "HEAD detached"
        out.echo_fit(out.printable(f"{where} at {st.head[:12]} ({out.step_of(st.head_step)}, {age(st.head_time)} ago)"))
    out.echo_fit(f"{st.versions} version(s) in the repository")
    if st.uncommitted:
        click.echo(f"\n{len(st.uncommitted)} snapshot(s) in flight, or abandoned (data written, no version yet; gc "
                   f"deletes abandoned ones after its grace period):")
        for u in st.uncommitted:
            out.echo_fit(f"  {u.id[:12]}  started {age(u.started)} ago" + ("  (distributed)" if u.distributed else ""))
    if st.failures:
        click.echo(f"\n{len(st.failures)} failed snapshot(s) or push(es) (see `ckptrepo log --all`):")
        for f in st.failures:
            ago = age(out.number(f.get("time")) or None)
            out.echo_fit(out.printable(f"  {out.failed_what(f)}{str(f.get('id'))[:12]}  step {f.get('step')}  "
                                       f"{ago} ago  {f.get('error')}"))
    if not st.uncommitted and not st.failures:
        click.echo("no snapshots in flight, none failed")


COMMANDS = (log, show, status)
