"""A validating safetensors reader with memory-mapped, zero-copy tensor access.

File layout (safetensors format)::

    [8 bytes]  N, unsigned little-endian: header length
    [N bytes]  UTF-8 JSON object {name: {"dtype", "shape", "data_offsets": [begin, end]},
               optional "__metadata__": {str: str}}, may be padded with spaces
    [rest]     the byte buffer; offsets are relative to its start

Checks, in order, before any tensor is touched: the file holds the 8-byte
prefix; N fits in the file (and under 100 MB, as the format requires); the
header is UTF-8 JSON, an object, with no duplicate names; each entry has
exactly the three fields with the right types; the dtype is known; shapes are
non-negative ints; byte length == numel * itemsize computed in Python ints
(F4 packs two values per byte); every span lies inside the buffer; spans do
not overlap and cover the buffer exactly (no holes, nothing trailing).
Every refusal is a ``CorruptDataError`` naming the file and the tensor.

Tensors are returned as read-only numpy views of one ``np.memmap`` of the
file; the FP8/FP4/BF16 payloads come back as their raw integer words
(uint8/uint16) for the codecs to decode.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Iterator

import numpy as np

from ds4quant.errors import BadInputError, CorruptDataError

MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit

# dtype tag -> (bits per element, numpy dtype of the raw words we hand out)
DTYPES: "MappingProxyType[str, tuple[int, str]]" = MappingProxyType({
    "BOOL": (8, "|b1"),
    "U8": (8, "|u1"),
    "I8": (8, "|i1"),
    "I16": (16, "<i2"),
    "U16": (16, "<u2"),
    "F16": (16, "<f2"),
    "BF16": (16, "<u2"),  # raw bf16 words
    "I32": (32, "<i4"),
    "U32": (32, "<u4"),
    "F32": (32, "<f4"),
    "I64": (64, "<i8"),
    "U64": (64, "<u8"),
    "F64": (64, "<f8"),
    "F8_E4M3": (8, "|u1"),  # raw e4m3fn bytes
    "F8_E5M2": (8, "|u1"),
    "F8_E8M0": (8, "|u1"),  # raw exponent bytes
    "F4": (4, "|u1"),  # two e2m1 codes per byte, element 2j in the low nibble
})


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file. ``begin``/``end`` are buffer offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _no_duplicates(pairs):
    seen = {}
    for k, v in pairs:
        if k in seen:
            raise _Duplicate(k)
        seen[k] = v
    return seen


class _Duplicate(Exception):
    pass


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class SafetensorsFile:
    """Open and validate one .safetensors file; read tensors lazily.

    Example::

        with SafetensorsFile("model-00001-of-00002.safetensors") as f:
            w = f.read("layers.0.ffn.experts.0.w1.weight")   # int8 memmap view
    """

    def __init__(self, path: "str | os.PathLike"):
        self.path = Path(path)
        self._mm = None
        where = str(self.path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as fh:
                prefix = fh.read(8)
                if len(prefix) < 8:
                    raise CorruptDataError(f"file of {size} bytes is too short for a safetensors header", where=where)
                n = int.from_bytes(prefix, "little")
                if n > size - 8:
                    raise CorruptDataError(
                        f"header length {n} runs past the end of the file ({size} bytes): truncated or not safetensors",
                        where=where)
                if n > MAX_HEADER_BYTES:
                    raise CorruptDataError(f"header length {n} exceeds the format limit {MAX_HEADER_BYTES}", where=where)
                raw = fh.read(n)
        except FileNotFoundError:
            raise BadInputError("file not found", where=where) from None
        except IsADirectoryError:
            raise BadInputError("is a directory, expected a .safetensors file", where=where) from None
        if len(raw) != n:
            raise CorruptDataError(f"header is {len(raw)} bytes, expected {n}", where=where)
        self.file_size = size
        self.header_bytes = raw
        self.data_start = 8 + n
        self.data_len = size - self.data_start
        self.header_sha256 = hashlib.sha256(raw).hexdigest()
        self.metadata, self._entries = self._parse_header(raw, where)

    # -- validation ----------------------------------------------------------

    def _parse_header(self, raw: bytes, where: str):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CorruptDataError(f"header is not UTF-8 (byte {e.start})", where=where) from None
        if not text.startswith("{"):
            raise CorruptDataError("header does not start with '{'", where=where)
        try:
            obj = json.loads(text, object_pairs_hook=_no_duplicates)
        except _Duplicate as d:
            raise CorruptDataError(f"header names tensor {d.args[0]!r} twice", where=where) from None
        except (json.JSONDecodeError, RecursionError) as e:
            raise CorruptDataError(f"header is not valid JSON ({e})", where=where) from None
        if not isinstance(obj, dict):
            raise CorruptDataError("header JSON is not an object", where=where)

        metadata = obj.pop("__metadata__", None)
        if metadata is None:
            metadata = {}
        if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in metadata.items()):
            raise CorruptDataError("__metadata__ must map strings to strings", where=where)

        entries: dict[str, TensorEntry] = {}
        for name, spec in obj.items():
            tw = f"{where}: tensor {name!r}"
            if not isinstance(spec, dict):
                raise CorruptDataError("entry is not an object", where=tw)
            if set(spec) != {"dtype", "shape", "data_offsets"}:
                raise CorruptDataError(
                    f"entry must have exactly dtype, shape, data_offsets; got {sorted(spec)}", where=tw)
            dtype, shape, offs = spec["dtype"], spec["shape"], spec["data_offsets"]
            if not isinstance(dtype, str) or dtype not in DTYPES:
                raise CorruptDataError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})", where=tw)
            if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
                raise CorruptDataError(f"shape must be a list of non-negative ints, got {shape!r}", where=tw)
            if (not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(o) for o in offs)
                    or offs[0] < 0 or offs[1] < offs[0]):
                raise CorruptDataError(f"data_offsets must be [begin, end] with 0 <= begin <= end, got {offs!r}",
                                       where=tw)
            numel = 1
            for d in shape:
                numel *= d  # Python int: cannot wrap
            bits = DTYPES[dtype][0] * numel
            if bits % 8:
                raise CorruptDataError(f"{numel} elements of {dtype} are not a whole number of bytes", where=tw)
            if dtype == "F4" and shape and shape[-1] % 2:
                raise CorruptDataError(f"F4 last dimension {shape[-1]} must be even (two codes per byte)", where=tw)
            if offs[1] - offs[0] != bits // 8:
                raise CorruptDataError(
                    f"byte length {offs[1] - offs[0]} != {bits // 8} for {dtype} {tuple(shape)}", where=tw)
            if offs[1] > self.data_len:
                raise CorruptDataError(
                    f"data [{offs[0]}, {offs[1]}) lies outside the {self.data_len}-byte buffer: file truncated?",
                    where=tw)
            entries[name] = TensorEntry(name, dtype, tuple(shape), offs[0], offs[1])

        # Spans must tile the buffer: sorted by begin, each begins where the last ended.
        pos = 0
        prev = None
        for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
            if e.begin != pos:
                what = (f"overlaps tensor {prev.name!r}" if e.begin < pos
                        else f"leaves a hole of {e.begin - pos} bytes before it")
                raise CorruptDataError(f"data [{e.begin}, {e.end}) {what}", where=f"{where}: tensor {e.name!r}")
            pos = e.end
            if e.nbytes:
                prev = e
        if pos != self.data_len:
            raise CorruptDataError(
                f"{self.data_len - pos} bytes after the last tensor are not covered by the header", where=where)
        return MappingProxyType(metadata), entries

    # -- access ----------------------------------------------------------------

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, name: str) -> TensorEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise BadInputError("no such tensor", where=f"{self.path}: tensor {name!r}") from None

    def _map(self):
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
            if len(self._mm) != self.file_size:
                raise CorruptDataError(
                    f"file changed size while open ({len(self._mm)} != {self.file_size})", where=str(self.path))
        return self._mm

    def read(self, name: str) -> np.ndarray:
        """The raw tensor as a read-only numpy view (no copy).

        BF16 -> uint16 words, F8_* -> uint8 bytes, F4 -> uint8 (..., last/2).
        """
        e = self.entry(name)
        bits, np_dtype = DTYPES[e.dtype]
        shape = e.shape
        if e.dtype == "F4":
            shape = shape[:-1] + (shape[-1] // 2,) if shape else shape
        if e.nbytes == 0:
            return np.zeros(shape, dtype=np_dtype)
        buf = self._map()[self.data_start + e.begin:self.data_start + e.end]
        arr = buf.view(np_dtype).reshape(shape)
        arr.flags.writeable = False
        return arr

    def release(self, name: str) -> None:
        """Drop the tensor's pages from this process (madvise DONTNEED).

        The mapping is read-only and file-backed, so a later read simply pages
        the bytes in again; this keeps RSS near one tensor while a converter
        streams a checkpoint larger than memory.
        """
        if self._mm is None:
            return
        e = self.entry(name)
        raw = getattr(self._mm, "_mmap", None)
        if raw is None or e.nbytes == 0 or not hasattr(raw, "madvise"):
            return
        page = mmap.PAGESIZE
        start = (self.data_start + e.begin) // page * page
        end = self.data_start + e.end
        try:
            raw.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):
            pass  # advice only; never fatal

    def close(self) -> None:
        """Drop our reference to the mapping; arrays already handed out keep it
        alive until they are freed (closing it under them would crash)."""
        self._mm = None

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
