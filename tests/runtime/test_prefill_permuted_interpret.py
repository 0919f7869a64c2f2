"""The permuted-activation prefill (kernels/prefill_permuted.py) through
Triton's interpreter on the CPU: per kernel qtype, with uneven expert loads
(an expert with no slot, one with all of them) and a mixed-format layer
(rocmfp2 gate/up, rocmfp3 down), the CUDA owner's result against the float64
reference of the bf16-rounded activations, and against the reshaped-tile
prefill (the same exact products; only the float32 summation order differs);
the column permutation itself, exactly."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4quant.runtime.kernels import layout  # noqa: E402

from . import _synth as S  # noqa: E402
from ._interp import kernels  # noqa: E402
from .test_prefill_interpret import ALL_IN_ONE, EXPERTS, LAYER, LOADS, _ref_bf16  # noqa: E402


@pytest.fixture(scope="module")
def pp():
    kernels("ds4quant.runtime.kernels.prefill_triton")
    return kernels("ds4quant.runtime.kernels.prefill_permuted")


def _owner(qtypes, kernel):
    from ds4quant.runtime.owners.cuda_owner import CudaOwner

    o = CudaOwner("cpu", identity="torch-cpu:9")
    o.gemv_max_slots, o.group_max_mean = 0, 0.0  # straight to the prefill kernels
    o.prefill_kernel = kernel
    # whole-matrix blocks: the interpreter's cost is per program
    o.prefill_tile = {"gu": (256, 64, 4, 1), "down": (256, 64, 4, 1)}
    o.prefill_tile_linear = o.prefill_tile
    # gate + up with the loads a step ahead, down without, so both forms run
    o.prefill_tile_permuted = {"gu": (256, 16, 4, 1, True, True), "down": (256, 32, 4, 1, False, False)}
    stacks = {}
    for proj, q in zip(("gate", "up", "down"), qtypes):
        st, entries = S.layer_stacks(q, LAYER, EXPERTS)
        stacks[proj] = st[proj]
        o.add_stack(st[proj])
        for t, ent in entries.items():
            if t == st[proj].tensor:
                o.register_books(t, EXPERTS, ent)
    return o, stacks


CASES = [(q,) * 3 for q in layout.KERNEL_QTYPES] + [("rocmfp2", "rocmfp2", "rocmfp3"),
                                                     ("rocmfp2", "rocmfp4", "rocmfp3_mix")]


@pytest.mark.parametrize("qtypes", CASES, ids=["-".join(dict.fromkeys(c)) for c in CASES])
def test_permuted_prefill_matches_float64_and_the_tile_kernel(pp, qtypes):
    for name, ids in LOADS.items():
        if name == "one expert" and qtypes[0] not in ALL_IN_ONE:
            continue
        o, stacks = _owner(qtypes, "permuted")
        ref_o, _ = _owner(qtypes, "tiles")
        x = S.tokens(len(ids), seed=13)
        assert o.prefill_set(LAYER) is not None
        y = o.run_slots(LAYER, x, ids, "fast")
        assert y.dtype == np.float32 and y.shape == x.shape and np.all(np.isfinite(y))
        what = f"{'-'.join(qtypes)} {name}"
        S.assert_rows_close(y, _ref_bf16(stacks, x, ids), ids, 1e-2, what)
        # the same exact bf16 products as the tile kernel: float32 summation order only
        S.assert_rows_close(y, ref_o.run_slots(LAYER, x, ids, "fast").astype(np.float64), ids, 1e-3, what)


def test_column_permutation(pp):
    x = torch.arange(2 * 32, dtype=torch.float32).view(2, 32)
    for cpb in (1, 2, 4):
        got = pp.permute_columns(x, cpb).to(torch.float32)
        K = 32
        for p in range(cpb):
            for j in range(K // cpb):
                assert torch.equal(got[:, p * (K // cpb) + j], x[:, j * cpb + p])
