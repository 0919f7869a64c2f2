"""Read a DeepSeek-V4 GGUF (one file or a split set) as a conversion source.

    src = open_gguf_source("ds4-tiny-mxfp4.gguf")
    src.config.n_routed_experts                                   # 16, from deepseek4.expert_count
    w = src.read_dequantized("blk.2.ffn_gate_exps.weight#5")      # float32 (128, 256): expert 5 only
    codes, scales = src.expert_fp4(2, 5, "gate")                  # MXFP4 stacks: lossless FP4

The same interface as the official-layout ``Source`` (``config``, ``names``,
``info``, ``read``, ``read_dequantized``, ``release``, ``expert_fp4``,
``fingerprint``, ``close``, ``path``), so ``ds4quant convert`` and ``verify``
take either. Names (docs/formats.md#ds4-gguf, Lucebox naming):

- a non-expert tensor's source name is its GGUF name (``blk.0.attn_q_a.weight``);
- a routed-expert stack ``blk.L.ffn_{gate,up,down}_exps.weight`` (GGUF shape
  [in, out, n_expert]) appears as one member per expert, named
  ``blk.L.ffn_gate_exps.weight#E`` (``EXPERT_SEP``); a member reads and
  decodes only expert E's bytes (each expert's ``out`` rows are contiguous);
- kinds, layers and surfaces come from ``naming.official_name`` (the inverse
  of the official -> GGUF map); unknown names are reported as skipped.

Opening validates, before any tensor byte is read:

1. the file or split set (``read_gguf_set``: every count, offset and size);
2. no ROCmFPX tensor (ggml 100-107): that is an already-quantized artifact,
   and re-quantizing it would compound its error;
3. ``general.architecture`` is ``deepseek4``; the config comes from the
   ``deepseek4.*`` keys (the inverse of ``naming.deepseek4_kvs``): every key
   Lucebox requires, ``attention.compress_ratios`` (one per block) and
   ``rope.scaling.factor`` (the loader's default, 16, differs from "none")
   must be present and integer/float typed; the other float keys default to
   the DeepSeek-V4 values. A layer's attention type is CSA when it has
   indexer tensors, HCA when its ratio is > 0 without them, sliding at 0;
4. tensor types: F32, F16, BF16, Q8_0, MXFP4 (I32 for ``ffn_gate_tid2eid``,
   which must be I32);
5. shapes against the keys (the same table as the official source), layer
   and expert indices in range, every layer with all three expert stacks.
   All offenders are collected; the error names the first and counts the rest.

``info(name).dtype`` is the upper-case ggml name ("BF16", "Q8_0", "MXFP4",
...), which ``recipes`` keeps as is; ``payload_qtype(name)`` says which
ds4quant qtype the stored bytes already are, so convert copies them instead
of decoding and re-encoding when the plan asks for that same qtype.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Iterable, Iterator, Optional

import numpy as np
from gguf import GGUFValueType as VT

from ds4quant.artifact import read_gguf_set
from ds4quant.artifact.qtypes import ROCMFPX_IDS
from ds4quant.errors import BadInputError, CorruptDataError, Ds4quantError, ShapeError, UnsupportedFormatError
from ds4quant.names import (
    ARCH,
    GATING_FUNC,
    KEY_ARCH,
    KEY_BLOCK_COUNT,
    KEY_EMBEDDING_LENGTH,
    KEY_EXPERT_COUNT,
    KEY_EXPERT_FFN_LENGTH,
    KEY_EXPERT_USED_COUNT,
    KEY_EXPERT_WEIGHTS_SCALE,
    KEY_HASH_LAYER_COUNT,
    KEY_SWIGLU_CLAMP,
    KEY_VOCAB_SIZE,
    PROJS,
    layer_of,
    parse_stack,
    stack_name,
)
from ds4quant.formats import decode
from ds4quant.formats.mxfp4 import e2m1_from_mxfp4
from ds4quant.sources.config import CSA, HASH_MOE, HCA, SLIDING, Ds4Config, RopeScaling, parse_config
from ds4quant.sources.naming import Kind, Mapped, NameMap, Skipped, map_name, official_name
from ds4quant.sources.official import expected_shape

FINGERPRINT_VERSION = "ds4quant-gguf-source-fingerprint/1"
FINGERPRINT_PREFIX = "gguf:"  # official fingerprints are bare hex
EXPERT_SEP = "#"

# ds4quant qtype of the stored bytes -> TensorInfo.dtype (what recipes keep)
SOURCE_TYPES = MappingProxyType({"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "mxfp4": "MXFP4",
                                 "i32": "I32"})
_RAW_VIEW = {"f32": "<f4", "f16": "<f2", "bf16": "<u2", "i32": "<i4"}  # plain types: element words
_WHICH = {"w1": "gate", "w3": "up", "w2": "down", "gate": "gate", "up": "up", "down": "down"}

# Ds4Config field <- deepseek4.* integer key (inverse of naming.deepseek4_kvs;
# tests/sources/test_gguf_source.py checks the round trip key by key).
_P = ARCH + "."
_INT_KEYS = MappingProxyType({
    "num_hidden_layers": KEY_BLOCK_COUNT,
    "hidden_size": KEY_EMBEDDING_LENGTH,
    "vocab_size": KEY_VOCAB_SIZE,
    "num_attention_heads": _P + "attention.head_count",
    "num_key_value_heads": _P + "attention.head_count_kv",
    "head_dim": _P + "attention.key_length",
    "qk_rope_head_dim": _P + "rope.dimension_count",
    "q_lora_rank": _P + "attention.q_lora_rank",
    "o_lora_rank": _P + "attention.output_lora_rank",
    "o_groups": _P + "attention.output_group_count",
    "n_routed_experts": KEY_EXPERT_COUNT,
    "num_experts_per_tok": KEY_EXPERT_USED_COUNT,
    "n_shared_experts": _P + "expert_shared_count",
    "moe_intermediate_size": KEY_EXPERT_FFN_LENGTH,
    "num_hash_layers": KEY_HASH_LAYER_COUNT,
    "sliding_window": _P + "attention.sliding_window",
    "index_n_heads": _P + "attention.indexer.head_count",
    "index_head_dim": _P + "attention.indexer.key_length",
    "index_topk": _P + "attention.indexer.top_k",
    "hc_mult": _P + "hyper_connection.count",
    "hc_sinkhorn_iters": _P + "hyper_connection.sinkhorn_iterations",
})
KEY_CONTEXT = _P + "context_length"
KEY_VALUE_LENGTH = _P + "attention.value_length"
KEY_RATIOS = _P + "attention.compress_ratios"
KEY_ROPE_FACTOR = _P + "rope.scaling.factor"
KEY_ROPE_ORIG = _P + "rope.scaling.original_context_length"
# float keys with the DeepSeek-V4 value a missing one stands for
_FLOAT_KEYS = MappingProxyType({
    "rope_theta": (_P + "rope.freq_base", 10000.0),
    "compress_rope_theta": (_P + "attention.compress_rope_freq_base", 160000.0),
    "rms_norm_eps": (_P + "attention.layer_norm_rms_epsilon", 1e-6),
    "hc_eps": (_P + "hyper_connection.epsilon", 1e-6),
    "routed_scaling_factor": (KEY_EXPERT_WEIGHTS_SCALE, 1.5),
})
KEY_ROPE_EXT = _P + "rope.scaling.yarn_ext_factor"
KEY_ROPE_ATTN = _P + "rope.scaling.yarn_attn_factor"
KEY_GATING = _P + "expert_gating_func"
KEY_WEIGHTS_NORM = _P + "expert_weights_norm"
_ROPE_FLOATS = {"beta_fast": (_P + "rope.scaling.yarn_beta_fast", 32.0),
                "beta_slow": (_P + "rope.scaling.yarn_beta_slow", 1.0)}
_INT_TYPES = (VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.INT32, VT.UINT64, VT.INT64)
# config field names in messages (parse_config's, the shape table's) -> the GGUF key
_KEY_OF = {**{f: k for f, k in _INT_KEYS.items()}, **{f: k for f, (k, _) in _FLOAT_KEYS.items()},
           "max_position_embeddings": KEY_CONTEXT, "swiglu_limit": KEY_SWIGLU_CLAMP}


@dataclass(frozen=True)
class GgufTensorInfo:
    """One source tensor of a GGUF (a whole tensor, or one expert of a stack).

    dtype: upper-case ggml name ("F32", "F16", "BF16", "Q8_0", "MXFP4", "I32");
    qtype: the same as a ds4quant qtype name; shape: GGUF ne of these bytes
    (an expert: [in, out]); shape_logical: numpy order (out, in);
    nbytes/offset: the bytes in ``file``; gguf: the GGUF tensor they live in;
    expert: the expert id within a stack, else None.
    """

    name: str
    dtype: str
    qtype: str
    shape: tuple[int, ...]
    shape_logical: tuple[int, ...]
    nbytes: int
    offset: int
    file: Path
    gguf: str
    expert: Optional[int] = None


def _natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def member_name(gguf: str, expert: int) -> str:
    """Source name of one expert of a stack: ``blk.L.ffn_gate_exps.weight#E``."""
    return f"{gguf}{EXPERT_SEP}{expert}"


def _explain_keys(text: str) -> str:
    """Config field names in a message -> the deepseek4.* keys they come from."""
    return re.sub(r"[a-z][a-z_]+[a-z]", lambda m: _KEY_OF.get(m.group(0), m.group(0)), text)


def _indexed_layer(tensor: str) -> Optional[int]:
    """The layer of a ``blk.L.indexer.*`` / ``blk.L.indexer_*`` tensor (a CSA layer), else None."""
    layer = layer_of(tensor)
    if layer is None or not tensor.split(".", 2)[2].startswith(("indexer.", "indexer_")):
        return None
    return layer


# ---------------------------------------------------------------------------
# config from the deepseek4.* keys


def _kv_int(g, key: str, where: str, required: bool = True) -> Optional[int]:
    kv = g.kv.get(key)
    if kv is None:
        if required:
            raise BadInputError(f"no KV {key!r}, which a DeepSeek-V4 GGUF must state", where=where)
        return None
    if kv.type not in _INT_TYPES or isinstance(kv.value, bool):
        raise BadInputError(f"KV {key!r} must be an integer, got {kv.type.name}", where=where)
    if kv.value < 0:
        raise BadInputError(f"KV {key!r} must be >= 0, got {kv.value}", where=where)
    return int(kv.value)


def _kv_float(g, key: str, where: str, default: Optional[float]) -> float:
    kv = g.kv.get(key)
    if kv is None:
        if default is None:
            raise BadInputError(f"no KV {key!r}, which a DeepSeek-V4 GGUF must state", where=where)
        return default
    if kv.type not in (VT.FLOAT32, VT.FLOAT64) + _INT_TYPES:
        raise BadInputError(f"KV {key!r} must be a number, got {kv.type.name}", where=where)
    v = float(kv.value)
    if not np.isfinite(v):
        raise BadInputError(f"KV {key!r} must be finite, got {v}", where=where)
    return v


def _kv_swiglu(g, where: str) -> float:
    """The clamp: one FLOAT32, or (as llama.cpp's converter writes it) one per block, all equal."""
    kv = g.kv.get(KEY_SWIGLU_CLAMP)
    if kv is None or kv.type != VT.ARRAY:
        return _kv_float(g, KEY_SWIGLU_CLAMP, where, 10.0)
    vals = [float(x) for x in kv.value] if kv.sub_type in (VT.FLOAT32, VT.FLOAT64) else []
    if not vals or any(v != vals[0] or not np.isfinite(v) for v in vals):
        raise BadInputError(f"KV {KEY_SWIGLU_CLAMP!r} must be a number or an array of one finite number per "
                            "block; DeepSeek-V4 clamps every layer alike", where=where)
    return vals[0]


def _kv_scoring(g, where: str) -> str:
    kv = g.kv.get(KEY_GATING)
    if kv is None:
        return "sqrtsoftplus"  # what every DeepSeek-V4 uses; files before the key existed
    by_id = {v: k for k, v in GATING_FUNC.items()}
    got = by_id.get(int(kv.value)) if kv.type in _INT_TYPES else None
    if got not in ("sqrtsoftplus", "sigmoid"):
        raise UnsupportedFormatError(f"KV {KEY_GATING!r} = {kv.value!r} is not sqrtsoftplus (4) or sigmoid (2)",
                                     where=where)
    return got


def config_from_kvs(g, tensor_names: Iterable[str], where: str) -> Ds4Config:
    """A Ds4Config from a GGUF's ``deepseek4.*`` keys (see module doc, step 3).

    tensor_names tell CSA layers (with indexer tensors) from HCA layers.
    """
    arch = g.kv.get(KEY_ARCH)
    if arch is None:
        raise BadInputError("no KV 'general.architecture'; not a DeepSeek-V4 GGUF", where=where)
    if arch.type != VT.STRING or arch.value != ARCH:
        raise UnsupportedFormatError(f"general.architecture is {arch.value!r}, not {ARCH!r}; "
                                     "only DeepSeek-V4 GGUFs can be converted", where=where)
    ints = {f: _kv_int(g, k, where) for f, k in _INT_KEYS.items()}
    n = ints["num_hidden_layers"]
    vl = _kv_int(g, KEY_VALUE_LENGTH, where, required=False)
    if vl is not None and vl != ints["head_dim"]:
        raise BadInputError(f"KV {KEY_VALUE_LENGTH!r} = {vl} differs from {_INT_KEYS['head_dim']!r} = "
                            f"{ints['head_dim']}; DeepSeek-V4 has one KV head of one width", where=where)
    if ints["num_hash_layers"] > n:
        raise BadInputError(f"KV {_INT_KEYS['num_hash_layers']!r} = {ints['num_hash_layers']} exceeds "
                            f"{_INT_KEYS['num_hidden_layers']!r} = {n}", where=where)

    # attention type per layer: ratio 0 = sliding; indexer tensors = CSA; else HCA
    rk = g.kv.get(KEY_RATIOS)
    if rk is None:
        raise BadInputError(f"no KV {KEY_RATIOS!r}, which a DeepSeek-V4 GGUF must state", where=where)
    if rk.type != VT.ARRAY or rk.sub_type not in _INT_TYPES:
        raise BadInputError(f"KV {KEY_RATIOS!r} must be an array of integers", where=where)
    ratios = [int(r) for r in rk.value]
    if len(ratios) != n or min(ratios, default=0) < 0:
        raise BadInputError(f"KV {KEY_RATIOS!r} must hold {n} rates >= 0 (one per block), got {ratios}",
                            where=where)
    indexed = {layer for t in tensor_names if (layer := _indexed_layer(t)) is not None}
    types, rates = [], {CSA: set(), HCA: set()}
    for layer, r in enumerate(ratios):
        if r == 0:
            if layer in indexed:
                raise BadInputError(f"blk.{layer} has indexer tensors but {KEY_RATIOS}[{layer}] is 0 (sliding)",
                                    where=where)
            types.append(SLIDING)
            continue
        t = CSA if layer in indexed else HCA
        types.append(t)
        rates[t].add(r)
    for t, label in ((CSA, "CSA (indexed)"), (HCA, "HCA")):
        if len(rates[t]) > 1:
            raise BadInputError(f"KV {KEY_RATIOS!r} gives {label} layers different rates {sorted(rates[t])}; "
                                "DeepSeek-V4 has one rate per attention type", where=where)

    cfg = dict(ints)
    cfg["model_type"] = "deepseek_v4"
    cfg["layer_types"] = types
    cfg["compress_rates"] = {CSA: min(rates[CSA], default=4), HCA: min(rates[HCA], default=128)}
    ctx = _kv_int(g, KEY_CONTEXT, where, required=False)
    cfg["max_position_embeddings"] = 1048576 if ctx is None else ctx  # V4-Flash, as config.py defaults
    for f, (k, d) in _FLOAT_KEYS.items():
        cfg[f] = _kv_float(g, k, where, d)
    cfg["swiglu_limit"] = _kv_swiglu(g, where)
    cfg["scoring_func"] = _kv_scoring(g, where)
    norm = g.kv.get(KEY_WEIGHTS_NORM)
    if norm is not None:
        if norm.type != VT.BOOL:
            raise BadInputError(f"KV {KEY_WEIGHTS_NORM!r} must be a BOOL, got {norm.type.name}", where=where)
        cfg["norm_topk_prob"] = bool(norm.value)
    if KEY_ROPE_FACTOR not in g.kv:
        raise BadInputError(f"no KV {KEY_ROPE_FACTOR!r}; ds4quant will not guess it", where=where,
                            hint="a DS4 loader's default is 16, 'no YaRN' is 1.0; add the key")
    factor = _kv_float(g, KEY_ROPE_FACTOR, where, None)
    if factor <= 0:
        raise BadInputError(f"KV {KEY_ROPE_FACTOR!r} must be > 0, got {factor}", where=where)
    rope = RopeScaling(
        factor=factor,
        original_context_length=_kv_int(g, KEY_ROPE_ORIG, where, required=factor != 1.0)
        or cfg["max_position_embeddings"],
        beta_fast=_kv_float(g, _ROPE_FLOATS["beta_fast"][0], where, _ROPE_FLOATS["beta_fast"][1]),
        beta_slow=_kv_float(g, _ROPE_FLOATS["beta_slow"][0], where, _ROPE_FLOATS["beta_slow"][1]),
        ext_factor=_kv_float(g, KEY_ROPE_EXT, where, None) if KEY_ROPE_EXT in g.kv else None,
        attn_factor=_kv_float(g, KEY_ROPE_ATTN, where, None) if KEY_ROPE_ATTN in g.kv else None,
    )
    try:
        config = parse_config(cfg, where=where)
    except Ds4quantError as e:
        raise type(e)(_explain_keys(e.message), where=where, hint=e.hint) from None
    # parse_config folds "no scaling" to (1.0, context); keep what the keys say
    return replace(config, rope_scaling=rope)


# ---------------------------------------------------------------------------
# the source


class GgufSource:
    """An open, validated DeepSeek-V4 GGUF source. Use ``open_gguf_source``."""

    format = "deepseek-v4-gguf"

    def __init__(self, path: Path, g):
        self.path = path  # the first file of the set
        self._g = g
        self._where = str(path)
        self._maps: dict[str, np.ndarray] = {}
        self._refuse_artifacts()
        self.config = config_from_kvs(g, g.tensors, self._where)
        self._infos, self.names = self._map_tensors()
        self._check()
        self._fingerprint = self._compute_fingerprint()

    @property
    def name(self) -> str:
        """The model's file stem (without ``.gguf`` and the split suffix)."""
        from ds4quant.artifact.gguf_writer import SPLIT_NAME

        m = SPLIT_NAME.match(self.path.name)
        return m.group("stem") if m else self.path.name[: -len(".gguf")] if self.path.name.endswith(".gguf") \
            else self.path.name

    # -- structure -------------------------------------------------------------

    def _tw(self, name: str) -> str:
        info = self._infos.get(name)
        return f"{info.file if info is not None else self.path}: tensor {name!r}"

    def _refuse_artifacts(self) -> None:
        bad = [t for t in self._g.tensors.values() if t.ggml_type in ROCMFPX_IDS]
        if bad:
            bad.sort(key=lambda t: _natural_key(t.name))
            more = f" (and {len(bad) - 1} more ROCmFPX tensor(s))" if len(bad) > 1 else ""
            raise UnsupportedFormatError(
                f"is {bad[0].qtype} (ROCmFPX type {bad[0].ggml_type}): this GGUF is an already-quantized ROCmFPX "
                f"artifact, and re-quantizing it would compound its error{more}",
                where=f"{bad[0].path}: tensor {bad[0].name!r}",
                hint="convert from the original checkpoint, or from a F32/F16/BF16/Q8_0/MXFP4 GGUF")

    def _map_tensors(self):
        infos: dict[str, GgufTensorInfo] = {}
        mapped: list[Mapped] = []
        skipped: list[Skipped] = []
        problems: list[tuple[str, str]] = []
        for t in sorted(self._g.tensors.values(), key=lambda t: _natural_key(t.name)):
            stack = parse_stack(t.name)
            if stack is not None and not stack.compact:
                if len(t.shape) != 3:
                    problems.append((t.name, f"expert stack must be 3-D [in, out, n_expert], got {list(t.shape)}"))
                    continue
                n_exp = t.shape[2]
                if n_exp != self.config.n_routed_experts:  # checked before making a member per expert
                    problems.append((t.name, f"stacks {n_exp} experts but {_INT_KEYS['n_routed_experts']} = "
                                             f"{self.config.n_routed_experts}"))
                    continue
                per = t.nbytes // n_exp
                for e in range(n_exp):
                    fwd = map_name(official_name(t.name, e))
                    name = member_name(t.name, e)
                    mapped.append(Mapped(name, t.name, fwd.kind, "weight", fwd.layer, e, fwd.which))
                    infos[name] = GgufTensorInfo(name, SOURCE_TYPES.get(t.qtype, t.qtype.upper()), t.qtype,
                                                 t.shape[:2], (t.shape[1], t.shape[0]), per, t.offset + e * per,
                                                 t.path, t.name, e)
                continue
            off = official_name(t.name)
            if off is None:
                skipped.append(Skipped(t.name, "no DeepSeek-V4 tensor has this GGUF name"))
                continue
            fwd = map_name(off)
            mapped.append(Mapped(t.name, t.name, fwd.kind, "weight", fwd.layer, None, fwd.which))
            infos[t.name] = GgufTensorInfo(t.name, SOURCE_TYPES.get(t.qtype, t.qtype.upper()), t.qtype, t.shape,
                                           tuple(reversed(t.shape)), t.nbytes, t.offset, t.path, t.name)
        if problems:
            self._raise(problems, ShapeError)
        return MappingProxyType(infos), NameMap(tuple(mapped), tuple(skipped))

    def _raise(self, problems: list[tuple[str, str]], cls) -> None:
        problems.sort(key=lambda p: _natural_key(p[0]))
        name, why = problems[0]
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        g = self._g.tensors.get(name.split(EXPERT_SEP)[0])
        where = f"{g.path if g is not None else self.path}: tensor {name!r}"
        raise cls(why + more, where=where)

    def _check(self) -> None:
        c = self.config
        # 4. tensor types
        types: list[tuple[str, str]] = []
        for gguf, members in self.names.by_gguf().items():
            m = members[0]
            t = self._g.tensors[gguf]
            if m.kind is Kind.HASH_TABLE:
                if t.qtype != "i32":
                    types.append((gguf, f"hash table is {t.qtype.upper()}; ffn_gate_tid2eid must be I32"))
            elif t.qtype not in SOURCE_TYPES or t.qtype == "i32":
                types.append((gguf, f"{t.qtype.upper()} (ggml type {t.ggml_type}) is not a supported source type "
                                    "(F32, F16, BF16, Q8_0, MXFP4; I32 only for ffn_gate_tid2eid)"))
        if types:
            self._raise(types, UnsupportedFormatError)
        # 5. shapes against the keys
        problems: list[tuple[str, str]] = []
        stacks: dict[int, set] = {}
        for gguf, members in self.names.by_gguf().items():
            m = members[0]
            t = self._g.tensors[gguf]
            if m.layer is not None and m.layer >= c.num_hidden_layers:
                problems.append((gguf, f"layer {m.layer} but {_INT_KEYS['num_hidden_layers']} = "
                                       f"{c.num_hidden_layers}"))
                continue
            if m.kind is Kind.HASH_TABLE and c.mlp_layer_types[m.layer] != HASH_MOE:
                problems.append((gguf, f"hash table in layer {m.layer}, but {_INT_KEYS['num_hash_layers']} = "
                                       f"{c.num_hash_layers}"))
            if m.stacked:
                stacks.setdefault(m.layer, set()).add(m.which)
            exp = expected_shape(c, map_name(official_name(gguf, m.expert)))
            if exp is None:
                continue
            want, keys = exp
            got = self._infos[m.name].shape_logical
            if tuple(got) != tuple(want):
                ne = list(reversed(want)) + ([c.n_routed_experts] if m.stacked else [])
                problems.append((gguf, f"GGUF shape {list(t.shape)} does not match the deepseek4.* keys: expected "
                                       f"{ne} from {_explain_keys(keys)}"))
        for layer in range(c.num_hidden_layers):
            for proj in PROJS:
                if proj.value not in stacks.get(layer, set()):
                    problems.append((stack_name(layer, proj),
                                     f"missing: {_INT_KEYS['num_hidden_layers']} = {c.num_hidden_layers} needs "
                                     "gate, up and down expert stacks in every block"))
        if problems:
            self._raise(problems, ShapeError)

    def _compute_fingerprint(self) -> str:
        files = []
        for s in self._g.splits:
            with open(s.path, "rb") as f:
                header = f.read(s.data_offset)
            if len(header) != s.data_offset:
                raise CorruptDataError("file shrank while open", where=str(s.path))
            files.append({"file": s.path.name, "size": s.file_size,
                          "header_sha256": hashlib.sha256(header).hexdigest()})
        doc = {"version": FINGERPRINT_VERSION, "files": files}
        return FINGERPRINT_PREFIX + hashlib.sha256(
            json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    # -- public API --------------------------------------------------------------

    @property
    def skipped(self) -> tuple[Skipped, ...]:
        """GGUF tensors with no DeepSeek-V4 role, each with the reason."""
        return self.names.skipped

    def tensor_names(self) -> list[str]:
        """Every source tensor (expert members included), in natural order."""
        return sorted(self._infos, key=_natural_key)

    def weight_names(self) -> list[str]:
        return self.tensor_names()

    def info(self, name: str) -> GgufTensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise BadInputError("no such tensor in the GGUF source", where=f"{self.path}: tensor {name!r}") from None

    def payload_qtype(self, name: str) -> str:
        """The ds4quant qtype the stored bytes of ``name`` already are."""
        return self.info(name).qtype

    def _data(self, gguf: str) -> np.ndarray:
        arr = self._maps.get(gguf)
        if arr is None:
            arr = self._maps[gguf] = self._g.tensor_data(gguf)  # checks the file is unchanged
        return arr

    def _bytes(self, info: GgufTensorInfo) -> np.ndarray:
        start = info.offset - self._g.tensors[info.gguf].offset
        return self._data(info.gguf)[start:start + info.nbytes]

    def read(self, name: str) -> np.ndarray:
        """The stored values, read-only, no copy: F32/F16 as float32/float16,
        BF16 as uint16 words, I32 as int32, all in shape_logical; Q8_0 and
        MXFP4 as uint8 (rows, row bytes) ggml blocks."""
        info = self.info(name)
        raw = self._bytes(info)
        if info.qtype in _RAW_VIEW:
            return raw.view(_RAW_VIEW[info.qtype]).reshape(info.shape_logical)
        return raw.reshape(-1, info.nbytes // _rows(info))

    def read_dequantized(self, name: str) -> np.ndarray:
        """float32 values of one tensor or expert, exactly (a new, writable array)."""
        info = self.info(name)
        if info.qtype == "i32":
            raise BadInputError("I32 tensor holds integers, not weights; use read()", where=self._tw(name))
        raw = self._bytes(info).reshape(_rows(info), -1)
        try:
            y = decode(info.qtype, raw, info.shape_logical[-1])
        except Ds4quantError as e:
            raise type(e)(e.message, where=self._tw(name), hint=e.hint) from None
        if np.may_share_memory(y, raw) or not y.flags.writeable:
            y = y.copy()
        return y.reshape(info.shape_logical)

    def iter_tensors(self, names: Optional[Iterable[str]] = None, *, dequantize: bool = False
                     ) -> Iterator[tuple[str, np.ndarray]]:
        for n in (self.weight_names() if names is None else names):
            yield n, (self.read_dequantized(n) if dequantize else self.read(n))

    def expert_fp4(self, layer: int, expert: int, which: str) -> tuple[np.ndarray, np.ndarray]:
        """Lossless FP4 of one expert of an MXFP4 stack: (int8 codes (out, in/2),
        low nibble = even element; uint8 E8M0 scales (out, in/32)), the
        official layout, so ``mxfp4_from_e2m1`` gives back the stored bytes.
        which: gate/up/down or w1/w3/w2."""
        if which not in _WHICH:
            raise BadInputError(f"which must be one of {sorted(_WHICH)}, got {which!r}")
        name = member_name(stack_name(layer, _WHICH[which]), expert)
        info = self.info(name)
        if info.qtype != "mxfp4":
            raise UnsupportedFormatError(f"is stored as {info.dtype}, not MXFP4; only MXFP4 experts repack "
                                         "losslessly to FP4", where=self._tw(name))
        try:
            return e2m1_from_mxfp4(self.read(name), info.shape_logical[1])
        except Ds4quantError as e:
            raise type(e)(e.message, where=self._tw(name), hint=e.hint) from None

    def release(self, name: str) -> None:
        """Let the OS drop a tensor's (or expert's) pages after use."""
        info = self.info(name)
        arr = self._maps.get(info.gguf)
        if arr is None:
            return
        if info.expert is None:
            del self._maps[info.gguf]  # unmapped once the arrays handed out are gone
        mm = getattr(arr, "_mmap", None)
        if mm is None or info.nbytes == 0 or not hasattr(mm, "madvise"):
            return
        # np.memmap maps from the offset rounded down to ALLOCATIONGRANULARITY
        base = self._g.tensors[info.gguf].offset
        start = base % mmap.ALLOCATIONGRANULARITY + (info.offset - base)
        page = start // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            mm.madvise(mmap.MADV_DONTNEED, page, start + info.nbytes - page)
        except (OSError, ValueError):
            pass  # advice only; never fatal

    def fingerprint(self) -> str:
        """"gguf:" + sha256 over each file's name, size and header bytes (KVs
        and tensor infos); no tensor data is hashed."""
        return self._fingerprint

    def close(self) -> None:
        """Drop our mappings; arrays already handed out keep theirs alive."""
        self._maps.clear()

    def __enter__(self) -> "GgufSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GgufSource({str(self.path)!r}, {len(self._g.tensors)} tensors, {len(self._g.splits)} file(s))"


def _rows(info: GgufTensorInfo) -> int:
    r = 1
    for d in info.shape_logical[:-1]:
        r *= d
    return r


def open_gguf_source(path: "str | os.PathLike") -> GgufSource:
    """Open and validate a DeepSeek-V4 GGUF (any file of a split set) as a source."""
    p = Path(path)
    if not p.exists():
        raise BadInputError("no such file", where=str(p))
    if not p.is_file():
        raise BadInputError("expected a .gguf file", where=str(p))
    # Untagged 107 reads as rocmfp2 here only so that it reaches the ROCmFPX
    # refusal below, which every ROCmFPX tensor gets whatever its variant.
    g = read_gguf_set(p, variant_107="rocmfp2")
    return GgufSource(g.path, g)
