"""``ds4quant inspect``: every tensor of an artifact, its totals and the runtimes that load it."""

from __future__ import annotations

import click

from ds4quant.cli.group import cli
from ds4quant.cli.options import PATH, json_option, variant_107_option
from ds4quant.cli.output import echo_excluded, echo_table, emit_json


@cli.command("inspect")
@click.argument("artifact", type=PATH)
@variant_107_option()
@json_option()
def inspect_cmd(artifact, variant_107, as_json):
    """Show every tensor of an artifact folder or GGUF file: qtype, ggml type,
    variant, shape, bytes, bpw; totals, expert bpw, codebook tables.

    \b
    Examples:
      ds4quant inspect out/tiny-strix
      ds4quant inspect model.gguf --variant-107 rocmfp2_affine --json
    """
    from ds4quant.artifact.runtimes import needs
    from ds4quant.inspect import inspect_artifact

    ins = inspect_artifact(artifact, variant_107=variant_107)
    if as_json:
        emit_json(ins.to_json())
        return
    planned = any(t.predicted_error is not None for t in ins.tensors)
    header = ("name", "qtype", "ggml", "variant", "shape", "bytes", "bpw") + (("predicted err",) if planned else ())
    rows = [(t.name, t.qtype, str(t.ggml_type), t.variant, "x".join(map(str, t.shape)), f"{t.bytes:,}", f"{t.bpw:.3f}")
            + ((f"{t.predicted_error:.4g}" if t.predicted_error is not None else "-",) if planned else ())
            for t in ins.tensors]
    echo_table(header, rows, rstrip=False)
    click.echo("")
    for q, d in sorted(ins.qtype_totals().items()):
        click.echo(f"{q:<14} {d['tensors']:>5} tensors {d['bytes']:>14,} bytes {8 * d['bytes'] / d['weights']:7.3f} bpw")
    bpw = ins.bpw_experts
    click.echo(f"files: {', '.join(p.name for p in ins.files)} ({ins.file_bytes:,} bytes)")
    click.echo(f"expert bpw: {bpw:.4f}" if bpw is not None else "expert bpw: no routed expert tensors")
    click.echo(f"codebook tables: {', '.join(ins.codebook_tables) or 'none'}")
    click.echo(f"loadable by: {', '.join(ins.runtimes) or 'no known runtime'}")
    for r in ins.runtimes:
        click.echo(f"  {r}: {needs(r)}")
    echo_excluded(ins.runtimes_excluded)
    if ins.stored_runtimes is not None and not set(ins.stored_runtimes) <= set(ins.runtimes):
        click.echo(f"note: its ds4quant.runtimes key says {', '.join(ins.stored_runtimes) or 'none'}, "
                   "more than its contents allow (ds4quant verify fails it)")
    alloc = ((ins.manifest or {}).get("recipe") or {}).get("allocation")
    if alloc:
        click.echo(f"adaptive plan: {alloc['method']}, {alloc['allocated_bytes']:,} of {alloc['budget_bytes']:,} "
                   f"budget bytes, predicted weighted SQNR {alloc['predicted_weighted_sqnr_db']:.2f} dB")
    for n in ins.notes:
        click.echo(f"note: {n}")
