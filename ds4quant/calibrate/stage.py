"""Calibrate: importance matrix and routing profile from the reference model.

Runs token sequences through the transformers DeepSeek-V4 reference model
(``DeepseekV4ForCausalLM`` on the exactly dequantized source weights, fp32,
``experts_implementation="eager"``; docs/reference-model.md; loaded and
hooked through ``ds4quant.runtime.reference``) and records, with forward
pre-hooks:

- routed experts (``model.model.layers[L].mlp.experts``, called as
  ``experts(hidden[T,H], top_k_index[T,k], top_k_weights[T,k])``): per layer,
  expert and surface the sum over routed rows of x^2 per input column and the
  row count. gate and up read the hidden rows routed to the expert; down reads
  ``silu(clamp(gate, max=limit)) * clamp(up, -limit, limit)`` of that expert,
  recomputed from its weights with the same ops, rows and order as the eager
  experts forward (so the values are the model's own, bit for bit);
- routing: the slots per layer and expert, from ``top_k_index`` itself, so
  hash-routed layers (experts from ``tid2eid``) count like scored ones;
- dense projections (attention, compressor, indexer, shared experts, output
  head): the same sums of their inputs, under their GGUF names.

Outputs in ``out_dir``: ``imatrix.gguf`` (GGUF imatrix: per-expert sums with
shape (n_expert, cols) and counts per expert; an expert no token reached has
count 0, so ``importance_for`` returns None and the converter falls back to the
weight-only error), ``routing.csv`` (Lucebox hotness CSV), ``routing.json`` and
``report.json`` (tokens, sequences, seconds, unreached experts per tensor),
and ``imatrix.lucebox.dat``, the same sums in the layout Lucebox's converter
reads (one mean vector per expert stack, no dataset tail).

Determinism: every sequence runs alone (batch 1) on one torch thread, its
sums are taken in float64 and the per-sequence sums are added in sequence
order. ``threads`` is the number of worker processes that run sequences, so
it changes speed, never bytes (torch's CPU kernels give different bits for
different intra-op thread counts: docs/reference-model.md#determinism). Only ``report.json``'s ``run``
block (seconds, threads) differs between runs.

Example::

    rep = calibrate("samples/ds4-tiny", "samples/tokens.txt", "out/calib")
    rep.unreached["blk.0.ffn_down_exps.weight"]     # experts no token reached
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ds4quant.errors import BadInputError
from ds4quant.names import stack_name
from ds4quant.progress import Meter, ProgressFn
from ds4quant.runtime.reference import capture_experts, check_dependencies, expert_rows, load_reference, torch_threads

__all__ = ["CalibrationReport", "calibrate", "read_tokens", "REPORT_SCHEMA", "REPORT_VERSION"]

REPORT_SCHEMA = "ds4quant.calibration_report"
REPORT_VERSION = 1
IMATRIX_FILE = "imatrix.gguf"
IMATRIX_LUCEBOX_FILE = "imatrix.lucebox.dat"  # ds4_mix_converter layout (imatrix.write_imatrix_lucebox)
ROUTING_CSV = "routing.csv"
ROUTING_JSON = "routing.json"
REPORT_FILE = "report.json"
# Sequences the sensitivity pass runs (each once per routed-expert tensor).
SENSITIVITY_SEQS = 8
SURFACES = ("gate", "up", "down")

# transformers module (inside model.model.layers.L) -> GGUF tensor stem (blk.L.<stem>.weight);
# names from docs/reference-model.md#names (official <-> transformers) and docs/formats.md#ds4-gguf.
_DENSE_MODULES = (
    ("self_attn.q_a_proj", "attn_q_a"),
    ("self_attn.q_b_proj", "attn_q_b"),
    ("self_attn.kv_proj", "attn_kv"),
    ("self_attn.o_a_proj", "attn_output_a"),  # grouped: each (token, group) row is one input row
    ("self_attn.o_b_proj", "attn_output_b"),
    ("self_attn.compressor.kv_proj", "attn_compressor_kv"),
    ("self_attn.compressor.gate_proj", "attn_compressor_gate"),
    ("self_attn.compressor.indexer.q_b_proj", "indexer.attn_q_b"),
    ("self_attn.compressor.indexer.kv_proj", "indexer_compressor_kv"),
    ("self_attn.compressor.indexer.gate_proj", "indexer_compressor_gate"),
    ("self_attn.compressor.indexer.scorer.weights_proj", "indexer.proj"),
    ("mlp.shared_experts.gate_proj", "ffn_gate_shexp"),
    ("mlp.shared_experts.up_proj", "ffn_up_shexp"),
    ("mlp.shared_experts.down_proj", "ffn_down_shexp"),
)
_HEAD_MODULE = ("lm_head", "output.weight")

_TOKEN_RE = re.compile(r"[0-9]+")


def expert_tensor(layer: int, surface: str) -> str:
    """GGUF name of a routed-expert stack, e.g. ``blk.3.ffn_down_exps.weight`` (names.stack_name)."""
    return stack_name(layer, surface)


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


# --------------------------------------------------------------------------
# per-sequence sums (the model itself: ds4quant.runtime.reference)


@dataclass
class _Partial:
    """One sequence's sums (float64) and counts; picklable for worker processes."""

    tokens: int
    slots: np.ndarray  # int64 (n_layer, n_expert): routed slots per expert
    experts: dict = field(default_factory=dict)  # (layer, expert) -> [rows, sum x^2 hidden (H,), sum x^2 act (I,)]
    dense: dict = field(default_factory=dict)  # GGUF name -> [rows, sum x^2 (cols,)]


def _sum_sq(x) -> np.ndarray:
    """float64 (cols,): sum over rows of x^2 (x: float32 torch [rows, cols]).
    Squares of float32 are exact in float64; numpy adds rows in order."""
    a = x.detach().numpy().astype(np.float64)
    return np.square(a).sum(axis=0)


class _Collector:
    """Hooks on one loaded model; ``run(ids)`` returns that sequence's _Partial."""

    def __init__(self, model):
        cfg = model.config
        self.model = model
        self.n_layer = len(model.model.layers)
        self.n_expert = int(cfg.n_routed_experts)
        self._part: Optional[_Partial] = None
        self._handles = []
        self._hooks = contextlib.ExitStack()
        self._hooks.enter_context(capture_experts(model, self._on_experts))
        self.dense_names: list[str] = []
        for layer_idx, layer in enumerate(model.model.layers):
            for path, stem in _DENSE_MODULES:
                try:
                    mod = layer.get_submodule(path)
                except AttributeError:
                    continue  # e.g. no compressor in sliding-only layers
                self._add_dense(mod, f"blk.{layer_idx}.{stem}.weight")
        self._add_dense(model.get_submodule(_HEAD_MODULE[0]), _HEAD_MODULE[1])

    def _add_dense(self, mod, name: str) -> None:
        def hook(_mod, args):
            if self._part is None:
                return
            x = args[0]
            rows = x.detach().reshape(-1, x.shape[-1])
            slot = self._part.dense.setdefault(name, [0, np.zeros(rows.shape[1], dtype=np.float64)])
            slot[0] += int(rows.shape[0])
            slot[1] += _sum_sq(rows)

        self._handles.append(mod.register_forward_pre_hook(hook))
        self.dense_names.append(name)

    def _on_experts(self, layer_idx: int, module, hidden, idx, _weights) -> None:
        import torch

        if self._part is None:
            return
        n_exp = module.num_experts
        with torch.no_grad():
            flat = idx.reshape(-1)
            # The eager forward skips index n_expert (an expert-parallel
            # placeholder); anything else out of range would have failed there.
            self._part.slots[layer_idx] += torch.bincount(flat[flat < n_exp], minlength=n_exp).numpy()
            idx_t = idx.transpose(0, 1)  # [k, T]: the eager forward's mask[e] layout
            for e in torch.unique(flat).tolist():
                if e >= n_exp:
                    continue
                _pos, tok, x, act = expert_rows(module, hidden, idx_t, e)
                slot = self._part.experts.get((layer_idx, e))
                if slot is None:
                    slot = self._part.experts[(layer_idx, e)] = [0, 0.0, 0.0]
                slot[0] += int(tok.shape[0])
                slot[1] = slot[1] + _sum_sq(x)
                slot[2] = slot[2] + _sum_sq(act)

    def run(self, ids: Sequence[int]) -> _Partial:
        import torch

        self._part = _Partial(tokens=len(ids), slots=np.zeros((self.n_layer, self.n_expert), dtype=np.int64))
        try:
            with torch.no_grad():
                self.model(input_ids=torch.tensor([list(ids)], dtype=torch.long), use_cache=False)
            return self._part
        finally:
            self._part = None

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._hooks.close()


# worker processes (spawned): one model each, one torch thread each
_WORKER: Optional[_Collector] = None


def _worker_init(source_dir: str) -> None:
    global _WORKER
    _WORKER = _Collector(load_reference(source_dir, threads=1))


def _worker_run(ids: tuple[int, ...]) -> _Partial:
    if _WORKER is None:
        raise RuntimeError("calibration worker used before _worker_init")  # a bug, not user input
    return _WORKER.run(ids)


# --------------------------------------------------------------------------
# totals and outputs


class _Totals:
    """Sums over all sequences, added in sequence order."""

    def __init__(self, n_layer: int, n_expert: int, hidden: int, inter: int):
        self.tokens = 0
        self.slots = np.zeros((n_layer, n_expert), dtype=np.int64)
        self.rows = np.zeros((n_layer, n_expert), dtype=np.int64)
        self.hidden = np.zeros((n_layer, n_expert, hidden), dtype=np.float64)
        self.act = np.zeros((n_layer, n_expert, inter), dtype=np.float64)
        self.dense: dict[str, list] = {}

    def add(self, p: _Partial) -> None:
        self.tokens += p.tokens
        self.slots += p.slots
        for (layer, e), (rows, sh, sa) in sorted(p.experts.items()):
            self.rows[layer, e] += rows
            self.hidden[layer, e] += sh
            self.act[layer, e] += sa
        for name, (rows, s) in sorted(p.dense.items()):
            slot = self.dense.setdefault(name, [0, np.zeros_like(s)])
            slot[0] += rows
            slot[1] += s


@dataclass(frozen=True)
class CalibrationReport:
    """What a calibration run did and wrote (``to_json`` is report.json).

    unreached: GGUF expert tensor -> experts with count 0 (ascending).
    files: role -> file name inside out_dir; sha256: file name -> hex digest
    (imatrix and routing files). seconds / threads: this run only.
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
    threads: int

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
                      "batch": 1, "torch_threads": 1},
            "versions": dict(self.versions),
            "files": dict(self.files),
            "sha256": dict(self.sha256),
            "unreached_experts": {k: list(v) for k, v in self.unreached.items()},
            "unreached_count": self.unreached_count,
            "dense_tensors": list(self.dense_tensors),
            "run": {"seconds": round(self.seconds, 3), "threads": self.threads},
        }


def _build_imatrix(tot: _Totals, n_layer: int, seq_lens: Sequence[int], dataset: str):
    from ds4quant.calib.imatrix import make_imatrix

    sums: dict[str, tuple[Any, Any]] = {}
    for layer in range(n_layer):
        hid = tot.hidden[layer].astype(np.float32)
        counts = tot.rows[layer].astype(np.float64)
        sums[expert_tensor(layer, "gate")] = (hid, counts)
        sums[expert_tensor(layer, "up")] = (hid, counts)
        sums[expert_tensor(layer, "down")] = (tot.act[layer].astype(np.float32), counts)
    for name, (rows, s) in tot.dense.items():
        sums[name] = (s.astype(np.float32), [rows])
    lens = set(seq_lens)
    return make_imatrix(sums, datasets=(dataset,), chunk_count=len(seq_lens),
                        chunk_size=next(iter(lens)) if len(lens) == 1 else None)


def _versions() -> dict[str, str]:
    import torch
    import transformers

    from ds4quant import __version__

    return {"ds4quant": __version__, "torch": torch.__version__, "transformers": transformers.__version__}


def calibrate(
    source_dir: "str | os.PathLike[str]",
    tokens: "str | os.PathLike[str] | Sequence[Sequence[int]]",
    out_dir: "str | os.PathLike[str]",
    *,
    threads: Optional[int] = None,
    progress: Optional[ProgressFn] = None,
    sensitivity_seqs: int = SENSITIVITY_SEQS,
) -> CalibrationReport:
    """Run ``tokens`` through the reference model of ``source_dir`` and write the
    imatrix, routing profile (CSV + JSON) and report into ``out_dir``.

    source_dir: an official-layout DeepSeek-V4 checkpoint folder (FP8/FP4 or
    BF16/F32). tokens: a token file (see ``read_tokens``) or a list of id
    sequences. threads: worker processes (default 1: in this process); output
    bytes do not depend on it. progress gets a ProgressEvent (stage
    "calibrate", unit "sequence", detail ``tokens``: tokens done) after each
    sequence. sensitivity_seqs: the first this many sequences also measure
    each routed-expert tensor's KL gain (``ds4quant.calibrate.sensitivity``;
    ``sensitivity.json``, which ``convert --sensitivity`` reads); 0 skips it.
    ``out_dir`` is created if its parent exists; every file in it is
    replaced atomically.

        rep = calibrate("samples/ds4-tiny", "samples/tokens.txt", "calib")
    """
    from ds4quant.artifact.atomic import atomic_write_json
    from ds4quant.calib.imatrix import write_imatrix_gguf, write_imatrix_lucebox
    from ds4quant.calib.routing import RoutingProfile, write_routing_csv, write_routing_json
    from ds4quant.sources import open_official_source
    from ds4quant.sources.config import HASH_MOE

    if threads is None:
        threads = 1
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise BadInputError(f"threads must be an int >= 1, got {threads!r}", where="threads")
    if not isinstance(sensitivity_seqs, int) or isinstance(sensitivity_seqs, bool) or sensitivity_seqs < 0:
        raise BadInputError(f"sensitivity_seqs must be an int >= 0, got {sensitivity_seqs!r}",
                            where="sensitivity_seqs")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise BadInputError("exists and is not a folder", where=str(out))
    if not out.exists() and not out.parent.is_dir():
        raise BadInputError(f"parent folder {out.parent} does not exist", where=str(out))

    # Validate the source (layout, config, shapes) before the heavy imports.
    src_path = Path(source_dir)
    with open_official_source(src_path, "calibrate (the transformers reference model)") as src:
        cfg = src.config
        fingerprint = src.fingerprint()
    if isinstance(tokens, (str, os.PathLike)):
        seqs = read_tokens(tokens, cfg.vocab_size, cfg.max_position_embeddings)
        tokens_file = Path(tokens).name
    else:
        if not isinstance(tokens, Sequence) or not all(isinstance(s, Sequence) for s in tokens):
            raise BadInputError("tokens must be a token file path or a list of token-id lists", where="tokens")
        seqs = tuple(_check_seq(s, cfg.vocab_size, cfg.max_position_embeddings, "tokens", f"sequence {i}")
                     for i, s in enumerate(tokens))
        if not seqs:
            raise BadInputError("no token sequences given", where="tokens")
        tokens_file = "<in-memory>"
    check_dependencies(cfg.expert_dtype is not None or cfg.fp8_block is not None, needed_by="calibrate")
    out.mkdir(exist_ok=True)

    n_layer, n_expert, k = cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_experts_per_tok
    hash_layers = tuple(i for i, t in enumerate(cfg.mlp_layer_types) if t == HASH_MOE)
    tot = _Totals(n_layer, n_expert, cfg.hidden_size, cfg.moe_intermediate_size)
    workers = min(threads, len(seqs))
    t0 = time.monotonic()
    done_tokens = 0
    meter = Meter("calibrate", len(seqs), "sequence", total_work=sum(len(s) for s in seqs))
    if workers == 1:
        with torch_threads(1):
            collector = _Collector(load_reference(src_path))
            try:
                for i, ids in enumerate(seqs):
                    tot.add(collector.run(ids))
                    done_tokens += len(ids)
                    ev = meter.step(f"sequence {i}", work=len(ids), tokens=done_tokens)
                    if progress is not None:
                        progress(ev)
            finally:
                collector.close()
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        from concurrent.futures.process import BrokenProcessPool

        # spawn: forking a process whose torch threads have started is unsafe. A
        # worker that fails to start breaks the pool (no endless respawn).
        ctx = multiprocessing.get_context("spawn")
        try:
            with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init,
                                     initargs=(str(src_path),)) as pool:
                for i, part in enumerate(pool.map(_worker_run, seqs)):
                    tot.add(part)  # map yields in sequence order: the fold order is fixed
                    done_tokens += part.tokens
                    ev = meter.step(f"sequence {i}", work=part.tokens, tokens=done_tokens)
                    if progress is not None:
                        progress(ev)
        except BrokenProcessPool:
            raise RuntimeError("a calibration worker process died; rerun with threads=1 to see why") from None
    seconds = time.monotonic() - t0

    # Every token fills k slots in every layer; anything else means the hooks missed a call.
    totals = tot.slots.sum(axis=1)
    if not np.all(totals == tot.tokens * k) or not np.array_equal(tot.slots, tot.rows):
        raise RuntimeError(f"calibration bookkeeping failed: slots per layer {totals.tolist()}, "
                           f"expected {tot.tokens * k}")  # a bug, not user input

    im = _build_imatrix(tot, n_layer, [len(s) for s in seqs], tokens_file)
    tokens_sha = _tokens_sha256(seqs)
    profile = RoutingProfile(
        n_layer, n_expert, k, tot.slots.astype(np.uint64), tokens=tot.tokens,
        source={"model": src_path.name, "fingerprint": fingerprint, "tokens_file": tokens_file,
                "tokens_sha256": tokens_sha, "sequences": len(seqs), "hash_layers": list(hash_layers),
                "reference": "transformers DeepseekV4ForCausalLM fp32 eager, batch 1"},
    )
    write_imatrix_gguf(out / IMATRIX_FILE, im)
    write_imatrix_lucebox(out / IMATRIX_LUCEBOX_FILE, im)
    write_routing_json(out / ROUTING_JSON, profile)
    write_routing_csv(out / ROUTING_CSV, profile)
    files = {"imatrix": IMATRIX_FILE, "imatrix_lucebox": IMATRIX_LUCEBOX_FILE, "routing_csv": ROUTING_CSV,
             "routing_json": ROUTING_JSON}
    if sensitivity_seqs:
        from ds4quant.calib.sensitivity import SENSITIVITY_FILE, write_sensitivity
        from ds4quant.calibrate.sensitivity import measure_sensitivity

        t1 = time.monotonic()
        with torch_threads(1):
            sens = measure_sensitivity(load_reference(src_path), seqs[:sensitivity_seqs], im, tot.slots,
                                       fingerprint=fingerprint, tokens_sha256=tokens_sha)
        write_sensitivity(out / SENSITIVITY_FILE, sens)
        files["sensitivity"] = SENSITIVITY_FILE
        seconds += time.monotonic() - t1

    unreached = {}
    for layer in range(n_layer):
        never = tuple(int(e) for e in np.nonzero(tot.rows[layer] == 0)[0])
        for s in SURFACES:
            unreached[expert_tensor(layer, s)] = never
    sha = {}
    for name in files.values():
        sha[name] = hashlib.sha256((out / name).read_bytes()).hexdigest()
    report = CalibrationReport(
        out_dir=str(out), source=src_path.name, fingerprint=fingerprint, tokens_file=tokens_file,
        tokens_sha256=tokens_sha, sequences=len(seqs), tokens=tot.tokens, n_layer=n_layer, n_expert=n_expert,
        n_expert_used=k, hash_layers=hash_layers, unreached=MappingProxyType(unreached),
        dense_tensors=tuple(sorted(tot.dense)),
        files=MappingProxyType({**files, "report": REPORT_FILE}),
        sha256=MappingProxyType(sha), versions=MappingProxyType(_versions()), seconds=seconds, threads=workers,
    )
    atomic_write_json(out / REPORT_FILE, report.to_json())
    return report

