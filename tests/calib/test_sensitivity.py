"""sensitivity.json: the file (read, refusals) and the allocation that uses its gains."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ds4quant.plan import AdaptiveOptions, Measure, Measurements, resolve
from ds4quant.errors import BadInputError, CorruptDataError
from ds4quant.calib.sensitivity import read_sensitivity

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "samples" / "ds4-tiny"


def _doc(**over) -> dict:
    d = {"schema": "ds4quant.sensitivity", "version": 1, "source_fingerprint": "ab" * 32, "tokens_sha256": "cd" * 32,
         "sequences": 2, "tokens": 40, "rel_std": 0.3,
         "tensors": {"blk.0.ffn_gate_exps.weight": {"gain": 2e-3, "kl": 0.02, "weighted_error": 10.0},
                     "blk.0.ffn_down_exps.weight": {"gain": 5e-2, "kl": 0.5, "weighted_error": 10.0}}}
    d.update(over)
    return d


def _write(tmp_path, obj, name="s.json") -> Path:
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return p


def test_read_round_trip_and_gain_lookup(tmp_path):
    s = read_sensitivity(_write(tmp_path, _doc()))
    assert s.gain("blk.0.ffn_down_exps.weight") == 5e-2
    assert (s.sequences, s.tokens, s.rel_std) == (2, 40, 0.3)
    with pytest.raises(BadInputError, match="blk.1.ffn_up_exps.weight"):
        s.gain("blk.1.ffn_up_exps.weight")
    assert read_sensitivity(_write(tmp_path, _doc()), fingerprint="ab" * 32).gains == s.gains


@pytest.mark.parametrize("obj, needle", [
    ("{not json", "not valid JSON"),
    ('{"schema": "ds4quant.sensitivity", "version": 1, "tensors": {"blk.0.ffn_gate_exps.weight": '
     '{"gain": NaN, "kl": 0, "weighted_error": 1}}}', "not valid JSON"),
    (_doc(schema="other"), "schema"),
    (_doc(version=9), "version 9"),
    (_doc(tensors={}), "no tensors"),
    (_doc(tensors={"token_embd.weight": {"gain": 1.0, "kl": 1.0, "weighted_error": 1.0}}), "not a routed-expert"),
    (_doc(tensors={"blk.0.ffn_gate_exps.weight": {"gain": -1.0, "kl": 1.0, "weighted_error": 1.0}}), "gain"),
    (_doc(tensors={"blk.0.ffn_gate_exps.weight": {"gain": 0.0, "kl": 1.0, "weighted_error": 1.0}}), "gain"),
    (_doc(tensors={"blk.0.ffn_gate_exps.weight": {"gain": "1", "kl": 1.0, "weighted_error": 1.0}}), "gain"),
    (_doc(tensors={"blk.0.ffn_gate_exps.weight": [1, 2]}), "not an object"),
    (_doc(sequences=0), "sequences"),
    (_doc(rel_std=True), "rel_std"),
])
def test_bad_files_are_refused_naming_the_file(tmp_path, obj, needle):
    p = _write(tmp_path, obj)
    with pytest.raises((CorruptDataError, BadInputError), match=needle) as ei:
        read_sensitivity(p)
    assert str(p) in ei.value.one_line() if hasattr(ei.value, "one_line") else True


def test_missing_file_and_other_source_refused(tmp_path):
    with pytest.raises(BadInputError, match="cannot read"):
        read_sensitivity(tmp_path / "absent.json")
    with pytest.raises(BadInputError, match="another source"):
        read_sensitivity(_write(tmp_path, _doc()), fingerprint="ef" * 32)


class _Choice:
    def __init__(self, name, surface):
        self.name, self.surface, self.layer = name, surface, 0


class _Member:
    def __init__(self, e):
        self.expert = e


def _toy():
    """Two tensors, one expert each; rocmfp3 costs 100 more bytes on either and
    lowers the weighted error more on the gate (90 -> 10) than on the down (60 -> 20)."""
    g, d = _Choice("blk.0.ffn_gate_exps.weight", "gate"), _Choice("blk.0.ffn_down_exps.weight", "down")
    m = {(g.name, 0, "rocmfp2"): Measure(300, 0, 1, 90.0, 1000.0, None),
         (g.name, 0, "rocmfp3"): Measure(400, 0, 1, 10.0, 1000.0, None),
         (d.name, 0, "rocmfp2"): Measure(300, 0, 1, 60.0, 1000.0, None),
         (d.name, 0, "rocmfp3"): Measure(400, 0, 1, 20.0, 1000.0, None)}
    meas = Measurements(m, {g.name: np.ones(1), d.name: np.ones(1)}, 0.0, 0)
    return [(g, [_Member(0)]), (d, [_Member(0)])], meas


def test_gains_move_the_bytes_to_the_tensor_the_model_feels():
    todo, meas = _toy()
    opts = AdaptiveOptions(target_bpw=3.0, candidates=("rocmfp2", "rocmfp3"))
    plain, _ = resolve(todo, meas, opts, budget=700)
    assert plain["blk.0.ffn_gate_exps.weight"].qtypes == ("rocmfp3",)  # 80 saved vs 40
    assert plain["blk.0.ffn_down_exps.weight"].qtypes == ("rocmfp2",)
    # the down projection costs 10x more KL per unit of weighted error: 400 vs 80 saved
    gains = {"blk.0.ffn_gate_exps.weight": 1e-3, "blk.0.ffn_down_exps.weight": 1e-2}
    weighted, _ = resolve(todo, meas, opts, budget=700, gains=gains)
    assert weighted["blk.0.ffn_gate_exps.weight"].qtypes == ("rocmfp2",)
    assert weighted["blk.0.ffn_down_exps.weight"].qtypes == ("rocmfp3",)
    # decisions keep the weighted error in its own units
    assert weighted["blk.0.ffn_down_exps.weight"].predicted_error == 20.0


def test_convert_refuses_a_sensitivity_file_of_another_source(tmp_path):
    from click.testing import CliRunner

    from ds4quant.cli import cli

    p = _write(tmp_path, _doc(tensors={f"blk.{i}.ffn_{s}_exps.weight": {"gain": 1e-3, "kl": 1e-2, "weighted_error": 10.0}
                                       for i in range(4) for s in ("gate", "up", "down")}))
    r = CliRunner().invoke(cli, ["convert", str(SAMPLE), str(tmp_path / "out"), "--recipe", "adaptive",
                                 "--target-bpw", "2.8", "--sensitivity", str(p), "--cache-dir", str(tmp_path / "c")])
    assert r.exit_code == 2, r.output
    assert "another source" in r.output and str(p) in r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("*.gguf"))
