"""Sensitivity of the model's output to routed-expert weight error, per tensor,
measured inside the streamed calibration pass.

The adaptive recipe ranks candidates by the imatrix-weighted weight error
``sum_e f_e sum_rc imp_ec dw_rc^2``. Those sums are not comparable across
tensors: an error in layer 0 passes through every later layer before it
reaches the logits, one in a gate or up projection through SwiGLU and the down
projection first. A gain per tensor, ``KL / weighted error``, puts them in one
unit (nats of next-token KL per token); ``sum_t gain_t * error_t`` predicts a
plan's KL, which the allocator minimises (``ds4quant.calib.sensitivity`` is
the file).

Both methods perturb expert weights with seeded Gaussian noise of standard
deviation ``REL_STD`` x each expert matrix's RMS (about a 2-bit type's error)
and run the first ``sensitivity_seqs`` calibration sequences. A perturbed run
is a *branch*: its hidden streams start from the reference's at the perturbed
layer and go through every later layer beside the reference's, in the same
single streamed pass; its KL(reference || branch) is read at the head.

- ``per-tensor`` (``Method.PER_TENSOR``): one branch per routed-expert tensor
  (3 per layer), its KL measured directly. Exact, but its compute grows like
  tensors x layers, so it is for small models; it gives the bytes the
  whole-model measurement always gave.
- ``streamed`` (``Method.STREAMED``, the default): the output KL of a few
  whole-layer perturbations calibrates, per layer, a coefficient that turns
  each tensor's *local* output error into predicted KL. For every tensor the
  local error ``sum_rows |dy|^2 / tokens`` is what its noise changes in the
  routed experts' output on the rows the router sends them (cheap: one expert
  at a time, the layer's captured inputs). For up to ``MAX_PROBES`` probed
  layers (all when the model has that few; else spread evenly, first and last
  included) all three surfaces of every expert carry the noise at
  ``PROBE_SCALES`` x its strength together; that branch's output KL against
  the same perturbation's local error fits ``c_L = sum KL*loc / sum loc^2``.
  Layers between probes take ``c`` interpolated in log space by depth.
  predicted ``KL_t = c_L * local_t``; gain = KL_t / weighted error.
  Compute: the reference pass, plus at most ``MAX_PROBES x len(PROBE_SCALES)``
  branches of ``sensitivity_seqs`` sequences: a constant number of passes,
  whatever the number of experts or tensors.

A probe branch adds its experts' output change to the reference experts'
output (the router's choices at the probed layer are the reference's, as the
per-tensor branch's are too), so one noise draw per expert serves every
sequence, the local errors and every probe scale.

Deterministic: noise from ``numpy.random.default_rng`` (per tensor) or
torch's CPU generator (per tensor and expert) seeded by names, one torch
thread, sums in float64 in a fixed order; with the layer on a GPU the
streamed method's scaling and weighting run there (``scaled_noise``), so that
device's reductions set the last bits, as its layers do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Callable, Sequence

import numpy as np

from ds4quant.calib.sensitivity import Sensitivity
from ds4quant.calibrate.experts import (
    SURFACES, ExpertNoise, PerturbedExperts, TensorNoise, expert_output, expert_weights, pert_weights, rms, surface_rows,
)
from ds4quant.errors import BadInputError
from ds4quant.names import stack_name

__all__ = ["Method", "MAX_PROBES", "PROBE_SCALES", "REL_STD", "SensitivityPass", "probe_layers", "make_pass", "kl_sum",
           "ref_logp", "sensitivity_bytes"]

# The noise level relative to each expert matrix's RMS: rocmfp2's relative
# error on the shipped samples (SQNR about 10 dB). Sensitivity is measured
# where the plans that need it live, not in the small-noise limit.
REL_STD = 0.3
# Whole-layer probe strengths (multiples of REL_STD's noise). One point where
# plans live: with c fitted by least squares through the origin, a second
# point at half strength weighs 1/16 as much and moved no plan on
# samples/ds4-copy; a second probe group is worth more (below).
PROBE_SCALES = (1.0,)
# Surfaces perturbed together in one probe; each group gets its own
# coefficient. gate/up errors reach the output through the expert's own down
# projection, in the directions the model reads, so per unit of local error
# they cost several times the KL that down's (isotropic) errors cost: on
# samples/ds4-copy one all-surface coefficient predicted gate/up KL at
# 0.1-0.5x of their measured KL, two groups at 0.4-1.1x.
PROBE_GROUPS = (("gate", "up"), ("down",))
MAX_PROBES = 8


class Method(str, Enum):
    STREAMED = "streamed"
    PER_TENSOR = "per-tensor"


def probe_layers(n_layer: int, max_probes: int = MAX_PROBES) -> tuple[int, ...]:
    """Every layer when there are at most ``max_probes``; else that many spread
    evenly by depth, first and last included."""
    if n_layer <= max_probes:
        return tuple(range(n_layer))
    return tuple(sorted({int(round(x)) for x in np.linspace(0, n_layer - 1, max_probes)}))


@dataclass(frozen=True)
class Branch:
    """A perturbed run starting at ``layer``: ``experts(base, i)`` is the
    layer's experts module for the sensitivity sequences of captured call
    ``i`` (one call a batch of them)."""

    key: str
    layer: int
    experts: Callable


def _layer_imatrix(sums, layer: int):
    """Layer ``layer``'s routed-expert imatrix entries, as the final file holds them."""
    from ds4quant.calib.imatrix import make_imatrix

    counts = sums.rows.astype(np.float64)
    hid = sums.hidden.astype(np.float32)
    return make_imatrix({stack_name(layer, "gate"): (hid, counts), stack_name(layer, "up"): (hid, counts),
                         stack_name(layer, "down"): (sums.act.astype(np.float32), counts)})


class _Weighting:
    """The allocator's weighted error of a noise draw: sum_e f_e sum_rc imp_ec d_rc^2."""

    def __init__(self, sums, layer: int, n_exp: int):
        from ds4quant.calib.imatrix import importance_for
        from ds4quant.plan import expert_weights as routing_weights

        im = _layer_imatrix(sums, layer)
        self.f = routing_weights(sums.slots, n_exp)
        self.imp: dict[str, list] = {}
        for s in SURFACES:
            name = stack_name(layer, s)
            cols = im.entries[name].values.shape[-1]
            imps = [importance_for(im, name, e, cols=cols) for e in range(n_exp)]
            seen = [q for q in imps if q is not None]
            fallback = np.mean(np.stack(seen), axis=0) if seen else np.ones(cols)
            self.imp[s] = [(q if q is not None else fallback).astype(np.float64) for q in imps]

    def term(self, surface: str, e: int, delta) -> float:
        return weighted_error(float(self.f[e]), self.imp[surface][e], delta)


def weighted_error(f: float, imp: np.ndarray, delta) -> float:
    """``f sum_rc imp_c delta_rc^2`` of one expert matrix. ``delta``: a float64
    ndarray (numpy's sums: the CPU's bytes) or a float64 tensor on a device
    (summed there)."""
    if isinstance(delta, np.ndarray):
        return f * float(np.sum((delta * delta) @ imp))
    import torch

    return f * float(((delta * delta) @ torch.from_numpy(imp).to(delta.device)).sum())


# Noise draws made ahead of the expert being measured, on CPU threads (torch's
# generator releases the GIL): at most this many bytes of float32 draws wait,
# (host, GPU). One DS4 Flash expert's draws (25 M) take about 0.1 s on one
# core, so a GPU that measures an expert in less waits for them: there up to
# 8 threads, with room for 10 experts' draws so that all of them have work;
# the host's own math is the slower side, and its --max-memory budget tighter.
_AHEAD_BYTES = (512 << 20, 1 << 30)
_DRAW_THREADS = (4, 8)


def scaled_noise(noise: ExpertNoise, L: int, experts, rel_std: float, weigh=None):
    """Yields (e, gate_up, down, {surface: delta}, {surface: weighted error})
    for every expert of layer ``L`` in order: ``rel_std`` x the matrix's RMS x
    its seeded standard draws (the same float32 draws on every host, made
    ahead on a few threads), and ``weigh(surface, e, delta)`` of each (None
    without ``weigh``). On the CPU the delta is a numpy float64 array, the
    bytes this file always had, and an expert's three surfaces are scaled and
    weighed on three threads (each surface's arithmetic is its own, so the
    bytes do not depend on it; numpy releases the GIL); with the expert on a
    GPU the delta is scaled and weighed in float64 on that device (the RMS
    reduced there, so its last bits follow the device, as the hidden states'
    do), which spares the host 6.4 G float64 products a DS4 Flash layer."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    import torch

    gu0, down0 = expert_weights(experts, 0)
    shapes = {"gate": (gu0.shape[0] // 2, gu0.shape[1]), "up": (gu0.shape[0] // 2, gu0.shape[1]),
              "down": tuple(down0.shape)}
    per_expert = 4 * sum(a * b for a, b in shapes.values())
    gpu = int(gu0.device.type != "cpu")
    threads = max(1, min(_DRAW_THREADS[gpu], os.cpu_count() or 1))
    ahead = max(1, min(threads + 2, _AHEAD_BYTES[gpu] // per_expert))
    n_exp = experts.num_experts

    def draw(e: int) -> dict:
        return {s: noise.draw(stack_name(L, s), e, shapes[s]) for s in SURFACES}

    def surface(s: str, e: int, w, z):
        if w.device.type == "cpu":
            d = z.double().numpy() * (rel_std * rms(w))
        else:
            wd = w.detach().double()
            d = z.to(w.device).double() * (rel_std * float(torch.sqrt(torch.mean(wd * wd))))
        return d, (weigh(s, e, d) if weigh is not None else None)

    with ThreadPoolExecutor(threads) as pool, ThreadPoolExecutor(len(SURFACES)) as math_pool:
        pending = {e: pool.submit(draw, e) for e in range(min(ahead, n_exp))}
        for e in range(n_exp):
            z = pending.pop(e).result()
            if e + ahead < n_exp:
                pending[e + ahead] = pool.submit(draw, e + ahead)
            gu, down = (gu0, down0) if e == 0 else expert_weights(experts, e)
            inter = gu.shape[0] // 2
            ws = {s: down if s == "down" else gu[surface_rows(s, inter)] for s in SURFACES}
            if gu.device.type == "cpu":
                jobs = {s: math_pool.submit(surface, s, e, ws[s], z[s]) for s in SURFACES}
                done = {s: jobs[s].result() for s in SURFACES}
            else:  # the device orders its own work
                done = {s: surface(s, e, ws[s], z[s]) for s in SURFACES}
            yield e, gu, down, {s: done[s][0] for s in SURFACES}, {s: done[s][1] for s in SURFACES}


def sensitivity_bytes(config, seq_lens: Sequence[int], method: "Method | str", device: str = "cpu") -> tuple[int, int]:
    """(host, device) bytes the sensitivity pass holds beside the stream at most
    (a transformers DeepSeek-V4 config; ``seq_lens``: the sensitivity
    sequences' lengths; ``device``: where the layers run). The captured experts
    calls (hidden rows, routing) and, for the streamed method, each probe
    branch's per-token change; per expert, its three surfaces' float64 noise and
    the perturbed copies of its weights; the per-tensor method keeps every
    expert's noise of the three surfaces for its branches, in host memory.
    The streamed method's draws made ahead are host memory wherever the layer
    runs; the rest is on the device (the host's when it is the CPU)."""
    if not seq_lens:
        return 0, 0
    m = Method(method)
    h, inter = int(config.hidden_size), int(config.moe_intermediate_size)
    k, n_exp = int(config.num_experts_per_tok), int(config.n_routed_experts)
    tokens = int(sum(seq_lens))
    calls = tokens * (4 * h + 12 * k)  # float32 rows, int64 top-k ids, float32 top-k weights
    gate_up = 2 * inter * h * 4
    gpu = int(not str(device).startswith("cpu"))
    if m is Method.PER_TENSOR:  # numpy's float64 noise, on the host wherever the layer runs
        host = 3 * n_exp * inter * h * 8
        return (host, calls + 3 * gate_up) if gpu else (host + calls + 3 * gate_up, 0)
    branches = len(PROBE_GROUPS) * len(PROBE_SCALES)
    work = branches * tokens * h * 4 + 3 * inter * h * 8 + (len(SURFACES) + branches) * gate_up
    # the draws waiting (``scaled_noise``: at most its byte cap, at most a few experts), and the one in use
    per_expert = 3 * inter * h * 4
    ahead = min(_AHEAD_BYTES[gpu], (_DRAW_THREADS[gpu] + 2) * per_expert) + per_expert
    if gpu:
        return ahead, calls + work
    return ahead + calls + work, 0


def kl_sum(ref_logp, logits) -> float:
    """sum over positions of KL(ref || cand) in float64."""
    import torch

    cand = torch.log_softmax(logits.double(), dim=-1)
    return float((ref_logp.exp() * (ref_logp - cand)).sum(-1).sum())


class SensitivityPass:
    """What the streamed walk asks of a sensitivity method.

    ``layer(L, experts, calls, sums)`` runs after layer L's reference pass,
    with the layer's experts module, the captured experts calls of the
    sensitivity sequences ([(hidden, top_k_index, top_k_weights)], one a
    batch of them, in order) and the
    layer's finished sums; it returns the layer's piece (name -> float64
    array, journaled) and the branches that start at L. ``keys_entering(L)``
    are the branches alive when layer L begins (carried through it).
    ``finish(pieces, kl_sums, tokens)`` makes the file's contents."""

    method: Method

    def __init__(self, n_layer: int, seqs: int, rel_std: float = REL_STD):
        self.n_layer, self.seqs, self.rel_std = n_layer, seqs, rel_std

    def keys_entering(self, layer: int) -> list[str]:
        return [k for L in range(layer) for k in self.keys_of(L)]

    def keys_of(self, layer: int) -> list[str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _check(self, name: str, kl: float, err: float) -> None:
        if not (math.isfinite(kl) and math.isfinite(err) and err > 0 and kl > 0):
            raise BadInputError(f"sensitivity of {name} is not finite and positive (KL {kl}, weighted error {err})",
                                where="sensitivity")


class PerTensorPass(SensitivityPass):
    method = Method.PER_TENSOR

    def keys_of(self, layer: int) -> list[str]:
        return [stack_name(layer, s) for s in SURFACES]

    def layer(self, L: int, experts, calls, sums):
        n_exp = experts.num_experts
        weighting = _Weighting(sums, L, n_exp)
        noise = TensorNoise()
        piece, branches = {}, []
        for s in SURFACES:
            name = stack_name(L, s)
            deltas, err = [], 0.0
            for e in range(n_exp):
                gu, down = expert_weights(experts, e)
                w = down if s == "down" else gu[surface_rows(s, gu.shape[0] // 2)]
                d = noise.standard(name, e, tuple(w.shape)) * (self.rel_std * rms(w))
                err += weighting.term(s, e, d)
                deltas.append(d)
            piece[f"err.{s}"] = np.array(err)
            mod = PerturbedExperts(experts, lambda e, s=s, deltas=deltas: {s: deltas[e]}).module()
            branches.append(Branch(name, L, lambda base, i, mod=mod: mod))
        return piece, branches

    def finish(self, pieces, kl_sums, tokens, fingerprint, tokens_sha256) -> Sensitivity:
        gains, kls, errs = {}, {}, {}
        for L in range(self.n_layer):
            for s in SURFACES:
                name = stack_name(L, s)
                kl, err = kl_sums[name] / tokens, float(pieces[L][f"err.{s}"])
                self._check(name, kl, err)
                gains[name], kls[name], errs[name] = kl / err, kl, err
        return Sensitivity(MappingProxyType(gains), MappingProxyType(kls), MappingProxyType(errs), fingerprint,
                           tokens_sha256, self.seqs, tokens, float(self.rel_std))


def _delta_experts(base, add):
    """``base``'s output plus a fixed per-token change ``add`` [T, H]."""
    import torch

    class DeltaExperts(torch.nn.Module):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return base(hidden_states, top_k_index, top_k_weights) + add

    return DeltaExperts()


class StreamedPass(SensitivityPass):
    method = Method.STREAMED

    def __init__(self, n_layer: int, seqs: int, rel_std: float = REL_STD, max_probes: int = MAX_PROBES,
                 groups: tuple = PROBE_GROUPS, scales: tuple = PROBE_SCALES):
        super().__init__(n_layer, seqs, rel_std)
        self.probes = probe_layers(n_layer, max_probes)
        self.groups = {"+".join(g): tuple(g) for g in groups}
        self.scales = tuple(scales)
        if sorted(s for g in self.groups.values() for s in g) != sorted(SURFACES):
            raise ValueError(f"probe groups {groups} must cover each surface once")  # a bug

    def keys_of(self, layer: int) -> list[str]:
        if layer not in self.probes:
            return []
        return [f"probe.{layer}.{g}.{m}" for g in self.groups for m in self.scales]

    def group_of(self, surface: str) -> str:
        return next(g for g, members in self.groups.items() if surface in members)

    def layer(self, L: int, experts, calls, sums):
        import torch

        from ds4quant.runtime.stream import rows_by_expert

        n_exp = experts.num_experts
        weighting = _Weighting(sums, L, n_exp)
        noise = ExpertNoise()
        probes = [(g, m) for g in self.groups for m in self.scales] if L in self.probes else []
        err = dict.fromkeys(SURFACES, 0.0)
        add = {p: [torch.zeros_like(h) for h, _i, _w in calls] for p in probes}
        # each call's rows per expert, found once (one host synchronization a call)
        rows = [{e: (pos, tok) for e, pos, tok in rows_by_expert(idx, n_exp)} for _h, idx, _w in calls]
        # the local sums stay on the rows' device until the layer is done: float64 additions in the
        # same order as on the host, without a synchronization per expert and sequence
        dev = calls[0][0].device if calls else torch.device("cpu")
        local = {s: torch.zeros((), dtype=torch.float64, device=dev) for s in SURFACES}
        local_probe = {p: torch.zeros((), dtype=torch.float64, device=dev) for p in probes}
        for e, gu, down, d, terms in scaled_noise(noise, L, experts, self.rel_std, weighting.term):
            for s in SURFACES:
                err[s] += terms[s]
            one = {s: pert_weights(gu, down, {s: d[s]}) for s in SURFACES}
            every = {(g, m): pert_weights(gu, down, {s: d[s] * m for s in self.groups[g]}) for g, m in probes}
            for i, (h, _idx, w) in enumerate(calls):
                if e not in rows[i]:
                    continue
                pos, tok = rows[i][e]
                x, wr = h[tok], w[tok, pos]
                y = expert_output(experts, gu, down, x, wr)
                for s in SURFACES:
                    local[s] += _sq(expert_output(experts, *one[s], x, wr) - y)
                for p, (gu_p, down_p) in every.items():
                    dy = expert_output(experts, gu_p, down_p, x, wr) - y
                    local_probe[p] += _sq(dy)
                    add[p][i].index_add_(0, tok, dy)
        piece = {f"err.{s}": np.array(err[s]) for s in SURFACES}
        piece.update({f"local.{s}": np.array(float(local[s])) for s in SURFACES})
        piece.update({f"local.probe.{g}.{m}": np.array(float(v)) for (g, m), v in local_probe.items()})
        branches = [Branch(f"probe.{L}.{g}.{m}", L, lambda base, i, p=(g, m): _delta_experts(base, add[p][i]))
                    for g, m in probes]
        return piece, branches

    def coefficients(self, pieces, kl_sums, tokens) -> dict[int, dict]:
        """Per layer and probe group: c (KL per unit of local error), and the probe points behind it."""
        out: dict[int, dict] = {L: {"probed": L in self.probes, "groups": {}} for L in range(self.n_layer)}
        for g in self.groups:
            for L in self.probes:
                pts = [(kl_sums[f"probe.{L}.{g}.{m}"] / tokens, float(pieces[L][f"local.probe.{g}.{m}"]) / tokens)
                       for m in self.scales]
                num = sum(k * loc for k, loc in pts)
                den = sum(loc * loc for _k, loc in pts)
                c = num / den if den > 0 else float("nan")
                if not (math.isfinite(c) and c > 0):
                    raise BadInputError(f"layer {L}: the {g} probe's KL per local error is {c} (probes {pts})",
                                        where="sensitivity")
                out[L]["groups"][g] = {"coefficient": c, "probes": [
                    {"scale": m, "kl": k, "local_error": loc} for m, (k, loc) in zip(self.scales, pts)]}
            xs = list(self.probes)
            logs = [math.log(out[L]["groups"][g]["coefficient"]) for L in xs]
            for L in range(self.n_layer):
                if L not in self.probes:
                    out[L]["groups"][g] = {"coefficient": math.exp(float(np.interp(L, xs, logs))), "probes": []}
        return out

    def finish(self, pieces, kl_sums, tokens, fingerprint, tokens_sha256) -> Sensitivity:
        coef = self.coefficients(pieces, kl_sums, tokens)
        gains, kls, errs, locs = {}, {}, {}, {}
        for L in range(self.n_layer):
            for s in SURFACES:
                name = stack_name(L, s)
                loc = float(pieces[L][f"local.{s}"]) / tokens
                c = coef[L]["groups"][self.group_of(s)]["coefficient"]
                kl, err = c * loc, float(pieces[L][f"err.{s}"])
                self._check(name, kl, err)
                gains[name], kls[name], errs[name], locs[name] = kl / err, kl, err, loc
        return Sensitivity(MappingProxyType(gains), MappingProxyType(kls), MappingProxyType(errs), fingerprint,
                           tokens_sha256, self.seqs, tokens, float(self.rel_std), method=self.method.value,
                           local_error=MappingProxyType(locs),
                           layers=MappingProxyType({L: MappingProxyType(v) for L, v in sorted(coef.items())}))


def _sq(dy):
    """The float64 sum of squares of ``dy``, a 0-d tensor on its device."""
    return dy.detach().double().square().sum()


_PASSES = {Method.STREAMED: StreamedPass, Method.PER_TENSOR: PerTensorPass}


def make_pass(method: "Method | str", n_layer: int, seqs: int) -> SensitivityPass:
    """The pass of ``method`` (a Method or its name)."""
    try:
        m = Method(method)
    except ValueError:
        raise BadInputError(f"unknown sensitivity method {method!r}; known: "
                            f"{', '.join(x.value for x in Method)}", where="--sensitivity-method") from None
    return _PASSES[m](n_layer, seqs)


def ref_logp(logits):
    """The reference's log-probabilities in float64 (the KL's left side)."""
    import torch

    return torch.log_softmax(logits.double(), dim=-1)
