"""Exact mode: the identity definition every owner implements bit for bit.

For one routed slot (token row x float32 (hidden,), expert e with decoded
weights Wg, Wu (ffn, hidden) and Wd (hidden, ffn), exactly as
``formats.decode`` gives them; limit L = deepseek4.swiglu_clamp_exp)::

    g = D(Wg, x);  u = D(Wu, x);  h = SWIGLU(g, u);  y = D(Wd, h)

**Q (activation quantization)**, per block of 32 consecutive inputs of a
float32 row (cols % 32 == 0): m = max |x_i| (any NaN/Inf in the row is an
error). m == 0: s = 0 and every q_i = 0. Otherwise s = frexp(m).exponent - 7
(m / 2^s in [64, 128)), and s += 1 when m / 2^s > 127. q_i = round half to
even of x_i / 2^s (exact: a power-of-two scaling, done in float64), an
integer in [-127, 127]; a_i = q_i * 2^s.

**D (exact product)**: out_j = RNE_fp32(SUM_i W[j, i] * a_i): the exact real
sum, rounded once to float32 (nearest, ties to even, gradual underflow,
overflow to +-Inf as IEEE RNE does). An exactly zero sum gives +0.0 (never
-0.0). W must be finite: a NaN/Inf weight is an error, not a value.

**SWIGLU**, in float64 with every +, -, *, / separately rounded (no FMA, no
libm), per feature j::

    gc = L if not (g < L) else g            (g is never NaN)
    uc = -L if u < -L else (L if u > L else u)
    z  = -gc
    z > 709:  silu = gc * 0.0               (E(z) = +inf; -0.0 for gc < 0)
    else:     n = rint_half_even(z * INV_LN2)            (a float64 integer)
              r = (z - n * LN2_HI) - n * LN2_LO
              p = C[13]; p = p * r + C[k] for k = 12 .. 0 (two roundings each)
              silu = gc / (1.0 + ldexp(p, n))
    h = RNE_fp32(silu * uc)

with LN2_HI = 0x1.62e42fee00000p-1, LN2_LO = 0x1.a39ef35793c76p-33,
INV_LN2 = 0x1.71547652b82fep0 and C[k] = float64(1.0 / k!) (the correctly
rounded quotient of 1.0 by the exact integer k!; hex values in ``C_HEX``).
g and u are float32 values widened exactly to float64. h is a float32; a
NaN/Inf h (only from g = -Inf, an overflowed product) fails Q of the down
projection, which is an error.

Readings of docs/exact-mode.md made precise here (the torch owner follows them too):

1. Q's row is the projection's whole input: x for gate/up, h for down.
2. An exact zero sum is +0.0; g = +-Inf is allowed (the sum overflowed
   float32) and flows through SWIGLU as written.
3. min/max in SWIGLU are the comparisons above (they differ from IEEE
   minNum/maxNum only for NaN, which cannot occur).
4. ldexp(p, n) is IEEE scalbn (p * 2^n, one rounding). For L <= 10 it is
   exact: z >= -10 gives n >= -15, and z <= 709 keeps p * 2^n finite, so a
   torch ``p * 2.0**n`` computes the same bits.

How the CPU owner gets the exact sum fast (``exact_matmul``): every
product W_ji * a_i is exact in float64 (24 + 8 significant bits). A weight
row has whi (every |W| < 2^whi) and wlo (every W a multiple of 2^wlo, from
the lowest set bit); a token row has ahi = max(s_b + 7) and alo = min(s_b)
over its nonzero blocks. When ``whi + ahi + ceil(log2(cols)) - (wlo + alo)
<= 53`` every partial sum, in any order, is a multiple of 2^(wlo + alo)
below 2^(wlo + alo + 53): exact in float64, so the float64 sum is the exact
sum and one conversion to float32 is the definition's rounding. Because the
order is free, the float64 dot may be reassociated and fused (FMA of an
exact product is the same sum): ``_dot_f64`` is vectorised with exactly
those two fastmath flags (rows are decoded by ``fast.decode_row_fast``, the
same bits as ``formats.decode``; the kernels compile with the SLP vectoriser,
which packs operations and cannot change a value), and from ``GEMM_MIN_TOKENS`` tokens per expert the
product is decoded tiles times BLAS dgemm. A sum that is exactly zero is
mapped to +0.0 (``+ 0.0``) whatever sign the reduction left. whi/wlo depend
only on the weights: ``row_spans`` computes them once per expert (the CPU
owner caches them). Otherwise the slot is flagged and
``exact_wide.fallback_rows_nb`` computes it in a wide fixed-point
accumulator (``exact_dot_fallback`` is the same with Python integers). ``exact_dot_ref``
is the slow, obviously correct reference.
"""

from __future__ import annotations

import math
import numba
import numpy as np
from numba.cpython.unsafe.numbers import trailing_zeros

from ds4quant.errors import BadInputError
from ds4quant.runtime.exact_wide import fallback_rows_nb
from ds4quant.runtime.fast import decode_row_fast, decode_tile
from ds4quant.runtime.jit import jit_call, parallel, readonly

BLOCK = 32
LN2_HI = float.fromhex("0x1.62e42fee00000p-1")
LN2_LO = float.fromhex("0x1.a39ef35793c76p-33")
INV_LN2 = float.fromhex("0x1.71547652b82fep0")
EXP_OVERFLOW = 709.0
#: C[k] = 1/k! as float64, k = 0..13 (Horner from C[13] down to C[0]).
C = np.array([1.0 / math.factorial(k) for k in range(14)], dtype=np.float64)
C.setflags(write=False)
C_HEX = tuple(float(c).hex() for c in C)
_SPAN_BITS = 53  # float64 significand
_NONE_HI = -(1 << 20)  # "no nonzero element": the span check always passes
_NONE_LO = 1 << 20

_NB = dict(cache=True, nogil=True)  # never fastmath: it would allow FMA and reassociation


# ==========================================================================
# plain-Python reference (slow, obviously correct)


def quantize_row_ref(x) -> tuple[list[int], list[int]]:
    """Q of one float32 row: (q ints (cols,), s ints (cols // 32,))."""
    xs = [float(v) for v in np.asarray(x, dtype=np.float32)]
    if any(not math.isfinite(v) for v in xs):
        raise BadInputError("exact mode: the activation row has a NaN or Inf value")
    q, s_list = [], []
    for b in range(0, len(xs), BLOCK):
        blk = xs[b:b + BLOCK]
        m = max(abs(v) for v in blk)
        if m == 0.0:
            s_list.append(0)
            q.extend([0] * len(blk))
            continue
        s = math.frexp(m)[1] - 7
        if math.ldexp(m, -s) > 127.0:
            s += 1
        s_list.append(s)
        q.extend(round(math.ldexp(v, -s)) for v in blk)  # Python round(): half to even
    return q, s_list


def round_f32(n: int, k: int) -> np.float32:
    """RNE_fp32 of the exact value n * 2^k (Python ints); +0.0 for n == 0."""
    if n == 0:
        return np.float32(0.0)
    sign = -1.0 if n < 0 else 1.0
    a = abs(n)
    top = a.bit_length() - 1 + k  # exponent of the leading bit
    shift = (a.bit_length() - 24) if top >= -126 else (-149 - k)  # keep 24 bits, or down to 2^-149
    if shift > 0:
        qv = a >> shift
        rem = a & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        if rem > half or (rem == half and qv & 1):
            qv += 1
        a, k = qv, k + shift
    if a.bit_length() + k > 128:  # at or past 2^128 after rounding: overflow
        return np.float32(sign * math.inf)
    return np.float32(sign * math.ldexp(float(a), k))  # exact: a < 2^25, in range


def _f32_parts(v: float) -> tuple[int, int]:
    """Finite float32 value as (integer m, exponent e) with v == m * 2^e."""
    if not math.isfinite(v):
        raise BadInputError("exact mode: a weight is NaN or Inf")
    f, e = math.frexp(v)
    return int(f * (1 << 24)), e - 24


def exact_dot_ref(w, q, s) -> np.float32:
    """D for one output: RNE_fp32(sum_i w_i * q_i * 2^s[i // 32]) with Python ints."""
    terms = []
    for i, wi in enumerate(np.asarray(w, dtype=np.float32)):
        m, e = _f32_parts(float(wi))
        if m and q[i]:
            terms.append((m * q[i], e + s[i // BLOCK]))
    if not terms:
        return np.float32(0.0)
    k0 = min(e for _, e in terms)
    return round_f32(sum(v << (e - k0) for v, e in terms), k0)


def _e_ref(z: float) -> float:
    n = round(z * INV_LN2)  # half to even
    r = (z - n * LN2_HI) - n * LN2_LO
    p = float(C[13])
    for k in range(12, -1, -1):
        p = p * r + float(C[k])  # CPython rounds * and + separately
    return math.ldexp(p, n)


def swiglu_ref(g, u, limit: float) -> np.ndarray:
    """SWIGLU of float32 g, u (same shape), float64 steps as defined; float32."""
    L = float(limit)
    g = np.asarray(g, dtype=np.float32)
    u = np.asarray(u, dtype=np.float32)
    out = np.empty(g.shape, dtype=np.float32)
    for idx in np.ndindex(g.shape):
        gv, uv = float(g[idx]), float(u[idx])
        gc = gv if gv < L else L
        uc = -L if uv < -L else (L if uv > L else uv)
        z = -gc
        silu = gc * 0.0 if z > EXP_OVERFLOW else gc / (1.0 + _e_ref(z))
        out[idx] = np.float32(silu * uc)
    return out


def expert_ref(wg, wu, wd, x, limit: float) -> np.ndarray:
    """The whole definition for one token row, all in plain Python: float32 (hidden,)."""
    q, s = quantize_row_ref(x)
    g = np.array([exact_dot_ref(r, q, s) for r in wg], dtype=np.float32)
    u = np.array([exact_dot_ref(r, q, s) for r in wu], dtype=np.float32)
    h = swiglu_ref(g, u, limit)
    q2, s2 = quantize_row_ref(h)
    return np.array([exact_dot_ref(r, q2, s2) for r in wd], dtype=np.float32)


def exact_dot_fallback(w, q, s) -> np.float32:
    """``exact_dot_ref`` with numpy: terms grouped by exponent, integers summed
    in int64 per group (|m*q| < 2^31, < 2^32 terms), groups joined as Python
    ints. Used for the slots whose float64 span check fails."""
    mant, exp = _parts_np(np.asarray(w, dtype=np.float32))
    qv = np.asarray(q, dtype=np.int64)
    sv = np.repeat(np.asarray(s, dtype=np.int64), BLOCK)[: len(qv)]
    prod = mant * qv
    nz = prod != 0
    if not nz.any():
        return np.float32(0.0)
    keys = (exp + sv)[nz]
    uniq, inv = np.unique(keys, return_inverse=True)
    sums = np.zeros(len(uniq), dtype=np.int64)
    np.add.at(sums, inv, prod[nz])
    k0 = int(uniq[0])
    return round_f32(sum(int(v) << (int(k) - k0) for v, k in zip(sums, uniq)), k0)


def _parts_np(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if not np.all(np.isfinite(w)):
        raise BadInputError("exact mode: a weight is NaN or Inf")
    f, e = np.frexp(w.astype(np.float64))
    return np.ldexp(f, 24).astype(np.int64), e.astype(np.int64) - 24


# ==========================================================================
# numba kernels


@numba.njit(**_NB)
def quantize_rows_nb(x, a, s_out, tok_hi, tok_lo):
    """Q of every row of x float32 (T, cols): a float64 (T, cols) = q * 2^s,
    s_out int64 (T, cols//32), and per row the span bounds ahi/alo.
    Returns the index of the first row with a NaN/Inf, or -1."""
    T, cols = x.shape
    for t in range(T):
        hi = _NONE_HI
        lo = _NONE_LO
        for b in range(cols // BLOCK):
            m = np.float32(0.0)
            for i in range(b * BLOCK, b * BLOCK + BLOCK):
                v = x[t, i]
                if not np.isfinite(v):
                    return t
                m = max(m, abs(v))
            if m == np.float32(0.0):
                s_out[t, b] = 0
                for i in range(b * BLOCK, b * BLOCK + BLOCK):
                    a[t, i] = 0.0
                continue
            s = math.frexp(np.float64(m))[1] - 7
            if math.ldexp(np.float64(m), -s) > 127.0:
                s += 1
            s_out[t, b] = s
            hi = max(hi, s + 7)
            lo = min(lo, s)
            for i in range(b * BLOCK, b * BLOCK + BLOCK):
                qv = np.rint(math.ldexp(np.float64(x[t, i]), -s))  # rint: ties to even
                a[t, i] = math.ldexp(qv, s)
        tok_hi[t] = hi
        tok_lo[t] = lo
    return -1


@numba.njit(**_NB)
def row_span_nb(w, bits):
    """(whi, wlo, finite) of a float32 row (bits: its uint32 view)."""
    hi = _NONE_HI
    lo = _NONE_LO
    for i in range(w.shape[0]):
        u = np.int64(bits[i])
        ex = (u >> 23) & 0xFF
        man = u & 0x7FFFFF
        if ex == 0xFF:
            return hi, lo, False
        if ex == 0 and man == 0:
            continue
        if ex == 0:
            e_hi = -126  # subnormal: |w| < 2^-126, unit 2^-149
            e_lo = -149 + trailing_zeros(man)
        else:
            e_hi = ex - 126
            e_lo = ex - 150 + trailing_zeros(man | 0x800000)
        hi = max(hi, e_hi)
        lo = min(lo, e_lo)
    return hi, lo, True


@numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _dot_f64(w, a, t, cols):
    # Reassociation and FMA only (no nsz/nnan/arcp): under the span bound
    # every product and every partial sum, in any order, is exact, so the
    # vectorised reduction LLVM builds from these flags is the exact sum.
    # The caller maps a -0.0 sum to +0.0 (acc + 0.0, outside this function).
    acc = 0.0
    for i in range(cols):
        acc += np.float64(w[i]) * a[t, i]
    return acc


@numba.njit(cache=True, nogil=True, parallel=True)
def row_spans_nb(kind, p0, p1, data, cols, lut, mode, whi, wlo, bad):
    """Per encoded row: whi/wlo (int32) of its decoded weights, bad = 1 for
    a NaN/Inf weight. Depends only on the weights: computed once per expert."""
    rows = data.shape[0]
    chunk = 8
    for c in numba.prange((rows + chunk - 1) // chunk):
        w = np.empty(cols, np.float32)
        wb = w.view(np.uint32)
        for j in range(c * chunk, min(rows, c * chunk + chunk)):
            decode_row_fast(kind, p0, p1, data[j], cols, lut, mode, w, wb)
            hi, lo, finite = row_span_nb(w, wb)
            whi[j] = hi
            wlo[j] = lo
            bad[j] = 0 if finite else 1


@numba.njit(cache=True, nogil=True, parallel=True)
def exact_matmul_nb(kind, p0, p1, data, cols, lut, mode, a, whi, wlo, tok_hi, tok_lo, log2c, out, flags):
    """out[t, j] = D(W_j, a_t) for the encoded rows data uint8 (rows, row_bytes).

    a float64 (T, cols); whi/wlo the rows' spans (``row_spans_nb``, finite
    rows only). Decodes each row once into an L1-sized scratch row, checks
    the span bound per (row, token) and sets flags[t, j] = 1 where the
    float64 sum is not provably exact (out is then left for the fallback).
    Rows run in parallel; every output is computed alone, so threads never
    change a bit.
    """
    rows = data.shape[0]
    T = a.shape[0]
    chunk = 8
    for c in numba.prange((rows + chunk - 1) // chunk):
        w = np.empty(cols, np.float32)
        wb = w.view(np.uint32)
        for j in range(c * chunk, min(rows, c * chunk + chunk)):
            need = False
            for t in range(T):
                if whi[j] + tok_hi[t] + log2c - (wlo[j] + tok_lo[t]) > _SPAN_BITS:
                    flags[t, j] = 1
                else:
                    need = True
            if not need:
                continue
            decode_row_fast(kind, p0, p1, data[j], cols, lut, mode, w, wb)
            for t in range(T):
                if flags[t, j] == 0:
                    out[t, j] = np.float32(_dot_f64(w, a, t, cols) + 0.0)  # + 0.0: -0.0 -> +0.0


# Serial twins for one thread or small products (jit.PARALLEL_MIN_WORK): the same
# per-output code, and any order of the exact sum is the same sum, so the same bytes.
row_spans_serial = numba.njit(cache=True, nogil=True)(row_spans_nb.py_func)
exact_matmul_serial = numba.njit(cache=True, nogil=True)(exact_matmul_nb.py_func)


@numba.njit(**_NB)
def _e_nb(z):
    n = np.rint(z * INV_LN2)
    r = (z - n * LN2_HI) - n * LN2_LO
    p = C[13]
    for k in range(12, -1, -1):
        p = p * r
        p = p + C[k]
    return math.ldexp(p, np.int64(n))


@numba.njit(**_NB)
def swiglu_nb(g, u, limit, out):
    """SWIGLU of float32 g, u (T, F) into out float32 (T, F); see the docstring."""
    L = np.float64(limit)
    for t in range(g.shape[0]):
        for j in range(g.shape[1]):
            gv = np.float64(g[t, j])
            uv = np.float64(u[t, j])
            gc = gv if gv < L else L
            uc = -L if uv < -L else (L if uv > L else uv)
            z = -gc
            if z > EXP_OVERFLOW:
                silu = gc * 0.0
            else:
                silu = gc / (1.0 + _e_nb(z))
            out[t, j] = np.float32(silu * uc)


# ==========================================================================
# drivers


def quantize_rows(x: np.ndarray, what: str = "activations"):
    """Q of float32 x (T, cols): (a float64 (T, cols), s int64 (T, nb), ahi, alo)."""
    x = readonly(x, np.float32)
    T, cols = x.shape
    if cols % BLOCK:
        raise BadInputError(f"exact mode needs {BLOCK}-multiple rows, got {cols}", where=what)
    a = np.empty((T, cols), np.float64)
    s = np.empty((T, cols // BLOCK), np.int64)
    hi = np.empty(T, np.int64)
    lo = np.empty(T, np.int64)
    bad = quantize_rows_nb(x, a, s, hi, lo) if T else -1
    if bad >= 0:
        raise BadInputError(f"exact mode: row {bad} has a NaN or Inf value", where=what)
    return a, s, hi, lo


def row_spans(kind: int, p0: int, p1: int, data: np.ndarray, cols: int, lut: np.ndarray, mode: int):
    """(whi int32 (rows,), wlo int32 (rows,), bad uint8 (rows,)) of one expert's
    encoded rows: what the span check needs from the weights, computed once
    (the CPU owner caches it per expert)."""
    data, lut = readonly(data), readonly(lut, np.float32)
    rows = data.shape[0]
    whi = np.empty(rows, np.int32)
    wlo = np.empty(rows, np.int32)
    bad = np.zeros(rows, np.uint8)
    if rows:
        jit_call(row_spans_nb if parallel(rows * cols) else row_spans_serial, kind, p0, p1, data, cols, lut, mode,
             whi, wlo, bad)
    for v in (whi, wlo, bad):
        v.setflags(write=False)
    return whi, wlo, bad


#: Tokens per expert from which the float64 product runs as decoded tiles
#: times BLAS dgemm (any summation order is exact under the span bound, FMA
#: included, so BLAS gives the exact sum too); below it, the fused row kernel.
GEMM_MIN_TOKENS = 8
_TILE_BYTES = 1 << 20


def exact_matmul(kind: int, p0: int, p1: int, data: np.ndarray, cols: int, lut: np.ndarray, mode: int,
                 x: np.ndarray, quant, *, what: str, spans=None) -> np.ndarray:
    """D of every row of x against one expert's encoded rows: float32 (T, rows).

    kind/p0/p1: ``formats.components.row_kind``; lut/mode: ``row_lut`` and the
    MIX expert's mode. quant: ``quantize_rows(x)``. spans: ``row_spans`` of
    the same rows (computed here when None).
    """
    a, s, hi, lo = quant
    data, lut, a = readonly(data), readonly(lut, np.float32), readonly(a)
    rows = data.shape[0]
    T = a.shape[0]
    out = np.zeros((T, rows), np.float32)
    flags = np.zeros((T, rows), np.uint8)
    if not (T and rows):
        return out
    whi, wlo, bad = spans if spans is not None else row_spans(kind, p0, p1, data, cols, lut, mode)
    if bad.any():
        raise BadInputError(f"exact mode: weight row {int(np.argmax(bad))} has a NaN or Inf value", where=what)
    log2c = int(math.ceil(math.log2(cols)))
    if T < GEMM_MIN_TOKENS:
        jit_call(exact_matmul_nb if parallel(rows * cols * T) else exact_matmul_serial, kind, p0, p1, data, cols,
             lut, mode, a, whi, wlo, hi, lo, log2c, out, flags)
    else:
        tile = max(8, min(rows, _TILE_BYTES // (4 * cols)))
        scratch = np.empty((tile, cols), np.float32)
        span_t = (hi - lo + log2c)[:, None]
        for r0 in range(0, rows, tile):
            r1 = min(rows, r0 + tile)
            w = scratch[: r1 - r0]
            decode_tile(kind, p0, p1, data, r0, r1, cols, lut, mode, w)
            acc = a @ w.astype(np.float64).T
            acc += 0.0  # an exact zero sum is +0.0
            over = (span_t + (whi[r0:r1] - wlo[r0:r1])[None, :]) > _SPAN_BITS
            out[:, r0:r1] = acc
            flags[:, r0:r1] = over
    if flags.any():  # rare: adversarial exponent spreads; the wide accumulator, exactly
        qi = np.rint(np.ldexp(a, -np.repeat(s, BLOCK, axis=1))).astype(np.int64)
        jit_call(fallback_rows_nb, kind, p0, p1, data, cols, lut, mode, qi, readonly(s, np.int64), flags, out)
    return out


def swiglu(g: np.ndarray, u: np.ndarray, limit: float) -> np.ndarray:
    out = np.empty(g.shape, np.float32)
    if g.size:
        swiglu_nb(readonly(g, np.float32), readonly(u, np.float32), float(limit), out)
    return out
