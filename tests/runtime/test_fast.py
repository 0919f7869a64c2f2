"""Fast-mode kernels against formats.decode then a float64 product: every path
(lane GEMV, BLAS tiles) within the float32 summation bound (cols * 2^-24
of sum abs); the lane kernels' exact bits against a numpy emulation of their order;
the tile decoder bitwise equal to formats.decode; bytes independent of threads."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from ds4quant import formats
from ds4quant.formats import numba_threads
from ds4quant.formats.components import row_kind, row_lut
from ds4quant.runtime import fast as Fm
from ds4quant.runtime import jit
from ds4quant.runtime.jit import jit_call
from tests.runtime import _synth as S

NAMES = ["rocmfp2", "rocmfp2_s40", "rocmfp3", "rocmfp4", "rocmfp2_mix", "rocmfp3_mix", "rocmfp2_affine", "q8_0",
         "mxfp4", "bf16"]


def _cases(name, rows=40, cols=256):
    qt = formats.QTYPES[name]
    for mode in ((1, 0) if qt.is_mix else (1,)):
        if qt.is_mix:
            books = S.books_for(name, 0, 2)
            data = formats.encode(name, S.weights(name, 0, "gate", 2, rows, cols), codebooks=books, mode=mode)
            yield mode, books, data, formats.decode(name, data, cols, codebooks=books, modes=mode)
        else:
            data = formats.encode(name, S.weights(name, 0, "gate", 2, rows, cols))
            yield mode, None, data, formats.decode(name, data, cols)


@pytest.mark.parametrize("tokens", [1, 2, Fm.LANE_MIN_TOKENS, 9])
@pytest.mark.parametrize("name", NAMES)
def test_fast_matmul_close_to_decode(name, tokens):
    cols = 256
    for mode, books, data, W in _cases(name, cols=cols):
        W = W.astype(np.float64)
        x = S.tokens(tokens, seed=5)
        kind, p0, p1 = row_kind(name)
        got = Fm.fast_matmul(kind, p0, p1, data, cols, row_lut(name, books, mode), mode, x)
        ref = x.astype(np.float64) @ W.T
        scale = np.abs(x).astype(np.float64) @ np.abs(W).T
        assert got.shape == (tokens, data.shape[0])
        assert np.all(np.abs(got - ref) <= 2e-5 * scale + 1e-30), f"{name} mode {mode}: {np.max(np.abs(got - ref) / scale):.2e}"


@pytest.mark.parametrize("name", NAMES)
def test_decode_tile_is_formats_decode_bit_for_bit(name):
    cols = 256
    for mode, books, data, W in _cases(name, cols=cols):
        kind, p0, p1 = row_kind(name)
        out = np.full((data.shape[0] - 3, cols), np.nan, np.float32)
        Fm.decode_tile(kind, p0, p1, data, 3, data.shape[0], cols, row_lut(name, books, mode), mode, out)
        assert np.array_equal(out.view(np.uint32), W[3:].view(np.uint32)), f"{name} mode {mode}"


@pytest.mark.parametrize("name", ["rocmfp2", "rocmfp3", "rocmfp2_mix", "rocmfp3_mix"])
def test_lane_kernel_bits_follow_their_stated_order(name):
    """The GEMV's float32 order, emulated in numpy from formats.components: per
    16-weight group, lane k = level_k * x_k + level_{k+8} * x_{k+8}, times the group
    scale, added to lane accumulator k; then ((l0+l4)+(l1+l5))+((l2+l6)+(l3+l7)).
    Bit equality shows the vectoriser kept every operation (no reassociation, no FMA)."""
    cols = 256
    for mode, books, data, W in _cases(name, cols=cols):
        kind, p0, p1 = row_kind(name)
        bits = Fm.lane_bits(kind, p0, p1)
        assert bits in (2, 3)
        x = S.tokens(2, seed=9)
        got = np.empty((2, data.shape[0]), np.float32)
        jit_call(Fm.lane_matmul_nb, kind, p0, bits, data, cols, row_lut(name, books, mode), mode, x, got)
        kw = dict(codebooks=books, modes=mode) if books is not None else {}
        comp = formats.components(name, data, cols, **kw)
        lev = comp.levels[np.repeat(comp.table, 16, axis=1), comp.codes].astype(np.float32)
        sc = comp.scale.astype(np.float32)
        out = np.empty_like(got)
        for t in range(2):
            acc = np.zeros((data.shape[0], 8), np.float32)
            for g in range(cols // 16):
                Lg, xg = lev[:, 16 * g:16 * g + 16], x[t, 16 * g:16 * g + 16]
                pair = (Lg[:, :8] * xg[:8]).astype(np.float32) + (Lg[:, 8:] * xg[8:]).astype(np.float32)
                acc = (acc + (pair.astype(np.float32) * sc[:, g:g + 1]).astype(np.float32)).astype(np.float32)
            a = acc
            out[t] = ((a[:, 0] + a[:, 4]) + (a[:, 1] + a[:, 5])) + ((a[:, 2] + a[:, 6]) + (a[:, 3] + a[:, 7]))
        assert np.array_equal(got.view(np.uint32), out.view(np.uint32)), f"{name} mode {mode}"


@pytest.mark.parametrize("tokens", [1, 2, 5, 9])
@pytest.mark.parametrize("name", ["rocmfp2", "rocmfp3_mix", "rocmfp4"])
def test_fast_bytes_do_not_depend_on_threads_or_the_batch(name, tokens, monkeypatch):
    monkeypatch.setattr(jit, "PARALLEL_MIN_WORK", 0)  # the parallel kernels on 1 and 2 threads
    cols = 256
    mode, books, data, _ = next(_cases(name, rows=70, cols=cols))
    kind, p0, p1 = row_kind(name)
    lut = row_lut(name, books, mode)
    x = S.tokens(tokens, seed=3)
    outs = []
    for th in (1, 2) if numba.config.NUMBA_NUM_THREADS >= 2 else (1,):
        with numba_threads(th):
            outs.append(Fm.fast_matmul(kind, p0, p1, data, cols, lut, mode, x))
    monkeypatch.setattr(jit, "PARALLEL_MIN_WORK", 1 << 40)  # the serial twins
    outs.append(Fm.fast_matmul(kind, p0, p1, data, cols, lut, mode, x))
    assert all(np.array_equal(o.view(np.uint32), outs[0].view(np.uint32)) for o in outs)
    if tokens < Fm.LANE_MIN_TOKENS and Fm.lane_bits(kind, p0, p1):
        one = np.concatenate([Fm.fast_matmul(kind, p0, p1, data, cols, lut, mode, x[t:t + 1]) for t in range(tokens)])
        assert np.array_equal(one.view(np.uint32), outs[0].view(np.uint32))  # the GEMV: each token alone


def test_lane_families():
    assert Fm.lane_bits(*row_kind("rocmfp2")) == 2 and Fm.lane_bits(*row_kind("rocmfp3_mix")) == 3
    assert Fm.lane_bits(*row_kind("rocmfp2_s40")) == 2 and Fm.lane_bits(*row_kind("rocmfp3")) == 3
    assert Fm.lane_bits(*row_kind("rocmfp4")) == 0 and Fm.lane_bits(*row_kind("rocmfp2_affine")) == 0
    assert Fm.lane_bits(*row_kind("rocmfp4_fast")) == 0 and Fm.lane_bits(*row_kind("mxfp4")) == 0
