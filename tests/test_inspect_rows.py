"""inspect holds every tensor to its codec's row rule, as verify's shapes check does (one rule,
``artifact.qtypes.row_rule_problem``). Before, inspect listed a rocmfp2_mix tensor of 32-weight
rows (its byte size cannot match: MIX rows come in 128s) and exited 0."""

from __future__ import annotations

from click.testing import CliRunner

from ds4quant.artifact.qtypes import row_rule_problem
from ds4quant.artifact.view import open_artifact
from ds4quant.cli import cli
from ds4quant.verify import verify
from tests.artifact.hostile import ROCMFP2_MIX, RawTensor, _with_tensors


def test_inspect_refuses_a_row_its_qtype_cannot_hold_and_verify_agrees(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(_with_tensors(RawTensor("t", [32, 2], ROCMFP2_MIX, 0)))
    res = CliRunner().invoke(cli, ["inspect", str(bad)])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ds4quant: error: bad.gguf: tensor t: ne[0] = 32")
    assert "128" in lines[0] and "rocmfp2_mix" in lines[0]
    shapes = [c for c in verify(bad).failed if c.name == "shapes"]
    assert [c.detail for c in shapes] == [row_rule_problem("rocmfp2_mix", 32)]
    # nor does the view list an engine that could load it: ds4quant is excluded with the reason
    with open_artifact(bad) as v:
        assert v.runtimes == () and v.runtimes_excluded["ds4quant"][0].startswith("tensor t: ne[0] = 32")
    good = tmp_path / "good.gguf"
    good.write_bytes(_with_tensors(RawTensor("t", [128, 2], ROCMFP2_MIX, 0)))
    assert CliRunner().invoke(cli, ["inspect", str(good)]).exit_code == 0


def test_row_rule():
    assert row_rule_problem("rocmfp2_mix", 256) is None and row_rule_problem("rocmfp3", 32) is None
    assert "multiple of 32" in row_rule_problem("rocmfp3", 48)
    assert row_rule_problem("q4_k", 7) is None  # standard ggml types: the reader holds them to their block


def test_no_engine_claims_a_tensor_whose_rows_break_its_rule():
    from ds4quant.artifact.runtimes import Tensor, decide

    good = decide({}, {"t": Tensor("rocmfp3", (64, 2))})
    assert "ds4quant" in good.runtimes
    bad = decide({}, {"t": Tensor("rocmfp3", (48, 2)), "u": Tensor("rocmfp3", (64, 2))})
    assert bad.runtimes == ()
    assert all(why[0].startswith("tensor t: ne[0] = 48") for why in bad.excluded.values())
    assert "ds4quant" in bad.excluded
