"""Routing frequency in the adaptive recipe at tensor granularity.

With one qtype per tensor, each tensor's predicted error must still be the
routing-weighted sum over its experts, sum_e f_e * err_e, with the documented
weights f_e = E * (count_e + 1) / (sum counts + E) (adaptive.py). A recipe that
ignored the profile at this granularity (f_e = 1) would predict sum_e err_e.
The per-expert errors are recomputed here from the source, with the qtype the
plan chose; without an imatrix the error weights are ones.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ds4quant import formats
from ds4quant.plan import AdaptiveOptions
from ds4quant.convert import convert
from ds4quant.calib.routing import RoutingProfile, write_routing_json
from ds4quant.sources.official import open_source

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "ds4-tiny"
N_LAYER, N_EXPERT = 4, 16
LEAF = {"gate": "w1", "up": "w3", "down": "w2"}


def _skewed_counts() -> np.ndarray:
    """Layer L routes almost every slot to expert 3L+1 and a few to 5."""
    c = np.zeros((N_LAYER, N_EXPERT), np.uint64)
    for layer in range(N_LAYER):
        c[layer, 3 * layer + 1] = 100_000
        c[layer, 5] += 250
    return c


def _weights(counts: np.ndarray) -> np.ndarray:
    E = counts.shape[0]
    c = counts.astype(np.float64)
    return E * (c + 1.0) / (c.sum() + E)


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("routing")
    prof = tmp / "skewed.json"
    write_routing_json(prof, RoutingProfile(N_LAYER, N_EXPERT, 4, _skewed_counts(), tokens=25_000))
    opts = AdaptiveOptions(target_bpw=3.0, candidates=("rocmfp2", "rocmfp3"), granularity="tensor",
                           routing=str(prof), cache_dir=str(tmp / "cache"), fit_restarts=0)
    rep = convert(SAMPLE, tmp / "out", "adaptive", threads=1, adaptive=opts)
    return rep


def _expert_sse(src, layer: int, surface: str, expert: int, qtype: str) -> float:
    x = np.ascontiguousarray(src.read_dequantized(f"layers.{layer}.ffn.experts.{expert}.{LEAF[surface]}.weight"),
                             dtype=np.float32)
    y = formats.decode(qtype, formats.encode(qtype, x), x.shape[1])
    d = x.astype(np.float64) - y.astype(np.float64)
    return float(np.sum(d * d))


def test_each_tensor_predicts_the_routing_weighted_sum(skewed):
    src = open_source(SAMPLE)
    counts = _skewed_counts()
    routed = [c for c in skewed.plan if c.tensor_class == "routed_expert"]
    assert len(routed) == 3 * N_LAYER
    for c in routed:
        assert c.predicted_error is not None, f"{c.name}: no predicted error"
        sse = np.array([_expert_sse(src, c.layer, c.surface, e, c.qtype) for e in range(N_EXPERT)])
        f = _weights(counts[c.layer])
        want = float(np.sum(f * sse))
        unweighted = float(np.sum(sse))
        assert c.predicted_error == pytest.approx(want, rel=1e-9), (
            f"{c.name} ({c.qtype}): predicted {c.predicted_error!r}, routing-weighted sum {want!r}, "
            f"unweighted sum {unweighted!r}")
        # the skew matters: the hot expert dominates, so ignoring f_e is visible
        assert abs(want - unweighted) > 1e-3 * unweighted


def _gains(src) -> dict[tuple[int, str], np.ndarray]:
    """Per tensor, each expert's error saved by rocmfp3 over rocmfp2."""
    return {(layer, s): np.array([_expert_sse(src, layer, s, e, "rocmfp2") - _expert_sse(src, layer, s, e, "rocmfp3")
                                  for e in range(N_EXPERT)])
            for layer in range(N_LAYER) for s in LEAF}


def _plan(tmp: Path, tag: str, counts: np.ndarray) -> dict[str, str]:
    prof = tmp / f"{tag}.csv"
    from ds4quant.calib.routing import write_routing_csv

    write_routing_csv(prof, RoutingProfile(N_LAYER, N_EXPERT, 4, counts))
    opts = AdaptiveOptions(target_bpw=3.0, candidates=("rocmfp2", "rocmfp3"), granularity="tensor",
                           routing=str(prof), cache_dir=str(tmp / "cache"), fit_restarts=0)
    rep = convert(SAMPLE, tmp / f"out-{tag}", "adaptive", threads=1, adaptive=opts)
    return {c.name: c.qtype for c in rep.plan if c.tensor_class == "routed_expert"}


def test_a_skewed_profile_changes_the_plan(tmp_path):
    """Send each layer's slots to the expert that gains most from rocmfp3 in
    layers 0-1 and least in layers 2-3, then the other way round: half the
    budget's upgrades follow the hot experts, so the two plans differ."""
    gains = _gains(open_source(SAMPLE))

    def counts(best_layers):
        c = np.zeros((N_LAYER, N_EXPERT), np.uint64)
        for layer in range(N_LAYER):
            g = gains[(layer, "down")]  # one hot expert per layer, picked on down
            c[layer, int(np.argmax(g) if layer in best_layers else np.argmin(g))] = 1_000_000
        return c

    a = _plan(tmp_path, "a", counts({0, 1}))
    b = _plan(tmp_path, "b", counts({2, 3}))
    assert set(a.values()) == {"rocmfp2", "rocmfp3"}, a  # the budget really splits
    assert a != b, f"the same plan under opposite routing profiles: {a}"
