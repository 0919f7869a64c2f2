"""The numba tier's MIX search (``formats.search.numba_mix``) gives the
pre-speed-up kernels' bytes and refusals (``benchmarks/_legacy_kernels.py``:
one row per prange iteration, a binary-search NL), its nearest-byte shortcut
the bisection's, and its pairwise sum ``np.sum``'s, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import _legacy_kernels
from ds4quant import formats
from ds4quant.codebooks import fit_reference
from ds4quant.formats import search
from ds4quant.formats.search import numba_mix
from ds4quant.formats.ue4m3 import UE4M3, nearest_nb

F = np.float32
MIX = ("rocmfp2_mix", "rocmfp3_mix")


def _legacy_encode(qtype, x, imp, books, mode):
    qt = formats.get_qtype(qtype)
    return _legacy_kernels.encode(x, imp, books, qt=qt, bits=2 if qt.codebook_levels == 4 else 3, mode=mode)


def _data(rng, rows, cols, kind):
    if kind == "t3":
        x = 0.02 * rng.standard_t(3, (rows, cols))
    elif kind == "zeros":  # zero halves and exact ties
        x = rng.integers(-2, 3, (rows, cols)) * 2.0**-7
        x[:, :16] = 0
    else:
        x = 0.01 * rng.standard_normal((rows, cols))
    return x.astype(F)


@pytest.mark.parametrize("qtype", MIX)
@pytest.mark.parametrize("mode", [1, 0])
@pytest.mark.parametrize("rows,kind", [(17, "t3"), (5, "zeros"), (33, "gauss")])
def test_vectorised_encoder_bytes_equal_the_legacy_kernel(qtype, mode, rows, kind):
    rng = np.random.default_rng(rows + mode)
    cols = 256
    x = _data(rng, rows, cols, kind)
    q = np.exp(rng.standard_normal(cols)).astype(F)
    q[rng.random(cols) < 0.1] = 0
    L = formats.get_qtype(qtype).codebook_levels
    books, _ = fit_reference([x if kind != "zeros" else x + F(1e-3)], L, q)
    for imp in (q, None):
        new = formats.encode(qtype, x, imp, books, mode=mode, impl="fast")
        old = _legacy_encode(qtype, x, imp, books, mode)
        assert np.array_equal(new, old), np.argwhere(new != old)[:5]
        assert np.array_equal(new, formats.encode(qtype, x, imp, books, mode=mode, impl="ref"))


def test_refusal_names_the_same_half_as_the_legacy_kernel():
    from ds4quant.formats import get_codec

    x = np.full((3, 128), 0.01, F)
    x[1, 40] = np.inf  # row 1, block 1, half 0
    books = np.array([[-1, -0.25, 0.25, 1], [-1, -0.5, 0.5, 1]], F)
    qt = formats.get_qtype("rocmfp2_mix")
    msgs = []
    for enc in (get_codec("rocmfp2_mix").encode_fast, lambda *a: _legacy_kernels.encode(*a, qt=qt, bits=2)):
        with pytest.raises(Exception) as e:
            enc(x, None, books)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1] and "row 1, block 1 (half 0)" in msgs[0], msgs


def test_nearest_by_bisection_equals_the_linear_scan():
    rng = np.random.default_rng(0)
    u = UE4M3[1:127].astype(F)
    ts = [rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(F),
          np.logspace(-12, 12, 20_000).astype(F), np.array([0, -0.0, np.inf, np.nan, 448, 449, 1e30], F)]
    for arr in (u, ((u[:-1] + u[1:]) / 2).astype(F)):
        for k in (-1, 0, 1):
            ts.append((arr.view(np.int32) + k).view(F))
    t = np.concatenate(ts)
    got = np.array([numba_mix._nearest_nb(v) for v in t[:: max(1, len(t) // 60_000)]])
    want = np.array([nearest_nb(v) for v in t[:: max(1, len(t) // 60_000)]])
    assert np.array_equal(got, want)


def test_pairwise_sum_is_np_sum_bit_for_bit():
    """The one-pass fitter evaluation's float64 total: numpy's pairwise order."""
    rng = np.random.default_rng(5)
    for n in (0, 1, 7, 8, 9, 127, 128, 129, 1000, 4096, 32768 + 5, 1 << 20):
        a = rng.standard_t(3, n) ** 2 * 1e-6
        assert search.pairwise_sum(a) == float(np.sum(a)), n
        if n >= 16 and n % 16 == 0:
            assert search.pairwise_sum(a) == float(np.sum(a.reshape(-1, 16)))
