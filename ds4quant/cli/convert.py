"""``ds4quant convert``: a checkpoint -> an artifact folder (fixed recipes and adaptive)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ds4quant.cli.group import cli
from ds4quant.cli.options import PATH, imatrix_option, json_option, size_option
from ds4quant.cli.output import command_progress, echo_excluded, emit_json


@cli.command("convert")
@click.argument("source", type=PATH)
@click.argument("outdir", type=PATH)
@click.option("--recipe", default="rocmfp2-strix", show_default=True,
              help="mxfp4, rocmfp2-strix, rocmfp3, rocmfp4, rocmfp4-fast, rocmfp8, adaptive.")
@click.option("--threads", type=int, default=None, help="Encoder threads (default: all cores). Never changes bytes.")
@imatrix_option(help="Importance matrix: GGUF imatrix, llama.cpp imatrix.dat, or the Lucebox converter layout.")
@click.option("--tensor-type", "tensor_types", multiple=True, metavar="REGEX=QTYPE",
              help="Override the qtype of tensors whose GGUF name matches REGEX; repeatable, last wins. "
                   "QTYPE 'source' keeps source precision.")
@click.option("--dense-type", "dense_qtype", default=None, metavar="QTYPE",
              help="qtype for attention projections and shared experts (default bf16).")
@click.option("--name", default=None, help="Artifact file name stem (default: SOURCE folder name + recipe).")
@size_option("--split-max-size", help="Split the GGUF into files of at most SIZE (e.g. 50G).")
@click.option("--target-bpw", type=float, default=None, help="adaptive: routed-expert bits per weight to land on.")
@size_option("--max-bytes", help="adaptive: cap on all tensor data (e.g. 90G).")
@click.option("--candidates", default=None, metavar="Q1,Q2,...",
              help="adaptive: candidate qtypes (default rocmfp2,rocmfp2_mix,rocmfp3,rocmfp3_mix,rocmfp4_fast,rocmfp4).")
@click.option("--granularity", type=click.Choice(["tensor", "expert"]), default="tensor", show_default=True,
              help="adaptive: one qtype per layer x surface (Lucebox layout), or per expert (compact stacks).")
@click.option("--routing", type=PATH, default=None,
              help="adaptive: routing profile (Lucebox hotness CSV or ds4quant JSON) to weight experts.")
@click.option("--sensitivity", type=PATH, default=None,
              help="adaptive: sensitivity.json from `ds4quant calibrate`: allocate by predicted KL, not raw weighted "
                   "error (default: the one beside --imatrix, if that calibrate run wrote it; 'none' ignores it).")
@click.option("--fitter", type=click.Choice(["optimized", "reference"]), default="optimized", show_default=True,
              help="adaptive: MIX codebook fitter.")
@click.option("--fit-effort", default="6,1,512", show_default=True, metavar="ITER,RESTARTS,ROWS",
              help="adaptive: optimized-fitter Lloyd iterations, restarts, and rows sampled per expert.")
@click.option("--cache-dir", type=PATH, default=None,
              help="adaptive: measurement cache (default $DS4QUANT_CACHE or ~/.cache/ds4quant).")
@click.option("--jobs", type=click.IntRange(min=1), default=None,
              help="adaptive: experts measured at once (default: --threads). Never changes bytes.")
@click.option("--device", "measure_device", default="cpu", show_default=True, metavar="cpu|cuda[:N]|torch-cpu",
              help="adaptive: run the measure stage's MIX and scale searches on a CUDA device through torch. "
                   "Never changes bytes.")
@click.option("--no-lucebox", is_flag=True, help="adaptive: allow layouts only ds4quant's runtime loads.")
@click.option("--gate-up-books", type=click.Choice(["separate", "joint"]), default="separate", show_default=True,
              help="MIX qtypes chosen with --tensor-type: fit each expert's gate and up codebooks apart, or one "
                   "pair over both and shared (as Lucebox's converter does).")
@click.option("--loose-sidecars/--no-loose-sidecars", default=True, show_default=True,
              help="Write Lucebox MIX codebooks also as NAME.gguf.gumix.bin / .p4mix.bin beside the GGUF (some "
                   "Lucebox loaders read only these; without them the key says lucebox-mix-embedded).")
@click.option("--resume", is_flag=True, help="Continue an interrupted run in OUTDIR (same source and recipe).")
@click.option("--force", is_flag=True,
              help="Replace an earlier convert's artifact in OUTDIR. Removes only files convert writes; "
                   "refuses if OUTDIR holds others.")
@json_option(help="Print one JSON object at the end; no progress lines.")
def convert_cmd(source, outdir, recipe, threads, imatrix, tensor_types, dense_qtype, name, split_max_size,
                target_bpw, max_bytes, candidates, granularity, routing, sensitivity, fitter, fit_effort, cache_dir,
                jobs, measure_device, no_lucebox, gate_up_books, loose_sidecars, resume, force, as_json):
    """Convert a DeepSeek-V4 checkpoint (official layout folder, or a F32/F16/BF16/Q8_0/MXFP4 GGUF) into a
    ROCmFPX artifact.

    \b
    Examples:
      ds4quant convert samples/ds4-tiny out/tiny-strix --recipe rocmfp2-strix
      ds4quant convert ckpt/ out/ --recipe rocmfp3 --imatrix imatrix.gguf --tensor-type 'blk\\.0\\..*exps=rocmfp4'
    """
    from ds4quant.plan import DEFAULT_CANDIDATES, AdaptiveOptions
    from ds4quant.convert import convert

    adaptive = None
    if recipe == "adaptive" or target_bpw is not None or max_bytes is not None:
        sensitivity = sensitivity_file(sensitivity, imatrix, not as_json)
        adaptive = AdaptiveOptions(
            target_bpw=target_bpw, max_bytes=None if max_bytes is None else int(max_bytes),
            candidates=tuple(c.strip() for c in candidates.split(",") if c.strip()) if candidates else DEFAULT_CANDIDATES,
            granularity=granularity, fitter=fitter, routing=routing, cache_dir=cache_dir, lucebox=not no_lucebox,
            sensitivity=sensitivity, jobs=jobs, device=measure_device,
            **parse_fit_effort(fit_effort),
        )
    progress = command_progress(as_json)
    rep = convert(source, outdir, recipe, threads=threads, imatrix=imatrix, tensor_types=tensor_types,
                  dense_qtype=dense_qtype, name=name, split_max_size=split_max_size, adaptive=adaptive,
                  gate_up_books=gate_up_books, loose_sidecars=loose_sidecars, resume=resume, force=force,
                  command=["ds4quant", *sys.argv[1:]], progress=progress)
    for f, nbytes, tensor in rep.oversize_splits:
        click.echo(f"ds4quant: warning: {f} holds {nbytes:,} bytes, over --split-max-size {split_max_size}: "
                   f"tensor {tensor} is larger than the limit and got a split of its own", err=True)
    if as_json:
        emit_json(rep.to_json())
        return
    j = rep.to_json()
    click.echo(f"wrote {j['artifact']}: {len(j['files'])} file(s), {j['bytes']:,} bytes, {j['tensors']} tensors")
    click.echo(f"routed experts: {j['bpw_experts']:.4f} bpw, SQNR {j['expert_sqnr_db'] or float('inf'):.2f} dB; "
               f"{j['seconds']:.1f} s" + (f" ({j['reused_tensors']} tensors resumed)" if j["reused_tensors"] else ""))
    click.echo(f"loadable by: {', '.join(j['runtimes']) or 'no known runtime'}")
    echo_excluded(j.get("runtimes_excluded") or {})
    a = j.get("adaptive")
    if a:
        click.echo(f"adaptive: {a['method']}, {a['allocated_bytes']:,} of {a['budget_bytes']:,} budget bytes "
                   f"({100 * a['slack']:.2f}% under); predicted weighted SQNR {a['predicted_weighted_sqnr_db']:.2f} dB")
        for rname, u in a.get("uniform", {}).items():
            click.echo(f"  vs {rname}: {u['bpw']:.4f} bpw, weighted SQNR {u['weighted_sqnr_db']:.2f} dB")
        fc = a.get("fitter_comparison")
        if fc and fc.get("gain_db") is not None:
            click.echo(f"  MIX fitter: ours {fc['gain_db']:+.2f} dB vs the reference fitter on {fc['experts']} experts")


def sensitivity_file(given, imatrix, say: bool):
    """--sensitivity: a path, 'none', or (not given) the calibrate run's own file beside --imatrix."""
    from ds4quant.calib.sensitivity import SENSITIVITY_FILE

    if given is not None:
        return None if given.lower() == "none" else given
    if imatrix is None or not (Path(imatrix).parent / SENSITIVITY_FILE).is_file():
        return None
    found = str(Path(imatrix).parent / SENSITIVITY_FILE)
    if say:
        click.echo(f"adaptive: allocating by predicted KL from {found} (beside --imatrix; "
                   "--sensitivity none to ignore)", err=True)
    return found


def parse_fit_effort(text: str) -> dict:
    """--fit-effort ITER,RESTARTS,ROWS -> AdaptiveOptions' fit_iterations, fit_restarts, fit_max_rows."""
    from ds4quant.errors import BadInputError

    try:
        it, rs, rows = (int(v) for v in text.split(","))
    except ValueError:
        raise BadInputError(f"expected ITER,RESTARTS,ROWS, got {text!r}", where="--fit-effort") from None
    if it < 0 or rs < 0 or rows < 1:
        raise BadInputError(f"iterations and restarts must be >= 0 and rows >= 1, got {text!r}", where="--fit-effort")
    return {"fit_iterations": it, "fit_restarts": rs, "fit_max_rows": rows}
