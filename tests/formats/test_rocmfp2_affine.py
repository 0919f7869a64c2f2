"""ROCmFP2 AFFINE (ggml 107, ROCMFP2_AFFINE build): layout, exact bytes,
fast == reference, decoders bitwise equal, error bounds (docs/formats.md#rocmfp2-affine)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ds4quant import formats
from ds4quant.formats.qtype import RT_DS4QUANT, RT_LUCEBOX, RT_LUCEBOX_AFFINE
from ds4quant.formats.ue4m3 import UE4M3
from tests.golden import describe_float_mismatch, describe_mismatch

QT = "rocmfp2_affine"
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _enc(x, imp=None, impl="ref"):
    return formats.encode(QT, x, imp, impl=impl, nonfinite="reference")


def _same_bytes(x, imp=None):
    ref = _enc(x, imp, "ref")
    fast = _enc(x, imp, "fast")
    assert np.array_equal(fast, ref), describe_mismatch(fast, ref, 10)
    return ref


# --------------------------------------------------------------------------
# layout


def test_qtype_record():
    qt = formats.get_qtype(QT)
    assert (qt.ggml_type, qt.variant, qt.family) == (107, "fp2-affine", "rocmfpx")
    assert (qt.block_size, qt.block_bytes) == (32, 8 + 1 + 1)
    assert qt.bpw == 2.5
    assert qt.row_bytes(4096) == 1280
    assert qt.runtimes == (RT_DS4QUANT, RT_LUCEBOX_AFFINE)
    assert RT_LUCEBOX not in qt.runtimes  # a default Lucebox would misread it
    assert "ROCMFP2_AFFINE" in qt.description and "107" in qt.description
    assert qt in formats.qtypes_for_ggml_type(107)
    assert not qt.is_mix


def test_hand_built_block():
    # s = S(0x40) = 1, o = S(0x40) = 1: the grid is exactly {-1, 0, 1, 2}.
    x = np.tile(np.array([-1, 0, 1, 2], np.float32), 8)[None, :]
    want = bytes([0xE4] * 8 + [0x40, 0x40])  # codes 0,1,2,3 -> 0b11_10_01_00
    for impl in ("ref", "fast"):
        got = _enc(x, impl=impl)
        assert got.tobytes() == want
    y = formats.decode(QT, np.frombuffer(want, np.uint8), 32)
    assert np.array_equal(y, x)


def test_decode_two_roundings():
    # y = (code * S(e0)) - S(e1), each step a float32 operation (docs/formats.md#rocmfp2-affine).
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, size=(3, 40), dtype=np.uint8)
    blocks = data.reshape(-1, 10)
    codes = np.stack([(blocks[:, i // 4] >> (2 * (i % 4))) & 3 for i in range(32)], axis=1)
    prod = (codes.astype(np.float32) * UE4M3[blocks[:, 8]][:, None]).astype(np.float32)
    want = (prod - UE4M3[blocks[:, 9]][:, None]).astype(np.float32).reshape(3, 128)
    for impl in ("ref", "fast"):
        got = formats.decode(QT, data, 128, impl=impl)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), describe_float_mismatch(got, want)


def test_invalid_scale_bytes_decode_to_zero_scale():
    block = np.array([[0xFF] * 8 + [0x7F, 0x80]], np.uint8)  # both bytes > 0x7E -> 0
    for impl in ("ref", "fast"):
        y = formats.decode(QT, block, 32, impl=impl)
        assert np.array_equal(y.view(np.uint32), np.zeros((1, 32), np.uint32))  # +0.0, not -0.0


# --------------------------------------------------------------------------
# edge cases of docs/formats.md#rocmfp2-affine


def test_zero_and_nonfinite_blocks():
    x = np.zeros((2, 96), np.float32)
    x[0, 32:64] = np.nan
    x[1, 32:64] = [np.inf, -np.inf] * 16
    x[1, 64:96] = np.linspace(-1, 1, 32)
    out = _same_bytes(x)
    blocks = out.reshape(-1, 10)
    assert not blocks[[0, 1, 3, 4]].any()  # zero / all-non-finite blocks: (0, 0), codes 0
    assert blocks[5, 8] > 0


def test_nan_inside_block_codes_as_zero():
    x = np.linspace(-2, 2, 32).astype(np.float32)[None, :]
    x[0, 5] = np.nan
    x[0, 7] = np.inf
    out = _same_bytes(x)
    s, o = UE4M3[out[0, 8]], UE4M3[out[0, 9]]
    codes = [(out[0, i // 4] >> (2 * (i % 4))) & 3 for i in range(32)]
    zero_code = min(3, max(0, int(np.floor(np.float32(o / s) + np.float32(0.5)))))
    assert codes[5] == codes[7] == zero_code  # acode(NaN) = acode(Inf) = acode(0)
    # min/max and the error skip them, so which non-finite value sits there
    # never matters.
    other = x.copy()
    other[0, 5], other[0, 7] = -np.inf, np.nan
    assert np.array_equal(_same_bytes(other), out)


def test_zero_importance_gives_one_zero():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    imp = np.zeros(64, np.float32)
    out = _same_bytes(x, imp)
    assert np.array_equal(out.reshape(-1, 10)[:, 8:], np.tile([1, 0], (4, 1)))


def test_overflow_outlier_block():
    x = np.full((1, 32), 0.5, np.float32)
    x[0, 3] = 3e38
    x[0, 4] = -3e38
    out = _same_bytes(x, np.ones(32, np.float32))
    assert out.shape == (1, 10)


def test_threads_do_not_change_bytes():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((9, 256)).astype(np.float32)
    imp = rng.exponential(size=256).astype(np.float32)
    one = formats.encode(QT, x, imp, impl="fast", threads=1)
    two = formats.encode(QT, x, imp, impl="fast", threads=2)
    assert np.array_equal(one, two)


# --------------------------------------------------------------------------
# properties

_floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)


@st.composite
def _rows(draw):
    rows = draw(st.integers(1, 3))
    blocks = draw(st.integers(1, 3))
    if draw(st.booleans()):
        x = draw(hnp.arrays(np.float32, (rows, 32 * blocks), elements=_floats32))
    else:
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        scale = 10.0 ** draw(st.floats(-7, 4))
        x = (rng.standard_normal((rows, 32 * blocks)) * scale).astype(np.float32)
        x += np.float32(draw(st.floats(-3, 3))) * np.float32(scale)  # shifted blocks
        specials = np.array([0.0, np.nan, np.inf, -np.inf, 1e30, -3e38, 1e-40], np.float32)
        k = draw(st.integers(0, 4))
        idx = rng.integers(0, x.size, size=k)
        x.reshape(-1)[idx] = specials[rng.integers(0, len(specials), size=k)]
    return x


@st.composite
def _importance(draw, cols):
    kind = draw(st.sampled_from(["none", "random", "sparse"]))
    if kind == "none":
        return None
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = np.exp(1.5 * rng.standard_normal(cols)).astype(np.float32)
    if kind == "sparse":
        q[rng.random(cols) < 0.5] = 0
    return q


@SETTINGS
@given(data=st.data())
def test_fast_matches_reference(data):
    x = data.draw(_rows())
    imp = data.draw(_importance(x.shape[1]))
    _same_bytes(x, imp)


@SETTINGS
@given(a=st.integers(1, 126), b=st.integers(0, 126), seed=st.integers(0, 2**32 - 1))
def test_exact_grid_round_trips(a, b, seed):
    # Every value of code*S(a) - S(b) is exact in float32; with all four
    # codes present the only zero-error parameters are (a, b).
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 4, size=32)
    codes[rng.permutation(32)[:4]] = [0, 1, 2, 3]
    block = np.zeros((1, 10), np.uint8)
    for i, c in enumerate(codes):
        block[0, i // 4] |= c << (2 * (i % 4))
    block[0, 8], block[0, 9] = a, b
    y = formats.decode(QT, block, 32)
    for impl in ("ref", "fast"):
        assert np.array_equal(_enc(y, impl=impl), block)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), log_scale=st.floats(-1.5, 1.5), shift=st.floats(-2, 2))
def test_error_bound_relative_to_block_range(seed, log_scale, shift):
    # The sweeps only ever accept a lower (or equal) error, so the result is
    # no worse than the start point, whose grid spans the block's range R
    # (from min(min, 0) to max(max, 0)) with step ~R/3: RMS error <= R/3.
    rng = np.random.default_rng(seed)
    scale = np.float32(10.0**log_scale)
    x = ((rng.standard_normal((2, 128)) + np.float32(shift)) * scale).astype(np.float32)
    y = formats.decode(QT, _enc(x, impl="fast"), 128)
    xb, yb = x.reshape(-1, 32).astype(np.float64), y.reshape(-1, 32).astype(np.float64)
    span = np.maximum(xb.max(axis=1), 0) - np.minimum(xb.min(axis=1), 0)
    rms = np.sqrt(((xb - yb) ** 2).mean(axis=1))
    assert np.all(rms <= span / 3 + 2.0**-10), (rms / span).max()


@SETTINGS
@given(data=hnp.arrays(np.uint8, st.tuples(st.integers(1, 3), st.sampled_from([10, 20, 80]))))
def test_decoders_agree_on_random_bytes(data):
    torch = pytest.importorskip("torch")
    cols = data.shape[1] // 10 * 32
    ref = formats.decode(QT, data, cols, impl="ref")
    fast = formats.decode(QT, data, cols, impl="fast")
    tor = formats.decode_torch(QT, torch.from_numpy(data.copy()), cols).numpy()
    assert np.array_equal(fast.view(np.uint32), ref.view(np.uint32)), describe_float_mismatch(fast, ref)
    assert np.array_equal(tor.view(np.uint32), ref.view(np.uint32)), describe_float_mismatch(tor, ref)


def test_empty_rows():
    x = np.zeros((0, 64), np.float32)
    for impl in ("ref", "fast"):
        assert formats.encode(QT, x, impl=impl).shape == (0, 20)
        assert formats.decode(QT, np.zeros((0, 20), np.uint8), 64, impl=impl).shape == (0, 64)


def test_torch_decode_on_cuda_is_bitwise():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    rng = np.random.default_rng(11)
    data = rng.integers(0, 256, size=(64, 1280), dtype=np.uint8)
    data[0, 8::10] = np.arange(128, dtype=np.uint8)  # every scale byte, valid and invalid
    data[1, 9::10] = np.arange(128, 256, dtype=np.uint8)
    want = formats.decode(QT, data, 4096, impl="ref")
    got = formats.decode_torch(QT, torch.from_numpy(data).cuda(), 4096)
    assert got.device.type == "cuda"
    got = got.cpu().numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), describe_float_mismatch(got, want)
