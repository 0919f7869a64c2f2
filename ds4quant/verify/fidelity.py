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
  perplexity ratio (``runtime.fidelity`` metrics);
- the greedy response (32 tokens, from the first protocol prompt) and its sha256;
- the sha256 over every layer's routed-experts output in call order; with a
  second placement, whether it and the response hash are identical;
- with ``protocol="exact-copy"``: runtime.fidelity's protocol on the candidate
  and on the reference (the source's own score).

A placement that records ranks (``ds4quant place --ranks N``) runs the
candidate's routed experts on N gloo ranks on this host
(``runtime.cluster_group.RankGroup``: started once per placement, serving every
layer call of the run; rank start-up and per-call timings go to
``cluster``); exact mode gives the single-process bytes there too.

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
- ``fidelity.exact_copy``: the candidate copies fewer than the source's own
  passes minus ``LIMITS["exact_copy_slack"]`` trials;
- ``fidelity.identity``: exact mode with two placements and different hashes;
- ``fidelity.<engine>.kl`` / ``.exact_copy``: the same limits for another engine
  (``engines``: llama.cpp through llama-cpp-python, ``verify/engines.py``), whose
  figures go to ``engines[<engine>]`` with the engine named.

The tokenizer keys (``tokenizer.ggml.*``) are checked against the source's
tokenizer.json whenever a source is given (``tokenizer_check``).
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ds4quant.errors import BadInputError
from ds4quant.verify._run import Context

LIMITS = MappingProxyType({"kl_mean": 0.5, "exact_copy_slack": 1})
EVAL_SEED = "ds4quant/verify/fidelity/eval"
EVAL_DOCS = 4
RESPONSE_TOKENS = 32
PROTOCOLS = ("exact-copy",)


def fidelity(ctx: Context) -> None:
    """Stage: the tokenizer keys with a source; the runtime's figures when requested."""
    o = ctx.options
    if o.source is not None:
        tokenizer_check(ctx)
    if not o.fidelity:
        ctx.fidelity = {"requested": False, "measured": False,
                        "detail": "not requested (verify --source SRC --fidelity measures it)"}
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


def copy_task(source: Path):
    from ds4quant.runtime import fidelity as fd

    p = Path(source) / "task.json"
    return fd.CopyTask.from_json(p) if p.is_file() else fd.ECHO


def builtin_docs(task) -> list[str]:
    """EVAL_DOCS documents: filler, a copy-task prompt with its answer, more filler."""
    from ds4quant.runtime import fidelity as fd

    rng = random.Random(EVAL_SEED)
    docs = []
    for _, tr in zip(range(EVAL_DOCS), fd.novel_trials(task, rng)):
        docs.append(tr.prompt + tr.expected + "\n" + "\n".join(fd.filler_lines(rng, 2)))
    return docs


def eval_tokens(o, tok, vocab: int, max_len: int) -> tuple[list[list[int]], str]:
    if o.tokens is not None:
        from ds4quant.calibrate import read_tokens

        return [list(s) for s in read_tokens(o.tokens, vocab, max_len)], f"token file {o.tokens}"
    if o.text is not None:
        try:
            text = Path(o.text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise BadInputError(f"cannot read the evaluation text: {e}", where=str(o.text)) from None
        docs = [d for d in text.split("\n\n") if d.strip()]
        what = f"text file {o.text}"
    else:
        docs = builtin_docs(copy_task(o.source))
        what = f"{EVAL_DOCS} built-in copy-task documents"
    seqs = [[tok.bos_token_id] + tok.encode(d) for d in docs]
    for i, s in enumerate(seqs):
        bad = [t for t in s if not 0 <= t < vocab]
        if bad or len(s) > max_len:
            raise BadInputError(f"document {i} tokenizes to ids outside the vocabulary or beyond "
                                f"{max_len} tokens", where=what)
    if not seqs:
        raise BadInputError("no evaluation documents", where=what)
    return seqs, what


# --------------------------------------------------------------------------
# the measurement


def _tokenizer(source: Path):
    from ds4quant.runtime import fidelity as fd
    from ds4quant.verify._candidate import source_tokenizer

    t = source_tokenizer(source)
    return (fd.as_tokenizer(t), "tokenizer.json") if t is not None else (fd.ByteTokenizer(), "byte ids")


def measure(ctx: Context) -> dict:
    import copy

    import torch

    from ds4quant.runtime import fidelity as fd
    from ds4quant.runtime.reference import load_reference, moe_blocks
    from ds4quant.verify import _candidate as C

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
    placements = tuple(o.placements) or (None,)
    if len(placements) > 2:
        raise BadInputError("at most two placements (the second is compared with the first)", where="--placement")
    tok, tok_kind = _tokenizer(o.source)
    with C.one_thread():
        ref = load_reference(o.source)
    cfg = ref.config
    seqs, eval_what = eval_tokens(o, tok, cfg.vocab_size, cfg.max_position_embeddings)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    cand = copy.deepcopy(ref)
    dense_problems = C.dense_into(cand, ctx.view)
    for p in dense_problems:
        ctx.fail("fidelity.dense", p, ctx.first)
    ctx.passed_if_clean("fidelity.dense", "every dense tensor of the model taken from the artifact", ctx.first)
    task = copy_task(o.source)
    prompt = [tok.bos_token_id] + tok.encode(fd.protocol_trials(task)[0].prompt)
    layers = [i for i, _ in moe_blocks(ref)]
    pos = C.valid_positions(seqs)
    rows = torch.tensor([p[0] for p in pos], dtype=torch.long)
    cols = torch.tensor([p[1] for p in pos], dtype=torch.long)
    targets = torch.tensor([seqs[r][c + 1] for r, c in pos], dtype=torch.long)
    res: dict[str, Any] = {"requested": True, "measured": True, "mode": o.mode, "tokenizer": tok_kind,
                           "eval": eval_what, "eval_tokens": len(pos),
                           "placements": [C.placement_label(p) for p in placements]}
    with C.one_thread(), torch.no_grad():
        with C.trace_moe(ref, keep_inputs=True) as rtr:
            ref_logits = C.logits_of(ref, seqs, pad)[rows, cols]
        ref_resp = fd.greedy_response(ref, prompt, RESPONSE_TOKENS, tok.eos_token_id)
        ref_copy = None
        if o.protocol == "exact-copy":
            ref_copy = fd.exact_copy(ref, tok, task)
        runs = []
        for k, plc in enumerate(placements):
            with C.runtime_for(ctx.view, plc, o.mode) as rt:
                old = C.swap_all(cand, rt)
                try:
                    with C.trace_moe(cand, routed=True) as ctr:
                        cand_logits = C.logits_of(cand, seqs, pad)[rows, cols]
                    run = {"moe_output_sha256": C.routed_sha256(ctr.routed),
                           "response": fd.greedy_response(cand, prompt, RESPONSE_TOKENS, tok.eos_token_id)}
                    if k == 0:
                        run["logits"] = cand_logits
                        run["propagated"] = {L: C.rel_error(rtr.outputs[L], ctr.outputs[L]) for L in layers}
                        run["local"] = C.local_moe_error(cand, rtr, layers)
                        if o.protocol == "exact-copy":
                            run["copy"] = fd.exact_copy(cand, tok, task)
                    if hasattr(rt, "stats"):  # a rank group: what starting once cost and each call took
                        run["cluster"] = rt.stats()
                    runs.append(run)
                finally:
                    C.restore(cand, old)
    first = runs[0]
    m = fd.logit_metrics(ref_logits, first["logits"], targets)
    res.update({
        "kl_mean": m.kl_mean, "kl_p99": m.kl_p99, "top1": m.top1, "ppl_ratio": m.ppl_ratio,
        "layers": [{"layer": L, "moe_rel_error": first["local"][L], "moe_rel_error_propagated": first["propagated"][L]}
                   for L in layers],
        "response_token_ids": list(first["response"].token_ids), "response_sha256": first["response"].sha256,
        "reference_response_sha256": ref_resp.sha256,
        "response_matches_reference": first["response"].sha256 == ref_resp.sha256,
        "moe_output_sha256": first["moe_output_sha256"] if o.mode == "exact" else None,
        "fast_moe_output_sha256": first["moe_output_sha256"] if o.mode == "fast" else None,
        "exact_copy": None,
    })
    if "copy" in first:
        c = first["copy"].to_json()
        res["exact_copy"] = {"passes": c["passes"], "trials": c["trials"], "failed": c["failed"], "task": c["task"],
                             "reference_passes": ref_copy.passes}
    if o.engines:
        from ds4quant.verify.engines import measure_engine

        with C.one_thread():
            res["engines"] = {e: measure_engine(ctx.view, e, ref_logits, rows, cols, targets, seqs, pad, prompt, tok,
                                                task, o.protocol, RESPONSE_TOKENS,
                                                ref_copy.passes if ref_copy is not None else None)
                              for e in o.engines}
        for f in res["engines"].values():
            f["response_matches_reference"] = f["response_sha256"] == ref_resp.sha256
    clusters = [r["cluster"] for r in runs if "cluster" in r]
    if clusters:
        res["cluster"] = clusters
    if len(runs) == 2:
        same_moe = runs[0]["moe_output_sha256"] == runs[1]["moe_output_sha256"]
        same_resp = runs[0]["response"].sha256 == runs[1]["response"].sha256
        res["second_placement"] = {"moe_output_sha256": runs[1]["moe_output_sha256"],
                                   "response_sha256": runs[1]["response"].sha256,
                                   "identical": same_moe and same_resp}
    _checks(ctx, res)
    res["seconds"] = time.perf_counter() - t0
    return res


def check_placements(view, placements) -> None:
    """Refuse, before anything is measured, a placement file planned for another
    artifact or shape (a cluster placement too: its ranks would refuse it only
    after the reference model has run)."""
    from os import PathLike

    from ds4quant.runtime.placement import Placement, read_placement

    h, fp = view.header, view.fingerprint()
    for p in placements:
        if isinstance(p, (str, PathLike)):
            read_placement(p).check_matches(h.n_layer, h.n_expert, fp, where=str(p))
        elif isinstance(p, Placement):
            p.check_matches(h.n_layer, h.n_expert, fp, where="placement")


def _checks(ctx: Context, res: dict) -> None:
    _quality_checks(ctx, res, "fidelity", res["mode"] + " mode")
    for name, f in (res.get("engines") or {}).items():
        _quality_checks(ctx, dict(f, layers=[], eval_tokens=res["eval_tokens"]), f"fidelity.{name}", name)
    sp = res.get("second_placement")
    if sp is not None and res["mode"] == "exact":
        if sp["identical"]:
            ctx.ok("fidelity.identity", "two placements give the same MoE output and response sha256 (exact mode)",
                   ctx.first)
        else:
            ctx.fail("fidelity.identity", f"placements differ: MoE output {res['moe_output_sha256'][:16]} vs "
                                          f"{sp['moe_output_sha256'][:16]}, response {res['response_sha256'][:16]} "
                                          f"vs {sp['response_sha256'][:16]}", ctx.first)


def _quality_checks(ctx: Context, res: dict, check: str, what: str) -> None:
    """KL and exact-copy against LIMITS, as ``check``.kl / ``check``.exact_copy; ``what`` names the run."""
    kl = res["kl_mean"]
    if not math.isfinite(kl) or kl > LIMITS["kl_mean"]:
        worst = max(res["layers"], key=lambda r: r["moe_rel_error"]) if res["layers"] else None
        ctx.fail(f"{check}.kl", f"mean KL {kl:.4g} nats over {res['eval_tokens']} tokens exceeds "
                                f"{LIMITS['kl_mean']:g}" + (f"; worst MoE layer {worst['layer']} (rel. error "
                                                            f"{worst['moe_rel_error']:.3g})" if worst else ""),
                 ctx.first)
    else:
        ctx.ok(f"{check}.kl", f"mean KL {kl:.4g} nats (p99 {res['kl_p99']:.4g}), top-1 {100 * res['top1']:.2f}% over "
                              f"{res['eval_tokens']} tokens ({what}); limit {LIMITS['kl_mean']:g}",
               ctx.first)
    ec = res["exact_copy"]
    if ec is not None:
        need = ec["reference_passes"] - LIMITS["exact_copy_slack"]
        text = f"{ec['passes']}/{ec['trials']} exact copies (the source: {ec['reference_passes']}/{ec['trials']})"
        if ec["passes"] < need:
            ctx.fail(f"{check}.exact_copy", f"{text}; fewer than the source's minus {LIMITS['exact_copy_slack']}",
                     ctx.first)
        else:
            ctx.ok(f"{check}.exact_copy", text + ("" if check == "fidelity" else f" ({what})"), ctx.first)
