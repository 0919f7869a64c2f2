"""MIX codecs 106/105 (docs/formats.md#mix): registry facts, a literal scalar reading of
docs/formats.md#mix-encoder against the vectorised reference, reference vs numba vs torch bytes and
bits, refusals, and mode-0 decode. Golden vectors run in test_golden.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4quant import formats
from ds4quant.errors import BadInputError, EncodeRejectedError, ShapeError
from ds4quant.formats.bits import unpack_bits
from ds4quant.formats.ue4m3 import UE4M3
from tests.golden import describe_float_mismatch, describe_mismatch

F = np.float32
MIX = {"rocmfp2_mix": (106, "mix106-7s1c", 10, 2, 4, 128), "rocmfp3_mix": (105, "mix105-7s1c", 14, 3, 8, 32)}
BITS = {"rocmfp2_mix": 2, "rocmfp3_mix": 3}

# The Lucebox unit-test style books, an asymmetric pair containing 0, and a
# pair with magnitudes above 1 and a -0.0 level (all bf16-exact).
BOOKS = {
    4: {
        "sym": [[-1.0, -0.25, 0.25, 1.0], [-1.0, -0.5, 0.5, 1.0]],
        "asym": [[-2.0, -0.5, 0.5, 2.0], [-0.75, 0.0, 0.375, 1.5]],
        "wide": [[-0.0, 0.5, 3.0, 96.0], [-8.0, -1.0, 0.0078125, 0.125]],
    },
    8: {
        "sym": [[-1, -0.625, -0.375, -0.125, 0.125, 0.375, 0.625, 1], [-1, -0.75, -0.5, -0.25, 0.25, 0.5, 0.75, 1]],
        "asym": [[-1.5, -1, -0.5, 0, 0.25, 0.5, 1, 3], [-0.875, -0.5, -0.25, -0.125, 0, 0.125, 0.5, 2]],
        "wide": [[-0.0, 0.25, 0.5, 1, 2, 4, 8, 200], [-64, -4, -1, -0.5, 0.5, 1, 4, 64]],
    },
}


def books_for(qtype, name):
    return np.array(BOOKS[formats.get_qtype(qtype).codebook_levels][name], dtype=F)


def dataset(rng, rows, cols):
    """Rows of several distributions with zero halves, ties and subnormals."""
    x = np.empty((rows, cols), dtype=F)
    for r in range(rows):
        kind = r % 6
        if kind == 0:
            v = rng.standard_normal(cols)
        elif kind == 1:
            v = 0.02 * rng.standard_normal(cols)
        elif kind == 2:
            v = rng.standard_t(3, cols)
        elif kind == 3:
            v = rng.integers(-8, 9, cols) * 2.0**-5
        elif kind == 4:
            v = 1e-4 * rng.standard_normal(cols)
            v[::7] = 1e-41 * np.sign(rng.standard_normal(len(v[::7])))
        else:
            v = rng.standard_normal(cols)
            v[rng.integers(0, cols)] = 3000.0
        x[r] = v
        x[r, 32:48] = 0.0  # a zero half
        x[r, 96:128] = -0.0  # a zero block of negative zeros
    return x


def importance(rng, cols):
    q = np.exp(1.5 * rng.standard_normal(cols)).astype(F)
    q[rng.random(cols) < 0.05] = 0
    q[128:160] = 0  # a block with zero weight
    return q


# --------------------------------------------------------------------------
# a literal, scalar reading of docs/formats.md#mix-encoder (independent of the vectorised reference)


def _nl(v, levels):
    lo, hi = 0, len(levels) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        split = F(0.5) * F(levels[mid] + levels[mid + 1])
        if v <= split:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _nearest(t):
    if not (t > 0) or not np.isfinite(t):
        return 0
    dist = [abs(F(UE4M3[e] - t)) for e in range(1, 127)]
    return 1 + int(np.argmin(dist))


def oracle_half(x, w, books):
    """(meta, codes) for one 16-value half, or None when the reference fails."""
    if not np.all(np.isfinite(x)):
        return None
    m = max(abs(v) for v in x)
    if m == 0:
        return 0, [_nl(F(0), books[0])] * 16
    best, bb, be = F(np.inf), 0, 1
    for b in range(2):
        ml = max(abs(v) for v in books[b])
        if not ml > 0:
            continue
        c = _nearest(F(m / ml))
        for delta in range(-2, 3):
            e = c + delta
            if e < 1 or e > 126:
                continue
            s = UE4M3[e]
            inv = F(1) / s
            err = F(0)
            for i in range(16):
                j = _nl(F(x[i] * inv), books[b])
                d = F(x[i] - F(s * books[b][j]))
                wi = F(1) if w is None else w[i]
                err = F(err + F(F(wi * d) * d))
            if w is not None and not all(np.isfinite(v) and v >= 0 for v in w):
                err = F(np.inf)
            if err < best or (err == best and (b < bb or (b == bb and e < be))):
                best, bb, be = err, b, e
    if best == np.inf:
        return None
    inv = F(1) / UE4M3[be]
    return be | (bb << 7), [_nl(F(v * inv), books[bb]) for v in x]


def split_blocks(qtype, data):
    bits = BITS[qtype]
    qs = 4 * bits
    blk = data.reshape(-1, qs + 2)
    return unpack_bits(blk[:, :qs], bits, 32), blk[:, qs:]


# --------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", sorted(MIX))
def test_registry_entry(qtype):
    ggml, variant, nbytes, bits, levels, row_multiple = MIX[qtype]
    qt = formats.get_qtype(qtype)
    assert (qt.ggml_type, qt.variant, qt.block_size, qt.block_bytes) == (ggml, variant, 32, nbytes)
    assert 32 * bits // 8 + 2 == qt.block_bytes  # qs + two meta bytes
    assert (qt.codebook_levels, qt.row_multiple, qt.is_mix) == (levels, row_multiple, True)
    assert set(qt.runtimes) == {"ds4quant", "lucebox"}
    assert "codebooks" in qt.description
    assert ("GUMIXs1" if ggml == 106 else "P4MIXv1") in qt.description
    assert qt in formats.qtypes_for_ggml_type(ggml)


@pytest.mark.parametrize("with_imp", [False, True])
@pytest.mark.parametrize("book", ["sym", "asym", "wide"])
@pytest.mark.parametrize("qtype", sorted(MIX))
def test_reference_matches_literal_reading(qtype, book, with_imp):
    rng = np.random.default_rng(7)
    x = dataset(rng, 6, 256)
    q = importance(rng, 256) if with_imp else None
    books = books_for(qtype, book)
    got = formats.encode(qtype, x, q, books, impl="ref")
    codes, meta = split_blocks(qtype, got)
    halves = x.reshape(-1, 16)
    for h in range(halves.shape[0]):
        col = (h * 16) % 256
        want = oracle_half(halves[h], None if q is None else q[col:col + 16], books)
        assert want is not None
        assert meta[h // 2, h % 2] == want[0], f"half {h}: meta {meta[h // 2, h % 2]} != {want[0]}"
        assert codes[h // 2, (h % 2) * 16:(h % 2) * 16 + 16].tolist() == want[1], f"half {h}"


@pytest.mark.parametrize("with_imp", [False, True])
@pytest.mark.parametrize("book", ["sym", "asym", "wide"])
@pytest.mark.parametrize("qtype", sorted(MIX))
def test_fast_encode_and_decoders_match_reference(qtype, book, with_imp):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    cols = 512
    x = dataset(rng, 23, cols)
    q = importance(rng, cols) if with_imp else None
    books = books_for(qtype, book)
    ref = formats.encode(qtype, x, q, books, impl="ref")
    fast = formats.encode(qtype, x, q, books, impl="fast")
    assert np.array_equal(ref, fast), describe_mismatch(fast, ref, formats.get_qtype(qtype).block_bytes)
    y_ref = formats.decode(qtype, ref, cols, books, impl="ref")
    y_fast = formats.decode(qtype, ref, cols, books, impl="fast")
    y_t = formats.decode_torch(qtype, torch.from_numpy(ref), cols, books).numpy()
    assert np.array_equal(y_ref.view(np.uint32), y_fast.view(np.uint32)), describe_float_mismatch(y_fast, y_ref)
    assert np.array_equal(y_ref.view(np.uint32), y_t.view(np.uint32)), describe_float_mismatch(y_t, y_ref)


@pytest.mark.parametrize("qtype", sorted(MIX))
def test_threads_and_expert_split_do_not_change_bytes(qtype):
    rng = np.random.default_rng(3)
    x = dataset(rng, 12, 256)
    b = np.stack([books_for(qtype, n) for n in ("sym", "asym", "wide")])
    one = formats.encode(qtype, x, None, b, threads=1)
    two = formats.encode(qtype, x, None, b, threads=2)
    assert np.array_equal(one, two)
    per = np.concatenate([formats.encode(qtype, x[4 * i:4 * i + 4], None, b[i], impl="ref") for i in range(3)])
    assert np.array_equal(one, per)
    y = formats.decode(qtype, one, 256, b, modes=[1, 0, 1])
    assert np.array_equal(y[4:8].view(np.uint32), formats.decode(qtype, one[4:8], 256, b[1], modes=0).view(np.uint32))


def test_zero_half_gets_meta_zero_and_nearest_zero_level():
    # docs/formats.md#mix-encoder step 5: book {-2, -0.5, 0.5, 2} -> code 1, which decodes to 0 * -0.5 = -0.0
    books = np.array([[-2.0, -0.5, 0.5, 2.0], [-1.0, -0.25, 0.25, 1.0]], dtype=F)
    x = np.zeros((1, 128), dtype=F)
    x[0, 16:32] = np.linspace(-1, 1, 16)
    for impl in ("ref", "fast"):
        data = formats.encode("rocmfp2_mix", x, None, books, impl=impl)
        codes, meta = split_blocks("rocmfp2_mix", data)
        assert meta[0, 0] == 0 and meta[1:].tolist() == [[0, 0]] * 3
        assert codes[0, :16].tolist() == [1] * 16
        y = formats.decode("rocmfp2_mix", data, 128, books)
        assert np.all(y[0, :16] == 0) and np.all(np.signbit(y[0, :16]))


def test_all_zero_importance_takes_book0_smallest_byte_of_window():
    # every candidate errs 0: the first one wins ties -> book 0, e = N(m/ML) - 2
    books = books_for("rocmfp3_mix", "sym")
    x = np.tile(np.linspace(-1, 1, 32, dtype=F), (1, 1))
    q = np.zeros(32, dtype=F)
    for impl in ("ref", "fast"):
        _, meta = split_blocks("rocmfp3_mix", formats.encode("rocmfp3_mix", x, q, books, impl=impl))
        assert meta[0].tolist() == [_nearest(F(1.0)) - 2] * 2 == [0x40 - 2] * 2


def _codec(qtype):
    return formats.get_codec(qtype)


@pytest.mark.parametrize("qtype", sorted(MIX))
@pytest.mark.parametrize("impl", ["encode_ref", "encode_fast"])
def test_rejections_name_row_and_block(qtype, impl):
    fn = getattr(_codec(qtype), impl)
    books = books_for(qtype, "sym")
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 256)).astype(F)
    bad = x.copy()
    bad[2, 3 * 32 + 20] = np.nan
    bad[3, 0] = np.inf  # a later failure must not win
    with pytest.raises(EncodeRejectedError, match=r"row 2, block 3 \(half 1\).*NaN or Inf"):
        fn(bad, None, books)
    over = x.copy()
    over[1, 200] = F(-3e38)  # d^2 overflows in every candidate
    with pytest.raises(EncodeRejectedError, match=r"row 1, block 6 \(half 0\).*no finite-error candidate"):
        fn(over, None, books)
    q = np.ones(256, dtype=F)
    q[40] = -1.0
    with pytest.raises(EncodeRejectedError, match=r"row 0, block 1 \(half 0\)"):
        fn(x, q, books)
    q[40] = np.inf
    with pytest.raises(EncodeRejectedError, match=r"row 0, block 1 \(half 0\)"):
        fn(x, q, books)
    # a negative weight inside an all-zero half is never looked at
    x[:, 32:48] = 0
    assert np.array_equal(fn(x, q, books), _codec(qtype).encode_ref(x, q, books))


def test_reference_and_fast_raise_the_same_message():
    books = books_for("rocmfp3_mix", "asym")
    x = np.ones((9, 64), dtype=F)
    x[5, 40] = F(1e38) * F(3)  # finite, overflowing outlier
    msgs = []
    for impl in ("encode_ref", "encode_fast"):
        with pytest.raises(EncodeRejectedError) as info:
            getattr(_codec("rocmfp3_mix"), impl)(x, None, books)
        msgs.append(str(info.value))
    assert msgs[0] == msgs[1]


def test_public_api_refuses_nonfinite_and_bad_shapes():
    books = books_for("rocmfp2_mix", "sym")
    x = np.ones((2, 128), dtype=F)
    x[1, 5] = np.nan
    with pytest.raises(BadInputError):
        formats.encode("rocmfp2_mix", x, None, books, nonfinite="reference")
    with pytest.raises(ShapeError, match="multiple of 128"):
        formats.encode("rocmfp2_mix", np.ones((1, 64), F), None, books)
    assert formats.encode("rocmfp3_mix", np.ones((1, 64), F), None, books_for("rocmfp3_mix", "sym")).shape == (1, 28)


# --------------------------------------------------------------------------
# decode


def _all_decoders(qtype, data, cols, books, modes):
    torch = pytest.importorskip("torch")
    outs = [
        formats.decode(qtype, data, cols, books, modes, impl="ref"),
        formats.decode(qtype, data, cols, books, modes, impl="fast"),
        formats.decode_torch(qtype, torch.from_numpy(data), cols, books, modes).numpy(),
    ]
    for o in outs[1:]:
        assert np.array_equal(outs[0].view(np.uint32), o.view(np.uint32)), describe_float_mismatch(o, outs[0])
    return outs[0]


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("qtype", sorted(MIX))
def test_decoders_agree_on_random_bytes(qtype, mode):
    rng = np.random.default_rng(17 + mode)
    qt = formats.get_qtype(qtype)
    data = rng.integers(0, 256, (7, qt.row_bytes(256)), dtype=np.uint8)
    _all_decoders(qtype, data, 256, books_for(qtype, "wide"), mode)


def test_mode0_fixed_levels_106():
    # codes 0..3 -> -1, 0, 1, 2 times S(meta); meta with bit 7 set -> scale 0
    books = books_for("rocmfp2_mix", "wide")
    blk = np.zeros((4, 10), dtype=np.uint8)
    blk[:, :8] = 0b11100100  # codes 0, 1, 2, 3 repeating
    blk[0, 8:] = [0x40, 0x50]  # 1.0 and 4.0 (docs/formats.md#ue4m3)
    blk[1, 8:] = [0xC0, 0x7F]  # bit 7 -> 0; 0x7F -> 0
    blk[2, 8:] = [0x01, 0x7E]  # 2^-10 and 224
    blk[3, 8:] = [0x80, 0x00]
    data = blk.reshape(1, 40)
    y = _all_decoders("rocmfp2_mix", data, 128, books, 0).reshape(4, 32)
    lv = np.array([-1, 0, 1, 2] * 4, dtype=F)
    assert np.array_equal(y[0], np.concatenate([lv, 4 * lv]))
    assert np.array_equal(y[2], np.concatenate([lv * F(2.0**-10), lv * F(224)]))
    assert np.all(y[1] == 0) and np.array_equal(np.signbit(y[1]), np.tile([True, False, False, False], 8))
    # mode 1 reads the same bytes through the books: meta 0xC0 = book 1, scale 1.0
    y1 = _all_decoders("rocmfp2_mix", data, 128, books, 1).reshape(4, 32)
    assert np.array_equal(y1[1, :16], np.tile(books[1], 4))


def test_mode0_fixed_levels_105_sign_magnitude():
    codes = np.arange(32, dtype=np.uint8) % 8  # 0..7: 0, 1, 2, 4, +0, -1, -2, -4
    from ds4quant.formats.bits import pack_bits

    blk = np.zeros((1, 14), dtype=np.uint8)
    blk[0, :12] = pack_bits(codes[None], 3)[0]
    blk[0, 12:] = [0x38, 0x80]  # 0.5, bit 7 -> 0
    y = _all_decoders("rocmfp3_mix", blk, 32, books_for("rocmfp3_mix", "sym"), 0)[0]
    mags = np.array([0, 1, 2, 4, 0, -1, -2, -4] * 2, dtype=F)
    assert np.array_equal(y[:16].view(np.uint32), (mags * F(0.5)).view(np.uint32))
    assert np.all(y[16:] == 0)
    assert np.signbit(y[16:]).tolist() == [False, False, False, False, False, True, True, True] * 2


def test_mode1_scale_7f_and_book_bit():
    books = books_for("rocmfp2_mix", "asym")
    blk = np.zeros((1, 10), dtype=np.uint8)
    blk[0, :8] = 0b11100100
    blk[0, 8:] = [0xFF, 0xC0]  # book 1 with scale 0 (low bits 0x7F); book 1 with 1.0
    y = _all_decoders("rocmfp2_mix", np.tile(blk, (1, 4)), 128, books, 1)[0, :32]
    assert np.array_equal(y[16:], np.tile(books[1], 4))
    assert np.all(y[:16] == 0) and np.array_equal(np.signbit(y[:16]), np.tile(np.signbit(books[1]), 4))


# --------------------------------------------------------------------------
# property: random books and data, reference == fast, decoders agree


@st.composite
def _case(draw):
    qtype = draw(st.sampled_from(sorted(MIX)))
    L = formats.get_qtype(qtype).codebook_levels
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scale = draw(st.sampled_from([1e-6, 0.02, 1.0, 50.0]))
    steps = rng.uniform(0.01, 1.0, (2, L)) * draw(st.sampled_from([0.1, 1.0, 8.0]))
    books = formats.bf16_round((np.cumsum(steps, axis=1) - steps.sum(axis=1, keepdims=True) * rng.uniform(0, 1, (2, 1))).astype(F))
    return qtype, books, rng, scale, draw(st.booleans())


@settings(max_examples=25, deadline=None)
@given(_case())
def test_property_reference_equals_fast(case):
    qtype, books, rng, scale, with_imp = case
    if not np.all(np.diff(books, axis=1) > 0):
        return  # bf16 rounding merged two levels: not a valid book
    cols = 256
    x = (scale * rng.standard_t(4, (3, cols))).astype(F)
    x[:, rng.integers(0, cols // 16) * 16:][:, :16] = 0
    q = importance(rng, cols) if with_imp else None
    ref = formats.encode(qtype, x, q, books, impl="ref")
    assert np.array_equal(ref, formats.encode(qtype, x, q, books, impl="fast"))
    y = _all_decoders(qtype, ref, cols, books, 1)
    assert np.all(np.isfinite(y))


# --------------------------------------------------------------------------
# mode 0: ds4quant's fixed-level encoder (no public reference, docs/formats.md#mix-encoder)


@pytest.mark.parametrize("qtype", sorted(MIX))
def test_mode0_encode_reference_equals_fast_and_round_trips(qtype):
    rng = np.random.default_rng(21)
    x = dataset(rng, 13, 256)
    q = importance(rng, 256)
    books = books_for(qtype, "asym")
    ref = formats.encode(qtype, x, q, books, impl="ref", mode=0)
    fast = formats.encode(qtype, x, q, books, impl="fast", mode=0)
    assert np.array_equal(ref, fast), describe_mismatch(fast, ref, formats.get_qtype(qtype).block_bytes)
    _, meta = split_blocks(qtype, ref)
    assert np.all(meta < 0x7F)  # bit 7 clear: the whole byte is the scale
    y = _all_decoders(qtype, ref, 256, books, 0)
    # each half's byte is the best of all 126 for the fixed levels
    fixed = np.array([-1, 0, 1, 2], F) if qtype == "rocmfp2_mix" else np.array([0, 1, 2, 4, 0, -1, -2, -4], F)
    halves, wts = x.reshape(-1, 16), q.reshape(-1, 16)

    def err(e, i):
        d = halves[i] - fixed[_lvl(qtype, halves[i] * (F(1) / UE4M3[e]))] * UE4M3[e]
        return float(np.sum(wts[i % 16].astype(np.float64) * d.astype(np.float64) ** 2))

    for i in range(0, halves.shape[0], 7):
        e = int(meta.reshape(-1)[i])
        if e:
            assert err(e, i) <= min(err(c, i) for c in range(1, 127)) * (1 + 1e-5)
    assert np.all(np.isfinite(y))


def _lvl(qtype, v):
    if qtype == "rocmfp2_mix":
        return np.searchsorted(np.array([-0.5, 0.5, 1.5], F), v, side="left")
    a = np.abs(v)
    idx = (a > 0.5).astype(int) + (a > 1.5) + (a > 3.0)
    return np.where((v < 0) & (idx != 0), idx | 4, idx)


@pytest.mark.parametrize("mix,plain", [("rocmfp2_mix", "rocmfp2"), ("rocmfp3_mix", "rocmfp3")])
def test_mode0_without_importance_equals_the_uniform_codec(mix, plain):
    # unweighted, finite input: mode 0 is the 107 / 104 search (docs/formats.md#rocmfp2, #rocmfp3) byte for byte
    if plain not in formats.QTYPES:
        pytest.skip(f"{plain} is not registered")
    rng = np.random.default_rng(23)
    x = dataset(rng, 12, 256)
    got = formats.encode(mix, x, None, books_for(mix, "sym"), mode=0)
    assert np.array_equal(got, formats.encode(plain, x))


@pytest.mark.parametrize("impl", ["encode_ref", "encode_fast"])
def test_mode0_refusals_match_mode1(impl):
    fn = getattr(_codec("rocmfp3_mix"), impl)
    books = books_for("rocmfp3_mix", "sym")
    x = np.ones((3, 64), F)
    x[2, 33] = np.nan
    with pytest.raises(EncodeRejectedError, match=r"row 2, block 1 \(half 0\)"):
        fn(x, None, books, mode=0)
    x[2, 33] = F(3e38)
    with pytest.raises(EncodeRejectedError, match=r"row 2, block 1 \(half 0\).*no finite-error"):
        fn(x, None, books, mode=0)
    with pytest.raises(BadInputError, match="mode must be 0 or 1"):
        fn(np.ones((1, 32), F), None, books, mode=2)


# --------------------------------------------------------------------------
# GPU: torch decode on CUDA/HIP must give the CPU reference bits


def _gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA/HIP device")
    return torch


@pytest.mark.parametrize("qtype", sorted(MIX))
def test_torch_decode_on_gpu_is_bitwise_reference(qtype):
    torch = _gpu()
    from tests.golden import load_cases

    fmt = {"rocmfp2_mix": "mix106", "rocmfp3_mix": "mix105"}[qtype]
    cases = [c for c in load_cases() if c.record["format"] == fmt and c.record["expect"] == "ok"]
    for case in cases:
        got = formats.decode_torch(qtype, torch.from_numpy(case.array("encoded")).cuda(), case.record["k"], case.books())
        assert got.device.type == "cuda"
        want = case.array("decoded")
        got = got.cpu().numpy()
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{case.id}: " + describe_float_mismatch(got, want)
    rng = np.random.default_rng(31)
    data = rng.integers(0, 256, (64, formats.get_qtype(qtype).row_bytes(1024)), dtype=np.uint8)
    b = np.stack([books_for(qtype, n) for n in ("sym", "asym", "wide", "sym")])
    for modes in ([1, 1, 0, 1], [0, 0, 0, 0]):
        want = formats.decode(qtype, data, 1024, b, modes)
        got = formats.decode_torch(qtype, torch.from_numpy(data).cuda(), 1024, torch.from_numpy(b).cuda(), modes).cpu().numpy()
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), describe_float_mismatch(got, want)
