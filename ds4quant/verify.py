"""`ds4quant verify`: is an artifact sound, and how faithful is it to its source?

``verify(ARTIFACT)`` takes an artifact folder (GGUF set + ``manifest.json``), a
release folder (the same plus ``SHA256SUMS``, model card and report), or a
bare ``.gguf`` (structure checks only), and returns a ``VerifyReport``.

Two kinds of failure, kept apart on purpose:

- **unusable input** raises a ``Ds4quantError`` (the CLI exits 2): the path
  is missing, the GGUF set, ``manifest.json`` or ``SHA256SUMS`` cannot be
  parsed (truncated, malformed, wrong magic). Nothing can be checked then.
- **a failed check** is a ``Check`` with ``ok=False`` (the CLI exits 1): the
  containers parse, but something inside disagrees: a hash, a tag, a shape,
  codebook coverage, the DS4 keys, a tensor below its quality floor.
  Every offender is collected, each naming its file and/or tensor.

Structure checks: qtypes and tags known and consistent; row rules and DS4
expert-stack shapes; the ``deepseek4.*`` keys a runtime needs; compact expert
stacks (``blk.L.ffn_P_exps.<qtype>.weight`` + ``ds4quant.expert_ids.<name>``)
covering every expert of every layer exactly once; the codebook tables
(``ds4quant.codebooks``, and the Lucebox ``P4MIXv1`` / ``GUMIXs1`` /
``DMIXs1`` blobs, embedded or loose) valid, covering every resident MIX
tensor exactly once and agreeing with each other; per-tensor payload sha256
and per-file sha256 against ``manifest.json`` (payload and file hashes come
from one read of each file); ``SHA256SUMS`` when present.

Numbers (``source=``): every tensor is decoded (expert stacks one expert at a
time) and compared with the source's exactly dequantized values: relative
MSE, SQNR dB, importance-weighted error (``imatrix=``), max abs error, cosine,
finiteness; per tensor, per layer and surface. Tensors below their floor
(``QUALITY_FLOORS_DB`` per qtype, or ``threshold_db``) fail a check.

    rep = verify("out/tiny-strix", source="samples/ds4-tiny")
    rep.ok, rep.summary["expert_sqnr_db"]
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from ds4quant.errors import BadInputError, CodebookError, CorruptDataError, Ds4quantError

MANIFEST = "manifest.json"
KEY_CODEBOOKS = "ds4quant.codebooks"
KEY_EXPERT_IDS = "ds4quant.expert_ids."
LUCEBOX_KINDS = ("p4mix", "gumix", "dmix")
_CHUNK = 8 << 20
_DECODE_CHUNK_WEIGHTS = 4 << 20  # weights decoded per call (whole experts; at least one)
_SUM_CHUNK_WEIGHTS = 1 << 20  # weights per float64 comparison block

# Quality floors: the lowest SQNR (dB, decode vs source) a tensor of each
# qtype may have before verify calls it broken. They are guards against a
# wrong codec, variant or codebook (which land far below), not quality
# targets: measured values on the shipped heavy-tailed sample sit several dB
# above each floor (tests/test_verify.py checks the margin).
QUALITY_FLOORS_DB: Mapping[str, float] = MappingProxyType({
    "f32": 100.0,
    "f16": 50.0,
    "bf16": 40.0,
    "q8_0": 30.0,
    "rocmfp8": 28.0,
    "mxfp4": 12.0,
    "rocmfp6": 20.0,
    "rocmfp4": 12.0,
    "rocmfp4_fast": 12.0,
    "rocmfp3": 7.0,
    "rocmfp3_mix": 7.0,
    "rocmfp2": 4.0,
    "rocmfp2_mix": 4.0,
    "rocmfp2_affine": 4.0,
    "rocmfp2_s40": 3.0,
})

# Surfaces a tensor is grouped under in per-layer tables and plots.
SURFACES = ("gate_exps", "up_exps", "down_exps", "shexp", "attn", "other")
EXPERT_SURFACES = SURFACES[:3]
# blk.L.ffn_P_exps.weight (full stack) or blk.L.ffn_P_exps.<qtype>.weight (compact stack)
_STACK = re.compile(r"^blk\.(?P<layer>0|[1-9]\d*)\.ffn_(?P<proj>gate|up|down)_exps"
                    r"(?:\.(?P<qtype>[a-z0-9_]+))?\.weight$")
_LAYER = re.compile(r"^blk\.(0|[1-9]\d*)\.")


# ----------------------------------------------------------------------------
# records


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


def _finite(v: Optional[float]) -> Optional[float]:
    return v if v is not None and math.isfinite(v) else None


@dataclass(frozen=True)
class ErrorFigures:
    """Error of one tensor or group (float64 sums over every weight).

    origin: "source" (decoded and compared now) or "manifest" (convert-time
    figures; no max abs / cosine). sse/ssx: sum of squared error / of squared
    source values; ssy: of squared decoded values; dot: source . decoded;
    wsse/wssx: the same weighted by importance (None without an imatrix).
    expert_sqnr_db: per local expert of a stack (source origin only).
    """

    origin: str
    n: int
    sse: float
    ssx: float
    wsse: Optional[float] = None
    wssx: Optional[float] = None
    ssy: Optional[float] = None
    dot: Optional[float] = None
    max_abs: Optional[float] = None
    finite: bool = True
    expert_sqnr_db: tuple[float, ...] = ()

    @property
    def exact(self) -> bool:
        return self.finite and self.sse == 0.0 and (self.origin == "source" or self.ssx > 0)

    @property
    def rel_mse(self) -> Optional[float]:
        if not self.finite:
            return None
        return self.sse / self.ssx if self.ssx > 0 else (0.0 if self.sse == 0 else math.inf)

    @property
    def sqnr_db(self) -> Optional[float]:
        """inf when exact, None when undefined (non-finite decode)."""
        return _sqnr(self.sse, self.ssx) if self.finite else None

    @property
    def weighted_rel_error(self) -> Optional[float]:
        if self.wsse is None or not self.wssx:
            return None
        return self.wsse / self.wssx

    @property
    def cosine(self) -> Optional[float]:
        if self.dot is None or self.ssy is None or not self.finite:
            return None
        if self.ssx == 0 and self.ssy == 0:
            return 1.0
        if self.ssx == 0 or self.ssy == 0:
            return 0.0
        return self.dot / math.sqrt(self.ssx * self.ssy)

    def plus(self, o: "ErrorFigures") -> "ErrorFigures":
        def add(a, b):
            return None if a is None or b is None else a + b

        return ErrorFigures(
            self.origin if self.origin == o.origin else "mixed", self.n + o.n, self.sse + o.sse, self.ssx + o.ssx,
            add(self.wsse, o.wsse), add(self.wssx, o.wssx), add(self.ssy, o.ssy), add(self.dot, o.dot),
            None if self.max_abs is None or o.max_abs is None else max(self.max_abs, o.max_abs),
            self.finite and o.finite, self.expert_sqnr_db + o.expert_sqnr_db)

    def to_json(self) -> dict:
        sq = self.sqnr_db
        return {
            "origin": self.origin, "n": self.n, "exact": self.exact,
            "rel_mse": _finite(self.rel_mse), "sqnr_db": _finite(sq),
            "weighted_rel_error": _finite(self.weighted_rel_error),
            "max_abs_error": _finite(self.max_abs), "cosine": _finite(self.cosine), "finite": self.finite,
            "sse": _finite(self.sse), "ssx": _finite(self.ssx),
            "weighted_sse": _finite(self.wsse), "weighted_ssx": _finite(self.wssx),
        }


def _sqnr(sse: float, ssx: float) -> float:
    if not (math.isfinite(sse) and math.isfinite(ssx)):
        return math.nan
    if sse <= 0:
        return math.inf
    if ssx <= 0:
        return -math.inf
    return 10.0 * math.log10(ssx / sse)


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


@dataclass(frozen=True)
class VerifyReport:
    """What verify found. ``ok`` is True when every check passed.

    kind: "artifact", "release" or "gguf"; files: the GGUF set, then the
    loose sidecars; numbers_from: "source", "manifest" or None.
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
    report_path: Optional[Path] = None
    seconds: float = 0.0

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
            "expert_sqnr_db": None if ee is None else _finite(ee.sqnr_db),
            "expert_rel_mse": None if ee is None else _finite(ee.rel_mse),
            "expert_weighted_rel_error": None if ee is None else _finite(ee.weighted_rel_error),
            "max_abs_error": max(mx) if mx else None,
            "min_cosine": min(cos) if cos else None,
            "flagged": [t.name for t in self.tensors if t.flagged],
            "codebook_tables": list(self.codebook_tables),
            "groups": [g.to_json() for g in self.groups],
        }

    def to_json(self) -> dict:
        """The ``--json`` object: ok, checks, tensors, summary (no timings: same input, same JSON)."""
        return {"ok": self.ok, "checks": [c.to_json() for c in self.checks],
                "tensors": [t.to_json() for t in self.tensors], "summary": self.summary}


# ----------------------------------------------------------------------------
# naming


def surface_of(name: str) -> str:
    """The surface a GGUF tensor is grouped under (see ``SURFACES``)."""
    m = _STACK.match(name)
    if m:
        return f"{m.group('proj')}_exps"
    if not name.startswith("blk."):
        return "other"
    stem = name.split(".", 2)[2]
    if "_shexp" in stem:
        return "shexp"
    if stem.startswith(("attn_", "indexer")):
        return "attn"
    return "other"


def layer_of(name: str) -> Optional[int]:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def base_name(name: str) -> str:
    """``blk.L.ffn_P_exps.<qtype>.weight`` -> ``blk.L.ffn_P_exps.weight``; others unchanged."""
    m = _STACK.match(name)
    return f"blk.{m.group('layer')}.ffn_{m.group('proj')}_exps.weight" if m else name


# ----------------------------------------------------------------------------
# the run


class _Run:
    """Collects checks; ``fail`` once per offender, ``ok`` once per passing check."""

    def __init__(self) -> None:
        self.checks: list[Check] = []

    def ok(self, name: str, detail: str, file: Optional[str] = None) -> None:
        self.checks.append(Check(name, True, detail, file))

    def fail(self, name: str, detail: str, file: Optional[str] = None, tensor: Optional[str] = None) -> None:
        self.checks.append(Check(name, False, detail, file, tensor))

    def failed(self, name: str) -> bool:
        return any(c.name == name and not c.ok for c in self.checks)

    def passed_if_clean(self, name: str, detail: str, file: Optional[str] = None) -> None:
        if not self.failed(name):
            self.ok(name, detail, file)


@dataclass(frozen=True)
class _Layout:
    path: Path
    kind: str
    folder: Path
    gguf: Path
    manifest: Optional[Path]
    sums: Optional[Path]


@dataclass(frozen=True)
class _Stack:
    """A routed-expert stack tensor: full (experts 0..E-1) or compact (ids)."""

    name: str
    layer: int
    proj: str
    ids: tuple[int, ...]
    compact: bool


def _locate(path: "str | os.PathLike") -> _Layout:
    from ds4quant.checksums import SUMS_NAME
    from ds4quant.inspection import _find_gguf

    p = Path(path)
    first, man = _find_gguf(p)
    if not p.is_dir():
        return _Layout(p, "gguf", p.parent, first, None, None)
    if man is None:
        raise BadInputError(f"no {MANIFEST} in the folder", where=str(p),
                            hint="pass the .gguf file itself for structure checks only")
    sums = p / SUMS_NAME
    sums = sums if sums.is_file() else None
    return _Layout(p, "release" if sums else "artifact", p, first, man, sums)


def _rel(lay: _Layout, path: Path) -> str:
    try:
        return path.relative_to(lay.folder).as_posix()
    except ValueError:
        return path.name


def _hash_pass(gf) -> tuple[str, dict[str, str]]:
    """sha256 of one GGUF file and of every tensor payload in it, in one read."""
    spans = sorted((info.offset, info.offset + info.nbytes, name) for name, info in gf.tensors.items())
    fh = hashlib.sha256()
    th = {name: hashlib.sha256() for _, _, name in spans}
    pos = k = 0
    with open(gf.path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            view = memoryview(chunk)
            fh.update(view)
            end = pos + len(chunk)
            j = k
            while j < len(spans) and spans[j][0] < end:
                s, e, name = spans[j]
                if e > pos:
                    th[name].update(view[max(s, pos) - pos:min(e, end) - pos])
                j += 1
            while k < len(spans) and spans[k][1] <= end:
                k += 1
            pos = end
    if pos != gf.file_size:
        raise CorruptDataError(f"file changed while it was read ({gf.file_size} bytes, then {pos})",
                               where=str(gf.path), hint="verify it again")
    return fh.hexdigest(), {n: h.hexdigest() for n, h in th.items()}


def verify(
    artifact: "str | os.PathLike",
    *,
    source: "str | os.PathLike | None" = None,
    imatrix: "str | os.PathLike | None" = None,
    report_dir: "str | os.PathLike | None" = None,
    threshold_db: Optional[float] = None,
    variant_107: Optional[str] = None,
    progress: Optional[Callable[[dict], None]] = None,
) -> VerifyReport:
    """Check an artifact folder, release folder or bare GGUF (see module doc).

    source: the checkpoint folder it was made from (decode-vs-source numbers).
    imatrix: importance matrix for the weighted error (needs ``source``).
    report_dir: write report.md and PNG plots there (``ds4quant.report``).
    threshold_db: one SQNR floor for every lossy tensor instead of the table.
    Raises Ds4quantError for unusable input; a failed check is ``ok=False``.
    """
    from ds4quant.artifact import read_gguf_set, read_manifest
    from ds4quant.artifact.tags import check_variant_107

    t0 = time.perf_counter()
    check_variant_107(variant_107)
    if threshold_db is not None and (isinstance(threshold_db, bool) or not math.isfinite(float(threshold_db))):
        raise BadInputError(f"must be a finite number of dB, got {threshold_db!r}", where="threshold_db")
    if imatrix is not None and source is None:
        raise BadInputError("an importance matrix weights the error against the source; pass the source too",
                            where="--imatrix", hint="add --source SRC")
    lay = _locate(artifact)
    if report_dir is not None and lay.kind != "gguf":
        rd, folder = Path(report_dir).resolve(), lay.folder.resolve()
        if rd == folder or folder in rd.parents:
            raise BadInputError("the report folder lies inside the artifact it checks; writing it would change "
                                "the artifact", where=str(report_dir), hint="choose a folder outside it")
    run = _Run()

    sums = None
    if lay.sums is not None:
        from ds4quant.checksums import read_sums

        sums = dict(read_sums(lay.sums))
    manifest = manifest_raw = None
    if lay.manifest is not None:
        try:
            manifest = read_manifest(lay.manifest)
        except Ds4quantError as e:
            raise _with_note(e, _damage_note(lay, lay.manifest, None, sums)) from None
        manifest_raw = lay.manifest.read_bytes()
    try:
        g = read_gguf_set(lay.gguf, variant_107=variant_107)
    except Ds4quantError as e:
        bad = Path(e.where) if e.where and Path(e.where).is_file() else lay.gguf
        raise _with_note(e, _damage_note(lay, bad, manifest, sums)) from None

    file_sha: dict[str, str] = {}
    tensor_sha: dict[str, str] = {}
    for s in g.splits:
        fsha, tsha = _hash_pass(s)
        file_sha[_rel(lay, s.path)] = fsha
        tensor_sha.update(tsha)
    sidecars = _loose_sidecars(g)

    _check_types(run, g, lay, tagged_required=manifest is not None)
    _check_shapes(run, g, lay)
    _check_ds4(run, g, lay)
    stacks = _check_experts(run, g, lay)
    books, tables, lucebox_mix = _check_codebooks(run, g, lay, stacks, sidecars)
    if manifest is not None:
        _check_manifest(run, lay, manifest, manifest_raw, g, file_sha, tensor_sha, sidecars, stacks)
    if sums is not None:
        _check_sums(run, lay, sums, file_sha)
    elif manifest is not None:
        run.ok("sha256sums", "no SHA256SUMS: manifest.json is checked against the GGUF, but its fields the GGUF "
                             "does not repeat (command line, plan details, figures of exact tensors) are covered "
                             "by no hash; --source re-measures the figures", MANIFEST)

    numbers: dict[str, ErrorFigures] = {}
    floors: dict[str, Optional[float]] = {}
    numbers_from = None
    src_fp = None
    if source is not None:
        numbers, floors, src_fp = _numbers(run, g, lay, manifest, stacks, books, source, imatrix, threshold_db,
                                           progress)
        numbers_from = "source"
    elif manifest is not None:
        numbers = _manifest_numbers(manifest, g)
        numbers_from = "manifest" if numbers else None

    records = []
    for name, info in g.tensors.items():
        st = stacks.get(name)
        fl = floors.get(name)
        e = numbers.get(name)
        flagged = bool(numbers_from == "source" and e is not None and fl is not None and _below(e, fl))
        records.append(TensorRecord(name, info.qtype, info.variant, info.ggml_type, tuple(info.shape), info.nbytes,
                                    Path(info.path).name, layer_of(name), surface_of(name),
                                    st.ids if st is not None and st.compact else None, e, fl, flagged))
    kv = {k: _kv_plain(v) for k, v in g.kv.items() if not k.startswith("ds4quant.qtype.")}
    rep = VerifyReport(lay.path, lay.kind, tuple(g.files) + tuple(sidecars), tuple(run.checks), tuple(records),
                       _groups(records), numbers_from, manifest, MappingProxyType(kv),
                       src_fp or (manifest.source.get("fingerprint") if manifest is not None else None)
                       or kv.get("ds4quant.source_fingerprint"),
                       tuple(tables), lucebox_mix, None, time.perf_counter() - t0)
    if report_dir is not None:
        from ds4quant.report import write_report

        path = write_report(rep, report_dir)
        rep = replace(rep, report_path=path, seconds=time.perf_counter() - t0)
    return rep


def _with_note(e: Ds4quantError, note: str) -> Ds4quantError:
    if not note:
        return e
    return type(e)(e.message + note, where=e.where, hint=e.hint)


def _damage_note(lay: _Layout, path: Path, manifest, sums: Optional[dict]) -> str:
    """When a file cannot be parsed: say whether its recorded hash also differs."""
    from ds4quant.artifact import sha256_file

    rel = _rel(lay, path)
    want = []
    if manifest is not None:
        want += [("manifest.json", f.sha256) for f in manifest.files if f.name == rel]
    if sums is not None and rel in sums:
        want.append(("SHA256SUMS", sums[rel]))
    if not want or not path.is_file():
        return ""
    have = sha256_file(path)
    bad = [w for w, sha in want if sha != have]
    return f" (its sha256 also differs from {' and '.join(bad)}: the file is damaged)" if bad else ""


def _kv_plain(kv) -> Any:
    v = kv.value
    if isinstance(v, np.ndarray):
        return f"<{v.size} x {kv.sub_type.name}>" if v.size > 16 else v.tolist()
    if isinstance(v, tuple):
        return f"<{len(v)} strings>" if len(v) > 16 else list(v)
    return v


def _loose_sidecars(g) -> list[Path]:
    out = []
    for f in g.files:
        for kind in LUCEBOX_KINDS:
            p = f.with_name(f"{f.name}.{kind}.bin")
            if p.is_file():
                out.append(p)
    return out


# ----------------------------------------------------------------------------
# structure


def _check_types(run: _Run, g, lay: _Layout, tagged_required: bool) -> None:
    first = _rel(lay, g.path)
    n = len(g.tensors)
    if g.format_version is None:
        if tagged_required:
            run.fail("types", "the GGUF carries no ds4quant qtype tags; an artifact tags every tensor "
                              "(ggml ids alone are ambiguous: 107 has three codecs)", first)
            return
        run.ok("types", f"{n} tensors; untagged file: qtypes read from ggml type ids"
                        + (f" ({len(g.notes)} note(s): {g.notes[0]})" if g.notes else ""), first)
        return
    run.ok("types", f"{n} tensors, every qtype tag known and matching its ggml type id "
                    f"(ds4quant format version {g.format_version})", first)


def _kv_int(g, key: str) -> Optional[int]:
    kv = g.kv.get(key)
    if kv is None or isinstance(kv.value, (np.ndarray, tuple, str, bytes, float)) or isinstance(kv.value, bool):
        return None
    return int(kv.value)


def _check_shapes(run: _Run, g, lay: _Layout) -> None:
    from ds4quant.formats import QTYPES

    H = _kv_int(g, "deepseek4.embedding_length")
    inter = _kv_int(g, "deepseek4.expert_feed_forward_length")
    E = _kv_int(g, "deepseek4.expert_count")
    L = _kv_int(g, "deepseek4.block_count")
    for name, info in g.tensors.items():
        f = Path(info.path).name
        qt = QTYPES.get(info.qtype)
        if qt is not None:
            need = max(qt.block_size, qt.row_multiple)
            if info.shape[0] % need:
                run.fail("shapes", f"ne[0] = {info.shape[0]} is not a multiple of {need}, which {qt.name} rows need",
                         f, name)
        m = _STACK.match(name)
        layer = layer_of(name)
        if L is not None and layer is not None and layer >= L:
            run.fail("shapes", f"layer {layer} but deepseek4.block_count = {L}", f, name)
        if not m:
            continue
        if m.group("qtype") is not None and m.group("qtype") != info.qtype:
            run.fail("shapes", f"compact stack named for qtype {m.group('qtype')!r} holds {info.qtype}", f, name)
        if len(info.shape) != 3:
            run.fail("shapes", f"an expert stack is [in, out, n_expert], got shape {list(info.shape)}", f, name)
            continue
        if H is not None and inter is not None:
            want = (inter, H) if m.group("proj") == "down" else (H, inter)
            if tuple(info.shape[:2]) != want:
                run.fail("shapes", f"[in, out] = {list(info.shape[:2])}, but the deepseek4 keys say {list(want)}",
                         f, name)
        if m.group("qtype") is None and E is not None and info.shape[2] != E:
            run.fail("shapes", f"a full stack holds {info.shape[2]} experts, deepseek4.expert_count = {E}", f, name)
    run.passed_if_clean("shapes", f"{len(g.tensors)} tensors: row rules and expert-stack shapes hold",
                        _rel(lay, g.path))


def _check_ds4(run: _Run, g, lay: _Layout) -> None:
    from ds4quant.artifact import check_ds4_header

    first = _rel(lay, g.path)
    problems = check_ds4_header(g.kv)
    for p in problems:
        run.fail("ds4_keys", p, first)
    if not problems:
        run.ok("ds4_keys", "general.architecture = deepseek4 and every key the DS4 loader requires is a UINT32",
               first)


def _check_experts(run: _Run, g, lay: _Layout) -> dict[str, _Stack]:
    from gguf import GGUFValueType as VT

    first = _rel(lay, g.path)
    E = _kv_int(g, "deepseek4.expert_count")
    L = _kv_int(g, "deepseek4.block_count")
    ids_kv = {k[len(KEY_EXPERT_IDS):]: v for k, v in g.kv.items() if k.startswith(KEY_EXPERT_IDS)}
    stacks: dict[str, _Stack] = {}
    for name, info in g.tensors.items():
        m = _STACK.match(name)
        if not m or len(info.shape) != 3:
            continue
        layer, proj, compact = int(m.group("layer")), m.group("proj"), m.group("qtype") is not None
        f = Path(info.path).name
        n = info.shape[2]
        if not compact:
            if name in ids_kv:
                run.fail("experts", f"a full stack must not carry {KEY_EXPERT_IDS}{name}", first, name)
            stacks[name] = _Stack(name, layer, proj, tuple(range(n)), False)
            continue
        kv = ids_kv.get(name)
        if kv is None:
            run.fail("experts", f"compact stack has no {KEY_EXPERT_IDS}<name> list of global expert ids", f, name)
            continue
        if kv.type != VT.ARRAY or kv.sub_type != VT.UINT32:
            run.fail("experts", f"{KEY_EXPERT_IDS}{name} must be an ARRAY of UINT32", first, name)
            continue
        ids = tuple(int(i) for i in kv.value)
        if len(ids) != n:
            run.fail("experts", f"{len(ids)} expert ids for a stack of {n} experts (ne[2])", f, name)
            continue
        if any(b <= a for a, b in zip(ids, ids[1:])) or (E is not None and ids and ids[-1] >= E):
            run.fail("experts", f"expert ids must be strictly increasing and below {E}", first, name)
            continue
        stacks[name] = _Stack(name, layer, proj, ids, True)
    for name in sorted(set(ids_kv) - set(stacks)):
        if name not in g.tensors:
            run.fail("experts", f"{KEY_EXPERT_IDS}{name} names no tensor of the set", first, name)
    if E is not None:
        by_key: dict[tuple[int, str], list[_Stack]] = {}
        for st in stacks.values():
            by_key.setdefault((st.layer, st.proj), []).append(st)
        layers = range(L) if L is not None and by_key else sorted({k[0] for k in by_key})
        for layer in layers:
            for proj in ("gate", "up", "down"):
                got = by_key.get((layer, proj))
                where = f"blk.{layer}.ffn_{proj}_exps"
                if not got:
                    run.fail("experts", "no stack holds this layer's experts", first, where)
                    continue
                count = np.zeros(E, np.int64)
                for st in got:
                    count[[i for i in st.ids if i < E]] += 1
                missing, twice = np.flatnonzero(count == 0), np.flatnonzero(count > 1)
                if missing.size or twice.size:
                    parts = []
                    if missing.size:
                        parts.append(f"{missing.size} expert(s) in no stack ({_ids_text(missing)})")
                    if twice.size:
                        parts.append(f"{twice.size} expert(s) in several stacks ({_ids_text(twice)})")
                    run.fail("experts", "; ".join(parts) + f" of {E}", first, where)
    if stacks:
        n_compact = sum(s.compact for s in stacks.values())
        run.passed_if_clean("experts", f"{len(stacks)} expert stacks ({n_compact} compact) cover every expert of "
                                       "every layer exactly once", first)
    return stacks


def _ids_text(ids) -> str:
    ids = [int(i) for i in ids]
    return ", ".join(map(str, ids[:8])) + (", ..." if len(ids) > 8 else "")


def _check_codebooks(run: _Run, g, lay: _Layout, stacks: Mapping[str, _Stack],
                     sidecars: Sequence[Path]) -> tuple[dict, list[str], bool]:
    """Validate every codebook table; return (tensor name -> CodebookEntry to
    decode with, names of the tables found, whether the Lucebox blobs hold
    valid books for every resident MIX tensor)."""
    from ds4quant.codebooks import from_lucebox, read_table
    from ds4quant.codebooks.gumix import check_gumix_coverage, read_gumix
    from ds4quant.codebooks.p4mix import check_p4mix_coverage, read_p4mix
    from ds4quant.codebooks.dmix import read_dmix
    from ds4quant.codebooks.table import check_coverage

    first = _rel(lay, g.path)
    E = _kv_int(g, "deepseek4.expert_count")
    L = _kv_int(g, "deepseek4.block_count")
    mix = {n: i for n, i in g.tensors.items() if i.needs_codebooks}
    resident = {n: (i.qtype, i.shape[2] if len(i.shape) == 3 else 1) for n, i in mix.items()}
    tables: list[str] = []
    books: dict = {}
    own = None
    if KEY_CODEBOOKS in g.kv:
        tables.append(KEY_CODEBOOKS)
        try:
            own = read_table(g.blob(KEY_CODEBOOKS), what=f"KV {KEY_CODEBOOKS}")
        except Ds4quantError as e:
            run.fail("codebooks", e.one_line(), first)
        else:
            try:
                check_coverage(own, resident, what=f"KV {KEY_CODEBOOKS}")
            except CodebookError as e:
                run.fail("codebooks", e.one_line(), first)
            for e in own.entries:
                st = stacks.get(e.name)
                if st is None or resident.get(e.name) != (e.qtype, e.n_experts):
                    continue
                n_global = E if E is not None else e.n_global
                if e.global_ids != st.ids or e.n_global != n_global:
                    run.fail("codebooks", f"table entry lists experts {_ids_text(e.global_ids)} of {e.n_global}, the "
                                          f"stack holds {_ids_text(st.ids)} of {n_global}", first, e.name)
                    continue
                books[e.name] = e
            for e in own.entries:
                if e.name in resident and e.name not in stacks and resident[e.name] == (e.qtype, e.n_experts):
                    books[e.name] = e  # a dense MIX tensor (one book pair)
    elif mix:
        if g.format_version is not None:
            run.fail("codebooks", f"{len(mix)} MIX tensor(s) but no {KEY_CODEBOOKS} table; every ds4quant "
                                  "artifact carries its own name-keyed table", first, sorted(mix)[0])

    # Lucebox blobs: embedded KV (the loader's preference) and loose files.
    blobs: dict[str, bytes] = {}
    readers = {"p4mix": read_p4mix, "gumix": read_gumix, "dmix": read_dmix}
    for kind in LUCEBOX_KINDS:
        key = f"deepseek4.{kind}.sidecar"
        found: list[tuple[str, bytes]] = []
        if key in g.kv:
            try:
                found.append((f"KV {key}", g.blob(key)))
            except Ds4quantError as e:
                run.fail("codebooks", e.one_line(), first)
        for p in sidecars:
            if p.name.endswith(f".{kind}.bin"):
                found.append((_rel(lay, p), p.read_bytes()))
        good = []
        for what, data in found:
            tables.append(what)
            try:
                readers[kind](data, n_layers=L, what=what)
            except Ds4quantError as e:
                run.fail("codebooks", e.one_line(), what if not what.startswith("KV ") else first)
                continue
            good.append((what, data))
        for what, data in good[1:]:
            if data != good[0][1]:
                run.fail("codebooks", f"differs from {good[0][0]} (the loader would read the embedded copy)",
                         what if not what.startswith("KV ") else first)
        if good:
            blobs[kind] = good[0][1]
    lucebox_mix = False
    if blobs:
        full = {n: mix[n] for n, st in stacks.items() if n in mix and not st.compact}
        try:
            if "p4mix" in blobs:
                check_p4mix_coverage(read_p4mix(blobs["p4mix"]), {
                    stacks[n].layer: (i.shape[2], i.shape[1], i.shape[0])
                    for n, i in full.items() if i.ggml_type == 105 and stacks[n].proj == "down"})
            if "gumix" in blobs:
                surface = {"gate": 0, "up": 1, "down": 2}
                check_gumix_coverage(read_gumix(blobs["gumix"]), {
                    (stacks[n].layer, surface[stacks[n].proj]): (i.shape[2], i.shape[1], i.shape[0])
                    for n, i in full.items() if i.ggml_type == 106})
            lb = from_lucebox(blobs.get("p4mix"), blobs.get("gumix"), blobs.get("dmix")).table
        except Ds4quantError as e:
            run.fail("codebooks", e.one_line(), first)
        else:
            lucebox_mix = bool(mix) and set(mix) <= set(lb.names)
            for e in lb.entries:
                if e.name not in resident:
                    run.fail("codebooks", "Lucebox blob has an entry for a tensor that is not a resident MIX tensor",
                             first, e.name)
                elif own is not None and e.name in own:
                    if own[e.name] != e:
                        run.fail("codebooks", f"Lucebox blob books/modes differ from {KEY_CODEBOOKS}", first, e.name)
                elif own is not None:
                    run.fail("codebooks", f"in a Lucebox blob but not in {KEY_CODEBOOKS}", first, e.name)
                if e.name not in books and e.name in resident and resident[e.name] == (e.qtype, e.n_experts):
                    books[e.name] = e  # foreign (Lucebox) files: decode with the blob's books
    if mix or tables:
        run.passed_if_clean("codebooks", f"{len(mix)} MIX tensor(s), each covered exactly once by "
                                         f"{', '.join(tables) or 'no table'}", first)
    return books, tables, lucebox_mix


def _check_manifest(run: _Run, lay: _Layout, manifest, raw: bytes, g, file_sha: Mapping[str, str],
                    tensor_sha: Mapping[str, str], sidecars: Sequence[Path], stacks: Mapping[str, _Stack]) -> None:
    from ds4quant.artifact import json_bytes, sha256_file

    # files: every listed file present with its size and hash; every artifact file listed
    listed = {f.name for f in manifest.files}
    for f in manifest.files:
        p = lay.folder / f.name
        if not p.is_file():
            run.fail("manifest.files", "listed in manifest.json but missing", f.name)
            continue
        size = p.stat().st_size
        if size != f.bytes:
            run.fail("manifest.files", f"is {size} bytes, manifest.json says {f.bytes}", f.name)
        have = file_sha.get(f.name) or sha256_file(p)
        if have != f.sha256:
            run.fail("manifest.files", f"sha256 {have[:16]}... differs from manifest.json's {f.sha256[:16]}...",
                     f.name)
    for p in list(g.files) + list(sidecars):
        rel = _rel(lay, p)
        if rel not in listed:
            run.fail("manifest.files", "artifact file is not listed in manifest.json", rel)
    run.passed_if_clean("manifest.files", f"{len(manifest.files)} file(s): sizes and sha256 match", MANIFEST)

    # tensors: the same set, and each entry's fields and payload hash
    entries = {t.name: t for t in manifest.tensors}
    for name in sorted(set(entries) - set(g.tensors)):
        run.fail("manifest.tensors", "listed in manifest.json but not in the GGUF", MANIFEST, name)
    for name, info in g.tensors.items():
        f = Path(info.path).name
        t = entries.get(name)
        if t is None:
            run.fail("manifest.tensors", "in the GGUF but not listed in manifest.json", f, name)
            continue
        diffs = [f"{k} {a!r} vs {b!r}" for k, a, b in (
            ("qtype", info.qtype, t.qtype), ("variant", info.variant, t.variant),
            ("ggml_type", info.ggml_type, t.ggml_type), ("shape", list(info.shape), list(t.shape)),
            ("bytes", info.nbytes, t.bytes)) if a != b]
        if diffs:
            run.fail("manifest.tensors", "GGUF and manifest.json disagree: " + ", ".join(diffs), f, name)
        if tensor_sha.get(name) != t.sha256:
            run.fail("manifest.tensors", f"payload sha256 {tensor_sha.get(name, '?')[:16]}... differs from "
                                         f"manifest.json's {t.sha256[:16]}...", f, name)
    run.passed_if_clean("manifest.tensors", f"{len(entries)} tensors: qtype, variant, type, shape, bytes and "
                                            "payload sha256 match", MANIFEST)

    # what the manifest and the GGUF both state must agree
    def kv_str(key: str) -> Optional[str]:
        kv = g.kv.get(key)
        return kv.value if kv is not None and isinstance(kv.value, str) else None

    fp = kv_str("ds4quant.source_fingerprint")
    if fp is not None and manifest.source.get("fingerprint") != fp:
        run.fail("manifest.consistency", f"source fingerprint {manifest.source.get('fingerprint')!r} differs from "
                                         f"the GGUF's ds4quant.source_fingerprint {fp!r}", MANIFEST)
    tv = kv_str("ds4quant.tool_version")
    if tv is not None and manifest.tool_version != tv:
        run.fail("manifest.consistency", f"tool_version {manifest.tool_version!r} differs from the GGUF's {tv!r}",
                 MANIFEST)
    rj = kv_str("ds4quant.recipe")
    if rj is not None:
        try:
            rk = json.loads(rj)
        except ValueError:
            run.fail("manifest.consistency", "the GGUF's ds4quant.recipe is not JSON", _rel(lay, g.path))
        else:
            mr = manifest.to_json()["recipe"]
            bad = sorted(k for k in (rk if isinstance(rk, dict) else {}) if mr.get(k) != rk[k])
            if bad or not isinstance(rk, dict):
                run.fail("manifest.consistency", f"recipe field(s) {', '.join(bad) or '(all)'} differ from the "
                                                 "GGUF's ds4quant.recipe", MANIFEST)
    plan = manifest.recipe.get("plan")
    if isinstance(plan, (list, tuple)):
        bases = {base_name(n) for n in g.tensors}
        for c in plan:
            if not hasattr(c, "get") or not isinstance(c.get("name"), str):
                run.fail("manifest.consistency", "recipe.plan has an entry without a tensor name", MANIFEST)
                continue
            n = c["name"]
            info = g.tensors.get(n)
            if info is None:
                if n not in bases:
                    run.fail("manifest.consistency", "recipe.plan names a tensor the GGUF lacks", MANIFEST, n)
                continue
            if c.get("qtype") != info.qtype or list(c.get("shape") or ()) != list(info.shape):
                run.fail("manifest.consistency", f"recipe.plan says {c.get('qtype')} {list(c.get('shape') or ())}, "
                                                 f"the GGUF holds {info.qtype} {list(info.shape)}", MANIFEST, n)
            m = _STACK.match(n)
            want: dict = {"layer": layer_of(n)}
            if m:
                want.update(surface=m.group("proj"), **{"class": "routed_expert"})
            bad = sorted(k for k, v in want.items() if k in c and c[k] != v)
            if bad:
                run.fail("manifest.consistency", f"recipe.plan field(s) {', '.join(bad)} contradict the tensor name",
                         MANIFEST, n)
    for t in manifest.tensors:
        why = _errors_inconsistent(t.errors)
        if why:
            run.fail("manifest.consistency", f"error figures disagree with each other: {why}", MANIFEST, t.name)
    try:
        canonical = json_bytes(json.loads(raw.decode("utf-8"))) == raw
    except (ValueError, Ds4quantError):
        canonical = False
    if not canonical:
        run.fail("manifest.consistency", "manifest.json is not in canonical form (sorted keys, 2-space indent, "
                                         "one trailing newline): it was edited or damaged", MANIFEST)
    run.passed_if_clean("manifest.consistency", "fingerprint, tool version, recipe, plan and error figures agree "
                                                "with the GGUF and with each other", MANIFEST)


def _errors_inconsistent(errors: Optional[Mapping[str, float]]) -> str:
    if not errors:
        return ""
    sse, ssx = errors.get("sse"), errors.get("ssx")
    for k in ("sse", "ssx", "weighted_sse", "weighted_ssx", "rel_mse"):
        if k in errors and errors[k] < 0:
            return f"{k} = {errors[k]} is negative"
    if ("weighted_sse" in errors) != ("weighted_ssx" in errors):
        return "weighted_sse and weighted_ssx come as a pair"
    if sse is None or ssx is None:
        return ""
    if "rel_mse" in errors:
        want = sse / ssx if ssx > 0 else 0.0
        if not math.isclose(errors["rel_mse"], want, rel_tol=1e-9, abs_tol=0.0):
            return f"rel_mse {errors['rel_mse']!r} but sse / ssx = {want!r}"
    if "sqnr_db" in errors:
        want = _sqnr(sse, ssx)
        if not (math.isfinite(want) and math.isclose(errors["sqnr_db"], want, rel_tol=1e-9, abs_tol=1e-12)):
            return f"sqnr_db {errors['sqnr_db']!r} but 10 log10(ssx / sse) = {want!r}"
    elif sse > 0 and ssx > 0:
        return "sqnr_db is missing though sse > 0"
    return ""


def _check_sums(run: _Run, lay: _Layout, sums: Mapping[str, str], file_sha: Mapping[str, str]) -> None:
    from ds4quant.artifact import sha256_file
    from ds4quant.checksums import SUMS_NAME, list_files

    for name, want in sums.items():
        p = lay.folder / name
        if not p.is_file():
            run.fail("sha256sums", "listed in SHA256SUMS but missing", name)
            continue
        have = file_sha.get(name) or sha256_file(p)
        if have != want:
            run.fail("sha256sums", f"sha256 {have[:16]}... differs from SHA256SUMS's {want[:16]}...", name)
    try:
        present = list_files(lay.folder)
    except Ds4quantError as e:
        run.fail("sha256sums", e.one_line(), SUMS_NAME)
        present = []
    for name in present:
        if name not in sums:
            run.fail("sha256sums", "file is not listed in SHA256SUMS", name)
    run.passed_if_clean("sha256sums", f"{len(sums)} file(s) listed, all present and matching; nothing unlisted",
                        SUMS_NAME)


# ----------------------------------------------------------------------------
# numbers


def _manifest_numbers(manifest, g) -> dict[str, ErrorFigures]:
    out = {}
    for t in manifest.tensors:
        e = t.errors or {}
        if t.name not in g.tensors or "sse" not in e or "ssx" not in e:
            continue
        if e["sse"] == 0 and e["ssx"] == 0:
            continue  # convert's marker for lossless repacks: no figures recorded
        out[t.name] = ErrorFigures("manifest", math.prod(t.shape), float(e["sse"]), float(e["ssx"]),
                                   e.get("weighted_sse"), e.get("weighted_ssx"))
    return out


def _below(e: ErrorFigures, floor: float) -> bool:
    if not e.finite:
        return True
    sq = e.sqnr_db
    return sq is not None and sq < floor


class _Acc:
    """Running float64 sums of one tensor's comparison."""

    def __init__(self) -> None:
        self.n = 0
        self.sse = self.ssx = self.ssy = self.dot = self.max_abs = 0.0
        self.wsse: Optional[float] = None
        self.wssx: Optional[float] = None
        self.finite = True
        self.experts: list[float] = []

    def add(self, x: np.ndarray, y: np.ndarray, imp: Optional[np.ndarray]) -> tuple[float, float]:
        """Compare source ``x`` with decoded ``y`` (rows, cols); returns this
        part's (sse, ssx). Works through row blocks so float64 temporaries stay
        at a few MB whatever the tensor size."""
        sse = ssx = 0.0
        step = max(1, _SUM_CHUNK_WEIGHTS // max(1, x.shape[1]))
        w = None if imp is None else imp.astype(np.float64)[None, :]
        for r in range(0, x.shape[0], step):
            xs = x[r:r + step].astype(np.float64)
            ys = y[r:r + step].astype(np.float64)
            if not np.all(np.isfinite(ys)):
                self.finite = False
                ys = np.where(np.isfinite(ys), ys, 0.0)
            d = xs - ys
            d2 = d * d
            e, s = float(d2.sum()), float((xs * xs).sum())
            sse, ssx = sse + e, ssx + s
            self.ssy += float((ys * ys).sum())
            self.dot += float((xs * ys).sum())
            if d.size:
                self.max_abs = max(self.max_abs, float(np.abs(d).max()))
            if w is not None:
                self.wsse = (self.wsse or 0.0) + float((w * d2).sum())
                self.wssx = (self.wssx or 0.0) + float((w * xs * xs).sum())
        self.n += x.size
        self.sse += sse
        self.ssx += ssx
        return sse, ssx

    def figures(self) -> ErrorFigures:
        return ErrorFigures("source", self.n, self.sse, self.ssx, self.wsse, self.wssx, self.ssy, self.dot,
                            self.max_abs, self.finite, tuple(self.experts))


def _numbers(run: _Run, g, lay: _Layout, manifest, stacks: Mapping[str, _Stack], books: Mapping[str, Any],
             source, imatrix, threshold_db, progress):
    from ds4quant.sources import open_any_source

    src = open_any_source(source)
    try:
        imx = None
        if imatrix is not None:
            from ds4quant.imatrix import read_imatrix

            imx = read_imatrix(imatrix)
        fp = src.fingerprint()
        claimed = manifest.source.get("fingerprint") if manifest is not None else None
        kv = g.kv.get("ds4quant.source_fingerprint")
        claimed = claimed or (kv.value if kv is not None else None)
        if claimed is not None and claimed != fp:
            run.fail("source", f"the artifact was made from source {claimed[:16]}..., this source is {fp[:16]}...",
                     str(source))
        else:
            run.ok("source", f"source {fp[:16]}... " + ("matches the artifact's fingerprint" if claimed
                                                         else "(the artifact records no fingerprint)"), str(source))
        return _measure_all(run, g, src, imx, manifest, stacks, books, threshold_db, progress) + (fp,)
    finally:
        src.close()


def _measure_all(run, g, src, imx, manifest, stacks, books, threshold_db, progress):
    from ds4quant.formats import QTYPES

    by_gguf = src.names.by_gguf()
    entries = {t.name: t for t in manifest.tensors} if manifest is not None else {}
    plan = manifest.recipe.get("plan") if manifest is not None else None
    plan = {c.get("name"): c for c in plan if hasattr(c, "get")} if isinstance(plan, (list, tuple)) else {}
    out: dict[str, ErrorFigures] = {}
    floors: dict[str, Optional[float]] = {}
    covered: set[str] = set()
    t_start = time.perf_counter()
    total = len(g.tensors)
    for idx, (name, info) in enumerate(g.tensors.items(), 1):
        f = Path(info.path).name
        base = base_name(name)
        members = by_gguf.get(base)
        if members is None:
            run.fail("numbers.coverage", "no source tensor maps to this GGUF tensor", f, name)
            continue
        covered.add(base)
        pc = plan.get(name) or plan.get(base)
        if pc is not None and "source_dtype" in pc and pc["source_dtype"] != src.info(members[0].name).dtype:
            run.fail("numbers.manifest", f"recipe.plan says source dtype {pc['source_dtype']!r}, the source holds "
                                         f"{src.info(members[0].name).dtype!r}", MANIFEST, name)
        qt = QTYPES.get(info.qtype)
        if qt is None or not info.decodable:
            run.fail("numbers.coverage", f"ds4quant cannot decode {info.qtype}; not compared", f, name)
            continue
        if qt.is_mix and name not in books:
            run.fail("numbers.coverage", "MIX tensor without valid codebooks; not compared", f, name)
            continue
        t0 = time.perf_counter()
        try:
            acc = _measure(g, src, imx, name, info, base, members, stacks.get(name), books.get(name))
        except _Mismatch as e:
            run.fail("numbers.coverage", str(e), f, name)
            continue
        fig = acc.figures()
        out[name] = fig
        floors[name] = (float(threshold_db) if threshold_db is not None and qt.lossy
                        else QUALITY_FLOORS_DB.get(info.qtype))
        if not fig.finite:
            run.fail("numbers.finite", "decoded values include NaN or Inf", f, name)
        fl = floors[name]
        if fl is not None and _below(fig, fl):
            run.fail("numbers.floor", f"SQNR {fig.sqnr_db:.2f} dB is below the {fl:g} dB floor for {info.qtype}",
                     f, name)
        me = entries.get(name)
        if me is not None and me.errors and "sse" in me.errors and "ssx" in me.errors:
            if not (math.isclose(me.errors["sse"], fig.sse, rel_tol=1e-6, abs_tol=1e-12 * max(fig.ssx, 1.0))
                    and (me.errors["ssx"] == 0 or math.isclose(me.errors["ssx"], fig.ssx, rel_tol=1e-6))):
                run.fail("numbers.manifest", f"manifest.json records sse {me.errors['sse']:.6g} / ssx "
                                             f"{me.errors['ssx']:.6g}, decoding gives {fig.sse:.6g} / {fig.ssx:.6g}",
                         f, name)
        if progress is not None:
            progress({"index": idx, "total": total, "name": name, "qtype": info.qtype,
                      "sqnr_db": fig.sqnr_db, "seconds": time.perf_counter() - t0,
                      "elapsed": time.perf_counter() - t_start})
    for base in sorted(set(by_gguf) - covered):
        run.fail("numbers.coverage", "source tensor has no counterpart in the artifact", None, base)
    n = len(out)
    run.passed_if_clean("numbers.coverage", f"{n} tensors decoded and compared with the source")
    run.passed_if_clean("numbers.finite", f"{n} tensors decode to finite values")
    run.passed_if_clean("numbers.floor", "every tensor at or above its SQNR floor" +
                        (f" ({threshold_db:g} dB)" if threshold_db is not None else " (QUALITY_FLOORS_DB)"))
    if entries:
        run.passed_if_clean("numbers.manifest", "manifest.json's convert-time sse/ssx match the decoded figures")
    return out, floors


class _Mismatch(Exception):
    """The source and the artifact do not line up for one tensor (a failed check)."""


def _decode(qtype: str, data: np.ndarray, cols: int, books, mode) -> np.ndarray:
    from ds4quant.formats import decode

    try:
        return decode(qtype, data, cols, books, mode)
    except Ds4quantError as e:
        raise _Mismatch(f"cannot decode: {e.one_line()}") from None


def _measure(g, src, imx, name: str, info, base: str, members, stack: Optional[_Stack], entry) -> _Acc:
    acc = _Acc()
    cols = info.shape[0]
    data = g.tensor_data(name)
    if stack is None:
        if len(members) != 1 or members[0].expert is not None:
            raise _Mismatch(f"source holds {len(members)} tensors for it")
        m = members[0]
        sinfo = src.info(m.name)
        want = tuple(reversed(sinfo.shape_logical)) if sinfo.shape_logical else (1,)
        if math.prod(want) != math.prod(info.shape) or want[0] != cols:
            raise _Mismatch(f"source shape {list(sinfo.shape_logical)} does not fit GGUF shape {list(info.shape)}")
        if info.qtype == "i32":
            x = np.asarray(src.read(m.name)).astype(np.int64).reshape(-1, cols)
            y = np.frombuffer(data, dtype="<i4").astype(np.int64).reshape(-1, cols)
            acc.add(x, y, None)
            return acc
        x = src.read_dequantized(m.name).reshape(-1, cols)
        imp = _importance(imx, base, None, cols)
        rows = x.shape[0]
        row_bytes = info.nbytes // rows
        step = max(1, _DECODE_CHUNK_WEIGHTS // cols)
        eb = (entry.books[0], int(entry.modes[0])) if entry is not None else (None, None)
        for r in range(0, rows, step):
            y = _decode(info.qtype, np.asarray(data[r * row_bytes:min(rows, r + step) * row_bytes]), cols, *eb)
            acc.add(x[r:r + step], y, imp)
        return acc
    by_expert = {m.expert: m for m in members}
    n, out = info.shape[2], info.shape[1]
    per = info.nbytes // n
    # decode a few whole experts per call: one call costs a fixed overhead
    k = max(1, _DECODE_CHUNK_WEIGHTS // (out * cols))
    for start in range(0, n, k):
        stop = min(n, start + k)
        eb = (entry.books[start:stop], entry.modes[start:stop]) if entry is not None else (None, None)
        y = _decode(info.qtype, np.asarray(data[start * per:stop * per]), cols, *eb)
        for i in range(start, stop):
            gid = stack.ids[i]
            m = by_expert.get(gid)
            if m is None:
                raise _Mismatch(f"source has no expert {gid}")
            x = src.read_dequantized(m.name)
            if x.shape != (out, cols):
                raise _Mismatch(f"source expert {gid} is {list(x.shape)}, the stack holds [{out}, {cols}]")
            sse, ssx = acc.add(x, y[(i - start) * out:(i - start + 1) * out], _importance(imx, base, gid, cols))
            acc.experts.append(_sqnr(sse, ssx))
        del y
    return acc


def _importance(imx, base: str, expert: Optional[int], cols: int) -> Optional[np.ndarray]:
    if imx is None:
        return None
    from ds4quant.imatrix import importance_for

    return importance_for(imx, base, expert, cols=cols)


# ----------------------------------------------------------------------------
# aggregation


def _groups(records: Sequence[TensorRecord]) -> tuple[GroupRecord, ...]:
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

