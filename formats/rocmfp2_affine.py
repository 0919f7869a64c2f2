"""ROCmFP2 AFFINE: ggml 107 in a Lucebox built with ROCMFP2_AFFINE, docs/formats.md#rocmfp2-affine.

One 32-weight block is 10 bytes: 8 bytes of 2-bit codes, then a scale byte
and an offset byte, both plain UE4M3 (docs/formats.md#ue4m3; bit 7 is NOT the fp2s mirror)::

    qs[0..7]  weight i at bits 2*(i%4) of qs[i//4]:
              qs[0] = w3 w3 w2 w2 w1 w1 w0 w0   (bit 7 .. bit 0)
    e[0]      scale byte  s = S(e[0])
    e[1]      offset byte o = S(e[1])           = 10 B / 32 weights

Decode: ``y = (code * s) - o`` with codes 0..3, each operation rounded on its
own (no FMA). The file carries no sign of which 107 it is; ``variant`` is
the tag that tells this codec apart from the default ROCmFP2.

Encode (docs/formats.md#rocmfp2-affine): per block, min/max over weighted finite elements, a start point
from them, then three coordinate sweeps (scale, offset, scale) over all
UE4M3 bytes, each an argmin with ties to the smaller byte. The error weights
are the imatrix weights of docs/formats.md#scale-search with sigma^2 over the whole row.
"""

from __future__ import annotations

from typing import Optional

import numba
import numpy as np

from ds4quant.formats.bits import pack_bits, unpack_bits
from ds4quant.formats._scale_search_nb import _weight_nb
from ds4quant.formats._scale_search_ref import importance_weights_ref, row_energy_ref
from ds4quant.formats.search.numba_scale import row_energy_nb
from ds4quant.formats.search.tables import FP2
from ds4quant.formats.qtype import RT_DS4QUANT, RT_LUCEBOX_AFFINE, Codec, QType, register
from ds4quant.formats.ue4m3 import UE4M3, nearest_nb, nearest_ref

_F32 = np.float32
_BLOCK = 32
_BLOCK_BYTES = 10
_TINY = _F32(2.0**-10)  # floor of the start scale (docs/formats.md#rocmfp2-affine)
_BLOCK_CHUNK = 1 << 14  # blocks per numpy-reference chunk (bounds memory)

# --------------------------------------------------------------------------
# docs/formats.md#rocmfp2-affine numpy reference, vectorised over blocks (each step as docs/formats.md writes it)


def _acode_ref(x: np.ndarray, s: np.ndarray, o: np.ndarray) -> np.ndarray:
    """acode(x, s, o) for blocks x (B, 32) and per-block s, o (B,): float32 codes.

    t = ((x + o) / s) + 0.5 in float32 (a true division), code =
    clamp(floor(t), 0, 3); non-finite x counts as 0; code 0 when !(s > 0).
    """
    xx = np.where(np.isfinite(x), x, _F32(0))
    live = s > 0
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        t = ((xx + o[:, None]) / np.where(live, s, _F32(1))[:, None]).astype(np.float32) + _F32(0.5)
    code = np.clip(np.floor(t), _F32(0), _F32(3)).astype(np.float32)
    return np.where(live[:, None], code, _F32(0))


def _block_error_ref(x, w, valid, se, oe) -> np.ndarray:
    """A(se, oe) per block (docs/formats.md#rocmfp2-affine): float32 (B,).

    err = sum over valid elements, in element order, of (w*d)*d with
    d = x - ((code*s) - o). Invalid terms are +0 and leave the sum unchanged.
    """
    s = UE4M3[se]
    o = UE4M3[oe]
    code = _acode_ref(x, s, o)
    with np.errstate(over="ignore", invalid="ignore"):
        y = (code * s[:, None]).astype(np.float32) - o[:, None]
        d = (x - y).astype(np.float32)
        term = ((w * d).astype(np.float32) * d).astype(np.float32)
    term = np.where(valid, term, _F32(0))
    # Left-to-right float32 sum (accumulate never reorders), starting at +0.
    with np.errstate(over="ignore"):
        return np.add.accumulate(term, axis=1, dtype=np.float32)[:, -1] + _F32(0)


def _sweep_ref(x, w, valid, se, oe, which: str, lo: int):
    """One coordinate sweep (the sweeps of docs/formats.md#rocmfp2-affine): for e = lo..126, adopt e when its
    error is strictly lower than the running best, or equal with e below the
    current byte. Returns the new (se, oe)."""
    se, oe = se.copy(), oe.copy()
    best = _block_error_ref(x, w, valid, se, oe)
    cur = se if which == "scale" else oe
    for e in range(lo, 127):
        cand = np.full_like(cur, e)
        err = _block_error_ref(x, w, valid, cand, oe) if which == "scale" else _block_error_ref(x, w, valid, se, cand)
        take = (err < best) | ((err == best) & (e < cur))
        cur[take] = e
        best = np.where(take, err, best)
    return (cur, oe) if which == "scale" else (se, cur)


def _encode_blocks_ref(x: np.ndarray, w: Optional[np.ndarray]) -> np.ndarray:
    """Encode blocks x (B, 32) with weights w (B, 32) or None -> uint8 (B, 10)."""
    B = x.shape[0]
    finite = np.isfinite(x)
    if w is None:
        w = np.ones_like(x)
        valid = finite
        pick = finite
    else:
        valid = finite & (w > 0)
        # Step 1: min/max over weighted elements, else over all finite ones.
        pick = np.where(valid.any(axis=1)[:, None], valid, finite)
    mn = np.where(pick, x, np.inf).min(axis=1).astype(np.float32)
    mx = np.where(pick, x, -np.inf).max(axis=1).astype(np.float32)
    # Step 2: nothing finite, or an all-zero block -> (0, 0) and codes 0.
    empty = ~finite.any(axis=1) | ((mn == 0) & (mx == 0))
    mn = np.where(empty, _F32(0), mn)
    mx = np.where(empty, _F32(0), mx)
    # Step 3: start point; an overflowing max + off0 gives N(+inf) = 0.
    off0 = np.maximum(_F32(0), -mn).astype(np.float32)
    with np.errstate(over="ignore"):
        sc0 = np.maximum((mx + off0).astype(np.float32) / _F32(3), _TINY).astype(np.float32)
    se = nearest_ref(sc0).astype(np.int64)
    oe = nearest_ref(off0).astype(np.int64)
    # Steps 4-6: scale sweep, offset sweep, scale sweep.
    se, oe = _sweep_ref(x, w, valid, se, oe, "scale", 1)
    se, oe = _sweep_ref(x, w, valid, se, oe, "offset", 0)
    se, oe = _sweep_ref(x, w, valid, se, oe, "scale", 1)
    se[empty] = 0
    oe[empty] = 0
    codes = _acode_ref(x, UE4M3[se], UE4M3[oe]).astype(np.uint8)
    out = np.empty((B, _BLOCK_BYTES), dtype=np.uint8)
    out[:, :8] = pack_bits(codes, 2)
    out[:, 8] = se
    out[:, 9] = oe
    return out


def _encode_ref(x: np.ndarray, importance: Optional[np.ndarray], codebooks=None) -> np.ndarray:
    rows, cols = x.shape
    nb = cols // _BLOCK
    if importance is None:
        w = None
    else:
        w = importance_weights_ref(x, importance, row_energy_ref(x))  # docs/formats.md#scale-search
    xb = x.reshape(rows * nb, _BLOCK)
    wb = None if w is None else w.reshape(rows * nb, _BLOCK)
    out = np.empty((rows * nb, _BLOCK_BYTES), dtype=np.uint8)
    for a in range(0, rows * nb, _BLOCK_CHUNK):
        b = min(a + _BLOCK_CHUNK, rows * nb)
        out[a:b] = _encode_blocks_ref(xb[a:b], None if wb is None else wb[a:b])
    return out.reshape(rows, nb * _BLOCK_BYTES)


def _decode_ref(data: np.ndarray, cols: int, codebooks=None, modes=None) -> np.ndarray:
    rows = data.shape[0]
    nb = cols // _BLOCK
    blocks = data.reshape(rows * nb, _BLOCK_BYTES)
    codes = unpack_bits(blocks[:, :8], 2, _BLOCK).astype(np.float32)
    s = UE4M3[blocks[:, 8]]
    o = UE4M3[blocks[:, 9]]
    y = (codes * s[:, None]).astype(np.float32) - o[:, None]  # two roundings
    return y.astype(np.float32).reshape(rows, cols)


# --------------------------------------------------------------------------
# numba fast path: same arithmetic. The sweeps run the 126 candidates as the
# inner (vectorised) loop and the elements as the outer one, so every
# candidate's error is still summed in element order.

# Scale table padded to 128 lanes; lanes 0 and 127 are dummies never read back.
_SWEEP_S = UE4M3[:128].copy()
_SWEEP_S[0] = 1.0
_SWEEP_S[127] = 1.0
_SWEEP_S.setflags(write=False)
# Offset table: lanes 0..126 are S(0..126) (S(0) = 0), lane 127 a dummy.
_SWEEP_O = UE4M3[:128].copy()
_SWEEP_O[127] = 0.0
_SWEEP_O.setflags(write=False)

_NB = dict(cache=True, nogil=True, error_model="numpy")


@numba.njit(**_NB)
def _weights_nb(row, q, sigma2, w):
    """The importance weights (docs/formats.md#scale-search) of one row into w (the shared per-element helper)."""
    for i in range(row.shape[0]):
        w[i] = _weight_nb(FP2, row[i], q[i], sigma2)  # any Lucebox format: the clamped form


@numba.njit(**_NB)
def _sweep_scale_nb(xv, wv, n, o, err):
    """err[e] = A(e, o) for e = 1..126 (lanes 0 and 127 are junk)."""
    half = _F32(0.5)
    zero = _F32(0.0)
    three = _F32(3.0)
    for e in range(128):
        err[e] = zero
    for i in range(n):
        xi = xv[i]
        wi = wv[i]
        xo = xi + o
        for e in range(128):
            s = _SWEEP_S[e]
            c = np.floor(xo / s + half)
            c = zero if c < zero else c
            c = three if c > three else c
            d = xi - (c * s - o)
            err[e] += (wi * d) * d


@numba.njit(**_NB)
def _sweep_offset_nb(xv, wv, n, s, err):
    """err[e] = A(se, e) for e = 0..126 with s = S(se) (lane 127 is junk)."""
    half = _F32(0.5)
    zero = _F32(0.0)
    three = _F32(3.0)
    for e in range(128):
        err[e] = zero
    if s > zero:
        for i in range(n):
            xi = xv[i]
            wi = wv[i]
            for e in range(128):
                o = _SWEEP_O[e]
                c = np.floor((xi + o) / s + half)
                c = zero if c < zero else c
                c = three if c > three else c
                d = xi - (c * s - o)
                err[e] += (wi * d) * d
    else:
        # acode is 0 for a zero scale: y = (0*s) - o.
        for i in range(n):
            xi = xv[i]
            wi = wv[i]
            for e in range(128):
                o = _SWEEP_O[e]
                d = xi - (zero * s - o)
                err[e] += (wi * d) * d


@numba.njit(**_NB)
def _error_at_zero_scale_nb(xv, wv, n, o):
    """A(0, oe): every code is 0, so y = -o."""
    acc = _F32(0.0)
    for i in range(n):
        d = xv[i] - (_F32(0.0) * _F32(0.0) - o)
        acc += (wv[i] * d) * d
    return acc


@numba.njit(**_NB)
def _adopt_nb(err, lo, cur, best):
    """The sweep rule (docs/formats.md#rocmfp2-affine) over e = lo..126 with incumbent (cur, best)."""
    for e in range(lo, 127):
        v = err[e]
        if v < best or (v == best and e < cur):
            cur = e
            best = v
    return cur


@numba.njit(**_NB)
def _encode_block_nb(xb, wb, has_w, xv, wv, err, out):
    """Encode one block xb (32,) with weights wb (32,) into out (10,)."""
    zero = _F32(0.0)
    n = 0
    nfin = 0
    mn_w = _F32(np.inf)
    mx_w = _F32(-np.inf)
    mn_f = _F32(np.inf)
    mx_f = _F32(-np.inf)
    for i in range(_BLOCK):
        v = xb[i]
        if np.isfinite(v):
            nfin += 1
            if v < mn_f:
                mn_f = v
            if v > mx_f:
                mx_f = v
            wi = wb[i] if has_w else _F32(1.0)
            if wi > zero:
                xv[n] = v
                wv[n] = wi
                n += 1
                if v < mn_w:
                    mn_w = v
                if v > mx_w:
                    mx_w = v
    mn = mn_w if n > 0 else mn_f
    mx = mx_w if n > 0 else mx_f
    for j in range(_BLOCK_BYTES):
        out[j] = 0
    if nfin == 0 or (mn == zero and mx == zero):
        return
    off0 = -mn if -mn > zero else zero
    sc0 = (mx + off0) / _F32(3.0)
    if sc0 < _TINY:
        sc0 = _TINY
    se = nearest_nb(sc0)
    oe = nearest_nb(off0)
    # Sweep A
    _sweep_scale_nb(xv, wv, n, UE4M3[oe], err)
    best = err[se] if se > 0 else _error_at_zero_scale_nb(xv, wv, n, UE4M3[oe])
    se = _adopt_nb(err, 1, se, best)
    # Sweep B
    _sweep_offset_nb(xv, wv, n, UE4M3[se], err)
    oe_b = _adopt_nb(err, 0, oe, err[oe])
    # Sweep C. With the offset unchanged it would repeat sweep A exactly and
    # keep se (already the smallest argmin byte), so it is skipped.
    if oe_b != oe:
        oe = oe_b
        _sweep_scale_nb(xv, wv, n, UE4M3[oe], err)
        best = err[se] if se > 0 else _error_at_zero_scale_nb(xv, wv, n, UE4M3[oe])
        se = _adopt_nb(err, 1, se, best)
    s = UE4M3[se]
    o = UE4M3[oe]
    if s > zero:
        for i in range(_BLOCK):
            v = xb[i]
            if not np.isfinite(v):
                v = zero
            c = np.floor((v + o) / s + _F32(0.5))
            c = zero if c < zero else c
            c = _F32(3.0) if c > _F32(3.0) else c
            out[i >> 2] |= np.uint8(np.int64(c) << (2 * (i & 3)))
    out[8] = se
    out[9] = oe


@numba.njit(cache=True, parallel=True, nogil=True, error_model="numpy")
def _encode_nb(x, q, has_w, out):
    rows, cols = x.shape
    nb = cols // _BLOCK
    for r in numba.prange(rows):
        row = x[r]
        w = np.ones(cols, dtype=np.float32)
        if has_w:
            _weights_nb(row, q, row_energy_nb(row), w)
        xv = np.empty(_BLOCK, dtype=np.float32)
        wv = np.empty(_BLOCK, dtype=np.float32)
        err = np.empty(128, dtype=np.float32)
        for b in range(nb):
            _encode_block_nb(
                row[b * _BLOCK:(b + 1) * _BLOCK],
                w[b * _BLOCK:(b + 1) * _BLOCK],
                has_w,
                xv,
                wv,
                err,
                out[r, b * _BLOCK_BYTES:(b + 1) * _BLOCK_BYTES],
            )


def _encode_fast(x: np.ndarray, importance: Optional[np.ndarray], codebooks=None) -> np.ndarray:
    rows, cols = x.shape
    out = np.empty((rows, (cols // _BLOCK) * _BLOCK_BYTES), dtype=np.uint8)
    if rows:
        has_w = importance is not None
        q = np.ascontiguousarray(importance, dtype=np.float32) if has_w else np.zeros(cols, np.float32)
        _encode_nb(np.ascontiguousarray(x, dtype=np.float32), q, has_w, out)
    return out


@numba.njit(cache=True, parallel=True, nogil=True, error_model="numpy")
def _decode_nb(data, cols, out):
    rows = data.shape[0]
    nb = cols // _BLOCK
    for r in numba.prange(rows):
        for b in range(nb):
            base = b * _BLOCK_BYTES
            s = UE4M3[data[r, base + 8]]
            o = UE4M3[data[r, base + 9]]
            for i in range(_BLOCK):
                code = (data[r, base + (i >> 2)] >> (2 * (i & 3))) & 3
                y = _F32(code) * s
                out[r, b * _BLOCK + i] = y - o


def _decode_fast(data: np.ndarray, cols: int, codebooks=None, modes=None) -> np.ndarray:
    out = np.empty((data.shape[0], cols), dtype=np.float32)
    if data.shape[0]:
        _decode_nb(np.ascontiguousarray(data), cols, out)
    return out


def _decode_torch(data, cols: int, codebooks=None, modes=None):
    import torch

    rows = data.shape[0]
    nb = cols // _BLOCK
    blocks = data.reshape(rows, nb, _BLOCK_BYTES)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=data.device)
    codes = ((blocks[:, :, :8, None] >> shifts) & 3).reshape(rows, nb, _BLOCK).to(torch.float32)
    table = torch.from_numpy(UE4M3.copy()).to(data.device)
    s = table[blocks[:, :, 8].long()]
    o = table[blocks[:, :, 9].long()]
    y = codes * s[:, :, None]  # rounded once
    y = y - o[:, :, None]  # rounded again: no fused multiply-add
    return y.reshape(rows, cols)


QTYPE = register(
    QType(
        name="rocmfp2_affine",
        ggml_type=107,
        variant="fp2-affine",
        block_size=_BLOCK,
        block_bytes=8 + 1 + 1,
        layout="qs[8] 2-bit codes + e[0] UE4M3 scale byte + e[1] UE4M3 offset byte",
        family="rocmfpx",
        runtimes=(RT_DS4QUANT, RT_LUCEBOX_AFFINE),
        description=(
            "ROCmFP2 affine, y = code*S(e0) - S(e1) with codes 0..3 (2.5 bpw). Loadable only by a "
            "Lucebox built with ROCMFP2_AFFINE; ggml id 107 alone cannot tell it apart from the "
            "default ROCmFP2 (or other forks' 107), so artifacts carry the variant tag."
        ),
    ),
    Codec(
        encode_ref=_encode_ref,
        encode_fast=_encode_fast,
        decode_ref=_decode_ref,
        decode_fast=_decode_fast,
        decode_torch=_decode_torch,
    ),
)
