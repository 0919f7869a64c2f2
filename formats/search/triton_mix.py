"""The MIX search (docs/formats.md#mix-encoder mode 1, and mode 0) as one Triton kernel per search: the Triton tier.

``torch_mix`` runs the search as ~100 torch launches per call; the
fitter makes ~22 calls per expert matrix, and at full width (16 workers on
one GPU) the measure stage was bound by those launches and the Python that
issues them. Here one launch does a whole search: a program takes BLOCK
halves, keeps each half's statistics in registers and evaluates every
candidate by reading its 16 values again (from cache), so nothing of size
(candidates, halves, 16) is ever written.

Why the choices are the numba kernels' (``numba_mix._choose_nb`` /
``_choose_fixed_nb``) bit for bit:

* the per-element arithmetic is the same IEEE float32 operations in the same
  order: v = x * (1/S), the select chain over the splits (mode 1) or the
  fixed quantiser (mode 0), S * y, x - S * y, w * d, (w * d) * d, and the
  half's error as 16 separate additions in element order (a static loop,
  never a reduction, whose order would be a tree). The kernels are launched
  with ``enable_fp_fusion=False``, so no multiply is contracted into a
  fused multiply-add, and the one division (max|x| / ML) is ``div_rn``
  (Triton's ``/`` is an approximate division on NVIDIA);
* candidates are visited in the numba kernel's order and adopted on a strict
  <, so ties keep the earlier one; a NaN or invalid candidate is never
  adopted;
* mode 1's centre byte is the first byte of least float32 |S(e) - t| over
  1..126 (a scan of the table; numba walks to the same byte), mode 0
  evaluates every byte 1..126 (numba's window is proved to give the answer
  of the full scan, and the reference's mode 0 is that scan).

Halves numba refuses (status 1 non-finite, 2 no finite candidate) get the
same status; their book, byte and codes are not defined (the codec raises
first). ``tests/formats/search/test_triton_mix.py`` checks all of it under Triton's
interpreter on the CPU, and on CUDA where present.
"""

from __future__ import annotations

import os

import numpy as np

import triton
import triton.language as tl

from ds4quant.formats.search.backend import to_host
from ds4quant.formats.search.numba_mix import max_level, splits
from ds4quant.formats.search.tables import HALF, fixed_levels, ue4m3_on

# halves per program on a GPU: mode 1 holds (BLOCK, 128) distances for the
# centre byte, mode 0 (BLOCK, 128) errors
BLOCK_BOOKS = 64
BLOCK_FIXED = 32
# the interpreter runs a program's operations as numpy calls over its block:
# one program for the whole search is the fast way there (the CPU tests)
INTERPRETED = bool(os.environ.get("TRITON_INTERPRET"))
INF = tl.constexpr(float("inf"))


@triton.jit
def _half_facts(x_ptr, w_ptr, h, m, wrow, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    """max |x| (NaN never wins, as numba's walk), all values finite, all weights
    finite and >= 0, for the halves h."""
    mx = tl.zeros([BLOCK], tl.float32)
    fin = tl.full([BLOCK], 1, tl.int1)
    wok = tl.full([BLOCK], 1, tl.int1)
    for i in tl.static_range(16):
        x = tl.load(x_ptr + h * 16 + i, mask=m, other=0.0)
        a = tl.abs(x)
        mx = tl.where(a > mx, a, mx)
        fin = fin & (a < INF)
        if HAS_W:
            w = tl.load(w_ptr + wrow * 16 + i, mask=m, other=1.0)
            wok = wok & (w >= 0.0) & (w < INF)
    return mx, fin, wok


@triton.jit
def _element(x_ptr, w_ptr, h, m, wrow, i: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    """Element i of the halves h and its weight (1 without importance), as (BLOCK, 1) columns."""
    x = tl.load(x_ptr + h * 16 + i, mask=m, other=0.0)[:, None]
    if HAS_W:
        w = tl.load(w_ptr + wrow * 16 + i, mask=m, other=1.0)[:, None]
    else:
        w = tl.full([BLOCK, 1], 1.0, tl.float32)
    return x, w


@triton.jit
def _byte_tables(S_ptr, INV_ptr):
    """S(e) and 1/S(e) for e = 0..127 as (1, 128) rows, and which e are bytes 1..126."""
    eb = tl.arange(0, 128)
    return (tl.load(S_ptr + eb)[None, :], tl.load(INV_ptr + eb)[None, :],
            ((eb >= 1) & (eb <= 126))[None, :])


@triton.jit
def _nearest(t, S_row, in_range):
    """The first byte 1..126 of least float32 |S(e) - t| (all bytes at once, the
    argmin keeping the first least); 0 where t is not a positive finite number."""
    d = tl.where(in_range, tl.abs(S_row - t[:, None]), INF)
    cen = tl.argmin(d, axis=1, tie_break_left=True).to(tl.int32)
    return tl.where((t > 0.0) & (t < INF), cen, 0)


@triton.jit
def _level(v, tab_ptr, b: tl.constexpr, L: tl.constexpr):
    """NL(v) in book b: the select chain over the splits (ties to the lower level)."""
    y = tl.zeros(v.shape, tl.float32) + tl.load(tab_ptr + b * (2 * L))
    for j in tl.static_range(1, L):
        sp = tl.load(tab_ptr + b * (2 * L) + L + (j - 1))
        lv = tl.load(tab_ptr + b * (2 * L) + j)
        y = tl.where(v > sp, lv, y)
    return y


@triton.jit
def _books_kernel(x_ptr, w_ptr, tab_ptr, S_ptr, INV_ptr, bk_ptr, be_ptr, codes_ptr, st_ptr, N, HW,
                  L: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    """Mode 1 for halves x (N, 16) (weights (HW, 16): half g uses row g % HW).
    tab: per book b, L levels then L-1 splits then ML at b * 2L (float32).
    A book's 5 candidate bytes are the columns of a (BLOCK, 8) tile."""
    h = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = h < N
    wrow = h % HW
    mx, fin, wok = _half_facts(x_ptr, w_ptr, h, m, wrow, HAS_W, BLOCK)
    S_row, INV_row, in_range = _byte_tables(S_ptr, INV_ptr)
    dl = tl.arange(0, 8)[None, :] - 2  # -2..2 used, in the kernel's visiting order
    best = tl.full([BLOCK], float("inf"), tl.float32)
    bk = tl.zeros([BLOCK], tl.int32)
    be = tl.full([BLOCK], 1, tl.int32)
    for b in tl.static_range(2):
        ml = tl.load(tab_ptr + b * (2 * L) + 2 * L - 1)
        if ml > 0.0:  # a book whose levels are all 0 has no candidates
            cen = _nearest(tl.math.div_rn(mx, ml + tl.zeros_like(mx)), S_row, in_range)
            e = cen[:, None] + dl
            valid = (e >= 1) & (e <= 126) & wok[:, None] & (dl <= 2)
            ec = tl.minimum(tl.maximum(e, 1), 126)
            s = tl.load(S_ptr + ec)
            inv = tl.load(INV_ptr + ec)
            err = tl.zeros([BLOCK, 8], tl.float32)
            for i in tl.static_range(16):
                x, w = _element(x_ptr, w_ptr, h, m, wrow, i, HAS_W, BLOCK)
                d = x - s * _level(x * inv, tab_ptr, b, L)
                err = err + (w * d) * d
            err = tl.where(valid & (err == err), err, INF)  # NaN or invalid: never adopted
            cb = tl.min(err, axis=1)
            ci = tl.argmin(err, axis=1, tie_break_left=True).to(tl.int32)
            take = cb < best  # book 0 before book 1: a tie keeps book 0
            best = tl.where(take, cb, best)
            bk = tl.where(take, b, bk)
            be = tl.where(take, cen + ci - 2, be)
    zero = mx == 0.0
    bk = tl.where(zero, 0, bk)
    be = tl.where(zero, 0, be)
    inv = tl.load(INV_ptr + be)  # S(0)'s entry is 0: zero halves give v = +-0, NL(0)
    for i in tl.static_range(16):
        x = tl.load(x_ptr + h * 16 + i, mask=m, other=0.0)
        v = x * inv
        c = tl.zeros([BLOCK], tl.int32)
        for j in tl.static_range(1, L):
            sp = tl.load(tab_ptr + bk * (2 * L) + L + (j - 1))
            c += (v > sp).to(tl.int32)
        tl.store(codes_ptr + h * 16 + i, c.to(tl.uint8), mask=m)
    st = tl.where(fin, tl.where((mx != 0.0) & (best == INF), 2, 0), 1)
    tl.store(bk_ptr + h, bk.to(tl.uint8), mask=m)
    tl.store(be_ptr + h, be.to(tl.uint8), mask=m)
    tl.store(st_ptr + h, st.to(tl.int8), mask=m)


@triton.jit
def _fixed_level(q, BITS: tl.constexpr):
    """Mode 0's element quantiser as a level: docs/formats.md#rocmfp2 {-1, 0, 1, 2} (ties to the
    lower code) or docs/formats.md#rocmfp3 sign + {0, 1, 2, 4} (ties to the lower magnitude)."""
    if BITS == 2:
        y = tl.full(q.shape, -1.0, tl.float32)
        y = tl.where(q > -0.5, 0.0, y)
        y = tl.where(q > 0.5, 1.0, y)
        y = tl.where(q > 1.5, 2.0, y)
    else:
        a = tl.abs(q)
        y = tl.zeros(q.shape, tl.float32)
        y = tl.where(a > 0.5, 1.0, y)
        y = tl.where(a > 1.5, 2.0, y)
        y = tl.where(a > 3.0, 4.0, y)
        y = tl.where(q < 0.0, -y, y)
    return y


@triton.jit
def _fixed_kernel(x_ptr, w_ptr, S_ptr, INV_ptr, be_ptr, codes_ptr, st_ptr, N, HW,
                  BITS: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    """Mode 0 for halves x (N, 16): the byte of least error over 1..126, ties
    to the smaller; every byte is evaluated, as the columns of a (BLOCK, 128) tile."""
    h = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = h < N
    wrow = h % HW
    mx, fin, wok = _half_facts(x_ptr, w_ptr, h, m, wrow, HAS_W, BLOCK)
    S_row, INV_row, in_range = _byte_tables(S_ptr, INV_ptr)
    err = tl.zeros([BLOCK, 128], tl.float32)
    for i in tl.static_range(16):
        x, w = _element(x_ptr, w_ptr, h, m, wrow, i, HAS_W, BLOCK)
        d = x - S_row * _fixed_level(x * INV_row, BITS)
        err = err + (w * d) * d
    err = tl.where(in_range & wok[:, None] & (err == err), err, INF)
    best = tl.min(err, axis=1)
    be = tl.argmin(err, axis=1, tie_break_left=True).to(tl.int32)
    be = tl.where(best < INF, be, 1)  # none finite: numba's initial byte
    be = tl.where(mx == 0.0, 0, be)
    inv = tl.load(INV_ptr + be)
    for i in tl.static_range(16):
        x = tl.load(x_ptr + h * 16 + i, mask=m, other=0.0)
        v = tl.where(be > 0, x * inv, 0.0)
        if BITS == 2:
            c = (v > -0.5).to(tl.int32) + (v > 0.5).to(tl.int32) + (v > 1.5).to(tl.int32)
            c = tl.where(v != v, 3, c)  # NaN: numba's chain falls through to the top code
        else:
            a = tl.abs(v)
            c = (a > 0.5).to(tl.int32) + (a > 1.5).to(tl.int32) + (a > 3.0).to(tl.int32)
            c = tl.where((v < 0.0) & (c != 0), c | 4, c)
        tl.store(codes_ptr + h * 16 + i, c.to(tl.uint8), mask=m)
    st = tl.where(fin, tl.where((mx != 0.0) & (best == INF), 2, 0), 1)
    tl.store(be_ptr + h, be.to(tl.uint8), mask=m)
    tl.store(st_ptr + h, st.to(tl.int8), mask=m)


@triton.jit
def _terms_kernel(x_ptr, w_ptr, lv_ptr, S_ptr, bk_ptr, be_ptr, codes_ptr, out_ptr, NE, HW,
                  L: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    """The fitter's error terms per element (``terms_stats_nb`` without the
    Lloyd sums): float64 (x - y)^2 * w with y = float32(S * level), level =
    lv[book * L + code] (the books in mode 1, the fixed levels in mode 0).
    One float32 product, then float64 subtract and multiplies: nothing for a
    fused multiply-add to change."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < NE
    g = o // 16
    x = tl.load(x_ptr + o, mask=m, other=0.0)
    c = tl.load(codes_ptr + o, mask=m, other=0).to(tl.int32)
    bk = tl.load(bk_ptr + g, mask=m, other=0).to(tl.int32)
    s = tl.load(S_ptr + tl.load(be_ptr + g, mask=m, other=0).to(tl.int32))
    y = s * tl.load(lv_ptr + bk * L + c)
    d = x.to(tl.float64) - y.to(tl.float64)
    t = d * d
    if HAS_W:
        t = t * tl.load(w_ptr + (g % HW) * 16 + (o % 16), mask=m, other=1.0).to(tl.float64)
    tl.store(out_ptr + o, t, mask=m)


def book_table(books: np.ndarray) -> np.ndarray:
    """The kernel's per-book table: levels, splits, ML (float32 (2, 2L))."""
    books = np.ascontiguousarray(books, np.float32)
    return np.concatenate([books, splits(books), max_level(books)[:, None]], axis=1).astype(np.float32)


def _flat(X, W):
    """(halves G, halves a row H, x (G, 16), w (H, 16) or x where unread, has_w) of ``to_device``'s tensors."""
    R, H, _ = X.shape
    x = X.reshape(R * H, HALF)
    has_w = W is not None
    return R * H, H, x, W.reshape(H, HALF) if has_w else x, has_w


def search_device(X, W, books: np.ndarray, mode: int, bits: int):
    """The search on device tensors from ``backend.to_device`` (X
    (R, H, 16), W (1, H, 16) or None), left on the device: book uint8 (G,),
    byte uint8 (G,), codes uint8 (G, 16), status int8 (G,), queued on the
    caller's stream."""
    import torch

    dev = X.device
    G, H, x, w, has_w = _flat(X, W)
    S, INV = ue4m3_on(dev)
    bk = torch.zeros(G, dtype=torch.uint8, device=dev)
    be = torch.empty(G, dtype=torch.uint8, device=dev)
    codes = torch.empty((G, HALF), dtype=torch.uint8, device=dev)
    st = torch.empty(G, dtype=torch.int8, device=dev)
    if G:
        blk = min(triton.next_power_of_2(G), 1 << 12) if INTERPRETED else (BLOCK_BOOKS if mode == 1 else BLOCK_FIXED)
        grid = (triton.cdiv(G, blk),)
        if mode == 1:
            tab = torch.from_numpy(book_table(books)).to(dev)
            _books_kernel[grid](x, w, tab, S, INV, bk, be, codes, st, G, H, L=4 if bits == 2 else 8,
                                HAS_W=has_w, BLOCK=blk, num_warps=4, enable_fp_fusion=False)
        else:
            _fixed_kernel[grid](x, w, S, INV, be, codes, st, G, H, BITS=bits, HAS_W=has_w, BLOCK=blk,
                                num_warps=4, enable_fp_fusion=False)
    return bk, be, codes, st


def _levels(books: np.ndarray, mode: int, bits: int, dev):
    """The levels a choice's book and code index: the books (mode 1) or the fixed levels (mode 0)."""
    import torch

    lv = np.ascontiguousarray(books, np.float32) if mode == 1 else fixed_levels(bits)
    return torch.from_numpy(np.array(lv, np.float32).reshape(-1)).to(dev), lv.shape[-1]  # a copy: read-only tables


def terms_device(X, W, books: np.ndarray, mode: int, bits: int, choices):
    """The fitter's float64 error terms (G, 16) of ``choices`` (``search_device``'s
    first three) on the device: ``terms_stats_nb``'s, bit for bit."""
    import torch

    bk, be, codes = choices[:3]
    dev = X.device
    G, H, x, w, has_w = _flat(X, W)
    t = torch.empty((G, HALF), dtype=torch.float64, device=dev)
    if G:
        S, _ = ue4m3_on(dev)
        lv, L = _levels(books, mode, bits, dev)
        ne = G * HALF
        blk = min(triton.next_power_of_2(ne), 1 << 16) if INTERPRETED else 1024
        _terms_kernel[(triton.cdiv(ne, blk),)](x, w, lv, S, bk, be, codes, t, ne, H, L=L,
                                               HAS_W=has_w, BLOCK=blk, num_warps=4, enable_fp_fusion=False)
    return t


def decode_device(choices, books: np.ndarray, mode: int, bits: int):
    """float32 (G, 16) on the device: the values the blocks of ``choices``
    decode to (``numba_fit.decode_choice_nb``'s one product, S(e) *
    level, which IEEE multiplication rounds the same in either order)."""
    import torch

    bk, be, codes = choices[:3]
    S, _ = ue4m3_on(codes.device)
    lv, L = _levels(books, mode, bits, codes.device)
    idx = bk.to(torch.int64).unsqueeze(1) * L + codes.to(torch.int64)
    return S[be.to(torch.int64)].unsqueeze(1) * lv[idx]


def choose(X, W, books: np.ndarray, mode: int, bits: int, terms: bool = False):
    """``numba_mix.choose`` for device tensors from ``backend.to_device``
    (X (R, H, 16), W (1, H, 16) or None): numpy book int64 (G,), byte int64
    (G,), codes uint8 (G, 16), status int8 (G,), on the caller's stream;
    with ``terms`` also the fitter's float64 error terms (G, 16) of those
    choices (``terms_stats_nb``'s, computed on the device)."""
    ch = search_device(X, W, books, mode, bits)
    bk, be, codes, st = ch
    out = (to_host(bk).astype(np.int64), to_host(be).astype(np.int64), to_host(codes), to_host(st))
    if not terms:
        return out
    return out + (to_host(terms_device(X, W, books, mode, bits, ch)),)
