"""verify --fidelity says what it does: its ProgressEvents, in order, change no figure."""

from __future__ import annotations

from pathlib import Path

import pytest

from ds4quant.progress import EventKind

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[2]
COPY = ROOT / "samples" / "ds4-copy"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from ds4quant.convert import convert
    from ds4quant.verify import verify

    art = tmp_path_factory.mktemp("fidprog") / "mx"
    convert(COPY, art, "mxfp4", force=True, command=["test"])
    events = []
    with_events = verify(art, source=COPY, fidelity=True, protocol="exact-copy", progress=events.append)
    without = verify(art, source=COPY, fidelity=True, protocol="exact-copy")
    return events, with_events, without


def test_events_come_in_the_order_of_the_measurement(runs):
    from ds4quant.verify.fidelity_progress import plan_passes

    events, rep, _ = runs
    decode = [e for e in events if e.stage == "decode"]
    assert [e.done for e in decode] == list(range(1, len(rep.tensors) + 1))
    assert all(e.kind is EventKind.STEP for e in decode)
    assert decode[-1].pending == ("the fidelity measurement",) and decode[-1].eta is None
    fid = [e for e in events if e.stage == "fidelity"]
    assert events.index(fid[0]) > events.index(decode[-1])  # the decode stage runs first
    label = rep.fidelity.runs[0].label
    planned = [name for name, _ in plan_passes([label], exact_copy=True)]
    assert [e.item for e in fid if e.kind is EventKind.STEP] == planned
    assert [e.item for e in fid if e.kind is EventKind.PHASE] == [
        "loading the reference model (transformers, fp32)",
        "building the candidate (dense tensors from the artifact)",
        f"loading the runtime [{label}]"]
    assert fid[0].kind is EventKind.PHASE and fid[-1].kind is EventKind.DONE
    assert fid[-1].done == fid[-1].total == len(planned)
    # a tick per decoder layer of each model pass, named after the pass that is running
    ticks = [e for e in fid if e.kind is EventKind.TICK]
    assert ticks[0].item == "reference logits: layer 1/4" and ticks[3].item == "reference logits: layer 4/4"
    assert {e.item.rsplit(": layer ", 1)[0] for e in ticks} == {n for n in planned if not n.startswith("local")}
    # no event says nothing is left before the end
    assert all(e.eta != 0.0 for e in events[:-2])
    assert [e.elapsed for e in fid] == sorted(e.elapsed for e in fid)


def test_the_progress_hooks_change_no_figure(runs):
    _, a, b = runs
    fa, fb = a.fidelity, b.fidelity
    assert fa.runs[0].moe_output_sha256 == fb.runs[0].moe_output_sha256
    assert fa.runs[0].response_sha256 == fb.runs[0].response_sha256
    assert fa.logits == fb.logits and fa.layers == fb.layers and fa.exact_copy == fb.exact_copy
