"""The one object that picks a search's tier: a frozen record that refuses
what cannot run, round-trips through JSON, and is what every face call takes."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from ds4quant.errors import BadInputError
from ds4quant.formats import search
from ds4quant.formats.search import NUMBA, Backend, DeviceKind, Tier


def test_backends_are_frozen_records_with_a_json_round_trip():
    for b in (NUMBA, Backend(Tier.TORCH, DeviceKind.CPU), Backend("triton", "cuda", 1), Backend(Tier.TORCH, "cuda")):
        assert Backend.from_json(b.to_json()) == b
        assert isinstance(b.tier, Tier) and isinstance(b.device, DeviceKind)
    assert Backend("triton", "cuda", 1).to_json() == {"tier": "triton", "device": "cuda", "index": 1}
    assert str(Backend(Tier.TRITON, "cuda", 1)) == "triton on cuda:1" and str(NUMBA) == "numba"
    with pytest.raises(AttributeError):
        NUMBA.tier = Tier.TORCH


@pytest.mark.parametrize("args, text", [
    (("numba", "cuda"), "numba tier runs on the host"),
    (("numba", "cpu", 0), "needs a CUDA device"),
    (("torch", "cpu", 1), "needs a CUDA device"),
    (("torch", "tpu"), "no search backend"),
    (("legacy", "cpu"), "no search backend"),
])
def test_a_backend_that_cannot_run_is_refused(args, text):
    with pytest.raises(BadInputError, match=text):
        Backend(*args)


def test_the_host_tier_has_no_device_and_the_face_says_which_tier_a_call_needs():
    with pytest.raises(BadInputError, match="no torch device"):
        NUMBA.torch_device
    with pytest.raises(BadInputError, match="triton tier, not numba"):
        search.mix_error_on_device(None, None, np.zeros((2, 4), np.float32), 1, None, NUMBA)


def test_importing_the_face_imports_neither_torch_nor_triton():
    import subprocess

    code = "import sys, ds4quant.formats.search; print('torch' in sys.modules, 'triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
