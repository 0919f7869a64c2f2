"""The reference's side of the fidelity measurement: run it, or read it from a base.

``run_reference`` runs the transformers reference (its logits over the scored
positions, MoE block inputs/outputs for the per-layer errors, greedy response
and exact-copy sets). ``from_base`` takes the same from a reference base
(``runtime/reference_base.py``), after checking it was made for this source,
these tokens, this protocol and this config, so the reference is never run:
the per-layer MoE errors need the reference's own block inputs and are not
reported then. ``make_reference_base`` writes a base (``ds4quant reference``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ds4quant.errors import BadInputError


@dataclass(frozen=True)
class ReferenceSide:
    logits: Any  # float [N, V] tensor: logits or stored log-probs at the scored positions
    kl_base: Any  # what kl_figures compares against: the logits, or the stored QuantizedLogProbs
    trace: Any  # MoeTrace with block inputs, or None from a base
    response_sha256: str
    sets: Any  # CopySets or None
    copy_passes: Optional[int]  # the protocol's own set


def run_reference(ref, seqs, pad, rows, cols, prompt, tok, task, o, fp=None) -> ReferenceSide:
    """The reference run whole; ``fp``: verify's FidelityProgress (its reference passes)."""
    import torch

    from ds4quant.runtime import fidelity as fd
    from ds4quant.runtime.copy_sets import copy_sets
    from ds4quant.runtime.indexer_ties import stable_indexer
    import ds4quant.verify._candidate as C

    from ds4quant.verify.fidelity_progress import FidelityProgress

    fp = fp or FidelityProgress(None, ())
    with C.one_thread(), torch.no_grad():
        with C.trace_moe(ref, keep_inputs=True) as tr, stable_indexer(ref), fp.run("reference logits", ref):
            logits = C.logits_of(ref, seqs, pad)[rows, cols]
        with fp.run("reference response", ref, calls=32):
            resp = fd.greedy_response(ref, prompt, 32, tok.eos_token_id)
        sets = copy = None
        if o.protocol == "exact-copy":
            with fp.run("reference exact-copy trials", ref):
                sets, copy = copy_sets(ref, tok, task, o.copy_sets)
    return ReferenceSide(logits, logits, tr, resp.sha256, sets, None if copy is None else copy.passes)


def _expect(o, seqs, cfg) -> dict:
    from ds4quant.version import VERSION
    from ds4quant.runtime import reference_base as B
    from ds4quant.sources import open_official_source

    with open_official_source(o.source, "the reference base") as src:
        fp = src.fingerprint()
    return {"source_fingerprint": fp, "tokens_sha": B.tokens_sha256(seqs), "protocol": o.protocol,
            "config": B.model_config(cfg), "tool_version": VERSION, "ctx_size": o.ctx_size}


def from_base(o, seqs, cfg) -> ReferenceSide:
    import torch

    from ds4quant.runtime import kl_figures as K
    from ds4quant.runtime import reference_base as B
    from ds4quant.runtime.copy_sets import CopySets

    base = B.read_base(o.reference)
    B.check_base(base, str(o.reference), **_expect(o, seqs, cfg))
    h, a = base.header, base.arrays
    if o.protocol == "exact-copy" and h.get("copy_sets") != o.copy_sets:
        raise BadInputError(f"the reference base holds {h.get('copy_sets')} identifier sets, --copy-sets asks for "
                            f"{o.copy_sets}", where=str(o.reference))
    q = K.QuantizedLogProbs(a["scale"], a["min_log_prob"], a["q"])
    sets = None
    if o.protocol == "exact-copy":
        sets = CopySets(tuple(int(s) for s in a["copy_seeds"]), tuple(int(p) for p in a["copy_passes"]),
                        int(h["copy_trials"]))
    return ReferenceSide(torch.from_numpy(q.log_probs()), q, None, h["response_sha256"], sets,
                         None if sets is None else sets.passes[0])


def _streamed_side(o, seqs, pos, pad, tok, task) -> ReferenceSide:
    from ds4quant.runtime.stream import SourceWeights, StreamedModel
    from ds4quant.runtime.stream_fidelity import streamed_copy_sets, streamed_logits
    import ds4quant.verify._candidate as C

    with C.one_thread(), SourceWeights(o.source) as w:
        sm = StreamedModel(w, device=o.device, threads=1)
        logits = streamed_logits(sm, seqs, pos, pad, max_memory=o.max_memory).logits
        sets = (streamed_copy_sets(sm, tok, task, o.copy_sets, max_memory=o.max_memory)[0]
                if o.protocol == "exact-copy" else None)
    return ReferenceSide(logits, logits, None, "", sets, None if sets is None else sets.passes[0])


def make_reference_base(source, out, *, tokens=None, text=None, ctx_size: Optional[int] = None,
                        protocol: Optional[str] = None, copy_sets: int = 5, stream: bool = False,
                        device: str = "cpu", max_memory=None) -> dict:
    """Run the reference once and write its base to ``out``; returns a summary
    (tokens scored, bytes, seconds, the storage error bound). ``stream``: through
    the layer-streamed forward (the whole model is never held; no greedy
    response then, its hash stored empty), each layer on ``device`` within the
    host budget ``max_memory``."""
    import numpy as np
    import torch

    from ds4quant.runtime import fidelity as fd
    from ds4quant.runtime import kl_figures as K
    from ds4quant.runtime import reference_base as B
    from ds4quant.runtime.copy_sets import check_sets
    from ds4quant.runtime.reference import load_reference
    import ds4quant.verify._candidate as C
    from ds4quant.verify._run import Options, stream_options
    from ds4quant.verify.eval_inputs import PROTOCOLS, copy_task, eval_tokens, scored_positions, tokenizer_for

    t0 = time.perf_counter()
    if tokens is not None and text is not None:
        raise BadInputError("give --tokens or --text, not both", where="--tokens")
    if protocol is not None and protocol not in PROTOCOLS:
        raise BadInputError(f"unknown protocol {protocol!r}", where="--protocol")
    check_sets(copy_sets)
    device, max_memory = stream_options(stream, device, max_memory, "reference")
    o = Options(source=Path(source), tokens=None if tokens is None else Path(tokens),
                text=None if text is None else Path(text), protocol=protocol, ctx_size=ctx_size, copy_sets=copy_sets,
                device=device, max_memory=max_memory)
    tok, _ = tokenizer_for(o.source)
    if stream:
        from ds4quant.runtime.stream import reference_config

        cfg = reference_config(o.source)
    else:
        with C.one_thread():
            ref = load_reference(o.source)
        cfg = ref.config
    seqs, what = eval_tokens(o, tok, cfg.vocab_size, cfg.max_position_embeddings)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    pos = scored_positions(o, seqs)
    rows = torch.tensor([p[0] for p in pos], dtype=torch.long)
    cols = torch.tensor([p[1] for p in pos], dtype=torch.long)
    task = copy_task(o.source)
    prompt = [tok.bos_token_id] + tok.encode(fd.protocol_trials(task)[0].prompt)
    side = _streamed_side(o, seqs, pos, pad, tok, task) if stream else \
        run_reference(ref, seqs, pad, rows, cols, prompt, tok, task, o)
    q = K.quantize_log_probs(side.logits)
    exp = _expect(o, seqs, cfg)
    header = {"source_fingerprint": exp["source_fingerprint"], "tokens_sha256": exp["tokens_sha"],
              "protocol": protocol, "config": exp["config"], "tool_version": exp["tool_version"],
              "ctx_size": ctx_size, "eval": what, "response_sha256": side.response_sha256,
              "copy_sets": copy_sets if protocol else None,
              "copy_trials": side.sets.trials if side.sets is not None else None,
              "storage": "llama.cpp per-token uint16 log-probs over 16 nats below the top; error <= scale/2"}
    arrays = {"tokens": np.asarray([t for s in seqs for t in s], dtype=np.int32),
              "lengths": np.asarray([len(s) for s in seqs], dtype=np.int32),
              "rows": rows.numpy().astype(np.int32), "cols": cols.numpy().astype(np.int32),
              "targets": np.asarray([seqs[r][c + 1] for r, c in pos], dtype=np.int32),
              "argmax": q.argmax().astype(np.int32), "scale": q.scale, "min_log_prob": q.min_log_prob, "q": q.q}
    if side.sets is not None:
        arrays["copy_seeds"] = np.asarray(side.sets.seeds, dtype=np.int32)
        arrays["copy_passes"] = np.asarray(side.sets.passes, dtype=np.int32)
    path = B.write_base(out, header, arrays)
    return {"path": str(path), "tokens": len(pos), "bytes": path.stat().st_size,
            "max_storage_error_nats": float(q.scale.max()) / 2, "seconds": time.perf_counter() - t0, "eval": what}
