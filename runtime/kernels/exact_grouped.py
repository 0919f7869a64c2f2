"""Exact mode's product ``D(W, a)`` (``docs/exact-mode.md#product``) for calls
whose experts see many slots each (prefill): the plane layout's grouped form.

``exact_planes`` runs one program per (slot, row block), so every slot reads its
expert's weights again; at 512 or 2,048 tokens a layer's experts see 12-48
slots each and that re-reading is the cost. Here a program owns up to ``BM``
slots of one expert (the device slot sort of ``prefill_triton.sort_slots``:
no host planning, no read-back) and a block of rows, decodes each scale
group's (BN, G) weight tile once and forms every slot's integer group sum
``P = sum(level_int * q)`` with one ``tl.dot`` of the (BM, G) quantized
inputs by the tile's integer levels.

Why that dot is exact: a group's levels are the integer tables of
``exact_planes.integer_levels`` cut into ``S`` bit slices of ``m`` bits
(``level_parts``: ``level = sum_j part_j * 2^(j m)``, m = 13 for 16-weight
groups, 12 for 32), each part an integer below 2^m with at most 8
significant bits, so a bf16 number. The inputs are integers with
``|q| <= 127``, so every product is an integer exact in bf16 x bf16 ->
float32 and every partial sum of a group's part is an integer below
``G * (2^m - 1) * 127 < 2^24``: a float32 accumulator holds every partial sum
in any order, on the tensor cores (bf16 operands) or, under Triton's
interpreter, in float32 ``ieee`` dots. The fixed formats' tables need one
part; MIX books whose levels span many octaves (``WIDE`` for
``exact_planes``) two or three, each one more dot and one more term.
Each part's term ``P_j * S * 2^(s + shift + j m)`` is then folded into a float64
accumulator with the bit-range tracking of ``exact_triton`` (``_fold``): a
(slot, row) whose terms span more than 53 bits counts in ``bad`` and, with
``flags``, is marked for the owner's limb patch, as in ``exact_planes``. The
bytes are therefore the definition's whatever the slot order or tile.
rocmfp2_affine adds its offset term ``-O * 2^s * sum(q)`` per group.

The float64 proof costs integer work per (slot, row, group) when it tracks
each pair's bit range (``exact_triton._fold``). A launch without ``flags``
uses a looser bound that separates: every term's magnitude is below
``2^(T + top(S) + shift + s)`` (``T``: the bits of the largest possible
group sum of the term's level table, ``parts_top``) and a multiple of ``2^(low(S) + shift + s)``, so the
range of a (slot, row) is bounded by the row's extreme scale bits plus the
slot's extreme block exponents, tracked per row and per slot only. A pair
within 53 bits under the bound is exact; one outside counts in ``bad`` and
the owner reruns the call with ``flags`` (the exact per-pair range, then the
limb patch), so the looser bound costs time on adversarial inputs, never
bytes.

Inputs and outputs stay in slot order: a program reads its slots' rows
through ``plan.order`` and writes its results back to the same slot rows, so
the owner's SwiGLU step and patching are ``exact_planes``'s.
"""

from __future__ import annotations

import math

import numpy as np
import triton
import triton.language as tl

from ds4quant.runtime.kernels.exact_planes import P_BOUND
from ds4quant.runtime.kernels.exact_triton import _bit_range, _fold, _pow2
from ds4quant.runtime.kernels.gemv_triton import _bn
from ds4quant.runtime.kernels.moe_triton import _tile
from ds4quant.runtime.kernels.prefill_triton import tile_slots

BIG = tl.constexpr(1 << 20)  # bit-range sentinel (exact_triton's)


@triton.jit
def _grouped_exact_kernel(q_ptr, stride_q, sx_ptr, KB, out_ptr, stride_o, bad_ptr, fl_ptr,
                          order_ptr, start_ptr, count_ptr, tend_ptr, NE,
                          a_ptr, b_ptr, s_ptr, o_ptr, tab_ptr, slut_ptr, ilut_ptr, ish_ptr,
                          N, K, ka_row, kb_row, ks_row, PART, gtop_ptr,
                          ABITS: tl.constexpr, BBITS: tl.constexpr, G: tl.constexpr, MIX: tl.constexpr,
                          NLEV: tl.constexpr, LV: tl.constexpr, AFF: tl.constexpr, LOG2G: tl.constexpr,
                          FLAGS: tl.constexpr, NATIVE: tl.constexpr, EP: tl.constexpr, BM: tl.constexpr,
                          BN: tl.constexpr, SPLITS: tl.constexpr, PBITS: tl.constexpr):
    pid_n = tl.program_id(1)
    ec, m, tmask, pos = tile_slots(tl.program_id(0), tend_ptr, count_ptr, start_ptr, NE, EP, BM)
    slot = tl.load(order_ptr + pos, mask=tmask, other=0).to(tl.int64)  # inputs and outputs in slot order
    e64 = ec.to(tl.int64)
    rows = pid_n * BN + tl.arange(0, BN)
    rmask = rows < N
    a_base = a_ptr + e64 * N * ka_row
    b_base = b_ptr + e64 * N * kb_row
    s_base = s_ptr + e64 * N * ks_row
    o_base = o_ptr + e64 * N * ks_row
    tab_base = 0
    if MIX:
        tab_base = tl.load(tab_ptr + ec)
    gg = tl.arange(0, G)
    shift0 = tl.load(ish_ptr)  # the fixed formats' one table
    top0 = tl.load(gtop_ptr)
    acc = tl.zeros((BM, BN), dtype=tl.float64)
    if FLAGS:  # the bit range of every (slot, row): exact per pair
        hi = tl.full((BM, BN), -(1 << 20), tl.int32)
        lo = tl.full((BM, BN), 1 << 20, tl.int32)
    else:  # a bound that separates into a row part and a slot part (module docstring)
        rtop = tl.full((BN,), -(1 << 20), tl.int32)
        rlow = tl.full((BN,), 1 << 20, tl.int32)
        ttop = tl.full((BM,), -(1 << 20), tl.int32)
        tlow = tl.full((BM,), 1 << 20, tl.int32)
    kend = tl.where(m > 0, K, 0)  # a program past the last tile runs no iterations
    for k0 in range(0, kend, G):
        q = tl.load(q_ptr + slot[:, None] * stride_q + (k0 + gg)[None, :], mask=tmask[:, None], other=0.0)
        qd = q
        if NATIVE:
            qd = q.to(tl.bfloat16)
        sblk = tl.load(sx_ptr + slot * KB + k0 // 32, mask=tmask, other=0)
        sb = tl.load(s_base + rows.to(tl.int64) * ks_row + k0 // G, mask=rmask, other=0).to(tl.int32)
        sc = tl.load(slut_ptr + sb)
        if MIX:
            tab = tab_base + (sb >> 7)
            rsh = tl.load(ish_ptr + tab)
            ex = sblk[:, None] + rsh[None, :]
        else:
            rsh = shift0
            ex = (sblk + shift0)[:, None]
        top_s, low_s = _bit_range(sc)
        if not FLAGS:
            ttop = tl.maximum(ttop, tl.where(tmask, sblk, -BIG))
            tlow = tl.minimum(tlow, tl.where(tmask, sblk, BIG))
            if MIX:
                rtop = tl.maximum(rtop, tl.where(sc != 0, top_s + rsh + tl.load(gtop_ptr + tab), -BIG))
            else:
                rtop = tl.maximum(rtop, tl.where(sc != 0, top_s + rsh + top0, -BIG))
            rlow = tl.minimum(rlow, tl.where(sc != 0, low_s + rsh, BIG))
        for j in tl.static_range(SPLITS):  # one dot and one term per bit slice of the levels
            lv, _, off = _tile(a_base, b_base, s_base, o_base, tab_base, rows, rmask, k0, ka_row, kb_row, ks_row,
                               slut_ptr, ilut_ptr + j * PART, ABITS, BBITS, G, MIX, NLEV, LV, AFF, BN, G)
            w = tl.reshape(lv, (BN, G))
            if NATIVE:  # integers: exact as bf16, their products and sums exact in the float32 accumulator
                p = tl.dot(qd, tl.trans(w.to(tl.bfloat16)))
            else:
                p = tl.dot(qd, tl.trans(w), input_precision="ieee")
            exj = ex + j * PBITS
            if FLAGS:
                acc, hi, lo = _fold(acc, hi, lo, p, sc[None, :], top_s[None, :], low_s[None, :], _pow2(exj), exj)
            else:
                acc += p.to(tl.float64) * (sc.to(tl.float64)[None, :] * _pow2(exj))
        if AFF:  # minus O * 2^s * sum(q): the offset's own exact term (one slice: a fixed format)
            p2 = tl.zeros((BM, BN), dtype=tl.float32) - tl.sum(q, axis=1)[:, None]
            offr = tl.reshape(off, (BN,))
            top_o, low_o = _bit_range(offr)
            if FLAGS:
                acc, hi, lo = _fold(acc, hi, lo, p2, offr[None, :], top_o[None, :], low_o[None, :], _pow2(ex), ex)
            else:
                acc += p2.to(tl.float64) * (offr.to(tl.float64)[None, :] * _pow2(ex))
                rtop = tl.maximum(rtop, tl.where(offr != 0, top_o + shift0 + top0, -BIG))
                rlow = tl.minimum(rlow, tl.where(offr != 0, low_o + shift0, BIG))
    if FLAGS:
        fits = (hi == -BIG) | (hi + LOG2G - lo <= 53)
    else:
        top = rtop[None, :] + ttop[:, None]
        fits = (rtop == -BIG)[None, :] | (top + LOG2G - (rlow[None, :] + tlow[:, None]) <= 53)
    live = tmask[:, None] & rmask[None, :]
    nbad = tl.sum(tl.sum(tl.where(fits | (live == 0), 0, 1), axis=1), axis=0)
    optr = slot[:, None] * stride_o + rows[None, :]
    # + 0.0: an exact zero is +0.0, as the definition's float64 route has it
    tl.store(out_ptr + optr, (acc + 0.0).to(tl.float32), mask=live)
    tl.atomic_add(bad_ptr, nbad, mask=nbad > 0)
    if FLAGS:  # which pairs: the caller patches them through the definition's limbs
        tl.store(fl_ptr + optr, tl.where(fits, 0, 1).to(tl.int8), mask=live)


MAX_SPLITS = 3  # 3 x 13 bits cover every table integer_levels accepts (below 2^49 / (16 * 127))


def part_bits(group: int) -> int:
    """m: the widest slice whose group sums stay below 2^24 (G * (2^m - 1) * 127 < 2^24)."""
    m = 1
    while group * ((1 << (m + 1)) - 1) * 127 < P_BOUND:
        m += 1
    return m


def parts_top(parts: np.ndarray, group: int, affine: bool = False) -> np.ndarray:
    """int32 (tables,): T per level table, every slice's group sum (times its 2^(j m)) below
    2^T in magnitude (affine: the offset term's sum(q) too). Per table, so that a MIX book of
    small levels (large integers, low shift) does not widen the bound of its partner."""
    m = part_bits(group)
    tables = parts.shape[1]
    top = np.full(tables, int(group * 127).bit_length() if affine else 0, dtype=np.int64)
    for j in range(parts.shape[0]):
        mx = np.abs(parts[j].astype(np.float64)).max(axis=1).astype(np.int64)
        bits = np.array([int(group * int(v) * 127).bit_length() + j * m if v else 0 for v in mx])
        top = np.maximum(top, bits)
    return top.astype(np.int32)


def level_parts(ilut: np.ndarray, group: int):
    """(parts float32 (S, tables, nlev), m): the integer level tables of ``integer_levels``
    cut into S slices of m bits with the level's sign (level = sum_j parts[j] * 2^(j m)), or
    None when a slice is not a bf16 number or more than ``MAX_SPLITS`` are needed."""
    from ds4quant.runtime.kernels.prefill_triton import bf16_exact

    v = np.asarray(ilut, dtype=np.float64)
    if not np.all(np.isfinite(v)) or not np.all(v == np.round(v)):
        return None
    m = part_bits(group)
    mag = np.abs(v).astype(np.int64)
    top = int(mag.max()).bit_length() if mag.size else 0
    n = max(1, -(-top // m))
    if n > MAX_SPLITS:
        return None
    sign = np.sign(v)
    parts = np.stack([sign * ((mag >> (m * j)) & ((1 << m) - 1)) for j in range(n)]).astype(np.float32)
    if not bf16_exact(parts):
        return None
    return parts, m


def product(fmt, w, q, s, plan, bad, *, flags: bool = False, native: bool = True, bn: int = 64,
            num_warps: int = 4, num_stages: int = 2):
    """Exact W_e @ a[slot] for every slot of ``plan`` (``prefill_triton.sort_slots``),
    a = (q (n, K) float32 integers in slot order, s int32 (n, K / 32)): float32 (n, N) in
    slot order (and, with ``flags``, int8 (n, N): 1 where the pair is outside the float64
    bound). w: a stack's planes dict with ``gparts`` (float32 (S, tables, nlev), contiguous)
    and ``gbits`` of ``level_parts``, ``gtop`` (int32 device tensor) of ``parts_top`` and ``ishift`` of
    ``integer_levels``. Without ``flags`` the separable bound decides ``bad``. ``native``: bf16
    operands on the tensor cores (False under Triton's interpreter: float32 ``ieee`` dots of
    the same integers)."""
    import torch

    a = w["a"]
    E, N, ka_row = a.shape
    n, K = q.shape
    if K % max(fmt.group, 32):
        raise ValueError(f"exact product needs a column count that is a multiple of {max(fmt.group, 32)}, got {K}")
    b = w["b"] if w["b"] is not None else a
    kb_row = b.shape[2] if w["b"] is not None else 0
    bn = _bn(N, bn)
    out = torch.empty((n, N), dtype=torch.float32, device=q.device)
    fl = torch.zeros((n, N), dtype=torch.int8, device=q.device) if flags else out
    parts = w["gparts"]
    splits = parts.shape[0]
    if fmt.affine and splits != 1:
        raise ValueError("an affine stack's levels are its codes: one slice")
    terms = (K // fmt.group) * (splits + (1 if fmt.affine else 0))
    if n:
        _grouped_exact_kernel[(plan.tiles, N // bn)](
            q, q.stride(0), s, s.shape[1], out, out.stride(0), bad, fl,
            plan.order, plan.start, plan.count, plan.tend, plan.experts,
            a, b, w["s"], w["o"] if w.get("o") is not None else w["s"], w["tab"], w["slut"], parts, w["ishift"],
            N, K, ka_row, kb_row, w["s"].shape[2], parts[0].numel(), w["gtop"],
            ABITS=fmt.abits, BBITS=fmt.bbits, G=fmt.group, MIX=fmt.mix, NLEV=fmt.nlev, LV=fmt.lv_mode,
            AFF=fmt.affine, LOG2G=int(math.ceil(math.log2(terms))) if terms > 1 else 0, FLAGS=bool(flags),
            NATIVE=bool(native), EP=triton.next_power_of_2(max(1, E)), BM=plan.bm, BN=bn, SPLITS=splits,
            PBITS=int(w["gbits"]),
            num_warps=num_warps, num_stages=num_stages)
    return (out, fl) if flags else out
