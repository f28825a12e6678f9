"""The web page: ``ui``."""
from __future__ import annotations

from typing import Any

import click

from ckptrepo.cli._context import complete_revision, open_repo


@click.command()
@click.option("--port", type=click.IntRange(0, 65535), default=8765, show_default=True,
              help="Port on 127.0.0.1 to serve on (0: any free port).")
@click.option("--rev", default="HEAD", show_default=True, shell_complete=complete_revision,
              help="Whose first-parent history the metrics and the heatmap follow (the page can change it).")
@click.pass_context
def ui(ctx: click.Context, port: int, rev: str) -> None:
    """Serve a web page of the history on 127.0.0.1 (read-only, until Ctrl-C): the version graph, metric
    curves, a heatmap of a per-tensor statistic over the steps, and each version's tensors and diff."""
    from ckptrepo.ui import serve
    repo = open_repo(ctx)
    if not (rev == "HEAD" and repo.head_version() is None):   # an empty repository shows an empty page
        repo.resolve(rev)   # a revision that names nothing fails here, before the port is taken

    def ready(server: Any) -> None:
        click.echo(f"serving {repo.url} at {server.url} (read-only; Ctrl-C to stop)")

    serve(repo, port, rev, ready)


COMMANDS = (ui,)
