"""scripts/demo.py's step lines (the helper only; the demo itself is not run here)."""

from __future__ import annotations

import importlib.util
import io
import sys
import time
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
    buf, now = io.StringIO(), [10.0]
    steps = demo.Steps(3, buf, clock=lambda: now[0], beat_every=None)
    with steps("convert --recipe mxfp4 -> out/demo/mxfp4"):
        assert buf.getvalue() == "[demo 1/3] convert --recipe mxfp4 -> out/demo/mxfp4 ...\n"
        now[0] = 12.25
    steps.skip("calibrate", "out/demo/calib is current: reused")
    now[0] = 20.0
    with steps("verify"):
        now[0] = 20.5
    assert buf.getvalue().splitlines() == [
        "[demo 1/3] convert --recipe mxfp4 -> out/demo/mxfp4 ...",
        "[demo 1/3] convert --recipe mxfp4 -> out/demo/mxfp4: done in 2.2 s",
        "[demo 2/3] calibrate: skipped (out/demo/calib is current: reused)",
        "[demo 3/3] verify ...",
        "[demo 3/3] verify: done in 0.5 s",
    ]


def test_a_failed_step_claims_no_done_line_and_silent_steps_print_nothing(demo, capsys):
    buf = io.StringIO()
    steps = demo.Steps(1, buf, clock=lambda: 0.0, beat_every=None)
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


def test_a_quiet_step_says_it_is_still_running(demo):
    """The heartbeat's check, driven by hand (the thread only calls it once a second)."""
    now = [0.0]
    buf = io.StringIO()
    steps = demo.Steps(2, buf, clock=lambda: now[0], quiet_after=15.0, quiet_note=" - first run: numba",
                       beat_every=None)
    steps.beat()  # no step running: nothing to say
    with steps("convert --recipe rocmfp2-strix"):
        now[0] = 14.0
        steps.beat()  # quiet for 14 s: not yet
        now[0] = 16.0
        steps.beat()
        now[0] = 20.0
        steps.heard()  # a library progress line was shown
        now[0] = 34.0
        steps.beat()  # 14 s since it: not yet
        now[0] = 35.5
        steps.beat()
        now[0] = 40.0
    lines = buf.getvalue().splitlines()
    assert lines == [
        "[demo 1/2] convert --recipe rocmfp2-strix ...",
        "[demo 1/2] convert --recipe rocmfp2-strix: still running (16 s) - first run: numba",
        "[demo 1/2] convert --recipe rocmfp2-strix: still running (36 s) - first run: numba",
        "[demo 1/2] convert --recipe rocmfp2-strix: done in 40.0 s",
    ]
    steps.beat()  # the step is over
    assert len(buf.getvalue().splitlines()) == 4


def test_the_heartbeat_thread_stops_with_its_step(demo):
    buf = io.StringIO()
    steps = demo.Steps(1, buf, quiet_after=0.0, beat_every=0.01)
    with steps("load"):
        for _ in range(1000):  # quiet_after 0: the first beat speaks (allow a busy box 10 s)
            if "still running" in buf.getvalue():
                break
            time.sleep(0.01)
    n = len(buf.getvalue().splitlines())
    assert "still running" in buf.getvalue() and buf.getvalue().splitlines()[-1].startswith("[demo 1/1] load: done")
    time.sleep(0.05)
    assert len(buf.getvalue().splitlines()) == n
