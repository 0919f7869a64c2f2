"""The measure stage: every candidate qtype on every expert of the tensors the
allocation decides, through the measurement cache.

For every routed-expert matrix (layer, surface, expert) and every candidate
qtype, an ``ExpertJob`` encodes the source with the encoder the artifact will
use (importance-weighted when an imatrix is given; MIX types with codebooks
fitted for that expert and surface) and records the squared error, weighted
per input column by the imatrix (E[x^2], the diagonal of the activation
second moment, so sum_c imp_c * dw_c^2 estimates the output error). Experts
are weighted by routing frequency (``records.expert_weights``).

Matrices are read on the calling thread in order and measured on ``jobs``
workers (``workers.ordered_map``); results are recorded in expert order, so
nothing depends on the worker count or the device. Measurements and fitted
codebooks are cached on disk under a key that covers the source, the imatrix
and the fitter settings, so another target reuses them and an interrupted
measurement resumes.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from ds4quant.version import VERSION
from ds4quant.errors import BadInputError
from ds4quant.formats import get_qtype
from ds4quant.formats.search import Backend
from ds4quant.plan.cache import CACHE_VERSION, Cache, check_cache_dir, default_cache_dir, load_books, save_books
from ds4quant.plan.job import measure_candidates
from ds4quant.plan.options import AdaptiveOptions
from ds4quant.plan.records import Books, Measure, Measurements, expert_weights
from ds4quant.plan.workers import default_jobs, ordered_map, worker_stream
from ds4quant.progress import Meter, ProgressFn

if TYPE_CHECKING:
    from ds4quant.sources.base import Source

# the cache's JSON grows with the run: rewritten this often, not per tensor
_SAVE_EVERY_S = 20.0


def fits(qtype: str, cols: int) -> bool:
    """Whether ``qtype`` encodes rows of ``cols`` values (rocmfp2_mix needs cols % 128 == 0)."""
    qt = get_qtype(qtype)
    return cols % max(qt.block_size, qt.row_multiple) == 0


def measure(src: "Source", expert_tensors: Sequence[tuple], opts: AdaptiveOptions, imatrix,
            imatrix_sha: Optional[str], routing, books: Books, progress: Optional[ProgressFn] = None) -> Measurements:
    """Measure every candidate on every expert of ``expert_tensors``; fitted
    MIX books go into ``books``.

    expert_tensors: (TensorChoice-like with .name/.layer/.surface, members)
    pairs for the routed-expert tensors the allocation decides.
    """
    from ds4quant.calib.imatrix import importance_for

    t0 = time.perf_counter()
    key_obj = {"v": CACHE_VERSION, "tool": VERSION, "source": src.fingerprint(), "imatrix": imatrix_sha,
               "opts": opts.key()}
    key = hashlib.sha256(json.dumps(key_obj, sort_keys=True).encode()).hexdigest()
    root = check_cache_dir(opts.cache_dir) if opts.cache_dir else check_cache_dir(default_cache_dir(),
                                                                                  "$DS4QUANT_CACHE")
    cache = Cache(root, key)
    cache.load()
    out: dict[tuple[str, int, str], Measure] = {}
    weights: dict[str, np.ndarray] = {}
    reused = 0
    # convert encodes after the plan is made: the last measured expert is not the end
    meter = Meter("measure", sum(len(m) for _, m in expert_tensors), "expert", then=("planning and encoding",))
    jobs = opts.jobs if opts.jobs is not None else default_jobs()
    backend = opts.backend()
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
        fitting = [q for q in opts.candidates if fits(q, cols)]
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
    for (ti, i), res in ordered_map(tasks(), lambda p: _measure_expert(p, opts, backend), jobs):
        choice, members, _, _, fitting = prepared[ti]
        m = members[i]
        if res is None:
            reused += 1
        else:  # recorded in expert order whatever finished first
            new = True
            for q, meas, bk in res:
                cache.data[f"{choice.name}|{m.expert}|{q}"] = meas.to_json()
                if bk is not None:
                    books.put(choice.name, m.expert, q, *bk)
                    fresh[ti] = True
        for q in fitting:
            out[(choice.name, m.expert, q)] = Measure.from_json(cache.data[f"{choice.name}|{m.expert}|{q}"])
        ev = meter.step(choice.name, expert=m.expert)
        if progress is not None:
            progress(ev)
        if i == len(members) - 1:  # the tensor is complete
            if fresh[ti]:
                save_books(cache, choice.name, [e.expert for e in members], fitting, books)
            if new and time.perf_counter() - saved >= _SAVE_EVERY_S:
                cache.save()
                saved, new = time.perf_counter(), False
    if new:
        cache.save()
    return Measurements(out, weights, time.perf_counter() - t0, reused)


def _measure_expert(payload, opts: AdaptiveOptions, backend: Backend) -> list:
    """[(qtype, Measure, books or None)] for one expert matrix, in ``need`` order."""
    x, imp, err_w, need, seed = payload
    with worker_stream(backend):
        return measure_candidates(x, imp, err_w, need, opts, seed, backend)
