"""``ds4quant calibrate``: the streamed reference model over token sequences -> imatrix, routing, sensitivity."""

from __future__ import annotations

import os

import click

from ds4quant.cli.group import cli
from ds4quant.cli.options import PATH, device_option, json_option, size_option
from ds4quant.cli.output import command_progress, emit_json

METHODS = ("streamed", "per-tensor")


@cli.command("calibrate")
@click.argument("source", type=PATH)
@click.option("--tokens", "tokens_file", required=True, type=PATH,
              help="Token ids: one sequence per line (whitespace-separated; '#' lines skipped), or a JSON list of lists.")
@click.option("--out", "out_dir", required=True, type=PATH,
              help="Output folder (created if its parent exists).")
@device_option()
@size_option("--max-memory", help="Refuse up front a layer whose weights and working set exceed SIZE (e.g. 6G).")
@click.option("--resume", is_flag=True, help="Continue the interrupted run in OUT from its first unfinished layer "
                                             "(refused when the source, tokens or options changed).")
@click.option("--force", is_flag=True, help="Discard an interrupted run in OUT and start over.")
@click.option("--sensitivity-seqs", type=click.IntRange(min=0), default=None,
              help="Sequences (the first N) for the sensitivity pass, sensitivity.json (default 8; 0 skips).")
@click.option("--sensitivity-method", type=click.Choice(METHODS), default="streamed", show_default=True,
              help="streamed: whole-layer probes turn each tensor's local error into KL (a constant number of "
                   "passes); per-tensor: one perturbed run per routed tensor (small models).")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Sequences run through a layer together (same length only, the sensitivity ones among "
                   "themselves; default: 1 on the CPU, whose bits are then the whole model's; on a GPU as many as "
                   "fit, up to 8).")
@json_option(help="Print the report as one JSON object; no progress.")
def calibrate_cmd(source: str, tokens_file: str, out_dir: str, device: str, max_memory, resume: bool, force: bool,
                  sensitivity_seqs, sensitivity_method: str, batch_size, as_json: bool) -> None:
    """Run token sequences through the reference model (transformers
    DeepSeek-V4 layers, fp32, on the source dequantized exactly) of SOURCE,
    one decoder layer at a time, and write an imatrix (E[x^2] per input
    column, per expert), a routing profile and the sensitivity file.

    \b
    Writes OUT/imatrix.gguf, imatrix.lucebox.dat (the layout Lucebox's
    ds4_mix_converter reads: one vector per expert stack, no tail),
    routing.csv (Lucebox hotness CSV), routing.json, sensitivity.json (KL per unit of weighted error for every
    routed-expert tensor, which `convert --sensitivity` uses) and report.json. Experts no token reached get
    count 0 and are listed. While it runs, OUT/.ds4quant-work journals every finished layer: a killed run
    continues with --resume and writes the same bytes.
    Examples:
      ds4quant calibrate samples/ds4-tiny --tokens samples/tokens.txt --out calib
      ds4quant calibrate ckpt/ --tokens toks.json --out calib --device cuda --max-memory 64G
      ds4quant calibrate ckpt/ --tokens toks.json --out calib --resume
    """
    from ds4quant.calibrate import calibrate

    progress = command_progress(as_json)
    extra = {} if sensitivity_seqs is None else {"sensitivity_seqs": sensitivity_seqs}
    rep = calibrate(source, tokens_file, out_dir, device=device, max_memory=max_memory, resume=resume, force=force,
                    progress=progress, sensitivity_method=sensitivity_method, batch_size=batch_size, **extra)
    if as_json:
        emit_json(rep.to_json())
        return
    click.echo(f"wrote {', '.join(os.path.join(rep.out_dir, f) for f in rep.files.values())}")
    resumed = f", resumed at layer {rep.resumed_at}" if rep.resumed_at else ""
    batched = f", batches of {rep.batch}" if rep.batch > 1 else ""
    click.echo(f"{rep.sequences} sequences, {rep.tokens} tokens, {rep.seconds:.1f} s on {rep.device}{batched}{resumed}")
    never = {k.split(".")[1]: v for k, v in rep.unreached.items() if k.endswith("ffn_gate_exps.weight") and v}
    if never:
        detail = "; ".join(f"layer {layer}: {' '.join(map(str, v))}" for layer, v in never.items())
        click.echo(f"experts never reached ({rep.unreached_count}, imatrix count 0): {detail}")
    else:
        click.echo("every expert was reached")
