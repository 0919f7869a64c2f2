"""Importance matrices from llama.cpp's ``llama-imatrix``: read, write, mean E[x^2].

An imatrix holds, per weight tensor, the sum of the squared input activations
per input column (and the number of tokens summed), so ``sum / count`` is
E[x^2] per column: the importance weights the codecs take (docs/formats.md#scale-search).
Expert stacks (``ffn_*_exps``) hold one vector per expert.

Two file forms exist, both little-endian.

GGUF (the current ``llama-imatrix`` default)::

    KV  general.type = "imatrix"
        imatrix.datasets     [string]   dataset files the sums came from
        imatrix.chunk_count  u32        chunks processed
        imatrix.chunk_size   u32        tokens per chunk
    per weight tensor NAME:
        NAME.in_sum2  F32 ne = [cols, n_mat]  sum of x^2 per column per matrix
        NAME.counts   F32 ne = [1, n_mat]     tokens that reached each matrix
        NAME.in_sum   F32 ne = [cols, n_mat]  sum of x (optional; not used)

Legacy ``imatrix.dat`` (no magic)::

    i32 n_entries
    n_entries x { i32 len, u8 name[len], i32 ncall, i32 nval, f32 values[nval] }
    i32 last_chunk, i32 len, u8 dataset[len]      (tail; older files lack it,
                                                   or carry only last_chunk)

where ``values = mean(x^2) * ncall`` (so ``values / ncall`` is the mean) and
an expert stack is one flat vector of ``n_expert * cols`` values sharing one
``ncall``; llama.cpp stores 1.0 as the mean of an expert that saw no token.

Lucebox layout (what Lucebox's ``ds4_mix_converter`` reads,
docs/formats.md#imatrix): the legacy entries **without
any tail** (its loader refuses trailing bytes), every ``ncall > 0``, at most
2^24 values and 4096 name bytes per entry, and **one** input-length vector per
tensor: an expert stack ``blk.L.ffn_*_exps.weight`` holds ``cols`` values that
every expert of the stack shares, where llama.cpp stores ``n_expert * cols``.
The converter uses the values as stored, so ``write_imatrix_lucebox`` writes
the mean E[x^2] itself with ``ncall = 1`` (a stack's mean pools all its
experts' tokens: sum of x^2 over every routed token / their count).
``read_imatrix`` reads a file without a tail as ``format == "lucebox"`` and
``importance_for`` hands a stack's one vector to every expert, so
``convert --imatrix`` takes either file.

Example::

    im = read_imatrix("imatrix.gguf")
    q = importance_for(im, "blk.3.ffn_down_exps.weight", expert=17)  # float32 (cols,) or None
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, BinaryIO, Callable, Mapping, Optional

import numpy as np

from ds4quant.artifact.atomic import atomic_write
from ds4quant.errors import BadInputError, CorruptDataError, ShapeError

__all__ = [
    "Imatrix",
    "ImatrixEntry",
    "make_imatrix",
    "read_imatrix",
    "write_imatrix_gguf",
    "write_imatrix_dat",
    "write_imatrix_lucebox",
    "importance_for",
]

GGUF_MAGIC = b"GGUF"
_GGUF_ALIGNMENT = 32  # GGUF default when general.alignment is absent
_GGUF_UINT32, _GGUF_STRING, _GGUF_ARRAY = 4, 8, 9  # GGUF value type ids
_I32_MAX = 2**31 - 1

SUFFIX_SUM2 = ".in_sum2"
SUFFIX_COUNTS = ".counts"
SUFFIX_SUM = ".in_sum"


# --------------------------------------------------------------------------
# records


@dataclass(frozen=True, eq=False)
class ImatrixEntry:
    """One weight tensor's statistics (arrays are read-only).

    values: float32 (cols,) for one matrix, (n_mat, cols) for a stack stored
        per expert (GGUF). Legacy files give a flat (n_expert * cols,) vector
        for stacks (see ``importance_for(..., cols=)``).
        GGUF: sums of x^2; legacy: mean(x^2) * ncall. Either way
        ``values / counts`` is the mean.
    counts: float64 (n_mat,): GGUF token counts per matrix; legacy ncall.
    """

    name: str
    values: np.ndarray
    counts: np.ndarray

    @property
    def n_mat(self) -> int:
        return int(self.counts.shape[0])


@dataclass(frozen=True, eq=False)
class Imatrix:
    """An importance matrix: entries by weight-tensor name plus metadata.

    format: what it was read from: "gguf", "dat" (llama.cpp legacy, with the
    chunk-count tail) or "lucebox" (legacy entries with no tail, the layout
    Lucebox's converter reads); "" when built in memory.
    datasets: dataset files named by the file; chunk_count / chunk_size when
    the file says (legacy files have no chunk size). names: sorted entry names.
    """

    path: str
    format: str
    entries: Mapping[str, ImatrixEntry]
    datasets: tuple[str, ...] = ()
    chunk_count: Optional[int] = None
    chunk_size: Optional[int] = None
    names: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", MappingProxyType(dict(self.entries)))
        object.__setattr__(self, "names", tuple(sorted(self.entries)))

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __len__(self) -> int:
        return len(self.entries)


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.array(a, copy=True)
    a.setflags(write=False)
    return a


def _check_entry(name: str, values: Any, counts: Any, fail: Callable[[str], Exception]) -> ImatrixEntry:
    """Validate one entry's arrays; ``fail(msg)`` builds the error to raise."""
    v = np.asarray(values)
    if v.dtype.kind not in "fiu" or v.ndim not in (1, 2) or v.size == 0:
        raise fail(f"entry {name!r}: values must be a non-empty 1-D or 2-D float array, got {v.dtype} {v.shape}")
    v = v.astype(np.float32)
    if v.ndim == 2 and v.shape[0] == 1:
        v = v.reshape(-1)  # one matrix is stored as a vector
    c = np.asarray(counts, dtype=np.float64).reshape(-1)
    n_mat = v.shape[0] if v.ndim == 2 else 1
    if c.shape != (n_mat,):
        raise fail(f"entry {name!r}: {n_mat} matrices but {c.size} counts")
    bad = np.nonzero(~np.isfinite(v.reshape(-1)) | (v.reshape(-1) < 0))[0]
    if bad.size:
        raise fail(
            f"entry {name!r}: value {int(bad[0])} is {float(v.reshape(-1)[bad[0]])!r}; sums of squares must be "
            f"finite and >= 0 ({bad.size} bad values)"
        )
    badc = np.nonzero(~np.isfinite(c) | (c < 0) | (c != np.floor(c)))[0]
    if badc.size:
        raise fail(f"entry {name!r}: count {int(badc[0])} is {float(c[badc[0]])!r}; counts must be whole numbers >= 0")
    return ImatrixEntry(name=name, values=_frozen(v), counts=_frozen(c))


def make_imatrix(
    sums: Mapping[str, tuple[Any, Any]],
    *,
    datasets: tuple[str, ...] = (),
    chunk_count: Optional[int] = None,
    chunk_size: Optional[int] = None,
    path: str = "",
) -> Imatrix:
    """Build an Imatrix from ``{name: (values, counts)}`` (see ImatrixEntry).

    values: float (cols,) or (n_mat, cols), finite and >= 0; counts: whole
    numbers >= 0, one per matrix (a scalar for one matrix).
    """
    entries = {}
    for name, (values, counts) in sums.items():
        if not isinstance(name, str) or not name:
            raise BadInputError(f"imatrix entry names must be non-empty strings, got {name!r}")
        entries[name] = _check_entry(name, values, counts, lambda m: BadInputError(m))
    for what, n in (("chunk_count", chunk_count), ("chunk_size", chunk_size)):
        if n is not None and not (isinstance(n, (int, np.integer)) and 0 <= n <= 2**32 - 1):
            raise BadInputError(f"imatrix {what} must be an int in 0..2^32-1, got {n!r}")
    return Imatrix(
        path=str(path),
        format="",
        entries=entries,
        datasets=tuple(str(d) for d in datasets),
        chunk_count=None if chunk_count is None else int(chunk_count),
        chunk_size=None if chunk_size is None else int(chunk_size),
    )


# --------------------------------------------------------------------------
# the mean E[x^2]


def importance_for(
    imatrix: Imatrix, tensor_name: str, expert: Optional[int] = None, *, cols: Optional[int] = None
) -> Optional[np.ndarray]:
    """Mean E[x^2] per input column for one tensor (or one expert of a stack).

    Returns float32 (cols,) = values / count, or None when the imatrix has no
    entry for ``tensor_name`` or the matrix saw no token (count 0): the caller
    then falls back to the weight-only error. ``expert`` selects a matrix of
    a per-expert entry; ``cols``, when given, is checked against the entry and
    splits a legacy flat expert stack (n_expert * cols values).
    """
    entry = imatrix.entries.get(tensor_name)
    if entry is None:
        return None
    where = f"{imatrix.path or 'imatrix'}: {tensor_name}"
    if expert is not None and (not isinstance(expert, (int, np.integer)) or expert < 0):
        raise BadInputError(f"expert must be an int >= 0, got {expert!r}", where=where)
    vals = entry.values
    if vals.ndim == 2:
        if expert is None:
            raise BadInputError(f"the imatrix stores {entry.n_mat} expert vectors; pass expert=", where=where)
        if expert >= entry.n_mat:
            raise ShapeError(f"expert {expert} out of range: the imatrix has {entry.n_mat} experts", where=where)
        row, count = vals[expert], entry.counts[expert]
    elif expert is None:
        row, count = vals, entry.counts[0]
    else:
        if cols is None:
            raise BadInputError(
                f"the imatrix stores {vals.shape[0]} values in one vector; pass cols= to pick expert {expert}",
                where=where,
            )
        if vals.shape[0] == cols:
            # Lucebox layout: one input-length vector shared by every expert
            # of the stack (see the module doc).
            row, count = vals, entry.counts[0]
            return None if count == 0 else (row / np.float32(count)).astype(np.float32)
        if cols <= 0 or vals.shape[0] % cols:
            raise ShapeError(f"{vals.shape[0]} imatrix values are not a whole number of {cols}-column experts", where=where)
        n_expert = vals.shape[0] // cols
        if expert >= n_expert:
            raise ShapeError(f"expert {expert} out of range: the imatrix has {n_expert} experts of {cols} columns", where=where)
        row, count = vals[expert * cols:(expert + 1) * cols], entry.counts[0]
    if cols is not None and row.shape[0] != cols:
        raise ShapeError(f"imatrix has {row.shape[0]} columns, the tensor has {cols}", where=where)
    if count == 0:
        return None
    # Whole-number counts >= 1 keep sum / count <= sum: finite and >= 0.
    return (row / np.float32(count)).astype(np.float32)


# --------------------------------------------------------------------------
# reading


class _Cursor:
    """Bounded little-endian reads: every size is checked against the bytes
    left before anything is read or allocated."""

    def __init__(self, f: BinaryIO, size: int, path: str):
        self.f = f
        self.size = size
        self.pos = 0
        self.path = path

    @property
    def left(self) -> int:
        return self.size - self.pos

    def fail(self, msg: str, hint: Optional[str] = None) -> CorruptDataError:
        return CorruptDataError(msg, where=self.path, hint=hint)

    def need(self, n: int, what: str) -> None:
        if n < 0 or n > self.left:
            raise self.fail(f"{what} needs {n} bytes at offset {self.pos} but only {self.left} are left (truncated file?)")

    def take(self, n: int, what: str) -> bytes:
        self.need(n, what)
        self.f.seek(self.pos)
        data = self.f.read(n)
        if len(data) != n:
            raise self.fail(f"{what}: short read at offset {self.pos} (file changed while reading?)")
        self.pos += n
        return data

    def unpack(self, fmt: str, what: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt), what))[0]


def read_imatrix(path: "str | os.PathLike[str]") -> Imatrix:
    """Read a GGUF imatrix or a legacy ``imatrix.dat`` (told apart by the
    GGUF magic). Every size is validated; malformed files raise
    CorruptDataError naming the file and the entry.
    """
    p = Path(path)
    try:
        f = open(p, "rb")
    except OSError as e:
        raise BadInputError(f"cannot open imatrix file: {e.strerror}", where=str(p)) from None
    with f:
        size = os.fstat(f.fileno()).st_size
        cur = _Cursor(f, size, str(p))
        if size == 0:
            raise cur.fail("empty file, not an imatrix")
        if f.read(4) != GGUF_MAGIC:
            return _read_dat(cur)
    return _read_gguf(p)


def _read_dat(cur: _Cursor) -> Imatrix:
    hint = "not a legacy imatrix.dat; a GGUF imatrix starts with 'GGUF'"
    if cur.size < 4:
        raise cur.fail("too short for an imatrix.dat header", hint=hint)
    n_entries = cur.unpack("i", "entry count")
    # Smallest entry: len + 1-byte name + ncall + nval + one value = 17 bytes.
    if n_entries < 1 or n_entries * 17 > cur.left:
        raise cur.fail(f"entry count {n_entries} does not fit the {cur.left} bytes that follow", hint=hint)
    entries: dict[str, ImatrixEntry] = {}
    for i in range(n_entries):
        what = f"entry {i + 1} of {n_entries}"
        n = cur.unpack("i", f"{what}: name length")
        if n < 1 or n > cur.left:
            raise cur.fail(f"{what}: name length {n} is not within 1..{cur.left} (bytes left)", hint=hint if i == 0 else None)
        raw = cur.take(n, f"{what}: name")
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise cur.fail(f"{what}: name is not UTF-8 ({raw[:40]!r})", hint=hint if i == 0 else None) from None
        what = f"entry {i + 1} ({name!r})"
        if name in entries:
            raise cur.fail(f"{what}: duplicate tensor name")
        ncall = cur.unpack("i", f"{what}: ncall")
        nval = cur.unpack("i", f"{what}: value count")
        if ncall < 0:
            raise cur.fail(f"{what}: negative call count {ncall}")
        if nval < 1 or 4 * nval > cur.left:
            raise cur.fail(f"{what}: value count {nval} does not fit the {cur.left} bytes left (truncated file?)")
        vals = np.frombuffer(cur.take(4 * nval, f"{what}: values"), dtype="<f4").astype(np.float32)
        entries[name] = _check_entry(name, vals, [ncall], lambda m: cur.fail(m))
    chunk_count: Optional[int] = None
    datasets: tuple[str, ...] = ()
    # Tail: nothing (early files), last_chunk alone, or last_chunk + dataset.
    if cur.left:
        chunk_count = cur.unpack("i", "tail: chunk count")
        if chunk_count < 0:
            raise cur.fail(f"tail: negative chunk count {chunk_count}")
        if cur.left:
            n = cur.unpack("i", "tail: dataset name length")
            if n < 0 or n != cur.left:
                raise cur.fail(
                    f"tail: dataset name length {n} but {cur.left} bytes are left (truncated, or trailing garbage)"
                )
            ds = cur.take(n, "tail: dataset name").decode("utf-8", errors="replace")
            datasets = (ds,) if ds else ()
    # No tail at all is what Lucebox's converter requires (and what
    # write_imatrix_lucebox writes); llama.cpp files carry one.
    fmt = "dat" if chunk_count is not None else "lucebox"
    return Imatrix(path=cur.path, format=fmt, entries=entries, datasets=datasets, chunk_count=chunk_count)


_GGUF_INT_TYPES = ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64")
_GGML_F32 = 0


def _read_gguf(path: Path) -> Imatrix:
    # The container (header, KVs, tensor infos, spans, alignment, end of file)
    # is validated by the artifact reader; the imatrix rules are checked here.
    from ds4quant.artifact.gguf_reader import read_gguf

    g = read_gguf(path)
    where = str(path)

    def fail(msg: str) -> CorruptDataError:
        return CorruptDataError(msg, where=where)

    gtype = g.kv.get("general.type")
    if gtype is not None and gtype.value != "imatrix":
        raise fail(f"general.type is {gtype.value!r}, not 'imatrix': this GGUF is not an importance matrix")
    datasets: tuple[str, ...] = ()
    kv = g.kv.get("imatrix.datasets")
    if kv is not None:
        if kv.type.name != "ARRAY" or not all(isinstance(d, str) for d in kv.value):
            raise fail("imatrix.datasets must be an array of strings")
        datasets = tuple(kv.value)
    meta: dict[str, Optional[int]] = {}
    for key in ("imatrix.chunk_count", "imatrix.chunk_size"):
        kv = g.kv.get(key)
        meta[key] = None
        if kv is not None:
            if kv.type.name not in _GGUF_INT_TYPES or kv.value < 0:
                raise fail(f"{key} must be an integer >= 0, got {kv.value!r}")
            meta[key] = int(kv.value)

    def load(name: str) -> np.ndarray:
        t = g.tensors[name]
        if t.ggml_type != _GGML_F32:
            raise fail(f"tensor {name!r}: ggml type {t.ggml_type}, an imatrix tensor must be F32 (0)")
        return np.frombuffer(g.tensor_data(name), dtype="<f4").astype(np.float32)

    entries: dict[str, ImatrixEntry] = {}
    for tname in sorted(g.tensors):
        if not tname.endswith(SUFFIX_SUM2):
            continue
        t = g.tensors[tname]
        name = tname[: -len(SUFFIX_SUM2)]
        c = g.tensors.get(name + SUFFIX_COUNTS)
        if not name or c is None:
            raise fail(f"tensor {tname!r} has no matching {name + SUFFIX_COUNTS!r}")
        cols, n_mat = t.shape[0], math.prod(t.shape[1:])
        if c.shape[0] != 1 or math.prod(c.shape[1:]) != n_mat:
            raise fail(f"tensor {c.name!r}: shape {list(c.shape)}, expected [1, {n_mat}] to match {tname!r}")
        s = g.tensors.get(name + SUFFIX_SUM)
        if s is not None and s.shape != t.shape:
            raise fail(f"tensor {s.name!r}: shape {list(s.shape)} differs from {tname!r} {list(t.shape)}")
        sums, counts = load(tname), load(c.name)
        values = sums if n_mat == 1 else sums.reshape(n_mat, cols)
        entries[name] = _check_entry(name, values, counts, fail)
    for tname in g.tensors:
        if tname.endswith(SUFFIX_COUNTS) and tname[: -len(SUFFIX_COUNTS)] not in entries:
            raise fail(f"tensor {tname!r} has no matching {tname[: -len(SUFFIX_COUNTS)] + SUFFIX_SUM2!r}")
    if not entries:
        raise fail(f"no '<name>{SUFFIX_SUM2}' tensors: this GGUF holds no importance matrix")
    return Imatrix(
        path=where,
        format="gguf",
        entries=entries,
        datasets=datasets,
        chunk_count=meta["imatrix.chunk_count"],
        chunk_size=meta["imatrix.chunk_size"],
    )


# --------------------------------------------------------------------------
# writing


def _write_parts(path: "str | os.PathLike[str]", parts: list[bytes]) -> None:
    # Temp file in the target folder, fsync, rename, fsync the folder: a
    # failure leaves the old file (if any) untouched.
    with atomic_write(path) as f:
        for part in parts:
            f.write(part)


def _gguf_str(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _f32_counts(e: ImatrixEntry) -> np.ndarray:
    c = e.counts.astype(np.float32)
    if not np.array_equal(c.astype(np.float64), e.counts):
        raise BadInputError(f"imatrix entry {e.name!r}: a count is not exactly representable as float32")
    return c


def write_imatrix_gguf(path: "str | os.PathLike[str]", imatrix: Imatrix) -> None:
    """Write ``imatrix`` as a GGUF imatrix (the llama-imatrix layout), atomically.

    Entries are written in name order, ``NAME.in_sum2`` then ``NAME.counts``;
    a legacy entry keeps its ``values`` and ``ncall``, so means are unchanged.
    """
    tensors: list[tuple[str, tuple[int, ...], bytes]] = []
    for name in imatrix.names:
        e = imatrix.entries[name]
        counts = _f32_counts(e)
        if e.values.ndim == 2:
            dims_v, dims_c = (e.values.shape[1], e.n_mat), (1, e.n_mat)
        else:
            dims_v, dims_c = (e.values.shape[0],), (1,)
        tensors.append((name + SUFFIX_SUM2, dims_v, e.values.astype("<f4").tobytes()))
        tensors.append((name + SUFFIX_COUNTS, dims_c, counts.astype("<f4").tobytes()))

    kvs = [_gguf_str("general.type") + struct.pack("<I", _GGUF_STRING) + _gguf_str("imatrix")]
    kvs.append(
        _gguf_str("imatrix.datasets")
        + struct.pack("<IIQ", _GGUF_ARRAY, _GGUF_STRING, len(imatrix.datasets))
        + b"".join(_gguf_str(d) for d in imatrix.datasets)
    )
    for key, value in (("imatrix.chunk_count", imatrix.chunk_count), ("imatrix.chunk_size", imatrix.chunk_size)):
        if value is not None:
            kvs.append(_gguf_str(key) + struct.pack("<II", _GGUF_UINT32, value))

    infos, data, offset = [], [], 0
    for name, dims, raw in tensors:
        infos.append(
            _gguf_str(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
            + struct.pack("<IQ", _GGML_F32, offset)
        )
        pad = -len(raw) % _GGUF_ALIGNMENT
        data.append(raw + b"\0" * pad)
        offset += len(raw) + pad
    head = GGUF_MAGIC + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(infos)
    head += b"\0" * (-len(head) % _GGUF_ALIGNMENT)
    _write_parts(path, [head, *data])


def write_imatrix_dat(path: "str | os.PathLike[str]", imatrix: Imatrix) -> tuple[str, ...]:
    """Write ``imatrix`` as a legacy ``imatrix.dat``, atomically.

    The legacy form has one ``ncall`` per tensor and ``values = mean * ncall``.
    An entry whose counts all equal that ncall (e.g. one read from a .dat) is
    written unchanged; otherwise, as llama-imatrix does, ncall is the largest
    count in chunks (``chunk_size`` tokens, 1 when unknown, rounded up) and
    ``values = (sum / count) * ncall`` in float32, with mean 1.0 for a matrix
    that saw no token. Only the last dataset name fits. Entries with no data
    at all cannot be expressed; they are left out and their names returned.
    """
    chunk = imatrix.chunk_size if imatrix.chunk_size else 1
    parts: list[bytes] = []
    skipped: list[str] = []
    for name in imatrix.names:
        e = imatrix.entries[name]
        max_count = float(e.counts.max())
        if max_count == 0:
            skipped.append(name)
            continue
        ncall = int(-(-int(max_count) // chunk))
        if ncall > _I32_MAX or e.values.size > _I32_MAX:
            raise BadInputError(f"imatrix entry {name!r}: ncall {ncall} or {e.values.size} values overflow imatrix.dat's int32")
        if np.all(e.counts == ncall):
            vals = e.values.reshape(-1)
        else:
            v2 = e.values.reshape(e.n_mat, -1)
            c = e.counts.astype(np.float32)[:, None]
            with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
                mean = np.where(c > 0, v2 / np.where(c > 0, c, np.float32(1)), np.float32(1)).astype(np.float32)
                vals = (mean * np.float32(ncall)).astype(np.float32).reshape(-1)
            if not np.all(np.isfinite(vals)):
                raise BadInputError(f"imatrix entry {name!r}: mean * ncall overflows float32")
        raw = name.encode("utf-8")
        parts.append(struct.pack("<i", len(raw)) + raw + struct.pack("<ii", ncall, vals.size) + vals.astype("<f4").tobytes())
    if not parts:
        raise BadInputError("imatrix has no entry with data; imatrix.dat cannot be empty")
    dataset = (imatrix.datasets[-1] if imatrix.datasets else "").encode("utf-8")
    chunk_count = imatrix.chunk_count or 0
    if chunk_count > _I32_MAX:
        raise BadInputError(f"chunk_count {chunk_count} overflows imatrix.dat's int32")
    tail = struct.pack("<ii", chunk_count, len(dataset)) + dataset
    _write_parts(path, [struct.pack("<i", len(parts)), *parts, tail])
    return tuple(skipped)


# Lucebox converter's load_imatrix bounds (ds4_mix_converter.cpp).
_LUCEBOX_MAX_ENTRIES = 1_000_000
_LUCEBOX_MAX_NAME = 4096
_LUCEBOX_MAX_VALUES = 1 << 24


def _pooled_mean(e: ImatrixEntry, cols: Optional[int]) -> Optional[np.ndarray]:
    """One input-length mean E[x^2] for an entry, or None when it saw no token.

    Per-expert entries pool every expert's tokens (sums / total count); a
    legacy flat stack (``cols`` given, n_expert * cols values, one ncall)
    averages its experts' means, the only weighting the file still knows.
    """
    total = float(e.counts.sum())
    if total == 0:
        return None
    if e.values.ndim == 2:
        mean = e.values.astype(np.float64).sum(axis=0) / total
    else:
        mean = e.values.astype(np.float64) / float(e.counts[0])
        if cols is not None and cols > 0 and mean.shape[0] != cols:
            if mean.shape[0] % cols:
                raise ShapeError(f"imatrix entry {e.name!r}: {mean.shape[0]} values are not a whole number of "
                                 f"{cols}-column experts")
            mean = mean.reshape(-1, cols).mean(axis=0)
    return mean.astype(np.float32)


def write_imatrix_lucebox(
    path: "str | os.PathLike[str]", imatrix: Imatrix, *, cols: Optional[Mapping[str, int]] = None
) -> tuple[str, ...]:
    """Write ``imatrix`` in the layout Lucebox's converter reads, atomically.

    Legacy ``imatrix.dat`` entries in name order, each one input-length
    float32 vector of the mean E[x^2] with ``ncall = 1``, and no tail (see the
    module doc). An expert stack stored per expert is pooled over its experts'
    tokens; ``cols`` (name -> input length) splits a legacy flat stack, which
    is otherwise written as it is. Entries that saw no token (Lucebox needs
    ``ncall > 0``) are left out and their names returned.

    Example::

        write_imatrix_lucebox("imatrix.lucebox.dat", read_imatrix("imatrix.gguf"))
    """
    parts: list[bytes] = []
    skipped: list[str] = []
    for name in imatrix.names:
        mean = _pooled_mean(imatrix.entries[name], None if cols is None else cols.get(name))
        if mean is None:
            skipped.append(name)
            continue
        raw = name.encode("utf-8")
        if len(raw) > _LUCEBOX_MAX_NAME or mean.size > _LUCEBOX_MAX_VALUES:
            raise BadInputError(f"imatrix entry {name!r}: {len(raw)} name bytes / {mean.size} values exceed "
                                f"Lucebox's {_LUCEBOX_MAX_NAME} / {_LUCEBOX_MAX_VALUES}")
        if not np.all(np.isfinite(mean)):
            raise BadInputError(f"imatrix entry {name!r}: the mean overflows float32")
        parts.append(struct.pack("<i", len(raw)) + raw + struct.pack("<ii", 1, mean.size)
                     + mean.astype("<f4").tobytes())
    if not parts:
        raise BadInputError("imatrix has no entry with data; Lucebox's converter refuses an empty imatrix")
    if len(parts) > _LUCEBOX_MAX_ENTRIES:
        raise BadInputError(f"{len(parts)} imatrix entries exceed Lucebox's {_LUCEBOX_MAX_ENTRIES}")
    _write_parts(path, [struct.pack("<i", len(parts)), *parts])
    return tuple(skipped)
