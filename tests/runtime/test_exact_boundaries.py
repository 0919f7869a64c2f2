"""Boundaries and ties of every exact-mode rounding step (docs/exact-mode.md), on
every path that implements the step, against the plain-Python definition:

- Q, the block scale and q = RNE(x / 2^s): a block maximum exactly 127 x 2^k
  (no bump), just above 127 x 2^k (bump), 64 x 2^k and 128 x 2^k (the
  frexp boundary), x / 2^s = k + 1/2 for even and odd k, subnormals, -0.0;
  on the numba kernel, the torch definition and the Triton kernel (through
  the interpreter);
- D, RNE to float32 of the exact sum: a float32 tie with and without a sticky
  tail far below it, the smallest subnormals and their ties, the overflow
  edge, an exact zero; on the numba row kernel, the float64 BLAS path (8+
  tokens, with a spread inside the bound only without the ceil(log2 cols)
  term), the wide fallback, the torch float64 route, the torch limbs and
  ``limbs_to_f32`` itself.
"""

from __future__ import annotations

import numpy as np
import pytest

from ds4quant.formats.components import row_kind, row_lut
from ds4quant.runtime import exact as X

torch = pytest.importorskip("torch")

from ds4quant.runtime.owners import torch_exact as te  # noqa: E402

COLS = 128


def _bits(a):
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu().numpy()
    return np.ascontiguousarray(np.asarray(a, np.float32)).view(np.uint32)


def _f32(v: float) -> np.float32:
    f = np.float32(v)
    assert float(f) == v, v  # every boundary value below is exactly representable
    return f


def q_boundary_rows() -> np.ndarray:
    """Rows of 4 blocks of 32, each block one boundary case of Q."""
    blocks = []
    for k in (-149 + 7, -60, -3, 0, 9, 100):  # 127 x 2^k: subnormal, small, around 1, large
        b = np.zeros(32, np.float32)
        b[0] = _f32(127.0 * 2.0 ** k)                  # the maximum, exactly 127 x 2^k: s = k, q = 127
        b[1] = _f32(-126.5 * 2.0 ** k)                 # a tie below it: -126.5 -> -126 (even)
        b[2] = _f32(3.5 * 2.0 ** k)                    # 3.5 -> 4
        b[3] = _f32(2.5 * 2.0 ** k)                    # 2.5 -> 2
        b[4] = -0.0
        blocks.append(b)
        c = b.copy()
        c[0] = _f32((127.0 + 2.0 ** -17) * 2.0 ** k) if k > -140 else _f32(127.5 * 2.0 ** k)  # just above: bump
        blocks.append(c)
        d = b.copy()
        d[0] = _f32(127.5 * 2.0 ** k)                  # bump; 127.5 / 2 = 63.75 -> 64
        d[1] = _f32(-125.0 * 2.0 ** k)                 # -62.5 -> -62 (even) after the bump
        d[2] = _f32(-123.0 * 2.0 ** k)                 # -61.5 -> -62
        blocks.append(d)
        e = np.zeros(32, np.float32)
        e[0] = _f32(64.0 * 2.0 ** k)                   # m / 2^s = 64: the lower frexp boundary
        e[1] = _f32(128.0 * 2.0 ** (k - 1))            # the same value written from above
        e[2] = _f32(0.5 * 2.0 ** k)                    # 0.5 -> 0 (even)
        e[3] = _f32(-1.5 * 2.0 ** k)                   # -1.5 -> -2
        blocks.append(e)
    f = np.zeros(32, np.float32)
    f[0] = _f32(2.0 ** -149)                           # the smallest subnormal alone
    blocks.append(f)
    g = np.zeros(32, np.float32)
    g[:] = -0.0                                        # an all -0.0 block: m = 0
    blocks.append(g)
    h = np.full(32, _f32(127.0 * 2.0 ** 120), np.float32)  # a large block of maxima
    blocks.append(h)
    while len(blocks) % (COLS // 32):
        blocks.append(np.zeros(32, np.float32))
    return np.concatenate(blocks).reshape(-1, COLS)


def _ref(x):
    out = [X.quantize_row_ref(r) for r in x]
    return np.array([q for q, _ in out], np.int64), np.array([s for _, s in out], np.int64)


def test_q_boundaries_numba():
    x = q_boundary_rows()
    q, s = _ref(x)
    assert (np.abs(q) <= 127).all() and (q == 127).any() and (q == 64).any()
    a, sn, hi, lo = X.quantize_rows(x)
    assert np.array_equal(sn, s)
    assert np.array_equal(a, np.ldexp(q.astype(np.float64), np.repeat(s, 32, axis=1)))
    # the numba kernel's scale, not only its values: a bump written >= 127 halves q of the
    # exact-127 blocks (127 -> 64) and moves s by one, both caught above; directly too:
    one = np.zeros((1, 32), np.float32)
    one[0, 0] = 127.0 * 8
    assert X.quantize_rows(one)[1][0, 0] == 3


def test_q_boundaries_torch():
    x = q_boundary_rows()
    q, s = _ref(x)
    qt, st = te.quantize_blocks(torch.from_numpy(x))
    assert np.array_equal(qt.numpy(), q) and np.array_equal(st.numpy(), s)


def test_q_boundaries_triton_interpreter():
    pytest.importorskip("triton")
    from tests.runtime._interp import kernels

    ek = kernels("ds4quant.runtime.kernels.exact_triton")
    x = torch.from_numpy(q_boundary_rows())
    q, s = _ref(x.numpy())
    bad = torch.zeros(1, dtype=torch.int32)
    qt, st = ek.quantize(x, bad)
    n, _, kw = qt.shape
    assert int(bad[0]) == 0
    assert np.array_equal(qt.permute(0, 2, 1).reshape(n, kw * 16).to(torch.int64).numpy(), q)
    assert np.array_equal(st.to(torch.int64).numpy(), s)


# --------------------------------------------------------------------------
# D: one rounding of the exact sum


def _f32_rows(rows):
    w = np.zeros((len(rows), COLS), np.float32)
    for j, vals in enumerate(rows):
        for i, v in vals.items():
            w[j, i] = _f32(v)
    return w


def d_cases():
    """(weights f32 (rows, COLS), one token row f32 (COLS,)): every row's exact sum is a
    rounding boundary. Block 0 carries the large terms at s = 0 (x = 1 or 127),
    block 1 a tail at its own scale."""
    x = np.zeros(COLS, np.float32)
    x[0] = 1.0
    x[1] = 1.0
    x[2] = 127.0  # block 0: s = 0, q = (1, 1, 127)
    x[32] = _f32(2.0 ** -60)  # block 1: a tiny tail, s = -66, q = 64
    x[64] = x[65] = _f32(2.0 ** -140)  # block 2: s = -146, q = 64
    rows = [
        {0: 2.0 ** 24, 1: 1.0},                 # 2^24 + 1: a tie, rounds to even 2^24
        {0: 2.0 ** 24, 1: 3.0},                 # 2^24 + 3: a tie, rounds up to 2^24 + 4
        {0: 2.0 ** 24, 1: 1.0, 32: 1.0},        # the tie plus 2^-60: rounds up (sticky far below)
        {0: 2.0 ** 24, 1: 1.0, 32: -1.0},       # the tie minus 2^-60: rounds down
        {0: -(2.0 ** 24), 1: -1.0, 32: -1.0},   # negative: away from zero, as the magnitude
        {64: 1.0},                              # 2^-140 alone: a normal float32
        {64: 2.0 ** -10},                       # 2^-150: half the smallest subnormal, ties to 0
        {64: 3.0 * 2.0 ** -10},                 # 1.5 x 2^-149: ties to 2 x 2^-149
        {64: 2.0 ** -10, 65: 2.0 ** -30},       # 2^-150 plus 2^-170: rounds up to 2^-149
        {0: 2.0 ** 127, 1: 2.0 ** 127 - 2.0 ** 104},  # 2^128 - 2^104: the largest float32
        {0: 2.0 ** 127, 1: 2.0 ** 127 - 2.0 ** 103},  # 2^128 - 2^103: a tie, to even: +inf
        {0: 1.5, 1: -1.5},                      # exact cancellation: +0.0
        {0: -0.0, 1: -0.0},                     # -0.0 products only: +0.0
    ]
    return _f32_rows(rows), x


def _want(w, x):
    q, s = X.quantize_row_ref(x)
    return np.array([X.exact_dot_ref(w[j], q, s) for j in range(w.shape[0])], np.float32)


def test_d_cases_are_the_boundaries_they_claim():
    w, x = d_cases()
    want = _want(w, x)
    assert want[0] == np.float32(2.0 ** 24) and want[1] == np.float32(2.0 ** 24 + 4)
    assert want[2] == np.float32(2.0 ** 24 + 2) and want[3] == np.float32(2.0 ** 24)
    assert want[4] == np.float32(-(2.0 ** 24 + 2))
    assert want[6] == 0.0 and want[7] == np.float32(2.0 ** -148) and want[8] == np.float32(2.0 ** -149)
    assert want[9] == np.finfo(np.float32).max and np.isinf(want[10])
    assert _bits(want[11:]).tolist() == [0, 0]


@pytest.mark.parametrize("tokens", [1, X.GEMM_MIN_TOKENS])  # the numba row kernel, then BLAS tiles
def test_d_boundaries_numba(tokens):
    w, x = d_cases()
    want = _want(w, x)
    xs = np.repeat(x[None, :], tokens, axis=0)
    kind, p0, p1 = row_kind("f32")
    with np.errstate(over="ignore"):
        got = X.exact_matmul(kind, p0, p1, w.view(np.uint8), COLS, row_lut("f32"), 1, xs, X.quantize_rows(xs),
                             what="f32")
    for t in range(tokens):
        assert np.array_equal(_bits(got[t]), _bits(want)), np.flatnonzero(_bits(got[t]) != _bits(want))
    q, s = X.quantize_row_ref(x)
    assert np.array_equal(_bits([X.exact_dot_fallback(w[j], q, s) for j in range(w.shape[0])]), _bits(want))


@pytest.mark.parametrize("f64", [True, False], ids=["float64 route", "limbs"])
def test_d_boundaries_torch(f64):
    w, x = d_cases()
    want = _want(w, x)
    xs = torch.from_numpy(np.repeat(x[None, :], 3, axis=0))
    got = te.exact_linear(torch.from_numpy(w), xs, f64=f64)
    for t in range(3):
        assert np.array_equal(_bits(got[t]), _bits(want)), np.flatnonzero(_bits(got[t]) != _bits(want))


def test_limbs_to_f32_rounds_with_every_limb_below():
    # n = 2^80 + 2^56 (+ 1): 2^56 is half an ulp of 2^80 in float32, so n is a tie that the
    # three limbs under the leading one see, and the 1 only the sticky limbs below them see
    def limbs(n: int, nb: int = 8):
        out = []
        for _ in range(nb):
            out.append(n & 0xFFFF)
            n >>= 16
        return out

    cases = [2 ** 80 + 2 ** 56 + 1, 2 ** 80 + 2 ** 56, 2 ** 80 + 2 ** 57 + 2 ** 56, 2 ** 80 + 2 ** 56 + 2 ** 20,
             (2 ** 24 + 1) * 2 ** 40 + 2 ** 3, 3 * 2 ** 60 + 2 ** 36 + 2 ** 35 + 1]
    acc = torch.tensor([limbs(n) for n in cases], dtype=torch.int64)
    for base in (0, -200, -150 - 80):
        got = te.limbs_to_f32(acc, base)
        want = [X.round_f32(n, base) for n in cases]
        assert np.array_equal(_bits(got), _bits(want)), (base, _bits(got), _bits(want))
        got = te.limbs_to_f32(-acc, base)
        assert np.array_equal(_bits(got), _bits([X.round_f32(-n, base) for n in cases]))
    assert float(te.limbs_to_f32(acc[:1], 0)[0]) == 2.0 ** 80 + 2.0 ** 57  # the sticky 1 rounds the tie up


def test_the_blas_path_bounds_the_span_with_the_log2_cols_term():
    """8+ tokens take float64 BLAS tiles. Every term's span fits 53 bits (weights
    integers below 2^10, activations 127 at s = 0 and one 2^-30 tail: 10 + 7 + 36),
    but 224 terms carry the sum 8 bits higher: 2^24 + 1 (a float32 tie) plus the
    2^-30 tail needs 61 bits, float64 drops the tail, and the tie rounds down. Only
    the ceil(log2 cols) term of the bound sends the pairs to the exact fallback."""
    cols = 256
    target = 2 ** 24 + 1
    k, r = divmod(target, 127)  # 127 * sum(w_big) + r * 1
    n_big = 223
    w = np.zeros((1, cols), np.float32)
    base, extra = divmod(k, n_big)
    big = [i for i in range(224) if i != 1]
    for n, i in enumerate(big):
        w[0, i] = base + (1 if n < extra else 0)
    assert w.max() < 1024 and int(w[0, big].astype(np.int64).sum()) == k
    w[0, 1] = r
    w[0, 224] = 1.0
    x = np.zeros((X.GEMM_MIN_TOKENS, cols), np.float32)
    x[:, :224] = 127.0
    x[:, 1] = 1.0
    x[:, 224] = _f32(2.0 ** -30)
    want = _want(w, x[0])
    assert want[0] == np.float32(2.0 ** 24 + 2)
    a = X.quantize_rows(x)
    assert np.float32(float(np.dot(w[0].astype(np.float64), a[0][0]))) == np.float32(2.0 ** 24)  # float64 fails
    kind, p0, p1 = row_kind("f32")
    got = X.exact_matmul(kind, p0, p1, w.view(np.uint8), cols, row_lut("f32"), 1, x, a, what="f32")
    assert (got[:, 0] == want[0]).all(), got[:, 0]
    got = te.exact_linear(torch.from_numpy(w), torch.from_numpy(x))
    assert (got[:, 0].numpy() == want[0]).all()
