"""Exact mode's Triton kernels (runtime/kernels/exact_triton.py) through Triton's
interpreter on the CPU (skipped without triton): each step gives the bits of
the definition (owners/torch_exact) — quantization, the float64 SwiGLU (its
edge cases: E = +inf, clamps, infinities, signed zeros), the exact products
for rocmfp2 and rocmfp3 (cancellation to +0.0, -0.0 weights, pairs outside
the float64 bound flagged) — and a CUDA owner on the CPU device gives the
CPU owners' exact bytes, patching flagged pairs with the definition's limbs."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4quant.errors import BadInputError  # noqa: E402
from ds4quant.runtime.kernels import layout  # noqa: E402
from ds4quant.runtime.owners import torch_exact as te  # noqa: E402

from . import _synth as S  # noqa: E402
from ._interp import kernels  # noqa: E402

LAYER = 2
EXPERTS = (1, 4, 9, 13)
# whole-matrix row blocks keep the interpreter short; two column steps a matrix cover the prefetch
BIG = {"gu": (128, 8, 1, True), "down": (256, 4, 1, True)}
# several row blocks, no prefetch for gate/up
MID = {"gu": (32, 8, 1, False), "down": (64, 2, 1, True)}


@pytest.fixture(scope="module")
def ek():
    return kernels("ds4quant.runtime.kernels.exact_triton")


def _bits(t):
    return np.ascontiguousarray(t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else t).view(np.uint32)


def _unT(qt):
    """(n, 16, K / 16) group-transposed -> (n, K)."""
    n, _, kw = qt.shape
    return qt.permute(0, 2, 1).reshape(n, kw * 16)


def _edge_tokens(K=128):
    x = torch.from_numpy(S.tokens(5, seed=3, hidden=K))
    x[1, :32] = 0.0  # a zero block
    x[1, 32:64] = -0.0
    x[2, :32] = torch.tensor(np.arange(-16, 16) + 0.5, dtype=torch.float32) * 2.0 ** -20  # ties
    x[2, 32:64] = torch.tensor(np.linspace(-127.75, 127.75, 32), dtype=torch.float32)  # max/2^s > 127: the bump
    x[3, :32] = torch.tensor(np.full(32, 1e-45), dtype=torch.float32)  # subnormals
    x[3, 32:64] = 3e38
    x[4] = torch.tensor(np.arange(K) % 3 - 1.0, dtype=torch.float32)
    return x


def test_quantize_is_the_definitions_step_1(ek):
    x = _edge_tokens()
    bad = torch.zeros(1, dtype=torch.int32)
    qt, s = ek.quantize(x, bad)
    q0, s0 = te.quantize_blocks(x)
    assert int(bad[0]) == 0
    assert torch.equal(_unT(qt).to(torch.int64), q0) and torch.equal(s.to(torch.int64), s0)
    assert np.all(_unT(qt).abs().numpy() <= 127)


def test_quantize_counts_non_finite_inputs(ek):
    for v in (float("inf"), float("nan")):
        x = torch.from_numpy(S.tokens(2, seed=4, hidden=64))
        x[1, 40] = v
        bad = torch.zeros(1, dtype=torch.int32)
        with np.errstate(invalid="ignore", over="ignore"):
            ek.quantize(x, bad)
        assert int(bad[0]) == 1


def _gate_up(K=128):
    g = torch.from_numpy(S.tokens(3, seed=5, hidden=K) * 8)
    u = torch.from_numpy(S.tokens(3, seed=6, hidden=K) * 8)
    edges = [-800.0, -709.5, -709.0, -708.9, 709.0, -0.0, 0.0, 1e-30, -1e-30, 9.99, 10.0, 10.01, 12.0, 3e38,
             float("inf"), -50.0, -1e-7, 2.5]
    g[0, :len(edges)] = torch.tensor(edges)
    u[0, :len(edges)] = torch.tensor([3.0, -2.0, 1.5, -0.0, 0.0, 4.0, -4.0, float("inf"), float("-inf"), 11.0,
                                      -11.0, 10.0, -10.0, 1e-30, 2.0, -3e38, 7.0, 0.0])
    g[1, :32] = -1000.0  # a block of signed zeros after SwiGLU
    return g, u


def test_swiglu_quantize_is_the_definitions_step_3_then_1(ek):
    g, u = _gate_up()
    bad = torch.zeros(1, dtype=torch.int32)
    h = torch.empty_like(g)
    qt, s = ek.swiglu_quantize(g, u, 10.0, bad, h=h)
    want = te.swiglu_exact(g, u, 10.0)
    assert int(bad[0]) == 0
    assert np.array_equal(_bits(h), _bits(want))  # every bit, signed zeros included
    assert (_bits(want[1, :32]) == 0x80000000).any()
    q0, s0 = te.quantize_blocks(want)
    assert torch.equal(_unT(qt).to(torch.int64), q0) and torch.equal(s.to(torch.int64), s0)


def test_swiglu_of_a_minus_infinite_gate_is_counted(ek):
    g, u = _gate_up(64)
    g[2, 5] = float("-inf")  # silu = -inf * 0.0 = NaN in the definition: its quantization refuses it
    bad = torch.zeros(1, dtype=torch.int32)
    with np.errstate(invalid="ignore", over="ignore"):
        ek.swiglu_quantize(g, u, 10.0, bad)
    assert int(bad[0]) == 1
    with pytest.raises(BadInputError, match="non-finite"):
        te.quantize_blocks(te.swiglu_exact(g, u, 10.0))


def _owner(qtypes, tiles=BIG, exact=True):
    from ds4quant.runtime.owners.cuda_owner import CudaOwner

    o = CudaOwner("cpu", identity="torch-cpu:8", prec="ieee", exact_kernels=exact)
    o.exact_tile = dict(tiles)
    mine = {}
    for proj, q in zip(("gate", "up", "down"), qtypes):
        mine[proj] = S.layer_stacks(q, LAYER, EXPERTS)[0][proj]
        o.add_stack(mine[proj])
    return o, mine


@pytest.mark.parametrize("qtype", sorted(layout.LINEAR_QTYPES))
@pytest.mark.parametrize("tiles,sdec", [(BIG, True), (MID, True), (BIG, False)],
                         ids=["big", "mid", "scale-lut"])
def test_exact_products_are_exact_linear(ek, qtype, tiles, sdec):
    o, stacks = _owner((qtype,) * 3)
    lg, lu, ld, loc, _ = o.gemv_set(LAYER)
    ids = torch.tensor([13, 1, 13, 4, 9])
    x = _edge_tokens(S.HIDDEN)
    x[0] *= 1e-3
    x[3, 32:] = 1e-44  # subnormals only: 3e38 beside them is outside the float64 bound (flagged below)
    bad = torch.zeros(1, dtype=torch.int32)
    qt, s = ek.quantize(x, bad)
    bn, bw, nw, pre = tiles["gu"]
    g, u = ek.gemv_exact(lg, qt, s, ids, loc, bad, lp2=lu, bn=bn, bw=bw, num_warps=nw, pre=pre, sdec=sdec)
    h = torch.from_numpy(S.tokens(5, seed=8, hidden=S.FFN))
    qh, sh = ek.quantize(h, bad)
    bn, bw, nw, pre = tiles["down"]
    y = ek.gemv_exact(ld, qh, sh, ids, loc, bad, bn=bn, bw=bw, num_warps=nw, pre=pre, sdec=sdec)
    assert int(bad[0]) == 0
    for i, e in enumerate(ids.tolist()):
        li = EXPERTS.index(e)
        for got, proj, inp in ((g, "gate", x), (u, "up", x), (y, "down", h)):
            w = torch.from_numpy(S.decoded(stacks[proj], li))
            want = te.exact_linear(w, inp[i:i + 1])[0]
            assert np.array_equal(_bits(got[i]), _bits(want)), f"{proj} slot {i}"
    o.close()


def _planes(rows=16, cols=128, seed=0):
    """A hand-built rocmfp2 word layout (1 expert): row 0 all level +1 at scale 1.0, row 1 all
    level 0 at scale -1.0 (-0.0 weights), the other rows random codes and scale bytes."""
    r = np.random.default_rng(seed)
    slut = layout.scale_lut("rocmfp2")
    one = int(np.flatnonzero(slut == 1.0)[0])
    neg = int(np.flatnonzero(slut == -1.0)[0])
    kw = cols // 16
    words = r.integers(0, 1 << 32, (1, rows, kw), dtype=np.uint64)
    sb = r.integers(0x18, 0x39, (1, rows, kw)).astype(np.uint8) | (r.integers(0, 2, (1, rows, kw)) << 7).astype(
        np.uint8)
    words[0, 0] = 0xAAAAAAAA  # code 2: level 1
    words[0, 1] = 0x55555555  # code 1: level 0
    sb[0, 0] = one
    sb[0, 1] = neg
    a = torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())
    return layout.LinearPlanes("rocmfp2", a, None, torch.from_numpy(sb), torch.from_numpy(slut), 2, 1)


def test_hand_built_rows_cancellation_signed_zero_and_flagged_pairs(ek):
    lp = _planes()
    w = layout.linear_reference(lp)[0]
    assert (_bits(w[1]) == 0x80000000).all()  # -0.0 weights
    K = w.shape[1]
    x = torch.from_numpy(S.tokens(4, seed=12, hidden=K))
    x[0] = torch.tensor([3.0, -3.0] * (K // 2))  # row 0: an exact cancellation
    x[1] = 0.0
    x[3, :32] *= 1e30  # a token whose blocks span 2^200: outside the float64 bound
    x[3, 32:64] *= 1e-30
    loc = torch.zeros(1, dtype=torch.int64)
    want = te.exact_linear(w, x)
    fits = te.f64_pairs(w, *te.quantize_blocks(x))
    assert not fits[3].all() and fits[:3].all()  # the definition mixes its routes on token 3
    for toks, flagged in (([0, 1, 2], False), ([3], True)):
        bad = torch.zeros(1, dtype=torch.int32)
        qt, s = ek.quantize(x[toks], bad)
        y, fl = ek.gemv_exact(lp, qt, s, torch.zeros(len(toks), dtype=torch.int64), loc, bad, bn=8, bw=4,
                              flags=True)
        assert (int(bad[0]) > 0) == flagged and int(fl.sum()) == int(bad[0])
        assert np.array_equal(_bits(y)[fl.numpy() == 0], _bits(want[toks])[fl.numpy() == 0])
    assert _bits(want[0, 0]) == 0 and (_bits(want[1]) == 0).all() and (_bits(want[:3, 1]) == 0).all()


@pytest.mark.parametrize("qtypes", [("rocmfp2",) * 3, ("rocmfp3",) * 3, ("rocmfp2", "rocmfp2", "rocmfp3")],
                         ids=["rocmfp2", "rocmfp3", "strix"])
def test_owner_exact_bytes_are_the_cpu_owners(ek, qtypes):
    from ds4quant.runtime.owners.torch_owner import TorchOwner

    o, stacks = _owner(qtypes, tiles=BIG if qtypes[0] == qtypes[2] else MID)
    ref = TorchOwner("cpu", identity="torch-cpu:9")
    for st in stacks.values():
        ref.add_stack(st)
    ids = np.array([4, 13, 4, 1, 9])
    x = S.tokens(len(ids), seed=21)
    y = o.run_slots(LAYER, x, ids, "exact")
    assert o.exact_stats == {"kernel": 1, "patched": 0, "rerun": 0}
    want = ref.run_slots(LAYER, x, ids, "exact")
    assert np.array_equal(_bits(y), _bits(want))
    try:
        from ds4quant.runtime.owners.cpu import CpuOwner
    except ImportError:  # the numba owner is optional
        CpuOwner = None
    if CpuOwner is not None:
        c = CpuOwner("cpu:7")
        for st in stacks.values():
            c.add_stack(st)
        assert np.array_equal(_bits(c.run_slots(LAYER, x, ids, "exact")), _bits(want))
        c.close()
    # a slot's bytes depend on its own row only
    y2 = o.run_slots(LAYER, x[::-1].copy(), ids[::-1].copy(), "exact")
    assert np.array_equal(_bits(y2[::-1]), _bits(y))
    o.close()
    ref.close()


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the interpreter's max over the NaN input
def test_owner_patches_flagged_pairs_with_the_definitions_limbs(ek):
    from ds4quant.runtime.owners.torch_owner import TorchOwner

    o, stacks = _owner(("rocmfp2",) * 3)
    ref = TorchOwner("cpu", identity="torch-cpu:9")
    for st in stacks.values():
        ref.add_stack(st)
    ids = np.array([1, 9])
    x = S.tokens(2, seed=22)
    x[1, :32] *= 1e30
    x[1, 32:64] *= 1e-30
    y = o.run_slots(LAYER, x, ids, "exact")
    assert o.exact_stats == {"kernel": 0, "patched": 1, "rerun": 0}
    assert np.array_equal(_bits(y), _bits(ref.run_slots(LAYER, x, ids, "exact")))
    x[0, 3] = np.nan  # non-finite input: the definition's error, through the rerun
    with np.errstate(invalid="ignore", over="ignore"), pytest.raises(BadInputError, match="non-finite"):
        o.run_slots(LAYER, x, ids, "exact")
    assert o.exact_stats["rerun"] == 1
    with pytest.raises(BadInputError, match="not resident"):
        o.run_slots(LAYER, S.tokens(1), np.array([2]), "exact")
    o.close()
    ref.close()


@pytest.mark.parametrize("proj", ["gate", "up", "down"])
def test_a_patched_pair_is_the_definitions_sum(ek, proj):
    o, stacks = _owner(("rocmfp2", "rocmfp2", "rocmfp3"))
    ids = np.array([9, 4, 9])
    inp = torch.from_numpy(S.tokens(3, seed=23, hidden=S.FFN if proj == "down" else S.HIDDEN))
    rows = stacks[proj].rows
    out = torch.full((3, rows), float("nan"))
    flags = torch.zeros((3, rows), dtype=torch.int8)
    flags[0, ::3] = 1
    flags[2] = 1
    o._patch(LAYER, proj, out, flags, ids, inp)
    for i, e in enumerate(ids):
        want = te.exact_linear(torch.from_numpy(S.decoded(stacks[proj], EXPERTS.index(e))), inp[i:i + 1])[0]
        m = flags[i].numpy() == 1
        assert np.array_equal(_bits(out[i])[m], _bits(want)[m]) and np.isnan(out[i].numpy()[~m]).all()
    o.close()


def test_layers_the_kernels_do_not_cover_take_the_definition(ek):
    o, _ = _owner(("q8_0",) * 3)  # no kernel layout (MIX and the other ROCmFPX: exact_planes)
    assert o.exact_set(LAYER, np.array([1])) is None
    o.close()
