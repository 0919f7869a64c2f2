"""One progress event for every long command (convert, adaptive measure, calibrate).

Library code never prints: a long function takes ``progress: ProgressFn`` and
calls it with a ``ProgressEvent`` after each item; the CLI's printer formats
events on a TTY and stays silent under ``--json``.

    meter = Meter("encode", total=12, unit="tensor", total_work=3_000_000)
    ev = meter.step("blk.0.ffn_down_exps.weight", work=250_000, qtype="rocmfp3")
    ev.done, ev.total, ev.eta            # 1, 12, None (warming up)

The ETA is taken over a moving window of the last ``window`` items, so a
slow first item (numba compiling, cold page cache) stops counting once the
window has moved past it; until ``warmup`` items are done there is no ETA
and ``warming_up`` says why.

Besides counted items (``step``, kind ``STEP``) a stage may report work
inside the current item (``tick``: the ETA moves, ``done`` does not),
uncounted phases (``phase``: "writing sensitivity.json", a model load) and
its end (``finish``, kind ``DONE``). Phases that follow the counted items
are named up front with ``then=`` so the last item's event does not claim
that nothing is left:

    meter = Meter("calibrate", total=4, unit="layer", total_work=4 * 900,
                  then=("sensitivity pass", "writing sensitivity.json"))
    meter.tick("layer 0: sequence 1/3", work=300, tokens=300)   # inside an item
    meter.step("layer 0", work=600, tokens=900)                 # item 1/4 done
    ...
    ev = meter.step("layer 3", work=900)   # ev.eta is None, ev.pending names both phases
    meter.phase("sensitivity pass")        # ev.kind is PHASE, eta None
    meter.phase("writing sensitivity.json")
    meter.finish()                         # DONE: eta 0.0, elapsed the stage's seconds

The rule printers rely on: ``eta == 0.0`` only on DONE or on the last STEP
with no phase pending; while work remains it is positive or None.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Callable, Iterable, Mapping, Optional

DEFAULT_WINDOW = 8
DEFAULT_WARMUP = 2


class EventKind(str, Enum):
    """What an event reports; printers format each kind their own way."""

    STEP = "step"    # a counted item finished (done/total moved)
    TICK = "tick"    # work inside the current item: the ETA moves, done does not
    PHASE = "phase"  # an uncounted phase began; item names it
    DONE = "done"    # the stage finished; elapsed is its total


@dataclass(frozen=True)
class ProgressEvent:
    """One finished item of a long stage.

    stage: "encode", "measure", "calibrate", ...; done/total: items (unit
    says what an item is); item: its name; elapsed: seconds since the stage
    began; eta: seconds left (None while warming up or when nothing is left
    to estimate); detail: stage-specific figures (qtype, bytes, sqnr_db, ...);
    kind: see EventKind; pending: uncounted phases still to come after the
    counted items (``Meter(then=...)``) that have not begun.
    """

    stage: str
    done: int
    total: int
    unit: str
    item: str
    elapsed: float
    eta: Optional[float]
    warming_up: bool
    detail: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    kind: EventKind = EventKind.STEP
    pending: tuple[str, ...] = ()


ProgressFn = Callable[[ProgressEvent], None]


class EtaWindow:
    """Seconds left from the rate over the last ``window`` samples.

    Feed cumulative (work done, elapsed seconds) after each item; ``eta``
    is None until ``warmup`` samples are in or while the window shows no
    progress. Work is any additive unit (items, source bytes).
    """

    def __init__(self, total_work: float, window: int = DEFAULT_WINDOW, warmup: int = DEFAULT_WARMUP):
        if window < 1 or warmup < 1:
            raise ValueError(f"window and warmup must be >= 1, got {window}, {warmup}")
        self.total_work = float(total_work)
        self.warmup = warmup
        # window + 1 points span ``window`` items; the start point (0, 0) is the first
        self._pts: deque[tuple[float, float]] = deque([(0.0, 0.0)], maxlen=window + 1)
        self._n = 0

    def add(self, work_done: float, elapsed: float) -> None:
        self._pts.append((float(work_done), float(elapsed)))
        self._n += 1

    @property
    def warming_up(self) -> bool:
        return self._n < self.warmup

    @property
    def eta(self) -> Optional[float]:
        if self.warming_up:
            return None
        (w0, t0), (w1, t1) = self._pts[0], self._pts[-1]
        left = self.total_work - w1
        if left <= 0:
            return 0.0
        if w1 <= w0 or t1 <= t0:
            return None
        return left * (t1 - t0) / (w1 - w0)


class Meter:
    """Makes the events of one stage: counts items and work, times them, keeps the ETA window.

    then: names of the uncounted phases that follow the counted items (each
    begun with ``phase``); while one is pending no event says ETA 0.
    """

    def __init__(self, stage: str, total: int, unit: str, total_work: Optional[float] = None,
                 window: int = DEFAULT_WINDOW, warmup: int = DEFAULT_WARMUP,
                 clock: Callable[[], float] = time.perf_counter, *, then: Iterable[str] = ()):
        self.stage, self.total, self.unit = stage, int(total), unit
        self._clock = clock
        self._t0 = clock()
        self._done = 0
        self._work = 0.0
        self._eta = EtaWindow(total if total_work is None else total_work, window, warmup)
        self._pending = tuple(then)

    @property
    def pending(self) -> tuple[str, ...]:
        return self._pending

    def _event(self, kind: EventKind, item: str, work: Optional[float], detail: dict) -> ProgressEvent:
        elapsed = self._clock() - self._t0
        if work is None:  # a phase or the end: no work to count, no rate to quote
            eta = 0.0 if kind is EventKind.DONE else None
        else:
            self._work += work
            self._eta.add(self._work, elapsed)
            eta = self._eta.eta
            # work weights are estimates: a window that has run out of work while
            # items remain knows no rate, and pending phases are work too
            if eta == 0.0 and (self._done < self.total or self._pending):
                eta = None
        return ProgressEvent(self.stage, self._done, self.total, self.unit, item, elapsed, eta,
                             self._eta.warming_up, MappingProxyType(detail), kind, self._pending)

    def step(self, item: str, work: float = 1.0, **detail: object) -> ProgressEvent:
        """Count one finished item (``work`` units of the total) and return its event."""
        self._done += 1
        return self._event(EventKind.STEP, item, work, dict(detail))

    def tick(self, item: str, work: float, **detail: object) -> ProgressEvent:
        """Work inside the current item (``item`` names the sub-step): the ETA moves, ``done`` does not."""
        return self._event(EventKind.TICK, item, work, dict(detail))

    def phase(self, name: str, **detail: object) -> ProgressEvent:
        """An uncounted phase begins (``name`` is dropped from the pending ones); its ETA is unknown."""
        self._pending = tuple(p for p in self._pending if p != name)
        return self._event(EventKind.PHASE, name, None, dict(detail))

    def finish(self, **detail: object) -> ProgressEvent:
        """The stage is over: a DONE event whose ``elapsed`` is the stage's seconds."""
        self._pending = ()
        return self._event(EventKind.DONE, self.stage, None, dict(detail))
