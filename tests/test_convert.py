"""`ds4quant convert` / `inspect` on the shipped tiny DeepSeek-V4 checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ds4quant import formats
from ds4quant.artifact import check_ds4_header, read_gguf_set, read_manifest, sha256_file
from ds4quant.cli import cli
from ds4quant.convert import WORK_DIR, convert
from ds4quant.errors import BadInputError, Ds4quantError, ResumeMismatchError, ShapeError
from ds4quant.sources.official import open_source

SAMPLE = Path(__file__).resolve().parents[1] / "samples" / "ds4-tiny"


@pytest.fixture(scope="module")
def strix(tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "strix"
    rep = convert(SAMPLE, out, "rocmfp2-strix", threads=1)
    return out, rep


def _gguf(out: Path) -> Path:
    return next(p for p in sorted(out.iterdir()) if p.suffix == ".gguf")


def test_strix_artifact_is_a_tagged_ds4_gguf_with_a_manifest(strix):
    out, rep = strix
    g = read_gguf_set(_gguf(out))
    assert check_ds4_header(g.kv) == []
    t = g.tensors
    assert t["blk.2.ffn_gate_exps.weight"].qtype == "rocmfp2"
    assert t["blk.2.ffn_up_exps.weight"].qtype == "rocmfp2"
    assert t["blk.2.ffn_down_exps.weight"].qtype == "rocmfp3"
    assert t["blk.2.ffn_gate_exps.weight"].shape == (256, 128, 16)  # [in, out, n_expert]
    assert t["blk.2.ffn_down_exps.weight"].shape == (128, 256, 16)
    assert t["blk.0.attn_q_a.weight"].qtype == "bf16"  # dense policy
    assert t["blk.0.attn_sinks.weight"].qtype == "f32"  # keeps source precision
    assert t["blk.0.ffn_gate_tid2eid.weight"].qtype == "i32"
    man = read_manifest(out / "manifest.json")
    assert {f.name for f in man.files} == {_gguf(out).name}
    for f in man.files:
        assert sha256_file(out / f.name) == f.sha256
    for entry in man.tensors:
        data = g.tensor_data(entry.name)
        import hashlib

        assert hashlib.sha256(bytes(data)).hexdigest() == entry.sha256
    assert not (out / WORK_DIR).exists()
    # 2/3 of the expert weights at 2.5 bpw, 1/3 at 3.5
    assert rep.bpw_experts == pytest.approx((2 * 2.5 + 3.5) / 3)


def test_expert_bytes_equal_direct_encoding_of_the_source(strix):
    out, _ = strix
    g = read_gguf_set(_gguf(out))
    src = open_source(SAMPLE)
    for e in (0, 7, 15):
        w = src.read_dequantized(f"layers.3.ffn.experts.{e}.w2.weight")
        want = formats.encode("rocmfp3", w)
        data = np.asarray(g.tensor_data("blk.3.ffn_down_exps.weight")).reshape(16, -1)
        assert np.array_equal(data[e], want.reshape(-1))


def test_thread_count_never_changes_bytes(strix, tmp_path):
    out, _ = strix
    out2 = tmp_path / "t2"
    convert(SAMPLE, out2, "rocmfp2-strix", threads=2)
    assert sha256_file(_gguf(out)) == sha256_file(_gguf(out2))


def test_mxfp4_recipe_is_lossless_through_gguf_py(tmp_path):
    gguf = pytest.importorskip("gguf")
    out = tmp_path / "mx"
    convert(SAMPLE, out, "mxfp4")
    r = gguf.GGUFReader(str(_gguf(out)))
    src = open_source(SAMPLE)
    checked = 0
    for t in r.tensors:
        if t.name == "blk.3.ffn_up_exps.weight":
            assert t.tensor_type == gguf.GGMLQuantizationType.MXFP4
            deq = gguf.quants.dequantize(t.data, t.tensor_type)
            for e in range(16):
                w = src.read_dequantized(f"layers.3.ffn.experts.{e}.w3.weight")
                assert np.array_equal(deq[e], w)
                checked += 1
    assert checked == 16


def test_overrides_last_wins_and_the_plan_records_asked_and_got(tmp_path):
    rep = convert(
        SAMPLE, tmp_path / "o", "rocmfp3",
        tensor_types=[r"blk\.2\.ffn_.*_exps=rocmfp4", r"blk\.2\.ffn_down_exps=rocmfp8", "output\\.weight=q8_0"],
    )
    plan = {c.name: c for c in rep.plan}
    assert plan["blk.2.ffn_gate_exps.weight"].qtype == "rocmfp4"
    assert plan["blk.2.ffn_down_exps.weight"].qtype == "rocmfp8"
    assert plan["blk.2.ffn_down_exps.weight"].rule == r"override:blk\.2\.ffn_down_exps"
    assert plan["blk.3.ffn_down_exps.weight"].qtype == "rocmfp3"
    assert plan["output.weight"].qtype == "q8_0" and plan["output.weight"].asked == "q8_0"
    g = read_gguf_set(_gguf(tmp_path / "o"))
    assert g.tensors["blk.2.ffn_down_exps.weight"].qtype == "rocmfp8"


def test_a_qtype_whose_block_does_not_divide_a_tensor_is_refused_and_nothing_is_left(tmp_path):
    out = tmp_path / "bad"
    with pytest.raises(ShapeError) as ei:
        convert(SAMPLE, out, "rocmfp3", tensor_types=[r"output_hc_base\.weight=rocmfp3"])
    assert "output_hc_base.weight" in str(ei.value)
    assert not out.exists()


def test_cli_bad_input_is_one_line_exit_2_and_leaves_no_artifact(tmp_path):
    broken = tmp_path / "src"
    shutil.copytree(SAMPLE, broken)
    (broken / "model-00002-of-00002.safetensors").unlink()
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["convert", str(broken), str(out)])
    assert res.exit_code == 2
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "model-00002-of-00002.safetensors" in lines[0]
    assert not out.exists()


def test_truncated_shard_is_refused(tmp_path):
    broken = tmp_path / "src"
    shutil.copytree(SAMPLE, broken)
    shard = broken / "model-00001-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    out = tmp_path / "out"
    with pytest.raises(Ds4quantError) as ei:
        convert(broken, out)
    assert "model-00001-of-00002.safetensors" in str(ei.value)
    assert not out.exists()


def test_non_empty_output_folder_needs_force(tmp_path, strix):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(BadInputError):
        convert(SAMPLE, out, "rocmfp3")
    assert (out / "keep.txt").exists()


class _Kill(BaseException):
    """Stands in for SIGKILL/Ctrl-C: not a Ds4quantError, so the journal stays."""


def test_interrupted_run_resumes_to_identical_bytes(tmp_path, strix):
    out_ref, _ = strix
    out = tmp_path / "r"
    seen = []

    def killer(ev):
        seen.append(ev.item)
        if len(seen) == 40:
            raise _Kill()

    with pytest.raises(_Kill):
        convert(SAMPLE, out, "rocmfp2-strix", progress=killer)
    # a killed run leaves no file that looks complete
    assert not list(out.glob("*.gguf")) and not (out / "manifest.json").exists()
    assert (out / WORK_DIR / "journal.json").exists()

    # resuming with another recipe is refused, naming both fingerprints
    with pytest.raises(ResumeMismatchError):
        convert(SAMPLE, out, "rocmfp3", resume=True)

    rep = convert(SAMPLE, out, "rocmfp2-strix", resume=True, threads=2)
    assert rep.reused >= 39
    assert sha256_file(_gguf(out)) == sha256_file(_gguf(out_ref))


def test_split_artifact_reads_back_as_one(tmp_path, strix):
    out_ref, _ = strix
    out = tmp_path / "s"
    rep = convert(SAMPLE, out, "rocmfp2-strix", split_max_size="1M")
    assert len(rep.files) > 2
    assert all("-of-" in p.name for p in rep.files)
    g = read_gguf_set(rep.files[0])
    ref = read_gguf_set(_gguf(out_ref))
    assert set(g.tensors) == set(ref.tensors)
    name = "blk.3.ffn_down_exps.weight"
    assert bytes(g.tensor_data(name)) == bytes(ref.tensor_data(name))


def test_convert_json_has_the_documented_fields(tmp_path):
    res = CliRunner().invoke(cli, ["convert", str(SAMPLE), str(tmp_path / "j"), "--recipe", "rocmfp4", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    for key in ("artifact", "files", "bytes", "tensors", "bpw_experts", "seconds"):
        assert key in d
    assert d["bpw_experts"] == pytest.approx(4.5)


def test_inspect_json_on_folder_and_on_plain_gguf(strix):
    out, rep = strix
    for target in (out, _gguf(out)):
        res = CliRunner().invoke(cli, ["inspect", str(target), "--json"])
        assert res.exit_code == 0, res.output
        d = json.loads(res.output)
        assert d["bpw_experts"] == pytest.approx(rep.bpw_experts)
        names = {t["name"] for t in d["tensors"]}
        assert "blk.2.ffn_down_exps.weight" in names
        row = next(t for t in d["tensors"] if t["name"] == "blk.2.ffn_down_exps.weight")
        assert row["qtype"] == "rocmfp3" and row["ggml_type"] == 104 and row["variant"] == "fp3"
        assert row["bpw"] == pytest.approx(3.5)


def test_inspect_refuses_a_non_gguf_with_exit_2(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOTGGUF" + b"\0" * 64)
    res = CliRunner().invoke(cli, ["inspect", str(bad)])
    assert res.exit_code == 2
    assert str(bad) in res.output
