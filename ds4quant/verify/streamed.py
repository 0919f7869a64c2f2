"""verify's fidelity stage through the layer-streamed forward (``verify --stream``).

Neither model is held whole: the reference (``SourceWeights``) or its base
(``--reference``), and the candidate (``ArtifactWeights`` on each placement:
CPU owner, worker owners, cluster ranks alike) run one layer at a time
(``runtime/stream_fidelity.py``). What streams is measured as in the
whole-model stage: llama.cpp's figures and today's KL/top-1/PPL ratio, the
routed-experts output sha256 (identical across placements in exact mode), the
exact-copy sets teacher-forced, a routing shortcut, and (when the reference
runs, not from a base) the per-layer MoE errors: the reference pass writes its
MoE blocks' inputs and outputs to a temporary folder that the first
placement's pass reads back. What needs every layer per token is not: the
greedy response (its hashes are empty strings).
"""

from __future__ import annotations

import importlib
import tempfile
import time

from ds4quant.errors import BadInputError
from ds4quant.records import ExactCopyScore, FidelityReport, LogitFigures, MoeLayerError, PlacementRun
from ds4quant.verify._run import Context


def measure_streamed(ctx: Context) -> FidelityReport:
    import torch

    from ds4quant.runtime import fidelity as fd
    from ds4quant.runtime.copy_sets import METHOD
    from ds4quant.runtime.stream import ArtifactWeights, SourceWeights, StreamedModel, reference_config
    from ds4quant.runtime.stream_fidelity import MoeTrace, streamed_copy_sets, streamed_logits
    F = importlib.import_module("ds4quant.verify.fidelity")  # the package's `fidelity` is the stage function
    from ds4quant.verify._candidate import one_thread
    from ds4quant.verify.reference_side import ReferenceSide, from_base

    o = ctx.options
    t0 = time.perf_counter()
    if o.engines:
        raise BadInputError("--engine runs the whole model; drop --stream or --engine", where="--stream")
    tok, tok_kind = F.tokenizer_for(o.source)
    cfg = reference_config(o.source)
    seqs, eval_what = F.eval_tokens(o, tok, cfg.vocab_size, cfg.max_position_embeddings)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    pos = F.scored_positions(o, seqs)
    targets = torch.tensor([seqs[r][c + 1] for r, c in pos], dtype=torch.long)
    task = F.copy_task(o.source)
    proto = o.protocol == "exact-copy"
    drop = None
    if o.drop_experts is not None:
        from ds4quant.runtime.routing_approx import read_drop_file

        drop = read_drop_file(o.drop_experts)
    with one_thread(), tempfile.TemporaryDirectory(prefix="ds4quant-moe-") as moe_dir:
        moe = None
        if o.reference is not None:
            side = from_base(o, seqs, cfg)
        else:
            with SourceWeights(o.source) as w:
                sm = StreamedModel(w, device=o.device, threads=1)
                sp = streamed_logits(sm, seqs, pos, pad, moe=MoeTrace(moe_dir), max_memory=o.max_memory)
                sets = streamed_copy_sets(sm, tok, task, o.copy_sets, max_memory=o.max_memory)[0] if proto else None
            side = ReferenceSide(sp.logits, sp.logits, None, "", sets, None if sets is None else sets.passes[0])
            moe = MoeTrace(moe_dir, compare=True)
        runs, first = [], {}
        for label, plc in o.placements:
            with ArtifactWeights(ctx.view, plc, o.mode, source_dir=o.source) as w:
                sm = StreamedModel(w, device=o.device, threads=1)
                sp = streamed_logits(sm, seqs, pos, pad, moe=None if first else moe, max_memory=o.max_memory)
                runs.append(PlacementRun(label, sp.routed_sha256, ""))
                if first:
                    continue
                first["logits"] = sp.logits
                first["layers"] = tuple(MoeLayerError(L, loc, prop)
                                        for L, (loc, prop) in (moe.errors() if moe else {}).items())
                if proto:
                    first["sets"], first["copy"] = streamed_copy_sets(sm, tok, task, o.copy_sets,
                                                                      max_memory=o.max_memory)
                if F.approx_requested(o):
                    first["approx"] = _approx(sm, o, seqs, pos, pad, side, targets, tok, task, drop, cfg)
    ctx.ok("fidelity.dense", "every dense tensor of the model taken from the artifact (streamed)", ctx.first)
    m = fd.logit_metrics(side.logits, first["logits"], targets)
    ec = None
    if proto:
        c, cs, rs = first["copy"].to_json(), first["sets"], side.sets
        from types import MappingProxyType

        ec = ExactCopyScore(c["passes"], c["trials"], tuple(MappingProxyType(f) for f in c["failed"]), c["task"],
                            side.copy_passes, cs.passes, rs.passes, cs.per60, cs.interval, rs.per60, rs.interval,
                            METHOD)
    rep = FidelityReport(
        requested=True, measured=True, mode=o.mode.value, tokenizer=tok_kind,
        eval=eval_what + " (layer-streamed)", eval_tokens=len(pos), runs=tuple(runs),
        logits=LogitFigures(m.kl_mean, m.kl_p99, m.top1, m.ppl_ratio), layers=first["layers"],
        response_token_ids=(),
        reference_response_sha256=side.response_sha256, exact_copy=ec,
        kl=F.kl_record(side.kl_base, first["logits"], targets, o), approximation=first.get("approx"))
    F.report_checks(ctx, rep)
    import dataclasses

    return dataclasses.replace(rep, seconds=time.perf_counter() - t0)


def _approx(sm, o, seqs, pos, pad, side, targets, tok, task, drop, cfg):
    from types import MappingProxyType

    from ds4quant.records import ApproximationFigures
    from ds4quant.runtime import fidelity as fd
    from ds4quant.runtime.routing_approx import check, moe_layers_of
    from ds4quant.runtime.stream_fidelity import streamed_copy_sets, streamed_logits
    F = importlib.import_module("ds4quant.verify.fidelity")  # the package's `fidelity` is the stage function

    d = drop or MappingProxyType({})
    a = check(cfg, moe_layers_of(cfg), o.experts_per_token, d,
              str(o.drop_experts) if o.drop_experts is not None else "--experts-per-token")
    logits = streamed_logits(sm, seqs, pos, pad, experts_per_token=o.experts_per_token, drop=d,
                             max_memory=o.max_memory).logits
    sets = streamed_copy_sets(sm, tok, task, o.copy_sets, experts_per_token=o.experts_per_token, drop=d,
                              max_memory=o.max_memory)[0] if o.protocol == "exact-copy" else None
    m = fd.logit_metrics(side.logits, logits, targets)
    from ds4quant.records import LogitFigures

    return ApproximationFigures(a.describe(), o.experts_per_token, sum(len(v) for v in d.values()),
                                LogitFigures(m.kl_mean, m.kl_p99, m.top1, m.ppl_ratio),
                                F.kl_record(side.kl_base, logits, targets, o),
                                None if sets is None else sets.per60, None if sets is None else sets.interval)
