"""Fast-mode kernels against formats.decode then a float64 product: every path
(pair tables, fused GEMV, BLAS tiles) within the float32 summation bound (cols * 2^-24 of sum abs)."""

from __future__ import annotations

import numpy as np
import pytest

from ds4quant import formats
from ds4quant.formats._components import row_kind, row_lut
from ds4quant.runtime import fast as Fm
from tests.runtime import _synth as S


@pytest.mark.parametrize("tokens", [1, 3, Fm.GEMM_MIN_TOKENS])
@pytest.mark.parametrize("name", ["rocmfp2", "rocmfp2_s40", "rocmfp3", "rocmfp4", "rocmfp2_mix", "rocmfp3_mix",
                                  "rocmfp2_affine", "q8_0"])
@pytest.mark.parametrize("widths", [Fm.PAIR_WIDTHS, (2, 3)])  # (2, 3): the 3-bit pair tables too
def test_fast_matmul_close_to_decode(name, tokens, widths, monkeypatch):
    monkeypatch.setattr(Fm, "PAIR_WIDTHS", widths)
    qt = formats.QTYPES[name]
    rows, cols = 40, 256
    kw, books, mode = {}, None, 1
    for mode in ((1, 0) if qt.is_mix else (1,)):
        if qt.is_mix:
            books = S.books_for(name, 0, 2)
            data = formats.encode(name, S.weights(name, 0, "gate", 2, rows, cols), codebooks=books, mode=mode)
            kw = dict(codebooks=books, modes=mode)
        else:
            data = formats.encode(name, S.weights(name, 0, "gate", 2, rows, cols))
        W = formats.decode(name, data, cols, **kw).astype(np.float64)
        x = S.tokens(tokens, seed=5)
        kind, p0, p1 = row_kind(name)
        got = Fm.fast_matmul(kind, p0, p1, data, cols, row_lut(name, books, mode), mode, x)
        ref = x.astype(np.float64) @ W.T
        scale = np.abs(x).astype(np.float64) @ np.abs(W).T
        assert got.shape == (tokens, rows)
        assert np.all(np.abs(got - ref) <= 2e-5 * scale + 1e-30), f"{name} mode {mode}: {np.max(np.abs(got - ref) / scale):.2e}"


def test_pair_path_is_taken_for_two_and_three_bit_codes():
    assert Fm._pair_kind(*row_kind("rocmfp2")) == 2 and Fm._pair_kind(*row_kind("rocmfp3_mix")) == 3
    assert Fm._pair_kind(*row_kind("rocmfp4")) == 0 and Fm._pair_kind(*row_kind("rocmfp2_affine")) == 0
