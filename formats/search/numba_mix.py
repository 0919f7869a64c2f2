"""The MIX search on the host (docs/formats.md#mix-encoder mode 1, and ds4quant's mode 0): numba, vectorised.

The same candidates, comparisons and float32 sums as the reference encoder
(``rocmfp_mix._encode_ref``, one half at a time), with SIMD lanes over a
tile of halves (each lane's error is still the sequential float32 sum in
element order; lanes never mix), so the choices are bit-identical. NL(v)
becomes a select chain over the splits: for non-decreasing splits the last
split below v gives the same level as the binary search (ties to the lower
level), and v is never NaN here (non-finite halves are refused before their
codes count).

``choose`` returns per half the book, the scale byte, the codes and a
status; ``numba_pack`` refuses a matrix with a refused half, as the
reference does, and writes the blocks from the choices.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from ds4quant.formats.search.tables import HALF
from ds4quant.formats.ue4m3 import UE4M3, UE4M3_INV

_F32 = np.float32

def splits(books: np.ndarray) -> np.ndarray:
    """NL's split points per book: 0.5 * (level[j] + level[j+1]), sum rounded
    first (docs/formats.md#mix-encoder), float32 (2, L-1)."""
    with np.errstate(over="ignore"):
        return (_F32(0.5) * (books[:, :-1] + books[:, 1:])).astype(np.float32)


def max_level(books: np.ndarray) -> np.ndarray:
    """ML per book: max_j |level_b[j]|, float32 (2,)."""
    return np.abs(books).max(axis=1).astype(np.float32)




@numba.njit(cache=True, nogil=True)
def fixed_code_nb(v, bits):
    """Mode-0 element quantiser (see ``rocmfp_mix._fixed_codes_ref``), one value."""
    if bits == 2:
        if v <= np.float32(-0.5):
            return 0
        if v <= np.float32(0.5):
            return 1
        if v <= np.float32(1.5):
            return 2
        return 3
    a = abs(v)
    idx = 0
    if a > np.float32(0.5):
        idx = 1
    if a > np.float32(1.5):
        idx = 2
    if a > np.float32(3.0):
        idx = 3
    if v < np.float32(0.0) and idx != 0:
        idx |= 4
    return idx


_TILE = 64  # halves per SIMD tile
_TILES_PER_TASK = 16  # tiles per prange task (scratch is allocated per task)


@numba.njit(cache=True, nogil=True)
def _first_ge_nb(t):
    """The first byte e in 1..126 with S(e) >= t (127 if none) for a positive
    finite float32 t: a guess from t's binary exponent and top mantissa bits
    (S(e) = (8 + M) 2^(E - 11), or M 2^-10 for E = 0), then walked to the exact
    boundary of the non-decreasing table, so it is the bisection's answer."""
    if t > UE4M3[126]:
        return 127
    m, k = math.frexp(t)  # t = m 2^k, m in [0.5, 1)
    E = k + 7
    if E >= 1:
        e = (E << 3) + int(np.float32(16.0) * m - np.float32(8.0))
    else:
        e = int(t * np.float32(1024.0))
    e = min(max(e, 1), 126)
    while e > 1 and UE4M3[e - 1] >= t:
        e -= 1
    while e < 126 and UE4M3[e] < t:
        e += 1
    return e


@numba.njit(cache=True, nogil=True)
def _nearest_nb(t):
    """``ue4m3.nearest_nb`` (the first byte of least float32 |S(e) - t|):
    below the first byte with S(e) >= t the rounded distance never rises,
    above it never falls, so the least is at that byte or the one below, and
    a tie run (huge t) is walked down to its first byte."""
    if not (t > np.float32(0.0)) or not np.isfinite(t):
        return 0
    lo = _first_ge_nb(t)
    if lo == 127:
        e = 126
    elif lo > 1 and abs(UE4M3[lo - 1] - t) <= abs(UE4M3[lo] - t):
        e = lo - 1
    else:
        return lo
    d = abs(UE4M3[e] - t)
    while e > 1 and abs(UE4M3[e - 1] - t) == d:
        e -= 1
    return e


_T_LO = np.uint32(np.float32(2.0**-7).view(np.uint32))  # S(8): bytes >= 8 are (8 + M) 2^(E - 11)
_T_HI = np.uint32(np.float32(224.0).view(np.uint32))  # S(126)


@numba.njit(cache=True, nogil=True)
def _nearest_lanes_nb(tt, cen, slow):
    """cen[k] = _nearest_nb(tt[k]) for a tile, without a search where it can:
    for S(8) <= t <= S(126) the byte of t truncated to 3 mantissa bits is
    (bits >> 20) - 952 (S(e) <= t < S(e + 1)), so the first byte with
    S(e) >= t is that or the next and the nearest is it or the one below;
    other targets, and a possible tie run below, take _nearest_nb."""
    T = tt.shape[0]
    ti = tt.view(np.uint32)
    for k in range(T):
        u = ti[k]
        lo = np.int64(u >> np.uint32(20)) - 952 + (1 if (u & np.uint32(0xFFFFF)) != 0 else 0)
        lo = min(max(lo, 2), 126)
        t = tt[k]
        dlo = abs(UE4M3[lo - 1] - t)
        e = lo - 1 if dlo <= abs(UE4M3[lo] - t) else lo
        cen[k] = e
        slow[k] = not (u >= _T_LO and u <= _T_HI) or (e == lo - 1 and e > 1 and abs(UE4M3[e - 1] - t) == dlo)
    for k in range(T):
        if slow[k]:
            cen[k] = _nearest_nb(tt[k])


@numba.njit(cache=True, nogil=True)
def _load_tile_nb(h, t0, n, wq, has_w, xt, wt, mx, wok, fin, zacc, wphase):
    """Transpose halves t0..t0+n of h (G, 16) into xt/wt (16, _TILE); per
    lane its max |x|, whether its weights are usable and its values finite
    (docs/formats.md#mix-encoder steps 1-3). Lanes >= n are zero halves with weight 1.

    The lane statistics run over the transposed tile, so they vectorise; the
    weights depend only on the tile's phase t0 % hpr (tiles start at
    multiples of _TILE), so they are copied only when it changes
    (``wphase[0]`` remembers the loaded phase, -1 for none)."""
    hpr = wq.shape[0]
    T = _TILE
    zero_f = np.float32(0.0)
    for k in range(n):
        g = t0 + k
        for i in range(16):
            xt[i, k] = h[g, i]
    for k in range(n, T):
        for i in range(16):
            xt[i, k] = zero_f
    for k in range(T):
        mx[k] = zero_f
        zacc[k] = zero_f
    for i in range(16):
        for k in range(T):
            v = xt[i, k]
            a = abs(v)
            mx[k] = a if a > mx[k] else mx[k]  # NaN never wins, as the scalar walk
            zacc[k] += np.float32(v * zero_f)  # NaN once any value is Inf or NaN
    for k in range(T):
        fin[k] = zacc[k] == zero_f
    phase = t0 % hpr if has_w else 0
    if n == T and wphase[0] == phase:
        return
    wphase[0] = phase if n == T else -1
    for k in range(T):
        if k >= n:
            for i in range(16):
                wt[i, k] = np.float32(1.0)
            wok[k] = True
            continue
        if not has_w:
            for i in range(16):
                wt[i, k] = np.float32(1.0)
            wok[k] = True
            continue
        r = (t0 + k) % hpr
        ok = True
        for i in range(16):
            q = wq[r, i]
            if not (np.isfinite(q) and q >= zero_f):
                ok = False
            wt[i, k] = q
        wok[k] = ok


@numba.njit(cache=True, nogil=True, inline="always")
def _cand_err4_nb(xt, wt, s, inv, err, lv, sp):
    """err[k] = sum_i (w*d)*d over the tile's lanes for one candidate per lane
    (scale s[k], 1/S inv[k]); one pass per element, the NL select chain
    unrolled so the lane loop vectorises. 4 levels."""
    l0, l1, l2, l3 = lv[0], lv[1], lv[2], lv[3]
    s0, s1, s2 = sp[0], sp[1], sp[2]
    for i in range(16):
        for k in range(_TILE):
            x = xt[i, k]
            v = np.float32(x * inv[k])
            y = l0
            y = l1 if v > s0 else y
            y = l2 if v > s1 else y
            y = l3 if v > s2 else y
            d = np.float32(x - np.float32(s[k] * y))
            err[k] = np.float32(err[k] + np.float32(np.float32(wt[i, k] * d) * d))


@numba.njit(cache=True, nogil=True, inline="always")
def _cand_err8_nb(xt, wt, s, inv, err, lv, sp):
    """_cand_err4_nb for 8 levels."""
    l0, l1, l2, l3, l4, l5, l6, l7 = lv[0], lv[1], lv[2], lv[3], lv[4], lv[5], lv[6], lv[7]
    s0, s1, s2, s3, s4, s5, s6 = sp[0], sp[1], sp[2], sp[3], sp[4], sp[5], sp[6]
    for i in range(16):
        for k in range(_TILE):
            x = xt[i, k]
            v = np.float32(x * inv[k])
            y = l0
            y = l1 if v > s0 else y
            y = l2 if v > s1 else y
            y = l3 if v > s2 else y
            y = l4 if v > s3 else y
            y = l5 if v > s4 else y
            y = l6 if v > s5 else y
            y = l7 if v > s6 else y
            d = np.float32(x - np.float32(s[k] * y))
            err[k] = np.float32(err[k] + np.float32(np.float32(wt[i, k] * d) * d))


@numba.njit(cache=True, nogil=True, inline="always")
def _codes4_nb(v, sp, k):
    """NL(v) for one lane as an int32 count of the splits below v (4 levels)."""
    c = np.int32(0)
    c += np.int32(1) if v > sp[0, k] else np.int32(0)
    c += np.int32(1) if v > sp[1, k] else np.int32(0)
    c += np.int32(1) if v > sp[2, k] else np.int32(0)
    return c


@numba.njit(cache=True, nogil=True, inline="always")
def _codes8_nb(v, sp, k):
    """_codes4_nb for 8 levels."""
    c = np.int32(0)
    c += np.int32(1) if v > sp[0, k] else np.int32(0)
    c += np.int32(1) if v > sp[1, k] else np.int32(0)
    c += np.int32(1) if v > sp[2, k] else np.int32(0)
    c += np.int32(1) if v > sp[3, k] else np.int32(0)
    c += np.int32(1) if v > sp[4, k] else np.int32(0)
    c += np.int32(1) if v > sp[5, k] else np.int32(0)
    c += np.int32(1) if v > sp[6, k] else np.int32(0)
    return c


@numba.njit(cache=True, nogil=True)
def _scratch_nb(L):
    """One tile's scratch, allocated once per call or prange task: float32
    (16, T) x and w, (L-1, T) per-lane splits; per-lane float32 and int32
    vectors. Lane state is int32 beside float32 so the lane loops vectorise
    at one width."""
    T = _TILE
    return (np.empty((16, T), np.float32), np.empty((16, T), np.float32), np.empty(T, np.float32),
            np.empty(T, np.bool_), np.empty(T, np.bool_), np.empty((2, T), np.int32), np.empty(T, np.float32),
            np.empty(T, np.bool_), np.empty(T, np.float32), np.empty(T, np.float32), np.empty(T, np.float32),
            np.empty(T, np.float32), np.empty(T, np.float32), np.empty(T, np.int32), np.empty(T, np.int32),
            np.empty(T, np.int32), np.empty((max(L - 1, 1), T), np.float32), np.empty((16, T), np.int32),
            np.empty(T, np.float32), np.full(1, -1, np.int64))


@numba.njit(cache=True, nogil=True, inline="always")
def _books_tile_nb(xt, wt, mx, wok, books, split, ml, sc):
    """Mode 1 (docs/formats.md#mix-encoder) for one loaded tile: per lane the (book, byte) of
    the reference encoder into bk/be (0, 0 for zero lanes), its error into best (inf
    where none is finite), and the codes NL(x / S) in that book into ct
    (16, T). Candidates come in (book, byte) order, so the kernel's tie rule
    (lower book, then lower byte) never adopts a later one: a strict < is it."""
    cen, tt, slow, s, inv, err, pen = sc[5], sc[6], sc[7], sc[8], sc[9], sc[10], sc[11]
    best, bk, be, ev, spk, ct = sc[12], sc[13], sc[14], sc[15], sc[16], sc[17]
    T = _TILE
    L = books.shape[1]
    inf = np.float32(np.inf)
    zero_f = np.float32(0.0)
    for k in range(T):
        best[k] = inf
        bk[k] = 0
        be[k] = 1
    for b in range(2):
        if ml[b] > zero_f:
            for k in range(T):
                tt[k] = np.float32(mx[k] / ml[b])
            _nearest_lanes_nb(tt, cen[b], slow)
    for b in range(2):
        if not (ml[b] > zero_f):
            continue
        for delta in range(-2, 3):
            for k in range(T):
                e = cen[b, k] + np.int32(delta)
                ec = min(max(e, np.int32(1)), np.int32(126))
                s[k] = UE4M3[ec]
                inv[k] = UE4M3_INV[ec]
                err[k] = zero_f
                ev[k] = e
                # an invalid byte or unusable weights: the error becomes inf (or
                # NaN), which a strict < never adopts
                pen[k] = zero_f if ((e == ec) & wok[k]) else inf
            if L == 4:
                _cand_err4_nb(xt, wt, s, inv, err, books[b], split[b])
            else:
                _cand_err8_nb(xt, wt, s, inv, err, books[b], split[b])
            bb = np.int32(b)
            for k in range(T):
                er = err[k] + pen[k]
                take = er < best[k]
                best[k] = er if take else best[k]
                bk[k] = bb if take else bk[k]
                be[k] = ev[k] if take else be[k]
    for k in range(T):
        if mx[k] == zero_f:
            bk[k] = 0
            be[k] = 0
        inv[k] = UE4M3_INV[be[k]]  # S(0)'s entry is 0: zero lanes give v = +-0, NL(0)
        for j in range(L - 1):
            spk[j, k] = split[bk[k], j]
    for i in range(16):
        if L == 4:
            for k in range(T):
                ct[i, k] = _codes4_nb(np.float32(xt[i, k] * inv[k]), spk, k)
        else:
            for k in range(T):
                ct[i, k] = _codes8_nb(np.float32(xt[i, k] * inv[k]), spk, k)


@numba.njit(cache=True, parallel=True, nogil=True)
def _choose_nb(h, wq, has_w, books, split, ml, out_b, out_e, codes, status):
    """Mode 1 (docs/formats.md#mix-encoder): per half of h float32 (G, 16) the (book, byte) of
    the reference encoder and the codes NL(x / S) in that book (NL(0) for zero halves);
    status 1 non-finite, 2 no finite candidate."""
    G = h.shape[0]
    L = books.shape[1]
    T = _TILE
    per = T * _TILES_PER_TASK
    inf = np.float32(np.inf)
    zero_f = np.float32(0.0)
    for task in numba.prange((G + per - 1) // per):
        sc = _scratch_nb(L)
        xt, wt, mx, wok, fin = sc[0], sc[1], sc[2], sc[3], sc[4]
        best, bk, be, ct = sc[12], sc[13], sc[14], sc[17]
        for t0 in range(task * per, min(G, (task + 1) * per), T):
            n = min(T, G - t0)
            _load_tile_nb(h, t0, n, wq, has_w, xt, wt, mx, wok, fin, sc[18], sc[19])
            _books_tile_nb(xt, wt, mx, wok, books, split, ml, sc)
            for k in range(n):
                g = t0 + k
                for i in range(16):
                    codes[g, i] = np.uint8(ct[i, k])
                if not fin[k]:
                    status[g] = 1
                elif mx[k] != zero_f and best[k] == inf:
                    status[g] = 2
                out_b[g] = bk[k]
                out_e[g] = be[k]


@numba.njit(cache=True, nogil=True)
def _zero_from_nb(m, start):
    """The first byte e in 1..126 with float32 m * (1/S(e)) < 0.5 (126 if none),
    walked from ``start`` (the condition holds from some byte on: 1/S falls):
    from there on every element of a half of max |x| = m quantises to level 0,
    so every larger byte gives the same error, sum (w x) x."""
    half = np.float32(0.5)
    e = max(1, min(start, 126))
    if np.float32(m * UE4M3_INV[e]) < half:
        while e > 1 and np.float32(m * UE4M3_INV[e - 1]) < half:
            e -= 1
        return e
    while e < 126 and not (np.float32(m * UE4M3_INV[e]) < half):
        e += 1
    return e


@numba.njit(cache=True, nogil=True, inline="always")
def _fixed_errs_nb(xt, wt, bits, e0, e1, err, best, be, wok):
    """Mode-0 candidates e0..e1-1 in ascending order into best/be (strict <)."""
    T = xt.shape[1]
    zero_f = np.float32(0.0)
    for e in range(e0, e1):
        s = UE4M3[e]
        inv = UE4M3_INV[e]
        for k in range(T):
            err[k] = zero_f
        for i in range(16):
            for k in range(T):
                x = xt[i, k]
                q = np.float32(x * inv)
                if bits == 2:  # docs/formats.md#rocmfp2: {-1, 0, 1, 2}, ties to the lower code
                    y = np.float32(-1.0)
                    y = np.float32(0.0) if q > np.float32(-0.5) else y
                    y = np.float32(1.0) if q > np.float32(0.5) else y
                    y = np.float32(2.0) if q > np.float32(1.5) else y
                else:  # docs/formats.md#rocmfp3: sign + {0, 1, 2, 4}, ties to the lower magnitude
                    a = abs(q)
                    y = zero_f
                    y = np.float32(1.0) if a > np.float32(0.5) else y
                    y = np.float32(2.0) if a > np.float32(1.5) else y
                    y = np.float32(4.0) if a > np.float32(3.0) else y
                    y = -y if q < zero_f else y
                d = np.float32(x - np.float32(s * y))
                err[k] = np.float32(err[k] + np.float32(np.float32(wt[i, k] * d) * d))
        for k in range(T):
            if wok[k] and err[k] < best[k]:
                best[k] = err[k]
                be[k] = e


@numba.njit(cache=True, parallel=True, nogil=True)
def _choose_fixed_nb(h, wq, has_w, bits, out_e, codes, status):
    """Mode 0: per half the byte of the reference's mode 0 (least error over
    1..126, ties to the smaller byte); status as _choose_nb.

    Only a window of bytes is evaluated per tile, with the answer of all 126:
    above the window every lane's error is the constant of its all-zero
    quantisation (``_zero_from_nb``), already met inside it; below it, a lane's
    clipping bound sum w (|x| - S Vmax)^2 (real, float64; it falls as S rises),
    less 1e-5 for the float32 rounding of the evaluated error (under 2e-6),
    exceeds the lane's best, so no byte there can win or tie. While that
    fails for a lane, the tile evaluates the next 8 bytes below and keeps the
    first least over both ranges (the lower byte wins a tie)."""
    G = h.shape[0]
    T = _TILE
    per = T * _TILES_PER_TASK
    inf = np.float32(np.inf)
    zero_f = np.float32(0.0)
    vmax = np.float32(2.0) if bits == 2 else np.float32(4.0)
    vneg = np.float32(1.0) if bits == 2 else np.float32(4.0)
    for task in numba.prange((G + per - 1) // per):
        xt = np.empty((16, T), np.float32)
        wt = np.empty((16, T), np.float32)
        mx = np.empty(T, np.float32)
        wok = np.empty(T, np.bool_)
        fin = np.empty(T, np.bool_)
        err = np.empty(T, np.float32)
        best = np.empty(T, np.float32)
        be = np.empty(T, np.int64)
        best2 = np.empty(T, np.float32)
        be2 = np.empty(T, np.int64)
        zacc = np.empty(T, np.float32)
        wphase = np.full(1, -1, np.int64)
        for t0 in range(task * per, min(G, (task + 1) * per), T):
            n = min(T, G - t0)
            _load_tile_nb(h, t0, n, wq, has_w, xt, wt, mx, wok, fin, zacc, wphase)
            for k in range(T):
                best[k] = inf
                be[k] = 1
            lo = 127
            hi = 1
            for k in range(n):
                if mx[k] > zero_f and fin[k] and wok[k]:
                    c = _nearest_nb(np.float32(mx[k] / vmax))
                    lo = min(lo, max(1, c - 12))
                    hi = max(hi, _zero_from_nb(mx[k], c + 8))
            if lo <= hi:
                _fixed_errs_nb(xt, wt, bits, lo, hi + 1, err, best, be, wok)
                # extend downwards, 8 bytes (an octave) at a time, while some lane's
                # clipping bound at the byte below does not clear its best
                while lo > 1:
                    sl = np.float64(UE4M3[lo - 1])
                    clear = True
                    for k in range(n):
                        if not (mx[k] > zero_f and fin[k] and wok[k]):
                            continue
                        lb = 0.0
                        for i in range(16):
                            x = np.float64(xt[i, k])
                            c64 = abs(x) - sl * np.float64(vmax if x > 0.0 else vneg)
                            if c64 > 0.0:
                                lb += np.float64(wt[i, k]) * c64 * c64
                        if not (lb * (1.0 - 1e-5) > np.float64(best[k])):
                            clear = False
                            break
                    if clear:
                        break
                    lo2 = max(1, lo - 8)
                    for k in range(T):
                        best2[k] = inf
                        be2[k] = 1
                    _fixed_errs_nb(xt, wt, bits, lo2, lo, err, best2, be2, wok)
                    for k in range(T):
                        if best2[k] <= best[k] and best2[k] < inf:  # the lower byte wins a tie
                            best[k] = best2[k]
                            be[k] = be2[k]
                    lo = lo2
            for k in range(T):
                if mx[k] == zero_f:
                    be[k] = 0
            for i in range(16):
                for k in range(n):
                    v = np.float32(xt[i, k] * UE4M3_INV[be[k]]) if be[k] > 0 else zero_f
                    codes[t0 + k, i] = np.uint8(fixed_code_nb(v, bits))
            for k in range(n):
                g = t0 + k
                if not fin[k]:
                    status[g] = 1
                elif mx[k] != zero_f and best[k] == inf:
                    status[g] = 2
                out_e[g] = be[k]


def _serial_twin(fn, name: str):
    """``fn``'s Python function compiled without parallel=True, under its own
    name: numba's cache is keyed by the function's name and line, not its
    flags, so a twin of the same name would share (and overwrite) the
    parallel kernel's cache entry."""
    import types

    f = fn.py_func
    twin = types.FunctionType(f.__code__, f.__globals__, name, f.__defaults__, f.__closure__)
    twin.__qualname__ = name
    return numba.njit(cache=True, nogil=True)(twin)


choose_serial_nb = _serial_twin(_choose_nb, "choose_serial_nb")
_choose_fixed_serial_nb = _serial_twin(_choose_fixed_nb, "_choose_fixed_serial_nb")
_SERIAL_HALVES = 4 * _TILE * _TILES_PER_TASK


def serial(G: int) -> bool:
    """A few tasks, or one thread: the serial twin (same code, prange as range)
    skips the thread-pool launch, which costs more than it saves on small matrices."""
    return G <= _SERIAL_HALVES or numba.get_num_threads() == 1


def choose(x: np.ndarray, importance, books: np.ndarray, mode: int, bits: int):
    """Per half of x (rows, cols): book int64 (G,), byte int64 (G,), codes
    uint8 (G, 16), status int8 (G,) (codes of a refused half are garbage)."""
    h = x.reshape(-1, HALF)
    G = h.shape[0]
    out_b = np.zeros(G, dtype=np.int64)
    out_e = np.zeros(G, dtype=np.int64)
    status = np.zeros(G, dtype=np.int8)
    codes = np.empty((G, HALF), dtype=np.uint8)
    has_w = importance is not None
    wq = importance.reshape(-1, HALF) if has_w else np.zeros((1, HALF), dtype=np.float32)
    one = serial(G)
    if mode == 1:
        fn = choose_serial_nb if one else _choose_nb
        fn(h, wq, has_w, books, np.ascontiguousarray(splits(books)), max_level(books), out_b, out_e, codes, status)
    else:
        fn = _choose_fixed_serial_nb if one else _choose_fixed_nb
        fn(h, wq, has_w, bits, out_e, codes, status)
    return out_b, out_e, codes, status
