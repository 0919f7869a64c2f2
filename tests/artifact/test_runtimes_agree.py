"""Which runtimes load an artifact: one answer from its whole header, and every place that says it agrees.

For every recipe, both adaptive granularities, the Lucebox build variants
(rocmfp2_affine, MIX with embedded-only books) and a tiny DS4 in llama.cpp's
shape with both dense types: ``ArtifactView.runtimes``, ``inspect`` (API and
CLI, with why each engine is left out), ``verify`` and the model card
``publish`` writes say the same thing; verify fails exactly the artifacts
whose stored ``ds4quant.runtimes`` key claims more than the contents allow
(an expert-granularity convert with plain candidates once stored
``['ds4quant', 'lucebox']`` for compact stacks).
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from gguf import GGUFValueType as VT

from ds4quant import names
from ds4quant.artifact.runtimes import engine_of
from ds4quant.artifact.view import open_artifact
from ds4quant.cli import cli
from ds4quant.formats import QTYPES
from ds4quant.inspect import inspect_artifact
from ds4quant.publish import model_card
from ds4quant.verify import verify
from tests._verify_util import rewrite
from tests.artifact.conftest import ADAPTIVE, LLAMA, UNIFORM, VARIANTS

ALL = UNIFORM + tuple(ADAPTIVE) + ("adaptive-tensor", "handmade") + VARIANTS + LLAMA


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
    lb = [r for r in v.runtimes if r.startswith("lucebox")]
    assert bool(lb) == lucebox
    # MIX types (105/106) exist only in MIX-capable Lucebox builds; books only embedded say so
    assert all(("-mix" in r) == mix and r.endswith("-embedded") == (mix and not v.lucebox_loose_books) for r in lb)
    # type 107: rocmfp2 needs a build without ROCMFP2_AFFINE, rocmfp2_affine one with it
    q107 = {QTYPES[i.qtype].name for i in v.tensors.values() if i.ggml_type == 107}
    assert all(("affine" in r) == ("rocmfp2_affine" in q107) for r in lb if q107)
    # llama.cpp: exactly the artifacts in its shape, with its keys, of types it knows
    assert ("llama.cpp" in v.runtimes) == kind.startswith("llama-")
    assert v.runtimes[0] == "ds4quant"
    assert set(v.runtimes_excluded) | {engine_of(r) for r in v.runtimes} == {"ds4quant", "lucebox", "llama.cpp",
                                                                             "gguf-py"}

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
    # and each engine left out, with why, in inspect (API, CLI), verify's record and the card
    assert ins.runtimes_excluded == rep.runtimes_excluded == v.runtimes_excluded
    for eng, why in v.runtimes_excluded.items():
        assert f"not loadable by {eng}: {'; '.join(why)}" in res.output
        assert f"Not loadable by **{eng}**: {'; '.join(why)}." in card

    agree = set(v.stored_runtimes) <= set(v.runtimes)
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
    # a key that leaves a runtime out claims nothing false: it passes, and the check says what else loads it
    strix = kinds("strix")
    short = rewrite(strix, tmp_path / "short", kv={names.KEY_RUNTIMES: (["ds4quant"], VT.ARRAY, VT.STRING)})
    rep = verify(short)
    (c,) = [c for c in rep.checks if c.name == "runtimes"]
    assert rep.ok and c.ok and "lucebox" in c.detail and "does not claim" in c.detail


def test_llama_cpp_claims_follow_the_whole_header(kinds, tmp_path):
    """A planted missing key or wrong type takes the llama.cpp claim away, and verify fails a key that keeps it."""
    from ds4quant.artifact.llama_cpp import KEYS

    art = kinds("llama-mxfp4")
    assert "llama.cpp" in open_artifact(art).stored_runtimes and verify(art).ok
    kv = open_artifact(art).kv
    required = [r.key for r in KEYS if r.required]
    plants = {
        "missing expert_weights_norm": {names.KEY_EXPERT_WEIGHTS_NORM: None},
        "missing gating": {names.KEY_EXPERT_GATING_FUNC: None},
        "missing merges": {names.KEY_TOK_MERGES: None},
        "u64 original context": {names.KEY_ROPE_SCALING_ORIG_CTX: (65536, VT.UINT64, None)},
        "u32 weights norm": {names.KEY_EXPERT_WEIGHTS_NORM: (1, VT.UINT32, None)},
        "unknown rope scaling": {names.KEY_ROPE_SCALING_TYPE: ("ntk", VT.STRING, None)},
        "short clamp array": {names.KEY_SWIGLU_CLAMP: ([10.0], VT.ARRAY, VT.FLOAT32)},
    }
    assert {names.KEY_EXPERT_WEIGHTS_NORM, names.KEY_EXPERT_GATING_FUNC} <= set(required) <= set(kv)
    for what, edit in plants.items():
        bad = rewrite(art, tmp_path / what.replace(" ", "-"), kv=edit)
        v = open_artifact(bad)
        assert "llama.cpp" not in v.runtimes and "llama.cpp" in v.runtimes_excluded, what
        key = next(iter(edit))
        assert any(key in w for w in v.runtimes_excluded["llama.cpp"]), (what, v.runtimes_excluded)
        # the rewritten file still claims llama.cpp: verify fails exactly that claim
        rep = verify(bad)
        assert [c.name for c in rep.failed] == ["runtimes"], (what, [c.one_line() for c in rep.failed])
        assert "llama.cpp" in rep.failed[0].detail
