"""One expert matrix's measurement: every candidate qtype, one job.

A job owns what the candidates of one expert matrix share: the matrix, its
importance and error weights, the backend the searches run on, the one
upload of them to its device (``Resident``), the reference fitter's
histogram (one for both MIX qtypes), the candidate loop and the MIX
codebook fits. For each candidate it encodes the matrix the way convert
will (MIX with books fitted for this expert and surface) and takes the
float64 error sums, weighted per column by ``err_w``, here and only here.

On a device (``formats.search.Backend``) the MIX searches and the scale
search of the types the device tiers cover run there, bit for bit the
host's, and what the plan needs comes back as figures: the fitter's error
evaluations and every candidate's error sums run on the device in the
host's order on the Triton tier, so no decoded matrix crosses the link.
Matrices under ``DEVICE_MIN_WEIGHTS`` weights stay on the CPU cores
(``measure_candidates``), where they are cheaper: the same bytes.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ds4quant.formats import decode, encode, encode_input, get_qtype, search
from ds4quant.formats.search import NUMBA, Backend, DeviceKind, Tier
from ds4quant.metrics import Sums, error_sums
from ds4quant.plan.options import AdaptiveOptions, Fitter
from ds4quant.plan.records import Measure

#: --device cuda measures matrices of fewer weights on the CPU cores (the same
#: bytes): there each search is a launch and a wait, and the workers' Python
#: costs more than numba's kernels (benchmarks/adaptive_crossover.py)
DEVICE_MIN_WEIGHTS = 1 << 20

_HALF = search.HALF


def _upload(a: np.ndarray, dtype, device):
    """``a`` as a tensor on ``device``: on CUDA through a pinned buffer and a
    copy queued on the current stream (the buffer is handed back, to be kept
    until the copy ran)."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(a, dtype))
    if device.type != "cuda":
        return t.to(device), None
    pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    pinned.copy_(t)
    return pinned.to(device, non_blocking=True), pinned


class Resident:
    """``x`` float32 (rows, cols), its importance (cols,) or None and the
    error weights float64 (cols,) on ``backend``'s device, uploaded once
    (through pinned memory, on the worker's stream) for all of one expert's
    candidates: the halves view for the MIX searches, the importance's row
    energies for the scale search, and the error sums of a decoded matrix
    (on the device with Triton; elsewhere, as on torch's CPU device, the
    host's ``error_sums`` of a copy). Build it inside the worker's stream
    (``workers.worker_stream``)."""

    def __init__(self, x: np.ndarray, imp: Optional[np.ndarray], err_w: np.ndarray, backend: Backend) -> None:
        self.x = np.ascontiguousarray(x, np.float32)
        self.imp = imp
        self.err_w = np.ascontiguousarray(err_w, np.float64)
        self.backend = backend
        self.device = backend.torch_device
        self._keep = []  # pinned sources of queued copies
        self.X = self._up(self.x, np.float32)
        self.Q = None if imp is None else self._up(imp, np.float32)
        self.E = self._up(self.err_w, np.float64)
        self._sigma2 = None

    def _up(self, a, dtype):
        t, pinned = _upload(a, dtype, self.device)
        if pinned is not None:
            self._keep.append(pinned)
        return t

    def halves(self):
        """(X (rows, cols/16, 16), W (1, cols/16, 16) or None): ``search.to_device``'s layout."""
        rows, cols = self.x.shape
        W = None if self.Q is None else self.Q.reshape(1, cols // _HALF, _HALF)
        return self.X.reshape(rows, cols // _HALF, _HALF), W

    def sigma2(self):
        """The rows' energies of the importance weights (``search.row_energies``), once per matrix."""
        if self._sigma2 is None:
            self._sigma2 = self._up(search.row_energies(self.x), np.float32)
        return self._sigma2

    def sums(self, Y) -> Sums:
        """``error_sums(x, y, err_w)`` of decoded values Y (a tensor of x's size on the device)."""
        Y = Y.reshape(self.x.shape)
        if self.backend.tier is Tier.TRITON:
            return search.error_sums_on_device(self.X, Y, self.E)
        return error_sums(self.x, search.to_host(Y), self.err_w)


class ExpertJob:
    """The candidates of one expert matrix: x float32 (rows, cols), its
    importance (cols,) or None (what the encoder weighs by), the error
    weights float64 (cols,), ``seed`` (a stable identity, "tensor/expert",
    that seeds the fitter), on ``backend``."""

    def __init__(self, x: np.ndarray, imp: Optional[np.ndarray], err_w: np.ndarray, opts: AdaptiveOptions,
                 seed: str, backend: Backend = NUMBA) -> None:
        self.x, self.imp, self.err_w = x, imp, err_w
        self.opts, self.seed, self.backend = opts, seed, backend
        self._resident: Optional[Resident] = None
        self._hist = None

    def run(self, qtypes: Sequence[str]) -> list:
        """[(qtype, Measure, (books, mode) or None)] for each of ``qtypes``, in order."""
        return [(q, *self.measure(q)) for q in qtypes]

    def resident(self) -> Resident:
        if self._resident is None:
            self._resident = Resident(self.x, self.imp, self.err_w, self.backend)
        return self._resident

    def histogram(self):
        """The reference fitter's histogram of the matrix and its importance,
        built once for both MIX qtypes (it does not depend on the levels)."""
        if self._hist is None:
            from ds4quant.codebooks import Histogram

            h = Histogram()
            h.add(self.x, self.imp)
            self._hist = h
        return self._hist

    def on_device(self, qt) -> bool:
        """Whether ``qt``'s search runs on the backend's device."""
        return self.backend.on_device and (qt.is_mix or search.scale_covers(qt.name))

    def measure(self, qtype: str) -> tuple[Measure, Optional[tuple[np.ndarray, int]]]:
        """Encode the matrix as ``qtype`` the way convert will: its Measure and,
        for MIX, the (books, mode) it used."""
        x, imp, err_w = self.x, self.imp, self.err_w
        qt = get_qtype(qtype)
        books = ref = None
        if qt.is_mix:
            b, mode, ref_err, enc = self._fit(qt)
            nbytes = x.shape[0] * qt.row_bytes(x.shape[1])
            if enc is not None:  # the fitter searched every row with these books: decode its choices
                s = self._sums(search.decode_mix_choices(qt, enc, x.shape, b, mode))
            else:
                if self.backend.on_device:
                    data = search.encode_mix(qt, x, imp, b, mode, self.backend)
                else:
                    data = encode(qt, x, imp, b, mode=mode)
                s = error_sums(x, decode(qt, data, x.shape[1], b, modes=mode), err_w)
                nbytes = int(data.nbytes)
            books = (b, mode)
            # fit_optimized weighs its reference error by the raw importance (ones
            # without); it compares with wsse only where err_w is that same weight
            same_weights = np.array_equal(err_w, imp) if imp is not None else bool(np.all(err_w == 1.0))
            if ref_err is not None and same_weights:
                ref = ref_err
        elif self.on_device(qt):
            encode_input(qt, x, imp)  # encode's refusals
            r = self.resident()
            q = r.Q
            nbytes, Y = search.measure_scale(qt.name, r.X, q, None if q is None else r.sigma2(), self.backend)
            s = r.sums(Y)  # searched, decoded and summed on the device
        else:
            data = encode(qt, x, imp)
            s = error_sums(x, decode(qt, data, x.shape[1]), err_w)
            nbytes = int(data.nbytes)
        return Measure(nbytes, s.sse, s.ssx, s.wsse, s.wssx, ref), books

    def _fit(self, qt):
        """(books, mode, ref_books_error or None, the encoder's choices for
        them on the matrix or None) for a MIX qtype."""
        from ds4quant.codebooks import fit_optimized

        opts = self.opts
        if opts.fitter is Fitter.REFERENCE:
            return self.histogram().fit(qt.codebook_levels).books, 1, None, None
        fit = fit_optimized([self.x], qt.name, self.imp, seed=self.seed, iterations=opts.fit_iterations,
                            restarts=opts.fit_restarts, max_rows=opts.fit_max_rows, backend=self.backend,
                            inputs=[self.resident().halves()] if self.backend.on_device else None,
                            histogram=self.histogram)
        return fit.books, fit.mode, fit.reference_error, fit.encoding

    def _sums(self, y) -> Sums:
        """The error sums of decoded values where they are: a host array here,
        a device tensor (the Triton tier kept the choices there) on the device."""
        if isinstance(y, np.ndarray):
            return error_sums(self.x, y, self.err_w)
        return self.resident().sums(y)


def backend_for(backend: Backend, weights: int) -> Backend:
    """Where a matrix of ``weights`` weights is searched on ``backend``: a CUDA
    device takes matrices of at least ``DEVICE_MIN_WEIGHTS`` weights, smaller
    ones stay on the CPU cores, where they are cheaper (the same bytes)."""
    if backend.device is DeviceKind.CUDA and weights < DEVICE_MIN_WEIGHTS:
        return NUMBA
    return backend


def measure_candidates(x: np.ndarray, imp: Optional[np.ndarray], err_w: np.ndarray, qtypes: Sequence[str],
                       opts: AdaptiveOptions, seed: str, backend: Backend = NUMBA) -> list:
    """[(qtype, Measure, (books, mode) or None)] of one expert matrix for each
    of ``qtypes`` in order, the matrix uploaded to the backend's device once
    for all of them (a CUDA device takes matrices of at least
    ``DEVICE_MIN_WEIGHTS`` weights); call it inside ``worker_stream(backend)``."""
    return ExpertJob(x, imp, err_w, opts, seed, backend_for(backend, x.size)).run(qtypes)


def measure_matrix(x: np.ndarray, imp: Optional[np.ndarray], err_w: np.ndarray, qtype: str,
                   opts: AdaptiveOptions, seed: str, backend: Backend = NUMBA):
    """``measure_candidates`` of one qtype, on ``backend`` whatever the
    matrix's size: (Measure, (books, mode) or None)."""
    return ExpertJob(x, imp, err_w, opts, seed, backend).measure(qtype)
