"""The CUDA owner on device rows (``run_slots_device``) against its host-array
``run_slots`` on a GPU (skipped without CUDA/HIP): the same bytes in fast and
exact mode for the decode step (graph), the grouped matrix-vector kernels and
the tensor-core prefill, and a layer run with the hidden states on the device
gives the CPU-hidden call's bytes, its output left on the device."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or HIP device")]

from . import _synth as S  # noqa: E402
from .test_prefill_exact_cuda import DEV, H, N_EXP, _layer  # noqa: E402

LAYER = 0
EXPERTS = tuple(range(N_EXP))


def _owner(qtype):
    """A CUDA owner holding a DS4-sized layer of random valid bytes (no encoder run)."""
    pytest.importorskip("triton")
    from ds4quant.runtime.owners.cuda_owner import CudaOwner

    o = CudaOwner(DEV)
    S.hold(o, *_layer(qtype, seed=11), EXPERTS)
    return o


def _tokens(n, seed):
    return np.random.default_rng(seed).standard_normal((n, H)).astype(np.float32)


# 1 and 9 slots: the decode step; 60 over 32 experts: grouped; 600: the prefill kernels
SLOTS = (1, 9, 60, 600)


@pytest.mark.parametrize("qtype", ["rocmfp2", "rocmfp4", "rocmfp3_mix"])
@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_device_rows_give_the_host_rows_bytes(qtype, mode):
    o = _owner(qtype)
    for n in SLOTS:
        ids = S.rng_for("ids", n).choice(EXPERTS, size=n).astype(np.int64)
        x = _tokens(n, n)
        host = o.run_slots(LAYER, x, ids, mode)
        dev = o.run_slots_device(LAYER, torch.from_numpy(x).to(DEV), ids, mode)
        assert dev.device.type == "cuda"
        assert dev.cpu().numpy().tobytes() == host.tobytes(), f"{qtype} {mode} {n} slots"
        S.record_gpu(test="device_rows", qtype=qtype, mode=mode, slots=n, sha=S.sha32(host))
    o.close()


def test_back_to_back_decode_steps_each_get_their_own_ids():
    """The graphed decode step copies its ids from a pinned buffer without blocking the host
    (``cuda_device.PinnedIds``): calls issued back to back, no synchronisation between them,
    each give the bytes of the same call on host rows."""
    o = _owner("rocmfp2")
    calls = []
    for k in range(24):
        ids = S.rng_for("steps", k).choice(EXPERTS, size=6).astype(np.int64)
        calls.append((ids, _tokens(6, 100 + k)))
    xs = [torch.from_numpy(x).to(DEV) for _, x in calls]
    outs = [o.run_slots_device(LAYER, x, ids, "fast") for (ids, _), x in zip(calls, xs)]
    for k, ((ids, x), y) in enumerate(zip(calls, outs)):
        assert y.cpu().numpy().tobytes() == o.run_slots(LAYER, x, ids, "fast").tobytes(), f"call {k}"
    o.close()


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_a_layer_on_device_hidden_states_gives_the_cpu_calls_bytes(mode):
    from ds4quant.runtime.execute import run_layer

    o = _owner("rocmfp2")
    table = ["cuda:0"] * len(EXPERTS)
    rng = np.random.default_rng(7)
    for T in (1, 100):
        idx = torch.from_numpy(rng.choice(EXPERTS, size=(T, 6)).astype(np.int64))
        w = torch.from_numpy(rng.uniform(0, 1, (T, 6)).astype(np.float32))
        hidden = torch.from_numpy(_tokens(T, T))
        host = run_layer(LAYER, hidden, idx, w, {"cuda:0": o}, table, mode)
        dev = run_layer(LAYER, hidden.to(DEV), idx.to(DEV), w.to(DEV), {"cuda:0": o}, table, mode)
        assert dev.out.device.type == "cuda" and host.out.device.type == "cpu"
        assert dev.out.cpu().numpy().tobytes() == host.out.numpy().tobytes(), f"{mode} T={T}"
        assert dev.slots.cpu().numpy().tobytes() == host.slots.numpy().tobytes(), f"{mode} T={T}"
    o.close()
