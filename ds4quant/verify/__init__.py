"""`ds4quant verify`: is an artifact sound, and how faithful is it to its source?

``verify(ARTIFACT)`` takes an artifact folder (GGUF set + ``manifest.json``), a
release folder (the same plus ``SHA256SUMS``, model card and report), or a
bare ``.gguf`` (structure checks only), and returns a ``VerifyReport``
(``ds4quant.records``). Writing the human report is the caller's
(``ds4quant.publish.report.write_report``; the CLI and ``publish`` do it).

Two kinds of failure, kept apart on purpose:

- **unusable input** raises a ``Ds4quantError`` (the CLI exits 2): the path
  is missing, the GGUF set, ``manifest.json`` or ``SHA256SUMS`` cannot be
  parsed (truncated, malformed, wrong magic). Nothing can be checked then.
- **a failed check** is a ``Check`` with ``ok=False`` (the CLI exits 1): the
  containers parse, but something inside disagrees: a hash, a tag, a shape,
  codebook coverage, the DS4 keys, the runtimes key, a tensor below its
  quality floor. Every offender is collected, each naming its file and/or tensor.

The artifact is read through ``ArtifactView`` (``ds4quant.artifact.view``),
whose rules report stacks, ids and codebook problems; verify is the list of
its stages (``STAGES``), one module each, run in order:

1. ``structure``: qtypes and tags, row rules and stack shapes, the
   ``deepseek4.*`` keys the loader needs, compact stacks covering every expert
   of every layer exactly once;
2. ``codebooks``: own table and Lucebox blobs valid, covering every resident
   MIX tensor exactly once, agreeing; then ``ds4quant.runtimes`` against what
   the whole header and tensor list allow (``artifact.runtimes.decide``): a
   key claiming more fails;
3. ``manifest``: per-tensor and per-file sha256 (one read of each file)
   against ``manifest.json``, its fields against the GGUF, ``SHA256SUMS``;
4. ``numbers`` (``source=``): every tensor decoded and compared with the
   source (relative MSE, SQNR dB, importance-weighted error with
   ``imatrix=``, max abs error, cosine, finiteness), floors per qtype;
5. ``fidelity``: the tokenizer keys against the source's tokenizer.json, and
   with ``fidelity=True`` the model through the bundled runtime against the
   transformers reference (KL, top-1, PPL ratio, per-layer MoE error, response
   and MoE-output hashes, the exact-copy protocol; ``verify/fidelity.py``), and with
   ``engines`` the same figures through another engine (``verify/engines.py``).

    rep = verify("out/tiny-strix", source="samples/ds4-tiny")
    rep.ok, rep.summary["expert_sqnr_db"]
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Optional

import numpy as np

from ds4quant import names
from ds4quant.errors import BadInputError
from ds4quant.metrics import ErrorFigures
from ds4quant.names import base_name, layer_of
from ds4quant.progress import ProgressFn
from ds4quant.records import (
    EXPERT_SURFACES,
    MANIFEST,
    SURFACES,
    Check,
    GroupRecord,
    TensorRecord,
    VerifyReport,
    group_records,
)
from ds4quant.verify._run import Context, Options, stream_options
from ds4quant.verify.codebooks import codebooks
from ds4quant.verify.fidelity import fidelity
from ds4quant.verify.manifest import hashes, manifest_and_sums
from ds4quant.verify.numbers import QUALITY_FLOORS_DB, below, numbers
from ds4quant.verify.structure import structure

__all__ = [
    "verify", "STAGES", "VerifyReport", "Check", "TensorRecord", "GroupRecord", "ErrorFigures",
    "QUALITY_FLOORS_DB", "SURFACES", "EXPERT_SURFACES", "MANIFEST", "surface_of", "layer_of", "base_name",
]

# verify's stages, in order; each reads and extends the Context.
STAGES: tuple[Callable[[Context], None], ...] = (structure, codebooks, hashes, manifest_and_sums, numbers, fidelity)


def surface_of(name: str) -> str:
    """The surface (``names.Group`` value) a GGUF tensor is grouped under."""
    return names.group_of(name).value


def verify(
    artifact: "str | os.PathLike",
    *,
    source: "str | os.PathLike | None" = None,
    imatrix: "str | os.PathLike | None" = None,
    threshold_db: Optional[float] = None,
    variant_107: Optional[str] = None,
    progress: Optional[ProgressFn] = None,
    fidelity: bool = False,
    placements: tuple = (),
    mode: str = "fast",
    tokens: "str | os.PathLike | None" = None,
    text: "str | os.PathLike | None" = None,
    protocol: Optional[str] = None,
    engines: tuple = (),
    ctx_size: Optional[int] = None,
    copy_sets: int = 5,
    experts_per_token: Optional[int] = None,
    drop_experts: "str | os.PathLike | None" = None,
    reference: "str | os.PathLike | None" = None,
    stream: bool = False,
    device: str = "cpu",
    max_memory: Any = None,
) -> VerifyReport:
    """Check an artifact folder, release folder or bare GGUF (see module doc).

    source: the checkpoint folder it was made from (decode-vs-source numbers).
    imatrix: importance matrix for the weighted error (needs ``source``).
    threshold_db: one SQNR floor for every lossy tensor instead of the table.
    progress: gets ProgressEvents: stage "decode" per tensor compared with the source (detail qtype,
    sqnr_db, seconds) and, with ``fidelity``, the stages of ``verify.fidelity.measure`` (see there).
    fidelity: measure the model through the runtime (needs ``source``) on ``placements`` (up to two
    placement files, mappings or Placements; none: one CPU owner; one that records ranks runs that many
    gloo ranks: ``runtime.load`` decides) in ``mode`` ("fast" or "exact"), over ``tokens`` (token-id
    file) or ``text`` (UTF-8 file) or the built-in documents; ``protocol="exact-copy"`` adds the
    exact-copy protocol. ``engines=("llama.cpp",)`` also runs the artifact through that engine
    (llama-cpp-python) and reports the same figures in ``rep.fidelity.engines``. ``ctx_size``:
    score as llama.cpp's perplexity tool does (the evaluation stream cut into chunks of that many
    tokens, the second half of each scored); the figures llama.cpp reports go to ``rep.fidelity.kl``.
    ``copy_sets``: seeded identifier sets the exact-copy protocol runs (its check uses their interval).
    ``experts_per_token`` (route top-K) / ``drop_experts`` (a JSON file {layer: [expert, ...]}): also
    measure the artifact with that routing shortcut (``rep.fidelity.approximation``).
    ``reference``: a reference base (``ds4quant reference``) read instead of running the reference.
    ``stream``: run both sides through the layer-streamed forward (no whole model in memory; no
    greedy response or per-layer MoE errors then). ``device`` ("cpu", "cuda", "cuda:N") and
    ``max_memory`` (a host budget, e.g. "64G"): where and within what a streamed pass runs.
    Figures go to ``rep.fidelity``, a ``records.FidelityReport``.
    Raises Ds4quantError for unusable input; a failed check is ``ok=False``.
    """
    from ds4quant.artifact.tags import check_variant_107
    from ds4quant.artifact.view import ArtifactView, locate

    t0 = time.perf_counter()
    check_variant_107(variant_107)
    if threshold_db is not None and (isinstance(threshold_db, bool) or not math.isfinite(float(threshold_db))):
        raise BadInputError(f"must be a finite number of dB, got {threshold_db!r}", where="threshold_db")
    if imatrix is not None and source is None:
        raise BadInputError("an importance matrix weights the error against the source; pass the source too",
                            where="--imatrix", hint="add --source SRC")
    if fidelity:
        from ds4quant.runtime import Mode

        if source is None:
            raise BadInputError("fidelity compares the artifact with its source model", where="--fidelity",
                                hint="add --source SRC")
        mode = Mode.parse(mode, where="--mode")
        if tokens is not None and text is not None:
            raise BadInputError("give --tokens or --text, not both", where="--tokens")
        from ds4quant.runtime.copy_sets import check_sets

        check_sets(copy_sets)
        if ctx_size is not None and (isinstance(ctx_size, bool) or not isinstance(ctx_size, int) or ctx_size < 4):
            raise BadInputError(f"must be an int >= 4, got {ctx_size!r}", where="--ctx")
    elif (placements or tokens is not None or text is not None or protocol is not None or engines
          or ctx_size is not None or experts_per_token is not None or drop_experts is not None
          or reference is not None or stream):
        raise BadInputError("--placement, --tokens, --text, --ctx, --protocol, --engine, --experts-per-token, "
                            "--drop-experts, --reference and --stream belong to the fidelity "
                            "measurement", where="verify", hint="add --fidelity")
    device, max_memory = stream_options(stream, device, max_memory, "verify")
    lay = locate(artifact)
    if lay.kind != "gguf" and lay.manifest is None:
        raise BadInputError(f"no {MANIFEST} in the folder", where=str(lay.path),
                            hint="pass the .gguf file itself for structure checks only")
    view = ArtifactView(lay, variant_107)
    runs = ()
    if fidelity:
        from ds4quant.verify.fidelity import placement_runs

        runs = placement_runs(view, tuple(placements))  # a placement for another artifact fails here, early
    ctx = Context(view, Options(None if source is None else Path(source), None if imatrix is None else Path(imatrix),
                                threshold_db, progress, bool(fidelity), runs, mode,
                                None if tokens is None else Path(tokens), None if text is None else Path(text),
                                protocol, tuple(engines), ctx_size, copy_sets, experts_per_token,
                                None if drop_experts is None else Path(drop_experts),
                                None if reference is None else Path(reference), bool(stream), device,
                                max_memory))
    if fidelity and (experts_per_token is not None or drop_experts is not None):
        # a routing shortcut the model cannot take is refused before anything runs
        from ds4quant.runtime.routing_approx import check, moe_layers_of, read_drop_file
        from ds4quant.runtime.stream import reference_config

        rc = reference_config(source)
        check(rc, moe_layers_of(rc), experts_per_token, read_drop_file(drop_experts) if drop_experts else {},
              str(drop_experts) if drop_experts is not None else "--experts-per-token")
    if reference is not None:
        from ds4quant.runtime.reference_base import read_base

        read_base(reference)  # a truncated or corrupt base is refused before anything runs
    if fidelity:
        from ds4quant.verify.engines import check_engines

        check_engines(view, tuple(engines))
    for stage in STAGES:
        stage(ctx)
    return _report(ctx, time.perf_counter() - t0)


def _report(ctx: Context, seconds: float) -> VerifyReport:
    v = ctx.view
    stacks = {s.name: s for s in v.stacks}
    records = []
    for name, info in v.tensors.items():
        st = stacks.get(name)
        fl = ctx.floors.get(name)
        e = ctx.numbers.get(name)
        flagged = bool(ctx.numbers_from == "source" and e is not None and fl is not None and below(e, fl))
        records.append(TensorRecord(name, info.qtype, info.variant, info.ggml_type, tuple(info.shape), info.nbytes,
                                    Path(info.path).name, layer_of(name), surface_of(name),
                                    st.expert_ids if st is not None and st.compact else None, e, fl, flagged))
    kv = {k: _kv_plain(x) for k, x in v.kv.items() if not k.startswith(names.KEY_QTYPE_TAG_PREFIX)}
    fp = (ctx.source_fingerprint or (v.manifest.source.get("fingerprint") if v.manifest is not None else None)
          or kv.get(names.KEY_SOURCE_FINGERPRINT))
    return VerifyReport(v.layout.path, v.kind, tuple(v.gguf_paths) + tuple(v.sidecars), tuple(ctx.checks),
                        tuple(records), group_records(records), ctx.numbers_from, v.manifest, MappingProxyType(kv),
                        fp, tuple(v.codebook_tables), v.lucebox_books, v.runtimes, v.stored_runtimes,
                        ctx.fidelity, seconds, MappingProxyType(dict(v.runtimes_excluded)))


def _kv_plain(kv) -> Any:
    v = kv.value
    if isinstance(v, np.ndarray):
        return f"<{v.size} x {kv.sub_type.name}>" if v.size > 16 else v.tolist()
    if isinstance(v, tuple):
        return f"<{len(v)} strings>" if len(v) > 16 else list(v)
    return v
