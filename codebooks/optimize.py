"""ds4quant's own codebook fitter: Lloyd against the MIX encoder itself.

The reference fitter (docs/formats.md#mix-fitter) clusters max-normalised values in a histogram; the
encoder (docs/formats.md#mix-encoder) then picks, per half, a book and a UE4M3 scale from a window,
so the books it is given are not the books that minimise its error.
``fit_optimized`` closes that loop, for one expert's book pair:

1. Starts: the reference books, evenly spaced levels, and ``restarts``
   jittered copies of the reference (jitter seeded from ``seed``, a stable
   identity such as "blk.3.ffn_down_exps/17", so any worker gets the bytes).
2. Each start runs ``iterations`` rounds of: encode + decode with the MIX
   encoder; for the (book, scale S, code j) the encoder chose per weight, set
   level[b][j] = sum(w S x) / sum(w S^2), the exact least-squares level for
   those choices (w = the importance, raw as the encoder uses it); rescale
   each book by a power of two so max|level| is in (0.5, 1] (a scale byte
   moves by 8 per octave, so this is free), bf16-round and repair (docs/formats.md#mix-fitter).
3. The error of a candidate is sum_c q_c (x - decode(encode(x)))^2 in float64
   over every matrix (q = 1 without importance). The result is the best of the
   reference books, the best refined books and fixed levels (mode 0), so it
   is never worse than ``fit_reference`` on the data it was given.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numba
import numpy as np

from ds4quant import formats
from ds4quant.codebooks.histogram import (_bf16_repair, _bf16_repair_fast, _bf16_repair_nb, _check_importance,
                                          _check_matrix, _importance_list, fit_reference)
from ds4quant.errors import BadInputError, CodebookError
from ds4quant.formats import search
from ds4quant.formats.bits import unpack_bits
from ds4quant.formats.search import NUMBA, Backend, Tier
from ds4quant.formats.ue4m3 import UE4M3


@dataclass(frozen=True)
class OptimizedFit:
    """books float32 (2, L) bf16-exact and strictly increasing (valid for both
    modes); mode 1 (codebook) or 0 (fixed levels); errors as in the module doc
    (reference_error is None when the reference fitter refused the data)."""

    books: np.ndarray
    mode: int
    error: float
    reference_error: Optional[float]
    fixed_error: float
    refined_error: float
    # the encoder's choices for (books, mode) on every row of the single
    # matrix, per half (book int64 (G,), byte int64 (G,), codes uint8 (G, 16);
    # uint8 torch tensors where the evaluations ran on the Triton tier), when
    # the fast fitter evaluated them there: what encoding it again gives
    encoding: Optional[tuple] = field(default=None, compare=False, repr=False)


def _project(levels: np.ndarray, repair=_bf16_repair) -> np.ndarray:
    """Any finite (2, L) -> bf16-exact, strictly increasing, max|l| in (0.5, 1]."""
    out = []
    for p, book in enumerate(np.asarray(levels, dtype=np.float64)):
        book = np.sort(book)
        ml = float(np.max(np.abs(book)))
        if not (ml > 0 and np.isfinite(ml)):
            book, ml = np.linspace(-1.0, 1.0, len(book)), 1.0
        book = (book * 2.0 ** -np.ceil(np.log2(ml))).astype(np.float32)
        bits, _ = repair(np.clip(book, np.float32(-1), np.float32(1)), p)
        out.append(bits)
    return (np.stack(out).astype(np.uint32) << 16).view(np.float32)


@numba.njit(cache=True, nogil=True)
def _project_nb(books, scales):
    """Scale sorted float64 books (2, L) by their power of two, round to
    float32, clip to [-1, 1] and bf16-repair: (bits int64 (2, L), ok)."""
    L = books.shape[1]
    bits = np.empty((2, L), np.int64)
    ok = True
    c = np.empty(L, np.float32)
    for p in range(2):
        for j in range(L):
            v = np.float32(books[p, j] * scales[p])
            c[j] = min(max(v, np.float32(-1.0)), np.float32(1.0)) if np.isfinite(v) else v
            if not (np.isfinite(c[j]) and abs(c[j]) <= np.float32(1.0)):
                ok = False
        b, _, good = _bf16_repair_nb(c)
        ok = ok and good
        bits[p] = b
    return bits, ok


def _project_fast(levels: np.ndarray) -> np.ndarray:
    """``_project`` with the loops in numba (same bits; the sort is numpy's and
    the power of two still numpy's log2 of the same Python float, so neither
    can differ)."""
    lv = np.sort(np.asarray(levels, dtype=np.float64), axis=1)
    ml0, ml1 = np.abs(lv).max(axis=1).tolist()  # max is exact: the per-book np.max
    if not (ml0 > 0 and math.isfinite(ml0) and ml1 > 0 and math.isfinite(ml1)):
        return _project(levels, _bf16_repair_fast)  # the linspace fallback
    books, ok = _project_books_nb(lv, 2.0 ** -np.ceil(np.log2(ml0)), 2.0 ** -np.ceil(np.log2(ml1)))
    if not ok:
        return _project(levels, _bf16_repair)  # raises the reference's message
    return books


@numba.njit(cache=True, nogil=True)
def _project_books_nb(lv, s0, s1):
    """_project_nb's bits as float32 books (bf16 bits << 16), and ok."""
    scales = np.empty(2)
    scales[0] = s0
    scales[1] = s1
    bits, ok = _project_nb(lv, scales)
    out = np.empty(bits.shape, np.uint32)
    for p in range(2):
        for j in range(bits.shape[1]):
            out[p, j] = np.uint32(bits[p, j]) << np.uint32(16)
    return out.view(np.float32), ok


@numba.njit(cache=True, nogil=True)
def _lloyd_levels_nb(books, num, den):
    """The least-squares levels num / den where a level was used, the input
    level where not: float64 (2, L)."""
    L = books.shape[1]
    out = np.empty((2, L), np.float64)
    for p in range(2):
        for j in range(L):
            i = p * L + j
            out[p, j] = num[i] / den[i] if den[i] > 0 else np.float64(books[p, j])
    return out


class _Problem:
    """The matrices, their importance, and the error / Lloyd statistics of books."""

    def __init__(self, qtype: str, mats: list, imps: list) -> None:
        self.qt = formats.get_qtype(qtype)
        self.mats = mats
        self.imps = imps
        self.bits = 2 if self.qt.codebook_levels == 4 else 3

    def error(self, books: np.ndarray, mode: int) -> float:
        total = 0.0
        for x, q in zip(self.mats, self.imps):
            data = formats.encode(self.qt, x, q, books, mode=mode)
            y = formats.decode(self.qt, data, x.shape[1], books, modes=mode)
            d2 = (x.astype(np.float64) - y) ** 2
            total += float(np.sum(d2 if q is None else d2 * q.astype(np.float64)))
        return total

    def lloyd_step(self, books: np.ndarray) -> tuple[np.ndarray, float]:
        """One encoder-Lloyd round: (updated books, error of the input books)."""
        L = self.qt.codebook_levels
        num = np.zeros(2 * L)
        den = np.zeros(2 * L)
        total = 0.0
        qs = 4 * self.bits
        for x, q in zip(self.mats, self.imps):
            data = formats.encode(self.qt, x, q, books)
            y = formats.decode(self.qt, data, x.shape[1], books)
            w = np.ones(x.shape[1]) if q is None else q.astype(np.float64)
            total += float(np.sum(((x.astype(np.float64) - y) ** 2) * w))
            blk = data.reshape(-1, qs + 2)
            codes = unpack_bits(blk[:, :qs], self.bits, 32).astype(np.int64).reshape(-1, 2, 16)
            meta = blk[:, qs:].astype(np.int64)[:, :, None]
            s = UE4M3[meta & 0x7F].astype(np.float64)
            idx = ((meta >> 7) * L + codes).reshape(-1)
            ww = np.broadcast_to(w.reshape(-1, 2, 16), (x.shape[0], x.shape[1] // 32, 2, 16)).reshape(-1, 2, 16)
            xs = x.astype(np.float64).reshape(-1, 2, 16)
            num += np.bincount(idx, weights=(ww * s * xs).reshape(-1), minlength=2 * L)
            den += np.bincount(idx, weights=np.broadcast_to(ww * s * s, codes.shape).reshape(-1), minlength=2 * L)
        levels = books.astype(np.float64).reshape(-1).copy()
        used = den > 0
        levels[used] = num[used] / den[used]
        return _project(levels.reshape(2, L)), total


class _FastProblem:
    """``_Problem`` with the vectorised MIX search and fused error / Lloyd
    sums: the same float64 figures and books bit for bit, no bytes packed or
    decoded, and each distinct (books, mode) evaluated once."""

    def __init__(self, qtype: str, mats: list, imps: list, backend: Backend = NUMBA, inputs=None) -> None:
        self.qt = formats.get_qtype(qtype)
        self.mats = [np.ascontiguousarray(m, dtype=np.float32) for m in mats]
        self.imps = imps
        self.bits = 2 if self.qt.codebook_levels == 4 else 3
        self.fixed = search.fixed_levels(self.bits)
        self._memo: dict = {}
        self._terms: list = [None] * len(self.mats)  # float64 scratch of the one-pass evaluation
        self._dterms: list = [None] * len(self.mats)  # and of the device search's Lloyd steps
        # (mode, books bytes) -> the choices on the single matrix (set keep: the all-rows problem)
        self.keep = False
        self.kept: dict = {}
        self._kept_min = float("inf")
        # on a device tier the search runs there (the matrices stay resident
        # across the Lloyd steps); the Lloyd steps' float64 sums stay on the
        # host, an error-only evaluation's run there with Triton
        self.backend = backend
        self._dev = None
        if inputs is not None:  # already there (the measure stage uploads an expert once)
            self._dev = list(inputs)
        elif backend.on_device:
            self._dev = [search.to_device(m, q, backend) for m, q in zip(self.mats, imps)]

    def _run(self, books: np.ndarray, mode: int, stats: bool):
        L = self.qt.codebook_levels
        books = np.ascontiguousarray(books, dtype=np.float32)
        num = np.zeros(2 * L)
        den = np.zeros(2 * L)
        total = 0.0
        split = ml = None
        for i, (x, q) in enumerate(zip(self.mats, self.imps)):
            h = x.reshape(-1, 16)
            has_w = q is not None
            wq = q.reshape(-1, 16) if has_w else np.zeros((1, 16), np.float32)
            n1 = np.zeros(2 * L)
            d1 = np.zeros(2 * L)
            if self._dev is None and mode == 1 and search.one_pass(h.shape[0]):
                # one pass: search, error terms, np.sum's order, Lloyd sums
                if split is None:
                    split, ml = search.book_tables(books)
                if self._terms[i] is None:  # reused by every evaluation of this matrix
                    G = h.shape[0]
                    self._terms[i] = (np.empty(h.shape, np.float64), np.empty(G, np.int64), np.empty(G, np.int64),
                                      np.empty((G, 16), np.uint8), np.empty(G, np.int8))
                t, bad, st = search.evaluate_books(h, wq, has_w, books, split, ml, stats, n1, d1, *self._terms[i],
                                                   self.fixed)
                if bad >= 0:
                    status = np.zeros(h.shape[0], np.int8)
                    status[bad] = st
                    search.check_status(self.qt, status, x.shape[1] // 16)
                if self.keep and len(self.mats) == 1 and t < self._kept_min:
                    # the fitter keeps the first least error: only such books can be chosen
                    self._kept_min = t
                    self.kept[(1, books.tobytes())] = tuple(a.copy() for a in self._terms[i][1:4])
                total += float(t)
                num += n1
                den += d1
                continue
            if self._dev is not None:
                if not stats and self.backend.tier is Tier.TRITON:
                    total += self._device_error(i, books, mode)
                    continue
                # on the torch tier shared with the other workers' searches: one set of launches for all
                ob, oe, codes, st = search.choose_mix(*self._dev[i], books, mode, self.bits, self.backend)
            else:
                ob, oe, codes, st = search.choose_mix(x, q, books, mode, self.bits)
            search.check_status(self.qt, st, x.shape[1] // 16)
            if self._dterms[i] is None:  # reused: a fresh 8 bytes a weight per evaluation costs its page faults
                self._dterms[i] = np.empty(h.shape, np.float64)
            terms = self._dterms[i]
            search.terms_stats(h, wq, has_w, books, ob, oe, codes, mode, self.fixed, terms, n1, d1, stats)
            # the legacy figure: np.sum over the (rows, cols) float64 array, in its
            # order by numba (which, unlike numpy's reduction, lets the other workers run)
            t = search.pairwise_sum(terms)
            if self.keep and len(self.mats) == 1 and (mode == 0 or t < self._kept_min):
                if mode == 1:
                    self._kept_min = t
                self.kept[(mode, books.tobytes() if mode == 1 else b"")] = (ob.copy(), oe.copy(), codes.copy())
            total += t
            num += n1
            den += d1
        return total, num, den

    def _device_error(self, i: int, books: np.ndarray, mode: int) -> float:
        """An error without Lloyd sums, all on the device (Triton): the search,
        the float64 terms and np.sum's pairwise total; the choices a kept
        evaluation needs stay there (``OptimizedFit.encoding``)."""
        t, ch = search.mix_error_on_device(*self._dev[i], books, mode, self.qt, self.backend)
        if self.keep and len(self.mats) == 1 and (mode == 0 or t < self._kept_min):
            if mode == 1:
                self._kept_min = t
            self.kept[(mode, books.tobytes() if mode == 1 else b"")] = ch
        return t

    def error(self, books: np.ndarray, mode: int) -> float:
        # mode 0 ignores the books: one evaluation per problem
        key = (mode, books.tobytes() if mode == 1 else b"")
        if key not in self._memo:
            self._memo[key] = self._run(books, mode, False)[0]
        return self._memo[key]

    def lloyd_step(self, books: np.ndarray) -> tuple[np.ndarray, float]:
        total, num, den = self._run(books, 1, True)
        self._memo.setdefault((1, np.ascontiguousarray(books, dtype=np.float32).tobytes()), total)
        return _project_fast(_lloyd_levels_nb(np.ascontiguousarray(books, np.float32), num, den)), total


def fit_optimized(
    matrices: Sequence[np.ndarray],
    qtype: str,
    importance=None,
    *,
    seed: str = "",
    iterations: int = 8,
    restarts: int = 2,
    max_rows: Optional[int] = None,
    impl: str = "fast",
    backend: Backend = NUMBA,
    inputs=None,
    histogram=None,
) -> OptimizedFit:
    """Fit one expert's book pair (and mode) for the MIX encoder's own error.

    matrices, importance: as ``fit_reference`` (gate then up for 106, down for
        105); importance is also the error weight.
    qtype: "rocmfp2_mix" or "rocmfp3_mix".
    seed: a stable identity (tensor name, expert id) that seeds the restarts.
    max_rows: refine on at most this many evenly spaced rows per matrix (the
        final choice is always made on all rows).
    impl: "fast" (vectorised search, fused sums, memoised errors) or
        "legacy" (encode + decode per step, the timing anchor); same result.
    backend: where the "fast" fitter's encoder searches run
        (``formats.search.Backend``; numba on the host by default); the same
        result bit for bit. Where the error evaluations run on the device
        (the Triton tier), ``encoding`` holds the choices as uint8 tensors there.
    inputs: the matrices and importance already on the backend's device, as
        ``formats.search.to_device`` gives them (one (X, W) a matrix).
    histogram: a zero-argument callable giving the reference fitter's
        ``Histogram`` of these matrices and importance, which does not depend
        on the levels: a caller fitting both MIX qtypes of one expert builds
        it once (the same books as ``fit_reference``).
    Returns an OptimizedFit whose error is <= the reference books' error.
    """
    qt = formats.get_qtype(qtype)
    if not qt.is_mix:
        raise BadInputError(f"fit_optimized: {qt.name} is not a MIX qtype")
    if iterations < 0 or restarts < 0:
        raise BadInputError("fit_optimized: iterations and restarts must be >= 0")
    if impl not in ("fast", "legacy"):
        raise BadInputError(f"fit_optimized: impl must be 'fast' or 'legacy', got {impl!r}")
    if impl == "fast":
        P = lambda q, m, w, dv: _FastProblem(q, m, w, backend, dv)  # noqa: E731
    else:
        P = lambda q, m, w, dv: _Problem(q, m, w)  # noqa: E731
    project = _project_fast if impl == "fast" else _project
    mats = [_check_matrix(m, i) for i, m in enumerate(matrices)]
    if not mats:
        raise BadInputError("fit_optimized: no matrices")
    imps = [_check_importance(q, m.shape[1], i) for i, (m, q) in enumerate(zip(mats, _importance_list(importance, len(mats))))]
    for i, m in enumerate(mats):
        if not np.all(np.isfinite(m)):
            raise CodebookError(f"fit_optimized: matrix {i} has non-finite values")
    L = qt.codebook_levels
    dev_in = inputs if backend.on_device and impl == "fast" else None
    full = P(qt.name, mats, imps, dev_in)
    if impl == "fast":
        full.keep = True  # the final encode of the chosen books reuses these choices
    if max_rows is not None and any(m.shape[0] > max_rows for m in mats):
        rows = [np.linspace(0, m.shape[0] - 1, max_rows).round().astype(int) if m.shape[0] > max_rows else None
                for m in mats]
        sub = [m if r is None else m[r] for m, r in zip(mats, rows)]
        sub_in = None
        if dev_in is not None:  # the sampled rows gathered on the device
            import torch

            sub_in = [(X if r is None else X.index_select(0, torch.from_numpy(r).to(X.device)), W)
                      for (X, W), r in zip(dev_in, rows)]
        fit = P(qt.name, sub, imps, sub_in)
    else:
        fit = full

    try:
        ref_books = histogram().fit(L).books if histogram is not None else fit_reference(mats, L, imps)[0]
    except CodebookError:
        ref_books = None
    uniform = project(np.tile(np.linspace(-1.0, 1.0, L), (2, 1)))
    starts = [uniform] if ref_books is None else [ref_books, uniform]
    rng = np.random.default_rng(zlib.crc32(f"fit_optimized/{qt.name}/{seed}".encode()))
    base = uniform if ref_books is None else ref_books
    for _ in range(restarts):
        spacing = np.mean(np.diff(base.astype(np.float64), axis=1), axis=1, keepdims=True)
        starts.append(project(base + rng.normal(0.0, 0.25, base.shape) * spacing))

    best_books, best_err = None, np.inf
    for books in starts:
        for _ in range(iterations):
            new, err = fit.lloyd_step(books)
            if err < best_err:
                best_books, best_err = books, err
            if new.tobytes() == books.tobytes():  # the same bits (the books are finite)
                break
            books = new
        err = fit.error(books, 1)
        if err < best_err:
            best_books, best_err = books, err

    refined_err = full.error(best_books, 1) if fit is not full else best_err
    ref_err = None if ref_books is None else full.error(ref_books, 1)
    fixed_err = full.error(best_books, 0)
    choices = [(refined_err, 1, best_books), (fixed_err, 0, best_books)]
    if ref_books is not None:
        choices.insert(0, (ref_err, 1, ref_books))
    err, mode, books = min(choices, key=lambda c: c[0])  # first wins ties: reference, refined, fixed
    enc = full.kept.get((mode, books.tobytes() if mode == 1 else b"")) if impl == "fast" else None
    return OptimizedFit(books=books, mode=mode, error=err, reference_error=ref_err, fixed_error=fixed_err,
                        refined_error=refined_err, encoding=enc)
