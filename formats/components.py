"""The parts a decoded weight is made of: codes, level tables, scales.

Every quantized ROCmFPX / MIX / MXFP4 / Q8_0 weight decodes as one float32
product of a *level* (a small integer, or a bf16 MIX book entry) and a
per-group *scale* (UE4M3, E8M0 or f16), docs/formats.md#levels, #mix::

    y = levels[table[g], codes[i]] * scale[g]                 g = i // group
    y = (levels[0, codes[i]] * scale[g]) - offset[g]          rocmfp2_affine (docs/formats.md#rocmfp2-affine)
    y = scale[i]                                              plain (group 1)

``components`` returns those parts for a block array and ``Components.recompose``
rebuilds ``formats.decode``'s float32 bits exactly (a test checks every qtype,
NaN payloads and signed zeros included). An exact integer execution path uses
``exact_parts``: every finite float32 is ``mant * 2^exp`` with an odd (or zero)
integer ``mant`` of at most 24 bits, so a level is an integer times a power
of two and a scale is one too: a weight is an integer times a dyadic scale.

``decode_row_nb`` is the numba row decoder for every family, with one
dispatcher so a kernel that decodes rows inside a product compiles once.

Example::

    c = formats.components("rocmfp2", q, 4096)
    assert np.array_equal(c.recompose().view(np.uint32), formats.decode("rocmfp2", q, 4096).view(np.uint32))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numba
import numpy as np

from ds4quant.errors import CodebookError, UnsupportedFormatError
from ds4quant.formats.scale_codecs import unpack_ref
from ds4quant.formats.bits import unpack_bits, unpack_nibbles_split
from ds4quant.formats.checks import as_blocks, check_codebooks, check_modes, split_experts
from ds4quant.formats.mxfp4 import KV as _MXFP4_KV
from ds4quant.formats.mxfp4 import half_scale as _e8m0_half
from ds4quant.formats.qtype import get_codec, get_qtype
from ds4quant.formats.search.tables import (BITS, FIXED_105, FIXED_106, FP2, FP3, FP4, FP6, FP8, LEVELS, S40,
                                            SCALES)
from ds4quant.formats.ue4m3 import UE4M3

__all__ = [
    "Components", "components", "exact_parts", "row_kind", "row_lut", "decode_row_nb", "chunk_nb",
    "K_SCALE", "K_AFFINE", "K_MIX", "K_MXFP4", "K_Q8_0", "K_BF16", "K_F16", "K_F32",
    "LEVELS", "SCALES", "BITS", "FP2", "FP3", "E8M0_HALF", "F16_TABLE", "Q8_LEVELS",
]

# Row-decoder families (the ``kind`` of ``decode_row_nb``).
K_SCALE, K_AFFINE, K_MIX, K_MXFP4, K_Q8_0, K_BF16, K_F16, K_F32 = range(8)

# Scale-search qtypes: element format and weights per scale (the codec modules' _GROUP).
_SCALE_QTYPES = {
    "rocmfp2": (FP2, 16),
    "rocmfp2_s40": (S40, 16),
    "rocmfp3": (FP3, 16),
    "rocmfp4": (FP4, 16),
    "rocmfp4_fast": (FP4, 32),
    "rocmfp6": (FP6, 16),
    "rocmfp8": (FP8, 32),
}
_MIX_BITS = {"rocmfp2_mix": 2, "rocmfp3_mix": 3}
_PLAIN = {"bf16": K_BF16, "f16": K_F16, "f32": K_F32}

# Mode-0 MIX levels (docs/formats.md#mix): 106 is code - 1, 105 is FP3 sign-magnitude.
_FIXED = {2: FIXED_106, 3: FIXED_105}

#: float32 value of every f16 word, as numpy converts (NaN payloads kept).
F16_TABLE = np.arange(65536, dtype=np.uint32).astype(np.uint16).view("<f2").astype(np.float32)
F16_TABLE.setflags(write=False)
#: ggml GGML_E8M0_TO_FP32_HALF of every byte (MXFP4 block scale).
E8M0_HALF = _e8m0_half(np.arange(256)).astype(np.float32)
E8M0_HALF.setflags(write=False)
#: int8 value of every Q8_0 code byte, as float32.
Q8_LEVELS = np.arange(256, dtype=np.int64).astype(np.uint8).view(np.int8).astype(np.float32)
Q8_LEVELS.setflags(write=False)


def row_kind(qtype: str) -> tuple[int, int, int]:
    """(kind, p0, p1) of ``decode_row_nb`` for a qtype name.

    scale-search: (K_SCALE, fmt, group); MIX: (K_MIX, bits, 0); others (kind, 0, 0).
    """
    if qtype in _SCALE_QTYPES:
        fmt, group = _SCALE_QTYPES[qtype]
        return K_SCALE, fmt, group
    if qtype == "rocmfp2_affine":
        return K_AFFINE, 0, 0
    if qtype in _MIX_BITS:
        return K_MIX, _MIX_BITS[qtype], 0
    if qtype == "mxfp4":
        return K_MXFP4, 0, 0
    if qtype == "q8_0":
        return K_Q8_0, 0, 0
    if qtype in _PLAIN:
        return _PLAIN[qtype], 0, 0
    raise UnsupportedFormatError(f"qtype {qtype!r} has no weight components (not an expert weight format)")


@dataclass(frozen=True, eq=False)
class Components:
    """Parts of a decoded (rows, cols) weight array; see the module docstring.

    codes: uint8 (rows, cols) code of each weight (None for plain types).
    levels: float32 (n_tables, n_codes) level of each code; MIX stacks hold
        two tables per expert (expert e, book b -> table 2e + b; a mode-0
        expert's two tables are the fixed levels).
    table: uint8/int64 (rows, cols // group) level table of each group.
    scale: float32 (rows, cols // group) the decoded group scale (exact dyadic,
        or NaN/Inf where Q8_0 / plain bytes say so).
    offset: float32 (rows, cols // group) for rocmfp2_affine, else None.
    """

    qtype: str
    group: int
    codes: Optional[np.ndarray]
    levels: Optional[np.ndarray]
    table: Optional[np.ndarray]
    scale: np.ndarray
    offset: Optional[np.ndarray] = None

    def recompose(self) -> np.ndarray:
        """float32 (rows, cols), bitwise equal to ``formats.decode``."""
        if self.codes is None:
            return self.scale.copy()
        rows, cols = self.codes.shape
        tab = np.repeat(self.table, self.group, axis=1)
        lv = self.levels[tab, self.codes]
        s = np.repeat(self.scale, self.group, axis=1)
        with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf scales decode as such
            y = (lv * s).astype(np.float32)
            if self.offset is not None:
                y = (y - np.repeat(self.offset, self.group, axis=1)).astype(np.float32)
        return y.reshape(rows, cols)


def exact_parts(values: Any) -> tuple[np.ndarray, np.ndarray]:
    """Finite float32 values as ``mant * 2^exp`` exactly: (int64 mant, int64 exp).

    mant is odd, or 0 (then exp is 0); |mant| < 2^24. Raises on NaN/Inf.
    """
    v = np.ascontiguousarray(values, dtype=np.float32)
    if not np.all(np.isfinite(v)):
        raise UnsupportedFormatError("exact_parts: NaN or Inf has no dyadic value")
    f, e = np.frexp(v.astype(np.float64))
    mant = np.rint(np.ldexp(f, 24)).astype(np.int64)  # exact: 24-bit significand
    exp = e.astype(np.int64) - 24
    nz = mant != 0
    tz = np.zeros_like(mant)
    m = np.abs(mant)
    low = m & -m  # lowest set bit
    tz[nz] = np.log2(low[nz].astype(np.float64)).astype(np.int64)  # exact for powers of two
    mant = np.where(nz, mant >> tz, 0)
    exp = np.where(nz, exp + tz, 0)
    return mant, exp


def components(qtype: str, data: Any, cols: int, codebooks: Any = None, modes: Any = None) -> Components:
    """The codes, level tables and scales of encoded ``data`` (rows, row_bytes).

    Arguments as ``formats.decode``: MIX needs codebooks (2, L) or (E, 2, L)
    (rows split evenly over E experts) and optional modes (default 1).
    """
    qt = get_qtype(qtype)
    kind, p0, p1 = row_kind(qt.name)
    blocks = as_blocks(data, qt, cols)
    rows = blocks.shape[0]
    if not qt.is_mix and (codebooks is not None or modes is not None):
        raise CodebookError(f"{qt.name} takes no codebooks or modes")
    if kind == K_SCALE:
        e, codes = unpack_ref(p0, blocks, cols, p1)
        return Components(qt.name, p1, codes, LEVELS[p0][None, :].copy(),
                          np.zeros(e.shape, np.uint8), SCALES[p0][e])
    nb = cols // 32
    if kind == K_AFFINE:
        blk = blocks.reshape(rows * nb, 10)
        codes = unpack_bits(blk[:, :8], 2, 32).reshape(rows, cols)
        lv = np.arange(4, dtype=np.float32)[None, :]
        return Components(qt.name, 32, codes, lv, np.zeros((rows, nb), np.uint8),
                          UE4M3[blk[:, 8]].reshape(rows, nb), UE4M3[blk[:, 9]].reshape(rows, nb))
    if kind == K_MIX:
        books = check_codebooks(qt, codebooks)
        if books.ndim == 2:
            books = books[None]
        n = books.shape[0]
        m = check_modes(modes, n)
        per = split_experts(rows, n, f"{qt.name} components")
        qsb = 4 * p0
        blk = blocks.reshape(rows * nb, qsb + 2)
        codes = unpack_bits(blk[:, :qsb], p0, 32).reshape(rows, cols)
        meta = blk[:, qsb:].reshape(rows, 2 * nb).astype(np.int64)
        expert = np.repeat(np.arange(n), per)[:, None]
        mode1 = m[expert] == 1
        levels = np.empty((2 * n, books.shape[2]), np.float32)
        for i in range(n):
            levels[2 * i:2 * i + 2] = books[i] if m[i] == 1 else _FIXED[p0][None, :]
        table = np.where(mode1, 2 * expert + (meta >> 7), 2 * expert)
        scale = np.where(mode1, UE4M3[meta & 0x7F], UE4M3[meta])  # mode 0: whole byte
        return Components(qt.name, 16, codes, levels, table, scale.astype(np.float32))
    if kind == K_MXFP4:
        blk = blocks.reshape(rows * nb, 17)
        codes = unpack_nibbles_split(blk[:, 1:]).reshape(rows, cols)
        return Components(qt.name, 32, codes, _MXFP4_KV[None, :].copy(), np.zeros((rows, nb), np.uint8),
                          E8M0_HALF[blk[:, 0]].reshape(rows, nb))
    if kind == K_Q8_0:
        blk = blocks.reshape(rows * nb, 34)
        d = F16_TABLE[blk[:, 0].astype(np.int64) | (blk[:, 1].astype(np.int64) << 8)]
        return Components(qt.name, 32, np.ascontiguousarray(blk[:, 2:]).reshape(rows, cols),
                          Q8_LEVELS[None, :].copy(), np.zeros((rows, nb), np.uint8), d.reshape(rows, nb))
    codec = get_codec(qt.name)  # plain floats: the values themselves, as ``formats.decode`` gives them
    return Components(qt.name, 1, None, None, None, (codec.decode_fast or codec.decode_ref)(blocks, cols, None, None))


# --------------------------------------------------------------------------
# numba: one row decoder for every family, driven by per-byte level tables
#
# A block's codes are read in *chunks* of ``per`` codes (``cb`` = per * bits
# stream bits): 2-bit codes 4 per byte, 3-bit 4 per 12 bits, 6-bit 2 per 12
# bits, 8-bit 1 per byte; 4-bit split nibbles (docs/formats.md#rocmfp4, MXFP4) give byte j the
# codes j and j + 16. ``row_lut`` maps each chunk value to its ``per`` levels
# (float32 (books, 2^cb, per)), so decoding is one table row times the scale:
# no per-code shifts or gathers, and the same float32 product as ``decode``.

_CHUNK = {2: (4, 8), 3: (4, 12), 6: (2, 12), 8: (1, 8), 4: (2, 8)}  # bits -> (per, cb)


def _chunk_lut(table: np.ndarray, bits: int) -> np.ndarray:
    """float32 (2^cb, per): the levels of every chunk value of a code table."""
    per, cb = _CHUNK[bits]
    idx = np.arange(1 << cb)
    if bits == 4:
        return np.stack([table[idx & 15], table[idx >> 4]], axis=1).astype(np.float32)
    mask = (1 << bits) - 1
    return np.stack([table[(idx >> (bits * m)) & mask] for m in range(per)], axis=1).astype(np.float32)


_LUT_CACHE: dict = {}


def row_lut(qtype: str, books: Optional[np.ndarray] = None, mode: int = 1) -> np.ndarray:
    """The level table ``decode_row_nb`` needs: float32 (2, 2^cb, per), read-only.

    MIX: from the expert's books (2, L) (mode 1) or the fixed levels (mode 0).
    """
    kind, p0, _ = row_kind(qtype)
    if kind == K_MIX:
        bits = p0
        if mode == 1:
            tabs = [np.asarray(books, np.float32)[b] for b in range(2)]
        else:
            tabs = [_FIXED[bits]] * 2
        lut = np.stack([_chunk_lut(t, bits) for t in tabs])
        lut.setflags(write=False)
        return lut
    hit = _LUT_CACHE.get(qtype)
    if hit is None:
        if kind == K_SCALE:
            lut = _chunk_lut(LEVELS[p0], int(BITS[p0]))
        elif kind == K_AFFINE:
            lut = _chunk_lut(np.arange(4, dtype=np.float32), 2)
        elif kind == K_MXFP4:
            lut = _chunk_lut(_MXFP4_KV, 4)
        else:
            lut = np.zeros((256, 1), np.float32)
        hit = np.ascontiguousarray(np.stack([lut, lut]))
        hit.setflags(write=False)
        _LUT_CACHE[qtype] = hit
    return hit


@numba.njit(cache=True, nogil=True, inline="always")
def chunk_nb(row, o, c, cb):
    """Chunk c of the block's code stream at row[o:] (cb = 8 or 12 bits)."""
    if cb == 8:
        return np.int64(row[o + c])
    pos = 12 * c
    w = np.int64(row[o + (pos >> 3)]) | (np.int64(row[o + (pos >> 3) + 1]) << 8)
    return (w >> (pos & 7)) & 0xFFF


@numba.njit(cache=True, nogil=True, inline="always")
def _group_nb(lut, bk, row, o, bits, g0, n, s, out, base):
    """Decode weights g0 .. g0+n-1 of the block at row[o:] as lut level * s
    (the scale second: ``decode``'s order for every family but MXFP4/Q8_0,
    whose products are commutative anyway)."""
    if bits == 4:  # split nibbles: weight g is nibble g >> 4 of byte g & 15
        for g in range(g0, g0 + n):
            out[base + g] = lut[bk, np.int64(row[o + (g & 15)]), g >> 4] * s
        return
    per = 4 if (bits == 2 or bits == 3) else (2 if bits == 6 else 1)
    cb = 8 if (bits == 2 or bits == 8) else 12
    for c in range(g0 // per, (g0 + n) // per):
        v = chunk_nb(row, o, c, cb)
        for m in range(per):
            out[base + c * per + m] = lut[bk, v, m] * s


@numba.njit(cache=True, nogil=True, inline="always")
def _scale_blocks_nb(lut, row, nb, sc, bits, group, out):
    qsb = 4 * bits
    nsc = 32 // group
    bb = qsb + nsc
    for b in range(nb):
        o = b * bb
        for h in range(nsc):
            _group_nb(lut, 0, row, o, bits, h * group, group, sc[row[o + qsb + h]], out, b * 32)


@numba.njit(cache=True, nogil=True, inline="always")
def _group_any_nb(lut, bk, row, o, bits, g0, n, s, out, base):
    # Literal widths, so each inlined copy of _group_nb has constant chunk
    # sizes that LLVM unrolls and vectorises.
    if bits == 2:
        _group_nb(lut, bk, row, o, 2, g0, n, s, out, base)
    elif bits == 3:
        _group_nb(lut, bk, row, o, 3, g0, n, s, out, base)
    elif bits == 4:
        _group_nb(lut, bk, row, o, 4, g0, n, s, out, base)
    elif bits == 6:
        _group_nb(lut, bk, row, o, 6, g0, n, s, out, base)
    else:
        _group_nb(lut, bk, row, o, 8, g0, n, s, out, base)


@numba.njit(cache=True, nogil=True)
def decode_row_nb(kind, p0, p1, row, cols, lut, mode, out, out_bits):
    """Decode one encoded row into out float32 (cols,) (out_bits: its uint32 view).

    kind/p0/p1 from ``row_kind``; lut from ``row_lut`` (for MIX: the row's
    expert's books and mode, which is passed again). Bitwise equal to ``decode``.
    """
    nb = cols // 32
    if kind == K_SCALE:
        sc = SCALES[p0]
        bits = BITS[p0]
        if bits == 2:  # literal (width, group) pairs: constant loops after inlining
            _scale_blocks_nb(lut, row, nb, sc, 2, 16, out)
        elif bits == 3:
            _scale_blocks_nb(lut, row, nb, sc, 3, 16, out)
        elif bits == 4 and p1 == 16:
            _scale_blocks_nb(lut, row, nb, sc, 4, 16, out)
        elif bits == 4:
            _scale_blocks_nb(lut, row, nb, sc, 4, 32, out)
        elif bits == 6:
            _scale_blocks_nb(lut, row, nb, sc, 6, 16, out)
        else:
            _scale_blocks_nb(lut, row, nb, sc, 8, 32, out)
    elif kind == K_AFFINE:
        for b in range(nb):
            o = b * 10
            s = UE4M3[row[o + 8]]
            off = UE4M3[row[o + 9]]
            _group_nb(lut, 0, row, o, 2, 0, 32, s, out, b * 32)
            for i in range(b * 32, b * 32 + 32):
                out[i] = out[i] - off  # (code * s) - o: two roundings (docs/formats.md#rocmfp2-affine)
    elif kind == K_MIX:
        bits = p0
        qsb = 4 * bits
        bb = qsb + 2
        for b in range(nb):
            o = b * bb
            for h in range(2):
                meta = np.int64(row[o + qsb + h])
                if mode == 1:
                    _group_any_nb(lut, meta >> 7, row, o, bits, 16 * h, 16, UE4M3[meta & 0x7F], out, b * 32)
                else:  # mode 0: fixed levels, the whole byte is the scale (docs/formats.md#mix)
                    _group_any_nb(lut, 0, row, o, bits, 16 * h, 16, UE4M3[meta], out, b * 32)
    elif kind == K_MXFP4:
        for b in range(nb):
            o = b * 17
            d = E8M0_HALF[row[o]]
            _group_nb(lut, 0, row, o + 1, 4, 0, 16, d, out, b * 32)
            _group_nb(lut, 0, row, o + 1, 4, 16, 16, d, out, b * 32)
    elif kind == K_Q8_0:
        for b in range(nb):
            o = b * 34
            d = F16_TABLE[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)]
            for j in range(32):
                out[b * 32 + j] = Q8_LEVELS[row[o + 2 + j]] * d
    elif kind == K_BF16:
        for i in range(cols):
            out_bits[i] = (np.uint32(row[2 * i]) << 16) | (np.uint32(row[2 * i + 1]) << 24)
    elif kind == K_F16:
        for i in range(cols):
            out[i] = F16_TABLE[np.int64(row[2 * i]) | (np.int64(row[2 * i + 1]) << 8)]
    else:
        for i in range(cols):
            o = 4 * i
            out_bits[i] = (np.uint32(row[o]) | (np.uint32(row[o + 1]) << 8) | (np.uint32(row[o + 2]) << 16)
                           | (np.uint32(row[o + 3]) << 24))
