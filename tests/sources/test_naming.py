"""Official -> GGUF names, tensor classes, transformers names and deepseek4.* keys."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ds4quant.errors import BadInputError, UnsupportedFormatError
from ds4quant.sources import open_source, parse_config
from ds4quant.sources.naming import (
    REQUIRED_U32_KEYS,
    Kind,
    Mapped,
    Skipped,
    classify,
    deepseek4_kvs,
    gguf_name,
    gguf_ne,
    hf_name,
    map_name,
    map_names,
)
from tests.sources._util import SAMPLE

gguf = pytest.importorskip("gguf")
V = gguf.GGUFValueType

# docs/formats.md#ds4-gguf and the Lucebox loader's tensor list
SPOT = [
    ("embed.weight", "token_embd.weight", Kind.EMBEDDING),
    ("head.weight", "output.weight", Kind.OUTPUT),
    ("norm.weight", "output_norm.weight", Kind.NORM),
    ("hc_head_fn", "output_hc_fn.weight", Kind.HC),
    ("hc_head_base", "output_hc_base.weight", Kind.HC),
    ("hc_head_scale", "output_hc_scale.weight", Kind.HC),
    ("layers.7.attn_norm.weight", "blk.7.attn_norm.weight", Kind.NORM),
    ("layers.7.ffn_norm.weight", "blk.7.ffn_norm.weight", Kind.NORM),
    ("layers.7.attn.wq_a.weight", "blk.7.attn_q_a.weight", Kind.ATTENTION),
    ("layers.7.attn.wq_a.scale", "blk.7.attn_q_a.weight", Kind.ATTENTION),
    ("layers.7.attn.q_norm.weight", "blk.7.attn_q_a_norm.weight", Kind.NORM),
    ("layers.7.attn.wq_b.weight", "blk.7.attn_q_b.weight", Kind.ATTENTION),
    ("layers.7.attn.wkv.weight", "blk.7.attn_kv.weight", Kind.ATTENTION),
    ("layers.7.attn.kv_norm.weight", "blk.7.attn_kv_a_norm.weight", Kind.NORM),
    ("layers.7.attn.attn_sink", "blk.7.attn_sinks.weight", Kind.ATTENTION),
    ("layers.7.attn.wo_a.weight", "blk.7.attn_output_a.weight", Kind.ATTENTION),
    ("layers.7.attn.wo_b.weight", "blk.7.attn_output_b.weight", Kind.ATTENTION),
    ("layers.7.attn.compressor.ape", "blk.7.attn_compressor_ape.weight", Kind.ATTENTION),
    ("layers.7.attn.compressor.wkv.weight", "blk.7.attn_compressor_kv.weight", Kind.ATTENTION),
    ("layers.7.attn.compressor.wgate.weight", "blk.7.attn_compressor_gate.weight", Kind.ATTENTION),
    ("layers.7.attn.compressor.norm.weight", "blk.7.attn_compressor_norm.weight", Kind.NORM),
    ("layers.7.attn.indexer.wq_b.weight", "blk.7.indexer.attn_q_b.weight", Kind.ATTENTION),
    ("layers.7.attn.indexer.weights_proj.weight", "blk.7.indexer.proj.weight", Kind.ATTENTION),
    ("layers.7.attn.indexer.compressor.ape", "blk.7.indexer_compressor_ape.weight", Kind.ATTENTION),
    ("layers.7.attn.indexer.compressor.wkv.weight", "blk.7.indexer_compressor_kv.weight", Kind.ATTENTION),
    ("layers.7.attn.indexer.compressor.wgate.weight", "blk.7.indexer_compressor_gate.weight", Kind.ATTENTION),
    ("layers.7.attn.indexer.compressor.norm.weight", "blk.7.indexer_compressor_norm.weight", Kind.NORM),
    ("layers.7.hc_attn_fn", "blk.7.hc_attn_fn.weight", Kind.HC),
    ("layers.7.hc_ffn_scale", "blk.7.hc_ffn_scale.weight", Kind.HC),
    ("layers.7.ffn.gate.weight", "blk.7.ffn_gate_inp.weight", Kind.ROUTER),
    ("layers.7.ffn.gate.bias", "blk.7.exp_probs_b.bias", Kind.ROUTER),
    ("layers.0.ffn.gate.tid2eid", "blk.0.ffn_gate_tid2eid.weight", Kind.HASH_TABLE),
    ("layers.7.ffn.shared_experts.w1.weight", "blk.7.ffn_gate_shexp.weight", Kind.SHARED_EXPERT),
    ("layers.7.ffn.shared_experts.w3.weight", "blk.7.ffn_up_shexp.weight", Kind.SHARED_EXPERT),
    ("layers.7.ffn.shared_experts.w2.weight", "blk.7.ffn_down_shexp.weight", Kind.SHARED_EXPERT),
    ("layers.7.ffn.experts.255.w1.weight", "blk.7.ffn_gate_exps.weight", Kind.ROUTED_EXPERT),
    ("layers.7.ffn.experts.0.w3.weight", "blk.7.ffn_up_exps.weight", Kind.ROUTED_EXPERT),
    ("layers.7.ffn.experts.3.w2.scale", "blk.7.ffn_down_exps.weight", Kind.ROUTED_EXPERT),
    ("layers.42.ffn.experts.3.w2.weight_scale_inv", "blk.42.ffn_down_exps.weight", Kind.ROUTED_EXPERT),
]


@pytest.mark.parametrize("official,want,kind", SPOT, ids=[s[0] for s in SPOT])
def test_spot_mappings(official, want, kind):
    m = map_name(official)
    assert isinstance(m, Mapped) and m.gguf == want and m.kind is kind
    assert classify(official) is kind and gguf_name(official) == want
    assert m.role == ("scale" if official.endswith((".scale", ".weight_scale_inv")) else "weight")


def test_expert_fields():
    m = map_name("layers.5.ffn.experts.17.w2.weight")
    assert (m.layer, m.expert, m.which, m.stacked) == (5, 17, "down", True)
    s = map_name("layers.5.ffn.shared_experts.w3.weight")
    assert (s.layer, s.expert, s.which, s.stacked) == (5, None, "up", False)


@pytest.mark.parametrize("name,reason", [
    ("mtp.0.emb.weight", "MTP"),
    ("mtp.2.markov_head.w1.weight", "MTP"),
    ("model.embed_tokens.weight", "transformers-style"),
    ("layers.0.attn.mystery.weight", "no GGUF name"),
    ("layers.01.attn_norm.weight", "no GGUF name"),  # not a canonical layer index
    ("layers.0.ffn.experts.1.w4.weight", "no GGUF name"),
    ("something", "no GGUF name"),
])
def test_unmappable_names_are_reported_not_dropped(name, reason):
    m = map_name(name)
    assert isinstance(m, Skipped) and reason in m.reason
    assert classify(name) is Kind.OTHER
    with pytest.raises(BadInputError, match=reason):
        gguf_name(name)
    nm = map_names(["embed.weight", name])
    assert [s.name for s in nm.skipped] == [name] and [x.name for x in nm.mapped] == ["embed.weight"]


def test_duplicate_targets_are_refused():
    with pytest.raises(BadInputError, match="maps to blk.0.ffn_gate_exps.weight"):
        map_names(["layers.0.ffn.experts.1.w1.scale", "layers.0.ffn.experts.1.w1.weight_scale_inv"])


def test_sample_gguf_names_per_layer_type():
    src = open_source(SAMPLE)
    names = set(src.names.by_gguf())
    for layer, ltype in enumerate(src.config.layer_types):
        has_comp = f"blk.{layer}.attn_compressor_kv.weight" in names
        has_idx = f"blk.{layer}.indexer.attn_q_b.weight" in names
        assert has_comp == (ltype != "sliding_attention") and has_idx == (ltype == "compressed_sparse_attention")
        assert (f"blk.{layer}.ffn_gate_tid2eid.weight" in names) == (layer < 2)
        assert (f"blk.{layer}.exp_probs_b.bias" in names) == (layer >= 2)
    assert {"token_embd.weight", "output.weight", "output_norm.weight", "output_hc_fn.weight"} <= names
    assert len(names) == 126


def test_gguf_ne_is_reversed_with_expert_last():
    assert gguf_ne((128, 256), 16) == (256, 128, 16)  # gate/up [in, out, n_expert]
    assert gguf_ne((4096, 2048), 256) == (2048, 4096, 256)  # V4-Flash down
    assert gguf_ne((512, 256)) == (256, 512)


def test_hf_names_cover_the_transformers_model_exactly():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    src = open_source(SAMPLE)
    cfg = transformers.DeepseekV4Config(**{k: v for k, v in json.loads((SAMPLE / "config.json").read_text()).items()
                                           if k != "quantization_config"})
    with torch.device("meta"):
        model = transformers.DeepseekV4ForCausalLM(cfg)
    want = set(model.state_dict())
    got = {}
    for n in src.weight_names():
        hf, part = hf_name(n)
        got.setdefault(hf, []).append(part)
    assert set(got) == want
    assert all(len(v) == 2 * 16 for k, v in got.items() if k.endswith("gate_up_proj"))
    with pytest.raises(BadInputError):
        hf_name("layers.0.attn.wq_a.scale")


# --------------------------------------------------------------------------
# deepseek4.* keys


FLASH_NATIVE = {  # V4-Flash facts (docs/formats.md#ds4-gguf; native config keys)
    "model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048,
    "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
    "q_lora_rank": 1024, "o_lora_rank": 1024, "o_groups": 8, "qk_rope_head_dim": 64,
    "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 1, "num_hash_layers": 3,
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "sliding_window": 128, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4],
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
}


def _kv(kvs):
    return {k.key: k for k in kvs}


def test_kvs_have_every_required_loader_key():
    kvs = _kv(deepseek4_kvs(parse_config(FLASH_NATIVE)))
    assert kvs["general.architecture"].value == "deepseek4" and kvs["general.architecture"].type == V.STRING
    for key in REQUIRED_U32_KEYS:
        assert kvs[key].type == V.UINT32 and isinstance(kvs[key].value, int), key
    want = {
        "deepseek4.block_count": 43, "deepseek4.embedding_length": 4096, "deepseek4.vocab_size": 129280,
        "deepseek4.attention.head_count": 64, "deepseek4.attention.head_count_kv": 1,
        "deepseek4.attention.key_length": 512, "deepseek4.rope.dimension_count": 64,
        "deepseek4.attention.q_lora_rank": 1024, "deepseek4.attention.output_lora_rank": 1024,
        "deepseek4.attention.output_group_count": 8, "deepseek4.expert_count": 256,
        "deepseek4.expert_used_count": 6, "deepseek4.expert_shared_count": 1,
        "deepseek4.expert_feed_forward_length": 2048, "deepseek4.hash_layer_count": 3,
        "deepseek4.attention.sliding_window": 128, "deepseek4.attention.indexer.head_count": 64,
        "deepseek4.attention.indexer.key_length": 128, "deepseek4.attention.indexer.top_k": 512,
        "deepseek4.hyper_connection.count": 4, "deepseek4.hyper_connection.sinkhorn_iterations": 20,
    }
    assert {k: kvs[k].value for k in want} == want
    assert kvs["deepseek4.expert_weights_scale"].value == 1.5
    # llama.cpp's dialect: the types its DS4 loader checks, arrays in its converter's forms
    clamp = kvs["deepseek4.swiglu_clamp_exp"]
    assert (clamp.type, clamp.sub_type, clamp.value) == (V.ARRAY, V.FLOAT32, [10.0] * 43)
    assert (kvs["deepseek4.expert_weights_norm"].type, kvs["deepseek4.expert_weights_norm"].value) == (V.BOOL, True)
    assert (kvs["deepseek4.expert_gating_func"].type, kvs["deepseek4.expert_gating_func"].value) == (V.UINT32, 4)
    assert (kvs["deepseek4.rope.scaling.type"].type, kvs["deepseek4.rope.scaling.type"].value) == (V.STRING, "yarn")
    assert kvs["deepseek4.rope.scaling.factor"].value == 16.0
    orig = kvs["deepseek4.rope.scaling.original_context_length"]
    assert (orig.type, orig.value) == (V.UINT32, 65536)
    assert (kvs["deepseek4.rope.scaling.yarn_beta_fast"].value, kvs["deepseek4.rope.scaling.yarn_beta_slow"].value) \
        == (32.0, 1.0)
    # the flash config states no extrapolation or attention factor: none is invented
    assert "deepseek4.rope.scaling.yarn_ext_factor" not in kvs and "deepseek4.rope.scaling.yarn_attn_factor" not in kvs
    ratios = kvs["deepseek4.attention.compress_ratios"]
    assert ratios.type == V.ARRAY and ratios.sub_type == V.INT32 and len(ratios.value) == 43
    assert ratios.value[:4] == [0, 0, 4, 128]


def test_kvs_carry_every_yarn_parameter_the_config_states():
    cfg = dict(FLASH_NATIVE, rope_scaling=dict(FLASH_NATIVE["rope_scaling"], extrapolation_factor=0.5,
                                               attention_factor=1.25))
    kvs = _kv(deepseek4_kvs(parse_config(cfg)))
    assert kvs["deepseek4.rope.scaling.yarn_ext_factor"].value == 0.5
    assert kvs["deepseek4.rope.scaling.yarn_attn_factor"].value == 1.25
    plain = _kv(deepseek4_kvs(parse_config({k: v for k, v in FLASH_NATIVE.items() if k != "rope_scaling"})))
    assert plain["deepseek4.rope.scaling.type"].value == "none" and plain["deepseek4.rope.scaling.factor"].value == 1.0
    sig = _kv(deepseek4_kvs(parse_config(dict(FLASH_NATIVE, scoring_func="sigmoid", norm_topk_prob=False))))
    assert sig["deepseek4.expert_gating_func"].value == 2 and sig["deepseek4.expert_weights_norm"].value is False


def test_loader_key_list_is_the_spec_list():
    spec = {"block_count", "embedding_length", "vocab_size", "attention.head_count", "attention.head_count_kv",
            "attention.key_length", "attention.q_lora_rank", "attention.output_lora_rank",
            "attention.output_group_count", "attention.sliding_window", "attention.indexer.head_count",
            "attention.indexer.key_length", "attention.indexer.top_k", "rope.dimension_count", "expert_count",
            "expert_used_count", "expert_shared_count", "expert_feed_forward_length", "hash_layer_count",
            "hyper_connection.count", "hyper_connection.sinkhorn_iterations"}
    assert {f"deepseek4.{k}" for k in spec} <= set(REQUIRED_U32_KEYS)
    assert set(REQUIRED_U32_KEYS) - {f"deepseek4.{k}" for k in spec} == {"deepseek4.attention.value_length"}


def test_kvs_for_the_sample_and_a_gguf_round_trip(tmp_path):
    src = open_source(SAMPLE)
    kvs = deepseek4_kvs(src.config)
    d = _kv(kvs)
    assert d["deepseek4.hash_layer_count"].value == 2
    assert d["deepseek4.attention.compress_ratios"].value == [0, 4, 16, 4]
    assert d["deepseek4.rope.scaling.factor"].value == 1.0  # no YaRN: written, not left to the default 16
    p = tmp_path / "kv.gguf"
    w = gguf.GGUFWriter(str(p), "deepseek4")
    for kv in kvs:
        if kv.key == "general.architecture":
            continue  # the writer adds it
        w.add_key_value(kv.key, kv.value, kv.type, sub_type=kv.sub_type)
    w.add_tensor("token_embd.weight", np.zeros((2, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = gguf.GGUFReader(str(p))
    for kv in kvs:
        f = r.fields[kv.key]
        val = f.contents()
        assert val == pytest.approx(kv.value), kv.key


def test_kvs_refuse_non_prefix_hash_layers():
    cfg = dict(FLASH_NATIVE, num_hidden_layers=4, compress_ratios=[0, 4, 128, 4],
               mlp_layer_types=["moe", "hash_moe", "moe", "moe"])
    with pytest.raises(UnsupportedFormatError, match="hash_layer_count"):
        deepseek4_kvs(parse_config(cfg))
