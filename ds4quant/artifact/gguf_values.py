"""Typed GGUF metadata values: the KV record, its checks, and its wire bytes.

GGUF KV wire (little-endian): ``u64 key_len, key utf-8, u32 type, value``
where a value is a fixed-size scalar, a string (``u64 len, utf-8 bytes``) or
an array (``u32 sub_type, u64 count, count values``). Type ids are
``gguf.GGUFValueType``. Nested arrays are valid GGUF but ggml refuses them,
so ds4quant neither writes nor reads them.

Values as held in memory:

- integer types -> int, FLOAT32/FLOAT64 -> float, BOOL -> bool, STRING -> str
- ARRAY of a numeric type or BOOL -> read-only 1-D numpy array (LE dtype)
- ARRAY of STRING -> tuple of str
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
from gguf import GGUFValueType as VT

from ds4quant.errors import BadInputError

# type -> (struct format, numpy dtype); strings and arrays are variable size.
SCALAR_FORMATS: dict[VT, tuple[str, str]] = {
    VT.UINT8: ("<B", "<u1"),
    VT.INT8: ("<b", "<i1"),
    VT.UINT16: ("<H", "<u2"),
    VT.INT16: ("<h", "<i2"),
    VT.UINT32: ("<I", "<u4"),
    VT.INT32: ("<i", "<i4"),
    VT.FLOAT32: ("<f", "<f4"),
    VT.BOOL: ("<B", "<u1"),  # one byte, 0 or 1
    VT.UINT64: ("<Q", "<u8"),
    VT.INT64: ("<q", "<i8"),
    VT.FLOAT64: ("<d", "<f8"),
}
SCALAR_SIZES: dict[VT, int] = {t: struct.calcsize(f) for t, (f, _) in SCALAR_FORMATS.items()}
_INT_RANGES: dict[VT, tuple[int, int]] = {
    VT.UINT8: (0, 2**8 - 1), VT.INT8: (-(2**7), 2**7 - 1),
    VT.UINT16: (0, 2**16 - 1), VT.INT16: (-(2**15), 2**15 - 1),
    VT.UINT32: (0, 2**32 - 1), VT.INT32: (-(2**31), 2**31 - 1),
    VT.UINT64: (0, 2**64 - 1), VT.INT64: (-(2**63), 2**63 - 1),
}
_FLOATS = (VT.FLOAT32, VT.FLOAT64)


@dataclass(frozen=True, eq=False)
class KV:
    """One metadata value with its GGUF type (``sub_type`` for arrays only)."""

    type: VT
    value: Any
    sub_type: Optional[VT] = None

    def same_as(self, other: "KV") -> bool:
        """Type and value equality (arrays compared element-wise, bitwise for floats)."""
        if self.type != other.type or self.sub_type != other.sub_type:
            return False
        if isinstance(self.value, np.ndarray):
            a, b = self.value, other.value
            return a.shape == b.shape and a.tobytes() == b.tobytes()
        if self.type in _FLOATS:
            fmt = SCALAR_FORMATS[self.type][0]
            return struct.pack(fmt, self.value) == struct.pack(fmt, other.value)
        return bool(self.value == other.value)

    def plain(self) -> Any:
        """The value alone (arrays stay numpy arrays / tuples)."""
        return self.value


def _check_scalar(value: Any, vtype: VT, what: str) -> Any:
    if vtype == VT.BOOL:
        if not isinstance(value, (bool, np.bool_)):
            raise BadInputError(f"{what}: BOOL value must be a bool, got {type(value).__name__}")
        return bool(value)
    if vtype in _INT_RANGES:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise BadInputError(f"{what}: {vtype.name} value must be an int, got {type(value).__name__}")
        lo, hi = _INT_RANGES[vtype]
        if not lo <= int(value) <= hi:
            raise BadInputError(f"{what}: {int(value)} does not fit {vtype.name} [{lo}, {hi}]")
        return int(value)
    if vtype in _FLOATS:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise BadInputError(f"{what}: {vtype.name} value must be a number, got {type(value).__name__}")
        f = float(value)
        with np.errstate(over="ignore"):
            overflows = vtype == VT.FLOAT32 and math.isfinite(f) and not np.isfinite(np.float32(f))
        if overflows:
            raise BadInputError(f"{what}: {f} overflows FLOAT32")
        # hold the value as it will read back (FLOAT32 rounds once)
        return float(np.float32(f)) if vtype == VT.FLOAT32 else f
    if vtype == VT.STRING:
        if not isinstance(value, str):
            raise BadInputError(f"{what}: STRING value must be a str, got {type(value).__name__}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadInputError(f"{what}: string is not encodable as UTF-8 ({e.reason})") from None
        return value
    raise BadInputError(f"{what}: {vtype!r} is not a scalar GGUF value type")


def make_kv(value: Any, vtype: "VT | int", sub_type: "VT | int | None" = None, *, what: str = "value") -> KV:
    """Check ``value`` against its GGUF type and return a normalised KV.

    Arrays: ``sub_type`` is required; numeric/bool arrays accept any sequence,
    numpy array or (UINT8 only) bytes-like object; string arrays a sequence of
    str. Raises BadInputError for a value the type cannot carry.
    """
    try:
        vtype = VT(int(vtype))
    except ValueError:
        raise BadInputError(f"{what}: unknown GGUF value type {vtype!r}") from None
    if vtype != VT.ARRAY:
        if sub_type is not None:
            raise BadInputError(f"{what}: sub_type is only for ARRAY values")
        return KV(vtype, _check_scalar(value, vtype, what))
    if sub_type is None:
        raise BadInputError(f"{what}: ARRAY values need a sub_type")
    try:
        sub = VT(int(sub_type))
    except ValueError:
        raise BadInputError(f"{what}: unknown GGUF array element type {sub_type!r}") from None
    if sub == VT.ARRAY:
        raise BadInputError(f"{what}: nested arrays are not supported (ggml refuses them)")
    if sub == VT.STRING:
        if isinstance(value, (str, bytes)):
            raise BadInputError(f"{what}: a STRING array needs a sequence of str, not one {type(value).__name__}")
        return KV(VT.ARRAY, tuple(_check_scalar(v, VT.STRING, f"{what}[{i}]") for i, v in enumerate(value)), sub)
    dtype = np.dtype(SCALAR_FORMATS[sub][1])
    if isinstance(value, (bytes, bytearray, memoryview)):
        if sub != VT.UINT8:
            raise BadInputError(f"{what}: bytes can only fill a UINT8 array, not {sub.name}")
        arr = np.frombuffer(bytes(value), dtype=np.uint8).copy()
    else:
        src = np.asarray(value)
        if src.ndim != 1:
            raise BadInputError(f"{what}: array values must be 1-D, got shape {src.shape}")
        if sub == VT.BOOL:
            if src.size and src.dtype != np.bool_:
                raise BadInputError(f"{what}: BOOL array needs bool elements, got {src.dtype}")
            arr = src.astype(np.uint8)
        elif sub in _FLOATS:
            if src.size and src.dtype.kind not in "fiu":
                raise BadInputError(f"{what}: {sub.name} array needs numbers, got {src.dtype}")
            if sub == VT.FLOAT32 and src.size and src.dtype.kind == "f":
                fin = np.isfinite(src)
                with np.errstate(over="ignore"):
                    if not np.all(np.isfinite(src.astype(dtype))[fin]):
                        raise BadInputError(f"{what}: values overflow FLOAT32")
            arr = src.astype(dtype)
        else:
            if src.size and src.dtype.kind not in "iu":
                raise BadInputError(f"{what}: {sub.name} array needs integers, got {src.dtype}")
            lo, hi = _INT_RANGES[sub]
            if src.size and (int(src.min()) < lo or int(src.max()) > hi):
                raise BadInputError(f"{what}: values outside {sub.name} [{lo}, {hi}]")
            arr = src.astype(dtype)
    arr = np.ascontiguousarray(arr, dtype=dtype)
    if sub == VT.BOOL:
        arr = arr.view(np.bool_)
    arr.flags.writeable = False
    return KV(VT.ARRAY, arr, sub)


def pack_string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def pack_value(kv: KV) -> bytes:
    """Wire bytes of a KV's type and value (the key is packed by the caller)."""
    out = [struct.pack("<I", int(kv.type))]
    if kv.type == VT.STRING:
        out.append(pack_string(kv.value))
    elif kv.type == VT.ARRAY:
        out.append(struct.pack("<IQ", int(kv.sub_type), len(kv.value)))
        if kv.sub_type == VT.STRING:
            out.extend(pack_string(s) for s in kv.value)
        else:
            a = kv.value.view(np.uint8) if kv.sub_type == VT.BOOL else kv.value
            out.append(np.ascontiguousarray(a).tobytes())
    else:
        v = int(kv.value) if kv.type == VT.BOOL else kv.value
        out.append(struct.pack(SCALAR_FORMATS[kv.type][0], v))
    return b"".join(out)


def pack_kv(key: str, kv: KV) -> bytes:
    return pack_string(key) + pack_value(kv)
