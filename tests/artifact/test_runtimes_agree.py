"""Which runtimes load an artifact: one answer from its contents, and every place that says it agrees.

For every recipe and both adaptive granularities: ``ArtifactView.runtimes``,
``inspect`` (API and CLI), ``verify`` and the model card ``publish`` writes
say the same thing; verify fails exactly the artifacts whose stored
``ds4quant.runtimes`` key disagrees (issue 8: an expert-granularity convert
with plain candidates stored ``['ds4quant', 'lucebox']`` for compact stacks).
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from gguf import GGUFValueType as VT

from ds4quant import names
from ds4quant.artifact.view import open_artifact
from ds4quant.cli import cli
from ds4quant.inspect import inspect_artifact
from ds4quant.publish import model_card
from ds4quant.verify import verify
from tests._verify_util import rewrite
from tests.artifact.conftest import ADAPTIVE, UNIFORM

ALL = UNIFORM + tuple(ADAPTIVE) + ("adaptive-tensor", "handmade")


def _card_runtimes(card: str) -> list[str]:
    line = next(x for x in card.splitlines() if x.startswith("Runtimes that can load every tensor"))
    return [p.split("**")[1] for p in line.split(":", 1)[1].split(",") if "**" in p]


@pytest.mark.parametrize("kind", ALL)
def test_view_inspect_verify_and_card_agree(kind, kinds):
    path = kinds(kind)
    v = open_artifact(path)
    compact = any(s.compact for s in v.stacks)
    mix = bool(v.mix_tensors)
    # the rule, restated: compact stacks load in ds4quant only; MIX needs Lucebox blobs for Lucebox
    lucebox = not compact and (not mix or v.lucebox_books)
    assert ("lucebox" in v.runtimes) == (lucebox and not mix)
    # MIX types (105/106) exist only in MIX-capable Lucebox builds
    assert ("lucebox-mix" in v.runtimes) == (lucebox and mix)
    assert v.runtimes[0] == "ds4quant"

    ins = inspect_artifact(path)
    assert ins.runtimes == v.runtimes and ins.to_json()["runtimes"] == list(v.runtimes)
    res = CliRunner().invoke(cli, ["inspect", str(path)])
    assert f"loadable by: {', '.join(v.runtimes)}" in res.output

    rep = verify(path)
    assert rep.runtimes == v.runtimes and rep.summary["runtimes"] == list(v.runtimes)
    assert _card_runtimes(model_card(rep, path.name)) == list(v.runtimes)
    # each runtime's requirement (which Lucebox build) is spelled out in the card and by inspect
    from ds4quant.artifact.runtimes import needs

    card = model_card(rep, path.name)
    for r in v.runtimes:
        assert f"- **{r}**: {needs(r)}" in card and f"  {r}: {needs(r)}" in res.output

    agree = set(v.stored_runtimes) == set(v.runtimes)
    checks = [c for c in rep.checks if c.name == "runtimes"]
    assert len(checks) == 1 and checks[0].ok == agree
    assert rep.ok == agree, [c.one_line() for c in rep.failed]
    if not agree:  # inspect says why verify will fail
        assert "ds4quant verify fails it" in res.output


@pytest.mark.parametrize("kind", ALL)
def test_convert_stores_what_the_contents_allow(kind, kinds):
    v = open_artifact(kinds(kind))
    assert set(v.stored_runtimes) == set(v.runtimes)


def test_a_key_that_claims_lucebox_for_compact_stacks_fails_verify(kinds, tmp_path):
    src = kinds("adaptive-expert-mix")
    assert open_artifact(src).stored_runtimes == ("ds4quant",) and verify(src).ok
    bad = rewrite(src, tmp_path / "lie", kv={names.KEY_RUNTIMES: (["ds4quant", "lucebox"], VT.ARRAY, VT.STRING)})
    rep = verify(bad)
    assert not rep.ok
    (c,) = rep.failed
    assert c.name == "runtimes" and "lucebox" in c.detail and c.file.endswith(".gguf")
    res = CliRunner().invoke(cli, ["verify", str(bad), "--json"])
    assert res.exit_code == 1
    assert [x["name"] for x in json.loads(res.output)["checks"] if not x["ok"]] == ["runtimes"]
    # and a key that leaves a runtime out fails too: the key must say exactly what the contents allow
    strix = kinds("strix")
    short = rewrite(strix, tmp_path / "short", kv={names.KEY_RUNTIMES: (["ds4quant"], VT.ARRAY, VT.STRING)})
    assert [c.name for c in verify(short).failed] == ["runtimes"]
