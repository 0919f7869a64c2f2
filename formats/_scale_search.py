"""The scale-search machinery shared by ROCmFP2/3/4/6/8 and ROCmFP2 S40.

Spec: rocmfpx-codecs.md §2 (row energy, importance weights, scale search),
with the element quantisers of §3 (FP2), §5 (FP3), §6 (FP6), §7 (FP8) and
§8 (FP4), plus the S40 fork quantiser (see ``rocmfp2_s40``).

Each format encodes a *group* (a 16-weight half, or a 32-weight block) with
one UE4M3 scale byte ``e`` and one code per weight. A decoded weight is
``LEVELS[fmt][code] * SCALES[fmt][e]``, one float32 product.

Two implementations that must give the same bytes:

* ``*_ref`` (numpy): reads like the spec. The scale search evaluates all 126
  candidates for every group at once, and sums each candidate's error terms
  with sequential float32 adds in element order (never ``np.sum``, which
  adds pairwise and rounds differently).
* ``encode_rows_nb`` / ``decode_rows_nb`` (numba): walk the candidates from
  ``N(max/top)`` outwards like the reference codec, abandon a candidate once
  its partial sum exceeds the best, and stop walking in a direction once a
  lower bound of the error of every further candidate that way exceeds the
  best: below, the clip errors (of the largest element, as the reference
  does, or of all of them); above, the terms of the elements already on the
  zero level, or a proof that every larger scale ties (ties go to the
  smaller byte). No pruned candidate could have been chosen, so the walk
  returns exactly the argmin the spec defines.

The search picks ``lexmin((err(e), e))`` over the candidates ``e = 1..126``
whose error is not NaN, together with an initial pair:

* Lucebox FP2/FP3/FP6/FP8: ``(+inf, 127)``, so "smallest e among the minimum
  errors, +inf == +inf" (§2.3; all-inf gives e = 1);
* FP4/FP4-FAST: ``(FLT_MAX, 0)`` -- an error >= FLT_MAX is never chosen (§2.3);
* S40: ``(+inf, N_fork(max/4))`` as in the fork's walk, or ``(err(0), 0)``
  with the fork's later zero-scale seed (``zero_seed=True``).

Lucebox errors are never NaN (weights are clamped to FLT_MAX). The S40 fork
does not clamp, so an infinite weight times a zero difference gives NaN;
such a candidate is never chosen, and a NaN seed error keeps byte 0, exactly
as the fork's comparisons behave.
"""

from __future__ import annotations

import numba
import numpy as np

from ds4quant.formats._bits import pack_bits, pack_nibbles_split, unpack_bits, unpack_nibbles_split
from ds4quant.formats.ue4m3 import FLT_MAX, UE4M3, UE4M3_INV, nearest_nb, nearest_ref

F32 = np.float32

# Element quantiser ids (index into the tables below).
FP2, FP3, FP6, FP8, FP4, S40 = 0, 1, 2, 3, 4, 5
FORMAT_NAMES = ("fp2", "fp3", "fp6", "fp8", "fp4", "s40")

# Largest level magnitude: the reference walk starts at N(max_abs / top) and
# bounds the clip error of the largest element with (max_abs - top*S)^2 (§2.3).
TOP = np.array([2, 4, 31, 127, 10, 4], dtype=np.float32)
# Bits per code on the wire (FP4 is nibbles in split order, §8).
BITS = np.array([2, 3, 6, 8, 4, 2], dtype=np.int64)
# The code an element gets when it is non-finite or the scale is 0:
# FP2's zero is code 1 (§3); S40's code 0 is the -4 level (fork behaviour).
ZERO_CODE = np.array([1, 0, 0, 0, 0, 0], dtype=np.uint8)
# Initial pair of the search (see module docstring); S40 is computed per group.
INIT_E = np.array([127, 127, 127, 127, 0, 127], dtype=np.int64)
INIT_ERR = np.array([np.inf, np.inf, np.inf, np.inf, FLT_MAX, np.inf], dtype=np.float32)

FP4_THRESHOLDS = np.array([0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 9.0], dtype=np.float32)  # §8


def _build_levels() -> np.ndarray:
    """V(code) for every format and code byte, float32 (6, 256).

    Levels are integers converted to float32, so "-0" codes (FP3 code 4,
    FP4 code 8, FP6 code 32) decode as +0 like the reference's integer V.
    """
    lv = np.zeros((6, 256), dtype=np.float32)
    c = np.arange(256)
    lv[FP2, :4] = np.arange(4) - 1  # §3: {-1, 0, 1, 2}
    mag3 = np.array([0, 1, 2, 4])
    lv[FP3, :8] = np.where(c[:8] & 4, -mag3[c[:8] & 3], mag3[c[:8] & 3])  # §5
    lv[FP6, :64] = np.where(c[:64] & 32, -(c[:64] & 31), c[:64] & 31)  # §6
    lv[FP8, :] = c.astype(np.uint8).view(np.int8)  # §7: two's complement
    mag4 = np.array([0, 1, 2, 3, 4, 6, 8, 10])
    lv[FP4, :16] = np.where(c[:16] & 8, -mag4[c[:16] & 7], mag4[c[:16] & 7])  # §8 Codebook10
    lv[S40, :4] = [-4, -1, 1, 4]  # S40 "MORD" order
    lv.setflags(write=False)
    return lv


def _build_scales() -> np.ndarray:
    """Decoded scale for every format and scale byte, float32 (6, 256)."""
    sc = np.empty((6, 256), dtype=np.float32)
    sc[:] = UE4M3  # S(e); 0 for e > 0x7E (§1, §12 "invalid scale byte")
    e = np.arange(256)
    # §3 fp2s: bit 7 negates S(e & 0x7F) (0x7F/0xFF -> scale +-0).
    mag = UE4M3[e & 0x7F]
    sc[FP2] = np.where(e & 0x80, -mag, mag)
    sc.setflags(write=False)
    return sc


LEVELS = _build_levels()
SCALES = _build_scales()


# ==========================================================================
# numpy reference


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
        # §3: nearest of {-1,0,1,2}, ties to the lower code. The reference
        # compares float32 |q - V| (first minimum wins), which matches the
        # §3 thresholds only while |q| < 2^24 (checked over every float32);
        # beyond that the distances collapse and the lower code wins, so an
        # outlier of 1e20 at S = 2^-10 gets code 0 (the golden overflow cases).
        dist = np.abs(v[..., None] - LEVELS[FP2, :4]).astype(np.float32)
        code = np.argmin(dist, axis=-1)
    elif fmt == FP3:  # §5: magnitudes {0,1,2,4}, ties to the lower magnitude
        idx = (a > F32(0.5)).astype(np.int64) + (a > F32(1.5)) + (a > F32(3.0))
        code = np.where(idx == 0, 0, idx | (4 * neg))
    elif fmt == FP6:  # §6: m = lroundf(min(|x*inv|, 31))
        m = _round_half_away(np.minimum(a, F32(31))).astype(np.int64)
        code = np.where(m == 0, 0, m | (32 * neg))
    elif fmt == FP8:  # §7: q = lroundf(clamp(x*inv, -127, 127)), int8
        c = np.clip(v, F32(-127), F32(127))
        q = (np.sign(c) * _round_half_away(np.abs(c))).astype(np.int64)
        code = q & 0xFF
    elif fmt == FP4:  # §8: Codebook10 thresholds, ties to the lower index
        idx = (a[..., None] > FP4_THRESHOLDS).sum(axis=-1)
        code = np.where(idx == 0, 0, idx | (8 * neg))
    elif fmt == S40:  # fork: inner (+-1) up to |x*inv| = 2.5, sign by signbit
        outer = a > F32(2.5)
        code = np.where(np.signbit(x), np.where(outer, 0, 1), np.where(outer, 3, 2))
    else:
        raise ValueError(f"unknown element format {fmt}")
    return np.where(ok, code, ZERO_CODE[fmt]).astype(np.uint8)


def row_energy_ref(x: np.ndarray) -> np.ndarray:
    """§2.1 sigma^2 per row: float32 (rows,) for float32 x (rows, k).

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
    """§2.2 per-element weights: float32 (rows, k).

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

    Unlike N() of §1 it does not collapse for huge targets (>224 gives 126).
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
    """§2.3 scale byte and its error for every group.

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
    """Scale bytes and codes for every group of every row (spec §2-§8).

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


# ==========================================================================
# numba fast path
#
# Everything is float32; constants are np.float32 so nothing promotes to
# float64 (which would round differently), and no fastmath.

_HALF = F32(0.5)
_ZERO = F32(0.0)
_ONE = F32(1.0)
_INF = F32(np.inf)


@numba.njit(cache=True, inline="always")
def _fp2_level_nb(v):
    """The FP2 level nearest to v = x*inv by float32 |v - V| (first minimum
    wins, as the reference loops codes 0..3), as selects so it vectorises."""
    lv = F32(-1.0)
    bd = abs(v + _ONE)  # |v - (-1)|: the same IEEE operation
    d = abs(v)
    lv = _ZERO if d < bd else lv
    bd = d if d < bd else bd
    d = abs(v - _ONE)
    lv = _ONE if d < bd else lv
    bd = d if d < bd else bd
    d = abs(v - F32(2.0))
    return F32(2.0) if d < bd else lv


@numba.njit(cache=True)
def row_energy_nb(x):
    """§2.1 for one float32 row (see row_energy_ref)."""
    k = x.shape[0]
    s = _ZERO
    for i in range(k):
        xi = x[i]
        if not np.isfinite(xi):
            continue
        sq = xi * xi
        if not np.isfinite(sq) or s > FLT_MAX - sq:
            total = 0.0
            for j in range(k):
                if np.isfinite(x[j]):
                    xd = np.float64(x[j])
                    total += xd * xd
            total = total / k
            if total > np.float64(FLT_MAX):
                total = np.float64(FLT_MAX)
            return np.float32(total)
        s += sq
    return s / np.float32(k)


@numba.njit(cache=True)
def row_energy_s40_nb(x):
    s = _ZERO
    for i in range(x.shape[0]):
        if np.isfinite(x[i]):
            s += x[i] * x[i]
    return s / np.float32(x.shape[0])


@numba.njit(cache=True, inline="always")
def _weight_nb(fmt, x, q, sigma2):
    """§2.2 weight of one finite element (the S40 fork: not clamped), as selects.

    With q > 0 an overflowing sigma^2 + x*x gives q*sqrt(inf) = inf, so one
    inf test covers both of §2.2's FLT_MAX cases.
    """
    w = q * np.sqrt(sigma2 + x * x)
    if fmt != S40:
        w = FLT_MAX if np.isinf(w) else w
    return w if (q > _ZERO and np.isfinite(q)) else _ZERO


@numba.njit(cache=True, inline="always")
def _group_codes_nb(fmt, x, base, n, inv, flip, codes, off):
    """codes[off+i] = code(+-x[base+i], inv) for a group, as straight loops.

    Same codes as quantize_ref (non-finite x -> the zero code; inv = 0 puts
    every finite x on the zero level, except S40, whose zero code is 0).
    """
    sg = F32(-1.0) if flip else _ONE
    if fmt == FP2:
        for i in range(n):
            v = x[base + i] * sg
            c = np.int64(_fp2_level_nb(v * inv)) + 1
            codes[off + i] = c if np.isfinite(v) else 1
    elif fmt == FP3:
        for i in range(n):
            v = x[base + i] * sg
            a = abs(v * inv)
            k = np.int64(a > _HALF) + np.int64(a > F32(1.5)) + np.int64(a > F32(3.0))
            c = k | (4 if (v < _ZERO and k > 0) else 0)
            codes[off + i] = c if np.isfinite(v) else 0
    elif fmt == FP4:
        for i in range(n):
            v = x[base + i] * sg
            a = abs(v * inv)
            k = (np.int64(a > _HALF) + np.int64(a > F32(1.5)) + np.int64(a > F32(2.5))
                 + np.int64(a > F32(3.5)) + np.int64(a > F32(5.0)) + np.int64(a > F32(7.0))
                 + np.int64(a > F32(9.0)))
            c = k | (8 if (v < _ZERO and k > 0) else 0)
            codes[off + i] = c if np.isfinite(v) else 0
    elif fmt == FP6:
        for i in range(n):
            v = x[base + i] * sg
            a = min(abs(v * inv), F32(31.0))
            m = np.floor(a)
            k = np.int64(m + np.float32(a - m >= _HALF))
            c = k | (32 if (v < _ZERO and k > 0) else 0)
            codes[off + i] = c if np.isfinite(v) else 0
    elif fmt == FP8:
        for i in range(n):
            v = x[base + i] * sg
            q = min(max(v * inv, F32(-127.0)), F32(127.0))
            a = abs(q)
            m = np.floor(a)
            k = np.int64(m + np.float32(a - m >= _HALF))
            c = (-k if q < _ZERO else k) & 0xFF
            codes[off + i] = c if np.isfinite(v) else 0
    else:  # S40
        for i in range(n):
            v = x[base + i] * sg
            outer = abs(v * inv) > F32(2.5)
            c = (0 if outer else 1) if np.signbit(v) else (3 if outer else 2)
            codes[off + i] = c if (np.isfinite(v) and inv > _ZERO) else 0


@numba.njit(cache=True, inline="always")
def _terms_nb(fmt, xg, wg, n, s, inv, t):
    """t[i] = (w_i*d_i)*d_i for every element at scale s.

    One straight loop per format with no data-dependent branches, so LLVM
    vectorises it when n is a compile-time constant (see _eval_nb; with a
    runtime trip count of 16 the vector loop is skipped for the scalar
    remainder). Levels come from comparison counts; a zero level may
    carry the sign of x here (-0*s), which changes d only by the sign of a
    zero and never the term. S40 takes the sign from x < 0 instead of
    signbit(x): for x = -0.0 that flips d = -+S, again the same term.
    """
    if fmt == FP2:
        for i in range(n):
            x = xg[i]
            d = x - _fp2_level_nb(x * inv) * s
            t[i] = (wg[i] * d) * d
    elif fmt == FP3:
        for i in range(n):
            x = xg[i]
            a = abs(x * inv)
            k = (a > _HALF) + (a > F32(1.5)) + (a > F32(3.0))
            m = np.float32(k + (k == 3))  # {0, 1, 2, 4}
            d = x - (-m if x < _ZERO else m) * s
            t[i] = (wg[i] * d) * d
    elif fmt == FP4:
        for i in range(n):
            x = xg[i]
            a = abs(x * inv)
            k = ((a > _HALF) + (a > F32(1.5)) + (a > F32(2.5)) + (a > F32(3.5))
                 + (a > F32(5.0)) + (a > F32(7.0)) + (a > F32(9.0)))
            m = np.float32(max(k, 2 * k - 4))  # {0, 1, 2, 3, 4, 6, 8, 10}
            d = x - (-m if x < _ZERO else m) * s
            t[i] = (wg[i] * d) * d
    elif fmt == FP6:
        for i in range(n):
            x = xg[i]
            a = min(abs(x * inv), F32(31.0))
            m = np.floor(a)
            m = m + np.float32(a - m >= _HALF)  # lroundf
            d = x - (-m if x < _ZERO else m) * s
            t[i] = (wg[i] * d) * d
    elif fmt == FP8:
        for i in range(n):
            x = xg[i]
            v = x * inv
            a = min(abs(v), F32(127.0))
            m = np.floor(a)
            m = m + np.float32(a - m >= _HALF)
            d = x - (-m if v < _ZERO else m) * s
            t[i] = (wg[i] * d) * d
    else:  # S40
        for i in range(n):
            x = xg[i]
            m = F32(4.0) if abs(x * inv) > F32(2.5) else _ONE
            d = x - (-m if x < _ZERO else m) * s
            t[i] = (wg[i] * d) * d


@numba.njit(cache=True, inline="always")
def _eval_nb(fmt, xg, wg, n, e, best, t):
    """err(e) of a group: the sequential float32 sum in element order, or a
    partial sum once it exceeds ``best`` (all terms are >= 0).

    xg holds 0 for non-finite inputs and wg their weight 0 (1 for finite
    inputs when unweighted: (1*d)*d == d*d), so every term is summed in order.
    """
    s = UE4M3[e]
    inv = UE4M3_INV[e]
    if n == 16:  # constant trip counts: one vector loop each
        _terms_nb(fmt, xg, wg, 16, s, inv, t)
    else:
        _terms_nb(fmt, xg, wg, 32, s, inv, t)
    err = _ZERO
    for i in range(n):
        err += t[i]
        if err > best:
            return err
    return err


@numba.njit(cache=True, inline="always")
def _walk_start_nb(t):
    """The S40 fork's nearest byte (binary search, ties lower), 0 for t <= 0."""
    if not (t > _ZERO) or not np.isfinite(t):
        return 0
    lo = 1
    hi = 126
    while lo < hi:
        mid = lo + (hi - lo) // 2
        if UE4M3[mid] < t:
            lo = mid + 1
        else:
            hi = mid
    if lo == 1:
        return 1
    if t - UE4M3[lo - 1] <= UE4M3[lo] - t:
        return lo - 1
    return lo


@numba.njit(cache=True, inline="always")
def _stops_up_nb(fmt, max_abs, e):
    """True when every scale above e has the same error as e, or a larger one.

    Zero-level formats: once the largest |x*inv| is on the zero level, every
    element is (|x_i*inv| <= max_abs*inv), so every larger scale has the
    identical error sum(w*x*x), and ties go to the smaller byte. S40 has no
    zero level: once S >= max_abs every code is +-1 and each |d| = S - |x|
    grows with S, so err is non-decreasing from here on.
    """
    if fmt == S40:
        return UE4M3[e] >= max_abs
    a = max_abs * UE4M3_INV[e]
    if fmt == FP3 or fmt == FP4:
        return a <= _HALF
    return a < _HALF  # FP2 (-0.5 is code 0), FP6/FP8 (0.5 rounds away)


@numba.njit(cache=True, inline="always")
def _keeps_term_nb(fmt, x, s, inv):
    """Whether element x's term at scale s bounds its term at every larger scale."""
    if fmt == S40:
        return abs(x) <= s  # on +-1, |d| = S - |x| grows with S
    q = x * inv
    if fmt == FP2:
        return q > F32(-0.5) and q <= _HALF  # zero level, stays there
    if fmt == FP3 or fmt == FP4:
        return abs(q) <= _HALF
    return abs(q) < _HALF


_BOUND_MARGIN = F32(1.0 - 2.0**-16)


@numba.njit(cache=True, inline="always")
def _larger_scales_lose_nb(fmt, xg, n, s, inv, t, z, best):
    """True when err(e') > best for every e' above the scale s just evaluated.

    Z, the in-order float32 sum of the terms t_i of elements that keep their
    term (or a smaller one) at every larger scale, bounds err(e') from below:
    float addition is monotone. Z itself is not summed in order here: a
    pairwise sum P (depth <= 5) satisfies Z >= P*(1 - 36*2^-24) for terms
    >= 0, so a finite P*(1 - 2^-16) >= best proves Z > best, in a few
    dependent adds instead of up to 32.
    """
    for i in range(n):
        z[i] = t[i] if _keeps_term_nb(fmt, xg[i], s, inv) else _ZERO
    m = n
    while m > 1:
        m = m // 2
        for i in range(m):
            z[i] = z[i] + z[i + m]
    return z[0] < _INF and z[0] * _BOUND_MARGIN >= best


@numba.njit(cache=True, inline="always")
def _smaller_scales_lose_nb(fmt, xg, wg, n, s, z, best):
    """True when err(e') > best for every e' at or below scale s.

    Every level satisfies |y| <= top*S' <= top*s (FP2 below zero: 1*s), so
    |d_i| >= c_i = |x_i| - top*s wherever that is positive, and the in-order
    sum of (w*c)*c bounds err(e') from below; P is its pairwise sum, as in
    _larger_scales_lose_nb. This extends the reference's clip test from the
    largest element to all of them.
    """
    top = TOP[fmt]
    for i in range(n):
        x = xg[i]
        r = _ONE if (fmt == FP2 and x < _ZERO) else top
        c = abs(x) - r * s
        z[i] = (wg[i] * c) * c if c > _ZERO else _ZERO
    m = n
    while m > 1:
        m = m // 2
        for i in range(m):
            z[i] = z[i] + z[i + m]
    return z[0] < _INF and z[0] * _BOUND_MARGIN > best


@numba.njit(cache=True, inline="always")
def search_nb(fmt, xg, wg, n, max_abs, w_max, init_e, init_err, t, z):
    """§2.3 for one group with max_abs > 0: returns (e, err(e)).

    The walk visits e0, e0-1, e0+1, ... from e0 = N(max_abs/top). Walking
    down stops once (w_max*cd)*cd > best with cd = max_abs - top*S > 0: the
    largest element's term alone is at least that (|y| <= top*S), and cd
    only grows as e falls; or, after a rejected candidate, once
    _smaller_scales_lose_nb proves it for all elements together. Walking up
    stops per _stops_up_nb, or once a rejected candidate shows that every
    larger one loses too.
    """
    top = TOP[fmt]
    e0 = _walk_start_nb(max_abs / top)
    if e0 < 1:
        e0 = 1
    best_e = init_e
    best = init_err
    down_done = False
    up_done = False
    for delta in range(127):
        if not down_done:
            e = e0 - delta
            if e < 1:
                down_done = True
            else:
                cd = max_abs - top * UE4M3[e]
                if cd > _ZERO and (w_max * cd) * cd > best:
                    down_done = True
                else:
                    err = _eval_nb(fmt, xg, wg, n, e, best, t)
                    if err < best or (err == best and e < best_e):
                        best = err
                        best_e = e
                    if delta == 0 and _stops_up_nb(fmt, max_abs, e):
                        up_done = True
                    if err > best and e > 1 and _smaller_scales_lose_nb(fmt, xg, wg, n, UE4M3[e - 1], z, best):
                        down_done = True
        if delta > 0 and not up_done:
            e = e0 + delta
            if e > 126:
                up_done = True
            else:
                err = _eval_nb(fmt, xg, wg, n, e, best, t)
                if err < best or (err == best and e < best_e):
                    best = err
                    best_e = e
                if _stops_up_nb(fmt, max_abs, e):
                    up_done = True
                elif err > best and _larger_scales_lose_nb(fmt, xg, n, UE4M3[e], UE4M3_INV[e], t, z, best):
                    up_done = True
        if down_done and up_done:
            break
    return best_e, best


@numba.njit(cache=True, inline="always")
def _pack_block_nb(fmt, codes, out, off):
    """Write 32 codes as the format's qs bytes at out[off:]."""
    bits = BITS[fmt]
    if bits == 4:  # §8 split nibbles: low = weight j, high = weight j+16
        for j in range(16):
            out[off + j] = np.uint8((codes[j] & 15) | ((codes[j + 16] & 15) << 4))
        return
    nbytes = 4 * bits
    for j in range(nbytes):
        out[off + j] = 0
    for i in range(32):  # little-endian bit stream, code i at bits*i (§3, §5, §6)
        pos = bits * i
        b = pos >> 3
        v = np.int64(codes[i]) << (pos & 7)
        out[off + b] |= np.uint8(v & 0xFF)
        if (pos & 7) + bits > 8:
            out[off + b + 1] |= np.uint8(v >> 8)


@numba.njit(cache=True, inline="always")
def _unpack_block_nb(fmt, row, off, codes):
    bits = BITS[fmt]
    if bits == 4:
        for j in range(16):
            c = row[off + j]
            codes[j] = c & 15
            codes[j + 16] = c >> 4
        return
    mask = (1 << bits) - 1
    for i in range(32):
        pos = bits * i
        b = pos >> 3
        v = np.int64(row[off + b])
        if (pos & 7) + bits > 8:
            v |= np.int64(row[off + b + 1]) << 8
        codes[i] = (v >> (pos & 7)) & mask


@numba.njit(cache=True)
def _encode_row_nb(fmt, x, imp, has_imp, group, mirror, zero_seed, fp8_nearest, out):
    cols = x.shape[0]
    nscales = 32 // group
    qsb = 4 * BITS[fmt]
    block_bytes = qsb + nscales
    sigma2 = _ZERO
    if has_imp:
        sigma2 = row_energy_s40_nb(x) if fmt == S40 else row_energy_nb(x)
    xg = np.empty(group, np.float32)
    ng = np.empty(group, np.float32)
    wg = np.empty(group, np.float32)
    tb = np.empty(group, np.float32)
    zb = np.empty(group, np.float32)
    codes = np.empty(32, np.int64)
    for blk in range(cols // 32):
        off = blk * block_bytes
        for h in range(nscales):
            base = blk * 32 + h * group
            # non-finite inputs become x = 0 with weight 0: their terms vanish
            if has_imp:
                for i in range(group):
                    v = x[base + i]
                    fin = np.isfinite(v)
                    xv = v if fin else _ZERO
                    xg[i] = xv
                    wg[i] = _weight_nb(fmt, xv, imp[base + i], sigma2) if fin else _ZERO
            else:
                for i in range(group):
                    v = x[base + i]
                    fin = np.isfinite(v)
                    xg[i] = v if fin else _ZERO
                    wg[i] = _ONE if fin else _ZERO
            max_abs = _ZERO
            for i in range(group):
                max_abs = max(max_abs, abs(xg[i]))
            w_max = _ZERO  # the largest weight among the largest elements
            for i in range(group):
                w_max = max(w_max, wg[i] if abs(xg[i]) == max_abs else _ZERO)
            e = 0
            err = _ZERO
            flip = False
            if max_abs > _ZERO:
                if fp8_nearest and not has_imp:
                    e = nearest_nb(max_abs / F32(127.0))  # §7: no search
                else:
                    init_e = INIT_E[fmt]
                    init_err = INIT_ERR[fmt]
                    if fmt == S40:
                        if zero_seed:
                            # err(0): every code is the -4 level times 0 = -0.
                            init_e = 0
                            init_err = _ZERO
                            for i in range(group):
                                init_err += (wg[i] * xg[i]) * xg[i]
                        else:
                            init_e = _walk_start_nb(max_abs / TOP[S40])
                            init_err = _INF
                    e, err = search_nb(fmt, xg, wg, group, max_abs, w_max, init_e, init_err, tb, zb)
                    if mirror:
                        for i in range(group):
                            ng[i] = -xg[i]
                        em, errm = search_nb(fmt, ng, wg, group, max_abs, w_max, init_e, init_err, tb, zb)
                        if errm < err:
                            e = em
                            flip = True
            _group_codes_nb(fmt, x, base, group, UE4M3_INV[e], flip, codes, h * group)
            out[off + qsb + h] = np.uint8(e | (0x80 if flip else 0))
        _pack_block_nb(fmt, codes, out, off)


@numba.njit(cache=True, parallel=True, nogil=True)
def encode_rows_nb(fmt, x, imp, has_imp, group, mirror, zero_seed, fp8_nearest, out):
    """Encode float32 x (rows, cols) into out uint8 (rows, row_bytes); rows in parallel."""
    for r in numba.prange(x.shape[0]):
        _encode_row_nb(fmt, x[r], imp, has_imp, group, mirror, zero_seed, fp8_nearest, out[r])


@numba.njit(cache=True, parallel=True, nogil=True)
def decode_rows_nb(fmt, data, group, out):
    """out (rows, cols) float32 = LEVELS[code] * SCALES[e] per group; rows in parallel."""
    rows, cols = out.shape
    nscales = 32 // group
    qsb = 4 * BITS[fmt]
    block_bytes = qsb + nscales
    lv = LEVELS[fmt]
    sc = SCALES[fmt]
    for r in numba.prange(rows):
        row = data[r]
        codes = np.empty(32, np.int64)
        for blk in range(cols // 32):
            off = blk * block_bytes
            _unpack_block_nb(fmt, row, off, codes)
            for h in range(nscales):
                s = sc[row[off + qsb + h]]
                for i in range(group):
                    out[r, blk * 32 + h * group + i] = lv[codes[h * group + i]] * s


# ==========================================================================
# drivers used by the codec modules


def block_bytes(fmt: int, group: int) -> int:
    return 4 * int(BITS[fmt]) + 32 // group


def pack_ref(fmt: int, e: np.ndarray, codes: np.ndarray, group: int) -> np.ndarray:
    """Blocks from scale bytes (rows, cols//group) and codes (rows, cols): uint8 (rows, row_bytes)."""
    rows, cols = codes.shape
    c = codes.reshape(-1, 32)
    qs = pack_nibbles_split(c) if BITS[fmt] == 4 else pack_bits(c, int(BITS[fmt]))
    blocks = np.concatenate([qs, e.reshape(-1, 32 // group)], axis=1)
    return np.ascontiguousarray(blocks.reshape(rows, -1), dtype=np.uint8)


def unpack_ref(fmt: int, data: np.ndarray, cols: int, group: int):
    """Inverse of pack_ref: (e uint8 (rows, cols//group), codes uint8 (rows, cols))."""
    rows = data.shape[0]
    blk = data.reshape(-1, block_bytes(fmt, group))
    qsb = 4 * int(BITS[fmt])
    qs = blk[:, :qsb]
    codes = unpack_nibbles_split(qs) if BITS[fmt] == 4 else unpack_bits(qs, int(BITS[fmt]), 32)
    return blk[:, qsb:].reshape(rows, -1), codes.reshape(rows, cols)


def encode_ref(fmt: int, x: np.ndarray, importance, group: int, **kw) -> np.ndarray:
    e, codes = encode_groups_ref(fmt, x, importance, group, **kw)
    return pack_ref(fmt, e, codes, group)


def decode_ref(fmt: int, data: np.ndarray, cols: int, group: int) -> np.ndarray:
    e, codes = unpack_ref(fmt, data, cols, group)
    return decode_values_ref(fmt, codes, e, group)


def encode_fast(fmt: int, x: np.ndarray, importance, group: int, *, mirror: bool = False,
                zero_seed: bool = False, fp8_nearest: bool = False) -> np.ndarray:
    rows, cols = x.shape
    out = np.empty((rows, cols // 32 * block_bytes(fmt, group)), dtype=np.uint8)
    has_imp = importance is not None
    imp = importance if has_imp else np.zeros(1, np.float32)
    if rows:
        encode_rows_nb(fmt, x, imp, has_imp, group, mirror, zero_seed, fp8_nearest, out)
    return out


def decode_fast(fmt: int, data: np.ndarray, cols: int, group: int) -> np.ndarray:
    out = np.empty((data.shape[0], cols), dtype=np.float32)
    if data.shape[0]:
        decode_rows_nb(fmt, data, group, out)
    return out


def decode_torch(fmt: int, data, cols: int, group: int):
    """LEVELS[code] * SCALES[e] with torch integer ops and one float32 product."""
    import torch

    dev = data.device
    rows = data.shape[0]
    bits = int(BITS[fmt])
    qsb = 4 * bits
    blk = data.reshape(-1, qsb + 32 // group).to(torch.int64)
    qs = blk[:, :qsb]
    if bits == 4:
        codes = torch.cat([qs & 15, qs >> 4], dim=1)
    else:
        pos = torch.arange(32, device=dev) * bits
        lo = pos >> 3
        hi = torch.clamp(lo + 1, max=qsb - 1)
        word = qs[:, lo] | (qs[:, hi] << 8)
        codes = (word >> (pos & 7)) & ((1 << bits) - 1)
    levels = torch.from_numpy(np.array(LEVELS[fmt])).to(dev)
    scales = torch.from_numpy(np.array(SCALES[fmt])).to(dev)
    s = scales[blk[:, qsb:]].repeat_interleave(group, dim=1)
    return (levels[codes] * s).reshape(rows, cols)


def make_codec(fmt: int, group: int, *, options: "dict[str, str] | None" = None, **fixed):
    """The registry Codec of one scale-search format.

    group: weights per scale (16 or 32). options: public encode option name ->
    encode keyword (booleans, e.g. {"fp2s": "mirror"}); fixed: keywords always
    passed (e.g. fp8_nearest=True).
    """
    from ds4quant.formats.qtype import Codec

    options = dict(options or {})

    def kw(opts: dict) -> dict:
        out = dict(fixed)
        out.update({options[k]: bool(v) for k, v in opts.items()})
        return out

    def enc_ref(x, importance, codebooks, **opts):
        return encode_ref(fmt, x, importance, group, **kw(opts))

    def enc_fast(x, importance, codebooks, **opts):
        return encode_fast(fmt, x, importance, group, **kw(opts))

    def dec_ref(data, cols, codebooks, modes):
        return decode_ref(fmt, data, cols, group)

    def dec_fast(data, cols, codebooks, modes):
        return decode_fast(fmt, data, cols, group)

    def dec_torch(data, cols, codebooks, modes):
        return decode_torch(fmt, data, cols, group)

    return Codec(encode_ref=enc_ref, encode_fast=enc_fast, decode_ref=dec_ref, decode_fast=dec_fast,
                 decode_torch=dec_torch, encode_options=tuple(options))
