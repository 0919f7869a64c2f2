"""Build samples/ds4-tiny: a tiny DeepSeek-V4 checkpoint in the OFFICIAL layout.

    python samples/make_ds4_tiny.py            # writes samples/ds4-tiny and samples/tokens.txt
    python samples/make_ds4_tiny.py --check    # rebuild in a temp folder, compare bytes with the shipped copy

What it writes (facts: docs/reference-model.md#tiny-models,
docs/formats.md#ds4-checkpoint):

- config.json with native DeepSeek keys (num_hash_layers, qk_rope_head_dim,
  compress_rate_{csa,hca}; layer_types for the attention types), the FP8 quantization_config and
  expert_dtype fp4, and "torch_dtype": "bfloat16" (without a dtype transformers
  cannot load F8_E8M0 tensors: pitfall 1);
- model.safetensors.index.json and two shards with official tensor names:
  routed experts as I8 FP4 e2m1 pairs (even element in the low nibble) with an
  F8_E8M0 scale per 32 inputs (pow2 >= absmax/6); dense attention and shared
  experts as F8_E4M3 with 128x128 F8_E8M0 block scales (pow2 >= absmax/448);
  embeddings, head, router and compressor weights bf16; norms, hyper-connection
  parameters, sinks, ape and router bias fp32; tid2eid int64 for hash layers;
- samples/tokens.txt: deterministic token sequences for calibration runs.

Every value comes from a numpy Generator seeded by the tensor's name, so two
runs give byte-identical files. The script then proves the checkpoint: the
transformers model loaded from it (FP8/FP4 dequantized on load) has 0 missing
or unexpected keys, and its parameters and logits are bitwise equal to a model
built in memory with the exactly dequantized weights.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE / "ds4-tiny"
TOKENS = HERE / "tokens.txt"

# The tiny config of docs/reference-model.md#tiny-models, 4 layers, first 2 hash-routed.
HF_KWARGS = {
    "vocab_size": 512, "hidden_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "q_lora_rank": 128,
    "partial_rotary_factor": 0.25,
    "num_experts_per_tok": 4, "n_routed_experts": 16, "n_shared_experts": 1,
    "layer_types": ["sliding_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention", "compressed_sparse_attention"],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "sliding_window": 16, "hc_mult": 2, "hc_sinkhorn_iters": 20,
    "o_groups": 2, "o_lora_rank": 64,
    "index_n_heads": 4, "index_head_dim": 32, "index_topk": 4,
    "max_position_embeddings": 4096, "num_nextn_predict_layers": 0,
    "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
}

# The same model in native DeepSeek keys ([A2]), except the attention types: the
# native compress_ratios would have to say 128 for the heavily compressed layer
# (the only value transformers' legacy map knows for it) while its real rate is
# 16, a contradiction DeepSeek's own code reads as rate 128. layer_types names
# the types and compress_rate_{csa,hca} their rates, so every reader agrees.
NATIVE_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 512,
    "hidden_size": 256,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "q_lora_rank": 128,
    "qk_rope_head_dim": 16,
    "o_groups": 2,
    "o_lora_rank": 64,
    "num_experts_per_tok": 4,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "num_hash_layers": 2,
    "layer_types": ["sliding_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention", "compressed_sparse_attention"],
    "compress_rate_csa": 4,
    "compress_rate_hca": 16,
    "compress_rope_theta": 160000.0,
    "rope_theta": 10000.0,
    "sliding_window": 16,
    "hc_mult": 2,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-06,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 4,
    "max_position_embeddings": 4096,
    "num_nextn_predict_layers": 0,
    "rms_norm_eps": 1e-06,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "torch_dtype": "bfloat16",
    "expert_dtype": "fp4",
    "quantization_config": {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
}

N_LAYERS = 4
N_EXPERTS = 16
TOPK = 4
HIDDEN = 256
INTER = 128
VOCAB = 512
HASH_LAYERS = (0, 1)

# Official dense projections stored FP8 with 128x128 block scales ([C]).
FP8_DENSE = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b",
             "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3")

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


# --------------------------------------------------------------------------
# official name <-> transformers parameter name (docs/reference-model.md#names)


def _official_name(hf: str) -> str:
    """The official name whose transformers parameter is ``hf`` (the one map
    lives in ds4quant.sources.naming)."""
    from ds4quant.sources.naming import _HF_GLOBAL, hf_name

    inv = {v: k for k, v in _HF_GLOBAL.items()}
    if hf in inv:
        return inv[hf]
    _, _, layer, _ = hf.split(".", 3)  # model.layers.L.rest
    for cand in _official_layer_candidates():
        official = f"layers.{layer}.{cand}"
        if hf_name(official)[0] == hf:
            return official
    raise KeyError(hf)


def _official_layer_candidates():
    base = ["attn.indexer.compressor.ape", "attn.compressor.ape", "attn.attn_sink",
            "hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
            "ffn.gate.bias", "ffn.gate.tid2eid"]
    mods = ["attn.indexer.compressor.wkv", "attn.indexer.compressor.wgate", "attn.indexer.compressor.norm",
            "attn.indexer.wq_b", "attn.indexer.weights_proj", "attn.compressor.wkv", "attn.compressor.wgate",
            "attn.compressor.norm", "attn.wq_a", "attn.wq_b", "attn.q_norm", "attn.wkv", "attn.kv_norm",
            "attn.wo_a", "attn.wo_b", "attn_norm", "ffn_norm", "ffn.gate", "ffn.shared_experts.w1",
            "ffn.shared_experts.w2", "ffn.shared_experts.w3"]
    return base + [m + ".weight" for m in mods]


# --------------------------------------------------------------------------
# deterministic values


def _rng(name: str) -> np.random.Generator:
    seed = int.from_bytes(hashlib.sha256(f"ds4-tiny/{name}".encode()).digest()[:8], "little")
    return np.random.default_rng(seed)


def _init_value(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A float32 value for one official tensor (non-expert), chosen by its role."""
    g = _rng(name)
    leaf = name.rsplit(".", 1)[-1] if "." in name else name
    if name.endswith("norm.weight"):
        v = 1.0 + 0.1 * g.standard_normal(shape)
    elif leaf in ("hc_attn_scale", "hc_ffn_scale", "hc_head_scale"):
        v = 1.0 + 0.05 * g.standard_normal(shape)
    elif leaf in ("hc_attn_base", "hc_ffn_base", "hc_head_base"):
        v = 0.1 * g.standard_normal(shape)
    elif leaf == "attn_sink":
        v = 0.5 * g.standard_normal(shape)
    elif leaf == "bias":  # router e_score_correction_bias
        v = 0.05 * g.standard_normal(shape)
    else:  # projections, embeddings, ape, hc fn: the HF init scale with a heavier tail
        v = 0.02 * g.standard_t(6, shape) / np.sqrt(1.5)
    return v.astype(np.float32)


def _expert_values(layer: int) -> dict[str, np.ndarray]:
    """Routed experts of one layer: Student-t entries, per-expert scale spread,
    per-input-column scales with a few outlier columns (imatrix-visible)."""
    out = {}
    for which, (rows, cols) in (("w1", (INTER, HIDDEN)), ("w3", (INTER, HIDDEN)), ("w2", (HIDDEN, INTER))):
        g = _rng(f"layers.{layer}.ffn.experts.{which}")
        col_scale = np.exp(0.35 * g.standard_normal(cols))
        col_scale[g.choice(cols, size=max(1, cols // 64), replace=False)] *= 4.0
        for e in range(N_EXPERTS):
            expert_scale = 0.02 * np.exp(0.5 * g.standard_normal())
            t = g.standard_t(3.5, (rows, cols)) / np.sqrt(3.5 / 1.5)
            out[f"layers.{layer}.ffn.experts.{e}.{which}.weight"] = (expert_scale * col_scale * t).astype(np.float32)
    return out


def _tid2eid(layer: int) -> np.ndarray:
    """vocab x k distinct experts per token; expert popularity is Zipf-like so a
    routing profile from the hash layers is skewed, not uniform."""
    g = _rng(f"layers.{layer}.ffn.gate.tid2eid")
    order = g.permutation(N_EXPERTS)
    p = np.empty(N_EXPERTS)
    p[order] = 1.0 / np.arange(1, N_EXPERTS + 1) ** 0.8
    p /= p.sum()
    table = np.stack([g.choice(N_EXPERTS, size=TOPK, replace=False, p=p) for _ in range(VOCAB)])
    return table.astype(np.int64)


# --------------------------------------------------------------------------
# official encodings (the DeepSeek rules; decoding lives in ds4quant.formats.fp8)


def _pow2_exponent_at_least(amax: np.ndarray, qmax: float) -> np.ndarray:
    """Smallest integer k with qmax * 2^k >= amax (amax > 0), exactly."""
    a = amax.astype(np.float64)
    k = np.ceil(np.log2(a / qmax))
    k = np.where(qmax * np.exp2(k) < a, k + 1, k)
    k = np.where(qmax * np.exp2(k - 1) >= a, k - 1, k)
    return k.astype(np.int64)


_E2M1_MAG = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def encode_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 (out, in) -> (int8 (out, in/2) low nibble = even element, uint8 E8M0 (out, in/32))."""
    rows, cols = w.shape
    blocks = w.astype(np.float64).reshape(rows, cols // 32, 32)
    amax = np.abs(blocks).max(axis=2)
    k = np.where(amax > 0, _pow2_exponent_at_least(np.where(amax > 0, amax, 1.0), 6.0), 0)
    v = blocks / np.exp2(k)[:, :, None]  # exact: power-of-two division
    a = np.abs(v)[..., None]
    dist = np.abs(a - _E2M1_MAG)
    best = dist.min(axis=-1, keepdims=True)
    idx = np.arange(8)
    tie_even = np.where((dist == best) & (idx % 2 == 0), idx, 99).min(axis=-1)
    first = dist.argmin(axis=-1)
    mag = np.where((dist == best).sum(axis=-1) > 1, tie_even, first)  # ties to even (RNE)
    codes = (mag | np.where((v < 0) & (mag > 0), 8, 0)).astype(np.uint8).reshape(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
    scale = (k + 127).astype(np.int64)
    assert scale.min() >= 0 and scale.max() <= 254
    return packed, scale.astype(np.uint8)


def encode_fp8(w: np.ndarray, torch) -> tuple[np.ndarray, np.ndarray]:
    """float32 (out, in) -> (uint8 e4m3fn bytes (out, in), uint8 E8M0 (ceil(out/128), ceil(in/128)))."""
    rows, cols = w.shape
    gr, gc = -(-rows // 128), -(-cols // 128)
    pad = np.zeros((gr * 128, gc * 128), np.float64)
    pad[:rows, :cols] = w
    amax = np.abs(pad.reshape(gr, 128, gc, 128)).max(axis=(1, 3))
    k = np.where(amax > 0, _pow2_exponent_at_least(np.where(amax > 0, amax, 1.0), 448.0), 0)
    kfull = np.repeat(np.repeat(k, 128, 0), 128, 1)[:rows, :cols]
    scaled = (w.astype(np.float64) / np.exp2(kfull)).astype(np.float32)  # exact
    q = torch.from_numpy(scaled).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    scale = (k + 127).astype(np.int64)
    assert scale.min() >= 0 and scale.max() <= 254
    return q, scale.astype(np.uint8)


# --------------------------------------------------------------------------
# build


def _hf_shapes(torch):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(DeepseekV4Config(**HF_KWARGS))
    return {n: tuple(t.shape) for n, t in model.state_dict().items()}


def build_tensors(torch):
    """-> (stored: official name -> torch tensor, exact: official name -> float32/int64 numpy)."""
    stored: dict = {}
    exact: dict = {}
    for hf, shape in _hf_shapes(torch).items():
        if hf.endswith(("gate_up_proj", "down_proj")) and ".experts." in hf:
            continue  # routed experts: per expert below
        name = _official_name(hf)
        if name.endswith("tid2eid"):
            layer = int(name.split(".")[1])
            t = _tid2eid(layer)
            stored[name] = torch.from_numpy(t)
            exact[name] = t
            continue
        store_dense(name, _init_value(name, shape), stored, exact, torch)
    for layer in range(N_LAYERS):
        for name, w in _expert_values(layer).items():
            store_expert(name, w, stored, exact, torch)
    return stored, exact


def store_dense(name: str, w: np.ndarray, stored: dict, exact: dict, torch) -> None:
    """One non-expert official tensor in the official storage type: FP8 dense
    projections (FP8_DENSE) with 128x128 scales, fp32 norms / hc / sinks / ape /
    router bias, bf16 for the rest. Sets stored[name] (+ ".scale") and exact[name]."""
    from ds4quant.formats.fp8 import dequant_fp8_blocks
    from ds4quant.formats import bf16_round

    module = name.rsplit(".", 1)[0]
    if module.split(".", 2)[-1] in FP8_DENSE:
        q, s = encode_fp8(w, torch)
        stored[name] = torch.from_numpy(q).view(torch.float8_e4m3fn)
        stored[module + ".scale"] = torch.from_numpy(s).view(torch.float8_e8m0fnu)
        exact[name] = dequant_fp8_blocks(q, s, where=name)
    elif name.endswith("norm.weight") or "hc_" in name or name.endswith(("attn_sink", "ape", "gate.bias")):
        stored[name] = torch.from_numpy(w)
        exact[name] = w
    else:  # embed, head, router weight, compressor/indexer projections
        wb = bf16_round(w)
        stored[name] = torch.from_numpy(wb).to(torch.bfloat16)
        exact[name] = wb


def store_expert(name: str, w: np.ndarray, stored: dict, exact: dict, torch) -> None:
    """One routed expert weight as official FP4 e2m1 (I8 pairs) + E8M0 per-32 scales."""
    from ds4quant.formats.fp8 import dequant_e2m1_blocks

    packed, s = encode_fp4(w)
    module = name.rsplit(".", 1)[0]
    stored[name] = torch.from_numpy(packed)
    stored[module + ".scale"] = torch.from_numpy(s).view(torch.float8_e8m0fnu)
    exact[name] = dequant_e2m1_blocks(packed, s, where=name)


def _shard_of(name: str) -> str:
    if name.startswith("layers."):
        return SHARDS[0] if int(name.split(".")[1]) < 2 else SHARDS[1]
    return SHARDS[0] if name == "embed.weight" else SHARDS[1]


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_checkpoint(out: Path, stored: dict, torch) -> None:
    write_official(out, stored, NATIVE_CONFIG, SHARDS, _shard_of)


def write_official(out: Path, stored: dict, config: dict, shards, shard_of) -> None:
    """Safetensors shards (shard_of(name) -> one of shards), the index and config.json."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    total = 0
    for shard in shards:
        part = {n: t.contiguous() for n, t in sorted(stored.items()) if shard_of(n) == shard}
        save_file(part, str(out / shard), metadata={"format": "pt"})
        os.chmod(out / shard, 0o644)  # safetensors creates 0600 files
        for n, t in part.items():
            weight_map[n] = shard
            total += t.numel() * t.element_size()
    _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_json(out / "config.json", config)


def write_tokens(path: Path) -> None:
    """16 sequences of 64 token ids: 12 random (bos first), 4 with repeats to copy."""
    g = _rng("tokens")
    lines = [
        "# Deterministic token-id sequences for ds4-tiny (vocab 512; 0 bos, 1 eos, 2 pad).",
        "# One sequence per line, ids separated by spaces. Made by samples/make_ds4_tiny.py.",
    ]
    for i in range(16):
        if i < 12:
            seq = [0] + list(g.integers(3, VOCAB, 63))
        else:
            motif = list(g.integers(3, VOCAB, 8 + 4 * (i - 12)))
            seq = [0] + (motif * 64)[:63]
        lines.append(" ".join(str(int(t)) for t in seq))
    path.write_text("\n".join(lines) + "\n")


def read_tokens(path: Path = TOKENS) -> list[list[int]]:
    return [[int(t) for t in line.split()] for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")]


# --------------------------------------------------------------------------
# proof: transformers loads it, bitwise equal to the exactly dequantized model


def verify(out: Path, exact: dict, torch, tokens: list[list[int]]) -> dict:
    import transformers
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)  # thread count changes bits; both models use the same
    ref = DeepseekV4ForCausalLM(DeepseekV4Config(**HF_KWARGS)).eval()
    ref.set_experts_implementation("eager")
    sd = {}
    for hf, t in ref.state_dict().items():
        if ".experts.gate_up_proj" in hf or ".experts.down_proj" in hf:
            layer = hf.split(".")[2]
            pre = f"layers.{layer}.ffn.experts"
            if hf.endswith("gate_up_proj"):
                sd[hf] = np.stack([np.concatenate([exact[f"{pre}.{e}.w1.weight"], exact[f"{pre}.{e}.w3.weight"]])
                                   for e in range(N_EXPERTS)])
            else:
                sd[hf] = np.stack([exact[f"{pre}.{e}.w2.weight"] for e in range(N_EXPERTS)])
        else:
            sd[hf] = exact[_official_name(hf)]
    ref.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}, strict=True)

    loaded, info = DeepseekV4ForCausalLM.from_pretrained(
        str(out), dtype=torch.float32, experts_implementation="eager", output_loading_info=True
    )
    loaded.eval()
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if problems:
        raise SystemExit(f"transformers loading problems: {problems}")
    lsd = loaded.state_dict()
    bad = [k for k, v in ref.state_dict().items()
           if k not in lsd or lsd[k].dtype != v.dtype or not torch.equal(lsd[k].view(-1), v.view(-1))]
    if bad:
        raise SystemExit(f"{len(bad)} parameters differ from the exact dequantized values, e.g. {bad[:3]}")
    ids = torch.tensor(tokens[:4], dtype=torch.long)
    with torch.no_grad():
        a = ref(ids, use_cache=False).logits
        b = loaded(ids, use_cache=False).logits
    if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
        raise SystemExit(f"logits differ: max |d| = {float((a - b).abs().max())}")
    if not torch.isfinite(a).all():
        raise SystemExit("logits are not finite")
    return {
        "params": sum(v.numel() for v in ref.state_dict().values()),
        "logits_sha256": hashlib.sha256(a.numpy().tobytes()).hexdigest(),
        "logits_shape": list(a.shape),
    }


README = """# ds4-tiny: a tiny DeepSeek-V4 checkpoint in the official layout

A 4-layer DeepSeek-V4 model (hidden 256, 16 routed experts of width 128, top-4,
1 shared expert, vocab 512; layers 0-1 hash-routed, 2-3 score-routed; attention
types sliding / CSA / HCA / CSA) stored the way DeepSeek ships V4:

| tensors | stored as |
|---|---|
| routed experts `layers.L.ffn.experts.E.w{{1,2,3}}.weight` | `I8` [out, in/2]: two FP4 e2m1 codes per byte, even element in the low nibble; `.scale` `F8_E8M0` [out, in/32], pow2 >= absmax/6 |
| `attn.{{wq_a,wq_b,wkv,wo_a,wo_b}}`, `attn.indexer.wq_b`, `ffn.shared_experts.w{{1,2,3}}` | `F8_E4M3` with `.scale` `F8_E8M0` per 128x128 block, pow2 >= absmax/448 |
| `embed`, `head`, `ffn.gate.weight`, compressor / indexer projections | `BF16` |
| norms, `hc_*`, `attn_sink`, `ape`, `ffn.gate.bias` | `F32` |
| `layers.{{0,1}}.ffn.gate.tid2eid` | `I64` [512, 4], 4 distinct experts per token (Zipf-like popularity) |

`config.json` uses the native DeepSeek keys (`compress_rate_csa` 4 and
`compress_rate_hca` 16 set the compression rates; `num_hash_layers` 2;
`qk_rope_head_dim` 16) with `layer_types` naming the attention types (the native
`compress_ratios` would have to call the HCA layer 128 while its rate and its
compressor's 16 position-embedding rows say 16), the FP8 `quantization_config` and
`expert_dtype` fp4, and `torch_dtype` bfloat16 (needed to load F8_E8M0 tensors).

Routed experts are drawn heavy-tailed (Student-t entries, a per-expert scale
spread, per-input-column scales with a few 4x outlier columns); all values come
from numpy generators seeded by tensor name, so regenerating gives the same bytes.

Checked when made: `transformers.DeepseekV4ForCausalLM.from_pretrained(dir,
dtype=torch.float32, experts_implementation="eager")` (accelerate installed)
loads it with 0 missing / unexpected / mismatched keys, and its parameters and
its logits on the first 4 sequences of `samples/tokens.txt` (1 thread) are bitwise
equal to a model built in memory from the exactly dequantized weights
({params:,} parameters; logits {shape} sha256 `{logits_sha}`).

Regenerate (or check the shipped bytes) from the repository root:

```bash
python samples/make_ds4_tiny.py          # rewrite samples/ds4-tiny and samples/tokens.txt
python samples/make_ds4_tiny.py --check  # rebuild in a temp folder and compare bytes
```

## Files

| file | bytes | sha256 |
|---|---|---|
{files}
"""


def _file_table(out: Path) -> str:
    rows = []
    for p in sorted(out.iterdir()):
        if p.name == "README.md":
            continue
        rows.append(f"| `{p.name}` | {p.stat().st_size:,} | `{hashlib.sha256(p.read_bytes()).hexdigest()}` |")
    return "\n".join(rows)


def make(out: Path, tokens_path: Path) -> dict:
    import torch

    if out.exists():
        shutil.rmtree(out)
    stored, exact = build_tensors(torch)
    write_checkpoint(out, stored, torch)
    write_tokens(tokens_path)
    facts = verify(out, exact, torch, read_tokens(tokens_path))
    (out / "README.md").write_text(README.format(
        params=facts["params"], shape=tuple(facts["logits_shape"]), logits_sha=facts["logits_sha256"],
        files=_file_table(out)))
    return facts


_LOGITS_SHA = re.compile(rb"sha256 `[0-9a-f]{64}`\)")


def _comparable(p: Path) -> bytes:
    """A file's bytes, less the README's logits digest: float logits depend on
    the CPU's vector width and BLAS kernels, so the digest is a record of the
    machine that made the sample, not part of the sample. The bitwise check
    itself (loaded model == model built from exact weights) runs in ``verify``
    on every machine."""
    data = p.read_bytes()
    return _LOGITS_SHA.sub(b"sha256 `<machine>`)", data) if p.name == "README.md" else data


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="rebuild in a temp folder and compare with the shipped files")
    args = ap.parse_args(argv)
    if not args.check:
        facts = make(OUT, TOKENS)
        size = sum(p.stat().st_size for p in OUT.iterdir())
        print(f"wrote {OUT} ({size:,} bytes), {TOKENS.name}; logits sha256 {facts['logits_sha256']}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out, tok = Path(tmp) / "ds4-tiny", Path(tmp) / "tokens.txt"
        make(out, tok)
        pairs = [(out / p.name, p) for p in sorted(OUT.iterdir())] + [(tok, TOKENS)]
        names = sorted(p.name for p in out.iterdir())
        differ = [b.name for a, b in pairs if not a.exists() or _comparable(a) != _comparable(b)]
        if differ or names != sorted(p.name for p in OUT.iterdir()):
            print(f"differs from the shipped sample: {differ or names}", file=sys.stderr)
            return 1
    print("identical to the shipped sample")
    return 0


if __name__ == "__main__":
    sys.exit(main())
