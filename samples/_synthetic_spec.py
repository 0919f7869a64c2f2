"""What make_synthetic.py generates: the spec (sizes, knobs, presets) and the
tensor list (official names, dtypes, shapes) grouped into units and shards."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import make_ds4_tiny as tiny  # noqa: E402  (the tiny sample's native config)


GENERATOR = "ds4quant-synthetic/1"
_RATIO_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
FP4_BLOCK = 32
FP8_BLOCK = 128


# --------------------------------------------------------------------------
# what to generate


@dataclass(frozen=True)
class SyntheticSpec:
    """Dimensions and knobs of a synthetic checkpoint (native DeepSeek-V4 meanings).

    compress_ratios: native per-layer codes (0 sliding, 4 CSA, 128 HCA); empty
    means [0, 4, 128, 4, 128, ...]. Hash-routed layers are the first
    ``hash_layers``. ``dead_fraction`` of each layer's experts (at least one)
    get magnitude x ``dead_scale``.
    """

    layers: int = 3
    experts: int = 8
    hidden: int = 256
    moe_inter: int = 128
    vocab: int = 512
    seed: int = 0
    shard_size: int = 64 << 20
    topk: int = 4
    hash_layers: int = 1
    shared_experts: int = 1
    heads: int = 4
    head_dim: int = 64
    rope_dim: int = 16
    q_lora_rank: int = 128
    o_groups: int = 2
    o_lora_rank: int = 64
    index_heads: int = 4
    index_head_dim: int = 32
    index_topk: int = 4
    hc_mult: int = 2
    sliding_window: int = 16
    compress_rate_csa: int = 4
    compress_rate_hca: int = 16
    compress_ratios: tuple[int, ...] = ()
    t_df: float = 4.0  # fixed: the inverse CDF below is the closed form for df 4
    expert_scale: float = 0.02
    expert_sigma: float = 0.5
    dead_fraction: float = 0.04
    dead_scale: float = 1e-3

    def ratios(self) -> tuple[int, ...]:
        if self.compress_ratios:
            return tuple(self.compress_ratios)
        return tuple(0 if i == 0 else (4 if i % 2 else 128) for i in range(self.layers))

    def validate(self) -> None:
        """Raise ValueError naming the first setting the layout cannot hold."""
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        for k in ("layers", "experts", "hidden", "moe_inter", "vocab", "topk", "heads", "head_dim",
                  "q_lora_rank", "o_groups", "o_lora_rank", "index_heads", "index_head_dim", "hc_mult",
                  "shard_size", "shared_experts"):
            need(isinstance(getattr(self, k), int) and getattr(self, k) >= 1, f"{k} must be a positive integer")
        # rocmfp2_mix rows need 128+ values and FP8 scales come per 128x128 block
        need(self.hidden % 128 == 0, f"hidden {self.hidden} must be a multiple of 128")
        need(self.moe_inter % 128 == 0, f"moe_inter {self.moe_inter} must be a multiple of 128")
        need(self.topk <= self.experts, f"topk {self.topk} exceeds experts {self.experts}")
        need(0 <= self.hash_layers <= self.layers, f"hash_layers must be in [0, {self.layers}]")
        need((self.heads * self.head_dim) % self.o_groups == 0, "heads * head_dim must divide by o_groups")
        need(self.rope_dim <= self.head_dim, "rope_dim exceeds head_dim")
        need(len(self.ratios()) == self.layers and all(r in (0, 4, 128) for r in self.ratios()),
             "compress_ratios needs one of 0/4/128 per layer")
        need(self.t_df == 4.0, "t_df is fixed at 4 (closed-form inverse CDF)")
        need(0.0 <= self.dead_fraction < 1.0 and 0.0 < self.dead_scale <= 1.0, "bad dead_fraction/dead_scale")

    def native_config(self) -> dict:
        """config.json: the tiny sample's native DeepSeek config with these dims."""
        cfg = json.loads(json.dumps(tiny.NATIVE_CONFIG))
        cfg.update({
            "vocab_size": self.vocab, "hidden_size": self.hidden, "moe_intermediate_size": self.moe_inter,
            "num_hidden_layers": self.layers, "num_attention_heads": self.heads, "num_key_value_heads": 1,
            "head_dim": self.head_dim, "q_lora_rank": self.q_lora_rank, "qk_rope_head_dim": self.rope_dim,
            "o_groups": self.o_groups, "o_lora_rank": self.o_lora_rank, "num_experts_per_tok": self.topk,
            "n_routed_experts": self.experts, "n_shared_experts": self.shared_experts,
            "num_hash_layers": self.hash_layers, "compress_ratios": list(self.ratios()),
            # the tiny sample's layer_types name its own 4 layers; these name ours
            "layer_types": [_RATIO_TYPE[r] for r in self.ratios()],
            "compress_rate_csa": self.compress_rate_csa, "compress_rate_hca": self.compress_rate_hca,
            "sliding_window": self.sliding_window, "hc_mult": self.hc_mult, "index_n_heads": self.index_heads,
            "index_head_dim": self.index_head_dim, "index_topk": self.index_topk,
            "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
        })
        gen = asdict(self)
        gen["compress_ratios"] = list(self.ratios())
        cfg["ds4quant_synthetic"] = {"generator": GENERATOR, **gen}
        return cfg


def _dims(hidden: int, moe_inter: int) -> dict:
    """Attention and hyper-connection sizes that scale with hidden (DS4 proportions, smaller)."""
    big = hidden >= 1024
    return {
        "heads": max(4, hidden // 256), "head_dim": 128 if big else 64, "rope_dim": 32 if big else 16,
        "q_lora_rank": hidden // 2, "o_groups": 4 if big else 2, "o_lora_rank": hidden // 8,
        "index_heads": 8 if big else 4, "index_head_dim": 64 if big else 32,
        "hc_mult": 4 if big else 2, "sliding_window": 128 if big else 16,
        "compress_rate_hca": 128 if big else 16,
    }


# DeepSeek-V4 Flash's attention types per layer (native compress_ratios codes):
# two sliding-window layers, then CSA (ratio 4) and HCA (ratio 128) alternating
# for 40 layers, and a last CSA layer (the official config's compress_ratios).
DS4_FLASH_RATIOS = (0, 0) + (4, 128) * 20 + (4,)

# DeepSeek-V4 Flash's real dimensions (same section): a slice of N layers has the
# real layers' shapes, so its cost per layer is the real model's.
_DS4_FLASH = dict(
    layers=2, experts=256, hidden=4096, moe_inter=2048, vocab=129280, topk=6, hash_layers=3, shared_experts=1,
    heads=64, head_dim=512, rope_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, index_heads=64,
    index_head_dim=128, index_topk=512, hc_mult=4, sliding_window=128, compress_rate_csa=4,
    compress_rate_hca=128, shard_size=4 << 30,
)

PRESETS = {
    # seconds: tests
    "tiny": dict(layers=3, experts=8, hidden=256, moe_inter=128, vocab=512, topk=4, hash_layers=1),
    # ~95 MB (67 MB FP4 experts): larger tests
    "medium": dict(layers=4, experts=20, hidden=1024, moe_inter=512, vocab=2048, topk=6, hash_layers=1,
                   shard_size=32 << 20),
    # ~0.96 GB of FP4 expert data (1.81 G weights): benchmarks/convert.py
    "bench": dict(layers=6, experts=48, hidden=2048, moe_inter=1024, vocab=8192, topk=6, hash_layers=2,
                  shard_size=256 << 20),
    # DeepSeek-V4 Flash at its real dimensions, --layers N of its 43 (2 layers: ~8.6 GB)
    "ds4-flash": _DS4_FLASH,
    # the same layout and ratio pattern, small (tests of streaming and memory budgets)
    "ds4-flash-mini": dict(layers=4, experts=32, hidden=512, moe_inter=512, vocab=8192, topk=6, hash_layers=3,
                           shared_experts=1, heads=8, head_dim=128, rope_dim=32, q_lora_rank=256, o_groups=8,
                           o_lora_rank=128, index_heads=8, index_head_dim=64, index_topk=32, hc_mult=4,
                           sliding_window=128, compress_rate_csa=4, compress_rate_hca=128, shard_size=256 << 20),
}
# presets whose layers follow DS4 Flash's attention pattern (from layer ``ratio_offset``)
_DS4_PATTERN = ("ds4-flash", "ds4-flash-mini")


def preset(name: str, ratio_offset: int = 0, **overrides) -> SyntheticSpec:
    """A SyntheticSpec from a preset ("tiny", "medium", "bench", "ds4-flash",
    "ds4-flash-mini") with overrides; attention sizes follow ``hidden`` unless
    given. The ds4-flash presets take DS4 Flash's attention types per layer,
    starting at its layer ``ratio_offset`` (a slice of later layers)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    kw = dict(PRESETS[name])
    kw.update({k: v for k, v in overrides.items() if v is not None})
    if name in _DS4_PATTERN and "compress_ratios" not in overrides:
        n = kw["layers"]
        if not 0 <= ratio_offset or ratio_offset + n > len(DS4_FLASH_RATIOS):
            raise ValueError(f"layers {ratio_offset}..{ratio_offset + n - 1} are outside DS4 Flash's "
                             f"{len(DS4_FLASH_RATIOS)} layers")
        kw["compress_ratios"] = DS4_FLASH_RATIOS[ratio_offset:ratio_offset + n]
        if overrides.get("hash_layers") is None:  # the model's first layers are hash-routed, not the slice's
            kw["hash_layers"] = max(0, min(kw["hash_layers"] - ratio_offset, n))
    dims = _dims(kw["hidden"], kw["moe_inter"])
    dims.update(kw)
    spec = SyntheticSpec(**dims)
    if spec.hash_layers >= spec.layers and spec.layers > 1:
        spec = replace(spec, hash_layers=spec.layers - 1)  # keep one score-routed layer (router bias)
    spec.validate()
    return spec


# --------------------------------------------------------------------------
# the tensor list (official names; shapes as ds4quant.sources.official checks them)


@dataclass(frozen=True)
class TensorPlan:
    name: str
    dtype: str  # safetensors tag
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * {"I8": 1, "F8_E8M0": 1, "F8_E4M3": 1, "BF16": 2, "F32": 4, "I64": 8}[self.dtype]


@dataclass(frozen=True)
class Unit:
    """Tensors made together (a weight and its scale), by ``kind``."""

    kind: str  # "expert" | "fp8" | "bf16" | "f32" | "tid2eid"
    tensors: tuple[TensorPlan, ...]
    layer: Optional[int] = None
    expert: Optional[int] = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _fp8(name: str, rows: int, cols: int) -> Unit:
    grid = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    return Unit("fp8", (TensorPlan(name + ".scale", "F8_E8M0", grid), TensorPlan(name + ".weight", "F8_E4M3", (rows, cols))))


def _plain(kind: str, name: str, *shape: int) -> Unit:
    return Unit(kind, (TensorPlan(name, {"bf16": "BF16", "f32": "F32"}[kind], tuple(shape)),))


def plan_units(spec: SyntheticSpec) -> list[Unit]:
    """Every tensor of the checkpoint, grouped into units, in file order:
    embed, then each layer (dense tensors, then experts 0..E-1), then head/norm."""
    H, V, I, E = spec.hidden, spec.vocab, spec.moe_inter, spec.experts
    hc, nh, hd = spec.hc_mult, spec.heads, spec.head_dim
    nhc = (2 + hc) * hc
    units = [_plain("bf16", "embed.weight", V, H)]
    for L, code in enumerate(spec.ratios()):
        p = f"layers.{L}."
        u = [
            _plain("f32", p + "attn.attn_sink", nh),
            _plain("f32", p + "attn.kv_norm.weight", hd),
            _plain("f32", p + "attn.q_norm.weight", spec.q_lora_rank),
            _fp8(p + "attn.wkv", hd, H),
            _fp8(p + "attn.wo_a", spec.o_groups * spec.o_lora_rank, nh * hd // spec.o_groups),
            _fp8(p + "attn.wo_b", H, spec.o_groups * spec.o_lora_rank),
            _fp8(p + "attn.wq_a", spec.q_lora_rank, H),
            _fp8(p + "attn.wq_b", nh * hd, spec.q_lora_rank),
        ]
        if code:
            csa = code == 4
            rate = spec.compress_rate_csa if csa else spec.compress_rate_hca
            coff = 2 if csa else 1  # CSA windows overlap: kv/gate/ape twice as wide
            u += [
                _plain("f32", p + "attn.compressor.ape", rate, coff * hd),
                _plain("f32", p + "attn.compressor.norm.weight", hd),
                _plain("bf16", p + "attn.compressor.wgate.weight", coff * hd, H),
                _plain("bf16", p + "attn.compressor.wkv.weight", coff * hd, H),
            ]
            if csa:
                ihd = spec.index_head_dim
                u += [
                    _plain("f32", p + "attn.indexer.compressor.ape", rate, 2 * ihd),
                    _plain("f32", p + "attn.indexer.compressor.norm.weight", ihd),
                    _plain("bf16", p + "attn.indexer.compressor.wgate.weight", 2 * ihd, H),
                    _plain("bf16", p + "attn.indexer.compressor.wkv.weight", 2 * ihd, H),
                    _plain("bf16", p + "attn.indexer.weights_proj.weight", spec.index_heads, H),
                    _fp8(p + "attn.indexer.wq_b", spec.index_heads * ihd, spec.q_lora_rank),
                ]
        Is = I * spec.shared_experts
        u += [
            _plain("f32", p + "attn_norm.weight", H),
            _plain("f32", p + "ffn_norm.weight", H),
            _plain("bf16", p + "ffn.gate.weight", E, H),
            (Unit("tid2eid", (TensorPlan(p + "ffn.gate.tid2eid", "I64", (V, spec.topk)),), layer=L)
             if L < spec.hash_layers else _plain("f32", p + "ffn.gate.bias", E)),
            _fp8(p + "ffn.shared_experts.w1", Is, H),
            _fp8(p + "ffn.shared_experts.w2", H, Is),
            _fp8(p + "ffn.shared_experts.w3", Is, H),
            _plain("f32", p + "hc_attn_base", nhc),
            _plain("f32", p + "hc_attn_fn", nhc, hc * H),
            _plain("f32", p + "hc_attn_scale", 3),
            _plain("f32", p + "hc_ffn_base", nhc),
            _plain("f32", p + "hc_ffn_fn", nhc, hc * H),
            _plain("f32", p + "hc_ffn_scale", 3),
        ]
        units += u
        for e in range(E):
            for w, (rows, cols) in (("w1", (I, H)), ("w2", (H, I)), ("w3", (I, H))):
                n = f"{p}ffn.experts.{e}.{w}"
                units.append(Unit("expert", (TensorPlan(n + ".scale", "F8_E8M0", (rows, cols // FP4_BLOCK)),
                                             TensorPlan(n + ".weight", "I8", (rows, cols // 2))), layer=L, expert=e))
    units += [
        _plain("bf16", "head.weight", V, H),
        _plain("f32", "hc_head_base", hc),
        _plain("f32", "hc_head_fn", hc, hc * H),
        _plain("f32", "hc_head_scale", 1),
        _plain("f32", "norm.weight", H),
    ]
    return units


def shard_units(units: list[Unit], shard_size: int) -> list[list[Unit]]:
    """Greedy split in file order: a shard closes before a unit that would overflow it."""
    shards: list[list[Unit]] = [[]]
    size = 0
    for u in units:
        if shards[-1] and size + u.nbytes > shard_size:
            shards.append([])
            size = 0
        shards[-1].append(u)
        size += u.nbytes
    return shards
