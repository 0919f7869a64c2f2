"""Exact mode in torch ops only: the implementation a CUDA/HIP device runs.

Written from the definition in docs/exact-mode.md,
independently of the numba CPU owner, so the two agree only if both follow
the definition. Every step is integer arithmetic or a single correctly
rounded IEEE operation, so the bits do not depend on the device, the thread
count or the other rows of a batch:

1. ``quantize_blocks``: per 32 inputs, s = frexp(max|x|).exponent - 7 (+1 when
   max/2^s > 127), q = round_half_even(x / 2^s) in [-127, 127].
2. ``exact_linear``: every product W[j,i] * q_i * 2^s_i is an integer
   (float32 mantissa of W x q, < 2^31) times a power of two. Where a (token,
   weight row) pair's bit span fits a float64 significand (|W| < 2^whi, W a
   multiple of 2^wlo over the row; the token's nonzero blocks likewise give
   ahi = max(s + 7), alo = min(s); whi + ahi + ceil(log2 cols) - wlo - alo
   <= 53), every partial sum in any order and with any fusing is exact, so
   a float64 matrix product (BLAS, cuBLAS: their order does not matter
   here) is the exact sum, and one cast rounds it to float32. The other
   pairs take the limb path: terms binned by exponent into 16-bit limbs
   (term << (E mod 16) lands in limb E // 16, < 2^46; a limb sums at most
   2^16 of them, < 2^62: integer sums in any order are exact), carries
   propagated, the limb number rounded once to float32 (round to nearest
   even, subnormals included). Both give the same bits; the split only
   decides the cost. (The float64 route is on by default on the devices of
   ``F64_DEVICES``.)
3. ``swiglu_exact``: float64, one op at a time (separate tensor ops are never
   fused into an FMA outside torch.compile), the fixed exp of the plan.
"""

from __future__ import annotations

import math

from ds4quant.errors import BadInputError, ShapeError

BLOCK = 32
LIMB = 16
# a limb sums up to MAX_COLS terms < 2^46 each and must stay below 2^62
MAX_COLS = 1 << 16
# elements of one (slots x rows x cols) product chunk: bounds temporary memory
CHUNK = 1 << 21
F64_SPAN = 53  # float64 significand bits: the span an exact float64 sum may cover
# Devices whose exact mode takes the float64 route by default. The route is exact
# in any summation order, so cuBLAS/rocBLAS give the same bits as the CPU's BLAS
# (shown on an H200, docs/performance.md#gpu-identity: tests/runtime/test_execute.py::
# test_exact_linear_on_the_device_gives_the_cpu_bits and the CUDA owner's identity
# tests); HIP devices are torch's "cuda" type too.
F64_DEVICES = ("cpu", "cuda")

LN2_HI = float.fromhex("0x1.62e42fee00000p-1")
LN2_LO = float.fromhex("0x1.a39ef35793c76p-33")
INV_LN2 = float.fromhex("0x1.71547652b82fep0")
# 1/k! correctly rounded (Python int / int true division rounds once)
TAYLOR = tuple(1.0 / math.factorial(k) for k in range(14))


def _pow2_f64(e):
    """2.0**e for an int64 tensor e in [-1022, 1023], built from the bits
    (no libm pow, so every device gives the same value)."""
    import torch

    return ((e + 1023) << 52).view(torch.float64)


def quantize_blocks(x):
    """Step 1 of exact mode. x float32 (n, cols), cols % 32 == 0.

    Returns (q int64 (n, cols), s int64 (n, cols // 32)).
    """
    import torch

    n, cols = x.shape
    if cols % BLOCK:
        raise ShapeError(f"exact mode needs inputs in blocks of {BLOCK}, got {cols} columns")
    if not bool(torch.isfinite(x).all()):
        bad = (~torch.isfinite(x)).nonzero()[0].tolist()
        raise BadInputError(f"exact mode input has a non-finite value at row {bad[0]}, column {bad[1]}")
    xb = x.reshape(n, cols // BLOCK, BLOCK).to(torch.float64)
    m = xb.abs().amax(dim=2)
    _, e = torch.frexp(m)
    s = e.to(torch.int64) - 7
    # m / 2^s is exact (a power-of-two scaling in float64); the bump keeps q in [-127, 127]
    s = s + (m * _pow2_f64(-s) > 127).to(torch.int64)
    zero = m == 0
    s = torch.where(zero, torch.zeros_like(s), s)
    q = torch.round(xb * _pow2_f64(-s)[:, :, None]).to(torch.int64)
    q = torch.where(zero[:, :, None], torch.zeros_like(q), q)
    return q.reshape(n, cols), s


def _propagate(acc):
    for i in range(acc.shape[1] - 1):
        carry = acc[:, i] >> LIMB  # arithmetic shift: floor division by 2^16
        acc[:, i] -= carry << LIMB
        acc[:, i + 1] += carry
    return acc


def limbs_to_f32(acc, base_exp: int):
    """Round the exact numbers sum_c acc[m, c] * 2^(base_exp + 16 c) once to float32.

    acc: int64 (M, nb) limb sums (any values with |acc| < 2^62; the top limbs
    must have room for the carries). Returns float32 (M,).
    """
    import torch

    acc = _propagate(acc.clone())
    neg = acc[:, -1] < 0
    acc = _propagate(torch.where(neg[:, None], -acc, acc))
    # two zero limbs below, so the three limbs under the leading one always exist
    M, nb = acc.shape
    acc = torch.cat([torch.zeros((M, 2), dtype=torch.int64, device=acc.device), acc], dim=1)
    base_exp -= 2 * LIMB
    nb += 2
    nz = acc != 0
    any_nz = nz.any(dim=1)
    h = (nb - 1) - torch.flip(nz, dims=[1]).to(torch.int8).argmax(dim=1)
    h = torch.where(any_nz, h, torch.full_like(h, 2))
    lh = acc.gather(1, h[:, None])[:, 0]
    l1 = acc.gather(1, (h - 1)[:, None])[:, 0]
    l2 = acc.gather(1, (h - 2)[:, None])[:, 0]
    H = (lh << (2 * LIMB)) | (l1 << LIMB) | l2  # < 2^48: exact in float64
    below = torch.arange(nb, device=acc.device)[None, :] < (h - 2)[:, None]
    sticky = (nz & below).any(dim=1)
    base_h = base_exp + LIMB * (h - 2)
    _, blen = torch.frexp(H.to(torch.float64))
    msb = blen.to(torch.int64) - 1 + base_h
    lsb = torch.clamp(msb - 23, min=-149)  # float32: 24 significant bits, subnormals at 2^-149
    # the leading limb is nonzero, so H has >= 33 bits below its msb: shift >= 9;
    # past 50 every bit of H is below half an ulp (rounds to 0 alike)
    shift = torch.clamp(lsb - base_h, min=1, max=50)
    q = H >> shift
    rem = H - (q << shift)
    half = torch.ones_like(shift) << (shift - 1)
    up = (rem > half) | ((rem == half) & (sticky | ((q & 1) == 1)))
    q = q + up.to(torch.int64)
    mag = q.to(torch.float64) * _pow2_f64(lsb)  # q <= 2^24: exact; cast below rounds only on overflow
    out = torch.where(neg, -mag, mag).to(torch.float32)
    return torch.where(any_nz, out, torch.zeros_like(out))


def _split_weights(w):
    """float32 W -> (integer mantissa int64 |m| <= 2^24, exponent int64): W = m * 2^e."""
    import torch

    mant, e = torch.frexp(w)
    m = (mant.to(torch.float64) * float(1 << 24)).to(torch.int64)
    return m, e.to(torch.int64) - 24


def exact_linear(w, x, spans=None, f64=None):
    """Step 2 of exact mode: y[n, j] = RNE_fp32(sum_i W[j, i] * a[n, i]) with a the
    block-quantized x. w float32 (rows, cols), x float32 (n, cols) -> float32 (n, rows);
    ``spans``: ``weight_spans(w)``, when the caller keeps it per resident tensor;
    ``f64``: take the float64 route where it is exact (default: on the devices of
    ``F64_DEVICES``), else every pair through the limbs."""
    import torch

    rows, cols = w.shape
    n = x.shape[0]
    if x.shape[1] != cols:
        raise ShapeError(f"exact product: input has {x.shape[1]} features, the weight {cols}")
    if cols > MAX_COLS:
        raise ShapeError(f"exact product supports up to {MAX_COLS} input features, got {cols}")
    if n == 0 or rows == 0:
        return torch.empty((n, rows), dtype=torch.float32, device=w.device)
    if spans is None:
        spans = weight_spans(w)  # refuses a non-finite weight
    q, s = quantize_blocks(x)
    if not (w.device.type in F64_DEVICES if f64 is None else f64):
        return _limb_linear(*_split_weights(w), q, s)
    fits = f64_pairs(w, q, s, spans)
    a = q.to(torch.float64) * _pow2_f64(s.repeat_interleave(BLOCK, dim=1))  # exact: |q| < 2^7
    # + 0.0 turns an exact zero's possible -0.0 into +0.0, as the definition wants
    out = ((a @ w.to(torch.float64).T) + 0.0).to(torch.float32)
    if not bool(fits.all()):
        wm, we = _split_weights(w)
        for t in (~fits).any(dim=1).nonzero()[:, 0].tolist():
            r = (~fits[t]).nonzero()[:, 0]
            out[t, r] = _limb_linear(wm.index_select(0, r), we.index_select(0, r),
                                     q[t:t + 1], s[t:t + 1])[0]
    return out


def weight_spans(w):
    """int64 (rows,): whi - wlo of each float32 weight row (|W| < 2^whi, every W a
    multiple of 2^wlo; 0 for an all-zero row), from the bits: no libm. A NaN/Inf
    weight is an error (exact mode's weights must be finite)."""
    import torch

    bits = w.contiguous().view(torch.int32) & 0x7FFFFFFF
    if bool((bits >= 0x7F800000).any()):
        raise BadInputError("exact mode weight has a non-finite value")
    ef = bits >> 23
    mant = bits & 0x7FFFFF
    sig = torch.where(ef > 0, mant | 0x800000, mant)  # value = sig * 2^(max(ef, 1) - 150)
    e0 = torch.clamp(ef, min=1) - 150
    # bit length of sig and its lowest set bit, read off exact int -> float32 conversions
    blen = (sig.to(torch.float32).view(torch.int32) >> 23) - 126
    ctz = ((sig & -sig).to(torch.float32).view(torch.int32) >> 23) - 127
    nz = bits != 0
    big = 1 << 20
    whi = torch.where(nz, e0 + blen, -big).amax(dim=1)
    wlo = torch.where(nz, e0 + ctz, big).amin(dim=1)
    return torch.where(nz.any(dim=1), whi - wlo, 0).to(torch.int64)


def f64_pairs(w, q, s, spans=None):
    """bool (n, rows): the (token, weight row) pairs whose exact sum a float64
    product computes exactly in any order (the bit-span bound above).
    ``spans``: ``weight_spans(w)`` when the caller keeps it."""
    import torch

    rows, cols = w.shape
    n = q.shape[0]
    wspan = weight_spans(w) if spans is None else spans
    live = (q.reshape(n, cols // BLOCK, BLOCK) != 0).any(dim=2)
    big = 1 << 20
    ahi = torch.where(live, s + 7, -big).amax(dim=1)
    alo = torch.where(live, s, big).amin(dim=1)
    aspan = torch.where(live.any(dim=1), ahi - alo, 0)
    log2c = int(math.ceil(math.log2(cols))) if cols > 1 else 0
    return (aspan[:, None] + wspan[None, :] + log2c) <= F64_SPAN


def _limb_linear(wm, we, q, s):
    """The limb path of ``exact_linear`` on split weights (rows, cols) and
    quantized rows (n, cols) -> float32 (n, rows)."""
    import torch

    rows, cols = wm.shape
    n = q.shape[0]
    out = torch.empty((n, rows), dtype=torch.float32, device=wm.device)
    s_el = s.repeat_interleave(BLOCK, dim=1)  # (n, cols)
    per = min(rows, max(1, CHUNK // cols))
    tn = max(1, CHUNK // (per * cols))
    # chunks of (slots x rows); each output depends only on its own row and slot
    for t0 in range(0, n, tn):
        t1 = min(n, t0 + tn)
        for r0 in range(0, rows, per):
            r1 = min(rows, r0 + per)
            P = wm[None, r0:r1] * q[t0:t1, None, :]
            E = we[None, r0:r1] + s_el[t0:t1, None, :]
            live = P != 0
            if not bool(live.any()):
                out[t0:t1, r0:r1] = 0.0
                continue
            c = torch.div(E, LIMB, rounding_mode="floor")
            cmin = int(c[live].min())
            cmax = int(c[live].max())
            c = torch.where(live, c, torch.full_like(c, cmin))
            sh = torch.where(live, P << (E - LIMB * c), torch.zeros_like(P))
            nb = cmax - cmin + 1 + 5  # 5 spare limbs take the carries (80 bits of headroom)
            M = (t1 - t0) * (r1 - r0)
            acc = torch.zeros((M, nb), dtype=torch.int64, device=wm.device)
            acc.scatter_add_(1, (c - cmin).reshape(M, cols), sh.reshape(M, cols))
            out[t0:t1, r0:r1] = limbs_to_f32(acc, LIMB * cmin).reshape(t1 - t0, r1 - r0)
    return out


def fixed_exp(z):
    """The plan's E(z) on float64 z (every op separately rounded); z > 709 -> +inf."""
    import torch

    big = z > 709
    zz = torch.where(big, torch.zeros_like(z), z)
    n = torch.round(zz * INV_LN2)
    r = (zz - n * LN2_HI) - n * LN2_LO
    p = torch.full_like(zz, TAYLOR[13])
    for k in range(12, -1, -1):
        p = p * r
        p = p + TAYLOR[k]
    e = p * _pow2_f64(n.to(torch.int64))
    return torch.where(big, torch.full_like(e, math.inf), e)


def swiglu_exact(g, u, limit: float):
    """Step 3: h = RNE_fp32(silu(min(g, L)) * clamp(u, -L, L)) in float64 op by op.
    g, u float32 (n, I) -> float32 (n, I)."""
    import torch

    L = float(limit)
    gc = torch.clamp(g.to(torch.float64), max=L)
    uc = torch.clamp(u.to(torch.float64), min=-L, max=L)
    z = -gc
    ez = fixed_exp(z)
    silu = gc / (1.0 + ez)
    # E = +inf: the definition takes silu = gc * 0.0 (a signed zero), not gc / inf
    silu = torch.where(z > 709, gc * 0.0, silu)
    return (silu * uc).to(torch.float32)


def expert_exact(wg, wu, wd, x, limit: float, spans=(None, None, None), f64=None):
    """One expert on rows x (float32 (n, H)) in exact mode -> float32 (n, H).
    ``spans``: the three weights' ``weight_spans`` when the caller keeps them."""
    g = exact_linear(wg, x, spans[0], f64)
    u = exact_linear(wu, x, spans[1], f64)
    h = swiglu_exact(g, u, limit)
    return exact_linear(wd, h, spans[2], f64)
