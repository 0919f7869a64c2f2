"""The records ``verify`` returns and the report writer and ``publish`` read.

They live below verify (they import only ``errors``, ``names`` and ``metrics``), so
``publish/report.py`` and ``publish/release.py`` read them without importing verify's stages,
and verify never imports the report writer.

    rep = verify("out/tiny-strix")          # a VerifyReport
    rep.ok, rep.failed, rep.summary, rep.runtimes
    f = rep.fidelity                        # a FidelityReport (measured with fidelity=True)
    f.logits.kl_mean, f.layers[0].local, f.exact_copy, f.runs[0].response_sha256
    FidelityReport.from_json(f.to_json(seconds=True)) == f
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Optional, Sequence

from ds4quant.errors import CorruptDataError
from ds4quant.metrics import ErrorFigures, finite_or_none
from ds4quant import names
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


# --------------------------------------------------------------------------
# fidelity through the runtime (verify --fidelity)


_NUM = (int, float)
_WHERE = "fidelity record"


def _need(obj: Any, key: str, kind, where: str = _WHERE):
    """obj[key] of type ``kind`` (a type or a tuple; bool is never an int here) from a
    fidelity record's JSON, else a one-line CorruptDataError naming the key."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    v = obj.get(key) if isinstance(obj, Mapping) else None
    if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
        names_ = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise CorruptDataError(f"{key} is {v!r}, not {names_}"[:200], where=where)
    return v


@dataclass(frozen=True)
class MoeLayerError:
    """One MoE block's relative error of its output against the reference.

    local: the candidate block fed the reference's own block input (what this
    layer adds by itself); propagated: inside the candidate's own run."""

    layer: int
    local: float
    propagated: float

    def to_json(self) -> dict:
        return {"layer": self.layer, "moe_rel_error": self.local, "moe_rel_error_propagated": self.propagated}

    @classmethod
    def from_json(cls, obj: Any) -> "MoeLayerError":
        return cls(_need(obj, "layer", int), float(_need(obj, "moe_rel_error", _NUM)),
                   float(_need(obj, "moe_rel_error_propagated", _NUM)))


@dataclass(frozen=True)
class LogitFigures:
    """Candidate vs reference next-token distributions: KL(ref || cand) mean and
    p99 in nats, top-1 agreement (share), perplexity ratio (candidate / reference)."""

    kl_mean: float
    kl_p99: float
    top1: float
    ppl_ratio: float

    def to_json(self) -> dict:
        return {"kl_mean": self.kl_mean, "kl_p99": self.kl_p99, "top1": self.top1, "ppl_ratio": self.ppl_ratio}

    @classmethod
    def from_json(cls, obj: Any) -> "LogitFigures":
        return cls(*(float(_need(obj, k, _NUM)) for k in ("kl_mean", "kl_p99", "top1", "ppl_ratio")))


@dataclass(frozen=True)
class KlFigures:
    """The figures llama.cpp's perplexity tool reports with a KL base, defined as it
    defines them (``runtime/kl_figures.py``): KLD(ref || cand) mean, median, p99 and
    max in nats; same top-1 and RMS Δp as fractions; both perplexities (the ratio
    is derived). ``chunking`` says which tokens were scored."""

    tokens: int
    kld_mean: float
    kld_median: float
    kld_p99: float
    kld_max: float
    same_top1: float
    rms_dp: float
    ppl_ref: float
    ppl_cand: float
    chunking: str

    _FLOATS = ("kld_mean", "kld_median", "kld_p99", "kld_max", "same_top1", "rms_dp", "ppl_ref", "ppl_cand")

    @property
    def ppl_ratio(self) -> float:
        return self.ppl_cand / self.ppl_ref

    def to_json(self) -> dict:
        return {"tokens": self.tokens, **{k: getattr(self, k) for k in self._FLOATS}, "ppl_ratio": self.ppl_ratio,
                "chunking": self.chunking}

    @classmethod
    def from_json(cls, obj: Any) -> "KlFigures":
        return cls(_need(obj, "tokens", int), *(float(_need(obj, k, _NUM)) for k in cls._FLOATS),
                   _need(obj, "chunking", str))


@dataclass(frozen=True)
class ApproximationFigures:
    """The same artifact with a runtime's routing shortcut (``runtime/routing_approx.py``):
    what changed, and its figures against the reference, to set beside the
    unmodified ones (the report's own)."""

    description: str
    experts_per_token: Optional[int]
    dropped: int
    logits: LogitFigures
    kl: KlFigures
    copy_per60: Optional[float] = None
    copy_interval: Optional[tuple[float, float]] = None

    def to_json(self) -> dict:
        return {"description": self.description, "experts_per_token": self.experts_per_token,
                "dropped_experts": self.dropped, **self.logits.to_json(), "llama_cpp": self.kl.to_json(),
                "exact_copy_per_60": self.copy_per60,
                "exact_copy_interval_per_60": None if self.copy_interval is None else list(self.copy_interval)}

    @classmethod
    def from_json(cls, obj: Any) -> "ApproximationFigures":
        iv = obj.get("exact_copy_interval_per_60") if isinstance(obj, dict) else None
        pc = obj.get("exact_copy_per_60") if isinstance(obj, dict) else None
        return cls(_need(obj, "description", str), _need(obj, "experts_per_token", (int, type(None))),
                   _need(obj, "dropped_experts", int), LogitFigures.from_json(obj),
                   KlFigures.from_json(_need(obj, "llama_cpp", dict)), None if pc is None else float(pc),
                   None if iv is None else (float(iv[0]), float(iv[1])))


@dataclass(frozen=True)
class ExactCopyScore:
    """The exact-copy protocol on the candidate (passes of trials, the failed
    trials as the protocol reports them) beside the source's own passes."""

    passes: int
    trials: int
    failed: tuple[Mapping[str, Any], ...]
    task: str
    reference_passes: int
    # with several seeded identifier sets (``runtime/copy_sets.py``; the first is the
    # protocol's own, whose passes are ``passes``): per-set passes, the pooled score
    # per 60 trials and its interval, for the candidate and the source
    sets: tuple[int, ...] = ()
    reference_sets: tuple[int, ...] = ()
    per60: Optional[float] = None
    interval: Optional[tuple[float, float]] = None
    reference_per60: Optional[float] = None
    reference_interval: Optional[tuple[float, float]] = None
    interval_method: Optional[str] = None

    def to_json(self) -> dict:
        out = {"passes": self.passes, "trials": self.trials, "failed": [dict(f) for f in self.failed],
               "task": self.task, "reference_passes": self.reference_passes}
        if self.sets:
            out.update({"sets": list(self.sets), "reference_sets": list(self.reference_sets), "per_60": self.per60,
                        "interval_per_60": list(self.interval), "reference_per_60": self.reference_per60,
                        "reference_interval_per_60": list(self.reference_interval),
                        "interval_method": self.interval_method})
        return out

    @classmethod
    def from_json(cls, obj: Any) -> "ExactCopyScore":
        failed = _need(obj, "failed", list)
        base = (_need(obj, "passes", int), _need(obj, "trials", int),
                tuple(MappingProxyType(dict(f)) for f in failed), _need(obj, "task", str),
                _need(obj, "reference_passes", int))
        if "sets" not in obj:
            return cls(*base)
        pair = lambda k: tuple(float(x) for x in _need(obj, k, list))  # noqa: E731
        return cls(*base, tuple(int(x) for x in _need(obj, "sets", list)),
                   tuple(int(x) for x in _need(obj, "reference_sets", list)), float(_need(obj, "per_60", _NUM)),
                   pair("interval_per_60"), float(_need(obj, "reference_per_60", _NUM)),
                   pair("reference_interval_per_60"), _need(obj, "interval_method", str))


@dataclass(frozen=True)
class PlacementRun:
    """One placement the candidate ran on: its label, the sha256 over every layer's
    routed-experts output in call order, and the greedy response's sha256."""

    label: str
    moe_output_sha256: str
    response_sha256: str


@dataclass(frozen=True)
class EngineFigures:
    """The same figures for the artifact run by another engine (``verify --engine``):
    its next-token distributions against the reference, its greedy response and,
    with the protocol, its exact copies."""

    engine: str
    logits: LogitFigures
    response_token_ids: tuple[int, ...]
    response_sha256: str
    response_matches_reference: bool
    exact_copy: Optional[ExactCopyScore] = None
    seconds: float = 0.0

    def to_json(self, seconds: bool = False) -> dict:
        out = {"engine": self.engine, **self.logits.to_json(), "response_token_ids": list(self.response_token_ids),
               "response_sha256": self.response_sha256, "response_matches_reference": self.response_matches_reference,
               "exact_copy": None if self.exact_copy is None else self.exact_copy.to_json()}
        if seconds:
            out["seconds"] = self.seconds
        return out

    @classmethod
    def from_json(cls, obj: Any) -> "EngineFigures":
        ec = obj.get("exact_copy") if isinstance(obj, dict) else None
        return cls(_need(obj, "engine", str), LogitFigures.from_json(obj),
                   tuple(int(t) for t in _need(obj, "response_token_ids", list)), _need(obj, "response_sha256", str),
                   _need(obj, "response_matches_reference", bool), None if ec is None else ExactCopyScore.from_json(ec),
                   float(obj.get("seconds", 0.0)))


@dataclass(frozen=True)
class FidelityReport:
    """What verify's fidelity stage measured (``verify/fidelity.py`` says how).

    Unmeasured: ``requested``/``measured`` False and ``detail`` saying why.
    Measured: mode ("exact" or "fast"), the evaluation set (``eval``, its
    tokenizer, ``eval_tokens`` positions), ``runs`` (the first placement, and a
    second one compared with it), logit figures, per-layer MoE errors (first
    placement), the greedy response of the first placement, the reference's
    response hash, the exact-copy score when the protocol ran, and ``cluster``:
    the figures of every run on cluster ranks (the executor's ``stats()``).

    ``to_json()`` is the ``"fidelity"`` object of ``verify --json``.
    """

    requested: bool = False
    measured: bool = False
    detail: Optional[str] = None
    mode: Optional[str] = None
    tokenizer: Optional[str] = None
    eval: Optional[str] = None
    eval_tokens: int = 0
    runs: tuple[PlacementRun, ...] = ()
    logits: Optional[LogitFigures] = None
    layers: tuple[MoeLayerError, ...] = ()
    response_token_ids: tuple[int, ...] = ()
    reference_response_sha256: Optional[str] = None
    exact_copy: Optional[ExactCopyScore] = None
    cluster: tuple[Mapping[str, Any], ...] = ()
    seconds: float = 0.0
    engines: tuple[EngineFigures, ...] = ()
    kl: Optional[KlFigures] = None
    approximation: Optional[ApproximationFigures] = None

    @classmethod
    def not_measured(cls, detail: str, requested: bool = False) -> "FidelityReport":
        return cls(requested=requested, measured=False, detail=detail)

    # derived figures (what the JSON also spells out)
    @property
    def placements(self) -> tuple[str, ...]:
        return tuple(r.label for r in self.runs)

    @property
    def response_sha256(self) -> Optional[str]:
        return self.runs[0].response_sha256 if self.runs else None

    @property
    def response_matches_reference(self) -> bool:
        return bool(self.runs) and bool(self.runs[0].response_sha256) \
            and self.runs[0].response_sha256 == self.reference_response_sha256

    @property
    def moe_output_sha256(self) -> Optional[str]:
        """The first placement's routed-output hash in exact mode (fast mode's is not an identity)."""
        return self.runs[0].moe_output_sha256 if self.runs and self.mode == "exact" else None

    @property
    def second(self) -> Optional[PlacementRun]:
        return self.runs[1] if len(self.runs) > 1 else None

    @property
    def identical(self) -> Optional[bool]:
        """Whether the second placement gave the first's routed output and response (None without one)."""
        s = self.second
        if s is None:
            return None
        first = self.runs[0]
        return s.moe_output_sha256 == first.moe_output_sha256 and s.response_sha256 == first.response_sha256

    def to_json(self, seconds: bool = False) -> dict:
        """The ``verify --json`` object; ``seconds`` adds the stage's wall time (left out
        there: same input, same JSON)."""
        if not self.measured:
            return {"requested": self.requested, "measured": False, "detail": self.detail}
        first = self.runs[0]
        out = {"requested": self.requested, "measured": True, "mode": self.mode, "tokenizer": self.tokenizer,
               "eval": self.eval, "eval_tokens": self.eval_tokens, "placements": list(self.placements),
               **self.logits.to_json(), "layers": [r.to_json() for r in self.layers],
               "response_token_ids": list(self.response_token_ids), "response_sha256": first.response_sha256,
               "reference_response_sha256": self.reference_response_sha256,
               "response_matches_reference": self.response_matches_reference,
               "moe_output_sha256": self.moe_output_sha256,
               "fast_moe_output_sha256": first.moe_output_sha256 if self.mode == "fast" else None,
               "exact_copy": None if self.exact_copy is None else self.exact_copy.to_json()}
        if self.kl is not None:
            out["llama_cpp"] = self.kl.to_json()
        if self.approximation is not None:
            out["approximation"] = self.approximation.to_json()
        if self.engines:
            out["engines"] = {e.engine: e.to_json(seconds) for e in self.engines}
        if self.cluster:
            out["cluster"] = [dict(c) for c in self.cluster]
        s = self.second
        if s is not None:
            out["second_placement"] = {"moe_output_sha256": s.moe_output_sha256,
                                       "response_sha256": s.response_sha256, "identical": self.identical}
        if seconds:
            out["seconds"] = self.seconds
        return out

    @classmethod
    def from_json(cls, obj: Any) -> "FidelityReport":
        """The record ``to_json`` wrote (a refusal names the first bad field)."""
        if not _need(obj, "measured", bool):
            return cls(_need(obj, "requested", bool), False, _need(obj, "detail", (str, type(None))))
        mode = _need(obj, "mode", str)
        if mode not in ("exact", "fast"):
            raise CorruptDataError(f"mode is {mode!r}, not exact or fast", where=_WHERE)
        labels = [str(x) for x in _need(obj, "placements", list)]
        hashes = [(_need(obj, "moe_output_sha256" if mode == "exact" else "fast_moe_output_sha256", str),
                   _need(obj, "response_sha256", str))]
        if "second_placement" in obj:
            sp = _need(obj, "second_placement", dict)
            hashes.append((_need(sp, "moe_output_sha256", str), _need(sp, "response_sha256", str)))
        if len(labels) != len(hashes):
            raise CorruptDataError(f"placements names {len(labels)} placements for {len(hashes)} runs", where=_WHERE)
        ec = obj.get("exact_copy")
        return cls(
            requested=_need(obj, "requested", bool), measured=True, mode=mode,
            tokenizer=_need(obj, "tokenizer", str), eval=_need(obj, "eval", str),
            eval_tokens=_need(obj, "eval_tokens", int),
            runs=tuple(PlacementRun(lab, moe, resp) for lab, (moe, resp) in zip(labels, hashes)),
            logits=LogitFigures.from_json(obj),
            layers=tuple(MoeLayerError.from_json(r) for r in _need(obj, "layers", list)),
            response_token_ids=tuple(int(t) for t in _need(obj, "response_token_ids", list)),
            reference_response_sha256=_need(obj, "reference_response_sha256", str),
            exact_copy=None if ec is None else ExactCopyScore.from_json(ec),
            cluster=tuple(MappingProxyType(dict(c)) for c in _need(obj, "cluster", list)) if "cluster" in obj else (),
            seconds=float(obj.get("seconds", 0.0)),
            engines=tuple(EngineFigures.from_json(e) for e in _need(obj, "engines", dict).values())
            if "engines" in obj else (),
            kl=KlFigures.from_json(_need(obj, "llama_cpp", dict)) if "llama_cpp" in obj else None,
            approximation=ApproximationFigures.from_json(_need(obj, "approximation", dict))
            if "approximation" in obj else None)


@dataclass(frozen=True)
class VerifyReport:
    """What verify found. ``ok`` is True when every check passed.

    kind: "artifact", "release" or "gguf"; files: the GGUF set, then the
    loose sidecars; numbers_from: "source", "manifest" or None.
    runtimes: which runtimes can load it, from its contents (``ArtifactView.runtimes``);
    stored_runtimes: what its ``ds4quant.runtimes`` key says (None without the key).
    fidelity: what the fidelity stage recorded (a ``FidelityReport``; ``measured`` once the runtime ran).
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
    fidelity: FidelityReport = field(default_factory=FidelityReport)
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

    def unreached(self) -> Optional[dict]:
        """The experts the importance matrix never reached (verify ``imatrix=``), or None when
        it reached every one: their count (layer x expert pairs, and tensor x expert pairs),
        the weights they hold, their unweighted error (the weighted figure leaves them out),
        and the first few by name."""
        from ds4quant.metrics import sqnr_db

        pairs, rows, sse, ssx, n = set(), [], 0.0, 0.0, 0
        for t in self.tensors:
            e = t.errors
            if not t.is_expert or e is None or not e.unreached:
                continue
            layer = names.layer_of(t.name)
            pairs |= {(layer, x) for x in e.unreached}
            rows += [f"{t.name} expert {x}" for x in e.unreached]
            sse, ssx = sse + e.unreached_sse, ssx + e.unreached_ssx
            n += len(e.unreached) * t.n_weights // max(1, t.shape[2] if len(t.shape) == 3 else 1)
        if not rows:
            return None
        return {"experts": len(pairs), "tensor_experts": len(rows), "weights": n,
                "rel_mse": finite_or_none(sse / ssx) if ssx else None, "sqnr_db": finite_or_none(sqnr_db(sse, ssx)),
                "first": rows[:5]}

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
            # only when an imatrix left experts out: the weighted figure covers the others
            **({"experts_unreached": un} if (un := self.unreached()) is not None else {}),
        }

    def to_json(self) -> dict:
        """The ``--json`` object: ok, checks, tensors, summary (no timings: same input, same JSON)."""
        out = {"ok": self.ok, "checks": [c.to_json() for c in self.checks],
               "tensors": [t.to_json() for t in self.tensors], "summary": self.summary}
        if self.fidelity.measured:
            out["fidelity"] = self.fidelity.to_json()  # without its seconds: same input, same JSON
        return out
