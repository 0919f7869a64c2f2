"""runtime/exact_wide.py: the numba fallback sum against exact_dot_ref (Python integers),
bit for bit, on the spans the float64 path refuses: huge exponent spreads, cancellation
to zero, ties, subnormal and overflowing results, negative values rounding to zero."""

from __future__ import annotations

import numpy as np
import pytest

from ds4quant.runtime import exact as X
from ds4quant.runtime.exact_wide import exact_dot_wide_nb
from tests.runtime import _synth as S


def _bits(v):
    return np.asarray(v, np.float32).view(np.uint32)


def _check(w, q, s):
    w = np.asarray(w, np.float32)
    q = np.asarray(q, np.int64)
    s = np.asarray(s, np.int64)
    got = exact_dot_wide_nb(w, q, s)
    want = X.exact_dot_ref(w, [int(v) for v in q], [int(v) for v in s])
    assert _bits(got) == _bits(want), (got, want)
    return got


@pytest.mark.parametrize("seed", range(6))
def test_random_spreads_equal_the_python_integer_reference(seed):
    r = S.rng_for("wide", seed)
    cols = 96
    for _ in range(20):
        w = (r.standard_normal(cols) * np.exp2(r.integers(-140, 120, cols))).astype(np.float32)
        w[~np.isfinite(w)] = 1.0
        q = r.integers(-127, 128, cols)
        s = r.integers(-150, 110, cols // 32)
        _check(w, q, s)


def test_edges():
    one = np.ones(32, np.float32)
    z = np.zeros(32, np.int64)
    assert not np.signbit(_check(one, z, [0]))  # nothing: +0.0
    q = z.copy()
    q[0], q[1] = 5, -5
    assert not np.signbit(_check(one, q, [3]))  # exact cancellation: +0.0
    # a tie to even at 2^24 + 1 and a rounding up at 2^24 + 3
    w = np.zeros(32, np.float32)
    w[0], w[1] = 2.0**24, 1.0
    q = z.copy()
    q[0], q[1] = 1, 1
    assert _check(w, q, [0]) == np.float32(2.0**24)
    q[1] = 3
    assert _check(w, q, [0]) == np.float32(2.0**24 + 4)
    # subnormal results, and a negative value below half the smallest subnormal: -0.0
    w[:] = 0
    w[0] = np.float32(2.0**-140)
    q = z.copy()
    q[0] = 3
    _check(w, q, [-10])
    assert np.signbit(_check(w, -q, [-30]))
    # overflow to +-Inf, and huge terms that cancel leaving a tiny one
    w[0], w[1] = np.float32(2.0**100), np.float32(2.0**-140)
    q[0], q[1] = 127, 1
    assert np.isinf(_check(w, q, [120]))
    w[2] = -np.float32(2.0**100)
    q[2] = 127
    assert _check(w, q, [0]) == np.float32(2.0**-140)


def test_exact_matmul_fallback_uses_it_and_equals_the_reference():
    # weights spanning 2^-60..2^60 with activations spanning 2^-50..2^50: the float64 path refuses
    r = S.rng_for("wide-mm", 1)
    cols = 128
    w = (r.standard_normal((6, cols)) * np.exp2(r.integers(-60, 60, (6, cols)))).astype(np.float32)
    from ds4quant import formats
    from ds4quant.formats.components import row_kind, row_lut

    w = formats.bf16_round(w)
    x = (r.standard_normal((3, cols)) * np.exp2(r.integers(-50, 50, (3, cols // 32)).repeat(32, axis=1))).astype(np.float32)
    data = formats.encode("bf16", w)
    kind, p0, p1 = row_kind("bf16")
    got = X.exact_matmul(kind, p0, p1, data, cols, row_lut("bf16"), 1, x, X.quantize_rows(x), what="t")
    for t in range(3):
        q, s = X.quantize_row_ref(x[t])
        ref = np.array([X.exact_dot_ref(w[j], q, s) for j in range(6)], np.float32)
        assert np.array_equal(_bits(got[t]), _bits(ref))
