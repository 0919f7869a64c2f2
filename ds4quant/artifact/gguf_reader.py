"""A validating GGUF v2/v3 reader (header only; tensor data is memory-mapped).

``read_gguf(path)`` checks, in this fixed order, before any tensor byte is
touched (STYLE.md item 6), and refuses with one CorruptDataError naming the
file, the key or tensor, and the byte offset:

1. magic ``GGUF``; version 2 or 3 (1 and big-endian files: unsupported);
2. tensor and KV counts that can fit in the bytes that remain;
3. each KV: key length inside the file, non-empty UTF-8 key, no duplicate,
   known value type, string lengths and array counts inside the file,
   UTF-8 strings, BOOL bytes 0/1, no nested arrays;
4. ``general.alignment`` (if present): UINT32, a power of two;
5. each tensor info: UTF-8 name of 1..63 bytes, no duplicate, n_dims 1..4,
   every dim >= 1, element count < 2^63 (Python ints, never wrapping),
   known ggml type (standard per gguf.GGML_QUANT_SIZES, or ROCmFPX 100-107),
   ne[0] a multiple of the type's block size;
6. the data section (header end rounded up to the alignment) inside the file;
   each tensor's offset aligned, its span inside the file, spans pairwise
   disjoint, and no two tensors starting at the same offset (a zero-size
   tensor counts as occupying its first byte);
7. the end of the file: at or after the last tensor byte and at most up to
   that end rounded up to the alignment (the padding writers put after the
   last tensor); with no tensors, between the end of the tensor infos and
   the aligned data-section start. Gaps *between* tensors are allowed
   (tensors may be stored in any order); anything past the rule is garbage;
8. split keys (if present) typed and in range; ds4quant tags (tags.py):
   each tensor's qtype resolved from its tag, checked against its id, or
   from the id alone for foreign files (untagged 107 refused unless
   ``variant_107`` names the variant).

``read_gguf_set(path)`` opens a split set from any of its files and checks
split.count / split.no / split.tensors.count, key consistency across the
splits, and tensor names unique across the set.

Example::

    g = read_gguf("model.gguf")
    g.tensors["blk.0.ffn_down_exps.weight"].qtype   # "rocmfp3"
    raw = g.tensor_data("blk.0.ffn_down_exps.weight")  # read-only uint8 memmap
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Optional

import numpy as np
from gguf import GGUFValueType as VT

from ds4quant.artifact.gguf_values import KV, SCALAR_FORMATS, SCALAR_SIZES
from ds4quant.artifact.gguf_writer import (
    DEFAULT_ALIGNMENT,
    KEY_ALIGNMENT,
    KEY_SPLIT_COUNT,
    KEY_SPLIT_NO,
    KEY_SPLIT_TENSORS,
    MAX_DIMS,
    MAX_NAME_BYTES,
    SPLIT_NAME,
    align_up,
    split_path,
)
from ds4quant.artifact.qtypes import ggml_type_name, id_geometry
from ds4quant.artifact.tags import TAG_PREFIX, Tags, check_variant_107, read_tags, resolve_tensor
from ds4quant.errors import BadInputError, CorruptDataError, Ds4quantError, UnsupportedFormatError

_MIN_KV_BYTES = 8 + 1 + 4 + 1  # key length, 1-byte key, type, 1-byte value
_MIN_TENSOR_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name length, name, n_dims, ne[0], type, offset
_MAX_KEY_BYTES = 65535  # GGUF spec: keys are at most 2^16 - 1 bytes
_MISSING = object()


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file.

    shape: GGUF order (ne[0] innermost); offset: absolute file offset of its
    payload; nbytes: payload size. qtype: ds4quant qtype name (or lowercase
    ggml name for standard types without one); decodable: ds4quant has a
    codec for it; qtype_source: "tag", "ggml_type" or "variant_107".
    """

    name: str
    ggml_type: int
    qtype: str
    variant: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    decodable: bool
    needs_codebooks: bool
    qtype_source: str
    path: Path
    info_offset: int  # where the tensor info starts in the header

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class _ViewMixin:
    """Shared accessors of a single file and a split set."""

    kv: Mapping[str, KV]
    tensors: Mapping[str, TensorInfo]

    def kv_value(self, key: str, default: Any = _MISSING) -> Any:
        """The plain value of ``key`` (KeyError-free with ``default``)."""
        kv = self.kv.get(key)
        if kv is None:
            if default is _MISSING:
                raise BadInputError(f"no KV {key!r}", where=str(self.path))  # type: ignore[attr-defined]
            return default
        return kv.value

    def blob(self, key: str) -> bytes:
        """An embedded byte blob (ARRAY of UINT8, e.g. a MIX sidecar)."""
        kv = self.kv.get(key)
        if kv is None:
            raise BadInputError(f"no KV {key!r}", where=str(self.path))  # type: ignore[attr-defined]
        if kv.type != VT.ARRAY or kv.sub_type != VT.UINT8:
            raise CorruptDataError(f"KV {key!r} is not an ARRAY of UINT8", where=str(self.path))  # type: ignore[attr-defined]
        return kv.value.tobytes()

    def tensor(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise BadInputError(f"no tensor {name!r}", where=str(self.path))  # type: ignore[attr-defined]
        return info


@dataclass(frozen=True)
class GGUFFile(_ViewMixin):
    """A validated GGUF file: header parsed, tensors located, qtypes resolved.

    kv: ordered key -> KV (typed); tensors: ordered name -> TensorInfo.
    notes: things a caller should know (e.g. untagged MIX tensors).
    """

    path: Path
    version: int
    kv: Mapping[str, KV]
    tensors: Mapping[str, TensorInfo]
    alignment: int
    data_offset: int
    file_size: int
    format_version: Optional[int]
    split_no: Optional[int]
    split_count: Optional[int]
    notes: tuple[str, ...]
    _identity: tuple = field(repr=False, compare=False, default=())

    def tensor_data(self, name: str) -> np.ndarray:
        """The payload of tensor ``name`` as a read-only uint8 memmap (nbytes,)."""
        info = self.tensor(name)
        _check_identity(info.path, self._identity)
        return np.memmap(info.path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))


@dataclass(frozen=True)
class GGUFSet(_ViewMixin):
    """A GGUF split set (or a single file) as one view.

    kv: keys of all splits merged in split order (values agree where a key
    repeats; ``split.no`` is left out). tensors: all tensors in split order,
    each with the ``path`` of its file. splits: the per-file GGUFFiles.
    """

    path: Path  # the first file
    version: int
    kv: Mapping[str, KV]
    tensors: Mapping[str, TensorInfo]
    format_version: Optional[int]
    notes: tuple[str, ...]
    splits: tuple[GGUFFile, ...]

    @property
    def files(self) -> tuple[Path, ...]:
        return tuple(s.path for s in self.splits)

    @property
    def total_bytes(self) -> int:
        return sum(s.file_size for s in self.splits)

    def tensor_data(self, name: str) -> np.ndarray:
        info = self.tensor(name)
        for s in self.splits:
            if s.path == info.path:
                return s.tensor_data(name)
        raise RuntimeError(f"tensor {name!r} belongs to no split")  # unreachable by construction


def _stat_identity(st: os.stat_result) -> tuple:
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


def _check_identity(path: Path, identity: tuple) -> None:
    try:
        st = os.stat(path)
    except OSError as e:
        raise CorruptDataError(f"file disappeared since it was read ({e.strerror})", where=str(path)) from None
    if _stat_identity(st) != identity:
        raise CorruptDataError("file changed since it was read", where=str(path), hint="open it again")


class _Cursor:
    """Bounded little-endian reads over the mapped header; every read checks
    the bytes it needs against the file size first."""

    def __init__(self, buf, size: int, where: str):
        self.buf = buf
        self.size = size
        self.pos = 0
        self.where = where

    def fail(self, message: str, offset: Optional[int] = None) -> CorruptDataError:
        at = self.pos if offset is None else offset
        return CorruptDataError(f"{message} (at byte {at})", where=self.where)

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"file ends inside {what}: {n} bytes needed, {self.size - self.pos} left")

    def unpack(self, fmt: str, n: int, what: str):
        self.need(n, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def u32(self, what: str) -> int:
        return self.unpack("<I", 4, what)[0]

    def u64(self, what: str) -> int:
        return self.unpack("<Q", 8, what)[0]

    def string(self, what: str, max_len: Optional[int] = None) -> str:
        start = self.pos
        n = self.u64(f"{what} length")
        if max_len is not None and n > max_len:
            raise self.fail(f"{what} length {n} exceeds {max_len}", start)
        if n > self.size - self.pos:
            raise self.fail(f"{what} length {n} runs past the end of the file ({self.size - self.pos} bytes left)", start)
        raw = self.buf[self.pos:self.pos + n]
        try:
            s = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 (byte {e.start} of the string)", self.pos) from None
        self.pos += n
        return s


def _read_value(cur: _Cursor, vtype: VT, what: str) -> KV:
    if vtype == VT.STRING:
        return KV(VT.STRING, cur.string(f"{what} string"))
    if vtype == VT.ARRAY:
        at = cur.pos
        sub_raw = cur.u32(f"{what} array type")
        try:
            sub = VT(sub_raw)
        except ValueError:
            raise cur.fail(f"{what} has unknown array element type {sub_raw}", at) from None
        if sub == VT.ARRAY:
            raise UnsupportedFormatError(f"{what} is a nested array, which ggml does not support (at byte {at})",
                                         where=cur.where)
        count_at = cur.pos
        count = cur.u64(f"{what} array length")
        elem = 8 if sub == VT.STRING else SCALAR_SIZES[sub]
        if count > (cur.size - cur.pos) // elem:
            raise cur.fail(f"{what} array of {count} {sub.name} cannot fit in the {cur.size - cur.pos} bytes left",
                           count_at)
        if sub == VT.STRING:
            return KV(VT.ARRAY, tuple(cur.string(f"{what}[{i}]") for i in range(count)), sub)
        arr = np.frombuffer(cur.buf, dtype=np.dtype(SCALAR_FORMATS[sub][1]), count=count, offset=cur.pos).copy()
        if sub == VT.BOOL:
            bad = np.flatnonzero(arr > 1)
            if bad.size:
                raise cur.fail(f"{what}[{int(bad[0])}] is BOOL {int(arr[bad[0]])}, not 0 or 1", cur.pos + int(bad[0]))
            arr = arr.view(np.bool_)
        cur.pos += count * elem
        arr.flags.writeable = False
        return KV(VT.ARRAY, arr, sub)
    at = cur.pos
    (v,) = cur.unpack(SCALAR_FORMATS[vtype][0], SCALAR_SIZES[vtype], f"{what} {vtype.name} value")
    if vtype == VT.BOOL:
        if v > 1:
            raise cur.fail(f"{what} is BOOL {v}, not 0 or 1", at)
        v = bool(v)
    return KV(vtype, v)


@dataclass(frozen=True)
class _RawTensor:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    rel_offset: int
    nbytes: int
    info_offset: int


def _open_map(path: Path):
    # stat first: opening a FIFO or device would block or read garbage
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise BadInputError("is not a regular file", where=str(path))
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise BadInputError("no such file", where=str(path)) from None
    except OSError as e:
        raise BadInputError(f"cannot open ({e.strerror})", where=str(path)) from None
    try:
        st = os.fstat(fd)
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if st.st_size else b""
    finally:
        os.close(fd)
    return mm, st


def read_gguf(path: "str | os.PathLike[str]", *, variant_107: Optional[str] = None) -> GGUFFile:
    """Read and validate one GGUF file (one split of a set is read on its own).

    variant_107: how to read untagged type-107 tensors ("rocmfp2",
    "rocmfp2_affine" or "rocmfp2_s40"); without it they are refused.
    Raises CorruptDataError / UnsupportedFormatError naming file, key or
    tensor and byte offset.
    """
    check_variant_107(variant_107)
    path = Path(path)
    mm, st = _open_map(path)
    try:
        return _parse(path, mm, st, variant_107)
    finally:
        if isinstance(mm, mmap.mmap):
            mm.close()


def _parse(path: Path, buf, st: os.stat_result, variant_107: Optional[str]) -> GGUFFile:
    where = str(path)
    size = st.st_size
    cur = _Cursor(buf, size, where)

    # 1. magic and version
    cur.need(4, "the magic")
    if buf[0:4] != b"GGUF":
        raise cur.fail(f"bad magic {bytes(buf[0:4])!r}, expected b'GGUF'; not a GGUF file", 0)
    cur.pos = 4
    version = cur.u32("the version")
    if version not in (2, 3):
        if version == 1:
            raise UnsupportedFormatError("GGUF version 1 is not supported (at byte 4)", where=where,
                                         hint="re-save the file with a current GGUF writer")
        if version in (2 << 24, 3 << 24):
            raise UnsupportedFormatError("big-endian GGUF is not supported (at byte 4)", where=where)
        raise cur.fail(f"unknown GGUF version {version}, expected 2 or 3", 4)

    # 2. counts bounded by what remains
    n_tensors = cur.u64("the tensor count")
    n_kv = cur.u64("the KV count")
    left = size - cur.pos
    if n_kv > left // _MIN_KV_BYTES or n_tensors > left // _MIN_TENSOR_BYTES \
            or n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_BYTES > left:
        raise cur.fail(f"{n_tensors} tensors and {n_kv} KVs cannot fit in the {left} bytes after the header", 8)

    # 3. KVs
    kv: dict[str, KV] = {}
    kv_at: dict[str, int] = {}
    for i in range(n_kv):
        at = cur.pos
        key = cur.string(f"KV #{i} key", _MAX_KEY_BYTES)
        if not key:
            raise cur.fail(f"KV #{i} has an empty key", at)
        if key in kv:
            raise cur.fail(f"duplicate KV key {key!r}", at)
        t_at = cur.pos
        t_raw = cur.u32(f"KV {key!r} type")
        try:
            vtype = VT(t_raw)
        except ValueError:
            raise cur.fail(f"KV {key!r} has unknown value type {t_raw}", t_at) from None
        kv[key] = _read_value(cur, vtype, f"KV {key!r}")
        kv_at[key] = at

    # 4. alignment
    alignment = DEFAULT_ALIGNMENT
    if KEY_ALIGNMENT in kv:
        a = kv[KEY_ALIGNMENT]
        if a.type != VT.UINT32:
            raise cur.fail(f"{KEY_ALIGNMENT} must be UINT32, got {a.type.name}", kv_at[KEY_ALIGNMENT])
        if a.value == 0 or a.value & (a.value - 1):
            raise cur.fail(f"{KEY_ALIGNMENT} = {a.value} is not a power of two", kv_at[KEY_ALIGNMENT])
        alignment = a.value

    # 5. tensor infos
    raw: list[_RawTensor] = []
    seen: set[str] = set()
    for i in range(n_tensors):
        at = cur.pos
        name = cur.string(f"tensor #{i} name")
        if not name:
            raise cur.fail(f"tensor #{i} has an empty name", at)
        if len(name.encode("utf-8")) > MAX_NAME_BYTES:
            raise cur.fail(f"tensor #{i} name is {len(name.encode('utf-8'))} bytes; ggml allows {MAX_NAME_BYTES}", at)
        if name in seen:
            raise cur.fail(f"duplicate tensor name {name!r}", at)
        seen.add(name)
        n_dims = cur.u32(f"tensor {name!r} n_dims")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has n_dims {n_dims}, expected 1..{MAX_DIMS}", cur.pos - 4)
        dims_at = cur.pos
        shape = cur.unpack(f"<{n_dims}Q", 8 * n_dims, f"tensor {name!r} dims")
        n = 1
        for j, d in enumerate(shape):
            if d < 1:
                raise cur.fail(f"tensor {name!r} has ne[{j}] = {d}; every dim must be >= 1", dims_at + 8 * j)
            n *= d
        if n >= 2**63:
            raise cur.fail(f"tensor {name!r} shape {shape} has {n} elements, more than 2^63", dims_at)
        t_at = cur.pos
        ggml_type = cur.u32(f"tensor {name!r} ggml type")
        geometry = id_geometry(ggml_type)
        if geometry is None:
            raise cur.fail(f"tensor {name!r} has unknown ggml type {ggml_type}", t_at)
        block_size, block_bytes = geometry
        if shape[0] % block_size:
            tname = ggml_type_name(ggml_type) or f"type {ggml_type}"
            raise cur.fail(f"tensor {name!r}: ne[0] = {shape[0]} is not a multiple of the {tname} block of {block_size}",
                           dims_at)
        rel = cur.u64(f"tensor {name!r} offset")
        raw.append(_RawTensor(name, tuple(shape), ggml_type, rel, n // block_size * block_bytes, at))

    # 6. data section and tensor spans
    info_end = cur.pos
    data_offset = align_up(info_end, alignment)
    if raw and data_offset > size:
        raise cur.fail(f"the data section would start at byte {data_offset}, past the end of the {size}-byte file",
                       info_end)
    for t in raw:
        if t.rel_offset % alignment:
            raise cur.fail(f"tensor {t.name!r} data offset {t.rel_offset} is not a multiple of the alignment {alignment}",
                           t.info_offset)
        start = data_offset + t.rel_offset
        if start > size or t.nbytes > size - start:
            raise cur.fail(f"tensor {t.name!r} data [{start}, {start + t.nbytes}) runs past the end of the "
                           f"{size}-byte file", t.info_offset)
    _check_spans(cur, [(t.name, data_offset + t.rel_offset, t.nbytes, t.info_offset) for t in raw])

    # 7. end of file
    if raw:
        last = max(data_offset + t.rel_offset + t.nbytes for t in raw)
        limit = align_up(last, alignment)
        if size > limit:
            raise cur.fail(f"{size - limit} unexplained bytes after the last tensor's padded end", limit)
    elif size > data_offset:
        raise cur.fail(f"{size - data_offset} unexplained bytes after the header of a file with no tensors",
                       data_offset)

    # 8. split keys and tags
    split_no, split_count = _split_keys(cur, kv, kv_at, len(raw))
    tags = read_tags(kv, where, kv_at)
    infos, notes = _resolve(path, raw, data_offset, tags, variant_107, where, kv_at)
    return GGUFFile(path, version, MappingProxyType(kv), MappingProxyType(infos), alignment, data_offset, size,
                    tags.format_version, split_no, split_count, tuple(notes), _stat_identity(st))


def _check_spans(cur: _Cursor, spans: list[tuple[str, int, int, int]]) -> None:
    """Spans (name, start, nbytes, info_offset) must be pairwise disjoint and
    start at distinct offsets (a zero-size span occupies its first byte)."""
    order = sorted(spans, key=lambda s: (s[1], s[3]))
    for prev, nxt in zip(order, order[1:]):
        prev_end = prev[1] + max(prev[2], 1)
        if nxt[1] < prev_end:
            what = "starts at the same offset as" if nxt[1] == prev[1] else "overlaps"
            raise cur.fail(f"tensor {nxt[0]!r} data [{nxt[1]}, {nxt[1] + nxt[2]}) {what} tensor {prev[0]!r} "
                           f"[{prev[1]}, {prev[1] + prev[2]})", nxt[3])


def _split_keys(cur: _Cursor, kv: Mapping[str, KV], kv_at: Mapping[str, int],
                n_tensors: int) -> tuple[Optional[int], Optional[int]]:
    present = [k for k in (KEY_SPLIT_NO, KEY_SPLIT_COUNT, KEY_SPLIT_TENSORS) if k in kv]
    if not present:
        return None, None
    if len(present) != 3:
        missing = sorted({KEY_SPLIT_NO, KEY_SPLIT_COUNT, KEY_SPLIT_TENSORS} - set(present))
        raise cur.fail(f"split keys incomplete: {', '.join(missing)} missing", kv_at[present[0]])
    expect = {KEY_SPLIT_NO: VT.UINT16, KEY_SPLIT_COUNT: VT.UINT16, KEY_SPLIT_TENSORS: VT.INT32}
    for k, t in expect.items():
        if kv[k].type != t:
            raise cur.fail(f"{k} must be {t.name}, got {kv[k].type.name}", kv_at[k])
    no, count, total = kv[KEY_SPLIT_NO].value, kv[KEY_SPLIT_COUNT].value, kv[KEY_SPLIT_TENSORS].value
    if count < 1 or no >= count:
        raise cur.fail(f"split.no = {no} is not below split.count = {count}", kv_at[KEY_SPLIT_NO])
    if total < n_tensors:
        raise cur.fail(f"split.tensors.count = {total} is below this split's {n_tensors} tensors",
                       kv_at[KEY_SPLIT_TENSORS])
    return no, count


def _resolve(path: Path, raw: list[_RawTensor], data_offset: int, tags: Tags, variant_107: Optional[str],
             where: str, kv_at: Mapping[str, int]) -> tuple[dict[str, TensorInfo], list[str]]:
    names = {t.name for t in raw}
    stale = sorted(set(tags.qtypes) - names)
    if stale:
        key = TAG_PREFIX + stale[0]
        more = f"; {len(stale)} such tags" if len(stale) > 1 else ""
        raise CorruptDataError(f"tag {key} names no tensor in this file (KV at byte {kv_at[key]}{more})",
                               where=where)
    infos: dict[str, TensorInfo] = {}
    notes: list[str] = []
    for t in raw:
        try:
            r = resolve_tensor(t.name, t.ggml_type, tags, variant_107, where)
        except Ds4quantError as e:
            raise type(e)(f"{e.message} (tensor info at byte {t.info_offset})", where=e.where, hint=e.hint) from None
        if r.ref.nbytes(_count(t.shape)) != t.nbytes:
            # the tables disagree with themselves; a bug, not the file's fault
            raise RuntimeError(f"{r.ref.name}: size tables disagree for ggml type {t.ggml_type}")
        if r.note:
            notes.append(r.note)
        infos[t.name] = TensorInfo(t.name, t.ggml_type, r.ref.name, r.ref.variant, t.shape, data_offset + t.rel_offset,
                                   t.nbytes, r.ref.decodable, r.ref.needs_codebooks, r.source, path, t.info_offset)
    return infos, notes


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------- split sets


def read_gguf_set(path: "str | os.PathLike[str]", *, variant_107: Optional[str] = None) -> GGUFSet:
    """Open a GGUF split set from any of its files (or a single unsplit file).

    Checks that every split ``NAME-0000k-of-0000n.gguf`` exists and is valid
    on its own, that split.no / split.count / split.tensors.count agree with
    the names and the tensors found, that a key present in several splits has
    the same type and value in each, and that tensor names are unique.
    """
    check_variant_107(variant_107)
    path = Path(path)
    first = read_gguf(path, variant_107=variant_107)
    m = SPLIT_NAME.match(path.name)
    if first.split_count is None:
        if m and int(m.group("count")) > 1:
            raise CorruptDataError(f"named as split {int(m.group('no'))} of {int(m.group('count'))} but has no "
                                   "split keys", where=str(path))
        return _merge((first,), variant_107)
    if not m:
        if first.split_count == 1:
            return _merge((first,), variant_107)
        raise CorruptDataError(f"has split.count = {first.split_count} but its name is not "
                               "NAME-0000k-of-0000n.gguf", where=str(path), hint="restore the split file names")
    no, count = int(m.group("no")), int(m.group("count"))
    if count != first.split_count or no != first.split_no + 1:
        raise CorruptDataError(f"name says split {no} of {count}, keys say split.no = {first.split_no} "
                               f"(0-based) of split.count = {first.split_count}", where=str(path))
    stem_path = path.with_name(m.group("stem") + ".gguf")
    splits = []
    for i in range(count):
        p = split_path(stem_path, i, count)
        if i == first.split_no:
            splits.append(first)
            continue
        if not p.is_file():
            raise CorruptDataError(f"split {i + 1} of {count} is missing", where=str(p),
                                   hint="download every split of the set")
        g = read_gguf(p, variant_107=variant_107)
        if g.split_count != count or g.split_no != i:
            raise CorruptDataError(f"expected split.no = {i} of split.count = {count}, keys say "
                                   f"{g.split_no} of {g.split_count}", where=str(p))
        splits.append(g)
    return _merge(tuple(splits), variant_107)


def _merge(splits: tuple[GGUFFile, ...], variant_107: Optional[str]) -> GGUFSet:
    first = splits[0]
    if len(splits) == 1:
        kv = {k: v for k, v in first.kv.items() if k != KEY_SPLIT_NO}
        return GGUFSet(first.path, first.version, MappingProxyType(kv), first.tensors, first.format_version,
                       first.notes, splits)
    kv: dict[str, KV] = {}
    owner: dict[str, Path] = {}
    tensors: dict[str, TensorInfo] = {}
    notes: list[str] = []
    total = first.kv[KEY_SPLIT_TENSORS].value
    for s in splits:
        if s.format_version != first.format_version:
            raise CorruptDataError(f"ds4quant format version {s.format_version} differs from {first.path.name}'s "
                                   f"{first.format_version}", where=str(s.path))
        for k, v in s.kv.items():
            if k == KEY_SPLIT_NO:
                continue
            if k in kv:
                if not kv[k].same_as(v):
                    raise CorruptDataError(f"KV {k!r} differs from its value in {owner[k].name}", where=str(s.path))
            else:
                kv[k] = v
                owner[k] = s.path
        for name, info in s.tensors.items():
            if name in tensors:
                raise CorruptDataError(f"tensor {name!r} is also in {tensors[name].path.name}", where=str(s.path))
            tensors[name] = info
        notes.extend(s.notes)
    if len(tensors) != total:
        raise CorruptDataError(f"split.tensors.count = {total} but the {len(splits)} splits hold {len(tensors)} "
                               "tensors", where=str(first.path))
    return GGUFSet(first.path, first.version, MappingProxyType(kv), MappingProxyType(tensors), first.format_version,
                   tuple(notes), splits)
