"""samples/make_synthetic.py: the synthetic DS4 source, and benchmarks/convert.py on it."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "samples"))

import make_ds4_tiny as tiny  # noqa: E402
import _synthetic_values as sv  # noqa: E402
import make_synthetic as ms  # noqa: E402

from ds4quant.convert import convert  # noqa: E402
from ds4quant.sources.official import ENC_FP4, ENC_FP8, open_source  # noqa: E402

TINY = ms.preset("tiny")
# samples/ds4-tiny's dimensions (make_ds4_tiny.NATIVE_CONFIG)
DS4_TINY = ms.SyntheticSpec(layers=4, experts=16, hidden=256, moe_inter=128, vocab=512, topk=4, hash_layers=2,
                            compress_ratios=(0, 4, 128, 4), compress_rate_hca=16)


def _digest(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("syn") / "tiny"
    ms.make_synthetic(out, TINY, workers=1)
    return out


def test_regeneration_is_byte_identical_whatever_the_workers(tiny_src, tmp_path):
    again = tmp_path / "again"
    info = ms.make_synthetic(again, TINY, workers=3)
    assert _digest(again) == _digest(tiny_src)
    assert sorted(p.name for p in info.files) == sorted(p.name for p in tiny_src.glob("*.safetensors"))


def test_large_tensors_are_made_in_row_blocks_on_threads_with_the_same_bytes(tmp_path, monkeypatch):
    """The embedding and head come as seeded row blocks; made on several threads
    they are the same words in the same order (and the file the same bytes)."""
    monkeypatch.setattr(sv, "CHUNK_VALUES", 1 << 12)  # the tiny vocabulary's embedding in 32 blocks
    units = [u for u in ms.plan_units(TINY) if u.kind in ("f32", "bf16")
             and int(np.prod(u.tensors[-1].shape)) > sv.CHUNK_VALUES]
    assert units
    for u in units:
        (one,), (many,) = sv.make_unit(TINY, u), sv.make_unit(TINY, u)
        assert isinstance(one, sv.RowBlocks) and isinstance(many, sv.RowBlocks)
        many.workers = 4
        a, b = list(one), list(many)
        assert len(a) >= 2 and len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    ms.make_synthetic(tmp_path / "one", TINY, workers=1)
    ms.make_synthetic(tmp_path / "many", TINY, workers=4)
    assert _digest(tmp_path / "one") == _digest(tmp_path / "many")


def test_small_shards_split_the_same_tensors(tiny_src, tmp_path):
    out = tmp_path / "small-shards"
    info = ms.make_synthetic(out, replace(TINY, shard_size=200_000))
    assert len(info.files) > 3
    with open_source(out) as a, open_source(tiny_src) as b:
        assert a.tensor_names() == b.tensor_names()
        for n in a.tensor_names():
            assert np.array_equal(np.asarray(a.read(n)), np.asarray(b.read(n))), n


def test_open_source_accepts_it(tiny_src):
    with open_source(tiny_src) as src:
        c = src.config
        assert (c.num_hidden_layers, c.n_routed_experts, c.hidden_size, c.moe_intermediate_size, c.vocab_size) == (
            TINY.layers, TINY.experts, TINY.hidden, TINY.moe_inter, TINY.vocab)
        assert c.mlp_layer_types == ("hash_moe", "moe", "moe") and c.expert_dtype == "fp4"
        assert src.info("layers.1.ffn.experts.7.w2.weight").encoding == ENC_FP4
        assert src.info("layers.1.ffn.experts.7.w2.weight").shape_logical == (TINY.hidden, TINY.moe_inter)
        assert src.info("layers.2.attn.wq_b.weight").encoding == ENC_FP8
        assert src.info("layers.0.ffn.shared_experts.w1.weight").encoding == ENC_FP8
        assert src.info("embed.weight").dtype == "BF16" and src.info("norm.weight").dtype == "F32"
        t = np.asarray(src.read("layers.0.ffn.gate.tid2eid"))
        assert t.dtype == np.int64 and t.shape == (TINY.vocab, TINY.topk)
        assert t.min() >= 0 and t.max() < TINY.experts
        assert all(len(set(row)) == TINY.topk for row in t.tolist())  # distinct experts per token
        for n in src.weight_names():  # every value decodes finite
            if src.info(n).dtype != "I64":
                assert np.all(np.isfinite(src.read_dequantized(n))), n
    info = ms.describe(TINY)
    assert info.total_bytes == sum(p.stat().st_size for p in tiny_src.glob("*.safetensors")) - sum(
        8 + int.from_bytes(p.read_bytes()[:8], "little") for p in tiny_src.glob("*.safetensors"))


def test_layout_equals_the_ds4_tiny_sample(tmp_path):
    """Same dims as samples/ds4-tiny -> the same tensor names, dtypes, shapes and parsed config."""
    out = tmp_path / "like-tiny"
    ms.make_synthetic(out, DS4_TINY)
    with open_source(out) as a, open_source(REPO / "samples" / "ds4-tiny") as b:
        la = {n: (a.info(n).dtype, a.info(n).shape) for n in a.tensor_names()}
        lb = {n: (b.info(n).dtype, b.info(n).shape) for n in b.tensor_names()}
        assert la == lb
        assert a.config == b.config


@pytest.mark.parametrize("layer,expert,which", [(0, 0, "w1"), (1, 3, "w2"), (2, 7, "w3")])
def test_expert_encoder_matches_the_tiny_samples_fp4_encoder(layer, expert, which):
    x = ms.expert_values(TINY, layer, expert, which)
    packed, scales = ms.expert_fp4(TINY, layer, expert, which)
    ref_packed, ref_scales = tiny.encode_fp4(x)
    assert np.array_equal(packed.view(np.uint8), ref_packed.view(np.uint8))
    assert np.array_equal(scales, ref_scales)


def test_experts_are_heavy_tailed_with_near_dead_ones():
    spec = ms.preset("tiny", experts=32)
    dead = sv._dead_experts(spec, 1)
    assert len(dead) == 1
    rms = {e: float(np.sqrt(np.mean(ms.expert_values(spec, 1, e, "w1") ** 2))) for e in range(32)}
    live = [v for e, v in rms.items() if e not in dead]
    assert max(rms[e] for e in dead) < 1e-2 * min(live)  # near-dead: x 1e-3 magnitude
    assert max(live) / min(live) > 2.0  # log-normal per-expert scale spread
    x = ms.expert_values(spec, 1, 0, "w1")
    z = x / x.std()
    assert float(np.mean(z ** 4)) > 6.0  # a Gaussian has kurtosis 3
    col = np.sqrt(np.mean(np.stack([ms.expert_values(spec, 1, e, "w1") for e in range(4)]) ** 2, axis=(0, 1)))
    assert col.max() / np.median(col) > 3.0  # outlier input columns shared by the experts


def test_t_table_is_a_unit_variance_symmetric_student_t():
    main, tail = sv.T_MAIN, sv.T_TAIL
    k = np.arange(1, 65535)
    assert np.all(np.diff(main[1:65535]) >= 0) and np.all(np.diff(tail) >= 0)
    assert np.array_equal(main[k], -main[65535 - k])
    assert tail[0] < -200 and tail[-1] <= main[1]  # the tail goes on beyond the main table
    var = np.mean(main[k].astype(np.float64) ** 2)
    assert 0.95 < var < 1.0  # the last 2^-15 of the mass (in the tail table) carries the rest
    # t4 quantiles, closed form, against known values: P(T4 <= 2.776445) = 0.975
    assert sv._t4_quantile(np.array([0.975]))[0] == pytest.approx(2.776445, abs=1e-6)


def test_a_tensor_does_not_depend_on_the_model_size_or_order():
    small = ms.preset("tiny", layers=2)
    a = ms.expert_fp4(small, 0, 5, "w3")
    b = ms.expert_fp4(TINY, 0, 5, "w3")
    assert all(np.array_equal(u, v) for u, v in zip(a, b))
    c = ms.expert_fp4(replace(TINY, seed=1), 0, 5, "w3")
    assert not np.array_equal(a[0], c[0])


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="multiple of 128"):
        ms.preset("tiny", hidden=200)
    with pytest.raises(ValueError, match="unknown preset"):
        ms.preset("huge")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(FileExistsError):
        ms.make_synthetic(tmp_path / "full", TINY)


def test_presets_have_the_sizes_they_promise():
    bench = ms.describe(ms.preset("bench"))
    assert 0.9e9 < bench.expert_bytes < 1.05e9
    medium = ms.describe(ms.preset("medium"))
    assert 50e6 < medium.total_bytes < 100e6


@pytest.mark.parametrize("recipe,bpw", [("rocmfp2-strix", (8 * 10 * 2 + 8 * 14) / (32 * 3)), ("mxfp4", 17 * 8 / 32)])
def test_convert_runs_on_it(tiny_src, tmp_path, recipe, bpw):
    rep = convert(tiny_src, tmp_path / recipe, recipe, threads=1)
    assert rep.bpw_experts == pytest.approx(bpw)
    assert rep.expert_weights == ms.describe(TINY).expert_weights
    assert all(p.is_file() for p in rep.files) and (tmp_path / recipe / "manifest.json").is_file()
    e, s = rep.expert_error()
    if recipe == "mxfp4":
        assert e == 0.0  # lossless repack of the FP4 source
    else:
        assert 5.0 < 10 * np.log10(s / e) < 30.0  # 2-3 bit codes on heavy-tailed experts


def test_cli_writes_the_same_bytes(tiny_src, tmp_path, capsys):
    out = tmp_path / "cli"
    assert ms.main([str(out), "--preset", "tiny", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["expert_bytes"] == ms.describe(TINY).expert_bytes
    assert _digest(out) == _digest(tiny_src)
    assert ms.main([str(out), "--preset", "tiny"]) == 2  # not empty, no --force


@pytest.mark.slow
def test_benchmark_reports_identical_bytes_across_threads(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "convert.py"), "--preset", "tiny",
                        "--threads", "1,2", "--json", "--workdir", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["identical_across_threads"] is True
    assert [x["threads"] for x in d["runs"]] == [1, 2]
    for run in d["runs"]:
        assert run["peak_rss_bytes"] > run["peak_anon_bytes"] > 0
        assert run["source_mb_per_s"] > 0 and run["encode_mb_per_s"] > 0
        assert 0 < run["x_ceiling"] < 1
    assert d["ceiling"]["bytes"] == sum(Path(p).stat().st_size for p in d["source"]["shards"])
