"""Interchange and source codecs against gguf-py and torch: bytes and float bits."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ds4quant import formats
from ds4quant.errors import BadInputError, CorruptDataError, ShapeError, UnsupportedFormatError
from ds4quant.formats import fp8, mxfp4, plain
from tests.golden import describe_float_mismatch, describe_mismatch

gguf = pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants  # noqa: E402

GGUF_TYPES = {"mxfp4": T.MXFP4, "q8_0": T.Q8_0, "bf16": T.BF16, "f16": T.F16, "f32": T.F32}
ENCODABLE = list(GGUF_TYPES)


def _gguf_encode(name: str, x: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        out = quants.quantize(x, GGUF_TYPES[name])
    return np.ascontiguousarray(out).view(np.uint8).reshape(x.shape[0], -1)


def _gguf_decode(name: str, data: np.ndarray, cols: int) -> np.ndarray:
    t = GGUF_TYPES[name]
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        if t == T.F32:
            out = data.view(np.float32)
        elif t == T.F16:
            out = quants.dequantize(data.view(np.float16), t)
        else:
            out = quants.dequantize(data, t)
    return np.asarray(out, dtype=np.float32).reshape(data.shape[0], cols)


def _bits_equal(a, b) -> bool:
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32))


def _heavy(rng, rows, cols, spread=30.0) -> np.ndarray:
    """Student-t rows with per-row scales over 10^+-spread: every exponent path."""
    scale = 10.0 ** rng.uniform(-spread, spread, size=(rows, 1))
    with np.errstate(over="ignore"):  # the widest spread may overflow float32 on purpose
        return (rng.standard_t(3, size=(rows, cols)) * scale).astype(np.float32)


def _edge_blocks() -> np.ndarray:
    """Blocks that hit the awkward branches: zeros, subnormals, near powers of two,
    exact midpoints between grid points, huge values."""
    f32 = np.float32
    rows = []
    rows.append(np.zeros(32, f32))
    rows.append(-np.zeros(32, f32))
    rows.append(np.full(32, np.finfo(f32).smallest_subnormal))
    rows.append(np.arange(32, dtype=np.uint32).view(f32))  # tiny subnormals incl. 0
    rows.append(np.linspace(-1e-39, 1e-39, 32).astype(f32))
    rows.append(np.linspace(-3e38, 3e38, 32).astype(f32))
    rows.append(np.full(32, np.finfo(f32).max))
    for p in (-130, -126, -20, -1, 0, 1, 2, 3, 7, 100, 127):
        top = np.uint32(int(np.float32(2.0**p).view(np.uint32)))
        below = (top - np.arange(1, 33, dtype=np.uint32)).view(f32)
        rows.append(below)  # amax a few ulps under a power of two
        rows.append(-below)
    # exact midpoints of the MXFP4 grid at scale 1 (amax 6 -> e = 127 + 0)
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4, f32)
    rows.append(mids)
    rows.append(-mids)
    # Q8_0 halfway codes: amax 127 -> d = 1, id = 1
    rows.append(np.array([127.0] + [k + 0.5 for k in range(-15, 16)], f32))
    return np.stack(rows)


# --------------------------------------------------------------------------
# registry entries agree with gguf-py's size table


@pytest.mark.parametrize("name", ENCODABLE)
def test_qtype_geometry_matches_gguf(name):
    qt = formats.get_qtype(name)
    t = GGUF_TYPES[name]
    assert qt.ggml_type == int(t)
    assert (qt.block_size, qt.block_bytes) == GGML_QUANT_SIZES[t]


def test_decode_only_types():
    assert formats.get_qtype("i32").ggml_type == int(T.I32)
    for name in ("fp8_e4m3", "e8m0", "i32"):
        assert not formats.get_qtype(name).can_encode
        with pytest.raises(UnsupportedFormatError):
            formats.encode(name, np.zeros((1, 4), np.float32))


# --------------------------------------------------------------------------
# encode: bytes equal gguf-py's


@pytest.mark.parametrize("impl", ["ref", "fast"])
@pytest.mark.parametrize("name", ENCODABLE)
@pytest.mark.parametrize("rows,cols", [(17, 64), (3, 4096), (1, 32)])
def test_encode_matches_gguf_py(name, impl, rows, cols):
    if impl == "fast" and formats.get_codec(name).encode_fast is None:
        pytest.skip(f"{name} has no fast encoder")
    rng = np.random.default_rng(rows * 1000 + cols)
    x = _heavy(rng, rows, cols)
    got = formats.encode(name, x, impl=impl)
    want = _gguf_encode(name, x)
    assert np.array_equal(got, want), describe_mismatch(got, want, formats.get_qtype(name).block_bytes)


@pytest.mark.parametrize("impl", ["ref", "fast"])
@pytest.mark.parametrize("name", ENCODABLE)
def test_encode_edge_blocks_match_gguf_py(name, impl):
    if impl == "fast" and formats.get_codec(name).encode_fast is None:
        pytest.skip(f"{name} has no fast encoder")
    x = _edge_blocks()
    got = formats.encode(name, x, impl=impl)
    want = _gguf_encode(name, x)
    assert np.array_equal(got, want), describe_mismatch(got, want, formats.get_qtype(name).block_bytes)


@pytest.mark.parametrize("impl", ["ref", "fast"])
@pytest.mark.parametrize("name", ENCODABLE)
def test_encode_nonfinite_like_gguf_py(name, impl):
    if impl == "fast" and formats.get_codec(name).encode_fast is None:
        pytest.skip(f"{name} has no fast encoder")
    rng = np.random.default_rng(5)
    x = _heavy(rng, 6, 64, spread=3)
    x[0, 3] = np.nan
    x[1, 40] = np.inf
    x[2, 0] = -np.inf
    x[3, :32] = np.nan
    x[4, 7] = np.inf
    x[4, 9] = np.nan
    x[5, 33] = np.float32(np.uint32(0x7F800001).view(np.float32))  # signalling NaN
    with pytest.raises(BadInputError):
        formats.encode(name, x, impl=impl)
    got = formats.encode(name, x, impl=impl, nonfinite="reference")
    want = _gguf_encode(name, x)
    assert np.array_equal(got, want), describe_mismatch(got, want, formats.get_qtype(name).block_bytes)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    rows=st.integers(1, 5),
    nblk=st.integers(1, 4),
    spread=st.sampled_from([0.0, 3.0, 38.0]),
)
def test_encode_random_matches_gguf_py(seed, rows, nblk, spread):
    rng = np.random.default_rng(seed)
    x = _heavy(rng, rows, 32 * nblk, spread=spread)
    if seed % 3 == 0:  # quantised inputs: many ties and repeats
        with np.errstate(over="ignore"):
            x = np.round(x * 4) / 4
    assume(np.all(np.isfinite(x)))  # the widest spread can overflow float32
    for name in ("mxfp4", "q8_0", "bf16"):
        want = _gguf_encode(name, x)
        for impl in ("ref", "fast"):
            if impl == "fast" and formats.get_codec(name).encode_fast is None:
                continue
            got = formats.encode(name, x, impl=impl)
            assert np.array_equal(got, want), f"{name}/{impl}: " + describe_mismatch(
                got, want, formats.get_qtype(name).block_bytes)


def test_mxfp4_exponent_table_matches_float32_log2():
    """The integer round-up thresholds reproduce floor(log2f(a)) on every float32
    within 600 ulps below each power of two (where log2f can round up)."""
    pats = []
    for p in range(-148, 128):
        top = int(np.float32(2.0**p).view(np.uint32)) if p >= -126 else 1 << (p + 149)
        pats.append(np.arange(max(1, top - 600), top + 3, dtype=np.int64))
    bits = np.concatenate(pats)
    vals = bits.astype(np.uint32).view(np.float32)
    with np.errstate(all="ignore"):
        want = np.floor(np.log2(vals)).astype(np.int64)
    got = mxfp4.floor_log2f(bits)
    bad = np.nonzero(got != want)[0]
    assert not len(bad), f"{len(bad)} differ, first {vals[bad[0]]!r}: got {got[bad[0]]} want {want[bad[0]]}"
    assert np.sum(want != np.floor(np.log2(vals.astype(np.float64)))) > 1000  # the effect is real


def test_mxfp4_fast_equals_ref_large():
    x = _heavy(np.random.default_rng(9), 256, 1024, spread=5)
    a = formats.encode("mxfp4", x, impl="ref")
    b = formats.encode("mxfp4", x, impl="fast")
    assert np.array_equal(a, b), describe_mismatch(a, b, 17)
    b1 = formats.encode("mxfp4", x, impl="fast", threads=1)
    assert np.array_equal(b, b1)


def test_q8_0_fast_equals_ref_large():
    x = _heavy(np.random.default_rng(10), 256, 1024, spread=5)
    a = formats.encode("q8_0", x, impl="ref")
    b = formats.encode("q8_0", x, impl="fast")
    assert np.array_equal(a, b), describe_mismatch(a, b, 34)
    assert np.array_equal(b, formats.encode("q8_0", x, impl="fast", threads=1))


# --------------------------------------------------------------------------
# decode: values equal gguf-py's; fast and torch bitwise equal the reference


ALL_DECODERS = ["mxfp4", "q8_0", "bf16", "f16", "f32", "i32", "fp8_e4m3", "e8m0"]


@pytest.mark.parametrize("name", ENCODABLE)
def test_decode_random_bytes_matches_gguf_py(name):
    qt = formats.get_qtype(name)
    rng = np.random.default_rng(11)
    data = rng.integers(0, 256, (19, qt.row_bytes(128)), dtype=np.uint8)
    with np.errstate(all="ignore"):
        got = formats.decode(name, data, 128)
    want = _gguf_decode(name, data, 128)
    assert _bits_equal(got, want), describe_float_mismatch(got, want)


@pytest.mark.parametrize("name", ALL_DECODERS)
def test_decode_fast_and_torch_bitwise_equal_ref(name):
    torch = pytest.importorskip("torch")
    qt = formats.get_qtype(name)
    rng = np.random.default_rng(12)
    cols = 96 if qt.block_size == 1 else 128
    data = rng.integers(0, 256, (23, qt.row_bytes(cols)), dtype=np.uint8)
    data[0] = 0  # all-zero row
    with np.errstate(all="ignore"):
        ref = formats.decode(name, data, cols, impl="ref")
        auto = formats.decode(name, data, cols)
    assert _bits_equal(ref, auto), describe_float_mismatch(auto, ref)
    got = formats.decode_torch(name, torch.from_numpy(data), cols).numpy()
    assert got.dtype == np.float32 and got.shape == (23, cols)
    assert _bits_equal(got, ref), describe_float_mismatch(got, ref)


@pytest.mark.parametrize("name", ["mxfp4", "q8_0"])
def test_encode_decode_round_trip_bounded(name):
    x = _heavy(np.random.default_rng(13), 8, 256, spread=2)
    y = formats.decode(name, formats.encode(name, x), 256)
    blocks = np.abs(x).reshape(-1, 32).max(axis=1, keepdims=True)
    err = np.abs(y - x).reshape(-1, 32) / blocks
    # q8_0: half a step of amax/127 plus 127 steps of the f16 rounding of d;
    # mxfp4: clipping at 1.5*2^floor(log2 amax) and the top step bound it by amax/4
    bound = (0.5 + 127 * 2.0**-11) / 127 * 1.001 if name == "q8_0" else 0.25 + 1e-6
    assert err.max() <= bound


def test_bf16_encode_rounds_ties_to_even_and_quiets_nan():
    words = np.array([0x3F808000, 0x3F818000, 0x3F807FFF, 0x7F7FFFFF, 0x7F800001, 0xFF810000], np.uint32)
    got = formats.encode("bf16", words.view(np.float32).reshape(1, -1), nonfinite="reference").view("<u2")[0]
    assert [hex(v) for v in got] == ["0x3f80", "0x3f82", "0x3f80", "0x7f80", "0x7fc0", "0xffc1"]


# --------------------------------------------------------------------------
# FP8 / E8M0 / E2M1 source elements


def test_e4m3_and_e8m0_tables_equal_torch_casts():
    torch = pytest.importorskip("torch")
    u = torch.arange(256, dtype=torch.uint8)
    assert _bits_equal(fp8.E4M3, u.view(torch.float8_e4m3fn).float().numpy())
    assert _bits_equal(fp8.E8M0, u.view(torch.float8_e8m0fnu).float().numpy())
    assert fp8.E4M3[0x7E] == 448.0 and fp8.E4M3[1] == 2.0**-9 and np.isnan(fp8.E4M3[[0x7F, 0xFF]]).all()
    assert fp8.E8M0[127] == 1.0 and fp8.E8M0[0] == 2.0**-127 and np.isnan(fp8.E8M0[255])


def test_e2m1_table_is_exact_ocp():
    for c in range(16):
        sign = -1.0 if c & 8 else 1.0
        exp, man = (c >> 1) & 3, c & 1
        v = sign * (man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1))
        assert fp8.E2M1[c] == v and np.signbit(fp8.E2M1[c]) == bool(c & 8)
    assert np.array_equal(2 * np.abs(fp8.E2M1), np.abs(mxfp4.KV))


@pytest.mark.parametrize("rows,cols", [(256, 384), (200, 300), (128, 64), (1, 1)])
def test_dequant_fp8_blocks_equals_torch(rows, cols):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(rows + cols)
    w = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    w[w == 0x7F] = 0x7E
    w[w == 0xFF] = 0xFE
    grid = fp8.fp8_scale_grid(rows, cols)
    s = rng.integers(100, 150, grid, dtype=np.uint8)
    got = fp8.dequant_fp8_blocks(w, s)
    # independent: torch casts, scale expanded per element
    tw = torch.from_numpy(w).view(torch.float8_e4m3fn).float()
    ts = torch.from_numpy(s).view(torch.float8_e8m0fnu).float()
    ts = ts.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    assert _bits_equal(got, (tw * ts).numpy())
    with pytest.raises(ShapeError):
        fp8.dequant_fp8_blocks(w, s[:, :1] if grid[1] > 1 else np.zeros((grid[0], 2), np.uint8))


def test_dequant_e2m1_blocks_exact():
    rng = np.random.default_rng(14)
    packed = rng.integers(-128, 128, (8, 64), dtype=np.int8)  # (out 8, in 128)
    s = rng.integers(110, 140, (8, 4), dtype=np.uint8)
    got = fp8.dequant_e2m1_blocks(packed, s)
    u = packed.view(np.uint8)
    for r in (0, 7):
        for c in (0, 1, 31, 32, 127):
            code = (u[r, c // 2] >> (4 * (c % 2))) & 0xF
            assert got[r, c] == fp8.E2M1[code] * 2.0 ** (int(s[r, c // 32]) - 127)
    with pytest.raises(ShapeError):
        fp8.dequant_e2m1_blocks(packed, s[:, :3])


def test_dequant_e2m1_fast_path_equals_numpy():
    """The numba pass gives the numpy reference's bits, every code and every
    scale byte (0: 2^-127, 254: 2^127, 255: NaN; products that overflow to inf)."""
    rng = np.random.default_rng(15)
    packed = rng.integers(-128, 128, (64, 512), dtype=np.int8)
    s = rng.integers(0, 256, (64, 32), dtype=np.uint8)
    s[0, :] = np.arange(32, dtype=np.uint8) + 224
    want = fp8.dequant_e2m1_blocks(packed, s, impl="ref")
    got = fp8.dequant_e2m1_blocks(packed, s)
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.isinf(got).any() and np.isnan(got).any()
    # a strided view reads the same values
    assert np.array_equal(fp8.dequant_e2m1_blocks(packed[::2], s[::2]).view(np.uint32), want[::2].view(np.uint32))


# --------------------------------------------------------------------------
# DeepSeek FP4 -> MXFP4 lossless repack


def _fp4_source(rng, rows, cols, lo=1, hi=254):
    packed = rng.integers(-128, 128, (rows, cols // 2), dtype=np.int8)
    scales = rng.integers(lo, hi + 1, (rows, cols // 32), dtype=np.uint8)
    return packed, scales


@pytest.mark.parametrize("lo,hi", [(100, 150), (0, 254), (0, 3), (250, 254)])
def test_mxfp4_from_e2m1_is_exact_under_gguf_py(lo, hi):
    rng = np.random.default_rng(lo * 7 + hi)
    packed, scales = _fp4_source(rng, 12, 256, lo, hi)
    blocks = mxfp4.mxfp4_from_e2m1(packed, scales)
    assert blocks.shape == (12, 8 * 17)
    with np.errstate(over="ignore"):
        exact = fp8.dequant_e2m1_blocks(packed, scales)
    got = _gguf_decode("mxfp4", blocks, 256)
    assert np.array_equal(got, exact)  # values (so -0.0 == +0.0); Inf where both overflow
    # our decoders agree with gguf-py bit for bit, and the inverse restores the source
    assert _bits_equal(formats.decode("mxfp4", blocks, 256), got)
    back_codes, back_scales = mxfp4.e2m1_from_mxfp4(blocks, 256)
    assert np.array_equal(back_codes, packed) and np.array_equal(back_scales, scales)


def test_mxfp4_from_e2m1_agrees_with_requantising_when_amax_code_is_4_or_6():
    """gguf-py's encoder picks the same exponent as the DeepSeek scale rule
    (pow2 >= amax/6) whenever the block max is e2m1 4 or 6: same bytes."""
    rng = np.random.default_rng(15)
    packed, scales = _fp4_source(rng, 4, 128, 100, 150)
    u = packed.view(np.uint8).copy()
    u[:, ::16] = (u[:, ::16] & 0xF0) | 0x7  # element 0 of each block = +6
    packed = u.view(np.int8)
    exact = fp8.dequant_e2m1_blocks(packed, scales)
    a = mxfp4.mxfp4_from_e2m1(packed, scales)
    b = formats.encode("mxfp4", exact)
    assert np.array_equal(a[:, 0::17], b[:, 0::17])  # scale bytes
    assert np.array_equal(formats.decode("mxfp4", a, 128), formats.decode("mxfp4", b, 128))


def test_mxfp4_from_e2m1_refuses_bad_input():
    rng = np.random.default_rng(16)
    packed, scales = _fp4_source(rng, 2, 64)
    bad = scales.copy()
    bad[1, 1] = 255
    with pytest.raises(CorruptDataError, match="255"):
        mxfp4.mxfp4_from_e2m1(packed, bad)
    with pytest.raises(ShapeError):
        mxfp4.mxfp4_from_e2m1(packed, scales[:, :1])
    with pytest.raises(ShapeError):
        mxfp4.mxfp4_from_e2m1(packed.astype(np.int16), scales)
    with pytest.raises(ShapeError):
        mxfp4.mxfp4_from_e2m1(packed[:, :8], scales[:, :1])  # 16 inputs: not a whole block


def test_plain_bf16_helper_matches_registry():
    x = _heavy(np.random.default_rng(17), 3, 64)
    assert np.array_equal(plain.bf16_bits(x).view(np.uint8).reshape(3, -1), formats.encode("bf16", x))
