"""The measure-stage benchmarks at small shapes: the DS4-shape cost
(``benchmarks/_adaptive_ds4shape.py``) holds the experts as a checkpoint does
with ``reads`` (FP4 codes and E8M0 scales that dequantize to its matrices bit
for bit) and gives the in-memory digest; the width benchmark's phases run and
every width gives one digest."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def ds4shape():
    sys.path.insert(0, str(BENCH))
    try:
        import _adaptive_ds4shape

        yield _adaptive_ds4shape
    finally:  # the benchmark scripts put their folder first too: leave none of it
        while str(BENCH) in sys.path:
            sys.path.remove(str(BENCH))


def test_packed_experts_dequantize_to_the_benchmark_matrices(ds4shape):
    from ds4quant.formats.fp8 import dequant_e2m1_blocks

    for key, shape in (("gate/0", (64, 256)), ("down/3", (256, 64))):
        x = ds4shape.fp4_matrix(key, shape)
        x[0, :32] = 0.0  # an all-zero block: scale byte 0
        x[1, :32] = -0.0
        codes, scales = ds4shape.fp4_packed(x)
        assert codes.shape == (shape[0], shape[1] // 2) and scales.shape == (shape[0], shape[1] // 32)
        assert np.array_equal(dequant_e2m1_blocks(codes, scales).view(np.uint32), x.view(np.uint32))


def test_reads_give_the_in_memory_figures(ds4shape):
    kw = dict(experts=1, one_core=False, shapes=((32, 256), (256, 32)), candidates=("rocmfp2", "rocmfp2_mix"))
    a = ds4shape.ds4_expert_cost(2, **kw)
    b = ds4shape.ds4_expert_cost(2, reads=True, **kw)
    assert b["reads"] and a["paths"]["2 cores"]["digest"] == b["paths"]["2 cores"]["digest"]


def test_width_benchmark_reports_phases_and_one_digest(ds4shape, tmp_path, monkeypatch):
    from tests.runtime._interp import device_kernels

    # the phases wrap these kernel modules: import them as the kernel tests do
    # (under the interpreter without CUDA), or those tests would skip
    device_kernels("ds4quant.formats.search.triton_mix")
    device_kernels("ds4quant.formats.search.triton_sums")
    import adaptive_width

    monkeypatch.setattr(adaptive_width, "GATE_UP", (32, 256))
    monkeypatch.setattr(adaptive_width, "DOWN", (256, 32))
    out = tmp_path / "w.json"
    assert adaptive_width.main(["--device", "torch-cpu", "--experts", "1", "--widths", "1,2", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["identical"] and set(d["widths"]) == {"1", "2"}
    assert d["widths"]["1"]["phases_s_per_matrix"]["MIX: the whole codebook fit"] > 0
