"""runtime/execute.py: slot split, owner branches, canonical combine.

Fake owners return chosen per-slot values, so what is checked is the
execution and the combine, not expert math (tests/runtime/test_identity.py
runs real owners)."""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4quant.errors import BadInputError, ShapeError  # noqa: E402
from ds4quant.runtime.execute import NONE, combine, run_layer  # noqa: E402
from ds4quant.runtime.owners import torch_exact  # noqa: E402

H = 4


class FakeOwner:
    """Expert e's output on any row is values[e] in every feature."""

    def __init__(self, identity, values, held):
        self.identity = identity
        self.values = values
        self.held = set(held)
        self.calls = []

    def run_slots(self, layer, x, expert_ids, mode):
        assert set(int(e) for e in expert_ids) <= self.held, "an owner got a slot it does not hold"
        self.calls.append(tuple(int(e) for e in expert_ids))
        return np.repeat(np.asarray([self.values[int(e)] for e in expert_ids], np.float32)[:, None], H, axis=1)


def _split(assign, values):
    names = sorted(set(assign) - {NONE})
    owners = {n: FakeOwner(n, values, [e for e, a in enumerate(assign) if a == n]) for n in names}
    return owners


VALUES = [1e20, 1.0, -1e20, 1.0]


@pytest.mark.parametrize("n_owners", [1, 2, 3, 4])
def test_combine_order_is_canonical_on_every_split(n_owners):
    # four expert outputs [1e20, 1, -1e20, 1], weights 1, slot order 0..3:
    # canonical fp32: ((1e20 + 1) - 1e20) + 1 = 1; a per-owner partial sum gives 0, 2 or 1e20-ish
    idx = torch.tensor([[0, 1, 2, 3]])
    w = torch.ones((1, 4))
    x = torch.zeros((1, H))
    seen = set()
    for assign in itertools.product([f"o{i}" for i in range(n_owners)], repeat=4):
        owners = _split(assign, VALUES)
        res = run_layer(0, x, idx, w, owners, assign, "exact")
        seen.add(res.out.numpy().tobytes())
        assert res.out[0, 0].item() == 1.0
        assert res.held.all() and res.missing == ()
    assert len(seen) == 1


def test_combine_follows_slot_order_not_expert_order():
    # same experts, slot order changed: the canonical order is the token's top-k order
    x = torch.zeros((2, H))
    idx = torch.tensor([[0, 1, 2, 3], [0, 2, 1, 3]])
    w = torch.ones((2, 4))
    res = run_layer(0, x, idx, w, _split(["a", "b", "a", "b"], VALUES), ["a", "b", "a", "b"], "exact")
    assert res.out[0, 0].item() == 1.0
    assert res.out[1, 0].item() == 2.0  # (1e20 - 1e20) + 1 + 1


def test_products_and_sums_are_each_rounded_to_fp32():
    # w * y and each partial sum rounded once to fp32, checked against exact rationals
    rng = np.random.default_rng(7)
    T, K = 9, 6
    w = rng.standard_normal((T, K)).astype(np.float32)
    y = rng.standard_normal((T, K, H)).astype(np.float32) * np.float32(1e3)
    shared = rng.standard_normal((T, H)).astype(np.float32)
    got = combine(torch.from_numpy(w), torch.from_numpy(y), shared=torch.from_numpy(shared)).numpy()
    for t in range(T):
        for i in range(H):
            acc = np.float32(w[t, 0] * y[t, 0, i])
            for k in range(1, K):
                acc = np.float32(acc + np.float32(w[t, k] * y[t, k, i]))
            want = np.float32(acc + shared[t, i])
            assert got[t, i].view(np.uint32) == want.view(np.uint32)


def test_none_slots_are_reported_and_the_complement_combines_to_the_same_bits():
    rng = np.random.default_rng(3)
    E, T, K = 8, 5, 3
    vals = [float(v) for v in rng.standard_normal(E).astype(np.float32) * 100]
    idx = torch.from_numpy(np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int64))
    w = torch.from_numpy(rng.random((T, K)).astype(np.float32))
    x = torch.zeros((T, H))
    full = ["a"] * E
    hot = ["a" if e < 3 else NONE for e in range(E)]
    cold = [NONE if e < 3 else "b" for e in range(E)]
    one = run_layer(1, x, idx, w, _split(full, vals), full, "exact")
    r_hot = run_layer(1, x, idx, w, _split(hot, vals), hot, "exact")
    r_cold = run_layer(1, x, idx, w, _split(cold, vals), cold, "exact")
    assert not r_hot.held.all()
    assert set(r_hot.missing) == {(t, k, int(idx[t, k])) for t in range(T) for k in range(K) if idx[t, k] >= 3}
    assert np.array_equal(r_hot.held, ~r_cold.held)
    merged = torch.where(torch.from_numpy(r_hot.held)[:, :, None], r_hot.slots, r_cold.slots)
    assert torch.equal(combine(w, merged), one.out)
    # a sum of the two partial combines is not the canonical combine in general: only slots travel
    assert torch.equal(r_hot.out, combine(w, r_hot.slots, held=r_hot.held))


def test_each_owner_gets_only_its_slots_once_per_call():
    E = 6
    assign = ["a", "b", "c", "a", "b", "c"]
    owners = _split(assign, [float(e) for e in range(E)])
    idx = torch.tensor([[0, 1, 2], [3, 4, 5], [0, 4, 2]])
    run_layer(0, torch.zeros((3, H)), idx, torch.ones((3, 3)), owners, assign, "fast")
    for n, o in owners.items():
        assert len(o.calls) == 1
        assert sorted(o.calls[0]) == sorted(int(e) for e in idx.reshape(-1) if assign[int(e)] == n)


def test_bad_routing_is_refused():
    owners = _split(["a"] * 4, VALUES)
    with pytest.raises(BadInputError, match="expert ids must be in 0..3"):
        run_layer(0, torch.zeros((1, H)), torch.tensor([[0, 4]]), torch.ones((1, 2)), owners, ["a"] * 4, "exact")
    with pytest.raises(ShapeError):
        run_layer(0, torch.zeros((2, H)), torch.tensor([[0, 1]]), torch.ones((1, 2)), owners, ["a"] * 4, "exact")
    with pytest.raises(BadInputError, match="owners"):
        run_layer(0, torch.zeros((1, H)), torch.tensor([[0, 1]]), torch.ones((1, 2)), owners, ["z"] * 4, "exact")


def test_an_owner_error_reaches_the_caller():
    from concurrent.futures import ThreadPoolExecutor

    class Boom(FakeOwner):
        def run_slots(self, *a):
            raise RuntimeError("owner b died")

    owners = {"a": FakeOwner("a", VALUES, [0, 1]), "b": Boom("b", VALUES, [2, 3])}
    with ThreadPoolExecutor(2) as pool, pytest.raises(RuntimeError, match="owner b died"):
        run_layer(0, torch.zeros((1, H)), torch.tensor([[0, 2]]), torch.ones((1, 2)), owners,
                  ["a", "a", "b", "b"], "exact", pool)


# --------------------------------------------------------------------------
# the torch implementation of the exact definition (docs/exact-mode.md: Q, D, SWIGLU)


def _rational_f32(S: Fraction) -> np.float32:
    """Round a rational once to float32, nearest even (subnormals, overflow)."""
    if S == 0:
        return np.float32(0.0)
    sign, S = (-1 if S < 0 else 1), abs(S)
    e = S.numerator.bit_length() - S.denominator.bit_length()
    while Fraction(2) ** e > S:
        e -= 1
    while Fraction(2) ** (e + 1) <= S:
        e += 1
    lsb = max(e - 23, -149)
    v = S / Fraction(2) ** lsb
    fl, rem = divmod(v.numerator, v.denominator)
    rem = Fraction(rem, v.denominator)
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and fl % 2):
        fl += 1
    mag = fl * 2.0 ** lsb
    return np.float32(sign * (mag if mag < 2.0 ** 128 else np.inf))


def _reference_linear(w, x):
    n, c = x.shape
    out = np.zeros((n, w.shape[0]), np.float32)
    for t in range(n):
        a = []
        for b in range(c // 32):
            blk = x[t, b * 32:(b + 1) * 32].astype(np.float64)
            m = float(np.abs(blk).max())
            if m == 0:
                a += [Fraction(0)] * 32
                continue
            s = int(np.frexp(m)[1]) - 7
            if m / 2.0 ** s > 127:
                s += 1
            a += [int(v) * Fraction(2) ** s for v in np.round(blk / 2.0 ** s)]
        for j in range(w.shape[0]):
            out[t, j] = _rational_f32(sum((Fraction(float(w[j, i])) * a[i] for i in range(c)), Fraction(0)))
    return out


@pytest.mark.parametrize("case", ["wide", "subnormal", "overflow", "cancel", "zero"])
def test_exact_linear_is_the_rational_sum_rounded_once(case):
    rng = np.random.default_rng(["wide", "subnormal", "overflow", "cancel", "zero"].index(case))
    r, c, n = 5, 64, 3
    w = (rng.standard_normal((r, c)) * np.exp2(rng.integers(-40, 40, (r, c)))).astype(np.float32)
    x = (rng.standard_normal((n, c)) * np.exp2(rng.integers(-20, 20, (n, c)))).astype(np.float32)
    if case == "subnormal":
        w[0] = np.float32(1e-45)
        w[1] = np.float32(3e-39)
        x[:] = np.float32(1e-30)
    if case == "overflow":
        w[:] = np.float32(3e38)
        x[:] = np.float32(1e30)
    if case == "cancel":
        w[1] = 1.0
        w[1, 1] = -1.0
        x[:, :2] = 1e20
    if case == "zero":
        x[1] = 0.0
        w[2] = 0.0
    got = torch_exact.exact_linear(torch.from_numpy(w), torch.from_numpy(x)).numpy()
    want = _reference_linear(w, x)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def _decoded_like(rng, r, c):
    """Weights as a low-bit decode gives them: small integer levels times per-16 power-of-two scales."""
    lv = rng.integers(-3, 4, (r, c)).astype(np.float64)
    sc = np.exp2(rng.integers(-9, -5, (r, c // 16))).repeat(16, axis=1)
    return (lv * sc).astype(np.float32)


@pytest.mark.parametrize("case", ["decoded", "mixed", "signed_zero", "cancel_to_zero"])
def test_exact_linear_float64_path_gives_the_rational_sum(case):
    """The float64 product handles the pairs whose bit span fits 53 bits, the limb path
    the rest; either way each output is the exact sum rounded once (+0.0 for zero)."""
    rng = np.random.default_rng(["decoded", "mixed", "signed_zero", "cancel_to_zero"].index(case) + 10)
    r, c, n = 6, 64, 4
    w = _decoded_like(rng, r, c)
    x = rng.standard_normal((n, c)).astype(np.float32)
    if case == "mixed":
        w[1, 0] = np.float32(2.0 ** 60)  # row 1 spans > 53 bits with any token: limb path
        x[2, :32] *= np.float32(2.0 ** -40)  # token 2 spans > 53 bits with every row
    if case == "signed_zero":
        w[0] = -0.0
        w[3, :] = 0.0
        w[3, 5] = -2.0 ** -8
        x[1] = 0.0
        x[1, 5] = -0.0
    if case == "cancel_to_zero":
        w[2] = 0.0
        w[2, 0], w[2, 1] = 2.0 ** -7, -(2.0 ** -7)
        x[:, 0] = x[:, 1] = 1.5
    wt, xt = torch.from_numpy(w), torch.from_numpy(x)
    q, s = torch_exact.quantize_blocks(xt)
    fits = torch_exact.f64_pairs(wt, q, s).numpy()
    if case == "mixed":
        assert not fits[:, 1].any() and not fits[2].any() and fits[0, 0] and fits[3, 5]
    else:
        assert fits.all()
    got = torch_exact.exact_linear(wt, xt).numpy()
    want = _reference_linear(w, x)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    if case in ("signed_zero", "cancel_to_zero"):
        zeros = want == 0
        assert zeros.any() and not np.signbit(got[zeros]).any()


def test_exact_linear_limb_path_alone_matches_float64_path():
    """Forcing every pair through the limbs gives the float64 path's bits."""
    rng = np.random.default_rng(21)
    w = torch.from_numpy(_decoded_like(rng, 40, 128))
    x = torch.from_numpy(rng.standard_normal((7, 128)).astype(np.float32))
    q, s = torch_exact.quantize_blocks(x)
    assert bool(torch_exact.f64_pairs(w, q, s).all())
    wm, we = torch_exact._split_weights(w)
    limbs = torch_exact._limb_linear(wm, we, q, s)
    assert torch.equal(limbs.view(torch.int32), torch_exact.exact_linear(w, x).view(torch.int32))
    assert torch.equal(limbs.view(torch.int32), torch_exact.exact_linear(w, x, f64=False).view(torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or HIP device")
@pytest.mark.parametrize("f64", [False, True])
def test_exact_linear_on_the_device_gives_the_cpu_bits(f64):
    """The float64 route through cuBLAS/rocBLAS and the limbs on the device: the CPU's bits
    (the reason F64_DEVICES holds "cuda")."""
    rng = np.random.default_rng(22)
    w = _decoded_like(rng, 256, 512)
    w[3, 7] = np.float32(2.0 ** 60)  # one row through the limbs on either route
    w, x = torch.from_numpy(w), torch.from_numpy(rng.standard_normal((9, 512)).astype(np.float32))
    want = torch_exact.exact_linear(w, x)
    got = torch_exact.exact_linear(w.cuda(), x.cuda(), f64=f64).cpu()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_exact_linear_refuses_non_finite_input():
    with pytest.raises(BadInputError, match="non-finite"):
        torch_exact.exact_linear(torch.ones((2, 32)), torch.full((1, 32), float("nan")))


def test_quantize_blocks_range_and_scale():
    x = torch.tensor([[127.5] + [0.0] * 31, [-1e-3] * 32, [0.0] * 32], dtype=torch.float32)
    q, s = torch_exact.quantize_blocks(x.reshape(1, -1)[:, :96].reshape(3, 32))
    assert int(q.abs().max()) <= 127
    assert s.tolist() == [[1], [-16], [0]]  # 127.5 > 127 at 2^0: bumped to 2^1; 1e-3 / 2^-16 = 65.5; zero block s = 0
    assert q[1, 0].item() == -66
    assert q[0, 0].item() == 64  # 127.5 / 2 = 63.75 -> 64


def test_fixed_exp_and_swiglu():
    import math

    z = torch.tensor([-10.0, -1.0, 0.0, 0.5, 10.0, 700.0, 709.5], dtype=torch.float64)
    e = torch_exact.fixed_exp(z)
    for zi, ei in zip(z.tolist()[:-1], e.tolist()[:-1]):
        assert abs(ei - math.exp(zi)) <= 4 * math.ulp(math.exp(zi))
    assert e[-1].item() == math.inf
    g = torch.tensor([[-800.0, -3.0, 0.0, 2.0, 50.0]])
    u = torch.tensor([[1.0, 2.0, 3.0, -40.0, 40.0]])
    h = torch_exact.swiglu_exact(g, u, 10.0)
    assert h[0, 0].item() == 0.0 and math.copysign(1, h[0, 0].item()) == -1  # gc * 0.0 * uc: -0
    assert h[0, 3].item() == pytest.approx(2 / (1 + math.exp(-2)) * -10, rel=1e-7)  # up clamped to -10
    assert h[0, 4].item() == pytest.approx(10 / (1 + math.exp(-10)) * 10, rel=1e-7)  # gate clamped to 10


# --------------------------------------------------------------------------
# TorchOwner: identity, residency, decode tables


def test_torch_identity_is_read_from_torch(monkeypatch):
    from ds4quant.runtime.owners.torch_owner import torch_identity

    assert torch_identity("cpu") == "torch-cpu:0"
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert torch_identity("cuda:1") == "cuda:1"
    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
    assert torch_identity("cuda:1") == "hip:1"


def _mix_stack(tensor="blk.0.ffn_gate_exps.rocmfp3_mix.weight", ids=(2, 5), rows=8, cols=64):
    from ds4quant import formats
    from ds4quant.codebooks import CodebookEntry
    from ds4quant.runtime.owners.base import ExpertStack

    L = formats.QTYPES["rocmfp3_mix"].codebook_levels
    rng = np.random.default_rng(1)
    books = np.stack([np.stack([np.linspace(-1, 1, L) * (1 + 0.25 * g), np.linspace(-0.5, 1.5, L) * (1 + 0.25 * g)])
                      for g in range(8)]).astype(np.float32)
    books = formats.bf16_round(books)
    data = np.stack([formats.encode("rocmfp3_mix", rng.standard_normal((rows, cols)).astype(np.float32),
                                    codebooks=books[g]) for g in ids])
    entry = CodebookEntry(tensor, "rocmfp3_mix", np.ones(8, np.uint8), books, n_global=8,
                          expert_ids=tuple(range(8)))
    stack = ExpertStack(tensor, 0, "gate", "rocmfp3_mix", rows, cols, tuple(ids), data)
    return stack, entry, books


def test_mix_decode_needs_the_owners_own_registration():
    from ds4quant import formats
    from ds4quant.errors import CodebookError
    from ds4quant.runtime.owners.torch_owner import TorchOwner

    stack, entry, books = _mix_stack()
    a = TorchOwner("cpu", identity="torch-cpu:0")
    b = TorchOwner("cpu", identity="torch-cpu:1")
    a.add_stack(stack)
    with pytest.raises(CodebookError):  # unregistered: never decoded with fixed levels
        a._decode(0, "gate", 5)
    a.register_books(stack.tensor, stack.expert_ids, entry)
    got = a._decode(0, "gate", 5).numpy()
    want = formats.decode("rocmfp3_mix", stack.data[1], stack.cols, codebooks=books[5], modes=1)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # global row 5 gathered to local 1
    with pytest.raises(CodebookError):  # another owner's identity never resolves a's entry
        a.registry.lookup(b.identity, stack.tensor)
    with pytest.raises(CodebookError):
        a.register_books(stack.tensor, (5, 2), entry)  # not the resident order
    with pytest.raises(CodebookError):
        a.register_books(stack.tensor, (), entry)
    a.close()
    with pytest.raises(CodebookError):
        a.registry.lookup(a.identity, stack.tensor)
    assert a.resident_bytes() == 0


# --------------------------------------------------------------------------
# Runtime on a small artifact (mxfp4: a lossless repack, quick to write)


@pytest.fixture(scope="module")
def mx(tmp_path_factory):
    from pathlib import Path

    from ds4quant.convert import convert

    out = tmp_path_factory.mktemp("rtx") / "mx"
    convert(Path(__file__).resolve().parents[2] / "samples" / "ds4-tiny", out, "mxfp4", threads=1)
    return out


def test_runtime_api_recorder_and_close(mx):
    from ds4quant import runtime

    from ds4quant.runtime.capture import RoutingRecorder

    rec = RoutingRecorder(4, 16, 4)
    x = torch.randn((3, 256), generator=torch.Generator().manual_seed(2))
    with runtime.load(mx, mode="fast", recorder=rec,
                      placement={L: {"torch-cpu:0": tuple(range(8)), "torch-cpu:1": tuple(range(8, 16))}
                                 for L in range(4)}) as rt:
        assert set(rt.owners) == {"torch-cpu:0", "torch-cpu:1"}
        assert rt.owners["torch-cpu:1"].identity == "torch-cpu:1"
        z = rt.moe(2, x, torch.tensor([1, 2, 3]))
        idx, w = rt.route(2, x, torch.tensor([1, 2, 3]))
        assert idx.shape == (3, 4) and w.dtype == torch.float32
        assert torch.allclose(w.sum(-1), torch.full((3,), rt.header.routed_scale))
        y = rt.experts(2)(x, idx, w)
        assert torch.equal(z, y + rt.shared(2, x))  # fast mode: one fp32 add of the shared expert
        assert isinstance(rt.experts(2), torch.nn.Module)
        with pytest.raises(BadInputError, match="layer 9"):
            rt.experts(9)
        # hash layer: the token id picks the experts
        hi, _ = rt.route(0, x, torch.tensor([7, 7, 8]))
        assert torch.equal(hi[0], hi[1])
    # moe() and experts() each ran layer 2 once on the same routing; nothing else was recorded
    want = 2 * np.bincount(idx.numpy().ravel(), minlength=16)
    assert rec.counts[2].tolist() == want.tolist() and not rec.counts[[0, 1, 3]].any()
    with pytest.raises(BadInputError, match="closed"):
        rt.run_layer(2, x, idx, w)
    assert sum(rt.resident_bytes().values()) == 0


def test_load_takes_a_placement_object(mx):
    placement = pytest.importorskip("ds4quant.runtime.placement")
    from ds4quant import runtime

    p = placement.Placement.build(4, 16, 4, ["torch-cpu:0", "torch-cpu:1"],
                                  [[list(range(0, 16, 2)), list(range(1, 12, 2))] for _ in range(4)],
                                  none=[[13, 15] for _ in range(4)])
    with runtime.load(mx, placement=p, mode="fast") as rt:
        assert rt.owners["torch-cpu:0"].experts(1) == tuple(range(0, 16, 2))
        assert rt.owners["torch-cpu:1"].experts(1) == tuple(range(1, 12, 2))
        res = rt.run_layer(1, torch.zeros((1, 256)), torch.tensor([[0, 13, 3, 15]]), torch.ones((1, 4)))
        assert res.missing == ((0, 1, 13), (0, 3, 15))


def _combine_torch(weights, slots, held=None, shared=None):
    """The torch-ops combine that execute.combine replaced (the oracle)."""
    T, K = weights.shape
    keep = torch.ones((T, K), dtype=torch.bool) if held is None else torch.from_numpy(held)
    acc = torch.zeros((T, slots.shape[2]), dtype=torch.float32)
    started = torch.zeros((T, 1), dtype=torch.bool)
    for k in range(K):
        term = weights[:, k:k + 1] * slots[:, k, :]
        acc = torch.where(keep[:, k:k + 1], torch.where(started, acc + term, term), acc)
        started = started | keep[:, k:k + 1]
    return acc if shared is None else acc + shared


@pytest.mark.parametrize("seed", range(6))
def test_numpy_combine_has_the_torch_ops_bits(seed):
    g = np.random.default_rng(seed)
    T, K, Hh = 5, 6, 33
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 3.4e38, 1e-38], np.float32)
    y = (g.standard_normal((T, K, Hh)) * 10.0 ** g.integers(-30, 30, (T, K, 1))).astype(np.float32)
    y.reshape(-1)[g.choice(y.size, 40, replace=False)] = g.choice(specials, 40)
    w = g.random((T, K)).astype(np.float32)
    w[0, 0] = -0.0
    held = g.random((T, K)) < 0.7 if seed % 2 else None
    shared = torch.from_numpy(g.standard_normal((T, Hh)).astype(np.float32)) if seed % 3 else None
    got = combine(torch.from_numpy(w), torch.from_numpy(y), held=held, shared=shared)
    want = _combine_torch(torch.from_numpy(w), torch.from_numpy(y), held, shared)
    assert got.dtype == torch.float32 and got.numpy().view(np.uint32).tobytes() == want.numpy().view(np.uint32).tobytes()
