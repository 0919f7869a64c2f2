"""``ds4quant calibrate``: the reference model over token sequences -> imatrix, routing, sensitivity."""

from __future__ import annotations

import os

import click

from ds4quant.cli.group import cli
from ds4quant.cli.options import PATH, json_option
from ds4quant.cli.output import command_progress, emit_json


@cli.command("calibrate")
@click.argument("source", type=PATH)
@click.option("--tokens", "tokens_file", required=True, type=PATH,
              help="Token ids: one sequence per line (whitespace-separated; '#' lines skipped), or a JSON list of lists.")
@click.option("--out", "out_dir", required=True, type=PATH,
              help="Output folder (created if its parent exists).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Worker processes, one core each (default 1). Output bytes do not depend on it.")
@click.option("--sensitivity-seqs", type=click.IntRange(min=0), default=None,
              help="Sequences (the first N) for the per-tensor KL sensitivity pass, sensitivity.json (default 8; 0 skips).")
@json_option(help="Print the report as one JSON object; no progress.")
def calibrate_cmd(source: str, tokens_file: str, out_dir: str, threads, sensitivity_seqs, as_json: bool) -> None:
    """Run token sequences through the reference model (transformers
    DeepSeek-V4, fp32) of SOURCE and write an imatrix (E[x^2] per input
    column, per expert) and a routing profile.

    \b
    Writes OUT/imatrix.gguf, imatrix.lucebox.dat (the layout Lucebox's
    ds4_mix_converter reads: one vector per expert stack, no tail),
    routing.csv (Lucebox hotness CSV), routing.json, sensitivity.json (KL per unit of weighted error for every
    routed-expert tensor, which `convert --sensitivity` uses) and report.json. Experts no token reached get
    count 0 and are listed.
    Examples:
      ds4quant calibrate samples/ds4-tiny --tokens samples/tokens.txt --out calib
      ds4quant calibrate ckpt/ --tokens toks.json --out calib --threads 4 --json
    """
    from ds4quant.calibrate import calibrate

    progress = command_progress(as_json)
    extra = {} if sensitivity_seqs is None else {"sensitivity_seqs": sensitivity_seqs}
    rep = calibrate(source, tokens_file, out_dir, threads=threads, progress=progress, **extra)
    if as_json:
        emit_json(rep.to_json())
        return
    click.echo(f"wrote {', '.join(os.path.join(rep.out_dir, f) for f in rep.files.values())}")
    click.echo(f"{rep.sequences} sequences, {rep.tokens} tokens, {rep.seconds:.1f} s ({rep.threads} worker(s))")
    never = {k.split(".")[1]: v for k, v in rep.unreached.items() if k.endswith("ffn_gate_exps.weight") and v}
    if never:
        detail = "; ".join(f"layer {layer}: {' '.join(map(str, v))}" for layer, v in never.items())
        click.echo(f"experts never reached ({rep.unreached_count}, imatrix count 0): {detail}")
    else:
        click.echo("every expert was reached")
