"""The numpy reference of the scale search (docs/formats.md#scale-search).

Reads like docs/formats.md: the scale search evaluates all 126 candidates for every
group at once, and sums each candidate's error terms with sequential float32
adds in element order (never ``np.sum``, which adds pairwise and rounds
differently). The rule it implements, and the fast path that must give the
same bytes, are described in ``scale_codecs``.
"""

from __future__ import annotations

import numpy as np

from ds4quant.formats.search.tables import (
    F32, FP2, FP3, FP4, FP4_THRESHOLDS, FP6, FP8, INIT_E, INIT_ERR, LEVELS, S40, SCALES, TOP, ZERO_CODE,
)
from ds4quant.formats.ue4m3 import FLT_MAX, UE4M3, UE4M3_INV, nearest_ref



def _round_half_away(a: np.ndarray) -> np.ndarray:
    """C lroundf of float32 a >= 0, as float32 (a - floor(a) is exact)."""
    m = np.floor(a)
    return (m + (a - m >= F32(0.5))).astype(np.float32)


def quantize_ref(fmt: int, x: np.ndarray, inv: np.ndarray) -> np.ndarray:
    """code(x, inv) of format ``fmt``, elementwise (broadcasts), uint8.

    A non-finite x or a scale of 0 (``inv <= 0``) gives the format's zero code.
    """
    x, inv = np.broadcast_arrays(np.asarray(x, np.float32), np.asarray(inv, np.float32))
    ok = np.isfinite(x) & (inv > 0)
    with np.errstate(all="ignore"):
        v = np.where(ok, x * inv, F32(0)).astype(np.float32)
    a = np.abs(v)
    neg = (x < 0).astype(np.int64)
    if fmt == FP2:
        # docs/formats.md#rocmfp2: nearest of {-1,0,1,2}, ties to the lower code. The reference
        # compares float32 |q - V| (first minimum wins), which matches the
        # docs/formats.md#rocmfp2 thresholds only while |q| < 2^24 (checked over every float32);
        # beyond that the distances collapse and the lower code wins, so an
        # outlier of 1e20 at S = 2^-10 gets code 0 (the golden overflow cases).
        dist = np.abs(v[..., None] - LEVELS[FP2, :4]).astype(np.float32)
        code = np.argmin(dist, axis=-1)
    elif fmt == FP3:  # docs/formats.md#rocmfp3: magnitudes {0,1,2,4}, ties to the lower magnitude
        idx = (a > F32(0.5)).astype(np.int64) + (a > F32(1.5)) + (a > F32(3.0))
        code = np.where(idx == 0, 0, idx | (4 * neg))
    elif fmt == FP6:  # docs/formats.md#rocmfp6: m = lroundf(min(|x*inv|, 31))
        m = _round_half_away(np.minimum(a, F32(31))).astype(np.int64)
        code = np.where(m == 0, 0, m | (32 * neg))
    elif fmt == FP8:  # docs/formats.md#rocmfp8: q = lroundf(clamp(x*inv, -127, 127)), int8
        c = np.clip(v, F32(-127), F32(127))
        q = (np.sign(c) * _round_half_away(np.abs(c))).astype(np.int64)
        code = q & 0xFF
    elif fmt == FP4:  # docs/formats.md#rocmfp4: Codebook10 thresholds, ties to the lower index
        idx = (a[..., None] > FP4_THRESHOLDS).sum(axis=-1)
        code = np.where(idx == 0, 0, idx | (8 * neg))
    elif fmt == S40:  # fork: inner (+-1) up to |x*inv| = 2.5, sign by signbit
        outer = a > F32(2.5)
        code = np.where(np.signbit(x), np.where(outer, 0, 1), np.where(outer, 3, 2))
    else:
        raise ValueError(f"unknown element format {fmt}")
    return np.where(ok, code, ZERO_CODE[fmt]).astype(np.uint8)


def row_energy_ref(x: np.ndarray) -> np.ndarray:
    """Row energy sigma^2 (docs/formats.md#scale-search) per row: float32 (rows,) for float32 x (rows, k).

    The float32 sum of finite x_i^2 in element order (a cumulative sum is the
    sequential sum); if a square is non-finite or the sum would pass FLT_MAX,
    the row falls back to a double sum / k, clamped to FLT_MAX.
    """
    x = np.asarray(x, dtype=np.float32)
    rows, k = x.shape
    fin = np.isfinite(x)
    with np.errstate(all="ignore"):
        sq = np.where(fin, x * x, F32(0)).astype(np.float32)
        run = np.cumsum(sq, axis=1, dtype=np.float32)
        before = np.concatenate([np.zeros((rows, 1), np.float32), run[:, :-1]], axis=1)
        # The check happens before each add; until it first fires, `before` is
        # the true running sum, and after that the row falls back anyway.
        trip = fin & (~np.isfinite(sq) | (before > FLT_MAX - sq))
        sigma2 = (run[:, -1] / F32(k)).astype(np.float32) if k else np.zeros(rows, np.float32)
    for r in np.nonzero(trip.any(axis=1))[0]:
        xd = x[r][fin[r]].astype(np.float64)
        total = np.cumsum(xd * xd)[-1]  # sequential double sum
        sigma2[r] = np.float32(min(total / k, float(FLT_MAX)))
    return sigma2


def row_energy_s40_ref(x: np.ndarray) -> np.ndarray:
    """S40 fork sigma^2: plain float32 sum of finite x_i^2 / k (no fallback)."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(all="ignore"):
        sq = np.where(np.isfinite(x), x * x, F32(0)).astype(np.float32)
        return (np.cumsum(sq, axis=1, dtype=np.float32)[:, -1] / F32(x.shape[1])).astype(np.float32)


def importance_weights_ref(x: np.ndarray, importance: np.ndarray, sigma2: np.ndarray) -> np.ndarray:
    """Per-element importance weights (docs/formats.md#scale-search): float32 (rows, k).

    w = q * sqrtf(sigma^2 + x*x) when q > 0 and both are finite; FLT_MAX when
    sigma^2 + x*x or the product overflows; 0 otherwise.
    """
    x = np.asarray(x, dtype=np.float32)
    q = np.asarray(importance, dtype=np.float32)[None, :]
    with np.errstate(all="ignore"):
        e = (sigma2[:, None] + x * x).astype(np.float32)
        w = (q * np.sqrt(e)).astype(np.float32)
    w = np.where(np.isfinite(e), np.where(np.isinf(w), FLT_MAX, w), FLT_MAX)
    use = np.isfinite(q) & (q > 0) & np.isfinite(x)
    return np.where(use, w, F32(0)).astype(np.float32)


def importance_weights_s40_ref(x: np.ndarray, importance: np.ndarray, sigma2: np.ndarray) -> np.ndarray:
    """S40 fork weights: q * sqrtf(sigma^2 + x*x), not clamped (may be +inf)."""
    x = np.asarray(x, dtype=np.float32)
    q = np.asarray(importance, dtype=np.float32)[None, :]
    with np.errstate(all="ignore"):
        w = (q * np.sqrt((sigma2[:, None] + x * x).astype(np.float32))).astype(np.float32)
    use = np.isfinite(q) & (q > 0) & np.isfinite(x)
    return np.where(use, w, F32(0)).astype(np.float32)


def fork_nearest_ref(t: np.ndarray) -> np.ndarray:
    """The S40 fork's nearest byte: binary search, ties to the lower byte.

    Unlike N() (docs/formats.md#ue4m3) it does not collapse for huge targets (>224 gives 126).
    """
    t = np.asarray(t, dtype=np.float32)
    table = UE4M3[1:127]
    lo = np.searchsorted(table, t, side="left") + 1  # first e with S(e) >= t
    lo = np.minimum(lo, 126)
    with np.errstate(all="ignore"):
        lower = (t - UE4M3[lo - 1]).astype(np.float32) <= (UE4M3[lo] - t).astype(np.float32)
    e = np.where((lo > 1) & lower, lo - 1, lo)
    return np.where((t > 0) & np.isfinite(t), e, 0).astype(np.int64)


def candidate_errors_ref(fmt: int, xg: np.ndarray, wg) -> np.ndarray:
    """err(e) for e = 0..126 of every group: float32 (G, 127).

    xg float32 (G, n); wg float32 (G, n) or None (unweighted). Terms
    ``(w*d)*d`` (or ``d*d``) over finite x, summed in element order.
    """
    e = np.arange(127)
    scale = UE4M3[e][None, :, None]
    inv = UE4M3_INV[e][None, :, None]
    x = xg[:, None, :]
    with np.errstate(all="ignore"):
        y = (LEVELS[fmt][quantize_ref(fmt, x, inv)] * scale).astype(np.float32)
        d = (x - y).astype(np.float32)
        term = d * d if wg is None else (wg[:, None, :] * d) * d
    term = np.where(np.isfinite(x), term, F32(0)).astype(np.float32)
    err = np.zeros(term.shape[:2], dtype=np.float32)
    with np.errstate(all="ignore"):
        for i in range(term.shape[2]):  # sequential float32 adds, element order
            err += term[:, :, i]
    return err


def _lexmin(err: np.ndarray, init_err: np.ndarray, init_e: np.ndarray) -> np.ndarray:
    """lexmin of (err[:, e-1], e) over e = 1..126 (NaN never chosen) and the init pair."""
    valid = ~np.isnan(err)
    best = np.minimum(np.where(valid, err, np.inf).min(axis=1), init_err)
    hit = valid & (err == best[:, None])
    first = np.argmax(hit, axis=1) + 1
    take = hit.any(axis=1) & ~((init_err == best) & (init_e < first))
    e = np.where(take, first, init_e)
    return np.where(np.isnan(init_err), init_e, e).astype(np.uint8)


def search_ref(fmt: int, xg: np.ndarray, wg, zero_seed: bool = False, chunk: int = 2048):
    """The scale byte (docs/formats.md#scale-search) and its error for every group.

    xg float32 (G, n) (may hold NaN/Inf); wg float32 (G, n) weights or None.
    Returns (e uint8 (G,), err float32 (G,)): err is err(e), 0 for e = 0.
    """
    xg = np.asarray(xg, dtype=np.float32)
    G = xg.shape[0]
    out_e = np.zeros(G, dtype=np.uint8)
    out_err = np.zeros(G, dtype=np.float32)
    for s in range(0, G, chunk):
        x = xg[s:s + chunk]
        w = None if wg is None else wg[s:s + chunk]
        fin = np.isfinite(x)
        max_abs = np.where(fin, np.abs(x), F32(0)).max(axis=1)
        err_all = candidate_errors_ref(fmt, x, w)
        if fmt == S40 and zero_seed:
            init_e = np.zeros(len(x), np.int64)
            init_err = err_all[:, 0]
        elif fmt == S40:
            init_e = fork_nearest_ref((max_abs / TOP[S40]).astype(np.float32))
            init_err = np.full(len(x), np.inf, np.float32)
        else:
            init_e = np.full(len(x), INIT_E[fmt])
            init_err = np.full(len(x), INIT_ERR[fmt], np.float32)
        e = _lexmin(err_all[:, 1:], init_err, init_e)
        e = np.where(max_abs > 0, e, 0).astype(np.uint8)  # all-zero / all-non-finite group
        out_e[s:s + chunk] = e
        out_err[s:s + chunk] = np.where(e > 0, err_all[np.arange(len(x)), e], F32(0))
    return out_e, out_err


def encode_groups_ref(fmt: int, x: np.ndarray, importance, group: int, *, mirror: bool = False,
                      zero_seed: bool = False, fp8_nearest: bool = False):
    """Scale bytes and codes for every group of every row (docs/formats.md#scale-search).

    x float32 (rows, cols), importance float32 (cols,) or None, group 16/32.
    mirror: FP2 only, the fp2s option (also search -x; bit 7 when the mirrored
    error is strictly lower). fp8_nearest: FP8 without importance, e = N(max/127).
    Returns (e uint8 (rows, cols//group), codes uint8 (rows, cols)).
    """
    rows, cols = x.shape
    if importance is None:
        w = None
    elif fmt == S40:
        w = importance_weights_s40_ref(x, importance, row_energy_s40_ref(x))
    else:
        w = importance_weights_ref(x, importance, row_energy_ref(x))
    xg = x.reshape(-1, group)
    wg = None if w is None else w.reshape(-1, group)
    if fp8_nearest and w is None:
        max_abs = np.where(np.isfinite(xg), np.abs(xg), F32(0)).max(axis=1)
        e = nearest_ref((max_abs / F32(127)).astype(np.float32))
        err = np.zeros(len(xg), np.float32)
    else:
        e, err = search_ref(fmt, xg, wg, zero_seed=zero_seed)
    src = xg
    if mirror:
        # fp2s: a mirrored half decodes as -(V*S); its error equals encoding -x.
        em, errm = search_ref(fmt, -xg, wg)
        flip = errm < err
        e = np.where(flip, em | 0x80, e).astype(np.uint8)
        src = np.where(flip[:, None], -xg, xg)
    inv = UE4M3_INV[e & 0x7F][:, None]
    codes = quantize_ref(fmt, src, inv)
    return e.reshape(rows, -1), codes.reshape(rows, cols)


def decode_values_ref(fmt: int, codes: np.ndarray, e: np.ndarray, group: int) -> np.ndarray:
    """y = LEVELS[code] * SCALES[e] per group: float32 (rows, cols)."""
    rows, cols = codes.shape
    scale = SCALES[fmt][e].reshape(rows, -1, 1)
    y = LEVELS[fmt][codes].reshape(rows, -1, group) * scale
    return y.astype(np.float32).reshape(rows, cols)
