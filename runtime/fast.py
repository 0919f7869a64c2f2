"""Fast mode kernels; never a dequantized copy of a whole matrix.

Few tokens per expert (below ``GEMM_MIN_TOKENS``): one fused numba kernel,
rows in parallel, each row decoded into an L1-sized scratch row and dotted
with every token while it is hot (a GEMV reads the packed bytes once: about
a tenth of the predecoded float32 product's memory traffic). More tokens:
a decoded tile of rows (about 1 MiB) times float32 BLAS.

Each weight row is decoded once per call whatever the batch size (the owner
groups slots by expert). The sums are float32 in a free order (the fused
dot is vectorised with fastmath): fast mode's distance from exact mode is
reported by the callers, not hidden.
"""

from __future__ import annotations

import numba
import numpy as np

from ds4quant.formats._components import decode_row_nb

TILE_BYTES = 1 << 20  # scratch tile: about 1 MiB of float32, cache sized
GEMM_MIN_TOKENS = 8  # from here BLAS on decoded tiles beats the fused GEMV


@numba.njit(cache=True, nogil=True, fastmath=True)
def _dot_f32(w, x, t, cols):
    acc = np.float32(0.0)
    for i in range(cols):
        acc += w[i] * x[t, i]
    return acc


@numba.njit(cache=True, nogil=True, parallel=True)
def fused_matmul_nb(kind, p0, p1, data, cols, lut, mode, x, out):
    """out[t, j] = dot(decode(row j), x[t]) for every row, decoded once into a scratch row."""
    rows = data.shape[0]
    T = x.shape[0]
    chunk = 8
    for c in numba.prange((rows + chunk - 1) // chunk):
        w = np.empty(cols, np.float32)
        wb = w.view(np.uint32)
        for j in range(c * chunk, min(rows, c * chunk + chunk)):
            decode_row_nb(kind, p0, p1, data[j], cols, lut, mode, w, wb)
            for t in range(T):
                out[t, j] = _dot_f32(w, x, t, cols)


@numba.njit(cache=True, nogil=True, parallel=True)
def decode_tile_nb(kind, p0, p1, data, r0, r1, cols, lut, mode, out):
    """Decode rows r0..r1-1 of data uint8 (rows, row_bytes) into out float32 (r1 - r0, cols)."""
    for j in numba.prange(r1 - r0):
        decode_row_nb(kind, p0, p1, data[r0 + j], cols, lut, mode, out[j], out[j].view(np.uint32))


def fast_matmul(kind: int, p0: int, p1: int, data: np.ndarray, cols: int, lut: np.ndarray, mode: int,
                x: np.ndarray) -> np.ndarray:
    """x float32 (T, cols) @ decode(data).T -> float32 (T, rows), tile by tile."""
    from ds4quant.runtime.exact import readonly

    data, lut = readonly(data), readonly(lut, np.float32)
    rows = data.shape[0]
    T = x.shape[0]
    out = np.empty((T, rows), np.float32)
    if T < GEMM_MIN_TOKENS:
        if T and rows:
            fused_matmul_nb(kind, p0, p1, data, cols, lut, mode, readonly(x, np.float32), out)
        return out
    tile = max(8, min(rows, TILE_BYTES // (4 * cols)))
    scratch = np.empty((tile, cols), np.float32)
    for r0 in range(0, rows, tile):
        r1 = min(rows, r0 + tile)
        w = scratch[: r1 - r0]
        decode_tile_nb(kind, p0, p1, data, r0, r1, cols, lut, mode, w)
        np.matmul(x, w.T, out=out[:, r0:r1])
    return out


def swiglu_fast(g: np.ndarray, u: np.ndarray, limit: float) -> np.ndarray:
    """float32 clamped SwiGLU with numpy's exp (fast mode only)."""
    L = np.float32(limit)
    gc = np.minimum(g, L)
    uc = np.clip(u, -L, L)
    with np.errstate(over="ignore"):
        return (gc / (np.float32(1.0) + np.exp(-gc)) * uc).astype(np.float32)
