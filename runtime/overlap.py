"""Overlapped owner submission (cold branches' copies overlap compute), off by default.

With ``overlap=True`` ``execute.run_layer`` submits a layer's owner branches
like this:

* the cold branches (every owner but the home one) go to the pool first, in
  name order; each is handed a ``Readiness``, a single-shot signal the branch
  fires once its input is staged (its host-to-device copy enqueued; an owner
  without ``run_slots_staged`` has its input as soon as it starts);
* the next branch is released only when the one before it has fired, so the
  copies are enqueued in submission order, but nothing waits for any
  branch's compute: no host-wide synchronize between owners (a CUDA owner
  orders its compute after its copy with CUDA events on its own streams);
* the home (hot) branch runs last, on the calling thread (no pool hop);
* every branch is joined before the call returns; the first error in
  submission order is raised. A branch that fails before it fires wakes the
  waiter with that failure (the hot branch is then never started), and one
  that ends without firing releases it as well: the wait cannot deadlock.

``BranchTiming`` records (host clock) when each branch started, fired and
ended; ``overlap_stats`` turns two owners' timings into the two figures the
issue asks for: the share of the slower owner's busy time during which both
owners are busy, and the gap between their start times.

    ready = Readiness()
    ready.fire()            # once; later fire()/fail() calls are ignored
    ready.wait(future)      # returns, or raises the branch's failure
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as _wait
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from ds4quant.runtime.mode import Mode


class Readiness:
    """A single-shot readiness signal: the first ``fire`` or ``fail`` wins."""

    def __init__(self) -> None:
        self._f: Future = Future()
        self._lock = threading.Lock()
        self.fired_at: Optional[float] = None

    @property
    def done(self) -> bool:
        return self._f.done()

    def fire(self) -> bool:
        """Signal that the input is staged; True if this call fired it."""
        with self._lock:
            if self._f.done():
                return False
            self.fired_at = time.perf_counter()
            self._f.set_result(True)
            return True

    def fail(self, exc: BaseException) -> bool:
        """Signal a failure before readiness; True if this call set it."""
        with self._lock:
            if self._f.done():
                return False
            self._f.set_exception(exc)
            return True

    def wait(self, branch: Optional[Future] = None, timeout: Optional[float] = None) -> None:
        """Block until fired (return), failed (raise the failure) or, when
        ``branch`` is given, until that branch ends (return, or raise its
        error). ``timeout`` seconds: TimeoutError."""
        waitees = [self._f] if branch is None else [self._f, branch]
        done, _ = _wait(waitees, timeout=timeout, return_when=FIRST_COMPLETED)
        if not done:
            raise TimeoutError(f"readiness not signalled within {timeout} s")
        if self._f.done():
            self._f.result()  # raises the branch's failure
            return
        branch.result()  # the branch ended first: raises its error, or it simply never fired


@dataclass(frozen=True)
class BranchTiming:
    """One owner branch of one layer call, host perf_counter seconds."""

    owner: str
    start: float
    ready: float  # when its Readiness fired (start when it never did)
    end: float
    slots: int

    @property
    def busy(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class OverlapStats:
    """Two owners of one call: overlap share and start gap (seconds)."""

    share: float  # both busy / busy time of the slower owner
    start_gap: float  # |start(a) - start(b)|
    busy: tuple[float, float]


def overlap_stats(a: BranchTiming, b: BranchTiming) -> OverlapStats:
    both = max(0.0, min(a.end, b.end) - max(a.start, b.start))
    slow = max(a.busy, b.busy)
    return OverlapStats(both / slow if slow > 0 else 0.0, abs(a.start - b.start), (a.busy, b.busy))


def run_staged(owner, layer: int, x, expert_ids, mode: Mode, ready: Readiness):
    """One branch through the owner contract's staged call: owners with
    ``run_slots_staged`` fire ``ready`` themselves; the rest have their input
    (a private copy of the rows) when they start."""
    staged = getattr(owner, "run_slots_staged", None)
    if staged is None:
        ready.fire()
        return owner.run_slots(layer, x, expert_ids, mode)
    return staged(layer, x, expert_ids, mode, ready)


def submit_overlapped(order: Sequence[str], branch: Callable[[str, Readiness], object], pool,
                      timings: Optional[list] = None) -> list:
    """Run ``branch(name, ready)`` for every name of ``order`` (the home owner
    last) as the module docstring says; results in ``order``'s order."""
    def guarded(name: str, ready: Readiness):
        t0 = time.perf_counter()
        try:
            res = branch(name, ready)
        except BaseException as exc:
            ready.fail(exc)  # wakes a waiter that is still waiting for this branch's input
            raise
        finally:
            ready.fire()  # a branch that never fired releases the next one (no-op after fail)
            if timings is not None:
                t1 = time.perf_counter()
                timings.append((name, t0, ready.fired_at or t0, t1))
        return res

    *cold, hot = order
    futures: list[Future] = []
    early: Optional[BaseException] = None
    for name in cold:
        ready = Readiness()
        fut = pool.submit(guarded, name, ready)
        futures.append(fut)
        try:
            ready.wait(fut)
        except BaseException as exc:  # failed before its input was staged: start nothing more
            early = exc
            break
    hot_res = hot_exc = None
    if early is None:
        try:
            hot_res = guarded(hot, Readiness())
        except BaseException as exc:
            hot_exc = exc
    results, first = [], early
    for fut in futures:  # join every started branch before any error leaves
        try:
            results.append(fut.result())
        except BaseException as exc:
            if first is None:
                first = exc
    if first is None:
        first = hot_exc
    if first is not None:
        raise first
    results.append(hot_res)
    return results


def timings_of(raw: Sequence[tuple], slots: dict) -> list[BranchTiming]:
    """BranchTiming records from ``submit_overlapped``'s raw tuples."""
    return [BranchTiming(n, t0, tr, t1, int(slots.get(n, 0))) for n, t0, tr, t1 in raw]
