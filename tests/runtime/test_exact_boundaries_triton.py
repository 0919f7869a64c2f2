"""Boundaries and ties of exact mode's D and SWIGLU steps (docs/exact-mode.md) on the
paths ``test_exact_boundaries.py`` leaves out, against the plain-Python definition
(runtime/exact.py):

- D on the Triton exact kernels through the interpreter: ``exact_triton.gemv_exact``
  (rocmfp2 word layout, hand-built) and ``exact_planes.product`` (mxfp4, chosen E8M0
  scales). Weights are +-1, 0.5, 1.5, 2^-10 and -0.0; the token rows put every boundary
  in the activations (a float32 tie with and without a sticky tail inside the
  float64 window, a tail far below it that the kernel must flag, subnormal ties,
  the overflow edge and its tie, exact cancellation to +0.0).
- SWIGLU ties and edges on the numba owner, the torch definition and the Triton
  ``swiglu_quantize``: a tiny gate makes silu = g / 2 exactly, so silu * u can be
  put on a float32 tie (normal and subnormal, with and without a sticky bit); the
  clamp limit, the E = +inf edge at z = 709 and their float32 neighbours.
  rint_half_even(z * INV_LN2) has no tie reachable from a float32 gate: no float32
  z in [-20, 1030] makes the float64 product k + 1/2, so there is none to test.
"""

from __future__ import annotations

import numpy as np
import pytest

from ds4quant.runtime import exact as X

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from ds4quant.runtime.kernels import layout  # noqa: E402
from ds4quant.runtime.owners import torch_exact as te  # noqa: E402

from . import _synth as S  # noqa: E402
from ._interp import kernels  # noqa: E402

COLS = 128
LIMIT = 10.0
F32 = np.float32


@pytest.fixture(scope="module")
def ek():
    return kernels("ds4quant.runtime.kernels.exact_triton")


def _bits(a):
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu().numpy()
    return np.ascontiguousarray(np.asarray(a, np.float32)).view(np.uint32)


def _f32(v: float) -> np.float32:
    f = F32(v)
    assert float(f) == v, v
    return f


def d_tokens() -> np.ndarray:
    """Token rows (COLS,): against a weight row of ones each sum is one boundary."""
    rows = []

    def row(**kv):
        x = np.zeros(COLS, np.float32)
        for k, v in kv.items():
            x[int(k[1:])] = _f32(v)
        rows.append(x)

    row(i0=2.0 ** 24, i32=1.0)                       # 0: 2^24 + 1, a tie: even 2^24
    row(i0=2.0 ** 24, i32=3.0)                       # 1: 2^24 + 3, a tie: up to 2^24 + 4
    row(i0=2.0 ** 24, i32=1.0, i64=2.0 ** -8)        # 2: the tie plus a sticky 2^-8: 2^24 + 2
    row(i0=2.0 ** 24, i32=1.0, i64=-(2.0 ** -8))     # 3: minus it: 2^24
    row(i0=-(2.0 ** 24), i32=-1.0, i64=-(2.0 ** -8))  # 4: negative, away from zero: -(2^24 + 2)
    row(i0=2.0 ** 24, i32=1.0, i64=2.0 ** -60)       # 5: sticky far below: outside the float64 window
    row(i0=2.0 ** -149)                              # 6: the smallest subnormal
    row(i0=2.0 ** -140, i32=2.0 ** -149)             # 7: x 2^-10: the tie 2^-150 plus a sticky 2^-159
    row(i0=127 * 2.0 ** 121, i32=127 * 2.0 ** 114, i64=127 * 2.0 ** 107, i96=7 * 2.0 ** 104)  # 8: 2^128 - 2^104
    row(i0=127 * 2.0 ** 121, i32=127 * 2.0 ** 114, i64=127 * 2.0 ** 107, i96=15 * 2.0 ** 103)  # 9: 2^128 - 2^103
    row(i0=1.5, i1=-1.5, i32=0.125, i33=-0.125)      # 10: exact cancellation: +0.0
    row()                                            # 11: zeros
    x = np.zeros(COLS, np.float32)
    x[:] = -0.0
    rows.append(x)                                   # 12: -0.0 everywhere
    row(i0=2.0 ** -140)                              # 13: x 2^-10: 2^-150, ties to +0.0
    row(i0=3 * 2.0 ** -140)                          # 14: x 2^-10: 1.5 x 2^-149, ties to 2^-148
    return np.stack(rows)


FAR = [5]  # the token whose sum spans more than float64 holds: flagged, patched by the owner


def _want(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    for t in range(x.shape[0]):
        q, s = X.quantize_row_ref(x[t])
        out[t] = [X.exact_dot_ref(w[j], q, s) for j in range(w.shape[0])]
    return out


def _check_claims(w, want, negzero=True):
    """The cases are the boundaries they claim (row 0: ones, 1: -ones, 2: 0.5, 3: 1.5, 4: -0.0,
    5: 2^-10)."""
    assert np.array_equal(w[0], np.ones_like(w[0])) and np.array_equal(w[2], np.full_like(w[2], 0.5))
    assert np.array_equal(w[1], -np.ones_like(w[1])) and np.array_equal(w[5], np.full_like(w[5], 2.0 ** -10))
    assert np.array_equal(w[3], np.full_like(w[3], 1.5)) and (_bits(w[4]) == (0x80000000 if negzero else 0)).all()
    ones = want[:, 0]
    assert ones[0] == F32(2.0 ** 24) and ones[1] == F32(2.0 ** 24 + 4) and ones[2] == F32(2.0 ** 24 + 2)
    assert ones[3] == F32(2.0 ** 24) and ones[4] == F32(-(2.0 ** 24 + 2)) and ones[5] == F32(2.0 ** 24 + 2)
    assert want[6, 0] == F32(2.0 ** -149) and _bits(want[6, 2]) == 0 and want[6, 3] == F32(2.0 ** -148)
    assert want[7, 5] == F32(2.0 ** -149) and _bits(want[13, 5]) == 0 and want[14, 5] == F32(2.0 ** -148)
    assert ones[8] == np.finfo(np.float32).max and np.isinf(ones[9]) and np.isneginf(want[9, 1])
    assert (_bits(want[10:13, :5]) == 0).all() and (_bits(want[:, 4]) == 0).all()  # +0.0, never -0.0


def _compare(got, fl, want, rows=6):
    fl = fl.numpy()
    assert fl[:, :rows].any(axis=1).tolist() == [t in FAR for t in range(want.shape[0])]
    ok = fl == 0
    bad = np.argwhere((_bits(got) != _bits(want)) & ok)
    assert bad.size == 0, [(int(t), int(j), float(got[t, j]), float(want[t, j])) for t, j in bad[:8]]


def _rocmfp2_planes(rows=16, seed=3):
    """One expert: row 0 level 1 at scale 1.0, 1: level -1 at 1.0, 2: level 1 at 0.5,
    3: level 1 at 1.5, 4: level 0 at -1.0 (-0.0), 5: level 1 at 2^-10, the rest random."""
    r = np.random.default_rng(seed)
    slut = layout.scale_lut("rocmfp2")
    idx = {v: int(np.flatnonzero(slut == v)[0]) for v in (1.0, 0.5, 1.5, -1.0, 2.0 ** -10)}
    kw = COLS // 16
    words = r.integers(0, 1 << 32, (1, rows, kw), dtype=np.uint64)
    sb = r.integers(0x18, 0x39, (1, rows, kw)).astype(np.uint8)
    for j, (word, sc) in enumerate([(0xAAAAAAAA, 1.0), (0x0, 1.0), (0xAAAAAAAA, 0.5), (0xAAAAAAAA, 1.5),
                                    (0x55555555, -1.0), (0xAAAAAAAA, 2.0 ** -10)]):
        words[0, j] = word
        sb[0, j] = idx[sc]
    a = torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())
    return layout.LinearPlanes("rocmfp2", a, None, torch.from_numpy(sb), torch.from_numpy(slut), 2, 1)


def test_d_boundaries_gemv_exact(ek):
    lp = _rocmfp2_planes()
    w = layout.linear_reference(lp)[0].numpy()
    x = d_tokens()
    want = _want(w, x)
    _check_claims(w, want)
    bad = torch.zeros(1, dtype=torch.int32)
    qt, s = ek.quantize(torch.from_numpy(x), bad)
    assert int(bad[0]) == 0
    n = x.shape[0]
    with np.errstate(over="ignore"):
        y, fl = ek.gemv_exact(lp, qt, s, torch.zeros(n, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), bad,
                              bn=8, bw=4, flags=True)
    assert int(bad[0]) == int(fl.sum())
    _compare(y, fl, want)


def test_d_boundaries_planes_product_mxfp4(ek):
    from ds4quant.runtime.kernels import exact_planes as _  # noqa: F401  (imported under the interpreter)
    from ds4quant.runtime.owners.base import ExpertStack
    from ds4quant.runtime.owners.cuda_owner import CudaOwner

    xp = kernels("ds4quant.runtime.kernels.exact_planes")
    layer, experts = 2, (1, 4)
    stacks, _ = S.layer_stacks("mxfp4", layer, experts)
    g = stacks["gate"]
    data = g.data.copy()
    blk = data.reshape(len(experts), g.rows, -1, 17)
    # E8M0 127 with codes 2 / 10 / 1 / 3 / 8: weights 1, -1, 0.5, 1.5, 0.0; 117 with 2: 2^-10
    for j, (code, e8) in enumerate(((2, 127), (10, 127), (1, 127), (3, 127), (8, 127), (2, 117))):
        blk[0, j, :, 0] = e8
        blk[0, j, :, 1:] = code | (code << 4)
    stacks["gate"] = ExpertStack(g.tensor, g.layer, g.proj, g.qtype, g.rows, g.cols, g.expert_ids, data)
    w = S.decoded(stacks["gate"], 0)
    x = np.zeros((len(d_tokens()), g.cols), np.float32)
    x[:, :COLS] = d_tokens()
    x[12, COLS:] = -0.0
    want = _want(w[:8], x)
    _check_claims(w, want, negzero=False)  # mxfp4's code 8 decodes to +0.0
    o = CudaOwner("cpu", identity="torch-cpu:8")
    o.exact_planes_tile = (128, 128, 4)
    for st in stacks.values():
        o.add_stack(st)
    pg, loc = o.single_stacks(layer)[0], o.single_stacks(layer)[3]
    o._exact_planes_set(layer)
    bad = torch.zeros(1, dtype=torch.int32)
    qt, s = ek.quantize(torch.from_numpy(x), bad)
    ids = torch.full((x.shape[0],), experts[0], dtype=torch.int64)
    with np.errstate(over="ignore"):
        y, fl = xp.product(pg["fmt"], pg, xp.plain(qt), s, ids, loc, bad, flags=True, bn=128, bk=128)
    o.close()
    assert int(bad[0]) == int(fl.sum())
    _compare(y[:, :8], fl[:, :8], want)


# --------------------------------------------------------------------------
# SWIGLU


def _is_tie(v: float) -> bool:
    f = F32(v)
    if float(f) == v or not np.isfinite(f):
        return False
    other = np.nextafter(f, F32(np.inf) if v > float(f) else F32(-np.inf))
    return (float(f) + float(other)) / 2 == v


def swiglu_cases():
    """(g, u, is_tie) float32: ties of h's rounding and the step's edges (limit 10)."""
    t = 2.0 ** -23
    cases = [
        # a tiny gate: E(-g) = 1.0 exactly, silu = g / 2, h = RNE(g / 2 * u)
        (3 * 2.0 ** -100, 1 + t, True),          # (1.5 + 2^-23 + 2^-24) x 2^-100: odd, up
        (3 * 2.0 ** -100, 1 + 3 * t, True),      # ... + 4.5 x 2^-23: even, down
        (-3 * 2.0 ** -100, 1 + t, True),
        (3 * 2.0 ** -100, -(1 + 3 * t), True),
        (3 * 2.0 ** -100, 1 + 5 * t, True),
        (2.0 ** -100, 2.0 ** -49, True),         # 2^-150: to even, +0.0
        (2.0 ** -100, -(2.0 ** -49), True),      # -0.0
        (2.0 ** -100, 3 * 2.0 ** -49, True),     # 1.5 x 2^-149: up to 2^-148
        (-(2.0 ** -100), 5 * 2.0 ** -49, True),  # -2.5 x 2^-149: down to -2^-148
        (2.0 ** -100, (1 + 2.0 ** -20) * 2.0 ** -49, False),  # just above the tie: 2^-149
        (2.0 ** -100, (1 - 2.0 ** -20) * 2.0 ** -49, False),  # just below: +0.0
        # the clamp limit and its float32 neighbours, on both sides
        (LIMIT, 2.0, False), (np.nextafter(F32(LIMIT), F32(0)), 2.0, False),
        (np.nextafter(F32(LIMIT), F32(np.inf)), 2.0, False), (3.0, LIMIT, False), (3.0, -LIMIT, False),
        (3.0, np.nextafter(F32(LIMIT), F32(np.inf)), False), (3.0, np.nextafter(F32(-LIMIT), F32(-np.inf)), False),
        (3.0, np.nextafter(F32(LIMIT), F32(0)), False), (3.0, np.nextafter(F32(-LIMIT), F32(0)), False),
        # z = -g at the E = +inf edge (709): finite E at and below it, the signed zero above
        (-709.0, 3.0, False), (-709.0, -3.0, False), (np.nextafter(F32(-709), F32(-np.inf)), 3.0, False),
        (np.nextafter(F32(-709), F32(-np.inf)), -3.0, False), (np.nextafter(F32(-709), F32(0)), 3.0, False),
        (-(2.0 ** -149), 1.0, False), (2.0 ** -149, -1.0, False),
    ]
    g = np.array([_f32(float(c[0])) for c in cases], np.float32)
    u = np.array([_f32(float(c[1])) for c in cases], np.float32)
    return g, u, [c[2] for c in cases]


def _swiglu_want():
    g, u, ties = swiglu_cases()
    want = X.swiglu_ref(g, u, LIMIT)
    for i, tie in enumerate(ties):  # the definition's float64 silu * uc is the tie the case claims
        gc = min(float(g[i]), LIMIT)
        uc = max(-LIMIT, min(LIMIT, float(u[i])))
        if tie:
            assert _is_tie(gc / 2 * uc) and gc / (1.0 + X._e_ref(-gc)) == gc / 2, i
    assert _bits(want[5]) == 0 and _bits(want[6]) == 0x80000000 and want[7] == F32(2.0 ** -148)
    assert want[8] == F32(-(2.0 ** -148)) and want[9] == F32(2.0 ** -149) and _bits(want[10]) == 0
    assert want[0] == F32((1.5 + 2.0 ** -22) * 2.0 ** -100) and want[1] == F32((1.5 + 2.0 ** -21) * 2.0 ** -100)
    assert _bits(want[22:24]).tolist() == [0x80000000, 0]  # gc * 0.0 * u
    return g, u, want


def _rows(a, n=2):
    return np.ascontiguousarray(np.tile(np.pad(a, (0, 32 - len(a) % 32 if len(a) % 32 else 0)), (n, 1)))


def test_swiglu_boundaries_numba():
    g, u, want = _swiglu_want()
    got = X.swiglu(g[None, :], u[None, :], LIMIT)[0]
    assert np.array_equal(_bits(got), _bits(want)), np.flatnonzero(_bits(got) != _bits(want))


def test_swiglu_boundaries_torch():
    g, u, want = _swiglu_want()
    got = te.swiglu_exact(torch.from_numpy(g)[None], torch.from_numpy(u)[None], LIMIT)[0]
    assert np.array_equal(_bits(got), _bits(want)), np.flatnonzero(_bits(got) != _bits(want))


def test_swiglu_boundaries_triton(ek):
    g, u, want = _swiglu_want()
    gt, ut = torch.from_numpy(_rows(g)), torch.from_numpy(_rows(u))
    bad = torch.zeros(1, dtype=torch.int32)
    h = torch.empty_like(gt)
    with np.errstate(over="ignore"):
        qt, s = ek.swiglu_quantize(gt, ut, LIMIT, bad, h=h)
    assert int(bad[0]) == 0
    for t in range(gt.shape[0]):
        got = h[t, :len(g)]
        assert np.array_equal(_bits(got), _bits(want)), np.flatnonzero(_bits(got) != _bits(want))
    full = X.swiglu_ref(gt.numpy(), ut.numpy(), LIMIT)
    q0, s0 = te.quantize_blocks(torch.from_numpy(full))
    n, _, kw = qt.shape
    assert torch.equal(qt.permute(0, 2, 1).reshape(n, kw * 16).to(torch.int64), q0)
    assert torch.equal(s.to(torch.int64), s0)
