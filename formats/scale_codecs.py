"""The scale-search machinery shared by ROCmFP2/3/4/6/8 and ROCmFP2 S40.

docs/formats.md#scale-search (row energy, importance weights, scale search),
with the element quantisers of FP2, FP3, FP6, FP8 and FP4 (docs/formats.md#rocmfp2, #rocmfp3, #rocmfp6, #rocmfp8,
#rocmfp4), plus the S40 fork quantiser (see ``rocmfp2_s40``).

Each format encodes a *group* (a 16-weight half, or a 32-weight block) with
one UE4M3 scale byte ``e`` and one code per weight. A decoded weight is
``LEVELS[fmt][code] * SCALES[fmt][e]``, one float32 product.

Two implementations that must give the same bytes:

* ``*_ref`` (numpy): reads like docs/formats.md. The scale search evaluates all 126
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
  returns exactly the argmin docs/formats.md defines.

The search picks ``lexmin((err(e), e))`` over the candidates ``e = 1..126``
whose error is not NaN, together with an initial pair:

* Lucebox FP2/FP3/FP6/FP8: ``(+inf, 127)``, so "smallest e among the minimum
  errors, +inf == +inf" (docs/formats.md#scale-search; all-inf gives e = 1);
* FP4/FP4-FAST: ``(FLT_MAX, 0)`` -- an error >= FLT_MAX is never chosen (docs/formats.md#scale-search);
* S40: ``(+inf, N_fork(max/4))`` as in the fork's walk, or ``(err(0), 0)``
  with the fork's later zero-scale seed (``zero_seed=True``).

Lucebox errors are never NaN (weights are clamped to FLT_MAX). The S40 fork
does not clamp, so an infinite weight times a zero difference gives NaN;
such a candidate is never chosen, and a NaN seed error keeps byte 0, exactly
as the fork's comparisons behave.

The tables live in ``search.tables``, the reference in ``_scale_search_ref``,
the fast path in ``_scale_search_nb`` (the rows' energies in
``search.numba_scale``); this module packs blocks and builds the codecs
(``make_codec``), and re-exports the tables and the reference's steps for the
codec tests, which reach them through ``ss.``.
"""

from __future__ import annotations

import numpy as np

from ds4quant.formats.bits import pack_bits, pack_nibbles_split, unpack_bits, unpack_nibbles_split
from ds4quant.formats._scale_search_nb import decode_rows_nb, encode_rows_nb
from ds4quant.formats.search.numba_scale import row_energy_nb, row_energy_s40_nb  # noqa: F401  (re-exported)
from ds4quant.formats._scale_search_ref import (  # noqa: F401  (re-exported)
    candidate_errors_ref, decode_values_ref, encode_groups_ref, fork_nearest_ref, importance_weights_ref,
    importance_weights_s40_ref, quantize_ref, row_energy_ref, row_energy_s40_ref, search_ref,
)
from ds4quant.formats.search.tables import (  # noqa: F401  (re-exported)
    BITS, F32, FORMAT_NAMES, FP2, FP3, FP4, FP6, FP8, LEVELS, S40, SCALES, TOP, ZERO_CODE,
)
from ds4quant.formats.ue4m3 import UE4M3_INV  # noqa: F401  (re-exported)



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
