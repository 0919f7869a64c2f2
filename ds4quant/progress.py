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
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping, Optional

DEFAULT_WINDOW = 8
DEFAULT_WARMUP = 2


@dataclass(frozen=True)
class ProgressEvent:
    """One finished item of a long stage.

    stage: "encode", "measure", "calibrate", ...; done/total: items (unit
    says what an item is); item: its name; elapsed: seconds since the stage
    began; eta: seconds left (None while warming up or when nothing is left
    to estimate); detail: stage-specific figures (qtype, bytes, sqnr_db, ...).
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
    """Makes the events of one stage: counts items and work, times them, keeps the ETA window."""

    def __init__(self, stage: str, total: int, unit: str, total_work: Optional[float] = None,
                 window: int = DEFAULT_WINDOW, warmup: int = DEFAULT_WARMUP,
                 clock: Callable[[], float] = time.perf_counter):
        self.stage, self.total, self.unit = stage, int(total), unit
        self._clock = clock
        self._t0 = clock()
        self._done = 0
        self._work = 0.0
        self._eta = EtaWindow(total if total_work is None else total_work, window, warmup)

    def step(self, item: str, work: float = 1.0, **detail: object) -> ProgressEvent:
        """Count one finished item (``work`` units of the total) and return its event."""
        self._done += 1
        self._work += work
        elapsed = self._clock() - self._t0
        self._eta.add(self._work, elapsed)
        return ProgressEvent(self.stage, self._done, self.total, self.unit, item, elapsed, self._eta.eta,
                             self._eta.warming_up, MappingProxyType(dict(detail)))
