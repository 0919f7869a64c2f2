"""The DeepSeek-V4 source element formats: FP8 E4M3, E8M0 scales, FP4 E2M1.

An official DeepSeek-V4 checkpoint stores (docs/formats.md#ds4-checkpoint,
docs/reference-model.md#loading):

- dense weights as ``F8_E4M3`` (e4m3fn: 1 sign, 4 exponent bits with bias 7,
  3 mantissa bits; no infinities, 0x7F/0xFF are NaN) with one ``F8_E8M0``
  scale per 128x128 block;
- routed experts as ``I8`` [out, in/2] holding two FP4 e2m1 codes per byte
  (the EVEN element in the LOW nibble) with one ``F8_E8M0`` scale per 32
  inputs, shape [out, in/32];
- ``F8_E8M0`` scale byte ``b`` means 2^(b-127); 255 is NaN.

Every value here is an exact float32 (small integer times a power of two), so
decoding is a table lookup times a power of two; the products are exact unless
they leave the float32 range. NaN bit patterns equal torch's native casts
(``float8_e4m3fn``/``float8_e8m0fnu`` ``.float()``).

Registers the decode-only qtypes ``fp8_e4m3`` and ``e8m0`` (block of 1).
"""

from __future__ import annotations

import numba
import numpy as np

from ds4quant.errors import CorruptDataError, ShapeError
from ds4quant.formats.qtype import RT_DS4QUANT, Codec, QType, register


def _e4m3_table() -> np.ndarray:
    bits = np.zeros(256, dtype=np.uint32)
    vals = np.zeros(256, dtype=np.float64)
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        exp, man = (b >> 3) & 0xF, b & 7
        if exp == 0xF and man == 7:
            continue  # NaN, filled below
        vals[b] = sign * (man * 2.0**-9 if exp == 0 else (1.0 + man / 8.0) * 2.0 ** (exp - 7))
    bits[:] = vals.astype(np.float32).view(np.uint32)
    bits[0x7F] = 0x7FF00000  # torch's float8_e4m3fn NaN -> float32
    bits[0xFF] = 0xFFF00000
    return bits.view(np.float32)


def _e8m0_table() -> np.ndarray:
    bits = np.zeros(256, dtype=np.uint32)
    bits[1:255] = np.arange(1, 255, dtype=np.uint32) << 23  # 2^(b-127), normal
    bits[0] = 0x00400000  # 2^-127 is a float32 subnormal
    bits[255] = 0x7F800001  # NaN, as torch's float8_e8m0fnu .float() gives
    return bits.view(np.float32)


#: float32 value of every e4m3fn byte (0x7F/0xFF NaN).
E4M3 = _e4m3_table()
E4M3.setflags(write=False)
#: float32 value of every E8M0 byte: 2^(b-127), 255 NaN.
E8M0 = _e8m0_table()
E8M0.setflags(write=False)
#: FP4 e2m1 code -> value (OCP MX): codes 0..7 positive, 8..15 negative (8 is -0.0).
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
E2M1.setflags(write=False)

E8M0_NAN = 255
FP8_BLOCK = 128  # dense weight scale block (rows and columns)
FP4_BLOCK = 32  # routed-expert scale block (inputs)


# --------------------------------------------------------------------------
# array helpers for the official layout


def e8m0_to_float(scales: np.ndarray) -> np.ndarray:
    """uint8 E8M0 bytes (any shape) -> float32 2^(b-127) (255 -> NaN)."""
    return E8M0[np.asarray(scales).view(np.uint8)]


def unpack_e2m1(packed: np.ndarray) -> np.ndarray:
    """Packed FP4 codes uint8/int8 (..., n) -> uint8 codes (..., 2n).

    Byte j holds element 2j in its low nibble and 2j+1 in its high nibble.
    """
    u = np.asarray(packed).view(np.uint8)
    out = np.empty(u.shape[:-1] + (2 * u.shape[-1],), dtype=np.uint8)
    out[..., 0::2] = u & 0xF
    out[..., 1::2] = u >> 4
    return out


def check_fp4_layout(packed, scale_e8m0, where: str) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Validate a DeepSeek FP4 weight: codes int8/uint8 (out, in/2), E8M0
    scales (out, in/32), in % 32 == 0. Returns (codes u8, scales u8, out, in)."""
    packed = np.asarray(packed)
    if packed.dtype not in (np.int8, np.uint8):
        raise ShapeError(f"FP4 codes must be int8 or uint8, got {packed.dtype}", where=where)
    codes = packed.view(np.uint8)
    sc = np.asarray(scale_e8m0).view(np.uint8)
    if codes.ndim != 2 or sc.ndim != 2:
        raise ShapeError(f"FP4 codes and scales must be 2-D, got {codes.shape} and {sc.shape}", where=where)
    rows, half = codes.shape
    cols = 2 * half
    if cols % FP4_BLOCK or sc.shape != (rows, cols // FP4_BLOCK):
        raise ShapeError(
            f"FP4 codes {codes.shape} (= {rows}x{cols} values) need scales of shape "
            f"({rows}, {cols // FP4_BLOCK}) and in % {FP4_BLOCK} == 0, got scales {sc.shape}",
            where=where,
        )
    return codes, sc, rows, cols


def dequant_e2m1_blocks(packed: np.ndarray, scale_e8m0: np.ndarray, *, where: str = "fp4 tensor",
                        impl: str = "fast") -> np.ndarray:
    """DeepSeek FP4 expert weight -> float32 (out, in), exactly.

    packed: int8/uint8 (out, in/2), even element in the low nibble.
    scale_e8m0: uint8 (out, in/32), value 2^(b-127) per 32 inputs.
    impl: "fast" (one numba pass, no temporaries: the adaptive measure stage
        reads every expert on one thread) or "ref" (numpy); the same bits.
    """
    codes, sc, rows, cols = check_fp4_layout(packed, scale_e8m0, where)
    if impl == "ref":
        vals = E2M1[unpack_e2m1(codes)].reshape(rows, cols // FP4_BLOCK, FP4_BLOCK)
        return (vals * E8M0[sc][:, :, None]).reshape(rows, cols)
    if impl != "fast":
        raise ValueError(f"impl must be 'fast' or 'ref', got {impl!r}")
    out = np.empty((rows, cols), np.float32)
    _dequant_e2m1_nb(np.ascontiguousarray(codes), np.ascontiguousarray(sc), E2M1, E8M0, out)
    return out


def dequant_e2m1_torch(packed, scale_e8m0):
    """``dequant_e2m1_blocks`` on torch tensors of any device (uint8/int8 codes
    (out, in/2), uint8 E8M0 scales (out, in/32)) -> float32 (out, in) there.

    The same one float32 product per weight as the numpy decode, so the same
    bits; every product is also exact in bfloat16 (a level has at most two
    significant bits and the scale is a power of two in float32's exponent
    range). Scales are not checked here: the caller refuses byte 255 first.
    """
    import torch

    codes = packed.view(torch.uint8) if packed.dtype == torch.int8 else packed
    if codes.dim() != 2:
        raise ShapeError(f"FP4 codes must be 2-D, got {tuple(codes.shape)}", where="dequant_e2m1_torch")
    rows, cols = int(codes.shape[0]), 2 * int(codes.shape[1])
    if tuple(scale_e8m0.shape) != (rows, cols // FP4_BLOCK) or cols % FP4_BLOCK:
        raise ShapeError(f"FP4 codes {tuple(codes.shape)} need scales ({rows}, {cols // FP4_BLOCK}), got "
                         f"{tuple(scale_e8m0.shape)}", where="dequant_e2m1_torch")
    dev = codes.device
    levels = torch.from_numpy(E2M1.copy()).to(dev)
    scales = torch.from_numpy(E8M0.copy()).to(dev)
    c = codes.to(torch.int32)
    vals = torch.stack((levels[c & 15], levels[c >> 4]), dim=-1).reshape(rows, cols // FP4_BLOCK, FP4_BLOCK)
    vals.mul_(scales[scale_e8m0.view(torch.uint8).to(torch.int32)].unsqueeze(-1))
    return vals.reshape(rows, cols)


@numba.njit(cache=True, nogil=True)
def _dequant_e2m1_nb(codes, sc, levels, scales, out):
    """out[r, c] = levels[code] * scales[sc[r, c // 32]], the reference's one float32 product."""
    rows, half = codes.shape
    for r in range(rows):
        for j in range(half):
            b = codes[r, j]
            s = scales[sc[r, j // 16]]  # (2j) // 32
            out[r, 2 * j] = levels[b & 15] * s
            out[r, 2 * j + 1] = levels[b >> 4] * s


def fp8_scale_grid(rows: int, cols: int, block: int = FP8_BLOCK) -> tuple[int, int]:
    """Shape of the E8M0 scale grid of an FP8 (rows, cols) weight: ceil per block."""
    return (-(-rows // block), -(-cols // block))


def dequant_fp8_blocks(weight_u8: np.ndarray, scale_e8m0: np.ndarray, block: int = FP8_BLOCK, *,
                       where: str = "fp8 tensor") -> np.ndarray:
    """DeepSeek FP8 dense weight -> float32 (out, in), exactly.

    weight_u8: uint8 view of F8_E4M3 (out, in).
    scale_e8m0: uint8 (ceil(out/block), ceil(in/block)); block (i, j) covers
    rows i*block.. and columns j*block.. (the last block may be partial).
    """
    w = np.asarray(weight_u8).view(np.uint8)
    sc = np.asarray(scale_e8m0).view(np.uint8)
    if w.ndim != 2 or sc.ndim != 2:
        raise ShapeError(f"FP8 weight and scale must be 2-D, got {w.shape} and {sc.shape}", where=where)
    rows, cols = w.shape
    if sc.shape != fp8_scale_grid(rows, cols, block):
        raise ShapeError(
            f"FP8 weight {w.shape} with {block}x{block} blocks needs a scale grid "
            f"{fp8_scale_grid(rows, cols, block)}, got {sc.shape}",
            where=where,
        )
    s = E8M0[sc]
    s_full = np.repeat(np.repeat(s, block, axis=0)[:rows], block, axis=1)[:, :cols]
    return E4M3[w] * s_full


def check_e8m0_finite(scale_e8m0: np.ndarray, where: str) -> None:
    """Refuse an E8M0 scale array that holds the NaN byte 255."""
    sc = np.asarray(scale_e8m0).view(np.uint8)
    bad = np.argwhere(sc == E8M0_NAN)
    if len(bad):
        raise CorruptDataError(
            f"{len(bad)} E8M0 scale byte(s) are 255 (NaN), first at index {tuple(int(i) for i in bad[0])}",
            where=where,
        )


# --------------------------------------------------------------------------
# registry entries (decode-only, elementwise)


def _lut_decode_ref(table):
    def decode(data, cols, codebooks, modes):
        return table[data]

    return decode


def _lut_decode_torch(table):
    def decode(data, cols, codebooks, modes):
        import torch

        lut = torch.from_numpy(table.copy()).to(data.device)
        return lut[data.long()]

    return decode


register(
    QType(
        name="fp8_e4m3", ggml_type=None, variant="fp8_e4m3", block_size=1, block_bytes=1,
        layout="v[1] e4m3fn byte (bias 7, 0x7F/0xFF NaN)", family="source", runtimes=(RT_DS4QUANT,),
        row_multiple=1, can_encode=False, lossy=True,
        description="DeepSeek dense weight element (F8_E4M3); decode only",
    ),
    Codec(decode_ref=_lut_decode_ref(E4M3), decode_torch=_lut_decode_torch(E4M3)),
)

register(
    QType(
        name="e8m0", ggml_type=None, variant="e8m0", block_size=1, block_bytes=1,
        layout="e[1] E8M0 exponent byte 2^(b-127) (255 NaN)", family="source", runtimes=(RT_DS4QUANT,),
        row_multiple=1, can_encode=False, lossy=True,
        description="DeepSeek scale element (F8_E8M0); decode only",
    ),
    Codec(decode_ref=_lut_decode_ref(E8M0), decode_torch=_lut_decode_torch(E8M0)),
)
