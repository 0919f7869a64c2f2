"""Verify stage 6, fidelity through the runtime (``verify(..., fidelity=True)``).

Reference: transformers ``DeepseekV4ForCausalLM`` over the source, exactly
dequantized, eager experts. Candidate: the same model with every dense tensor
taken from the artifact and every layer's routed experts run by the bundled
runtime on the given placement (default: one CPU owner) in the given mode
(``_candidate``). Over the evaluation tokens the stage measures:

- per MoE layer, the relative error of the block output: ``local`` (the
  candidate block fed the reference's own block input: what that layer adds,
  so a damaged layer is named) and ``propagated`` (in the candidate's run);
- KL(ref || cand) of next-token distributions (mean, p99), top-1 agreement,
  perplexity ratio (``runtime.fidelity`` metrics), and beside them the figures
  llama.cpp's perplexity tool reports, defined as it defines them
  (``runtime.kl_figures``; with ``ctx_size`` over its chunking);
- with ``experts_per_token`` / ``drop_experts``: the first placement's candidate
  again with that routing shortcut (``runtime.routing_approx``), its figures in
  ``approximation`` beside the unmodified ones (reported, never a failed check);
- with ``reference`` (a base from ``ds4quant reference``): the reference's
  side is read from it (``verify/reference_side.py``), after it is checked
  against this source, these tokens, protocol and config; the reference does
  not run, and the per-layer MoE errors (which need its block inputs) are
  left out;
- with ``stream``: both sides through the layer-streamed forward
  (``verify/streamed.py``), without the greedy response and per-layer errors;
- every forward of both models breaks the CSA indexer's top-k ties by position
  (``runtime.indexer_ties``), so a prefix's logits do not depend on what follows;
- the greedy response (32 tokens, from the first protocol prompt) and its sha256;
- the sha256 over every layer's routed-experts output in call order; with a
  second placement, whether it and the response hash are identical;
- with ``protocol="exact-copy"``: runtime.fidelity's protocol on the candidate
  and on the reference (the source's own score).

Each placement runs through ``runtime.load``, whatever it names: a placement
that records ranks (``ds4quant place --ranks N``) runs the candidate's routed
experts on N gloo ranks on this host (started once per placement, serving
every layer call of the run; their start-up and per-call figures go to
``cluster``); exact mode gives the single-process bytes there too.

The figures are a ``records.FidelityReport``.

Evaluation set: ``tokens`` (token-id file, ``calibrate.read_tokens`` format),
``text`` (a UTF-8 file, one document per blank-line-separated block, through the
source's tokenizer), or by default ``EVAL_DOCS`` fixed documents of the copy
task's form (seeded, never the protocol's identifiers) through the source's
tokenizer.json, or as byte ids (``ByteTokenizer``) when it has none.

Which figures fail the check (``LIMITS``); every figure is reported either way:

- ``fidelity.dense``: an artifact tensor that lands on no model parameter, a
  shape mismatch, or a model parameter the artifact lacks;
- ``fidelity.kl``: mean KL above ``LIMITS["kl_mean"]`` nats (a guard against a
  broken conversion: the 2-3 bpw artifacts of samples/ds4-copy measure far below);
- ``fidelity.exact_copy``: over ``copy_sets`` seeded identifier sets
  (``runtime/copy_sets.py``), the candidate's 95% Wilson interval per 60 trials
  lies wholly below the source's (one set of 60 cannot resolve a few trials);
- ``fidelity.identity``: exact mode with two placements and different hashes;
- ``fidelity.<engine>.kl`` / ``.exact_copy``: the KL limit, and the protocol's own
  set against the source's passes minus ``LIMITS["exact_copy_slack"]``, for another engine
  (``engines``: llama.cpp through llama-cpp-python, ``verify/engines.py``), whose
  figures go to ``engines[<engine>]`` with the engine named.

The tokenizer keys (``tokenizer.ggml.*``) are checked against the source's
tokenizer.json whenever a source is given (``tokenizer_check``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from types import MappingProxyType

from ds4quant.errors import BadInputError
from ds4quant.records import ExactCopyScore, FidelityReport, LogitFigures, MoeLayerError, PlacementRun
from ds4quant.verify._run import Context
from ds4quant.verify.eval_inputs import (  # noqa: F401  (public here too)
    EVAL_DOCS, PROTOCOLS, builtin_docs, copy_task, eval_tokens, scored_positions, tokenizer_for)

LIMITS = MappingProxyType({"kl_mean": 0.5, "exact_copy_slack": 1})
RESPONSE_TOKENS = 32


def fidelity(ctx: Context) -> None:
    """Stage: the tokenizer keys with a source; the runtime's figures when requested."""
    o = ctx.options
    if o.source is not None:
        tokenizer_check(ctx)
    if not o.fidelity:
        ctx.fidelity = FidelityReport.not_measured("not requested (verify --source SRC --fidelity measures it)")
        return
    ctx.fidelity = measure(ctx)


# --------------------------------------------------------------------------
# tokenizer keys


def tokenizer_check(ctx: Context) -> None:
    from ds4quant.convert.tokenizer import compare_tokenizer

    problems, detail = compare_tokenizer(ctx.view.kv, ctx.options.source)
    for p in problems:
        ctx.fail("tokenizer", p, ctx.first)
    if detail is not None and not problems:
        ctx.ok("tokenizer", detail, ctx.first)


# --------------------------------------------------------------------------
# evaluation set


def kl_record(ref_logits, cand_logits, targets, o):
    """llama.cpp's figures of the candidate against the reference (``records.KlFigures``)."""
    from ds4quant.runtime import kl_figures as K

    how = (f"llama.cpp chunks of {o.ctx_size}, second halves" if o.ctx_size is not None
           else "every next token of each document")
    return K.kl_summary(ref_logits, cand_logits, targets, how)


def approx_requested(o) -> bool:
    return o.experts_per_token is not None or o.drop_experts is not None


def _approximated(cand, o, seqs, pad, rows, cols, side, targets, tok, task):
    """The candidate again with the routing shortcut (``runtime.routing_approx``)."""
    from types import MappingProxyType

    from ds4quant.records import ApproximationFigures, LogitFigures
    from ds4quant.runtime import fidelity as fd
    from ds4quant.runtime.copy_sets import copy_sets
    from ds4quant.runtime.indexer_ties import stable_indexer
    from ds4quant.runtime.routing_approx import approximate_routing, read_drop_file
    import ds4quant.verify._candidate as C

    drop = read_drop_file(o.drop_experts) if o.drop_experts is not None else MappingProxyType({})
    where = str(o.drop_experts) if o.drop_experts is not None else "--experts-per-token"
    with approximate_routing(cand, o.experts_per_token, drop, where) as a:
        with stable_indexer(cand):
            logits = C.logits_of(cand, seqs, pad)[rows, cols]
        sets = copy_sets(cand, tok, task, o.copy_sets)[0] if o.protocol == "exact-copy" else None
    m = fd.logit_metrics(side.logits, logits, targets)
    return ApproximationFigures(a.describe(), o.experts_per_token, sum(len(v) for v in drop.values()),
                                LogitFigures(m.kl_mean, m.kl_p99, m.top1, m.ppl_ratio),
                                kl_record(side.kl_base, logits, targets, o),
                                None if sets is None else sets.per60, None if sets is None else sets.interval)


# --------------------------------------------------------------------------
# the measurement


def measure(ctx: Context) -> FidelityReport:
    import copy

    import torch

    from ds4quant import runtime
    from ds4quant.runtime import fidelity as fd
    from ds4quant.runtime.copy_sets import METHOD as COPY_METHOD
    from ds4quant.runtime.copy_sets import copy_sets
    from ds4quant.runtime.indexer_ties import stable_indexer
    from ds4quant.runtime.reference import load_reference, moe_blocks
    import ds4quant.verify._candidate as C
    from ds4quant.verify.fidelity_progress import FidelityProgress, plan_passes
    from ds4quant.verify.reference_side import from_base, run_reference

    o = ctx.options
    t0 = time.perf_counter()
    if o.source is None:
        raise BadInputError("fidelity compares against the source model", where="--fidelity", hint="add --source SRC")
    if o.protocol is not None and o.protocol not in PROTOCOLS:
        raise BadInputError(f"unknown protocol {o.protocol!r} (known: {', '.join(PROTOCOLS)})", where="--protocol")
    if o.protocol == "exact-copy":
        missing = [f for f in ("tokenizer.json", "task.json") if not (Path(o.source) / f).is_file()]
        if missing:
            raise BadInputError(f"the exact-copy protocol needs the source's {' and '.join(missing)} "
                                "(a model that was trained to copy, with its task)", where=str(o.source),
                                hint="drop --protocol, or use a source such as samples/ds4-copy")
    if o.stream:
        from ds4quant.verify.streamed import measure_streamed

        return measure_streamed(ctx)
    tok, tok_kind = tokenizer_for(o.source)
    based = None
    if o.reference is not None:  # a base made for something else is refused before the model loads
        from ds4quant.runtime.stream import reference_config

        rc = reference_config(o.source)
        based = from_base(o, eval_tokens(o, tok, rc.vocab_size, rc.max_position_embeddings)[0], rc)
    fp = FidelityProgress(o.progress, plan_passes([label for label, _ in o.placements], o.protocol == "exact-copy",
                                                  o.engines))
    fp.phase("loading the reference model (transformers, fp32)")
    with C.one_thread():
        ref = load_reference(o.source)
    cfg = ref.config
    seqs, eval_what = eval_tokens(o, tok, cfg.vocab_size, cfg.max_position_embeddings)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    fp.phase("building the candidate (dense tensors from the artifact)")
    cand = copy.deepcopy(ref)
    dense_problems = C.dense_into(cand, ctx.view)
    for p in dense_problems:
        ctx.fail("fidelity.dense", p, ctx.first)
    ctx.passed_if_clean("fidelity.dense", "every dense tensor of the model taken from the artifact", ctx.first)
    task = copy_task(o.source)
    prompt = [tok.bos_token_id] + tok.encode(fd.protocol_trials(task)[0].prompt)
    layers = [i for i, _ in moe_blocks(ref)]
    pos = scored_positions(o, seqs)
    rows = torch.tensor([p[0] for p in pos], dtype=torch.long)
    cols = torch.tensor([p[1] for p in pos], dtype=torch.long)
    targets = torch.tensor([seqs[r][c + 1] for r, c in pos], dtype=torch.long)
    if o.reference is not None:  # the reference's side from its base: the reference does not run
        with fp.run("reference logits"):
            side = based
        with fp.run("reference response"):
            pass
        if o.protocol == "exact-copy":
            with fp.run("reference exact-copy trials"):
                pass
        layers = []
    else:
        side = run_reference(ref, seqs, pad, rows, cols, prompt, tok, task, o, fp)
    ref_logits, rtr, ref_sets = side.logits, side.trace, side.sets
    with C.one_thread(), torch.no_grad():
        runs, clusters = [], []
        first: dict = {}
        for label, plc in o.placements:
            fp.phase(f"loading the runtime [{label}]")
            # stage 3 hashed every file and reports a mismatch itself: no second pass here
            with runtime.load(ctx.view, plc, o.mode, verify_payloads=False) as rt:
                old = C.swap_all(cand, rt)
                try:
                    with C.trace_moe(cand, routed=True) as ctr, stable_indexer(cand), \
                            fp.run(f"candidate logits [{label}]", cand):
                        cand_logits = C.logits_of(cand, seqs, pad)[rows, cols]
                    with fp.run(f"candidate response [{label}]", cand, calls=RESPONSE_TOKENS):
                        resp = fd.greedy_response(cand, prompt, RESPONSE_TOKENS, tok.eos_token_id)
                    runs.append(PlacementRun(label, C.routed_sha256(ctr.routed), resp.sha256))
                    if not first:
                        propagated = {L: C.rel_error(rtr.outputs[L], ctr.outputs[L]) for L in layers}
                        with fp.run(f"local MoE error [{label}]"):
                            local = C.local_moe_error(cand, rtr, layers)
                        first = {"logits": cand_logits, "response": resp, "propagated": propagated, "local": local}
                        if o.protocol == "exact-copy":
                            with fp.run(f"candidate exact-copy trials [{label}]", cand):
                                first["sets"], first["copy"] = copy_sets(cand, tok, task, o.copy_sets)
                        if approx_requested(o):
                            first["approx"] = _approximated(cand, o, seqs, pad, rows, cols, side, targets,
                                                            tok, task)
                    if rt.n_ranks:  # cluster ranks: what starting them once cost and each call took
                        clusters.append(rt.stats())
                finally:
                    C.restore(cand, old)
    m = fd.logit_metrics(ref_logits, first["logits"], targets)
    ec = None
    if "copy" in first:
        c = first["copy"].to_json()
        cs_, rs_ = first["sets"], ref_sets
        ec = ExactCopyScore(c["passes"], c["trials"], tuple(MappingProxyType(f) for f in c["failed"]), c["task"],
                            side.copy_passes, cs_.passes, rs_.passes, cs_.per60, cs_.interval, rs_.per60,
                            rs_.interval, COPY_METHOD)
    rep = FidelityReport(
        requested=True, measured=True, mode=o.mode.value, tokenizer=tok_kind, eval=eval_what, eval_tokens=len(pos),
        runs=tuple(runs), logits=LogitFigures(m.kl_mean, m.kl_p99, m.top1, m.ppl_ratio),
        layers=tuple(MoeLayerError(L, first["local"][L], first["propagated"][L]) for L in layers),
        response_token_ids=tuple(first["response"].token_ids), reference_response_sha256=side.response_sha256,
        exact_copy=ec, cluster=tuple(clusters), kl=kl_record(side.kl_base, first["logits"], targets, o),
        approximation=first.get("approx"))
    if o.engines:
        from ds4quant.verify.engines import measure_engine

        figures = []
        with C.one_thread():
            for e in o.engines:
                with fp.run(f"{e} figures"):
                    figures.append(measure_engine(ctx.view, e, ref_logits, rows, cols, targets, seqs, pad, prompt,
                                                  tok, task, o.protocol, RESPONSE_TOKENS, side.copy_passes,
                                                  side.response_sha256, ref_sets))
        rep = dataclasses.replace(rep, engines=tuple(figures))
    fp.finish()
    report_checks(ctx, rep)
    return dataclasses.replace(rep, seconds=time.perf_counter() - t0)


def placement_runs(view, placements) -> tuple:
    """(label, Placement) per placement the candidate runs on (none given: one CPU
    owner); each read and checked against ``view`` once, before anything is
    measured (a cluster placement too: its ranks would refuse it only after the
    reference model has run)."""
    from ds4quant.runtime import as_placement
    from ds4quant.verify._candidate import placement_label

    given = tuple(placements) or (None,)
    if len(given) > 2:
        raise BadInputError("at most two placements (the second is compared with the first)", where="--placement")
    out = []
    for p in given:
        plc = as_placement(p, view)
        out.append((placement_label(p, plc), plc))
    return tuple(out)


def report_checks(ctx: Context, rep: FidelityReport) -> None:
    _quality_checks(ctx, "fidelity", f"{rep.mode} mode", rep.logits, rep.exact_copy, rep.eval_tokens, rep.layers,
                    rep.kl)
    for eng in rep.engines:
        _quality_checks(ctx, f"fidelity.{eng.engine}", eng.engine, eng.logits, eng.exact_copy, rep.eval_tokens, ())
    sp = rep.second
    if sp is not None and rep.mode == "exact":
        if rep.identical:
            ctx.ok("fidelity.identity", "two placements give the same MoE output and response sha256 (exact mode)",
                   ctx.first)
        else:
            first = rep.runs[0]
            ctx.fail("fidelity.identity", f"placements differ: MoE output {first.moe_output_sha256[:16]} vs "
                                          f"{sp.moe_output_sha256[:16]}, response {first.response_sha256[:16]} "
                                          f"vs {sp.response_sha256[:16]}", ctx.first)


def _llama_line(kf) -> str:
    if kf is None:
        return ""
    return (f"; llama.cpp figures: KLD median {kf.kld_median:.4g} max {kf.kld_max:.4g}, same top-1 "
            f"{100 * kf.same_top1:.2f}%, RMS dp {100 * kf.rms_dp:.3f}%, PPL {kf.ppl_cand:.4g} vs {kf.ppl_ref:.4g}")


def _quality_checks(ctx: Context, check: str, what: str, m, ec, n: int, layers, kf=None) -> None:
    """KL and exact-copy against LIMITS, as ``check``.kl / ``check``.exact_copy; ``what`` names the run."""
    kl = m.kl_mean
    if not math.isfinite(kl) or kl > LIMITS["kl_mean"]:
        worst = max(layers, key=lambda r: r.local) if layers else None
        ctx.fail(f"{check}.kl", f"mean KL {kl:.4g} nats over {n} tokens exceeds "
                                f"{LIMITS['kl_mean']:g}" + (f"; worst MoE layer {worst.layer} (rel. error "
                                                            f"{worst.local:.3g})" if worst else ""),
                 ctx.first)
    else:
        ctx.ok(f"{check}.kl", f"mean KL {kl:.4g} nats (p99 {m.kl_p99:.4g}), top-1 {100 * m.top1:.2f}% over "
                              f"{n} tokens ({what}); limit {LIMITS['kl_mean']:g}" + _llama_line(kf), ctx.first)
    if ec is not None and ec.sets:
        # the interval, not one draw: fail only when the candidate's whole interval
        # lies below the source's (a difference the sets resolve)
        lo, hi = ec.interval
        rlo, rhi = ec.reference_interval
        text = (f"{ec.per60:.1f} per 60 exact copies [{lo:.1f}, {hi:.1f}] over {len(ec.sets)} identifier sets "
                f"{list(ec.sets)} (the source: {ec.reference_per60:.1f} [{rlo:.1f}, {rhi:.1f}], "
                f"{list(ec.reference_sets)}; {ec.interval_method})")
        if hi < rlo:
            ctx.fail(f"{check}.exact_copy", f"{text}; below the source's interval", ctx.first)
        else:
            ctx.ok(f"{check}.exact_copy", text + ("" if check == "fidelity" else f" ({what})"), ctx.first)
    elif ec is not None:
        need = ec.reference_passes - LIMITS["exact_copy_slack"]
        text = f"{ec.passes}/{ec.trials} exact copies (the source: {ec.reference_passes}/{ec.trials})"
        if ec.passes < need:
            ctx.fail(f"{check}.exact_copy", f"{text}; fewer than the source's minus {LIMITS['exact_copy_slack']}",
                     ctx.first)
        else:
            ctx.ok(f"{check}.exact_copy", text + ("" if check == "fidelity" else f" ({what})"), ctx.first)
