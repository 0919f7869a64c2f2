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
    # (the main pass split where the sensitivity sequence ends and the rest begins)
    parts = d["calibrate"]["layer_parts"]
    whole = ("weights", "main", "noise_and_local", "branches")
    assert len(parts) == 2 and all(min(p.values()) >= 0 for p in parts)
    assert set(parts[0]) == set(whole) | {"main_sens", "main_rest"}
    for p, sec in zip(parts, d["calibrate"]["seconds_per_layer"]):
        assert sum(p[k] for k in whole) == pytest.approx(sec, abs=1e-3)
        assert p["main_sens"] + p["main_rest"] == pytest.approx(p["main"], abs=1e-9)
    assert proj["calibrate"]["by_parts"] and not proj["calibrate"]["upper_bound"]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from scale_projection import flash_types

    # two more main sequences cost each layer two sequence-layers at its type's rate after the sensitivity ones
    here, there = flash_types(0, 2)
    main = {t: max(p["main_rest"] / 1 for p, u in zip(parts, here) if u == t) for t in set(here)}
    extra = 2 * sum(main.get(t, max(main.values())) for t in there)
    assert proj["calibrate_4_seqs"]["seconds"] - proj["calibrate"]["seconds"] == pytest.approx(extra, rel=1e-9)
    assert d["adaptive_convert"]["calibrated"] is True
    assert d["candidate"]["artifact"] == "adaptive"
    cal = tmp_path / "w" / "calib"
    for f in ("imatrix.gguf", "routing.json", "sensitivity.json"):
        assert (cal / f).is_file(), f
    assert any((tmp_path / "w" / "adaptive").glob("*.gguf")) and any((tmp_path / "w" / "uniform").glob("*.gguf"))
    assert "PROJECTION to 43 layers" in res.stdout and "whole pipeline" in res.stdout


def test_layer_parts_split_the_main_pass_where_the_sensitivity_sequences_end():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from scale_clocks import layer_parts

    ev = [("tick", "layer 0: weights ready", 1.0), ("tick", "layer 0: sequence 1/4", 2.0),
          ("tick", "layer 0: sequence 2/4", 3.0), ("tick", "layer 0: sequence 3/4", 3.5),
          ("tick", "layer 0: sequence 4/4", 3.5), ("tick", "layer 0: noise and local errors", 4.0),
          ("step", "layer 0", 6.0), ("tick", "layer 1: sequence 4/4", 7.0), ("step", "layer 1", 7.5)]
    one, two = layer_parts(ev, 0.0, sens=2)
    assert one == {"weights": 1.0, "main": 2.5, "noise_and_local": 0.5, "branches": 2.0,
                   "main_sens": 2.0, "main_rest": 0.5}
    assert two == {"weights": 0.0, "main": 1.0, "noise_and_local": 0.0, "branches": 0.5}  # no split tick seen
    assert set(layer_parts(ev, 0.0)[0]) == {"weights", "main", "noise_and_local", "branches"}
