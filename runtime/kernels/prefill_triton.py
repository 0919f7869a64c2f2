"""Tensor-core prefill (fast mode): grouped expert GEMMs whose weight tiles are
decoded into registers as bf16 and fed to ``tl.dot``, with the slots sorted
by expert on the device.

* ``sort_slots``: the slot -> expert sort in torch ops on the device (a stable
  argsort, per-expert counts by ``scatter_add_`` — ``torch.bincount`` reads the
  maximum back to the host on CUDA — and cumulative sums). Nothing is read back:
  the launch grid is an upper bound known from the slot count alone,
  ``cdiv(n, BM) + min(E, n)`` row tiles (every expert wastes at most one
  partial tile), and a program past the last tile runs no loop iterations.
  A CUDA graph of a prefill call therefore replays any routing of ``n`` slots.
* ``grouped``: program (tile, row block) finds its expert from the tiles'
  cumulative ends (one vector compare over the local experts), reads up to
  ``BM`` of its slots' rows (gathered through ``order`` for gate + up, so the
  input is never permuted in memory), decodes a (BN, BK) weight tile once with
  the decode of ``moe_triton`` and multiplies it on the tensor cores. The
  down projection scatters its rows back to slot order in its epilogue.

Exactness of the bf16 weights (``bf16_terms``): a decoded weight is a level
times a scale byte's value. For rocmfp2 / s40 / rocmfp3 / rocmfp4 / mxfp4 every
such product has at most 8 significant bits and is exact in bf16: one
``tl.dot``. rocmfp6 (levels up to 31) and rocmfp8 (up to 127) and MIX books
(bf16 levels times 4-bit scales) need up to 12 bits: the weight is split
``w = hi + lo`` with both halves bf16 and exact, two ``tl.dot`` calls.
rocmfp2_affine (``code * s - o``) takes the product and the offset as the two
exact parts. ``bf16_terms`` proves it per qtype over every level x scale byte
(and per registered book pair for MIX) at load; a stack it cannot prove stays
on the float32 ``tl.dot`` path of ``moe_triton``.

The activations are rounded to bf16 (as the bf16 ``grouped_mm`` anchor does);
the products are exact and the sums float32, so fast mode's distance from the
float64 product of the bf16-rounded activations is float32 summation error
only (``tests/runtime/test_prefill_interpret.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import triton
import triton.language as tl

from ds4quant.runtime.kernels.moe_triton import _tile

#: decorated under Triton's interpreter (the CPU tests): its bf16 tl.dot multiplies the raw
#: bits, so there the parts stay float32 values of bf16 numbers (an IEEE float32 dot of them
#: gives the same exact products and float32 sums)
INTERPRETED = bool(os.environ.get("TRITON_INTERPRET"))
#: the row tile (slots of one expert per program) by mean slots per local expert
BM_CHOICES = (16, 32, 64, 128)


@triton.jit
def _bf16(v, NATIVE: tl.constexpr):
    """float32 -> bf16 rounded to nearest even: the hardware conversion, or under the
    interpreter (whose bf16 dot is not usable) the same rounding in integer operations,
    the result kept as a float32 holding a bf16 value."""
    if NATIVE:
        r = v.to(tl.bfloat16)
    else:
        u = v.to(tl.int32, bitcast=True)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return r


@triton.jit
def _bf16_exact(v, NATIVE: tl.constexpr):
    """float32 -> bf16 for values that are bf16 numbers (``bf16_terms`` proves it): the
    upper half of the bits, by a shift rather than a rounding conversion (same value)."""
    if NATIVE:
        r = (v.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        r = (v.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
    return r


@triton.jit
def _parts(lv, sc, off, AFF: tl.constexpr, SPLIT: tl.constexpr, NATIVE: tl.constexpr, BN: tl.constexpr,
           BK: tl.constexpr):
    """The decoded (BN, BK) tile as bf16: (w, unused) or, with SPLIT, two exact parts
    (hi, lo) of the float32 weight, or (code * s, -o) for affine."""
    p = tl.reshape(lv * sc[:, :, None], (BN, BK))
    if SPLIT:
        hi = _bf16(p, NATIVE)
        lo = _bf16(p - hi.to(tl.float32), NATIVE)
    else:  # one exact part (affine: two, each exact)
        hi = _bf16_exact(p, NATIVE)
        lo = hi
        if AFF:
            lo = _bf16_exact(tl.reshape(tl.zeros_like(lv) - off[:, :, None], (BN, BK)), NATIVE)
    return hi, lo


@triton.jit
def _dot_tile(xb, a_base, b_base, s_base, o_base, tab_base, rows, rmask, k0, ka_row, kb_row, ks_row, slut_ptr,
              llut_ptr, acc, ABITS: tl.constexpr, BBITS: tl.constexpr, G: tl.constexpr, MIX: tl.constexpr,
              NLEV: tl.constexpr, LV: tl.constexpr, AFF: tl.constexpr, SPLIT: tl.constexpr, NATIVE: tl.constexpr,
              SWAP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    lv, sc, off = _tile(a_base, b_base, s_base, o_base, tab_base, rows, rmask, k0, ka_row, kb_row, ks_row,
                        slut_ptr, llut_ptr, ABITS, BBITS, G, MIX, NLEV, LV, AFF, BN, BK)
    hi, lo = _parts(lv, sc, off, AFF, SPLIT, NATIVE, BN, BK)
    if SWAP:  # acc (BN, BM) += W (BN, BK) @ x^T: the decoded tile is the A operand, held in registers
        acc = tl.dot(hi, tl.trans(xb), acc, input_precision="ieee")
        if AFF or SPLIT:
            acc = tl.dot(lo, tl.trans(xb), acc, input_precision="ieee")
    else:  # acc (BM, BN) += x (BM, BK) @ W^T
        acc = tl.dot(xb, tl.trans(hi), acc, input_precision="ieee")
        if AFF or SPLIT:
            acc = tl.dot(xb, tl.trans(lo), acc, input_precision="ieee")
    return acc


@triton.jit
def tile_slots(t, tend_ptr, count_ptr, start_ptr, NE, EP: tl.constexpr, BM: tl.constexpr):
    """Row tile t of a ``SlotPlan``: (local expert, slots in the tile, slot mask (BM,), sorted
    positions int64 (BM,)); a tile past the last expert's has no slots."""
    ee = tl.arange(0, EP)
    tend = tl.load(tend_ptr + ee, mask=ee < NE, other=1 << 30)
    e = tl.sum((tend <= t).to(tl.int32), axis=0)  # the expert whose tiles hold tile t
    ec = tl.minimum(e, NE - 1)
    cnt = tl.load(count_ptr + ec)
    ntile = (cnt + BM - 1) // BM
    mblk = t - (tl.load(tend_ptr + ec) - ntile)
    m = tl.where(e < NE, tl.minimum(cnt - mblk * BM, BM), 0)
    tt = tl.arange(0, BM)
    tmask = tt < m
    pos = (tl.load(start_ptr + ec) + mblk * BM + tl.where(tmask, tt, 0)).to(tl.int64)
    return ec, m, tmask, pos


@triton.jit
def _prefill_kernel(
    x_ptr, stride_x, out_ptr, stride_o, order_ptr, start_ptr, count_ptr, tend_ptr, NE,
    a_ptr, b_ptr, s_ptr, o_ptr, tab_ptr,
    a2_ptr, b2_ptr, s2_ptr, o2_ptr, tab2_ptr,
    slut_ptr, llut_ptr, slut2_ptr, llut2_ptr,
    N, K, ka_row, kb_row, ks_row, limit,
    ABITS: tl.constexpr, BBITS: tl.constexpr, G: tl.constexpr, MIX: tl.constexpr, NLEV: tl.constexpr,
    LV: tl.constexpr, AFF: tl.constexpr, SPLIT: tl.constexpr, DUAL: tl.constexpr, GATHER: tl.constexpr,
    SCATTER: tl.constexpr, NATIVE: tl.constexpr, SWAP: tl.constexpr, N_FIRST: tl.constexpr, EP: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    if N_FIRST:  # a row tile's column blocks are neighbours in launch order: its rows are read once from DRAM
        pid_n = tl.program_id(0)
        pid_t = tl.program_id(1)
    else:
        pid_n = tl.program_id(1)
        pid_t = tl.program_id(0)
    ec, m, tmask, slot = tile_slots(pid_t, tend_ptr, count_ptr, start_ptr, NE, EP, BM)
    src = slot
    if GATHER or SCATTER:
        perm = tl.load(order_ptr + slot, mask=tmask, other=0).to(tl.int64)
        if GATHER:
            src = perm
    dst = slot
    if SCATTER:
        dst = perm
    e64 = ec.to(tl.int64)
    rows = pid_n * BN + tl.arange(0, BN)
    rmask = rows < N
    a_base = a_ptr + e64 * N * ka_row
    b_base = b_ptr + e64 * N * kb_row
    s_base = s_ptr + e64 * N * ks_row
    o_base = o_ptr + e64 * N * ks_row
    a2_base = a2_ptr + e64 * N * ka_row
    b2_base = b2_ptr + e64 * N * kb_row
    s2_base = s2_ptr + e64 * N * ks_row
    o2_base = o2_ptr + e64 * N * ks_row
    tab_base = 0
    tab2_base = 0
    if MIX:
        tab_base = tl.load(tab_ptr + ec)
        if DUAL:
            tab2_base = tl.load(tab2_ptr + ec)
    kk = tl.arange(0, BK)
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        acc2 = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc2 = tl.zeros((BM, BN), dtype=tl.float32)
    kend = tl.where(m > 0, K, 0)  # a program past the last tile runs no iterations
    for k0 in range(0, kend, BK):
        xt = tl.load(x_ptr + src[:, None] * stride_x + (k0 + kk)[None, :], mask=tmask[:, None], other=0.0)
        xb = _bf16(xt.to(tl.float32), NATIVE)
        acc = _dot_tile(xb, a_base, b_base, s_base, o_base, tab_base, rows, rmask, k0, ka_row, kb_row, ks_row,
                        slut_ptr, llut_ptr, acc, ABITS, BBITS, G, MIX, NLEV, LV, AFF, SPLIT, NATIVE, SWAP, BN, BK)
        if DUAL:
            acc2 = _dot_tile(xb, a2_base, b2_base, s2_base, o2_base, tab2_base, rows, rmask, k0, ka_row, kb_row,
                             ks_row, slut2_ptr, llut2_ptr, acc2, ABITS, BBITS, G, MIX, NLEV, LV, AFF, SPLIT, NATIVE,
                             SWAP, BN, BK)
    res = acc
    if DUAL:  # fast mode's SwiGLU (moe_triton's)
        gc = tl.minimum(acc, limit)
        uc = tl.minimum(tl.maximum(acc2, -limit), limit)
        res = gc / (1.0 + tl.exp(-gc)) * uc
    if SWAP:
        optr = out_ptr + dst[None, :] * stride_o + rows[:, None]
        tl.store(optr, res.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & tmask[None, :])
    else:
        optr = out_ptr + dst[:, None] * stride_o + rows[None, :]
        tl.store(optr, res.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & rmask[None, :])


@dataclass(frozen=True, eq=False)
class SlotPlan:
    """The device sort of one call: order int32 (n,) sorted slot -> slot; start, count,
    tend int32 (E,): each local expert's first sorted slot, slot count and cumulative tile
    end; tiles: the grid's row-tile bound; bm: slots per tile."""

    order: object
    start: object
    count: object
    tend: object
    n: int
    experts: int
    tiles: int
    bm: int


def pick_bm(n: int, experts: int) -> int:
    """The row tile for ``n`` slots over ``experts`` local experts: the smallest choice
    at least the mean slots per expert (a host rule on sizes only, no device read)."""
    mean = n / max(1, experts)
    for bm in BM_CHOICES:
        if bm >= mean:
            return bm
    return BM_CHOICES[-1]


def sort_slots(ids, loc, experts: int, n: int, bm: int = 0) -> SlotPlan:
    """The slot sort on the device: ids int64 (n,) global experts, loc int64 device table
    global -> local (every id resident: the caller checks on the host)."""
    import torch

    dev = ids.device
    bm = bm or pick_bm(n, experts)
    lid = loc.index_select(0, ids) if n else ids
    order = torch.argsort(lid, stable=True).to(torch.int32)
    count = torch.zeros(experts, dtype=torch.int64, device=dev)
    count.scatter_add_(0, lid, torch.ones_like(lid))
    start = torch.cumsum(count, 0) - count
    tend = torch.cumsum((count + bm - 1) // bm, 0)
    tiles = triton.cdiv(n, bm) + min(experts, n)
    i32 = torch.int32
    return SlotPlan(order, start.to(i32), count.to(i32), tend.to(i32), n, experts, tiles, bm)


def tile_kw(tile: tuple) -> dict:
    """``grouped``'s keywords for an owner's tile (weight rows per program, columns per step,
    warps, pipeline stages, swap): the one reading of the tile tuple."""
    bn, bk, nw, ns, swap = tile
    return dict(bn=bn, bk=bk, num_warps=nw, num_stages=ns, swap=bool(swap))


def grouped(fmt, x, plan: SlotPlan, w, *, w2=None, limit: float = 0.0, scatter: bool = False,
            split: bool = False, out=None, out_dtype=None, bn: int = 64, bk: int = 64, num_warps: int = 4,
            num_stages: int = 3, swap: bool = False, n_first: bool = True):
    """out[slot] = W_e @ x[slot] (or SwiGLU(W_e x, W2_e x) with ``w2``) for every slot of ``plan``.

    Without ``scatter``: x in slot order (rows gathered through ``plan.order``), out in
    sorted order. With ``scatter``: x in sorted order, out rows written back to slot order.
    fmt: layout.Format; w / w2: a stack's planes dict (a, b, s, o, slut, llut, tab).
    ``split``: two bf16 parts per weight (``bf16_terms`` == 2; affine always takes two).
    ``swap``: the product computed transposed (weights as the tensor-core A operand; the
    tensor cores' float32 sums may group differently: fast mode); ``n_first``: column blocks
    before row tiles in launch order (launch order only: the same bytes)."""
    import torch

    a = w["a"]
    E, N, ka_row = a.shape
    K = x.shape[1]
    n = plan.n
    if out is None:
        out = torch.empty((n, N), dtype=out_dtype or torch.float32, device=x.device)
    if n == 0:
        return out
    b = w["b"] if w["b"] is not None else a
    kb_row = b.shape[2] if w["b"] is not None else 0
    ks_row = w["s"].shape[2]
    o = w2 if w2 is not None else w
    floor = max(fmt.group, 16)
    bk = max(min(bk, K), floor)
    while K % bk and bk > floor:  # the largest power-of-two step up to bk that divides K
        bk //= 2
    if K % bk:
        raise ValueError(f"prefill kernel needs a column count that is a multiple of {floor}, got {K}")

    def off(p):
        return p["o"] if p.get("o") is not None else p["s"]

    grid = (triton.cdiv(N, bn), plan.tiles) if n_first else (plan.tiles, triton.cdiv(N, bn))
    _prefill_kernel[grid](
        x, x.stride(0), out, out.stride(0), plan.order, plan.start, plan.count, plan.tend, plan.experts,
        a, b, w["s"], off(w), w["tab"],
        o["a"], o["b"] if o["b"] is not None else o["a"], o["s"], off(o), o["tab"],
        w["slut"], w["llut"], o["slut"], o["llut"],
        N, K, ka_row, kb_row, ks_row, float(limit),
        ABITS=fmt.abits, BBITS=fmt.bbits, G=fmt.group, MIX=fmt.mix, NLEV=fmt.nlev, LV=fmt.lv_mode,
        AFF=fmt.affine, SPLIT=bool(split) and not fmt.affine, DUAL=w2 is not None, GATHER=not scatter,
        SCATTER=bool(scatter), NATIVE=not INTERPRETED, SWAP=bool(swap), N_FIRST=bool(n_first),
        EP=triton.next_power_of_2(max(1, E)), BM=plan.bm, BN=bn, BK=bk, num_warps=num_warps, num_stages=num_stages,
    )
    return out


# -- the bf16 exactness proof -------------------------------------------------

def _bf16_np(v: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bf16 (ties to even), as float32 (numpy, no device)."""
    u = np.ascontiguousarray(v, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    return np.where(np.isfinite(v), r, v).astype(np.float32)


def bf16_exact(v: np.ndarray) -> bool:
    """Whether every value of the float32 array v is a bf16 number."""
    v = np.asarray(v, dtype=np.float32)
    return bool(np.array_equal(_bf16_np(v), v))


def bf16_terms(levels: np.ndarray, scales: np.ndarray, affine: bool = False) -> int:
    """How many bf16 parts carry every decoded weight exactly: 1, 2, or 0 (neither).

    levels float32 (tables, nlev), scales float32 (256,): the layout's LUTs; the
    weights are every level x every finite scale (the float32 product ``formats.decode``
    forms). Affine (``code * s - o``): the product and the offset are the two parts, each
    must be exact alone."""
    lv = np.asarray(levels, np.float32).reshape(-1)
    sc = np.asarray(scales, np.float32)
    sc = sc[np.isfinite(sc)]
    with np.errstate(over="ignore", invalid="ignore"):
        p = (lv[:, None] * sc[None, :]).astype(np.float32).reshape(-1)
    p = p[np.isfinite(p)]
    if affine:
        return 2 if np.array_equal(_bf16_np(p), p) and np.array_equal(_bf16_np(sc), sc) else 0
    hi = _bf16_np(p)
    if np.array_equal(hi, p):
        return 1
    lo = _bf16_np((p - hi).astype(np.float32))  # p - hi is exact in float32 (hi is p's leading bits)
    if np.array_equal(hi.astype(np.float64) + lo.astype(np.float64), p.astype(np.float64)):
        return 2
    return 0


def qtype_terms(qtype: str, books=None, modes=None) -> int:
    """``bf16_terms`` of a qtype's kernel LUTs (MIX: of the registered books and modes)."""
    from ds4quant.runtime.kernels import layout

    f = layout.kernel_format(qtype)
    return bf16_terms(layout.level_lut(qtype, books, modes), layout.scale_lut(qtype), affine=f.affine)


def split_variants(qtype: str) -> tuple:
    """The SPLIT constexprs a qtype's stacks can launch with (MIX: either, by its books)."""
    from ds4quant.runtime.kernels import layout

    f = layout.kernel_format(qtype)
    if f.mix:
        return (False, True)
    return (qtype_terms(qtype) == 2 and not f.affine,)
