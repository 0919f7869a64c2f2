"""Triton kernels for exact mode on the word layout (rocmfp2 / rocmfp3 decode
steps): the bits of ``owners/torch_exact`` (the definition), at about the
cost of fast mode's matrix-vector kernels.

A decode step is four launches: ``quantize`` (``Q`` of docs/exact-mode.md on the
layer input), ``gemv_exact`` for gate + up, ``swiglu_quantize`` (``SWIGLU``,
then ``Q`` on its output), ``gemv_exact`` for down. Why the products are
exact:

* a weight is level * scale with an integer level (|level| <= 4) and the
  quantized input is q * 2^s with an integer |q| <= 127 shared exponent s per
  32 inputs. A 16-weight scale group lies in one 32-input block, so its terms
  are scale * 2^s * sum_c level_c * q_c, and that integer sum P (|P| < 2^13)
  is exact in a float32 accumulator in any order, with or without FMA: the
  inner loop is fast mode's (one decode, one FMA a weight).
* each group's term C = P * scale * 2^s is exact in float64 (13 + 24 bits).
  The kernel tracks, per (token, row), the highest bit any term may reach
  (|C| < 2^(top(P) + top(scale) + s)) and the lowest bit any term has
  (lsb(scale) + s: P is an integer); when hi + ceil(log2 groups) - lo <= 53,
  every partial sum of the terms is an integer multiple of 2^lo below
  2^(hi + log2 groups) in magnitude, a float64 number: the float64 sum in the
  kernel's order (any order) is the exact sum, and one cast rounds it to
  float32 as the definition's single rounding does.
* pairs outside that bound are counted in ``bad`` (an int32 device counter)
  and, with ``flags``, marked per pair; the caller patches those outputs
  with the definition's integer limbs (``torch_exact._limb_linear``, what
  torch_exact does for such pairs). The bound is this kernel's own,
  not ``torch_exact.f64_pairs``: both routes of the definition give the same
  bits, so the split decides the cost, never the bytes.

``quantize`` and ``swiglu_quantize`` are float64 one IEEE operation at a
time: they are launched with ``enable_fp_fusion=False`` (no FMA contraction),
round half to even by adding and subtracting 1.5 * 2^52, build powers of two
from the exponent bits (no libm), divide with the IEEE float64 division
(``div.rn.f64`` in the PTX; checked on the lent GPU), and read their float64
constants from a tensor (a float literal in Triton is float32). Non-finite
inputs or SwiGLU outputs also count in ``bad``; the rerun through the
definition raises the error the definition raises.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from ds4quant.runtime.kernels.gemv_triton import MAGIC, _bn, _bw, _code, _load_tile, _scale, _sdec_of

BLOCK = 32  # inputs sharing one exponent (torch_exact.BLOCK)
BIG = tl.constexpr(1 << 20)  # bit-range sentinel (torch_exact's)
# 1.5 * 2^52: (v + RND) - RND rounds |v| < 2^51 half to even (a float32 value too, so the
# literal loses nothing when Triton types it)
RND = tl.constexpr(6755399441055744.0)


@triton.jit
def _pow2(e):
    """2.0 ** e in float64 for integer e in [-1022, 1023], from the bits."""
    return ((e.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _bit_range(v):
    """(top, low) of nonzero float32 v: |v| < 2^top, v a multiple of 2^low (exact int -> float32
    conversions of the 24-bit significand read its length and lowest set bit)."""
    b = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    ef = b >> 23
    mant = b & 0x7FFFFF
    sig = tl.where(ef > 0, mant | 0x800000, mant)
    e0 = tl.maximum(ef, 1) - 150
    top = e0 + (sig.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 126
    low = e0 + ((sig & -sig).to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
    return top, low


@triton.jit
def _fold(acc, hi, lo, p, sc, top_s, low_s, sp2, sblk):
    """Add one scale group's exact term p * sc * 2^s to acc (float64) and widen its bit range."""
    acc += p.to(tl.float64) * (sc.to(tl.float64) * sp2)
    top_p = ((p.to(tl.int32, bitcast=True) & 0x7FFFFFFF) >> 23) - 126  # p: an integer, 0 < |p| < 2^13
    live = (p != 0) & (sc != 0)
    hi = tl.maximum(hi, tl.where(live, top_p + top_s + sblk, -BIG))
    lo = tl.minimum(lo, tl.where(live, low_s + sblk, BIG))
    return acc, hi, lo


@triton.jit
def _finish(out_ptr, stride_o, slot, rows, acc, hi, lo, bad_ptr, fl_ptr, LOG2G: tl.constexpr,
            FLAGS: tl.constexpr):
    res = tl.sum(acc, axis=1)
    h = tl.max(hi, axis=1)
    l_ = tl.min(lo, axis=1)
    fits = (h == -BIG) | (h + LOG2G - l_ <= 53)
    nbad = tl.sum(tl.where(fits, 0, 1), axis=0)
    # + 0.0: an exact zero is +0.0, as the definition's float64 route has it
    tl.store(out_ptr + slot.to(tl.int64) * stride_o + rows, (res + 0.0).to(tl.float32))
    tl.atomic_add(bad_ptr, nbad, mask=nbad > 0)
    if FLAGS:  # which pairs: the caller patches them through the definition's limbs
        tl.store(fl_ptr + slot.to(tl.int64) * stride_o + rows, tl.where(fits, 0, 1).to(tl.int8))


@triton.jit
def _gemv_exact_kernel(qt_ptr, stride_q, sx_ptr, ids_ptr, loc_ptr, out_ptr, out2_ptr, stride_o, bad_ptr,
                       fl_ptr, fl2_ptr, a_ptr, a2_ptr, s_ptr, slut_ptr, g_ptr, g2_ptr, gs_ptr, gslut_ptr,
                       N, magic, KW: tl.constexpr, CBITS: tl.constexpr, OFF: tl.constexpr,
                       DUAL: tl.constexpr, PRE: tl.constexpr, SDEC: tl.constexpr, LOG2G: tl.constexpr,
                       FLAGS: tl.constexpr, BN: tl.constexpr, BW: tl.constexpr):
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(loc_ptr + tl.load(ids_ptr + slot)).to(tl.int64)
    rows = pid_n * BN + tl.arange(0, BN)
    jj = tl.arange(0, BW)
    off0 = e * N * KW + rows[:, None].to(tl.int64) * KW + jj[None, :]
    xq = qt_ptr + slot.to(tl.int64) * stride_q
    xs = sx_ptr + slot.to(tl.int64) * (KW // 2)
    acc = tl.zeros((BN, BW), dtype=tl.float64)
    acc2 = tl.zeros((BN, BW), dtype=tl.float64)
    hi = tl.full((BN, BW), -BIG, tl.int32)
    lo = tl.full((BN, BW), BIG, tl.int32)
    hi2 = hi
    lo2 = lo
    nw = tl.zeros((BN, BW), dtype=tl.int32)
    nwb = nw
    nsb = tl.zeros((BN, BW), dtype=tl.uint8)
    nga = nw
    ngb = nw
    nsg = nsb
    if PRE:
        nw, nwb, nsb, nga, ngb, nsg = _load_tile(a_ptr, a2_ptr, s_ptr, g_ptr, g2_ptr, gs_ptr, off0, CBITS, DUAL)
    for j0 in range(0, KW, BW):
        if PRE:  # the next tile's loads in flight while this one is summed (gemv_triton's prefetch)
            wa, wb, sb, ga, gb, sg = nw, nwb, nsb, nga, ngb, nsg
            nxt = off0 + tl.minimum(j0 + BW, KW - BW)
            nw, nwb, nsb, nga, ngb, nsg = _load_tile(a_ptr, a2_ptr, s_ptr, g_ptr, g2_ptr, gs_ptr, nxt, CBITS, DUAL)
        else:
            wa, wb, sb, ga, gb, sg = _load_tile(a_ptr, a2_ptr, s_ptr, g_ptr, g2_ptr, gs_ptr, off0 + j0, CBITS, DUAL)
        wah = wa >> 16
        wbh = wb >> 16
        gah = ga >> 16
        gbh = gb >> 16
        p = tl.zeros((BN, BW), dtype=tl.float32)
        p2 = tl.zeros((BN, BW), dtype=tl.float32)
        xj = j0 + jj
        for c in tl.static_range(16):
            xc = tl.load(xq + xj + c * KW)[None, :]  # q: small integers held as float32
            v = _code(wa, wah, wb, wbh, c, magic, CBITS, OFF)
            p += v * xc
            if DUAL:
                u = _code(ga, gah, gb, gbh, c, magic, CBITS, OFF)
                p2 += u * xc
        sblk = tl.load(xs + xj // 2)[None, :]  # the word's 32-input block exponent
        sp2 = _pow2(sblk)
        sc = _scale(slut_ptr, sb, SDEC)
        top_s, low_s = _bit_range(sc)
        acc, hi, lo = _fold(acc, hi, lo, p, sc, top_s, low_s, sp2, sblk)
        if DUAL:
            sc2 = _scale(gslut_ptr, sg, SDEC)
            top2, low2 = _bit_range(sc2)
            acc2, hi2, lo2 = _fold(acc2, hi2, lo2, p2, sc2, top2, low2, sp2, sblk)
    _finish(out_ptr, stride_o, slot, rows, acc, hi, lo, bad_ptr, fl_ptr, LOG2G, FLAGS)
    if DUAL:
        _finish(out2_ptr, stride_o, slot, rows, acc2, hi2, lo2, bad_ptr, fl2_ptr, LOG2G, FLAGS)


@triton.jit
def _quant_store(xv, slot, b, qt_ptr, s_ptr, bad_ptr, K, KW, KB):
    """Step 1 of exact mode on float64 blocks xv (NB, 32) of blocks b: q (group-transposed,
    float32) and s (int32); a non-finite value counts in bad."""
    nonfin = tl.sum(tl.sum(((xv - xv) != 0).to(tl.int32), axis=1), axis=0)
    m = tl.max(tl.abs(xv), axis=1)
    e = ((m.to(tl.int64, bitcast=True) >> 52) & 0x7FF) - 1022  # frexp's exponent (m is a normal float64)
    zero = m == 0
    s = tl.where(zero, 0, e - 7)
    s = s + (m * _pow2(-s) > 127).to(tl.int64)
    v = xv * _pow2(-s)[:, None]  # exact: a power-of-two scaling
    q = (v + RND) - RND
    f = b[:, None] * 32 + tl.arange(0, 32)[None, :]
    tl.store(qt_ptr + slot.to(tl.int64) * K + (f % 16) * KW + f // 16, q.to(tl.float32))
    tl.store(s_ptr + slot.to(tl.int64) * KB + b, s.to(tl.int32))
    tl.atomic_add(bad_ptr, nonfin, mask=nonfin > 0)


@triton.jit
def _quant_kernel(x_ptr, stride_x, qt_ptr, s_ptr, bad_ptr, K, KW, KB, NB: tl.constexpr):
    slot = tl.program_id(0)
    b = tl.program_id(1) * NB + tl.arange(0, NB)
    f = b[:, None] * 32 + tl.arange(0, 32)[None, :]
    xv = tl.load(x_ptr + slot.to(tl.int64) * stride_x + f).to(tl.float64)
    _quant_store(xv, slot, b, qt_ptr, s_ptr, bad_ptr, K, KW, KB)


@triton.jit
def _swiglu_quant_kernel(g_ptr, u_ptr, stride_g, c_ptr, qt_ptr, s_ptr, bad_ptr, h_ptr, K, KW, KB,
                         NB: tl.constexpr, H_OUT: tl.constexpr):
    slot = tl.program_id(0)
    b = tl.program_id(1) * NB + tl.arange(0, NB)
    f = b[:, None] * 32 + tl.arange(0, 32)[None, :]
    g = tl.load(g_ptr + slot.to(tl.int64) * stride_g + f).to(tl.float64)
    u = tl.load(u_ptr + slot.to(tl.int64) * stride_g + f).to(tl.float64)
    L = tl.load(c_ptr)
    gc = tl.minimum(g, L)
    uc = tl.minimum(tl.maximum(u, -L), L)
    # torch_exact.fixed_exp(-gc), one rounding an operation
    z = -gc
    big = z > 709.0
    zz = tl.where(big, 0.0, z)
    n = (zz * tl.load(c_ptr + 1) + RND) - RND
    r = (zz - n * tl.load(c_ptr + 2)) - n * tl.load(c_ptr + 3)
    p = tl.zeros_like(zz) + tl.load(c_ptr + 5 + 13)
    for i in tl.static_range(13):
        p = p * r
        p = p + tl.load(c_ptr + 5 + 12 - i)
    ez = tl.where(big, tl.load(c_ptr + 4), p * _pow2(n.to(tl.int64)))
    silu = gc / (1.0 + ez)
    silu = tl.where(big, gc * 0.0, silu)  # the definition's signed zero when E = +inf
    h = (silu * uc).to(tl.float32)
    if H_OUT:  # the SwiGLU output itself (tests: its bits against the definition's)
        tl.store(h_ptr + slot.to(tl.int64) * K + f, h)
    _quant_store(h.to(tl.float64), slot, b, qt_ptr, s_ptr, bad_ptr, K, KW, KB)


_CONST: dict = {}  # (device, limit) -> float64 constants of swiglu_quantize


def swiglu_constants(device, limit: float):
    """float64 (19,): limit, 1/ln2, ln2 hi, ln2 lo, +inf, the 14 Taylor terms (torch_exact's)."""
    import torch

    from ds4quant.runtime.owners import torch_exact as te

    key = (str(device), float(limit))
    if key not in _CONST:
        vals = [float(limit), te.INV_LN2, te.LN2_HI, te.LN2_LO, math.inf] + list(te.TAYLOR)
        _CONST[key] = torch.tensor(vals, dtype=torch.float64, device=device)
    return _CONST[key]


def _nb(kb: int, want: int = 16) -> int:
    nb = max(1, min(want, kb))
    while kb % nb:
        nb //= 2
    return nb


def quantize(x, bad, qt=None, s=None, nb: int = 16):
    """Step 1 on float32 x (n, K) -> (qt float32 (n, 16, K / 16) group-transposed integers,
    s int32 (n, K / 32)); non-finite values count in ``bad`` (int32 (1,))."""
    import torch

    n, K = x.shape
    if K % BLOCK:
        raise ValueError(f"exact mode needs inputs in blocks of {BLOCK}, got {K} columns")
    qt = torch.empty((n, 16, K // 16), dtype=torch.float32, device=x.device) if qt is None else qt
    s = torch.empty((n, K // BLOCK), dtype=torch.int32, device=x.device) if s is None else s
    nb = _nb(K // BLOCK, nb)
    if n:
        _quant_kernel[(n, K // BLOCK // nb)](x, x.stride(0), qt, s, bad, K, K // 16, K // BLOCK, NB=nb,
                                            num_warps=1, enable_fp_fusion=False)
    return qt, s


def swiglu_quantize(g, u, limit: float, bad, nb: int = 16, h=None):
    """``SWIGLU`` on float32 gate / up outputs (n, I), then ``Q`` on its float32 result:
    (qt, s) as ``quantize`` gives them; a non-finite SwiGLU output counts in ``bad``.
    ``h``: a float32 (n, I) tensor that also receives the SwiGLU output."""
    import torch

    n, K = g.shape
    qt = torch.empty((n, 16, K // 16), dtype=torch.float32, device=g.device)
    s = torch.empty((n, K // BLOCK), dtype=torch.int32, device=g.device)
    nb = _nb(K // BLOCK, nb)
    if n:
        _swiglu_quant_kernel[(n, K // BLOCK // nb)](g, u, g.stride(0), swiglu_constants(g.device, limit), qt, s,
                                                    bad, qt if h is None else h, K, K // 16, K // BLOCK, NB=nb,
                                                    H_OUT=h is not None, num_warps=2, enable_fp_fusion=False)
    return qt, s


def gemv_exact(lp, qt, s, ids, loc, bad, *, lp2=None, bn: int = 8, bw: int = 64, num_warps: int = 4,
               pre: bool = True, sdec: bool = True, flags: bool = False):
    """Exact W_e @ a[slot] for every slot (e = loc[ids[slot]]), a = the quantized input (qt, s)
    from ``quantize`` / ``swiglu_quantize``: float32 (n, N), or (gate, up) with ``lp2``.
    Pairs outside the kernel's float64 bound count in ``bad`` (their outputs are not exact);
    ``flags``: also an int8 (n, N) tensor per output, 1 at those pairs (returned after the outputs)."""
    import torch

    n = qt.shape[0]
    E, N, KW = lp.a.shape
    o = lp2 if lp2 is not None else lp
    if (o.cbits, o.off, o.a.shape) != (lp.cbits, lp.off, lp.a.shape):
        raise ValueError("gate and up of one launch need the same linear layout")
    if qt.shape[1:] != (16, KW) or s.shape[1] * 2 != KW:
        raise ValueError(f"exact product: input {tuple(qt.shape)} for weights of {KW * 16} columns")
    out = torch.empty((n, N), dtype=torch.float32, device=qt.device)
    out2 = torch.empty_like(out) if lp2 is not None else out
    fl = torch.zeros((n, N), dtype=torch.int8, device=qt.device) if flags else out
    fl2 = torch.zeros((n, N), dtype=torch.int8, device=qt.device) if flags and lp2 is not None else fl
    bw = _bw(KW, bw)
    bn = _bn(N, bn)
    sd = _sdec_of(lp.slut) if sdec else 0
    if sd and lp2 is not None and _sdec_of(lp2.slut) != sd:
        sd = 0
    if n:
        _gemv_exact_kernel[(n, N // bn)](
            qt, qt.stride(0), s, ids, loc, out, out2, out.stride(0), bad, fl, fl2,
            lp.a, lp.a2 if lp.a2 is not None else lp.a, lp.s, lp.slut,
            o.a, o.a2 if o.a2 is not None else o.a, o.s, o.slut,
            N, MAGIC, KW=KW, CBITS=lp.cbits, OFF=int(lp.off), DUAL=lp2 is not None, PRE=bool(pre), SDEC=sd,
            LOG2G=int(math.ceil(math.log2(KW))) if KW > 1 else 0, FLAGS=bool(flags), BN=bn, BW=bw,
            num_warps=num_warps)
    outs = (out, out2) if lp2 is not None else (out,)
    if flags:
        outs += (fl, fl2) if lp2 is not None else (fl,)
    return outs if len(outs) > 1 else out
