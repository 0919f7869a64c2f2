"""The summary of an adaptive plan: the ``adaptive`` block of a convert report.

From the measurements and the allocation: the predicted weighted error and
SQNR of the plan, the uniform recipes the candidates can express on the same
metric, the reference fitter against ours on the MIX experts the plan uses,
the experts calibration never reached, the qtype shares, and under a
sensitivity file the predicted KL. Nothing here measures or decides.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence

import numpy as np

from ds4quant.formats import get_qtype

if TYPE_CHECKING:
    from ds4quant.plan.planner import Measurements
    from ds4quant.plan.allocate import Allocation


def weighted_error(expert_tensors: Sequence[tuple], meas: Measurements,
                   pick: Callable[[object], str]) -> tuple[float, float]:
    """(sum f_e * weighted error, sum f_e * weighted energy) when every tensor
    ``choice`` uses qtype ``pick(choice)`` for all its experts."""
    e = s = 0.0
    for choice, members in expert_tensors:
        w = meas.weights[choice.name]
        q = pick(choice)
        for wi, m in zip(w, members):
            x = meas.measures[(choice.name, m.expert, q)]
            e += wi * x.wsse
            s += wi * x.wssx
    return e, s


def predicted_kl(info: dict, todo, meas: Measurements, decisions, gains: Mapping[str, float]) -> None:
    """The allocation objective under a sensitivity file: predicted KL per token
    (nats) of the plan and of rocmfp2-strix on the same measurements."""
    info["objective"] = "predicted KL (sensitivity-weighted error)"
    info["predicted_kl"] = float(sum(gains[n] * d.predicted_error for n, d in decisions.items()))
    strix = {"gate": "rocmfp2", "up": "rocmfp2", "down": "rocmfp3"}
    if "rocmfp2-strix" in info.get("uniform", {}):
        kl = 0.0
        for c, ms in todo:
            w = meas.weights[c.name]
            kl += gains[c.name] * sum(wi * meas.measures[(c.name, m.expert, strix[c.surface])].wsse
                                      for wi, m in zip(w, ms))
        info["uniform"]["rocmfp2-strix"]["predicted_kl"] = kl


def _db(err: float, energy: float) -> Optional[float]:
    return 10.0 * float(np.log10(energy / err)) if err > 0 and energy > 0 else None


def plan_info(todo, meas: Measurements, opts, alloc: Allocation, budget, budget_what, fixed, total_w, decisions,
          imatrix) -> dict:
    chosen_e = sum(d.predicted_error for d in decisions.values())
    energy = 0.0  # the weighted source energy does not depend on the qtype
    for c, ms in todo:
        w = meas.weights[c.name]
        for i, m in enumerate(ms):
            q = next(q for q in opts.candidates if (c.name, m.expert, q) in meas.measures)
            energy += w[i] * meas.measures[(c.name, m.expert, q)].wssx
    info = {
        "options": {"target_bpw": opts.target_bpw, "max_bytes": opts.max_bytes, "candidates": list(opts.candidates),
                    "granularity": opts.granularity, "fitter": opts.fitter, "routing": opts.routing,
                    "lucebox": opts.lucebox, "sensitivity": opts.sensitivity},
        "objective": "weighted error",
        "budget_bytes": budget,
        "budget": budget_what,
        "allocated_bytes": alloc.bytes,
        "slack": alloc.slack,
        "method": alloc.method,
        "fixed_expert_bytes": fixed,
        "predicted_weighted_error": chosen_e,
        "predicted_weighted_sqnr_db": _db(chosen_e, energy),
        "measure_seconds": meas.seconds,
        "measures_reused": meas.reused,
        "qtype_share": _shares(todo, decisions),
    }
    # the uniform recipes the candidates can express, on the same metric
    uniform = {}
    strix = {"gate": "rocmfp2", "up": "rocmfp2", "down": "rocmfp3"}
    have = {k[2] for k in meas.measures}
    if {"rocmfp2", "rocmfp3"} <= have:
        e, s = weighted_error(todo, meas, lambda c: strix[c.surface])
        b = sum(meas.measures[(c.name, m.expert, strix[c.surface])].nbytes for c, ms in todo for m in ms)
        uniform["rocmfp2-strix"] = {"weighted_error": e, "weighted_sqnr_db": _db(e, s), "bytes": b,
                                    "bpw": 8.0 * (b + fixed) / total_w}
    for q in ("rocmfp3", "rocmfp4", "rocmfp4_fast"):
        if q in have:
            e, s = weighted_error(todo, meas, lambda c, q=q: q)
            b = sum(meas.measures[(c.name, m.expert, q)].nbytes for c, ms in todo for m in ms)
            uniform[q] = {"weighted_error": e, "weighted_sqnr_db": _db(e, s), "bytes": b,
                          "bpw": 8.0 * (b + fixed) / total_w}
    info["uniform"] = uniform
    # reference vs our fitter on the MIX experts the plan uses
    ref = ours = 0.0
    n_mix = 0
    for c, ms in todo:
        w = meas.weights[c.name]
        for i, (m, q) in enumerate(zip(ms, decisions[c.name].qtypes)):
            x = meas.measures.get((c.name, m.expert, q))
            if x is not None and get_qtype(q).is_mix and x.ref_wsse is not None:
                ref += w[i] * x.ref_wsse
                ours += w[i] * x.wsse
                n_mix += 1
    if n_mix:
        info["fitter_comparison"] = {"experts": n_mix, "reference_weighted_error": ref,
                                     "optimized_weighted_error": ours,
                                     "gain_db": 10.0 * float(np.log10(ref / ours)) if ours > 0 and ref > 0 else None}
    if imatrix is not None:
        from ds4quant.imatrix import importance_for

        unreached = {}
        for c, ms in todo:
            ids = [m.expert for m in ms if importance_for(imatrix, c.name, m.expert, cols=c.shape[0]) is None]
            if ids:
                unreached[c.name] = ids
        info["unreached_experts"] = unreached
    return info


def _shares(todo, decisions) -> dict:
    counts: dict[str, int] = {}
    for c, ms in todo:
        for q in decisions[c.name].qtypes:
            counts[q] = counts.get(q, 0) + 1
    n = sum(counts.values())
    return {q: k / n for q, k in sorted(counts.items())}
