"""Remotes: ``remote``, ``push``, ``fetch``, ``pull`` and ``clone``."""
from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Sequence

import click

import ckptrepo
from ckptrepo.cli import _output as out
from ckptrepo.cli._context import MEMORY_ONLY, open_repo
from ckptrepo.errors import CkptRepoError


def _location(url: str) -> str:
    """A repository URL as a remote records it: a local path made absolute, so that the remote is the same
    wherever the command runs from."""
    if url.startswith("memory://"):
        raise CkptRepoError("a memory:// repository lives only in the process that creates it, so the CLI cannot "
                            "reach one as a remote; use a path, or an s3:// or gs:// URL")
    return url if "://" in url or url.startswith("file:") else os.path.abspath(url)


@click.group(invoke_without_command=True)
@click.option("-v", "--verbose", is_flag=True, help="Show each remote's URL.")
@click.pass_context
def remote(ctx: click.Context, verbose: bool) -> None:
    """Remotes: other repositories (usually on an object store) to push versions to and fetch them from, as
    git's. With no subcommand, list their names (-v: with URLs)."""
    if ctx.invoked_subcommand is None:
        _list_remotes(open_repo(ctx), verbose, False)


def _list_remotes(repo: ckptrepo.Repository, verbose: bool, as_json: bool) -> None:
    found = repo.remotes()
    if as_json:
        out.emit_json([{"name": n, "url": found[n]} for n in sorted(found)])
        return
    for name in sorted(found):
        out.echo_fit(out.printable(f"{name}\t{found[name]}" if verbose else name))


@remote.command(name="list")
@click.option("-v", "--verbose", is_flag=True, help="Show each remote's URL.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (names and URLs).")
@click.pass_context
def remote_list(ctx: click.Context, verbose: bool, as_json: bool) -> None:
    """List the remotes (-v: with their URLs)."""
    _list_remotes(open_repo(ctx), verbose or bool(ctx.parent and ctx.parent.params.get("verbose")), as_json)


@remote.command(name="add")
@click.argument("name")
@click.argument("url")
@click.pass_context
def remote_add(ctx: click.Context, name: str, url: str) -> None:
    """Add remote NAME at URL (a path, s3://BUCKET/PREFIX or gs://BUCKET/PREFIX); nothing is contacted yet."""
    repo = open_repo(ctx)
    repo.remote_add(name, _location(url))
    out.echo_fit(out.printable(f"added remote {name!r} at {repo.remotes()[name]}"))


@remote.command(name="remove")
@click.argument("name")
@click.pass_context
def remote_remove(ctx: click.Context, name: str) -> None:
    """Forget remote NAME and its remote-tracking refs (NAME/BRANCH); nothing there is deleted."""
    open_repo(ctx).remote_remove(name)
    out.echo_fit(out.printable(f"removed remote {name!r}"))


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
    return [out.printable(f" {flag} {summary:<{width}}  {src} -> {dst}") for flag, summary, src, dst in rows]


def _copied(result: Any, verb: str) -> str:
    n, arrays = len(result.versions), result.arrays
    return f"{verb} {n} version{'s' * (n != 1)}, {arrays} array{'s' * (arrays != 1)}, {out.size(result.bytes)}"


@click.command()
@click.argument("remote_name", metavar="[REMOTE]", required=False, default="origin")
@click.argument("refs", metavar="[REF]...", nargs=-1)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def push(ctx: click.Context, remote_name: str, refs: tuple[str, ...], as_json: bool) -> None:
    """Copy the versions that branches and tags REF (default: the current branch) reach to REMOTE (default
    origin), what it lacks only, then move its branches, as a fast-forward only: a remote branch that has
    versions this repository lacks rejects the push (fetch first)."""
    repo = open_repo(ctx)
    branches, tags = _push_refs(repo, refs)
    result = out.transfer(f"push to {remote_name}", lambda p: repo.push(remote_name, branches, tags, progress=p))
    if as_json:
        out.emit_json(result.to_json())
        return
    lines = _ref_lines(result.refs)
    out.echo_fit(out.printable(f"To {result.url}"))
    for line in lines or ["Everything up-to-date"]:
        out.echo_fit(line)
    if result.versions:
        out.echo_fit(_copied(result, "pushed"))


@click.command()
@click.argument("remote_name", metavar="[REMOTE]", required=False, default="origin")
@click.option("--lazy", is_flag=True, help="Copy manifests and refs only: tensor data is read from REMOTE when a "
                                           "version is loaded (only the byte ranges the load needs).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def fetch(ctx: click.Context, remote_name: str, lazy: bool, as_json: bool) -> None:
    """Copy the versions REMOTE's (default origin) branches and tags reach that are not here, and record where
    its branches are (REMOTE/BRANCH, a revision like any other); local branches do not move."""
    repo = open_repo(ctx)
    result = out.transfer(f"fetch {remote_name}", lambda p: repo.fetch(remote_name, lazy=lazy, progress=p))
    if as_json:
        out.emit_json(result.to_json())
        return
    _print_fetched(result, lazy)


def _print_fetched(result: Any, lazy: bool) -> None:
    lines = _ref_lines(u for u in result.refs if not u.ref.startswith("refs/heads/"))   # pull's own: below
    if lines:
        out.echo_fit(out.printable(f"From {result.url}"))
        for line in lines:
            out.echo_fit(line)
    if result.versions:
        out.echo_fit(_copied(result, "fetched") + (" (manifests only: tensor data is read from "
                                                   f"{result.remote} when loaded)" if lazy else ""))


@click.command()
@click.argument("remote_name", metavar="[REMOTE]", required=False, default="origin")
@click.option("--lazy", is_flag=True, help="Fetch manifests and refs only (see fetch --lazy).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def pull(ctx: click.Context, remote_name: str, lazy: bool, as_json: bool) -> None:
    """Fetch REMOTE (default origin), then fast-forward the current branch to REMOTE's branch of the same name;
    branches that have diverged are left as they are, with what to do."""
    repo = open_repo(ctx)
    result = out.transfer(f"fetch {remote_name}", lambda p: repo.pull(remote_name, lazy=lazy, progress=p))
    if as_json:
        out.emit_json(result.to_json())
        return
    _print_fetched(result, lazy)
    mine = next((u for u in result.refs if u.ref.startswith("refs/heads/")), None)
    if mine is None or mine.status == "up to date":
        click.echo("Already up to date.")
    else:
        click.echo(f"Updating {(mine.old or '')[:12] or '(no versions)'}..{mine.new[:12]}\nFast-forward")


@click.command()
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
    repo = out.transfer(f"clone {url}", run_clone)
    branch = repo.current_branch()
    head = repo.head_version()
    versions = repo.version_count()
    if as_json:
        out.emit_json({"url": url, "directory": repo.url, "remote": "origin", "branch": branch, "head": head,
                       "versions": versions, "bytes": copied[0], "lazy": lazy, "depth": depth})
        return
    at = f"at {head[:12]}" if head else "with no versions yet"
    how = (" (manifests only: tensor data is read from origin when loaded)" if lazy else
           f" (tensor data of the newest {depth} versions of each branch; older ones read from origin when "
           f"loaded)" if depth else "")
    out.echo_fit(out.printable(f"cloned {url} into {directory}: {versions} version{'s' * (versions != 1)}, "
                               f"{out.size(copied[0])}, branch {branch!r} {at}{how}"))


COMMANDS = (remote, push, fetch, pull, clone)
