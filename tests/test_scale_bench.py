"""benchmarks/scale.py end to end at a small width (the DS4 Flash layer
pattern, ds4-flash-mini): every step runs in its child, calibrate's files feed
the adaptive convert, the candidate runs over the adaptive artifact, and the
result holds per-layer seconds, peak memory and the 43-layer projection.
Not a timing test: the script is what measures on the lent GPU host, and this
keeps it runnable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_scale_benchmark_runs_the_whole_pipeline_on_a_small_slice(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "scale.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--preset", "ds4-flash-mini",
                          "--layers", "2", "--seqs", "2", "--tokens", "16", "--max-memory", "2G", "--threads", "1",
                          "--sensitivity-seqs", "1", "--recipe", "mxfp4", "--work", str(tmp_path / "w"), "--keep",
                          "--project-seqs", "4",
                          "--json-out", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    d = json.loads(out.read_text())
    assert "partial" not in d and d["warmup_seconds"] > 0
    for step in ("reference", "calibrate", "candidate"):
        assert len(d[step]["seconds_per_layer"]) == 2, step
        assert d[step]["peak_rss_bytes"] > 0 and d["projection_43_layers"][step]["seconds"] > 0, step
    assert d["calibrate"]["tokens"] == 2 * 16 and d["calibrate"]["sensitivity_seqs"] == 1
    # 43 layers, probes at 0, 6, ..., 42 (8), one sensitivity sequence, two probe groups: 4 x 43 main
    # sequence-layers, 8 x 2 started, 2 x (42 + 36 + ... + 0) carried
    proj = d["projection_43_layers"]
    assert proj["calibrate_4_seqs"]["seq_layers"] == 4 * 43 + 16 + 2 * 168
    assert proj["calibrate"]["seq_layers"] == 2 * 43 + 16 + 2 * 168
    # calibrate's layers timed by parts (main pass, noise and local errors, probe branches), and projected
    # by them: two more main sequences cost each DS4 Flash layer two main sequence-layers at its type's rate
    parts = d["calibrate"]["layer_parts"]
    assert len(parts) == 2 and all(min(p.values()) >= 0 for p in parts)
    assert set(parts[0]) == {"weights", "main", "noise_and_local", "branches"}
    for p, sec in zip(parts, d["calibrate"]["seconds_per_layer"]):
        assert sum(p.values()) == pytest.approx(sec, abs=1e-3)
    assert proj["calibrate"]["by_parts"] and not proj["calibrate"]["upper_bound"]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from scale_projection import flash_types

    here, there = flash_types(0, 2)
    main = {t: max(p["main"] / 2 for p, u in zip(parts, here) if u == t) for t in set(here)}
    extra = 2 * sum(main.get(t, max(main.values())) for t in there)
    assert proj["calibrate_4_seqs"]["seconds"] - proj["calibrate"]["seconds"] == pytest.approx(extra, rel=1e-9)
    assert d["adaptive_convert"]["calibrated"] is True
    assert d["candidate"]["artifact"] == "adaptive"
    cal = tmp_path / "w" / "calib"
    for f in ("imatrix.gguf", "routing.json", "sensitivity.json"):
        assert (cal / f).is_file(), f
    assert any((tmp_path / "w" / "adaptive").glob("*.gguf")) and any((tmp_path / "w" / "uniform").glob("*.gguf"))
    assert "PROJECTION to 43 layers" in res.stdout and "whole pipeline" in res.stdout
