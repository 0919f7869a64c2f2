"""MXFP4 (ggml type 39): OCP microscaling FP4, byte-compatible with gguf-py.

Block layout (17 bytes for 32 weights)::

    e[1]   E8M0 exponent byte
    qs[16] FP4 e2m1 codes, split nibble order:
           qs[j] = code[j] | code[j + 16] << 4      (j = 0..15)

Weight j = KV[code[j]] * 2^(e - 128), where KV = 2 x e2m1 =
(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12) (code 8 is +0 here);
ggml's ``GGML_E8M0_TO_FP32_HALF(e)`` is that 2^(e-128), so a weight is
e2m1(code) * 2^(e-127), the OCP value.

Encoding mirrors ggml's ``quantize_row_mxfp4_ref`` / gguf-py's
``MXFP4.quantize_blocks``: ``amax = max|x|`` (NaN propagates);
``e = floor(log2f(amax)) - 2 + 127`` as a byte (wrapping below 0), or 0 when
amax is 0, NaN or Inf; each code is the first index of the smallest float32
``|d*KV[k] - x|`` (ties to the lower code, NaN inputs to code 0).

``floor(log2f(amax))`` is one more than the exact exponent of ``amax`` when
``amax`` sits a few ulps below a power of two and log2f rounds up to the
integer. We reproduce a correctly rounded log2f with integer thresholds
(``_ROUNDUP_FROM``) so the bytes do not depend on a libm; a test checks the
table against numpy's float32 log2 on every near-power-of-two value.

``mxfp4_from_e2m1`` repacks DeepSeek's FP4 expert layout into these blocks
without loss (the E8M0 byte is the same number in both layouts).
"""

from __future__ import annotations

import numba
import numpy as np

from ds4quant.errors import CorruptDataError, ShapeError
from ds4quant.formats.bits import pack_nibbles_split, unpack_nibbles_split
from ds4quant.formats.fp8 import check_fp4_layout
from ds4quant.formats.qtype import RT_DS4QUANT, RT_GGUF_PY, RT_LLAMA_CPP, RT_LUCEBOX, Codec, QType, register

BLOCK = 32
BLOCK_BYTES = 1 + 16  # E8M0 byte + 16 bytes of nibbles

#: doubled e2m1 values, indexed by code (ggml kvalues_mxfp4).
KV = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)
KV.setflags(write=False)

_CHUNK_BLOCKS = 8192  # numpy reference works on this many blocks at a time


def _roundup_table() -> np.ndarray:
    """For exact exponent f in [-149, 127] (index f + 149): the smallest float32
    bit pattern in [2^f, 2^(f+1)) whose correctly rounded float32 log2 is >= f+1
    (or the bits of 2^(f+1) when none is). Candidates are the 512 patterns just
    below 2^(f+1), far more than the at most ~90 that can round up."""
    table = np.zeros(277, dtype=np.int64)
    for f in range(-149, 128):
        top = (1 << (f + 150)) if f < -126 else ((f + 128) << 23)  # bits of 2^(f+1)
        low = (1 << (f + 149)) if f < -126 else ((f + 127) << 23)  # bits of 2^f
        cand = np.arange(max(low, top - 512), top, dtype=np.int64)
        vals = cand.astype(np.uint32).view(np.float32).astype(np.float64)
        r = np.log2(vals).astype(np.float32)
        up = cand[r >= np.float32(f + 1)]
        table[f + 149] = up[0] if len(up) else top
    return table


_ROUNDUP_FROM = _roundup_table()
_ROUNDUP_FROM.setflags(write=False)


def floor_log2f(amax_bits: np.ndarray) -> np.ndarray:
    """floor(correctly rounded float32 log2(a)) for positive finite float32 bit patterns (int64)."""
    b = np.asarray(amax_bits, dtype=np.int64)
    exp = b >> 23
    sub_f = np.zeros_like(b)
    sub = exp == 0
    if np.any(sub):
        # subnormal: value = b * 2^-149, exponent = bit_length(b) - 1 - 149
        sub_f[sub] = np.floor(np.log2(b[sub].astype(np.float64))).astype(np.int64) - 149
    f = np.where(sub, sub_f, exp - 127)
    return f + (b >= _ROUNDUP_FROM[f + 149]).astype(np.int64)


def scale_byte_ref(amax: np.ndarray) -> np.ndarray:
    """E8M0 byte gguf-py picks for float32 block maxima ``amax`` (any shape)."""
    a = np.asarray(amax, dtype=np.float32)
    ok = (a > 0) & np.isfinite(a)
    bits = np.where(ok, a.view(np.uint32), np.uint32(0x3F800000)).astype(np.int64)
    return np.where(ok, (floor_log2f(bits) + 125) & 0xFF, 0).astype(np.uint8)


def half_scale(e: np.ndarray) -> np.ndarray:
    """ggml GGML_E8M0_TO_FP32_HALF: byte e -> float32 2^(e-128) (e = 0, 1 subnormal)."""
    e = np.asarray(e, dtype=np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


# --------------------------------------------------------------------------
# numpy reference


def _encode_blocks_ref(blocks: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        amax = np.max(np.abs(blocks), axis=1)
        e = scale_byte_ref(amax)
        d = half_scale(e)
        grid = d[:, None] * KV[None, :]  # exact: power of two x small integer
        errs = np.abs(grid[:, None, :] - blocks[:, :, None])  # (n, 32, 16) float32
    codes = np.argmin(errs, axis=2).astype(np.uint8)  # first minimum; all-NaN -> 0
    return np.concatenate([e[:, None], pack_nibbles_split(codes)], axis=1)


def encode_ref(x: np.ndarray, importance=None, codebooks=None) -> np.ndarray:
    """float32 (rows, cols) -> uint8 (rows, cols/32*17). importance is ignored (as ggml's ref)."""
    rows, cols = x.shape
    blocks = x.reshape(-1, BLOCK)
    out = np.empty((blocks.shape[0], BLOCK_BYTES), dtype=np.uint8)
    for s in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        out[s:s + _CHUNK_BLOCKS] = _encode_blocks_ref(blocks[s:s + _CHUNK_BLOCKS])
    return out.reshape(rows, (cols // BLOCK) * BLOCK_BYTES)


def decode_ref(data: np.ndarray, cols: int, codebooks=None, modes=None) -> np.ndarray:
    """uint8 (rows, cols/32*17) -> float32 (rows, cols)."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(-1, BLOCK_BYTES)
    d = half_scale(blocks[:, 0])
    codes = unpack_nibbles_split(blocks[:, 1:])
    return (d[:, None] * KV[codes]).reshape(rows, cols)


# --------------------------------------------------------------------------
# numba fast path


@numba.njit(cache=True, nogil=True)
def _scale_byte_nb(amax, amax_bits, table):
    if not (amax > np.float32(0.0)) or amax == np.float32(np.inf):
        return 0
    b = np.int64(amax_bits)
    exp = b >> 23
    if exp == 0:
        n = 0
        t = b
        while t > 1:
            t >>= 1
            n += 1
        f = n - 149
    else:
        f = exp - 127
    if b >= table[f + 149]:
        f += 1
    return (f + 125) & 0xFF


@numba.njit(cache=True, nogil=True)
def _half_scale_nb(e):
    if e < 2:
        return np.uint32(0x00200000) << np.uint32(e)
    return np.uint32(e - 1) << np.uint32(23)


@numba.njit(cache=True, nogil=True)
def _encode_row_nb(x, out, table, kv):
    nb = x.shape[0] // 32
    buf = np.empty(1, dtype=np.float32)
    buf_bits = buf.view(np.uint32)
    codes = np.empty(32, dtype=np.uint8)
    for b in range(nb):
        amax = np.float32(0.0)
        nan = False
        for j in range(32):
            a = abs(x[b * 32 + j])
            if a != a:
                nan = True
            elif a > amax:
                amax = a
        if nan:
            e = 0
        else:
            buf[0] = amax
            e = _scale_byte_nb(amax, buf_bits[0], table)
        buf_bits[0] = _half_scale_nb(e)
        d = buf[0]
        for j in range(32):
            v = x[b * 32 + j]
            best = 0
            best_err = abs(d * kv[0] - v)
            for k in range(1, 16):
                err = abs(d * kv[k] - v)
                if err < best_err:  # strict: first minimum wins; NaN never wins
                    best_err = err
                    best = k
            codes[j] = best
        o = b * 17
        out[o] = e
        for j in range(16):
            out[o + 1 + j] = codes[j] | (codes[j + 16] << 4)


@numba.njit(cache=True, parallel=True, nogil=True)
def _encode_nb(x, out, table, kv):
    for r in numba.prange(x.shape[0]):
        _encode_row_nb(x[r], out[r], table, kv)


def encode_fast(x: np.ndarray, importance=None, codebooks=None) -> np.ndarray:
    rows, cols = x.shape
    out = np.empty((rows, (cols // BLOCK) * BLOCK_BYTES), dtype=np.uint8)
    if rows:
        _encode_nb(x, out, _ROUNDUP_FROM, KV)
    return out


@numba.njit(cache=True, parallel=True, nogil=True)
def _decode_nb(data, out, kv):
    nb = out.shape[1] // 32
    for r in numba.prange(data.shape[0]):
        buf = np.empty(1, dtype=np.float32)
        buf_bits = buf.view(np.uint32)
        for b in range(nb):
            o = b * 17
            buf_bits[0] = _half_scale_nb(data[r, o])
            d = buf[0]
            for j in range(16):
                q = data[r, o + 1 + j]
                out[r, b * 32 + j] = d * kv[q & 0xF]
                out[r, b * 32 + 16 + j] = d * kv[q >> 4]


def decode_fast(data: np.ndarray, cols: int, codebooks=None, modes=None) -> np.ndarray:
    out = np.empty((data.shape[0], cols), dtype=np.float32)
    if data.shape[0]:
        _decode_nb(np.ascontiguousarray(data), out, KV)
    return out


def decode_torch(data, cols, codebooks=None, modes=None):
    import torch

    rows = data.shape[0]
    blocks = data.contiguous().reshape(-1, BLOCK_BYTES)
    e = blocks[:, 0].to(torch.int32)
    bits = torch.where(e < 2, torch.bitwise_left_shift(torch.full_like(e, 0x00200000), e), (e - 1) << 23)
    d = bits.view(torch.float32)
    qs = blocks[:, 1:].to(torch.int64)
    codes = torch.cat([qs & 0xF, qs >> 4], dim=1)
    kv = torch.from_numpy(KV.copy()).to(data.device)
    return (d[:, None] * kv[codes]).reshape(rows, cols)


# --------------------------------------------------------------------------
# DeepSeek FP4 experts <-> MXFP4 blocks (lossless)


def mxfp4_from_e2m1(codes_packed_lowfirst: np.ndarray, e8m0_scales: np.ndarray, *, where: str = "fp4 expert") -> np.ndarray:
    """DeepSeek FP4 expert weight -> MXFP4 rows, bit-exactly.

    codes_packed_lowfirst: int8/uint8 (out, in/2); byte j holds element 2j in
        the low nibble and 2j+1 in the high nibble (official layout).
    e8m0_scales: uint8 (out, in/32), 2^(b-127) per 32 inputs.
    Returns uint8 (out, in/32*17). gguf-py's dequantize of the result equals
    e2m1(code) * 2^(b-127) for every weight (code 8, -0.0, becomes +0.0).
    A scale byte of 255 (NaN) has no MXFP4 form and is refused.
    """
    packed, sc, rows, cols = check_fp4_layout(codes_packed_lowfirst, e8m0_scales, where)
    nan = np.argwhere(sc == 255)
    if len(nan):
        raise CorruptDataError(
            f"E8M0 scale 255 (NaN) at {tuple(int(i) for i in nan[0])} has no MXFP4 form", where=where
        )
    nblk = rows * (cols // BLOCK)
    # low-first pairs (..., 16 bytes) -> 32 codes in element order -> split nibbles
    pairs = np.ascontiguousarray(packed).reshape(nblk, BLOCK // 2)
    codes = np.empty((nblk, BLOCK), dtype=np.uint8)
    codes[:, 0::2] = pairs & 0xF
    codes[:, 1::2] = pairs >> 4
    out = np.empty((nblk, BLOCK_BYTES), dtype=np.uint8)
    # The same byte in both layouts: ggml's 2^(e-128) x doubled e2m1 = 2^(e-127) x e2m1.
    out[:, 0] = sc.reshape(-1)
    out[:, 1:] = pack_nibbles_split(codes)
    return out.reshape(rows, (cols // BLOCK) * BLOCK_BYTES)


def e2m1_from_mxfp4(data: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of ``mxfp4_from_e2m1``: uint8 (rows, cols/32*17) ->
    (int8 codes (rows, cols/2) low nibble first, uint8 E8M0 scales (rows, cols/32)).
    A block byte of 255 would read as NaN in the official layout; it is refused."""
    data = np.ascontiguousarray(np.asarray(data, dtype=np.uint8))
    if cols <= 0 or cols % BLOCK or data.ndim != 2 or data.shape[1] != (cols // BLOCK) * BLOCK_BYTES:
        raise ShapeError(f"MXFP4 data {data.shape} does not hold rows of {cols} weights")
    rows = data.shape[0]
    blocks = data.reshape(-1, BLOCK_BYTES)
    if np.any(blocks[:, 0] == 255):
        raise CorruptDataError("MXFP4 scale byte 255 reads as NaN in the E8M0 source layout")
    codes = unpack_nibbles_split(blocks[:, 1:])
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.reshape(rows, cols // 2).view(np.int8), blocks[:, 0].reshape(rows, cols // BLOCK).copy()


register(
    QType(
        name="mxfp4", ggml_type=39, variant="mxfp4", block_size=BLOCK, block_bytes=BLOCK_BYTES,
        layout="e[1] E8M0 exponent + qs[16] e2m1 nibbles (j | j+16 << 4)", family="ggml",
        runtimes=(RT_DS4QUANT, RT_LUCEBOX, RT_LLAMA_CPP, RT_GGUF_PY),
        description="OCP MXFP4, 4.25 bpw; byte-compatible with gguf-py; lossless target for DeepSeek FP4 experts",
    ),
    Codec(encode_ref=encode_ref, encode_fast=encode_fast, decode_ref=decode_ref, decode_fast=decode_fast,
          decode_torch=decode_torch),
)
