"""scripts/demo.py's step lines (the helper only; the demo itself is not run here)."""

from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo():
    spec = importlib.util.spec_from_file_location("ds4quant_demo_script", ROOT / "scripts" / "demo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_line_when_a_step_starts_and_one_with_its_seconds_when_it_ends(demo):
    buf = io.StringIO()
    steps = demo.Steps(3, buf, clock=iter([10.0, 12.25, 20.0, 20.5]).__next__)
    with steps("convert --recipe mxfp4 -> out/demo/mxfp4"):
        assert buf.getvalue() == "[demo 1/3] convert --recipe mxfp4 -> out/demo/mxfp4 ...\n"
    steps.skip("calibrate", "out/demo/calib is current: reused")
    with steps("verify"):
        pass
    assert buf.getvalue().splitlines() == [
        "[demo 1/3] convert --recipe mxfp4 -> out/demo/mxfp4 ...",
        "[demo 1/3] convert --recipe mxfp4 -> out/demo/mxfp4: done in 2.2 s",
        "[demo 2/3] calibrate: skipped (out/demo/calib is current: reused)",
        "[demo 3/3] verify ...",
        "[demo 3/3] verify: done in 0.5 s",
    ]


def test_a_failed_step_claims_no_done_line_and_silent_steps_print_nothing(demo, capsys):
    buf = io.StringIO()
    steps = demo.Steps(1, buf, clock=iter([0.0, 1.0]).__next__)
    with pytest.raises(RuntimeError):
        with steps("publish"):
            raise RuntimeError("boom")
    assert buf.getvalue() == "[demo 1/1] publish ...\n"
    quiet = demo.Steps(2)  # --json: no stream
    with quiet("convert"):
        pass
    quiet.skip("calibrate", "reused")
    assert quiet.n == 2 and capsys.readouterr() == ("", "")


def test_the_first_run_is_told_from_an_empty_numba_cache(demo, tmp_path):
    assert not demo.kernels_cached(tmp_path)
    cache = tmp_path / "formats" / "__pycache__"
    cache.mkdir(parents=True)
    (cache / f"mxfp4._decode_nb-216.py{sys.version_info.major}{sys.version_info.minor}.nbc").write_bytes(b"")
    assert not demo.kernels_cached(tmp_path)  # the index file says a kernel is cached, not its code
    (cache / f"mxfp4._decode_nb-216.py{sys.version_info.major}{sys.version_info.minor}.nbi").write_bytes(b"")
    assert demo.kernels_cached(tmp_path)
