"""``manifest.json``: what an artifact holds, how it was made, and its hashes.

Schema (version 1), canonical JSON (sorted keys, 2-space indent)::

    {"schema_version": 1, "tool": "ds4quant", "tool_version": "0.1.0",
     "command": ["ds4quant", "convert", ...],      # created-by command line
     "source": {...},                              # source fingerprint (free JSON object)
     "recipe": {...},                              # the full recipe (free JSON object)
     "files":   [{"name", "bytes", "sha256"}],     # names relative to the manifest
     "tensors": [{"name", "qtype", "variant", "ggml_type", "shape", "bytes",
                  "sha256", "codebook"?, "errors"?}]}

``shape`` is GGUF order (ne[0] innermost); ``sha256`` of a tensor is over
its payload bytes; ``codebook`` names where its MIX codebooks live (optional);
``errors`` holds error figures by name (optional, finite numbers).
No timestamps: the same inputs give the same bytes.

    m = Manifest(tool_version=..., command=(...), source={...}, recipe={...},
                 files=(FileEntry.of(path),), tensors=tensor_entries(gguf_set))
    write_manifest(folder / "manifest.json", m)
    m2 = read_manifest(folder / "manifest.json")       # validated; m2 == m
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Optional

from ds4quant.artifact.atomic import atomic_write_json
from ds4quant.errors import BadInputError, CorruptDataError, UnsupportedFormatError

SCHEMA_VERSION = 1
TOOL = "ds4quant"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 8 << 20


def sha256_file(path: "str | os.PathLike[str]", chunk_bytes: int = _CHUNK) -> str:
    """Hex sha256 of a file, streamed in ``chunk_bytes`` pieces."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while True:
                block = f.read(chunk_bytes)
                if not block:
                    break
                h.update(block)
    except FileNotFoundError:
        raise BadInputError("no such file", where=str(path)) from None
    return h.hexdigest()


def sha256_bytes(data: Any) -> str:
    """Hex sha256 of a bytes-like object or a contiguous numpy array (e.g. a tensor memmap)."""
    return hashlib.sha256(memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else data).hexdigest()


def _freeze(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return MappingProxyType({k: _freeze(v) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return tuple(_freeze(v) for v in obj)
    return obj


def _thaw(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {k: _thaw(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return [_thaw(v) for v in obj]
    return obj


@dataclass(frozen=True)
class FileEntry:
    name: str  # relative to the manifest's folder, "/" separated
    bytes: int
    sha256: str

    @classmethod
    def of(cls, path: "str | os.PathLike[str]", name: Optional[str] = None) -> "FileEntry":
        """Measure a file on disk (size and streamed sha256)."""
        p = Path(path)
        return cls(name or p.name, p.stat().st_size, sha256_file(p))

    def to_json(self) -> dict:
        return {"name": self.name, "bytes": self.bytes, "sha256": self.sha256}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    qtype: str
    variant: str
    ggml_type: int
    shape: tuple[int, ...]  # GGUF order, ne[0] innermost
    bytes: int
    sha256: str  # of the payload bytes
    codebook: Optional[str] = None
    errors: Optional[Mapping[str, float]] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        if self.errors is not None:
            object.__setattr__(self, "errors", MappingProxyType(dict(self.errors)))

    def to_json(self) -> dict:
        d: dict[str, Any] = {"name": self.name, "qtype": self.qtype, "variant": self.variant,
                             "ggml_type": self.ggml_type, "shape": list(self.shape), "bytes": self.bytes,
                             "sha256": self.sha256}
        if self.codebook is not None:
            d["codebook"] = self.codebook
        if self.errors is not None:
            d["errors"] = dict(self.errors)
        return d


@dataclass(frozen=True)
class Manifest:
    tool_version: str
    command: tuple[str, ...]
    source: Mapping[str, Any]
    recipe: Mapping[str, Any]
    files: tuple[FileEntry, ...] = ()
    tensors: tuple[TensorEntry, ...] = ()
    schema_version: int = SCHEMA_VERSION
    tool: str = TOOL
    _index: Mapping[str, TensorEntry] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "command", tuple(self.command))
        object.__setattr__(self, "source", _freeze(self.source))
        object.__setattr__(self, "recipe", _freeze(self.recipe))
        object.__setattr__(self, "files", tuple(self.files))
        object.__setattr__(self, "tensors", tuple(self.tensors))
        object.__setattr__(self, "_index", MappingProxyType({t.name: t for t in self.tensors}))

    def tensor(self, name: str) -> TensorEntry:
        try:
            return self._index[name]
        except KeyError:
            raise BadInputError(f"manifest has no tensor {name!r}") from None

    def to_json(self) -> dict:
        return {
            "schema_version": self.schema_version,
            "tool": self.tool,
            "tool_version": self.tool_version,
            "command": list(self.command),
            "source": _thaw(self.source),
            "recipe": _thaw(self.recipe),
            "files": [f.to_json() for f in self.files],
            "tensors": [t.to_json() for t in self.tensors],
        }


# ---------------------------------------------------------------- validation


class _Check:
    """Type checks that name the JSON path of the offending field."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, path: str, msg: str) -> CorruptDataError:
        return CorruptDataError(f"{path}: {msg}", where=self.where)

    def obj(self, v: Any, path: str, required: set[str], optional: set[str] = frozenset()) -> dict:
        if not isinstance(v, dict):
            raise self.fail(path, f"must be an object, got {type(v).__name__}")
        missing = sorted(required - set(v))
        if missing:
            raise self.fail(path, f"missing key(s) {', '.join(missing)}")
        unknown = sorted(set(v) - required - set(optional))
        if unknown:
            raise self.fail(path, f"unknown key(s) {', '.join(unknown)}")
        return v

    def str_(self, v: Any, path: str, nonempty: bool = True) -> str:
        if not isinstance(v, str) or (nonempty and not v):
            raise self.fail(path, f"must be a{' non-empty' if nonempty else ''} string, got {v!r}")
        return v

    def int_(self, v: Any, path: str, lo: int = 0) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise self.fail(path, f"must be an integer >= {lo}, got {v!r}")
        return v

    def sha(self, v: Any, path: str) -> str:
        if not isinstance(v, str) or not _SHA256.match(v):
            raise self.fail(path, f"must be 64 lowercase hex digits, got {v!r}")
        return v

    def list_(self, v: Any, path: str) -> list:
        if not isinstance(v, list):
            raise self.fail(path, f"must be a list, got {type(v).__name__}")
        return v


def manifest_from_json(obj: Any, where: str = "manifest") -> Manifest:
    """Validate a parsed manifest.json object and build the Manifest."""
    c = _Check(where)
    if not isinstance(obj, dict):
        raise c.fail("$", f"must be an object, got {type(obj).__name__}")
    sv = obj.get("schema_version")
    if isinstance(sv, bool) or not isinstance(sv, int):
        raise c.fail("schema_version", f"must be an integer, got {sv!r}")
    if sv != SCHEMA_VERSION:
        raise UnsupportedFormatError(f"manifest schema_version {sv} is not supported (this build reads "
                                     f"{SCHEMA_VERSION})", where=where, hint="upgrade ds4quant")
    c.obj(obj, "$", {"schema_version", "tool", "tool_version", "command", "source", "recipe", "files", "tensors"})
    if obj["tool"] != TOOL:
        raise c.fail("tool", f"must be {TOOL!r}, got {obj['tool']!r}")
    tool_version = c.str_(obj["tool_version"], "tool_version")
    command = tuple(c.str_(a, f"command[{i}]", nonempty=False) for i, a in enumerate(c.list_(obj["command"], "command")))
    for k in ("source", "recipe"):
        if not isinstance(obj[k], dict):
            raise c.fail(k, f"must be an object, got {type(obj[k]).__name__}")
    files, seen = [], set()
    for i, f in enumerate(c.list_(obj["files"], "files")):
        p = f"files[{i}]"
        c.obj(f, p, {"name", "bytes", "sha256"})
        name = c.str_(f["name"], f"{p}.name")
        if name.startswith("/") or ".." in name.split("/") or "\\" in name:
            raise c.fail(f"{p}.name", f"must be a relative path inside the artifact folder, got {name!r}")
        if name in seen:
            raise c.fail(f"{p}.name", f"duplicate file {name!r}")
        seen.add(name)
        files.append(FileEntry(name, c.int_(f["bytes"], f"{p}.bytes"), c.sha(f["sha256"], f"{p}.sha256")))
    tensors, seen = [], set()
    for i, t in enumerate(c.list_(obj["tensors"], "tensors")):
        p = f"tensors[{i}]"
        c.obj(t, p, {"name", "qtype", "variant", "ggml_type", "shape", "bytes", "sha256"}, {"codebook", "errors"})
        name = c.str_(t["name"], f"{p}.name")
        if name in seen:
            raise c.fail(f"{p}.name", f"duplicate tensor {name!r}")
        seen.add(name)
        shape = tuple(c.int_(d, f"{p}.shape[{j}]", 1) for j, d in enumerate(c.list_(t["shape"], f"{p}.shape")))
        if not 1 <= len(shape) <= 4:
            raise c.fail(f"{p}.shape", f"must have 1..4 dims, got {list(shape)}")
        codebook = t.get("codebook")
        if codebook is not None:
            c.str_(codebook, f"{p}.codebook")
        errors = t.get("errors")
        if errors is not None:
            if not isinstance(errors, dict):
                raise c.fail(f"{p}.errors", f"must be an object, got {type(errors).__name__}")
            for k, v in errors.items():
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise c.fail(f"{p}.errors.{k}", f"must be a finite number, got {v!r}")
        tensors.append(TensorEntry(name, c.str_(t["qtype"], f"{p}.qtype"), c.str_(t["variant"], f"{p}.variant"),
                                   c.int_(t["ggml_type"], f"{p}.ggml_type"), shape, c.int_(t["bytes"], f"{p}.bytes"),
                                   c.sha(t["sha256"], f"{p}.sha256"), codebook, errors))
    return Manifest(tool_version, command, obj["source"], obj["recipe"], tuple(files), tuple(tensors), sv)


def write_manifest(path: "str | os.PathLike[str]", manifest: Manifest) -> Path:
    """Validate and write ``manifest`` atomically as canonical JSON."""
    obj = manifest.to_json()
    manifest_from_json(json.loads(json.dumps(obj)), where=str(path))  # the same checks a reader applies
    return atomic_write_json(path, obj)


def read_manifest(path: "str | os.PathLike[str]") -> Manifest:
    """Read and validate a manifest.json (unknown schema versions refused)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise BadInputError("no such file", where=str(path)) from None
    try:
        obj = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
        raise CorruptDataError(f"not valid JSON: {e}", where=str(path)) from None
    return manifest_from_json(obj, where=str(path))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def tensor_entries(gguf_view: Any, *, codebooks: Optional[Mapping[str, str]] = None,
                   errors: Optional[Mapping[str, Mapping[str, float]]] = None) -> tuple[TensorEntry, ...]:
    """TensorEntries for every tensor of a GGUFFile/GGUFSet, hashing each payload
    (streamed through the memmap). ``codebooks``/``errors`` are per tensor name."""
    out = []
    for name, info in gguf_view.tensors.items():
        data = gguf_view.tensor_data(name)
        h = hashlib.sha256()
        for start in range(0, info.nbytes, _CHUNK):
            h.update(data[start:start + _CHUNK])
        out.append(TensorEntry(name, info.qtype, info.variant, info.ggml_type, info.shape, info.nbytes, h.hexdigest(),
                               (codebooks or {}).get(name), (errors or {}).get(name)))
        del data
    return tuple(out)
