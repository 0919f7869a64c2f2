"""Plain element types: f32 (ggml 0), f16 (1), bf16 (30), and decode-only i32 (26).

Byte layouts are little-endian scalars, one per weight, as GGUF stores them.
Encoders give gguf-py's bytes: f16 is IEEE round-to-nearest-even (numpy
``astype``), bf16 is ggml's ``ggml_compute_fp32_to_bf16``: a NaN is quieted by
keeping its top 16 bits and setting bit 22, every other value is rounded to
nearest-even on the top 16 bits (so values past the bf16 range become Inf).
i32 holds integer tables (``ffn_gate_tid2eid``); it decodes to float32, exact
for |v| < 2^24.
"""

from __future__ import annotations

import numpy as np

from ds4quant.formats.qtype import RT_DS4QUANT, RT_GGUF_PY, RT_LLAMA_CPP, RT_LUCEBOX, Codec, QType, register

_RUNTIMES = (RT_DS4QUANT, RT_LUCEBOX, RT_LLAMA_CPP, RT_GGUF_PY)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 array -> uint16 bf16 words, as ggml rounds (see module doc).

    uint32 arithmetic is enough: after NaN quieting the largest word is
    0xFFFF0000 and adding 0x8000 cannot wrap. Works in 1 Mi-element chunks so
    a large tensor needs no full-size temporaries.
    """
    n = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    flat = n.reshape(-1)
    out = np.empty(flat.shape, dtype=np.uint16)
    step = 1 << 20
    for i in range(0, flat.size, step):
        u = flat[i:i + step].copy()
        nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        if nan.any():
            u[nan] = (u[nan] & np.uint32(0xFFFF0000)) | np.uint32(0x00400000)
        lsb = (u >> np.uint32(16)) & np.uint32(1)
        u += np.uint32(0x7FFF)
        u += lsb
        u >>= np.uint32(16)
        out[i:i + step] = u
    return out.reshape(n.shape)


# --- f32 -------------------------------------------------------------------


def _f32_encode(x, importance, codebooks):
    return np.ascontiguousarray(x, dtype="<f4").view(np.uint8).reshape(x.shape[0], -1)


def _f32_decode(data, cols, codebooks, modes):
    return np.ascontiguousarray(data).view("<f4").astype(np.float32).reshape(data.shape[0], cols)


def _f32_decode_torch(data, cols, codebooks, modes):
    import torch

    return data.contiguous().view(torch.float32).reshape(data.shape[0], cols)


# --- f16 -------------------------------------------------------------------


def _f16_encode(x, importance, codebooks):
    with np.errstate(over="ignore"):  # overflow to Inf is the format's rule
        h = x.astype("<f2")
    return h.view(np.uint8).reshape(x.shape[0], -1)


def _f16_decode(data, cols, codebooks, modes):
    return np.ascontiguousarray(data).view("<f2").astype(np.float32).reshape(data.shape[0], cols)


def f16_to_f32_torch(words):
    """torch int16 float16 words -> torch.float32, bitwise as numpy converts.

    torch quiets a signalling NaN on conversion, numpy keeps the payload as is
    (sign | 0x7F800000 | mantissa << 13); fix those lanes with integer ops.
    """
    import torch

    w = words.to(torch.int32) & 0xFFFF
    out = words.view(torch.float16).to(torch.float32)
    nan = ((w & 0x7C00) == 0x7C00) & ((w & 0x03FF) != 0)
    nan_bits = ((w & 0x8000) << 16) | 0x7F800000 | ((w & 0x03FF) << 13)
    return torch.where(nan, nan_bits, out.view(torch.int32)).view(torch.float32)


def _f16_decode_torch(data, cols, codebooks, modes):
    import torch

    return f16_to_f32_torch(data.contiguous().view(torch.int16)).reshape(data.shape[0], cols)


# --- bf16 ------------------------------------------------------------------


def _bf16_encode(x, importance, codebooks):
    return bf16_bits(x).astype("<u2").view(np.uint8).reshape(x.shape[0], -1)


def _bf16_decode(data, cols, codebooks, modes):
    words = np.ascontiguousarray(data).view("<u2").astype(np.uint32)
    words <<= np.uint32(16)
    return words.view(np.float32).reshape(data.shape[0], cols)


def _bf16_decode_torch(data, cols, codebooks, modes):
    import torch

    # Bit shift on int32 words, not a bf16 cast: keeps NaN payloads bit-exact.
    words = data.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    return (words << 16).view(torch.float32).reshape(data.shape[0], cols)


# --- i32 (decode only) -----------------------------------------------------


def _i32_decode(data, cols, codebooks, modes):
    return np.ascontiguousarray(data).view("<i4").astype(np.float32).reshape(data.shape[0], cols)


def _i32_decode_torch(data, cols, codebooks, modes):
    import torch

    return data.contiguous().view(torch.int32).to(torch.float32).reshape(data.shape[0], cols)


def _plain(name, ggml_type, nbytes, layout, lossy, description, can_encode=True):
    return QType(
        name=name, ggml_type=ggml_type, variant=name, block_size=1, block_bytes=nbytes, layout=layout,
        family="plain", runtimes=_RUNTIMES, row_multiple=1, can_encode=can_encode, lossy=lossy,
        description=description,
    )


register(
    _plain("f32", 0, 4, "v[4] IEEE binary32", False, "float32, lossless"),
    Codec(encode_ref=_f32_encode, decode_ref=_f32_decode, decode_torch=_f32_decode_torch),
)
register(
    _plain("f16", 1, 2, "v[2] IEEE binary16", True, "float16, round to nearest even"),
    Codec(encode_ref=_f16_encode, decode_ref=_f16_decode, decode_torch=_f16_decode_torch),
)
register(
    _plain("bf16", 30, 2, "v[2] bfloat16 (top half of binary32)", True, "bfloat16, ggml rounding"),
    Codec(encode_ref=_bf16_encode, decode_ref=_bf16_decode, decode_torch=_bf16_decode_torch),
)
register(
    _plain("i32", 26, 4, "v[4] little-endian int32", False, "int32 table (tid2eid); decode only",
           can_encode=False),
    Codec(decode_ref=_i32_decode, decode_torch=_i32_decode_torch),
)
