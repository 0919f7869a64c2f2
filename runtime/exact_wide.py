"""Exact mode's fallback sum in numba: a wide fixed-point accumulator.

For a slot whose float64 span check fails (``exact.exact_matmul``), D is
RNE_fp32 of the exact sum of w_i * q_i * 2^s[i // 32]. Every term is an
integer v = m_i * q_i (|m_i| < 2^24 the weight's integer mantissa, |q_i| <=
127, so |v| < 2^31) times 2^k with k = e_i + s_b in [-305, 225]; the sum of
at most 2^20 terms is below 2^(225 + 31 + 20). The accumulator is ``NL``
signed 64-bit limbs of 32 bits each from 2^BASE: a term is split into two
limbs, each limb stays below 2^53 in magnitude, and one carry pass gives
the exact two's-complement value, rounded once to float32 (nearest, ties to
even, gradual underflow, overflow to +-Inf; an exact zero is +0.0, a
nonzero value that rounds to zero keeps its sign), as ``exact.round_f32``
does with Python integers. tests/runtime/test_exact.py checks it against
``exact_dot_ref`` on adversarial spans.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from ds4quant.runtime.fast import decode_row_fast

BASE = -320  # exponent of limb 0's lowest bit: below the smallest term (2^-305)
NL = 20  # 640 bits: up to 2^320, above the largest sum (2^276)


@numba.njit(cache=True, nogil=True)
def _bit(L, pos):
    if pos < 0:
        return 0
    return (L[pos >> 5] >> (pos & 31)) & 1


@numba.njit(cache=True, nogil=True)
def exact_dot_wide_nb(w, q, s):
    """RNE_fp32(sum_i w[i] * q[i] * 2^s[i // 32]): w float32 (finite), q int64, s int64 (blocks)."""
    L = np.zeros(NL, np.int64)
    nz = False
    for i in range(w.shape[0]):
        qi = q[i]
        wi = np.float64(w[i])
        if qi == 0 or wi == 0.0:
            continue
        f, e = math.frexp(wi)
        m = np.int64(math.ldexp(f, 24))  # exact: a float32 has 24 significant bits
        v = m * qi
        p = (e - 24) + s[i // 32] - BASE
        t = v << (p & 31)  # |v| < 2^31, shift < 32: |t| < 2^62
        j = p >> 5
        L[j] += t & 0xFFFFFFFF
        L[j + 1] += t >> 32  # arithmetic: t == (t >> 32) * 2^32 + (t & 0xFFFFFFFF)
        nz = True
    if not nz:
        return np.float32(0.0)
    carry = np.int64(0)
    for j in range(NL):
        v = L[j] + carry
        L[j] = v & 0xFFFFFFFF
        carry = v >> 32
    sign = 1.0
    if carry < 0:  # negative: take the magnitude (two's complement over the limbs)
        sign = -1.0
        c = np.int64(1)
        for j in range(NL):
            v = ((~L[j]) & 0xFFFFFFFF) + c
            L[j] = v & 0xFFFFFFFF
            c = v >> 32
    hi = NL - 1
    while hi >= 0 and L[hi] == 0:
        hi -= 1
    if hi < 0:
        return np.float32(0.0)  # an exact zero sum
    nb = 0
    top = L[hi]
    while top:
        nb += 1
        top >>= 1
    msb = 32 * hi + nb - 1  # position (from BASE) of the leading bit
    E = msb + BASE
    keep = 24 if E >= -126 else E + 150  # significant bits float32 keeps at this exponent
    if keep < 0:
        return np.float32(sign * 0.0)  # below half the smallest subnormal
    lo = msb - keep + 1  # lowest kept bit
    M = np.int64(0)
    for b in range(msb, lo - 1, -1):
        M = (M << 1) | _bit(L, b)
    r = lo - 1  # the rounding bit; sticky: any bit below it
    rbit = _bit(L, r)
    sticky = False
    if r > 0:
        jj = r >> 5
        if L[jj] & ((np.int64(1) << (r & 31)) - 1):
            sticky = True
        for j in range(jj):
            if L[j]:
                sticky = True
                break
    if rbit and (sticky or (M & 1)):
        M += 1
    # M <= 2^24 times a power of two: exact in float64, exact (or +-Inf) in float32
    return np.float32(sign * math.ldexp(np.float64(M), lo + BASE))


@numba.njit(cache=True, nogil=True)
def fallback_rows_nb(kind, p0, p1, data, cols, lut, mode, qi, s, flags, out):
    """out[t, j] = exact_dot_wide_nb(decode(row j), qi[t], s[t]) for every flagged
    (t, j) of data uint8 (rows, row_bytes); each row decoded once."""
    T, rows = flags.shape
    w = np.empty(cols, np.float32)
    wb = w.view(np.uint32)
    for j in range(rows):
        need = False
        for t in range(T):
            if flags[t, j]:
                need = True
        if not need:
            continue
        decode_row_fast(kind, p0, p1, data[j], cols, lut, mode, w, wb)
        for t in range(T):
            if flags[t, j]:
                out[t, j] = exact_dot_wide_nb(w, qi[t], s[t])
