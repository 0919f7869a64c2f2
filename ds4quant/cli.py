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
from ds4quant.cli_support import eta_text, parse_fit_effort, progress_printer, sensitivity_file, size_cell, verify_progress
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
        order = ["convert", "inspect", "verify", "publish", "calibrate", "place", "run", "formats"]
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


def _echo_excluded(excluded) -> None:
    """One line per engine that cannot load the artifact, with why (artifact.runtimes.decide)."""
    for eng, why in excluded.items():
        click.echo(f"not loadable by {eng}: {'; '.join(why)}")


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


@cli.command("convert")
@click.argument("source", type=click.Path(path_type=str))
@click.argument("outdir", type=click.Path(path_type=str))
@click.option("--recipe", default="rocmfp2-strix", show_default=True,
              help="mxfp4, rocmfp2-strix, rocmfp3, rocmfp4, rocmfp4-fast, rocmfp8, adaptive.")
@click.option("--threads", type=int, default=None, help="Encoder threads (default: all cores). Never changes bytes.")
@click.option("--imatrix", type=click.Path(path_type=str), default=None,
              help="Importance matrix: GGUF imatrix, llama.cpp imatrix.dat, or the Lucebox converter layout.")
@click.option("--tensor-type", "tensor_types", multiple=True, metavar="REGEX=QTYPE",
              help="Override the qtype of tensors whose GGUF name matches REGEX; repeatable, last wins. "
                   "QTYPE 'source' keeps source precision.")
@click.option("--dense-type", "dense_qtype", default=None, metavar="QTYPE",
              help="qtype for attention projections and shared experts (default bf16).")
@click.option("--name", default=None, help="Artifact file name stem (default: SOURCE folder name + recipe).")
@click.option("--split-max-size", default=None, metavar="SIZE", help="Split the GGUF into files of at most SIZE (e.g. 50G).")
@click.option("--target-bpw", type=float, default=None, help="adaptive: routed-expert bits per weight to land on.")
@click.option("--max-bytes", default=None, metavar="SIZE", help="adaptive: cap on all tensor data (e.g. 90G).")
@click.option("--candidates", default=None, metavar="Q1,Q2,...",
              help="adaptive: candidate qtypes (default rocmfp2,rocmfp2_mix,rocmfp3,rocmfp3_mix,rocmfp4_fast,rocmfp4).")
@click.option("--granularity", type=click.Choice(["tensor", "expert"]), default="tensor", show_default=True,
              help="adaptive: one qtype per layer x surface (Lucebox layout), or per expert (compact stacks).")
@click.option("--routing", type=click.Path(path_type=str), default=None,
              help="adaptive: routing profile (Lucebox hotness CSV or ds4quant JSON) to weight experts.")
@click.option("--sensitivity", type=click.Path(path_type=str), default=None,
              help="adaptive: sensitivity.json from `ds4quant calibrate`: allocate by predicted KL, not raw weighted "
                   "error (default: the one beside --imatrix, if that calibrate run wrote it; 'none' ignores it).")
@click.option("--fitter", type=click.Choice(["optimized", "reference"]), default="optimized", show_default=True,
              help="adaptive: MIX codebook fitter.")
@click.option("--fit-effort", default="6,1,512", show_default=True, metavar="ITER,RESTARTS,ROWS",
              help="adaptive: optimized-fitter Lloyd iterations, restarts, and rows sampled per expert.")
@click.option("--cache-dir", type=click.Path(path_type=str), default=None,
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
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object at the end; no progress lines.")
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
    from ds4quant.adaptive import DEFAULT_CANDIDATES, AdaptiveOptions
    from ds4quant.convert import convert, parse_size

    adaptive = None
    if recipe == "adaptive" or target_bpw is not None or max_bytes is not None:
        sensitivity = sensitivity_file(sensitivity, imatrix, not as_json)
        adaptive = AdaptiveOptions(
            target_bpw=target_bpw, max_bytes=parse_size(max_bytes, "--max-bytes"),
            candidates=tuple(c.strip() for c in candidates.split(",") if c.strip()) if candidates else DEFAULT_CANDIDATES,
            granularity=granularity, fitter=fitter, routing=routing, cache_dir=cache_dir, lucebox=not no_lucebox,
            sensitivity=sensitivity, jobs=jobs, device=measure_device,
            **parse_fit_effort(fit_effort),
        )
    progress = progress_printer(not as_json and sys.stderr.isatty())
    rep = convert(source, outdir, recipe, threads=threads, imatrix=imatrix, tensor_types=tensor_types,
                  dense_qtype=dense_qtype, name=name, split_max_size=split_max_size, adaptive=adaptive,
                  gate_up_books=gate_up_books, loose_sidecars=loose_sidecars, resume=resume, force=force,
                  command=["ds4quant", *sys.argv[1:]], progress=progress)
    for f, nbytes, tensor in rep.oversize_splits:
        click.echo(f"ds4quant: warning: {f} holds {nbytes:,} bytes, over --split-max-size {split_max_size}: "
                   f"tensor {tensor} is larger than the limit and got a split of its own", err=True)
    if as_json:
        _emit_json(rep.to_json())
        return
    j = rep.to_json()
    click.echo(f"wrote {j['artifact']}: {len(j['files'])} file(s), {j['bytes']:,} bytes, {j['tensors']} tensors")
    click.echo(f"routed experts: {j['bpw_experts']:.4f} bpw, SQNR {j['expert_sqnr_db'] or float('inf'):.2f} dB; "
               f"{j['seconds']:.1f} s" + (f" ({j['reused_tensors']} tensors resumed)" if j["reused_tensors"] else ""))
    click.echo(f"loadable by: {', '.join(j['runtimes']) or 'no known runtime'}")
    _echo_excluded(j.get("runtimes_excluded") or {})
    a = j.get("adaptive")
    if a:
        click.echo(f"adaptive: {a['method']}, {a['allocated_bytes']:,} of {a['budget_bytes']:,} budget bytes "
                   f"({100 * a['slack']:.2f}% under); predicted weighted SQNR {a['predicted_weighted_sqnr_db']:.2f} dB")
        for rname, u in a.get("uniform", {}).items():
            click.echo(f"  vs {rname}: {u['bpw']:.4f} bpw, weighted SQNR {u['weighted_sqnr_db']:.2f} dB")
        fc = a.get("fitter_comparison")
        if fc and fc.get("gain_db") is not None:
            click.echo(f"  MIX fitter: ours {fc['gain_db']:+.2f} dB vs the reference fitter on {fc['experts']} experts")


@cli.command("inspect")
@click.argument("artifact", type=click.Path(path_type=str))
@click.option("--variant-107", default=None, metavar="QTYPE",
              help="Name the codec of untagged ggml type 107 tensors (rocmfp2, rocmfp2_affine, rocmfp2_s40).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect_cmd(artifact, variant_107, as_json):
    """Show every tensor of an artifact folder or GGUF file: qtype, ggml type,
    variant, shape, bytes, bpw; totals, expert bpw, codebook tables.

    \b
    Examples:
      ds4quant inspect out/tiny-strix
      ds4quant inspect model.gguf --variant-107 rocmfp2_affine --json
    """
    from ds4quant.inspection import inspect_artifact

    ins = inspect_artifact(artifact, variant_107=variant_107)
    if as_json:
        _emit_json(ins.to_json())
        return
    planned = any(t.predicted_error is not None for t in ins.tensors)
    header = ("name", "qtype", "ggml", "variant", "shape", "bytes", "bpw") + (("predicted err",) if planned else ())
    rows = [(t.name, t.qtype, str(t.ggml_type), t.variant, "x".join(map(str, t.shape)), f"{t.bytes:,}", f"{t.bpw:.3f}")
            + ((f"{t.predicted_error:.4g}" if t.predicted_error is not None else "-",) if planned else ())
            for t in ins.tensors]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    click.echo("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    click.echo("")
    for q, d in sorted(ins.qtype_totals().items()):
        click.echo(f"{q:<14} {d['tensors']:>5} tensors {d['bytes']:>14,} bytes {8 * d['bytes'] / d['weights']:7.3f} bpw")
    bpw = ins.bpw_experts
    click.echo(f"files: {', '.join(p.name for p in ins.files)} ({ins.file_bytes:,} bytes)")
    click.echo(f"expert bpw: {bpw:.4f}" if bpw is not None else "expert bpw: no routed expert tensors")
    click.echo(f"codebook tables: {', '.join(ins.codebook_tables) or 'none'}")
    click.echo(f"loadable by: {', '.join(ins.runtimes) or 'no known runtime'}")
    from ds4quant.artifact.runtimes import needs

    for r in ins.runtimes:
        click.echo(f"  {r}: {needs(r)}")
    _echo_excluded(ins.runtimes_excluded)
    if ins.stored_runtimes is not None and not set(ins.stored_runtimes) <= set(ins.runtimes):
        click.echo(f"note: its ds4quant.runtimes key says {', '.join(ins.stored_runtimes) or 'none'}, "
                   "more than its contents allow (ds4quant verify fails it)")
    alloc = ((ins.manifest or {}).get("recipe") or {}).get("allocation")
    if alloc:
        click.echo(f"adaptive plan: {alloc['method']}, {alloc['allocated_bytes']:,} of {alloc['budget_bytes']:,} "
                   f"budget bytes, predicted weighted SQNR {alloc['predicted_weighted_sqnr_db']:.2f} dB")
    for n in ins.notes:
        click.echo(f"note: {n}")


@cli.command("verify")
@click.argument("artifact", type=click.Path(path_type=str))
@click.option("--source", default=None, type=click.Path(path_type=str),
              help="The checkpoint folder (or GGUF) it was made from: decode every tensor and compare.")
@click.option("--imatrix", default=None, type=click.Path(path_type=str),
              help="Importance matrix for the importance-weighted error (needs --source).")
@click.option("--report", "report_dir", default=None, type=click.Path(path_type=str),
              help="Write report.md and PNG plots into this folder.")
@click.option("--threshold-db", type=float, default=None,
              help="Flag lossy tensors below this SQNR (default: a floor per qtype).")
@click.option("--variant-107", default=None, metavar="QTYPE",
              help="Name the codec of untagged ggml type 107 tensors (rocmfp2, rocmfp2_affine, rocmfp2_s40).")
@click.option("--fidelity", "fidelity", is_flag=True,
              help="Run the model through the bundled runtime against the transformers reference (needs --source): "
                   "KL, top-1, PPL ratio, MoE error per layer, response and MoE-output hashes.")
@click.option("--placement", "placements", multiple=True, type=click.Path(path_type=str),
              help="Placement file for --fidelity (default: one CPU owner); a cluster placement (place --ranks N) "
                   "runs the experts on N gloo ranks of this host; give it twice to compare two placements.")
@click.option("--mode", type=click.Choice(["exact", "fast"]), default="fast", show_default=True,
              help="Runtime numeric mode for --fidelity (exact: the bitwise identity definition, slower).")
@click.option("--tokens", "tokens_file", default=None, type=click.Path(path_type=str),
              help="Evaluation token ids for --fidelity (one sequence per line, or a JSON list of lists).")
@click.option("--text", "text_file", default=None, type=click.Path(path_type=str),
              help="Evaluation text for --fidelity (UTF-8; blank-line-separated documents, the source's tokenizer).")
@click.option("--protocol", type=click.Choice(["exact-copy"]), default=None,
              help="Also run the exact-copy protocol (20 identifiers x 3 contexts; needs the source's "
                   "tokenizer.json and task.json).")
@click.option("--engine", "engines", multiple=True, type=click.Choice(["llama.cpp"]),
              help="With --fidelity: also run the artifact through this engine (llama.cpp via llama-cpp-python, "
                   "which scripts/interop.sh installs) and report the same figures for it.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object {ok, checks, tensors, summary[, fidelity]}.")
def verify_cmd(artifact, source, imatrix, report_dir, threshold_db, variant_107, fidelity, placements, mode,
               tokens_file, text_file, protocol, engines, as_json):
    """Check that an artifact (or release folder, or bare .gguf) is sound:
    types and tags, sizes and offsets, DS4 keys, codebook coverage, tensor and
    file hashes against manifest.json (and SHA256SUMS). With --source, decode
    every tensor and report its error against the source.

    Exit status: 0 sound, 1 a check failed, 2 unusable input.

    \b
    Examples:
      ds4quant verify out/tiny-strix
      ds4quant verify out/tiny-strix --source samples/ds4-tiny --report out/tiny-strix-report
      ds4quant verify release/ --json
      ds4quant verify out/copy-strix --source samples/ds4-copy --fidelity --protocol exact-copy
      ds4quant verify out/llama-mxfp4 --source SRC --fidelity --engine llama.cpp
      ds4quant verify out/copy-strix --source samples/ds4-copy --fidelity --mode exact \\
          --placement a.json --placement b.json
      ds4quant verify out/copy-strix --source samples/ds4-copy --fidelity --mode exact \\
          --placement cluster.json     # ds4quant place --ranks 2: two gloo ranks
    """
    from ds4quant.verify import verify

    if report_dir is not None:
        from ds4quant.report import check_report_dir

        check_report_dir(report_dir, artifact)
    progress = verify_progress(source is not None and not as_json and sys.stderr.isatty())
    rep = verify(artifact, source=source, imatrix=imatrix, threshold_db=threshold_db, variant_107=variant_107,
                 progress=progress, fidelity=fidelity, placements=tuple(placements), mode=mode, tokens=tokens_file,
                 text=text_file, protocol=protocol, engines=tuple(engines))
    report_path = None
    if report_dir is not None:
        from ds4quant.report import write_report

        report_path = write_report(rep, report_dir)
    if as_json:
        _emit_json(rep.to_json())
    else:
        s = rep.summary
        click.echo(f"verify {s['artifact']} ({s['kind']}): {len(rep.files)} file(s), {s['n_tensors']} tensors, "
                   f"{s['tensor_bytes']:,} tensor bytes")
        for c in rep.checks:
            click.echo(f"  {'ok  ' if c.ok else 'FAIL'} {c.one_line()}")
        if s["bpw_experts"] is not None:
            line = f"routed experts: {s['bpw_experts']:.4f} bpw"
            if s["expert_sqnr_db"] is not None:
                line += f", SQNR {s['expert_sqnr_db']:.2f} dB, rel MSE {s['expert_rel_mse']:.4g}"
            if s["expert_weighted_rel_error"] is not None:
                line += f", weighted rel error {s['expert_weighted_rel_error']:.4g}"
            if s["numbers_from"]:
                line += f" ({'decoded vs source' if s['numbers_from'] == 'source' else 'convert-time, from manifest.json'})"
            click.echo(line)
        f = rep.fidelity
        if f.get("measured"):
            line = (f"fidelity ({f['mode']} mode, {f['eval_tokens']} tokens): KL mean {f['kl_mean']:.4g} "
                    f"p99 {f['kl_p99']:.4g}, top-1 {100 * f['top1']:.2f}%, PPL ratio {f['ppl_ratio']:.4f}, "
                    f"response {f['response_sha256'][:16]}")
            if f.get("exact_copy"):
                line += f", exact copy {f['exact_copy']['passes']}/{f['exact_copy']['trials']}"
            click.echo(line)
            for name, e in (f.get("engines") or {}).items():
                line = (f"fidelity ({name}): KL mean {e['kl_mean']:.4g} p99 {e['kl_p99']:.4g}, top-1 "
                        f"{100 * e['top1']:.2f}%, PPL ratio {e['ppl_ratio']:.4f}, response {e['response_sha256'][:16]}")
                if e.get("exact_copy"):
                    line += f", exact copy {e['exact_copy']['passes']}/{e['exact_copy']['trials']}"
                click.echo(line)
            for c in f.get("cluster") or ():
                click.echo(f"cluster: {c['n_ranks']} ranks started once in {c['start_s']:.1f} s, {c['calls']} layer "
                           f"calls, {c['call_ms_median']:.1f} ms median; expert bytes read per rank "
                           f"{[r['expert_bytes_read'] for r in c['ranks']]}")
        if report_path is not None:
            click.echo(f"report: {report_path}")
        n_bad = len(rep.failed)
        click.echo("sound" if rep.ok else f"NOT SOUND: {n_bad} check(s) failed")
    if not rep.ok:
        click.get_current_context().exit(1)


@cli.command("publish")
@click.argument("artifact", type=click.Path(path_type=str))
@click.argument("outdir", type=click.Path(path_type=str))
@click.option("--source", default=None, type=click.Path(path_type=str),
              help="Verify against this checkpoint first; the model card then shows decoded fidelity.")
@click.option("--imatrix", default=None, type=click.Path(path_type=str),
              help="Importance matrix for the weighted error (needs --source).")
@click.option("--hf-repo", default=None, metavar="NAME",
              help="Also upload the release folder to this Hugging Face repo (one commit).")
@click.option("--fidelity", is_flag=True,
              help="Also measure fidelity through the bundled runtime (KL, top-1, exact copy; needs --source); "
                   "the model card carries the figures.")
@click.option("--protocol", type=click.Choice(["exact-copy"]), default=None,
              help="With --fidelity: run this protocol too.")
@click.option("--mode", type=click.Choice(["exact", "fast"]), default="fast", show_default=True,
              help="With --fidelity: the runtime's mode.")
@click.option("--force", is_flag=True, help="Replace a non-empty OUTDIR.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def publish_cmd(artifact, outdir, source, imatrix, hf_repo, fidelity, protocol, mode, force, as_json):
    """Verify an artifact, then write a release folder: the artifact files,
    manifest.json, SHA256SUMS, the verify report with plots, and a model card
    README.md. An unsound artifact is refused (exit 1).

    \b
    Examples:
      ds4quant publish out/tiny-mix release/tiny-mix --source samples/ds4-tiny
      ds4quant publish out/tiny-mix release/tiny-mix --hf-repo me/ds4-tiny-rocmfpx
      ds4quant publish out/copy-mix release/copy-mix --source samples/ds4-copy --fidelity --protocol exact-copy
    """
    from ds4quant.publish import publish

    if (fidelity or protocol) and source is None:
        from ds4quant.errors import BadInputError

        raise BadInputError("--fidelity and --protocol need --source", where=str(artifact))
    rep = publish(artifact, outdir, source=source, imatrix=imatrix, hf_repo=hf_repo, overwrite=force,
                  fidelity=fidelity or protocol is not None, protocol=protocol, mode=mode)
    if as_json:
        _emit_json(rep.to_json())
        return
    click.echo(f"release {rep.release}: {len(rep.files)} files, {rep.bytes:,} bytes; check it with "
               f"`cd {rep.release} && sha256sum -c SHA256SUMS`")
    if rep.url:
        click.echo(f"uploaded: {rep.url}")


@cli.command("calibrate")
@click.argument("source", type=click.Path(path_type=str))
@click.option("--tokens", "tokens_file", required=True, type=click.Path(path_type=str),
              help="Token ids: one sequence per line (whitespace-separated; '#' lines skipped), or a JSON list of lists.")
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=str),
              help="Output folder (created if its parent exists).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Worker processes, one core each (default 1). Output bytes do not depend on it.")
@click.option("--sensitivity-seqs", type=click.IntRange(min=0), default=None,
              help="Sequences (the first N) for the per-tensor KL sensitivity pass, sensitivity.json (default 8; 0 skips).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object; no progress.")
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

    progress = None
    if not as_json and sys.stderr.isatty():

        def progress(ev) -> None:
            tokens = ev.detail["tokens"]
            rate = tokens / ev.elapsed if ev.elapsed > 0 else 0.0
            click.echo(f"\rcalibrate: {ev.done}/{ev.total} sequences, {tokens} tokens, {rate:.0f} tok/s, "
                       f"{eta_text(ev)} ", err=True, nl=ev.done == ev.total)

    extra = {} if sensitivity_seqs is None else {"sensitivity_seqs": sensitivity_seqs}
    rep = calibrate(source, tokens_file, out_dir, threads=threads, progress=progress, **extra)
    if as_json:
        _emit_json(rep.to_json())
        return
    click.echo(f"wrote {', '.join(os.path.join(rep.out_dir, f) for f in rep.files.values())}")
    click.echo(f"{rep.sequences} sequences, {rep.tokens} tokens, {rep.seconds:.1f} s ({rep.threads} worker(s))")
    never = {k.split(".")[1]: v for k, v in rep.unreached.items() if k.endswith("ffn_gate_exps.weight") and v}
    if never:
        detail = "; ".join(f"layer {layer}: {' '.join(map(str, v))}" for layer, v in never.items())
        click.echo(f"experts never reached ({rep.unreached_count}, imatrix count 0): {detail}")
    else:
        click.echo("every expert was reached")


@cli.command("run")
@click.argument("artifact", type=click.Path(path_type=str))
@click.option("--ranks", type=int, required=True, help="Ranks to start on this host (torch.distributed).")
@click.option("--placement", required=True, type=click.Path(path_type=str),
              help="A rank placement (ds4quant place --ranks N).")
@click.option("--tokens", type=int, default=1, show_default=True, help="Seeded synthetic tokens per layer.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--layers", default=None, metavar="L1,L2,...", help="MoE layers to run (default: all).")
@click.option("--mode", type=click.Choice(["exact", "fast"]), default="exact", show_default=True)
@click.option("--owner", "owners", multiple=True, metavar="NAME",
              help="Local owner(s) of each rank, {local_rank} substituted (default: the placement's).")
@click.option("--backend", type=click.Choice(["gloo", "nccl"]), default="gloo", show_default=True)
@click.option("--launcher", type=click.Choice(["torchrun", "spawn"]), default="torchrun", show_default=True)
@click.option("--timeout", type=float, default=120.0, show_default=True,
              help="Seconds a collective may wait for a peer before every rank fails.")
@click.option("--out", default=None, type=click.Path(path_type=str), help="Write the result JSON here.")
@click.option("--json", "as_json", is_flag=True, help="Print the result JSON instead of lines.")
def run_cmd(artifact, ranks, placement, tokens, seed, layers, mode, owners, backend, launcher, timeout, out,
            as_json):
    """Run the MoE layers of ARTIFACT on --ranks processes (an expert-parallel cluster)."""
    from ds4quant.runtime.cluster import result_lines, run_cluster_layers

    lay = None
    if layers:
        try:
            lay = [int(v) for v in layers.split(",")]
        except ValueError:
            raise click.BadParameter("must be comma-separated layer numbers", param_hint="--layers") from None
    run = run_cluster_layers(artifact, placement, tokens=tokens, n_ranks=ranks, mode=mode, timeout_s=timeout,
                             layers=lay, owners=list(owners) or None, backend=backend, launcher=launcher, seed=seed)
    j = run.to_json()
    if out:
        from ds4quant.artifact.atomic import atomic_write_bytes, json_bytes

        atomic_write_bytes(out, json_bytes(j))
    if as_json:
        _emit_json(j)
    else:
        click.echo("\n".join(result_lines(run)))


@cli.command("place")
@click.argument("artifact", type=click.Path(path_type=str))
@click.option("--routing", required=True, type=click.Path(path_type=str),
              help="Routing profile: Lucebox hotness CSV or ds4quant routing JSON (ds4quant calibrate writes both).")
@click.option("--owner", "owners", multiple=True, metavar="NAME=BYTES",
              help="An owner and its byte budget (50G, 512M, 1024; NAME alone: no budget); repeatable, "
                   "first = hot. Names: cpu, cpu:N, cuda:N, hip:N, torch-cpu:N, worker:N.")
@click.option("--min-hot", type=int, default=0, show_default=True, help="Hot experts per layer on the first owner.")
@click.option("--speed-ratio", type=float, default=None,
              help="First owner's speed over the others: critical-path balancing (Lucebox MAIN_TO_PEER_RATE).")
@click.option("--cold", default=None, metavar="none|OWNER",
              help="Where experts that fit no budget go: an owner, or 'none' (held outside this process).")
@click.option("--ranks", type=int, default=None, help="A cluster placement over N ranks instead.")
@click.option("--strategy", type=click.Choice(["uniform", "balanced"]), default="uniform", show_default=True,
              help="--ranks: e % N, or longest-processing-time by hotness.")
@click.option("--replicate-hot", type=int, default=0, show_default=True,
              help="--ranks: replicate the K hottest experts of each layer on every rank.")
@click.option("--out", type=click.Path(path_type=str), default=None, help="Placement file to write (JSON).")
@click.option("--check", "check", type=click.Path(path_type=str), default=None, metavar="PLACEMENT",
              help="Instead of planning: validate an existing placement file against ARTIFACT and report it.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
def place_cmd(artifact, routing, owners, min_hot, speed_ratio, cold, ranks, strategy, replicate_hot, out, check,
              as_json):
    """Plan which owner holds which routed expert: greedy by routed slots per
    byte within each owner's budget, with a per-layer floor of hot experts
    (Lucebox's byte-budget placement), or a cluster placement over ranks.

    \b
    Examples:
      ds4quant place out/tiny --routing calib/routing.csv --owner cuda:0=8G --owner cpu --cold cpu --out p.json
      ds4quant place out/tiny --routing calib/routing.csv --owner cuda:0=2G --cold none --min-hot 4 --out p.json
      ds4quant place out/tiny --routing calib/routing.csv --ranks 2 --strategy balanced --out cluster.json
    """
    from ds4quant.errors import BadInputError
    from ds4quant.place import check_placement, place

    if check is not None:
        if out is not None or owners or ranks is not None:
            raise BadInputError("--check reports an existing placement; it takes no --out, --owner or --ranks",
                                where="--check")
        _p, rep = check_placement(artifact, routing, check)
    else:
        if out is None:
            raise BadInputError("name the placement file to write", where="--out")
        if not owners and ranks is None:
            raise BadInputError("give at least one --owner NAME=BYTES (or --ranks N)", where="--owner")
        _p, rep = place(artifact, routing, owners, cold=cold, min_hot=min_hot, speed_ratio=speed_ratio, ranks=ranks,
                        strategy=strategy, replicate_hot=replicate_hot, out=out)
    j = rep.to_json()
    if as_json:
        _emit_json({**j, "out": out})
        return
    if j["kind"] == "ranks":
        rows = [(str(r["rank"]), str(r["experts"]), size_cell(r["bytes"]), f"{100 * r['slot_share']:.2f}%")
                for r in j["ranks"]]
        header = ("rank", "experts", "bytes", "slots")
    else:
        rows = [(o["name"], size_cell(o["budget"]), size_cell(o["bytes"]), str(o["experts"])) for o in j["owners"]]
        if j["none"]["experts"]:
            rows.append(("none", "-", size_cell(j["none"]["bytes"]), str(j["none"]["experts"])))
        header = ("owner", "budget", "bytes", "experts")
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    click.echo("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    if j["kind"] == "owners":
        click.echo(f"slot-resident rate {100 * j['slot_resident_rate']:.2f}%, token-resident rate "
                   f"{100 * j['token_resident_rate']:.2f}% ({j['token_resident_method']}) on {j['owners'][0]['name']}")
    for n in j["notes"]:
        click.echo(f"note: {n}")
    click.echo(f"{'wrote' if check is None else 'checked'} {out or check} "
               f"(content sha256 {j['placement_sha256'][:16]})")


def main(argv=None) -> None:
    """Console-script entry point."""
    cli.main(args=argv, prog_name="ds4quant")


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
