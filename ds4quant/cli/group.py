"""The ``ds4quant`` click group and the table that turns user errors into exit codes.

A ``Ds4quantError`` raised anywhere below the group (a command, or an option's
type while the command line is parsed) becomes one line on stderr and its
exit code; set ``DS4QUANT_DEBUG=1`` to see the traceback instead. A command
line click cannot parse (``UsageError``, ``BadParameter``: an unknown option,
a value outside its choices or range) is one line and exit 2 as well.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import click

from ds4quant.version import VERSION
from ds4quant.errors import Ds4quantError

# exception type -> its exit code; the first row the exception is an instance of wins.
# Every other exception is a bug and keeps its traceback.
EXIT_CODES: tuple[tuple[type, Callable[[Ds4quantError], int]], ...] = (
    (Ds4quantError, lambda exc: exc.exit_code),  # 2 for bad input, 1 where a check failed (UnsoundArtifactError)
)

# the pipeline order --help lists the commands in (not alphabetical)
COMMAND_ORDER = ("convert", "inspect", "verify", "publish", "calibrate", "place", "run", "formats")


def exit_code_of(exc: BaseException) -> Optional[int]:
    """The exit code for a user error, or None when ``exc`` is no user error."""
    for kind, code in EXIT_CODES:
        if isinstance(exc, kind):
            return code(exc)
    return None


def _usage_exit(exc: click.UsageError) -> None:
    """A command line click cannot parse: one line naming the command and what is wrong, exit 2
    (click's own four-line usage block buries the error). A bare command that asks for its help
    (``NoArgsIsHelpError``) keeps click's help text."""
    if isinstance(exc, click.exceptions.NoArgsIsHelpError):
        raise exc
    # the program's own name, however it was started (python -m, a test runner)
    cmd = " ".join(["ds4quant", *(exc.ctx.command_path.split()[1:] if exc.ctx is not None else [])])
    msg = " ".join(exc.format_message().split())
    click.echo(f"ds4quant: error: {msg} (see `{cmd} --help`)", err=True)
    raise SystemExit(exc.exit_code)


class _Group(click.Group):
    """Turns user errors into one line + their exit code, everywhere below it."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as exc:  # the group's own options
            _usage_exit(exc)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:  # a subcommand's options and arguments, or an unknown command
            _usage_exit(exc)
        except tuple(kind for kind, _ in EXIT_CODES) as exc:
            if os.environ.get("DS4QUANT_DEBUG"):
                raise
            click.echo(f"ds4quant: error: {exc.one_line()}", err=True)
            ctx.exit(exit_code_of(exc))
        except OSError as exc:
            # the file system refused (full, read-only, gone) where no command named it yet: still one
            # line naming the file, and the user-error code (the writes are atomic: nothing half-made)
            if os.environ.get("DS4QUANT_DEBUG"):
                raise
            where = f"{os.fsdecode(exc.filename)}: " if exc.filename else ""
            click.echo(f"ds4quant: error: {where}{exc.strerror or exc}", err=True)
            ctx.exit(2)

    def list_commands(self, ctx):
        names = list(self.commands)
        return sorted(names, key=lambda n: (COMMAND_ORDER.index(n) if n in COMMAND_ORDER else len(COMMAND_ORDER), n))


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(VERSION, "--version", "-V", prog_name="ds4quant")
def cli() -> None:
    """Convert DeepSeek-V4 MoE checkpoints to ROCmFPX expert artifacts,
    verify them, and publish them.

    \b
    Examples:
      ds4quant formats
      ds4quant formats --json
    """
