"""The official-layout source reader on the shipped tiny checkpoint and broken copies of it."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from ds4quant import formats
from ds4quant.errors import BadInputError, CorruptDataError, ShapeError, UnsupportedFormatError
from ds4quant.formats import fp8, mxfp4
from ds4quant.sources import open_source, parse_config
from ds4quant.sources.config import CSA, HCA, SLIDING
from ds4quant.sources.naming import Kind, hf_name
from ds4quant.sources.official import ENC_FP4, ENC_FP8, ENC_PLAIN, ENC_SCALE
from tests.sources._util import SAMPLE, TOKENS, copy_sample, raw_header, write_safetensors

SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"


@pytest.fixture(scope="module")
def src():
    s = open_source(SAMPLE)
    yield s
    s.close()


@pytest.fixture(scope="module")
def hf_model():
    """transformers' own load of the sample (FP8/FP4 dequantized on load)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load FP8 checkpoints")
    transformers.logging.set_verbosity_error()
    model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        str(SAMPLE), dtype=torch.float32, experts_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    return model


def _bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


# --------------------------------------------------------------------------
# the sample


def test_sample_opens_with_config(src):
    c = src.config
    assert (c.hidden_size, c.num_hidden_layers, c.n_routed_experts, c.moe_intermediate_size) == (256, 4, 16, 128)
    assert c.layer_types == (SLIDING, CSA, HCA, CSA)
    assert c.compress_ratios == (0, 4, 16, 4)
    assert c.num_hash_layers == 2 and c.hash_layers_are_prefix
    assert c.qk_rope_head_dim == 16 and c.fp8_block == (128, 128) and c.expert_dtype == "fp4"
    assert len(src.tensor_names()) == 532 and len(src.weight_names()) == 306
    assert src.skipped == ()


def test_every_tensor_maps(src):
    mapped = {m.name: m for m in src.names.mapped}
    assert set(mapped) == set(src.tensor_names())
    stacks = {g: ms for g, ms in src.names.by_gguf().items() if ms[0].kind is Kind.ROUTED_EXPERT}
    assert len(stacks) == 4 * 3
    assert all([m.expert for m in ms] == list(range(16)) for ms in stacks.values())
    for name in src.tensor_names():
        info = src.info(name)
        if info.encoding == ENC_SCALE:
            assert mapped[name].role == "scale" and mapped[info.weight].gguf == mapped[name].gguf


def test_encodings_and_logical_shapes(src):
    e = src.info("layers.3.ffn.experts.15.w2.weight")
    assert (e.dtype, e.shape, e.shape_logical, e.encoding) == ("I8", (256, 64), (256, 128), ENC_FP4)
    assert e.scale == "layers.3.ffn.experts.15.w2.scale"
    a = src.info("layers.0.attn.wo_b.weight")
    assert (a.dtype, a.encoding, src.info(a.scale).shape) == ("F8_E4M3", ENC_FP8, (2, 1))
    assert src.info("embed.weight").dtype == "BF16" and src.info("embed.weight").encoding == ENC_PLAIN
    assert src.info("layers.0.ffn.gate.tid2eid").dtype == "I64"


def test_dequantized_values_equal_transformers(src, hf_model):
    params = dict(hf_model.state_dict())
    I = src.config.moe_intermediate_size
    covered = set()
    for name in src.weight_names():
        hf, part = hf_name(name)
        covered.add(hf)
        want = params[hf].detach().cpu().numpy()
        if src.info(name).dtype == "I64":
            assert np.array_equal(src.read(name), want), name
            continue
        if part is not None:
            e, which = part
            want = {"gate": want[e, :I], "up": want[e, I:], "down": want[e]}[which]
        got = src.read_dequantized(name)
        assert got.dtype == np.float32 and got.shape == want.shape, name
        assert np.array_equal(_bits(got), _bits(want)), name
    assert covered == set(params)  # every transformers parameter came from the source


def test_fp4_expert_repacks_losslessly_to_mxfp4(src):
    gguf = pytest.importorskip("gguf")
    for layer, expert, which in ((0, 0, "w1"), (2, 7, "down"), (3, 15, "up")):
        codes, scales = src.expert_fp4(layer, expert, which)
        blocks = mxfp4.mxfp4_from_e2m1(codes, scales)
        got = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.MXFP4).reshape(codes.shape[0], -1)
        name = f"layers.{layer}.ffn.experts.{expert}.{ {'down': 'w2', 'up': 'w3'}.get(which, which)}.weight"
        assert np.array_equal(got, src.read_dequantized(name))
        assert np.array_equal(formats.decode("mxfp4", blocks, got.shape[1]), got)
    with pytest.raises(BadInputError, match="which"):
        src.expert_fp4(0, 0, "w4")


def test_bf16_expert_reads_but_is_not_fp4(tmp_path, src):
    d = tmp_path / "bf16"
    d.mkdir()
    (d / "config.json").write_bytes((SAMPLE / "config.json").read_bytes())
    tensors = {n: (src.info(n).dtype, src.info(n).shape, src.read(n).tobytes()) for n in src.tensor_names()}
    name = "layers.0.ffn.experts.0.w1.weight"
    exact = src.read_dequantized(name)
    del tensors["layers.0.ffn.experts.0.w1.scale"]
    tensors[name] = ("BF16", exact.shape, (exact.view(np.uint32) >> 16).astype("<u2").tobytes())
    write_safetensors(d / "model.safetensors", tensors)
    s = open_source(d)
    assert s.info(name).encoding == ENC_PLAIN
    assert np.array_equal(_bits(s.read_dequantized(name)), _bits(exact))  # FP4 values are bf16-exact
    with pytest.raises(UnsupportedFormatError, match="not FP4"):
        s.expert_fp4(0, 0, "gate")


def test_fp8_dequant_matches_elementwise_formula(src):
    name = "layers.1.attn.wq_b.weight"
    raw, scale = src.read(name), src.read(src.info(name).scale)
    got = src.read_dequantized(name)
    r, c = 200, 100
    assert got[r, c] == fp8.E4M3[raw[r, c]] * 2.0 ** (int(scale[r // 128, c // 128]) - 127)


def test_reading_is_one_tensor_at_a_time(src):
    it = src.iter_tensors(dequantize=True)
    assert isinstance(it, types.GeneratorType)
    name, arr = next(it)
    assert name == src.weight_names()[0] and arr.dtype == np.float32
    raw = src.read("layers.2.ffn.experts.3.w1.weight")
    assert not raw.flags.writeable and raw.dtype == np.int8
    assert isinstance(raw.base, np.ndarray) and not raw.flags.owndata  # a view of the file map


def test_integer_tensor_refuses_dequantize(src):
    with pytest.raises(BadInputError, match="integers"):
        src.read_dequantized("layers.0.ffn.gate.tid2eid")
    with pytest.raises(BadInputError, match="no such tensor"):
        src.info("layers.9.nope")


def test_fingerprint_is_stable_and_cheap(tmp_path, src):
    d = copy_sample(tmp_path)
    assert open_source(d).fingerprint() == src.fingerprint()
    # data bytes are not hashed (cheap); headers, sizes, config and index are
    p = d / SHARD2
    b = bytearray(p.read_bytes())
    b[-1] ^= 0x01
    p.write_bytes(bytes(b))
    assert open_source(d).fingerprint() == src.fingerprint()
    cfg = json.loads((d / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (d / "config.json").write_text(json.dumps(cfg))
    assert open_source(d).fingerprint() != src.fingerprint()


def test_single_file_checkpoint(tmp_path, src):
    d = tmp_path / "single"
    d.mkdir()
    (d / "config.json").write_bytes((SAMPLE / "config.json").read_bytes())
    tensors = {n: (src.info(n).dtype, src.info(n).shape, src.read(n).tobytes()) for n in src.tensor_names()}
    write_safetensors(d / "model.safetensors", tensors)
    s = open_source(d)
    assert s.tensor_names() == src.tensor_names()
    for n in ("layers.1.ffn.experts.4.w3.weight", "layers.0.attn.wkv.weight", "head.weight"):
        assert np.array_equal(_bits(s.read_dequantized(n)), _bits(src.read_dequantized(n)))


# --------------------------------------------------------------------------
# refusals


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    cfg = {k: v for k, v in cfg.items() if v is not None}  # None: drop the key
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes,match,tensor", [
    ({"moe_intermediate_size": 64}, "moe_intermediate_size", "ffn.experts.0.w"),
    ({"hidden_size": 512}, "hidden_size", ""),
    ({"n_routed_experts": 8}, "expert 8 but config.json has n_routed_experts=8", "experts.8."),
    ({"n_routed_experts": 32, "num_experts_per_tok": 4}, "missing", "experts.16."),
    ({"num_hidden_layers": 3, "layer_types": None, "compress_ratios": [0, 4, 128]}, "layer 3 but", "layers.3."),
    ({"vocab_size": 1024}, "vocab_size", ""),
    ({"num_hash_layers": 1}, "routes by score", "layers.1.ffn.gate.tid2eid"),
])
def test_shape_mismatch_with_config_is_refused(tmp_path, changes, match, tensor):
    d = copy_sample(tmp_path)
    _edit_config(d, **changes)
    with pytest.raises(ShapeError, match=match) as ei:
        open_source(d)
    text = str(ei.value)
    assert "tensor '" in text and tensor in text and "\n" not in text


def test_missing_shard_is_refused(tmp_path):
    d = copy_sample(tmp_path)
    (d / SHARD2).unlink()
    with pytest.raises(CorruptDataError, match=f"shard '{SHARD2}'.*does not exist"):
        open_source(d)


def test_truncated_shard_is_refused(tmp_path):
    d = copy_sample(tmp_path)
    p = d / SHARD1
    p.write_bytes(p.read_bytes()[:-1000])
    with pytest.raises(CorruptDataError, match="outside the .* buffer") as ei:
        open_source(d)
    assert SHARD1 in str(ei.value) and "tensor '" in str(ei.value)


def test_corrupt_header_is_refused(tmp_path):
    d = copy_sample(tmp_path)
    p = d / SHARD2
    b = bytearray(p.read_bytes())
    b[9] = ord("[")  # header JSON no longer parses
    p.write_bytes(bytes(b))
    with pytest.raises(CorruptDataError, match="not valid JSON") as ei:
        open_source(d)
    assert SHARD2 in str(ei.value)


def _edit_index(d, fn):
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    fn(idx["weight_map"])
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))


@pytest.mark.parametrize("edit,match", [
    (lambda wm: wm.update({"layers.0.extra.weight": SHARD1}), "does not hold it"),
    (lambda wm: wm.pop("layers.0.attn_norm.weight"), "does not list it"),
    (lambda wm: wm.update({"layers.0.attn_norm.weight": SHARD2}), "does not hold it"),
    (lambda wm: wm.update({"norm.weight": "../" + SHARD2}), "not a plain file name"),
    (lambda wm: wm.clear(), "no weight_map"),
])
def test_index_inconsistencies_are_refused(tmp_path, edit, match):
    d = copy_sample(tmp_path)
    _edit_index(d, edit)
    with pytest.raises(CorruptDataError, match=match):
        open_source(d)


def test_nan_scale_is_refused_on_read(tmp_path):
    d = copy_sample(tmp_path)
    p = d / SHARD1
    name = "layers.0.ffn.experts.2.w1.scale"
    n, header = raw_header(p)
    begin = header[name]["data_offsets"][0]
    b = bytearray(p.read_bytes())
    b[8 + n + begin + 5] = 255
    p.write_bytes(bytes(b))
    s = open_source(d)  # data is not validated at open: it stays cheap
    with pytest.raises(CorruptDataError, match="255") as ei:
        s.read_dequantized("layers.0.ffn.experts.2.w1.weight")
    assert name in str(ei.value)
    with pytest.raises(CorruptDataError, match="255"):
        mxfp4.mxfp4_from_e2m1(*s.expert_fp4(0, 2, "w1"))


def test_scale_without_weight_and_bad_scale_shape(tmp_path, src):
    d = tmp_path / "odd"
    d.mkdir()
    (d / "config.json").write_bytes((SAMPLE / "config.json").read_bytes())
    tensors = {n: (src.info(n).dtype, src.info(n).shape, src.read(n).tobytes()) for n in src.tensor_names()}
    t = dict(tensors)
    t["layers.0.attn.bogus.scale"] = ("F8_E8M0", (1,), bytes([127]))
    write_safetensors(d / "model.safetensors", t)
    with pytest.raises(CorruptDataError, match="without its weight"):
        open_source(d)
    t = dict(tensors)
    t["layers.0.ffn.experts.0.w1.scale"] = ("F8_E8M0", (128, 4), bytes(512))
    write_safetensors(d / "model.safetensors", t)
    with pytest.raises(ShapeError, match=r"needs scale \(128, 8\)"):
        open_source(d)


def test_not_a_checkpoint_folder(tmp_path):
    with pytest.raises(BadInputError, match="no such folder"):
        open_source(tmp_path / "nope")
    with pytest.raises(BadInputError, match="no config.json"):
        open_source(tmp_path)
    (tmp_path / "config.json").write_bytes((SAMPLE / "config.json").read_bytes())
    with pytest.raises(BadInputError, match="neither"):
        open_source(tmp_path)
    with pytest.raises(BadInputError, match="folder"):
        open_source(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CorruptDataError, match="not valid JSON"):
        open_source(tmp_path)


# --------------------------------------------------------------------------
# config.json: native and transformers keys agree


HF_KEYS = {
    "model_type": "deepseek_v4", "vocab_size": 512, "hidden_size": 256, "moe_intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
    "q_lora_rank": 128, "partial_rotary_factor": 0.25, "num_experts_per_tok": 4, "n_routed_experts": 16,
    "n_shared_experts": 1, "layer_types": [SLIDING, CSA, HCA, CSA],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "compress_rates": {CSA: 4, HCA: 16}, "sliding_window": 16, "hc_mult": 2, "hc_sinkhorn_iters": 20,
    "o_groups": 2, "o_lora_rank": 64, "index_n_heads": 4, "index_head_dim": 32, "index_topk": 4,
    "max_position_embeddings": 4096, "num_nextn_predict_layers": 0,
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "expert_dtype": "fp4"},
}


def test_native_and_transformers_config_keys_agree(src):
    hf = parse_config(HF_KEYS)
    assert hf == src.config  # raw is excluded from equality


def test_config_matches_transformers_folding():
    transformers = pytest.importorskip("transformers")
    native = json.loads((SAMPLE / "config.json").read_text())
    t = transformers.DeepseekV4Config(**{k: v for k, v in native.items() if k not in ("architectures",)})
    c = parse_config(native)
    assert list(c.layer_types) == t.layer_types and list(c.mlp_layer_types) == t.mlp_layer_types
    assert c.qk_rope_head_dim == t.qk_rope_head_dim
    assert dict(zip((CSA, HCA), (c.compress_ratios[1], c.compress_ratios[2]))) == t.compress_rates


@pytest.mark.parametrize("changes,err,match", [
    ({"hidden_size": None}, BadInputError, "hidden_size"),
    ({"hidden_size": 256.0}, BadInputError, "integer"),
    ({"hidden_size": True}, BadInputError, "integer"),
    ({"num_experts_per_tok": 17}, BadInputError, "num_experts_per_tok"),
    ({"compress_ratios": [0, 4, 16, 4], "layer_types": None}, UnsupportedFormatError, "0, 4, 128"),
    ({"compress_ratios": [0, 4], "layer_types": None}, BadInputError, "each of the 4 layers"),
    ({"scoring_func": "softmax"}, UnsupportedFormatError, "softmax"),
    ({"model_type": "llama"}, UnsupportedFormatError, "not DeepSeek-V4"),
    ({"quantization_config": {"quant_method": "awq"}}, UnsupportedFormatError, "awq"),
    ({"layer_types": ["sliding_attention"] * 3 + ["dense"]}, BadInputError, "dense"),
    ({"compress_rates": {CSA: 4}}, BadInputError, "both keys"),
])
def test_bad_config_is_refused(changes, err, match):
    cfg = json.loads((SAMPLE / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    with pytest.raises(err, match=match):
        parse_config(cfg)


def test_tokens_file_is_usable():
    lines = [ln for ln in TOKENS.read_text().splitlines() if ln and not ln.startswith("#")]
    seqs = [[int(t) for t in ln.split()] for ln in lines]
    assert len(seqs) == 16 and all(len(s) == 64 and s[0] == 0 for s in seqs)
    assert all(0 <= t < 512 for s in seqs for t in s)
