"""The decode-step kernels (runtime/kernels/gemv_triton.py) and their word
layout, on the CPU: the layout decodes to formats.decode's values (torch
only); the kernels, through Triton's interpreter (skipped without triton),
match a float64 product of the decoded weights for rocmfp2, rocmfp3 and the
rocmfp2-strix mix (rocmfp2 gate/up, rocmfp3 down), any slot order, repeated
experts, and refuse experts that are not resident."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4quant.errors import BadInputError  # noqa: E402
from ds4quant.runtime.kernels import layout  # noqa: E402

from . import _synth as S  # noqa: E402
from ._interp import kernels  # noqa: E402

LAYER = 2
EXPERTS = (1, 4, 9, 13)


@pytest.mark.parametrize("qtype", sorted(layout.LINEAR_QTYPES))
def test_word_layout_decodes_to_the_artifact_values(qtype):
    stacks, _ = S.layer_stacks(qtype, LAYER, EXPERTS)
    for st in stacks.values():
        a, b, s, _ = layout.repack(qtype, torch.from_numpy(np.ascontiguousarray(st.data)), st.cols)
        lp = layout.linear_planes(qtype, a, b, s, torch.from_numpy(layout.scale_lut(qtype)))
        assert lp.a.dtype == torch.int32 and tuple(lp.a.shape) == (st.n_experts, st.rows, st.cols // 16)
        got = layout.linear_reference(lp).numpy()
        for i in range(st.n_experts):
            want = S.decoded(st, i)
            # equal values; rocmfp3's "-0" level becomes +0 (fast mode only reads these planes)
            assert np.array_equal(got[i], want), f"{st.tensor} expert {st.expert_ids[i]}"
            nz = want != 0
            assert np.array_equal(got[i][nz].view(np.uint32), want[nz].view(np.uint32))


def test_no_word_layout_for_level_tables():
    with pytest.raises(Exception, match="no linear word layout"):
        layout.linear_planes("mxfp4", None, None, torch.zeros((1, 1, 1), dtype=torch.uint8), None)


@pytest.fixture(scope="module")
def interp():
    return kernels("ds4quant.runtime.kernels.gemv_triton")


# the interpreter's cost is per program: whole-matrix row blocks keep the tests short; two
# column steps a matrix keep the prefetch path covered
BIG_TILES = {"gu": (128, 8, 1, 1, True, True), "down": (256, 4, 1, 1, True, True)}
# several row blocks a matrix, the path without the prefetch (gate/up), the scale LUT gather (down)
MID_TILES = {"gu": (64, 8, 2, 1, False, True), "down": (64, 4, 2, 1, True, False)}


def _owner(qtypes, big=True):
    from ds4quant.runtime.owners.cuda_owner import CudaOwner

    o = CudaOwner("cpu", identity="torch-cpu:8", prec="ieee")
    o.gemv_tile = dict(BIG_TILES if big else MID_TILES)
    mine = {}
    for proj, q in zip(("gate", "up", "down"), qtypes):
        stacks, _ = S.layer_stacks(q, LAYER, EXPERTS)
        mine[proj] = stacks[proj]
        o.add_stack(stacks[proj])
    return o, mine


@pytest.mark.parametrize("qtypes", [("rocmfp2",) * 3, ("rocmfp3",) * 3, ("rocmfp2", "rocmfp2", "rocmfp3")],
                         ids=["rocmfp2", "rocmfp3", "strix"])
@pytest.mark.parametrize("ids", [[13, 1, 9], [4, 4, 1, 13, 4]], ids=["distinct", "repeated"])
def test_decode_step_kernels_match_float64(interp, qtypes, ids):
    o, stacks = _owner(qtypes, big=not (len(ids) == 3 and qtypes[2] != qtypes[0]))
    assert o.gemv_set(LAYER) is not None
    ids = np.array(ids)
    x = S.tokens(len(ids), seed=len(ids))
    y = o.run_slots(LAYER, x, ids, "fast")
    ref = S.moe_ref64(stacks, x, ids)
    assert y.dtype == np.float32 and y.shape == x.shape and np.all(np.isfinite(y))
    S.assert_rows_close(y, ref, ids, 2e-5, f"{qtypes}")
    # a slot's output depends on its own row only: the reversed batch gives the same rows
    y2 = o.run_slots(LAYER, x[::-1].copy(), ids[::-1].copy(), "fast")
    assert np.array_equal(y2[::-1], y)
    o.close()


def test_decode_step_refuses_experts_it_does_not_hold(interp):
    o, _ = _owner(("rocmfp2",) * 3)
    with pytest.raises(BadInputError, match="not resident"):
        o.run_slots(LAYER, S.tokens(2), np.array([1, 2]), "fast")


def test_two_stacks_per_projection_use_the_grouped_kernels(interp):
    from ds4quant.runtime.owners.cuda_owner import CudaOwner

    o = CudaOwner("cpu", identity="torch-cpu:8", prec="ieee")
    a, _ = S.layer_stacks("rocmfp2", LAYER, (1, 4))
    b, _ = S.layer_stacks("rocmfp3", LAYER, (9, 13), tensor_suffix=".b")
    for st in list(a.values()) + list(b.values()):
        o.add_stack(st)
    assert o.gemv_set(LAYER) is None  # compact per-qtype stacks: the planned path
    ids = np.array([9, 1])
    y = o.run_slots(LAYER, S.tokens(2, seed=9), ids, "fast")
    assert y.shape == (2, S.HIDDEN) and np.all(np.isfinite(y))


# --------------------------------------------------------------------------
# the per-position magic exponent (numpy: the identity the kernels' decode rests on)


@pytest.mark.parametrize("bits", [2, 4])
def test_masked_code_with_a_position_exponent_is_the_code_exactly(bits):
    rng = np.random.default_rng(bits)
    words = rng.integers(0, 1 << 32, 4096, dtype=np.uint64).astype(np.uint32)
    for q in range(0, 24 - bits):
        m = ((1 << bits) - 1) << q
        v = ((words & m) | np.uint32((150 - q) << 23)).view(np.float32)
        got = v - np.float32((1 << (23 - q)) + 1)  # the kernels' subtract: level = code - off
        want = ((words >> q) & ((1 << bits) - 1)).astype(np.float32) - 1
        assert np.array_equal(got, want), q


@pytest.mark.parametrize("qtype", sorted(layout.LINEAR_QTYPES))
def test_computed_scales_are_the_scale_tables_bits(interp, qtype):
    gk = interp
    lut = layout.scale_lut(qtype)
    sdec = gk.scale_decode(lut)
    assert sdec != 0 and np.array_equal(gk.scale_values(sdec).view(np.uint32), lut.view(np.uint32))
    assert gk.scale_decode(lut[::-1].copy()) == 0  # any other table: the gather


# --------------------------------------------------------------------------
# the grouped form (batches whose experts see few tokens each)

GROUPED_IDS = np.array([4, 13, 4, 1, 4, 9, 4, 1, 4])  # expert 4: 5 tokens, 1: 2, 9 and 13: 1


# (tb 1, the decode step's grouping, runs on the GPU: tests/runtime/test_gemv_cuda.py)
@pytest.mark.parametrize("qtypes,tb", [(("rocmfp2",) * 3, 2), (("rocmfp2", "rocmfp2", "rocmfp3"), 4)],
                         ids=["rocmfp2-2", "strix-4"])
def test_grouped_kernels_match_float64_and_the_decode_step_bits(interp, qtypes, tb):
    o, stacks = _owner(qtypes)
    o.gemv_max_slots = 0  # every batch takes the grouped form
    o.group_tb = tb
    o.group_tile = dict(o.gemv_tile)
    ids = GROUPED_IDS
    x = S.tokens(len(ids), seed=11)
    order, groups = o.grouped_plan(LAYER, ids)
    assert np.array_equal(ids[order], np.sort(ids)) and groups[:, 2].max() <= tb
    assert groups[:, 2].sum() == len(ids) and len(groups) == sum(-(-c // tb) for c in (2, 5, 1, 1))
    y = o.run_slots(LAYER, x, ids, "fast")
    ref = S.moe_ref64(stacks, x, ids)
    S.assert_rows_close(y, ref, ids, 2e-5, f"{qtypes} tb {tb}")
    # a token's arithmetic is the decode step's: the same bits, whatever the grouping
    o.gemv_max_slots = 16
    some = [0, 1, 3, 5]
    assert np.array_equal(o.run_slots(LAYER, x[some], ids[some], "fast"), y[some])
    o.close()


def test_busy_experts_take_the_tl_dot_kernels(interp):
    o, _ = _owner(("rocmfp2",) * 3)
    ids = np.repeat(np.array([1, 4]), 12)  # 12 tokens an expert > group_max_mean
    assert o.grouped_plan(LAYER, ids) is None
    assert o.grouped_plan(LAYER, ids[:8]) is not None
    assert o.grouped_plan(LAYER, np.array([1, 2])) is None  # expert 2 is not resident here
    o.close()
