"""Issue 14: the measure stage in parallel and on a device gives the same bytes.

- the torch MIX search (``formats._mix_search_torch``) equals the numba
  search bit for bit: on torch's CPU device always, on CUDA where present;
- the codebook fitter and ``measure_matrix`` give the same books, modes and
  float64 figures through it;
- the mode-0 search over its window of bytes equals the pre-change kernel
  (``_mix_legacy``) on inputs built to defeat the window (zero-weight peaks,
  mixed magnitudes in a tile, huge and subnormal values);
- ``--jobs``: plans, errors, GGUF bytes and the measurement cache are the
  same for 1 and 2 workers;
- on CUDA (skips without): convert ``--device cuda`` == the CPU path, plan,
  errors and GGUF sha256, on samples/ds4-tiny at the default effort.
"""

from __future__ import annotations

import numpy as np
import pytest

from ds4quant import formats
from ds4quant.plan.planner import AdaptiveOptions, measure_matrix
from ds4quant.artifact import sha256_file
from ds4quant.codebooks import fit_reference
from ds4quant.codebooks.optimize import fit_optimized
from ds4quant.convert import convert
from ds4quant.errors import BadInputError
from ds4quant.formats import rocmfp_mix
from ds4quant.formats.search import numba_mix as _mix_search
from tests.plan.test_adaptive import IMATRIX, ROUTING, SAMPLE, _gguf

torch = pytest.importorskip("torch")
from ds4quant.formats.search.torch_mix import choose_torch, encode_torch, to_device  # noqa: E402

F = np.float32
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _data(rng, rows, cols, kind):
    if kind == "zeros":  # zero halves and exact ties
        x = (rng.integers(-2, 3, (rows, cols)) * 2.0**-7).astype(F)
        x[:, :16] = 0
        return x
    x = (0.02 * rng.standard_t(3, (rows, cols))).astype(F)
    if kind == "wide":  # magnitudes over 2^-30..2^10 within one tile
        x *= (2.0 ** rng.integers(-30, 10, (rows, cols // 16))).repeat(16, axis=1).astype(F)
    if kind == "bad":
        x[1, 40] = np.inf
        x[2, 3] = np.nan
        x[3, 7] = F(1e38)
    return x


def _books(x, L, q):
    return fit_reference([np.nan_to_num(x, nan=0, posinf=0, neginf=0) + F(1e-3)], L, q)[0]


def _same_choice(a, b):
    ok = a[3] == 0  # a refused half's codes are garbage; its status must agree
    return np.array_equal(a[3], b[3]) and all(np.array_equal(u[ok], v[ok]) for u, v in zip(a[:3], b[:3]))


DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("mode", [1, 0])
@pytest.mark.parametrize("rows,cols,kind", [(17, 256, "t3"), (5, 128, "zeros"), (9, 384, "wide"), (4, 128, "bad")])
def test_torch_search_equals_numba(dev, bits, mode, rows, cols, kind):
    check_search(lambda x, imp, books: choose_torch(*to_device(x, imp, dev), books, mode, bits),
                 np.random.default_rng(rows * 7 + bits + mode), rows, cols, kind, mode, bits)


def check_search(choose, rng, rows, cols, kind, mode, bits):
    """choose(x, importance, books) == numba's search, with and without importance."""
    x = _data(rng, rows, cols, kind)
    q = np.exp(rng.standard_normal(cols)).astype(F)
    q[rng.random(cols) < 0.1] = 0
    books = _books(x, 4 if bits == 2 else 8, q)
    for imp in (q, None):
        want = _mix_search._choose(x, imp, books, mode, bits)
        assert _same_choice(want, choose(x, imp, books)), (kind, imp is None)
    if kind == "bad":
        assert set(np.unique(want[3])) == {0, 1, 2}  # both refusals were exercised


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("mode", [1, 0])
def test_batched_search_equals_numba_whatever_it_is_batched_with(dev, bits, mode):
    """Requests of several shapes, books, weights (and none) and refusals in
    one batch, and again from 6 threads through the queue: each one's slice
    is the numba search of it alone."""
    from concurrent.futures import ThreadPoolExecutor

    from ds4quant.formats.search.torch_batch import _Request, _run_group, choose_batched

    rng = np.random.default_rng(40 + bits + mode)
    L = 4 if bits == 2 else 8
    cases = []
    for rows, cols, kind in ((17, 256, "t3"), (5, 128, "zeros"), (9, 384, "wide"), (4, 128, "bad"), (33, 128, "t3")):
        x = _data(rng, rows, cols, kind)
        q = np.exp(rng.standard_normal(cols)).astype(F)
        q[rng.random(cols) < 0.1] = 0
        books = _books(x, L, q)
        for imp in (q, None):
            cases.append((x, imp, books))
    books0 = cases[0][2].copy()
    books0[1] = 0  # a book whose max level is 0 has no candidates
    cases.append((cases[0][0], cases[0][1], books0))
    want = [_mix_search._choose(x, imp, b, mode, bits) for x, imp, b in cases]
    reqs = [_Request(*to_device(x, imp, torch.device(dev)), b, mode, bits) for x, imp, b in cases]
    _run_group(reqs)
    for r, w in zip(reqs, want):
        assert _same_choice(w, r.result)
    with ThreadPoolExecutor(6) as ex:
        got = list(ex.map(lambda c: choose_batched(*to_device(c[0], c[1], torch.device(dev)), c[2], mode, bits),
                          cases * 3))
    for g, w in zip(got, want * 3):
        assert _same_choice(w, g)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("qtype", ["rocmfp2_mix", "rocmfp3_mix"])
def test_fitter_and_measure_matrix_through_torch_equal_the_host(dev, qtype):
    rng = np.random.default_rng(3)
    x = _data(rng, 96, 128, "t3")
    q = np.exp(1.5 * rng.standard_normal(128)).astype(F)
    q[rng.random(128) < 0.05] = 0
    for imp in (q, None):
        a = fit_optimized([x], qtype, imp, seed="blk.1/3", iterations=3, restarts=1, max_rows=40)
        b = fit_optimized([x], qtype, imp, seed="blk.1/3", iterations=3, restarts=1, max_rows=40,
                          device=torch.device(dev))
        assert np.array_equal(a.books.view(np.uint32), b.books.view(np.uint32)) and a.mode == b.mode
        assert (a.error, a.reference_error, a.fixed_error, a.refined_error) == \
            (b.error, b.reference_error, b.fixed_error, b.refined_error)
        for mode in (0, 1):
            assert np.array_equal(encode_torch(qtype, x, imp, a.books, mode, dev),
                                  formats.encode(qtype, x, imp, a.books, mode=mode))
    opts = AdaptiveOptions(target_bpw=2.7, fit_iterations=2, fit_restarts=1, fit_max_rows=40)
    w = q.astype(np.float64)
    m0, b0 = measure_matrix(x, q, w, qtype, opts, seed="t/1")
    m1, b1 = measure_matrix(x, q, w, qtype, opts, seed="t/1", device=torch.device(dev))
    assert m0 == m1 and np.array_equal(b0[0], b1[0]) and b0[1] == b1[1]


def test_encode_torch_refuses_like_the_codec():
    books = np.array([[-1, -0.25, 0.25, 1], [-1, -0.5, 0.5, 1]], F)
    for value, what in ((np.inf, "non-finite value at row 1, column 40"),
                        (F(3e38), "row 1, block 1 (half 0)")):  # every candidate's error overflows
        x = np.full((3, 128), 0.01, F)
        x[1, 40] = value
        msgs = []
        for enc in (lambda: formats.encode("rocmfp2_mix", x, None, books),
                    lambda: encode_torch("rocmfp2_mix", x, None, books, 1, "cpu")):
            with pytest.raises(Exception) as e:
                enc()
            msgs.append(str(e.value))
        assert msgs[0] == msgs[1] and what in msgs[0], msgs


def _legacy(qtype, x, imp, books, mode):
    old = rocmfp_mix._LEGACY_ENCODE
    rocmfp_mix._LEGACY_ENCODE = True
    try:
        return formats.encode(qtype, x, imp, books, mode=mode, impl="fast")
    finally:
        rocmfp_mix._LEGACY_ENCODE = old


@pytest.mark.parametrize("qtype", ["rocmfp2_mix", "rocmfp3_mix"])
@pytest.mark.parametrize("case", ["zero_weight_peak", "wide", "huge", "subnormal", "negative", "t3"])
def test_windowed_fixed_search_equals_the_full_scan(qtype, case):
    rng = np.random.default_rng(hash(case) % 1000)
    rows, cols = 24, 256
    x = _data(rng, rows, cols, "wide" if case == "wide" else "t3")
    q = np.exp(rng.standard_normal(cols)).astype(F)
    if case == "zero_weight_peak":  # the clipping bound is 0: the bytes below must be scanned
        peak = np.abs(x).reshape(rows, -1, 16).argmax(-1)
        for r in range(0, rows, 2):
            q[(np.arange(cols // 16) * 16 + peak[r])[: cols // 32]] = 0
    elif case == "huge":
        x = (x * F(2.0**100)).astype(F)
    elif case == "subnormal":
        x = (x * F(2.0**-120)).astype(F)
    elif case == "negative":
        x = -np.abs(x)
    books = _books(x, formats.get_qtype(qtype).codebook_levels, q)
    for imp in (q, None):
        try:
            want = _legacy(qtype, x, imp, books, 0)
        except Exception as e:  # noqa: BLE001  (a refusal must be the same refusal)
            with pytest.raises(type(e)):
                formats.encode(qtype, x, imp, books, mode=0)
            with pytest.raises(type(e)):
                encode_torch(qtype, x, imp, books, 0, "cpu")
            continue
        assert np.array_equal(formats.encode(qtype, x, imp, books, mode=0), want)
        for dev in DEVICES:  # the device search's own window
            assert np.array_equal(encode_torch(qtype, x, imp, books, 0, dev), want), dev


def test_bad_device_and_jobs_are_refused():
    with pytest.raises(BadInputError, match="--device"):
        AdaptiveOptions(target_bpw=2.7, device="tpu").validate()
    with pytest.raises(BadInputError, match="--jobs"):
        AdaptiveOptions(target_bpw=2.7, jobs=0).validate()
    if not CUDA:
        from ds4quant.plan.workers import resolve_device

        with pytest.raises(BadInputError, match="no CUDA device"):
            resolve_device("cuda")


def _run(tmp, label, target, jobs, threads, device="cpu", effort=(2, 0, 64)):
    opts = AdaptiveOptions(target_bpw=target, routing=str(ROUTING), cache_dir=str(tmp / f"c-{label}"),
                           fit_iterations=effort[0], fit_restarts=effort[1], fit_max_rows=effort[2],
                           jobs=jobs, device=device)
    out = tmp / f"{label}-{target:.4f}"
    rep = convert(SAMPLE, out, "adaptive", imatrix=IMATRIX, threads=threads, adaptive=opts)
    return rep, sha256_file(_gguf(out))


def _cache_bytes(root):
    files = sorted(root.glob("measure-*.json"))
    assert len(files) == 1
    return files[0].read_bytes()


def test_plans_bytes_and_cache_do_not_depend_on_the_worker_count(tmp_path):
    runs = {}
    for label, jobs, threads in (("j1", 1, 1), ("j2", 2, 1), ("j3t2", 3, 2)):
        runs[label] = _run(tmp_path, label, 17 / 6, jobs, threads)
    shas = {k: v[1] for k, v in runs.items()}
    assert len(set(shas.values())) == 1, shas
    plans = {k: [(c.name, c.qtype) for c in v[0].plan] for k, v in runs.items()}
    assert plans["j1"] == plans["j2"] == plans["j3t2"]
    errs = {k: v[0].adaptive["predicted_weighted_error"] for k, v in runs.items()}
    assert len(set(errs.values())) == 1, errs
    caches = {k: _cache_bytes(tmp_path / f"c-{k}") for k in runs}
    assert caches["j1"] == caches["j2"] == caches["j3t2"]


def test_convert_through_the_torch_search_equals_the_cpu_path(tmp_path):
    """--device torch-cpu end to end (the plumbing CUDA uses), on one adaptive tensor."""
    got = {}
    for device in ("cpu", "torch-cpu"):
        opts = AdaptiveOptions(target_bpw=2.5625, routing=str(ROUTING), cache_dir=str(tmp_path / f"c-{device}"),
                               candidates=("rocmfp2", "rocmfp2_mix", "rocmfp3"), fit_iterations=2, fit_restarts=0,
                               fit_max_rows=64, device=device, jobs=2)
        out = tmp_path / device
        rep = convert(SAMPLE, out, "adaptive", imatrix=IMATRIX, threads=1, adaptive=opts,
                      tensor_types=(r"blk\.[1-3]\..*exps=rocmfp2", r"blk\.0\.ffn_(up|down)_exps=rocmfp2"))
        got[device] = (sha256_file(_gguf(out)), _cache_bytes(tmp_path / f"c-{device}"),
                       rep.adaptive["predicted_weighted_error"])
        assert any(c.qtype == "rocmfp2_mix" for c in rep.plan)  # the MIX path was measured and chosen
    assert got["cpu"] == got["torch-cpu"]


@needs_cuda
@pytest.mark.gpu
def test_convert_on_cuda_equals_the_cpu_path(tmp_path, monkeypatch):
    """Default effort (6,1,512), both budgets: same plan, figures and GGUF bytes
    (every matrix on the device: the sample's are below DEVICE_MIN_WEIGHTS)."""
    from ds4quant.plan import planner as adaptive

    monkeypatch.setattr(adaptive, "DEVICE_MIN_WEIGHTS", 0)
    for target in (17 / 6, 2.7):
        a = _run(tmp_path, "cpu", target, 2, None, "cpu", (6, 1, 512))
        b = _run(tmp_path, "cuda", target, 2, None, "cuda", (6, 1, 512))
        assert a[1] == b[1]
        assert [(c.name, c.qtype) for c in a[0].plan] == [(c.name, c.qtype) for c in b[0].plan]
        assert a[0].adaptive["predicted_weighted_error"] == b[0].adaptive["predicted_weighted_error"]
    assert _cache_bytes(tmp_path / "c-cpu") == _cache_bytes(tmp_path / "c-cuda")
