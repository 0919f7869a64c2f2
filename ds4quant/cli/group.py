"""The ``ds4quant`` click group and the table that turns user errors into exit codes.

A ``Ds4quantError`` raised anywhere below the group (a command, or an option's
type while the command line is parsed) becomes one line on stderr and its
exit code; set ``DS4QUANT_DEBUG=1`` to see the traceback instead.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import click

from ds4quant import __version__
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


class _Group(click.Group):
    """Turns user errors into one line + their exit code, everywhere below it."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except tuple(kind for kind, _ in EXIT_CODES) as exc:
            if os.environ.get("DS4QUANT_DEBUG"):
                raise
            click.echo(f"ds4quant: error: {exc.one_line()}", err=True)
            ctx.exit(exit_code_of(exc))

    def list_commands(self, ctx):
        names = list(self.commands)
        return sorted(names, key=lambda n: (COMMAND_ORDER.index(n) if n in COMMAND_ORDER else len(COMMAND_ORDER), n))


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="ds4quant")
def cli() -> None:
    """Convert DeepSeek-V4 MoE checkpoints to ROCmFPX expert artifacts,
    verify them, and publish them.

    \b
    Examples:
      ds4quant formats
      ds4quant formats --json
    """
