"""A GGUF v3 writer that plans first and streams tensor data, atomically.

State machine (STYLE.md item 9): COLLECTING (add KVs and tensor infos) ->
PLANNED (offsets, splits and header bytes fixed; sizes known) -> WRITTEN.
Tensor data is pulled one tensor at a time at write time (bytes, a numpy
array, or a callable returning either or an iterable of chunks), so a model
never sits in memory. All files of a set are written to temp files in the
target folder, fsynced, and only then renamed into place.

File layout (GGUF v3, little-endian)::

    "GGUF" u32 version=3 u64 n_tensors u64 n_kv
    n_kv x (string key, u32 type, value)
    n_tensors x (string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset)
    zero padding to `alignment`                      <- data section starts here
    tensor data in add order, each zero-padded to `alignment` (offsets are
    relative to the data section)

Shapes are given in GGUF order: ``shape[0]`` = ne[0] is the innermost
(contiguous) dimension, e.g. an expert stack is ``(in, out, n_expert)``.

Splits follow llama.cpp gguf-split: ``NAME-00001-of-0000N.gguf``, with
``split.no`` (UINT16, 0-based), ``split.count`` (UINT16) and
``split.tensors.count`` (INT32) in every split. The first split holds every
user KV; each split holds the ds4quant tags of its own tensors (tags.py) and
``general.alignment`` when it is not the default 32. ``split_max_bytes``
bounds the padded tensor data of a split (a soft limit: a tensor larger than
it gets a split of its own). A set that fits in one file is written plainly
as ``NAME.gguf`` without split keys.

Example::

    w = GGUFWriter("out/model.gguf")
    w.add_string("general.architecture", "deepseek4")
    w.add_tensor("blk.0.ffn_down_exps.weight", "rocmfp3", (2048, 4096, 256), data=lambda: enc())
    paths = w.write()
"""

from __future__ import annotations

import hashlib
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import numpy as np
from gguf import GGUFValueType as VT

from ds4quant.artifact.atomic import AtomicFile
from ds4quant.artifact.gguf_values import KV, make_kv, pack_kv, pack_string
from ds4quant.artifact.qtypes import tensor_nbytes, type_ref
from ds4quant.artifact.tags import RESERVED_KEYS, TAG_PREFIX, tag_kvs
from ds4quant.errors import BadInputError, ShapeError

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 63  # GGML_MAX_NAME (64) minus the NUL ggml keeps
KEY_ALIGNMENT = "general.alignment"
KEY_SPLIT_NO = "split.no"
KEY_SPLIT_COUNT = "split.count"
KEY_SPLIT_TENSORS = "split.tensors.count"
SPLIT_KEYS = (KEY_SPLIT_NO, KEY_SPLIT_COUNT, KEY_SPLIT_TENSORS)
MAX_SPLITS = 65535  # split.count is a UINT16
SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

Chunk = Union[bytes, bytearray, memoryview, np.ndarray]
TensorData = Union[Chunk, Callable[[], Union[Chunk, Iterable[Chunk]]], Iterable[Chunk]]


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def split_path(path: "str | Path", split_no: int, count: int) -> Path:
    """``NAME.gguf`` -> ``NAME-0000k-of-0000n.gguf`` for 0-based ``split_no``."""
    path = Path(path)
    stem = path.name[:-5] if path.name.endswith(".gguf") else path.name
    return path.with_name(f"{stem}-{split_no + 1:05d}-of-{count:05d}.gguf")


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    qtype: str
    ggml_type: int
    shape: tuple[int, ...]  # GGUF order, ne[0] innermost
    nbytes: int
    offset: int  # relative to the file's data section


@dataclass(frozen=True)
class PlannedFile:
    path: Path
    split_no: int  # 0-based; 0 for an unsplit file
    tensors: tuple[PlannedTensor, ...]
    data_offset: int  # absolute offset of the data section
    size: int  # total file bytes


@dataclass(frozen=True)
class GGUFPlan:
    files: tuple[PlannedFile, ...]
    alignment: int

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass
class _Tensor:
    name: str
    qtype: str
    ggml_type: int
    shape: tuple[int, ...]
    nbytes: int
    data: Any


def _check_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not name:
        raise BadInputError(f"{what} must be a non-empty str, got {name!r}")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise BadInputError(f"{what} {name!r} is not encodable as UTF-8") from None
    return name


class GGUFWriter:
    """Collect KVs and tensors, ``plan()``, then ``write()`` (see module doc).

    alignment: power of two (written as ``general.alignment`` when not 32).
    split_max_bytes: max padded tensor bytes per file, or None for one file.
    tags: write ds4quant per-tensor qtype tags (tags.py); False writes a
        plain GGUF (as foreign tools do).
    """

    def __init__(self, path: "str | Path", *, alignment: int = DEFAULT_ALIGNMENT,
                 split_max_bytes: Optional[int] = None, tags: bool = True):
        self.path = Path(path)
        if not self.path.name.endswith(".gguf") or len(self.path.name) <= 5:
            raise BadInputError("output file name must end in .gguf", where=str(self.path))
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            raise BadInputError(f"alignment must be a power of two, got {alignment!r}")
        if alignment > 2**31:
            raise BadInputError(f"alignment {alignment} does not fit general.alignment (UINT32)")
        if split_max_bytes is not None and (isinstance(split_max_bytes, bool) or not isinstance(split_max_bytes, int)
                                            or split_max_bytes < 1):
            raise BadInputError(f"split_max_bytes must be a positive int, got {split_max_bytes!r}")
        self.alignment = alignment
        self.split_max_bytes = split_max_bytes
        self.tags = tags
        self._kv: dict[str, KV] = {}
        self._tensors: dict[str, _Tensor] = {}
        self._state = "collecting"
        self.sha256: dict[Path, str] = {}  # per written file, filled by write()
        # after plan(): (file name, padded tensor bytes, tensor) of each split over split_max_bytes
        # (always a split of one tensor larger than the limit)
        self.oversize: tuple[tuple[str, int, str], ...] = ()
        self._plan: Optional[GGUFPlan] = None
        self._headers: list[bytes] = []

    # ------------------------------------------------------------ collecting
    @property
    def kv(self) -> "Mapping[str, KV]":
        """The KVs added so far (read-only; the writer's own keys are added at write time)."""
        return MappingProxyType(self._kv)

    def _need(self, state: str) -> None:
        if self._state != state:
            raise RuntimeError(f"GGUFWriter is {self._state}; this call needs it {state}")

    def add_kv(self, key: str, value: Any, vtype: "VT | int", sub_type: "VT | int | None" = None) -> None:
        """Add a typed KV (``gguf.GGUFValueType``). Keys are unique; the keys
        the writer owns (alignment, split.*, ds4quant tags) are refused."""
        self._need("collecting")
        _check_name(key, "KV key")
        if key in self._kv:
            raise BadInputError(f"KV key {key!r} added twice")
        if key == KEY_ALIGNMENT or key in SPLIT_KEYS or key in RESERVED_KEYS or key.startswith(TAG_PREFIX):
            raise BadInputError(f"KV key {key!r} is set by the writer",
                                hint="use GGUFWriter(alignment=..., split_max_bytes=...) and add_tensor(qtype=...)")
        self._kv[key] = make_kv(value, vtype, sub_type, what=f"KV {key!r}")

    def add_string(self, key: str, value: str) -> None:
        self.add_kv(key, value, VT.STRING)

    def add_uint32(self, key: str, value: int) -> None:
        self.add_kv(key, value, VT.UINT32)

    def add_int32(self, key: str, value: int) -> None:
        self.add_kv(key, value, VT.INT32)

    def add_uint64(self, key: str, value: int) -> None:
        self.add_kv(key, value, VT.UINT64)

    def add_float32(self, key: str, value: float) -> None:
        self.add_kv(key, value, VT.FLOAT32)

    def add_bool(self, key: str, value: bool) -> None:
        self.add_kv(key, value, VT.BOOL)

    def add_array(self, key: str, values: Any, sub_type: "VT | int") -> None:
        self.add_kv(key, values, VT.ARRAY, sub_type)

    def add_blob(self, key: str, data: "bytes | bytearray | memoryview | np.ndarray") -> None:
        """An embedded byte blob (e.g. a MIX sidecar), stored as ARRAY of UINT8
        (docs/formats.md#gumix, #p4mix)."""
        if isinstance(data, np.ndarray) and data.dtype != np.uint8:
            raise BadInputError(f"blob {key!r} must be uint8 bytes, got dtype {data.dtype}")
        self.add_kv(key, data, VT.ARRAY, VT.UINT8)

    def add_tensor(self, name: str, qtype: str, shape: "tuple[int, ...] | list[int]", data: TensorData) -> None:
        """Add a tensor of ``qtype`` and GGUF ``shape`` (ne[0] innermost).

        ``data``: its payload bytes (bytes-like or a little-endian numpy array
        of exactly ``nbytes``), or a callable called once at write time that
        returns such a payload or an iterable of chunks.
        """
        self._need("collecting")
        _check_name(name, "tensor name")
        if len(name.encode("utf-8")) > MAX_NAME_BYTES:
            raise BadInputError(f"tensor name {name!r} is longer than {MAX_NAME_BYTES} bytes (ggml limit)")
        if name in self._tensors:
            raise BadInputError(f"tensor {name!r} added twice")
        ref = type_ref(qtype)
        dims = tuple(shape)
        if not 1 <= len(dims) <= MAX_DIMS:
            raise ShapeError(f"tensor {name!r}: shape must have 1..{MAX_DIMS} dims, got {dims}")
        for d in dims:
            if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)) or int(d) < 1 or int(d) >= 2**63:
                raise ShapeError(f"tensor {name!r}: every dim must be an int in [1, 2^63), got {dims}")
        dims = tuple(int(d) for d in dims)
        if dims[0] % ref.block_size:
            raise ShapeError(f"tensor {name!r}: ne[0]={dims[0]} is not a multiple of {ref.name}'s block of {ref.block_size}",
                             hint="shape is in GGUF order: ne[0] is the innermost (row) dimension")
        n = 1
        for d in dims:
            n *= d
        if n >= 2**63:
            raise ShapeError(f"tensor {name!r}: {dims} has more than 2^63 elements")
        if data is None:
            raise BadInputError(f"tensor {name!r}: data is required (bytes, array or callable)")
        self._tensors[name] = _Tensor(name, ref.name, ref.ggml_type, dims, tensor_nbytes(ref, dims), data)

    # ------------------------------------------------------------ planning
    def _group(self) -> list[list[_Tensor]]:
        groups: list[list[_Tensor]] = [[]]
        used = 0
        for t in self._tensors.values():
            size = align_up(t.nbytes, self.alignment)
            if self.split_max_bytes is not None and groups[-1] and used + size > self.split_max_bytes:
                groups.append([])
                used = 0
            groups[-1].append(t)
            used += size
        return groups

    def plan(self) -> GGUFPlan:
        """Fix splits, offsets and header bytes; no more adds after this."""
        if self._plan is not None:
            return self._plan
        self._need("collecting")
        groups = self._group()
        n = len(groups)
        if n > MAX_SPLITS:
            raise BadInputError(f"{n} splits needed; split.count allows at most {MAX_SPLITS}",
                                hint="raise split_max_bytes")
        all_qtypes = {t.qtype for t in self._tensors.values()}
        total = len(self._tensors)
        if n > 1 and total >= 2**31:
            raise BadInputError(f"{total} tensors do not fit split.tensors.count (INT32)")
        files, headers = [], []
        for i, group in enumerate(groups):
            kv: dict[str, KV] = dict(self._kv) if i == 0 else {}
            if self.alignment != DEFAULT_ALIGNMENT:
                kv[KEY_ALIGNMENT] = make_kv(self.alignment, VT.UINT32)
            if self.tags:
                kv.update(tag_kvs({t.name: t.qtype for t in group}, all_qtypes))
            if n > 1:
                kv[KEY_SPLIT_NO] = make_kv(i, VT.UINT16)
                kv[KEY_SPLIT_COUNT] = make_kv(n, VT.UINT16)
                kv[KEY_SPLIT_TENSORS] = make_kv(total, VT.INT32)
            header = bytearray(GGUF_MAGIC)
            header += struct.pack("<IQQ", GGUF_VERSION, len(group), len(kv))
            for key, val in kv.items():
                header += pack_kv(key, val)
            planned, offset = [], 0
            for t in group:
                header += pack_string(t.name)
                header += struct.pack("<I", len(t.shape))
                header += struct.pack(f"<{len(t.shape)}Q", *t.shape)
                header += struct.pack("<IQ", t.ggml_type, offset)
                planned.append(PlannedTensor(t.name, t.qtype, t.ggml_type, t.shape, t.nbytes, offset))
                offset += align_up(t.nbytes, self.alignment)
            data_offset = align_up(len(header), self.alignment)
            header += bytes(data_offset - len(header))
            path = self.path if n == 1 else split_path(self.path, i, n)
            files.append(PlannedFile(path, i, tuple(planned), data_offset, data_offset + offset))
            headers.append(bytes(header))
        self._plan = GGUFPlan(tuple(files), self.alignment)
        self._headers = headers
        if self.split_max_bytes is not None:
            self.oversize = tuple(
                (pf.path.name, pf.size - pf.data_offset, pf.tensors[0].name) for pf in files
                if pf.size - pf.data_offset > self.split_max_bytes)
        self._state = "planned"
        return self._plan

    # ------------------------------------------------------------ writing
    def write(self) -> tuple[Path, ...]:
        """Stream every file to a temp file, then rename all into place.
        Returns the written paths. On any error no target file is touched."""
        plan = self.plan()
        self._need("planned")
        self._state = "writing"
        pending: list[AtomicFile] = []
        sums: dict[Path, str] = {}
        pf = None
        try:
            for pf, header in zip(plan.files, self._headers):
                af = AtomicFile(pf.path)
                pending.append(af)
                f = _Hashing(af.file)
                f.write(header)
                for pt in pf.tensors:
                    t = self._tensors[pt.name]
                    t.data = _write_payload(f, t)  # drop our reference as we go
                    f.write(bytes(align_up(pt.nbytes, self.alignment) - pt.nbytes))
                if f.tell() != pf.size:
                    raise RuntimeError(f"{pf.path}: wrote {f.tell()} bytes, planned {pf.size}")
                af.finish()
                sums[pf.path] = f.sha.hexdigest()
            for af in pending:
                af.commit()
        except BaseException as e:
            for af in pending:
                af.abort()
            self._state = "failed"
            if isinstance(e, OSError) and e.filename is None and pf is not None:
                from ds4quant.artifact.atomic import with_path

                raise with_path(e, pf.path) from e
            raise
        self._state = "written"
        self.sha256 = sums
        return tuple(pf.path for pf in plan.files)


class _Hashing:
    """A file whose every written byte also feeds a sha256: the manifest's file
    digests come from the stream, so the finished GGUF is never read back."""

    def __init__(self, f) -> None:
        self._f = f
        self.sha = hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)
        return self._f.write(data)

    def tell(self) -> int:
        return self._f.tell()


def _as_bytes_view(chunk: Any, name: str) -> "memoryview | np.ndarray":
    if isinstance(chunk, np.ndarray):
        bo = chunk.dtype.byteorder
        if chunk.dtype.itemsize > 1 and (bo == ">" or (bo == "=" and sys.byteorder == "big")):
            raise BadInputError(f"tensor {name!r}: array data must be little-endian, got dtype {chunk.dtype.str}")
        if chunk.dtype.hasobject:
            raise BadInputError(f"tensor {name!r}: object arrays cannot be written")
        return np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)
    if isinstance(chunk, (bytes, bytearray)):
        return memoryview(chunk)
    if isinstance(chunk, memoryview):
        return chunk.cast("B") if chunk.c_contiguous else memoryview(chunk.tobytes())
    raise BadInputError(f"tensor {name!r}: data chunk must be bytes or a numpy array, got {type(chunk).__name__}")


def _write_payload(f, t: _Tensor) -> None:
    data = t.data() if callable(t.data) else t.data
    chunks = [data] if isinstance(data, (bytes, bytearray, memoryview, np.ndarray)) else data
    if isinstance(chunks, (str, dict)) or not hasattr(chunks, "__iter__"):
        raise BadInputError(f"tensor {t.name!r}: data must be bytes, an array, or chunks of them, got {type(data).__name__}")
    written = 0
    for chunk in chunks:
        view = _as_bytes_view(chunk, t.name)
        n = view.nbytes
        if written + n > t.nbytes:
            raise ShapeError(f"tensor {t.name!r}: data is longer than the {t.nbytes} bytes of {t.qtype} {t.shape}")
        f.write(view)
        written += n
    if written != t.nbytes:
        raise ShapeError(f"tensor {t.name!r}: data has {written} bytes, {t.qtype} {t.shape} needs {t.nbytes}")
    return None
