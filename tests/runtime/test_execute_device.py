"""run_layer with the rows kept on the hidden states' device (``device_rows``):
the same slots and the same combined bytes as the host path, on every owner
split, with slots held elsewhere, -0 and non-finite values; the device
combine against the host combine bit for bit; refusals. Fake owners here
(the expert math is the owners' tests'); tests/runtime/test_device_rows_cuda.py
runs the CUDA owner on a GPU."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4quant.errors import BadInputError  # noqa: E402
from ds4quant.runtime.execute import NONE, combine, combine_on_device, run_layer  # noqa: E402

H = 4


class DeviceFake:
    """Expert e's output on row r is values[e] * (1 + x[r, 0]) in every feature, from tensors
    on ``device`` (run_slots_device) or host arrays (run_slots)."""

    def __init__(self, identity, values, held, device="cpu"):
        self.identity = identity
        self.values = np.asarray(values, np.float32)
        self.held = set(held)
        self.device = torch.device(device)
        self.device_calls = 0

    def _out(self, x, ids):
        assert set(int(e) for e in ids) <= self.held, "an owner got a slot it does not hold"
        v = self.values[np.asarray(ids, np.int64)] * (np.float32(1) + np.asarray(x, np.float32)[:, 0])
        return np.repeat(v.astype(np.float32)[:, None], H, axis=1)

    def run_slots(self, layer, x, expert_ids, mode):
        return self._out(x, expert_ids)

    def run_slots_device(self, layer, x, expert_ids, mode):
        assert isinstance(x, torch.Tensor) and x.device == self.device
        self.device_calls += 1
        return torch.from_numpy(self._out(x.numpy(), expert_ids))


VALUES = [1e20, 1.0, -1e20, 1.0, -0.0, np.inf, 3.5]


def _call(assign, device_rows, idx, w, x, shared=None):
    names = sorted(set(assign) - {NONE})
    owners = {n: DeviceFake(n, VALUES, [e for e, a in enumerate(assign) if a == n]) for n in names}
    res = run_layer(2, x, idx, w, owners, assign, "exact", device_rows=device_rows, shared=shared)
    return res, owners


@pytest.mark.parametrize("n_owners", [1, 2, 3])
def test_device_rows_give_the_host_bytes_on_every_split(n_owners):
    rng = np.random.default_rng(5)
    idx = torch.from_numpy(rng.integers(0, len(VALUES), (9, 4)).astype(np.int64))
    w = torch.from_numpy(rng.uniform(-1, 1, (9, 4)).astype(np.float32))
    w[0, 1] = -0.0
    x = torch.from_numpy(rng.standard_normal((9, H)).astype(np.float32))
    shared = torch.from_numpy(rng.standard_normal((9, H)).astype(np.float32))
    choices = [f"o{i}" for i in range(n_owners)] + [NONE]
    checked = 0
    for assign in itertools.islice(itertools.product(choices, repeat=len(VALUES)), 0, None, 7):
        host, _ = _call(assign, False, idx, w, x, shared)
        dev, owners = _call(assign, True, idx, w, x, shared)
        assert all(o.device_calls == 1 for o in owners.values())
        assert dev.out.numpy().tobytes() == host.out.numpy().tobytes(), assign
        assert dev.slots.numpy().tobytes() == host.slots.numpy().tobytes(), assign
        assert np.array_equal(dev.held, host.held) and dev.missing == host.missing
        checked += 1
    assert checked > 10


def test_the_device_combine_is_the_host_combine_bit_for_bit():
    rng = np.random.default_rng(9)
    T, K = 64, 6
    y = rng.standard_normal((T, K, 32)).astype(np.float32) * np.float32(1e30)
    y[0, 0] = -0.0
    y[1, 2, :3] = (np.inf, -np.inf, np.nan)
    w = rng.uniform(-2, 2, (T, K)).astype(np.float32)
    w[2] = -0.0
    held = rng.random((T, K)) < 0.7
    held[3] = False  # a token with no slot here
    shared = rng.standard_normal((T, 32)).astype(np.float32)
    for h in (None, held):
        for s in (None, torch.from_numpy(shared)):
            a = combine(torch.from_numpy(w), torch.from_numpy(y), held=h, shared=s)
            b = combine_on_device(torch.from_numpy(w), torch.from_numpy(y), held=h, shared=s)
            assert a.numpy().tobytes() == b.numpy().tobytes()


def test_device_rows_are_refused_when_an_owner_runs_elsewhere():
    class HostOnly:
        identity = "cpu:0"

        def run_slots(self, layer, x, expert_ids, mode):
            return np.zeros((len(expert_ids), H), np.float32)

    owners = {"a": DeviceFake("a", VALUES, [0, 1]), "b": HostOnly()}
    idx = torch.tensor([[0, 2]])
    w = torch.ones((1, 2))
    with pytest.raises(BadInputError, match="device rows need every owner"):
        run_layer(0, torch.zeros((1, H)), idx, w, owners, ["a", "a", "b"], "fast", device_rows=True)
    # left to itself on CPU rows the call takes the host path
    res = run_layer(0, torch.zeros((1, H)), idx, w, owners, ["a", "a", "b"], "fast")
    assert owners["a"].device_calls == 0 and res.out.shape == (1, H)
