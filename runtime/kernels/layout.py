"""The runtime's own weight layout for the Triton MoE kernels (torch only).

The artifact bytes stay the contract; at load a CUDA owner repacks each
resident stack once into planes the kernels read with plain strided loads:

    a: uint8 (E, rows, cols * ABITS / 8)  the low ABITS bits of each code, weight order,
       LSB first (2-bit: 4 codes a byte; 4-bit: 2; 8-bit: 1). 3-bit codes keep
       their low 2 bits here, 6-bit codes (rocmfp6) their low 4
    b: uint8 (E, rows, cols * BBITS / 8)  the code's remaining high bits, same order:
       bit 2 of a 3-bit code (8 a byte), bits 4-5 of a 6-bit code (4 a byte)
    s: uint8 (E, rows, cols / G)          the group's scale / meta byte, unchanged
    o: uint8 (E, rows, cols / G)          rocmfp2_affine only: the group's offset byte

A weight is ``levels[table, code] * scales[s_byte]`` where ``scales`` is a
256-entry float32 LUT of the byte and ``levels`` a small float32 table
(one per format; two per expert for MIX, the book picked by bit 7 of the
meta byte). These are the same products ``formats.decode`` forms
(``formats.components``: level x scale), so decoding the planes reproduces
``formats.decode`` bit for bit (a test checks it on the CPU device); the
kernels' sums are fast mode's, not exact mode's.

rocmfp2_affine (type 107, docs/formats.md#rocmfp2-affine) is ``(code * scales[s]) - scales[o]`` with
codes 0..3 and both bytes plain UE4M3: two float32 roundings, as its decode
does. The product of a 2-bit code and a UE4M3 value (4 significant bits) is
exact in float32, so a compiler that contracts the multiply and the
subtraction into one fused multiply-add still gives the same bits (a test
checks the product's exactness over every byte).

Repacking is per expert so a DS4 stack (256 x 4096 x 2048) never needs more
than one expert's int64 temporaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ds4quant.errors import UnsupportedFormatError

# scale-search qtype -> (format code of scale_codecs, code bits); MIX qtype -> code bits
_SCALE = {"rocmfp2": (0, 2), "rocmfp2_s40": (5, 2), "rocmfp3": (1, 3), "rocmfp4": (4, 4),
          "rocmfp4_fast": (4, 4), "rocmfp6": (2, 6), "rocmfp8": (3, 8)}
_GROUPS = {"rocmfp4_fast": 32, "rocmfp8": 32}
_MIX = {"rocmfp2_mix": 2, "rocmfp3_mix": 3}

# code bits -> (bits in plane a, bits in plane b)
_SPLIT = {2: (2, 0), 3: (2, 1), 4: (4, 0), 6: (4, 2), 8: (8, 0)}
AFFINE = "rocmfp2_affine"

#: qtypes the Triton kernels decode in place; every other qtype runs
#: decode_torch + matmul (q8_0, bf16, f16, f32).
KERNEL_QTYPES = tuple(sorted(set(_SCALE) | set(_MIX) | {"mxfp4", AFFINE}))

#: ``tl.dot`` input precision of the float32 tl.dot tiles by backend: three tf32 products
#: (close to float32) on NVIDIA; AMD's Triton accepts only ieee / bf16x3 / bf16x6 (and tf32
#: on gfx942), so three bf16 products there (the ahead-of-time check found tf32x3 refused
#: for gfx1151)
DOT_PREC = {"cuda": "tf32x3", "hip": "bf16x3"}


def dot_prec() -> str:
    """The default ``tl.dot`` precision of this torch build's GPU backend."""
    import torch

    return DOT_PREC["hip" if getattr(torch.version, "hip", None) else "cuda"]


# level arithmetic the kernel may do instead of a table gather (LV_CODE: level = code;
# LV_E2M1: twice the e2m1 value, {0, 1, 2, 3, 4, 6, 8, 12} with a sign bit; LV_FP4: the
# same with 10 for 12, rocmfp4's table). A gather per weight from a table in memory costs
# the tensor-core prefill most of its time; shifts and selects cost a few integer ops. Tables
# of up to 8 levels under LV_GATHER (MIX books, rocmfp2_s40) are selected by the code bits
# (moe_triton._select) rather than gathered.
LV_GATHER, LV_FP2, LV_FP3, LV_CODE, LV_E2M1, LV_FP4 = 0, 1, 2, 3, 4, 5


@dataclass(frozen=True)
class Format:
    """How the kernels read one qtype (constexpr parameters of the launch)."""

    qtype: str
    abits: int  # bits per code in plane a (2, 4 or 8)
    bbits: int  # bits per code in plane b (0: no plane b; 1: 3-bit codes; 2: 6-bit codes)
    group: int  # weights per scale byte
    mix: bool  # levels from the expert's registered books, book = meta >> 7
    nlev: int  # entries of one level table
    lv_mode: int  # LV_GATHER / LV_FP2 / LV_FP3 / LV_CODE
    affine: bool = False  # rocmfp2_affine: minus scales[offset byte] (plane o)

    @property
    def has_b(self) -> bool:
        return self.bbits > 0

    @property
    def key(self) -> tuple:
        """Two stacks with equal keys can share one launch (gate + up)."""
        return (self.abits, self.bbits, self.group, self.mix, self.nlev, self.lv_mode, self.affine)


def kernel_format(qtype: str) -> Optional[Format]:
    """The kernel format of a qtype, or None when the qtype falls back."""
    if qtype in _SCALE:
        fmt, bits = _SCALE[qtype]
        lv = {"rocmfp2": LV_FP2, "rocmfp3": LV_FP3, "rocmfp4": LV_FP4, "rocmfp4_fast": LV_FP4}.get(qtype, LV_GATHER)
        return Format(qtype, *_SPLIT[bits], _GROUPS.get(qtype, 16), False, 1 << bits, lv)
    if qtype in _MIX:
        bits = _MIX[qtype]
        return Format(qtype, *_SPLIT[bits], 16, True, 1 << bits, LV_GATHER)
    if qtype == "mxfp4":
        return Format(qtype, 4, 0, 32, False, 16, LV_E2M1)
    if qtype == AFFINE:
        return Format(qtype, 2, 0, 32, False, 4, LV_CODE, affine=True)
    return None


def scale_lut(qtype: str) -> np.ndarray:
    """float32 (256,): the decoded value of every scale / meta byte."""
    from ds4quant.formats.components import E8M0_HALF, SCALES
    from ds4quant.formats.ue4m3 import UE4M3

    if qtype in _SCALE:
        return np.array(SCALES[_SCALE[qtype][0]], dtype=np.float32)
    if qtype in _MIX:
        return np.asarray(UE4M3, dtype=np.float32)[np.arange(256) & 0x7F].copy()  # bit 7 picks the book
    if qtype == "mxfp4":
        return np.array(E8M0_HALF, dtype=np.float32)
    if qtype == AFFINE:  # scale and offset bytes alike: plain UE4M3 (no fp2s mirror bit)
        return np.asarray(UE4M3, dtype=np.float32).copy()
    raise UnsupportedFormatError(f"{qtype} has no kernel layout")


def level_lut(qtype: str, books=None, modes=None) -> np.ndarray:
    """float32 (n_tables, nlev). Fixed formats: one table. MIX: two per
    expert (2e + book) from the registered books; a mode-0 expert decodes
    with the fixed levels and its whole meta byte as the scale, so a meta
    with bit 7 set gives 0: its book-1 table is all zeros."""
    from ds4quant.formats.components import FP2, FP3, LEVELS
    from ds4quant.formats.mxfp4 import KV

    if qtype in _SCALE:
        fmt, bits = _SCALE[qtype]
        return np.array(LEVELS[fmt][: 1 << bits], dtype=np.float32)[None, :]
    if qtype == "mxfp4":
        return np.array(KV, dtype=np.float32)[None, :]
    if qtype == AFFINE:
        return np.arange(4, dtype=np.float32)[None, :]
    if qtype in _MIX:
        bits = _MIX[qtype]
        fixed = np.array(LEVELS[FP2 if bits == 2 else FP3][: 1 << bits], dtype=np.float32)
        b = np.array(books, dtype=np.float32).reshape(-1, 2, 1 << bits).copy()
        for i, m in enumerate(np.asarray(modes).reshape(-1)):
            if int(m) == 0:
                b[i, 0] = fixed
                b[i, 1] = 0.0
        return b.reshape(-1, 1 << bits)
    raise UnsupportedFormatError(f"{qtype} has no kernel layout")


def _pack(codes, bits: int):
    """int64 (..., m) codes < 2^bits -> uint8 (..., m * bits / 8), LSB first."""
    import torch

    per = 8 // bits
    c = codes.reshape(*codes.shape[:-1], -1, per)
    sh = torch.arange(per, device=codes.device, dtype=torch.int64) * bits
    return (c << sh).sum(dim=-1).to(torch.uint8)


def repack(qtype: str, data, cols: int):
    """Artifact rows -> (a, b or None, s, o or None) planes; data torch.uint8
    (E, rows, row_bytes) on the target device. See the module docstring."""
    import torch

    f = kernel_format(qtype)
    if f is None:
        raise UnsupportedFormatError(f"{qtype} has no kernel layout")
    E, rows, _ = data.shape
    nb = cols // 32
    bits = f.abits + f.bbits
    dev = data.device
    a = torch.empty((E, rows, cols * f.abits // 8), dtype=torch.uint8, device=dev)
    b = torch.empty((E, rows, cols * f.bbits // 8), dtype=torch.uint8, device=dev) if f.has_b else None
    s = torch.empty((E, rows, cols // f.group), dtype=torch.uint8, device=dev)
    o = torch.empty_like(s) if f.affine else None
    for e in range(E):
        blk = data[e].reshape(rows, nb, -1)
        if qtype == "mxfp4":
            s[e] = blk[:, :, 0].reshape(rows, -1)
            qs = blk[:, :, 1:].to(torch.int64)
            codes = torch.cat([qs & 15, qs >> 4], dim=2)  # split nibble order -> weight order
            a[e] = _pack(codes, 4).reshape(rows, -1)
            continue
        qsb = 4 * bits
        if f.affine:  # qs[8], then the scale byte and the offset byte
            s[e] = blk[:, :, qsb]
            o[e] = blk[:, :, qsb + 1]
        else:
            s[e] = blk[:, :, qsb:].reshape(rows, -1)
        qs = blk[:, :, :qsb]
        if bits in (2, 8):
            a[e] = qs.reshape(rows, -1)  # already weight order, LSB first
            continue
        q64 = qs.to(torch.int64)
        if bits == 4:
            codes = torch.cat([q64 & 15, q64 >> 4], dim=2)
            a[e] = _pack(codes, 4).reshape(rows, -1)
            continue
        # 3- and 6-bit codes: a little-endian bit stream; a code never spans more than two bytes
        pos = torch.arange(32, device=dev) * bits
        lo = pos >> 3
        hi = torch.clamp(lo + 1, max=qsb - 1)
        word = q64[:, :, lo] | (q64[:, :, hi] << 8)
        codes = (word >> (pos & 7)) & ((1 << bits) - 1)
        a[e] = _pack(codes & ((1 << f.abits) - 1), f.abits).reshape(rows, -1)
        b[e] = _pack(codes >> f.abits, f.bbits).reshape(rows, -1)
    return a, b, s, o


def _unpack_codes(plane, nbits: int, shape):
    import torch

    per = 8 // nbits
    sh = torch.arange(per, device=plane.device, dtype=torch.int64) * nbits
    return ((plane.to(torch.int64)[..., None] >> sh) & ((1 << nbits) - 1)).reshape(shape)


def unpack_reference(qtype: str, a, b, s, cols: int, levels, scales, tables=None, o=None):
    """float32 (E, rows, cols) weights from the planes, in torch (the layout's
    test oracle: must equal formats.decode bit for bit). levels/scales: the LUTs
    as torch tensors; tables: int64 (E,) first level table of each expert (MIX);
    o: the offset plane (rocmfp2_affine)."""
    import torch

    f = kernel_format(qtype)
    E, rows, _ = a.shape
    codes = _unpack_codes(a, f.abits, (E, rows, cols))
    if f.has_b:
        codes = codes | (_unpack_codes(b, f.bbits, (E, rows, cols)) << f.abits)
    sb = s.to(torch.int64).repeat_interleave(f.group, dim=2)
    tab = torch.zeros_like(sb)
    if f.mix:
        tab = tables.to(torch.int64)[:, None, None] + (sb >> 7)
    w = levels[tab, codes] * scales[sb]
    if f.affine:
        w = w - scales[o.to(torch.int64).repeat_interleave(f.group, dim=2)]  # its own rounding
    return w


# -- the decode-step kernels' word layout (kernels/gemv_triton.py) -------------

#: qtypes whose levels are small integers, read as 32-bit words of codes:
#: qtype -> (bits per code, level offset): level = code - offset
LINEAR_QTYPES = {"rocmfp2": (2, 1), "rocmfp3": (4, 4)}
# rocmfp3's 3-bit code (sign bit 2, magnitudes 0, 1, 2, 4) -> level + 4
_FP3_TO_LIN4 = (4, 5, 6, 8, 4, 3, 2, 0)


@dataclass(frozen=True, eq=False)
class LinearPlanes:
    """a: int32 (E, rows, cols / 16), one word per 16-weight scale group
    (2-bit codes), or its first 8 codes (4-bit; a2 holds codes 8..15);
    s: uint8 (E, rows, cols / 16) scale bytes; slut: float32 (256,);
    a weight is (code - off) * slut[s]."""

    qtype: str
    a: object
    a2: object
    s: object
    slut: object
    cbits: int
    off: int


def _to_int32(words):
    import torch

    # uint32 values held in int64 -> the same 32 bits as int32
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def linear_planes(qtype: str, a, b, s, slut) -> LinearPlanes:
    """The word layout from ``repack``'s planes (same device). rocmfp2: views of
    a and s (no copy); rocmfp3: 4-bit codes of level + 4, repacked per expert."""
    import torch

    if qtype not in LINEAR_QTYPES:
        raise UnsupportedFormatError(f"{qtype} has no linear word layout")
    cbits, off = LINEAR_QTYPES[qtype]
    E, rows, _ = s.shape
    cols = s.shape[2] * 16
    if cbits == 2:
        return LinearPlanes(qtype, a.contiguous().view(torch.int32), None, s, slut, cbits, off)
    lut = torch.tensor(_FP3_TO_LIN4, dtype=torch.int64, device=a.device)
    sh2 = torch.arange(4, device=a.device, dtype=torch.int64) * 2
    sh1 = torch.arange(8, device=a.device, dtype=torch.int64)
    sh4 = torch.arange(8, device=a.device, dtype=torch.int64) * 4
    w0 = torch.empty((E, rows, cols // 16), dtype=torch.int32, device=a.device)
    w1 = torch.empty_like(w0)
    for e in range(E):
        lo = ((a[e].to(torch.int64)[..., None] >> sh2) & 3).reshape(rows, cols)
        hi = ((b[e].to(torch.int64)[..., None] >> sh1) & 1).reshape(rows, cols)
        lin = lut[lo | (hi << 2)].reshape(rows, cols // 16, 2, 8)
        words = (lin << sh4).sum(dim=-1)
        w0[e] = _to_int32(words[..., 0])
        w1[e] = _to_int32(words[..., 1])
    return LinearPlanes(qtype, w0, w1, s, slut, cbits, off)


def linear_reference(lp: LinearPlanes):
    """float32 (E, rows, cols) from the word layout (the test oracle)."""
    import torch

    E, rows, kw = lp.a.shape
    per = 32 // lp.cbits
    sh = torch.arange(per, device=lp.a.device, dtype=torch.int64) * lp.cbits
    mask = (1 << lp.cbits) - 1
    words = lp.a.to(torch.int64) & 0xFFFFFFFF
    codes = (words[..., None] >> sh) & mask
    if lp.a2 is not None:
        codes2 = ((lp.a2.to(torch.int64) & 0xFFFFFFFF)[..., None] >> sh) & mask
        codes = torch.cat([codes, codes2], dim=-1)
    lv = (codes.reshape(E, rows, kw * 16) - lp.off).to(torch.float32)
    return lv * lp.slut[lp.s.to(torch.int64).repeat_interleave(16, dim=2)]
