"""`ds4quant inspect`: what an artifact (or any GGUF) holds, per tensor.

Works on an artifact folder (its GGUF set, manifest and codebook tables), on
one ``.gguf`` of a split set, or on a plain GGUF from another tool.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ds4quant.errors import BadInputError

EXPERT_SURFACES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# KVs that carry out-of-band codebooks (spec rocmfpx-codecs.md §11) and ours.
CODEBOOK_KVS = ("deepseek4.gumix.sidecar", "deepseek4.p4mix.sidecar", "deepseek4.dmix.sidecar",
                "ds4quant.codebooks")
CODEBOOK_FILES = (".gumix.bin", ".p4mix.bin", ".dmix.bin")


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
        return any(f".{s}." in f".{self.name}" for s in EXPERT_SURFACES) or self.name.split(".")[-2] in EXPERT_SURFACES

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
            "runtimes": self.kv.get("ds4quant.runtimes"),
            "tensors": [t.to_json() for t in self.tensors],
        }


def _find_gguf(path: Path) -> tuple[Path, Optional[Path]]:
    """(first gguf of the artifact, manifest path or None)."""
    if path.is_dir():
        ggufs = sorted(p for p in path.iterdir() if p.suffix == ".gguf" and p.is_file())
        if not ggufs:
            raise BadInputError("no .gguf file in the folder", where=str(path))
        stems = {_split_stem(p) for p in ggufs}
        if len(stems) > 1:
            raise BadInputError(f"several GGUF artifacts in one folder: {sorted(stems)}", where=str(path),
                                hint="pass one .gguf file")
        man = path / "manifest.json"
        return ggufs[0], (man if man.is_file() else None)
    if not path.exists():
        raise BadInputError("no such file or folder", where=str(path))
    man = path.parent / "manifest.json"
    return path, (man if man.is_file() else None)


def _split_stem(p: Path) -> str:
    from ds4quant.artifact.gguf_writer import SPLIT_NAME

    m = SPLIT_NAME.match(p.name)
    return m.group("stem") if m else p.stem


def inspect_artifact(path: "str | os.PathLike", *, variant_107: Optional[str] = None) -> Inspection:
    """Read an artifact folder or a .gguf and describe every tensor."""
    from ds4quant.artifact import read_gguf_set, read_manifest

    p = Path(path)
    first, man_path = _find_gguf(p)
    g = read_gguf_set(first, variant_107=variant_107)
    plan = _plan(g)
    rows = []
    for name, info in g.tensors.items():
        n = 1
        for d in info.shape:
            n *= d
        p = plan.get(name, {})
        ids = p.get("experts")
        rows.append(TensorRow(name, info.qtype, info.ggml_type, info.variant, tuple(info.shape), info.nbytes, n,
                              Path(info.path).name, p.get("rule"), p.get("predicted_error"),
                              tuple(ids) if ids is not None else None))
    tables = [k for k in CODEBOOK_KVS if k in g.kv]
    for f in g.files:
        for suffix in CODEBOOK_FILES:
            side = f.with_name(f.name + suffix)
            if side.is_file():
                tables.append(side.name)
    manifest = None
    if man_path is not None:
        manifest = read_manifest(man_path).to_json()
    kv = {k: _kv_summary(v) for k, v in g.kv.items()
          if not k.startswith(("ds4quant.qtype.", "ds4quant.expert_ids.")) and k != "ds4quant.plan"}
    if "ds4quant.runtimes" in g.kv:
        kv["ds4quant.runtimes"] = [str(x) for x in g.kv["ds4quant.runtimes"].value]
    return Inspection(p, tuple(g.files), tuple(rows), tuple(tables), manifest, kv, tuple(g.notes))


def _plan(g) -> dict:
    """The plan convert stored in the GGUF (KV ds4quant.plan), by tensor name."""
    kv = g.kv.get("ds4quant.plan")
    if kv is None:
        return {}
    try:
        rows = json.loads(str(kv.value))
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
