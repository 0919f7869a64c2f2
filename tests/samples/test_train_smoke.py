"""samples/train_ds4_copy.py --smoke: the script runs, writes a valid official-layout
checkpoint, and is deterministic from its seed (CI smoke test of the script, not of
the shipped result: tests/runtime/test_fidelity_protocol.py scores that)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "samples" / "train_ds4_copy.py"

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _run(out: Path, seed: int = 5) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--seed", str(seed), "--no-report", "--quiet",
                    "--out", str(out)], check=True, env=env, capture_output=True, timeout=300)


def _digests(out: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    a, b = tmp_path_factory.mktemp("a") / "ck", tmp_path_factory.mktemp("b") / "ck"
    _run(a)
    _run(b)
    return a, b


def test_same_seed_gives_identical_bytes(runs):
    a, b = runs
    da = _digests(a)
    assert set(da) == {"config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                       "model.safetensors.index.json", "task.json", "tokenizer.json", "tokenizer_config.json"}
    assert da == _digests(b)


def test_checkpoint_is_the_official_layout_and_loads_with_no_missing_keys(runs):
    from safetensors import safe_open

    a, _ = runs
    index = json.loads((a / "model.safetensors.index.json").read_text())
    dtypes = {}
    for shard in set(index["weight_map"].values()):
        with safe_open(str(a / shard), "pt") as f:
            for n in f.keys():
                dtypes[n] = f.get_slice(n).get_dtype()
    assert set(dtypes) == set(index["weight_map"])
    assert dtypes["layers.0.ffn.experts.0.w1.weight"] == "I8"
    assert dtypes["layers.0.ffn.experts.0.w1.scale"] == "F8_E8M0"
    assert dtypes["layers.1.attn.wq_a.weight"] == "F8_E4M3" and dtypes["layers.1.attn.wq_a.scale"] == "F8_E8M0"
    assert dtypes["layers.0.ffn.gate.tid2eid"] == "I64" and dtypes["embed.weight"] == "BF16"
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["expert_dtype"] == "fp4" and cfg["quantization_config"]["weight_block_size"] == [128, 128]
    transformers.logging.set_verbosity_error()
    model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        str(a), dtype=torch.float32, experts_implementation="eager", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    tid = model.model.layers[0].mlp.gate.tid2eid
    assert int(tid.min()) >= 0 and all(len(set(r.tolist())) == r.numel() for r in tid)  # filled, distinct


def test_tokenizer_is_byte_level_with_three_specials(runs):
    a, _ = runs
    tok = transformers.AutoTokenizer.from_pretrained(str(a))
    text = "x_1 = f(y)\n>>> é"
    assert tok(text, add_special_tokens=False)["input_ids"] == [3 + b for b in text.encode()]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert tok.decode([3 + b for b in text.encode()] + [1]) .replace("<eos>", "") == text


def test_another_seed_gives_other_weights(runs, tmp_path):
    a, _ = runs
    c = tmp_path / "c"
    _run(c, seed=6)
    da, dc = _digests(a), _digests(c)
    assert da["model-00001-of-00002.safetensors"] != dc["model-00001-of-00002.safetensors"]
    assert da["task.json"] != dc["task.json"]  # the substitution table comes from the seed


def test_a_later_stage_continues_from_a_checkpoint_and_refuses_another_shape(runs, tmp_path):
    a, _ = runs
    env = dict(os.environ, OMP_NUM_THREADS="1")
    later = tmp_path / "stage2"
    subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--seed", "5", "--steps", "2", "--init-from", str(a),
                    "--data-stream", "stage2", "--qat-frac", "1.0", "--quiet", "--out", str(later)],
                   check=True, env=env, capture_output=True, timeout=300)
    rep = json.loads((later / "train_report.json").read_text())
    assert rep["init_from"] == str(a) and rep["data_stream"] == "stage2"
    assert rep["steps"] == 2 and rep["qat_from_step"] == 0 and rep["qat_tensors"] > 0
    da, dl = _digests(a), _digests(later)
    assert da["task.json"] == dl["task.json"]  # same seed, same table
    assert da["model-00001-of-00002.safetensors"] != dl["model-00001-of-00002.safetensors"]  # it trained
    # the full config's flags do not fit the smoke checkpoint: refused, naming the key
    bad = subprocess.run([sys.executable, str(SCRIPT), "--steps", "1", "--batch", "2", "--init-from", str(a),
                          "--quiet", "--no-report", "--out", str(tmp_path / "bad")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "hidden_size" in bad.stderr and not (tmp_path / "bad" / "config.json").exists()


def test_engine_shape_trains_in_the_proportions_engines_fix(tmp_path):
    """--engine-shape: hc 4, CSA 4 / HCA 128 and an indexer head dim of 64 in the written
    config, a layer of each attention kind, and its mxfp4 artifact claims llama.cpp (whose
    loader asserts those proportions) where the shipped sample's shape is left out."""
    from ds4quant.artifact.view import open_artifact
    from ds4quant.convert import convert

    src = tmp_path / "engine"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--engine-shape", "--seed", "5", "--no-report", "--quiet",
                    "--out", str(src)], check=True, env=env, capture_output=True, timeout=300)
    cfg = json.loads((src / "config.json").read_text())
    assert (cfg["hc_mult"], cfg["compress_rate_csa"], cfg["compress_rate_hca"], cfg["index_head_dim"]) == (4, 4, 128, 64)
    assert cfg["layer_types"] == ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    convert(src, tmp_path / "mx", "mxfp4", threads=1)
    v = open_artifact(next((tmp_path / "mx").glob("*.gguf")))
    assert "llama.cpp" in v.runtimes, v.runtimes_excluded.get("llama.cpp")
    shipped = ROOT / "samples" / "ds4-copy"
    convert(shipped, tmp_path / "mx-shipped", "mxfp4", threads=1)
    assert "llama.cpp" in open_artifact(next((tmp_path / "mx-shipped").glob("*.gguf"))).runtimes_excluded


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_same_seed_gives_identical_bytes_on_the_gpu(tmp_path):
    """On CUDA the script runs deterministic kernels: two runs of one seed (engine shape, a
    few QAT steps included) write the same bytes."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    outs = []
    for k in range(2):
        out = tmp_path / f"run{k}"
        subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--engine-shape", "--device", "cuda", "--steps", "12",
                        "--seed", "6", "--no-report", "--quiet", "--out", str(out)],
                       check=True, env=env, capture_output=True, timeout=600)
        outs.append(_digests(out))
    assert outs[0] == outs[1]


def test_train_seeds_packs_one_tar_a_seed(tmp_path):
    """samples/train_seeds.sh (several seeds side by side, one tar each: the lent GPU returns few
    files a call) on the CPU smoke config: each tar holds that seed's checkpoint and its log."""
    import tarfile

    env = dict(os.environ, OMP_NUM_THREADS="1", OUT=str(tmp_path / "out"), SEEDS="3 4", DEVICE="cpu", THREADS="1",
               EXTRA="--smoke --no-report", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    subprocess.run(["bash", str(ROOT / "samples" / "train_seeds.sh")], check=True, env=env, capture_output=True,
                   timeout=600)
    for s in (3, 4):
        with tarfile.open(tmp_path / "out" / f"seed{s}.tar") as t:
            names = set(t.getnames())
        assert {f"seed{s}/config.json", f"seed{s}/model.safetensors.index.json", f"seed{s}/task.json",
                f"seed{s}/train{s}.log"} <= names
