"""What every command starts from: the repository ``--repo`` names, the files it may write, and the shell
completion of revisions and ref names."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable

import click

import ckptrepo
from ckptrepo.errors import CkptRepoError
from ckptrepo.tools import natural_key

if TYPE_CHECKING:
    from click.shell_completion import CompletionItem

MEMORY_ONLY = ("a memory:// repository lives only in the process that creates it, so `ckptrepo {0}` cannot "
               "reach one; use a path, or an s3:// or gs:// URL")


def url_of(ctx: click.Context) -> str:
    """The ``--repo`` URL, refused for memory://, which no other process can reach."""
    url: str = ctx.obj["url"]
    if url.startswith("memory://"):
        raise CkptRepoError(MEMORY_ONLY.format(ctx.info_name))
    return url


def open_repo(ctx: click.Context) -> ckptrepo.Repository:
    return ckptrepo.open(url_of(ctx))


def output_path(repo: ckptrepo.Repository, path: str | None, force: bool, what: str) -> str | None:
    """``path`` checked as a file to write (before any computation); None when not asked for. No output file
    may go inside a local repository's folder (it could replace HEAD or a ref)."""
    if path is None:
        return None
    from ckptrepo.tools import output_file
    return str(output_file(path, force=force, repo_root=repo.local_root, what=what))


def _completion_repo(ctx: click.Context) -> ckptrepo.Repository:
    return ckptrepo.open(ctx.find_root().params.get("url") or os.environ.get("CKPTREPO_REPO") or ".")


def complete_revision(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """Shell completion of a revision: HEAD, branches, tags, and short ids once a hex prefix is typed (see the
    README's "Shell completion"). A repository that cannot be opened completes nothing, silently."""
    from click.shell_completion import CompletionItem
    try:
        return [CompletionItem(name) for name in _completion_repo(ctx).revision_names(incomplete)]
    except Exception:  # noqa: BLE001 - a completion must never print an error into the shell's prompt
        return []


def complete_ref(kind: str) -> Callable[[click.Context, click.Parameter, str], list[CompletionItem]]:
    """Shell completion of an existing branch or tag name (``branch -d``, ``tag -d``)."""
    def complete(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
        from click.shell_completion import CompletionItem
        try:
            repo = _completion_repo(ctx)
            names = repo.branches() if kind == "branch" else repo.tags()
        except Exception:  # noqa: BLE001 - as complete_revision
            return []
        return [CompletionItem(n) for n in sorted(names, key=natural_key) if n.startswith(incomplete)]
    return complete
