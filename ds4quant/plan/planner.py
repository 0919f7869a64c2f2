"""Adaptive recipes: measure every candidate qtype, then allocate under a budget.

For every routed-expert matrix (layer, surface, expert) and every candidate
qtype, ``measure`` encodes the source with the encoder the artifact will use
(importance-weighted when an imatrix is given; MIX types with codebooks fitted
for that expert and surface) and records the squared error, weighted per
input column by the imatrix (E[x^2], the diagonal of the activation second
moment, so sum_c imp_c * dw_c^2 estimates the output error). Experts are then
weighted by routing frequency: f_e = E * (count_e + 1) / (sum counts + E), so
the weights average 1 and never-routed experts still count a little.

``resolve`` turns the measurements into items for ``allocate.allocate``:
one item per (layer, surface) with granularity "tensor" (one qtype per
tensor, the Lucebox layout), or per expert with granularity "expert" (a
layer's experts may differ; each qtype's experts form a compact stack).

Measurements and fitted codebooks are cached on disk under a key that covers
the source, the imatrix and the fitter settings, so another target reuses
them and an interrupted measurement resumes.
"""

from __future__ import annotations

import hashlib
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

import numpy as np

from ds4quant import __version__
from ds4quant.plan.cache import CACHE_VERSION, Cache, load_books, save_books, default_cache_dir
from ds4quant.plan.summary import plan_info, predicted_kl, weighted_error  # noqa: F401 (weighted_error: public)
from ds4quant.plan.workers import check_device, default_jobs, ordered_map, resolve_device, worker_stream
from ds4quant.plan.allocate import Allocation, Candidate, Item, allocate
from ds4quant.errors import BadInputError, BudgetError, UnknownQTypeError
from ds4quant.formats.search import torch_scale as sst
from ds4quant.formats import decode, encode, get_qtype
from ds4quant.metrics import error_sums
from ds4quant.names import stack_name
from ds4quant.progress import Meter, ProgressFn

if TYPE_CHECKING:
    from ds4quant.sources.base import Source

DEFAULT_CANDIDATES = ("rocmfp2", "rocmfp2_mix", "rocmfp3", "rocmfp3_mix", "rocmfp4_fast", "rocmfp4")
GRANULARITIES = ("tensor", "expert")
FITTERS = ("optimized", "reference")


@dataclass(frozen=True)
class AdaptiveOptions:
    """How to measure and allocate.

    target_bpw: routed-expert bits per weight to land on (tensor payload);
    max_bytes: or a cap on all tensor data plus codebook tables, in bytes;
    lucebox: keep the result loadable by Lucebox at tensor granularity (no
    rocmfp3_mix on gate/up); fit_*: fit_optimized effort per expert;
    sensitivity: a ``sensitivity.json`` (``ds4quant.sensitivity``) whose
    per-tensor KL gains turn the weighted errors into predicted KL before
    allocating (without it every tensor's weighted error counts the same).
    jobs: experts measured at once (None: convert's threads); device: "cpu"
    or "cuda[:N]" for the MIX and scale searches (adaptive_jobs says what
    moves). Neither changes a figure, a plan or a byte.
    """

    target_bpw: Optional[float] = None
    max_bytes: Optional[int] = None
    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    granularity: str = "tensor"
    fitter: str = "optimized"
    routing: Optional[str] = None
    cache_dir: Optional[str] = None
    lucebox: bool = True
    fit_iterations: int = 6
    fit_restarts: int = 1
    fit_max_rows: int = 512
    sensitivity: Optional[str] = None
    jobs: Optional[int] = None
    device: str = "cpu"

    def validate(self) -> "AdaptiveOptions":
        if (self.target_bpw is None) == (self.max_bytes is None):
            raise BadInputError("the adaptive recipe needs exactly one of --target-bpw or --max-bytes")
        if self.target_bpw is not None and not (0 < self.target_bpw < 64):
            raise BadInputError(f"--target-bpw must be in (0, 64), got {self.target_bpw}")
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise BadInputError(f"--max-bytes must be positive, got {self.max_bytes}")
        if self.granularity not in GRANULARITIES:
            raise BadInputError(f"--granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.fitter not in FITTERS:
            raise BadInputError(f"--fitter must be one of {FITTERS}, got {self.fitter!r}")
        if not self.candidates:
            raise BadInputError("--candidates is empty")
        for q in self.candidates:
            try:
                qt = get_qtype(q)
            except UnknownQTypeError as exc:
                raise BadInputError(exc.message, where="--candidates", hint=exc.hint) from None
            if not qt.can_encode or qt.block_size != 32:
                raise BadInputError(f"{q} cannot be an expert candidate", where="--candidates")
        if len(set(self.candidates)) != len(self.candidates):
            raise BadInputError("--candidates lists a qtype twice")
        if self.jobs is not None and self.jobs < 1:
            raise BadInputError(f"--jobs must be >= 1, got {self.jobs}")
        check_device(self.device)
        return self

    def key(self) -> dict:
        """What a measurement depends on (not the budget: targets share it)."""
        d = {"candidates": sorted(self.candidates), "fitter": self.fitter}
        if self.fitter == "optimized":
            d.update(iterations=self.fit_iterations, restarts=self.fit_restarts, max_rows=self.fit_max_rows)
        return d


@dataclass(frozen=True)
class Measure:
    """One (tensor, expert, qtype): payload bytes and float64 error sums.

    wsse/wssx are weighted per column by importance (ones without any);
    ref_wsse: for MIX with the optimized fitter, the same error with the
    reference fitter's books (None otherwise)."""

    nbytes: int
    sse: float
    ssx: float
    wsse: float
    wssx: float
    ref_wsse: Optional[float] = None


def expert_weights(counts: Optional[np.ndarray], n_expert: int) -> np.ndarray:
    """Routing weights f_e (mean 1) from one layer's activation counts."""
    if counts is None:
        return np.ones(n_expert)
    c = np.asarray(counts, dtype=np.float64)
    return n_expert * (c + 1.0) / (c.sum() + n_expert)


class Books:
    """Fitted MIX codebooks: (tensor, expert, qtype) -> (books (2, L), mode)."""

    def __init__(self) -> None:
        self._m: dict[tuple[str, int, str], tuple[np.ndarray, int]] = {}

    def put(self, tensor: str, expert: int, qtype: str, books: np.ndarray, mode: int) -> None:
        self._m[(tensor, expert, qtype)] = (np.asarray(books, np.float32), int(mode))

    def get(self, tensor: str, expert: int, qtype: str) -> tuple[np.ndarray, int]:
        return self._m[(tensor, expert, qtype)]

    def __contains__(self, k) -> bool:
        return k in self._m


_LEGACY = False


@contextmanager
def legacy_kernels():
    """Run the measure stage on its pre-issue-14 kernels (MIX encode per
    candidate with a binary-search NL, encode + decode + unpack per Lloyd
    step, numpy Lloyd and bf16 repair): the same figures, books and plan,
    slower. The anchor that benchmarks/adaptive.py times in the same run."""
    global _LEGACY
    from ds4quant.codebooks import histogram
    from ds4quant.formats import rocmfp_mix

    old = (_LEGACY, rocmfp_mix._LEGACY_ENCODE, histogram._LEGACY_LLOYD)
    _LEGACY = rocmfp_mix._LEGACY_ENCODE = histogram._LEGACY_LLOYD = True
    try:
        yield
    finally:
        _LEGACY, rocmfp_mix._LEGACY_ENCODE, histogram._LEGACY_LLOYD = old


def _fit_books(x: np.ndarray, qtype: str, imp: Optional[np.ndarray], opts: AdaptiveOptions, seed: str, device=None,
               resident=None):
    """(books, mode, ref_books_error or None, the encoder's choices for them
    on x or None) for one expert matrix."""
    from ds4quant.codebooks import fit_optimized, fit_reference

    L = get_qtype(qtype).codebook_levels
    if opts.fitter == "reference":
        books, _ = fit_reference([x], L, imp)
        return books, 1, None, None
    fit = fit_optimized([x], qtype, imp, seed=seed, iterations=opts.fit_iterations,
                        restarts=opts.fit_restarts, max_rows=opts.fit_max_rows,
                        impl="legacy" if _LEGACY else "fast", device=None if _LEGACY else device,
                        inputs=None if resident is None else [resident.halves()])
    return fit.books, fit.mode, fit.reference_error, fit.encoding


def _on_device(qt, device) -> bool:
    """Whether ``measure_matrix`` runs ``qt``'s search on ``device``."""
    return device is not None and not _LEGACY and (qt.is_mix or sst.covers(qt.name))


def measure_matrix(x: np.ndarray, imp: Optional[np.ndarray], err_w: np.ndarray, qtype: str,
                   opts: AdaptiveOptions, seed: str, device=None,
                   resident=None) -> tuple[Measure, Optional[tuple[np.ndarray, int]]]:
    """Encode ``x`` (float32 (rows, cols)) as ``qtype`` the way convert will;
    return its Measure and, for MIX, the (books, mode) it used. ``device``
    (a torch device or None) runs the MIX search and the scale search of
    the types ``_scale_search_torch`` covers there, the same bytes, on the
    matrix ``resident`` holds there (``adaptive_device.Resident``; made here
    when not given). The error, weighted per column by ``err_w``, is taken
    here and only here."""
    qt = get_qtype(qtype)
    books = None
    ref = None
    s = None
    if resident is None and _on_device(qt, device):
        from ds4quant.plan.resident import Resident

        resident = Resident(x, imp, err_w, device)
    if qt.is_mix:
        b, mode, ref_err, enc = _fit_books(x, qtype, imp, opts, seed, device, resident)
        nbytes = x.shape[0] * qt.row_bytes(x.shape[1])
        if enc is not None and not isinstance(enc[0], np.ndarray):
            # the fitter's choices stayed on the device: decode and sum there
            from ds4quant.formats.search.triton_mix import decode_device

            s = resident.sums(decode_device(enc, b, mode, 2 if qt.codebook_levels == 4 else 3))
        elif enc is not None:  # the fitter searched every row with these books: decode its choices
            from ds4quant.formats.search.numba_fit import decode_choices

            y = decode_choices(qt, enc, x.shape, b, mode)
        else:
            if device is not None and not _LEGACY:
                from ds4quant.formats.search.torch_mix import encode_torch

                data = encode_torch(qt.name, x, imp, b, mode, device)
            else:
                data = encode(qt, x, imp, b, mode=mode)
            y = decode(qt, data, x.shape[1], b, modes=mode)
            nbytes = int(data.nbytes)
        books = (b, mode)
        # fit_optimized weighs its reference error by the raw importance (ones
        # without); it compares with wsse only where err_w is that same weight
        same_weights = np.array_equal(err_w, imp) if imp is not None else bool(np.all(err_w == 1.0))
        if ref_err is not None and same_weights:
            ref = ref_err
    elif _on_device(qt, device):
        from ds4quant.formats import encode_input

        encode_input(qt, x, imp)  # encode's refusals
        q = resident.Q
        nbytes, Y = sst.measure_on(qt.name, resident.X, q, None if q is None else resident.sigma2())
        s = resident.sums(Y)  # searched, decoded and summed on the device
    else:
        data = encode(qt, x, imp)
        y = decode(qt, data, x.shape[1])
        nbytes = int(data.nbytes)
    if s is None:
        s = error_sums(x, y, err_w)
    return Measure(nbytes, s.sse, s.ssx, s.wsse, s.wssx, ref), books


#: --device cuda measures matrices of fewer weights on the CPU cores (the same
#: bytes): there each search is a launch and a wait, and the workers' Python
#: costs more than numba's kernels (benchmarks/adaptive_crossover.py)
DEVICE_MIN_WEIGHTS = 1 << 20


def measure_candidates(x: np.ndarray, imp: Optional[np.ndarray], err_w: np.ndarray, qtypes: Sequence[str],
                       opts: AdaptiveOptions, seed: str, device=None) -> list:
    """[(qtype, Measure, (books, mode) or None)] of one expert matrix for each
    of ``qtypes`` in order (``measure_matrix``), the matrix uploaded to
    ``device`` once for all of them (a CUDA device takes matrices of at least
    ``DEVICE_MIN_WEIGHTS`` weights); call it inside ``worker_stream(device)``."""
    if device is not None and getattr(device, "type", None) == "cuda" and x.size < DEVICE_MIN_WEIGHTS:
        device = None
    resident = None
    if any(_on_device(get_qtype(q), device) for q in qtypes):
        from ds4quant.plan.resident import Resident

        resident = Resident(x, imp, err_w, device)  # measure_matrix reads it for the device's candidates only
    return [(q, *measure_matrix(x, imp, err_w, q, opts, seed=seed, device=device, resident=resident))
            for q in qtypes]


@dataclass(frozen=True)
class Measurements:
    """All measures: (tensor, expert, qtype) -> Measure, and the routing weights."""

    measures: Mapping[tuple[str, int, str], Measure]
    weights: Mapping[str, np.ndarray]  # tensor -> f_e per expert
    seconds: float
    reused: int


def measure(src: "Source", expert_tensors: Sequence[tuple], opts: AdaptiveOptions, imatrix,
            imatrix_sha: Optional[str], routing, books: Books, progress: Optional[ProgressFn] = None) -> Measurements:
    """Measure every candidate on every expert of ``expert_tensors``.

    expert_tensors: (TensorChoice-like with .name/.layer/.surface, members)
    pairs for the routed-expert tensors the allocation decides.
    """
    from ds4quant.imatrix import importance_for

    t0 = time.perf_counter()
    key_obj = {"v": CACHE_VERSION, "tool": __version__, "source": src.fingerprint(), "imatrix": imatrix_sha,
               "opts": opts.key()}
    key = hashlib.sha256(json.dumps(key_obj, sort_keys=True).encode()).hexdigest()
    root = Path(opts.cache_dir) if opts.cache_dir else default_cache_dir()
    cache = Cache(root, key)
    cache.load()
    out: dict[tuple[str, int, str], Measure] = {}
    weights: dict[str, np.ndarray] = {}
    reused = 0
    meter = Meter("measure", sum(len(m) for _, m in expert_tensors), "expert")
    jobs = opts.jobs if opts.jobs is not None else default_jobs()
    dev = resolve_device(opts.device)
    saved = time.perf_counter()
    new = False
    prepared = []  # per tensor: (choice, members, importance per expert, fallback weights, candidates)
    for choice, members in expert_tensors:
        n_exp = len(members)
        counts = None
        if routing is not None and choice.layer is not None and choice.layer < routing.counts.shape[0]:
            counts = routing.counts[choice.layer]
            if counts.shape[0] != n_exp:
                raise BadInputError(f"routing profile has {counts.shape[0]} experts, the model {n_exp}",
                                    where=str(opts.routing))
        weights[choice.name] = expert_weights(counts, n_exp)
        cols = choice.shape[0]
        imps = [importance_for(imatrix, choice.name, m.expert, cols=cols) if imatrix is not None else None
                for m in members]
        # error weights for experts calibration never reached: the mean of the rest
        seen = [q for q in imps if q is not None]
        fallback = (np.mean(np.stack(seen), axis=0) if seen else np.ones(cols)).astype(np.float64)
        fitting = [q for q in opts.candidates if _fits(q, cols)]
        load_books(cache, choice.name, books)
        prepared.append((choice, members, imps, fallback, fitting))

    def tasks():
        # read on this thread, in order, across tensor boundaries (the workers
        # never wait for a tensor's last expert); each payload is independent
        for ti, (choice, members, imps, fallback, fitting) in enumerate(prepared):
            for i, (m, imp) in enumerate(zip(members, imps)):
                need = [q for q in fitting
                        if f"{choice.name}|{m.expert}|{q}" not in cache.data
                        or (get_qtype(q).is_mix and (choice.name, m.expert, q) not in books)]
                if not need:
                    yield (ti, i), None
                    continue
                x = np.ascontiguousarray(src.read_dequantized(m.name), dtype=np.float32)
                src.release(m.name)  # x is a copy: the pages may go
                err_w = imp.astype(np.float64) if imp is not None else fallback
                yield (ti, i), (x, imp, err_w, need, f"{choice.name}/{m.expert}")

    fresh = [False] * len(prepared)
    for (ti, i), res in ordered_map(tasks(), lambda p: _measure_expert(p, opts, dev), jobs):
        choice, members, _, _, fitting = prepared[ti]
        m = members[i]
        if res is None:
            reused += 1
        else:  # recorded in expert order whatever finished first
            new = True
            for q, meas, bk in res:
                cache.data[f"{choice.name}|{m.expert}|{q}"] = [meas.nbytes, meas.sse, meas.ssx, meas.wsse,
                                                              meas.wssx, meas.ref_wsse]
                if bk is not None:
                    books.put(choice.name, m.expert, q, *bk)
                    fresh[ti] = True
        for q in fitting:
            v = cache.data[f"{choice.name}|{m.expert}|{q}"]
            out[(choice.name, m.expert, q)] = Measure(int(v[0]), *map(float, v[1:5]),
                                                      None if v[5] is None else float(v[5]))
        ev = meter.step(choice.name, expert=m.expert)
        if progress is not None:
            progress(ev)
        if i == len(members) - 1:  # the tensor is complete
            if fresh[ti]:
                save_books(cache, choice.name, [e.expert for e in members], fitting, books)
            # the JSON grows with the run: rewrite it every _SAVE_EVERY_S, not per tensor
            if new and time.perf_counter() - saved >= _SAVE_EVERY_S:
                cache.save()
                saved, new = time.perf_counter(), False
    if new:
        cache.save()
    return Measurements(out, weights, time.perf_counter() - t0, reused)


_SAVE_EVERY_S = 20.0


def _measure_expert(payload, opts: AdaptiveOptions, device) -> list:
    """[(qtype, Measure, books or None)] for one expert matrix, in ``need`` order."""
    x, imp, err_w, need, seed = payload
    with worker_stream(device):
        return measure_candidates(x, imp, err_w, need, opts, seed, device)


def allowed_candidates(opts: AdaptiveOptions, surface: str) -> tuple[str, ...]:
    """Lucebox loads rocmfp3_mix (105) on down experts only (P4MIXv1)."""
    if opts.granularity == "tensor" and opts.lucebox and surface != "down":
        return tuple(q for q in opts.candidates if get_qtype(q).ggml_type != 105)
    return tuple(opts.candidates)


@dataclass(frozen=True)
class Decision:
    """The allocation outcome for one routed-expert tensor: qtype per expert
    (a single qtype at tensor granularity) and its predicted weighted error."""

    name: str
    qtypes: tuple[str, ...]  # per expert, global order
    predicted_error: float
    nbytes: int


def resolve(expert_tensors: Sequence[tuple], meas: Measurements, opts: AdaptiveOptions,
            budget: int, gains: Optional[Mapping[str, float]] = None) -> tuple[dict[str, Decision], Allocation]:
    """Allocate qtypes under ``budget`` bytes of routed-expert payload,
    minimising the weighted error, or with ``gains`` (tensor -> KL per unit
    of weighted error) the predicted KL. Decisions keep the weighted error."""
    items = []
    for choice, members in expert_tensors:
        w = meas.weights[choice.name] * (1.0 if gains is None else gains[choice.name])
        allowed = tuple(q for q in allowed_candidates(opts, choice.surface)
                        if (choice.name, members[0].expert, q) in meas.measures)
        if not allowed:
            raise BadInputError(f"no candidate qtype is allowed on {choice.surface} experts", where="--candidates")
        if opts.granularity == "tensor":
            cands = []
            for q in allowed:
                ms = [meas.measures[(choice.name, m.expert, q)] for m in members]
                cands.append(Candidate(q, sum(x.nbytes for x in ms), float(sum(wi * x.wsse for wi, x in zip(w, ms)))))
            items.append(Item(choice.name, tuple(cands)))
        else:
            for i, m in enumerate(members):
                cands = tuple(Candidate(q, meas.measures[(choice.name, m.expert, q)].nbytes,
                                        float(w[i] * meas.measures[(choice.name, m.expert, q)].wsse)) for q in allowed)
                items.append(Item(f"{choice.name}#{m.expert}", cands))
    alloc = allocate(items, budget)
    out = {}
    for choice, members in expert_tensors:
        w = meas.weights[choice.name]
        if opts.granularity == "tensor":
            q = alloc.choice[choice.name]
            qs = tuple(q for _ in members)
        else:
            qs = tuple(alloc.choice[f"{choice.name}#{m.expert}"] for m in members)
        err = float(sum(wi * meas.measures[(choice.name, m.expert, q)].wsse for wi, m, q in zip(w, members, qs)))
        nb = sum(meas.measures[(choice.name, m.expert, q)].nbytes for m, q in zip(members, qs))
        out[choice.name] = Decision(choice.name, qs, err, nb)
    return out, alloc


# ----------------------------------------------------------------------------
# from measurements to a plan


def _fits(qtype: str, cols: int) -> bool:
    qt = get_qtype(qtype)
    return cols % max(qt.block_size, qt.row_multiple) == 0


def plan_adaptive(src: "Source", plan, members, opts: AdaptiveOptions, imatrix, imatrix_sha, books: Books,
                  progress: Optional[ProgressFn] = None):
    """Replace the plan's "adaptive" routed-expert choices with measured,
    budgeted qtypes. Returns (new plan, info dict for reports, the measured
    figures: (tensor, expert, qtype) -> Measure, which convert records for
    the chosen encodings instead of decoding them again)."""
    from dataclasses import replace

    routing = None
    if opts.routing is not None:
        from ds4quant.routing import read_routing

        routing = read_routing(opts.routing)
        if routing.counts.shape[0] != src.config.num_hidden_layers:
            raise BadInputError(f"routing profile has {routing.counts.shape[0]} layers, the model "
                                f"{src.config.num_hidden_layers}", where=str(opts.routing))
    todo = [(c, members[c.name]) for c in plan if c.qtype == "adaptive"]
    if not todo:
        raise BadInputError("the adaptive recipe has no routed-expert tensor left to decide",
                            hint="a --tensor-type override fixed all of them")
    # a candidate must fit every tensor it may go to (rocmfp2_mix needs in % 128)
    for c, _ in todo:
        bad = [q for q in opts.candidates if not _fits(q, c.shape[0])]
        if len(bad) == len(opts.candidates):
            raise BadInputError(f"no candidate qtype fits row length {c.shape[0]}", where=c.name)
    expert_weights_total = sum(int(np.prod(c.shape)) for c in plan if c.tensor_class == "routed_expert")
    fixed = sum(get_qtype(c.qtype).nbytes(int(np.prod(c.shape))) for c in plan
                if c.tensor_class == "routed_expert" and c.qtype != "adaptive")
    if opts.target_bpw is not None:
        budget = int(opts.target_bpw * expert_weights_total // 8) - fixed
        budget_what = f"target {opts.target_bpw} bpw over {expert_weights_total:,} routed-expert weights"
    else:
        dense = sum(get_qtype(c.qtype).nbytes(int(np.prod(c.shape))) for c in plan
                    if c.tensor_class != "routed_expert")
        n_exp = sum(c.shape[2] for c, _ in todo)
        books_bound = 2 * (33 * n_exp + 128 * len(todo)) + 4096  # own table + Lucebox blobs, upper bound
        budget = opts.max_bytes - dense - fixed - books_bound
        budget_what = f"max {opts.max_bytes:,} bytes minus {dense:,} dense, {books_bound:,} codebook bound"
    if budget <= 0:
        raise BudgetError(f"no bytes left for the routed experts ({budget_what})",
                          hint="raise --target-bpw / --max-bytes")

    gains = None
    if opts.sensitivity is not None:
        from ds4quant.sensitivity import read_sensitivity

        sens = read_sensitivity(opts.sensitivity, fingerprint=src.fingerprint())
        gains = {c.name: sens.gain(c.name) for c, _ in todo}
    meas = measure(src, todo, opts, imatrix, imatrix_sha, routing, books, progress)
    decisions, alloc = resolve(todo, meas, opts, budget, gains)

    new_plan = []
    for c in plan:
        if c.qtype != "adaptive":
            new_plan.append(c)
            continue
        d = decisions[c.name]
        rule = f"adaptive:{'bpw=' + str(opts.target_bpw) if opts.target_bpw is not None else 'bytes=' + str(opts.max_bytes)}"
        groups: dict[str, list[int]] = {}
        for m, q in zip(members[c.name], d.qtypes):
            groups.setdefault(q, []).append(m.expert)
        if len(groups) == 1:
            (q,) = groups
            new_plan.append(replace(c, qtype=q, rule=rule, predicted_error=d.predicted_error))
            continue
        w = meas.weights[c.name]
        for q in opts.candidates:  # a stable order: the candidate order
            if q not in groups:
                continue
            ids = tuple(groups[q])
            err = float(sum(w[e] * meas.measures[(c.name, e, q)].wsse for e in ids))
            new_plan.append(replace(c, name=stack_name(c.layer, c.surface, q), qtype=q, rule=rule, experts=ids,
                                    shape=(c.shape[0], c.shape[1], len(ids)), predicted_error=err))
    info = plan_info(todo, meas, opts, alloc, budget, budget_what, fixed, expert_weights_total, decisions, imatrix)
    if gains is not None:
        predicted_kl(info, todo, meas, decisions, gains)
    return new_plan, info, meas.measures
