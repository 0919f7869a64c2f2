"""``ds4quant formats``: the qtype registry as a table or JSON."""

from __future__ import annotations

from ds4quant.cli.group import cli
from ds4quant.cli.options import json_option
from ds4quant.cli.output import echo_table, emit_json


@cli.command("formats")
@json_option(help="Print one JSON object instead of a table.")
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
        emit_json({"qtypes": rows})
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
    echo_table(header, table)
