"""The scale search of ``_scale_search_nb`` in torch operations: the torch tier.

Covers the adaptive recipe's scale-search candidates without encode options
(``tables.SCALE_SEARCHES``):
rocmfp2 (FP2, per 16), rocmfp3 (FP3, per 16), rocmfp4 (FP4, per 16) and
rocmfp4_fast (FP4, per 32). The rule is ``scale_codecs``'s: per group the
byte ``lexmin((err(e), e))`` over e = 1..126 whose error is not NaN, together
with the format's initial pair, where err(e) is the sequential float32 sum in
element order of ``(w*d)*d``, ``d = x - level(x * inv(e)) * S(e)``.

The numba walk prunes candidates one by one; a GPU wants the opposite, so:

1. every group evaluates the same number of bytes, a window (``WINDOWS``)
   around the first byte whose scale reaches max|x|/top;
2. two proofs per group, from float64 bounds with a margin (1e-5 relative,
   1e-40 absolute) far above what float32 rounding of at most 35 operations
   can take away, show that no byte outside the window can win:
   below, every byte e' < lo clips: |y| <= top*S(lo-1) (FP2: 1*S for x < 0),
   so err(e') >= sum w*(|x| - top*S(lo-1))^2 over the clipped elements, which
   must exceed the window's best; above, either every element is on the zero
   level at the window's last byte hi (then every larger byte has hi's error
   and loses the tie), or, since at any scale S' >= S(hi) an element's level
   is 0 (|d| = |x|), the first level (|d| >= S(hi) - |x|) or farther,
   sum w*min(|x|, S(hi) - |x|)^2 reaches the best;
3. groups without both proofs are scanned over all 126 bytes.

Each group's byte is therefore the exact argmin docs/formats.md#scale-search defines, whatever
the window, and equal to the numba walk's (tests/formats/search/test_torch_scale.py
runs narrow windows, the default and the full scan on torch's CPU device and on
CUDA where present). Every float32 operation is its own torch operation, so
nothing is fused into a multiply-add: x*inv, the level (FP3/FP4 by threshold
counts on |x*inv|; their terms depend on |x| only, since IEEE rounding is
symmetric under negation; FP2 by its docs/formats.md#rocmfp2 thresholds while every |x*inv| <
2^23, else by the distance rule), level*S, x - y, w*d, (w*d)*d, and the sum as
``g`` separate additions in element order. The weights are (docs/formats.md#scale-search)
``q * sqrt(sigma^2 + x*x)`` with sigma^2 from the host's ``row_energy_nb``
(a sequential float32 row sum, which a device reduction would round
differently).

The Triton tier (``triton_scale``) scans all 126 bytes of every group in one
launch instead (the definition itself, no window or proofs): the same bytes.
"""

from __future__ import annotations

import numpy as np

from ds4quant.formats.search.tables import FP2, FP3, FP4, INIT_E, INIT_ERR, TOP, scale_format_on
from ds4quant.formats.ue4m3 import FLT_MAX

# (format, group) -> (bytes evaluated per group before the proofs, how many
# of them lie below the first byte whose scale reaches max|x|/top): from the
# proofs' failure rates on FP4-grid matrices at DS4 shapes (benchmarks/
# _adaptive_ds4shape.py), where each setting costs about WINDOW + 126 x the
# share of groups scanned in full (2-4%). Tests narrow them to drive groups
# through the full scan; any window gives the same bytes.
WINDOWS = {(FP2, 16): (20, 8), (FP3, 16): (18, 6), (FP4, 16): (16, 2), (FP4, 32): (12, 2)}
# candidates x groups per evaluated batch (bounds device memory: ~6 float32
# temporaries of this many elements are alive at once)
_BATCH = 1 << 24


def _fp2_level(v):
    """``_fp2_level_nb``: the level of {-1, 0, 1, 2} with the least float32
    |v - V|, the first of equal distances (the same operations and selects)."""
    import torch

    lv = torch.full_like(v, -1.0)
    bd = (v + 1.0).abs()
    for level in (0.0, 1.0):
        d = (v - level).abs()
        take = d < bd
        lv = torch.where(take, level, lv)
        bd = torch.where(take, d, bd)
    return torch.where((v - 2.0).abs() < bd, 2.0, lv)


def _fp2_level_fast(v, T):
    """``_fp2_level`` for |v| < 2^23: the docs/formats.md#rocmfp2 thresholds, ties to the lower code
    (equal to the distance rule for every float32 |v| < 2^24; checked
    exhaustively, tests/formats/search/test_torch_scale.py samples it)."""
    import torch

    return T["levels"][torch.bucketize(v, T["thr2"], out_int32=True)]


def _errors(fmt, T, XT, AXT, WT, e, fast2=False):
    """err(e) float32 (C, n) of the groups whose elements are the columns of
    XT (g, n) (|x| in AXT, weights WT), for the bytes e int64 (C, n); fast2:
    every |x * inv| < 2^23 (FP2's thresholds hold)."""
    import torch

    s = T["S"][e]
    inv = T["INV"][e]
    acc = None
    for i in range(XT.shape[0]):
        if fmt == FP2:
            v = XT[i] * inv
            d = XT[i] - (_fp2_level_fast(v, T) if fast2 else _fp2_level(v)) * s
        else:
            k = torch.bucketize(AXT[i] * inv, T["thr"], out_int32=True)  # = count of (a > threshold)
            d = AXT[i] - T["mag"][k] * s
        t = (WT[i] * d) * d
        if acc is None:
            acc = t  # 0 + t0 == t0: terms are >= +0, inf or NaN
        else:
            acc.add_(t)
    return acc


def _keys(err, e):
    """lexmin((err, e)) as one integer order: err >= +0 (a sum of terms >= +0;
    adding +0 turns a -0 into +0), so its float32 bits order like its values,
    inf included; the byte (< 256) below them. NaN: never taken."""
    import torch

    bits = (err + 0.0).view(torch.int32).to(torch.int64)
    return torch.where(torch.isnan(err), torch.iinfo(torch.int64).max, (bits << 8) | e)


def _scan(fmt, T, XT, AXT, WT, lo, K, key, fast2):
    """Fold the bytes lo .. lo+K-1 (each <= 126) of every group into ``key``
    (``_keys`` of the best so far), in batches."""
    import torch

    n = XT.shape[1]
    per = max(1, _BATCH // max(1, n))
    for c0 in range(0, K, per):
        e = lo.unsqueeze(0) + torch.arange(c0, min(K, c0 + per), device=lo.device).unsqueeze(1)
        key = torch.minimum(key, _keys(_errors(fmt, T, XT, AXT, WT, e, fast2), e).amin(dim=0))
    return key


def _init_key(fmt, n, dev):
    """The format's initial pair (``tables.INIT_*``) as ``_keys``, per group."""
    import torch

    bits = int(np.array([INIT_ERR[fmt]], np.float32).view(np.int32)[0])
    return torch.full((n,), (bits << 8) | int(INIT_E[fmt]), dtype=torch.int64, device=dev)


def _weights(fmt, x, fin, q, sigma2):
    """The importance weight (docs/formats.md#scale-search) per element (``_weight_nb``): q*sqrt(sigma^2 + x*x), inf -> FLT_MAX,
    0 where q is not a positive finite number or x is not finite; ones without q."""
    import torch

    if q is None:
        return fin.to(torch.float32)
    w = q.unsqueeze(0) * torch.sqrt(sigma2.unsqueeze(1) + x * x)
    w = torch.where(torch.isinf(w), float(FLT_MAX), w)
    w = torch.where(((q > 0) & torch.isfinite(q)).unsqueeze(0), w, 0.0)
    return torch.where(fin, w, 0.0)


def search(fmt: int, group: int, x, q, sigma2, stats: "dict | None" = None):
    """Scale bytes int64 (rows, cols // group) and codes uint8 (rows, cols) for
    float32 device tensors x (rows, cols) (non-finite allowed: the reference's
    handling), q (cols,) or None, sigma2 (rows,) (used with q)."""
    import torch

    T = scale_format_on(x.device, fmt)
    rows, cols = x.shape
    n = rows * cols // group
    fin = torch.isfinite(x)
    xv = torch.where(fin, x, 0.0)
    w = _weights(fmt, xv, fin, q, sigma2)
    XT = xv.reshape(n, group).t().contiguous()
    WT = w.reshape(n, group).t().contiguous()
    AXT = XT.abs()
    mx = AXT.amax(dim=0)
    top = float(TOP[fmt])
    K, below = WINDOWS[(fmt, group)]
    K = max(1, min(K, 126))
    e0 = torch.searchsorted(T["S1"], mx / top) + 1  # first byte with S >= max/top
    lo = (e0 - below).clamp(1, 127 - K)
    # one host sync: FP2's thresholds hold while every |x * inv| < 2^23 (inv <= 1024)
    fast2 = fmt == FP2 and n > 0 and float(mx.max()) < 2.0**13
    key = _scan(fmt, T, XT, AXT, WT, lo, K, _init_key(fmt, n, x.device), fast2)
    best = (key >> 8).to(torch.int32).view(torch.float32)

    # the proofs (module docstring), in float64
    b64 = best.to(torch.float64)
    W64 = WT.to(torch.float64)
    A64 = AXT.to(torch.float64)
    s_below = T["S"][(lo - 1).clamp(min=1)].to(torch.float64)
    reach = torch.where(XT < 0, 1.0, 2.0).to(torch.float64) if fmt == FP2 else top
    clip = (A64 - reach * s_below).clamp(min=0.0)
    below_ok = (lo == 1) | ((W64 * clip * clip).sum(dim=0) * (1 - 1e-5) - 1e-40 > b64)
    hi = lo + (K - 1)
    s_hi = T["S"][hi].to(torch.float64)
    # at every scale S' >= S(hi) an element's nearest level is 0 (error |x|),
    # the first level (error >= S(hi) - |x|) or farther: |d| >= min(|x|, S(hi) - |x|)^+
    near = torch.minimum(A64, (s_hi - A64).clamp(min=0.0))
    all_zero = mx * T["INV"][hi] < 0.5 if fmt == FP2 else mx * T["INV"][hi] <= 0.5
    above_ok = (hi == 126) | all_zero | ((W64 * near * near).sum(dim=0) * (1 - 1e-5) - 1e-40 >= b64)
    redo = torch.nonzero((mx > 0) & ~(below_ok & above_ok)).reshape(-1)
    if stats is not None:
        stats["groups"] = stats.get("groups", 0) + n
        stats["full_scans"] = stats.get("full_scans", 0) + int(redo.numel())
        stats["below_fail"] = stats.get("below_fail", 0) + int(((mx > 0) & ~below_ok).sum())
        stats["above_fail"] = stats.get("above_fail", 0) + int(((mx > 0) & ~above_ok).sum())
    if redo.numel():
        sub = lambda a: a[:, redo].contiguous()  # noqa: E731
        key[redo] = _scan(fmt, T, sub(XT), sub(AXT), sub(WT), torch.ones_like(redo), 126,
                          _init_key(fmt, redo.numel(), x.device), fast2)
    be = key & 255
    be = torch.where(mx > 0, be, 0)
    return be.reshape(rows, cols // group), _codes(fmt, T, x, be, group, fast2)


def _codes(fmt, T, x, be, group, fast2):
    """``_group_codes_nb`` at the chosen bytes (non-finite x: the zero code)."""
    import torch

    rows, cols = x.shape
    xg = x.reshape(-1, group)
    v = xg * T["INV"][be].unsqueeze(1)
    fin = torch.isfinite(xg)
    if fmt == FP2:
        c = (torch.bucketize(v, T["thr2"], out_int32=True) if fast2 else _fp2_level(v) + 1.0).to(torch.uint8)
        c = torch.where(fin, c, 1)
    else:
        k = torch.bucketize(v.abs(), T["thr"], out_int32=True).to(torch.uint8)
        sign = 4 if fmt == FP3 else 8
        c = torch.where((xg < 0) & (k > 0), k | sign, k)
        c = torch.where(fin, c, 0)
    return c.to(torch.uint8).reshape(rows, cols)


def decode_chosen(fmt: int, group: int, e, codes):
    """float32 (rows, cols) on the device: LEVELS[code] * SCALES[e], the decode
    of the blocks (e, codes) pack to (``decode_rows_nb``'s one product)."""
    T = scale_format_on(codes.device, fmt)
    rows, cols = codes.shape
    lv = T["levels"][codes.to(dtype=e.dtype)].reshape(-1, group)
    return (lv * T["scales"][e.reshape(-1)].unsqueeze(1)).reshape(rows, cols)
