"""The `ds4quant` command line: thin click commands over public functions.

Each command parses options, calls one library function, and formats its
result. A ``Ds4quantError`` becomes one line on stderr and exit code 2; set
``DS4QUANT_DEBUG=1`` to see the traceback instead. Heavy imports (torch,
transformers) happen inside the commands that need them, so ``--help`` is fast.
"""

from __future__ import annotations

import json
import os
import sys

import click

from ds4quant import __version__
from ds4quant.errors import Ds4quantError


class _Group(click.Group):
    """Turns user errors into one line + exit 2, everywhere below it."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except Ds4quantError as exc:
            if os.environ.get("DS4QUANT_DEBUG"):
                raise
            click.echo(f"ds4quant: error: {exc.one_line()}", err=True)
            ctx.exit(exc.exit_code)

    def list_commands(self, ctx):
        # Keep the pipeline order in --help rather than alphabetical.
        order = ["convert", "inspect", "verify", "publish", "calibrate", "formats"]
        names = list(self.commands)
        return sorted(names, key=lambda n: (order.index(n) if n in order else len(order), n))


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


def _emit_json(obj) -> None:
    click.echo(json.dumps(obj, indent=1, sort_keys=False))


@cli.command("formats")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def formats_cmd(as_json: bool) -> None:
    """List every qtype: name, ggml type id, variant tag, block geometry,
    bits per weight, and which runtimes can load it.

    \b
    ggml ids collide between forks (107 is three codecs), so artifacts carry
    the variant tag per tensor and readers check it.
    """
    from ds4quant.formats import QTYPES

    rows = [q.to_json() for q in QTYPES.values()]
    rows.sort(key=lambda r: (r["ggml_type"] is None, r["ggml_type"] or 0, r["name"]))
    if as_json:
        _emit_json({"qtypes": rows})
        return
    header = ("name", "ggml", "variant", "block", "bytes", "bpw", "encode", "runtimes")
    table = [
        (
            r["name"],
            "-" if r["ggml_type"] is None else str(r["ggml_type"]),
            r["variant"],
            str(r["block_size"]),
            str(r["block_bytes"]),
            f"{r['bpw']:.3f}",
            "yes" if r["can_encode"] else "no",
            ",".join(r["runtimes"]) or "-",
        )
        for r in rows
    ]
    widths = [max([len(h)] + [len(t[i]) for t in table]) for i, h in enumerate(header)]
    click.echo("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    for t in table:
        click.echo("  ".join(c.ljust(w) for c, w in zip(t, widths)).rstrip())


def main(argv=None) -> None:
    """Console-script entry point."""
    cli.main(args=argv, prog_name="ds4quant")


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
