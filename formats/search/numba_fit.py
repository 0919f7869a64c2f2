"""The codebook fitter's evaluation of one book pair in one pass, and numpy's pairwise sum.

``fit_optimized`` evaluates ~22 book pairs per expert matrix: each is the
mode-1 MIX search (``numba_mix._books_tile_nb``, the encoder's choices bit
for bit), then per element the float64 error term (x - y)^2 w and, for a
Lloyd step, the level sums num[b*L + j] += (w S) x, den += (w S) S in element
order. ``eval_books_nb`` does all of it tile by tile in one call, with no
codes, bytes or arrays handed back to Python; the figure is the float64 sum
of the terms in ``np.sum``'s order (``pairwise_sum_nb``: numpy's pairwise
summation, 8 accumulators per block of 128, tested against ``np.sum``), so
it is the legacy figure bit for bit.
"""

from __future__ import annotations

import numba
import numpy as np

from ds4quant.formats.search.numba_mix import choose_serial_nb
from ds4quant.formats.search.tables import fixed_levels
from ds4quant.formats.ue4m3 import UE4M3


@numba.njit(cache=True, nogil=True)
def book_tables_nb(books):
    """``numba_mix.splits`` and ``max_level`` of float32 books (2, L) in
    one call: the same float32 operations (overflow gives inf, as there)."""
    L = books.shape[1]
    split = np.empty((2, L - 1), np.float32)
    ml = np.empty(2, np.float32)
    for p in range(2):
        m = abs(books[p, 0])
        for j in range(L - 1):
            split[p, j] = np.float32(np.float32(0.5) * np.float32(books[p, j] + books[p, j + 1]))
            a = abs(books[p, j + 1])
            m = a if (a > m or a != a) else m  # NaN propagates, as np.max
        ml[p] = m
    return split, ml


@numba.njit(cache=True, nogil=True)
def _pairwise_leaf_nb(a, lo, n):
    """numpy's pairwise_sum for n <= 128 (its leaf; n < 8: a plain sum)."""
    if n < 8:
        res = 0.0
        for i in range(n):
            res += a[lo + i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    m = n - (n % 8)
    while i < m:
        j = lo + i
        r0 += a[j]
        r1 += a[j + 1]
        r2 += a[j + 2]
        r3 += a[j + 3]
        r4 += a[j + 4]
        r5 += a[j + 5]
        r6 += a[j + 6]
        r7 += a[j + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@numba.njit(cache=True, nogil=True)
def pairwise_sum_nb(a, lo, n):
    """numpy's pairwise sum of a[lo:lo+n] (float64), the order of np.sum over
    a contiguous float64 array: 0 + this equals np.sum(a[lo:lo+n]). numpy
    recurses (halves rounded down to a multiple of 8, leaves of <= 128); this
    walks the same tree with an explicit stack (a cached numba function must
    not call a recursive one: loading it from the cache crashes)."""
    if n <= 128:
        return _pairwise_leaf_nb(a, lo, n)
    tl = np.empty(256, np.int64)
    tn = np.empty(256, np.int64)
    ts = np.empty(256, np.int64)  # 0: sum this range, 1: add the last two values
    vals = np.empty(256, np.float64)
    top = 0
    nv = 0
    tl[0], tn[0], ts[0] = lo, n, 0
    top = 1
    while top > 0:
        top -= 1
        l, m, st = tl[top], tn[top], ts[top]
        if st == 1:
            nv -= 1
            vals[nv - 1] = vals[nv - 1] + vals[nv]
        elif m <= 128:
            vals[nv] = _pairwise_leaf_nb(a, l, m)
            nv += 1
        else:
            n2 = m // 2
            n2 -= n2 % 8
            tl[top], tn[top], ts[top] = l, m, 1
            tl[top + 1], tn[top + 1], ts[top + 1] = l + n2, m - n2, 0
            tl[top + 2], tn[top + 2], ts[top + 2] = l, n2, 0
            top += 3
    return vals[0]


@numba.njit(cache=True, nogil=True)
def pairwise_leaves_nb(n):
    """The leaves (start int64 (k,), length int64 (k,)) of numpy's pairwise
    tree over n > 128 values, left to right: what ``pairwise_sum_nb`` sums
    one by one. A device sums them in parallel; ``pairwise_combine_nb`` then
    adds their sums in the tree's order."""
    lo = np.empty(n // 56 + 2, np.int64)
    ln = np.empty(n // 56 + 2, np.int64)
    k = 0
    tl = np.empty(256, np.int64)
    tn = np.empty(256, np.int64)
    tl[0], tn[0] = 0, n
    top = 1
    while top > 0:  # depth first, the left child on top: leaves come out in order
        top -= 1
        l, m = tl[top], tn[top]
        if m <= 128:
            lo[k], ln[k] = l, m
            k += 1
        else:
            n2 = m // 2
            n2 -= n2 % 8
            tl[top], tn[top] = l + n2, m - n2
            tl[top + 1], tn[top + 1] = l, n2
            top += 2
    return lo[:k].copy(), ln[:k].copy()


@numba.njit(cache=True, nogil=True)
def pairwise_combine_nb(vals, n):
    """numpy's pairwise sum of n > 128 values from the sums of its leaves
    (``pairwise_leaves_nb(n)``'s, in order): ``pairwise_sum_nb``'s additions
    above the leaves, in its order, so 0 + this equals np.sum."""
    tn = np.empty(256, np.int64)
    ts = np.empty(256, np.int64)
    acc = np.empty(256, np.float64)
    tn[0], ts[0] = n, 0
    top = 1
    nv = 0
    k = 0
    while top > 0:
        top -= 1
        m, st = tn[top], ts[top]
        if st == 1:
            nv -= 1
            acc[nv - 1] = acc[nv - 1] + acc[nv]
        elif m <= 128:
            acc[nv] = vals[k]
            k += 1
            nv += 1
        else:
            n2 = m // 2
            n2 -= n2 % 8
            tn[top], ts[top] = m, 1
            tn[top + 1], ts[top + 1] = m - n2, 0
            tn[top + 2], ts[top + 2] = n2, 0
            top += 3
    return acc[0]


@numba.njit(cache=True, nogil=True)
def terms_stats_nb(h, wq, has_w, books, out_b, out_e, codes, mode, fixed, terms, num, den, stats):
    """Per element of h float32 (G, 16): terms = (x - y)^2 * w in float64
    (y the decoded float32 value, w the raw importance, none without), and
    with ``stats`` the Lloyd sums num[b*L + j] += (w*S)*x, den += (w*S)*S in
    element order (np.bincount's order, so the sums are the legacy ones)."""
    G = h.shape[0]
    L = books.shape[1]
    hpr = wq.shape[0]
    for g in range(G):
        be = out_e[g]
        bk = out_b[g]
        s = UE4M3[be]
        s64 = np.float64(s)
        for i in range(16):
            c = codes[g, i]
            if mode == 1:
                y = np.float32(s * books[bk, c])
            else:
                y = np.float32(fixed[c] * s)
            x64 = np.float64(h[g, i])
            d = x64 - np.float64(y)
            t = d * d
            if has_w:
                w64 = np.float64(wq[g % hpr, i])
                terms[g, i] = t * w64
            else:
                w64 = 1.0
                terms[g, i] = t
            if stats:
                idx = bk * L + c
                ws = w64 * s64
                num[idx] += ws * x64
                den[idx] += ws * s64


@numba.njit(cache=True, nogil=True)
def eval_books_nb(h, wq, has_w, books, split, ml, stats, num, den, terms, out_b, out_e, codes, status, fixed):
    """Mode 1 on h float32 (G, 16): (total, first refused half or -1, its
    status 1 non-finite / 2 no finite candidate). The serial search writes
    the choices to out_b/out_e/codes/status (scratch), then
    ``terms_stats_nb`` the float64 terms (x - y)^2 w to terms (G, 16) and
    with ``stats`` the Lloyd sums; total is np.sum of the terms."""
    G = h.shape[0]
    status[:] = 0
    choose_serial_nb(h, wq, has_w, books, split, ml, out_b, out_e, codes, status)
    for g in range(G):
        if status[g] != 0:
            return 0.0, g, np.int64(status[g])
    terms_stats_nb(h, wq, has_w, books, out_b, out_e, codes, 1, fixed, terms, num, den, stats)
    return 0.0 + pairwise_sum_nb(terms.reshape(-1), 0, G * 16), -1, np.int64(0)


@numba.njit(cache=True, nogil=True)
def decode_choice_nb(out_b, out_e, codes, books, mode, fixed, out):
    """The decode of the blocks the choices pack to (the MIX decoder's
    products: S(e) * level[book][code] in mode 1, fixed[code] * S(e) in mode
    0), from the choices themselves: out float32 (G, 16)."""
    for g in range(out_e.shape[0]):
        s = UE4M3[out_e[g]]
        b = out_b[g]
        for i in range(16):
            c = codes[g, i]
            if mode == 1:
                out[g, i] = np.float32(s * books[b, c])
            else:
                out[g, i] = np.float32(fixed[c] * s)


def decode_choices(qt, enc, shape, books: np.ndarray, mode: int) -> np.ndarray:
    """float32 ``shape`` values the blocks of the choices ``enc`` (book, byte,
    codes per half) decode to, for MIX qtype ``qt``: its decode, bit for bit."""
    y = np.empty(shape, np.float32)
    decode_choice_nb(*enc, np.ascontiguousarray(books, np.float32), int(mode),
                     fixed_levels(2 if qt.codebook_levels == 4 else 3), y.reshape(-1, 16))
    return y
