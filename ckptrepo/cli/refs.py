"""Refs: ``branch``, ``tag`` and ``checkout``."""
from __future__ import annotations

from typing import Any

import click

from ckptrepo.cli import _output as out
from ckptrepo.cli._context import complete_ref, complete_revision, open_repo
from ckptrepo.tools import natural_key


@click.command()
@click.argument("rev", required=False, shell_complete=complete_revision)
@click.option("-b", "branch", default=None, help="Create branch NAME at REV and switch to it.")
@click.option("--orphan", "orphan", default=None, metavar="NAME",
              help="Switch to a new branch NAME with no versions: its first snapshot starts a new history (no "
                   "parent). Takes no REV.")
@click.pass_context
def checkout(ctx: click.Context, rev: str | None, branch: str | None, orphan: str | None) -> None:
    """Move HEAD to REV (roll back); with -b, start a new branch there; with --orphan, a new history."""
    repo = open_repo(ctx)
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
        click.echo(f"HEAD is now on branch {where!r} at {v.short_id} ({out.step(v)})")
    else:
        click.echo(f"HEAD is now detached at {v.short_id} ({out.step(v)}); "
                   f"to take snapshots from here: ckptrepo checkout {v.short_id} -b NAME")


def _list_refs(refs: dict[str, str], current: str | None, as_json: bool) -> None:
    names = sorted(refs, key=natural_key)   # v2 before v10
    if as_json:
        out.emit_json([{"name": n, "version": refs[n], "current": n == current} for n in names])
        return
    for n in names:
        out.echo_fit(f"{'*' if n == current else ' '} {n:20s} {refs[n][:12]}")


def _ref_command(kind: str, doc: str) -> Any:
    """``branch`` and ``tag``: list with no NAME, create NAME at REV, or delete NAME with -d."""
    @click.command(name=kind, help=doc)
    @click.argument("name", required=False, shell_complete=complete_ref(kind))
    @click.argument("rev", required=False, default="HEAD", shell_complete=complete_revision)
    @click.option("-d", "--delete", "delete", is_flag=True, help=f"Delete {kind} NAME.")
    @click.option("--json", "as_json", is_flag=True, help="Machine-readable output (listing).")
    @click.pass_context
    def command(ctx: click.Context, name: str | None, rev: str, delete: bool, as_json: bool,
                force: bool = False, move: bool = False) -> None:
        repo = open_repo(ctx)
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

COMMANDS = (branch, tag, checkout)
