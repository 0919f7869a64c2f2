"""Error figures: one pass of sums, one record, one SQNR.

``error_sums(x, y, w)``: float64 sums between a source matrix and its decoded
copy; rows are summed in parallel into per-row partials that are then added
in row order, so the figures never depend on the thread count. Memory stays at
the two input matrices (no float64 temporaries).

``sqnr_db(sse, ssx)``: the one SQNR formula, ``10 log10(ssx / sse)``, with one
convention for the edge cases (everything else that prints an SQNR uses it):

- non-finite ``sse`` or ``ssx`` (a decode gave NaN/Inf): ``nan``, undefined;
- zero error (``sse == 0``, zero signal or not): ``+inf``, exact;
- zero signal with some error (``ssx == 0 < sse``): ``-inf``;
- otherwise the finite value.

``ErrorFigures``: the error record of one tensor or group that verify,
reports and publish read (``sqnr_db`` is None for a non-finite decode).

    s = error_sums(x, y)
    fig = ErrorFigures.of(s)
    fig.sqnr_db, fig.rel_mse, fig.cosine
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numba
import numpy as np


@dataclass(frozen=True)
class Sums:
    """sse = sum (x-y)^2, ssx = sum x^2, ssy = sum y^2, dot = sum x*y;
    wsse/wssx: the same weighted per column by w (None without w);
    max_abs: max |x-y|; finite: every y finite; n: element count."""

    n: int
    sse: float
    ssx: float
    ssy: float
    dot: float
    max_abs: float
    finite: bool
    wsse: Optional[float] = None
    wssx: Optional[float] = None

    def plus(self, o: "Sums") -> "Sums":
        """The sums of both parts (weighted sums only when both parts have them)."""
        both = self.wsse is not None and o.wsse is not None
        return Sums(self.n + o.n, self.sse + o.sse, self.ssx + o.ssx, self.ssy + o.ssy, self.dot + o.dot,
                    max(self.max_abs, o.max_abs), self.finite and o.finite,
                    self.wsse + o.wsse if both else None, self.wssx + o.wssx if both else None)


def sqnr_db(sse: float, ssx: float) -> float:
    """10 log10(ssx / sse) in dB; nan / +inf / -inf by the module's edge convention."""
    if not (math.isfinite(sse) and math.isfinite(ssx)):
        return math.nan
    if sse <= 0:
        return math.inf
    if ssx <= 0:
        return -math.inf
    return 10.0 * math.log10(ssx / sse)


def finite_or_none(v: Optional[float]) -> Optional[float]:
    return v if v is not None and math.isfinite(v) else None


@dataclass(frozen=True)
class ErrorFigures:
    """Error of one tensor or group (float64 sums over every weight).

    origin: "source" (decoded and compared now) or "manifest" (convert-time
    figures; no max abs / cosine). sse/ssx: sum of squared error / of squared
    source values; ssy: of squared decoded values; dot: source . decoded;
    wsse/wssx: the same weighted by importance (None without an imatrix).
    expert_sqnr_db: per local expert of a stack (source origin only).
    """

    origin: str
    n: int
    sse: float
    ssx: float
    wsse: Optional[float] = None
    wssx: Optional[float] = None
    ssy: Optional[float] = None
    dot: Optional[float] = None
    max_abs: Optional[float] = None
    finite: bool = True
    expert_sqnr_db: tuple[float, ...] = ()
    # experts of a stack the importance matrix has no data for (the calibration never routed a
    # token to them): wsse/wssx cover the other experts only, and these experts' unweighted
    # error is kept apart, so the weighted figure neither drops them silently nor goes missing
    unreached: tuple[int, ...] = ()
    unreached_sse: float = 0.0
    unreached_ssx: float = 0.0

    @classmethod
    def of(cls, s: Sums, expert_sqnr_db: tuple[float, ...] = ()) -> "ErrorFigures":
        """Figures measured now (origin "source") from ``error_sums``."""
        return cls("source", s.n, s.sse, s.ssx, s.wsse, s.wssx, s.ssy, s.dot, s.max_abs, s.finite,
                   tuple(expert_sqnr_db))

    @property
    def exact(self) -> bool:
        return self.finite and self.sse == 0.0 and (self.origin == "source" or self.ssx > 0)

    @property
    def rel_mse(self) -> Optional[float]:
        if not self.finite:
            return None
        return self.sse / self.ssx if self.ssx > 0 else (0.0 if self.sse == 0 else math.inf)

    @property
    def sqnr_db(self) -> Optional[float]:
        """inf when exact, None when undefined (non-finite decode)."""
        return sqnr_db(self.sse, self.ssx) if self.finite else None

    @property
    def weighted_rel_error(self) -> Optional[float]:
        if self.wsse is None or not self.wssx:
            return None
        return self.wsse / self.wssx

    @property
    def cosine(self) -> Optional[float]:
        if self.dot is None or self.ssy is None or not self.finite:
            return None
        if self.ssx == 0 and self.ssy == 0:
            return 1.0
        if self.ssx == 0 or self.ssy == 0:
            return 0.0
        return self.dot / math.sqrt(self.ssx * self.ssy)

    @property
    def unreached_rel_mse(self) -> Optional[float]:
        """Unweighted relative MSE over the unreached experts (None when there are none)."""
        if not self.unreached or not self.unreached_ssx:
            return None
        return self.unreached_sse / self.unreached_ssx

    def plus(self, o: "ErrorFigures") -> "ErrorFigures":
        def add(a, b):
            return None if a is None or b is None else a + b

        def add_weighted(a, b):
            # a part with no weighted figure only because none of its experts were reached adds nothing
            if a is None and self.unreached:
                return b
            if b is None and o.unreached:
                return a
            return add(a, b)

        return ErrorFigures(
            self.origin if self.origin == o.origin else "mixed", self.n + o.n, self.sse + o.sse, self.ssx + o.ssx,
            add_weighted(self.wsse, o.wsse), add_weighted(self.wssx, o.wssx), add(self.ssy, o.ssy),
            add(self.dot, o.dot),
            None if self.max_abs is None or o.max_abs is None else max(self.max_abs, o.max_abs),
            self.finite and o.finite, self.expert_sqnr_db + o.expert_sqnr_db, self.unreached + o.unreached,
            self.unreached_sse + o.unreached_sse, self.unreached_ssx + o.unreached_ssx)

    def to_json(self) -> dict:
        sq = self.sqnr_db
        return {
            "origin": self.origin, "n": self.n, "exact": self.exact,
            "rel_mse": finite_or_none(self.rel_mse), "sqnr_db": finite_or_none(sq),
            "weighted_rel_error": finite_or_none(self.weighted_rel_error),
            "max_abs_error": finite_or_none(self.max_abs), "cosine": finite_or_none(self.cosine), "finite": self.finite,
            "sse": finite_or_none(self.sse), "ssx": finite_or_none(self.ssx),
            "weighted_sse": finite_or_none(self.wsse), "weighted_ssx": finite_or_none(self.wssx),
            **({"unreached_experts": list(self.unreached),
                "unreached_rel_mse": finite_or_none(self.unreached_rel_mse),
                "unreached_sqnr_db": finite_or_none(sqnr_db(self.unreached_sse, self.unreached_ssx))}
               if self.unreached else {}),
        }


@numba.njit(cache=True, parallel=True, nogil=True)
def _rows(x, y, w, has_w, part):
    rows, cols = x.shape
    for r in numba.prange(rows):
        sse = ssx = ssy = dot = wsse = wssx = 0.0
        mx = 0.0
        bad = 0.0
        for c in range(cols):
            xv = np.float64(x[r, c])
            yv = np.float64(y[r, c])
            if not np.isfinite(yv):
                bad += 1.0
                continue
            d = xv - yv
            d2 = d * d
            sse += d2
            ssx += xv * xv
            ssy += yv * yv
            dot += xv * yv
            a = abs(d)
            if a > mx:
                mx = a
            if has_w:
                wc = np.float64(w[c])
                wsse += wc * d2
                wssx += wc * xv * xv
        part[r, 0] = sse
        part[r, 1] = ssx
        part[r, 2] = ssy
        part[r, 3] = dot
        part[r, 4] = mx
        part[r, 5] = bad
        part[r, 6] = wsse
        part[r, 7] = wssx


def error_sums(x: np.ndarray, y: np.ndarray, w: Optional[np.ndarray] = None) -> Sums:
    """Sums over float32 x, y of shape (rows, cols); w float (cols,) or None."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.ascontiguousarray(y, dtype=np.float32).reshape(x.shape)
    if x.ndim != 2:
        x = x.reshape(1, -1)
        y = y.reshape(1, -1)
    has_w = w is not None
    wv = np.ascontiguousarray(w, dtype=np.float64) if has_w else np.zeros(1, np.float64)
    part = np.zeros((x.shape[0], 8), dtype=np.float64)
    _rows(x, y, wv, has_w, part)
    return sums_of_rows(part, int(x.size), has_w)


def sums_of_rows(part: np.ndarray, n: int, has_w: bool) -> Sums:
    """The Sums of per-row partials float64 (rows, 8) (sse, ssx, ssy, dot,
    max|d|, non-finite count, wsse, wssx; each a sequential sum over the row
    in column order), added in row order: ``error_sums``'s figures, wherever
    the rows were summed (``ds4quant.formats.search.triton_sums`` on a GPU)."""
    tot = np.zeros(8)
    for r in range(part.shape[0]):  # fixed order: thread count never changes the figures
        tot += part[r]
    return Sums(
        n=int(n), sse=float(tot[0]), ssx=float(tot[1]), ssy=float(tot[2]), dot=float(tot[3]),
        max_abs=float(part[:, 4].max()) if part.shape[0] else 0.0, finite=bool(tot[5] == 0),
        wsse=float(tot[6]) if has_w else None, wssx=float(tot[7]) if has_w else None,
    )
