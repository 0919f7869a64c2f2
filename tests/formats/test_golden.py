"""Every golden vector of the reference codec: bytes and float bits exactly."""

from __future__ import annotations

import numpy as np
import pytest

from ds4quant import formats
from ds4quant.errors import Ds4quantError
from tests.golden import describe_float_mismatch, describe_mismatch, load_cases

CASES = [c for c in load_cases() if c.kind in ("encode", "decode")]


def _books(case):
    return case.books() if case.has("books") else None


def _encode(case, impl):
    x = case.array("input")
    imp = case.array("imatrix") if case.has("imatrix") else None
    # The vectors include NaN/Inf inputs; reproduce the reference behaviour.
    return formats.encode(case.qtype, x, imp, _books(case), impl=impl, nonfinite="reference")


@pytest.mark.parametrize("impl", ["ref", "fast"])
@pytest.mark.parametrize("case", [c for c in CASES if c.kind == "encode"], ids=lambda c: c.id)
def test_encode_matches_reference(case, impl):
    qt = formats.get_qtype(case.qtype)
    if impl == "fast" and formats.get_codec(qt.name).encode_fast is None:
        pytest.skip(f"{qt.name} has no fast encoder")
    if case.record["expect"] == "reject":
        with pytest.raises(Ds4quantError):
            _encode(case, impl)
        return
    got = _encode(case, impl)
    want = case.array("encoded")
    assert got.shape == want.shape
    assert np.array_equal(got, want), describe_mismatch(got, want, qt.block_bytes)


@pytest.mark.parametrize("impl", ["ref", "fast"])
@pytest.mark.parametrize(
    "case", [c for c in CASES if c.record["expect"] == "ok"], ids=lambda c: c.id
)
def test_decode_matches_reference(case, impl):
    qt = formats.get_qtype(case.qtype)
    if impl == "fast" and formats.get_codec(qt.name).decode_fast is None:
        pytest.skip(f"{qt.name} has no fast decoder")
    got = formats.decode(case.qtype, case.array("encoded"), case.record["k"], _books(case), impl=impl)
    want = case.array("decoded")
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), describe_float_mismatch(got, want)


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.record["expect"] == "ok"], ids=lambda c: c.id
)
def test_torch_decode_matches_reference(case):
    torch = pytest.importorskip("torch")
    got = formats.decode_torch(case.qtype, torch.from_numpy(case.array("encoded")), case.record["k"], _books(case))
    want = case.array("decoded")
    got = got.cpu().numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), describe_float_mismatch(got, want)
