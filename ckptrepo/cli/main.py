"""The ``ckptrepo`` command group and its entry point. Each command parses, calls the library, and prints; no
logic lives in the CLI.

The commands live one family to a module, as git's ``builtin/``: history (log, show, status), refs (branch,
tag, checkout), data (diff, stats, trajectory, bisect, metrics), maintenance (gc, prune, fsck, du), remotes
(remote, push, fetch, pull, clone), exchange (export, import) and ui; how they print is ``_output``. What a
command needs beyond click is imported inside it (the library's heavy modules, rich for progress bars and
colour on a terminal), so that a quick command such as ``log -n 10`` starts without loading torch, numpy,
TensorStore or rich: tests/integration/test_startup.py holds ``log`` to that.
"""
from __future__ import annotations

import io
import os
import select
import stat
import sys
from typing import NoReturn

import click

import ckptrepo
from ckptrepo.cli import _errors as errors
from ckptrepo.cli import _output as out
from ckptrepo.cli import data, exchange, history, maintenance, refs, remotes, ui
from ckptrepo.errors import CkptRepoError


class _ReaderLeft(Exception):
    """stdout's reader went away mid-command; not an OSError, so that click's own EPIPE handling (exit 1) passes
    it by to ``main``."""


class _OtherPipe(Exception):
    """A broken pipe that is not stdout's (a FIFO the command writes, a library's socket): carried past click's
    EPIPE handling, which would exit quietly, to ``main``, which reports it as the error it is."""


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except BrokenPipeError as err:
            if _stdout_gone():
                raise _ReaderLeft() from None
            raise _OtherPipe() from err


def _stdout_gone() -> bool:
    """Whether stdout's reader has gone: flushing stdout fails with EPIPE or, nothing being left to flush,
    stdout is a pipe that poll says has no reader."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        return True
    except (OSError, ValueError):
        return False
    try:
        fd = sys.stdout.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):   # no descriptor, or no poll
        return False


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
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


for _family in (history, refs, data, maintenance, remotes, exchange, ui):
    for _command in _family.COMMANDS:
        cli.add_command(_command)


def main() -> None:
    """Entry point: run the CLI, turning every error into one line on stderr and a non-zero exit."""
    try:
        # named, not guessed from how Python was started: completion reads _CKPTREPO_COMPLETE under any launcher
        cli.main(standalone_mode=False, prog_name="ckptrepo")
    except _ReaderLeft:
        _reader_left()
    except _OtherPipe as e:
        _fail(e.__cause__ or e)
    except click.exceptions.Abort:
        out.err_console().print("aborted")
        sys.exit(130)
    except click.ClickException as e:
        errors.show_usage_error(e)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - the CLI never shows a traceback unless asked
        _fail(e)
    try:
        sys.stdout.flush()   # here, where a closed pipe is caught, not in the interpreter's exit
    except BrokenPipeError:
        _reader_left()


def _fail(err: BaseException) -> NoReturn:
    """Report an error on one line and exit 2; an unexpected one shows its traceback with CKPTREPO_DEBUG."""
    if errors.debugging() and not isinstance(err, CkptRepoError):
        raise err
    errors.report(err)
    sys.exit(2)


def _reader_left() -> None:
    """The reader of stdout went away (``ckptrepo log | head -1``): stop quietly with status 0, as git does
    for a pager or ``head``, with nothing on stderr. stdout is pointed at the null device first, so that the
    interpreter's own flush at exit finds no closed pipe to complain about."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):   # a stream with no descriptor (tests run in-process)
        pass
    sys.exit(0)


__all__ = ["cli", "main"]

if __name__ == "__main__":
    main()
