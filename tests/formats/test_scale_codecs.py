"""The scale-search codecs: rocmfp2 (+fp2s), rocmfp2_s40, rocmfp3/6/8, rocmfp4(+fast).

Golden vectors are checked in test_golden.py; here: layout sizes, the numba
path against the numpy reference byte for byte, torch and numba decode
against the numpy decode bit for bit, error bounds, edge blocks, the fp2s
mirror, the S40 fork semantics, and refusal of bad input.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4quant import formats
from ds4quant.errors import BadInputError, ShapeError
from ds4quant.formats import scale_codecs as ss
from ds4quant.formats.ue4m3 import FLT_MAX, UE4M3
from tests.golden import describe_float_mismatch, describe_mismatch, load_cases

F32 = np.float32
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# name -> (ggml type, variant, qs bytes, scale bytes, spec block bytes)
SPEC = {
    "rocmfp2": (107, "fp2-default", 8, 2, 10),
    "rocmfp2_s40": (107, "fp2-s40", 8, 2, 10),
    "rocmfp3": (104, "fp3", 12, 2, 14),
    "rocmfp6": (102, "fp6", 24, 2, 26),
    "rocmfp8": (103, "fp8", 32, 1, 33),
    "rocmfp4": (100, "fp4-cb10-h16", 16, 2, 18),
    "rocmfp4_fast": (101, "fp4-cb10-b32", 16, 1, 17),
}
NAMES = list(SPEC)
# name -> (element format, scale group, options to try)
FMT = {
    "rocmfp2": (ss.FP2, 16, [{}, {"fp2s": True}]),
    "rocmfp2_s40": (ss.S40, 16, [{}, {"zero_seed": True}]),
    "rocmfp3": (ss.FP3, 16, [{}]),
    "rocmfp6": (ss.FP6, 16, [{}]),
    "rocmfp8": (ss.FP8, 32, [{}]),
    "rocmfp4": (ss.FP4, 16, [{}]),
    "rocmfp4_fast": (ss.FP4, 32, [{}]),
}
_GOLDEN_FORMAT = {"rocmfp2": "fp2", "rocmfp3": "fp3", "rocmfp6": "fp6", "rocmfp8": "fp8",
                  "rocmfp4": "fp4", "rocmfp4_fast": "fp4fast"}


# --------------------------------------------------------------------------
# layout


@pytest.mark.parametrize("name", NAMES)
def test_layout_matches_spec(name):
    ggml, variant, qs, nscale, total = SPEC[name]
    qt = formats.get_qtype(name)
    assert (qt.ggml_type, qt.variant, qt.block_size) == (ggml, variant, 32)
    assert qt.block_bytes == qs + nscale == total
    assert re.search(rf"\bqs\[{qs}\]", qt.layout)
    assert (re.search(r"\be\[2\]", qt.layout) is not None) == (nscale == 2)
    assert ss.block_bytes(FMT[name][0], FMT[name][1]) == total
    assert qt.row_bytes(4096) == 128 * total


@pytest.mark.parametrize("name", list(_GOLDEN_FORMAT))
def test_block_bytes_match_golden(name):
    recs = [c.record for c in load_cases() if c.record["format"] == _GOLDEN_FORMAT[name]]
    assert recs
    for r in recs:
        assert r["block_bytes"] == formats.get_qtype(name).block_bytes
        assert r["row_bytes"] == formats.get_qtype(name).row_bytes(r["k"])


def test_runtimes_and_107_variants():
    assert formats.get_qtype("rocmfp2_s40").runtimes == ("ds4quant",)
    for name in ("rocmfp2", "rocmfp3", "rocmfp6", "rocmfp8", "rocmfp4", "rocmfp4_fast"):
        assert formats.get_qtype(name).runtimes == ("ds4quant", "lucebox")
    variants = {q.variant for q in formats.qtypes_for_ggml_type(107)}
    assert {"fp2-default", "fp2-s40"} <= variants


# --------------------------------------------------------------------------
# input generators


@st.composite
def matrices(draw, nonfinite=False, max_blocks=6):
    """Random float32 (rows, cols) with mixed distributions and edge values."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = draw(st.integers(1, 3))
    cols = 32 * draw(st.integers(1, max_blocks))
    dist = draw(st.sampled_from(["gauss", "laplace", "t3", "uniform", "grid", "sparse", "skew"]))
    x = {
        "gauss": lambda: rng.standard_normal((rows, cols)),
        "laplace": lambda: rng.laplace(size=(rows, cols)),
        "t3": lambda: rng.standard_t(3, size=(rows, cols)),
        "uniform": lambda: rng.uniform(-1, 1, (rows, cols)),
        "grid": lambda: rng.integers(-16, 17, (rows, cols)) / 4.0,  # exact ties
        "sparse": lambda: rng.standard_normal((rows, cols)) * (rng.random((rows, cols)) < 0.2),
        "skew": lambda: -np.abs(rng.standard_normal((rows, cols))) ** 2,
    }[dist]()
    x = (x * 2.0 ** draw(st.integers(-30, 10))).astype(F32)
    flat = x.reshape(-1)
    if draw(st.booleans()):  # zero a few 16-blocks
        for h in rng.choice(flat.size // 16, size=min(2, flat.size // 16), replace=False):
            flat[16 * h:16 * h + 16] = 0
    if draw(st.booleans()):  # outliers, up to overflowing ones
        for _ in range(draw(st.integers(1, 3))):
            flat[rng.integers(flat.size)] = draw(st.sampled_from([50.0, -300.0, 1e6, -1e20, 3e38, 1e-40]))
    if nonfinite and draw(st.booleans()):
        for _ in range(draw(st.integers(1, 6))):
            flat[rng.integers(flat.size)] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        if draw(st.booleans()):
            flat[16:32] = np.nan  # an all-NaN half
    return x


@st.composite
def importances(draw, cols):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["none", "exp", "zeros", "huge"]))
    if kind == "none":
        return None
    q = np.exp(1.5 * rng.standard_normal(cols)).astype(F32)
    q[rng.random(cols) < 0.1] = 0
    if kind == "zeros":
        q[: cols // 2] = 0
    if kind == "huge":
        q[rng.integers(cols)] = F32(3e38)  # weights overflow -> FLT_MAX (Lucebox) / inf (S40)
    return q


def _encode_both(name, x, imp, **opts):
    ref = formats.encode(name, x, imp, impl="ref", nonfinite="reference", **opts)
    fast = formats.encode(name, x, imp, impl="fast", nonfinite="reference", **opts)
    return ref, fast


# --------------------------------------------------------------------------
# numba == numpy


@pytest.mark.parametrize("name", NAMES)
@SETTINGS
@given(data=st.data())
def test_fast_encode_equals_reference(name, data):
    x = data.draw(matrices(nonfinite=True))
    imp = data.draw(importances(x.shape[1]))
    for opts in FMT[name][2]:
        ref, fast = _encode_both(name, x, imp, **opts)
        assert np.array_equal(ref, fast), describe_mismatch(fast, ref, formats.get_qtype(name).block_bytes)


@pytest.mark.parametrize("name", NAMES)
@SETTINGS
@given(data=st.data())
def test_decoders_agree_on_random_bytes(name, data):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    qt = formats.get_qtype(name)
    cols = 32 * data.draw(st.integers(1, 8))
    raw = rng.integers(0, 256, (data.draw(st.integers(1, 4)), qt.row_bytes(cols)), dtype=np.uint8)
    ref = formats.decode(name, raw, cols, impl="ref")
    fast = formats.decode(name, raw, cols, impl="fast")
    tor = formats.decode_torch(name, torch.from_numpy(raw), cols).numpy()
    assert np.array_equal(ref.view(np.uint32), fast.view(np.uint32)), describe_float_mismatch(fast, ref)
    assert np.array_equal(ref.view(np.uint32), tor.view(np.uint32)), describe_float_mismatch(tor, ref)


@pytest.mark.parametrize("name", NAMES)
def test_torch_cuda_decode_equals_numpy(name):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    rng = np.random.default_rng(17)
    qt = formats.get_qtype(name)
    raw = rng.integers(0, 256, (64, qt.row_bytes(4096)), dtype=np.uint8)
    x = rng.standard_normal((64, 4096)).astype(F32)
    for data in (raw, formats.encode(name, x)):
        got = formats.decode_torch(name, torch.from_numpy(data).cuda(), 4096)
        assert got.device.type == "cuda" and got.dtype == torch.float32
        want = formats.decode(name, data, 4096, impl="ref")
        got = got.cpu().numpy()
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), describe_float_mismatch(got, want)


@pytest.mark.parametrize("name", ["rocmfp2", "rocmfp3", "rocmfp4_fast"])
def test_thread_count_never_changes_bytes(name):
    x = np.random.default_rng(7).standard_normal((37, 256)).astype(F32)
    imp = np.exp(np.random.default_rng(8).standard_normal(256)).astype(F32)
    one = formats.encode(name, x, imp, threads=1)
    two = formats.encode(name, x, imp, threads=2)
    assert np.array_equal(one, two)


@SETTINGS
@given(x=matrices(nonfinite=True, max_blocks=64))
def test_row_energy_fast_equals_reference(x):
    x = np.concatenate([x, np.full((1, x.shape[1]), 3e19, F32)])  # forces the double fallback
    ref = ss.row_energy_ref(x)
    fast = np.array([ss.row_energy_nb(r) for r in x], dtype=F32)
    assert np.array_equal(ref.view(np.uint32), fast.view(np.uint32))
    ref40 = ss.row_energy_s40_ref(x)
    fast40 = np.array([ss.row_energy_s40_nb(r) for r in x], dtype=F32)
    assert np.array_equal(ref40.view(np.uint32), fast40.view(np.uint32))


def test_row_energy_overflow_falls_back_to_double():
    x = np.full((1, 64), 3e19, F32)  # x*x = 9e38 > FLT_MAX: float sum abandoned
    assert ss.row_energy_ref(x)[0] == FLT_MAX
    x = np.zeros((1, 64), F32)
    x[0, :3] = 1.5e19  # each square finite, but the sum passes FLT_MAX
    want = np.float32(min(3 * float(np.float64(F32(1.5e19)) ** 2) / 64, float(FLT_MAX)))
    assert ss.row_energy_ref(x)[0] == want == ss.row_energy_nb(x[0])


# --------------------------------------------------------------------------
# quality bounds

# Per element |d| <= half_gap * S* for the candidate S* = the smallest scale
# covering max/top (S* <= 1.125*max/top + 2^-10: UE4M3 steps are 1/8 relative
# above 2^-7 and 2^-10 absolute below). The chosen scale minimises the
# (weighted) squared error, so its (weighted) RMS is at most that bound.
# FP2 can only reach -1*S below zero, so it is bounded with top = 1.
BOUND = {  # name -> (top for S*, half of the largest level gap)
    "rocmfp2": (1, 0.5), "rocmfp2_s40": (4, 1.5), "rocmfp3": (4, 1.0), "rocmfp6": (31, 0.5),
    "rocmfp8": (127, 0.5), "rocmfp4": (10, 1.0), "rocmfp4_fast": (10, 1.0),
}


def _group_rms(name, x, y, w):
    g = FMT[name][1]
    d = (x.astype(np.float64) - y).reshape(-1, g)
    ww = np.ones_like(d) if w is None else np.broadcast_to(w, x.shape).reshape(-1, g).astype(np.float64)
    den = ww.sum(axis=1)
    rms = np.sqrt((ww * d * d).sum(axis=1) / np.where(den > 0, den, 1))
    return rms, np.abs(x).reshape(-1, g).max(axis=1), den > 0


@pytest.mark.parametrize("name", NAMES)
@SETTINGS
@given(data=st.data())
def test_round_trip_error_bound(name, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    cols = 32 * data.draw(st.integers(1, 8))
    x = rng.standard_normal((2, cols)) * 2.0 ** data.draw(st.integers(-24, 0))  # S* <= 224
    if data.draw(st.booleans()):
        x[0, rng.integers(cols)] *= 40  # a single outlier
    x = x.astype(F32)
    use_imp = data.draw(st.booleans())
    imp = np.exp(rng.standard_normal(cols)).astype(F32) if use_imp else None
    y = formats.decode(name, formats.encode(name, x, imp), cols)
    if imp is not None:
        sig = ss.row_energy_ref(x)
        w = ss.importance_weights_s40_ref(x, imp, sig) if name == "rocmfp2_s40" else ss.importance_weights_ref(x, imp, sig)
    else:
        w = None
    rms, mx, ok = _group_rms(name, x, y, w)
    top, half_gap = BOUND[name]
    bound = half_gap * (1.125 * mx / top + 2.0**-10)
    if name == "rocmfp8" and imp is None:
        # N(max/127): S >= max/127 - (max/127)/16, or - 2^-11 in the linear range
        bound = mx / 16 + 128 * 2.0**-11
    assert np.all(rms[ok] <= bound[ok] * (1 + 1e-5)), (rms / np.maximum(bound, 1e-30)).max()


@pytest.mark.parametrize("name", NAMES)
def test_all_zero_blocks(name):
    fmt, group, _ = FMT[name]
    qt = formats.get_qtype(name)
    x = np.zeros((2, 64), F32)
    x[1] = -0.0
    for imp in (None, np.ones(64, F32)):
        got = formats.encode(name, x, imp)
        qs = np.full(4 * int(ss.BITS[fmt]), 0x55 if fmt == ss.FP2 else 0, np.uint8)
        block = np.concatenate([qs, np.zeros(32 // group, np.uint8)])
        assert np.array_equal(got, np.tile(block, (2, 2))), got
        y = formats.decode(name, got, 64)
        # every code is the zero code times scale 0; S40 has no zero level, its
        # code 0 is -4 and decodes as -4 * 0 = -0.0
        want = np.full((2, 64), -0.0 if fmt == ss.S40 else 0.0, F32)
        assert np.array_equal(y.view(np.uint32), want.view(np.uint32))
    assert qt.block_bytes == block.size


@pytest.mark.parametrize("name", NAMES)
def test_tiny_and_subnormal_groups_get_the_smallest_scale(name):
    fmt, group, _ = FMT[name]
    x = np.full((1, 32), 1e-40, F32)  # subnormal float32
    x[0, 1::2] = -3e-6
    e, codes = ss.unpack_ref(fmt, formats.encode(name, x), 32, group)
    assert np.all(e == 1)  # values far below 2^-11 -> e = 1 (docs/formats.md#scale-search)
    if fmt == ss.S40:
        assert set(np.unique(codes)) <= {1, 2}  # no zero level: +-1 * 2^-10
        e0, _ = ss.unpack_ref(fmt, formats.encode(name, x, zero_seed=True), 32, group)
        assert np.all(e0 == 0)  # the zero-scale seed wins for such halves
    else:
        assert np.all(codes == ss.ZERO_CODE[fmt])


@pytest.mark.parametrize("name", [n for n in NAMES if n != "rocmfp2_s40"])
def test_single_outlier_is_kept(name):
    # At S* (see BOUND) the outlier errs by at most half_gap*S* and every
    # small value maps to zero (error x_j^2), so the chosen scale's group
    # error, hence the outlier's own, is at most that sum.
    group = FMT[name][1]
    x = (np.random.default_rng(3).standard_normal((1, 64)) * 0.01).astype(F32)
    x[0, 5], x[0, 40] = -7.5, 7.5
    y = formats.decode(name, formats.encode(name, x), 64)
    top, half_gap = BOUND[name]
    for i in (5, 40):
        g = slice(i - i % group, i - i % group + group)
        others = float(np.sum(x[0, g].astype(np.float64) ** 2)) - 7.5**2
        assert np.sign(y[0, i]) == np.sign(x[0, i])
        assert abs(y[0, i] - x[0, i]) <= np.sqrt((half_gap * 1.125 * 7.5 / top) ** 2 + others) + 1e-6


# --------------------------------------------------------------------------
# the search rules of docs/formats.md#scale-search


def test_search_overflow_rules():
    x = np.zeros((1, 32), F32)
    x[0, 3] = 1e20  # d^2 overflows for every candidate once weighted
    imp = np.ones(32, F32)
    for name, want in (("rocmfp2", 1), ("rocmfp3", 1), ("rocmfp6", 1), ("rocmfp4", 0), ("rocmfp4_fast", 0)):
        fmt, group, _ = FMT[name]
        for impl in ("ref", "fast"):
            e, _ = ss.unpack_ref(fmt, formats.encode(name, x, imp, impl=impl), 32, group)
            assert e[0, 0] == want, (name, impl)  # inf == inf -> e = 1; FP4: never >= FLT_MAX -> 0


def test_fp8_nearest_collapse_without_importance():
    x = np.zeros((1, 32), F32)
    x[0, 0] = 1e20  # N(1e20/127) collapses to 1 in float32 (docs/formats.md#ue4m3)
    for impl in ("ref", "fast"):
        assert formats.encode("rocmfp8", x, impl=impl)[0, 32] == 1


def test_zero_importance_group_takes_e1():
    x = np.random.default_rng(1).standard_normal((1, 32)).astype(F32)
    imp = np.zeros(32, F32)
    for name in ("rocmfp2", "rocmfp3", "rocmfp6", "rocmfp8", "rocmfp4_fast"):
        fmt, group, _ = FMT[name]
        e, _ = ss.unpack_ref(fmt, formats.encode(name, x, imp), 32, group)
        assert np.all(e == 1), name  # all errors 0: the smallest byte wins


def test_fp2_outlier_code_collapses_like_the_reference():
    # |x/S| >= 2^24: the float32 distances to all levels tie, the lower code wins.
    x = np.zeros((1, 32), F32)
    x[0, 0], x[0, 1] = 1e20, 0.5
    imp = np.ones(32, F32)
    for impl in ("ref", "fast"):
        e, codes = ss.unpack_ref(ss.FP2, formats.encode("rocmfp2", x, imp, impl=impl), 32, 16)
        assert e[0, 0] == 1 and codes[0, 0] == 0


# --------------------------------------------------------------------------
# fp2s


def _fp2_block(codes, e0, e1):
    return ss.pack_ref(ss.FP2, np.array([[e0, e1]], np.uint8), np.asarray(codes, np.uint8).reshape(1, 32), 16)


def test_fp2s_mirror_decode():
    codes = np.tile([0, 1, 2, 3], 8)
    plain = formats.decode("rocmfp2", _fp2_block(codes, 0x40, 0x38), 32)  # S = 1, 0.5
    mirr = formats.decode("rocmfp2", _fp2_block(codes, 0xC0, 0xB8), 32)
    assert np.array_equal(plain[0, :4], [-1, 0, 1, 2]) and np.array_equal(plain[0, 16:20], [-0.5, 0, 0.5, 1])
    assert np.array_equal(mirr.view(np.uint32), (-plain).view(np.uint32))  # zero code -> -0.0
    assert np.signbit(mirr[0, 1]) and not np.signbit(plain[0, 1])
    inval = formats.decode("rocmfp2", _fp2_block(codes, 0x7F, 0xFF), 32)
    assert np.all(inval == 0)
    assert np.array_equal(np.signbit(inval[0, :4]), [True, False, False, False])  # -1 * +0
    assert np.array_equal(np.signbit(inval[0, 16:20]), [False, True, True, True])  # V * -0
    for impl in ("ref", "fast"):
        got = formats.decode("rocmfp2", _fp2_block(codes, 0xC0, 0xFF), 32, impl=impl)
        assert np.array_equal(got[0, :16].view(np.uint32), mirr[0, :16].view(np.uint32))


def _half_errors(x, y, w=None):
    with np.errstate(over="ignore"):
        d = (x - y).astype(F32)
        t = d * d if w is None else (w * d) * d
    err = np.zeros(x.size // 16, F32)
    for i in range(16):
        err += t.reshape(-1, 16)[:, i]
    return err


@SETTINGS
@given(x=matrices(), use_imp=st.booleans())
def test_fp2s_never_increases_the_error(x, use_imp):
    imp = np.exp(np.random.default_rng(0).standard_normal(x.shape[1])).astype(F32) if use_imp else None
    w = None if imp is None else ss.importance_weights_ref(x, imp, ss.row_energy_ref(x))
    plain = formats.encode("rocmfp2", x, imp)
    mirrored = formats.encode("rocmfp2", x, imp, fp2s=True)
    ep = _half_errors(x, formats.decode("rocmfp2", plain, x.shape[1]), w)
    em = _half_errors(x, formats.decode("rocmfp2", mirrored, x.shape[1]), w)
    assert np.all((em <= ep) | np.isnan(ep))
    e = mirrored.reshape(-1, 10)[:, 8:].reshape(-1)
    flipped = (e & 0x80) != 0
    assert np.all(em[flipped] < ep[flipped])  # set only when strictly better
    assert np.array_equal(mirrored.reshape(-1, 10)[~flipped.reshape(-1, 2).any(1)],
                          plain.reshape(-1, 10)[~flipped.reshape(-1, 2).any(1)])


def test_fp2s_helps_negatively_skewed_data():
    rng = np.random.default_rng(11)
    x = (-np.abs(rng.standard_normal((16, 256))) ** 1.5).astype(F32)
    plain = formats.decode("rocmfp2", formats.encode("rocmfp2", x), 256)
    enc = formats.encode("rocmfp2", x, fp2s=True)
    mirrored = formats.decode("rocmfp2", enc, 256)
    assert np.mean((x - mirrored) ** 2) < 0.8 * np.mean((x - plain) ** 2)
    assert np.mean(enc.reshape(-1, 10)[:, 8:] >= 0x80) > 0.5
    assert not np.any(formats.encode("rocmfp2", x).reshape(-1, 10)[:, 8:] & 0x80)  # default: never


# --------------------------------------------------------------------------
# S40 fork semantics


def test_s40_levels_and_codes():
    # S = 0.25 (e = 0x30): |x/S| <= 2.5 -> +-1, above -> +-4; signbit picks the side.
    inv = ss.UE4M3_INV[0x30]
    x = np.array([0.25, -0.25, 1.0, -1.0, 0.625, 0.6251, -0.0, 0.0], F32)
    assert np.array_equal(ss.quantize_ref(ss.S40, x, inv), [2, 1, 3, 0, 2, 3, 1, 2])
    raw = ss.pack_ref(ss.S40, np.array([[0x30, 0x30]], np.uint8), np.tile([0, 1, 2, 3], 8).reshape(1, 32), 16)
    assert np.array_equal(formats.decode("rocmfp2_s40", raw, 32)[0, :4], [-1.0, -0.25, 0.25, 1.0])
    # data on the S = 0.25 grid is reproduced exactly, with that scale
    x = np.tile(np.array([0.25, -0.25, 1.0, -1.0], F32), 8).reshape(1, 32)
    for impl in ("ref", "fast"):
        enc = formats.encode("rocmfp2_s40", x, impl=impl)
        assert np.array_equal(enc[0, 8:], [0x30, 0x30])
        assert np.array_equal(formats.decode("rocmfp2_s40", enc, 32), x)


def test_s40_nonfinite_gets_code_zero():
    x = np.ones((1, 32), F32)
    x[0, 3] = np.nan
    _, codes = ss.unpack_ref(ss.S40, formats.encode("rocmfp2_s40", x, nonfinite="reference"), 32, 16)
    assert codes[0, 3] == 0  # the fork's quantiser: non-finite -> code 0 (the -4 level)


def test_s40_unclamped_weights_follow_the_fork():
    # 3e19^2 overflows the fork's plain float32 energy sum: sigma^2 = inf, so
    # every weight with q > 0 is inf and a candidate that reproduces a value
    # exactly (d = 0) scores inf*0 = NaN. NaN is never chosen; all-inf picks
    # the smallest byte; a NaN zero-scale seed keeps byte 0.
    x = (np.random.default_rng(0).integers(-8, 9, (1, 64)) / 4.0).astype(F32)
    x[0, 0] = 3e19
    imp = np.ones(64, F32)
    w = ss.importance_weights_s40_ref(x, imp, ss.row_energy_s40_ref(x))
    assert np.isinf(w).all()
    err = ss.candidate_errors_ref(ss.S40, x.reshape(-1, 16), w.reshape(-1, 16))
    assert np.isnan(err[:, 1:]).any(axis=1).all()
    for impl in ("ref", "fast"):
        e, _ = ss.unpack_ref(ss.S40, formats.encode("rocmfp2_s40", x, imp, impl=impl), 64, 16)
        assert np.all(e == 1)
        e, _ = ss.unpack_ref(ss.S40, formats.encode("rocmfp2_s40", x, imp, impl=impl, zero_seed=True), 64, 16)
        assert np.all(e == 0)


def test_s40_zero_seed_never_increases_the_error():
    rng = np.random.default_rng(5)
    tiny_halves = np.repeat(rng.random((8, 16)) < 0.5, 16, axis=1)  # whole halves far below 2^-10
    x = (rng.standard_normal((8, 256)) * np.where(tiny_halves, 1e-5, 1)).astype(F32)
    a = formats.decode("rocmfp2_s40", formats.encode("rocmfp2_s40", x), 256)
    b = formats.decode("rocmfp2_s40", formats.encode("rocmfp2_s40", x, zero_seed=True), 256)
    ea, eb = _half_errors(x, a), _half_errors(x, b)
    assert np.all(eb <= ea) and np.any(eb < ea)


# --------------------------------------------------------------------------
# refusals through the public API


@pytest.mark.parametrize("name", NAMES)
def test_bad_input_is_refused(name):
    x = np.ones((2, 64), F32)
    with pytest.raises(ShapeError, match="multiple of 32"):
        formats.encode(name, np.ones((2, 48), F32))
    imp = np.ones(64, F32)
    imp[7] = -1
    with pytest.raises(BadInputError, match="importance must be >= 0; column 7"):
        formats.encode(name, x, imp)
    with pytest.raises(ShapeError, match="length 64"):
        formats.encode(name, x, np.ones(32, F32))
    bad = x.copy()
    bad[1, 9] = np.nan
    with pytest.raises(BadInputError, match="non-finite value at row 1, column 9"):
        formats.encode(name, bad)
    with pytest.raises(BadInputError, match="has no option"):
        formats.encode(name, x, bogus=True)
    with pytest.raises(ShapeError):
        formats.decode(name, np.zeros(formats.get_qtype(name).block_bytes + 1, np.uint8), 32)


def test_fp2s_is_rocmfp2_only():
    with pytest.raises(BadInputError, match="fp2s"):
        formats.encode("rocmfp3", np.ones((1, 32), F32), fp2s=True)
    with pytest.raises(BadInputError, match="zero_seed"):
        formats.encode("rocmfp2", np.ones((1, 32), F32), zero_seed=True)


def test_empty_rows():
    for name in NAMES:
        out = formats.encode(name, np.zeros((0, 64), F32))
        assert out.shape == (0, formats.get_qtype(name).row_bytes(64))
        assert formats.decode(name, out, 64).shape == (0, 64)


def test_scale_tables():
    assert np.array_equal(ss.SCALES[ss.FP3], UE4M3)
    assert ss.SCALES[ss.FP2, 0xC0] == -1.0 and np.signbit(ss.SCALES[ss.FP2, 0xFF])
    assert ss.LEVELS[ss.FP6, 32] == 0 and not np.signbit(ss.LEVELS[ss.FP6, 32])  # "-0" -> +0
    assert list(ss.LEVELS[ss.FP4, 8:16]) == [0, -1, -2, -3, -4, -6, -8, -10]
