"""Overlapped owner submission (runtime/overlap.py) on the CPU.

Ordering (cold branches first, each released only after the one before it
fired, the hot branch on the calling thread), single-shot readiness, failure
propagation without deadlock, and on == off bytes with real owners (the
numba CPU owner and the torch-cpu owner, exact and fast)."""

from __future__ import annotations

import importlib.util
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4quant.runtime.execute import run_layer  # noqa: E402
from ds4quant.runtime.overlap import (BranchTiming, Readiness, overlap_stats,  # noqa: E402
                                      submit_overlapped)

from . import _synth as S  # noqa: E402

HAVE_CPU = importlib.util.find_spec("ds4quant.runtime.owners.cpu") is not None
H = 4


class Logged:
    """Expert e's output is e in every feature; logs (event, owner, thread)."""

    def __init__(self, name, log, staged=False, fail_before=False, fail_after=False, sleep=0.0):
        self.identity = name
        self.log = log
        self.sleep = sleep
        self.fail_before, self.fail_after = fail_before, fail_after
        if staged:
            self.run_slots_staged = self._staged

    def run_slots(self, layer, x, ids, mode):
        self.log.append(("start", self.identity, threading.get_ident()))
        time.sleep(self.sleep)
        self.log.append(("end", self.identity, threading.get_ident()))
        return np.repeat(np.asarray(ids, np.float32)[:, None], np.shape(x)[1], axis=1)

    def _staged(self, layer, x, ids, mode, ready):
        self.log.append(("stage", self.identity, threading.get_ident()))
        if self.fail_before:
            raise RuntimeError(f"{self.identity} failed staging")
        time.sleep(self.sleep)
        ready.fire()
        self.log.append(("fired", self.identity, threading.get_ident()))
        if self.fail_after:
            raise RuntimeError(f"{self.identity} failed computing")
        return self.run_slots(layer, x, ids, mode)


def _call(owners, table, overlap=True, timings=None, home=None):
    idx = torch.tensor([[0, 1, 2, 3]])
    return run_layer(0, torch.zeros((1, H)), idx, torch.ones((1, 4)), owners, table, "fast",
                     ThreadPoolExecutor(4), overlap=overlap, timings=timings, home=home)


def _in_thread(fn, timeout=10.0):
    """fn() on a thread; (returned, raised) or a failed test when it hangs."""
    box = {}

    def go():
        try:
            box["ret"] = fn()
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            box["exc"] = exc

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "overlapped submission deadlocked"
    return box.get("ret"), box.get("exc")


def test_readiness_is_single_shot():
    r = Readiness()
    assert r.fire() and not r.fire() and not r.fail(RuntimeError("late"))
    r.wait()  # fired: the late failure is ignored
    r2 = Readiness()
    assert r2.fail(ValueError("early")) and not r2.fire()
    with pytest.raises(ValueError, match="early"):
        r2.wait()
    with pytest.raises(TimeoutError):
        Readiness().wait(timeout=0.01)


def test_cold_first_released_after_fire_hot_on_the_caller_thread():
    log = []
    owners = {"a": Logged("a", log, staged=True, sleep=0.05), "b": Logged("b", log, staged=True, sleep=0.05),
              "home": Logged("home", log)}
    timings = []
    res = _call(owners, ["a", "b", "home", "home"], timings=timings, home="home")
    assert res.out[0, 0].item() == 0 + 1 + 2 + 3
    ev = [(e, o) for e, o, _ in log]
    # a stages and fires before b stages; b fires before home starts
    assert ev.index(("fired", "a")) < ev.index(("stage", "b")) < ev.index(("fired", "b")) < ev.index(("start", "home"))
    home_thread = {t for e, o, t in log if o == "home"}
    assert home_thread == {threading.get_ident()}
    assert {t for e, o, t in log if o == "a"}.isdisjoint(home_thread)
    assert [t.owner for t in timings] and {t.owner for t in timings} == {"a", "b", "home"}
    for t in timings:
        assert t.start <= t.ready <= t.end and t.slots in (1, 2)
    # the cold branches were still running when home started: they overlap
    b = next(t for t in timings if t.owner == "b")
    h = next(t for t in timings if t.owner == "home")
    st = overlap_stats(b, h)
    assert st.share > 0 and st.start_gap >= 0.05 * 0.9 and h.start >= b.ready


def test_plain_owner_is_ready_when_it_starts_and_results_match_off():
    log = []
    owners = {"a": Logged("a", log, sleep=0.02), "b": Logged("b", log)}
    on = _call(owners, ["a", "a", "b", "b"], overlap=True, home="b")
    off = _call(owners, ["a", "a", "b", "b"], overlap=False, home="b")
    assert on.out.numpy().tobytes() == off.out.numpy().tobytes()
    assert on.slots.numpy().tobytes() == off.slots.numpy().tobytes()


def test_failure_before_fire_propagates_and_hot_never_starts():
    log = []
    owners = {"a": Logged("a", log, staged=True, fail_before=True), "home": Logged("home", log)}
    _, exc = _in_thread(lambda: _call(owners, ["a", "a", "home", "home"], home="home"))
    assert isinstance(exc, RuntimeError) and "a failed staging" in str(exc)
    assert not any(o == "home" for _, o, _ in log)


def test_failure_after_fire_and_hot_failure_propagate_after_joining():
    log = []
    owners = {"a": Logged("a", log, staged=True, fail_after=True, sleep=0.02), "home": Logged("home", log)}
    _, exc = _in_thread(lambda: _call(owners, ["a", "a", "home", "home"], home="home"))
    assert isinstance(exc, RuntimeError) and "a failed computing" in str(exc)
    assert ("end", "home") in [(e, o) for e, o, _ in log]  # the hot branch ran, then the cold error came out

    class HotBoom(Logged):
        def run_slots(self, *a):
            raise KeyError("home died")

    log.clear()
    owners = {"a": Logged("a", log, staged=True, sleep=0.05), "home": HotBoom("home", log)}
    _, exc = _in_thread(lambda: _call(owners, ["a", "a", "home", "home"], home="home"))
    assert isinstance(exc, KeyError)
    assert ("end", "a") in [(e, o) for e, o, _ in log]  # the cold branch was joined before the error left


def test_a_branch_that_never_fires_does_not_deadlock():
    def branch(name, ready):
        if name == "cold":
            return "cold result"  # never calls ready.fire(): the guard releases the waiter
        return "hot result"

    ret, exc = _in_thread(lambda: submit_overlapped(["cold", "hot"], branch, ThreadPoolExecutor(2)))
    assert exc is None and ret == ["cold result", "hot result"]


def test_overlap_stats():
    a = BranchTiming("a", 0.0, 0.0, 10.0, 1)
    b = BranchTiming("b", 2.0, 2.0, 5.0, 1)
    st = overlap_stats(a, b)
    assert st.share == pytest.approx(0.3) and st.start_gap == 2.0
    assert overlap_stats(a, BranchTiming("c", 11.0, 11.0, 12.0, 1)).share == 0.0


@pytest.mark.parametrize("mode", ["exact", "fast"])
@pytest.mark.parametrize("qtype", ["rocmfp2", "rocmfp3_mix"])
def test_real_owners_give_the_same_bytes_on_and_off(mode, qtype):
    from ds4quant.runtime.owners.torch_owner import TorchOwner

    experts = (0, 1, 2, 3, 4, 5)
    cold_ids, hot_ids = (0, 2, 4), (1, 3, 5)
    if HAVE_CPU:
        from ds4quant.runtime.owners.cpu import CpuOwner

        cold = CpuOwner("cpu:0")
    else:
        cold = TorchOwner("cpu", identity="torch-cpu:9")
    hot = TorchOwner("cpu", identity="torch-cpu:1")
    for owner, ids in ((cold, cold_ids), (hot, hot_ids)):
        stacks, entries = S.layer_stacks(qtype, 1, ids)
        for st in stacks.values():
            owner.add_stack(st)
        for t, ent in entries.items():
            owner.register_books(t, ids, ent)
    table = ["cold" if e in cold_ids else "hot" for e in experts]
    owners = {"cold": cold, "hot": hot}
    x = torch.from_numpy(S.tokens(3, seed=4))
    idx = torch.tensor([[0, 1, 5], [2, 3, 4], [4, 1, 0]])
    w = torch.tensor([[0.5, 0.3, 0.2], [0.25, 0.25, 0.5], [0.1, 0.6, 0.3]])
    outs = []
    with ThreadPoolExecutor(2) as pool:
        for overlap in (False, True, False, True):
            tm = []
            r = run_layer(1, x, idx, w, owners, table, mode, pool, home="hot", overlap=overlap, timings=tm)
            outs.append(r.out.numpy().tobytes() + r.slots.numpy().tobytes())
            assert sorted(t.owner for t in tm) == ["cold", "hot"]
    single = {"one": TorchOwner("cpu", identity="torch-cpu:2")}
    stacks, entries = S.layer_stacks(qtype, 1, experts)
    for st in stacks.values():
        single["one"].add_stack(st)
    for t, ent in entries.items():
        single["one"].register_books(t, experts, ent)
    ref = run_layer(1, x, idx, w, single, ["one"] * 6, mode)
    assert len(set(outs)) == 1
    if mode == "exact":  # exact: any split, any owner kind, on or off: the one-owner bytes
        assert outs[0] == ref.out.numpy().tobytes() + ref.slots.numpy().tobytes()
    for o in (cold, hot, single["one"]):
        o.close()


def test_a_worker_fires_once_its_request_is_sent():
    import os
    from pathlib import Path

    from ds4quant.runtime.owners.worker import WorkerOwner
    from tests.runtime._fake_owner import make_layer

    root = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    w = WorkerOwner("worker:0", owner="tests.runtime._fake_owner:FakeOwner", env=env, timeout_s=10.0)
    try:
        for st in make_layer(0, (0, 1), 8, 4):
            w.add_stack(st)
        log = []
        owners = {"worker:0": w, "home": Logged("home", log)}
        table = ["worker:0", "worker:0", "home", "home"]
        idx = torch.tensor([[0, 1, 2, 3]])
        x = torch.from_numpy(np.random.default_rng(0).standard_normal((1, 8)).astype(np.float32))
        outs = []
        with ThreadPoolExecutor(2) as pool:
            for overlap in (True, False):
                tm = []
                outs.append(run_layer(0, x, idx, torch.ones((1, 4)), owners, table, "exact", pool, home="home",
                                      overlap=overlap, timings=tm).out.numpy().tobytes())
                if overlap:
                    wt = next(t for t in tm if t.owner == "worker:0")
                    ht = next(t for t in tm if t.owner == "home")
                    assert wt.start < wt.ready < wt.end and ht.start >= wt.ready
        assert outs[0] == outs[1]
    finally:
        w.close()
