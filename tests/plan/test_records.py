"""The planner's records cross into convert, the manifest, verify and the
report as frozen records with a JSON round trip: the options' choices are
str-enums parsed once, a recorded plan reads back as TensorChoice records
(an entry that is none is named, not guessed at), and the plan summary keeps
its JSON keys and order."""

from __future__ import annotations

import json

import pytest

from ds4quant.errors import BadInputError
from ds4quant.formats.search import NUMBA, Backend, Tier
from ds4quant.plan import (AdaptiveOptions, Device, Fitter, FitterComparison, Granularity, Measure, Objective,
                           PlanSummary, TensorChoice, UniformPoint, plan_from_json)

STACK = TensorChoice("blk.3.ffn_down_exps.rocmfp2_mix.weight", "routed_expert", (256, 64, 3), "I8", "adaptive",
                     "rocmfp2_mix", "adaptive:bpw=2.7", "down", 3, (0, 4, 7), 1.25)
DENSE = TensorChoice("output_norm.weight", "norm", (64,), "BF16", "source", "bf16", "keep-source")


def test_options_hold_their_choices_as_enums_and_refuse_others():
    o = AdaptiveOptions(target_bpw=2.7, granularity="expert", fitter="reference", device="cuda:1")
    assert (o.granularity, o.fitter, o.device, o.device_index) == (Granularity.EXPERT, Fitter.REFERENCE,
                                                                     Device.CUDA, 1)
    assert o.device_name == "cuda:1" and o == AdaptiveOptions(target_bpw=2.7, granularity=Granularity.EXPERT,
                                                              fitter=Fitter.REFERENCE, device=Device.CUDA,
                                                              device_index=1)
    assert json.dumps(o.key()) == '{"candidates": ["rocmfp2", "rocmfp2_mix", "rocmfp3", "rocmfp3_mix", ' \
                                  '"rocmfp4", "rocmfp4_fast"], "fitter": "reference"}'
    assert AdaptiveOptions(target_bpw=2.7).backend() is NUMBA
    assert AdaptiveOptions(target_bpw=2.7, device="torch-cpu").backend() == Backend(Tier.TORCH, "cpu")
    for kw, text in ((dict(granularity="row"), "--granularity must be one of"), (dict(fitter="x"), "--fitter"),
                     (dict(device="tpu"), "--device must be cpu, cuda, cuda:N or torch-cpu"),
                     (dict(device="torch-cpu", device_index=0), "takes no device index")):
        with pytest.raises(BadInputError, match=text):
            AdaptiveOptions(target_bpw=2.7, **kw)


def test_measures_round_trip_as_the_cache_stores_them():
    for m in (Measure(10, 1.5, 2.0, 0.25, 3.0), Measure(7, 0.0, 1.0, 0.0, 1.0, 0.125)):
        assert Measure.from_json(json.loads(json.dumps(m.to_json()))) == m
    assert Measure(10, 1.5, 2.0, 0.25, 3.0).to_json() == [10, 1.5, 2.0, 0.25, 3.0, None]


def test_a_recorded_plan_reads_back_as_tensor_choices():
    entries = json.loads(json.dumps([STACK.to_json(), DENSE.to_json()]))
    choices, problems = plan_from_json(entries)
    assert choices == [STACK, DENSE] and problems == []
    frozen = {**STACK.to_json(), "shape": tuple(STACK.shape), "experts": tuple(STACK.experts)}  # a read manifest
    assert plan_from_json([frozen]) == ([STACK], [])


def test_an_entry_that_is_no_tensor_choice_is_named():
    good = STACK.to_json()
    bad = [7, {**good, "name": None}, {**good, "shape": [256, "64"]}, {k: v for k, v in good.items() if k != "rule"},
           {**good, "layer": True}, good]
    choices, problems = plan_from_json(bad)
    assert choices == [STACK]
    assert problems == [
        "entry 0: a plan entry must be an object, got int",
        "entry 1: plan entry field 'name' is None",
        f"entry 2 ({STACK.name}): plan entry field 'shape' is [256, '64']",
        f"entry 3 ({STACK.name}): plan entry field 'rule' is None",
        f"entry 4 ({STACK.name}): plan entry field 'layer' is True",
    ]


def test_the_plan_summary_keeps_its_json():
    s = PlanSummary({"target_bpw": 2.7, "granularity": "tensor"}, Objective.PREDICTED_KL, 100, "target 2.7 bpw", 99,
                    0.01, "dp", 0, 3.5, 12.0, 1.5, 4, {"rocmfp2": 0.5, "rocmfp3": 0.5},
                    {"rocmfp2-strix": UniformPoint(4.0, 11.0, 90, 2.6, 0.5), "rocmfp3": UniformPoint(3.0, 12.0, 99, 3.1)},
                    FitterComparison(3, 2.0, 1.0, 3.0103), {"blk.2.ffn_gate_exps.weight": (5,)}, 0.25)
    j = s.to_json()
    assert list(j) == ["options", "objective", "budget_bytes", "budget", "allocated_bytes", "slack", "method",
                       "fixed_expert_bytes", "predicted_weighted_error", "predicted_weighted_sqnr_db",
                       "measure_seconds", "measures_reused", "qtype_share", "uniform", "fitter_comparison",
                       "unreached_experts", "predicted_kl"]
    assert j["objective"] == "predicted KL (sensitivity-weighted error)"
    assert j["uniform"]["rocmfp2-strix"] == {"weighted_error": 4.0, "weighted_sqnr_db": 11.0, "bytes": 90,
                                             "bpw": 2.6, "predicted_kl": 0.5}
    assert "predicted_kl" not in j["uniform"]["rocmfp3"] and j["unreached_experts"] == {
        "blk.2.ffn_gate_exps.weight": [5]}
    assert PlanSummary.from_json(json.loads(json.dumps(j))) == s
    assert "measure_seconds" not in s.artifact_json() and "measures_reused" not in s.artifact_json()
    bare = PlanSummary({}, Objective.WEIGHTED_ERROR, 1, "", 1, 0.0, "dp", 0, 0.0, None, 0.0, 0, {})
    assert set(bare.to_json()) == set(j) - {"fitter_comparison", "unreached_experts", "predicted_kl"}
    assert PlanSummary.from_json(bare.to_json()) == bare
