"""The scale search of rocmfp2 / rocmfp3 / rocmfp4 / rocmfp4_fast as one Triton kernel: the Triton tier.

``torch_scale`` runs the search as hundreds of small torch launches
per matrix (a window of bytes, float64 proofs, a full-scan fallback); on a GPU
it is bound by the launches. Here one launch does everything per group: the
weights, the error of every byte e = 1..126, the choice, the codes and (for
the measure stage) the decoded values. A program takes BLOCK groups and holds
a (BLOCK, 128) float32 tile of errors, one column per byte, so no window and
no proof is needed: a full scan is the definition itself.

Why the bytes are the definition's (``scale_codecs``; numba's
``search_nb`` walk gives the same argmin) bit for bit:

* the chosen byte is ``lexmin((err(e), e))`` over e = 1..126 with non-NaN
  err, together with the format's initial pair (``INIT_E`` / ``INIT_ERR``).
  err >= +0 (a sum of terms (w*d)*d with w >= +0, started from +0), so its
  float32 bits order like its values, +inf included; the minimum of the bits
  (an integer reduction: any order gives the same minimum), then the least
  byte holding it, then the initial pair on ties of the bits with its byte,
  is exactly the strict < walk in ascending byte order. NaN errors and the
  padding columns e = 0, 127 take a sentinel above every error's bits;
* err(e) is ``acc = 0; acc += t_i`` for i = 0..g-1: a loop over the group's
  elements with the tile as its carried value, each element loaded as its own
  (BLOCK,) vector, so the float32 additions happen in element order (a
  ``tl.sum`` would add as a tree). The loop is not unrolled (``range``, not
  ``static_range``): unrolled, the PTX of one variant is 1-2 MB and takes
  ~45 s to compile, looped ~80 KB and well under a second;
* every float32 operation is one IEEE operation: the kernel is launched with
  ``enable_fp_fusion=False`` (no multiply contracted into a multiply-add), the
  one square root is ``sqrt_rn`` (``tl.sqrt`` is approximate on NVIDIA), there
  is no division (1/S(e) comes from ``UE4M3_INV``), |v| is a bit mask and
  tests of finiteness, NaN and zero are integer tests on the bits, so nothing
  depends on how a comparison or ``abs`` treats subnormals;
* the terms are numba's: x*inv, the level (FP2: ``_fp2_level_nb``'s distance
  rule, the selects of the first least |v - V|, valid at every |v|; FP3/FP4:
  counts of thresholds exceeded by |x|*inv, which equals |x*inv| since IEEE
  rounding is symmetric under negation), level*S, d = |x| - m*S (FP3/FP4:
  numba's x - (+-m)*S up to its sign, the same square), w*d, (w*d)*d;
* the weights are (docs/formats.md#scale-search) ``q*sqrt(sigma^2 + x*x)`` (inf -> FLT_MAX, 0 where q
  is not a positive finite number or x is not finite; 1 for finite x without
  importance), with sigma^2 from the host's ``row_energy_nb`` (a sequential
  row sum that a device reduction would round differently);
* codes are ``_group_codes_nb``'s at the chosen byte (non-finite x: the zero
  code), and a decoded value is level * S(e), the one product of
  ``decode_rows_nb``.

``tests/formats/search/test_triton_scale.py`` checks the bytes against numba
under Triton's interpreter on the CPU, and on CUDA where present.
"""

from __future__ import annotations

import os

import numpy as np

import triton
import triton.language as tl

from ds4quant.formats.search.tables import FP2, FP3, FP4, INIT_E, INIT_ERR, ue4m3_on

ABS = tl.constexpr(0x7FFFFFFF)
EXP = tl.constexpr(0x7F800000)  # exponent bits: all set = inf or NaN; also +inf's bits
FLT_MAX_BITS = tl.constexpr(0x7F7FFFFF)
SENTINEL = tl.constexpr(0x7FFFFFFF)  # above every non-NaN error's bits
NE = tl.constexpr(128)  # byte columns of the error tile (0 and 127 are padding)
_FP2 = tl.constexpr(FP2)
_FP3 = tl.constexpr(FP3)
_FP4 = tl.constexpr(FP4)

#: decorated under Triton's interpreter (the CPU tests): never chosen for a GPU by default
INTERPRETED = bool(os.environ.get("TRITON_INTERPRET"))
#: groups per program on a GPU (the error tile is BLOCK x 128 float32)
BLOCK = 16
NUM_WARPS = 4
#: the compiler options every launch needs: no multiply-add contraction
LAUNCH = dict(enable_fp_fusion=False)


@triton.jit
def _fp2_level(v):
    """``_fp2_level_nb``: the first of {-1, 0, 1, 2} at the least float32 |v - V|
    (|.| as a bit mask throughout: exact whatever the target does with subnormals)."""
    bd = ((v + 1.0).to(tl.int32, bitcast=True) & ABS).to(tl.float32, bitcast=True)
    lv = tl.zeros_like(v) - 1.0
    d = (v.to(tl.int32, bitcast=True) & ABS).to(tl.float32, bitcast=True)
    take = d < bd
    lv = tl.where(take, 0.0, lv)
    bd = tl.where(take, d, bd)
    d = ((v - 1.0).to(tl.int32, bitcast=True) & ABS).to(tl.float32, bitcast=True)
    take = d < bd
    lv = tl.where(take, 1.0, lv)
    bd = tl.where(take, d, bd)
    d = ((v - 2.0).to(tl.int32, bitcast=True) & ABS).to(tl.float32, bitcast=True)
    return tl.where(d < bd, 2.0, lv)


@triton.jit
def _count(a, FMT: tl.constexpr):
    """FP3/FP4: how many of the format's thresholds a = |x*inv| exceeds (the code's magnitude
    bits), counted in float32: small integers, exact (and no integer overflow checks in the
    interpreter)."""
    k = (a > 0.5).to(tl.float32) + (a > 1.5).to(tl.float32)
    if FMT == _FP3:
        k += (a > 3.0).to(tl.float32)
    else:
        k += (a > 2.5).to(tl.float32) + (a > 3.5).to(tl.float32) + (a > 5.0).to(tl.float32)
        k += (a > 7.0).to(tl.float32) + (a > 9.0).to(tl.float32)
    return k


@triton.jit
def _magnitude(k, FMT: tl.constexpr):
    """The level magnitude of count k: FP3 {0, 1, 2, 4}, FP4 {0, 1, 2, 3, 4, 6, 8, 10} (exact)."""
    if FMT == _FP3:
        m = k + (k == 3.0).to(tl.float32)
    else:
        m = tl.maximum(k, 2.0 * k - 4.0)
    return m


@triton.jit
def _element(x_ptr, q_ptr, s2, idx, col, live, HAS_Q: tl.constexpr):
    """One element of each group: (x, or 0 where not finite; its weight)."""
    x = tl.load(x_ptr + idx, mask=live, other=0.0)
    fin = (x.to(tl.int32, bitcast=True) & EXP) != EXP
    xf = tl.where(fin, x, 0.0)
    if HAS_Q:
        q = tl.load(q_ptr + col, mask=live, other=0.0)
        w = q * tl.math.sqrt_rn(s2 + xf * xf)
        flt_max = (tl.zeros_like(col).to(tl.int32) + FLT_MAX_BITS).to(tl.float32, bitcast=True)
        w = tl.where((w.to(tl.int32, bitcast=True) & ABS) == EXP, flt_max, w)
        qok = (q > 0.0) & ((q.to(tl.int32, bitcast=True) & EXP) != EXP)
        w = tl.where(qok & fin, w, 0.0)
    else:
        w = tl.where(fin, 1.0, 0.0)
    return xf, w


@triton.jit
def _search_kernel(x_ptr, q_ptr, s2_ptr, S_ptr, INV_ptr, e_ptr, c_ptr, y_ptr, n, cols,
                   FMT: tl.constexpr, G: tl.constexpr, HAS_Q: tl.constexpr, INIT_BITS: tl.constexpr,
                   INIT_BYTE: tl.constexpr, CODES: tl.constexpr, DECODE: tl.constexpr, BLOCK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = g < n
    base = g * G
    col0 = base % cols
    if HAS_Q:
        s2 = tl.load(s2_ptr + base // cols, mask=live, other=0.0)
    else:
        s2 = tl.zeros([BLOCK], tl.float32)
    ek = tl.arange(0, NE)
    S = tl.load(S_ptr + ek)[None, :]
    INV = tl.load(INV_ptr + ek)[None, :]
    acc = tl.zeros([BLOCK, NE], tl.float32)
    nz = tl.zeros([BLOCK], tl.int1)
    for i in range(G):  # element order: the sum's order
        xf, w = _element(x_ptr, q_ptr, s2, base + i, col0 + i, live, HAS_Q)
        nz = nz | ((xf.to(tl.int32, bitcast=True) & ABS) != 0)
        wb = w[:, None]
        if FMT == _FP2:
            xb = xf[:, None]
            d = xb - _fp2_level(xb * INV) * S
        else:
            ab = (xf.to(tl.int32, bitcast=True) & ABS).to(tl.float32, bitcast=True)[:, None]
            d = ab - _magnitude(_count(ab * INV, FMT), FMT) * S
        acc = acc + (wb * d) * d
    bits = (acc + 0.0).to(tl.int32, bitcast=True)
    bad = ((bits & ABS) > EXP) | (ek[None, :] == 0) | (ek[None, :] == NE - 1)
    bits = tl.where(bad, SENTINEL, bits)
    best = tl.min(bits, axis=1)
    be = tl.min(tl.where(bits == best[:, None], ek[None, :], NE), axis=1)
    init = (best > INIT_BITS) | ((best == INIT_BITS) & (be > INIT_BYTE))
    be = tl.where(init, INIT_BYTE, be)
    be = tl.where(nz, be, 0)  # max|x| = 0: byte 0, no search
    tl.store(e_ptr + g, be, mask=live)

    inv = tl.load(INV_ptr + be)
    s = tl.load(S_ptr + be)
    for i in range(G):
        x = tl.load(x_ptr + base + i, mask=live, other=0.0)
        fin = (x.to(tl.int32, bitcast=True) & EXP) != EXP
        v = x * inv
        if FMT == _FP2:
            lv = _fp2_level(v)
            code = tl.where(fin, (lv + 1.0).to(tl.int32), 1)
            lv = tl.where(fin, lv, 0.0)
        else:
            k = _count((v.to(tl.int32, bitcast=True) & ABS).to(tl.float32, bitcast=True), FMT)
            neg = (x < 0.0) & (k > 0.0)
            if FMT == _FP3:
                sign = tl.where(neg, 4, 0)
            else:
                sign = tl.where(neg, 8, 0)
            code = tl.where(fin, k.to(tl.int32) | sign, 0)
            m = _magnitude(k, FMT)
            lv = tl.where(fin, tl.where(neg, -m, m), 0.0)
        if CODES:
            tl.store(c_ptr + base + i, code.to(tl.uint8), mask=live)
        if DECODE:
            tl.store(y_ptr + base + i, lv * s, mask=live)


def _block(n: int, dev) -> int:
    """BLOCK compiled (a GPU, or the ahead-of-time check's capture); under the interpreter (the
    CPU tests) one wide program, which numpy runs fastest."""
    if getattr(dev, "type", None) == "cuda" or not INTERPRETED:
        return BLOCK
    return max(16, min(256, triton.next_power_of_2(max(1, n))))


def search(fmt: int, group: int, x, q, sigma2, *, codes: bool = True, decode: bool = False):
    """``torch_scale.search`` (and ``decode_chosen``) in one launch: for float32
    device tensors x (rows, cols) (non-finite allowed), q (cols,) or None, sigma2 (rows,)
    (used with q): (scale bytes int64 (rows, cols // group), codes uint8 (rows, cols) or None,
    decoded float32 (rows, cols) or None)."""
    import torch

    if fmt not in (FP2, FP3, FP4) or group not in (16, 32):
        raise ValueError(f"no Triton scale search for format {fmt}, group {group}")
    x = x.contiguous()
    rows, cols = x.shape
    n = rows * cols // group
    dev = x.device
    S, INV = ue4m3_on(dev)
    e = torch.empty(n, dtype=torch.int32, device=dev)
    c = torch.empty((rows, cols), dtype=torch.uint8, device=dev) if codes else e
    y = torch.empty((rows, cols), dtype=torch.float32, device=dev) if decode else x
    has_q = q is not None
    if n:
        blk = _block(n, dev)
        init_bits = int(np.array([INIT_ERR[fmt]], np.float32).view(np.int32)[0])
        _search_kernel[(triton.cdiv(n, blk),)](
            x, q.contiguous() if has_q else x, sigma2.contiguous() if has_q else x, S, INV, e, c, y, n, cols,
            FMT=int(fmt), G=int(group), HAS_Q=has_q, INIT_BITS=init_bits, INIT_BYTE=int(INIT_E[fmt]),
            CODES=bool(codes), DECODE=bool(decode), BLOCK=blk, num_warps=NUM_WARPS, **LAUNCH)
    return (e.to(torch.int64).reshape(rows, cols // group), c if codes else None, y if decode else None)
