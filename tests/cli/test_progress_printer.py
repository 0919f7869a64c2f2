"""The CLI's progress printer consumes ProgressEvents (TTY only; silent otherwise)."""

from __future__ import annotations

from ds4quant.cli.output import progress_printer
from ds4quant.progress import Meter


def test_printer_shows_warm_up_then_a_windowed_eta(capsys):
    assert progress_printer(False) is None
    show = progress_printer(True)
    t = iter([0.0, 5.0, 6.0, 7.0])
    m = Meter("encode", total=3, unit="tensor", total_work=3, clock=lambda: next(t))
    for name in ("a", "b", "c"):
        show(m.step(name, qtype="rocmfp3", bytes=1, seconds=0.5, reused=False, sqnr_db=12.5))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("[   1/3] a") and "warm-up" in lines[0] and "12.50 dB" in lines[0]
    assert "ETA      3s" in lines[1]  # one item left; the window (0 s, 0) -> (6 s, 2) says 3 s per item
    assert "ETA      0s" in lines[2]
    mm = Meter("measure", total=2, unit="expert", clock=iter([0.0, 1.0]).__next__)
    show(mm.step("blk.0.ffn_down_exps.weight", expert=7))
    assert "expert 7" in capsys.readouterr().err
