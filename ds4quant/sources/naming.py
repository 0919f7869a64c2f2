"""Official DeepSeek-V4 tensor names -> GGUF names, tensor classes, deepseek4.* keys.

Names follow docs/formats.md#ds4-gguf (the Lucebox converter and loader)
and the transformers table in docs/reference-model.md#names:

- routed experts ``layers.L.ffn.experts.E.w{1,3,2}`` stack over E into
  ``blk.L.ffn_{gate,up,down}_exps.weight`` with GGUF shape [in, out, n_expert];
- ``.scale`` (or ``.weight_scale_inv``) tensors are part of their weight's
  source encoding: they map to the same GGUF tensor with role "scale";
- ``mtp.*`` (MTP / DSpark heads) has no place in the target GGUF and is
  reported as skipped with the reason, as is anything unknown.

``deepseek4_kvs`` computes every key Lucebox's loader requires
(``kRequiredU32Keys``, plus ``attention.value_length`` that newer loaders also
require) and the optional float / array keys it reads, and every key
llama.cpp's DeepSeek-V4 loader requires, in the types it checks
(``artifact/llama_cpp.py`` holds that list as data; docs/runtimes.md), from a
``Ds4Config``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from types import MappingProxyType
from typing import Any, Iterable, NamedTuple, Optional

from ds4quant import names as N
from ds4quant.errors import BadInputError, UnsupportedFormatError
from ds4quant.names import WRITTEN_U32_KEYS as REQUIRED_U32_KEYS  # noqa: F401 (re-exported: names.DS4_U32_KEYS is the one table)
from ds4quant.names import layer_of, parse_stack, stack_name
from ds4quant.sources.config import Ds4Config


class Kind(str, Enum):
    """What a tensor is, for recipes (string-valued so it serializes as is)."""

    ROUTED_EXPERT = "routed_expert"
    SHARED_EXPERT = "shared_expert"
    ATTENTION = "attention"
    ROUTER = "router"
    NORM = "norm"
    HASH_TABLE = "hash_table"
    HC = "hc"
    EMBEDDING = "embedding"
    OUTPUT = "output"
    OTHER = "other"


@dataclass(frozen=True)
class Mapped:
    """One official tensor and where it goes.

    gguf: target GGUF tensor name; role: "weight" (the values) or "scale" (an
    E8M0 scale that belongs to the weight's source encoding); layer / expert:
    indices when the name has them; which: "gate"/"up"/"down" for expert FFNs.
    """

    name: str
    gguf: str
    kind: Kind
    role: str = "weight"
    layer: Optional[int] = None
    expert: Optional[int] = None
    which: Optional[str] = None

    @property
    def stacked(self) -> bool:
        """True for routed experts: many official tensors fill one GGUF tensor."""
        return self.expert is not None


@dataclass(frozen=True)
class Skipped:
    name: str
    reason: str


_EXPERT_WHICH = {"w1": "gate", "w3": "up", "w2": "down"}

# per-layer module (official, without the .weight suffix) -> (GGUF stem, kind)
_LAYER_MODULES: dict[str, tuple[str, Kind]] = {
    "attn_norm": ("attn_norm", Kind.NORM),
    "ffn_norm": ("ffn_norm", Kind.NORM),
    "attn.wq_a": ("attn_q_a", Kind.ATTENTION),
    "attn.q_norm": ("attn_q_a_norm", Kind.NORM),
    "attn.wq_b": ("attn_q_b", Kind.ATTENTION),
    "attn.wkv": ("attn_kv", Kind.ATTENTION),
    "attn.kv_norm": ("attn_kv_a_norm", Kind.NORM),
    "attn.wo_a": ("attn_output_a", Kind.ATTENTION),
    "attn.wo_b": ("attn_output_b", Kind.ATTENTION),
    "attn.compressor.wkv": ("attn_compressor_kv", Kind.ATTENTION),
    "attn.compressor.wgate": ("attn_compressor_gate", Kind.ATTENTION),
    "attn.compressor.norm": ("attn_compressor_norm", Kind.NORM),
    "attn.indexer.wq_b": ("indexer.attn_q_b", Kind.ATTENTION),
    "attn.indexer.weights_proj": ("indexer.proj", Kind.ATTENTION),
    "attn.indexer.compressor.wkv": ("indexer_compressor_kv", Kind.ATTENTION),
    "attn.indexer.compressor.wgate": ("indexer_compressor_gate", Kind.ATTENTION),
    "attn.indexer.compressor.norm": ("indexer_compressor_norm", Kind.NORM),
    "ffn.gate": ("ffn_gate_inp", Kind.ROUTER),
    "ffn.shared_experts.w1": ("ffn_gate_shexp", Kind.SHARED_EXPERT),
    "ffn.shared_experts.w3": ("ffn_up_shexp", Kind.SHARED_EXPERT),
    "ffn.shared_experts.w2": ("ffn_down_shexp", Kind.SHARED_EXPERT),
}

# per-layer bare parameters (no .weight suffix in the official files)
_LAYER_PARAMS: dict[str, tuple[str, Kind]] = {
    "attn.attn_sink": ("blk.{L}.attn_sinks.weight", Kind.ATTENTION),
    "attn.compressor.ape": ("blk.{L}.attn_compressor_ape.weight", Kind.ATTENTION),
    "attn.indexer.compressor.ape": ("blk.{L}.indexer_compressor_ape.weight", Kind.ATTENTION),
    "hc_attn_fn": ("blk.{L}.hc_attn_fn.weight", Kind.HC),
    "hc_attn_base": ("blk.{L}.hc_attn_base.weight", Kind.HC),
    "hc_attn_scale": ("blk.{L}.hc_attn_scale.weight", Kind.HC),
    "hc_ffn_fn": ("blk.{L}.hc_ffn_fn.weight", Kind.HC),
    "hc_ffn_base": ("blk.{L}.hc_ffn_base.weight", Kind.HC),
    "hc_ffn_scale": ("blk.{L}.hc_ffn_scale.weight", Kind.HC),
    "ffn.gate.bias": ("blk.{L}.exp_probs_b.bias", Kind.ROUTER),
    "ffn.gate.tid2eid": ("blk.{L}.ffn_gate_tid2eid.weight", Kind.HASH_TABLE),
}

_GLOBAL: dict[str, tuple[str, Kind]] = {
    "embed.weight": ("token_embd.weight", Kind.EMBEDDING),
    "head.weight": ("output.weight", Kind.OUTPUT),
    "norm.weight": ("output_norm.weight", Kind.NORM),
    "hc_head_fn": ("output_hc_fn.weight", Kind.HC),
    "hc_head_base": ("output_hc_base.weight", Kind.HC),
    "hc_head_scale": ("output_hc_scale.weight", Kind.HC),
}

_LAYER_RE = re.compile(r"^layers\.(0|[1-9][0-9]*)\.(.+)$")
_EXPERT_RE = re.compile(r"^ffn\.experts\.(0|[1-9][0-9]*)\.(w[123])\.(weight|scale|weight_scale_inv)$")
_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")


def map_name(name: str) -> "Mapped | Skipped":
    """Map one official tensor name; never raises for an unknown name."""
    if name in _GLOBAL:
        gguf, kind = _GLOBAL[name]
        return Mapped(name, gguf, kind)
    if name.startswith("mtp."):
        return Skipped(name, "MTP/DSpark head: not part of the target GGUF (a draft GGUF carries DSpark)")
    if name.startswith("model."):
        return Skipped(name, "transformers-style name (model.*): not the official DeepSeek layout")
    m = _LAYER_RE.match(name)
    if not m:
        return Skipped(name, "no GGUF name for this tensor")
    layer, rest = int(m.group(1)), m.group(2)
    e = _EXPERT_RE.match(rest)
    if e:
        which = _EXPERT_WHICH[e.group(2)]
        role = "weight" if e.group(3) == "weight" else "scale"
        return Mapped(name, stack_name(layer, which), Kind.ROUTED_EXPERT, role, layer,
                      int(e.group(1)), which)
    if rest in _LAYER_PARAMS:
        gguf, kind = _LAYER_PARAMS[rest]
        return Mapped(name, gguf.format(L=layer), kind, layer=layer)
    for suffix, role in ((".weight", "weight"),) + tuple((s, "scale") for s in _SCALE_SUFFIXES):
        if rest.endswith(suffix) and rest[: -len(suffix)] in _LAYER_MODULES:
            stem, kind = _LAYER_MODULES[rest[: -len(suffix)]]
            which = None
            if kind is Kind.SHARED_EXPERT:
                which = _EXPERT_WHICH[rest.split(".")[2]]
            return Mapped(name, f"blk.{layer}.{stem}.weight", kind, role, layer, which=which)
    return Skipped(name, "no GGUF name for this tensor")


def classify(name: str) -> Kind:
    """The tensor class of an official name (``Kind.OTHER`` when unmappable)."""
    m = map_name(name)
    return m.kind if isinstance(m, Mapped) else Kind.OTHER


def gguf_name(name: str) -> str:
    """GGUF tensor name of an official name; BadInputError if it has none."""
    m = map_name(name)
    if isinstance(m, Skipped):
        raise BadInputError(m.reason, where=f"tensor {name!r}")
    return m.gguf


@dataclass(frozen=True)
class NameMap:
    """Every official name accounted for: mapped or skipped (with a reason)."""

    mapped: tuple[Mapped, ...]
    skipped: tuple[Skipped, ...]

    @cached_property
    def _by_gguf(self) -> "MappingProxyType[str, tuple[Mapped, ...]]":
        out: dict[str, list[Mapped]] = {}
        for m in self.mapped:
            if m.role == "weight":
                out.setdefault(m.gguf, []).append(m)
        return MappingProxyType(
            {k: tuple(sorted(v, key=lambda m: (m.expert is None, m.expert or 0))) for k, v in out.items()})

    def by_gguf(self) -> "MappingProxyType[str, tuple[Mapped, ...]]":
        """GGUF name -> its official weight tensors (expert stacks sorted by expert)."""
        return self._by_gguf


def map_names(names: Iterable[str]) -> NameMap:
    """Map many names; a GGUF name claimed twice by non-expert tensors is refused."""
    mapped, skipped = [], []
    seen: dict[tuple[str, str, Optional[int]], str] = {}
    for n in sorted(names):
        m = map_name(n)
        if isinstance(m, Skipped):
            skipped.append(m)
            continue
        key = (m.gguf, m.role, m.expert)
        if key in seen:
            raise BadInputError(f"maps to {m.gguf} ({m.role}) like {seen[key]!r}", where=f"tensor {n!r}")
        seen[key] = n
        mapped.append(m)
    return NameMap(tuple(mapped), tuple(skipped))


# GGUF -> official: the inverse of map_name for weights, derived from the same
# tables (the forward map stays the single source of truth; every answer is
# checked by mapping it forward again).

_WHICH_W = {which: w for w, which in _EXPERT_WHICH.items()}
_GLOBAL_BY_GGUF = {g: name for name, (g, _) in _GLOBAL.items()}
_LAYER_BY_GGUF = {**{f"{stem}.weight": f"{module}.weight" for module, (stem, _) in _LAYER_MODULES.items()},
                  **{tmpl.format(L=0).split(".", 2)[2]: param for param, (tmpl, _) in _LAYER_PARAMS.items()}}


def official_name(gguf: str, expert: Optional[int] = None) -> Optional[str]:
    """The official weight name ``map_name`` sends to GGUF tensor ``gguf``
    (an expert stack needs ``expert``); None when no official weight does.

        official_name("blk.2.attn_q_a.weight")            # "layers.2.attn.wq_a.weight"
        official_name("blk.2.ffn_up_exps.weight", 5)      # "layers.2.ffn.experts.5.w3.weight"
    """
    if gguf in _GLOBAL_BY_GGUF:
        cand = _GLOBAL_BY_GGUF[gguf] if expert is None else None
    else:
        layer = layer_of(gguf)
        if layer is None:
            return None
        rest = gguf.split(".", 2)[2]
        stack = parse_stack(gguf)
        if stack is not None and not stack.compact:
            ok = isinstance(expert, int) and not isinstance(expert, bool) and expert >= 0
            cand = f"layers.{layer}.ffn.experts.{expert}.{_WHICH_W[stack.proj.value]}.weight" if ok else None
        else:
            cand = f"layers.{layer}.{_LAYER_BY_GGUF[rest]}" if expert is None and rest in _LAYER_BY_GGUF else None
    if cand is None:
        return None
    back = map_name(cand)
    return cand if isinstance(back, Mapped) and back.role == "weight" and back.gguf == gguf else None


def gguf_ne(logical_shape: tuple[int, ...], n_experts: Optional[int] = None) -> tuple[int, ...]:
    """GGUF ne (fastest dimension first) of a tensor with numpy/official shape
    ``logical_shape`` (out, in); expert stacks append n_expert: [in, out, n_expert]."""
    ne = tuple(reversed(tuple(logical_shape)))
    return ne + (n_experts,) if n_experts is not None else ne


# --------------------------------------------------------------------------
# transformers (reference model) names, for comparing against HF parameters

_HF_LAYER = [  # indexer entries before compressor entries (docs/reference-model.md#names)
    ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    ("attn.indexer.compressor.wkv.", "self_attn.compressor.indexer.kv_proj."),
    ("attn.indexer.compressor.wgate.", "self_attn.compressor.indexer.gate_proj."),
    ("attn.indexer.compressor.norm.", "self_attn.compressor.indexer.kv_norm."),
    ("attn.indexer.wq_b.", "self_attn.compressor.indexer.q_b_proj."),
    ("attn.indexer.weights_proj.", "self_attn.compressor.indexer.scorer.weights_proj."),
    ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    ("attn.compressor.wkv.", "self_attn.compressor.kv_proj."),
    ("attn.compressor.wgate.", "self_attn.compressor.gate_proj."),
    ("attn.compressor.norm.", "self_attn.compressor.kv_norm."),
    ("attn.attn_sink", "self_attn.sinks"),
    ("attn.wq_a.", "self_attn.q_a_proj."),
    ("attn.wq_b.", "self_attn.q_b_proj."),
    ("attn.q_norm.", "self_attn.q_a_norm."),
    ("attn.wkv.", "self_attn.kv_proj."),
    ("attn.kv_norm.", "self_attn.kv_norm."),
    ("attn.wo_a.", "self_attn.o_a_proj."),
    ("attn.wo_b.", "self_attn.o_b_proj."),
    ("attn_norm.", "input_layernorm."),
    ("ffn_norm.", "post_attention_layernorm."),
    ("hc_attn_fn", "attn_hc.fn"), ("hc_attn_base", "attn_hc.base"), ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"), ("hc_ffn_base", "ffn_hc.base"), ("hc_ffn_scale", "ffn_hc.scale"),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.tid2eid", "mlp.gate.tid2eid"),
    ("ffn.gate.weight", "mlp.gate.weight"),
    ("ffn.shared_experts.w1.", "mlp.shared_experts.gate_proj."),
    ("ffn.shared_experts.w3.", "mlp.shared_experts.up_proj."),
    ("ffn.shared_experts.w2.", "mlp.shared_experts.down_proj."),
]
_HF_GLOBAL = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}


def hf_name(name: str) -> tuple[str, Optional[tuple[int, str]]]:
    """transformers parameter for an official weight name.

    Returns (hf_name, None), or for a routed expert (hf_name, (expert, part)):
    w1 is ``gate_up_proj[e, :I]`` (part "gate"), w3 ``gate_up_proj[e, I:]``
    ("up"), w2 ``down_proj[e]`` ("down").
    """
    if name in _HF_GLOBAL:
        return _HF_GLOBAL[name], None
    m = _LAYER_RE.match(name)
    if m:
        layer, rest = m.group(1), m.group(2)
        e = _EXPERT_RE.match(rest)
        if e and e.group(3) == "weight":
            which = _EXPERT_WHICH[e.group(2)]
            param = "down_proj" if which == "down" else "gate_up_proj"
            return f"model.layers.{layer}.mlp.experts.{param}", (int(e.group(1)), which)
        for src, dst in _HF_LAYER:
            if rest.startswith(src) and not rest.endswith(_SCALE_SUFFIXES):
                return f"model.layers.{layer}.{dst}{rest[len(src):]}", None
    raise BadInputError("has no transformers parameter", where=f"tensor {name!r}")


# --------------------------------------------------------------------------
# GGUF key/values


class GgufKv(NamedTuple):
    """(key, value, gguf.GGUFValueType, element type of an ARRAY value)."""

    key: str
    value: Any
    type: Any
    sub_type: Any = None


def deepseek4_kvs(config: Ds4Config) -> list[GgufKv]:
    """Every ``deepseek4.*`` key (required and read-with-default) plus
    ``general.architecture``, computed from ``config``.

    Refuses a config whose hash-routed layers are not the first N layers: the
    GGUF only states a count (``hash_layer_count``).
    """
    from gguf import GGUFValueType as V

    c = config
    if not c.hash_layers_are_prefix:
        raise UnsupportedFormatError(
            f"hash-routed layers {[i for i, t in enumerate(c.mlp_layer_types) if t == 'hash_moe']} are not "
            "the first layers; deepseek4.hash_layer_count cannot express that", where="config")
    u32 = {
        "deepseek4.block_count": c.num_hidden_layers,
        "deepseek4.embedding_length": c.hidden_size,
        "deepseek4.vocab_size": c.vocab_size,
        "deepseek4.attention.head_count": c.num_attention_heads,
        "deepseek4.attention.head_count_kv": c.num_key_value_heads,
        "deepseek4.attention.key_length": c.head_dim,
        "deepseek4.attention.value_length": c.head_dim,  # one shared KV head of head_dim
        "deepseek4.rope.dimension_count": c.qk_rope_head_dim,
        "deepseek4.attention.q_lora_rank": c.q_lora_rank,
        "deepseek4.attention.output_lora_rank": c.o_lora_rank,
        "deepseek4.attention.output_group_count": c.o_groups,
        "deepseek4.expert_count": c.n_routed_experts,
        "deepseek4.expert_used_count": c.num_experts_per_tok,
        "deepseek4.expert_shared_count": c.n_shared_experts,
        "deepseek4.expert_feed_forward_length": c.moe_intermediate_size,
        "deepseek4.hash_layer_count": c.num_hash_layers,
        "deepseek4.attention.sliding_window": c.sliding_window,
        "deepseek4.attention.indexer.head_count": c.index_n_heads,
        "deepseek4.attention.indexer.key_length": c.index_head_dim,
        "deepseek4.attention.indexer.top_k": c.index_topk,
        "deepseek4.hyper_connection.count": c.hc_mult,
        "deepseek4.hyper_connection.sinkhorn_iterations": c.hc_sinkhorn_iters,
    }
    rs = c.rope_scaling
    kvs = [GgufKv("general.architecture", "deepseek4", V.STRING)]
    kvs.append(GgufKv(N.KEY_CONTEXT_LENGTH, c.max_position_embeddings, V.UINT32))
    kvs += [GgufKv(k, int(v), V.UINT32) for k, v in u32.items()]
    # Arrays in the element types llama.cpp's converter writes (python ints -> INT32, floats ->
    # FLOAT32), one entry per block: both llama.cpp and Lucebox read these forms (docs/runtimes.md).
    kvs += [
        GgufKv(N.KEY_COMPRESS_RATIOS, [int(r) for r in c.compress_ratios], V.ARRAY, V.INT32),
        GgufKv("deepseek4.rope.freq_base", c.rope_theta, V.FLOAT32),
        GgufKv("deepseek4.attention.compress_rope_freq_base", c.compress_rope_theta, V.FLOAT32),
        # "none" or "yarn": without it llama.cpp would apply *linear* scaling by the factor
        GgufKv(N.KEY_ROPE_SCALING_TYPE, rs.kind, V.STRING),
        # factor 1.0 (no YaRN) is written rather than omitted: the Lucebox loader's default is 16
        GgufKv(N.KEY_ROPE_SCALING_FACTOR, rs.factor, V.FLOAT32),
        GgufKv(N.KEY_ROPE_YARN_BETA_FAST, rs.beta_fast, V.FLOAT32),
        GgufKv(N.KEY_ROPE_YARN_BETA_SLOW, rs.beta_slow, V.FLOAT32),
        # UINT32: llama.cpp type-checks it (Lucebox reads UINT32 or UINT64)
        GgufKv(N.KEY_ROPE_SCALING_ORIG_CTX, rs.original_context_length, V.UINT32),
    ]
    if rs.ext_factor is not None:
        kvs.append(GgufKv(N.KEY_ROPE_YARN_EXT_FACTOR, rs.ext_factor, V.FLOAT32))
    if rs.attn_factor is not None:
        kvs.append(GgufKv(N.KEY_ROPE_YARN_ATTN_FACTOR, rs.attn_factor, V.FLOAT32))
    kvs += [
        GgufKv("deepseek4.attention.layer_norm_rms_epsilon", c.rms_norm_eps, V.FLOAT32),
        GgufKv("deepseek4.hyper_connection.epsilon", c.hc_eps, V.FLOAT32),
        GgufKv(N.KEY_EXPERT_WEIGHTS_SCALE, c.routed_scaling_factor, V.FLOAT32),
        GgufKv(N.KEY_EXPERT_WEIGHTS_NORM, bool(c.norm_topk_prob), V.BOOL),
        GgufKv(N.KEY_EXPERT_GATING_FUNC, N.GATING_FUNC[c.scoring_func], V.UINT32),
        GgufKv(N.KEY_SWIGLU_CLAMP, [float(c.swiglu_limit)] * c.num_hidden_layers, V.ARRAY, V.FLOAT32),
    ]
    for kv in kvs:
        if kv.type == V.UINT32 and not (0 <= kv.value < 2**32):
            raise BadInputError(f"{kv.key} = {kv.value} does not fit in uint32", where="config")
    return kvs
