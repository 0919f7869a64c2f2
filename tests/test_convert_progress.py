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
    rep = convert(SAMPLE, tmp_path / "a", "mxfp4", tensor_types=[r"blk\.0\.ffn_up_exps=rocmfp2_mix"],
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
    # no line says nothing is left before the end: the last codebook and the last
    # encoded tensor name what comes next instead
    assert all(e.eta != 0.0 for e in events[:-1])
    assert books[-1].pending == ("encoding",) and books[-1].eta is None
    assert enc[-1].pending[0] == "writing the GGUF" and enc[-1].eta is None


def test_the_command_prints_progress_on_a_tty_and_nothing_under_json(tmp_path, monkeypatch):
    monkeypatch.setattr(output, "stderr_is_tty", lambda: True)
    r = CliRunner().invoke(cli, ["convert", str(SAMPLE), str(tmp_path / "c"), "--recipe", "mxfp4"])
    assert r.exit_code == 0, r.output
    err = r.stderr.splitlines()
    assert err[0].startswith("[   1/") and "[convert] writing manifest.json and SHA256SUMS ..." in r.stderr
    assert err[-1].startswith("[convert] done")
    r = CliRunner().invoke(cli, ["verify", str(tmp_path / "c"), "--source", str(SAMPLE), "--json"])
    assert r.exit_code == 0 and r.stderr == ""  # --json: one object on stdout, nothing on stderr
    assert r.stdout.startswith("{")
    r = CliRunner().invoke(cli, ["verify", str(tmp_path / "c"), "--source", str(SAMPLE)])
    assert r.exit_code == 0 and r.stderr.splitlines()[0].startswith("[   1/")
    assert output.command_progress(False, wanted=False) is None  # verify without a source decodes nothing
    monkeypatch.setattr(output, "stderr_is_tty", lambda: False)  # a pipe or a file: quiet
    assert output.command_progress(False) is None


def test_publish_passes_verify_progress_on(tmp_path, monkeypatch):
    from ds4quant.publish import publish

    art = tmp_path / "art"
    convert(SAMPLE, art, "mxfp4")
    events = []
    publish(art, tmp_path / "rel", source=SAMPLE, progress=events.append)
    decode = [e for e in events if e.stage == "decode"]
    assert [e.done for e in decode] == list(range(1, decode[0].total + 1))
    monkeypatch.setattr(output, "stderr_is_tty", lambda: True)
    r = CliRunner().invoke(cli, ["publish", str(art), str(tmp_path / "rel2"), "--source", str(SAMPLE), "--json"])
    assert r.exit_code == 0 and r.stderr == "", r.output
