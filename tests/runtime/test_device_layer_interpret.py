"""The whole MoE layer on the owner's device (runtime/device_layer.py) through
Triton's interpreter on the CPU device: routing (top-k and a hash layer), the
routed experts (decode-step and prefill kernels), the canonical combine and the
shared expert give the bytes of the home process's pieces (``route.route``,
``CudaOwner.run_slots``, ``execute.combine``, the fast shared expert)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4quant.errors import BadInputError  # noqa: E402

from . import _synth as S  # noqa: E402
from ._interp import kernels  # noqa: E402

LAYER = 1
E, K = 8, 3


@pytest.fixture(scope="module")
def interp():
    kernels("ds4quant.runtime.kernels.gemv_triton")
    return kernels("ds4quant.runtime.kernels.prefill_triton")


def _owner(qtype, experts=tuple(range(E))):
    from ds4quant.runtime.owners.cuda_owner import CudaOwner

    o = CudaOwner("cpu", identity="torch-cpu:9")
    o.prefill_tile = {"gu": (128, 64, 4, 1, False), "down": (256, 64, 4, 1, False)}
    o.prefill_tile_linear = o.prefill_tile
    big = {"gu": (S.FFN, 8, 1, 1, True, True), "down": (S.HIDDEN, 4, 1, 1, True, True)}
    o.gemv_tile, o.group_tile = dict(big), dict(big)
    S.hold_layer(o, qtype, LAYER, experts)
    return o


def _params(seed=0):
    r = np.random.default_rng(seed)
    gate = torch.from_numpy((r.standard_normal((E, S.HIDDEN)) * 0.1).astype(np.float32))
    bias = torch.from_numpy((r.standard_normal(E) * 0.01).astype(np.float32))
    shared = tuple(torch.from_numpy((r.standard_normal(s) * 0.05).astype(np.float32))
                   for s in ((S.FFN, S.HIDDEN), (S.FFN, S.HIDDEN), (S.HIDDEN, S.FFN)))
    tid = torch.from_numpy(np.stack([r.permutation(E)[:K] for _ in range(50)]).astype(np.int64))
    return gate, bias, shared, tid


def _reference(o, hidden, token_ids, gate, bias, tid, shared):
    from ds4quant.runtime.execute import combine
    from ds4quant.runtime.route import route
    from ds4quant.runtime.swiglu import swiglu_fast

    idx, w = route(hidden, token_ids, gate, bias, tid, K, 1.5)
    T = hidden.shape[0]
    x = hidden.repeat_interleave(K, dim=0).numpy()
    y = o.run_slots(LAYER, x, idx.reshape(-1).numpy(), "fast").reshape(T, K, -1)
    sh = swiglu_fast(hidden @ shared[0].T, hidden @ shared[1].T, 10.0) @ shared[2].T
    return combine(w, torch.from_numpy(y), shared=sh)


@pytest.mark.parametrize("qtype,tokens,hashed", [("rocmfp2", 2, False), ("rocmfp2", 3, True),
                                                 ("rocmfp4", 12, False)],
                         ids=["decode-step", "hash-layer", "prefill"])
def test_device_layer_gives_the_home_pieces_bytes(interp, qtype, tokens, hashed):
    from ds4quant.runtime.device_layer import DeviceLayer

    o = _owner(qtype)
    if qtype == "rocmfp4":
        o.group_max_mean = 0.0  # run_slots takes the prefill kernels as the device layer does
    gate, bias, shared, tid = _params()
    dl = DeviceLayer(o, LAYER, gate, bias, tid if hashed else None, top_k=K, routed_scale=1.5, shared=shared)
    hidden = torch.from_numpy(S.tokens(tokens, seed=4))
    token_ids = torch.tensor([7, 3, 49, 0][:tokens], dtype=torch.int64)
    got = dl(hidden, token_ids)
    want = _reference(o, hidden, token_ids, gate, None if hashed else bias, tid if hashed else None, shared)
    assert np.array_equal(got.numpy().view(np.uint32), want.numpy().view(np.uint32))
    o.close()


def test_device_layer_needs_every_expert_and_a_sane_table(interp):
    from ds4quant.runtime.device_layer import DeviceLayer

    gate, bias, shared, tid = _params()
    o = _owner("rocmfp2", experts=(0, 1, 2, 3))
    with pytest.raises(BadInputError, match="needs all 8 experts"):
        DeviceLayer(o, LAYER, gate, bias, top_k=K)
    o.close()
    o = _owner("rocmfp2")
    with pytest.raises(BadInputError, match="outside"):
        DeviceLayer(o, LAYER, gate, None, tid + E, top_k=K)
    o.close()
