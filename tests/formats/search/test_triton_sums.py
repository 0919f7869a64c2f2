"""The measure stage's float64 figures on a device are the host's bit for bit
(the Triton tier's sums, ``formats.search.triton_sums``): ``error_sums_device`` = ``metrics.error_sums``
(row partials in column order, rows added in order, non-finite decoded values
skipped and counted), ``pairwise_total`` = ``np.sum`` (numpy's pairwise tree),
under Triton's interpreter on the CPU and on CUDA where present."""

from __future__ import annotations

import numpy as np
import pytest

from ds4quant.formats.search.numba_fit import _pairwise_leaf_nb, pairwise_combine_nb, pairwise_leaves_nb
from ds4quant.metrics import error_sums

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
F = np.float32


@pytest.fixture(scope="module")
def md():
    from tests.runtime._interp import device_kernels

    return device_kernels("ds4quant.formats.search.triton_sums")


def _t(a):
    return torch.from_numpy(np.ascontiguousarray(a)).to("cuda" if CUDA else "cpu")


def _wide(rng, shape):
    """Values over many octaves, so any change of order changes the low bits."""
    return (rng.standard_normal(shape) * 2.0 ** rng.integers(-20, 20, shape)).astype(F)


@pytest.mark.parametrize("n", [129, 136, 255, 256, 1000, 4097, 65536 + 24, 300_007])
def test_pairwise_leaves_rebuild_np_sum(n):
    a = np.abs(_wide(np.random.default_rng(n), n).astype(np.float64))
    lo, ln = pairwise_leaves_nb(n)
    assert lo[0] == 0 and np.array_equal(lo[1:], lo[:-1] + ln[:-1]) and lo[-1] + ln[-1] == n
    assert ln.min() >= 8 and ln.max() <= 128
    vals = np.array([_pairwise_leaf_nb(a, lo_, n_) for lo_, n_ in zip(lo, ln)])
    assert 0.0 + pairwise_combine_nb(vals, n) == float(np.sum(a))


@pytest.mark.parametrize("n", [0, 1, 7, 128, 129, 136, 1000, 4097, 70_001])
def test_pairwise_total_equals_np_sum(md, n):
    rng = np.random.default_rng(7 + n)
    a = np.abs(_wide(rng, n).astype(np.float64)) * rng.random(n)
    got = md.pairwise_total(_t(a))
    assert got == float(np.sum(a)) and got == float(np.sum(a.reshape(-1, 1)))
    if n > 1000:  # the order matters on this data: a sequential sum differs
        assert got != float(np.add.accumulate(a)[-1])


@pytest.mark.parametrize("rows,cols", [(1, 5), (7, 33), (37, 256), (0, 16), (3, 0)])
def test_error_sums_device_equals_the_host(md, rows, cols):
    rng = np.random.default_rng(rows * 100 + cols)
    x = _wide(rng, (rows, cols))
    y = (x + _wide(rng, (rows, cols)) * F(1e-3)).astype(F)
    flat = y.reshape(-1)
    flat[::11] = np.nan  # skipped and counted, as metrics._rows does
    flat[5::13] = -np.inf
    w = np.exp(rng.standard_normal(cols)) * 2.0 ** rng.integers(-4, 4, cols)
    for wv in (w, None):
        want = error_sums(x, y, wv)
        got = md.error_sums_device(_t(x), _t(y), None if wv is None else _t(wv))
        assert got == want
    clean = error_sums(x, x + F(1), w)
    assert md.error_sums_device(_t(x), _t(x + F(1)), _t(w)) == clean and clean.finite


def test_error_sums_device_refuses_mismatched_shapes(md):
    with pytest.raises(ValueError, match="shapes"):
        md.error_sums_device(_t(np.zeros((2, 4), F)), _t(np.zeros((4, 2), F)))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.gpu
def test_ds4_sized_figures_on_cuda(md):
    rng = np.random.default_rng(3)
    x = (0.02 * rng.standard_t(3, (4096, 2048))).astype(F)
    y = (x + 1e-3 * rng.standard_normal(x.shape)).astype(F)
    w = np.exp(rng.standard_normal(2048))
    assert md.error_sums_device(_t(x), _t(y), _t(w)) == error_sums(x, y, w)
    t = ((x - y).astype(np.float64) ** 2).reshape(-1)
    assert md.pairwise_total(_t(t)) == float(np.sum(t))


@pytest.mark.parametrize("rows,cols", [(0, 64), (1, 4096), (48, 4096), (130, 2048), (7, 33)])
def test_column_square_sums_are_numpys(md, rows, cols):
    """calibrate's importance sums: np.square(x.astype(float64)).sum(axis=0), rows in order,
    bit for bit, over values spanning 40 octaves (any other order changes low bits)."""
    x = _wide(np.random.default_rng(rows * 7 + cols), (rows, cols))
    want = np.square(x.astype(np.float64)).sum(axis=0)
    got = md.column_square_sums(_t(x)).cpu().numpy()
    assert got.dtype == np.float64 and np.array_equal(got.view(np.uint64), want.view(np.uint64))
    if rows > 2:  # the check can fail: another order gives other bits here
        other = np.square(x[::-1].astype(np.float64)).sum(axis=0)
        assert not np.array_equal(other, want)
