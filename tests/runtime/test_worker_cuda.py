"""The worker-process owner hosting a CUDA runtime (a CudaOwner in a child
process, activations and outputs through the shared host arenas): its bytes
equal the in-process CudaOwner's (exact and fast) and a mixed placement's
MoE bytes equal the single-process placement's, overlap on and off. The
GPU tests skip without CUDA/HIP."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4quant.runtime.execute import run_layer  # noqa: E402
from ds4quant.runtime.owners.kinds import OwnerKind, owner_factory  # noqa: E402
from ds4quant.runtime.owners.worker import WorkerOwner, hosted_name  # noqa: E402

from . import _synth as S  # noqa: E402
from ._synth import sha32  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
LAYER = 1
EXPERTS = (0, 1, 2, 3, 4, 5)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or HIP device")


def test_cuda_is_a_hostable_owner():
    from ds4quant.runtime.owners import cuda_owner

    assert hosted_name("cuda:0").kind is OwnerKind.CUDA and hosted_name("hip:1").kind is OwnerKind.HIP
    assert owner_factory(OwnerKind.CUDA) is owner_factory(OwnerKind.HIP) is cuda_owner.owner_for


def _fill(owner, qtypes, ids):
    for proj, q in zip(("gate", "up", "down"), qtypes):
        stacks, entries = S.layer_stacks(q, LAYER, ids)
        owner.add_stack(stacks[proj])
        if stacks[proj].tensor in entries:
            owner.register_books(stacks[proj].tensor, ids, entries[stacks[proj].tensor])
    return owner


QTYPES = [("rocmfp2", "rocmfp2", "rocmfp3"), ("rocmfp3_mix",) * 3, ("mxfp4",) * 3]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("qtypes", QTYPES, ids=["strix", "rocmfp3_mix", "mxfp4"])
def test_worker_hosted_cuda_owner_gives_in_process_bytes(qtypes):
    pytest.importorskip("triton")
    from ds4quant.runtime.owners.cuda_owner import CudaOwner

    local = _fill(CudaOwner("cuda:0", identity="cuda:0"), qtypes, EXPERTS)
    w = WorkerOwner("worker:1", owner="cuda:0", env=ENV, timeout_s=120.0)
    try:
        _fill(w, qtypes, EXPERTS)
        assert w.inner_identity == "worker:1/cuda:0" and w.pid != os.getpid()
        assert w.experts(LAYER) == EXPERTS
        for mode in ("exact", "fast"):
            for ids in ([5, 0, 3], [2, 2, 4, 1, 0, 5, 3, 3]):
                ids = np.array(ids)
                x = S.tokens(len(ids), seed=len(ids))
                a, b = local.run_slots(LAYER, x, ids, mode), w.run_slots(LAYER, x, ids, mode)
                assert a.tobytes() == b.tobytes(), f"{qtypes} {mode} {ids}"
    finally:
        w.close()
        local.close()


@gpu
@pytest.mark.gpu
def test_mixed_placement_with_a_cuda_worker_equals_one_process():
    pytest.importorskip("triton")
    from ds4quant.runtime.owners.cuda_owner import CudaOwner
    from ds4quant.runtime.owners.torch_owner import TorchOwner

    q = ("rocmfp2", "rocmfp2", "rocmfp3")
    x = torch.from_numpy(S.tokens(4, seed=21))
    idx = torch.tensor([[0, 3, 5], [1, 2, 4], [5, 4, 0], [2, 1, 3]])
    wts = torch.tensor([[0.5, 0.3, 0.2], [0.25, 0.25, 0.5], [0.1, 0.6, 0.3], [0.4, 0.4, 0.2]])
    one = {"cuda:0": _fill(CudaOwner("cuda:0", identity="cuda:0"), q, EXPERTS)}
    ref = run_layer(LAYER, x, idx, wts, one, ["cuda:0"] * 6, "exact")
    # the torch-cpu owner (the second exact implementation; no numba compile on the lent GPU's clock)
    cpu = {"cpu:0": _fill(TorchOwner("cpu", identity="torch-cpu:0", torch_decode=True), q, EXPERTS)}
    ref_cpu = run_layer(LAYER, x, idx, wts, cpu, ["cpu:0"] * 6, "exact")
    assert sha32(ref.out.numpy()) == sha32(ref_cpu.out.numpy())
    w = WorkerOwner("worker:1", owner="cuda:0", env=ENV, timeout_s=120.0)
    hot = CudaOwner("cuda:0", identity="cuda:0")
    try:
        _fill(w, q, (0, 2, 4))
        _fill(hot, q, (1, 3, 5))
        owners = {"worker:1": w, "cuda:0": hot}
        table = ["worker:1" if e % 2 == 0 else "cuda:0" for e in EXPERTS]
        with ThreadPoolExecutor(2) as pool:
            for overlap in (False, True):
                got = run_layer(LAYER, x, idx, wts, owners, table, "exact", pool, home="cuda:0", overlap=overlap)
                assert sha32(got.out.numpy()) == sha32(ref.out.numpy()), f"overlap={overlap}"
            fast = [run_layer(LAYER, x, idx, wts, owners, table, "fast", pool, home="cuda:0", overlap=o).out
                    for o in (False, True)]
        assert sha32(fast[0].numpy()) == sha32(fast[1].numpy())
        fast_one = run_layer(LAYER, x, idx, wts, one, ["cuda:0"] * 6, "fast").out
        assert sha32(fast_one.numpy()) == sha32(fast[0].numpy())  # fast slots depend on their own row only
    finally:
        w.close()
        hot.close()
        one["cuda:0"].close()
        cpu["cpu:0"].close()
