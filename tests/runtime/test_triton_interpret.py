"""The CUDA owner's Triton kernels run through Triton's interpreter
(TRITON_INTERPRET=1) on the CPU, so CI checks their arithmetic without a GPU.

The repacked layout must decode to ``formats.decode``'s bits (torch only, no
triton needed); the kernels' fast output must match a float64 product of the
decoded weights within float32 rounding, and TorchOwner's fast path (decode
then matmul) within the same tolerance, on matrix-vector (one slot per
expert) and grouped (tl.dot) batches, for every qtype with a kernel layout:
every ROCmFPX qtype (rocmfp6 and rocmfp2_affine included), MIX 105/106, mxfp4.
"""

from __future__ import annotations


import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4quant.runtime.kernels import layout  # noqa: E402

from . import _synth as S  # noqa: E402
from ._interp import kernels  # noqa: E402

LAYER = 1
EXPERTS = (3, 7, 8, 20)


def _planes(stack):
    return layout.repack(stack.qtype, torch.from_numpy(np.ascontiguousarray(stack.data)), stack.cols)


@pytest.mark.parametrize("qtype", layout.KERNEL_QTYPES)
def test_repacked_planes_decode_to_the_artifact_bits(qtype):
    stacks, entries = S.layer_stacks(qtype, LAYER, EXPERTS)
    for st in stacks.values():
        a, b, s, o = _planes(st)
        assert (b is not None) == layout.kernel_format(qtype).has_b
        assert (o is not None) == (qtype == "rocmfp2_affine")
        assert a.nbytes + s.nbytes + sum(p.nbytes for p in (b, o) if p is not None) == st.nbytes  # same bits, moved
        books = modes = None
        if st.tensor in entries:
            books, modes = entries[st.tensor].books, entries[st.tensor].modes
        lev = torch.from_numpy(layout.level_lut(qtype, books, modes))
        sc = torch.from_numpy(layout.scale_lut(qtype))
        tab = torch.arange(0, 2 * st.n_experts, 2) if books is not None else None
        got = layout.unpack_reference(qtype, a, b, s, st.cols, lev, sc, tab, o).numpy()
        for i, e in enumerate(st.expert_ids):
            want = S.decoded(st, i)
            if books is not None and int(modes[i]) == 0:
                # mode 0 with bit 7 set: decode gives level * 0 (a signed zero), the layout +0
                assert np.array_equal(got[i], want), f"{st.tensor} expert {e}"
            else:
                assert np.array_equal(got[i].view(np.uint32), want.view(np.uint32)), f"{st.tensor} expert {e}"


def test_every_rocmfpx_qtype_has_a_kernel_layout():
    from ds4quant import formats

    rocmfpx = {q for q, t in formats.QTYPES.items() if t.family == "rocmfpx" or t.is_mix}
    assert {"rocmfp6", "rocmfp2_affine", "rocmfp2_mix", "rocmfp3_mix"} <= rocmfpx
    assert rocmfpx | {"mxfp4"} <= set(layout.KERNEL_QTYPES)


def test_affine_products_are_exact_in_float32():
    """code * scale is exact for every scale byte, so the kernels' decode of
    rocmfp2_affine gives the same bits whether or not the compiler fuses the
    product and the offset's subtraction into one multiply-add."""
    sc = layout.scale_lut("rocmfp2_affine")
    assert np.isfinite(sc).all()
    for c in range(4):
        p32 = np.float32(c) * sc
        assert np.array_equal(p32.astype(np.float64), float(c) * sc.astype(np.float64))
        for o in sc[::7]:
            fused = (float(c) * sc.astype(np.float64) - np.float64(o)).astype(np.float32)  # one rounding
            assert np.array_equal(fused.view(np.uint32), (p32 - o).view(np.uint32))


def test_no_kernel_layout_for_the_fallback_qtypes():
    for q in ("q8_0", "bf16", "f16", "f32"):
        assert layout.kernel_format(q) is None
        with pytest.raises(Exception, match="no kernel layout"):
            layout.scale_lut(q)


# --------------------------------------------------------------------------
# the kernels, interpreted


@pytest.fixture(scope="module")
def interp():
    return kernels("ds4quant.runtime.kernels.moe_triton")


def _owner(qtype, experts=EXPERTS):
    from ds4quant.runtime.owners.cuda_owner import CudaOwner

    o = CudaOwner("cpu", identity="torch-cpu:9", prec="ieee")
    # whole-matrix row blocks: the interpreter's cost is per program (two column steps for gate/up)
    o.tile = {1: (256, 4, 128), 4: (256, 4, 128), 16: (256, 4, 64)}
    o.gemv_max_slots, o.group_max_mean = 0, 0.0  # rocmfp2/3 too: these kernels, not gemv_triton's
    o.prefill = False  # nor the tensor-core prefill's (tests/runtime/test_prefill_interpret.py)
    stacks, entries = S.layer_stacks(qtype, LAYER, experts)
    for st in stacks.values():
        o.add_stack(st)
    for t, ent in entries.items():
        o.register_books(t, experts, ent)
    return o, stacks


BATCHES = {
    "one slot per expert": np.array([20, 3, 8]),
    "grouped": np.array([7, 3, 7, 20, 7, 3, 8]),  # 1.75 slots an expert: matrix-vector groups
    "busy": np.array([7, 3, 7, 20, 7, 3, 7, 7, 7, 3, 7, 20, 7, 7]),  # 4.7: the tl.dot tile
}
BT = {"one slot per expert": 1, "grouped": 4, "busy": 16}


@pytest.mark.parametrize("qtype", layout.KERNEL_QTYPES)
@pytest.mark.parametrize("batch", list(BATCHES))
def test_kernel_fast_output_matches_float64(interp, qtype, batch):
    ids = BATCHES[batch]
    o, stacks = _owner(qtype)
    x = S.tokens(len(ids), seed=3)
    plan = o.plan(LAYER, ids)
    assert plan is not None and plan.bt == BT[batch]
    assert len(plan.stages) == 1 and plan.stages[0][-1]  # one fused gate+up launch, one down
    y = o.run_slots(LAYER, x, ids, "fast")
    ref = S.moe_ref64(stacks, x, ids)
    assert y.dtype == np.float32 and y.shape == x.shape and np.all(np.isfinite(y))
    S.assert_rows_close(y, ref, ids, 2e-5, f"{qtype}")


def test_kernel_mix_needs_registered_books(interp):
    from ds4quant.errors import UnregisteredTableError
    from ds4quant.runtime.owners.cuda_owner import CudaOwner

    o = CudaOwner("cpu", identity="torch-cpu:9")
    stacks, entries = S.layer_stacks("rocmfp3_mix", LAYER, EXPERTS)
    for st in stacks.values():
        o.add_stack(st)
    x = S.tokens(2, seed=1)
    with pytest.raises(UnregisteredTableError):
        o.run_slots(LAYER, x, np.array([3, 8]), "fast")
    for t, ent in entries.items():
        o.register_books(t, EXPERTS, ent)
    ref = S.moe_ref64(stacks, x, [3, 8])
    y = o.run_slots(LAYER, x, np.array([3, 8]), "fast")
    assert np.abs(y - ref).max() / np.abs(ref).max() < 2e-5


def test_fallback_qtype_runs_decode_then_matmul(interp):
    o, stacks = _owner("q8_0")
    ids = np.array([3, 20])
    assert o.plan(LAYER, ids) is None
    x = S.tokens(2, seed=2)
    ref = S.moe_ref64(stacks, x, ids)
    y = o.run_slots(LAYER, x, ids, "fast")
    assert np.abs(y - ref).max() / np.abs(ref).max() < 1e-5


def test_kernel_compact_stacks_mixed_formats(interp):
    """Two stack combinations in one call (compact per-qtype stacks); in the second, gate and up
    differ in format, so they run as two launches and SwiGLU in torch."""
    from ds4quant.runtime.owners.cuda_owner import CudaOwner

    o = CudaOwner("cpu", identity="torch-cpu:9", prec="ieee")
    a, _ = S.layer_stacks("rocmfp2", LAYER, (3, 7))
    b, eb = S.layer_stacks("rocmfp3_mix", LAYER, (8, 20))
    c, _ = S.layer_stacks("mxfp4", LAYER, (8, 20))
    mine = {"gate": [a["gate"], b["gate"]], "up": [a["up"], c["up"]], "down": [a["down"], b["down"]]}
    for sts in mine.values():
        for st in sts:
            o.add_stack(st)
    for t, ent in eb.items():
        if t != b["up"].tensor:  # b's up stack is not resident (c's mxfp4 up is)
            o.register_books(t, (8, 20), ent)
    ids = np.array([20, 3, 8, 3, 20, 7])
    plan = o.plan(LAYER, ids)
    assert [s[-1] for s in plan.stages] == [True, False]  # dual launch only where gate and up agree
    x = S.tokens(len(ids), seed=8)
    y = o.run_slots(LAYER, x, ids, "fast")
    for r, e in enumerate(ids):
        k = 0 if e in (3, 7) else 1
        st = {p: mine[p][k] for p in mine}
        loc = st["gate"].expert_ids.index(int(e))
        W = {p: S.decoded(s, loc).astype(np.float64) for p, s in st.items()}
        xi = x[r].astype(np.float64)
        gc = np.minimum(W["gate"] @ xi, 10.0)
        ref = W["down"] @ (gc / (1 + np.exp(-gc)) * np.clip(W["up"] @ xi, -10.0, 10.0))
        assert np.abs(y[r] - ref).max() / np.abs(ref).max() < 2e-5, f"slot {r} expert {e}"


@pytest.mark.parametrize("qtype", layout.KERNEL_QTYPES)
@pytest.mark.parametrize("batch", list(BATCHES))
def test_kernel_fast_output_matches_the_torch_owner(interp, qtype, batch):
    """The CUDA owner's kernels on the CPU device against TorchOwner's fast path
    (decode_torch + matmul) on the same stacks: within float32 rounding of each other."""
    from ds4quant.runtime.owners.torch_owner import TorchOwner

    ids = BATCHES[batch]
    o, stacks = _owner(qtype)
    t = TorchOwner("cpu", identity="torch-cpu:8")
    for st in stacks.values():
        t.add_stack(st)
    _, entries = S.layer_stacks(qtype, LAYER, EXPERTS)
    for name, ent in entries.items():
        t.register_books(name, EXPERTS, ent)
    assert o.plan(LAYER, ids) is not None  # the kernels, not the owner's own fallback
    x = S.tokens(len(ids), seed=6)
    y = o.run_slots(LAYER, x, ids, "fast")
    want = t.run_slots(LAYER, x, ids, "fast")
    S.assert_rows_close(y, want.astype(np.float64), ids, 2e-5, f"{qtype} vs TorchOwner")


@pytest.mark.parametrize("qtype", ["rocmfp6", "rocmfp2_affine"])
def test_exact_mode_does_not_read_the_kernel_planes(qtype):
    """Exact mode on these layers is the definition's (decode_torch + torch_exact): the
    CUDA owner's bytes are TorchOwner's, though the stacks now have kernel planes."""
    from ds4quant.runtime.owners.torch_owner import TorchOwner

    ids = np.array([7, 3, 7, 20])
    o, stacks = _owner(qtype)
    assert o.plan(LAYER, ids) is not None and o.gemv_set(LAYER) is None
    t = TorchOwner("cpu", identity="torch-cpu:8")
    for st in stacks.values():
        t.add_stack(st)
    x = S.tokens(len(ids), seed=9)
    got, want = o.run_slots(LAYER, x, ids, "exact"), t.run_slots(LAYER, x, ids, "exact")
    assert got.dtype == want.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
