"""Triton kernels: fused decode + grouped expert products (fast mode).

Two launches per layer on the selected experts (``layout.py`` gives the
weight planes):

* ``linear(..., dual=True)``: gate and up of every selected expert in one
  launch, SwiGLU fused (h = silu(min(g, L)) * clamp(u, -L, L));
* ``linear(...)`` for down.

The grid is (slot groups, row blocks). Slots are sorted by expert; a group
is one expert and up to ``bt`` of its slots (a token row each). ``bt == 1``
(every expert has one slot: decode) multiplies a decoded (BN, BK) tile by
the activation chunk and reduces, scale applied once per group of 16/32
weights; ``bt == 16`` decodes the tile once and uses ``tl.dot`` for all the
group's tokens (``input_precision``: tf32x3 by default, close to float32). Calls whose
experts see few slots each (batch 64: 1.5 on average) take the matrix-vector
tile with up to ``MV_TOKENS`` slots per group: one decode, a multiply-and-
reduce per slot.

rocmfp2_affine (weight = code * s - o per 32-weight group): the tl.dot tile
decodes every weight as the artifact's decode does, the product and the
subtraction rounded apart (``layout``: the product is exact, so a fused
multiply-add would give the same bits); the matrix-vector tile instead sums
per group ``s * sum(code * x) - o * sum(x)``, which differs from summing the
decoded weights' products by float32 rounding only: fast mode's sums are
float32 tree sums either way, and the tests hold it to the other qtypes'
tolerance against a float64 product of the decoded weights.

Fast mode only: sums are tree-ordered float32 (no exact-mode claim). Runs
under ``TRITON_INTERPRET=1`` on the CPU for tests.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ds4quant.runtime.kernels.layout import LV_CODE, LV_E2M1, LV_FP2, LV_FP3, LV_FP4

#: the most tokens per program the matrix-vector tile takes (more: the tl.dot tile); an
#: expert's few slots at batch 64 then share one decode of its weights without the
#: float32 tl.dot's three tf32 products per step
MV_TOKENS = 4
_MV = tl.constexpr(MV_TOKENS)


@triton.jit
def _tile(a_base, b_base, s_base, o_base, tab_base, rows, rmask, k0, ka_row, kb_row, ks_row,
          slut_ptr, llut_ptr,
          ABITS: tl.constexpr, BBITS: tl.constexpr, G: tl.constexpr, MIX: tl.constexpr,
          NLEV: tl.constexpr, LV: tl.constexpr, AFF: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Levels (BN, BK // G, G), scales (BN, BK // G) and offsets (BN, BK // G;
    AFF only, else the scales again) of one weight tile."""
    CPB: tl.constexpr = 8 // ABITS
    NG: tl.constexpr = BK // G
    ja = tl.arange(0, BK // CPB)
    pa = a_base + rows[:, None].to(tl.int64) * ka_row + (k0 // CPB + ja)[None, :]
    ba = tl.load(pa, mask=rmask[:, None], other=0).to(tl.int32)
    if CPB > 1:
        sh = tl.arange(0, CPB) * ABITS
        codes = (ba[:, :, None] >> sh[None, None, :]) & ((1 << ABITS) - 1)
        codes = tl.reshape(codes, (BN, BK))
    else:
        codes = ba
    if BBITS > 0:  # the code's high bits (3-bit: bit 2; 6-bit: bits 4-5)
        CPBB: tl.constexpr = 8 // BBITS
        jb = tl.arange(0, BK // CPBB)
        pb = b_base + rows[:, None].to(tl.int64) * kb_row + (k0 // CPBB + jb)[None, :]
        bb = tl.load(pb, mask=rmask[:, None], other=0).to(tl.int32)
        hb = (bb[:, :, None] >> (tl.arange(0, CPBB) * BBITS)[None, None, :]) & ((1 << BBITS) - 1)
        codes = codes | (tl.reshape(hb, (BN, BK)) << ABITS)
    js = tl.arange(0, NG)
    ps = s_base + rows[:, None].to(tl.int64) * ks_row + (k0 // G + js)[None, :]
    sb = tl.load(ps, mask=rmask[:, None], other=0).to(tl.int32)
    scale = tl.load(slut_ptr + sb)
    off = scale
    if AFF:  # the offset plane has the scale plane's shape and LUT (plain UE4M3)
        po = o_base + rows[:, None].to(tl.int64) * ks_row + (k0 // G + js)[None, :]
        off = tl.load(slut_ptr + tl.load(po, mask=rmask[:, None], other=0).to(tl.int32))
    c3 = tl.reshape(codes, (BN, NG, G))
    if LV == 1:  # rocmfp2: {-1, 0, 1, 2}
        lv = _i2f(c3, 1)
    elif LV == 3:  # rocmfp2_affine: the code itself
        lv = _i2f(c3, 0)
    elif LV == 2:  # rocmfp3: sign bit 2, magnitudes {0, 1, 2, 4}
        m = c3 & 3
        mag = _i2f(m + (m == 3).to(tl.int32), 0)
        lv = tl.where((c3 & 4) != 0, -mag, mag)
    elif LV == 4 or LV == 5:  # e2m1 x 2 (mxfp4), or rocmfp4 (7 -> 10): sign bit 3
        m = c3 & 7
        ex = m >> 1
        mag = tl.where(ex == 0, m & 1, (2 + (m & 1)) << tl.maximum(ex - 1, 0))
        if LV == 5:
            mag = mag - 2 * (m == 7).to(tl.int32)
        fm = _i2f(mag, 0)
        lv = tl.where((c3 & 8) != 0, -fm, fm)
    elif NLEV <= 8:  # MIX books and small fixed tables: a select tree, no gather per weight
        if MIX:
            tb = (tab_base + (sb >> 7)) * NLEV  # the book of each (row, group)
        else:
            tb = tl.zeros_like(sb)
        lv = _select(llut_ptr, tb, c3, NLEV)
    elif MIX:
        tab = tab_base + (sb >> 7)
        lv = tl.load(llut_ptr + (tab * NLEV)[:, :, None] + c3)
    else:
        lv = tl.load(llut_ptr + c3)
    return lv, scale, off


@triton.jit
def _i2f(v, OFF: tl.constexpr):
    """float32 of v - OFF for int32 v in [0, 2^23), exactly, with no conversion instruction
    (those issue at a fraction of the logic and float rate): v in the mantissa of 2^23,
    minus 2^23 + OFF in one subtraction."""
    return (v | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFF)


@triton.jit
def _select(llut_ptr, tb, c3, NLEV: tl.constexpr):
    """Levels of codes c3 (BN, NG, G) from the NLEV-entry (4 or 8) tables starting at tb
    (BN, NG): NLEV loads per (row, group) and a select on each code bit. A gather per
    weight is one memory instruction per weight; this is a few register selects."""
    b0 = (c3 & 1) != 0
    b1 = (c3 & 2) != 0
    v01 = tl.where(b0, tl.load(llut_ptr + tb + 1)[:, :, None], tl.load(llut_ptr + tb)[:, :, None])
    v23 = tl.where(b0, tl.load(llut_ptr + tb + 3)[:, :, None], tl.load(llut_ptr + tb + 2)[:, :, None])
    lv = tl.where(b1, v23, v01)
    if NLEV == 8:
        v45 = tl.where(b0, tl.load(llut_ptr + tb + 5)[:, :, None], tl.load(llut_ptr + tb + 4)[:, :, None])
        v67 = tl.where(b0, tl.load(llut_ptr + tb + 7)[:, :, None], tl.load(llut_ptr + tb + 6)[:, :, None])
        lv = tl.where((c3 & 4) != 0, tl.where(b1, v67, v45), lv)
    return lv


@triton.jit
def _weights(lv, sc, off, AFF: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """The decoded (BN, BK) tile: level * scale, minus the offset for affine."""
    w = lv * sc[:, :, None]
    if AFF:
        w = w - off[:, :, None]
    return tl.reshape(w, (BN, BK))


@triton.jit
def _gsum(lv, sc, off, x3, AFF: tl.constexpr):
    """(BN,) the tile's products with one token x3 (1, BK // G, G): per group
    scale * sum(level * x), minus offset * sum(x) for affine, summed over groups."""
    part = tl.sum(lv * x3, axis=2) * sc
    if AFF:  # sum(x) is one row's: cheap beside the tile, so gate and up each form it
        part = part - off * tl.sum(x3, axis=2)
    return tl.sum(part, axis=1)


@triton.jit
def _moe_linear_kernel(
    x_ptr, stride_x, out_ptr, stride_o, groups_ptr,
    a_ptr, b_ptr, s_ptr, o_ptr, tab_ptr,
    a2_ptr, b2_ptr, s2_ptr, o2_ptr, tab2_ptr,
    slut_ptr, llut_ptr, slut2_ptr, llut2_ptr,
    N, K, ka_row, kb_row, ks_row, limit,
    ABITS: tl.constexpr, BBITS: tl.constexpr, G: tl.constexpr, MIX: tl.constexpr,
    NLEV: tl.constexpr, LV: tl.constexpr, AFF: tl.constexpr, DUAL: tl.constexpr,
    BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
):
    gid = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(groups_ptr + gid * 3).to(tl.int64)
    s0 = tl.load(groups_ptr + gid * 3 + 1)
    cnt = tl.load(groups_ptr + gid * 3 + 2)
    rows = pid_n * BN + tl.arange(0, BN)
    rmask = rows < N
    a_base = a_ptr + e * N * ka_row
    b_base = b_ptr + e * N * kb_row
    s_base = s_ptr + e * N * ks_row
    o_base = o_ptr + e * N * ks_row
    o2_base = o2_ptr + e * N * ks_row
    a2_base = a2_ptr + e * N * ka_row
    b2_base = b2_ptr + e * N * kb_row
    s2_base = s2_ptr + e * N * ks_row
    tab_base = 0
    tab2_base = 0
    if MIX:
        tab_base = tl.load(tab_ptr + e)
        if DUAL:
            tab2_base = tl.load(tab2_ptr + e)
    NG: tl.constexpr = BK // G
    kk = tl.arange(0, BK)
    if BT <= _MV:  # matrix-vector tile: the decoded tile times each of up to BT slots
        tt = tl.arange(0, BT)
        acc = tl.zeros((BT, BN), dtype=tl.float32)
        acc2 = tl.zeros((BT, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            lv, sc, off = _tile(a_base, b_base, s_base, o_base, tab_base, rows, rmask, k0, ka_row, kb_row,
                                ks_row, slut_ptr, llut_ptr, ABITS, BBITS, G, MIX, NLEV, LV, AFF, BN, BK)
            if DUAL:
                lv2, sc2, off2 = _tile(a2_base, b2_base, s2_base, o2_base, tab2_base, rows, rmask, k0, ka_row,
                                       kb_row, ks_row, slut2_ptr, llut2_ptr, ABITS, BBITS, G, MIX, NLEV, LV,
                                       AFF, BN, BK)
            for t in tl.static_range(BT):
                xk = tl.load(x_ptr + (s0 + t).to(tl.int64) * stride_x + k0 + kk, mask=t < cnt, other=0.0)
                x3 = tl.reshape(xk, (1, NG, G))
                sel = (tt == t)[:, None]
                acc += tl.where(sel, _gsum(lv, sc, off, x3, AFF)[None, :], 0.0)
                if DUAL:
                    acc2 += tl.where(sel, _gsum(lv2, sc2, off2, x3, AFF)[None, :], 0.0)
        res = acc
        if DUAL:
            gc = tl.minimum(acc, limit)
            uc = tl.minimum(tl.maximum(acc2, -limit), limit)
            res = gc / (1.0 + tl.exp(-gc)) * uc
        trow = (s0 + tt).to(tl.int64)
        tl.store(out_ptr + trow[:, None] * stride_o + rows[None, :], res,
                 mask=(tt < cnt)[:, None] & rmask[None, :])
    else:
        tt = tl.arange(0, BT)
        tmask = tt < cnt
        trow = (s0 + tt).to(tl.int64)
        acc = tl.zeros((BT, BN), dtype=tl.float32)
        acc2 = tl.zeros((BT, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            xt = tl.load(x_ptr + trow[:, None] * stride_x + (k0 + kk)[None, :], mask=tmask[:, None], other=0.0)
            lv, sc, off = _tile(a_base, b_base, s_base, o_base, tab_base, rows, rmask, k0, ka_row, kb_row,
                                ks_row, slut_ptr, llut_ptr, ABITS, BBITS, G, MIX, NLEV, LV, AFF, BN, BK)
            acc += tl.dot(xt, tl.trans(_weights(lv, sc, off, AFF, BN, BK)), input_precision=PREC)
            if DUAL:
                lv2, sc2, off2 = _tile(a2_base, b2_base, s2_base, o2_base, tab2_base, rows, rmask, k0, ka_row,
                                       kb_row, ks_row, slut2_ptr, llut2_ptr, ABITS, BBITS, G, MIX, NLEV, LV,
                                       AFF, BN, BK)
                acc2 += tl.dot(xt, tl.trans(_weights(lv2, sc2, off2, AFF, BN, BK)), input_precision=PREC)
        res = acc
        if DUAL:
            gc = tl.minimum(acc, limit)
            uc = tl.minimum(tl.maximum(acc2, -limit), limit)
            res = gc / (1.0 + tl.exp(-gc)) * uc
        tl.store(out_ptr + trow[:, None] * stride_o + rows[None, :], res, mask=tmask[:, None] & rmask[None, :])


def _bk(cols: int, g: int) -> int:
    for bk in (256, 128, 64, 32):
        if cols % bk == 0 and bk >= g:
            return bk
    raise ValueError(f"kernel needs a column count that is a multiple of 32, got {cols}")


def linear(fmt, x, groups, w, out, *, w2=None, limit: float = 0.0, bt: int = 1, bn: int = 0,
           num_warps: int = 0, bk: int = 0, prec: str = "tf32x3"):
    # ``prec`` matters to the tl.dot tile only: the matrix-vector tile takes one specialisation
    # for every backend (``layout.DOT_PREC``: tf32x3 does not compile for AMD)
    """out[slot] = W_e @ x[slot] (or SwiGLU(W_e x, W2_e x) with ``w2``) for every group.

    fmt: layout.Format; x float32 (n_slots, K) sorted by expert; groups int32
    (n_groups, 3) = (local expert, first slot, slots <= bt); w / w2: the
    planes dict of a stack (a, b, s, o, slut, llut, tab; b and o may be None or
    absent); out float32 (n_slots, N).
    """
    a = w["a"]
    _, N, ka_row = a.shape
    K = x.shape[1]
    b = w["b"] if w["b"] is not None else a
    kb_row = b.shape[2] if w["b"] is not None else 0
    ks_row = w["s"].shape[2]
    dual = w2 is not None
    o = w2 if dual else w
    # defaults measured on an H200 (benchmarks/results/runtime_gpu_dot_tiles_h200.json): the
    # matrix-vector tile likes 32 rows x 256 columns (112 us a DS4 layer at batch 1, 16 rows: 131);
    # the tl.dot tile must stay narrow in K (64 rows x 32 columns: 7.1 ms at batch 64; 256 columns
    # spill: 106 ms)
    mv = bt <= MV_TOKENS
    if not bk or K % bk or bk < fmt.group:
        bk = _bk(K, fmt.group) if mv else max(32, fmt.group)
    if not bn:
        bn = 32 if mv else 64
    if not num_warps:
        num_warps = 4
    def off(p):  # the offset plane, or any plane as a pointer the kernel never reads
        return p["o"] if p.get("o") is not None else p["s"]

    grid = (groups.shape[0], triton.cdiv(N, bn))
    _moe_linear_kernel[grid](
        x, x.stride(0), out, out.stride(0), groups,
        a, b, w["s"], off(w), w["tab"],
        o["a"], o["b"] if o["b"] is not None else o["a"], o["s"], off(o), o["tab"],
        w["slut"], w["llut"], o["slut"], o["llut"],
        N, K, ka_row, kb_row, ks_row, float(limit),
        ABITS=fmt.abits, BBITS=fmt.bbits, G=fmt.group, MIX=fmt.mix, NLEV=fmt.nlev,
        LV=fmt.lv_mode, AFF=fmt.affine, DUAL=dual, BT=bt, BN=bn, BK=bk, PREC="ieee" if mv else prec,
        num_warps=num_warps,
    )
    return out


assert (LV_FP2, LV_FP3, LV_CODE, LV_E2M1, LV_FP4) == (1, 2, 3, 4, 5)  # the kernel's constexpr branches
