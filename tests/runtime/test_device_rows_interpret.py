"""``run_slots_device`` (rows already on the owner's device, outputs left there)
through Triton's interpreter on the CPU device: the CUDA owner's exact kernels
give the CPU definition's bytes from device rows, a layer of two owners run
with ``device_rows`` gives the host path's bytes, and rows that are not a
tensor on the owner's device, or that disagree with the ids, are refused.
tests/runtime/test_device_rows_cuda.py compares the two paths on a GPU."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4quant.errors import BadInputError, ShapeError  # noqa: E402

from . import _synth as S  # noqa: E402
from ._interp import kernels  # noqa: E402

LAYER = 2
EXPERTS = (1, 4, 6)


@pytest.fixture(scope="module", autouse=True)
def _interpreted():
    kernels("ds4quant.runtime.kernels.exact_triton")


def _owner(qtype, cls="cuda", experts=EXPERTS, ident="torch-cpu:7"):
    from ds4quant.runtime.owners.cuda_owner import CudaOwner
    from ds4quant.runtime.owners.torch_owner import TorchOwner

    o = CudaOwner("cpu", identity=ident) if cls == "cuda" else TorchOwner("cpu", identity=ident)
    S.hold_layer(o, qtype, LAYER, experts)
    return o


@pytest.mark.parametrize("qtype", ["rocmfp2", "rocmfp4"])
def test_exact_kernels_from_device_rows_give_the_definitions_bytes(qtype):
    o, ref = _owner(qtype), _owner(qtype, "torch", ident="torch-cpu:8")
    ids = np.array([4, 1, 4, 6, 4])
    x = S.tokens(len(ids), seed=3)
    before = dict(o.exact_stats)
    y = o.run_slots_device(LAYER, torch.from_numpy(x), ids, "exact")
    assert isinstance(y, torch.Tensor) and y.device == o.device
    assert o.exact_stats["kernel"] == before["kernel"] + 1  # the kernels ran, not the definition
    assert y.numpy().tobytes() == ref.run_slots(LAYER, x, ids, "exact").tobytes()


def test_a_layer_on_device_rows_gives_the_host_paths_bytes():
    from ds4quant.runtime.execute import run_layer

    owners = {"cuda:0": _owner("rocmfp2", experts=(1, 4)), "cpu:0": _owner("rocmfp2", "torch", experts=(6,),
                                                                             ident="torch-cpu:8")}
    table = ["none"] * 8
    table[1] = table[4] = "cuda:0"
    table[6] = "cpu:0"
    rng = np.random.default_rng(2)
    idx = torch.from_numpy(rng.choice([1, 4, 6, 0], size=(5, 3)).astype(np.int64))
    w = torch.from_numpy(rng.uniform(0, 1, (5, 3)).astype(np.float32))
    hidden = torch.from_numpy(S.tokens(5, seed=4))
    for mode in ("exact", "fast"):
        host = run_layer(LAYER, hidden, idx, w, owners, table, mode, device_rows=False)
        dev = run_layer(LAYER, hidden, idx, w, owners, table, mode, device_rows=True)
        assert dev.out.numpy().tobytes() == host.out.numpy().tobytes(), mode
        assert dev.slots.numpy().tobytes() == host.slots.numpy().tobytes(), mode
        assert dev.missing == host.missing


def test_rows_off_the_device_or_off_count_are_refused():
    o = _owner("rocmfp2")
    ids = np.array([1, 4])
    with pytest.raises(BadInputError, match="the rows are on the host"):
        o.run_slots_device(LAYER, S.tokens(2), ids, "fast")
    with pytest.raises(ShapeError, match="disagree"):
        o.run_slots_device(LAYER, torch.from_numpy(S.tokens(3)), ids, "fast")
    assert o.run_slots_device(LAYER, torch.zeros((0, S.HIDDEN)), np.zeros(0, np.int64), "exact").shape == (0,
                                                                                                     S.HIDDEN)
