"""Exchange with plain checkpoint formats: ``export`` and ``import``."""
from __future__ import annotations

import click

from ckptrepo.cli import _output as out
from ckptrepo.cli._context import complete_revision, open_repo


@click.command()
@click.argument("rev", shell_complete=complete_revision)
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
    v = open_repo(ctx).export(rev, out_path, format=fmt, force=force, max_shard_size=max_shard_size)
    click.echo(f"exported {v.short_id} ({out.step(v)}) to {out_path} as {fmt}")


@click.command(name="import")
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
    repo = open_repo(ctx)
    v = repo.import_state(path, trust=trust, step=step, message=message)
    click.echo(f"imported {path} as {v.short_id} ({out.step(v)}) on branch {repo.current_branch()!r}")


COMMANDS = (export, import_)
