"""decode_torch on a CUDA device is bitwise equal to the numpy decode, for every
registered qtype and every golden case. Skips cleanly without CUDA."""

from __future__ import annotations

import numpy as np
import pytest

from ds4quant import formats
from tests.golden import describe_float_mismatch, load_cases

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA (or ROCm) device"),
]

_BOOKS = {
    4: np.array([[-1.0, -0.25, 0.25, 1.0], [-1.0, -0.5, 0.0, 0.5]], np.float32),
    8: np.array([[-1.0, -0.75, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0],
                 [-0.9375, -0.5, -0.25, -0.125, 0.125, 0.25, 0.5, 1.0]], np.float32),
}


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32))


@pytest.mark.parametrize("name", sorted(q for q, t in formats.QTYPES.items()
                                        if formats.get_codec(q).decode_torch is not None))
def test_random_bytes_decode_identically_on_the_gpu(name):
    qt = formats.get_qtype(name)
    cols = 256
    rng = np.random.default_rng(abs(hash(name)) % (2**32))
    data = rng.integers(0, 256, size=(64, qt.row_bytes(cols)), dtype=np.uint8)
    books = _BOOKS[qt.codebook_levels] if qt.is_mix else None
    for mode in ((0, 1) if qt.is_mix else (None,)):
        want = formats.decode(name, data, cols, books, modes=mode)
        got = formats.decode_torch(name, torch.from_numpy(data).cuda(), cols, books, modes=mode)
        assert got.device.type == "cuda" and got.dtype == torch.float32
        got = got.cpu().numpy()
        assert _same(got, want), describe_float_mismatch(got, want)


@pytest.mark.parametrize("case", [c for c in load_cases() if c.kind in ("encode", "decode")
                                  and c.record["expect"] == "ok"], ids=lambda c: c.id)
def test_golden_decode_on_the_gpu(case):
    books = case.books() if case.has("books") else None
    got = formats.decode_torch(case.qtype, torch.from_numpy(case.array("encoded")).cuda(), case.record["k"], books)
    want = case.array("decoded")
    got = got.cpu().numpy()
    assert _same(got, want), describe_float_mismatch(got, want)
