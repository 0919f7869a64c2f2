"""The fidelity records (ds4quant/records.py): frozen parts, the ``verify --json``
"fidelity" object they write (keys, order, values: a public output), and the JSON round trip."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ds4quant.errors import CorruptDataError
from ds4quant.records import (
    ExactCopyScore,
    FidelityReport,
    LogitFigures,
    MoeLayerError,
    PlacementRun,
    VerifyReport,
)

A, B, R = "a" * 64, "b" * 64, "c" * 64

# The "fidelity" object of `verify --json`, key for key and in this order (the order the
# CLI prints). Keys after "exact_copy" appear only with ranks ("cluster") or a second
# placement ("second_placement").
KEYS = ["requested", "measured", "mode", "tokenizer", "eval", "eval_tokens", "placements", "kl_mean", "kl_p99",
        "top1", "ppl_ratio", "layers", "response_token_ids", "response_sha256", "reference_response_sha256",
        "response_matches_reference", "moe_output_sha256", "fast_moe_output_sha256", "exact_copy"]


def _report(mode="exact", second=True, copy=True, cluster=True) -> FidelityReport:
    runs = (PlacementRun("cpu:0 (one CPU owner)", A, R),) + ((PlacementRun("c.json (2 gloo ranks)", A, B),)
                                                            if second else ())
    failed = ({"identifier": "x_1", "repeat": 0, "prompt": "p", "expected": "x_1", "got": "x_2"},)
    return FidelityReport(
        requested=True, measured=True, mode=mode, tokenizer="tokenizer.json", eval="4 built-in copy-task documents",
        eval_tokens=123, runs=runs, logits=LogitFigures(0.002, 0.01, 0.99, 1.0001),
        layers=(MoeLayerError(0, 0.0, 0.0), MoeLayerError(1, 1e-3, 2e-3)), response_token_ids=(5, 6, 7),
        reference_response_sha256=R,
        exact_copy=ExactCopyScore(59, 60, failed, "echo", 60) if copy else None,
        cluster=({"n_ranks": 2, "calls": 4, "ranks": [{"rank": 0}, {"rank": 1}]},) if cluster else (),
        seconds=12.5)


def test_the_json_object_keeps_its_keys_order_and_values():
    rep = _report()
    assert rep.to_json() == {
        "requested": True, "measured": True, "mode": "exact", "tokenizer": "tokenizer.json",
        "eval": "4 built-in copy-task documents", "eval_tokens": 123,
        "placements": ["cpu:0 (one CPU owner)", "c.json (2 gloo ranks)"],
        "kl_mean": 0.002, "kl_p99": 0.01, "top1": 0.99, "ppl_ratio": 1.0001,
        "layers": [{"layer": 0, "moe_rel_error": 0.0, "moe_rel_error_propagated": 0.0},
                   {"layer": 1, "moe_rel_error": 1e-3, "moe_rel_error_propagated": 2e-3}],
        "response_token_ids": [5, 6, 7], "response_sha256": R, "reference_response_sha256": R,
        "response_matches_reference": True, "moe_output_sha256": A, "fast_moe_output_sha256": None,
        "exact_copy": {"passes": 59, "trials": 60, "failed": [{"identifier": "x_1", "repeat": 0, "prompt": "p",
                                                                "expected": "x_1", "got": "x_2"}],
                       "task": "echo", "reference_passes": 60},
        "cluster": [{"n_ranks": 2, "calls": 4, "ranks": [{"rank": 0}, {"rank": 1}]}],
        "second_placement": {"moe_output_sha256": A, "response_sha256": B, "identical": False}}
    assert list(rep.to_json()) == KEYS + ["cluster", "second_placement"]
    assert rep.to_json(seconds=True)["seconds"] == 12.5
    fast = _report("fast", second=False, copy=False, cluster=False).to_json()
    assert list(fast) == KEYS
    assert fast["moe_output_sha256"] is None and fast["fast_moe_output_sha256"] == A and fast["exact_copy"] is None


def test_verify_json_carries_it_without_seconds_only_when_measured():
    rep = VerifyReport("art", "artifact", (), (), (), (), None)
    assert "fidelity" not in rep.to_json() and not rep.fidelity.measured
    rep = dataclasses.replace(rep, fidelity=_report())
    assert rep.to_json()["fidelity"] == _report().to_json() and "seconds" not in rep.to_json()["fidelity"]
    off = FidelityReport.not_measured("not requested (verify --source SRC --fidelity measures it)")
    assert off.to_json() == {"requested": False, "measured": False,
                             "detail": "not requested (verify --source SRC --fidelity measures it)"}


@pytest.mark.parametrize("kw", [{}, {"mode": "fast", "second": False}, {"copy": False, "cluster": False},
                                {"mode": "fast", "copy": False}])
def test_json_round_trip(kw):
    rep = _report(**kw)
    for obj in (rep.to_json(seconds=True), json.loads(json.dumps(rep.to_json(seconds=True)))):
        back = FidelityReport.from_json(obj)
        assert back == rep and back.to_json() == rep.to_json()
    off = FidelityReport.not_measured("why")
    assert FidelityReport.from_json(json.loads(json.dumps(off.to_json()))) == off


def test_the_parts_are_frozen_and_derived_figures_follow_the_runs():
    rep = _report()
    with pytest.raises(dataclasses.FrozenInstanceError):
        rep.mode = "fast"
    with pytest.raises(dataclasses.FrozenInstanceError):
        rep.logits.kl_mean = 0.0
    assert rep.placements == ("cpu:0 (one CPU owner)", "c.json (2 gloo ranks)") and rep.second.response_sha256 == B
    same = dataclasses.replace(rep, runs=(rep.runs[0], PlacementRun("b", A, R)))
    assert same.identical and not rep.identical and _report(second=False).identical is None


@pytest.mark.parametrize("edit, says", [
    (lambda j: j.pop("mode"), "mode is None"),
    (lambda j: j.update(mode="approx"), "mode is 'approx'"),
    (lambda j: j.update(eval_tokens="12"), "eval_tokens is '12'"),
    (lambda j: j.update(kl_mean=True), "kl_mean is True"),
    (lambda j: j["layers"][0].pop("moe_rel_error"), "moe_rel_error is None"),
    (lambda j: j.update(placements=["one"]), "placements names 1 placements for 2 runs"),
    (lambda j: j["exact_copy"].update(passes=None), "passes is None"),
    (lambda j: j.update(moe_output_sha256=None), "moe_output_sha256 is None"),
])
def test_a_damaged_record_is_one_line(edit, says):
    j = json.loads(json.dumps(_report().to_json()))
    edit(j)
    with pytest.raises(CorruptDataError) as ei:
        FidelityReport.from_json(j)
    assert says in ei.value.one_line() and ei.value.one_line().startswith("fidelity record: ")
