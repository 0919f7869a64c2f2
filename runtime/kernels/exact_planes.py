"""Exact mode's product ``D(W, a)`` (``docs/exact-mode.md#product``) on the plane
layout of ``layout.repack``: every kernel qtype (MIX 105/106, rocmfp2 / s40 /
rocmfp3 / rocmfp4 / rocmfp4_fast / rocmfp6 / rocmfp8, rocmfp2_affine, mxfp4),
one program per (slot, row block), the slot's expert looked up on the device.

Why the sums are exact (the argument of ``exact_triton``, generalised):

* every level table is integers times one power of two per table
  (``integer_levels``): the fixed formats' levels are integers (shift 0), a
  MIX book's bf16 levels are integers times 2^shift with shift the lowest set
  bit over the book. The quantized input is q * 2^s with |q| <= 127 and one s
  per 32 inputs, and a scale group (16 or 32 weights) lies inside one 32-input
  block. So a group's terms are S * 2^(s + shift) * P with the integer
  P = sum(level_int * q) over the group; ``integer_levels`` refuses a table
  whose G * max|level_int| * 127 reaches 2^24 for the float32 inner sum (exact
  in any order, fused or not); MIX books whose small levels need more bits sum
  a group in float64 instead (``WIDE``: exact below 2^49).
* rocmfp2_affine's weight is code * S - O (exact in float32: every value is a
  multiple of 2^-10 below 2^10), so its group contributes S * 2^s * sum(code * q)
  and -O * 2^s * sum(q): two integer sums, two terms.
* each term P * S * 2^(s + shift) is exact in float64 (24 + 4 bits; E8M0 scales
  are one bit), and the kernel tracks per (slot, row) the highest and lowest
  bit any term can have; where hi + ceil(log2 terms) - lo <= 53 every partial
  sum is a float64 number and the float64 sum in any order is the exact sum,
  rounded once to float32. Other pairs count in ``bad`` (and are flagged per
  pair with ``flags``); the owner patches them with the definition's limbs.

So the bytes are the definition's, i.e. the CPU owner's. No division, square
root or exponential; multiply-adds may fuse (the products are exact).
"""

from __future__ import annotations

import math

import numpy as np
import triton
import triton.language as tl

from ds4quant.runtime.kernels.exact_triton import _bit_range, _finish, _fold, _pow2
from ds4quant.runtime.kernels.gemv_triton import _bn
from ds4quant.runtime.kernels.moe_triton import _tile

P_BOUND = 1 << 24  # the float32 inner sum is exact below this
WIDE_BOUND = 1 << 49  # a float64 inner sum below this times a 4-bit scale stays within 53 bits
BIG = tl.constexpr(1 << 20)  # bit-range sentinel (exact_triton's)


def integer_levels(levels: np.ndarray, group: int):
    """(ilut float32 (tables, nlev) of integers, shift int32 (tables,), wide) with
    levels == ilut * 2^shift per table; ``wide``: some table's integer group sum can
    leave float32's exact range (G * max|int| * 127 >= 2^24), so the kernel sums a
    group in float64 (exact below 2^49 with room for the scale's 4 bits). None when
    even that bound fails (levels whose exponents lie absurdly far apart)."""
    lv = np.asarray(levels, dtype=np.float32)
    wide = False
    ilut = np.zeros_like(lv)
    shift = np.zeros(lv.shape[0], dtype=np.int32)
    for t in range(lv.shape[0]):
        row = lv[t].astype(np.float64)
        nz = row[row != 0]
        if nz.size == 0:
            continue
        if not np.all(np.isfinite(nz)):
            return None
        m, e = np.frexp(nz)  # nz = m * 2^e, 0.5 <= |m| < 1, m has at most 24 bits
        mi = (m * 2.0 ** 24).astype(np.int64)
        tz = np.array([(int(v) & -int(v)).bit_length() - 1 for v in np.abs(mi)])
        lsb = int((e - 24 + tz).min())
        ints = np.ldexp(row, -lsb)
        bound = group * np.abs(ints).max() * 127
        if not np.all(ints == np.round(ints)) or bound >= WIDE_BOUND:
            return None
        wide |= bool(bound >= P_BOUND)
        ilut[t] = ints.astype(np.float32)  # 24 significant bits at most: exact
        shift[t] = lsb
    return ilut, shift, wide


@triton.jit
def _fold64(acc, hi, lo, p, sc, top_s, low_s, ex):
    """``exact_triton._fold`` for a float64 integer group sum p (|p| < 2^49)."""
    acc += p * (sc.to(tl.float64) * _pow2(ex))
    top_p = ((p.to(tl.int64, bitcast=True) & 0x7FFFFFFFFFFFFFFF) >> 52).to(tl.int32) - 1022
    live = (p != 0) & (sc != 0)
    hi = tl.maximum(hi, tl.where(live, top_p + top_s + ex, -BIG))
    lo = tl.minimum(lo, tl.where(live, low_s + ex, BIG))
    return acc, hi, lo


@triton.jit
def _planes_exact_kernel(q_ptr, stride_q, sx_ptr, ids_ptr, loc_ptr, out_ptr, stride_o, bad_ptr, fl_ptr,
                         a_ptr, b_ptr, s_ptr, o_ptr, tab_ptr, slut_ptr, ilut_ptr, ish_ptr,
                         N, K, KB, ka_row, kb_row, ks_row,
                         ABITS: tl.constexpr, BBITS: tl.constexpr, G: tl.constexpr, MIX: tl.constexpr,
                         NLEV: tl.constexpr, LV: tl.constexpr, AFF: tl.constexpr, LOG2G: tl.constexpr,
                         WIDE: tl.constexpr, FLAGS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(loc_ptr + tl.load(ids_ptr + slot)).to(tl.int64)
    rows = pid_n * BN + tl.arange(0, BN)
    rmask = rows < N
    a_base = a_ptr + e * N * ka_row
    b_base = b_ptr + e * N * kb_row
    s_base = s_ptr + e * N * ks_row
    o_base = o_ptr + e * N * ks_row
    tab_base = 0
    if MIX:
        tab_base = tl.load(tab_ptr + e)
    NG: tl.constexpr = BK // G
    kk = tl.arange(0, BK)
    js = tl.arange(0, NG)
    shift0 = tl.load(ish_ptr)  # the fixed formats' one table
    acc = tl.zeros((BN, NG), dtype=tl.float64)
    hi = tl.full((BN, NG), -(1 << 20), tl.int32)
    lo = tl.full((BN, NG), 1 << 20, tl.int32)
    for k0 in range(0, K, BK):
        q = tl.load(q_ptr + slot.to(tl.int64) * stride_q + k0 + kk)  # small integers held as float32
        q3 = tl.reshape(q, (1, NG, G))
        lv, sc, off = _tile(a_base, b_base, s_base, o_base, tab_base, rows, rmask, k0, ka_row, kb_row, ks_row,
                            slut_ptr, ilut_ptr, ABITS, BBITS, G, MIX, NLEV, LV, AFF, BN, BK)
        if WIDE:  # (BN, NG): integers below 2^49, float64 sums exact in any order
            p = tl.sum(lv.to(tl.float64) * q3.to(tl.float64), axis=2)
        else:  # integers below 2^24: float32 sums exact in any order, fused or not
            p = tl.sum(lv * q3, axis=2)
        sblk = tl.load(sx_ptr + slot.to(tl.int64) * KB + (k0 + js * G) // 32)[None, :]
        if MIX:
            sb = tl.load(s_base + rows[:, None].to(tl.int64) * ks_row + (k0 // G + js)[None, :],
                         mask=rmask[:, None], other=0).to(tl.int32)
            ex = sblk + tl.load(ish_ptr + tab_base + (sb >> 7))
        else:
            ex = sblk + shift0
        top_s, low_s = _bit_range(sc)
        if WIDE:
            acc, hi, lo = _fold64(acc, hi, lo, p, sc, top_s, low_s, ex)
        else:
            acc, hi, lo = _fold(acc, hi, lo, p, sc, top_s, low_s, _pow2(ex), ex)
        if AFF:  # minus O * 2^s * sum(q): the offset's own exact term
            p2 = tl.zeros_like(p) - tl.sum(q3, axis=2)
            top_o, low_o = _bit_range(off)
            acc, hi, lo = _fold(acc, hi, lo, p2, off, top_o, low_o, _pow2(ex), ex)
    _finish(out_ptr, stride_o, slot, rows, acc, hi, lo, bad_ptr, fl_ptr, LOG2G, FLAGS)


def plain(qt):
    """``exact_triton.quantize``'s group-transposed q (n, 16, K / 16) -> (n, K) in input order."""
    n = qt.shape[0]
    return qt.transpose(1, 2).reshape(n, -1).contiguous()


def product(fmt, w, q, s, ids, loc, bad, *, flags: bool = False, bn: int = 16, bk: int = 64,
            num_warps: int = 4):
    """Exact W_e @ a[slot] for every slot (e = loc[ids[slot]]), a = (q (n, K) float32 integers,
    s int32 (n, K / 32)): float32 (n, N) (and, with ``flags``, int8 (n, N): 1 where the pair is
    outside the float64 bound, its output not exact). w: a stack's planes dict with ``ilut``
    (float32 integer levels), ``ishift`` (int32 per table) and ``wide`` from ``integer_levels``."""
    import torch

    a = w["a"]
    _, N, ka_row = a.shape
    n, K = q.shape
    b = w["b"] if w["b"] is not None else a
    kb_row = b.shape[2] if w["b"] is not None else 0
    floor = max(fmt.group, 32)
    bk = max(min(bk, K), floor)
    while K % bk and bk > floor:  # the largest power-of-two step up to bk that divides K
        bk //= 2
    if K % bk:
        raise ValueError(f"exact product needs a column count that is a multiple of {floor}, got {K}")
    bn = _bn(N, bn)  # row blocks divide the rows: the stores are unmasked
    out = torch.empty((n, N), dtype=torch.float32, device=q.device)
    fl = torch.zeros((n, N), dtype=torch.int8, device=q.device) if flags else out
    terms = (K // fmt.group) * (2 if fmt.affine else 1)
    if n:
        _planes_exact_kernel[(n, N // bn)](
            q, q.stride(0), s, ids, loc, out, out.stride(0), bad, fl,
            a, b, w["s"], w["o"] if w.get("o") is not None else w["s"], w["tab"], w["slut"], w["ilut"],
            w["ishift"], N, K, s.shape[1], ka_row, kb_row, w["s"].shape[2],
            ABITS=fmt.abits, BBITS=fmt.bbits, G=fmt.group, MIX=fmt.mix, NLEV=fmt.nlev, LV=fmt.lv_mode,
            AFF=fmt.affine, LOG2G=int(math.ceil(math.log2(terms))) if terms > 1 else 0, WIDE=bool(w["wide"]),
            FLAGS=bool(flags),
            BN=bn, BK=bk, num_warps=num_warps)
    return (out, fl) if flags else out
