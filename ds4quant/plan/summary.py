"""The summary of an adaptive plan: the ``adaptive`` block of a convert report.

From the measurements and the allocation: the predicted weighted error and
SQNR of the plan, the uniform recipes the candidates can express on the same
metric, the reference fitter against ours on the MIX experts the plan uses,
the experts calibration never reached, the qtype shares, and under a
sensitivity file the predicted KL. Nothing here measures or decides.

A ``PlanSummary`` is a frozen record; ``to_json`` is the report's block and,
less the run's timings (``artifact_json``), the manifest's
``recipe.allocation``::

    {"options": {...}, "objective": "weighted error", "budget_bytes": int, "budget": str,
     "allocated_bytes": int, "slack": float, "method": "dp" | "lagrange+fill",
     "fixed_expert_bytes": int, "predicted_weighted_error": float,
     "predicted_weighted_sqnr_db": float | null, "measure_seconds": float, "measures_reused": int,
     "qtype_share": {qtype: share}, "uniform": {recipe: {"weighted_error", "weighted_sqnr_db",
     "bytes", "bpw"[, "predicted_kl"]}}[, "fitter_comparison": {...}][, "unreached_experts":
     {tensor: [expert, ...]}][, "predicted_kl": float]}
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from ds4quant.formats import get_qtype
from ds4quant.plan.allocate import Allocation
from ds4quant.plan.options import AdaptiveOptions
from ds4quant.plan.records import Measurements

# rocmfp2-strix, the uniform recipe the adaptive one is compared with
_STRIX = {"gate": "rocmfp2", "up": "rocmfp2", "down": "rocmfp3"}
# figures of the run, not of the artifact (a warm cache changes them, never the bytes)
_RUN_ONLY = ("measure_seconds", "measures_reused")


class Objective(str, Enum):
    WEIGHTED_ERROR = "weighted error"
    PREDICTED_KL = "predicted KL (sensitivity-weighted error)"


@dataclass(frozen=True)
class UniformPoint:
    """A uniform recipe the candidates can express, on the plan's metric."""

    weighted_error: float
    weighted_sqnr_db: Optional[float]
    bytes: int
    bpw: float
    predicted_kl: Optional[float] = None  # under a sensitivity file (rocmfp2-strix)

    def to_json(self) -> dict:
        d = {"weighted_error": self.weighted_error, "weighted_sqnr_db": self.weighted_sqnr_db, "bytes": self.bytes,
             "bpw": self.bpw}
        if self.predicted_kl is not None:
            d["predicted_kl"] = self.predicted_kl
        return d

    @classmethod
    def from_json(cls, d: Mapping) -> "UniformPoint":
        return cls(d["weighted_error"], d["weighted_sqnr_db"], d["bytes"], d["bpw"], d.get("predicted_kl"))


@dataclass(frozen=True)
class FitterComparison:
    """The reference fitter's books against ours, on the MIX experts the plan uses."""

    experts: int
    reference_weighted_error: float
    optimized_weighted_error: float
    gain_db: Optional[float]

    def to_json(self) -> dict:
        return {"experts": self.experts, "reference_weighted_error": self.reference_weighted_error,
                "optimized_weighted_error": self.optimized_weighted_error, "gain_db": self.gain_db}

    @classmethod
    def from_json(cls, d: Mapping) -> "FitterComparison":
        return cls(d["experts"], d["reference_weighted_error"], d["optimized_weighted_error"], d["gain_db"])


@dataclass(frozen=True)
class PlanSummary:
    """See the module docstring. unreached_experts: None without an imatrix."""

    options: Mapping[str, object]
    objective: Objective
    budget_bytes: int
    budget: str
    allocated_bytes: int
    slack: float
    method: str
    fixed_expert_bytes: int
    predicted_weighted_error: float
    predicted_weighted_sqnr_db: Optional[float]
    measure_seconds: float
    measures_reused: int
    qtype_share: Mapping[str, float]
    uniform: Mapping[str, UniformPoint] = field(default_factory=dict)
    fitter_comparison: Optional[FitterComparison] = None
    unreached_experts: Optional[Mapping[str, tuple[int, ...]]] = None
    predicted_kl: Optional[float] = None

    def to_json(self) -> dict:
        d = {"options": dict(self.options), "objective": self.objective.value, "budget_bytes": self.budget_bytes,
             "budget": self.budget, "allocated_bytes": self.allocated_bytes, "slack": self.slack,
             "method": self.method, "fixed_expert_bytes": self.fixed_expert_bytes,
             "predicted_weighted_error": self.predicted_weighted_error,
             "predicted_weighted_sqnr_db": self.predicted_weighted_sqnr_db, "measure_seconds": self.measure_seconds,
             "measures_reused": self.measures_reused, "qtype_share": dict(self.qtype_share),
             "uniform": {k: u.to_json() for k, u in self.uniform.items()}}
        if self.fitter_comparison is not None:
            d["fitter_comparison"] = self.fitter_comparison.to_json()
        if self.unreached_experts is not None:
            d["unreached_experts"] = {k: list(v) for k, v in self.unreached_experts.items()}
        if self.predicted_kl is not None:
            d["predicted_kl"] = self.predicted_kl
        return d

    def artifact_json(self) -> dict:
        """``to_json`` as the artifact records it: no timings or cache statistics."""
        return {k: v for k, v in self.to_json().items() if k not in _RUN_ONLY}

    @classmethod
    def from_json(cls, d: Mapping) -> "PlanSummary":
        fc, un = d.get("fitter_comparison"), d.get("unreached_experts")
        return cls(dict(d["options"]), Objective(d["objective"]), d["budget_bytes"], d["budget"],
                   d["allocated_bytes"], d["slack"], d["method"], d["fixed_expert_bytes"],
                   d["predicted_weighted_error"], d["predicted_weighted_sqnr_db"], d.get("measure_seconds", 0.0),
                   d.get("measures_reused", 0), dict(d["qtype_share"]),
                   {k: UniformPoint.from_json(u) for k, u in d["uniform"].items()},
                   None if fc is None else FitterComparison.from_json(fc),
                   None if un is None else {k: tuple(v) for k, v in un.items()}, d.get("predicted_kl"))


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


def _db(err: float, energy: float) -> Optional[float]:
    return 10.0 * float(np.log10(energy / err)) if err > 0 and energy > 0 else None


def plan_summary(todo, meas: Measurements, opts: AdaptiveOptions, alloc: Allocation, budget: int, budget_what: str,
                 fixed: int, total_w: int, decisions, imatrix, gains: Optional[Mapping[str, float]] = None
                 ) -> PlanSummary:
    """The summary of ``decisions`` (tensor -> ``records.Decision``) made by
    ``alloc`` from ``meas`` for the tensors ``todo``; with ``gains`` (tensor
    -> KL per unit of weighted error) the predicted KL."""
    from ds4quant.artifact.portable import portable_path

    chosen_e = sum(d.predicted_error for d in decisions.values())
    energy = 0.0  # the weighted source energy does not depend on the qtype
    for c, ms in todo:
        w = meas.weights[c.name]
        for i, m in enumerate(ms):
            q = next(q for q in opts.candidates if (c.name, m.expert, q) in meas.measures)
            energy += w[i] * meas.measures[(c.name, m.expert, q)].wssx
    options = {"target_bpw": opts.target_bpw, "max_bytes": opts.max_bytes, "candidates": list(opts.candidates),
               "granularity": opts.granularity.value, "fitter": opts.fitter.value, "routing": portable_path(opts.routing),
               "lucebox": opts.lucebox, "sensitivity": portable_path(opts.sensitivity)}
    summary = PlanSummary(options, Objective.WEIGHTED_ERROR, budget, budget_what, alloc.bytes, alloc.slack,
                          alloc.method, fixed, chosen_e, _db(chosen_e, energy), meas.seconds, meas.reused,
                          _shares(todo, decisions), _uniform(todo, meas, fixed, total_w),
                          _fitters(todo, meas, decisions), _unreached(todo, imatrix))
    return summary if gains is None else _predicted_kl(summary, todo, meas, decisions, gains)


def _uniform(todo, meas: Measurements, fixed: int, total_w: int) -> dict:
    """The uniform recipes the candidates can express, on the same metric."""
    uniform = {}
    have = {k[2] for k in meas.measures}
    if {"rocmfp2", "rocmfp3"} <= have:
        e, s = weighted_error(todo, meas, lambda c: _STRIX[c.surface])
        b = sum(meas.measures[(c.name, m.expert, _STRIX[c.surface])].nbytes for c, ms in todo for m in ms)
        uniform["rocmfp2-strix"] = UniformPoint(e, _db(e, s), b, 8.0 * (b + fixed) / total_w)
    for q in ("rocmfp3", "rocmfp4", "rocmfp4_fast"):
        if q in have:
            e, s = weighted_error(todo, meas, lambda c, q=q: q)
            b = sum(meas.measures[(c.name, m.expert, q)].nbytes for c, ms in todo for m in ms)
            uniform[q] = UniformPoint(e, _db(e, s), b, 8.0 * (b + fixed) / total_w)
    return uniform


def _fitters(todo, meas: Measurements, decisions) -> Optional[FitterComparison]:
    """Reference vs our fitter on the MIX experts the plan uses."""
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
    if not n_mix:
        return None
    return FitterComparison(n_mix, ref, ours, 10.0 * float(np.log10(ref / ours)) if ours > 0 and ref > 0 else None)


def _unreached(todo, imatrix) -> Optional[dict]:
    """tensor -> the experts the imatrix has no importance for (None without an imatrix)."""
    if imatrix is None:
        return None
    from ds4quant.calib.imatrix import importance_for

    unreached = {}
    for c, ms in todo:
        ids = [m.expert for m in ms if importance_for(imatrix, c.name, m.expert, cols=c.shape[0]) is None]
        if ids:
            unreached[c.name] = tuple(ids)
    return unreached


def _predicted_kl(summary: PlanSummary, todo, meas: Measurements, decisions,
                  gains: Mapping[str, float]) -> PlanSummary:
    """The allocation objective under a sensitivity file: predicted KL per token
    (nats) of the plan and of rocmfp2-strix on the same measurements."""
    uniform = dict(summary.uniform)
    if "rocmfp2-strix" in uniform:
        kl = 0.0
        for c, ms in todo:
            w = meas.weights[c.name]
            kl += gains[c.name] * sum(wi * meas.measures[(c.name, m.expert, _STRIX[c.surface])].wsse
                                      for wi, m in zip(w, ms))
        uniform["rocmfp2-strix"] = replace(uniform["rocmfp2-strix"], predicted_kl=kl)
    return replace(summary, objective=Objective.PREDICTED_KL, uniform=uniform,
                   predicted_kl=float(sum(gains[n] * d.predicted_error for n, d in decisions.items())))


def _shares(todo, decisions) -> dict:
    counts: dict[str, int] = {}
    for c, ms in todo:
        for q in decisions[c.name].qtypes:
            counts[q] = counts.get(q, 0) + 1
    n = sum(counts.values())
    return {q: k / n for q, k in sorted(counts.items())}
