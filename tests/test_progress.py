"""The one progress event and its moving-window ETA."""

from __future__ import annotations

import dataclasses

import pytest

from ds4quant.progress import EtaWindow, EventKind, Meter, ProgressEvent


def test_no_eta_while_warming_up_then_the_rate_of_the_window():
    w = EtaWindow(total_work=10, window=3, warmup=2)
    assert w.warming_up and w.eta is None
    w.add(1, 1.0)
    assert w.warming_up and w.eta is None
    w.add(2, 2.0)  # 1 unit/s so far, 8 left
    assert not w.warming_up and w.eta == pytest.approx(8.0)


def test_a_slow_first_item_leaves_the_window():
    w = EtaWindow(total_work=10, window=2, warmup=1)
    w.add(1, 100.0)  # compile + cold cache
    assert w.eta == pytest.approx(9 * 100.0)
    w.add(2, 101.0)
    w.add(3, 102.0)  # the window (2 items) no longer holds the slow one
    assert w.eta == pytest.approx(7 * 1.0)
    # a whole-run average would still say ~34 s per unit
    assert w.eta < 7 * 102.0 / 3


def test_eta_is_zero_when_done_and_unknown_without_progress():
    w = EtaWindow(total_work=2, window=4, warmup=1)
    w.add(0, 1.0)
    assert w.eta is None  # no work done in the window: no rate
    w.add(2, 2.0)
    assert w.eta == 0.0
    with pytest.raises(ValueError):
        EtaWindow(1, window=0)


def test_meter_counts_items_weighs_work_and_times_them():
    t = iter([0.0, 1.0, 3.0, 4.0])
    m = Meter("encode", total=3, unit="tensor", total_work=40, window=8, warmup=2, clock=lambda: next(t))
    e1 = m.step("a", work=10, qtype="rocmfp3")
    assert (e1.stage, e1.done, e1.total, e1.unit, e1.item, e1.elapsed) == ("encode", 1, 3, "tensor", "a", 1.0)
    assert e1.warming_up and e1.eta is None and e1.detail["qtype"] == "rocmfp3"
    e2 = m.step("b", work=10)
    assert not e2.warming_up and e2.eta == pytest.approx(20 / (20 / 3.0))  # 20 work left at 20/3 per s
    e3 = m.step("c", work=20)
    assert e3.done == 3 and e3.eta == 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        e3.done = 4
    with pytest.raises(TypeError):
        e3.detail["x"] = 1  # read-only detail
    assert isinstance(e3, ProgressEvent)


def _clock(*ts):
    it = iter(ts)
    return lambda: next(it)


def test_eta_is_never_zero_while_items_or_phases_remain():
    m = Meter("calibrate", total=2, unit="layer", total_work=10, warmup=1,
              clock=_clock(0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0),
              then=("sensitivity pass", "writing sensitivity.json"))
    tick = m.tick("layer 0: sequence 1/2", work=5)
    assert tick.kind is EventKind.TICK and tick.done == 0 and tick.eta is not None and tick.eta > 0
    # the work estimate ran out before the items did: no rate, not "0 s left"
    a = m.step("layer 0", work=5)
    assert a.kind is EventKind.STEP and a.done == 1 and a.eta is None
    b = m.step("layer 1", work=0)
    assert b.done == b.total and b.eta is None  # two phases still to come
    assert b.pending == ("sensitivity pass", "writing sensitivity.json")
    p = m.phase("sensitivity pass", tensors=12)
    assert (p.kind, p.item, p.eta, p.pending, p.detail["tensors"]) == (
        EventKind.PHASE, "sensitivity pass", None, ("writing sensitivity.json",), 12)
    w = m.phase("writing sensitivity.json")
    assert w.pending == () and w.eta is None and w.elapsed == 5.0
    d = m.finish()
    assert (d.kind, d.eta, d.elapsed, d.done, d.total) == (EventKind.DONE, 0.0, 6.0, 2, 2)


def test_the_last_step_says_zero_only_when_nothing_is_pending():
    m = Meter("encode", total=2, unit="tensor", warmup=1, clock=_clock(0.0, 1.0, 2.0))
    assert m.step("a").eta == pytest.approx(1.0)
    last = m.step("b")
    assert last.eta == 0.0 and last.pending == () and last.kind is EventKind.STEP
    # an event made the old positional way still is a STEP with nothing pending
    ev = ProgressEvent("encode", 1, 2, "tensor", "a", 1.0, None, True)
    assert ev.kind is EventKind.STEP and ev.pending == ()
