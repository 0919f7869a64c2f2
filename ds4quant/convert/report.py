"""What a conversion produced: per-tensor results and the ConvertReport."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

import numpy as np

from ds4quant.plan import PlanSummary, TensorChoice


@dataclass(frozen=True)
class TensorResult:
    """Per output tensor: bytes written and float64 error sums.

    sse/ssx: sum of squared error and of squared source values; wsse/wssx
    the same weighted by importance (None without an imatrix entry).
    """

    name: str
    qtype: str
    nbytes: int
    sha256: str
    n_weights: int
    sse: float
    ssx: float
    wsse: Optional[float] = None
    wssx: Optional[float] = None
    seconds: float = 0.0
    reused: bool = False

    @property
    def rel_mse(self) -> float:
        return self.sse / self.ssx if self.ssx > 0 else 0.0

    @property
    def sqnr_db(self) -> float:
        if self.sse <= 0:
            return float("inf")
        return 10.0 * float(np.log10(self.ssx / self.sse)) if self.ssx > 0 else float("-inf")

    def errors_json(self) -> dict:
        d = {"rel_mse": self.rel_mse, "sqnr_db": self.sqnr_db, "sse": self.sse, "ssx": self.ssx}
        if self.wsse is not None:
            d["weighted_sse"] = self.wsse
            d["weighted_ssx"] = self.wssx
        # the manifest holds finite numbers only: a lossless tensor has no SQNR
        return {k: v for k, v in d.items() if not (isinstance(v, float) and not np.isfinite(v))}

    def to_journal(self) -> dict:
        return {
            "name": self.name, "qtype": self.qtype, "bytes": self.nbytes, "sha256": self.sha256,
            "n_weights": self.n_weights, "sse": self.sse, "ssx": self.ssx, "wsse": self.wsse,
            "wssx": self.wssx, "seconds": self.seconds,
        }

    @classmethod
    def from_journal(cls, d: dict) -> "TensorResult":
        return cls(d["name"], d["qtype"], d["bytes"], d["sha256"], d["n_weights"], d["sse"], d["ssx"],
                   d.get("wsse"), d.get("wssx"), d.get("seconds", 0.0), reused=True)


@dataclass(frozen=True)
class ConvertReport:
    """What a conversion produced. ``to_json`` is the ``--json`` output."""

    artifact: Path
    files: tuple[Path, ...]
    bytes: int
    plan: tuple[TensorChoice, ...]
    results: tuple[TensorResult, ...]
    expert_bytes: int
    expert_weights: int
    codebook_bytes: int
    seconds: float
    recipe: dict
    source_fingerprint: str
    runtimes: tuple[str, ...]
    reused: int = 0
    adaptive: Optional[PlanSummary] = None
    # (file name, padded tensor bytes, its one tensor) of every split over --split-max-size:
    # a tensor larger than the limit gets a split of its own, as llama.cpp's gguf-split does
    oversize_splits: tuple[tuple[str, int, str], ...] = ()
    # engine -> why it cannot load the artifact (artifact.runtimes.decide); empty when not decided here
    runtimes_excluded: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def bpw_experts(self) -> float:
        return 8.0 * self.expert_bytes / self.expert_weights if self.expert_weights else 0.0

    def expert_error(self, weighted: bool = False) -> tuple[float, float]:
        """(sum of errors, sum of source energy) over routed experts."""
        kinds = {c.name: c.tensor_class for c in self.plan}
        e = s = 0.0
        for r in self.results:
            if kinds[r.name] != "routed_expert":
                continue
            if weighted:
                if r.wsse is not None:
                    e, s = e + r.wsse, s + r.wssx
            else:
                e, s = e + r.sse, s + r.ssx
        return e, s

    def to_json(self) -> dict:
        e, s = self.expert_error()
        we, ws = self.expert_error(weighted=True)
        return {
            "artifact": str(self.artifact),
            "files": [str(p) for p in self.files],
            "bytes": self.bytes,
            "tensors": len(self.plan),
            "bpw_experts": self.bpw_experts,
            "bpw_experts_with_codebooks": (8.0 * (self.expert_bytes + self.codebook_bytes) / self.expert_weights
                                           if self.expert_weights else 0.0),
            "expert_bytes": self.expert_bytes,
            "expert_weights": self.expert_weights,
            "codebook_bytes": self.codebook_bytes,
            "expert_sqnr_db": (10 * float(np.log10(s / e)) if e > 0 and s > 0 else None),
            "expert_weighted_error": we if ws else None,
            "expert_weighted_sqnr_db": (10 * float(np.log10(ws / we)) if we > 0 and ws > 0 else None),
            "seconds": self.seconds,
            "reused_tensors": self.reused,
            "runtimes": list(self.runtimes),
            "runtimes_excluded": {k: list(v) for k, v in self.runtimes_excluded.items()},
            "recipe": self.recipe,
            "adaptive": None if self.adaptive is None else self.adaptive.to_json(),
            "source_fingerprint": self.source_fingerprint,
            "plan": [c.to_json() for c in self.plan],
            "oversize_splits": [{"file": f, "bytes": b, "tensor": t} for f, b, t in self.oversize_splits],
        }


def build_report(out: Path, files, plan, results, cb_bytes: int, rec, source_fp: str, runtimes, adaptive_info,
                 t_start: float, oversize=(), excluded=None) -> ConvertReport:
    """The ConvertReport of a finished run (a fresh one, or one ``--resume`` recognised);
    ``seconds`` counts from ``t_start`` (``time.perf_counter``)."""
    expert_bytes = sum(r.nbytes for r, c in zip(results, plan) if c.tensor_class == "routed_expert")
    expert_weights = sum(int(np.prod(c.shape)) for c in plan if c.tensor_class == "routed_expert")
    return ConvertReport(
        artifact=out,
        files=tuple(files),
        bytes=sum(p.stat().st_size for p in files),
        plan=tuple(plan),
        results=tuple(results),
        expert_bytes=expert_bytes,
        expert_weights=expert_weights,
        codebook_bytes=cb_bytes,
        seconds=time.perf_counter() - t_start,
        recipe=rec.to_json(),
        source_fingerprint=source_fp,
        runtimes=runtimes,
        reused=sum(1 for r in results if r.reused),
        adaptive=adaptive_info,
        oversize_splits=tuple(oversize),
        runtimes_excluded=dict(excluded or {}),
    )
