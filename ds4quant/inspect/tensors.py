"""`ds4quant inspect`: what an artifact (or any GGUF) holds, per tensor.

Works on an artifact folder (its GGUF set, manifest and codebook tables), on
one ``.gguf`` of a split set, or on a plain GGUF from another tool.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

from ds4quant import names

# the order inspect lists codebook tables in: embedded KVs, then loose files per GGUF file
_KV_ORDER = tuple(names.sidecar_key(k) for k in ("gumix", "p4mix", "dmix")) + (names.KEY_CODEBOOKS,)
_FILE_ORDER = tuple(names.sidecar_suffix(k) for k in ("gumix", "p4mix", "dmix"))


@dataclass(frozen=True)
class TensorRow:
    name: str
    qtype: str
    ggml_type: int
    variant: str
    shape: tuple[int, ...]
    bytes: int
    n_weights: int
    file: str
    rule: Optional[str] = None  # from the plan stored in the artifact
    predicted_error: Optional[float] = None
    experts: Optional[tuple[int, ...]] = None  # global ids of a compact stack

    @property
    def bpw(self) -> float:
        return 8.0 * self.bytes / self.n_weights if self.n_weights else 0.0

    @property
    def is_expert(self) -> bool:
        return names.parse_stack(self.name) is not None

    def to_json(self) -> dict:
        d = {"name": self.name, "qtype": self.qtype, "ggml_type": self.ggml_type, "variant": self.variant,
             "shape": list(self.shape), "bytes": self.bytes, "bpw": self.bpw, "file": self.file}
        if self.rule is not None:
            d["rule"] = self.rule
        if self.predicted_error is not None:
            d["predicted_error"] = self.predicted_error
        if self.experts is not None:
            d["experts"] = list(self.experts)
        return d


@dataclass(frozen=True)
class Inspection:
    path: Path
    files: tuple[Path, ...]
    tensors: tuple[TensorRow, ...]
    codebook_tables: tuple[str, ...]
    manifest: Optional[dict]
    kv: dict
    notes: tuple[str, ...]
    runtimes: tuple[str, ...] = ()  # from the contents (ArtifactView.runtimes)
    stored_runtimes: Optional[tuple[str, ...]] = None  # the ds4quant.runtimes key
    runtimes_excluded: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # engine -> why not

    @property
    def total_bytes(self) -> int:
        return sum(t.bytes for t in self.tensors)

    @property
    def file_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files)

    @property
    def bpw_experts(self) -> Optional[float]:
        ex = [t for t in self.tensors if t.is_expert]
        n = sum(t.n_weights for t in ex)
        return 8.0 * sum(t.bytes for t in ex) / n if n else None

    def qtype_totals(self) -> dict:
        out: dict[str, dict] = {}
        for t in self.tensors:
            d = out.setdefault(t.qtype, {"tensors": 0, "bytes": 0, "weights": 0})
            d["tensors"] += 1
            d["bytes"] += t.bytes
            d["weights"] += t.n_weights
        return out

    def to_json(self) -> dict:
        return {
            "path": str(self.path),
            "files": [str(p) for p in self.files],
            "file_bytes": self.file_bytes,
            "tensor_bytes": self.total_bytes,
            "n_tensors": len(self.tensors),
            "bpw_experts": self.bpw_experts,
            "qtypes": self.qtype_totals(),
            "codebook_tables": list(self.codebook_tables),
            "notes": list(self.notes),
            "recipe": _recipe_summary(self.manifest),
            "runtimes": list(self.runtimes),
            "runtime_needs": {r: _needs(r) for r in self.runtimes},
            "stored_runtimes": None if self.stored_runtimes is None else list(self.stored_runtimes),
            "runtimes_excluded": {k: list(v) for k, v in self.runtimes_excluded.items()},
            "tensors": [t.to_json() for t in self.tensors],
        }


def inspect_artifact(path: "str | os.PathLike", *, variant_107: Optional[str] = None) -> Inspection:
    """Read an artifact folder or a .gguf (through ``ArtifactView``) and describe every tensor."""
    from ds4quant.artifact import read_manifest
    from ds4quant.artifact.qtypes import row_rule_problem
    from ds4quant.artifact.view import open_artifact
    from ds4quant.errors import CorruptDataError

    p = Path(path)
    v = open_artifact(p, variant_107=variant_107)
    plan = _plan(v.kv)
    compact = {s.name: s.expert_ids for s in v.stacks if s.compact}
    rows = []
    bad = [(name, Path(info.path).name, why) for name, info in v.tensors.items()
           if (why := row_rule_problem(info.qtype, info.shape[0])) is not None]
    if bad:
        # its byte size cannot match what the codec decodes: verify fails the same rule ("shapes")
        name, f, why = bad[0]
        more = f" (and {len(bad) - 1} more tensor(s))" if len(bad) > 1 else ""
        raise CorruptDataError(f"tensor {name}: {why}{more}", where=f, hint="ds4quant verify lists every problem")
    for name, info in v.tensors.items():
        n = 1
        for d in info.shape:
            n *= d
        c = plan.get(name, {})
        rows.append(TensorRow(name, info.qtype, info.ggml_type, info.variant, tuple(info.shape), info.nbytes, n,
                              Path(info.path).name, c.get("rule"), c.get("predicted_error"), compact.get(name)))
    found = set(v.codebook_tables)
    tables = [k for k in _KV_ORDER if k in found or f"KV {k}" in found]
    tables += [side.name for f in v.gguf_paths for suffix in _FILE_ORDER
               if (side := f.with_name(f.name + suffix)) in v.sidecars]
    manifest = v.manifest
    sibling = p.parent / names.MANIFEST_NAME
    if manifest is None and v.kind == "gguf" and sibling.is_file():
        manifest = read_manifest(sibling)  # a .gguf inside an artifact folder
    kv = {k: _kv_summary(x) for k, x in v.kv.items()
          if not k.startswith((names.KEY_QTYPE_TAG_PREFIX, names.KEY_EXPERT_IDS_PREFIX)) and k != names.KEY_PLAN}
    if v.stored_runtimes is not None:
        kv[names.KEY_RUNTIMES] = list(v.stored_runtimes)
    return Inspection(p, tuple(v.gguf_paths), tuple(rows), tuple(tables),
                      manifest.to_json() if manifest is not None else None, kv, tuple(v.gguf.notes),
                      v.runtimes, v.stored_runtimes, dict(v.runtimes_excluded))


def _needs(runtime: str) -> str:
    from ds4quant.artifact.runtimes import needs

    return needs(runtime)


def _plan(kv: dict) -> dict:
    """The plan convert stored in the GGUF (KV ds4quant.plan), by tensor name: rule and predicted error."""
    x = kv.get(names.KEY_PLAN)
    if x is None:
        return {}
    try:
        rows = json.loads(str(x.value))
        return {r["name"]: r for r in rows if isinstance(r, dict) and "name" in r}
    except (ValueError, TypeError):
        return {}  # a foreign or damaged plan is informational only; verify checks integrity


def _recipe_summary(manifest: Optional[dict]) -> Optional[dict]:
    if not manifest:
        return None
    r = dict(manifest.get("recipe") or {})
    r.pop("plan", None)  # per tensor: already in "tensors"
    return r


def _kv_summary(kv) -> object:
    v = kv.value
    if hasattr(v, "tolist") and getattr(v, "ndim", 0) > 0:
        return f"[{len(v)} items]"
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, (list, tuple)):
        return f"[{len(v)} items]"
    if isinstance(v, (bytes, bytearray, memoryview)):
        return f"<{len(v)} bytes>"
    try:
        json.dumps(v)
        return v
    except TypeError:
        return str(v)
