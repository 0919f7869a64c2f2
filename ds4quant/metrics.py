"""Error sums between a source matrix and its decoded copy, in one pass.

float64 accumulators; rows are summed in parallel into per-row partials that
are then added in row order, so the figures never depend on the thread count.
Memory stays at the two input matrices (no float64 temporaries).
"""

from __future__ import annotations

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
    tot = np.zeros(8)
    for r in range(part.shape[0]):  # fixed order: thread count never changes the figures
        tot += part[r]
    return Sums(
        n=int(x.size), sse=float(tot[0]), ssx=float(tot[1]), ssy=float(tot[2]), dot=float(tot[3]),
        max_abs=float(part[:, 4].max()) if part.shape[0] else 0.0, finite=bool(tot[5] == 0),
        wsse=float(tot[6]) if has_w else None, wssx=float(tot[7]) if has_w else None,
    )
