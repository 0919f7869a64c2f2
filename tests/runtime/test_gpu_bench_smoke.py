"""The GPU benchmarks' CPU smoke runs through Triton's interpreter: the prefill
sweep times each launch form and reports its distance from the first form
(docs/gpu.md#prefill), and the profiler script runs each fast path
(docs/gpu.md#profile). On a GPU they run at DS4 size."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from ._interp import kernels  # noqa: E402

BENCH = str(Path(__file__).resolve().parents[2] / "benchmarks")


@pytest.fixture(scope="module")
def bench():
    kernels("ds4quant.runtime.kernels.prefill_triton")  # the interpreter before the kernels import
    sys.path.insert(0, BENCH)
    yield
    sys.path.remove(BENCH)


def test_prefill_sweep_compares_the_launch_forms(bench, tmp_path):
    import runtime_gpu_prefill

    out = tmp_path / "prefill.json"
    args = ["--quick", "--device", "cpu", "--recipes", "rocmfp2-strix", "--paths", "fast", "--out", str(out)]
    assert runtime_gpu_prefill.main(args) == 0
    rows = [r for r in json.loads(out.read_text())["rows"] if r["path"] == "fast prefill"]
    rel = {tuple(r["tile"][5:]): r["max_rel_vs_first_tile"] for r in rows}  # (swap, n_first, x16)
    assert set(rel) == {(0, 0, 0), (0, 1, 1), (1, 1, 1)}
    assert rel[0, 1, 1] == 0.0  # launch order and the bf16 input cast: the same bytes
    assert 0.0 <= rel[1, 1, 1] < 1e-5  # the transposed product: float32 sums grouped apart at most


def test_profile_script_runs_every_fast_path(bench, capsys):
    import gpu_profile

    assert gpu_profile.main(["--quick", "--device", "cpu", "--batches", "1,8,64"]) == 0
    said = capsys.readouterr().out
    for path in ("decode-step gemv", "grouped gemv", "tensor-core prefill"):
        assert path in said


def test_profile_script_reports_the_host_side_of_run_slots(bench, capsys):
    import gpu_profile

    assert gpu_profile.main(["--quick", "--device", "cpu", "--batches", "1", "--recipe", "rocmfp4", "--host", "1"]) == 0
    said = capsys.readouterr().out
    assert "run_slots (host arrays):" in said and "tottime" in said
