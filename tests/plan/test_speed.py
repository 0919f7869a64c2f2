"""The fast measure stage gives the pre-speed-up figures bit for bit.

The fused fitter sums, the numba Lloyd / projection / repair and the
memoised errors are speed only (the vectorised MIX search's own tests:
tests/formats/search/test_numba_mix.py): every test here compares them with
the pre-speed-up path (``legacy_kernels()`` in benchmarks/_legacy_kernels.py,
the fitter's ``impl="legacy"``) byte for byte or bit for bit, checks that
the thread count never changes a plan or a byte, and pins the weighted error
on the shipped sample measured before the speed-up.
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks._legacy_kernels import legacy_kernels
from ds4quant import formats
from ds4quant.artifact import sha256_file
from ds4quant.codebooks.histogram import BINS, _bf16_repair, _bf16_repair_fast, _lloyd, _lloyd_fast
from ds4quant.codebooks.optimize import _project, _project_fast, fit_optimized
from ds4quant.convert import convert
from ds4quant.plan import AdaptiveOptions
from tests.formats.search.test_numba_mix import _data
from tests.plan.test_adaptive import IMATRIX, ROUTING, SAMPLE, _gguf

F = np.float32
MIX = ("rocmfp2_mix", "rocmfp3_mix")

# Routing-weighted imatrix error of the plan on samples/ds4-tiny at the
# suite's light effort (2 iterations, 0 restarts, 64 rows), measured with
# main's code (6e8481d) before the speed-up. The fast path must not be worse.
TODAY = {2.7: 334.8224675890745, 17 / 6: 269.2279181767368}
# The same at the default effort (6 iterations, 1 restart, 512 rows), from the
# pre-change kernels (legacy_kernels(), benchmarks/results/adaptive_measure_ds4tiny_2core.json).
TODAY_DEFAULT = {2.7: 313.50545272279595, 17 / 6: 254.18054807328568}


@pytest.mark.parametrize("qtype", MIX)
@pytest.mark.parametrize("shape,n,max_rows", [((128, 256), 1, 512), ((96, 128), 2, 40), ((300, 128), 1, 64)])
def test_fast_fitter_equals_legacy_bit_for_bit(qtype, shape, n, max_rows):
    rng = np.random.default_rng(shape[0] + n)
    mats = [_data(rng, *shape, "t3") for _ in range(n)]
    q = np.exp(1.5 * rng.standard_normal(shape[1])).astype(F)
    q[rng.random(shape[1]) < 0.05] = 0
    for imp in (q, None):
        a = fit_optimized(mats, qtype, imp, seed="blk.1/3", iterations=4, restarts=1, max_rows=max_rows, impl="fast")
        b = fit_optimized(mats, qtype, imp, seed="blk.1/3", iterations=4, restarts=1, max_rows=max_rows, impl="legacy")
        assert np.array_equal(a.books.view(np.uint32), b.books.view(np.uint32)) and a.mode == b.mode
        assert (a.error, a.reference_error, a.fixed_error, a.refined_error) == \
            (b.error, b.reference_error, b.fixed_error, b.refined_error)


@pytest.mark.parametrize("qtype", MIX)
@pytest.mark.parametrize("rows,max_rows", [(96, 512), (300, 64)])
def test_measure_reuses_the_fitters_choices_with_the_encoders_figures(qtype, rows, max_rows):
    """measure_matrix decodes the fitter's own choices for the chosen books
    instead of encoding again: the same Measure and books as the pre-change
    path (encode + decode); and for mode 0 and 1 the decode of the choices
    is the decode of the blocks they pack to."""
    from ds4quant.formats import search
    from ds4quant.plan import measure_matrix

    rng = np.random.default_rng(rows)
    q = np.exp(1.5 * rng.standard_normal(128)).astype(F)
    opts = AdaptiveOptions(target_bpw=2.7, fit_iterations=3, fit_restarts=1, fit_max_rows=max_rows)
    for kind in ("t3", "zeros"):
        x = _data(rng, rows, 128, kind)
        for imp in (q, None):
            w = q.astype(np.float64) if imp is not None else np.ones(128)
            m1, b1 = measure_matrix(x, imp, w, qtype, opts, seed="m/1")
            with legacy_kernels():
                m0, b0 = measure_matrix(x, imp, w, qtype, opts, seed="m/1")
            assert m0 == m1 and np.array_equal(b0[0].view(np.uint32), b1[0].view(np.uint32)) and b0[1] == b1[1]
            # and for either mode, the choices decode to what their packed blocks decode to
            bits = 2 if qtype == "rocmfp2_mix" else 3
            for mode in (0, 1):
                ob, oe, codes, st = search.choose_mix(x, imp, b1[0], mode, bits)
                y = search.decode_mix_choices(formats.get_qtype(qtype), (ob, oe, codes), x.shape, b1[0], mode)
                data = formats.encode(qtype, x, imp, b1[0], mode=mode)
                want = formats.decode(qtype, data, 128, b1[0], modes=mode)
                assert np.array_equal(y.view(np.uint32), want.view(np.uint32))


def test_numba_lloyd_projection_and_repair_equal_numpy():
    rng = np.random.default_rng(5)
    for t in range(300):
        h = np.zeros(BINS)
        if t % 3 == 0:
            h = rng.random(BINS) * (rng.random(BINS) < 0.3)
        elif t % 3 == 1:
            h[2048] = 16.0  # zero halves
            h[rng.integers(0, BINS, 3)] = 1.0
        else:
            h[rng.integers(0, BINS, 20)] = rng.random(20)
        for L in (4, 8):
            assert np.array_equal(_lloyd(h, L).view(np.uint32), _lloyd_fast(h, L).view(np.uint32))
    for t in range(2000):
        L = (4, 8)[t % 2]
        lv = rng.normal(0, rng.choice([1e-3, 0.3, 1, 5, 1e3]), (2, L))
        if t % 5 == 0:
            lv[1] = np.round(lv[1], 1)  # ties for the repair
        assert np.array_equal(_project(lv).view(np.uint32), _project_fast(lv).view(np.uint32))
        c = np.sort(np.float32(1.0) - rng.integers(0, 4, L).astype(F) * F(2.0**-9))
        a, b = _bf16_repair(c, 0), _bf16_repair_fast(c, 0)
        assert np.array_equal(a[0], b[0]) and a[1] == b[1]


def _opts(cache, target):
    return AdaptiveOptions(target_bpw=target, routing=str(ROUTING), cache_dir=str(cache), fit_iterations=2,
                           fit_restarts=0, fit_max_rows=64)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """target -> {label: (report, gguf sha)}: fast 1 thread, fast 2 threads,
    legacy kernels 1 thread, each from its own empty cache."""
    root = tmp_path_factory.mktemp("speed")
    out = {}
    for label, threads, legacy in (("t1", 1, False), ("t2", 2, False), ("legacy", 1, True)):
        for target in TODAY:
            d = root / f"{label}-{target:.4f}"
            if legacy:
                with legacy_kernels():
                    rep = convert(SAMPLE, d, "adaptive", imatrix=IMATRIX, threads=threads,
                                  adaptive=_opts(root / f"c-{label}", target))
            else:
                rep = convert(SAMPLE, d, "adaptive", imatrix=IMATRIX, threads=threads,
                              adaptive=_opts(root / f"c-{label}", target))
            out.setdefault(target, {})[label] = (rep, sha256_file(_gguf(d)))
    return out


def test_plans_and_bytes_do_not_depend_on_threads_or_the_kernels(runs):
    for target, by in runs.items():
        shas = {k: v[1] for k, v in by.items()}
        assert len(set(shas.values())) == 1, (target, shas)
        plans = {k: [(c.name, c.qtype) for c in v[0].plan] for k, v in by.items()}
        assert plans["t1"] == plans["t2"] == plans["legacy"]
        errs = {k: v[0].adaptive.predicted_weighted_error for k, v in by.items()}
        assert errs["t1"] == errs["t2"] == errs["legacy"], errs


@pytest.mark.parametrize("target", sorted(TODAY))
def test_weighted_error_is_no_worse_than_before_the_speed_up(runs, target):
    rep = runs[target]["t1"][0]
    assert rep.bpw_experts <= target
    assert rep.adaptive.predicted_weighted_error <= TODAY[target] * (1 + 1e-12)


def test_default_effort_error_is_no_worse_than_before_the_speed_up(tmp_path):
    """The shipped sample at the default --fit-effort, 2 workers: the plan's
    routing-weighted imatrix error at each budget against the pre-change figure."""
    for target in sorted(TODAY_DEFAULT, reverse=True):  # the cold run first, the second reuses the cache
        opts = AdaptiveOptions(target_bpw=target, routing=str(ROUTING), cache_dir=str(tmp_path / "c"), jobs=2)
        rep = convert(SAMPLE, tmp_path / f"o-{target:.4f}", "adaptive", imatrix=IMATRIX, threads=1, adaptive=opts)
        assert rep.bpw_experts <= target
        assert rep.adaptive.predicted_weighted_error <= TODAY_DEFAULT[target] * (1 + 1e-12), target
