"""`ds4quant convert`: a DeepSeek-V4 checkpoint -> a ROCmFPX artifact folder.

Stages (a job with a journal, so a killed run resumes):

1. open + validate the source; build the plan (recipes.plan_tensors; for the
   adaptive recipe, measure every candidate and allocate under the budget,
   ds4quant.adaptive). Nothing is written until the plan is valid, so bad
   input leaves OUTDIR untouched;
2. encode each output tensor into a piece file under ``OUTDIR/.ds4quant-work``
   (atomic per piece), recording its size and sha256 in ``journal.json``;
   expert stacks are encoded one expert at a time, with the next expert read
   and dequantized while the current one encodes, so memory stays at a few
   experts whatever the model size;
3. assemble the GGUF (or splits) from the pieces with the codebook tables,
   atomically, then write ``manifest.json`` and ``SHA256SUMS`` last; remove
   the work folder.

Resume policy: the source fingerprint and the plan fingerprint (recipe,
overrides, dense qtype, allocation, importance file hash, tool version) must
match the journal; thread count, split size and artifact name may change,
since they never change tensor bytes.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from ds4quant import __version__
from ds4quant.adaptive import AdaptiveOptions, Books
from ds4quant.artifact import (
    FileEntry,
    GGUFWriter,
    Manifest,
    TensorEntry,
    atomic_write,
    atomic_write_bytes,
    atomic_write_json,
    read_gguf_set,
    sha256_file,
    write_manifest,
)
from ds4quant.errors import BadInputError, Ds4quantError, ResumeMismatchError
from ds4quant.formats import QTYPES, decode, encode, get_qtype, numba_threads
from ds4quant.formats.qtype import RT_LUCEBOX
from ds4quant.metrics import error_sums
from ds4quant.recipes import Override, Recipe, TensorChoice, TensorSpec, get_recipe, plan_tensors

WORK_DIR = ".ds4quant-work"
JOURNAL = "journal.json"
MANIFEST = "manifest.json"
JOURNAL_VERSION = 2
KEY_CODEBOOKS = "ds4quant.codebooks"
KEY_EXPERT_IDS = "ds4quant.expert_ids."
KEY_GUMIX = "deepseek4.gumix.sidecar"
KEY_P4MIX = "deepseek4.p4mix.sidecar"
_CHUNK = 8 << 20
# Non-expert 2-D tensors are encoded in row blocks of about this many bytes
# of float32, so an embedding table never needs several full-size copies.
_ROW_BLOCK_BYTES = 16 << 20
_JOURNAL_EVERY_S = 2.0


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
    adaptive: Optional[dict] = None

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
            "recipe": self.recipe,
            "adaptive": self.adaptive,
            "source_fingerprint": self.source_fingerprint,
            "plan": [c.to_json() for c in self.plan],
        }


ProgressFn = Callable[[dict], None]


# ----------------------------------------------------------------------------
# planning


def _tensor_specs(src) -> list[tuple[TensorSpec, tuple]]:
    """(spec, official members) per output tensor, in a stable order."""
    out = []
    n_exp = src.config.n_routed_experts
    for gguf, members in sorted(src.names.by_gguf().items(), key=lambda kv: _gguf_order(kv[0])):
        first = members[0]
        info = src.info(first.name)
        logical = tuple(info.shape_logical)
        if first.stacked:
            if len(members) != n_exp:
                raise BadInputError(f"has {len(members)} experts, config says {n_exp}", where=gguf)
            shape = tuple(reversed(logical)) + (n_exp,)
        else:
            shape = tuple(reversed(logical)) if logical else (1,)
        spec = TensorSpec(gguf, str(first.kind.value), shape, info.dtype, first.which, first.layer)
        out.append((spec, members))
    return out


def _gguf_order(name: str):
    # token_embd first, then blocks in numeric order, then the output tensors.
    parts = name.split(".")
    if parts[0] == "blk":
        return (1, int(parts[1]), ".".join(parts[2:]))
    return (0 if name.startswith("token_embd") else 2, 0, name)


def _plan_fingerprint(recipe: Recipe, plan: Sequence[TensorChoice], imatrix_sha: Optional[str],
                      extra: Optional[dict]) -> str:
    blob = json.dumps(
        {
            "tool_version": __version__,
            "recipe": recipe.to_json(),
            "plan": [c.to_json() for c in plan],
            "imatrix": imatrix_sha,
            "extra": extra,
        },
        sort_keys=True,
    ).encode()
    return hashlib.sha256(blob).hexdigest()


def _members_of(choice: TensorChoice, members: dict) -> tuple:
    ms = members[choice.base]
    if choice.experts is None:
        return ms
    by_id = {m.expert: m for m in ms}
    return tuple(by_id[e] for e in choice.experts)


# ----------------------------------------------------------------------------
# encoding one tensor


def _importance(imatrix, name: str, expert: Optional[int], cols: int) -> Optional[np.ndarray]:
    if imatrix is None:
        return None
    from ds4quant.imatrix import importance_for

    return importance_for(imatrix, name, expert, cols=cols)


def _load(src, m, cols: int) -> np.ndarray:
    x = src.read_dequantized(m.name)
    return np.ascontiguousarray(x.reshape(-1, cols), dtype=np.float32)


def _encode_parts(src, choice: TensorChoice, members, imatrix, books: Optional[Books],
                  pool: ThreadPoolExecutor) -> Iterator[tuple[bytes, tuple]]:
    """Yield (payload chunk, (sse, ssx, wsse|None, wssx|None, n)) per matrix
    (per row block for big non-expert tensors)."""
    qt = get_qtype(choice.qtype)
    cols = choice.shape[0]
    lossless = choice.asked == "source" or not qt.lossy
    dense_members = choice.experts is None and members[0].expert is None
    # read + dequantize the next matrix while this one encodes
    pending = None
    # --- GGUF sources: stored bytes already in the target qtype are copied, never re-encoded
    payload_qtype = getattr(src, "payload_qtype", None)
    for k, m in enumerate(members):
        if payload_qtype is not None and qt.name != "i32" and payload_qtype(m.name) == qt.name:
            x = (pending if pending is not None else pool.submit(_load, src, m, cols)).result()
            pending = None
            # the source energy feeds the manifest's error figures; the error is 0
            yield np.ascontiguousarray(src.read(m.name)).view(np.uint8), (0.0, error_sums(x, x).ssx,
                                                                         None, None, x.size)
            src.release(m.name)
            continue
        # --- end GGUF byte copy
        if choice.asked == "mxfp4-lossless":
            codes, scales = src.expert_fp4(m.layer, m.expert, m.which)
            payload = mxfp4_payload(codes, scales, m.name)
            src.release(m.name)
            yield payload, (0.0, 0.0, None, None, codes.size * 2)
            continue
        if qt.name == "i32":
            raw = np.asarray(src.read(m.name))
            if raw.dtype.kind not in "iu":
                raise BadInputError(f"{raw.dtype} tensor cannot be stored as i32", where=m.name)
            if raw.size and (int(raw.min()) < -(2**31) or int(raw.max()) >= 2**31):
                raise BadInputError("values do not fit in int32", where=m.name)
            yield raw.astype("<i4").tobytes(), (0.0, 0.0, None, None, raw.size)
            continue
        fut = pending if pending is not None else pool.submit(_load, src, m, cols)
        pending = pool.submit(_load, src, members[k + 1], cols) if k + 1 < len(members) and not dense_members else None
        x = fut.result()
        src.release(m.name)  # x is a copy: the mapped source pages can go now
        imp = _importance(imatrix, choice.base, m.expert, cols) if qt.lossy else None
        kw = {}
        bk = None
        if qt.is_mix:
            bk, mode = books.get(choice.base, m.expert, qt.name)
            kw = {"mode": mode} if mode != 1 else {}
        step = max(1, _ROW_BLOCK_BYTES // (4 * cols)) if dense_members else x.shape[0]
        for r0 in range(0, x.shape[0], step):
            xb = x[r0:r0 + step]
            if not np.all(np.isfinite(xb)):
                bad = np.argwhere(~np.isfinite(xb))[0]
                raise BadInputError(f"source value at {(int(bad[0]) + r0, int(bad[1]))} is not finite", where=m.name)
            try:
                q = encode(qt.name, xb, imp, bk, **kw)
            except Ds4quantError as exc:
                raise type(exc)(exc.message, where=m.name, hint=exc.hint) from None
            if lossless:
                stats = (0.0, error_sums(xb, xb).ssx, None, None, xb.size)
            else:
                y = decode(qt.name, q, cols, bk, modes=(kw.get("mode", 1) if qt.is_mix else None))
                s = error_sums(xb, y, imp)
                stats = (s.sse, s.ssx, s.wsse, s.wssx, xb.size)
            yield q, stats


def mxfp4_payload(codes, scales, where: str) -> bytes:
    from ds4quant.formats.mxfp4 import mxfp4_from_e2m1

    return mxfp4_from_e2m1(codes, scales, where=where).tobytes()


def _encode_tensor(src, choice: TensorChoice, members, imatrix, books, pool, piece: Path) -> TensorResult:
    t0 = time.perf_counter()
    h = hashlib.sha256()
    nbytes = n = 0
    sse = ssx = 0.0
    wsse = wssx = None
    with atomic_write(piece) as f:
        for chunk, (e, s, we, ws, cnt) in _encode_parts(src, choice, members, imatrix, books, pool):
            view = memoryview(chunk).cast("B")  # bytes or a C-contiguous uint8 array, no copy
            f.write(view)
            h.update(view)
            nbytes += view.nbytes
            sse, ssx, n = sse + e, ssx + s, n + cnt
            if we is not None:
                wsse, wssx = (wsse or 0.0) + we, (wssx or 0.0) + ws
    expect = get_qtype(choice.qtype).nbytes(int(np.prod(choice.shape)))
    if nbytes != expect:  # a bug, not a user error
        raise RuntimeError(f"{choice.name}: encoded {nbytes} bytes, expected {expect}")
    return TensorResult(choice.name, choice.qtype, nbytes, h.hexdigest(), n, sse, ssx, wsse, wssx,
                        time.perf_counter() - t0)


# ----------------------------------------------------------------------------
# the job


@dataclass
class _Journal:
    path: Path
    source_fingerprint: str
    plan_fingerprint: str
    done: dict = field(default_factory=dict)
    _saved: float = 0.0

    def save(self, force: bool = True) -> None:
        # fsyncs cost; between tensors a few seconds of lost progress is fine
        if not force and time.monotonic() - self._saved < _JOURNAL_EVERY_S:
            return
        atomic_write_json(self.path, {
            "version": JOURNAL_VERSION,
            "source_fingerprint": self.source_fingerprint,
            "plan_fingerprint": self.plan_fingerprint,
            "done": self.done,
        })
        self._saved = time.monotonic()

    @classmethod
    def load(cls, path: Path) -> "_Journal":
        try:
            d = json.loads(path.read_text())
            if d.get("version") != JOURNAL_VERSION:
                raise ValueError(f"version {d.get('version')}")
            return cls(path, d["source_fingerprint"], d["plan_fingerprint"], dict(d["done"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ResumeMismatchError(f"journal is unreadable ({exc})", where=str(path),
                                      hint="start over with --force") from None


def _parse_size(text: Optional[str], where: str = "--split-max-size") -> Optional[int]:
    if text is None:
        return None
    t = str(text).strip().upper().removesuffix("B")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    try:
        v = int(float(t) * mult)
    except ValueError:
        raise BadInputError(f"bad size {text!r}", where=where, hint="e.g. 512M or 50G") from None
    if v <= 0:
        raise BadInputError(f"size must be positive, got {text!r}", where=where)
    return v


def _check_outdir(out: Path, resume: bool, force: bool) -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise BadInputError("exists and is not a folder", where=str(out))
    entries = [p.name for p in out.iterdir()]
    if not entries or force or (resume and WORK_DIR in entries):
        return
    raise BadInputError(
        "output folder is not empty", where=str(out),
        hint="pass --resume to continue an interrupted run, or --force to replace its contents",
    )


def _file_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while True:
            b = f.read(_CHUNK)
            if not b:
                return
            yield b


def convert(
    source: "str | os.PathLike",
    outdir: "str | os.PathLike",
    recipe: str = "rocmfp2-strix",
    *,
    threads: Optional[int] = None,
    imatrix: "str | os.PathLike | None" = None,
    tensor_types: Sequence[str] = (),
    dense_qtype: Optional[str] = None,
    name: Optional[str] = None,
    split_max_size: Optional[str] = None,
    adaptive: Optional[AdaptiveOptions] = None,
    loose_sidecars: bool = False,
    resume: bool = False,
    force: bool = False,
    command: Optional[Sequence[str]] = None,
    progress: Optional[ProgressFn] = None,
) -> ConvertReport:
    """Convert a DeepSeek-V4 checkpoint (official folder or GGUF) into an artifact folder.

    ``adaptive`` (an AdaptiveOptions) is required by the ``adaptive`` recipe.
    Returns a ConvertReport; raises a Ds4quantError for bad input, leaving no
    artifact in ``outdir``. The bytes never depend on ``threads``.
    """
    from ds4quant.sources import open_any_source
    from ds4quant.sources.naming import deepseek4_kvs

    t_start = time.perf_counter()
    out = Path(outdir)
    rec = get_recipe(recipe)
    if dense_qtype is not None:
        get_qtype(dense_qtype)
        rec = Recipe(rec.name, rec.description, rec.experts, dense_qtype, rec.adaptive)
    if rec.adaptive:
        if adaptive is None:
            raise BadInputError("the adaptive recipe needs --target-bpw or --max-bytes")
        adaptive.validate()
    elif adaptive is not None and (adaptive.target_bpw is not None or adaptive.max_bytes is not None):
        raise BadInputError(f"--target-bpw/--max-bytes only apply to --recipe adaptive, not {rec.name}")
    overrides = [Override.parse(t) for t in tensor_types]
    split_bytes = _parse_size(split_max_size)
    if threads is not None and threads < 1:
        raise BadInputError(f"must be >= 1, got {threads}", where="--threads")

    src = open_any_source(source)
    try:
        imx = imx_sha = None
        if imatrix is not None:
            from ds4quant.imatrix import read_imatrix

            imx = read_imatrix(imatrix)
            imx_sha = sha256_file(imatrix)
        specs = _tensor_specs(src)
        plan = plan_tensors(rec, [s for s, _ in specs], overrides)
        members = {s.name: m for s, m in specs}
        kvs = deepseek4_kvs(src.config)
        _check_outdir(out, resume, force)
        source_fp = src.fingerprint()
        art_name = name or f"{getattr(src, 'name', None) or Path(source).resolve().name}-{rec.name}"
        if "/" in art_name or art_name.startswith(".") or not art_name:
            raise BadInputError(f"bad artifact name {art_name!r}", where="--name")

        books = Books()
        adaptive_info = None
        with numba_threads(threads):
            if rec.adaptive:
                from ds4quant.adaptive import plan_adaptive

                plan, adaptive_info = plan_adaptive(src, plan, members, adaptive, imx, imx_sha, books,
                                                    kvs, progress)
            else:
                _fit_fixed_mix_books(plan, members, src, imx, books)
        plan_fp = _plan_fingerprint(rec, plan, imx_sha, adaptive.key() if rec.adaptive else None)

        created_out = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        work = out / WORK_DIR
        pieces = work / "pieces"
        journal_path = work / JOURNAL
        if resume and journal_path.exists():
            journal = _Journal.load(journal_path)
            for what, old, new in (("source", journal.source_fingerprint, source_fp),
                                   ("recipe/plan", journal.plan_fingerprint, plan_fp)):
                if old != new:
                    raise ResumeMismatchError(
                        f"cannot resume: the {what} fingerprint differs (journal {old[:12]}, this run {new[:12]})",
                        where=str(journal_path),
                        hint="run with the same source, recipe, options and --imatrix, or start over with --force",
                    )
        else:
            if force and out.exists():
                for p in out.iterdir():
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
            journal = _Journal(journal_path, source_fp, plan_fp)
        pieces.mkdir(parents=True, exist_ok=True)
        journal.save()

        results: list[TensorResult] = []
        try:
            results = _run_encode(src, plan, members, imx, books, pieces, journal, threads, progress)
            table = _codebook_table(plan, books, src.config.n_routed_experts)
            files, cb_bytes, runtimes = _assemble(out, art_name, rec, plan, kvs, pieces, split_bytes, source_fp,
                                                  table, loose_sidecars, adaptive_info)
        except Ds4quantError:
            # bad input mid-run: leave no artifact and no half-made folder
            shutil.rmtree(work, ignore_errors=True)
            if created_out:
                shutil.rmtree(out, ignore_errors=True)
            raise
        manifest = _manifest(out, files, src, rec, plan, results, overrides, imatrix, imx_sha, command, source_fp,
                             runtimes, adaptive_info, table)
        write_manifest(out / MANIFEST, manifest)
        shutil.rmtree(work, ignore_errors=True)
        from ds4quant.checksums import write_sums

        # last: a folder with SHA256SUMS is complete, and every byte is covered
        write_sums(out, known={f.name: f.sha256 for f in manifest.files})
    finally:
        src.close()

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
    )


def _fit_fixed_mix_books(plan, members, src, imx, books: Books) -> None:
    """MIX qtypes chosen outright (--tensor-type ...=rocmfp2_mix): the reference
    fitter per expert, as the Lucebox converter does (per surface here)."""
    from ds4quant.codebooks import fit_reference

    for c in plan:
        qt = get_qtype(c.qtype) if c.qtype in QTYPES else None
        if qt is None or not qt.is_mix:
            continue
        for m in _members_of(c, members):
            x = _load(src, m, c.shape[0])
            imp = _importance(imx, c.base, m.expert, c.shape[0])
            b, _ = fit_reference([x], qt.codebook_levels, imp)
            books.put(c.base, m.expert, qt.name, b, 1)
            src.release(m.name)


class _flush_on_exit:
    """Save the journal however the encode loop ends (Ctrl-C included), so a
    resume loses at most the tensor in flight; SIGKILL loses at most
    _JOURNAL_EVERY_S seconds of finished tensors."""

    def __init__(self, journal: "_Journal"):
        self.journal = journal

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.journal.save()
        return False


def _run_encode(src, plan, members, imx, books, pieces: Path, journal: _Journal, threads,
                progress) -> list[TensorResult]:
    results = []
    mem = {c.name: _members_of(c, members) for c in plan}
    total_src = sum(src.info(m.name).nbytes for c in plan for m in mem[c.name])
    done_src = 0
    t0 = time.perf_counter()
    with numba_threads(threads), ThreadPoolExecutor(max_workers=1) as pool, _flush_on_exit(journal):
        for i, choice in enumerate(plan):
            piece = pieces / f"{i:05d}.bin"
            prev = journal.done.get(choice.name)
            src_bytes = sum(src.info(m.name).nbytes for m in mem[choice.name])
            if prev is not None and piece.is_file() and piece.stat().st_size == prev["bytes"]:
                res = TensorResult.from_journal(prev)
            else:
                res = _encode_tensor(src, choice, mem[choice.name], imx, books, pool, piece)
                journal.done[choice.name] = res.to_journal()
                journal.save(force=False)
            results.append(res)
            done_src += src_bytes
            if progress is not None:
                progress({
                    "stage": "encode", "index": i + 1, "total": len(plan), "name": choice.name,
                    "qtype": choice.qtype, "bytes": res.nbytes, "seconds": res.seconds, "reused": res.reused,
                    "sqnr_db": res.sqnr_db if res.ssx > 0 else None,
                    "source_done": done_src, "source_total": total_src, "elapsed": time.perf_counter() - t0,
                })
    journal.save()
    return results


def _codebook_table(plan, books: Books, n_global: int):
    """ds4quant's own table: one entry per resident MIX tensor (None if none)."""
    from ds4quant.codebooks import CodebookEntry, CodebookTable

    entries = []
    for c in plan:
        qt = get_qtype(c.qtype) if c.qtype in QTYPES else None
        if qt is None or not qt.is_mix:
            continue
        ids = c.experts if c.experts is not None else tuple(range(c.shape[2]))
        got = [books.get(c.base, e, qt.name) for e in ids]
        entries.append(CodebookEntry(
            c.name, qt.name,
            modes=np.array([m for _, m in got], dtype=np.uint8),
            books=np.stack([b for b, _ in got]).astype(np.float32),
            expert_ids=c.experts, n_global=n_global if c.experts is not None else None,
        ))
    return CodebookTable(tuple(entries)) if entries else None


def _lucebox_blobs(plan, table):
    """Lucebox sidecars for the table, or None when Lucebox cannot load it."""
    from ds4quant.codebooks import to_lucebox
    from ds4quant.errors import UnsupportedFormatError

    if table is None:
        return None
    dims = {c.name: (c.shape[1], c.shape[0]) for c in plan if c.tensor_class == "routed_expert"}
    try:
        return to_lucebox(table, dims)
    except (UnsupportedFormatError,) as exc:
        return exc


def _runtimes(plan, lucebox_ok: bool) -> tuple[str, ...]:
    rts = None
    for c in plan:
        r = set(get_qtype(c.qtype).runtimes)
        rts = r if rts is None else rts & r
    rts = rts or set()
    if not lucebox_ok:
        rts.discard(RT_LUCEBOX)
    return tuple(sorted(rts))


def _assemble(out: Path, art_name: str, rec: Recipe, plan, kvs, pieces: Path, split_bytes: Optional[int],
              source_fp: str, table, loose_sidecars: bool, adaptive_info: Optional[dict]):
    # Stale files of an earlier attempt under this name would confuse readers.
    for p in list(out.glob(f"{art_name}*.gguf")) + list(out.glob(f"{art_name}*.gguf.*.bin")):
        p.unlink()
    w = GGUFWriter(out / f"{art_name}.gguf", split_max_bytes=split_bytes)
    for kv in kvs:
        w.add_kv(kv.key, kv.value, kv.type, kv.sub_type)
    w.add_string("general.name", art_name)
    w.add_uint32("general.quantization_version", 2)
    w.add_string("ds4quant.tool_version", __version__)
    w.add_string("ds4quant.recipe", json.dumps(rec.to_json(), sort_keys=True))
    w.add_string("ds4quant.source_fingerprint", source_fp)
    if adaptive_info is not None:
        w.add_string("ds4quant.plan", json.dumps([c.to_json() for c in plan], sort_keys=True))
    cb_bytes = 0
    blobs = _lucebox_blobs(plan, table)
    lucebox_ok = table is None or not isinstance(blobs, Exception)
    if table is not None:
        from ds4quant.codebooks import write_table

        raw = write_table(table)
        w.add_blob(KEY_CODEBOOKS, raw)
        cb_bytes += len(raw)
        if not isinstance(blobs, Exception):
            for key, blob in ((KEY_GUMIX, blobs.gumix), (KEY_P4MIX, blobs.p4mix)):
                if blob is not None:
                    w.add_blob(key, blob)
    runtimes = _runtimes(plan, lucebox_ok)
    from gguf import GGUFValueType as VT

    w.add_array("ds4quant.runtimes", list(runtimes), VT.STRING)
    for c in plan:
        if c.experts is not None:
            w.add_array(KEY_EXPERT_IDS + c.name, list(c.experts), VT.UINT32)
    for i, choice in enumerate(plan):
        piece = pieces / f"{i:05d}.bin"
        w.add_tensor(choice.name, choice.qtype, choice.shape, data=(lambda p=piece: _file_chunks(p)))
    files = list(w.write())
    if loose_sidecars and table is not None and not isinstance(blobs, Exception):
        for suffix, blob in ((".gumix.bin", blobs.gumix), (".p4mix.bin", blobs.p4mix)):
            if blob is not None:
                side = files[0].with_name(files[0].name + suffix)
                atomic_write_bytes(side, blob)
                files.append(side)
    return files, cb_bytes, runtimes


def _manifest(out: Path, files, src, rec: Recipe, plan, results, overrides, imatrix, imx_sha, command,
              source_fp: str, runtimes, adaptive_info, table) -> Manifest:
    g = read_gguf_set(next(p for p in files if p.suffix == ".gguf"))
    mix_names = set(table.names) if table is not None else set()
    entries = []
    for choice, res in zip(plan, results):
        info = g.tensors[choice.name]
        if info.nbytes != res.nbytes:
            raise RuntimeError(f"{choice.name}: GGUF holds {info.nbytes} bytes, piece had {res.nbytes}")
        entries.append(TensorEntry(choice.name, choice.qtype, info.variant, info.ggml_type, info.shape,
                                   res.nbytes, res.sha256, KEY_CODEBOOKS if choice.name in mix_names else None,
                                   res.errors_json()))
    recipe = dict(rec.to_json())
    recipe["tensor_types"] = [o.pattern + "=" + o.qtype for o in overrides]
    recipe["imatrix"] = ({"path": str(imatrix), "sha256": imx_sha} if imatrix is not None else None)
    recipe["runtimes"] = list(runtimes)
    if adaptive_info is not None:
        recipe["allocation"] = adaptive_info
    recipe["plan"] = [c.to_json() for c in plan]
    return Manifest(
        tool_version=__version__,
        command=tuple(command if command is not None else sys.argv),
        source={"path": str(Path(src.path)), "fingerprint": source_fp,
                "format": getattr(src, "format", "deepseek-v4-official")},
        recipe=recipe,
        files=tuple(FileEntry.of(p, p.relative_to(out).as_posix()) for p in files),
        tensors=tuple(entries),
    )
