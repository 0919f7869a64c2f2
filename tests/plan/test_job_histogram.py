"""One expert matrix's measurement builds the reference fitter's histogram once
for both MIX qtypes (it does not depend on the levels), with the books and
figures of separate fits."""

from __future__ import annotations

import numpy as np

from ds4quant.codebooks import Histogram, fit_optimized
from ds4quant.plan.job import ExpertJob
from ds4quant.plan.options import AdaptiveOptions, Fitter

MIX = ("rocmfp2_mix", "rocmfp3_mix")


def _matrix(seed: int = 3):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((192, 512)) * 0.02).astype(np.float32)
    x[:, :7] *= 9.0  # a few heavy columns, as real experts have
    return x, rng.random(512).astype(np.float32) + 0.01


def test_both_mix_fits_share_one_histogram_and_keep_their_books(monkeypatch):
    x, q = _matrix()
    opts = AdaptiveOptions(target_bpw=2.6)
    adds = []
    real_add = Histogram.add
    monkeypatch.setattr(Histogram, "add", lambda self, *a, **k: (adds.append(1), real_add(self, *a, **k))[1])
    job = ExpertJob(x, q, q.astype(np.float64), opts, "blk.0.ffn_up_exps.weight/4")
    got = job.run(MIX)
    assert len(adds) == 1
    for qt, (name, meas, (books, mode)) in zip(MIX, got):
        alone = fit_optimized([x], qt, q, seed="blk.0.ffn_up_exps.weight/4", iterations=opts.fit_iterations,
                              restarts=opts.fit_restarts, max_rows=opts.fit_max_rows)
        assert name == qt and np.array_equal(books, alone.books) and mode == alone.mode
        assert meas.ref_wsse == alone.reference_error is not None


def test_the_reference_fitter_reads_the_shared_histogram_too():
    from ds4quant.codebooks import fit_reference

    x, q = _matrix(5)
    job = ExpertJob(x, q, q.astype(np.float64), AdaptiveOptions(target_bpw=2.6, fitter=Fitter.REFERENCE), "t/0")
    for qt, levels in zip(MIX, (4, 8)):
        _meas, (books, mode) = job.measure(qt)
        assert mode == 1 and np.array_equal(books, fit_reference([x], levels, q)[0])
