"""llama.cpp (through llama-cpp-python) loads and runs ds4quant artifacts: the interop check.

Skipped without llama-cpp-python; ``bash scripts/interop.sh`` installs it (a long compile, once)
and runs this module. Each run's figures are written to $DS4QUANT_INTEROP_REPORT (JSON) when set,
for the record.

- a tiny random-weight DS4 in llama.cpp's shape (tests/artifact/conftest.py ``LLAMA_SHAPE``),
  converted to mxfp4 with bf16 and with q8_0 dense tensors: both load, and
  ``verify --fidelity --engine llama.cpp`` reports the engine's figures beside the runtime's
  (random weights route near ties, so only a loose top-1 floor applies);
- the copy sample in llama.cpp's shape (samples/ds4-copy-engine; samples/ds4-copy skips, its
  proportions named): top-1 agreement with the transformers reference at least 95% over the
  fidelity evaluation tokens, greedy exact copies within one trial of the source's own score.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from ds4quant.artifact.view import open_artifact  # noqa: E402
from ds4quant.convert import convert  # noqa: E402
from ds4quant.verify import verify  # noqa: E402
from tests.artifact.conftest import llama_shape_source  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
COPY = ROOT / "samples" / "ds4-copy"
ENGINE_COPY = ROOT / "samples" / "ds4-copy-engine"  # the copy sample in llama.cpp's proportions
DENSE = {"bf16": None, "q8_0": "q8_0"}
FIGURES: dict = {}


def _record(name: str, fid: dict) -> None:
    e = fid["engines"]["llama.cpp"]
    FIGURES[name] = {"runtime": {k: fid.get(k) for k in ("kl_mean", "top1", "response_sha256", "exact_copy")},
                     "llama.cpp": {k: e.get(k) for k in ("kl_mean", "top1", "ppl_ratio", "response_sha256",
                                                         "response_matches_reference", "exact_copy")}}
    out = os.environ.get("DS4QUANT_INTEROP_REPORT")
    if out:
        Path(out).write_text(json.dumps({"llama_cpp_python": llama_cpp.__version__, "runs": FIGURES}, indent=1))
    print(f"\ninterop {name}: {json.dumps(FIGURES[name])}")


@pytest.fixture(scope="module")
def shaped(tmp_path_factory):
    root = tmp_path_factory.mktemp("interop")
    src = llama_shape_source(root / "src")
    arts = {d: root / f"mxfp4-{d}" for d in DENSE}
    for d, out in arts.items():
        convert(src, out, "mxfp4", threads=1, dense_qtype=DENSE[d])
    return src, arts


@pytest.mark.parametrize("dense", list(DENSE))
def test_llama_cpp_loads_and_runs_the_artifact(shaped, dense):
    _, arts = shaped
    v = open_artifact(arts[dense])
    assert "llama.cpp" in v.runtimes and "llama.cpp" in v.stored_runtimes
    llm = llama_cpp.Llama(model_path=str(v.gguf_paths[0]), n_ctx=256, n_threads=1, logits_all=True, verbose=False)
    llm.eval([0, 5, 9, 17])
    logits = np.asarray(llm.scores[:4])
    assert logits.shape == (4, int(v.kv["deepseek4.vocab_size"].value)) and np.isfinite(logits).all()


@pytest.mark.parametrize("dense", list(DENSE))
def test_verify_reports_the_engine_beside_the_runtime(shaped, dense):
    src, arts = shaped
    rep = verify(arts[dense], source=src, fidelity=True, engines=("llama.cpp",))
    f = rep.fidelity.to_json()
    e = f["engines"]["llama.cpp"]
    assert e["engine"] == "llama.cpp" and np.isfinite(e["kl_mean"]) and len(e["response_sha256"]) == 64
    assert e["top1"] >= 0.5, e  # a broken load agrees on ~1/264 of the tokens
    assert any(c.name == "fidelity.llama.cpp.kl" for c in rep.checks)
    _record(f"random-{dense}", f)


@pytest.mark.parametrize("sample", [ENGINE_COPY, COPY], ids=lambda p: p.name)
@pytest.mark.parametrize("dense", list(DENSE))
def test_the_copy_sample_runs_in_llama_cpp_as_in_the_reference(tmp_path, dense, sample):
    out = tmp_path / "copy"
    convert(sample, out, "mxfp4", threads=1, dense_qtype=DENSE[dense])
    v = open_artifact(out)
    if "llama.cpp" not in v.runtimes:
        assert sample != ENGINE_COPY, v.runtimes_excluded["llama.cpp"]
        pytest.skip(f"samples/{sample.name} is not in llama.cpp's shape ("
                    + "; ".join(v.runtimes_excluded["llama.cpp"]) + ")")
    rep = verify(out, source=sample, fidelity=True, protocol="exact-copy", engines=("llama.cpp",))
    f = rep.fidelity.to_json()
    e = f["engines"]["llama.cpp"]
    assert e["top1"] >= 0.95, e
    ec = e["exact_copy"]
    assert ec["passes"] >= ec["reference_passes"] - 1, ec
    # the same seeded identifier sets as the runtime's candidate, the source's beside them
    assert len(ec["sets"]) == len(f["exact_copy"]["sets"]) and ec["reference_sets"] == f["exact_copy"]["reference_sets"]
    assert ec["per_60"] >= ec["reference_per_60"] - 1, ec
    _record(f"{sample.name}-{dense}", f)
