"""The torch FP4 e2m1 decode (any device) gives the numpy decode's bits for every
code and every finite E8M0 scale byte, and every value survives bfloat16 (the
streamed reference keeps a GPU layer's FP4 experts that way)."""

from __future__ import annotations

import numpy as np
import pytest

from ds4quant.errors import ShapeError
from ds4quant.formats.fp8 import dequant_e2m1_blocks, dequant_e2m1_torch

torch = pytest.importorskip("torch")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _every_scale(rows: int = 255, cols: int = 64):
    rng = np.random.default_rng(7)
    codes = rng.integers(0, 256, size=(rows, cols // 2), dtype=np.uint8)
    scales = np.repeat(np.arange(255, dtype=np.uint8)[:rows, None], cols // 32, axis=1)  # bytes 0..254
    return codes, scales


@pytest.mark.parametrize("device", DEVICES)
def test_same_bits_as_the_numpy_decode(device):
    codes, scales = _every_scale()
    want = dequant_e2m1_blocks(codes, scales)
    for c in (torch.from_numpy(codes), torch.from_numpy(codes.view(np.int8))):
        got = dequant_e2m1_torch(c.to(device), torch.from_numpy(scales).to(device))
        assert got.dtype == torch.float32 and got.device.type == device
        assert np.array_equal(got.cpu().numpy().view(np.uint32), want.view(np.uint32))


def test_every_value_is_exact_in_bfloat16():
    codes, scales = _every_scale()
    got = dequant_e2m1_torch(torch.from_numpy(codes), torch.from_numpy(scales))
    back = got.bfloat16().float()
    assert torch.equal(back.view(torch.int32), got.view(torch.int32))
    assert torch.isinf(got).any() and (got == 0).any()  # both range ends were reached


def test_wrong_scale_shape_is_refused():
    codes, scales = _every_scale(8, 64)
    with pytest.raises(ShapeError, match="need scales"):
        dequant_e2m1_torch(torch.from_numpy(codes), torch.from_numpy(scales[:, :1]))
