"""The rows' energies of the scale search's importance weights (docs/formats.md#scale-search), in numba.

sigma^2 of a row is a sequential float32 sum (float64 where float32 would
overflow), which a device reduction would round differently: the encoder's
host path reads it per row, and the device tiers take it from the host once
per matrix (``row_energies``).
"""

from __future__ import annotations

import numba
import numpy as np

from ds4quant.formats.ue4m3 import FLT_MAX

_ZERO = np.float32(0.0)


@numba.njit(cache=True, nogil=True)
def row_energy_nb(x):
    """The row energy (docs/formats.md#scale-search) of one float32 row (see row_energy_ref)."""
    k = x.shape[0]
    s = _ZERO
    for i in range(k):
        xi = x[i]
        if not np.isfinite(xi):
            continue
        sq = xi * xi
        if not np.isfinite(sq) or s > FLT_MAX - sq:
            total = 0.0
            for j in range(k):
                if np.isfinite(x[j]):
                    xd = np.float64(x[j])
                    total += xd * xd
            total = total / k
            if total > np.float64(FLT_MAX):
                total = np.float64(FLT_MAX)
            return np.float32(total)
        s += sq
    return s / np.float32(k)


@numba.njit(cache=True, nogil=True)
def row_energy_s40_nb(x):
    s = _ZERO
    for i in range(x.shape[0]):
        if np.isfinite(x[i]):
            s += x[i] * x[i]
    return s / np.float32(x.shape[0])


@numba.njit(cache=True, parallel=True, nogil=True)
def row_energies_nb(x, out):
    """out[r] = row_energy_nb(x[r]) (docs/formats.md#scale-search, the weights' sigma^2) for every row:
    what the device tiers' scale search takes from the host."""
    for r in numba.prange(x.shape[0]):
        out[r] = row_energy_nb(x[r])


def row_energies(x: np.ndarray) -> np.ndarray:
    """sigma^2 of the importance weights per row of float32 x (rows, cols): float32 (rows,)."""
    sigma2 = np.empty(x.shape[0], np.float32)
    if x.shape[0]:
        row_energies_nb(x, sigma2)
    return sigma2
