"""Q8_0 (ggml type 8): blocks of 32 weights, byte-compatible with gguf-py.

Block layout (34 bytes)::

    d[2]   float16 scale, little-endian
    qs[32] int8 codes; weight j = qs[j] * d

Encoding mirrors ggml's ``quantize_row_q8_0_ref`` (and gguf-py's
``Q8_0.quantize_blocks``) in float32, step by step:
``amax = max|x|``; ``d = amax / 127``; ``id = d == 0 ? 0 : 1/d``;
``q = roundf(x * id)`` (half away from zero); ``d`` is stored as float16
(round to nearest even). A non-finite ``x * id`` (NaN/Inf input, or an ``id``
that overflowed for a subnormal ``d``) becomes code 0, and finite codes wrap
into int8 as the reference's float -> int8 cast does on x86
(float -> int32 -> low byte).
"""

from __future__ import annotations

import numba
import numpy as np

from ds4quant.formats.plain import f16_to_f32_torch
from ds4quant.formats.qtype import RT_DS4QUANT, RT_GGUF_PY, RT_LLAMA_CPP, RT_LUCEBOX, Codec, QType, register

BLOCK = 32
BLOCK_BYTES = 2 + 32  # f16 scale + 32 int8 codes

_F127 = np.float32(127.0)
_ONE = np.float32(1.0)
_ZERO = np.float32(0.0)
_HALF_INT32 = np.float32(2.0**31)


# --------------------------------------------------------------------------
# numpy reference


def _roundf(v: np.ndarray) -> np.ndarray:
    """C roundf in float32: floor(|v|) + (frac >= 0.5), with v's sign."""
    a = np.abs(v)
    fl = np.floor(a)
    b = fl + np.floor(np.float32(2.0) * (a - fl))
    return np.sign(v) * b


def _to_int8_wrapped(q: np.ndarray) -> np.ndarray:
    """float32 -> int8 as x86 cvttss2si + truncation does: NaN/Inf/out of int32 -> 0."""
    ok = np.isfinite(q) & (np.abs(q) < _HALF_INT32)
    return np.where(ok, q, _ZERO).astype(np.int64).astype(np.int8)


def encode_ref(x: np.ndarray, importance=None, codebooks=None) -> np.ndarray:
    """float32 (rows, cols) -> uint8 (rows, cols/32*34). importance is ignored (as ggml's ref)."""
    rows, cols = x.shape
    blocks = x.reshape(-1, BLOCK)
    with np.errstate(all="ignore"):
        amax = np.max(np.abs(blocks), axis=1, keepdims=True)
        d = amax / _F127
        inv = np.where(d == _ZERO, _ZERO, _ONE / d).astype(np.float32)
        q = _roundf(blocks * inv)
        codes = _to_int8_wrapped(q)
        dh = d.astype("<f2")
    out = np.concatenate([dh.view(np.uint8), codes.view(np.uint8)], axis=1)
    return out.reshape(rows, (cols // BLOCK) * BLOCK_BYTES)


def decode_ref(data: np.ndarray, cols: int, codebooks=None, modes=None) -> np.ndarray:
    """uint8 (rows, cols/32*34) -> float32 (rows, cols)."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(-1, BLOCK_BYTES)
    d = np.ascontiguousarray(blocks[:, :2]).view("<f2").astype(np.float32)
    q = blocks[:, 2:].view(np.int8).astype(np.float32)
    with np.errstate(invalid="ignore"):  # NaN scale bytes decode to NaN
        return (q * d).reshape(rows, cols)


# --------------------------------------------------------------------------
# numba fast path


@numba.njit(cache=True, nogil=True)
def _f32_to_f16_bits(bits):
    """IEEE float32 bits -> float16 bits, round to nearest even (numpy's conversion)."""
    u = np.int64(bits)
    sign = (u >> 16) & 0x8000
    exp = (u >> 23) & 0xFF
    man = u & 0x7FFFFF
    if exp == 0xFF:
        if man == 0:
            return sign | 0x7C00
        h = 0x7C00 | (man >> 13)
        if h == 0x7C00:
            h += 1  # keep it a NaN
        return sign | h
    e = exp - 127 + 15
    if e >= 31:
        return sign | 0x7C00  # overflow to Inf
    if e <= 0:
        if e < -10:
            return sign  # underflow to +-0 (below half the smallest subnormal)
        m = man | 0x800000  # 24-bit significand
        shift = 14 - e  # value = m * 2^(exp-150); subnormal unit is 2^-24
        q = m >> shift
        rem = m & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        if rem > half or (rem == half and (q & 1)):
            q += 1
        return sign | q
    q = (e << 10) | (man >> 13)
    rem = man & 0x1FFF
    if rem > 0x1000 or (rem == 0x1000 and (q & 1)):
        q += 1  # may carry into the exponent, up to Inf: still correct
    return sign | q


@numba.njit(cache=True, nogil=True)
def _encode_row_nb(x, out):
    nb = x.shape[0] // 32
    dv = np.empty(1, dtype=np.float32)
    dbits = dv.view(np.uint32)
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
            amax = np.float32(np.nan)
        d = amax / np.float32(127.0)
        inv = np.float32(0.0) if d == np.float32(0.0) else np.float32(1.0) / d
        dv[0] = d
        h = _f32_to_f16_bits(dbits[0])
        o = b * 34
        out[o] = h & 0xFF
        out[o + 1] = (h >> 8) & 0xFF
        for j in range(32):
            v = x[b * 32 + j] * inv
            a = abs(v)
            if not (a < np.float32(2.0**31)):  # NaN, Inf, beyond int32
                out[o + 2 + j] = 0
                continue
            fl = np.floor(a)
            r = fl + np.floor(np.float32(2.0) * (a - fl))
            qi = np.int64(r)
            if v < np.float32(0.0):
                qi = -qi
            out[o + 2 + j] = qi & 0xFF


@numba.njit(cache=True, parallel=True, nogil=True)
def _encode_nb(x, out):
    for r in numba.prange(x.shape[0]):
        _encode_row_nb(x[r], out[r])


def encode_fast(x: np.ndarray, importance=None, codebooks=None) -> np.ndarray:
    rows, cols = x.shape
    out = np.empty((rows, (cols // BLOCK) * BLOCK_BYTES), dtype=np.uint8)
    if rows:
        _encode_nb(x, out)
    return out


def decode_torch(data, cols, codebooks=None, modes=None):
    import torch

    rows = data.shape[0]
    blocks = data.contiguous().reshape(-1, BLOCK_BYTES)
    d = f16_to_f32_torch(blocks[:, :2].contiguous().view(torch.int16))
    q = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    out = q * d
    # NaN results carry the CPU's bits: a NaN scale propagates its own (quieted)
    # payload, inf * 0 gives this CPU's default NaN; GPUs would give 0x7fffffff.
    d_full = d.expand_as(out)
    quiet = (d_full.contiguous().view(torch.int32) | 0x00400000).view(torch.float32)
    out = torch.where(torch.isnan(d_full), quiet, out)
    inf0 = torch.isinf(d_full) & (q == 0)
    if bool(inf0.any()):
        out = torch.where(inf0, torch.from_numpy(_INF_TIMES_ZERO).to(out.device), out)
    return out.reshape(rows, cols)


with np.errstate(invalid="ignore"):
    _INF_TIMES_ZERO = np.array([np.float32(np.inf) * np.float32(0.0)], np.float32)  # this CPU's default NaN


register(
    QType(
        name="q8_0", ggml_type=8, variant="q8_0", block_size=BLOCK, block_bytes=BLOCK_BYTES,
        layout="d[2] f16 scale + qs[32] int8 codes", family="ggml",
        runtimes=(RT_DS4QUANT, RT_LUCEBOX, RT_LLAMA_CPP, RT_GGUF_PY),
        description="ggml Q8_0, 8.5 bpw; byte-compatible with gguf-py",
    ),
    Codec(encode_ref=encode_ref, encode_fast=encode_fast, decode_ref=decode_ref, decode_torch=decode_torch),
)
