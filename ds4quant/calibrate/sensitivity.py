"""Sensitivity of the model's output to routed-expert weight error, per tensor.

The adaptive recipe ranks candidates by the imatrix-weighted weight error
``sum_e f_e sum_rc imp_ec dw_rc^2``. Those sums estimate each matrix's own
output error, but they are not comparable across tensors: an error in layer 0
passes through every later layer before it reaches the logits, and an error
in a gate or up projection passes through SwiGLU and the down projection
first. Summing them as if a unit meant the same everywhere spends bytes where
the model does not notice them (measured on samples/ds4-copy: the weighted
SQNR of the adaptive artifact was 3.5 dB above rocmfp2-strix's and its KL
divergence 45% worse).

This module measures, for every (layer, surface) routed-expert tensor, how
many nats of next-token KL divergence one unit of that weighted error costs:
perturb the tensor's experts with seeded Gaussian noise (standard deviation
``REL_STD`` x each expert matrix's RMS, about the error of a 2-bit type),
compute the weighted error that noise has under the same imatrix and routing
weights the allocator uses, run the calibration sequences and take the mean
KL(reference || perturbed) per token. ``gain = KL / weighted error``. The
errors of independent perturbations add to second order, so
``sum_t gain_t * error_t`` predicts the KL of a whole plan, which is what the
allocator then minimises.

The file is ``ds4quant.calib.sensitivity``'s (``sensitivity.json`` beside the
imatrix; ``convert --sensitivity`` reads it). Deterministic: the noise comes from
``numpy.random.default_rng`` seeded by the tensor name, the model runs on one
torch thread, sequences one at a time, sums in float64 in a fixed order.
"""

from __future__ import annotations

import hashlib
import math
from types import MappingProxyType
from typing import Optional, Sequence

import numpy as np

from ds4quant.calib.sensitivity import Sensitivity
from ds4quant.errors import BadInputError
from ds4quant.names import stack_name

__all__ = ["measure_sensitivity", "REL_STD"]

# The noise level relative to each expert matrix's RMS: rocmfp2's relative
# error on the shipped samples (SQNR about 10 dB). Sensitivity is measured
# where the plans that need it live, not in the small-noise limit.
REL_STD = 0.3
SURFACES = ("gate", "up", "down")


def _seed(tensor: str) -> int:
    return int.from_bytes(hashlib.sha256(f"ds4quant/sensitivity/{tensor}".encode()).digest()[:8], "little")


def _kl_sum(ref_logp, logits) -> tuple[float, int]:
    """sum over positions of KL(ref || cand) in float64, and the position count."""
    import torch

    cand = torch.log_softmax(logits.double(), dim=-1)
    kl = (ref_logp.exp() * (ref_logp - cand)).sum(-1)
    return float(kl.sum()), int(kl.numel())


def measure_sensitivity(model, seqs: Sequence[Sequence[int]], imatrix, counts: np.ndarray, *,
                        rel_std: float = REL_STD, fingerprint: Optional[str] = None,
                        tokens_sha256: Optional[str] = None) -> Sensitivity:
    """Gains for every routed-expert tensor of ``model`` (a loaded reference
    ``DeepseekV4ForCausalLM``) over ``seqs``; ``imatrix``/``counts`` (n_layer,
    n_expert) are the calibration's own, so the weighted errors are in the
    allocator's units. The model's weights are restored before returning."""
    import torch

    from ds4quant.calib.imatrix import importance_for
    from ds4quant.plan import expert_weights
    from ds4quant.runtime.reference import moe_blocks

    if not seqs:
        raise BadInputError("no sequences to measure sensitivity on", where="sensitivity")
    if not (0 < rel_std < 10):
        raise BadInputError(f"rel_std must be in (0, 10), got {rel_std}", where="sensitivity")
    inputs = [torch.tensor([list(s)], dtype=torch.long) for s in seqs]
    with torch.no_grad():
        refs = [torch.log_softmax(model(input_ids=x, use_cache=False).logits[0].double(), dim=-1) for x in inputs]
    n_tok = sum(int(r.shape[0]) for r in refs)
    gains, kls, errs = {}, {}, {}
    for layer, block in moe_blocks(model):
        ex = block.experts
        inter = ex.gate_up_proj.shape[1] // 2
        for surface in SURFACES:
            name = stack_name(layer, surface)
            param = ex.down_proj if surface == "down" else ex.gate_up_proj
            rows = slice(None) if surface == "down" else (slice(0, inter) if surface == "gate" else slice(inter, None))
            w = param.data[:, rows, :]
            n_exp, cols = w.shape[0], w.shape[2]
            w0 = w.detach().clone()
            base = w0.double().numpy()
            rms = np.sqrt(np.mean(base * base, axis=(1, 2)))
            noise = np.random.default_rng(_seed(name)).standard_normal(base.shape)
            delta = noise * (rel_std * rms)[:, None, None]
            f = expert_weights(counts[layer] if counts is not None and layer < counts.shape[0] else None, n_exp)
            imps = [importance_for(imatrix, name, e, cols=cols) if imatrix is not None else None for e in range(n_exp)]
            seen = [q for q in imps if q is not None]
            fallback = np.mean(np.stack(seen), axis=0) if seen else np.ones(cols)
            err = 0.0
            for e in range(n_exp):
                imp = (imps[e] if imps[e] is not None else fallback).astype(np.float64)
                err += float(f[e]) * float(np.sum((delta[e] * delta[e]) @ imp))
            try:
                param.data[:, rows, :] = (w0.double() + torch.from_numpy(delta)).to(w0.dtype)
                total = 0.0
                with torch.no_grad():
                    for x, ref in zip(inputs, refs):
                        total += _kl_sum(ref, model(input_ids=x, use_cache=False).logits[0])[0]
            finally:
                param.data[:, rows, :] = w0
            kl = total / n_tok
            if not (math.isfinite(kl) and math.isfinite(err) and err > 0):
                raise BadInputError(f"sensitivity of {name} is not finite (KL {kl}, weighted error {err})",
                                    where="sensitivity")
            gains[name], kls[name], errs[name] = kl / err, kl, err
    if not gains:
        raise BadInputError("the model has no routed-expert layers", where="sensitivity")
    return Sensitivity(MappingProxyType(gains), MappingProxyType(kls), MappingProxyType(errs), fingerprint,
                       tokens_sha256, len(seqs), n_tok, float(rel_std))
