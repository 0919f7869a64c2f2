"""``ds4quant verify``: is an artifact sound, and (with --source, --fidelity) how faithful."""

from __future__ import annotations

import sys

import click

from ds4quant.cli.group import cli
from ds4quant.cli.options import (
    PATH,
    device_option,
    fidelity_option,
    imatrix_option,
    json_option,
    mode_option,
    protocol_option,
    size_option,
    source_option,
    variant_107_option,
)
from ds4quant.cli.output import command_progress, emit_json


@cli.command("verify")
@click.argument("artifact", type=PATH)
@source_option(help="The checkpoint folder (or GGUF) it was made from: decode every tensor and compare.")
@imatrix_option(help="Importance matrix for the importance-weighted error (needs --source).")
@click.option("--report", "report_dir", default=None, type=PATH,
              help="Write report.md and PNG plots into this folder.")
@click.option("--threshold-db", type=float, default=None,
              help="Flag lossy tensors below this SQNR (default: a floor per qtype).")
@variant_107_option()
@fidelity_option(help="Run the model through the bundled runtime against the transformers reference (needs --source): "
                      "KL, top-1, PPL ratio, MoE error per layer, response and MoE-output hashes.")
@click.option("--placement", "placements", multiple=True, type=PATH,
              help="Placement file for --fidelity (default: one CPU owner); a cluster placement (place --ranks N) "
                   "runs the experts on N gloo ranks of this host; give it twice to compare two placements.")
@mode_option(help="Runtime numeric mode for --fidelity (exact: the bitwise identity definition, slower).")
@click.option("--tokens", "tokens_file", default=None, type=PATH,
              help="Evaluation token ids for --fidelity (one sequence per line, or a JSON list of lists).")
@click.option("--text", "text_file", default=None, type=PATH,
              help="Evaluation text for --fidelity (UTF-8; blank-line-separated documents, the source's tokenizer).")
@click.option("--ctx", "ctx_size", type=int, default=None,
              help="With --fidelity: score as llama.cpp's perplexity tool (the --text/--tokens stream cut into "
                   "chunks of this many tokens, the second half of each scored).")
@protocol_option(help="Also run the exact-copy protocol (20 identifiers x 3 contexts; needs the source's "
                      "tokenizer.json and task.json).")
@click.option("--copy-sets", "copy_sets", type=int, default=5, show_default=True,
              help="With --protocol exact-copy: seeded identifier sets of 60 trials (the protocol's own first); "
                   "the score is their mean per 60 with a 95% Wilson interval, and the check uses the interval.")
@click.option("--experts-per-token", "experts_per_token", type=int, default=None,
              help="With --fidelity: also measure the artifact routing top-K experts instead of the model's k "
                   "(a runtime's speed switch), reported beside the unmodified figures.")
@click.option("--drop-experts", "drop_experts", default=None, type=PATH,
              help="With --fidelity: also measure with these experts never selected (JSON {layer: [expert, ...]}; "
                   "routing renormalised as the model does).")
@click.option("--reference", "reference", default=None, type=PATH,
              help="With --fidelity: a reference base from `ds4quant reference` (same source, tokens, --ctx and "
                   "protocol): the reference is read, not run.")
@click.option("--stream", is_flag=True,
              help="With --fidelity: run the reference (or read --reference) and the candidate layer by layer "
                   "(DeepSeek-V4-Flash size); no greedy response or per-layer MoE errors then.")
@device_option(help="With --stream: where each layer of both sides runs (the candidate's routed experts run on "
                    "their placement's owners).")
@size_option("--max-memory", help="With --stream: host budget; a layer that cannot fit is refused up front.")
@click.option("--engine", "engines", multiple=True, type=click.Choice(["llama.cpp"]),
              help="With --fidelity: also run the artifact through this engine (llama.cpp via llama-cpp-python, "
                   "which scripts/interop.sh installs) and report the same figures for it.")
@json_option(help="Print one JSON object {ok, checks, tensors, summary[, fidelity]}.")
def verify_cmd(artifact, source, imatrix, report_dir, threshold_db, variant_107, fidelity, placements, mode,
               tokens_file, text_file, ctx_size, protocol, copy_sets, experts_per_token, drop_experts, reference, stream, device, max_memory, engines, as_json):
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
        from ds4quant.publish.report import check_report_dir

        check_report_dir(report_dir, artifact)
    progress = command_progress(as_json, wanted=source is not None)
    rep = verify(artifact, source=source, imatrix=imatrix, threshold_db=threshold_db, variant_107=variant_107,
                 progress=progress, fidelity=fidelity, placements=tuple(placements), mode=mode, tokens=tokens_file,
                 text=text_file, protocol=protocol, engines=tuple(engines), ctx_size=ctx_size,
                 copy_sets=copy_sets, experts_per_token=experts_per_token, drop_experts=drop_experts,
                 reference=reference, stream=stream, device=device, max_memory=max_memory)
    report_path = None
    if report_dir is not None:
        from ds4quant.publish.report import write_report

        report_path = write_report(rep, report_dir)
    if as_json:
        emit_json(rep.to_json())
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
        un = s.get("experts_unreached")
        if un:
            click.echo(f"imatrix: the calibration never reached {un['experts']} expert(s) ({un['tensor_experts']} "
                       f"expert matrices, e.g. {un['first'][0]}): the weighted error leaves them out; their "
                       f"unweighted SQNR is {_db(un['sqnr_db'])} dB, rel MSE {_num(un['rel_mse'])}")
        f = rep.fidelity
        if f.measured:
            m = f.logits
            line = (f"fidelity ({f.mode} mode, {f.eval_tokens} tokens): KL mean {m.kl_mean:.4g} "
                    f"p99 {m.kl_p99:.4g}, top-1 {100 * m.top1:.2f}%, PPL ratio {m.ppl_ratio:.4f}, "
                    f"response {f.response_sha256[:16] or 'not decoded (streamed)'}")
            if f.exact_copy:
                line += f", exact copy {f.exact_copy.passes}/{f.exact_copy.trials}"
            click.echo(line)
            ec = f.exact_copy
            if ec is not None and ec.sets:
                click.echo(f"exact copy over {len(ec.sets)} identifier sets: {ec.per60:.1f} per 60 "
                           f"[{ec.interval[0]:.1f}, {ec.interval[1]:.1f}] {list(ec.sets)}; the source "
                           f"{ec.reference_per60:.1f} [{ec.reference_interval[0]:.1f}, {ec.reference_interval[1]:.1f}] "
                           f"{list(ec.reference_sets)} ({ec.interval_method})")
            if f.kl is not None:
                k = f.kl
                click.echo(f"llama.cpp figures ({k.tokens} tokens, {k.chunking}): KLD mean {k.kld_mean:.4g} median "
                           f"{k.kld_median:.4g} p99 {k.kld_p99:.4g} max {k.kld_max:.4g}, same top-1 "
                           f"{100 * k.same_top1:.2f}%, RMS dp {100 * k.rms_dp:.3f}%, PPL {k.ppl_cand:.4f} "
                           f"(reference {k.ppl_ref:.4f}, ratio {k.ppl_ratio:.4f})")
            ap = f.approximation
            if ap is not None:
                k0, k1 = f.kl, ap.kl
                line = (f"approximation ({ap.description}): KLD mean {k1.kld_mean:.4g} (unmodified {k0.kld_mean:.4g}), "
                        f"same top-1 {100 * k1.same_top1:.2f}% ({100 * k0.same_top1:.2f}%), RMS dp "
                        f"{100 * k1.rms_dp:.3f}% ({100 * k0.rms_dp:.3f}%), PPL ratio {k1.ppl_ratio:.4f} "
                        f"({k0.ppl_ratio:.4f})")
                if ap.copy_per60 is not None and f.exact_copy is not None and f.exact_copy.per60 is not None:
                    line += f", exact copy {ap.copy_per60:.1f} per 60 ({f.exact_copy.per60:.1f})"
                click.echo(line)
            for e in f.engines:
                line = (f"fidelity ({e.engine}): KL mean {e.logits.kl_mean:.4g} p99 {e.logits.kl_p99:.4g}, top-1 "
                        f"{100 * e.logits.top1:.2f}%, PPL ratio {e.logits.ppl_ratio:.4f}, "
                        f"response {e.response_sha256[:16]}")
                ec = e.exact_copy
                if ec:
                    line += f", exact copy {ec.passes}/{ec.trials}"
                    if ec.sets:
                        line += (f"; over {len(ec.sets)} identifier sets {ec.per60:.1f} per 60 "
                                 f"[{ec.interval[0]:.1f}, {ec.interval[1]:.1f}] {list(ec.sets)}")
                click.echo(line)
            for c in f.cluster:
                click.echo(f"cluster: {c['n_ranks']} ranks started once in {c['start_s']:.1f} s, {c['calls']} layer "
                           f"calls, {c['call_ms_median']:.1f} ms median; expert bytes read per rank "
                           f"{[r['expert_bytes_read'] for r in c['ranks']]}")
        if report_path is not None:
            click.echo(f"report: {report_path}")
        n_bad = len(rep.failed)
        click.echo("sound" if rep.ok else f"NOT SOUND: {n_bad} check(s) failed")
    if not rep.ok:
        click.get_current_context().exit(1)


def _db(v) -> str:
    return "inf" if v is None else f"{v:.2f}"


def _num(v) -> str:
    return "-" if v is None else f"{v:.4g}"
