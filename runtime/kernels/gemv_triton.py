"""Triton matrix-vector kernels over the word layout (fast mode): the decode
step (one program row block of one slot, every selected expert of a layer in
one launch) and the grouped form for small batches (one program row block of
one expert and up to ``TB`` of its tokens: the tile is decoded once and
applied to each token, a grouped matrix-vector product, not a GEMM).

Weights whose levels are small integers are read as 32-bit words of codes
(``layout.linear_planes``): rocmfp2's 2-bit codes (level = code - 1, a word
is one 16-weight scale group, no copy: a view of plane a) and rocmfp3
repacked to 4-bit codes (level = code - 4, a group is two words).

Decode, exact, with no shift for most codes: a code at bit offset p of word
w (p + bits <= 23) is masked in place and given the exponent 150 - p, so

    float_bits((w & (M << p)) | ((150 - p) << 23)) == 2^(23-p) + code

exactly (the code sits in the mantissa's low bits of a float whose unit in
the last place is 1); subtracting the constant 2^(23-p) + off gives the level
(code - off) exactly, so a weight costs one logic op (mask + exponent in one
LOP3), one subtract and one FMA. Codes above bit 22 are read from ``w >> 16``
(one shift a word). The scale is applied once per 16-weight group:

    sum_i level_i * scale * x_i = scale * sum_i level_i x_i      (fp32 sums)

Activations arrive "group-transposed" (``xt[slot, c, j] = x[slot, 16 j + c]``),
so the c-th code of every word in a tile meets a contiguous activation
vector; the gate+up kernel writes its SwiGLU output in that layout for down.
Decode step: slots are independent (no sort, no host planning): slot s reads
the weights of local expert ``loc[ids[s]]``, so a CUDA graph of the two
launches replays any routing. Grouped: ``groups`` rows (local expert, first
sorted slot, count <= TB) from ``groups_for``; a token's arithmetic is the
decode step's (same order), so its output bits do not depend on the batch.

The next weight tile is loaded before the current one is used (a
loop-carried prefetch, ``PRE``), so a program keeps two tiles of loads in
flight. Scale bytes are turned into their float32 values by arithmetic where
that reproduces the format's table bit for bit (``SDEC``, checked against
the LUT at launch), else by a LUT gather. Row counts must be multiples of the
row block (no masks). Tiles measured on an H200:
docs/performance.md#runtime-gpu-step.
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

MAGIC = 0x4B000000  # float bits of 2^23 (exponent field 150)


@triton.jit
def _lv(src, q: tl.constexpr, magic, CBITS: tl.constexpr, OFF: tl.constexpr):
    """level (code - OFF) of the code at bit q of every word of src, float32, exact (q + CBITS <= 23).

    ``magic`` is the kernel argument 0x4B000000 (float bits of 2^23): an exponent derived from
    a run-time value stays in a register, so ptxas fuses the mask and the OR into one LOP3 (one
    immediate a LOP3; with both constants immediate it emitted two, seen in the SASS)."""
    m: tl.constexpr = ((1 << CBITS) - 1) << q
    k: tl.constexpr = (1 << (23 - q)) + OFF
    return ((src & m) | (magic - (q << 23))).to(tl.float32, bitcast=True) - k


@triton.jit
def _load_tile(a_ptr, a2_ptr, s_ptr, g_ptr, g2_ptr, gs_ptr, off, CBITS: tl.constexpr, DUAL: tl.constexpr):
    wa = tl.load(a_ptr + off)
    wb = wa
    if CBITS == 4:
        wb = tl.load(a2_ptr + off)
    sb = tl.load(s_ptr + off)
    ga = wa
    gb = wa
    sg = sb
    if DUAL:
        ga = tl.load(g_ptr + off)
        gb = ga
        if CBITS == 4:
            gb = tl.load(g2_ptr + off)
        sg = tl.load(gs_ptr + off)
    return wa, wb, sb, ga, gb, sg


@triton.jit
def _code(wa, wah, wb, wbh, c: tl.constexpr, magic, CBITS: tl.constexpr, OFF: tl.constexpr):
    """level of the c-th code of every group (wah, wbh: the words >> 16, for codes above bit 22)."""
    if CBITS == 2:
        if 2 * c + 2 <= 23:
            v = _lv(wa, 2 * c, magic, 2, OFF)
        else:
            v = _lv(wah, 2 * c - 16, magic, 2, OFF)
    elif c < 8:
        if 4 * c + 4 <= 23:
            v = _lv(wa, 4 * c, magic, 4, OFF)
        else:
            v = _lv(wah, 4 * c - 16, magic, 4, OFF)
    else:
        if 4 * (c - 8) + 4 <= 23:
            v = _lv(wb, 4 * (c - 8), magic, 4, OFF)
        else:
            v = _lv(wbh, 4 * (c - 8) - 16, magic, 4, OFF)
    return v


@triton.jit
def _gemv_kernel(xt_ptr, stride_x, ids_ptr, loc_ptr, groups_ptr, out_ptr, stride_o,
                 a_ptr, a2_ptr, s_ptr, slut_ptr,
                 g_ptr, g2_ptr, gs_ptr, gslut_ptr,
                 N, limit, magic, KW: tl.constexpr, OKW: tl.constexpr,
                 CBITS: tl.constexpr, OFF: tl.constexpr, DUAL: tl.constexpr, OUT_T: tl.constexpr,
                 GROUPED: tl.constexpr, TB: tl.constexpr, PRE: tl.constexpr, SDEC: tl.constexpr,
                 BN: tl.constexpr, BW: tl.constexpr):
    gid = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GROUPED:  # (local expert, first sorted slot, count)
        e = tl.load(groups_ptr + gid * 3).to(tl.int64)
        s0 = tl.load(groups_ptr + gid * 3 + 1)
        cnt = tl.load(groups_ptr + gid * 3 + 2)
    else:  # global -> local expert on the device
        e = tl.load(loc_ptr + tl.load(ids_ptr + gid)).to(tl.int64)
        s0 = gid
        cnt = 1
    rows = pid_n * BN + tl.arange(0, BN)
    jj = tl.arange(0, BW)
    off0 = e * N * KW + rows[:, None].to(tl.int64) * KW + jj[None, :]
    # token t of the group; tokens past the count repeat the last one (stored never)
    x0 = xt_ptr + s0.to(tl.int64) * stride_x
    x1 = xt_ptr + (s0 + tl.minimum(1, cnt - 1)).to(tl.int64) * stride_x
    x2 = xt_ptr + (s0 + tl.minimum(2, cnt - 1)).to(tl.int64) * stride_x
    x3 = xt_ptr + (s0 + tl.minimum(3, cnt - 1)).to(tl.int64) * stride_x
    acc0 = tl.zeros((BN, BW), dtype=tl.float32)
    acc1 = tl.zeros((BN, BW), dtype=tl.float32)
    acc2 = tl.zeros((BN, BW), dtype=tl.float32)
    acc3 = tl.zeros((BN, BW), dtype=tl.float32)
    ag0 = tl.zeros((BN, BW), dtype=tl.float32)
    ag1 = tl.zeros((BN, BW), dtype=tl.float32)
    ag2 = tl.zeros((BN, BW), dtype=tl.float32)
    ag3 = tl.zeros((BN, BW), dtype=tl.float32)
    nw = tl.zeros((BN, BW), dtype=tl.int32)
    nwb = nw
    nsb = tl.zeros((BN, BW), dtype=tl.uint8)
    nga = nw
    ngb = nw
    nsg = nsb
    if PRE:
        nw, nwb, nsb, nga, ngb, nsg = _load_tile(a_ptr, a2_ptr, s_ptr, g_ptr, g2_ptr, gs_ptr, off0, CBITS, DUAL)
    for j0 in range(0, KW, BW):
        if PRE:  # this tile was loaded last step; load the next one now (the last step reloads itself)
            wa, wb, sb, ga, gb, sg = nw, nwb, nsb, nga, ngb, nsg
            nxt = off0 + tl.minimum(j0 + BW, KW - BW)
            nw, nwb, nsb, nga, ngb, nsg = _load_tile(a_ptr, a2_ptr, s_ptr, g_ptr, g2_ptr, gs_ptr, nxt, CBITS, DUAL)
        else:
            wa, wb, sb, ga, gb, sg = _load_tile(a_ptr, a2_ptr, s_ptr, g_ptr, g2_ptr, gs_ptr, off0 + j0, CBITS, DUAL)
        wah = wa >> 16
        wbh = wb >> 16
        gah = ga >> 16
        gbh = gb >> 16
        p0 = tl.zeros((BN, BW), dtype=tl.float32)
        p1 = tl.zeros((BN, BW), dtype=tl.float32)
        p2 = tl.zeros((BN, BW), dtype=tl.float32)
        p3 = tl.zeros((BN, BW), dtype=tl.float32)
        q0 = tl.zeros((BN, BW), dtype=tl.float32)
        q1 = tl.zeros((BN, BW), dtype=tl.float32)
        q2 = tl.zeros((BN, BW), dtype=tl.float32)
        q3 = tl.zeros((BN, BW), dtype=tl.float32)
        xj = j0 + jj
        for c in tl.static_range(16):
            xo = xj + c * KW  # KW constexpr: the c-th row of x is an immediate offset of the load
            v = _code(wa, wah, wb, wbh, c, magic, CBITS, OFF)
            xc0 = tl.load(x0 + xo)[None, :]
            p0 += v * xc0
            if DUAL:
                u = _code(ga, gah, gb, gbh, c, magic, CBITS, OFF)
                q0 += u * xc0
            if TB >= 2:
                xc1 = tl.load(x1 + xo)[None, :]
                p1 += v * xc1
                if DUAL:
                    q1 += u * xc1
            if TB >= 4:
                xc2 = tl.load(x2 + xo)[None, :]
                xc3 = tl.load(x3 + xo)[None, :]
                p2 += v * xc2
                p3 += v * xc3
                if DUAL:
                    q2 += u * xc2
                    q3 += u * xc3
        sc = _scale(slut_ptr, sb, SDEC)
        acc0 += sc * p0
        if TB >= 2:
            acc1 += sc * p1
        if TB >= 4:
            acc2 += sc * p2
            acc3 += sc * p3
        if DUAL:
            sc2 = _scale(gslut_ptr, sg, SDEC)
            ag0 += sc2 * q0
            if TB >= 2:
                ag1 += sc2 * q1
            if TB >= 4:
                ag2 += sc2 * q2
                ag3 += sc2 * q3
    if OUT_T:  # group-transposed for the next stage: [c, j] = feature 16 j + c
        dst = (rows % 16) * OKW + rows // 16
    else:
        dst = rows
    _store(out_ptr, stride_o, dst, s0, 0, cnt, acc0, ag0, limit, DUAL)
    if TB >= 2:
        _store(out_ptr, stride_o, dst, s0, 1, cnt, acc1, ag1, limit, DUAL)
    if TB >= 4:
        _store(out_ptr, stride_o, dst, s0, 2, cnt, acc2, ag2, limit, DUAL)
        _store(out_ptr, stride_o, dst, s0, 3, cnt, acc3, ag3, limit, DUAL)


@triton.jit
def _scale(slut_ptr, sb, SDEC: tl.constexpr):
    """float32 value of every scale byte: the LUT (SDEC 0, a gather), or the same values
    computed (SDEC 1: signed E4M3 with exponent bias 8, 0x7F / 0xFF -> 0, rocmfp2's table;
    SDEC 2: unsigned, bytes >= 127 -> 0, rocmfp3's). The gather gets a layout of its own
    in Triton, converted through shared memory every step (BAR.SYNC in the loop); the
    arithmetic keeps the tile's layout. ``scale_decode`` checks the tables at launch."""
    if SDEC == 0:
        sc = tl.load(slut_ptr + sb.to(tl.int32))
    else:
        b = sb.to(tl.int32) & 0xFF
        f = (((b & 0x7F) << 20) + (119 << 23)).to(tl.float32, bitcast=True)  # 2^(e-8) (1 + m/8)
        f = tl.where((b & 0x78) == 0, f * 2.0 - 0.0078125, f)  # e == 0: m 2^-10, exact
        if SDEC == 1:
            f = tl.where((b & 0x7F) == 0x7F, 0.0, f)
            f = tl.where(b >= 128, -f, f)
        else:
            f = tl.where(b >= 127, 0.0, f)
        sc = f
    return sc


def scale_values(sdec: int) -> np.ndarray:
    """float32 (256,): the values ``_scale`` computes for SDEC 1 / 2 (numpy, same arithmetic)."""
    b = np.arange(256, dtype=np.int64)
    f = (((b & 0x7F) << 20) + (119 << 23)).astype(np.uint32).view(np.float32)
    f = np.where((b & 0x78) == 0, f * np.float32(2.0) - np.float32(0.0078125), f).astype(np.float32)
    if sdec == 1:
        f = np.where((b & 0x7F) == 0x7F, np.float32(0.0), f)
        f = np.where(b >= 128, -f, f)
    else:
        f = np.where(b >= 127, np.float32(0.0), f)
    return f.astype(np.float32)


def scale_decode(slut) -> int:
    """The SDEC whose arithmetic gives exactly the LUT's bits (float32 (256,) numpy), else 0."""
    want = np.ascontiguousarray(slut, dtype=np.float32).view(np.uint32)
    for sdec in (1, 2):
        if np.array_equal(scale_values(sdec).view(np.uint32), want):
            return sdec
    return 0


@triton.jit
def _store(out_ptr, stride_o, dst, s0, t: tl.constexpr, cnt, acc, ag, limit, DUAL: tl.constexpr):
    res = tl.sum(acc, axis=1)
    if DUAL:  # acc: gate, ag: up
        gc = tl.minimum(res, limit)
        uc = tl.minimum(tl.maximum(tl.sum(ag, axis=1), -limit), limit)
        res = gc / (1.0 + tl.exp(-gc)) * uc
    ok = (dst * 0 + t) < cnt
    tl.store(out_ptr + (s0 + t).to(tl.int64) * stride_o + dst, res, mask=ok)


def _bw(kw: int, want: int) -> int:
    bw = max(1, min(want, kw))
    while kw % bw:
        bw //= 2
    return bw


def _bn(n: int, want: int) -> int:
    bn = max(1, min(want, n))
    while n % bn:
        bn //= 2
    return bn


def groups_for(ids: np.ndarray, loc: np.ndarray, tb: int):
    """Host plan of a grouped launch: (order int64 (n,), groups int32 (g, 3)).

    order sorts the slots by expert (stable); a group is (local expert, first
    sorted slot, count <= tb): an expert with more tokens gets more groups."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    order = np.argsort(ids, kind="stable")
    sids = ids[order]
    n = sids.shape[0]
    if n == 0:
        return order, np.zeros((0, 3), np.int32)
    starts = np.flatnonzero(np.r_[True, sids[1:] != sids[:-1]])
    counts = np.diff(np.r_[starts, n])
    per = -(-counts // tb)  # groups of each expert
    first = np.repeat(starts, per) + tb * (np.arange(per.sum()) - np.repeat(np.cumsum(per) - per, per))
    cnt = np.minimum(tb, np.repeat(starts + counts, per) - first)
    return order, np.stack([np.asarray(loc)[sids[first]], first, cnt], axis=1).astype(np.int32)


_SDEC: dict = {}  # id of a scale LUT tensor -> (the tensor, its SDEC)


def _sdec_of(slut) -> int:
    got = _SDEC.get(id(slut))
    if got is None or got[0] is not slut:
        got = (slut, scale_decode(slut.detach().cpu().numpy()))
        _SDEC[id(slut)] = got
    return got[1]


def gemv(lp, xt, ids, loc, out, *, lp2=None, limit: float = 0.0, out_t: bool = False, groups=None,
         tb: int = 1, bn: int = 16, bw: int = 32, num_warps: int = 2, num_stages: int = 1, pre: bool = True,
         sdec: bool = True):
    """out[s] = W_e @ x[s] for every slot s (or SwiGLU(gate, up) with ``lp2``).

    Decode step (``groups`` None): e = loc[ids[s]], one program row block per
    slot. Grouped: ``groups`` int32 (g, 3) device tensor from ``groups_for``
    over slots already sorted by expert (ids / loc unused), ``tb`` in 1, 2, 4.

    lp / lp2: ``layout.LinearPlanes`` (a, a2, s, slut, cbits, off); xt float32
    (n, 16, K/16) group-transposed; ids int64 (n,) global experts, loc int64
    (global -> local index); out float32 (n, N) or, with out_t, (n, 16, N/16)."""
    n = xt.shape[0]
    E, N, KW = lp.a.shape
    o = lp2 if lp2 is not None else lp
    if (o.cbits, o.off, o.a.shape) != (lp.cbits, lp.off, lp.a.shape):
        raise ValueError("gate and up of one launch need the same linear layout")
    if tb not in (1, 2, 4) or (groups is None and tb != 1):
        raise ValueError(f"tokens per program must be 1, 2 or 4 (and 1 for the decode step), got {tb}")
    bw = _bw(KW, bw)
    bn = _bn(N, bn)
    sd = _sdec_of(lp.slut) if sdec else 0
    if sd and lp2 is not None and _sdec_of(lp2.slut) != sd:
        sd = 0
    grouped = groups is not None
    grid = (groups.shape[0] if grouped else n, N // bn)
    if grid[0] == 0:
        return out
    _gemv_kernel[grid](
        xt, xt.stride(0), ids, loc, groups if grouped else ids, out, out.stride(0),
        lp.a, lp.a2 if lp.a2 is not None else lp.a, lp.s, lp.slut,
        o.a, o.a2 if o.a2 is not None else o.a, o.s, o.slut,
        N, float(limit), MAGIC, KW=KW, OKW=N // 16,
        CBITS=lp.cbits, OFF=int(lp.off), DUAL=lp2 is not None, OUT_T=out_t, GROUPED=grouped, TB=tb,
        PRE=bool(pre), SDEC=sd, BN=bn, BW=bw, num_warps=num_warps, num_stages=num_stages,
    )
    return out
