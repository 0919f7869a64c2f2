"""Exact mode's grouped kernels (runtime/kernels/exact_grouped.py: prefill-sized
calls, one weight tile read for all of an expert's slots) through Triton's
interpreter on the CPU: for every kernel qtype, a CUDA owner on the CPU device
routed to them gives the CPU owners' exact bytes, with uneven expert loads (an
expert with no slot, one with all of them); pairs outside the float64 bound are
flagged and patched; level tables the kernel cannot take keep the per-slot
kernels."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4quant.runtime.kernels import layout  # noqa: E402

from . import _synth as S  # noqa: E402
from ._interp import kernels  # noqa: E402

LAYER = 3
EXPERTS = (2, 5, 6, 11)
LOADS = {
    "uneven": np.array([5, 2, 5, 11, 5, 2, 5, 5, 11, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 2]),  # expert 6: no slot
    "one expert": np.array([11] * 18),
}
ALL_IN_ONE = ("rocmfp2", "rocmfp8", "rocmfp2_affine", "rocmfp3_mix", "mxfp4")


@pytest.fixture(scope="module")
def xg():
    kernels("ds4quant.runtime.kernels.exact_triton")
    kernels("ds4quant.runtime.kernels.prefill_triton")
    return kernels("ds4quant.runtime.kernels.exact_grouped")


def _bits(t):
    return np.ascontiguousarray(t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else t).view(np.uint32)


def _owners(qtype, books=None):
    """A CUDA owner on the CPU device routed to the grouped kernels and a TorchOwner, on the
    same stacks (``books``: one level table for every MIX expert and book, mode 1)."""
    from dataclasses import replace

    from ds4quant.runtime.owners.cuda_owner import CudaOwner
    from ds4quant.runtime.owners.torch_owner import TorchOwner

    o = CudaOwner("cpu", identity="torch-cpu:8")
    o.exact_grouped_mean = 1  # every call to the grouped kernels
    o.exact_grouped_tile = (128, 4, 1)  # few programs: the interpreter's cost is per program
    ref = TorchOwner("cpu", identity="torch-cpu:9")
    stacks, entries = S.layer_stacks(qtype, LAYER, EXPERTS)
    if books is not None:
        entries = {t: replace(e, modes=np.ones_like(e.modes), books=np.broadcast_to(books, e.books.shape).copy())
                   for t, e in entries.items()}
    for owner in (o, ref):
        for st in stacks.values():
            owner.add_stack(st)
        for t, ent in entries.items():
            owner.register_books(t, EXPERTS, ent)
    return o, ref, stacks


@pytest.mark.parametrize("qtype", layout.KERNEL_QTYPES)
def test_grouped_exact_bytes_are_the_cpu_owners(xg, qtype):
    o, ref, _ = _owners(qtype)
    for name, ids in LOADS.items():
        if name == "one expert" and qtype not in ALL_IN_ONE:
            continue
        got = o.exact_set(LAYER, ids)
        assert got is not None and got[0] == "grouped", (qtype, name)
        x = S.tokens(len(ids), seed=31)
        before = dict(o.exact_stats)
        y = o.run_slots(LAYER, x, ids, "exact")
        assert o.exact_stats["kernel"] == before["kernel"] + 1, (qtype, name)
        assert np.array_equal(_bits(y), _bits(ref.run_slots(LAYER, x, ids, "exact"))), (qtype, name)
    o.close()
    ref.close()


def test_slot_order_does_not_change_a_slots_bytes(xg):
    o, _, _ = _owners("rocmfp4")
    ids = LOADS["uneven"]
    x = S.tokens(len(ids), seed=32)
    y = o.run_slots(LAYER, x, ids, "exact")
    perm = np.random.default_rng(3).permutation(len(ids))
    y2 = o.run_slots(LAYER, x[perm], ids[perm], "exact")
    assert np.array_equal(_bits(y2), _bits(y[perm]))
    o.close()


def test_the_grouped_kernels_give_the_per_slot_kernels_bytes(xg):
    """The same call through exact_grouped and through exact_planes (a mean below the threshold)."""
    o, _, _ = _owners("rocmfp6")
    ids = LOADS["uneven"]
    x = S.tokens(len(ids), seed=33)
    y = o.run_slots(LAYER, x, ids, "exact")
    o.exact_grouped_mean = 10 ** 6
    o.exact_planes_tile = (128, 128, 4)
    assert o.exact_set(LAYER, ids)[0] == "planes"
    assert np.array_equal(_bits(o.run_slots(LAYER, x, ids, "exact")), _bits(y))
    o.close()


@pytest.mark.filterwarnings("ignore:All-NaN slice")
def test_flagged_pairs_are_patched_with_the_definitions_limbs(xg):
    o, ref, _ = _owners("rocmfp8")
    ids = np.array([2, 11, 2, 2])
    x = S.tokens(len(ids), seed=34)
    x[1, :32] *= 1e30  # block exponents far apart: outside the float64 bound
    x[1, 32:64] *= 1e-30
    y = o.run_slots(LAYER, x, ids, "exact")
    assert o.exact_stats == {"kernel": 0, "patched": 1, "rerun": 0}
    assert np.array_equal(_bits(y), _bits(ref.run_slots(LAYER, x, ids, "exact")))
    o.close()
    ref.close()


def test_products_flag_exactly_the_pairs_outside_the_bound(xg):
    from ds4quant.runtime.kernels import exact_planes as xp
    from ds4quant.runtime.kernels import exact_triton as ek
    from ds4quant.runtime.kernels import prefill_triton as pk
    from ds4quant.runtime.owners import torch_exact as te

    o, _, stacks = _owners("rocmfp6")
    ps = o._exact_planes_set(LAYER)
    assert o._grouped_levels(ps)
    pg, _, _, loc, _, E = ps
    x = torch.from_numpy(S.tokens(3, seed=7))
    x[2, :32] *= 1e35
    x[2, 64:96] *= 1e-35
    bad = torch.zeros(1, dtype=torch.int32)
    qt, s = ek.quantize(x, bad)
    ids = torch.tensor([5, 5, 5])
    plan = pk.sort_slots(ids, loc, E, 3)
    y, fl = xg.product(pg["fmt"], pg, xp.plain(qt), s, plan, bad, flags=True, native=False, bn=128)
    want = te.exact_linear(torch.from_numpy(S.decoded(stacks["gate"], EXPERTS.index(5))), x)
    assert int(fl[:2].sum()) == 0 and int(fl[2].sum()) > 0 and int(bad[0]) == int(fl.sum())
    m = fl.numpy() == 0
    assert np.array_equal(_bits(y)[m], _bits(want)[m])
    # without flags the separable bound decides: never tighter than the per-pair range, and
    # the ordinary slots pass it with the same bytes
    bad2 = torch.zeros(1, dtype=torch.int32)
    y2 = xg.product(pg["fmt"], pg, xp.plain(qt), s, plan, bad2, native=False, bn=128)
    assert int(bad2[0]) >= int(bad[0])
    assert np.array_equal(_bits(y2)[:2], _bits(want)[:2])
    bad3 = torch.zeros(1, dtype=torch.int32)
    xg.product(pg["fmt"], pg, xp.plain(qt[:2]), s[:2], pk.sort_slots(ids[:2], loc, E, 2), bad3, native=False, bn=128)
    assert int(bad3[0]) == 0
    o.close()


def test_level_slices(xg):
    assert xg.part_bits(16) == 13 and xg.part_bits(32) == 12  # G * (2^m - 1) * 127 < 2^24
    parts, m = xg.level_parts(np.array([[-1, 0, 1, 2]], np.float32), 16)
    assert parts.shape == (1, 1, 4) and parts[0].tolist() == [[-1, 0, 1, 2]] and m == 13
    lv = np.array([[-3 << 20, -5, 0, 7 << 12, 1 << 30, 96, -1, 3]], np.float32)
    parts, m = xg.level_parts(lv, 16)
    assert parts.shape[0] == 3
    assert np.array_equal(sum(parts[j].astype(np.float64) * 2.0 ** (m * j) for j in range(3)), lv)
    assert np.abs(parts).max() < 2 ** 13
    assert xg.level_parts(np.array([[257, 1]], np.float32), 16) is None  # 9 significant bits: no bf16
    assert xg.level_parts(np.array([[1 << 40, 1]], np.float32), 16) is None  # four slices


def test_group_sum_bits_are_per_table(xg):
    """The separable bound's T: per level table, so a book of small levels (large integers)
    does not widen its partner's bound; slices add their 2^(j m); affine adds sum(q)'s bits."""
    parts, m = xg.level_parts(np.array([[-1, 0, 1, 2], [3 << 14, -5, 0, 96]], np.float32), 16)
    assert parts.shape[0] == 2
    top = xg.parts_top(parts, 16)
    assert top.tolist() == [(16 * 2 * 127).bit_length(), (16 * 6 * 127).bit_length() + 13]  # 3 << 14 = 6 * 2^13
    assert xg.parts_top(parts[:1, :1], 16, affine=True).tolist() == [(16 * 127 * 2).bit_length()]
    assert xg.parts_top(np.zeros((1, 1, 4), np.float32), 32, affine=True).tolist() == [(32 * 127).bit_length()]


@pytest.mark.filterwarnings("ignore:All-NaN slice")
def test_wide_mix_books_take_two_slices(xg):
    """Books whose levels span 2^-14 .. 1.5: float64 group sums for exact_planes, two bf16
    slices here; the definition's bytes either way."""
    wide = np.array([-1.0, -0.25, -2.0 ** -9, 0.0, 2.0 ** -14, 0.125, 0.5, 1.5], np.float32)
    o, ref, _ = _owners("rocmfp3_mix", books=np.stack([wide, wide * 0.5]))
    ids = LOADS["uneven"]
    assert o.exact_set(LAYER, ids)[0] == "grouped"
    ps = o._exact_planes_set(LAYER)
    assert ps[0]["wide"] and ps[0]["gparts"].shape[0] == 2
    x = S.tokens(len(ids), seed=35)
    y = o.run_slots(LAYER, x, ids, "exact")
    assert o.exact_stats == {"kernel": 1, "patched": 0, "rerun": 0}  # the per-table bound holds
    assert np.array_equal(_bits(y), _bits(ref.run_slots(LAYER, x, ids, "exact")))
    o.close()
    ref.close()


def test_tables_the_kernel_cannot_take(xg):
    o, _, _ = _owners("rocmfp4")
    ps = o._exact_planes_set(LAYER)
    ps[0]["ilut"] = ps[0]["ilut"] * 257  # a table of integers no bf16 holds
    ps[0]["gparts_key"] = -1
    assert o.exact_set(LAYER, np.array([5] * 8))[0] == "planes"
    assert o.exact_set(LAYER, np.array([5] * (o.exact_max_slots + 1))) is None  # the definition's path
    o.close()
