"""The ``ds4quant`` command line: thin click commands over public functions.

- ``group``: the click group, the order --help lists commands in, and the
  table that turns a ``Ds4quantError`` into one line on stderr and its exit
  code (``DS4QUANT_DEBUG=1`` shows the traceback instead);
- ``options``: the options several commands share, declared once, and the
  SIZE type;
- ``output``: JSON, aligned tables and progress lines;
- one module per command, each parsing its options, calling one library
  function and formatting its result.

Heavy imports (torch, transformers) happen inside the commands that need
them, so ``ds4quant --help`` stays fast.
"""

from __future__ import annotations

from ds4quant.cli.group import cli

# each command module registers its command on the group when imported
from ds4quant.cli import calibrate, convert, formats, inspect, place, publish, reference, run, verify  # noqa: E402,F401,E501  isort: skip

__all__ = ["cli", "main"]


def main(argv=None) -> None:
    """Console-script entry point (``[project.scripts] ds4quant``)."""
    cli.main(args=argv, prog_name="ds4quant")
