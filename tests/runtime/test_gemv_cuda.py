"""gemv_triton's kernels on a real device (skipped without CUDA/HIP): the
decode step and the grouped form against a float64 product of the decoded
weights, at the synthetic test shapes and at DS4's (4096 x 2048, random
valid bytes, the owner's default tiles: several column steps, so the
prefetch path runs), and a token's bits equal between the two forms."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or HIP device")]

from . import _synth as S  # noqa: E402

LAYER = 3
EXPERTS = (2, 5, 11, 17)
IDS = np.array([5, 17, 5, 2, 5, 11, 5, 2, 5])  # expert 5: 5 tokens


def _f64(stacks, x, ids, limit=10.0):
    out = np.empty((len(ids), x.shape[1]))
    for r, e in enumerate(ids):
        i = stacks["gate"].expert_ids.index(int(e))
        W = {p: S.decoded(st, i).astype(np.float64) for p, st in stacks.items()}
        gc = np.minimum(W["gate"] @ x[r].astype(np.float64), limit)
        out[r] = W["down"] @ (gc / (1 + np.exp(-gc)) * np.clip(W["up"] @ x[r].astype(np.float64), -limit, limit))
    return out


@pytest.mark.parametrize("qtypes", [("rocmfp2",) * 3, ("rocmfp3",) * 3, ("rocmfp2", "rocmfp2", "rocmfp3")],
                         ids=["rocmfp2", "rocmfp3", "strix"])
def test_decode_step_and_grouped_kernels_on_the_device(qtypes):
    pytest.importorskip("triton")
    from ds4quant.runtime.owners.cuda_owner import CudaOwner

    o = CudaOwner("cuda:0")
    stacks = {}
    for proj, q in zip(("gate", "up", "down"), qtypes):
        stacks[proj] = S.layer_stacks(q, LAYER, EXPERTS)[0][proj]
        o.add_stack(stacks[proj])
    x = S.tokens(len(IDS), seed=21)
    ref = _f64(stacks, x, IDS)
    step = o.run_slots(LAYER, x, IDS, "fast")  # 9 slots: the decode step, graph
    o.gemv_max_slots = 0
    o.group_tile = dict(o.gemv_tile)
    for tb in (1, 2, 4):
        o.group_tb = tb
        got = o.run_slots(LAYER, x, IDS, "fast")
        assert np.array_equal(got, step), f"tb {tb}: the grouped form changed a token's bits"
    for r in range(len(IDS)):
        err = np.abs(step[r] - ref[r]).max() / np.abs(ref[r]).max()
        assert err < 2e-5, f"{qtypes} slot {r}: {err}"
    o.close()


def test_kernels_at_ds4_shape_match_float64():
    pytest.importorskip("triton")
    from ds4quant.runtime.kernels import gemv_triton as gk
    from ds4quant.runtime.kernels import layout
    from ds4quant.runtime.owners.base import ExpertStack
    from ds4quant.runtime.owners.cuda_owner import CudaOwner, group_t

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import runtime_gpu as base  # the benchmarks' random valid bytes

    H, I, n_exp = 4096, 2048, 4
    gen = torch.Generator(device="cuda").manual_seed(5)
    o = CudaOwner("cuda:0")
    for p, q, r, c in (("gate", "rocmfp2", I, H), ("up", "rocmfp2", I, H), ("down", "rocmfp3", H, I)):
        o.add_stack(ExpertStack(f"blk.0.ffn_{p}_exps.weight", 0, p, q, r, c, tuple(range(n_exp)),
                                base._random_stack(torch, q, n_exp, r, c, gen, torch.device("cuda"))))
    lg, lu, ld, loc, loc_h = o.gemv_set(0)
    ids = np.array([3, 0, 3, 1, 3, 3, 2])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((len(ids), H)).astype(np.float32)
    W = {k: layout.linear_reference(lp).double() for k, lp in (("g", lg), ("u", lu), ("d", ld))}
    e = torch.from_numpy(ids).cuda()
    x64 = torch.from_numpy(x).cuda().double()
    gc = torch.clamp(torch.einsum("sik,sk->si", W["g"][e], x64), max=o.swiglu_limit)
    uc = torch.clamp(torch.einsum("sik,sk->si", W["u"][e], x64), -o.swiglu_limit, o.swiglu_limit)
    ref = torch.einsum("shi,si->sh", W["d"][e], gc / (1 + torch.exp(-gc)) * uc).cpu().numpy()
    W = None
    y = o.gemv_device(0, torch.from_numpy(group_t(x)).cuda(), e).cpu().numpy()
    for tb in (2, 4):
        order, groups = gk.groups_for(ids, loc_h, tb)
        o.group_tb = tb
        ys = o.grouped_device(0, torch.from_numpy(group_t(x[order])).cuda(), torch.from_numpy(groups).cuda())
        yg = np.empty_like(y)
        yg[order] = ys.cpu().numpy()
        rel = np.linalg.norm(yg - ref) / np.linalg.norm(ref)
        assert rel < 1e-5, f"grouped tb {tb}: {rel}"
    rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert rel < 1e-5, rel
    for r in range(len(ids)):
        assert np.abs(y[r] - ref[r]).max() / np.abs(ref[r]).max() < 1e-4, r
    o.close()
