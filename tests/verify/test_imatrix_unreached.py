"""verify --imatrix says which experts the calibration never reached, and how they fare unweighted.

Before, an expert with no importance data (the calibration routed no token to it) made the
weighted figure of its whole stack, and so of every routed expert, disappear without a word.
"""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from ds4quant import formats
from ds4quant.artifact import read_gguf_set
from ds4quant.calib.imatrix import make_imatrix, write_imatrix_gguf
from ds4quant.cli import cli
from ds4quant.sources.official import open_source
from ds4quant.verify import verify
from tests._verify_util import SAMPLE, gguf_of, strix_artifact

UNREACHED = (3, 7)  # blk.1's experts the calibration never routed a token to


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("unreached")
    strix = strix_artifact(root / "strix")
    rng = np.random.default_rng(0)
    sums = {}
    for layer in range(4):
        for proj, cols in (("gate", 256), ("up", 256), ("down", 128)):
            counts = np.full(16, 10.0, np.float32)
            if layer == 1:
                counts[list(UNREACHED)] = 0.0
            sums[f"blk.{layer}.ffn_{proj}_exps.weight"] = (rng.uniform(0.1, 4, (16, cols)).astype(np.float32), counts)
    path = root / "imatrix.gguf"
    write_imatrix_gguf(path, make_imatrix(sums))
    return strix, path, sums


def test_unreached_experts_are_counted_and_their_unweighted_error_reported(case):
    strix, path, sums = case
    rep = verify(strix, source=SAMPLE, imatrix=path)
    assert rep.ok, [c.one_line() for c in rep.failed]
    name = "blk.1.ffn_down_exps.weight"
    t = next(t for t in rep.tensors if t.name == name)
    assert t.errors.unreached == UNREACHED
    # weighted over the reached experts, unweighted over the others: computed here by hand
    raw = np.asarray(read_gguf_set(gguf_of(strix)).tensor_data(name))
    per = raw.size // 16
    wsse = wssx = usse = ussx = 0.0
    with open_source(SAMPLE) as src:
        for e in range(16):
            x = src.read_dequantized(f"layers.1.ffn.experts.{e}.w2.weight").astype(np.float64)
            y = formats.decode("rocmfp3", raw[e * per:(e + 1) * per], 128).astype(np.float64)
            if e in UNREACHED:
                usse += float(np.sum((x - y) ** 2))
                ussx += float(np.sum(x * x))
                continue
            w = (sums[name][0][e] / 10.0).astype(np.float32).astype(np.float64)[None, :]
            wsse += float(np.sum(w * (x - y) ** 2))
            wssx += float(np.sum(w * x * x))
    assert t.errors.weighted_rel_error == pytest.approx(wsse / wssx, rel=1e-9)
    assert t.errors.unreached_rel_mse == pytest.approx(usse / ussx, rel=1e-9)
    un = rep.summary["experts_unreached"]
    assert un["experts"] == 2 and un["tensor_experts"] == 6 and un["first"][0] == "blk.1.ffn_down_exps.weight expert 3"
    assert un["weights"] == 2 * (256 * 128 * 2 + 128 * 256)
    assert un["sqnr_db"] is not None and rep.summary["expert_weighted_rel_error"] is not None
    assert rep.to_json()["summary"]["experts_unreached"] == un


def test_the_cli_says_so_with_the_count(case):
    strix, path, _ = case
    res = CliRunner().invoke(cli, ["verify", str(strix), "--source", str(SAMPLE), "--imatrix", str(path)])
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.output.splitlines() if ln.startswith("imatrix:"))
    assert "never reached 2 expert(s) (6 expert matrices" in line and "unweighted SQNR" in line
    assert "weighted rel error" in res.output


def test_a_full_imatrix_reports_nothing_unreached(case, tmp_path):
    strix, _, sums = case
    full = {k: (v, np.full(16, 10.0, np.float32)) for k, (v, _) in sums.items()}
    path = tmp_path / "full.gguf"
    write_imatrix_gguf(path, make_imatrix(full))
    rep = verify(strix, source=SAMPLE, imatrix=path)
    assert "experts_unreached" not in rep.summary and all(not t.errors.unreached for t in rep.tensors if t.errors)


def test_the_report_names_them_too(case, tmp_path):
    from ds4quant.publish.report import write_report

    strix, path, _ = case
    md = write_report(verify(strix, source=SAMPLE, imatrix=path), tmp_path / "rep").read_text()
    assert "| experts the calibration never reached | 2 (6 expert matrices; left out of the weighted error)" in md
