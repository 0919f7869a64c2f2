"""The numba fast path of the scale search: ``encode_rows_nb`` / ``decode_rows_nb``.

Walks the candidates from ``N(max/top)`` outwards like the reference codec,
abandons a candidate once its partial sum exceeds the best, and stops walking
in a direction once a lower bound of every further candidate's error exceeds
the best, so it returns exactly the argmin of ``_scale_search_ref`` (see
``scale_codecs`` for the rule and the bounds).
"""

from __future__ import annotations

import numba
import numpy as np

from ds4quant.formats.search.numba_scale import row_energy_nb, row_energy_s40_nb
from ds4quant.formats.search.tables import (
    BITS, F32, FP2, FP3, FP4, FP6, FP8, INIT_E, INIT_ERR, LEVELS, S40, SCALES, TOP,
)
from ds4quant.formats.ue4m3 import FLT_MAX, UE4M3, UE4M3_INV, nearest_nb


# numba fast path
#
# Everything is float32; constants are np.float32 so nothing promotes to
# float64 (which would round differently), and no fastmath.

_HALF = F32(0.5)
_ZERO = F32(0.0)
_ONE = F32(1.0)
_INF = F32(np.inf)


@numba.njit(cache=True, inline="always")
def _fp2_level_nb(v):
    """The FP2 level nearest to v = x*inv by float32 |v - V| (first minimum
    wins, as the reference loops codes 0..3), as selects so it vectorises."""
    lv = F32(-1.0)
    bd = abs(v + _ONE)  # |v - (-1)|: the same IEEE operation
    d = abs(v)
    lv = _ZERO if d < bd else lv
    bd = d if d < bd else bd
    d = abs(v - _ONE)
    lv = _ONE if d < bd else lv
    bd = d if d < bd else bd
    d = abs(v - F32(2.0))
    return F32(2.0) if d < bd else lv


@numba.njit(cache=True, inline="always")
def _weight_nb(fmt, x, q, sigma2):
    """The importance weight (docs/formats.md#scale-search) of one finite element (the S40 fork: not clamped), as selects.

    With q > 0 an overflowing sigma^2 + x*x gives q*sqrt(inf) = inf, so one
    inf test covers both FLT_MAX cases of docs/formats.md#scale-search.
    """
    w = q * np.sqrt(sigma2 + x * x)
    if fmt != S40:
        w = FLT_MAX if np.isinf(w) else w
    return w if (q > _ZERO and np.isfinite(q)) else _ZERO


@numba.njit(cache=True, inline="always")
def _group_codes_nb(fmt, x, base, n, inv, flip, codes, off):
    """codes[off+i] = code(+-x[base+i], inv) for a group, as straight loops.

    Same codes as quantize_ref (non-finite x -> the zero code; inv = 0 puts
    every finite x on the zero level, except S40, whose zero code is 0).
    """
    sg = F32(-1.0) if flip else _ONE
    if fmt == FP2:
        for i in range(n):
            v = x[base + i] * sg
            c = np.int64(_fp2_level_nb(v * inv)) + 1
            codes[off + i] = c if np.isfinite(v) else 1
    elif fmt == FP3:
        for i in range(n):
            v = x[base + i] * sg
            a = abs(v * inv)
            k = np.int64(a > _HALF) + np.int64(a > F32(1.5)) + np.int64(a > F32(3.0))
            c = k | (4 if (v < _ZERO and k > 0) else 0)
            codes[off + i] = c if np.isfinite(v) else 0
    elif fmt == FP4:
        for i in range(n):
            v = x[base + i] * sg
            a = abs(v * inv)
            k = (np.int64(a > _HALF) + np.int64(a > F32(1.5)) + np.int64(a > F32(2.5))
                 + np.int64(a > F32(3.5)) + np.int64(a > F32(5.0)) + np.int64(a > F32(7.0))
                 + np.int64(a > F32(9.0)))
            c = k | (8 if (v < _ZERO and k > 0) else 0)
            codes[off + i] = c if np.isfinite(v) else 0
    elif fmt == FP6:
        for i in range(n):
            v = x[base + i] * sg
            a = min(abs(v * inv), F32(31.0))
            m = np.floor(a)
            k = np.int64(m + np.float32(a - m >= _HALF))
            c = k | (32 if (v < _ZERO and k > 0) else 0)
            codes[off + i] = c if np.isfinite(v) else 0
    elif fmt == FP8:
        for i in range(n):
            v = x[base + i] * sg
            q = min(max(v * inv, F32(-127.0)), F32(127.0))
            a = abs(q)
            m = np.floor(a)
            k = np.int64(m + np.float32(a - m >= _HALF))
            c = (-k if q < _ZERO else k) & 0xFF
            codes[off + i] = c if np.isfinite(v) else 0
    else:  # S40
        for i in range(n):
            v = x[base + i] * sg
            outer = abs(v * inv) > F32(2.5)
            c = (0 if outer else 1) if np.signbit(v) else (3 if outer else 2)
            codes[off + i] = c if (np.isfinite(v) and inv > _ZERO) else 0


@numba.njit(cache=True, inline="always")
def _terms_nb(fmt, xg, wg, n, s, inv, t):
    """t[i] = (w_i*d_i)*d_i for every element at scale s.

    One straight loop per format with no data-dependent branches, so LLVM
    vectorises it when n is a compile-time constant (see _eval_nb; with a
    runtime trip count of 16 the vector loop is skipped for the scalar
    remainder). Levels come from comparison counts; a zero level may
    carry the sign of x here (-0*s), which changes d only by the sign of a
    zero and never the term. S40 takes the sign from x < 0 instead of
    signbit(x): for x = -0.0 that flips d = -+S, again the same term.
    """
    if fmt == FP2:
        for i in range(n):
            x = xg[i]
            d = x - _fp2_level_nb(x * inv) * s
            t[i] = (wg[i] * d) * d
    elif fmt == FP3:
        for i in range(n):
            x = xg[i]
            a = abs(x * inv)
            k = (a > _HALF) + (a > F32(1.5)) + (a > F32(3.0))
            m = np.float32(k + (k == 3))  # {0, 1, 2, 4}
            d = x - (-m if x < _ZERO else m) * s
            t[i] = (wg[i] * d) * d
    elif fmt == FP4:
        for i in range(n):
            x = xg[i]
            a = abs(x * inv)
            k = ((a > _HALF) + (a > F32(1.5)) + (a > F32(2.5)) + (a > F32(3.5))
                 + (a > F32(5.0)) + (a > F32(7.0)) + (a > F32(9.0)))
            m = np.float32(max(k, 2 * k - 4))  # {0, 1, 2, 3, 4, 6, 8, 10}
            d = x - (-m if x < _ZERO else m) * s
            t[i] = (wg[i] * d) * d
    elif fmt == FP6:
        for i in range(n):
            x = xg[i]
            a = min(abs(x * inv), F32(31.0))
            m = np.floor(a)
            m = m + np.float32(a - m >= _HALF)  # lroundf
            d = x - (-m if x < _ZERO else m) * s
            t[i] = (wg[i] * d) * d
    elif fmt == FP8:
        for i in range(n):
            x = xg[i]
            v = x * inv
            a = min(abs(v), F32(127.0))
            m = np.floor(a)
            m = m + np.float32(a - m >= _HALF)
            d = x - (-m if v < _ZERO else m) * s
            t[i] = (wg[i] * d) * d
    else:  # S40
        for i in range(n):
            x = xg[i]
            m = F32(4.0) if abs(x * inv) > F32(2.5) else _ONE
            d = x - (-m if x < _ZERO else m) * s
            t[i] = (wg[i] * d) * d


@numba.njit(cache=True, inline="always")
def _eval_nb(fmt, xg, wg, n, e, best, t):
    """err(e) of a group: the sequential float32 sum in element order, or a
    partial sum once it exceeds ``best`` (all terms are >= 0).

    xg holds 0 for non-finite inputs and wg their weight 0 (1 for finite
    inputs when unweighted: (1*d)*d == d*d), so every term is summed in order.
    """
    s = UE4M3[e]
    inv = UE4M3_INV[e]
    if n == 16:  # constant trip counts: one vector loop each
        _terms_nb(fmt, xg, wg, 16, s, inv, t)
    else:
        _terms_nb(fmt, xg, wg, 32, s, inv, t)
    err = _ZERO
    for i in range(n):
        err += t[i]
        if err > best:
            return err
    return err


@numba.njit(cache=True, inline="always")
def _walk_start_nb(t):
    """The S40 fork's nearest byte (binary search, ties lower), 0 for t <= 0."""
    if not (t > _ZERO) or not np.isfinite(t):
        return 0
    lo = 1
    hi = 126
    while lo < hi:
        mid = lo + (hi - lo) // 2
        if UE4M3[mid] < t:
            lo = mid + 1
        else:
            hi = mid
    if lo == 1:
        return 1
    if t - UE4M3[lo - 1] <= UE4M3[lo] - t:
        return lo - 1
    return lo


@numba.njit(cache=True, inline="always")
def _stops_up_nb(fmt, max_abs, e):
    """True when every scale above e has the same error as e, or a larger one.

    Zero-level formats: once the largest |x*inv| is on the zero level, every
    element is (|x_i*inv| <= max_abs*inv), so every larger scale has the
    identical error sum(w*x*x), and ties go to the smaller byte. S40 has no
    zero level: once S >= max_abs every code is +-1 and each |d| = S - |x|
    grows with S, so err is non-decreasing from here on.
    """
    if fmt == S40:
        return UE4M3[e] >= max_abs
    a = max_abs * UE4M3_INV[e]
    if fmt == FP3 or fmt == FP4:
        return a <= _HALF
    return a < _HALF  # FP2 (-0.5 is code 0), FP6/FP8 (0.5 rounds away)


@numba.njit(cache=True, inline="always")
def _keeps_term_nb(fmt, x, s, inv):
    """Whether element x's term at scale s bounds its term at every larger scale."""
    if fmt == S40:
        return abs(x) <= s  # on +-1, |d| = S - |x| grows with S
    q = x * inv
    if fmt == FP2:
        return q > F32(-0.5) and q <= _HALF  # zero level, stays there
    if fmt == FP3 or fmt == FP4:
        return abs(q) <= _HALF
    return abs(q) < _HALF


_BOUND_MARGIN = F32(1.0 - 2.0**-16)


@numba.njit(cache=True, inline="always")
def _larger_scales_lose_nb(fmt, xg, n, s, inv, t, z, best):
    """True when err(e') > best for every e' above the scale s just evaluated.

    Z, the in-order float32 sum of the terms t_i of elements that keep their
    term (or a smaller one) at every larger scale, bounds err(e') from below:
    float addition is monotone. Z itself is not summed in order here: a
    pairwise sum P (depth <= 5) satisfies Z >= P*(1 - 36*2^-24) for terms
    >= 0, so a finite P*(1 - 2^-16) >= best proves Z > best, in a few
    dependent adds instead of up to 32.
    """
    for i in range(n):
        z[i] = t[i] if _keeps_term_nb(fmt, xg[i], s, inv) else _ZERO
    m = n
    while m > 1:
        m = m // 2
        for i in range(m):
            z[i] = z[i] + z[i + m]
    return z[0] < _INF and z[0] * _BOUND_MARGIN >= best


@numba.njit(cache=True, inline="always")
def _smaller_scales_lose_nb(fmt, xg, wg, n, s, z, best):
    """True when err(e') > best for every e' at or below scale s.

    Every level satisfies |y| <= top*S' <= top*s (FP2 below zero: 1*s), so
    |d_i| >= c_i = |x_i| - top*s wherever that is positive, and the in-order
    sum of (w*c)*c bounds err(e') from below; P is its pairwise sum, as in
    _larger_scales_lose_nb. This extends the reference's clip test from the
    largest element to all of them.
    """
    top = TOP[fmt]
    for i in range(n):
        x = xg[i]
        r = _ONE if (fmt == FP2 and x < _ZERO) else top
        c = abs(x) - r * s
        z[i] = (wg[i] * c) * c if c > _ZERO else _ZERO
    m = n
    while m > 1:
        m = m // 2
        for i in range(m):
            z[i] = z[i] + z[i + m]
    return z[0] < _INF and z[0] * _BOUND_MARGIN > best


@numba.njit(cache=True, inline="always")
def search_nb(fmt, xg, wg, n, max_abs, w_max, init_e, init_err, t, z):
    """The scale search (docs/formats.md#scale-search) for one group with max_abs > 0: returns (e, err(e)).

    The walk visits e0, e0-1, e0+1, ... from e0 = N(max_abs/top). Walking
    down stops once (w_max*cd)*cd > best with cd = max_abs - top*S > 0: the
    largest element's term alone is at least that (|y| <= top*S), and cd
    only grows as e falls; or, after a rejected candidate, once
    _smaller_scales_lose_nb proves it for all elements together. Walking up
    stops per _stops_up_nb, or once a rejected candidate shows that every
    larger one loses too.
    """
    top = TOP[fmt]
    e0 = _walk_start_nb(max_abs / top)
    if e0 < 1:
        e0 = 1
    best_e = init_e
    best = init_err
    down_done = False
    up_done = False
    for delta in range(127):
        if not down_done:
            e = e0 - delta
            if e < 1:
                down_done = True
            else:
                cd = max_abs - top * UE4M3[e]
                if cd > _ZERO and (w_max * cd) * cd > best:
                    down_done = True
                else:
                    err = _eval_nb(fmt, xg, wg, n, e, best, t)
                    if err < best or (err == best and e < best_e):
                        best = err
                        best_e = e
                    if delta == 0 and _stops_up_nb(fmt, max_abs, e):
                        up_done = True
                    if err > best and e > 1 and _smaller_scales_lose_nb(fmt, xg, wg, n, UE4M3[e - 1], z, best):
                        down_done = True
        if delta > 0 and not up_done:
            e = e0 + delta
            if e > 126:
                up_done = True
            else:
                err = _eval_nb(fmt, xg, wg, n, e, best, t)
                if err < best or (err == best and e < best_e):
                    best = err
                    best_e = e
                if _stops_up_nb(fmt, max_abs, e):
                    up_done = True
                elif err > best and _larger_scales_lose_nb(fmt, xg, n, UE4M3[e], UE4M3_INV[e], t, z, best):
                    up_done = True
        if down_done and up_done:
            break
    return best_e, best


@numba.njit(cache=True, inline="always")
def _pack_block_nb(fmt, codes, out, off):
    """Write 32 codes as the format's qs bytes at out[off:]."""
    bits = BITS[fmt]
    if bits == 4:  # docs/formats.md#rocmfp4 split nibbles: low = weight j, high = weight j+16
        for j in range(16):
            out[off + j] = np.uint8((codes[j] & 15) | ((codes[j + 16] & 15) << 4))
        return
    nbytes = 4 * bits
    for j in range(nbytes):
        out[off + j] = 0
    for i in range(32):  # little-endian bit stream, code i at bits*i (docs/formats.md#rocmfp2, #rocmfp3, #rocmfp6)
        pos = bits * i
        b = pos >> 3
        v = np.int64(codes[i]) << (pos & 7)
        out[off + b] |= np.uint8(v & 0xFF)
        if (pos & 7) + bits > 8:
            out[off + b + 1] |= np.uint8(v >> 8)


@numba.njit(cache=True, inline="always")
def _unpack_block_nb(fmt, row, off, codes):
    bits = BITS[fmt]
    if bits == 4:
        for j in range(16):
            c = row[off + j]
            codes[j] = c & 15
            codes[j + 16] = c >> 4
        return
    mask = (1 << bits) - 1
    for i in range(32):
        pos = bits * i
        b = pos >> 3
        v = np.int64(row[off + b])
        if (pos & 7) + bits > 8:
            v |= np.int64(row[off + b + 1]) << 8
        codes[i] = (v >> (pos & 7)) & mask


@numba.njit(cache=True, nogil=True)
def _encode_row_nb(fmt, x, imp, has_imp, group, mirror, zero_seed, fp8_nearest, out):
    cols = x.shape[0]
    nscales = 32 // group
    qsb = 4 * BITS[fmt]
    block_bytes = qsb + nscales
    sigma2 = _ZERO
    if has_imp:
        sigma2 = row_energy_s40_nb(x) if fmt == S40 else row_energy_nb(x)
    xg = np.empty(group, np.float32)
    ng = np.empty(group, np.float32)
    wg = np.empty(group, np.float32)
    tb = np.empty(group, np.float32)
    zb = np.empty(group, np.float32)
    codes = np.empty(32, np.int64)
    for blk in range(cols // 32):
        off = blk * block_bytes
        for h in range(nscales):
            base = blk * 32 + h * group
            # non-finite inputs become x = 0 with weight 0: their terms vanish
            if has_imp:
                for i in range(group):
                    v = x[base + i]
                    fin = np.isfinite(v)
                    xv = v if fin else _ZERO
                    xg[i] = xv
                    wg[i] = _weight_nb(fmt, xv, imp[base + i], sigma2) if fin else _ZERO
            else:
                for i in range(group):
                    v = x[base + i]
                    fin = np.isfinite(v)
                    xg[i] = v if fin else _ZERO
                    wg[i] = _ONE if fin else _ZERO
            max_abs = _ZERO
            for i in range(group):
                max_abs = max(max_abs, abs(xg[i]))
            w_max = _ZERO  # the largest weight among the largest elements
            for i in range(group):
                w_max = max(w_max, wg[i] if abs(xg[i]) == max_abs else _ZERO)
            e = 0
            err = _ZERO
            flip = False
            if max_abs > _ZERO:
                if fp8_nearest and not has_imp:
                    e = nearest_nb(max_abs / F32(127.0))  # docs/formats.md#rocmfp8: no search
                else:
                    init_e = INIT_E[fmt]
                    init_err = INIT_ERR[fmt]
                    if fmt == S40:
                        if zero_seed:
                            # err(0): every code is the -4 level times 0 = -0.
                            init_e = 0
                            init_err = _ZERO
                            for i in range(group):
                                init_err += (wg[i] * xg[i]) * xg[i]
                        else:
                            init_e = _walk_start_nb(max_abs / TOP[S40])
                            init_err = _INF
                    e, err = search_nb(fmt, xg, wg, group, max_abs, w_max, init_e, init_err, tb, zb)
                    if mirror:
                        for i in range(group):
                            ng[i] = -xg[i]
                        em, errm = search_nb(fmt, ng, wg, group, max_abs, w_max, init_e, init_err, tb, zb)
                        if errm < err:
                            e = em
                            flip = True
            _group_codes_nb(fmt, x, base, group, UE4M3_INV[e], flip, codes, h * group)
            out[off + qsb + h] = np.uint8(e | (0x80 if flip else 0))
        _pack_block_nb(fmt, codes, out, off)


@numba.njit(cache=True, parallel=True, nogil=True)
def encode_rows_nb(fmt, x, imp, has_imp, group, mirror, zero_seed, fp8_nearest, out):
    """Encode float32 x (rows, cols) into out uint8 (rows, row_bytes); rows in parallel."""
    for r in numba.prange(x.shape[0]):
        _encode_row_nb(fmt, x[r], imp, has_imp, group, mirror, zero_seed, fp8_nearest, out[r])


@numba.njit(cache=True, parallel=True, nogil=True)
def decode_rows_nb(fmt, data, group, out):
    """out (rows, cols) float32 = LEVELS[code] * SCALES[e] per group; rows in parallel."""
    rows, cols = out.shape
    nscales = 32 // group
    qsb = 4 * BITS[fmt]
    block_bytes = qsb + nscales
    lv = LEVELS[fmt]
    sc = SCALES[fmt]
    for r in numba.prange(rows):
        row = data[r]
        codes = np.empty(32, np.int64)
        for blk in range(cols // 32):
            off = blk * block_bytes
            _unpack_block_nb(fmt, row, off, codes)
            for h in range(nscales):
                s = sc[row[off + qsb + h]]
                for i in range(group):
                    out[r, blk * 32 + h * group + i] = lv[codes[h * group + i]] * s
