"""The CLI's progress printer consumes ProgressEvents (TTY only; silent otherwise)."""

from __future__ import annotations

from ds4quant.cli.output import progress_line, progress_printer
from ds4quant.progress import Meter


def _clock(*ts):
    return iter(ts).__next__


def test_printer_shows_warm_up_then_a_windowed_eta(capsys):
    assert progress_printer(False) is None
    show = progress_printer(True)
    m = Meter("encode", total=3, unit="tensor", total_work=3, clock=_clock(0.0, 5.0, 6.0, 7.0))
    for name in ("a", "b", "c"):
        show(m.step(name, qtype="rocmfp3", bytes=1, seconds=0.5, reused=False, sqnr_db=12.5))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("[   1/3] a") and "warm-up" in lines[0] and "12.50 dB" in lines[0]
    assert "ETA      3s" in lines[1]  # one item left; the window (0 s, 0) -> (6 s, 2) says 3 s per item
    assert "ETA      0s" in lines[2]  # the last item, nothing pending: nothing is left
    mm = Meter("measure", total=2, unit="expert", clock=_clock(0.0, 1.0))
    show(mm.step("blk.0.ffn_down_exps.weight", expert=7))
    assert "expert 7" in capsys.readouterr().err


def test_a_fraction_of_a_second_left_reads_one_not_zero():
    m = Meter("encode", total=10, unit="tensor", warmup=1, clock=_clock(0.0, 0.01))
    ev = m.step("a", qtype="q8_0", seconds=0.01, sqnr_db=40.0)
    assert 0 < ev.eta < 0.5 and "ETA      1s" in progress_line(ev)


def test_a_layer_stage_with_a_phase_after_it_never_reads_eta_zero(capsys):
    """calibrate's shape: layers counted, then uncounted phases; every line on a TTY."""
    show = progress_printer(True, tick_every=1.0)
    m = Meter("calibrate", total=2, unit="layer", total_work=4, warmup=1,
              clock=_clock(0.0, 0.5, 0.7, 2.0, 4.0, 5.0, 9.0),
              then=("writing sensitivity.json",))
    show(m.tick("layer 0: sequence 1/2", work=1, tokens=10))
    show(m.tick("layer 0: sequence 2/2", work=1, tokens=20))  # 0.2 s after the last shown tick: dropped
    show(m.step("layer 0", work=0, tokens=20))
    show(m.step("layer 1", work=2, tokens=40))
    show(m.phase("writing sensitivity.json"))
    show(m.finish())
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 5, lines
    assert lines[0].startswith("[calibrate 0/2 layer] layer 0: sequence 1/2") and "ETA      2s" in lines[0]
    assert "10 tokens, 20 tok/s" in lines[0]
    assert lines[1].startswith("[calibrate 1/2 layer] layer 0")
    assert lines[2].startswith("[calibrate 2/2 layer] layer 1") and "ETA      ?" in lines[2]
    assert lines[2].endswith("(next: writing sensitivity.json)")
    assert lines[3] == "[calibrate] writing sensitivity.json ...  (5.0s)"
    assert lines[4] == "[calibrate] done: 2 layers in 9.0s"
    assert not any("ETA      0s" in line for line in lines)


def test_verify_decode_lines():
    m = Meter("decode", total=2, unit="tensor", clock=_clock(0.0, 1.0))
    line = progress_line(m.step("blk.0.ffn_up_exps.weight", qtype="rocmfp2", sqnr_db=9.5, seconds=0.25))
    assert line.startswith("[   1/2] blk.0.ffn_up_exps.weight") and "rocmfp2" in line and "warm-up" in line


def test_a_stage_of_phases_only_ends_without_a_count():
    m = Meter("convert", 0, "phase", clock=_clock(0.0, 1.0, 2.5))
    assert progress_line(m.phase("writing manifest.json and SHA256SUMS")) == (
        "[convert] writing manifest.json and SHA256SUMS ...  (1.0s)")
    assert progress_line(m.finish()) == "[convert] done in 2.5s"
