"""The records ``verify`` returns and the report writer and ``publish`` read.

They live below verify (they import only ``names`` and ``metrics``), so
``report.py`` and ``publish.py`` read them without importing verify's stages,
and verify never imports the report writer.

    rep = verify("out/tiny-strix")          # a VerifyReport
    rep.ok, rep.failed, rep.summary, rep.runtimes
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Optional, Sequence

from ds4quant.metrics import ErrorFigures, finite_or_none
from ds4quant.names import EXPERT_GROUPS, GROUPS, MANIFEST_NAME

MANIFEST = MANIFEST_NAME
# Groups ("surfaces") a tensor is summed under in per-layer tables and plots (names.Group values).
SURFACES: tuple[str, ...] = tuple(g.value for g in GROUPS)
EXPERT_SURFACES: tuple[str, ...] = tuple(g.value for g in EXPERT_GROUPS)


@dataclass(frozen=True)
class Check:
    """One check result. A failing check names its file and/or tensor."""

    name: str
    ok: bool
    detail: str
    file: Optional[str] = None
    tensor: Optional[str] = None

    def to_json(self) -> dict:
        return {"name": self.name, "ok": self.ok, "detail": self.detail, "file": self.file, "tensor": self.tensor}

    def one_line(self) -> str:
        where = ": ".join(w for w in (self.file, self.tensor) if w)
        return f"{self.name}: {where + ': ' if where else ''}{self.detail}"


@dataclass(frozen=True)
class TensorRecord:
    """One GGUF tensor as verify saw it (shape in GGUF order)."""

    name: str
    qtype: str
    variant: str
    ggml_type: int
    shape: tuple[int, ...]
    bytes: int
    file: str
    layer: Optional[int]
    surface: str
    expert_ids: Optional[tuple[int, ...]] = None
    errors: Optional[ErrorFigures] = None
    floor_db: Optional[float] = None
    flagged: bool = False

    @property
    def n_weights(self) -> int:
        return math.prod(self.shape)

    @property
    def bpw(self) -> float:
        return 8.0 * self.bytes / self.n_weights

    @property
    def is_expert(self) -> bool:
        return self.surface in EXPERT_SURFACES

    def to_json(self) -> dict:
        d = {"name": self.name, "qtype": self.qtype, "variant": self.variant, "ggml_type": self.ggml_type,
             "shape": list(self.shape), "bytes": self.bytes, "bpw": self.bpw, "file": self.file,
             "layer": self.layer, "surface": self.surface,
             "expert_ids": None if self.expert_ids is None else list(self.expert_ids),
             "errors": None if self.errors is None else self.errors.to_json(),
             "floor_db": self.floor_db, "flagged": self.flagged}
        if self.errors is not None and self.errors.expert_sqnr_db:
            finite = [(v, i) for i, v in enumerate(self.errors.expert_sqnr_db) if math.isfinite(v)]
            if finite:
                v, i = min(finite)
                gid = self.expert_ids[i] if self.expert_ids is not None else i
                d["worst_expert"] = {"expert": gid, "sqnr_db": v}
        return d


@dataclass(frozen=True)
class GroupRecord:
    """Totals of one (layer, surface); layer None holds the global tensors."""

    layer: Optional[int]
    surface: str
    n_tensors: int
    bytes: int
    n_weights: int
    qtypes: Mapping[str, int]  # qtype -> weights stored in it
    errors: Optional[ErrorFigures]

    @property
    def bpw(self) -> float:
        return 8.0 * self.bytes / self.n_weights if self.n_weights else 0.0

    def to_json(self) -> dict:
        return {"layer": self.layer, "surface": self.surface, "tensors": self.n_tensors, "bytes": self.bytes,
                "weights": self.n_weights, "bpw": self.bpw, "qtypes": dict(self.qtypes),
                "errors": None if self.errors is None else self.errors.to_json()}


def group_records(records: Sequence[TensorRecord]) -> tuple[GroupRecord, ...]:
    """Per (layer, surface) totals, global tensors last; errors only where every member has figures."""
    acc: dict[tuple, dict] = {}
    for t in records:
        key = (t.layer, t.surface)
        d = acc.setdefault(key, {"n": 0, "bytes": 0, "weights": 0, "qtypes": {}, "errors": None, "complete": True})
        d["n"] += 1
        d["bytes"] += t.bytes
        d["weights"] += t.n_weights
        d["qtypes"][t.qtype] = d["qtypes"].get(t.qtype, 0) + t.n_weights
        if t.errors is None:
            d["complete"] = False
        else:
            d["errors"] = t.errors if d["errors"] is None else d["errors"].plus(t.errors)
    order = {s: i for i, s in enumerate(SURFACES)}
    out = []
    for (layer, surface), d in sorted(acc.items(), key=lambda kv: (kv[0][0] is None, kv[0][0] or 0,
                                                                    order[kv[0][1]])):
        errs = d["errors"] if d["complete"] else None
        out.append(GroupRecord(layer, surface, d["n"], d["bytes"], d["weights"],
                               MappingProxyType(dict(sorted(d["qtypes"].items()))), errs))
    return tuple(out)


@dataclass(frozen=True)
class VerifyReport:
    """What verify found. ``ok`` is True when every check passed.

    kind: "artifact", "release" or "gguf"; files: the GGUF set, then the
    loose sidecars; numbers_from: "source", "manifest" or None.
    runtimes: which runtimes can load it, from its contents (``ArtifactView.runtimes``);
    stored_runtimes: what its ``ds4quant.runtimes`` key says (None without the key).
    fidelity: what the fidelity stage recorded ({"requested": False, ...} until the runtime measures it).
    """

    artifact: Path
    kind: str
    files: tuple[Path, ...]
    checks: tuple[Check, ...]
    tensors: tuple[TensorRecord, ...]
    groups: tuple[GroupRecord, ...]
    numbers_from: Optional[str]
    manifest: Optional[Any] = None  # ds4quant.artifact.Manifest
    kv: Mapping[str, Any] = field(default_factory=dict)  # GGUF KVs (plain values, blobs summarized)
    source_fingerprint: Optional[str] = None
    codebook_tables: tuple[str, ...] = ()
    lucebox_mix: bool = False  # every resident MIX tensor has valid books in the Lucebox blobs
    runtimes: tuple[str, ...] = ()
    stored_runtimes: Optional[tuple[str, ...]] = None
    fidelity: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({"requested": False}))
    seconds: float = 0.0
    runtimes_excluded: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # engine -> why not

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failed(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.ok)

    def expert_errors(self) -> Optional[ErrorFigures]:
        tot = None
        for t in self.tensors:
            if t.is_expert:
                if t.errors is None:
                    return None
                tot = t.errors if tot is None else tot.plus(t.errors)
        return tot

    @property
    def summary(self) -> dict:
        ex = [t for t in self.tensors if t.is_expert]
        ew = sum(t.n_weights for t in ex)
        eb = sum(t.bytes for t in ex)
        tw = sum(t.n_weights for t in self.tensors)
        tb = sum(t.bytes for t in self.tensors)
        ee = self.expert_errors()
        measured = [t.errors for t in self.tensors if t.errors is not None]
        cos = [c for c in (e.cosine for e in measured) if c is not None]
        mx = [m for m in (e.max_abs for e in measured) if m is not None]
        return {
            "artifact": str(self.artifact),
            "kind": self.kind,
            "ok": self.ok,
            "n_checks": len(self.checks),
            "n_failed": len(self.failed),
            "failed": sorted({c.name for c in self.failed}),
            "files": [p.name for p in self.files],
            "file_bytes": sum(p.stat().st_size for p in self.files if p.exists()),
            "n_tensors": len(self.tensors),
            "tensor_bytes": tb,
            "bpw": 8.0 * tb / tw if tw else None,
            "expert_bytes": eb,
            "expert_weights": ew,
            "bpw_experts": 8.0 * eb / ew if ew else None,
            "numbers_from": self.numbers_from,
            "source_fingerprint": self.source_fingerprint,
            "expert_sqnr_db": None if ee is None else finite_or_none(ee.sqnr_db),
            "expert_rel_mse": None if ee is None else finite_or_none(ee.rel_mse),
            "expert_weighted_rel_error": None if ee is None else finite_or_none(ee.weighted_rel_error),
            "max_abs_error": max(mx) if mx else None,
            "min_cosine": min(cos) if cos else None,
            "flagged": [t.name for t in self.tensors if t.flagged],
            "codebook_tables": list(self.codebook_tables),
            "runtimes": list(self.runtimes),
            "runtimes_excluded": {k: list(v) for k, v in self.runtimes_excluded.items()},
            "groups": [g.to_json() for g in self.groups],
        }

    def to_json(self) -> dict:
        """The ``--json`` object: ok, checks, tensors, summary (no timings: same input, same JSON)."""
        out = {"ok": self.ok, "checks": [c.to_json() for c in self.checks],
               "tensors": [t.to_json() for t in self.tensors], "summary": self.summary}
        if self.fidelity.get("measured"):
            # seconds are left out: same input, same JSON
            out["fidelity"] = {k: v for k, v in self.fidelity.items() if k != "seconds"}
        return out
