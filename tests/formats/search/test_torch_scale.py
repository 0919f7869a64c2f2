"""The torch tier's scale search (``formats.search.torch_scale``) gives the
numba encoder's bytes for every qtype it covers, on torch's CPU device (CI)
and on CUDA where present.

- random matrices with edge values (the codec tests' generators: NaN/Inf,
  zero halves, outliers up to 3e38, subnormals; importance with zeros and
  overflowing weights), at the default windows, at windows too narrow for the
  proofs (every group through the full scan) and at the full window;
- FP4-grid matrices like DS4 Flash's experts: the same bytes, some groups
  proved inside the window and some scanned in full (both paths run);
- the search rules of docs/formats.md#scale-search (inf ties -> e = 1, FP4 never >= FLT_MAX,
  all-zero importance -> e = 1) and FP2's collapsing distances (|x/S| >= 2^24),
  where the threshold shortcut is off;
- FP2's threshold shortcut equals the distance rule on sampled float32 below 2^24;
- ``search.measure_scale`` (no packing) gives ``decode(encode(x))``'s bits, and
  ``measure_matrix`` on a device the host's Measure; refusals as ``encode``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4quant import formats
from ds4quant.errors import BadInputError
from ds4quant.formats import search
from ds4quant.formats.bits import unpack_bits
from ds4quant.formats.search import Backend, Tier, tables
from tests.formats.test_scale_codecs import SETTINGS, importances, matrices

torch = pytest.importorskip("torch")
from ds4quant.formats.search import torch_scale as sst  # noqa: E402

F = np.float32
CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
NAMES = list(search.SCALE_SEARCHES)
_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], F)


def _torch(dev) -> Backend:
    return Backend(Tier.TORCH, dev)


def _windows(mp, k, below):
    """Set every format's (window, below) inside a MonkeyPatch context."""
    mp.setattr(sst, "WINDOWS", {key: (k, below) for key in sst.WINDOWS})


def _numba(name, x, imp):
    return formats.encode(name, x, imp, impl="fast", nonfinite="reference")


def measured(name, x, imp, backend):
    """``search.measure_scale`` of host arrays: (payload bytes, the decoded values on the host)."""
    nbytes, Y = search.measure_scale(name, *search.scale_inputs(name, x, imp, backend), backend)
    return nbytes, search.to_host(Y)


def _bytes_and_codes(name, data, cols):
    """The scale bytes (rows, blocks, scales) and the FP2 codes (rows, cols) of ``data``."""
    fmt, group = search.SCALE_SEARCHES[name]
    qsb = 4 * int(tables.BITS[fmt])
    blk = data.reshape(-1, qsb + 32 // group)
    return blk[:, qsb:].reshape(data.shape[0], -1), unpack_bits(blk[:, :qsb], int(tables.BITS[fmt]), 32).reshape(-1, cols)


def _fp4_grid(rng, rows, cols):
    """E2M1 levels times a power-of-two scale per 32 (the DS4 Flash source)."""
    x = (0.02 * rng.standard_t(3, (rows, cols))).astype(F).reshape(rows, -1, 32)
    scale = (2.0 ** np.ceil(np.log2(np.maximum(np.abs(x).max(-1, keepdims=True), 1e-30) / 6.0))).astype(F)
    q = _E2M1[np.searchsorted((_E2M1[1:] + _E2M1[:-1]) / 2, np.abs(x) / scale)]
    return (np.sign(x) * q * scale).reshape(rows, cols).astype(F)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("name", NAMES)
@SETTINGS
@given(data=st.data())
def test_torch_encode_equals_numba(dev, name, data):
    x = data.draw(matrices(nonfinite=True))
    imp = data.draw(importances(x.shape[1]))
    want = _numba(name, x, imp)
    got = search.encode_scale(name, x, imp, _torch(dev), nonfinite="reference")
    assert np.array_equal(got, want)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("k,below", [(1, 0), (2, 2), (3, 0), (126, 0)])
@settings(SETTINGS, max_examples=12)
@given(data=st.data())
def test_any_window_gives_the_same_bytes(dev, name, k, below, data):
    x = data.draw(matrices(nonfinite=True))
    imp = data.draw(importances(x.shape[1]))
    with pytest.MonkeyPatch.context() as mp:
        _windows(mp, k, below)
        got = search.encode_scale(name, x, imp, _torch(dev), nonfinite="reference")
    assert np.array_equal(got, _numba(name, x, imp))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("name", NAMES)
def test_fp4_grid_matrices_run_both_paths(dev, name):
    rng = np.random.default_rng(11)
    x = _fp4_grid(rng, 64, 512)
    q = np.exp(rng.standard_normal(512)).astype(F)
    for imp in (q, None):
        stats: dict = {}
        got = search.encode_scale(name, x, imp, _torch(dev), stats=stats)
        assert np.array_equal(got, formats.encode(name, x, imp))
        assert 0 < stats["full_scans"] < 0.25 * stats["groups"], stats  # proved in the window, mostly


@pytest.mark.parametrize("dev", DEVICES)
def test_search_rules_and_collapsing_distances(dev):
    x = np.zeros((2, 64), F)
    x[0, 3] = 1e20  # every weighted candidate overflows: inf ties -> 1; FP4 never >= FLT_MAX -> 0
    x[0, 40], x[0, 41] = 1e20, 0.5  # FP2: |x/S| >= 2^24, all distances tie, the lower code
    x[1] = np.random.default_rng(1).standard_normal(64).astype(F)
    imp = np.ones(64, F)
    zero_imp = np.zeros(64, F)
    for name in NAMES:
        for q in (imp, zero_imp, None):
            want = _numba(name, x, q)
            assert np.array_equal(search.encode_scale(name, x, q, _torch(dev)), want), (name, q is None)
    e, codes = _bytes_and_codes("rocmfp2", search.encode_scale("rocmfp2", x, imp, _torch(dev)), 64)
    assert e[0, 0] == 1 and codes[0, 40] == 0
    e, _ = _bytes_and_codes("rocmfp4", search.encode_scale("rocmfp4", x, imp, _torch(dev)), 64)
    assert e[0, 0] == 0
    e, _ = _bytes_and_codes("rocmfp3", search.encode_scale("rocmfp3", x, zero_imp, _torch(dev)), 64)
    assert np.all(e[1] == 1)


def test_fp2_thresholds_equal_the_distance_rule_below_2_24():
    rng = np.random.default_rng(5)
    top = int(np.array([2.0**24], F).view(np.uint32)[0])
    bits = rng.integers(0, top, 1 << 20, dtype=np.uint32)
    near = np.array([-1.5, -0.5, 0.5, 1.5, 2.5], F)  # the thresholds and their float32 neighbours
    v = np.concatenate([bits.view(F), -bits.view(F), near, np.nextafter(near, F(-np.inf)),
                        np.nextafter(near, F(np.inf)), F([0.0, -0.0])])
    t = torch.from_numpy(v)
    T = tables.scale_format_on(t.device, tables.FP2)
    assert torch.equal(sst._fp2_level_fast(t, T), sst._fp2_level(t))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("name", NAMES)
def test_measure_scale_gives_the_decoded_bits(dev, name):
    rng = np.random.default_rng(2)
    x = (0.05 * rng.standard_t(3, (24, 256))).astype(F)
    q = np.exp(rng.standard_normal(256)).astype(F)
    for imp in (q, None):
        data = formats.encode(name, x, imp)
        nbytes, y = measured(name, x, imp, _torch(dev))
        assert nbytes == data.nbytes
        assert np.array_equal(y.view(np.uint32), formats.decode(name, data, 256).view(np.uint32))


@pytest.mark.parametrize("dev", DEVICES)
def test_measure_matrix_on_a_device_equals_the_host(dev):
    from ds4quant.plan import AdaptiveOptions, measure_matrix

    rng = np.random.default_rng(4)
    x = _fp4_grid(rng, 32, 256)
    q = np.exp(rng.standard_normal(256)).astype(F)
    opts = AdaptiveOptions(target_bpw=2.7)
    for name in NAMES:
        for imp, w in ((q, q.astype(np.float64)), (None, np.ones(256))):
            assert measure_matrix(x, imp, w, name, opts, seed="t/0") == \
                measure_matrix(x, imp, w, name, opts, seed="t/0", backend=_torch(dev))


def test_refusals_are_the_encoders():
    x = np.ones((2, 64), F)
    x[1, 5] = np.nan
    with pytest.raises(BadInputError, match="non-finite value at row 1, column 5"):
        search.encode_scale("rocmfp3", x, None, _torch("cpu"))
    with pytest.raises(BadInputError):
        formats.encode("rocmfp3", x)
    with pytest.raises(BadInputError):
        search.encode_scale("rocmfp4", np.ones((2, 48), F), None, _torch("cpu"))  # not a multiple of 32
    assert search.scale_covers("rocmfp2") and not search.scale_covers("rocmfp2", {"fp2s": True})
    assert not search.scale_covers("rocmfp6")
    assert search.encode_scale("rocmfp2", np.zeros((0, 64), F), None, _torch("cpu")).shape == (0, 20)
    with pytest.raises(BadInputError, match="numba"):  # a host backend has no device search
        search.encode_scale("rocmfp2", np.ones((1, 64), F), None, search.NUMBA)
