"""benchmarks/adaptive.py's reading of the measurement cache: every candidate's
error on every expert, priced for any choice of qtypes (plans, uniform points).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Optional

import numpy as np

# Uniform points read from the measurement cache: label -> qtype per surface.
UNIFORM_POINTS = {
    "rocmfp2": {"gate": "rocmfp2", "up": "rocmfp2", "down": "rocmfp2"},
    "rocmfp2_mix": {"gate": "rocmfp2_mix", "up": "rocmfp2_mix", "down": "rocmfp2_mix"},
    "rocmfp2-strix": {"gate": "rocmfp2", "up": "rocmfp2", "down": "rocmfp3"},
    "rocmfp3": {"gate": "rocmfp3", "up": "rocmfp3", "down": "rocmfp3"},
    "rocmfp3_mix": {"gate": "rocmfp3_mix", "up": "rocmfp3_mix", "down": "rocmfp3_mix"},
    "rocmfp4_fast": {"gate": "rocmfp4_fast", "up": "rocmfp4_fast", "down": "rocmfp4_fast"},
    "rocmfp4": {"gate": "rocmfp4", "up": "rocmfp4", "down": "rocmfp4"},
}
_SURFACE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.")


class Measured:
    """The cached measures of one fitter setting: (tensor, expert, qtype) ->
    (nbytes, sse, ssx, wsse, wssx, ref_wsse), plus routing weights f_e and the
    experts the imatrix reached."""

    def __init__(self, cache: Path, routing: Optional[Path], imatrix: Optional[Path]):
        from ds4quant.plan import expert_weights

        files = sorted(cache.glob("measure-*.json"))
        if len(files) != 1:
            raise SystemExit(f"{cache}: expected one measurement file, found {len(files)}")
        raw = json.loads(files[0].read_text())["measures"]
        self.m = {}
        for k, v in raw.items():
            t, e, q = k.split("|")
            self.m[(t, int(e), q)] = v
        self.tensors = sorted({t for t, _, _ in self.m}, key=_tensor_order)
        self.n_exp = {t: 1 + max(e for tt, e, _ in self.m if tt == t) for t in self.tensors}
        counts = None
        if routing is not None:
            from ds4quant.calib.routing import read_routing

            counts = read_routing(routing).counts
        self.w = {t: expert_weights(None if counts is None else counts[_layer(t)], self.n_exp[t])
                  for t in self.tensors}
        self.reached = {t: np.ones(self.n_exp[t], bool) for t in self.tensors}
        if imatrix is not None:
            from ds4quant.calib.imatrix import importance_for, read_imatrix

            im = read_imatrix(imatrix)
            for t in self.tensors:
                self.reached[t] = np.array([importance_for(im, t, e) is not None for e in range(self.n_exp[t])])

    def errors(self, pick) -> dict:
        """Sums for a choice ``pick(tensor, expert) -> qtype`` over all experts:
        routing-weighted (err, energy), imatrix-only over reached experts
        (err, energy), and payload bytes."""
        re_ = rs = ie = is_ = 0.0
        nb = 0
        for t in self.tensors:
            for e in range(self.n_exp[t]):
                v = self.m[(t, e, pick(t, e))]
                nb += int(v[0])
                re_ += self.w[t][e] * v[3]
                rs += self.w[t][e] * v[4]
                if self.reached[t][e]:
                    ie, is_ = ie + v[3], is_ + v[4]
        return {"bytes": nb, "routed": (re_, rs), "imatrix": (ie, is_)}

    def qtypes(self) -> set:
        return {q for _, _, q in self.m}

    def fitter_gain(self) -> Optional[dict]:
        """Reference vs optimized books on every measured MIX expert the imatrix
        reached, per qtype, routing-weighted. (Unreached experts are left out:
        their cached reference error is unweighted while their own error uses
        the fallback column weights, so the two are not comparable.)"""
        out = {}
        for q in sorted(self.qtypes()):
            ref = ours = 0.0
            n = 0
            for (t, e, qq), v in self.m.items():
                if qq == q and v[5] is not None and self.reached[t][e]:
                    ref += self.w[t][e] * v[5]
                    ours += self.w[t][e] * v[3]
                    n += 1
            if n:
                out[q] = {"experts": n, "reference_weighted_error": ref, "optimized_weighted_error": ours,
                          "gain_db": _db(ours, ref)}
        return out or None


def _layer(tensor: str) -> int:
    return int(_SURFACE.match(tensor).group(1))


def _surface(tensor: str) -> str:
    return _SURFACE.match(tensor).group(2)


def _tensor_order(t: str):
    return (_layer(t), ("gate", "up", "down").index(_surface(t)))


def _db(err: float, energy: float) -> Optional[float]:
    return 10.0 * math.log10(energy / err) if err > 0 and energy > 0 else None


def plan_choice(plan: list[dict]):
    """pick(tensor, expert) -> qtype from a routed-expert plan (compact stacks too)."""
    by = {}
    for c in plan:
        base = c["name"] if "experts" not in c else c["name"].rsplit(".", 2)[0] + ".weight"
        ids = c.get("experts", range(c["shape"][2]))
        for e in ids:
            by[(base, int(e))] = c["qtype"]
    return lambda t, e: by[(t, e)]


def uniform_points(meas: Measured, expert_weights: int) -> dict:
    out = {}
    have = meas.qtypes()
    for label, per in UNIFORM_POINTS.items():
        if not set(per.values()) <= have:
            continue
        s = meas.errors(lambda t, e, per=per: per[_surface(t)])
        out[label] = {"bpw": 8.0 * s["bytes"] / expert_weights, "bytes": s["bytes"],
                      "weighted_sqnr_db": _db(*s["routed"]), "imatrix_sqnr_db": _db(*s["imatrix"])}
    return out


def cross_check(run: dict, meas: Measured) -> dict:
    """The run's plan priced from the cache, against what the run reported."""
    s = meas.errors(plan_choice(run["plan"]))
    return {"bytes": s["bytes"], "predicted_db": _db(*s["routed"]), "imatrix_predicted_db": _db(*s["imatrix"]),
            "imatrix_actual_db": run["expert_weighted_sqnr_db"]}
