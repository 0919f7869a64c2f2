"""The UE4M3 scale byte shared by every ROCmFPX format (docs/formats.md#ue4m3).

Byte ``e`` (0..126) decodes to ``M * 2^-10`` when ``E = e >> 3`` is 0, else
``(8 + M) * 2^(E - 11)`` with ``M = e & 7``; bytes above 0x7E decode to 0.
That is standard E4M3 without a sign bit and with bias 8: half the value.
"""

from __future__ import annotations

import numba
import numpy as np

FLT_MAX = np.float32(np.finfo(np.float32).max)


def _build_table() -> np.ndarray:
    table = np.zeros(256, dtype=np.float32)
    for e in range(0x7F):
        exp, man = e >> 3, e & 7
        table[e] = man * 2.0**-10 if exp == 0 else (8 + man) * 2.0 ** (exp - 11)
    return table


# S(e) for every byte; S(e) = 0 for e > 0x7E.
UE4M3 = _build_table()
UE4M3.setflags(write=False)
# 1 / S(e) rounded to float32 for e in 1..126 (index 0 holds 0: "inv = 0").
UE4M3_INV = np.zeros(256, dtype=np.float32)
UE4M3_INV[1:127] = (np.float32(1.0) / UE4M3[1:127]).astype(np.float32)
UE4M3_INV.setflags(write=False)


def decode_scale(e: np.ndarray) -> np.ndarray:
    """S(e) for a uint8 array; float32 of the same shape."""
    return UE4M3[np.asarray(e, dtype=np.uint8)]


def nearest_ref(t: np.ndarray) -> np.ndarray:
    """N(t): the byte in 1..126 nearest to each target (docs/formats.md#ue4m3), uint8.

    Distances are float32 ``|S(e) - t|``, ties to the smaller byte, so huge
    targets collapse towards 1 exactly as the reference does. Non-positive or
    non-finite targets give 0.
    """
    t = np.asarray(t, dtype=np.float32)
    flat = t.reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        dist = np.abs(UE4M3[1:127][None, :] - flat[:, None]).astype(np.float32)
    out = (np.argmin(dist, axis=1) + 1).astype(np.uint8)  # first minimum = smaller byte
    bad = ~(flat > 0) | ~np.isfinite(flat)
    out[bad] = 0
    return out.reshape(t.shape)


@numba.njit(cache=True, nogil=True)
def nearest_nb(t):
    """Numba twin of ``nearest_ref`` for one float32 target."""
    if not (t > np.float32(0.0)) or not np.isfinite(t):
        return 0
    best_e = 1
    best_d = abs(UE4M3[1] - t)
    for e in range(2, 127):
        d = abs(UE4M3[e] - t)
        if d < best_d:
            best_d = d
            best_e = e
    return best_e
