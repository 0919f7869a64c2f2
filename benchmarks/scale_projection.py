"""``benchmarks/scale.py``'s PROJECTION of a DS4 Flash slice's figures to the
43-layer model: each layer at its attention type's rate, calibrate by its
sequence-layers or its parts, convert with its set-up once. Arithmetic on
measured figures, printed as a projection."""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["FLASH_LAYERS", "flash_types", "project", "seq_layers"]

REPO = Path(__file__).resolve().parents[1]
FLASH_LAYERS = 43


def seq_layers(n_layer: int, seqs: int, sens: int) -> list:
    """Sequence-layers calibrate runs in each layer of an ``n_layer`` model: the
    ``seqs`` main ones, plus the streamed sensitivity's branches alive there
    (those that start at the layer and those carried into it, each over the
    first ``sens`` sequences), as ``calibrate/walk.py`` runs them."""
    if not sens:
        return [seqs] * n_layer
    from ds4quant.calibrate.sensitivity import make_pass

    sp, k = make_pass("streamed", n_layer, sens), min(sens, seqs)
    return [seqs + k * (len(sp.keys_entering(L)) + len(sp.keys_of(L))) for L in range(n_layer)]


def flash_types(offset: int, n: int) -> tuple:
    """(the slice's layers' attention types, DS4 Flash's 43): native compress-ratio
    codes, 0 sliding window, 4 CSA, 128 HCA."""
    sys.path.insert(0, str(REPO / "samples"))
    from make_synthetic import DS4_FLASH_RATIOS

    return tuple(DS4_FLASH_RATIOS[offset:offset + n]), tuple(DS4_FLASH_RATIOS)


def _by_type(rates: list, here: tuple, there: tuple) -> tuple:
    """(a rate per DS4 Flash layer, {type: rate} measured): each layer takes its
    attention type's worst measured rate, a type the slice lacks the worst of all."""
    worst: dict = {}
    for t, r in zip(here, rates):
        worst[t] = max(worst.get(t, r), r)
    anything = max(rates)
    return [worst.get(t, anything) for t in there], worst


def _project_calibrate(r: dict, types: tuple, seqs: int, sens: int, main_seqs: int) -> dict:
    """calibrate at 43 layers and ``main_seqs`` calibration sequences: per DS4
    Flash layer its sequence-layers times its attention type's worst rate per
    sequence-layer in the slice (the first layer's one-time costs, the noise
    and local errors counted in it: an upper bound); the fixed part as measured."""
    here, there = types
    layers = r["seconds_per_layer"]
    n_here = seq_layers(len(layers), seqs, sens)
    n_there = seq_layers(FLASH_LAYERS, main_seqs, sens)
    fixed = r["wall_seconds"] - sum(layers)
    out = {"seq_layers": sum(n_there), "sequences": main_seqs,
           "peak_rss_bytes": r["peak_rss_bytes"], "peak_gpu_bytes": r.get("peak_gpu_bytes", 0)}
    parts = r.get("layer_parts") or []
    if len(parts) == len(layers) and seqs:
        # by parts: the main pass per main sequence-layer, the noise and local errors once a layer
        # (over the sensitivity sequences, whatever the main count), the branches per branch
        # sequence-layer (a layer without branches takes the main rate)
        k_sens = min(sens, seqs)
        if seqs > k_sens > 0 and all("main_rest" in p for p in parts):
            # the sensitivity sequences (their calls captured) and the rest, each at its own rate
            sr, _ = _by_type([p["main_sens"] / k_sens for p in parts], here, there)
            rr, _ = _by_type([p["main_rest"] / (seqs - k_sens) for p in parts], here, there)
            main = [(a * k_sens + b * (main_seqs - k_sens)) / main_seqs for a, b in zip(sr, rr)]
            out.update(seconds_per_sens_seq_layer=max(sr), seconds_per_rest_seq_layer=max(rr))
        else:
            main, _ = _by_type([p["main"] / seqs for p in parts], here, there)
        noise, _ = _by_type([p["noise_and_local"] for p in parts], here, there)
        branch_rates = [p["branches"] / (k - seqs) if k > seqs else p["main"] / seqs for p, k in zip(parts, n_here)]
        branch, measured = _by_type(branch_rates, here, there)
        # the weights: the first layer's part also holds calibrate's set-up, counted once; the later
        # layers' worst (the first's, with one layer: an overestimate) for each of the others
        weights = [p.get("weights", 0.0) for p in parts]
        per_weights = max(weights[1:]) if len(weights) > 1 else weights[0]
        total = fixed + weights[0] + per_weights * (FLASH_LAYERS - 1) + sum(
            mr * main_seqs + nz + br * (k - main_seqs) for mr, nz, br, k in zip(main, noise, branch, n_there))
        return dict(out, seconds=total, by_parts=True, upper_bound=False, types_measured=sorted(measured),
                    weights_first_layer=weights[0], weights_per_layer=per_weights,
                    seconds_per_main_seq_layer=max(main), noise_and_local_per_layer=max(noise),
                    seconds_per_branch_seq_layer=max(branch))
    rates, measured = _by_type([t / k for t, k in zip(layers, n_here)], here, there)
    return dict(out, seconds=fixed + sum(k * rt for k, rt in zip(n_there, rates)), seconds_per_seq_layer=max(rates),
                upper_bound=True, types_measured=sorted(measured))


def project(res: dict, n: int) -> dict:
    """PROJECTION to 43 layers, memory flat in the layer count. The streamed passes: the fixed part
    once, each DS4 Flash layer at its attention type's rate in the slice (the first layer counted
    once as measured when later layers of its type exist); calibrate by its sequence-layers
    (``_project_calibrate``; and at ``--project-seqs`` sequences); convert: the time to its first
    measured expert once (set-up, kernel compiles), the rest / n x 43 (an upper bound: the
    embedding and head counted per layer)."""
    out = {}
    st = res.get("settings", {})
    types = flash_types(int(st.get("ratio_offset") or 0), n)
    cal = res.get("calibrate")
    if cal:
        seqs, sens = int(st.get("seqs", 1)), int(cal.get("sensitivity_seqs", 0))
        out["calibrate"] = _project_calibrate(cal, types, seqs, sens, seqs)
        if st.get("project_seqs"):
            out[f"calibrate_{st['project_seqs']}_seqs"] = _project_calibrate(cal, types, seqs, sens,
                                                                              int(st["project_seqs"]))
    for key in ("reference", "candidate"):
        r = res.get(key)
        if r:
            # the first layer also pays one-time costs (kernel compiles, the device's first use): where a
            # later layer of its type was measured it is counted once and the later layers give the rates
            layers = r["seconds_per_layer"]
            here, there = types
            skip = 1 if here[0] in here[1:len(layers)] else 0
            rates, measured = _by_type(layers[skip:], here[skip:len(layers)], there)
            fixed = r["wall_seconds"] - sum(layers)
            once = layers[0] - measured[here[0]] if skip else 0.0
            out[key] = {"seconds": fixed + once + sum(rates), "seconds_per_layer": sum(rates) / FLASH_LAYERS,
                        "types_measured": sorted(measured),
                        "peak_rss_bytes": r["peak_rss_bytes"], "peak_gpu_bytes": r.get("peak_gpu_bytes", 0)}
    for key in ("uniform_convert", "adaptive_convert"):
        r = res.get(key)
        if r:
            first = (r.get("stages") or {}).get("measure", {}).get("first", 0.0)
            out[key] = {"seconds": first + (r["wall_seconds"] - first) / n * FLASH_LAYERS,
                        "once_seconds": first, "peak_rss_bytes": r["peak_rss_bytes"],
                        "peak_gpu_bytes": r.get("peak_gpu_bytes", 0)}
    return out
