"""metrics: one SQNR with one edge convention, one error record, sums that add."""

from __future__ import annotations

import math

import numpy as np

from ds4quant.metrics import ErrorFigures, error_sums, sqnr_db


def test_sqnr_edge_convention():
    assert sqnr_db(1.0, 100.0) == 20.0
    assert sqnr_db(0.0, 5.0) == math.inf  # zero error: exact
    assert sqnr_db(0.0, 0.0) == math.inf  # zero signal and zero error: still exact
    assert sqnr_db(1.0, 0.0) == -math.inf  # zero signal, some error
    assert math.isnan(sqnr_db(math.inf, 1.0)) and math.isnan(sqnr_db(1.0, math.nan))


def test_error_figures_from_sums():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((17, 64)).astype(np.float32)
    y = (x + rng.standard_normal(x.shape).astype(np.float32) * 0.1).astype(np.float32)
    s = error_sums(x, y)
    d = x.astype(np.float64) - y.astype(np.float64)
    assert math.isclose(s.sse, float((d * d).sum()), rel_tol=1e-12)
    f = ErrorFigures.of(s)
    assert f.origin == "source" and f.sqnr_db == sqnr_db(s.sse, s.ssx)
    assert 19 < f.sqnr_db < 21 and 0.99 < f.cosine <= 1.0
    # two halves add up to the whole
    h = error_sums(x[:9], y[:9]).plus(error_sums(x[9:], y[9:]))
    assert h.n == s.n and math.isclose(h.sse, s.sse, rel_tol=1e-12) and h.max_abs == s.max_abs
    # a non-finite decode has no SQNR and is not exact
    y[3, 5] = np.nan
    bad = ErrorFigures.of(error_sums(x, y))
    assert not bad.finite and bad.sqnr_db is None and not bad.exact and bad.to_json()["sqnr_db"] is None
    assert ErrorFigures.of(error_sums(x, x)).exact and ErrorFigures.of(error_sums(x, x)).sqnr_db == math.inf
