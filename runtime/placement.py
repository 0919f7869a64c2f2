"""Placements: which owner holds which routed expert of each MoE layer.

A placement is data (STYLE.md 11): frozen, versioned, stored as canonical JSON
with a content hash, validated completely on read. Per layer it lists the
global expert ids each owner holds (ascending, the owner's local order) and
``none``: experts held outside this process (a cluster shard's complement,
Lucebox's cold owner ``None``, docs/usage.md#placement). Every expert of
every layer is in exactly one of those lists.

A rank placement (docs/usage.md#placement, Lucebox ``cluster_expert_placement.h``) adds
``ranks``: per layer the owner rank of every expert, or -1 (REPLICATED) for
the ``replicate_hot`` hottest experts, which every rank holds; token row t of
a replicated expert is computed by rank (expert + t) % n_ranks. Its per-layer
lists hold nothing (every expert is ``none`` from the launcher's view);
``for_rank(r)`` gives the placement the process of rank r loads.

File form (schema ``ds4quant.placement``, version 1)::

    {"schema": "ds4quant.placement", "version": 1,
     "n_layer": 4, "n_expert": 16, "n_expert_used": 4,
     "owners": ["cuda:0", "cpu"],
     "layers": [{"cuda:0": [0, 5, 12], "cpu": [1, 2, ...], "none": []}, ...],
     "ranks": null | {"n_ranks": 2, "strategy": "balanced", "replicate_hot": 1,
                      "owner": [[0, 1, -1, ...] x n_layer]},
     "artifact": null | "sha256:...",          # fingerprint it was planned for
     "content_sha256": "..."}                  # sha256 of the canonical JSON of
                                               # every other field

Example::

    p = placement_for_one_owner(4, 16, owner="cpu")
    write_placement("placement.json", p); assert read_placement("placement.json") == p
    p.owner_of(2)          # int64 (16,): index into p.owners, -1 = none
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ds4quant.artifact.atomic import atomic_write_bytes, json_bytes
from ds4quant.errors import BadInputError, CorruptDataError, IntegrityError, OutputError, UnsupportedFormatError
from ds4quant.runtime.owners.kinds import OWNER_NAMES, OwnerName

__all__ = [
    "SCHEMA",
    "VERSION",
    "NONE",
    "REPLICATED",
    "RankPlacement",
    "Placement",
    "placement_from_json",
    "read_placement",
    "write_placement",
    "placement_for_one_owner",
    "as_placement",
]

SCHEMA = "ds4quant.placement"
VERSION = 1
NONE = "none"
REPLICATED = -1
STRATEGIES = ("uniform", "balanced")

# Bounds on what a file may claim (DS4 Flash: 43 layers x 256 experts, top-6);
# far above any real model, low enough that no check allocates much.
MAX_LAYER = 4096
MAX_EXPERT = 1 << 16
MAX_RANKS = 4096
MAX_OWNERS = 64
MAX_FILE_BYTES = 64 << 20

_HEX64 = re.compile(r"[0-9a-f]{64}")


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _canonical(obj: Any) -> bytes:
    # The hash input: sorted keys, no whitespace, ASCII; independent of how the
    # file itself is indented.
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


@dataclass(frozen=True)
class RankPlacement:
    """Expert ranks of a cluster placement.

    owner: per layer a tuple of n_expert ranks (0..n_ranks-1, or REPLICATED).
    replicate_hot: replicated experts per layer (exactly that many -1 per layer).
    """

    n_ranks: int
    strategy: str
    replicate_hot: int
    owner: tuple[tuple[int, ...], ...]

    def to_json(self) -> dict:
        return {"n_ranks": self.n_ranks, "strategy": self.strategy, "replicate_hot": self.replicate_hot,
                "owner": [list(r) for r in self.owner]}


@dataclass(frozen=True)
class Placement:
    """Per layer, the experts each owner holds; see the module doc.

    owners: owner names in planning order (owners[0] is the hot/primary one).
    experts: experts[layer][i] = ascending global ids held by owners[i].
    none: none[layer] = ascending ids held outside this process.
    ranks: RankPlacement or None. artifact: fingerprint or None.
    Build with ``Placement.build`` (validates); ``content_sha256`` is derived.
    """

    n_layer: int
    n_expert: int
    n_expert_used: int
    owners: tuple[str, ...]
    experts: tuple[tuple[tuple[int, ...], ...], ...]
    none: tuple[tuple[int, ...], ...]
    ranks: Optional[RankPlacement] = None
    artifact: Optional[str] = None

    @classmethod
    def build(cls, n_layer: int, n_expert: int, n_expert_used: int, owners: Sequence[str],
              experts: Sequence[Sequence[Sequence[int]]], none: Optional[Sequence[Sequence[int]]] = None,
              ranks: Optional[RankPlacement] = None, artifact: Optional[str] = None) -> "Placement":
        """Validate and freeze (ids are sorted; none defaults to empty)."""
        if none is None:
            none = [[] for _ in range(n_layer)]
        if len(experts) != len(none) or any(len(row) != len(owners) for row in experts):
            raise BadInputError(f"experts must hold one list per owner ({len(owners)}) per layer, "
                                f"and none one list per layer")
        obj = {
            "schema": SCHEMA, "version": VERSION, "n_layer": n_layer, "n_expert": n_expert,
            "n_expert_used": n_expert_used, "owners": list(owners),
            "layers": [{**{o: sorted(int(e) for e in experts[L][i]) for i, o in enumerate(owners)},
                        NONE: sorted(int(e) for e in none[L])} for L in range(len(experts))],
            "ranks": None if ranks is None else ranks.to_json(), "artifact": artifact,
        }
        return _from_content(obj, "placement")

    @classmethod
    def from_mapping(cls, layers: Mapping[Any, Mapping[str, Sequence[int]]], n_layer: int, n_expert: int,
                     n_expert_used: int = 1, artifact: Optional[str] = None) -> "Placement":
        """The placement a mapping {layer: {owner name or ``none``: expert ids}}
        spells for a model of ``n_layer`` x ``n_expert``: every layer listed once
        (JSON's string keys too), every expert of a layer in exactly one list.
        Owners keep their first appearance's order. A defect is one BadInputError
        line naming the layer and expert.

            Placement.from_mapping({0: {"cpu:0": (0, 1), "torch-cpu:1": (2, 3)}}, n_layer=1, n_expert=4)
        """
        if not isinstance(layers, Mapping):
            raise BadInputError(f"placement must be a mapping {{layer: {{owner: expert ids}}}}, got "
                                f"{type(layers).__name__}")
        rows: dict[int, Mapping] = {}
        for key, spec in layers.items():
            L = _layer_key(key, n_layer)
            if L in rows:
                raise BadInputError(f"placement lists layer {L} twice")
            if not isinstance(spec, Mapping):
                raise BadInputError(f"placement: layer {L} must map owner names to expert ids, got {spec!r}"[:200])
            rows[L] = spec
        gap = [L for L in range(n_layer) if L not in rows]
        if gap:
            raise BadInputError(f"placement has no layer {gap[0]}" + (f" (nor {gap[1:8]})" if len(gap) > 1 else ""))
        owners = list(dict.fromkeys(str(OwnerName.parse(o, where=f"placement layer {L}"))
                                    for L in range(n_layer) for o in rows[L] if o != NONE))
        experts, none = [], []
        for L in range(n_layer):
            table: list[Optional[str]] = [None] * n_expert
            for owner, ids in rows[L].items():
                if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
                    raise BadInputError(f"placement: layer {L} {owner} must list expert ids, got {ids!r}"[:200])
                for e in ids:
                    if not _is_int(e) or not 0 <= e < n_expert:
                        raise BadInputError(f"placement: layer {L} expert {e!r} outside 0..{n_expert - 1}")
                    if table[e] is not None:
                        raise BadInputError(f"placement: layer {L} expert {e} placed on {table[e]} and {owner}")
                    table[e] = owner
            if None in table:
                raise BadInputError(f"placement: layer {L} experts {[e for e, t in enumerate(table) if t is None]} "
                                    "are placed nowhere (use 'none' for experts held elsewhere)")
            experts.append([[e for e, t in enumerate(table) if t == o] for o in owners])
            none.append([e for e, t in enumerate(table) if t == NONE])
        return cls.build(n_layer, n_expert, n_expert_used, owners, experts, none, artifact=artifact)

    # ------------------------------------------------------------------
    def content_json(self) -> dict:
        """Every field but the hash, in file form."""
        return {
            "schema": SCHEMA, "version": VERSION, "n_layer": self.n_layer, "n_expert": self.n_expert,
            "n_expert_used": self.n_expert_used, "owners": list(self.owners),
            "layers": [{**{o: list(self.experts[L][i]) for i, o in enumerate(self.owners)},
                        NONE: list(self.none[L])} for L in range(self.n_layer)],
            "ranks": None if self.ranks is None else self.ranks.to_json(),
            "artifact": self.artifact,
        }

    @property
    def content_sha256(self) -> str:
        """sha256 (hex) of the canonical JSON of ``content_json()``."""
        return hashlib.sha256(_canonical(self.content_json())).hexdigest()

    def to_json(self) -> dict:
        return {**self.content_json(), "content_sha256": self.content_sha256}

    def _layer(self, layer: Any) -> int:
        if not _is_int(layer) or not 0 <= layer < self.n_layer:
            raise BadInputError(f"layer must be an int in 0..{self.n_layer - 1}, got {layer!r}")
        return int(layer)

    def owner_of(self, layer: int) -> np.ndarray:
        """int64 (n_expert,): index into ``owners`` of each expert's owner; -1 = none."""
        L = self._layer(layer)
        out = np.full(self.n_expert, -1, dtype=np.int64)
        for i, ids in enumerate(self.experts[L]):
            out[list(ids)] = i
        return out

    def owner_names(self, layer: int) -> tuple[str, ...]:
        """The owner name of each expert of ``layer`` (``none``: held outside this process)."""
        idx = self.owner_of(layer)
        return tuple(NONE if i < 0 else self.owners[int(i)] for i in idx)

    def experts_of(self, owner: str, layer: int) -> tuple[int, ...]:
        """Ascending global ids ``owner`` holds in ``layer`` (() for an owner not in the placement)."""
        L = self._layer(layer)
        if owner == NONE:
            return self.none[L]
        return self.experts[L][self.owners.index(owner)] if owner in self.owners else ()

    def owner_bytes(self, expert_nbytes: np.ndarray) -> dict[str, int]:
        """Bytes per owner (and ``none``) from int64 (n_layer, n_expert) expert bytes."""
        nb = np.asarray(expert_nbytes)
        if nb.shape != (self.n_layer, self.n_expert):
            raise BadInputError(f"expert bytes have shape {nb.shape}, expected ({self.n_layer}, {self.n_expert})")
        out = {o: 0 for o in self.owners}
        out[NONE] = 0
        for L in range(self.n_layer):
            for i, o in enumerate(self.owners):
                out[o] += sum(int(nb[L, e]) for e in self.experts[L][i])
            out[NONE] += sum(int(nb[L, e]) for e in self.none[L])
        return out

    def check_matches(self, n_layer: int, n_expert: int, fingerprint: Optional[str] = None,
                      where: Optional[str] = None) -> None:
        """Refuse (one line naming ``where``) a placement planned for another
        shape, or, when both are known, for another artifact fingerprint."""
        if (self.n_layer, self.n_expert) != (n_layer, n_expert):
            raise BadInputError(f"placement is for {self.n_layer} layers x {self.n_expert} experts, the artifact "
                                f"has {n_layer} x {n_expert}", where=where, hint="re-run ds4quant place")
        if fingerprint is not None and self.artifact is not None and fingerprint != self.artifact:
            raise IntegrityError(f"placement was planned for artifact {self.artifact[:23]}..., this one is "
                                 f"{fingerprint[:23]}...", where=where, hint="re-run ds4quant place")

    # ------------------------------------------------------------------ ranks
    def _need_ranks(self) -> RankPlacement:
        if self.ranks is None:
            raise BadInputError("this placement has no ranks (plan it with --ranks N)")
        return self.ranks

    def rank_owner(self, layer: int) -> np.ndarray:
        """int64 (n_expert,): owner rank of each expert of ``layer``; REPLICATED (-1) = every rank."""
        return np.array(self._need_ranks().owner[self._layer(layer)], dtype=np.int64)

    def slot_rank(self, layer: int, expert: int, t: int) -> int:
        """The rank that computes token row ``t``'s slot of ``expert`` (a replicated
        expert: (expert + t) % n_ranks, so no rank computes it twice)."""
        rk = self._need_ranks()
        if not _is_int(expert) or not 0 <= expert < self.n_expert or not _is_int(t) or t < 0:
            raise BadInputError(f"expert must be in 0..{self.n_expert - 1} and t >= 0, got {expert!r}, {t!r}")
        r = rk.owner[self._layer(layer)][int(expert)]
        return (int(expert) + int(t)) % rk.n_ranks if r == REPLICATED else r

    def slot_ranks(self, layer: int, top_k_index: np.ndarray) -> np.ndarray:
        """int64 like ``top_k_index`` [T, k]: ``slot_rank`` of every slot (t = row)."""
        rk = self._need_ranks()
        idx = np.asarray(top_k_index, dtype=np.int64)
        if idx.ndim != 2 or (idx.size and (idx.min() < 0 or idx.max() >= self.n_expert)):
            raise BadInputError(f"top_k_index must be [T, k] ids in 0..{self.n_expert - 1}")
        own = self.rank_owner(layer)[idx]
        t = np.arange(idx.shape[0], dtype=np.int64)[:, None]
        return np.where(own == REPLICATED, (idx + t) % rk.n_ranks, own)

    def for_rank(self, rank: int, owner: Optional[str] = None) -> "Placement":
        """The placement rank ``rank`` loads: its own and the replicated experts on
        ``owner`` (default owners[0]), every other expert ``none``; no ranks data."""
        rk = self._need_ranks()
        if not _is_int(rank) or not 0 <= rank < rk.n_ranks:
            raise BadInputError(f"rank must be in 0..{rk.n_ranks - 1}, got {rank!r}")
        name = str(OwnerName.parse(owner if owner is not None else self.owners[0]))
        mine, rest = [], []
        for L in range(self.n_layer):
            row = rk.owner[L]
            mine.append([[e for e in range(self.n_expert) if row[e] in (rank, REPLICATED)]])
            rest.append([e for e in range(self.n_expert) if row[e] not in (rank, REPLICATED)])
        return Placement.build(self.n_layer, self.n_expert, self.n_expert_used, [name], mine, rest,
                               artifact=self.artifact)


def _layer_key(key: Any, n_layer: int) -> int:
    """A mapping's layer key (an int, or its decimal text as JSON keys are) in 0..n_layer-1."""
    L = int(key) if _is_int(key) else (int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else None)
    if L is None or not 0 <= L < n_layer:
        raise BadInputError(f"placement names layer {key!r}; the artifact has layers 0..{n_layer - 1}")
    return L


# --------------------------------------------------------------------------
# validation (one path for files and for Placement.build)


def _from_content(obj: Any, where: str, stored_hash: Optional[str] = None) -> Placement:
    def fail(msg: str) -> CorruptDataError:
        return CorruptDataError(msg, where=where)

    if not isinstance(obj, dict):
        raise fail("top level is not a JSON object")
    if obj.get("schema") != SCHEMA:
        raise fail(f"schema is {obj.get('schema')!r}, expected {SCHEMA!r}")
    ver = obj.get("version")
    if not _is_int(ver):
        raise fail(f"version must be an integer, got {ver!r}")
    if ver != VERSION:
        raise UnsupportedFormatError(f"placement version {ver}; this build reads version {VERSION}",
                                     where=where, hint="upgrade ds4quant or re-run ds4quant place")
    known = {"schema", "version", "n_layer", "n_expert", "n_expert_used", "owners", "layers", "ranks",
             "artifact", "content_sha256"}
    unknown = sorted(set(obj) - known)
    if unknown:
        raise fail(f"unknown fields {unknown}")
    missing = sorted(known - {"content_sha256"} - set(obj))
    if missing:
        raise fail(f"missing fields {missing}")
    dims = {}
    for key, hi in (("n_layer", MAX_LAYER), ("n_expert", MAX_EXPERT), ("n_expert_used", MAX_EXPERT)):
        v = obj[key]
        if not _is_int(v) or not 1 <= v <= hi:
            raise fail(f"{key} must be an integer in 1..{hi}, got {v!r}")
        dims[key] = int(v)
    n_layer, n_expert, n_used = dims["n_layer"], dims["n_expert"], dims["n_expert_used"]
    if n_used > n_expert:
        raise fail(f"n_expert_used {n_used} exceeds n_expert {n_expert}")
    owners = obj["owners"]
    if not isinstance(owners, list) or not 1 <= len(owners) <= MAX_OWNERS:
        raise fail(f"owners must be a list of 1..{MAX_OWNERS} owner names")
    for o in owners:
        try:
            OwnerName.parse(o)
        except BadInputError:
            raise fail(f"unknown owner name {o!r} (expected {OWNER_NAMES})") from None
    if len(set(owners)) != len(owners):
        raise fail(f"owner names repeat: {owners}")
    layers = obj["layers"]
    if not isinstance(layers, list) or len(layers) != n_layer:
        n = len(layers) if isinstance(layers, list) else type(layers).__name__
        raise fail(f"layers must be a list of n_layer={n_layer} objects, got {n}")
    keys = set(owners) | {NONE}
    experts, none = [], []
    for L, lay in enumerate(layers):
        if not isinstance(lay, dict):
            raise fail(f"layers[{L}] is not an object")
        extra = sorted(set(lay) - keys)
        if extra:
            raise fail(f"layers[{L}] names owners {extra} not in owners {owners}")
        seen: dict[int, str] = {}
        per: list[tuple[int, ...]] = []
        for o in [*owners, NONE]:
            ids = lay.get(o, [])
            if not isinstance(ids, list) or len(ids) > n_expert:
                raise fail(f"layers[{L}].{o} must be a list of at most n_expert={n_expert} expert ids")
            for e in ids:
                if not _is_int(e):
                    raise fail(f"layers[{L}].{o} holds {e!r}, not an integer expert id")
                if not 0 <= e < n_expert:
                    raise fail(f"layers[{L}].{o} holds expert {e}, outside 0..{n_expert - 1}")
                if e in seen:
                    raise fail(f"layer {L}: expert {e} placed twice ({seen[e]} and {o})")
                seen[e] = o
            if any(a >= b for a, b in zip(ids, ids[1:])):
                raise fail(f"layers[{L}].{o} is not in ascending order")
            per.append(tuple(int(e) for e in ids))
        if len(seen) != n_expert:
            gap = [e for e in range(n_expert) if e not in seen][:8]
            raise fail(f"layer {L}: {n_expert - len(seen)} experts placed nowhere (e.g. {gap}); "
                       f"list them under 'none' if they are held outside this process")
        experts.append(tuple(per[:-1]))
        none.append(per[-1])
    ranks = _ranks_from(obj["ranks"], n_layer, n_expert, fail)
    if ranks is not None and any(any(x) for x in experts):
        raise fail("a rank placement holds no experts on local owners (every expert is 'none'; use for_rank)")
    art = obj["artifact"]
    if art is not None and (not isinstance(art, str) or not 1 <= len(art) <= 256 or not art.isprintable()):
        raise fail(f"artifact must be null or a fingerprint string of 1..256 printable characters, got {art!r}")
    p = Placement(n_layer, n_expert, n_used, tuple(owners), tuple(experts), tuple(none), ranks, art)
    if stored_hash is not None and stored_hash != p.content_sha256:
        raise IntegrityError(f"content_sha256 {stored_hash[:16]}... does not match the content "
                             f"({p.content_sha256[:16]}...); the file was edited or damaged",
                             where=where, hint="re-run ds4quant place")
    return p


def _ranks_from(r: Any, n_layer: int, n_expert: int, fail) -> Optional[RankPlacement]:
    if r is None:
        return None
    if not isinstance(r, dict) or set(r) != {"n_ranks", "strategy", "replicate_hot", "owner"}:
        raise fail("ranks must be null or an object {n_ranks, strategy, replicate_hot, owner}")
    n, k, strat = r["n_ranks"], r["replicate_hot"], r["strategy"]
    if not _is_int(n) or not 1 <= n <= MAX_RANKS:
        raise fail(f"ranks.n_ranks must be an integer in 1..{MAX_RANKS}, got {n!r}")
    if not _is_int(k) or not 0 <= k <= n_expert:
        raise fail(f"ranks.replicate_hot must be an integer in 0..{n_expert}, got {k!r}")
    if strat not in STRATEGIES:
        raise fail(f"ranks.strategy must be one of {list(STRATEGIES)}, got {strat!r}")
    own = r["owner"]
    if not isinstance(own, list) or len(own) != n_layer:
        raise fail(f"ranks.owner must be a list of n_layer={n_layer} rows")
    rows = []
    for L, row in enumerate(own):
        if not isinstance(row, list) or len(row) != n_expert:
            raise fail(f"ranks.owner[{L}] must be a list of n_expert={n_expert} ranks")
        for e, v in enumerate(row):
            if not _is_int(v) or not (v == REPLICATED or 0 <= v < n):
                raise fail(f"ranks.owner[{L}][{e}] = {v!r} is not a rank in 0..{n - 1} or -1 (replicated)")
        if sum(1 for v in row if v == REPLICATED) != k:
            raise fail(f"ranks.owner[{L}] has {sum(1 for v in row if v == REPLICATED)} replicated experts, "
                       f"replicate_hot says {k}")
        rows.append(tuple(int(v) for v in row))
    return RankPlacement(int(n), strat, int(k), tuple(rows))


# --------------------------------------------------------------------------
# files


def placement_from_json(obj: Any, where: str = "placement") -> Placement:
    """Build from a decoded JSON object; ``content_sha256`` is required and checked."""
    if isinstance(obj, dict):
        h = obj.get("content_sha256")
        if not isinstance(h, str) or not _HEX64.fullmatch(h):
            raise CorruptDataError(f"content_sha256 must be 64 lowercase hex digits, got {h!r}"[:200], where=where)
        content = {k: v for k, v in obj.items() if k != "content_sha256"}
        return _from_content(content, where, stored_hash=h)
    return _from_content(obj, where)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def read_placement(path: "str | os.PathLike[str]") -> Placement:
    """Read and validate a placement file (see the module doc); any defect is a
    one-line Ds4quantError naming the file."""
    p = Path(path)
    where = str(p)
    try:
        size = p.stat().st_size
        if size > MAX_FILE_BYTES:
            raise CorruptDataError(f"{size} bytes, more than a placement can be ({MAX_FILE_BYTES})", where=where)
        raw = p.read_bytes()
    except OSError as e:
        raise BadInputError(f"cannot read placement: {e.strerror}", where=where) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptDataError(f"byte {e.start} is not UTF-8 text; not a placement file", where=where) from None
    try:
        # parse_int bounds huge literals before Python builds them (int() of a
        # 10^6-digit string is slow and past any valid value anyway).
        obj = json.loads(text, parse_constant=_refuse_constant, parse_int=_bounded_int)
    except ValueError as e:
        raise CorruptDataError(f"not valid JSON: {e}", where=where) from None
    except RecursionError:
        raise CorruptDataError("JSON nested too deeply", where=where) from None
    return placement_from_json(obj, where)


def _bounded_int(s: str) -> int:
    if len(s.lstrip("-")) > 20:
        raise ValueError(f"integer literal of {len(s)} digits is out of range")
    return int(s)


def write_placement(path: "str | os.PathLike[str]", p: Placement) -> Path:
    """Write ``p`` as canonical JSON with its content hash, atomically."""
    if not isinstance(p, Placement):
        raise BadInputError(f"expected a Placement, got {type(p).__name__}")
    try:
        return atomic_write_bytes(path, json_bytes(p.to_json()))
    except OSError as e:  # a full disk, a read-only folder: the atomic write left nothing behind
        raise OutputError(f"cannot write the placement ({e.strerror or e}); nothing was written",
                          where=str(e.filename or path)) from None


def as_placement(placement: Any, view) -> Placement:
    """The one door from what a caller names to the Placement run on the artifact
    ``view``: None (every expert on one CPU owner, ``cpu:0``), a placement file
    (``read_placement``), a mapping (``Placement.from_mapping``) or a Placement.
    A file or Placement planned for another shape, or for another artifact when
    both fingerprints are known, is refused in one line naming it."""
    h = view.header
    used = h.n_expert_used or 1
    if placement is None:
        return placement_for_one_owner(h.n_layer, h.n_expert, "cpu:0", used)
    if isinstance(placement, Mapping):
        return Placement.from_mapping(placement, h.n_layer, h.n_expert, used)
    if isinstance(placement, (str, os.PathLike)):
        plc, where = read_placement(placement), str(placement)
    elif isinstance(placement, Placement):
        plc, where = placement, "placement"
    else:
        raise BadInputError(f"placement must be None, a path, a mapping or a Placement, got {type(placement).__name__}")
    check_fits(plc, view, where)
    return plc


def check_fits(plc: Placement, view, where: Optional[str] = None) -> None:
    """The one check that a placement fits the artifact ``view``, shared by
    ``runtime.load`` and ``ds4quant place --check``: the artifact's layers x
    experts (its deepseek4 keys, else its stacks) and, when the placement
    records one, its fingerprint. One line naming ``where``."""
    nb = view.expert_nbytes()
    plc.check_matches(int(nb.shape[0]), int(nb.shape[1]), view.fingerprint(), where=where)


def placement_for_one_owner(n_layer: int, n_expert: int, owner: str = "cpu", n_expert_used: int = 1,
                            artifact: Optional[str] = None) -> Placement:
    """Every expert of every layer on ``owner`` (the default of ``runtime.load``)."""
    OwnerName.parse(owner)
    return Placement.build(n_layer, n_expert, n_expert_used, [owner],
                           [[list(range(n_expert))] for _ in range(n_layer)], artifact=artifact)
