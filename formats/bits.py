"""Bit packing shared by the codecs (numpy reference versions).

ROCmFPX packs b-bit codes as a little-endian bit stream: code ``i`` of a
block occupies stream bits ``b*i .. b*i+b-1`` and stream bit ``s`` is bit
``s % 8`` of byte ``s // 8`` (docs/formats.md#rocmfp2, #rocmfp3, #rocmfp6). For b = 2 that is the familiar
"weight i at bits 2*(i%4) of qs[i//4]"::

    qs[0] = w3 w3 w2 w2 w1 w1 w0 w0   (bit 7 .. bit 0)

ROCmFP4 and MXFP4 use nibbles instead (see ``pack_nibbles_split``).
"""

from __future__ import annotations

import numpy as np


def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes uint8 (n, m) with values < 2**bits -> uint8 (n, m*bits/8)."""
    codes = np.asarray(codes, dtype=np.uint8)
    n, m = codes.shape
    if (m * bits) % 8:
        raise ValueError("m*bits must be a multiple of 8")
    expanded = (codes[:, :, None] >> np.arange(bits, dtype=np.uint8)) & 1
    return np.packbits(expanded.reshape(n, m * bits), axis=1, bitorder="little")


def unpack_bits(packed: np.ndarray, bits: int, m: int) -> np.ndarray:
    """Inverse of pack_bits: uint8 (n, m*bits/8) -> uint8 (n, m)."""
    packed = np.asarray(packed, dtype=np.uint8)
    n = packed.shape[0]
    stream = np.unpackbits(packed, axis=1, bitorder="little")[:, : m * bits]
    weights = (np.uint8(1) << np.arange(bits, dtype=np.uint8))
    return (stream.reshape(n, m, bits) * weights).sum(axis=2, dtype=np.uint16).astype(np.uint8)


def pack_nibbles_split(codes: np.ndarray) -> np.ndarray:
    """(n, 32) 4-bit codes -> (n, 16): byte j = code[j] | code[j+16] << 4."""
    codes = np.asarray(codes, dtype=np.uint8)
    return (codes[:, :16] & 0xF) | ((codes[:, 16:32] & 0xF) << 4)


def unpack_nibbles_split(packed: np.ndarray) -> np.ndarray:
    """(n, 16) bytes -> (n, 32) codes: low nibbles are 0..15, high 16..31."""
    packed = np.asarray(packed, dtype=np.uint8)
    return np.concatenate([packed & 0xF, packed >> 4], axis=1)
