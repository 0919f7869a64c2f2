"""Exact mode on the plane layout (runtime/kernels/exact_planes.py) through
Triton's interpreter on the CPU: for every kernel qtype the word layout does
not cover (MIX 105/106, rocmfp2_s40, rocmfp4, rocmfp4_fast, rocmfp6, rocmfp8,
rocmfp2_affine, mxfp4), a CUDA owner on the CPU device gives the CPU owners'
exact bytes; the integer level tables are checked; pairs outside the float64
bound are flagged and patched with the definition's limbs."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4quant.runtime.kernels import layout  # noqa: E402
from ds4quant.runtime.owners import torch_exact as te  # noqa: E402

from . import _synth as S  # noqa: E402
from ._interp import kernels  # noqa: E402

LAYER = 2
EXPERTS = (1, 4, 9, 13)
PLANE_QTYPES = tuple(q for q in layout.KERNEL_QTYPES if q not in layout.LINEAR_QTYPES)


@pytest.fixture(scope="module")
def xp():
    kernels("ds4quant.runtime.kernels.exact_triton")
    return kernels("ds4quant.runtime.kernels.exact_planes")


def _bits(t):
    return np.ascontiguousarray(t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else t).view(np.uint32)


def _owner(qtype):
    from ds4quant.runtime.owners.cuda_owner import CudaOwner

    o = CudaOwner("cpu", identity="torch-cpu:8")
    o.exact_planes_tile = (128, 128, 4)  # few programs: the interpreter's cost is per program
    stacks, entries = S.layer_stacks(qtype, LAYER, EXPERTS)
    for st in stacks.values():
        o.add_stack(st)
    for t, ent in entries.items():
        o.register_books(t, EXPERTS, ent)
    return o, stacks, entries


def _reference(stacks, entries):
    from ds4quant.runtime.owners.torch_owner import TorchOwner

    ref = TorchOwner("cpu", identity="torch-cpu:9")
    for st in stacks.values():
        ref.add_stack(st)
    for t, ent in entries.items():
        ref.register_books(t, EXPERTS, ent)
    return ref


def test_integer_levels(xp):
    ilut, sh, wide = xp.integer_levels(np.array([[-1, 0, 1, 2], [0.375, -1.25, 0, 0.5]], np.float32), 16)
    assert ilut.tolist() == [[-1, 0, 1, 2], [3, -10, 0, 4]] and sh.tolist() == [0, -3] and not wide
    assert xp.integer_levels(np.array([[1.0, 2.0 ** -14]], np.float32), 16)[2]  # 16 * 2^14 * 127 > 2^24
    assert xp.integer_levels(np.array([[1.0, 2.0 ** -40]], np.float32), 16) is None  # past 2^49
    for q in PLANE_QTYPES:
        if not layout.kernel_format(q).mix:
            lv = layout.level_lut(q)
            ilut, sh, wide = xp.integer_levels(lv, layout.kernel_format(q).group)
            assert not wide, q
            assert np.array_equal(np.ldexp(ilut.astype(np.float64), sh[:, None]), lv.astype(np.float64)), q


@pytest.mark.parametrize("qtype", PLANE_QTYPES)
def test_owner_exact_bytes_are_the_cpu_owners(xp, qtype):
    o, stacks, entries = _owner(qtype)
    assert o.exact_set(LAYER, np.array([1]))[0] == "planes"
    ref = _reference(stacks, entries)
    ids = np.array([4, 13, 4, 1, 9])
    x = S.tokens(len(ids), seed=21)
    y = o.run_slots(LAYER, x, ids, "exact")
    assert o.exact_stats == {"kernel": 1, "patched": 0, "rerun": 0}
    want = ref.run_slots(LAYER, x, ids, "exact")
    assert np.array_equal(_bits(y), _bits(want)), qtype
    # a slot's bytes depend on its own row only
    y2 = o.run_slots(LAYER, x[::-1].copy(), ids[::-1].copy(), "exact")
    assert np.array_equal(_bits(y2[::-1]), _bits(y))
    o.close()
    ref.close()


@pytest.mark.parametrize("qtype", ["rocmfp4", "rocmfp3_mix"])
def test_numba_cpu_owner_agrees(xp, qtype):
    cpu = pytest.importorskip("ds4quant.runtime.owners.cpu")
    o, stacks, entries = _owner(qtype)
    c = cpu.CpuOwner("cpu:7")
    for st in stacks.values():
        c.add_stack(st)
    for t, ent in entries.items():
        c.register_books(t, EXPERTS, ent)
    ids = np.array([9, 1, 13])
    x = S.tokens(len(ids), seed=5)
    assert np.array_equal(_bits(o.run_slots(LAYER, x, ids, "exact")), _bits(c.run_slots(LAYER, x, ids, "exact")))
    c.close()
    o.close()


@pytest.mark.filterwarnings("ignore:All-NaN slice")
def test_flagged_pairs_are_patched_with_the_definitions_limbs(xp):
    o, stacks, entries = _owner("rocmfp8")
    ref = _reference(stacks, entries)
    ids = np.array([1, 9])
    x = S.tokens(2, seed=22)
    x[1, :32] *= 1e30  # block exponents far apart: outside the float64 bound
    x[1, 32:64] *= 1e-30
    y = o.run_slots(LAYER, x, ids, "exact")
    assert o.exact_stats == {"kernel": 0, "patched": 1, "rerun": 0}
    assert np.array_equal(_bits(y), _bits(ref.run_slots(LAYER, x, ids, "exact")))
    o.close()
    ref.close()


def test_products_flag_exactly_the_pairs_outside_the_bound(xp):
    from ds4quant.runtime.kernels import exact_triton as ek

    o, stacks, _ = _owner("rocmfp6")
    pg = o.single_stacks(LAYER)[0]
    o._exact_planes_set(LAYER)
    x = torch.from_numpy(S.tokens(3, seed=7))
    x[2, :32] *= 1e35
    x[2, 64:96] *= 1e-35
    bad = torch.zeros(1, dtype=torch.int32)
    qt, s = ek.quantize(x, bad)
    ids = torch.tensor([4, 4, 4])
    loc = o.single_stacks(LAYER)[3]
    y, fl = xp.product(pg["fmt"], pg, xp.plain(qt), s, ids, loc, bad, flags=True, bn=128, bk=128)
    w = torch.from_numpy(S.decoded(stacks["gate"], EXPERTS.index(4)))
    want = te.exact_linear(w, x)
    assert int(fl[:2].sum()) == 0 and int(fl[2].sum()) > 0 and int(bad[0]) == int(fl.sum())
    m = fl.numpy() == 0
    assert np.array_equal(_bits(y)[m], _bits(want)[m])
    o.close()


def test_a_stack_with_overflowing_weights_keeps_the_definitions_path(xp):
    """mxfp4's top E8M0 bytes times its largest level overflow float32: the definition refuses
    such a weight, so the owner does not take the kernels (which would sum it finitely)."""
    from ds4quant.errors import BadInputError
    from ds4quant.runtime.owners.base import ExpertStack

    stacks, _ = S.layer_stacks("mxfp4", LAYER, EXPERTS)
    g = stacks["gate"]
    data = g.data.copy()
    blk = data.reshape(len(EXPERTS), g.rows, -1, 17)
    blk[1, 0, 0, 0] = 254  # one block of expert 4: scale 2^126 (times level 12: inf)
    blk[1, 0, 0, 1] = 0x77  # codes 7: level 12
    stacks["gate"] = ExpertStack(g.tensor, g.layer, g.proj, g.qtype, g.rows, g.cols, g.expert_ids, data)
    from ds4quant.runtime.owners.cuda_owner import CudaOwner

    o = CudaOwner("cpu", identity="torch-cpu:8")
    for st in stacks.values():
        o.add_stack(st)
    assert o.exact_set(LAYER, np.array([1])) is None
    with pytest.raises(BadInputError, match="non-finite"):
        o.run_slots(LAYER, S.tokens(1), np.array([4]), "exact")
    o.close()
