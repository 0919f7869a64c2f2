"""Routing profiles: how often each routed expert of each layer was selected.

A profile counts, per MoE layer and expert, the routed slots (token x top-k
slot) that chose that expert. Placement reads it to pick hot experts
(DESIGN.md "Placement"); the budget optimizer reads it as expert frequency.
Two file forms:

Lucebox hotness CSV (``MoeHybridRoutingStats::save_csv``;
docs/formats.md#routing-profile), what ``DFLASH_DS4_HOTNESS_CSV`` loads::

    # hotness table: n_layer=43 n_expert=256 n_expert_used=6
    # format: one row per layer, columns are expert activation counts (expert 0..N-1)
    12,0,5,...                       <- layer 0: n_expert uint64 counts
    ...                              <- one row per layer

The reader takes what Lucebox's loader takes: other ``#`` lines and blank lines
are skipped, values may be whitespace-separated (legacy files), a header
without ``n_expert_used`` means 8 (capped at n_expert), a file without a header
takes its shape from the rows. Anything else (a negative, signed, fractional
or empty value, a row of the wrong width, a per-layer total past uint64) is a
CorruptDataError naming the file and line.

JSON (ds4quant's own, schema-versioned; keeps tokens seen and source info)::

    {"schema": "ds4quant.routing_profile", "version": 1, "n_layer": 4,
     "n_expert": 16, "n_expert_used": 4, "tokens": 1024,
     "source": {...}, "counts": [[...n_expert ints...] x n_layer]}

Example::

    p = read_routing("routing.csv")
    p.hot_experts(3, 8)          # the 8 most selected experts of layer 3
    p.frequencies()[3]           # float64 (n_expert,): share of layer 3's slots
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Optional

import numpy as np

from ds4quant.artifact.atomic import atomic_write_bytes, json_bytes
from ds4quant.errors import BadInputError, CorruptDataError, ShapeError, UnsupportedFormatError

__all__ = [
    "RoutingProfile",
    "read_routing",
    "read_routing_csv",
    "read_routing_json",
    "routing_csv_text",
    "write_routing_csv",
    "write_routing_json",
    "CSV_FORMAT_LINE",
    "JSON_SCHEMA",
    "JSON_VERSION",
]

UINT64_MAX = 2**64 - 1
DEFAULT_EXPERT_USED = 8  # Lucebox's loader default when the header lacks it
CSV_HEADER_PREFIX = "# hotness table:"
CSV_FORMAT_LINE = "# format: one row per layer, columns are expert activation counts (expert 0..N-1)"
JSON_SCHEMA = "ds4quant.routing_profile"
JSON_VERSION = 1

_HEADER_RE = re.compile(
    r"# hotness table: n_layer=([0-9]+) n_expert=([0-9]+)(?: n_expert_used=([0-9]+))?[ \t\r]*"
)
_UINT_RE = re.compile(r"[0-9]+")
_MAX_DIM = 2**31 - 1  # Lucebox keeps dims and n_layer*n_expert in an int


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


@dataclass(frozen=True, eq=False)
class RoutingProfile:
    """Routed-slot counts per layer and expert (arrays are read-only).

    counts: uint64 (n_layer, n_expert); counts[L, e] = slots of layer L that
    chose expert e. n_expert_used: top-k of the model (slots per token).
    tokens: tokens seen, or None when unknown (a CSV does not say).
    source: JSON-serializable facts about where the counts came from.
    path: the file it was read from (None when built in memory); not part of
    equality or the JSON, it only lets errors about the profile name the file.
    """

    n_layer: int
    n_expert: int
    n_expert_used: int
    counts: np.ndarray
    tokens: Optional[int] = None
    source: Mapping[str, Any] = field(default_factory=dict)
    path: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_expert", "n_expert_used"):
            v = getattr(self, name)
            if not _is_int(v) or not 1 <= v <= _MAX_DIM:
                raise BadInputError(f"routing profile {name} must be an int in 1..{_MAX_DIM}, got {v!r}")
            object.__setattr__(self, name, int(v))
        if self.n_expert_used > self.n_expert:
            raise BadInputError(
                f"routing profile n_expert_used {self.n_expert_used} exceeds n_expert {self.n_expert}"
            )
        c = self.counts
        if not isinstance(c, np.ndarray):
            c = _counts_from_lists(c)
        if c.dtype.kind not in "ui":
            raise BadInputError(f"routing counts must be an unsigned integer array, got {c.dtype}")
        if c.dtype.kind == "i" and c.size and int(c.min()) < 0:
            raise BadInputError("routing counts must be >= 0")
        if c.shape != (self.n_layer, self.n_expert):
            raise ShapeError(f"routing counts have shape {c.shape}, expected ({self.n_layer}, {self.n_expert})")
        c = np.array(c, dtype=np.uint64, copy=True)
        for layer in range(self.n_layer):
            if sum(int(v) for v in c[layer]) > UINT64_MAX:
                raise BadInputError(f"routing counts of layer {layer} sum past 2^64-1")
        c.setflags(write=False)
        object.__setattr__(self, "counts", c)
        if self.tokens is not None:
            if not _is_int(self.tokens) or not 0 <= self.tokens <= UINT64_MAX:
                raise BadInputError(f"routing profile tokens must be an int >= 0 or None, got {self.tokens!r}")
            object.__setattr__(self, "tokens", int(self.tokens))
        if not isinstance(self.source, Mapping) or not all(isinstance(k, str) for k in self.source):
            raise BadInputError("routing profile source must be a mapping with string keys")
        json_bytes(dict(self.source))  # refuses what JSON cannot hold
        object.__setattr__(self, "source", MappingProxyType(dict(self.source)))
        if self.path is not None:
            object.__setattr__(self, "path", str(self.path))

    @property
    def where(self) -> str:
        """The file for error messages ("routing profile" when built in memory)."""
        return self.path or "routing profile"

    def check_shape(self, n_layer: int, n_expert: int, what: str = "the model") -> None:
        """Raise ShapeError naming the file unless the profile is (n_layer, n_expert)."""
        if (self.n_layer, self.n_expert) != (n_layer, n_expert):
            raise ShapeError(
                f"routing profile is {self.n_layer} layers x {self.n_expert} experts, {what} "
                f"{n_layer} x {n_expert}",
                where=self.where, hint="profile the same model (calibrate writes routing.csv / routing.json)",
            )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RoutingProfile):
            return NotImplemented
        return (
            (self.n_layer, self.n_expert, self.n_expert_used, self.tokens)
            == (other.n_layer, other.n_expert, other.n_expert_used, other.tokens)
            and np.array_equal(self.counts, other.counts)
            and dict(self.source) == dict(other.source)
        )

    __hash__ = None  # type: ignore[assignment]

    def _layer(self, layer: Any) -> int:
        if not _is_int(layer) or not 0 <= layer < self.n_layer:
            raise BadInputError(f"layer must be an int in 0..{self.n_layer - 1}, got {layer!r}")
        return int(layer)

    def layer_totals(self) -> np.ndarray:
        """uint64 (n_layer,): routed slots per layer (never wraps: checked on build)."""
        return self.counts.sum(axis=1, dtype=np.uint64)

    def frequencies(self) -> np.ndarray:
        """float64 (n_layer, n_expert): each expert's share of its layer's routed
        slots (rows sum to 1; a layer with no slots is all 0)."""
        c = self.counts.astype(np.float64)
        tot = c.sum(axis=1, keepdims=True)
        return np.divide(c, tot, out=np.zeros_like(c), where=tot > 0)

    def ranked_experts(self, layer: int) -> tuple[int, ...]:
        """Expert ids of ``layer`` by count, most selected first; ties go to the
        lower id (Lucebox ``ranked_experts``)."""
        row = self.counts[self._layer(layer)]
        # lexsort: last key is primary; -count via the order of a stable sort
        order = np.lexsort((np.arange(self.n_expert), np.iinfo(np.uint64).max - row))
        return tuple(int(e) for e in order)

    def hot_experts(self, layer: int, k: int) -> tuple[int, ...]:
        """The ``k`` most selected experts of ``layer`` (see ranked_experts); k is
        clamped to 0..n_expert."""
        if not _is_int(k):
            raise BadInputError(f"k must be an int, got {k!r}")
        return self.ranked_experts(layer)[: max(0, min(int(k), self.n_expert))]

    def unreached(self, layer: int) -> tuple[int, ...]:
        """Experts of ``layer`` with count 0, ascending."""
        return tuple(int(e) for e in np.nonzero(self.counts[self._layer(layer)] == 0)[0])

    def to_json(self) -> dict:
        return {
            "schema": JSON_SCHEMA,
            "version": JSON_VERSION,
            "n_layer": self.n_layer,
            "n_expert": self.n_expert,
            "n_expert_used": self.n_expert_used,
            "tokens": self.tokens,
            "source": dict(self.source),
            "counts": [[int(v) for v in row] for row in self.counts],
        }


def _counts_from_lists(rows: Any) -> np.ndarray:
    if not isinstance(rows, (list, tuple)) or not all(isinstance(r, (list, tuple)) for r in rows):
        raise BadInputError("routing counts must be an array or a list of rows")
    width = {len(r) for r in rows}
    if len(width) > 1:
        raise ShapeError(f"routing count rows have different widths {sorted(width)}")
    for i, r in enumerate(rows):
        for j, v in enumerate(r):
            if not _is_int(v) or not 0 <= v <= UINT64_MAX:
                raise BadInputError(f"routing count [{i}][{j}] = {v!r} is not an int in 0..2^64-1")
    return np.array([[int(v) for v in r] for r in rows], dtype=np.uint64).reshape(len(rows), -1)


# --------------------------------------------------------------------------
# Lucebox hotness CSV


def routing_csv_text(profile: RoutingProfile) -> str:
    """The CSV text ``MoeHybridRoutingStats::save_csv`` writes for ``profile``."""
    lines = [
        f"# hotness table: n_layer={profile.n_layer} n_expert={profile.n_expert} "
        f"n_expert_used={profile.n_expert_used}",
        CSV_FORMAT_LINE,
    ]
    lines += [",".join(str(int(v)) for v in row) for row in profile.counts]
    return "\n".join(lines) + "\n"


def write_routing_csv(path: "str | os.PathLike[str]", profile: RoutingProfile) -> Path:
    """Write ``profile`` as a Lucebox hotness CSV, atomically (tokens/source are not kept)."""
    return atomic_write_bytes(path, routing_csv_text(profile).encode("ascii"))


def _read_text(path: "str | os.PathLike[str]", what: str) -> tuple[str, str]:
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise BadInputError(f"cannot read {what}: {e.strerror}", where=str(p)) from None
    try:
        return raw.decode("utf-8"), str(p)
    except UnicodeDecodeError as e:
        raise CorruptDataError(f"byte {e.start} is not UTF-8 text; not a {what}", where=str(p)) from None


def read_routing_csv(path: "str | os.PathLike[str]") -> RoutingProfile:
    """Read a Lucebox hotness CSV (see module doc); tokens is None."""
    text, where = _read_text(path, "routing CSV")

    def fail(lineno: int, msg: str) -> CorruptDataError:
        return CorruptDataError(f"line {lineno}: {msg}", where=where)

    header: Optional[tuple[int, int, Optional[int]]] = None
    rows: list[list[int]] = []
    width: Optional[int] = None
    for lineno, line in enumerate(text.split("\n"), start=1):
        if line.endswith("\r"):
            line = line[:-1]
        if not line.strip(" \t"):
            continue
        if line.startswith("#"):
            if line.startswith(CSV_HEADER_PREFIX):
                m = _HEADER_RE.fullmatch(line)
                if m is None:
                    raise fail(lineno, f"malformed header {line[:80]!r}; expected "
                                       "'# hotness table: n_layer=L n_expert=E n_expert_used=K'")
                if header is not None:
                    raise fail(lineno, "a second '# hotness table:' header")
                if rows:
                    raise fail(lineno, "the header comes after data rows")
                nl, ne = int(m.group(1)), int(m.group(2))
                nu = None if m.group(3) is None else int(m.group(3))
                if not (1 <= nl <= _MAX_DIM and 1 <= ne <= _MAX_DIM and nl * ne <= _MAX_DIM):
                    raise fail(lineno, f"header n_layer={nl} n_expert={ne} is not a valid shape")
                if nu is not None and not 1 <= nu <= ne:
                    raise fail(lineno, f"header n_expert_used={nu} is not in 1..n_expert ({ne})")
                header = (nl, ne, nu)
                width = ne
            continue
        # Commas are canonical; a line without one is a whitespace-separated legacy row.
        fields = line.split(",") if "," in line else line.split()
        row = []
        for col, fld in enumerate(fields):
            v = fld.strip(" \t")
            if not _UINT_RE.fullmatch(v):
                shown = repr(v) if v else "an empty value"
                raise fail(lineno, f"column {col}: {shown} is not an unsigned integer count")
            n = int(v)
            if n > UINT64_MAX:
                raise fail(lineno, f"column {col}: {v} does not fit uint64")
            row.append(n)
        if width is None:
            width = len(row)
        elif len(row) != width:
            raise fail(lineno, f"row of layer {len(rows)} has {len(row)} counts, expected {width} (n_expert)")
        if sum(row) > UINT64_MAX:
            raise fail(lineno, f"counts of layer {len(rows)} sum past uint64")
        rows.append(row)
    if not rows:
        raise CorruptDataError("no data rows: not a routing hotness CSV", where=where)
    n_layer, n_expert, n_used = header if header is not None else (len(rows), width, None)
    if len(rows) != n_layer:
        raise CorruptDataError(f"header says n_layer={n_layer} but the file has {len(rows)} rows", where=where)
    if n_used is None:
        n_used = min(DEFAULT_EXPERT_USED, n_expert)
    return RoutingProfile(n_layer, n_expert, n_used, np.array(rows, dtype=np.uint64).reshape(n_layer, n_expert),
                          path=where)


# --------------------------------------------------------------------------
# JSON


def write_routing_json(path: "str | os.PathLike[str]", profile: RoutingProfile) -> Path:
    """Write ``profile`` as schema-versioned canonical JSON, atomically."""
    return atomic_write_bytes(path, json_bytes(profile.to_json()))


def profile_from_json(obj: Any, where: str = "routing JSON", path: Optional[str] = None) -> RoutingProfile:
    """Build a profile from a decoded JSON object (see module doc); malformed
    content raises CorruptDataError naming ``where`` and the field."""

    def fail(msg: str) -> CorruptDataError:
        return CorruptDataError(msg, where=where)

    if not isinstance(obj, dict):
        raise fail("top level is not a JSON object")
    if obj.get("schema") != JSON_SCHEMA:
        raise fail(f"schema is {obj.get('schema')!r}, expected {JSON_SCHEMA!r}")
    ver = obj.get("version")
    if not _is_int(ver):
        raise fail(f"version must be an integer, got {ver!r}")
    if ver != JSON_VERSION:
        raise UnsupportedFormatError(f"routing profile version {ver}; this build reads version {JSON_VERSION}",
                                     where=where, hint="upgrade ds4quant")
    unknown = set(obj) - {"schema", "version", "n_layer", "n_expert", "n_expert_used", "tokens", "source", "counts"}
    if unknown:
        raise fail(f"unknown fields {sorted(unknown)}")
    dims = {}
    for key in ("n_layer", "n_expert", "n_expert_used"):
        v = obj.get(key)
        if not _is_int(v) or not 1 <= v <= _MAX_DIM:
            raise fail(f"{key} must be an integer in 1..{_MAX_DIM}, got {v!r}")
        dims[key] = int(v)
    if dims["n_expert_used"] > dims["n_expert"]:
        raise fail(f"n_expert_used {dims['n_expert_used']} exceeds n_expert {dims['n_expert']}")
    tokens = obj.get("tokens")
    if tokens is not None and (not _is_int(tokens) or not 0 <= tokens <= UINT64_MAX):
        raise fail(f"tokens must be null or an integer in 0..2^64-1, got {tokens!r}")
    source = obj.get("source", {})
    if not isinstance(source, dict):
        raise fail("source must be an object")
    counts = obj.get("counts")
    if not isinstance(counts, list) or len(counts) != dims["n_layer"]:
        n = len(counts) if isinstance(counts, list) else type(counts).__name__
        raise fail(f"counts must be a list of n_layer={dims['n_layer']} rows, got {n}")
    for i, row in enumerate(counts):
        if not isinstance(row, list) or len(row) != dims["n_expert"]:
            n = len(row) if isinstance(row, list) else type(row).__name__
            raise fail(f"counts[{i}] must be a list of n_expert={dims['n_expert']} integers, got {n}")
        for j, v in enumerate(row):
            if not _is_int(v) or not 0 <= v <= UINT64_MAX:
                raise fail(f"counts[{i}][{j}] = {v!r} is not an integer in 0..2^64-1")
        if sum(row) > UINT64_MAX:
            raise fail(f"counts[{i}] sum past 2^64-1")
    arr = np.array(counts, dtype=np.uint64).reshape(dims["n_layer"], dims["n_expert"])
    return RoutingProfile(dims["n_layer"], dims["n_expert"], dims["n_expert_used"], arr, tokens=tokens, source=source,
                          path=path)


def read_routing_json(path: "str | os.PathLike[str]") -> RoutingProfile:
    """Read a ds4quant routing profile JSON."""
    text, where = _read_text(path, "routing profile JSON")
    try:
        obj = json.loads(text, parse_constant=_refuse_constant)
    except ValueError as e:
        raise CorruptDataError(f"not valid JSON: {e}", where=where) from None
    return profile_from_json(obj, where, path=where)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def read_routing(path: "str | os.PathLike[str]") -> RoutingProfile:
    """Read a routing profile in either form: JSON (starts with '{') or CSV."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            head = f.read(64)
    except OSError as e:
        raise BadInputError(f"cannot read routing profile: {e.strerror}", where=str(p)) from None
    if head.lstrip().startswith(b"{"):
        return read_routing_json(p)
    return read_routing_csv(p)
