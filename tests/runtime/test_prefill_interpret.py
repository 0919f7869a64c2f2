"""The tensor-core prefill kernels (kernels/prefill_triton.py) through Triton's
interpreter on the CPU: the device slot sort, the bf16 weight decode and the
grouped GEMMs against the float64 reference, per kernel qtype, with uneven
expert loads (an expert with no slot, one with all of them); and the bf16
exactness proof of every level x scale product per qtype."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4quant.runtime.kernels import layout  # noqa: E402

from . import _synth as S  # noqa: E402
from ._interp import kernels  # noqa: E402

LAYER = 1
EXPERTS = (3, 7, 8, 20)


@pytest.fixture(scope="module")
def pk():
    return kernels("ds4quant.runtime.kernels.prefill_triton")


def _owner(qtype, experts=EXPERTS):
    from ds4quant.runtime.owners.cuda_owner import CudaOwner

    o = CudaOwner("cpu", identity="torch-cpu:9")
    o.gemv_max_slots, o.group_max_mean = 0, 0.0  # straight to the prefill kernels
    # whole-matrix column blocks: the interpreter's cost is per program
    o.prefill_tile = {"gu": (128, 64, 4, 1, False), "down": (256, 64, 4, 1, False)}
    o.prefill_tile_linear = o.prefill_tile
    return o, S.hold_layer(o, qtype, LAYER, experts)


LOADS = {
    "uneven": np.array([7, 3, 7, 20, 7, 3, 7, 7, 20, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 3]),  # expert 8: no slot
    "one expert": np.array([20] * 18),
}


# every qtype with the uneven load; one expert holding every slot for one qtype of each decode
# form (one bf16 part, a hi + lo split, affine's two parts, MIX books)
ALL_IN_ONE = ("rocmfp4", "rocmfp8", "rocmfp2_affine", "rocmfp3_mix")


@pytest.mark.parametrize("qtype", layout.KERNEL_QTYPES)
def test_prefill_matches_float64(pk, qtype):
    for name, ids in LOADS.items():
        if name == "one expert" and qtype not in ALL_IN_ONE:
            continue
        o, stacks = _owner(qtype)
        x = S.tokens(len(ids), seed=11)
        assert o.prefill_set(LAYER) is not None
        y = o.run_slots(LAYER, x, ids, "fast")
        assert y.dtype == np.float32 and y.shape == x.shape and np.all(np.isfinite(y))
        # the bf16-rounded activations: only float32 summation error remains
        S.assert_rows_close(y, S.moe_ref64(stacks, x, ids, bf16=True), ids, 1e-2, f"{qtype} {name} (bf16 inputs)")
        # the unrounded float64 reference: bf16 activations' rounding
        S.assert_rows_close(y, S.moe_ref64(stacks, x, ids), ids, 3e-2, f"{qtype} {name}")


def test_device_sort_plans_every_slot_once(pk):
    ids = torch.tensor([5, 1, 5, 5, 9, 1, 5], dtype=torch.int64)
    loc = torch.full((10,), -1, dtype=torch.int64)
    loc[torch.tensor([1, 5, 7, 9])] = torch.arange(4)
    plan = pk.sort_slots(ids, loc, 4, 7, bm=2)
    order = plan.order.long()
    assert sorted(order.tolist()) == list(range(7))
    assert loc[ids[order]].tolist() == sorted(loc[ids].tolist())
    assert plan.count.tolist() == [2, 4, 0, 1]  # expert 7 (local 2): no slot
    assert plan.start.tolist() == [0, 2, 6, 6]
    assert plan.tend.tolist() == [1, 3, 3, 4]
    assert plan.tiles >= int(plan.tend[-1])


def test_bf16_parts_are_exact_per_qtype(pk):
    """One bf16 part carries every decoded weight of the low-bit formats exactly, two parts
    those of rocmfp6 / rocmfp8 / affine; MIX books are checked per registered pair."""
    one = {"rocmfp2", "rocmfp2_s40", "rocmfp3", "rocmfp4", "rocmfp4_fast", "mxfp4"}
    two = {"rocmfp6", "rocmfp8", "rocmfp2_affine"}
    for q in layout.KERNEL_QTYPES:
        if layout.kernel_format(q).mix:
            continue
        assert pk.qtype_terms(q) == (1 if q in one else 2), q
        assert q in one | two
    for q in ("rocmfp2_mix", "rocmfp3_mix"):
        books = np.stack([S.books_for(q, LAYER, e) for e in EXPERTS])
        modes = np.array([S.mode_for(q, e) for e in EXPERTS])
        assert pk.qtype_terms(q, books, modes) in (1, 2)


def test_bf16_proof_refuses_what_two_parts_cannot_hold(pk):
    lv = np.array([[1.0, np.float32(1 + 2.0 ** -10 + 2.0 ** -20)]], np.float32)  # 21 bits, two apart
    sc = np.array([1.0, 0.5], np.float32)
    assert pk.bf16_terms(lv, sc) == 0
    assert pk.bf16_terms(np.array([[1.0, 3.0]], np.float32), sc) == 1
    assert pk.bf16_terms(np.array([[1.0, 257.0]], np.float32), sc) == 2


def test_prefill_falls_back_on_books_without_an_exact_bf16_form(pk, monkeypatch):
    o, stacks = _owner("rocmfp2_mix")
    monkeypatch.setattr(pk, "qtype_terms", lambda *a, **k: 0)
    ids = LOADS["uneven"]
    x = S.tokens(len(ids), seed=2)
    y = o.run_slots(LAYER, x, ids, "fast")  # the float32 tl.dot path
    S.assert_rows_close(y, S.moe_ref64(stacks, x, ids), ids, 2e-5, "fallback")


def test_prefill_device_on_a_fresh_owner(pk):
    """``prefill_device`` called first (as a CUDA-graph capture's warm-up does, with no
    ``prefill_set`` before it) finds its stacks itself and gives the owner's own result;
    a layer without single stacks answers None instead of raising."""
    o, _stacks = _owner("rocmfp4")
    ids = LOADS["uneven"]
    x = S.tokens(len(ids), seed=5)
    got = o.prefill_device(LAYER, torch.from_numpy(x), torch.from_numpy(ids))
    assert got is not None
    want = o.run_slots(LAYER, x, ids, "fast")
    assert np.array_equal(got.numpy(), want)
    assert o.prefill_device(LAYER + 1, torch.from_numpy(x), torch.from_numpy(ids)) is None


@pytest.mark.parametrize("qtype", ALL_IN_ONE + ("rocmfp2",))
def test_prefill_launch_forms(pk, qtype):
    """Launch order (column blocks first or row tiles first) and the bf16 cast of the input
    before the launch change no byte; the transposed product (weights as the A operand)
    holds the same bounds as the default form."""
    ids = LOADS["uneven"]
    x = S.tokens(len(ids), seed=7)
    o, stacks = _owner(qtype)
    o.prefill_x16 = False
    want = o.run_slots(LAYER, x, ids, "fast")
    o.prefill_x16 = True
    assert np.array_equal(o.run_slots(LAYER, x, ids, "fast"), want), "bf16 input cast"
    pg, pu, pd, loc, _, E = o.single_stacks(LAYER)
    xt = torch.from_numpy(x)
    plan = pk.sort_slots(torch.from_numpy(ids), loc, E, len(ids))
    split = o._bf16_split(pg)
    outs = [pk.grouped(pg["fmt"], xt, plan, pg, split=split, bn=64, bk=64, n_first=nf) for nf in (True, False)]
    assert torch.equal(outs[0], outs[1]), "launch order"
    plain = o.prefill_tile
    swapped = {k: t[:4] + (True,) for k, t in plain.items()}  # the tile's last field
    for name, ids in LOADS.items():  # an expert with no slot; one expert with every slot
        x = S.tokens(len(ids), seed=7)
        o.prefill_tile = o.prefill_tile_linear = swapped
        y = o.run_slots(LAYER, x, ids, "fast")
        S.assert_rows_close(y, S.moe_ref64(stacks, x, ids, bf16=True), ids, 1e-2, f"{qtype} {name} swap (bf16)")
        o.prefill_tile = o.prefill_tile_linear = plain
        want = o.run_slots(LAYER, x, ids, "fast")
        S.assert_rows_close(y, want, ids, 1e-5, f"{qtype} {name} swap against the default form")


def test_exact_bf16_by_shift_is_the_rounded_value(pk, monkeypatch):
    """The compiled path's shift (``_bf16_exact``, NATIVE) gives every bf16 number the
    rounding conversion gives, signs and zeros included (the interpreter runs the same
    integer and bitcast operations the GPU does)."""
    import triton
    import triton.language as tl

    # the interpreter runs a kernel's source against its module's globals (no closures)
    monkeypatch.setitem(globals(), "_SHIFT", pk._bf16_exact)
    monkeypatch.setitem(globals(), "_ROUND", pk._bf16)

    @triton.jit
    def both(x_ptr, a_ptr, b_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        v = tl.load(x_ptr + i)
        tl.store(a_ptr + i, _SHIFT(v, True).to(tl.float32))  # noqa: F821
        tl.store(b_ptr + i, _ROUND(v, True).to(tl.float32))  # noqa: F821

    rng = np.random.default_rng(0)
    v = pk._bf16_np(rng.standard_normal(1024).astype(np.float32) * np.float32(2.0) ** rng.integers(-20, 20, 1024))
    v[:4] = (0.0, -0.0, 1.5, -3.0)
    a, b = torch.empty(1024), torch.empty(1024)
    both[(1,)](torch.from_numpy(v), a, b, N=1024)
    assert np.array_equal(a.numpy().view(np.uint32), v.view(np.uint32))
    assert np.array_equal(b.numpy().view(np.uint32), v.view(np.uint32))
