"""Maintenance: ``gc``, ``prune``, ``fsck`` and ``du``."""
from __future__ import annotations

import sys
from typing import Any

import click

import ckptrepo
from ckptrepo.cli import _output as out
from ckptrepo.cli._context import complete_revision, open_repo, url_of


@click.command()
@click.argument("rev", shell_complete=complete_revision)
@click.pass_context
def prune(ctx: click.Context, rev: str) -> None:
    """Delete the data of version REV now (its place in the history stays, as gc's pruning leaves it)."""
    repo = open_repo(ctx)
    vid = repo.resolve(rev)
    freed = repo.prune(vid)
    click.echo(f"pruned {vid[:12]}: " + (f"{out.size(freed)} freed" if freed else "nothing of its own to free"))


@click.command()
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
    # done on the store before the repository is opened: one whose config is damaged cannot be
    repaired: list[str] = ckptrepo.Repository.repair_config(url_of(ctx)) if repair_config else []
    repo = open_repo(ctx)
    if repair:
        repaired += repo.repair_lost()
    if not as_json:
        for line in repaired:
            click.echo(f"repair: {line}")
    progress = out.progress()
    if progress is not None:
        with progress:
            task = progress.add_task("fsck", total=None)   # sized once fsck has read the manifests
            report = repo.fsck(on_bytes=lambda n: progress.advance(task, n),
                               on_total=lambda n: progress.update(task, total=n))
    else:
        report = repo.fsck()
    if as_json:
        out.emit_json(dict(report.to_json(), **({"repaired": repaired} if repair_config or repair else {})))
    else:
        for w in report.warnings:
            click.echo(f"warning: {w}")
        for e in report.errors:
            click.echo(f"error: {e}")
        status = "ok" if report.ok else f"{len(report.errors)} problem(s) found"
        click.echo(f"checked {report.versions} versions, {report.objects} data objects, {out.size(report.bytes)}: "
                   f"{status}")
    if not report.ok:
        sys.exit(1)


@click.command()
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
    r = open_repo(ctx).gc(keep_last=keep_last, keep_every=keep_every, keep_tagged=keep_tagged,
                          keep_branch_heads=keep_branch_heads, grace_period_s=grace_s, dry_run=dry_run,
                          keep_best=keep_best, best_metric=best_metric, best_mode=best_mode)
    if as_json:
        out.emit_json(r.to_json())
        return
    if dry_run:   # what would go, oldest first, one line each, so that a gc can be checked before it deletes
        _print_doomed(r)
    verb = "would free" if dry_run else "freed"
    click.echo(f"kept {len(r.kept)} versions, pruned {len(r.pruned)}, collected {len(r.collected)} unreachable and "
               f"{len(r.orphan_data)} leftover data sets; {verb} {out.size(r.stored_bytes_freed)} "
               f"({out.size(r.bytes_freed)} of tensors)"
               + (f"; {len(r.too_young)} unreferenced objects are younger than the grace period"
                  if r.too_young else ""))


def _print_doomed(r: Any) -> None:
    """``gc --dry-run``'s list: what would be pruned, collected or deleted as leftover data (or have its
    pruning, cut short by a killed pass, finished), oldest first, each with its step, time and the stored
    bytes it would free."""
    what = {**{v: "prune" for v in r.pruned}, **{v: "collect" for v in r.collected},
            **{v: "delete leftover data of" for v in r.orphan_data}}
    for vid, d in r.details.items():   # a dry run's: every version above, in time order
        verb = what.get(vid, "finish pruning")
        when = "-" if d.get("time") is None else out.when(d["time"], seconds=False)
        out.echo_fit(f"would {verb} {vid[:12]}  {out.step_of(d.get('step')):<12}  {when:<16}  "
                     f"{out.size(d.get('stored_bytes', 0)):>10}".rstrip())


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def du(ctx: click.Context, as_json: bool) -> None:
    """Bytes of tensor data per version: unique to it, and shared with other versions (per stored array); the
    total as stored, and as tensor bytes."""
    usage = open_repo(ctx).du()
    if as_json:
        out.emit_json(usage.to_json())
        return
    for u in usage.versions:
        v = u.version
        out.echo_fit(f"{v.short_id}  step {v.step if v.step is not None else '-':>8}  "
                     f"unique {out.size(u.unique_bytes):>10}  shared {out.size(u.shared_bytes):>10}"
                     + ("  pruned" if v.pruned else ""))
    out.echo_fit(f"total {out.size(usage.stored_bytes)} stored ({out.size(usage.total_bytes)} of tensors), "
                 f"{len(usage.versions)} versions, each array once")


COMMANDS = (gc, prune, fsck, du)
