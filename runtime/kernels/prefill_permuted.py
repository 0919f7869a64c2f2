"""Tensor-core prefill on permuted activations (fast mode): the grouped expert
GEMMs of ``prefill_triton`` with the weight tile decoded straight into the
layout the dot takes, no reshape of codes or levels.

A plane byte holds ``CPB = 8 / ABITS`` codes: code p of byte j of a row is
the weight at column ``j * CPB + p``. A sum over a row's columns can take
its terms in any order, so the kernel takes them code position by code
position: for each p, the p-th codes of a (BN rows, BJ bytes) byte tile are
one shift and mask away from a (BN, BJ) level tile, and they meet the
activations of columns ``j * CPB + p``. Those are contiguous when the
activations are stored permuted, column ``p * K / CPB + j`` holding
column ``j * CPB + p`` (``permute_columns``): the gate + up input is
permuted (and rounded to bf16, as ``prefill_triton`` rounds it) by one
torch op a call, and the gate + up launch writes its SwiGLU output already
permuted for the down projection (``out_cpb``). Each p is one ``tl.dot`` of
the decoded (BN, BJ) tile (the A operand, rows = output features) with a
(BJ, BM) activation slice (the slots of one expert as columns). Scale bytes
and the high-bit plane (3- and 6-bit codes) are read with the byte tile's
shape, each element at its group's byte.

Weights are the same exact bf16 products as ``prefill_triton`` (one part, or
two for ``SPLIT`` and affine: ``prefill_triton.bf16_terms``), levels by
arithmetic on the codes (small integers through the float exponent trick,
no int-to-float conversion) or the select tree for tables of up to 8, and
the sums float32; only the order of the float32 sums differs from
``prefill_triton``. ``PRE`` loads each step's byte tiles one step ahead. Programs run the row blocks of one slot tile next to
each other (``NFIRST``), so the tile's activations are read from L2 by
all of them. Measured against ``prefill_triton`` in
``benchmarks/runtime_gpu_prefill.py`` (docs/gpu.md#prefill).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ds4quant.runtime.kernels.prefill_triton import INTERPRETED, SlotPlan, _bf16, tile_slots

#: float bits of 2^23: (i | MAGIC) as float is 2^23 + i for 0 <= i < 2^23
MAGIC = tl.constexpr(0x4B000000)


@triton.jit
def _i2f(i):
    """float32 of small non-negative integers (below 2^23), exact: an OR and a subtraction."""
    return (i | MAGIC).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _levels(c, tb, llut_ptr, LV: tl.constexpr, NLEV: tl.constexpr):
    """Levels of the codes c (any shape, int32) as ``moe_triton._tile`` decodes them;
    tb: the level table's first entry for each code (same shape; LV_GATHER only)."""
    if LV == 1:  # rocmfp2: code - 1
        lv = _i2f(c) - 1.0
    elif LV == 3:  # rocmfp2_affine: the code
        lv = _i2f(c)
    elif LV == 2:  # rocmfp3: sign bit 2, magnitudes {0, 1, 2, 4}
        m = c & 3
        mag = _i2f(m + (m == 3).to(tl.int32))
        lv = tl.where((c & 4) != 0, -mag, mag)
    elif LV == 4 or LV == 5:  # e2m1 x 2 (mxfp4), or rocmfp4 (7 -> 10): sign bit 3
        m = c & 7
        ex = m >> 1
        mag = tl.where(ex == 0, m & 1, (2 + (m & 1)) << tl.maximum(ex - 1, 0))
        if LV == 5:
            mag = mag - 2 * (m == 7).to(tl.int32)
        lv = _i2f(mag)
        lv = tl.where((c & 8) != 0, -lv, lv)
    elif NLEV <= 8:  # small tables: a select on each code bit, the entries read per element
        b0 = (c & 1) != 0
        b1 = (c & 2) != 0
        v01 = tl.where(b0, tl.load(llut_ptr + tb + 1), tl.load(llut_ptr + tb))
        v23 = tl.where(b0, tl.load(llut_ptr + tb + 3), tl.load(llut_ptr + tb + 2))
        lv = tl.where(b1, v23, v01)
        if NLEV == 8:
            v45 = tl.where(b0, tl.load(llut_ptr + tb + 5), tl.load(llut_ptr + tb + 4))
            v67 = tl.where(b0, tl.load(llut_ptr + tb + 7), tl.load(llut_ptr + tb + 6))
            lv = tl.where((c & 4) != 0, tl.where(b1, v67, v45), lv)
    else:
        lv = tl.load(llut_ptr + tb + c)
    return lv


@triton.jit
def _planes_dot(xp, wa, hb, sc, off, tb, llut_ptr, acc, p: tl.constexpr, jj, ABITS: tl.constexpr,
                BBITS: tl.constexpr, LV: tl.constexpr, NLEV: tl.constexpr, AFF: tl.constexpr, SPLIT: tl.constexpr,
                NATIVE: tl.constexpr):
    """acc += (the p-th codes of the byte tile wa, decoded) @ xp."""
    CPB: tl.constexpr = 8 // ABITS
    c = (wa >> (p * ABITS)) & ((1 << ABITS) - 1)
    if BBITS > 0:  # the high bits: the byte tile hb holds each column's byte of plane b
        R: tl.constexpr = (8 // BBITS) // CPB  # plane-a bytes per plane-b byte
        sh = ((jj % R) * CPB + p) * BBITS
        c = c | (((hb >> sh[None, :]) & ((1 << BBITS) - 1)) << ABITS)
    w = _levels(c, tb, llut_ptr, LV, NLEV) * sc
    hi = _bf16(w, NATIVE)
    acc = tl.dot(hi, xp, acc, input_precision="ieee")
    if AFF:  # code * s - o: the offset is the second exact part
        acc = tl.dot(_bf16(tl.zeros_like(w) - off, NATIVE), xp, acc, input_precision="ieee")
    elif SPLIT:
        acc = tl.dot(_bf16(w - hi.to(tl.float32), NATIVE), xp, acc, input_precision="ieee")
    return acc


@triton.jit
def _bytes(a_base, b_base, s_base, o_base, tab_base, rows, rmask, j, ka_row, kb_row, ks_row, slut_ptr,
           ABITS: tl.constexpr, BBITS: tl.constexpr, G: tl.constexpr, MIX: tl.constexpr, NLEV: tl.constexpr,
           AFF: tl.constexpr):
    """The (BN, BJ) byte tile at plane-a bytes j (BJ,), with each element's high-bit byte,
    scale, offset and level-table start."""
    CPB: tl.constexpr = 8 // ABITS
    r64 = rows[:, None].to(tl.int64)
    wa = tl.load(a_base + r64 * ka_row + j[None, :], mask=rmask[:, None], other=0).to(tl.int32)
    hb = wa
    if BBITS > 0:
        R: tl.constexpr = (8 // BBITS) // CPB
        hb = tl.load(b_base + r64 * kb_row + (j // R)[None, :], mask=rmask[:, None], other=0).to(tl.int32)
    g = (j // (G // CPB))[None, :]  # the scale group of each byte (G is a multiple of CPB)
    sb = tl.load(s_base + r64 * ks_row + g, mask=rmask[:, None], other=0).to(tl.int32)
    sc = tl.load(slut_ptr + sb)
    off = sc
    if AFF:
        off = tl.load(slut_ptr + tl.load(o_base + r64 * ks_row + g, mask=rmask[:, None], other=0).to(tl.int32))
    tb = sb
    if MIX:
        tb = (tab_base + (sb >> 7)) * NLEV  # the book of each group
    else:
        tb = tl.zeros_like(sb)
    return wa, hb, sc, off, tb


@triton.jit
def _prefill_permuted_kernel(
    x_ptr, stride_x, out_ptr, stride_o, order_ptr, start_ptr, count_ptr, tend_ptr, NE,
    a_ptr, b_ptr, s_ptr, o_ptr, tab_ptr,
    a2_ptr, b2_ptr, s2_ptr, o2_ptr, tab2_ptr,
    slut_ptr, llut_ptr, slut2_ptr, llut2_ptr,
    N, KP, ka_row, kb_row, ks_row, limit,
    ABITS: tl.constexpr, BBITS: tl.constexpr, G: tl.constexpr, MIX: tl.constexpr, NLEV: tl.constexpr,
    LV: tl.constexpr, AFF: tl.constexpr, SPLIT: tl.constexpr, DUAL: tl.constexpr, GATHER: tl.constexpr,
    SCATTER: tl.constexpr, NATIVE: tl.constexpr, OUTP: tl.constexpr, NFIRST: tl.constexpr, PRE: tl.constexpr,
    EP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BJ: tl.constexpr,
):
    if NFIRST:  # the row blocks of one slot tile run next to each other: its activations stay in L2
        pid_n = tl.program_id(0)
        t = tl.program_id(1)
    else:
        t = tl.program_id(0)
        pid_n = tl.program_id(1)
    CPB: tl.constexpr = 8 // ABITS
    ec, m, tmask, slot = tile_slots(t, tend_ptr, count_ptr, start_ptr, NE, EP, BM)
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
    jj = tl.arange(0, BJ)
    xcol = x_ptr + src[None, :] * stride_x  # (1, BM): each slot's permuted row
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    acc2 = tl.zeros((BN, BM), dtype=tl.float32)
    jend = tl.where(m > 0, KP, 0)  # a program past the last tile runs no iterations
    if PRE:  # the first byte tiles, loaded before the loop (see below)
        nwa, nhb, nsc, noff, ntb = _bytes(a_base, b_base, s_base, o_base, tab_base, rows, rmask, jj, ka_row,
                                          kb_row, ks_row, slut_ptr, ABITS, BBITS, G, MIX, NLEV, AFF)
        nwa2, nhb2, nsc2, noff2, ntb2 = nwa, nhb, nsc, noff, ntb
        if DUAL:
            nwa2, nhb2, nsc2, noff2, ntb2 = _bytes(a2_base, b2_base, s2_base, o2_base, tab2_base, rows, rmask, jj,
                                                   ka_row, kb_row, ks_row, slut2_ptr, ABITS, BBITS, G, MIX, NLEV, AFF)
    for j0 in range(0, jend, BJ):
        j = j0 + jj
        if PRE:  # this step's tiles came in the last step; the next step's are loaded now (the last reloads)
            wa, hb, sc, off, tb = nwa, nhb, nsc, noff, ntb
            wa2, hb2, sc2, off2, tb2 = nwa2, nhb2, nsc2, noff2, ntb2
            jn = tl.minimum(j0 + BJ, KP - BJ) + jj
            nwa, nhb, nsc, noff, ntb = _bytes(a_base, b_base, s_base, o_base, tab_base, rows, rmask, jn, ka_row,
                                              kb_row, ks_row, slut_ptr, ABITS, BBITS, G, MIX, NLEV, AFF)
            if DUAL:
                nwa2, nhb2, nsc2, noff2, ntb2 = _bytes(a2_base, b2_base, s2_base, o2_base, tab2_base, rows, rmask,
                                                       jn, ka_row, kb_row, ks_row, slut2_ptr, ABITS, BBITS, G, MIX,
                                                       NLEV, AFF)
        else:
            wa, hb, sc, off, tb = _bytes(a_base, b_base, s_base, o_base, tab_base, rows, rmask, j, ka_row, kb_row,
                                         ks_row, slut_ptr, ABITS, BBITS, G, MIX, NLEV, AFF)
            if DUAL:
                wa2, hb2, sc2, off2, tb2 = _bytes(a2_base, b2_base, s2_base, o2_base, tab2_base, rows, rmask, j,
                                                  ka_row, kb_row, ks_row, slut2_ptr, ABITS, BBITS, G, MIX, NLEV, AFF)
        for p in tl.static_range(CPB):
            xp = tl.load(xcol + p * KP + j[:, None], mask=tmask[None, :], other=0.0)  # (BJ, BM)
            if not NATIVE:
                xp = xp.to(tl.float32)
            acc = _planes_dot(xp, wa, hb, sc, off, tb, llut_ptr, acc, p, jj, ABITS, BBITS, LV, NLEV, AFF, SPLIT,
                              NATIVE)
            if DUAL:
                acc2 = _planes_dot(xp, wa2, hb2, sc2, off2, tb2, llut2_ptr, acc2, p, jj, ABITS, BBITS, LV, NLEV,
                                   AFF, SPLIT, NATIVE)
    res = acc
    if DUAL:  # fast mode's SwiGLU (moe_triton's)
        gc = tl.minimum(acc, limit)
        uc = tl.minimum(tl.maximum(acc2, -limit), limit)
        res = gc / (1.0 + tl.exp(-gc)) * uc
    col = rows
    if OUTP > 1:  # written permuted for a next stage with OUTP codes a byte
        col = (rows % OUTP) * (N // OUTP) + rows // OUTP
    optr = out_ptr + dst[None, :] * stride_o + col[:, None]
    tl.store(optr, res.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & tmask[None, :])


def codes_per_byte(fmt) -> int:
    """CPB: the codes one plane-a byte holds, the permutation's stride."""
    return 8 // fmt.abits


def permute_columns(x, cpb: int):
    """bf16 (n, K) with column ``p * K / cpb + j`` = x's column ``j * cpb + p``, x rounded to bf16
    (ties to even, as ``prefill_triton`` rounds its input)."""
    import torch

    n, K = x.shape
    xb = x.to(torch.bfloat16)
    if cpb == 1:
        return xb.contiguous()
    return xb.view(n, K // cpb, cpb).transpose(1, 2).reshape(n, K).contiguous()


def grouped(fmt, x, plan: SlotPlan, w, *, w2=None, limit: float = 0.0, scatter: bool = False,
            split: bool = False, out=None, out_dtype=None, out_cpb: int = 1, bn: int = 128, bj: int = 16,
            num_warps: int = 4, num_stages: int = 3, nfirst: bool = True, pre: bool = False):
    """out[slot] = W_e @ x[slot] (or SwiGLU(W_e x, W2_e x) with ``w2``), ``prefill_triton.grouped``'s
    contract on permuted activations: x (n, K) from ``permute_columns(., codes_per_byte(fmt))``
    (gate + up: slot order, gathered through the plan; down: the sorted rows a gate + up launch
    wrote with ``out_cpb`` = this stage's codes a byte). ``out_cpb`` > 1 writes the output
    permuted for such a next stage. ``pre``: each step's byte tiles are loaded one step ahead
    (two steps of weight loads in flight a program, as the decode-step kernels keep)."""
    import torch

    a = w["a"]
    E, N, ka_row = a.shape
    cpb = codes_per_byte(fmt)
    K = x.shape[1]
    kp = K // cpb
    n = plan.n
    if out is None:
        out = torch.empty((n, N), dtype=out_dtype or torch.float32, device=x.device)
    if n == 0:
        return out
    if K % cpb or kp % 16 or ka_row != kp or (out_cpb > 1 and N % out_cpb):
        raise ValueError(f"permuted prefill needs {cpb} x a multiple of 16 columns matching the planes "
                         f"({ka_row} bytes a row), got {K}")
    while kp % bj:
        bj //= 2
    if bj < 16 or fmt.group % cpb:
        raise ValueError(f"permuted prefill: no byte step for {K} columns of {fmt.qtype}")
    b = w["b"] if w["b"] is not None else a
    kb_row = b.shape[2] if w["b"] is not None else 0
    ks_row = w["s"].shape[2]
    o = w2 if w2 is not None else w

    def off(p):
        return p["o"] if p.get("o") is not None else p["s"]

    nb = triton.cdiv(N, bn)
    grid = (nb, plan.tiles) if nfirst else (plan.tiles, nb)
    _prefill_permuted_kernel[grid](
        x, x.stride(0), out, out.stride(0), plan.order, plan.start, plan.count, plan.tend, plan.experts,
        a, b, w["s"], off(w), w["tab"],
        o["a"], o["b"] if o["b"] is not None else o["a"], o["s"], off(o), o["tab"],
        w["slut"], w["llut"], o["slut"], o["llut"],
        N, kp, ka_row, kb_row, ks_row, float(limit),
        ABITS=fmt.abits, BBITS=fmt.bbits, G=fmt.group, MIX=fmt.mix, NLEV=fmt.nlev, LV=fmt.lv_mode,
        AFF=fmt.affine, SPLIT=bool(split) and not fmt.affine, DUAL=w2 is not None, GATHER=not scatter,
        SCATTER=bool(scatter), NATIVE=not INTERPRETED, OUTP=int(out_cpb), NFIRST=bool(nfirst), PRE=bool(pre),
        EP=triton.next_power_of_2(max(1, E)), BM=plan.bm, BN=bn, BJ=bj, num_warps=num_warps, num_stages=num_stages,
    )
    return out
