"""convert says what it does: codebook fits, encoded tensors, the writing phases, its end."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from ds4quant.cli import cli
from ds4quant.cli import output
from ds4quant.convert import convert
from ds4quant.progress import EventKind

SAMPLE = Path(__file__).resolve().parents[1] / "samples" / "ds4-tiny"


def test_events_of_every_stage_in_order(tmp_path):
    events = []
    rep = convert(SAMPLE, tmp_path / "a", "rocmfp3", tensor_types=[r"blk\.0\.ffn_up_exps=rocmfp2_mix"],
                  progress=events.append)
    stages = [e.stage for e in events]
    books = [e for e in events if e.stage == "codebooks"]
    n_expert = 16  # ds4-tiny: one book per expert of the one MIX tensor
    assert len(books) == books[0].total == n_expert and books[-1].done == n_expert
    assert books[0].item == "blk.0.ffn_up_exps.weight expert 0" and books[0].detail["qtype"] == "rocmfp2_mix"
    enc = [e for e in events if e.stage == "encode"]
    assert len(enc) == enc[0].total == len(rep.results)
    conv = [e for e in events if e.stage == "convert"]
    assert [e.kind for e in conv] == [EventKind.PHASE, EventKind.PHASE, EventKind.DONE]
    assert conv[0].item.startswith("writing ") and "GGUF" in conv[0].item
    assert conv[1].item == "writing manifest.json and SHA256SUMS"
    # codebooks before encoding, encoding before writing, the end last
    assert stages.index("encode") > max(i for i, s in enumerate(stages) if s == "codebooks")
    assert stages.index("convert") > max(i for i, s in enumerate(stages) if s == "encode")
    assert events[-1].kind is EventKind.DONE
    for stage_events in (books, enc):
        assert all(e.eta != 0.0 for e in stage_events[:-1])


def test_the_command_prints_progress_on_a_tty_and_nothing_under_json(tmp_path, monkeypatch):
    monkeypatch.setattr(output, "stderr_is_tty", lambda: True)
    r = CliRunner().invoke(cli, ["convert", str(SAMPLE), str(tmp_path / "b"), "--recipe", "mxfp4", "--json"])
    assert r.exit_code == 0, r.output
    assert r.stderr == ""
    r = CliRunner().invoke(cli, ["convert", str(SAMPLE), str(tmp_path / "c"), "--recipe", "mxfp4"])
    assert r.exit_code == 0, r.output
    err = r.stderr.splitlines()
    assert err[0].startswith("[   1/") and "[convert] writing manifest.json and SHA256SUMS ..." in r.stderr
    assert err[-1].startswith("[convert] done")
    r = CliRunner().invoke(cli, ["verify", str(tmp_path / "c"), "--source", str(SAMPLE), "--json"])
    assert r.exit_code == 0 and r.stderr == ""
    r = CliRunner().invoke(cli, ["verify", str(tmp_path / "c"), "--source", str(SAMPLE)])
    assert r.exit_code == 0 and r.stderr.splitlines()[0].startswith("[   1/")
    monkeypatch.setattr(output, "stderr_is_tty", lambda: False)  # a pipe or a file: quiet
    r = CliRunner().invoke(cli, ["verify", str(tmp_path / "c"), "--source", str(SAMPLE)])
    assert r.exit_code == 0 and r.stderr == ""
