"""samples/ds4-copy-engine: the copy sample in the proportions llama.cpp's loader asserts.

What users rely on: the shipped files are the ones its README lists (bytes and sha256), its
config has hc 4, CSA 4 / HCA 128 and an indexer head dim of 64, its mxfp4 artifacts (bf16 and
q8_0 dense tensors) claim llama.cpp, and the measured properties hold over five seeded identifier
sets: the source copies at least 59 per 60, the adaptive artifact more than rocmfp2-strix at the
same expert bytes, and 2-bit experts everywhere cost trials (samples/measure_ds4_copy.py, the
script the README's table comes from).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "samples" / "ds4-copy-engine"

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_the_files_are_the_ones_the_readme_lists_and_under_20_mb():
    listed = dict(re.findall(r"^\| `([^`]+)` \| [\d,]+ \| `([0-9a-f]{64})` \|$", (SAMPLE / "README.md").read_text(),
                             flags=re.MULTILINE))
    present = {p.name for p in SAMPLE.iterdir() if p.name != "README.md"}
    assert set(listed) == present
    for name, digest in listed.items():
        assert hashlib.sha256((SAMPLE / name).read_bytes()).hexdigest() == digest, name
    assert sum((SAMPLE / n).stat().st_size for n in present) < 20e6


def test_the_config_has_the_proportions_engines_fix():
    sys.path.insert(0, str(ROOT / "samples"))
    import train_ds4_copy as tr

    cfg = json.loads((SAMPLE / "config.json").read_text())
    assert (cfg["hc_mult"], cfg["compress_rate_csa"], cfg["compress_rate_hca"], cfg["index_head_dim"]) == (
        tr.ENGINE_SHAPE["hc_mult"], *tr.ENGINE_SHAPE["compress_rates"].values(), tr.ENGINE_SHAPE["index_head_dim"])
    assert cfg["hc_mult"] == 4 and cfg["compress_rate_hca"] == 128 and cfg["index_head_dim"] % 64 == 0
    rep = json.loads((SAMPLE / "train_report.json").read_text())
    assert rep["config"] == "full-engine-shape" and rep["seed"] == 4 and rep["steps"] == rep["steps_asked"]


@pytest.mark.parametrize("dense", [None, "q8_0"])
def test_its_mxfp4_artifact_claims_llama_cpp(tmp_path, dense):
    from ds4quant.artifact.view import open_artifact
    from ds4quant.convert import convert

    convert(SAMPLE, tmp_path / "mx", "mxfp4", threads=1, dense_qtype=dense)
    v = open_artifact(tmp_path / "mx")
    assert "llama.cpp" in v.runtimes and "llama.cpp" in v.stored_runtimes, v.runtimes_excluded.get("llama.cpp")


def test_the_measured_properties_hold_over_five_identifier_sets(tmp_path):
    sys.path.insert(0, str(ROOT / "samples"))
    import measure_ds4_copy as ms

    buf = io.StringIO()
    with redirect_stdout(buf):
        ms.main(["--source", str(SAMPLE), "--work", str(tmp_path), "--copy-sets", "5",
                 "--only", "rocmfp2-strix", "rocmfp2", "adaptive"])
    rows = {}
    for line in buf.getvalue().splitlines():
        d = json.loads(line)
        if "artifact" in d:
            rows[d["artifact"].split(" ")[0]] = d
    assert set(rows) == {"source", "rocmfp2-strix", "rocmfp2", "adaptive"}
    assert all(len(r["sets"]) == 5 for r in rows.values())
    src, strix, two, ada = (rows[k]["per60"] for k in ("source", "rocmfp2-strix", "rocmfp2", "adaptive"))
    assert src >= 59, rows["source"]
    assert ada > strix, (ada, strix)  # the same expert bytes
    assert rows["adaptive"]["expert_bytes"] == rows["rocmfp2-strix"]["expert_bytes"]
    assert two <= src - 5, (two, src)  # the experts carry the answer (README: 6.6 trials, short of 10)
