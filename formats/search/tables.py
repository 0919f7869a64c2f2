"""The tables of the searches: the scale-search formats (ROCmFP2/3/4/6/8,
ROCmFP2 S40), MIX mode 0, and their copies on a device.

Element quantiser ids, per-format code widths, zero codes, the search's
initial pairs, and the decode tables: a decoded weight is
``LEVELS[fmt][code] * SCALES[fmt][e]`` (docs/formats.md#levels); MIX mode 0
decodes ``FIXED[bits][code] * S(meta)`` (docs/formats.md#mix). Shared by the numpy reference
search, the numba fast path, the block drivers, the row decoders and the
device tiers, which read them through ``ue4m3_on`` / ``scale_format_on``
(one upload per device, kept).
"""

from __future__ import annotations

import numpy as np

from ds4quant.formats.ue4m3 import FLT_MAX, UE4M3, UE4M3_INV

F32 = np.float32

# Element quantiser ids (index into the tables below).
FP2, FP3, FP6, FP8, FP4, S40 = 0, 1, 2, 3, 4, 5
FORMAT_NAMES = ("fp2", "fp3", "fp6", "fp8", "fp4", "s40")

# Largest level magnitude: the reference walk starts at N(max_abs / top) and
# bounds the clip error of the largest element with (max_abs - top*S)^2 (docs/formats.md#scale-search).
TOP = np.array([2, 4, 31, 127, 10, 4], dtype=np.float32)
# Bits per code on the wire (FP4 is nibbles in split order, docs/formats.md#rocmfp4).
BITS = np.array([2, 3, 6, 8, 4, 2], dtype=np.int64)
# The code an element gets when it is non-finite or the scale is 0:
# FP2's zero is code 1 (docs/formats.md#rocmfp2); S40's code 0 is the -4 level (fork behaviour).
ZERO_CODE = np.array([1, 0, 0, 0, 0, 0], dtype=np.uint8)
# Initial pair of the search (see module docstring); S40 is computed per group.
INIT_E = np.array([127, 127, 127, 127, 0, 127], dtype=np.int64)
INIT_ERR = np.array([np.inf, np.inf, np.inf, np.inf, FLT_MAX, np.inf], dtype=np.float32)

FP4_THRESHOLDS = np.array([0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 9.0], dtype=np.float32)  # docs/formats.md#rocmfp4


def _build_levels() -> np.ndarray:
    """V(code) for every format and code byte, float32 (6, 256).

    Levels are integers converted to float32, so "-0" codes (FP3 code 4,
    FP4 code 8, FP6 code 32) decode as +0 like the reference's integer V.
    """
    lv = np.zeros((6, 256), dtype=np.float32)
    c = np.arange(256)
    lv[FP2, :4] = np.arange(4) - 1  # docs/formats.md#rocmfp2: {-1, 0, 1, 2}
    mag3 = np.array([0, 1, 2, 4])
    lv[FP3, :8] = np.where(c[:8] & 4, -mag3[c[:8] & 3], mag3[c[:8] & 3])  # docs/formats.md#rocmfp3
    lv[FP6, :64] = np.where(c[:64] & 32, -(c[:64] & 31), c[:64] & 31)  # docs/formats.md#rocmfp6
    lv[FP8, :] = c.astype(np.uint8).view(np.int8)  # docs/formats.md#rocmfp8: two's complement
    mag4 = np.array([0, 1, 2, 3, 4, 6, 8, 10])
    lv[FP4, :16] = np.where(c[:16] & 8, -mag4[c[:16] & 7], mag4[c[:16] & 7])  # docs/formats.md#rocmfp4 Codebook10
    lv[S40, :4] = [-4, -1, 1, 4]  # S40 "MORD" order
    lv.setflags(write=False)
    return lv


def _build_scales() -> np.ndarray:
    """Decoded scale for every format and scale byte, float32 (6, 256)."""
    sc = np.empty((6, 256), dtype=np.float32)
    sc[:] = UE4M3  # S(e); 0 for e > 0x7E (docs/formats.md#ue4m3)
    e = np.arange(256)
    # docs/formats.md#rocmfp2 fp2s: bit 7 negates S(e & 0x7F) (0x7F/0xFF -> scale +-0).
    mag = UE4M3[e & 0x7F]
    sc[FP2] = np.where(e & 0x80, -mag, mag)
    sc.setflags(write=False)
    return sc


LEVELS = _build_levels()
SCALES = _build_scales()


#: qtype -> (element format, weights per scale) of the scale searches the
#: device tiers run: the adaptive recipe's scale-search candidates
SCALE_SEARCHES = {"rocmfp2": (FP2, 16), "rocmfp3": (FP3, 16), "rocmfp4": (FP4, 16), "rocmfp4_fast": (FP4, 32)}

HALF = 16  # weights per MIX half: one scale byte (and book) each (docs/formats.md#mix)

# Mode-0 MIX levels (docs/formats.md#mix), indexed by code: 106 is code - 1 (FP2's levels),
# 105 is FP3's sign-magnitude {0, 1, 2, 4, +0, -1, -2, -4}.
FIXED_106 = np.array([-1.0, 0.0, 1.0, 2.0], dtype=np.float32)
FIXED_105 = np.array([0.0, 1.0, 2.0, 4.0, 0.0, -1.0, -2.0, -4.0], dtype=np.float32)
FIXED_106.setflags(write=False)
FIXED_105.setflags(write=False)


def fixed_levels(bits: int) -> np.ndarray:
    """The mode-0 levels of MIX codes of ``bits`` bits (2: ggml 106, 3: ggml 105)."""
    return FIXED_106 if bits == 2 else FIXED_105


# --------------------------------------------------------------------------
# the tables on a device (torch imported on first use)

_ON_DEVICE: dict = {}
_MAG = {FP3: (0.0, 1.0, 2.0, 4.0), FP4: (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 10.0)}
_THR = {FP3: (0.5, 1.5, 3.0), FP4: tuple(float(t) for t in FP4_THRESHOLDS)}


def ue4m3_on(dev):
    """(S(e), 1/S(e)) for e = 0..255 as float32 tensors on ``dev``."""
    import torch

    key = ("ue4m3", str(dev))
    t = _ON_DEVICE.get(key)
    if t is None:
        t = _ON_DEVICE[key] = (torch.from_numpy(UE4M3.copy()).to(dev), torch.from_numpy(UE4M3_INV.copy()).to(dev))
    return t


def scale_format_on(dev, fmt: int) -> dict:
    """Format ``fmt``'s tables on ``dev`` as float32 tensors: S, INV, S1 (S(1..126)),
    levels, scales; FP3/FP4 their magnitudes and thresholds (mag, thr), FP2 its
    thresholds (thr2)."""
    import torch

    key = ("scale", str(dev), fmt)
    t = _ON_DEVICE.get(key)
    if t is None:
        f32 = lambda a: torch.tensor(np.asarray(a, np.float32), device=dev)  # noqa: E731
        t = {"S": f32(UE4M3), "INV": f32(UE4M3_INV), "S1": f32(UE4M3[1:127]),
             "levels": f32(LEVELS[fmt]), "scales": f32(SCALES[fmt])}
        if fmt in _MAG:
            t["mag"], t["thr"] = f32(_MAG[fmt]), f32(_THR[fmt])
        if fmt == FP2:
            t["thr2"] = f32((-0.5, 0.5, 1.5))
        _ON_DEVICE[key] = t
    return t
