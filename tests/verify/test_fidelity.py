"""verify --fidelity through the runtime on samples/ds4-copy (and ds4-tiny as the model that cannot copy)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[2]
COPY = ROOT / "samples" / "ds4-copy"
TINY = ROOT / "samples" / "ds4-tiny"


@pytest.fixture(scope="module")
def mx(tmp_path_factory):
    from ds4quant.convert import convert

    out = tmp_path_factory.mktemp("fid") / "mx"
    convert(COPY, out, "mxfp4", force=True, command=["test"])
    return out


@pytest.fixture(scope="module")
def fast_rep(mx):
    from ds4quant.verify import verify

    return verify(mx, source=COPY, fidelity=True, mode="fast", protocol="exact-copy")


@pytest.fixture(scope="module")
def exact_rep(mx):
    from ds4quant.verify import verify

    split = {L: {"cpu:0": tuple(range(0, 32, 2)), "cpu:1": tuple(range(1, 32, 2))} for L in range(4)}
    return verify(mx, source=COPY, fidelity=True, mode="exact", placements=(None, split))


def _checks(rep, prefix="fidelity"):
    return {c.name: c for c in rep.checks if c.name.startswith(prefix)}


def test_mxfp4_fast_is_the_source(fast_rep):
    f = fast_rep.fidelity
    assert f.measured and f.mode == "fast"
    assert f.logits.kl_mean < 1e-6 and f.logits.kl_p99 < 1e-6
    assert f.logits.top1 == 1.0
    assert abs(f.logits.ppl_ratio - 1.0) < 1e-4
    assert f.response_matches_reference
    assert [r.layer for r in f.layers] == [0, 1, 2, 3]
    assert all(r.local < 1e-5 for r in f.layers)
    assert all(c.ok for c in _checks(fast_rep).values()), [c.one_line() for c in fast_rep.failed]
    assert {"fidelity.dense", "fidelity.kl", "fidelity.exact_copy"} <= set(_checks(fast_rep))
    j = fast_rep.to_json()["fidelity"]
    for key in ("kl_mean", "kl_p99", "top1", "ppl_ratio", "response_sha256", "moe_output_sha256", "exact_copy"):
        assert key in j
    assert len(j["response_sha256"]) == 64


def test_exact_copy_protocol_on_the_lossless_artifact(fast_rep):
    ec = fast_rep.fidelity.exact_copy
    assert ec.trials == 60
    assert 59 <= ec.passes <= 60
    assert ec.reference_passes >= 59
    assert len(ec.failed) == 60 - ec.passes


def test_exact_mode_reports_its_own_cost_and_is_placement_independent(exact_rep):
    f = exact_rep.fidelity
    # exact mode's own arithmetic (int8 activations) is not the float reference: shown, not hidden
    assert 0.0 < f.logits.kl_mean < 0.01
    assert 0.95 <= f.logits.top1 <= 1.0
    assert len(f.moe_output_sha256) == 64
    sp = f.second
    assert f.identical
    assert sp.moe_output_sha256 == f.moe_output_sha256
    assert sp.response_sha256 == f.response_sha256
    assert _checks(exact_rep)["fidelity.identity"].ok


def _damage(mx: Path, out: Path) -> tuple[int, int]:
    """Copy ``mx``; scramble the codes of the most used expert of layer 1's gate stack and scale
    layer 3's shared down projection by 2. Returns (expert layer, dense layer)."""
    from ds4quant import names
    from ds4quant.artifact.view import open_artifact
    from ds4quant.runtime import fidelity as fd
    from ds4quant.verify.fidelity import builtin_docs, copy_task
    from ds4quant.verify._candidate import source_tokenizer

    shutil.copytree(mx, out)
    gguf = next(out.glob("*.gguf"))
    tok = fd.as_tokenizer(source_tokenizer(COPY))
    ids = [t for d in builtin_docs(copy_task(COPY)) for t in tok.encode(d)]
    with open_artifact(out) as v:
        tid = np.asarray(v.dense(names.tid2eid_name(1)))
        expert = int(np.bincount(tid[ids].reshape(-1), minlength=v.header.n_expert).argmax())
        path, off, n = v.expert_span(names.stack_name(1, "gate"), expert)
        dense = v.tensor(names.shared_name(3, "down"))
        before = bytes(np.asarray(v.tensor_data(dense.name))[:16])
    raw = bytearray(gguf.read_bytes())
    blocks = np.frombuffer(bytes(raw[off:off + n]), dtype=np.uint8).reshape(-1, 17).copy()  # mxfp4: e8m0 + 16 code bytes
    rng = np.random.default_rng(12)
    blocks[:, 1:] = rng.permuted(blocks[:, 1:], axis=1) ^ np.uint8(0x77)
    raw[off:off + n] = blocks.tobytes()
    assert bytes(raw[dense.offset:dense.offset + 16]) == before
    w = np.frombuffer(bytes(raw[dense.offset:dense.offset + dense.nbytes]), dtype="<u2").astype(np.uint32) << 16
    scaled = (w.view(np.float32) * np.float32(2.0)).view(np.uint32) >> 16  # exact in bf16
    raw[dense.offset:dense.offset + dense.nbytes] = scaled.astype("<u2").tobytes()
    gguf.write_bytes(bytes(raw))
    return 1, 3


def test_damaged_artifact_is_worse_and_names_its_layers(mx, fast_rep, tmp_path):
    from ds4quant.verify import verify

    exp_layer, dense_layer = _damage(mx, tmp_path / "bad")
    rep = verify(tmp_path / "bad", source=COPY, fidelity=True, mode="fast")
    f = rep.fidelity
    assert f.logits.kl_mean > 100 * max(fast_rep.fidelity.logits.kl_mean, 1e-9)
    err = {r.layer: r.local for r in f.layers}
    clean = max(err[L] for L in err if L not in (exp_layer, dense_layer))
    assert err[exp_layer] > 100 * clean and err[dense_layer] > 100 * clean
    assert not rep.ok  # the manifest hashes catch the edit too
    from ds4quant.publish.report import fidelity_section

    md = fidelity_section(rep, {})
    assert f"| {exp_layer} | {err[exp_layer]:.3e}" in md


def test_a_model_that_cannot_copy_scores_about_zero():
    from ds4quant.runtime import fidelity as fd
    from ds4quant.runtime.reference import load_reference
    from ds4quant.verify._candidate import one_thread

    with one_thread():
        res = fd.exact_copy(load_reference(TINY), fd.ByteTokenizer(), fd.ECHO)
    assert res.trials == 60 and res.passes <= 2


def test_protocol_refused_without_task_or_tokenizer(tmp_path):
    from ds4quant.convert import convert
    from ds4quant.errors import BadInputError
    from ds4quant.verify import verify

    out = tmp_path / "tiny"
    convert(TINY, out, "mxfp4", force=True, command=["test"])
    with pytest.raises(BadInputError, match="tokenizer.json and task.json"):
        verify(out, source=TINY, fidelity=True, protocol="exact-copy")
    with pytest.raises(BadInputError, match="--fidelity"):
        verify(out, protocol="exact-copy")
    with pytest.raises(BadInputError, match="source"):
        verify(out, fidelity=True)


def test_report_and_card_carry_the_fidelity_section(fast_rep, tmp_path):
    from ds4quant.publish.report import PLOT_FIDELITY, write_report

    md = write_report(fast_rep, tmp_path / "r").read_text()
    assert "KL mean / p99" in md and ("**60/60**" in md or "**59/60**" in md)
    assert "_Not measured" not in md
    assert (tmp_path / "r" / PLOT_FIDELITY).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_refuses_fidelity_options_without_fidelity(mx):
    from click.testing import CliRunner

    from ds4quant.cli import cli

    r = CliRunner().invoke(cli, ["verify", str(mx), "--protocol", "exact-copy"])
    assert r.exit_code == 2 and "--fidelity" in r.output
    r = CliRunner().invoke(cli, ["verify", str(mx), "--fidelity"])
    assert r.exit_code == 2 and "--source" in r.output


def test_verify_json_fidelity_block_keeps_its_keys_and_round_trips(fast_rep, exact_rep):
    """The "fidelity" object of `verify --json` is a public output: its keys, their order and
    the mode-dependent hashes as before the record replaced the dict; it reads back as the record."""
    from ds4quant.records import FidelityReport
    from tests.test_records import KEYS

    for rep, extra in ((fast_rep, []), (exact_rep, ["second_placement"])):
        j = rep.to_json()["fidelity"]
        assert list(j) == KEYS + ["llama_cpp"] + extra
        assert FidelityReport.from_json(j).to_json() == j
        assert j["placements"][0] == "cpu:0 (one CPU owner)"
    fj, ej = fast_rep.to_json()["fidelity"], exact_rep.to_json()["fidelity"]
    assert fj["mode"] == "fast" and fj["moe_output_sha256"] is None and len(fj["fast_moe_output_sha256"]) == 64
    assert ej["mode"] == "exact" and ej["fast_moe_output_sha256"] is None and len(ej["moe_output_sha256"]) == 64
    assert ej["placements"][1] == "placement" and ej["exact_copy"] is None
    assert {"passes", "trials", "failed", "task", "reference_passes", "sets", "interval_per_60"} <= set(fj["exact_copy"])
