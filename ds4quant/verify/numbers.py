"""Verify stage 4, numbers: every tensor decoded (expert stacks a few whole
experts at a time) and compared with the source's exactly dequantized values,
or, without a source, the convert-time figures recorded in manifest.json.

Figures come from ``metrics.error_sums`` (float64, thread-count independent)
and are recorded as ``metrics.ErrorFigures``; a tensor below its floor
(``QUALITY_FLOORS_DB`` per qtype, or ``threshold_db``) fails ``numbers.floor``.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Mapping, Optional

import numpy as np

from ds4quant import names
from ds4quant.errors import Ds4quantError
from ds4quant.metrics import ErrorFigures, Sums, error_sums, sqnr_db
from ds4quant.plan import plan_from_json
from ds4quant.progress import Meter
from ds4quant.records import MANIFEST
from ds4quant.verify._run import Context, show_digests

_DECODE_CHUNK_WEIGHTS = 4 << 20  # weights decoded per call (whole experts; at least one)

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


def below(e: ErrorFigures, floor: float) -> bool:
    """A non-finite decode, or an SQNR under ``floor``."""
    if not e.finite:
        return True
    sq = e.sqnr_db
    return sq is not None and sq < floor


def numbers(ctx: Context) -> None:
    """Stage: decode vs source with ``source``, else the manifest's figures."""
    if ctx.options.source is not None:
        _from_source(ctx)
        ctx.numbers_from = "source"
    elif ctx.view.manifest is not None:
        ctx.numbers = _manifest_numbers(ctx.view)
        ctx.numbers_from = "manifest" if ctx.numbers else None


def _manifest_numbers(v) -> dict[str, ErrorFigures]:
    out = {}
    for t in v.manifest.tensors:
        e = t.errors or {}
        if t.name not in v.tensors or "sse" not in e or "ssx" not in e:
            continue
        if e["sse"] == 0 and e["ssx"] == 0:
            continue  # convert's marker for lossless repacks: no figures recorded
        out[t.name] = ErrorFigures("manifest", math.prod(t.shape), float(e["sse"]), float(e["ssx"]),
                                   e.get("weighted_sse"), e.get("weighted_ssx"))
    return out


def _from_source(ctx: Context) -> None:
    from ds4quant.sources import open_any_source

    source, v = ctx.options.source, ctx.view
    src = open_any_source(source)
    try:
        imx = None
        if ctx.options.imatrix is not None:
            from ds4quant.calib.imatrix import read_imatrix

            imx = read_imatrix(ctx.options.imatrix)
        fp = src.fingerprint()
        claimed = v.manifest.source.get("fingerprint") if v.manifest is not None else None
        kv = v.kv.get(names.KEY_SOURCE_FINGERPRINT)
        claimed = claimed or (kv.value if kv is not None else None)
        if claimed is not None and claimed != fp:
            a, b = show_digests(claimed, fp)
            ctx.fail("source", f"the artifact was made from source {a}, this source is {b}", str(source))
        else:
            ctx.ok("source", f"source {fp[:16]}... " + ("matches the artifact's fingerprint" if claimed
                                                         else "(the artifact records no fingerprint)"), str(source))
        _check_source_config(ctx, src)
        _measure_all(ctx, src, imx)
        ctx.source_fingerprint = fp
    finally:
        src.close()


def _check_source_config(ctx: Context, src) -> None:
    """Check ``source_config``: a source config that its readers read two ways."""
    from ds4quant.sources.config import compress_ratio_problems

    rows = {}
    for layer in range(src.config.num_hidden_layers):
        n = f"layers.{layer}.attn.compressor.ape"
        try:
            rows[layer] = int(src.info(n).shape_logical[0])
        except (Ds4quantError, KeyError, IndexError):
            pass
    where = str(Path(ctx.options.source) / "config.json") if Path(ctx.options.source).is_dir() else \
        str(ctx.options.source)
    for p in compress_ratio_problems(src.config, rows):
        ctx.fail("source_config", p, where)
    ctx.passed_if_clean("source_config", "the source config reads the same to DeepSeek's code and to transformers",
                        where)


def _metered(ctx: Context):
    """The artifact's (name, info) pairs; after each one's loop body (also one
    that ``continue``d: a tensor not compared is done too) a "decode"
    ProgressEvent goes to ``ctx.options.progress``, work weighted by payload bytes."""
    progress, tensors = ctx.options.progress, ctx.view.tensors
    meter = Meter("decode", len(tensors), "tensor", total_work=sum(i.nbytes for i in tensors.values()),
                  then=("the fidelity measurement",) if ctx.options.fidelity else ())
    for name, info in tensors.items():
        t0 = time.perf_counter()
        yield name, info
        fig = ctx.numbers.get(name)
        ev = meter.step(name, work=info.nbytes, qtype=info.qtype, sqnr_db=None if fig is None else fig.sqnr_db,
                        seconds=time.perf_counter() - t0)
        if progress is not None:
            progress(ev)


def _measure_all(ctx: Context, src, imx) -> None:
    from ds4quant.formats import QTYPES

    v, threshold_db = ctx.view, ctx.options.threshold_db
    by_gguf = src.names.by_gguf()
    manifest = v.manifest
    entries = {t.name: t for t in manifest.tensors} if manifest is not None else {}
    plan = manifest.recipe.get("plan") if manifest is not None else None
    # an entry that is no tensor choice is manifest.consistency's finding
    plan = {c.name: c for c in plan_from_json(plan)[0]} if isinstance(plan, (list, tuple)) else {}
    stacks = {s.name: s for s in v.stacks}
    covered: set[str] = set()
    for name, info in _metered(ctx):
        f = Path(info.path).name
        base = names.base_name(name)
        members = by_gguf.get(base)
        if members is None:
            ctx.fail("numbers.coverage", "no source tensor maps to this GGUF tensor", f, name)
            continue
        covered.add(base)
        pc = plan.get(name) or plan.get(base)
        if pc is not None and pc.source_dtype != src.info(members[0].name).dtype:
            ctx.fail("numbers.manifest", f"recipe.plan says source dtype {pc.source_dtype!r}, the source holds "
                                         f"{src.info(members[0].name).dtype!r}", MANIFEST, name)
        qt = QTYPES.get(info.qtype)
        if qt is None or not info.decodable:
            ctx.fail("numbers.coverage", f"ds4quant cannot decode {info.qtype}; not compared", f, name)
            continue
        entry = v.book_entry(name)
        if qt.is_mix and entry is None:
            ctx.fail("numbers.coverage", "MIX tensor without valid codebooks; not compared", f, name)
            continue
        try:
            fig = _measure(v, src, imx, name, info, base, members, stacks.get(name), entry)
        except _Mismatch as e:
            ctx.fail("numbers.coverage", str(e), f, name)
            continue
        ctx.numbers[name] = fig
        ctx.floors[name] = fl = (float(threshold_db) if threshold_db is not None and qt.lossy
                                 else QUALITY_FLOORS_DB.get(info.qtype))
        if not fig.finite:
            ctx.fail("numbers.finite", "decoded values include NaN or Inf", f, name)
        if fl is not None and below(fig, fl):
            ctx.fail("numbers.floor", f"SQNR {fig.sqnr_db:.2f} dB is below the {fl:g} dB floor for {info.qtype}",
                     f, name)
        me = entries.get(name)
        if me is not None and me.errors and "sse" in me.errors and "ssx" in me.errors:
            if not (math.isclose(me.errors["sse"], fig.sse, rel_tol=1e-6, abs_tol=1e-12 * max(fig.ssx, 1.0))
                    and (me.errors["ssx"] == 0 or math.isclose(me.errors["ssx"], fig.ssx, rel_tol=1e-6))):
                ctx.fail("numbers.manifest", f"manifest.json records sse {me.errors['sse']:.6g} / ssx "
                                             f"{me.errors['ssx']:.6g}, decoding gives {fig.sse:.6g} / {fig.ssx:.6g}",
                         f, name)
    for base in sorted(set(by_gguf) - covered):
        ctx.fail("numbers.coverage", "source tensor has no counterpart in the artifact", None, base)
    n = len(ctx.numbers)
    ctx.passed_if_clean("numbers.coverage", f"{n} tensors decoded and compared with the source")
    ctx.passed_if_clean("numbers.finite", f"{n} tensors decode to finite values")
    ctx.passed_if_clean("numbers.floor", "every tensor at or above its SQNR floor" +
                        (f" ({threshold_db:g} dB)" if threshold_db is not None else " (QUALITY_FLOORS_DB)"))
    if entries:
        ctx.passed_if_clean("numbers.manifest", "manifest.json's convert-time sse/ssx match the decoded figures")


def shape_mismatch(logical: tuple, ne: tuple) -> str:
    """Which dims of a GGUF shape disagree with a source tensor of ``logical`` ([out, in]) shape."""
    want = tuple(reversed(logical)) if logical else (1,)
    if len(want) != len(ne):
        return (f"source shape {list(logical)} has {len(logical)} dims (GGUF order {list(want)}); the GGUF shape "
                f"{list(ne)} has {len(ne)}")
    bad = [f"ne[{i}] is {g} in the GGUF but {w} in the source" for i, (g, w) in enumerate(zip(ne, want)) if g != w]
    what = " (the same dims, transposed)" if sorted(want) == sorted(ne) else ""
    return f"source shape {list(logical)} (GGUF order {list(want)}) vs GGUF shape {list(ne)}{what}: " + "; ".join(bad)


class _Mismatch(Exception):
    """The source and the artifact do not line up for one tensor (a failed check)."""


def _decode(qtype: str, data: np.ndarray, cols: int, books, mode) -> np.ndarray:
    from ds4quant.formats import decode

    try:
        return decode(qtype, data, cols, books, mode)
    except Ds4quantError as e:
        raise _Mismatch(f"cannot decode: {e.one_line()}") from None


def _add(tot: Optional[Sums], s: Sums) -> Sums:
    return s if tot is None else tot.plus(s)


def _measure(v, src, imx, name: str, info, base: str, members, stack, entry) -> ErrorFigures:
    cols = info.shape[0]
    if stack is None:
        if len(members) != 1 or members[0].expert is not None:
            raise _Mismatch(f"source holds {len(members)} tensors for it")
        m = members[0]
        sinfo = src.info(m.name)
        want = tuple(reversed(sinfo.shape_logical)) if sinfo.shape_logical else (1,)
        if tuple(want) != tuple(info.shape):
            raise _Mismatch(shape_mismatch(tuple(sinfo.shape_logical), tuple(info.shape)))
        data = v.tensor_data(name)
        if info.qtype == "i32":
            # integer tables (hash routing): small ids, exact in float32
            x = np.asarray(src.read(m.name)).astype(np.float32).reshape(-1, cols)
            y = np.frombuffer(data, dtype="<i4").astype(np.float32).reshape(-1, cols)
            return ErrorFigures.of(error_sums(x, y))
        x = src.read_dequantized(m.name).reshape(-1, cols)
        imp = _importance(imx, base, None, cols)
        rows = x.shape[0]
        row_bytes = info.nbytes // rows
        step = max(1, _DECODE_CHUNK_WEIGHTS // cols)
        eb = (entry.books[0], int(entry.modes[0])) if entry is not None else (None, None)
        tot = None
        for r in range(0, rows, step):
            y = _decode(info.qtype, np.asarray(data[r * row_bytes:min(rows, r + step) * row_bytes]), cols, *eb)
            tot = _add(tot, error_sums(x[r:r + step], y, imp))
        return ErrorFigures.of(tot if tot is not None else error_sums(x[:0], x[:0]))
    by_expert = {m.expert: m for m in members}
    n, out = stack.n_experts, stack.rows
    # decode a few whole experts per call: one call costs a fixed overhead
    k = max(1, _DECODE_CHUNK_WEIGHTS // (out * cols))
    tot = None
    per_expert = []
    weighted = [0.0, 0.0]  # wsse, wssx over the experts the imatrix reached
    unreached, u_sums = [], [0.0, 0.0]
    for start in range(0, n, k):
        stop = min(n, start + k)
        eb = (entry.books[start:stop], entry.modes[start:stop]) if entry is not None else (None, None)
        raw = np.asarray(v.expert_data(stack.name, stack.expert_ids[start:stop]))
        y = _decode(info.qtype, raw.reshape(-1), cols, *eb)
        for i in range(start, stop):
            gid = stack.expert_ids[i]
            m = by_expert.get(gid)
            if m is None:
                raise _Mismatch(f"source has no expert {gid}")
            x = src.read_dequantized(m.name)
            if x.shape != (out, cols):
                raise _Mismatch(f"source expert {gid} is {list(x.shape)}, the stack holds [{out}, {cols}]")
            imp = _importance(imx, base, gid, cols)
            s = error_sums(x, y[(i - start) * out:(i - start + 1) * out], imp)
            per_expert.append(sqnr_db(s.sse, s.ssx))
            if imx is not None and imp is None:  # the calibration never reached this expert
                unreached.append(int(gid))
                u_sums[0] += s.sse
                u_sums[1] += s.ssx
            elif s.wsse is not None:
                weighted[0] += s.wsse
                weighted[1] += s.wssx
            tot = _add(tot, replace(s, wsse=None, wssx=None))
        del y
    figs = ErrorFigures.of(tot, tuple(per_expert))
    if imx is None:
        return figs
    some = len(unreached) < n
    return replace(figs, wsse=weighted[0] if some else None, wssx=weighted[1] if some else None,
                   unreached=tuple(unreached), unreached_sse=u_sums[0], unreached_ssx=u_sums[1])


def _importance(imx, base: str, expert: Optional[int], cols: int) -> Optional[np.ndarray]:
    if imx is None:
        return None
    from ds4quant.calib.imatrix import importance_for

    return importance_for(imx, base, expert, cols=cols)
