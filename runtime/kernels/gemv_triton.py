"""Triton decode-step kernels: one program row block of one slot, every
selected expert of a layer in one launch (fast mode, few slots).

Weights whose levels are small integers are read as 32-bit words of codes
(``layout.linear_planes``): rocmfp2's 2-bit codes (level = code - 1, a word
is one 16-weight scale group, no copy: a view of plane a) and rocmfp3
repacked to 4-bit codes (level = code - 4, a group is two words). A code
becomes a float through the exponent trick (code | 0x4B000000 reinterpreted
is 2^23 + code: no int-to-float conversion, which runs at a quarter rate on
Hopper), so a weight costs a shift, a logic op, a subtract and an FMA; the
level offset and the scale are applied once per group:

    sum_i lv_i x_i = sum_i code_i x_i - off * sum_i x_i      (one scale group)

Activations arrive "group-transposed" (``xt[slot, c, j] = x[slot, 16 j + c]``),
so the c-th code of every word in a tile meets a contiguous activation
vector; the gate+up kernel writes its SwiGLU output in that layout for down.
Slots are independent (no sort, no host planning): slot s reads the weights
of local expert ``loc[ids[s]]``, so a CUDA graph of the two launches replays
any routing.
"""

from __future__ import annotations

import triton
import triton.language as tl

MAGIC = tl.constexpr(0x4B000000)  # float bits of 2^23
TWO23 = tl.constexpr(8388608.0)


@triton.jit
def _val(wa, wb, c: tl.constexpr, CBITS: tl.constexpr):
    """2^23 + the c-th code of every word (as float; codes 0..15 exact)."""
    if CBITS == 2:
        code = (wa >> (2 * c)) & 3
    elif c < 8:
        code = (wa >> (4 * c)) & 15
    else:
        code = (wb >> (4 * (c - 8))) & 15
    return (code | MAGIC).to(tl.float32, bitcast=True) - TWO23


@triton.jit
def _gemv_kernel(xt_ptr, stride_x, ids_ptr, loc_ptr, out_ptr, stride_o,
                 a_ptr, a2_ptr, s_ptr, slut_ptr,
                 g_ptr, g2_ptr, gs_ptr, gslut_ptr,
                 N, KW, OKW, limit,
                 CBITS: tl.constexpr, OFF: tl.constexpr, DUAL: tl.constexpr, OUT_T: tl.constexpr,
                 BN: tl.constexpr, BW: tl.constexpr):
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(loc_ptr + tl.load(ids_ptr + slot)).to(tl.int64)  # global -> local expert
    rows = pid_n * BN + tl.arange(0, BN)
    rmask = rows < N
    base = e * N * KW
    xt_row = xt_ptr + slot.to(tl.int64) * stride_x
    acc = tl.zeros((BN, BW), dtype=tl.float32)
    acc2 = tl.zeros((BN, BW), dtype=tl.float32)
    for j0 in range(0, KW, BW):
        jj = j0 + tl.arange(0, BW)
        off = base + rows[:, None].to(tl.int64) * KW + jj[None, :]
        m2 = rmask[:, None]
        wa = tl.load(a_ptr + off, mask=m2, other=0)
        wb = wa
        if CBITS == 4:
            wb = tl.load(a2_ptr + off, mask=m2, other=0)
        ga = wa
        gb = wa
        if DUAL:
            ga = tl.load(g_ptr + off, mask=m2, other=0)
            gb = ga
            if CBITS == 4:
                gb = tl.load(g2_ptr + off, mask=m2, other=0)
        sb = tl.load(s_ptr + off, mask=m2, other=0).to(tl.int32)
        p = tl.zeros((BN, BW), dtype=tl.float32)
        p2 = tl.zeros((BN, BW), dtype=tl.float32)
        xs = tl.zeros((BW,), dtype=tl.float32)
        for c in tl.static_range(16):
            xc = tl.load(xt_row + c * KW + jj)
            p += _val(wa, wb, c, CBITS) * xc[None, :]
            if DUAL:
                p2 += _val(ga, gb, c, CBITS) * xc[None, :]
            xs += xc
        acc += tl.load(slut_ptr + sb) * (p - OFF * xs[None, :])
        if DUAL:
            sb2 = tl.load(gs_ptr + off, mask=m2, other=0).to(tl.int32)
            acc2 += tl.load(gslut_ptr + sb2) * (p2 - OFF * xs[None, :])
    res = tl.sum(acc, axis=1)
    if DUAL:
        gc = tl.minimum(res, limit)
        uc = tl.minimum(tl.maximum(tl.sum(acc2, axis=1), -limit), limit)
        res = gc / (1.0 + tl.exp(-gc)) * uc
    if OUT_T:  # group-transposed for the next stage: [c, j] = feature 16 j + c
        dst = (rows % 16) * OKW + rows // 16
    else:
        dst = rows
    tl.store(out_ptr + slot.to(tl.int64) * stride_o + dst, res, mask=rmask)


def _bw(kw: int, want: int) -> int:
    bw = max(1, min(want, kw))
    while kw % bw:
        bw //= 2
    return bw


def gemv(lp, xt, ids, loc, out, *, lp2=None, limit: float = 0.0, out_t: bool = False,
         bn: int = 32, bw: int = 32, num_warps: int = 4, num_stages: int = 3):
    """out[s] = W_{loc[ids[s]]} @ x[s] for every slot s (or SwiGLU(gate, up) with ``lp2``).

    lp / lp2: ``layout.LinearPlanes`` (a, a2, s, slut, cbits, off); xt float32
    (n, 16, K/16) group-transposed; ids int64 (n,) global experts, loc int64
    (global -> local index); out float32 (n, N) or, with out_t, (n, 16, N/16)."""
    n = xt.shape[0]
    E, N, KW = lp.a.shape
    o = lp2 if lp2 is not None else lp
    if (o.cbits, o.off, o.a.shape) != (lp.cbits, lp.off, lp.a.shape):
        raise ValueError("gate and up of one launch need the same linear layout")
    bw = _bw(KW, bw)
    grid = (n, triton.cdiv(N, bn))
    _gemv_kernel[grid](
        xt, xt.stride(0), ids, loc, out, out.stride(0),
        lp.a, lp.a2 if lp.a2 is not None else lp.a, lp.s, lp.slut,
        o.a, o.a2 if o.a2 is not None else o.a, o.s, o.slut,
        N, KW, N // 16, float(limit),
        CBITS=lp.cbits, OFF=float(lp.off), DUAL=lp2 is not None, OUT_T=out_t,
        BN=bn, BW=bw, num_warps=num_warps, num_stages=num_stages,
    )
    return out
