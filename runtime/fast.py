"""Fast mode kernels; never a dequantized copy of a whole matrix.

Two paths per projection of one expert:

- the 2- and 3-bit codes with 16-weight scale groups (rocmfp2, rocmfp2_s40,
  rocmfp3, both MIX widths: the DS4 expert formats), below
  ``LANE_MIN_TOKENS`` tokens: a lane GEMV, rows in parallel, that reads each
  packed row once per token and never writes a decoded weight. A 16-weight
  group is four code chunks, each a table row of four levels (``row_lut``),
  multiplied into eight float32 lanes that LLVM packs into one vector; the
  group's lane sums are scaled once.
- otherwise: a decoded tile of rows (about ``TILE_BYTES``) times float32
  BLAS, the tile decoded by the same table reads for those families
  (bitwise ``formats.decode``; exact mode's dgemm tiles use it too). Other
  formats take it from one token: decoding a tile and BLAS's GEMV beat a
  scalar row dot (rocmfp4_fast 2048 x 4096, one token: 5.9 vs 8.8 ms).

No fastmath: every lane is plain float32 multiply and add in a fixed order
and the lanes are summed in a fixed tree, so a GEMV row's result does not
depend on the thread count or the batch (each output is computed by one
thread alone); the BLAS path is as deterministic as BLAS for a given thread
count. The lane kernels are
compiled with LLVM's SLP vectoriser on (``jit.jit_call``), which numba leaves off by
default; it packs independent scalar operations and cannot change a bit.
Fast mode's distance from exact mode is reported by the callers.
"""

from __future__ import annotations

import numba
import numpy as np

from ds4quant.formats.components import BITS, K_MIX, K_SCALE, SCALES, decode_row_nb
from ds4quant.formats.components import chunk_nb as _chunk  # chunk c of a block's code stream
from ds4quant.formats.ue4m3 import UE4M3
from ds4quant.runtime.jit import jit_call, parallel, readonly

TILE_BYTES = 4 << 20  # decoded tile for the BLAS path: a few MiB of float32 (L3 resident)
LANE_MIN_TOKENS = 4  # lane families: the GEMV costs one pass per token; BLAS tiles win from about 4 (DS4 shapes)

# ---------------------------------------------------------------- lane families


def lane_bits(kind: int, p0: int, p1: int) -> int:
    """Code width (2 or 3) of a lane-family layout, else 0."""
    if kind == K_SCALE and p1 == 16 and int(BITS[p0]) in (2, 3):
        return int(BITS[p0])
    if kind == K_MIX and p0 in (2, 3):
        return p0
    return 0


@numba.njit(cache=True, nogil=True, inline="always")
def _meta(kind, mode, sc, meta):
    """(scale, book) of a half block's scale byte (MIX mode 1: book bit 7)."""
    if kind == K_SCALE:
        return sc[meta], 0
    if mode == 1:
        return UE4M3[meta & 0x7F], meta >> 7
    return UE4M3[meta], 0


@numba.njit(cache=True, nogil=True, inline="always")
def _lane_dot(kind, bits, row, nb, lut, mode, sc, x, t):
    """dot(decode(row), x[t]) in eight float32 lanes, summed as a fixed tree."""
    qsb = 4 * bits
    cb = 8 if bits == 2 else 12
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    for b in range(nb):
        o = b * (qsb + 2)
        for h in range(2):
            s, bk = _meta(kind, mode, sc, np.int64(row[o + qsb + h]))
            oo = o + 2 * bits * h
            xb = 32 * b + 16 * h
            va = _chunk(row, oo, 0, cb)
            vb = _chunk(row, oo, 1, cb)
            vc = _chunk(row, oo, 2, cb)
            vd = _chunk(row, oo, 3, cb)
            # lane m: weights m and m + 8 of the group (chunks a|b then c|d)
            g0 = lut[bk, va, 0] * x[t, xb] + lut[bk, vc, 0] * x[t, xb + 8]
            g1 = lut[bk, va, 1] * x[t, xb + 1] + lut[bk, vc, 1] * x[t, xb + 9]
            g2 = lut[bk, va, 2] * x[t, xb + 2] + lut[bk, vc, 2] * x[t, xb + 10]
            g3 = lut[bk, va, 3] * x[t, xb + 3] + lut[bk, vc, 3] * x[t, xb + 11]
            g4 = lut[bk, vb, 0] * x[t, xb + 4] + lut[bk, vd, 0] * x[t, xb + 12]
            g5 = lut[bk, vb, 1] * x[t, xb + 5] + lut[bk, vd, 1] * x[t, xb + 13]
            g6 = lut[bk, vb, 2] * x[t, xb + 6] + lut[bk, vd, 2] * x[t, xb + 14]
            g7 = lut[bk, vb, 3] * x[t, xb + 7] + lut[bk, vd, 3] * x[t, xb + 15]
            a0 += g0 * s
            a1 += g1 * s
            a2 += g2 * s
            a3 += g3 * s
            a4 += g4 * s
            a5 += g5 * s
            a6 += g6 * s
            a7 += g7 * s
    return ((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7))


@numba.njit(cache=True, nogil=True, inline="always")
def _lane_decode(kind, bits, row, nb, lut, mode, sc, w):
    """decode(row) into w float32 (cols,): lut level * scale, bitwise ``formats.decode``."""
    qsb = 4 * bits
    cb = 8 if bits == 2 else 12
    for b in range(nb):
        o = b * (qsb + 2)
        for h in range(2):
            s, bk = _meta(kind, mode, sc, np.int64(row[o + qsb + h]))
            oo = o + 2 * bits * h
            for p in range(2):
                va = _chunk(row, oo, 2 * p, cb)
                vb = _chunk(row, oo, 2 * p + 1, cb)
                # all eight loads before the stores: the vectoriser may not move a load past a store
                l0, l1, l2, l3 = lut[bk, va, 0], lut[bk, va, 1], lut[bk, va, 2], lut[bk, va, 3]
                l4, l5, l6, l7 = lut[bk, vb, 0], lut[bk, vb, 1], lut[bk, vb, 2], lut[bk, vb, 3]
                q = 32 * b + 16 * h + 8 * p
                w[q] = l0 * s
                w[q + 1] = l1 * s
                w[q + 2] = l2 * s
                w[q + 3] = l3 * s
                w[q + 4] = l4 * s
                w[q + 5] = l5 * s
                w[q + 6] = l6 * s
                w[q + 7] = l7 * s


_ROW_CHUNK = 16  # rows per parallel work item: fixed, so the split never depends on the thread count


@numba.njit(cache=True, nogil=True, parallel=True)
def lane_matmul_nb(kind, p0, bits, data, cols, lut, mode, x, out):
    """out[t, j] = dot(decode(row j), x[t]) for a lane-family layout (``lane_bits``)."""
    rows = data.shape[0]
    T = x.shape[0]
    nb = cols // 32
    sc = SCALES[p0] if kind == K_SCALE else SCALES[0]
    for c in numba.prange((rows + _ROW_CHUNK - 1) // _ROW_CHUNK):
        for j in range(c * _ROW_CHUNK, min(rows, c * _ROW_CHUNK + _ROW_CHUNK)):
            row = data[j]
            for t in range(T):  # literal widths: each inlined copy has constant chunk sizes
                if bits == 2:
                    out[t, j] = _lane_dot(kind, 2, row, nb, lut, mode, sc, x, t)
                else:
                    out[t, j] = _lane_dot(kind, 3, row, nb, lut, mode, sc, x, t)


@numba.njit(cache=True, nogil=True, inline="always")
def decode_row_fast(kind, p0, p1, row, cols, lut, mode, out, out_bits):
    """``decode_row_nb`` with the lane families' vectorisable decoder (same bits)."""
    nb = cols // 32
    if kind == K_SCALE and p1 == 16 and BITS[p0] == 2:
        _lane_decode(kind, 2, row, nb, lut, mode, SCALES[p0], out)
    elif kind == K_SCALE and p1 == 16 and BITS[p0] == 3:
        _lane_decode(kind, 3, row, nb, lut, mode, SCALES[p0], out)
    elif kind == K_MIX and p0 == 2:
        _lane_decode(kind, 2, row, nb, lut, mode, SCALES[0], out)
    elif kind == K_MIX and p0 == 3:
        _lane_decode(kind, 3, row, nb, lut, mode, SCALES[0], out)
    else:
        decode_row_nb(kind, p0, p1, row, cols, lut, mode, out, out_bits)


@numba.njit(cache=True, nogil=True, parallel=True)
def decode_tile_nb(kind, p0, p1, data, r0, r1, cols, lut, mode, out):
    """Decode rows r0..r1-1 of data uint8 (rows, row_bytes) into out float32 (r1 - r0, cols)."""
    for j in numba.prange(r1 - r0):
        decode_row_fast(kind, p0, p1, data[r0 + j], cols, lut, mode, out[j], out[j].view(np.uint32))


# The same kernels without the parallel region: numba's launch costs 0.1-2 ms on a
# busy host (threads wait to be scheduled), more than the whole product of a small
# matrix; small products take these (same bits: each output is computed alone
# either way). Large ones keep the parallel kernels even on one thread: LLVM
# optimises the outlined parallel body better (3-bit lane GEMV 2.2 vs 3.7 ms at
# 2048 x 4096, one thread).
lane_matmul_serial = numba.njit(cache=True, nogil=True)(lane_matmul_nb.py_func)
decode_tile_serial = numba.njit(cache=True, nogil=True)(decode_tile_nb.py_func)


def decode_tile(kind: int, p0: int, p1: int, data: np.ndarray, r0: int, r1: int, cols: int, lut: np.ndarray,
                mode: int, out: np.ndarray) -> None:
    """``decode_tile_nb`` compiled with the SLP vectoriser (bitwise ``formats.decode``)."""
    fn = decode_tile_nb if parallel((r1 - r0) * cols) else decode_tile_serial
    jit_call(fn, kind, p0, p1, data, r0, r1, cols, lut, mode, out)


def _ro(a: np.ndarray, dtype) -> np.ndarray:
    """``jit.readonly`` unless ``a`` already is one (the owner caches its operands read-only)."""
    if a.dtype == dtype and not a.flags.writeable and a.flags.c_contiguous:
        return a
    return readonly(a, dtype)


def fast_matmul(kind: int, p0: int, p1: int, data: np.ndarray, cols: int, lut: np.ndarray, mode: int,
                x: np.ndarray) -> np.ndarray:
    """x float32 (T, cols) @ decode(data).T -> float32 (T, rows)."""
    data, lut = _ro(data, np.uint8), _ro(lut, np.float32)
    rows = data.shape[0]
    T = x.shape[0]
    out = np.empty((T, rows), np.float32)
    if not (T and rows):
        return out
    bits = lane_bits(kind, p0, p1)
    if bits and T < LANE_MIN_TOKENS:
        fn = lane_matmul_nb if parallel(rows * cols * T) else lane_matmul_serial
        jit_call(fn, kind, p0, bits, data, cols, lut, mode, _ro(x, np.float32), out)
        return out
    tile = max(8, min(rows, TILE_BYTES // (4 * cols)))
    scratch = np.empty((tile, cols), np.float32)
    for r0 in range(0, rows, tile):
        r1 = min(rows, r0 + tile)
        w = scratch[: r1 - r0]
        decode_tile(kind, p0, p1, data, r0, r1, cols, lut, mode, w)
        np.matmul(x, w.T, out=out[:, r0:r1])
    return out
