"""Calibrate: importance matrix, routing profile and sensitivity from the
reference model, streamed one decoder layer at a time.

Runs token sequences through the DeepSeek-V4 reference model (transformers'
own decoder layers on the source's weights dequantized by our code, fp32,
eager experts; docs/reference-model.md) through the layer-streamed
forward (``ds4quant.runtime.stream``): one layer's weights in memory at a
time, every sequence's hidden streams in the work folder. It records, per
layer (``collect``):

- routed experts: per layer, expert and surface the sum over routed rows of
  x^2 per input column and the row count (gate and up read the hidden rows
  routed to the expert; down reads the expert's own SwiGLU output, recomputed
  with the eager forward's ops, rows and order);
- routing: the slots per layer and expert, from ``top_k_index`` itself, so
  hash-routed layers (experts from ``tid2eid``) count like scored ones;
- dense projections (attention, compressor, indexer, shared experts, output
  head): the same sums of their inputs, under their GGUF names;
- sensitivity (``sensitivity``): KL per unit of weighted error per
  routed-expert tensor, from perturbed branches carried in the same pass.

Outputs in ``out_dir``: ``imatrix.gguf`` (GGUF imatrix: per-expert sums with
shape (n_expert, cols) and counts per expert; an expert no token reached has
count 0, so ``importance_for`` returns None and the converter falls back to
the weight-only error), ``imatrix.lucebox.dat`` (the same sums in the layout
Lucebox's converter reads), ``routing.csv`` (Lucebox hotness CSV),
``routing.json``, ``sensitivity.json`` and ``report.json`` (tokens,
sequences, seconds, unreached experts per tensor).

Resume: the work folder ``OUT/.ds4quant-work`` journals every finished layer
(``journal``); ``resume=True`` continues a killed run from its first
unfinished layer with the same bytes, and refuses when the source, tokens or
options changed.

Determinism: on the CPU every sequence runs alone (batch 1) on one torch
thread, its sums are taken in float64 and added in sequence order (torch's
CPU kernels give different bits for different intra-op thread counts:
docs/reference-model.md#determinism); the streamed layer gives the whole
model's bits (``ds4quant.runtime.stream``), so the files are the bytes a
whole-model run writes. Only ``report.json``'s ``run`` block (seconds,
device) differs between runs. On a GPU the sequences run in batches
(``batch_size``; by default as many as fit, at most 8; the sensitivity
sequences and their branches among themselves): fewer, larger expert calls,
each batch's sums added in order. A batch changes the last bits as the
device does; the batch is in ``report.json`` and the journal, and a resumed
run keeps it.

Example::

    rep = calibrate("samples/ds4-tiny", "samples/tokens.txt", "out/calib")
    rep.unreached["blk.0.ffn_down_exps.weight"]     # experts no token reached
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ds4quant.calibrate.sensitivity import Method
from ds4quant.errors import BadInputError
from ds4quant.names import stack_name
from ds4quant.progress import ProgressFn

__all__ = ["CalibrationReport", "calibrate", "read_tokens", "REPORT_SCHEMA", "REPORT_VERSION"]

REPORT_SCHEMA = "ds4quant.calibration_report"
REPORT_VERSION = 1
IMATRIX_FILE = "imatrix.gguf"
IMATRIX_LUCEBOX_FILE = "imatrix.lucebox.dat"  # ds4_mix_converter layout (imatrix.write_imatrix_lucebox)
ROUTING_CSV = "routing.csv"
ROUTING_JSON = "routing.json"
REPORT_FILE = "report.json"
# Sequences the sensitivity pass runs (the first N of the calibration set).
SENSITIVITY_SEQS = 8
SURFACES = ("gate", "up", "down")


_TOKEN_RE = re.compile(r"[0-9]+")


def _inside(path, folder: Path) -> bool:
    if not path:
        return False
    try:
        Path(os.fsdecode(path)).resolve().relative_to(folder.resolve())
    except ValueError:
        return False
    return True


# --------------------------------------------------------------------------
# token input


def read_tokens(path: "str | os.PathLike[str]", vocab_size: int,
                max_len: Optional[int] = None) -> tuple[tuple[int, ...], ...]:
    """Token-id sequences from a file.

    Text: one sequence per line, whitespace-separated decimal ids; blank lines
    and lines starting with ``#`` are skipped. JSON (content starts with
    ``[``): a list of non-empty lists of ints. Every id must be in
    0..vocab_size-1 and a sequence at most ``max_len`` long; otherwise a
    BadInputError names the file and line (or index).
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise BadInputError(f"cannot read token file: {e.strerror}", where=str(p)) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInputError(f"byte {e.start} is not UTF-8; expected token ids as text or JSON", where=str(p)) from None
    where = str(p)
    seqs: list[tuple[int, ...]] = []
    if text.lstrip().startswith("["):
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise BadInputError(f"not valid JSON: {e}", where=where) from None
        if not isinstance(obj, list):
            raise BadInputError("JSON token file must be a list of lists of token ids", where=where)
        for i, seq in enumerate(obj):
            if not isinstance(seq, list):
                raise BadInputError(f"sequence {i} is {type(seq).__name__}, not a list of token ids", where=where)
            seqs.append(_check_seq(seq, vocab_size, max_len, where, f"sequence {i}"))
    else:
        for lineno, line in enumerate(text.splitlines(), start=1):
            s = line.strip()
            if not s or s.startswith("#"):
                continue
            ids = []
            for tok in s.split():
                if not _TOKEN_RE.fullmatch(tok):
                    raise BadInputError(f"line {lineno}: token {tok[:40]!r} is not a token id (a decimal integer >= 0)",
                                        where=where)
                ids.append(int(tok))
            seqs.append(_check_seq(ids, vocab_size, max_len, where, f"line {lineno}"))
    if not seqs:
        raise BadInputError("holds no token sequences", where=where,
                            hint="one sequence per line, whitespace-separated ids, or a JSON list of lists")
    return tuple(seqs)


def _check_seq(seq: Sequence[Any], vocab_size: int, max_len: Optional[int], where: str, what: str) -> tuple[int, ...]:
    if len(seq) == 0:
        raise BadInputError(f"{what}: empty sequence", where=where)
    if max_len is not None and len(seq) > max_len:
        raise BadInputError(f"{what}: {len(seq)} tokens exceed the model's max_position_embeddings {max_len}",
                            where=where)
    out = []
    for j, t in enumerate(seq):
        if not isinstance(t, (int, np.integer)) or isinstance(t, (bool, np.bool_)):
            raise BadInputError(f"{what}: item {j} is {t!r}, not an integer token id", where=where)
        if not 0 <= t < vocab_size:
            raise BadInputError(f"{what}: token id {t} is out of range for vocab_size {vocab_size} "
                                f"(ids 0..{vocab_size - 1})", where=where)
        out.append(int(t))
    return tuple(out)


def _tokens_sha256(seqs: Sequence[Sequence[int]]) -> str:
    """sha256 of the canonical text form (one line per sequence, ids by single spaces)."""
    h = hashlib.sha256()
    for s in seqs:
        h.update((" ".join(str(t) for t in s) + "\n").encode("ascii"))
    return h.hexdigest()


@dataclass(frozen=True)
class CalibrationReport:
    """What a calibration run did and wrote (``to_json`` is report.json).

    unreached: GGUF expert tensor -> experts with count 0 (ascending).
    files: role -> file name inside out_dir; sha256: file name -> hex digest
    (imatrix, routing and sensitivity files). seconds / device / resumed_at
    (the first layer this session ran, 0 when it began afresh): this run only.
    """

    out_dir: str
    source: str
    fingerprint: str
    tokens_file: str
    tokens_sha256: str
    sequences: int
    tokens: int
    n_layer: int
    n_expert: int
    n_expert_used: int
    hash_layers: tuple[int, ...]
    unreached: Mapping[str, tuple[int, ...]]
    dense_tensors: tuple[str, ...]
    files: Mapping[str, str]
    sha256: Mapping[str, str]
    versions: Mapping[str, str]
    seconds: float
    device: str
    resumed_at: int = 0
    batch: int = 1  # sequences run through a layer together (``walk.batch_groups``)

    @property
    def unreached_count(self) -> int:
        """Unreached (layer, expert) pairs (gate/up/down share their rows, so one per surface triple)."""
        return sum(len(v) for k, v in self.unreached.items() if k.endswith("ffn_gate_exps.weight"))

    def to_json(self) -> dict:
        return {
            "schema": REPORT_SCHEMA,
            "version": REPORT_VERSION,
            "source": {"name": self.source, "fingerprint": self.fingerprint},
            "tokens": {"file": self.tokens_file, "sha256": self.tokens_sha256,
                       "sequences": self.sequences, "tokens": self.tokens},
            "model": {"n_layer": self.n_layer, "n_expert": self.n_expert, "n_expert_used": self.n_expert_used,
                      "hash_layers": list(self.hash_layers), "dtype": "float32", "experts_implementation": "eager",
                      "batch": self.batch, "torch_threads": 1},
            "versions": dict(self.versions),
            "files": dict(self.files),
            "sha256": dict(self.sha256),
            "unreached_experts": {k: list(v) for k, v in self.unreached.items()},
            "unreached_count": self.unreached_count,
            "dense_tensors": list(self.dense_tensors),
            "run": {"seconds": round(self.seconds, 3), "device": self.device, "resumed_at": self.resumed_at},
        }


def _versions() -> dict[str, str]:
    import torch
    import transformers

    from ds4quant.version import VERSION

    return {"ds4quant": VERSION, "torch": torch.__version__, "transformers": transformers.__version__}




def _seqs_of(tokens, cfg) -> tuple[tuple[tuple[int, ...], ...], str]:
    if isinstance(tokens, (str, os.PathLike)):
        return read_tokens(tokens, cfg.vocab_size, cfg.max_position_embeddings), Path(tokens).name
    if not isinstance(tokens, Sequence) or not all(isinstance(s, Sequence) for s in tokens):
        raise BadInputError("tokens must be a token file path or a list of token-id lists", where="tokens")
    seqs = tuple(_check_seq(s, cfg.vocab_size, cfg.max_position_embeddings, "tokens", f"sequence {i}")
                 for i, s in enumerate(tokens))
    if not seqs:
        raise BadInputError("no token sequences given", where="tokens")
    return seqs, "<in-memory>"


def _check_int(v, what: str, lo: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise BadInputError(f"{what} must be an int >= {lo}, got {v!r}", where=what)


def calibrate(
    source_dir: "str | os.PathLike[str]",
    tokens: "str | os.PathLike[str] | Sequence[Sequence[int]]",
    out_dir: "str | os.PathLike[str]",
    *,
    device: str = "cpu",
    max_memory: "int | str | None" = None,
    resume: bool = False,
    force: bool = False,
    progress: Optional[ProgressFn] = None,
    sensitivity_seqs: int = SENSITIVITY_SEQS,
    sensitivity_method: "Method | str" = Method.STREAMED,
    batch_size: Optional[int] = None,
) -> CalibrationReport:
    """Run ``tokens`` through the streamed reference model of ``source_dir``
    and write the imatrix (GGUF and Lucebox layouts), routing profile (CSV +
    JSON), sensitivity file and report into ``out_dir``.

    source_dir: an official-layout DeepSeek-V4 checkpoint folder (FP8/FP4 or
    BF16/F32). tokens: a token file (see ``read_tokens``) or a list of id
    sequences. device: "cpu", "cuda" or "cuda:N" (the layers and hidden
    streams in work; bytes are the CPU's on "cpu"). max_memory: a byte budget
    (int or SIZE text such as "6G") a single layer must fit in; None: no
    check. resume: continue the interrupted run in ``out_dir`` (refused when
    its source, tokens or options differ); force: discard one. progress gets
    ProgressEvents of stage "calibrate" (unit "layer"): a TICK per sequence,
    a STEP per layer and for the head (detail ``tokens``: tokens through the
    layers so far), the PHASE "writing files", then DONE.
    sensitivity_seqs: the first this many sequences measure each
    routed-expert tensor's KL gain (``sensitivity.json``, which ``convert
    --sensitivity`` reads); 0 skips it. sensitivity_method: "streamed" (a
    constant number of branches) or "per-tensor" (one branch per tensor;
    small models), see ``ds4quant.calibrate.sensitivity``. batch_size: the
    sequences run this many at a time (same-length neighbours, the
    sensitivity ones among themselves; None: 1 on the CPU, on a GPU as many
    as fit up to 8, and on resume the journal's). ``out_dir`` is
    created if its parent exists; every file in it is replaced atomically.

        rep = calibrate("samples/ds4-tiny", "samples/tokens.txt", "calib")
    """
    from ds4quant.artifact.atomic import atomic_write_json
    from ds4quant.calib.imatrix import write_imatrix_gguf, write_imatrix_lucebox
    from ds4quant.calib.routing import RoutingProfile, write_routing_csv, write_routing_json
    from ds4quant.calibrate.collect import Totals
    from ds4quant.calibrate.journal import WORK_DIR_NAME, Journal, check_out_dir
    from ds4quant.calibrate.model import open_stream
    from ds4quant.calibrate.sensitivity import make_pass
    from ds4quant.calibrate.walk import meter_for, walk
    from ds4quant.sources import open_official_source
    from ds4quant.sources.config import HASH_MOE

    _check_int(sensitivity_seqs, "sensitivity_seqs", 0)
    method = make_pass(sensitivity_method, 1, 1).method  # refuses an unknown name before any work
    out = Path(out_dir)
    resume = check_out_dir(out, bool(resume), bool(force))

    # Validate the source (layout, config, shapes) before the heavy imports.
    src_path = Path(source_dir)
    with open_official_source(src_path, "calibrate (the transformers reference model)") as src:
        cfg = src.config
        fingerprint = src.fingerprint()
    seqs, tokens_file = _seqs_of(tokens, cfg)
    if resume and batch_size is None:  # a resumed run keeps its batch, whatever fits now
        batch_size = Journal.stored_option(out / WORK_DIR_NAME, "batch")
    n_sens = min(sensitivity_seqs, len(seqs))
    stream = open_stream(src_path, cfg, [len(s) for s in seqs], device, max_memory, batch=batch_size,
                         split=n_sens, sensitivity=method if n_sens else None)
    tokens_sha = _tokens_sha256(seqs)
    versions = _versions()
    options = {"source": fingerprint, "tokens": tokens_sha, "tokens_file": tokens_file,
               "tool_version": versions["ds4quant"],
               "versions": {k: v for k, v in versions.items() if k != "ds4quant"},
               "device": stream.device, "sensitivity_method": method.value if sensitivity_seqs else None,
               "sensitivity_seqs": sensitivity_seqs, "batch": stream.batch}
    # one calibrate at a time per OUT, as convert: flock locks that die with their holder
    from ds4quant.convert.outdir import OutLock, make_out_dir

    make_out_dir(out)

    lock = OutLock(out, command="calibrate").acquire()
    finished = False
    try:
        work = out / WORK_DIR_NAME
        journal = Journal.resume(work, options) if resume else Journal.start(work, options)
        resumed_at = journal.finished + 1

        n_layer, n_expert, k = cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_experts_per_tok
        hash_layers = tuple(i for i, t in enumerate(cfg.mlp_layer_types) if t == HASH_MOE)
        sens = make_pass(method, n_layer, sensitivity_seqs) if sensitivity_seqs else None
        t0 = time.monotonic()
        meter = meter_for(n_layer, journal, seqs)
        with stream.open() as sm:
            res = walk(sm, seqs, journal, sens, stream, meter=meter, progress=progress)
        if progress is not None:
            progress(meter.phase("writing files"))
        tot = Totals(res.layers, res.head, sum(len(s) for s in seqs))

        # Every token fills k slots in every layer; anything else means the hooks missed a call.
        totals = tot.slots.sum(axis=1)
        if not np.all(totals == tot.tokens * k) or not np.array_equal(tot.slots, tot.rows):
            raise RuntimeError(f"calibration bookkeeping failed: slots per layer {totals.tolist()}, "
                               f"expected {tot.tokens * k}")  # a bug, not user input

        im = tot.imatrix([len(s) for s in seqs], tokens_file)
        profile = RoutingProfile(
            n_layer, n_expert, k, tot.slots.astype(np.uint64), tokens=tot.tokens,
            source={"model": src_path.name, "fingerprint": fingerprint, "tokens_file": tokens_file,
                    "tokens_sha256": tokens_sha, "sequences": len(seqs), "hash_layers": list(hash_layers),
                    "reference": f"transformers DeepseekV4ForCausalLM fp32 eager, batch {stream.batch}"},
        )
        write_imatrix_gguf(out / IMATRIX_FILE, im)
        write_imatrix_lucebox(out / IMATRIX_LUCEBOX_FILE, im)
        write_routing_json(out / ROUTING_JSON, profile)
        write_routing_csv(out / ROUTING_CSV, profile)
        files = {"imatrix": IMATRIX_FILE, "imatrix_lucebox": IMATRIX_LUCEBOX_FILE, "routing_csv": ROUTING_CSV,
                 "routing_json": ROUTING_JSON}
        if sens is not None:
            from ds4quant.calib.sensitivity import SENSITIVITY_FILE, write_sensitivity

            write_sensitivity(out / SENSITIVITY_FILE,
                              sens.finish(res.pieces, res.kl_sums, res.sens_tokens, fingerprint, tokens_sha))
            files["sensitivity"] = SENSITIVITY_FILE
        seconds = time.monotonic() - t0

        unreached = {}
        for layer in range(n_layer):
            never = tuple(int(e) for e in np.nonzero(tot.rows[layer] == 0)[0])
            for s in SURFACES:
                unreached[stack_name(layer, s)] = never
        sha = {name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in files.values()}
        report = CalibrationReport(
            out_dir=str(out), source=src_path.name, fingerprint=fingerprint, tokens_file=tokens_file,
            tokens_sha256=tokens_sha, sequences=len(seqs), tokens=tot.tokens, n_layer=n_layer, n_expert=n_expert,
            n_expert_used=k, hash_layers=hash_layers, unreached=MappingProxyType(unreached),
            dense_tensors=tuple(sorted(tot.dense)),
            files=MappingProxyType({**files, "report": REPORT_FILE}),
            sha256=MappingProxyType(sha), versions=MappingProxyType(versions), seconds=seconds,
            device=stream.device, resumed_at=resumed_at, batch=stream.batch,
        )
        atomic_write_json(out / REPORT_FILE, report.to_json())
        shutil.rmtree(work, ignore_errors=True)
        if progress is not None:
            progress(meter.finish())
        finished = True
        return report
    except OSError as e:
        if not _inside(e.filename, out):
            raise
        # a full or read-only OUT: one line, and the journal's finished layers kept for --resume
        from ds4quant.convert.resume import fs_error

        raise fs_error(e, out, out / WORK_DIR_NAME, created_out=False) from None
    finally:
        lock.release(remove=finished, remove_created=True)
