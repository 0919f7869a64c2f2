"""Bounded little-endian reading and bf16 helpers shared by the blob modules.

Every read names its field and is checked against the bytes that remain
before anything is allocated, so a hostile count fails fast with the offset.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from ds4quant.errors import CodebookError, CorruptDataError

MAX_EXPERTS = 65536  # Lucebox reader bound on E (docs/formats.md#p4mix)
MAX_DIM = 1 << 20  # Lucebox reader bound on out / in


def as_buffer(data: Any, what: str) -> memoryview:
    """bytes, bytearray, memoryview or a uint8 numpy array -> flat byte view."""
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8:
            raise CorruptDataError(f"blob must be uint8 bytes, got dtype {data.dtype}", where=what)
        data = np.ascontiguousarray(data).reshape(-1)
    try:
        view = memoryview(data)
    except TypeError:
        raise CorruptDataError(f"blob must be bytes, got {type(data).__name__}", where=what) from None
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class Cursor:
    """Reads fields from a byte view; every read is bounds-checked first."""

    def __init__(self, data: Any, what: str) -> None:
        self.buf = as_buffer(data, what)
        self.pos = 0
        self.what = what

    @property
    def remaining(self) -> int:
        return len(self.buf) - self.pos

    def fail(self, message: str, cls=CorruptDataError):
        raise cls(message, where=self.what)

    def need(self, n: int, field: str) -> None:
        if n > self.remaining:
            self.fail(f"truncated at offset {self.pos}: {field} needs {n} bytes, {self.remaining} left")

    def raw(self, n: int, field: str) -> bytes:
        self.need(n, field)
        out = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return out

    def u8(self, field: str) -> int:
        return self.raw(1, field)[0]

    def u16(self, field: str) -> int:
        return struct.unpack("<H", self.raw(2, field))[0]

    def u32(self, field: str) -> int:
        return struct.unpack("<I", self.raw(4, field))[0]

    def array(self, dtype: str, count: int, field: str) -> np.ndarray:
        """``count`` little-endian items (count already bounded by the caller)."""
        dt = np.dtype(dtype)
        self.need(count * dt.itemsize, field)
        out = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).astype(dt.newbyteorder("="))
        self.pos += count * dt.itemsize
        return out

    def finish(self) -> None:
        if self.remaining:
            self.fail(f"{self.remaining} trailing bytes after the last entry (offset {self.pos})")


def open_blob(data: Any, what: str, magic: bytes, least_entry: int,
              refused: "dict[bytes, str] | None" = None) -> "tuple[Cursor, int]":
    """Read the 16-byte header every Lucebox sidecar shares (8-byte magic,
    u32 n_entries, u32 reserved) and bound n_entries by the bytes left, given
    the smallest possible entry. Returns (cursor at the first entry, n)."""
    cur = Cursor(data, what)
    got = cur.raw(8, "magic")
    if refused and got in refused:
        cur.fail(refused[got])
    if got != magic:
        cur.fail(f"bad magic {got!r}, expected {magic!r}")
    n = cur.u32("n_entries")
    cur.u32("reserved")
    if n * least_entry > cur.remaining:
        cur.fail(f"n_entries = {n} needs at least {n * least_entry} bytes, only {cur.remaining} left")
    return cur, n


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 words -> float32 of the same shape."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray, what: str) -> np.ndarray:
    """bf16-exact float32 -> uint16 words; refuses values bf16 cannot hold."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    if np.any(u & 0xFFFF):
        raise CodebookError("codebook levels must be exactly representable in bf16", where=what)
    return (u >> 16).astype(np.uint16)


def check_books(books: np.ndarray, modes: np.ndarray, what: str) -> None:
    """Books float32 (E, 2, L): finite and strictly increasing per book for
    every expert in mode 1 (mode-0 experts never read their books, docs/formats.md#mix)."""
    if books.shape[0] == 0:
        return
    use = modes == 1
    finite = np.all(np.isfinite(books), axis=(1, 2))
    increasing = np.all(np.diff(books, axis=2) > 0, axis=(1, 2))
    bad = np.flatnonzero(use & ~(finite & increasing))
    if len(bad):
        e = int(bad[0])
        raise CodebookError(
            f"expert {e} (and {len(bad) - 1} more) has books that are not finite and strictly increasing: "
            f"{books[e].tolist()}",
            where=what,
        )


def check_modes(modes: np.ndarray, what: str, cls=CorruptDataError) -> None:
    bad = np.flatnonzero(modes > 1)
    if len(bad):
        raise cls(f"expert {int(bad[0])} has mode {int(modes[bad[0]])}; modes are 0 or 1", where=what)


def frozen(a: np.ndarray) -> np.ndarray:
    a = np.array(a, copy=True)
    a.setflags(write=False)
    return a
