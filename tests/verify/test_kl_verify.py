"""verify --fidelity --ctx: llama.cpp's figures beside today's on samples/ds4-copy."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[2]
COPY = ROOT / "samples" / "ds4-copy"


@pytest.fixture(scope="module")
def mx(tmp_path_factory):
    from ds4quant.convert import convert

    out = tmp_path_factory.mktemp("klv") / "mx"
    convert(COPY, out, "mxfp4", force=True, command=["test"])
    return out


def test_chunked_figures_beside_todays(copy_rep):
    from ds4quant.records import FidelityReport

    rep = copy_rep
    f = rep.fidelity
    k = f.kl
    assert k is not None and "chunks of 64" in f.eval and "llama.cpp" in k.chunking
    assert k.tokens == f.eval_tokens and k.tokens % (64 - 1 - 32) == 0
    # mxfp4 of an MXFP4 checkpoint is the source: both definitions agree on ~0
    assert k.kld_mean < 1e-6 and k.kld_max < 1e-5 and k.same_top1 == 1.0 and k.rms_dp < 1e-4
    assert k.ppl_ratio == pytest.approx(1.0, abs=1e-4) and f.logits.kl_mean < 1e-6
    assert f.layers and f.moe_output_sha256 is None  # today's per-layer figures stay
    j = rep.to_json()["fidelity"]
    assert j["llama_cpp"]["chunking"] == k.chunking and "kl_mean" in j
    assert FidelityReport.from_json(j).kl == k
    assert "llama.cpp figures" in next(c for c in rep.checks if c.name == "fidelity.kl").detail


def test_ctx_refusals(mx, tmp_path):
    from ds4quant.errors import BadInputError
    from ds4quant.verify import verify

    with pytest.raises(BadInputError, match="--fidelity"):
        verify(mx, source=COPY, ctx_size=64)
    short = tmp_path / "short.txt"
    short.write_text("abc")
    with pytest.raises(BadInputError, match="at least 128"):
        verify(mx, source=COPY, fidelity=True, text=short, ctx_size=64)


@pytest.fixture(scope="module")
def copy_rep(mx):
    from ds4quant.verify import verify

    return verify(mx, source=COPY, fidelity=True, mode="fast", protocol="exact-copy", copy_sets=2, ctx_size=64)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from ds4quant.verify.reference_side import make_reference_base

    out = tmp_path_factory.mktemp("base") / "copy.base"
    s = make_reference_base(COPY, out, protocol="exact-copy", copy_sets=2, ctx_size=64)
    assert s["max_storage_error_nats"] < 1.3e-4
    return out


def test_base_gives_the_same_figures_without_running_the_reference(mx, copy_rep, base):
    from ds4quant.verify import verify

    a = copy_rep.fidelity
    b = verify(mx, source=COPY, fidelity=True, mode="fast", protocol="exact-copy", copy_sets=2, ctx_size=64,
               reference=base).fidelity
    assert b.kl.same_top1 == a.kl.same_top1 and abs(b.kl.kld_mean - a.kl.kld_mean) < 1e-4
    assert abs(b.kl.rms_dp - a.kl.rms_dp) < 1e-4 and b.kl.ppl_cand == a.kl.ppl_cand
    assert b.reference_response_sha256 == a.reference_response_sha256 and b.response_sha256 == a.response_sha256
    assert b.exact_copy.reference_sets == a.exact_copy.reference_sets and b.exact_copy.sets == a.exact_copy.sets
    assert b.layers == ()  # the per-layer errors need the reference's block inputs


def test_cli_refuses_a_flipped_or_mismatched_base(mx, base, tmp_path):
    from click.testing import CliRunner

    from ds4quant.cli import cli

    args = ["verify", str(mx), "--source", str(COPY), "--fidelity", "--copy-sets", "2", "--ctx", "64"]
    r = CliRunner().invoke(cli, args + ["--reference", str(base)])  # made with the protocol, asked without
    assert r.exit_code == 2 and "another protocol" in r.output and "sound" not in r.output
    bad = tmp_path / "flipped.base"
    data = bytearray(base.read_bytes())
    data[len(data) // 3] ^= 0x40
    bad.write_bytes(bytes(data))
    r = CliRunner().invoke(cli, args + ["--protocol", "exact-copy", "--reference", str(bad)])
    assert r.exit_code == 2 and "truncated or corrupt" in r.output and "fidelity" not in r.output.split("corrupt")[1]
    bad.write_bytes(base.read_bytes()[:-1000])
    r = CliRunner().invoke(cli, args + ["--protocol", "exact-copy", "--reference", str(bad)])
    assert r.exit_code == 2 and "truncated or corrupt" in r.output


def test_copy_sets_interval_decides_the_check(copy_rep):
    from ds4quant.records import ExactCopyScore

    rep = copy_rep
    ec = rep.fidelity.exact_copy
    assert len(ec.sets) == len(ec.reference_sets) == 2 and ec.sets[0] == ec.passes and ec.trials == 60
    assert ec.per60 == pytest.approx(sum(ec.sets) / 2)
    assert ec.interval[0] <= ec.per60 <= ec.interval[1] and "Wilson" in ec.interval_method
    assert ec.sets == ec.reference_sets  # mxfp4 of the MXFP4 source copies as the source does
    for f in ec.failed:
        assert f["position"] >= 0 and f["preferred_token"] >= 0
    check = next(c for c in rep.checks if c.name == "fidelity.exact_copy")
    assert check.ok and "identifier sets" in check.detail
    assert ExactCopyScore.from_json(ec.to_json()) == ec


TINY = ROOT / "samples" / "ds4-tiny"


def test_routing_shortcut_at_the_models_k_changes_nothing(tmp_path):
    from ds4quant.convert import convert
    from ds4quant.records import FidelityReport
    from ds4quant.verify import verify

    art = tmp_path / "tiny-mx"
    convert(TINY, art, "mxfp4", force=True, command=["test"])
    empty = tmp_path / "drop.json"
    empty.write_text("{}")
    rep = verify(art, source=TINY, fidelity=True, mode="fast", experts_per_token=4, drop_experts=empty)
    f = rep.fidelity
    ap = f.approximation
    assert ap is not None and ap.experts_per_token == 4 and ap.dropped == 0
    assert ap.kl == f.kl and ap.logits == f.logits  # bit-identical figures
    j = rep.to_json()["fidelity"]
    assert FidelityReport.from_json(j).approximation == ap


def test_a_shortcut_the_model_cannot_take_is_refused_before_anything_runs(mx, tmp_path):
    from click.testing import CliRunner

    from ds4quant.cli import cli

    bad = tmp_path / "drop.json"
    bad.write_text('{"2": [40]}')
    base = ["verify", str(mx), "--source", str(COPY), "--fidelity"]
    r = CliRunner().invoke(cli, base + ["--drop-experts", str(bad)])
    assert r.exit_code == 2 and "expert 40 outside 0..31" in r.output and str(bad) in r.output
    r = CliRunner().invoke(cli, base + ["--experts-per-token", "33"])
    assert r.exit_code == 2 and "--experts-per-token" in r.output
