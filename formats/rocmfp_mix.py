"""ROCmFP MIX: ggml 106 (2-bit, 10 B/32) and 105 (3-bit, 14 B/32), docs/formats.md#mix.

The wire is the uniform ROCmFP2 / ROCmFP3 block (docs/formats.md#rocmfp2, #rocmfp3); only the two
half bytes change meaning. They are "meta" bytes, 7-bit scale + 1-bit book::

    meta = book << 7 | e          e: UE4M3 byte 0..126 (docs/formats.md#ue4m3), book: 0 or 1
    106 block: qs[8]  2-bit codes, weight i at bits 2i..2i+1 of qs (LE)
               + e[2] meta (weights 0-15, 16-31)                    = 10 B
    105 block: qs[12] 3-bit codes, weight i at bits 3i..3i+2 of the
               96-bit LE stream + e[2] meta                          = 14 B

A code indexes one of L levels (L = 4 for 106, 8 for 105) of the selected
book. The books live out of band, one (2, L) bf16 pair and a mode byte per
expert (docs/formats.md#mix; see ds4quant.codebooks for the tables that carry them).

Decode (docs/formats.md#mix):
    mode 1 (codebook): y = S(meta & 0x7F) * level[meta >> 7][code]
    mode 0 (fixed):    y = V(code) * S(meta); the WHOLE meta byte is the
                       scale, so bit 7 set -> scale 0. V is 106: code - 1,
                       105: FP3 sign-magnitude {0, 1, 2, 4, +0, -1, -2, -4}.

Encode: ``mode=1`` (default) is docs/formats.md#mix-encoder, the Lucebox CPU reference
``quantize_row_fp{2,3}_mix_ref``, byte for byte. ``mode=0`` is ds4quant's own
fixed-level encoder (no public one exists, docs/formats.md#mix-encoder): per half the UE4M3 byte
1..126 with the least raw-importance-weighted error, ties to the smaller byte,
with the rocmfp2 / rocmfp3 element quantiser (docs/formats.md#rocmfp2, #rocmfp3); zero halves get meta 0; the same inputs are
refused. Its rows must be decoded with mode 0.
"""

from __future__ import annotations

from typing import Optional

import numba
import numpy as np

from ds4quant.errors import BadInputError
from ds4quant.formats.bits import pack_bits, unpack_bits
from ds4quant.formats.qtype import RT_DS4QUANT, RT_LUCEBOX, Codec, QType, register
from ds4quant.formats.search import numba_mix, numba_pack
from ds4quant.formats.search.numba_mix import max_level, splits
from ds4quant.formats.search.numba_pack import NO_CANDIDATE, NONFINITE, refuse
from ds4quant.formats.search.tables import FIXED_105, FIXED_106, HALF
from ds4quant.formats.ue4m3 import UE4M3, UE4M3_INV, nearest_ref

_HALF_CHUNK = 1 << 15  # halves per numpy-reference chunk (bounds memory of N(t))

_FIXED_SPLITS_106 = np.array([-0.5, 0.5, 1.5], dtype=np.float32)  # docs/formats.md#rocmfp2 thresholds


# --------------------------------------------------------------------------
# numpy reference


def _nl_ref(v: np.ndarray, split: np.ndarray) -> np.ndarray:
    """NL(v): binary search over the levels, ties to the lower level (docs/formats.md#mix-encoder)."""
    lo = np.zeros(v.shape, dtype=np.int64)
    hi = np.full(v.shape, split.shape[0], dtype=np.int64)  # L - 1
    active = lo < hi
    while np.any(active):
        mid = (lo + hi) // 2
        go_low = v <= split[np.minimum(mid, split.shape[0] - 1)]
        hi = np.where(active & go_low, mid, hi)
        lo = np.where(active & ~go_low, mid + 1, lo)
        active = lo < hi
    return lo


def _encode_halves_ref(h: np.ndarray, w: Optional[np.ndarray], books: np.ndarray):
    """Encode halves h float32 (n, 16) with weights w (n, 16) or None.

    Returns (meta uint8 (n,), codes uint8 (n, 16), status int8 (n,)).
    """
    n = h.shape[0]
    split = splits(books)
    ml = max_level(books)
    status = np.zeros(n, dtype=np.int8)
    with np.errstate(over="ignore", invalid="ignore"):
        finite = np.all(np.isfinite(h), axis=1)
        m = np.abs(h).max(axis=1)
        zero = m == 0
        if w is None:
            w_bad = np.zeros(n, dtype=bool)
            wcol = np.ones((n, HALF), dtype=np.float32)
        else:
            w_bad = ~np.all(np.isfinite(w) & (w >= 0), axis=1)
            wcol = w
        best_err = np.full(n, np.inf, dtype=np.float32)
        best_b = np.zeros(n, dtype=np.int64)
        best_e = np.ones(n, dtype=np.int64)
        for b in range(2):
            if not (ml[b] > 0):
                continue
            centre = nearest_ref((m / ml[b]).astype(np.float32)).astype(np.int64)
            for delta in range(-2, 3):
                e = centre + delta
                valid = (e >= 1) & (e <= 126)
                ec = np.clip(e, 1, 126)
                s, inv = UE4M3[ec], UE4M3_INV[ec]
                err = np.zeros(n, dtype=np.float32)
                for i in range(HALF):  # float32 sum in element order
                    xi = h[:, i]
                    j = _nl_ref(xi * inv, split[b])
                    d = xi - s * books[b][j]
                    err = err + (wcol[:, i] * d) * d
                err[w_bad] = np.inf
                better = (err < best_err) | (
                    (err == best_err) & ((b < best_b) | ((b == best_b) & (e < best_e)))
                )
                adopt = valid & better
                best_err = np.where(adopt, err, best_err)
                best_b = np.where(adopt, b, best_b)
                best_e = np.where(adopt, e, best_e)
        # zero half: book 0, byte 0 (docs/formats.md#mix-encoder step 2)
        best_b[zero] = 0
        best_e[zero] = 0
        status[~zero & (best_err == np.inf)] = NO_CANDIDATE
        status[~finite] = NONFINITE
        # codes: NL(x * (1/S)) in the chosen book; NL(0) when S = 0
        inv = UE4M3_INV[best_e][:, None]
        v = np.where(zero[:, None], np.float32(0.0), h * inv).astype(np.float32)
        codes = np.where(best_b[:, None] == 0, _nl_ref(v, split[0]), _nl_ref(v, split[1]))
    meta = (best_e | (best_b << 7)).astype(np.uint8)
    return meta, codes.astype(np.uint8), status


def _fixed_codes_ref(v: np.ndarray, bits: int) -> np.ndarray:
    """Mode-0 element quantiser: 106 is rocmfp2's nearest of {-1, 0, 1, 2} (ties to
    the lower code), 105 is rocmfp3's sign + {0, 1, 2, 4} (ties to the lower magnitude)."""
    if bits == 2:
        return _nl_ref(v, _FIXED_SPLITS_106)
    a = np.abs(v)
    idx = (a > 0.5).astype(np.int64) + (a > 1.5) + (a > 3.0)
    return np.where((v < 0) & (idx != 0), idx | 4, idx)


def _encode_halves_fixed_ref(h: np.ndarray, w: Optional[np.ndarray], bits: int):
    """Mode 0 (ds4quant's encoder; no public reference exists, docs/formats.md#mix-encoder): per half
    the byte e in 1..126 with the least raw-weighted error (ties to the smaller
    byte), fixed levels, meta = e (bit 7 clear). Same refusals as mode 1."""
    n = h.shape[0]
    fixed = FIXED_106 if bits == 2 else FIXED_105
    status = np.zeros(n, dtype=np.int8)
    with np.errstate(over="ignore", invalid="ignore"):
        finite = np.all(np.isfinite(h), axis=1)
        zero = np.abs(h).max(axis=1) == 0
        w_bad = np.zeros(n, dtype=bool) if w is None else ~np.all(np.isfinite(w) & (w >= 0), axis=1)
        wcol = np.ones((n, HALF), dtype=np.float32) if w is None else w
        best_err = np.full(n, np.inf, dtype=np.float32)
        best_e = np.ones(n, dtype=np.int64)
        for e in range(1, 127):
            s, inv = UE4M3[e], UE4M3_INV[e]
            err = np.zeros(n, dtype=np.float32)
            for i in range(HALF):
                xi = h[:, i]
                d = xi - s * fixed[_fixed_codes_ref(xi * inv, bits)]
                err = err + (wcol[:, i] * d) * d
            err[w_bad] = np.inf
            adopt = err < best_err
            best_err = np.where(adopt, err, best_err)
            best_e = np.where(adopt, e, best_e)
        best_e[zero] = 0
        status[~zero & (best_err == np.inf)] = NO_CANDIDATE
        status[~finite] = NONFINITE
        v = (h * UE4M3_INV[best_e][:, None]).astype(np.float32)
        v[zero] = 0
        codes = _fixed_codes_ref(v, bits)
    return best_e.astype(np.uint8), codes.astype(np.uint8), status


def _encode_ref(x: np.ndarray, importance, books: np.ndarray, *, qt: QType, bits: int, mode: int = 1) -> np.ndarray:
    """mode 1: the Lucebox reference (docs/formats.md#mix-encoder); mode 0: fixed levels (ours)."""
    if mode not in (0, 1):
        raise BadInputError(f"{qt.name} encoder: mode must be 0 or 1, got {mode!r}")
    rows, cols = x.shape
    hpr = cols // HALF  # halves per row
    nb = cols // 32
    qs_bytes = 32 * bits // 8
    out = np.zeros((rows, nb, qs_bytes + 2), dtype=np.uint8)
    w_row = None if importance is None else importance.reshape(hpr, HALF)
    rows_per_chunk = max(1, _HALF_CHUNK // hpr)
    for r0 in range(0, rows, rows_per_chunk):
        r1 = min(rows, r0 + rows_per_chunk)
        h = x[r0:r1].reshape(-1, HALF)
        w = None if w_row is None else np.tile(w_row, (r1 - r0, 1))
        meta, codes, status = _encode_halves_ref(h, w, books) if mode == 1 else _encode_halves_fixed_ref(h, w, bits)
        bad = np.flatnonzero(status)
        if len(bad):  # the reference stops at the first bad half in row order
            i = int(bad[0])
            refuse(qt.name, int(status[i]), r0 + i // hpr, (i % hpr) // 2, i % 2)
        out[r0:r1, :, :qs_bytes] = pack_bits(codes.reshape(-1, 32), bits).reshape(r1 - r0, nb, qs_bytes)
        out[r0:r1, :, qs_bytes:] = meta.reshape(r1 - r0, nb, 2)
    return out.reshape(rows, nb * (qs_bytes + 2))


def _decode_ref(data: np.ndarray, cols: int, books: np.ndarray, modes: int, *, bits: int, fixed: np.ndarray) -> np.ndarray:
    rows = data.shape[0]
    nb = cols // 32
    qs_bytes = 32 * bits // 8
    blk = data.reshape(rows * nb, qs_bytes + 2)
    codes = unpack_bits(blk[:, :qs_bytes], bits, 32).astype(np.int64).reshape(-1, 2, HALF)
    meta = blk[:, qs_bytes:].astype(np.int64)[:, :, None]  # (blocks, 2, 1)
    if modes == 1:
        scale = UE4M3[meta & 0x7F]
        level = books[meta >> 7, codes]
    else:
        scale = UE4M3[meta]  # whole byte: bit 7 set -> 0
        level = fixed[codes]
    return (scale * level).astype(np.float32).reshape(rows, cols)


# --------------------------------------------------------------------------
# numba fast path: the search of ``search.numba_mix`` and the packing of
# ``search.numba_pack`` (its refusals are the reference's), and the decode


def _encode_fast(x: np.ndarray, importance, books: np.ndarray, *, qt: QType, bits: int, mode: int = 1) -> np.ndarray:
    """Numba twin of ``_encode_ref`` (same bytes, same refusals)."""
    if mode not in (0, 1):
        raise BadInputError(f"{qt.name} encoder: mode must be 0 or 1, got {mode!r}")
    rows, cols = x.shape
    choices = numba_mix.choose(np.ascontiguousarray(x, dtype=np.float32), importance,
                               np.ascontiguousarray(books, dtype=np.float32), mode, bits)
    return numba_pack.pack(qt, choices, mode, bits, rows, cols)


@numba.njit(cache=True, parallel=True, nogil=True)
def _decode_nb(data, cols, books, mode, fixed, bits, out):
    rows = data.shape[0]
    nb = cols // 32
    qs_bytes = 32 * bits // 8
    bb = qs_bytes + 2
    mask = (1 << bits) - 1
    for r in numba.prange(rows):
        for blk in range(nb):
            o = blk * bb
            for i in range(32):
                pos = bits * i
                byte = pos >> 3
                sh = pos & 7
                word = np.int64(data[r, o + byte])
                if sh + bits > 8:
                    word |= np.int64(data[r, o + byte + 1]) << 8
                code = (word >> sh) & mask
                meta = np.int64(data[r, o + qs_bytes + i // 16])
                if mode == 1:
                    y = np.float32(UE4M3[meta & 0x7F] * books[meta >> 7, code])
                else:
                    y = np.float32(fixed[code] * UE4M3[meta])
                out[r, blk * 32 + i] = y


def _decode_fast(data: np.ndarray, cols: int, books: np.ndarray, modes: int, *, bits: int, fixed: np.ndarray) -> np.ndarray:
    out = np.empty((data.shape[0], cols), dtype=np.float32)
    _decode_nb(data, cols, np.ascontiguousarray(books, dtype=np.float32), int(modes), fixed, bits, out)
    return out


# --------------------------------------------------------------------------
# torch decode: one gather for the level, one for the scale, one multiply


def _decode_torch(data, cols: int, books, modes: int, *, bits: int, fixed: np.ndarray):
    import torch

    dev = data.device
    rows = data.shape[0]
    nb = cols // 32
    qs_bytes = 32 * bits // 8
    blk = data.reshape(rows * nb, qs_bytes + 2).to(torch.int64)
    shifts = torch.arange(8, device=dev, dtype=torch.int64)
    stream = ((blk[:, :qs_bytes, None] >> shifts) & 1).reshape(-1, 32, bits)
    weights = torch.tensor([1 << j for j in range(bits)], device=dev, dtype=torch.int64)
    codes = (stream * weights).sum(dim=2).reshape(-1, 2, HALF)
    meta = blk[:, qs_bytes:].reshape(-1, 2, 1)
    table = torch.from_numpy(UE4M3.copy()).to(dev)
    if modes == 1:
        scale = table[meta & 0x7F]
        level = books.to(device=dev, dtype=torch.float32).reshape(-1)[(meta >> 7) * books.shape[-1] + codes]
    else:
        scale = table[meta]
        level = torch.from_numpy(fixed.copy()).to(dev)[codes]
    return (scale * level).reshape(rows, cols)


# --------------------------------------------------------------------------
# registration


def _bind(fn, **kw):
    def call(*args, **options):
        return fn(*args, **kw, **options)

    call.__name__ = fn.__name__
    call.__doc__ = fn.__doc__
    return call


_RUNTIMES = (RT_DS4QUANT, RT_LUCEBOX)

ROCMFP2_MIX = QType(
    name="rocmfp2_mix",
    ggml_type=106,
    variant="mix106-7s1c",
    block_size=32,
    block_bytes=8 + 2,
    layout="qs[8] 2-bit codebook indices + e[2] meta bytes (book << 7 | UE4M3 scale) per half",
    family="rocmfpx-mix",
    runtimes=_RUNTIMES,
    row_multiple=128,
    codebook_levels=4,
    description=(
        "Q2_1_ROCMFP2_MIX: 2-bit index into one of two 4-level bf16 books per expert, 7-bit scale "
        "+ 1-bit book per 16 weights. Needs out-of-band per-expert codebooks and modes (Lucebox loads "
        "106 on any routed surface via a GUMIXs1 blob, dense tensors via DMIXs1); rows need cols % 128 == 0."
    ),
)

ROCMFP3_MIX = QType(
    name="rocmfp3_mix",
    ggml_type=105,
    variant="mix105-7s1c",
    block_size=32,
    block_bytes=12 + 2,
    layout="qs[12] 3-bit codebook indices + e[2] meta bytes (book << 7 | UE4M3 scale) per half",
    family="rocmfpx-mix",
    runtimes=_RUNTIMES,
    row_multiple=32,
    codebook_levels=8,
    description=(
        "Q3_1_ROCMFP3_MIX: 3-bit index into one of two 8-level bf16 books per expert, 7-bit scale "
        "+ 1-bit book per 16 weights. Needs out-of-band per-expert codebooks and modes (Lucebox loads "
        "105 only on routed down experts via a P4MIXv1 blob, dense tensors via DMIXs1)."
    ),
)

for _qt, _bits, _fixed in ((ROCMFP2_MIX, 2, FIXED_106), (ROCMFP3_MIX, 3, FIXED_105)):
    register(
        _qt,
        Codec(
            encode_ref=_bind(_encode_ref, qt=_qt, bits=_bits),
            encode_fast=_bind(_encode_fast, qt=_qt, bits=_bits),
            decode_ref=_bind(_decode_ref, bits=_bits, fixed=_fixed),
            decode_fast=_bind(_decode_fast, bits=_bits, fixed=_fixed),
            decode_torch=_bind(_decode_torch, bits=_bits, fixed=_fixed),
            encode_options=("mode",),
        ),
    )
