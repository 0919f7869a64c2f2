"""The measure stage's float64 figures on a GPU, bit for bit the host's: the device sums.

Two sums decide an adaptive plan, and both have an order that a GPU
reduction would not keep:

* ``metrics.error_sums``: per row, sequential float64 sums over the columns
  (sse, ssx, ssy, dot, max|d|, the non-finite count, and with weights wsse,
  wssx), then the rows added in row order. ``error_sums_device`` runs the
  row loop here, one lane a row walking its columns in order, and hands the
  (rows, 8) partials to ``metrics.sums_of_rows``, the host's row order.
* ``np.sum`` of the codebook fitter's float64 error terms: numpy's pairwise
  tree (leaves of 64..128 values summed by 8 accumulators, then halves
  added). ``pairwise_total`` sums the leaves here, one lane a leaf, and
  ``numba_fit.pairwise_combine_nb`` adds them on the host in the
  tree's order.
* ``np.square(x.astype(float64)).sum(axis=0)``: calibrate's importance sums of
  a layer's inputs (``calibrate.collect.sum_sq``). numpy reduces axis 0 of a
  C-ordered array row by row, each column's total growing in row order;
  ``column_square_sums`` walks the rows in that order, one lane a column, and
  only the (cols,) totals come back instead of the rows.

So a matrix's decoded values and the fitter's terms never cross the link:
4 (rows, cols) float32 copies a candidate and 8 bytes a weight per
evaluation come back as 64 bytes a row and 8 bytes per leaf. The kernels
run with ``enable_fp_fusion=False`` (no multiply folded into an add), every
operation is IEEE float64 and rounds as numba's does; a non-finite decoded
value skips its column as ``metrics._rows`` does. Tests:
``tests/formats/search/test_triton_sums.py`` (Triton's interpreter on the
CPU; CUDA where present).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from ds4quant.formats.search.backend import to_host
from ds4quant.formats.search.numba_fit import pairwise_combine_nb, pairwise_leaves_nb, pairwise_sum_nb
from ds4quant.metrics import Sums, sums_of_rows

# the interpreter runs a program's operations as numpy calls over its block:
# few wide programs are the fast way there (the CPU tests)
INTERPRETED = bool(os.environ.get("TRITON_INTERPRET"))
ROWS_PER_PROGRAM = 32
LEAVES_PER_PROGRAM = 128
INF = tl.constexpr(float("inf"))


@triton.jit
def _row_sums_kernel(x_ptr, y_ptr, w_ptr, part_ptr, R, C, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    """part[r] = (sse, ssx, ssy, dot, max|d|, non-finite count, wsse, wssx) of
    row r of float32 x, y (R, C) with float64 column weights w: one lane a
    row, the columns in order (``metrics._rows``'s loop)."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = r < R
    base = r.to(tl.int64) * C
    zero = tl.zeros([BLOCK], tl.float64)
    sse = zero
    ssx = zero
    ssy = zero
    dot = zero
    mx = zero
    bad = zero
    wsse = zero
    wssx = zero
    for c in range(0, C):
        xv = tl.load(x_ptr + base + c, mask=m, other=0.0).to(tl.float64)
        yv = tl.load(y_ptr + base + c, mask=m, other=0.0).to(tl.float64)
        ok = tl.abs(yv) < INF  # false for NaN too
        bad = tl.where(ok, bad, bad + 1.0)
        d = xv - yv
        d2 = d * d
        sse = tl.where(ok, sse + d2, sse)
        ssx = tl.where(ok, ssx + xv * xv, ssx)
        ssy = tl.where(ok, ssy + yv * yv, ssy)
        dot = tl.where(ok, dot + xv * yv, dot)
        a = tl.abs(d)
        mx = tl.where(ok & (a > mx), a, mx)
        if HAS_W:
            wc = tl.load(w_ptr + c)
            wsse = tl.where(ok, wsse + wc * d2, wsse)
            wssx = tl.where(ok, wssx + (wc * xv) * xv, wssx)
    out = part_ptr + r.to(tl.int64) * 8
    tl.store(out + 0, sse, mask=m)
    tl.store(out + 1, ssx, mask=m)
    tl.store(out + 2, ssy, mask=m)
    tl.store(out + 3, dot, mask=m)
    tl.store(out + 4, mx, mask=m)
    tl.store(out + 5, bad, mask=m)
    tl.store(out + 6, wsse, mask=m)
    tl.store(out + 7, wssx, mask=m)


@triton.jit
def _leaves_kernel(t_ptr, lo_ptr, n_ptr, out_ptr, K, BLOCK: tl.constexpr):
    """out[k] = numpy's pairwise leaf sum of t[lo[k] : lo[k] + n[k]] (8 <= n <= 128):
    eight accumulators seeded with the first eight values, stepping by 8,
    combined as ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)), then the last n % 8
    added one by one (``numba_fit._pairwise_leaf_nb``)."""
    k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = k < K
    lo = tl.load(lo_ptr + k, mask=m, other=0)
    n = tl.load(n_ptr + k, mask=m, other=8)
    p = t_ptr + lo
    r0 = tl.load(p + 0, mask=m, other=0.0)
    r1 = tl.load(p + 1, mask=m, other=0.0)
    r2 = tl.load(p + 2, mask=m, other=0.0)
    r3 = tl.load(p + 3, mask=m, other=0.0)
    r4 = tl.load(p + 4, mask=m, other=0.0)
    r5 = tl.load(p + 5, mask=m, other=0.0)
    r6 = tl.load(p + 6, mask=m, other=0.0)
    r7 = tl.load(p + 7, mask=m, other=0.0)
    full = n - n % 8
    for i in tl.static_range(8, 128, 8):
        on = m & (i < full)
        r0 = tl.where(on, r0 + tl.load(p + i + 0, mask=on, other=0.0), r0)
        r1 = tl.where(on, r1 + tl.load(p + i + 1, mask=on, other=0.0), r1)
        r2 = tl.where(on, r2 + tl.load(p + i + 2, mask=on, other=0.0), r2)
        r3 = tl.where(on, r3 + tl.load(p + i + 3, mask=on, other=0.0), r3)
        r4 = tl.where(on, r4 + tl.load(p + i + 4, mask=on, other=0.0), r4)
        r5 = tl.where(on, r5 + tl.load(p + i + 5, mask=on, other=0.0), r5)
        r6 = tl.where(on, r6 + tl.load(p + i + 6, mask=on, other=0.0), r6)
        r7 = tl.where(on, r7 + tl.load(p + i + 7, mask=on, other=0.0), r7)
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    for i in tl.static_range(0, 7):
        on = m & (full + i < n)
        res = tl.where(on, res + tl.load(p + full + i, mask=on, other=0.0), res)
    tl.store(out_ptr + k, res, mask=m)


@triton.jit
def _column_sq_kernel(x_ptr, out_ptr, R, C, BLOCK: tl.constexpr):
    """out[c] = sum over rows r in order of float64(x[r, c])^2 for float32 x (R, C):
    one lane a column (the square of a float32 is exact in float64, so a fused
    multiply-add would round the same; fusion is off all the same)."""
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = c < C
    acc = tl.zeros([BLOCK], tl.float64)
    p = x_ptr + c
    for _r in range(0, R):
        v = tl.load(p, mask=m, other=0.0).to(tl.float64)
        acc = acc + v * v
        p += C  # pointer arithmetic: 64-bit past 2^31 elements
    tl.store(out_ptr + c, acc, mask=m)


COLUMNS_PER_PROGRAM = 128


def _launch(kernel, grid, *args, **meta):
    kernel[grid](*args, num_warps=1 if INTERPRETED else 2, enable_fp_fusion=False, **meta)


def error_sums_device(x, y, w=None) -> Sums:
    """``metrics.error_sums(x, y, w)`` for float32 device tensors x, y of one
    shape (rows, cols) and w (cols,) float64 on the device or None: the same
    Sums bit for bit, with 64 bytes a row copied back."""
    import torch

    rows, cols = x.shape
    if tuple(y.shape) != (rows, cols):
        raise ValueError(f"error_sums_device: shapes {tuple(x.shape)} and {tuple(y.shape)}")
    part = torch.zeros((rows, 8), dtype=torch.float64, device=x.device)
    if rows and cols:
        has_w = w is not None
        blk = triton.next_power_of_2(rows) if INTERPRETED else ROWS_PER_PROGRAM
        _launch(_row_sums_kernel, (triton.cdiv(rows, blk),), x.contiguous(), y.contiguous(),
                w.to(torch.float64).contiguous() if has_w else part, part, rows, cols, HAS_W=has_w, BLOCK=blk)
    return sums_of_rows(to_host(part), rows * cols, w is not None)


_TREES: dict = {}


def _tree(n: int, device):
    """The pairwise tree's leaves for n values, on ``device`` (kept per n: a
    measure stage sees a handful of matrix sizes)."""
    import torch

    key = (n, str(device))
    t = _TREES.get(key)
    if t is None:
        lo, ln = pairwise_leaves_nb(n)
        t = _TREES[key] = (torch.from_numpy(lo).to(device), torch.from_numpy(ln).to(device))
    return t


def pairwise_total(t) -> float:
    """``float(np.sum(a))`` for a float64 device tensor t holding a's values
    (contiguous, any shape): numpy's pairwise order, bit for bit."""
    import torch

    flat = t.reshape(-1)
    n = int(flat.numel())
    if n <= 128:  # one leaf: a few values to the host
        return 0.0 + pairwise_sum_nb(to_host(flat), 0, n) if n else 0.0
    lo, ln = _tree(n, flat.device)
    k = int(lo.numel())
    out = torch.empty(k, dtype=torch.float64, device=flat.device)
    blk = triton.next_power_of_2(k) if INTERPRETED else LEAVES_PER_PROGRAM
    _launch(_leaves_kernel, (triton.cdiv(k, blk),), flat, lo, ln, out, k, BLOCK=blk)
    return float(0.0 + pairwise_combine_nb(to_host(out), n))


def column_square_sums(x):
    """float64 (cols,) on x's device: ``np.square(x.astype(np.float64)).sum(axis=0)``
    of a float32 device tensor x (rows, cols), bit for bit."""
    import torch

    x = x.detach().to(torch.float32).contiguous()
    rows, cols = x.shape
    out = torch.zeros(cols, dtype=torch.float64, device=x.device)
    if rows and cols:
        blk = triton.next_power_of_2(cols) if INTERPRETED else COLUMNS_PER_PROGRAM
        _launch(_column_sq_kernel, (triton.cdiv(cols, blk),), x, out, rows, cols, BLOCK=blk)
    return out
