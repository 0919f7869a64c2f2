"""Same inputs, same bytes: manifest.json and SHA256SUMS do not depend on timings,
cache state, thread counts or options that cannot change bytes.

An adaptive run recorded ``measure_seconds`` and ``measures_reused`` in
manifest.json, and the command line with ``--threads``; both made SHA256SUMS
differ between identical runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from ds4quant.plan import AdaptiveOptions
from ds4quant.convert import convert
from ds4quant.convert.assemble import normalized_command

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "samples" / "ds4-tiny"


def _run(out: Path, cache: Path, threads: int):
    cmd = ["ds4quant", "convert", str(SAMPLE), "OUT", "--recipe", "adaptive", "--target-bpw", "3.0",
           "--threads", str(threads), "--cache-dir", str(cache), "--json"]
    opts = AdaptiveOptions(target_bpw=3.0, granularity="tensor", candidates=("rocmfp2", "rocmfp3"),
                           fit_iterations=2, fit_restarts=0, fit_max_rows=64, cache_dir=str(cache))
    return convert(SAMPLE, out, "adaptive", adaptive=opts, threads=threads, name="tiny", command=cmd)


def test_manifest_and_sums_are_identical_across_runs_threads_and_caches(tmp_path):
    cold = _run(tmp_path / "a", tmp_path / "cache1", threads=1)          # cold cache
    warm = _run(tmp_path / "b", tmp_path / "cache1", threads=2)          # warm cache, other threads
    # the run itself differs (timing, cache hits): the report says so, the artifact does not
    assert cold.adaptive.measures_reused == 0 and warm.adaptive.measures_reused > 0
    other = _run(tmp_path / "c", tmp_path / "cache2", threads=2)         # another cold cache
    for name in ("manifest.json", "SHA256SUMS", "tiny.gguf"):
        a = (tmp_path / "a" / name).read_bytes()
        assert a == (tmp_path / "b" / name).read_bytes() == (tmp_path / "c" / name).read_bytes(), name
    man = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert "measure_seconds" not in man["recipe"]["allocation"]
    assert "measures_reused" not in man["recipe"]["allocation"]
    assert not {"--threads", "--cache-dir", "--json"} & set(man["command"])
    assert other.adaptive.measure_seconds >= 0  # kept for --json and the report


def test_the_recorded_command_drops_only_options_that_cannot_change_bytes():
    argv = ["ds4quant", "convert", "s", "o", "--threads", "8", "--json", "--recipe", "rocmfp3", "--resume",
            "--cache-dir=/c", "--force", "--cache-dir", "/d", "--threads=2", "--name", "n"]
    assert normalized_command(argv) == ("ds4quant", "convert", "s", "o", "--recipe", "rocmfp3", "--name", "n")
