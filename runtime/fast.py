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

from ds4quant.formats import _scale_search as _ss
from ds4quant.formats._components import K_MIX, K_SCALE, UE4M3, decode_row_nb

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


# Pair tables (2-bit and 3-bit codes with 16-weight scale groups: rocmfp2,
# rocmfp2_s40, rocmfp3 and the MIX pair): for few tokens the GEMV never
# decodes a weight. P[bk, t, p, c] = lev[bk, c & m] * x[t, 2p] + lev[bk, c >> b]
# * x[t, 2p + 1] for every pair code c of weights 2p, 2p + 1, so a 16-weight
# group costs 8 table reads and one scale multiply. Tables are
# (cols / 2) * 4^b floats per book and token: 32 KiB / 256 KiB at 4096 / 2048
# input features, L2 sized.


#: Code widths that take the pair-table GEMV. 3-bit tables (64 entries per
#: pair) measured no faster than the fused decode+dot at DS4 shapes (4.5 vs
#: 4.3 ms per 4096 x 2048 matrix, one thread), so only 2-bit codes use it.
PAIR_WIDTHS = (2,)


def _pair_kind(kind: int, p0: int, p1: int) -> int:
    """Code width for the pair-table GEMV (2 or 3), or 0 when the layout has none."""
    if kind == K_SCALE and p1 == 16 and int(_ss.BITS[p0]) in (2, 3):
        return int(_ss.BITS[p0])
    if kind == K_MIX and p0 in (2, 3):
        return p0
    return 0


@numba.njit(cache=True, nogil=True, parallel=True)
def pair_tables_nb(lut, bits, x, P):
    nbk, T, npair, ncode = P.shape
    m = (1 << bits) - 1
    for p in numba.prange(npair):
        for bk in range(nbk):
            for t in range(T):
                x0 = x[t, 2 * p]
                x1 = x[t, 2 * p + 1]
                for c in range(ncode):
                    P[bk, t, p, c] = lut[bk, c & m, 0] * x0 + lut[bk, c >> bits, 0] * x1


@numba.njit(cache=True, nogil=True, inline="always")
def _pair_row(P, bk, t, row, o, bits, pb):
    # The 16 weights (8 pairs) of one scale group starting at pair pb, summed
    # as a tree: the eight reads are independent, not one chain of adds.
    if bits == 2:
        v0 = np.int64(row[o])
        v1 = np.int64(row[o + 1])
        v2 = np.int64(row[o + 2])
        v3 = np.int64(row[o + 3])
        s0 = P[bk, t, pb, v0 & 15] + P[bk, t, pb + 1, v0 >> 4]
        s1 = P[bk, t, pb + 2, v1 & 15] + P[bk, t, pb + 3, v1 >> 4]
        s2 = P[bk, t, pb + 4, v2 & 15] + P[bk, t, pb + 5, v2 >> 4]
        s3 = P[bk, t, pb + 6, v3 & 15] + P[bk, t, pb + 7, v3 >> 4]
        return (s0 + s1) + (s2 + s3)
    # 3-bit: 48 bits = 6 bytes, four 12-bit chunks of two 6-bit pair codes
    lo = (np.int64(row[o]) | (np.int64(row[o + 1]) << 8) | (np.int64(row[o + 2]) << 16))
    hi = (np.int64(row[o + 3]) | (np.int64(row[o + 4]) << 8) | (np.int64(row[o + 5]) << 16))
    s0 = P[bk, t, pb, lo & 63] + P[bk, t, pb + 1, (lo >> 6) & 63]
    s1 = P[bk, t, pb + 2, (lo >> 12) & 63] + P[bk, t, pb + 3, (lo >> 18) & 63]
    s2 = P[bk, t, pb + 4, hi & 63] + P[bk, t, pb + 5, (hi >> 6) & 63]
    s3 = P[bk, t, pb + 6, (hi >> 12) & 63] + P[bk, t, pb + 7, (hi >> 18) & 63]
    return (s0 + s1) + (s2 + s3)


@numba.njit(cache=True, nogil=True, parallel=True)
def pair_matmul_nb(kind, p0, bits, data, cols, mode, P, out):
    """out[t, j] = sum over scale groups of scale * (sum of the group's pair-table reads)."""
    rows = data.shape[0]
    T = P.shape[1]
    nb = cols // 32
    qsb = 4 * bits
    bb = qsb + 2
    sc = _ss.SCALES[p0]
    for j in numba.prange(rows):
        row = data[j]
        for t in range(T):
            tot0 = np.float32(0.0)  # one accumulator per half block: two short chains
            tot1 = np.float32(0.0)
            for b in range(nb):
                o = b * bb
                for h in range(2):
                    meta = np.int64(row[o + qsb + h])
                    if kind == K_SCALE:
                        s = sc[meta]
                        bk = 0
                    elif mode == 1:
                        s = UE4M3[meta & 0x7F]
                        bk = meta >> 7
                    else:
                        s = UE4M3[meta]
                        bk = 0
                    if bits == 2:
                        g = _pair_row(P, bk, t, row, o + 4 * h, 2, 16 * b + 8 * h)
                    else:
                        g = _pair_row(P, bk, t, row, o + 6 * h, 3, 16 * b + 8 * h)
                    if h == 0:
                        tot0 += g * s
                    else:
                        tot1 += g * s
            out[t, j] = tot0 + tot1


def fast_matmul(kind: int, p0: int, p1: int, data: np.ndarray, cols: int, lut: np.ndarray, mode: int,
                x: np.ndarray) -> np.ndarray:
    """x float32 (T, cols) @ decode(data).T -> float32 (T, rows), tile by tile."""
    from ds4quant.runtime.exact import readonly

    data, lut = readonly(data), readonly(lut, np.float32)
    rows = data.shape[0]
    T = x.shape[0]
    out = np.empty((T, rows), np.float32)
    if T < GEMM_MIN_TOKENS:
        bits = _pair_kind(kind, p0, p1)
        if bits in PAIR_WIDTHS and T and rows:
            nbk = 2 if kind == K_MIX else 1
            P = np.empty((nbk, T, cols // 2, 1 << (2 * bits)), np.float32)
            pair_tables_nb(lut, bits, readonly(x, np.float32), P)
            pair_matmul_nb(kind, p0, bits, data, cols, mode, P, out)
        elif T and rows:
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
