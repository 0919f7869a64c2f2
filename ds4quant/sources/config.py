"""DeepSeek-V4 model configuration from config.json, native or transformers keys.

DeepSeek ships native keys (``compress_ratios`` per layer as 0/4/128 codes,
``num_hash_layers``, ``qk_rope_head_dim``, ``compress_rate_{csa,hca}``,
``rope_scaling``); transformers writes ``layer_types``, ``mlp_layer_types``,
``compress_rates``, ``partial_rotary_factor`` and ``rope_parameters``. Both fold
into one frozen ``Ds4Config`` the way transformers' ``DeepseekV4Config`` folds
them (docs/reference-model.md#config). Missing dimensions that
transformers defaults to the V4-Flash sizes take the same defaults, except the
core sizes every checkpoint states (``REQUIRED``), which are refused if absent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional

from ds4quant.errors import BadInputError, UnsupportedFormatError

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
HASH_MOE = "hash_moe"
MOE = "moe"

# native compress_ratios codes -> attention type (transformers' mapping knows only these)
_RATIO_CODE = {0: SLIDING, 4: CSA, 128: HCA}

REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "moe_intermediate_size",
            "n_routed_experts", "num_experts_per_tok")

# transformers DeepseekV4Config defaults (V4-Flash sizes) for the rest
_INT_DEFAULTS = {
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024,
    "o_groups": 8, "o_lora_rank": 1024, "n_shared_experts": 1, "sliding_window": 128,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "max_position_embeddings": 1048576,
}
_FLOAT_DEFAULTS = {
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
}


@dataclass(frozen=True)
class RopeScaling:
    """YaRN scaling of the compressed-attention RoPE (factor 1.0 = none).

    ext_factor / attn_factor: the source's ``extrapolation_factor`` and
    ``attention_factor`` (or ``attn_factor``) when it states them, else None
    (engines then derive their own).
    """

    factor: float = 1.0
    original_context_length: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    ext_factor: Optional[float] = None
    attn_factor: Optional[float] = None

    @property
    def kind(self) -> str:
        """"yarn", or "none" when the factor is 1 (no scaling)."""
        return "none" if self.factor == 1.0 else "yarn"


@dataclass(frozen=True)
class Ds4Config:
    """Normalized DeepSeek-V4 hyperparameters (one value per concept)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    q_lora_rank: int
    qk_rope_head_dim: int
    o_groups: int
    o_lora_rank: int
    n_shared_experts: int
    sliding_window: int
    hc_mult: int
    hc_sinkhorn_iters: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    max_position_embeddings: int
    routed_scaling_factor: float
    swiglu_limit: float
    hc_eps: float
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    scoring_func: str
    layer_types: tuple[str, ...]
    compress_ratios: tuple[int, ...]  # actual rate per layer, 0 for sliding-only
    mlp_layer_types: tuple[str, ...]
    rope_scaling: RopeScaling
    expert_dtype: Optional[str]  # "fp4" for the official FP4 experts
    fp8_block: Optional[tuple[int, int]]  # weight_block_size of the FP8 quantization_config
    norm_topk_prob: bool = True  # the top-k routing weights are renormalized to sum 1
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_hash_layers(self) -> int:
        return sum(t == HASH_MOE for t in self.mlp_layer_types)

    @property
    def hash_layers_are_prefix(self) -> bool:
        n = self.num_hash_layers
        return all(t == HASH_MOE for t in self.mlp_layer_types[:n])


def _int(cfg: Mapping, key: str, where: str, default: Optional[int] = None, minimum: int = 1) -> int:
    v = cfg.get(key, default)
    if v is None:
        raise BadInputError(f"config has no {key!r}, which every DeepSeek-V4 checkpoint states", where=where)
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadInputError(f"{key} must be an integer, got {v!r}", where=where)
    if v < minimum:
        raise BadInputError(f"{key} must be >= {minimum}, got {v}", where=where)
    return v


def _float(cfg: Mapping, key: str, where: str, default: float) -> float:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise BadInputError(f"{key} must be a finite number, got {v!r}", where=where)
    return float(v)


def _str_list(cfg: Mapping, key: str, n: int, allowed: tuple[str, ...], where: str) -> Optional[tuple[str, ...]]:
    v = cfg.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(t, str) for t in v):
        raise BadInputError(f"{key} must be a list of strings", where=where)
    if len(v) < n:
        raise BadInputError(f"{key} has {len(v)} entries for {n} layers", where=where)
    bad = [t for t in v if t not in allowed]
    if bad:
        raise BadInputError(f"{key} entries must be one of {allowed}, got {bad[0]!r}", where=where)
    return tuple(v[:n])  # transformers truncates to num_hidden_layers


def _rope_scaling(cfg: Mapping, where: str, max_pos: int) -> RopeScaling:
    rs = cfg.get("rope_scaling")
    if rs is None:
        rp = cfg.get("rope_parameters")
        if isinstance(rp, dict) and isinstance(rp.get("compress"), dict):
            rs = rp["compress"]
    if not isinstance(rs, dict):
        return RopeScaling(1.0, max_pos)
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind in ("default", None):
        return RopeScaling(1.0, max_pos)
    if kind != "yarn":
        raise UnsupportedFormatError(f"rope scaling type {kind!r} is not supported (yarn or none)", where=where)
    attn = rs.get("attention_factor", rs.get("attn_factor"))
    return RopeScaling(
        factor=_float(rs, "factor", where, 1.0),
        original_context_length=_int(rs, "original_max_position_embeddings", where, max_pos),
        beta_fast=_float(rs, "beta_fast", where, 32.0),
        beta_slow=_float(rs, "beta_slow", where, 1.0),
        ext_factor=_float(rs, "extrapolation_factor", where, 1.0) if "extrapolation_factor" in rs else None,
        attn_factor=_float({"f": attn}, "f", where, 1.0) if attn is not None else None,
    )


def parse_config(cfg: Mapping[str, Any], where: str = "config.json") -> Ds4Config:
    """Fold a config.json dict (native DeepSeek or transformers keys) into a Ds4Config."""
    if not isinstance(cfg, Mapping):
        raise BadInputError("config must be a JSON object", where=where)
    model_type = cfg.get("model_type")
    if model_type is not None and not str(model_type).startswith("deepseek_v4"):
        raise UnsupportedFormatError(f"model_type {model_type!r} is not DeepSeek-V4", where=where)
    ints = {k: _int(cfg, k, where) for k in REQUIRED}
    ints.update({k: _int(cfg, k, where, d) for k, d in _INT_DEFAULTS.items()})
    floats = {k: _float(cfg, k, where, d) for k, d in _FLOAT_DEFAULTS.items()}
    n = ints["num_hidden_layers"]

    if ints["num_experts_per_tok"] > ints["n_routed_experts"]:
        raise BadInputError(
            f"num_experts_per_tok {ints['num_experts_per_tok']} > n_routed_experts {ints['n_routed_experts']}",
            where=where)
    if (ints["num_attention_heads"] * ints["head_dim"]) % ints["o_groups"]:
        raise BadInputError("num_attention_heads * head_dim must be divisible by o_groups", where=where)

    # rope width: native qk_rope_head_dim, else head_dim * partial_rotary_factor (default 64/512)
    if "qk_rope_head_dim" in cfg:
        rope_dim = _int(cfg, "qk_rope_head_dim", where)
    else:
        prf = 64 / 512
        if cfg.get("partial_rotary_factor") is not None:
            prf = _float(cfg, "partial_rotary_factor", where, prf)
        rope_dim = int(ints["head_dim"] * prf)
    if rope_dim > ints["head_dim"]:
        raise BadInputError(f"rope dimension {rope_dim} exceeds head_dim {ints['head_dim']}", where=where)

    # compress rates: transformers dict, then native scalar overrides
    rates = {CSA: 4, HCA: 128}
    cr = cfg.get("compress_rates")
    if cr is not None:
        if not isinstance(cr, dict):
            raise BadInputError("compress_rates must be an object", where=where)
        for key in (CSA, HCA):
            if key not in cr:
                raise BadInputError(f"compress_rates needs both keys; {key!r} is missing", where=where)
            rates[key] = _int(cr, key, where)
    if "compress_rate_csa" in cfg:
        rates[CSA] = _int(cfg, "compress_rate_csa", where)
    if "compress_rate_hca" in cfg:
        rates[HCA] = _int(cfg, "compress_rate_hca", where)

    layer_types = _str_list(cfg, "layer_types", n, (SLIDING, CSA, HCA), where)
    if layer_types is None and cfg.get("compress_ratios") is not None:
        codes = cfg["compress_ratios"]
        if not isinstance(codes, list) or len(codes) < n or not all(_int_like(c) for c in codes):
            raise BadInputError(f"compress_ratios must list an integer for each of the {n} layers", where=where)
        bad = [c for c in codes[:n] if c not in _RATIO_CODE]
        if bad:
            raise UnsupportedFormatError(
                f"compress_ratios value {bad[0]} is not one of 0, 4, 128 (sliding, CSA, HCA)", where=where)
        layer_types = tuple(_RATIO_CODE[c] for c in codes[:n])
    if layer_types is None:  # transformers' default: 2 x HCA, then HCA/CSA alternating
        layer_types = tuple([HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))])
    compress_ratios = tuple(0 if t == SLIDING else rates[t] for t in layer_types)

    mlp_types = _str_list(cfg, "mlp_layer_types", n, (HASH_MOE, MOE), where)
    if mlp_types is None:
        n_hash = _int(cfg, "num_hash_layers", where, 3, minimum=0)
        mlp_types = tuple([HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash))

    norm_topk = cfg.get("norm_topk_prob", True)
    if not isinstance(norm_topk, bool):
        raise BadInputError(f"norm_topk_prob must be true or false, got {norm_topk!r}", where=where)
    scoring = cfg.get("scoring_func", "sqrtsoftplus")
    if scoring not in ("sqrtsoftplus", "sigmoid"):
        raise UnsupportedFormatError(f"scoring_func {scoring!r} is not supported (sqrtsoftplus, sigmoid)", where=where)

    qc = cfg.get("quantization_config")
    expert_dtype = cfg.get("expert_dtype")
    fp8_block = None
    if qc is not None:
        if not isinstance(qc, dict):
            raise BadInputError("quantization_config must be an object", where=where)
        expert_dtype = qc.get("expert_dtype", expert_dtype)
        if qc.get("quant_method", "fp8") != "fp8":
            raise UnsupportedFormatError(f"quant_method {qc.get('quant_method')!r} is not supported (fp8)", where=where)
        wbs = qc.get("weight_block_size", [128, 128])
        if not (isinstance(wbs, list) and len(wbs) == 2 and all(_int_like(b) and b > 0 for b in wbs)):
            raise BadInputError(f"weight_block_size must be [rows, cols], got {wbs!r}", where=where)
        fp8_block = (int(wbs[0]), int(wbs[1]))
    if expert_dtype not in (None, "fp4", "fp8", "bf16"):
        raise UnsupportedFormatError(f"expert_dtype {expert_dtype!r} is not supported", where=where)

    return Ds4Config(
        **ints,
        **floats,
        qk_rope_head_dim=rope_dim,
        scoring_func=scoring,
        layer_types=layer_types,
        compress_ratios=compress_ratios,
        mlp_layer_types=mlp_types,
        rope_scaling=_rope_scaling(cfg, where, ints["max_position_embeddings"]),
        expert_dtype=expert_dtype,
        fp8_block=fp8_block,
        norm_topk_prob=norm_topk,
        raw=MappingProxyType(dict(cfg)),
    )


def _int_like(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def compress_ratio_problems(c: Ds4Config, ape_rows: Mapping[int, int]) -> list[str]:
    """Why a config's native ``compress_ratios`` read two ways (empty when it does not).

    DeepSeek's own reference code takes ``compress_ratios[L]`` as layer L's
    ratio; transformers (and ds4quant) read 0/4/128 as the attention *type*
    and take the ratio from ``compress_rate_{csa,hca}``. When the two differ
    the checkpoint means one thing to one reader and another to the other.
    ape_rows: layer -> rows of its ``attn.compressor.ape`` (one per compressed
    position, so the true ratio), named in the message when known.
    """
    codes = c.raw.get("compress_ratios") if c.raw is not None else None
    if not isinstance(codes, list) or c.raw.get("layer_types") is not None:
        return []
    out = []
    for layer, (code, rate) in enumerate(zip(codes, c.compress_ratios)):
        if _int_like(code) and code != rate:
            key = "compress_rate_hca" if code == 128 else "compress_rate_csa"
            rows = ape_rows.get(layer)
            out.append(f"config.json compress_ratios[{layer}] = {code}, but {key} = {rate}"
                       + (f" and layers.{layer}.attn.compressor.ape has {rows} rows" if rows is not None else "")
                       + f": DeepSeek's reference code reads ratio {code}, transformers and ds4quant {rate} "
                         f"(make compress_ratios[{layer}] and {key} agree)")
    return out
