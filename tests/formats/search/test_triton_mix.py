"""The Triton tier's MIX search (``formats.search.triton_mix``, one launch a
search) gives the numba search's books, bytes, codes and refusals bit for
bit: under Triton's interpreter on the CPU (CI), and on CUDA where present
(DS4-sized matrices, the fitter and ``measure_matrix`` through it)."""

from __future__ import annotations

import numpy as np
import pytest

from ds4quant.formats import search
from ds4quant.formats.search import Backend, DeviceKind, Tier, numba_mix

torch = pytest.importorskip("torch")
from tests.formats.search.test_torch_mix import _books, _data, _same_choice, check_search  # noqa: E402

CUDA = torch.cuda.is_available()
F = np.float32
# the kernels on CUDA where present, else under Triton's interpreter on torch's CPU device
TRITON = Backend(Tier.TRITON, DeviceKind.CUDA if CUDA else DeviceKind.CPU)


@pytest.fixture(scope="module")
def mt():
    from tests.runtime._interp import device_kernels

    return device_kernels("ds4quant.formats.search.triton_mix")


def _to(x, imp):
    return search.to_device(x, imp, TRITON)


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("mode", [1, 0])
@pytest.mark.parametrize("rows,cols,kind", [(9, 256, "t3"), (5, 128, "zeros"), (6, 384, "wide"), (4, 128, "bad")])
def test_triton_search_equals_numba(mt, bits, mode, rows, cols, kind):
    check_search(lambda x, imp, books: mt.choose(*_to(x, imp), books, mode, bits),
                 np.random.default_rng(rows * 7 + bits + mode + 100), rows, cols, kind, mode, bits)


@pytest.mark.parametrize("bits", [2, 3])
def test_triton_edge_books_and_weights(mt, bits):
    """A book whose max level is 0 (no candidates), unusable weights (NaN,
    negative, inf: status 2), huge values whose quotient by ML overflows, and
    subnormals."""
    rng = np.random.default_rng(7 + bits)
    L = 4 if bits == 2 else 8
    x = _data(rng, 6, 128, "t3")
    x[0, :16] = F(3e38)
    x[1, 16:32] = F(1e-42)
    x[2, 32:48] = F(2.0**-133)
    q = np.exp(rng.standard_normal(128)).astype(F)
    q[5] = np.nan
    q[40] = -1.0
    q[77] = np.inf
    books = _books(x[3:], L, None)
    b0 = books.copy()
    b0[1] = 0
    same = np.stack([books[0], books[0]])  # every book-1 candidate ties its book-0 twin: book 0 wins
    for mode in (1, 0):
        for bk in ((books, b0, same) if mode == 1 else (books,)):  # mode 0 reads no books
            for imp in (q, None, np.abs(np.nan_to_num(q, nan=0, posinf=1))):
                want = numba_mix.choose(x, imp, bk, mode, bits)
                got = mt.choose(*_to(x, imp), bk, mode, bits)
                assert _same_choice(want, got), (mode, imp is None)


def test_the_face_takes_the_kernel_on_the_triton_tier(mt, monkeypatch):
    """search.choose_mix (the fitter's entry) runs the kernel for a Triton backend."""
    calls = []
    orig = mt.choose
    monkeypatch.setattr(mt, "choose", lambda *a, **k: calls.append(1) or orig(*a, **k))
    rng = np.random.default_rng(3)
    x = _data(rng, 4, 128, "t3")
    books = _books(x, 4, None)
    got = search.choose_mix(*_to(x, None), books, 1, 2, TRITON)
    assert calls and _same_choice(numba_mix.choose(x, None, books, 1, 2), got)


needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("mode", [1, 0])
def test_triton_search_equals_numba_at_ds4_size(mt, bits, mode):
    rng = np.random.default_rng(11 + bits + mode)
    x = (0.02 * rng.standard_t(3, (512, 2048))).astype(F)
    q = np.exp(rng.standard_normal(2048)).astype(F)
    q[rng.random(2048) < 0.05] = 0
    books = _books(x, 4 if bits == 2 else 8, q)
    for imp in (q, None):
        assert _same_choice(numba_mix.choose(x, imp, books, mode, bits),
                            mt.choose(*_to(x, imp), books, mode, bits))


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ["rocmfp2_mix", "rocmfp3_mix"])
def test_measure_matrix_on_cuda_through_the_kernel_equals_the_host(mt, qtype):
    from ds4quant.plan import AdaptiveOptions, measure_matrix

    rng = np.random.default_rng(5)
    x = (0.02 * rng.standard_t(3, (256, 1024))).astype(F)
    q = np.exp(rng.standard_normal(1024)).astype(F)
    opts = AdaptiveOptions(target_bpw=2.7)
    w = q.astype(np.float64)
    a, ba = measure_matrix(x, q, w, qtype, opts, "t/0")
    b, bb = measure_matrix(x, q, w, qtype, opts, "t/0", backend=Backend.for_device("cuda"))
    assert a == b and ba[1] == bb[1] and np.array_equal(ba[0], bb[0])


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("mode", [1, 0])
def test_triton_terms_equal_the_hosts(mt, bits, mode):
    """The device's float64 error terms of the kernel's choices are
    ``terms_stats_nb``'s bit for bit (so the fitter's np.sum of them is too)."""

    rng = np.random.default_rng(21 + bits + mode)
    x = _data(rng, 6, 256, "wide")
    q = np.exp(rng.standard_normal(256)).astype(F)
    q[rng.random(256) < 0.1] = 0
    L = 4 if bits == 2 else 8
    books = _books(x, L, q)
    fixed = search.fixed_levels(bits)
    for imp in (q, None):
        ob, oe, codes, st, terms = mt.choose(*_to(x, imp), books, mode, bits, terms=True)
        want = np.empty((x.size // 16, 16), np.float64)
        wq = imp.reshape(-1, 16) if imp is not None else np.zeros((1, 16), F)
        search.terms_stats(x.reshape(-1, 16), wq, imp is not None, books, ob, oe, codes, mode, fixed, want,
                           np.zeros(2 * L), np.zeros(2 * L), False)
        assert terms.dtype == np.float64 and np.array_equal(terms.view(np.uint64), want.view(np.uint64))


@pytest.mark.parametrize("qtype", ["rocmfp2_mix", "rocmfp3_mix"])
def test_fitter_through_the_kernels_equals_the_host(mt, qtype):
    """fit_optimized with its searches and error terms in the kernels (on
    torch's CPU device under the interpreter; on CUDA where present) gives the
    host's books, mode, figures and the encoder's choices."""
    from ds4quant.codebooks import fit_optimized

    rng = np.random.default_rng(9)
    x = (0.02 * rng.standard_t(3, (40, 256))).astype(F)
    q = np.exp(rng.standard_normal(256)).astype(F)
    kw = dict(seed="t/1", iterations=3, restarts=1, max_rows=16)
    a = fit_optimized([x], qtype, q, **kw)
    b = fit_optimized([x], qtype, q, backend=TRITON, **kw)
    assert np.array_equal(a.books, b.books) and a.mode == b.mode
    assert (a.error, a.reference_error, a.fixed_error, a.refined_error) == \
        (b.error, b.reference_error, b.fixed_error, b.refined_error)
    # through the kernels the choices stay on the device
    assert all(np.array_equal(u, v.cpu().numpy() if torch.is_tensor(v) else v) for u, v in zip(a.encoding, b.encoding))


def test_measure_candidates_on_the_device_equal_the_cpu_path(mt, monkeypatch):
    """The measure stage's device path with everything in the kernels (the
    searches, the fitter's error evaluations, the MIX decode, the error sums;
    the matrix uploaded once) gives the CPU path's Measures and books for
    every default candidate; no decoded matrix comes back to the host."""
    from ds4quant.plan import DEFAULT_CANDIDATES, AdaptiveOptions, job, measure_candidates
    from tests.runtime._interp import device_kernels

    monkeypatch.setattr(job, "DEVICE_MIN_WEIGHTS", 0)  # this small matrix on the device too
    device_kernels("ds4quant.formats.search.triton_scale")
    device_kernels("ds4quant.formats.search.triton_sums")
    rng = np.random.default_rng(17)
    x = (0.02 * rng.standard_t(3, (24, 128))).astype(F)
    q = np.exp(rng.standard_normal(128)).astype(F)
    # error weights other than the importance (as for an expert calibration
    # missed): the device sums must take err_w, the searches q
    err_w = np.exp(rng.standard_normal(128))
    # (the interpreter's cost is per operation: few rows and Lloyd steps)
    opts = AdaptiveOptions(target_bpw=2.7, fit_iterations=1, fit_restarts=0, fit_max_rows=8)
    want = measure_candidates(x, q, err_w, DEFAULT_CANDIDATES, opts, "t/2")

    def host_sums(*a, **k):
        raise AssertionError("a decoded matrix was summed on the host")

    monkeypatch.setattr(job, "error_sums", host_sums)
    got = measure_candidates(x, q, err_w, DEFAULT_CANDIDATES, opts, "t/2", backend=TRITON)
    assert [g[0] for g in got] == [w[0] for w in want] == list(DEFAULT_CANDIDATES)
    for (qt, mw, bw), (_, mg, bg) in zip(want, got):
        assert mw == mg, qt
        assert (bw is None) == (bg is None) and (bw is None or (np.array_equal(bw[0], bg[0]) and bw[1] == bg[1]))


def test_small_matrices_stay_on_the_cpu_cores(monkeypatch):
    """--device cuda measures a matrix below DEVICE_MIN_WEIGHTS on the CPU path
    (nothing is uploaded); the figures are the CPU path's either way."""
    from ds4quant.plan import AdaptiveOptions, job, measure_candidates

    def no_upload(*a, **k):
        raise AssertionError("a small matrix went to the device")

    monkeypatch.setattr(job, "Resident", no_upload)
    rng = np.random.default_rng(4)
    x = (0.02 * rng.standard_t(3, (8, 128))).astype(F)
    q = np.exp(rng.standard_normal(128)).astype(F)
    opts = AdaptiveOptions(target_bpw=2.7, fit_iterations=1, fit_restarts=0, fit_max_rows=8)
    assert x.size < job.DEVICE_MIN_WEIGHTS
    cands = ("rocmfp2", "rocmfp2_mix")
    got = measure_candidates(x, q, q.astype(np.float64), cands, opts, "t/3", backend=Backend(Tier.TORCH, "cuda"))
    want = measure_candidates(x, q, q.astype(np.float64), cands, opts, "t/3")
    assert [(g[0], g[1]) for g in got] == [(w[0], w[1]) for w in want]
