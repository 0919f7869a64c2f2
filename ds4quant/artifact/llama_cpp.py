"""llama.cpp's DeepSeek-V4 dialect, as data, and the check that decides whether llama.cpp loads a GGUF.

What llama.cpp's loader needs (its ``deepseek4`` model: hparams, tensors,
graph; its generic hparams and vocabulary loaders; docs/runtimes.md has the
list in words and where each rule comes from):

- ``KEYS``: every key it reads, with the GGUF types it accepts. Its
  ``get_key`` refuses a key of another type even when the key is optional
  ("wrong type u64 but expected type u32"), so an optional key counts too
  when present. Arrays read per block accept a scalar or an array of exactly
  ``block_count`` entries; ``compress_ratios`` must have at least that many.
- ``DIMS``: the model's dimensions inside the fixed set the graph is written
  for: compress ratios in {0, 4, 128} (the loader throws on others),
  ``hyper_connection.count`` 4 (asserted), the indexer head dim a multiple of
  64 (its Hadamard rotation), gating ``expert_gating_func`` 4 (sqrtsoftplus:
  the loader throws on others).
- the vocabulary: ``tokenizer.ggml.model`` and ``tokens`` always; a ``gpt2``
  (BPE) vocabulary also needs ``tokenizer.ggml.merges`` (an empty list is
  fine); the token count is the embedding's row count.
- the tensors: exactly the set its DeepSeek-V4 loader creates for the header
  (it refuses a file with other tensors: "wrong number of tensors"), in the
  shapes ``artifact.ds4`` gives, each of a ggml type llama.cpp knows
  (``QType.runtimes`` lists ``llama.cpp``).

Every rule returns problems as sentences, never raises; ``runtimes.decide``
turns a non-empty list into "llama.cpp cannot load it, because ...".

    problems = llama_cpp_problems(view.kv, {n: (t.qtype, t.shape) for n, t in view.tensors.items()})
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

from gguf import GGUFValueType as VT

from ds4quant import names
from ds4quant.artifact.gguf_values import KV

ENGINE = "llama.cpp"
_K = names.ARCH + "."


@dataclass(frozen=True)
class KeyRule:
    """One key llama.cpp reads: the GGUF types it accepts and whether it must be present.

    types: accepted (type, element type) pairs; element type None for scalars.
    per_block: an ARRAY form must hold one entry per block (``get_key_or_arr``).
    """

    key: str
    types: tuple[tuple[VT, Optional[VT]], ...]
    required: bool
    per_block: bool = False

    def type_text(self) -> str:
        return " or ".join(f"ARRAY of {s.name}" if s is not None else t.name for t, s in self.types)


def _rule(key: str, kind: str, required: bool = True) -> KeyRule:
    forms = {
        "u32": ((VT.UINT32, None),),
        "f32": ((VT.FLOAT32, None),),
        "bool": ((VT.BOOL, None),),
        "str": ((VT.STRING, None),),
        "u32/arr": ((VT.UINT32, None), (VT.ARRAY, VT.UINT32), (VT.ARRAY, VT.INT32)),
        "f32/arr": ((VT.FLOAT32, None), (VT.ARRAY, VT.FLOAT32)),
        "int-arr": ((VT.ARRAY, VT.INT32), (VT.ARRAY, VT.UINT32)),
        "str-arr": ((VT.ARRAY, VT.STRING),),
        "i32-arr": ((VT.ARRAY, VT.INT32),),
        "f32-arr": ((VT.ARRAY, VT.FLOAT32),),
    }
    return KeyRule(key, forms[kind], required, per_block=kind.endswith("/arr"))


# Every key llama.cpp's DeepSeek-V4 load reads; required ones first. (deepseek4.* unless prefixed.)
KEYS: tuple[KeyRule, ...] = tuple(_rule(k if k.startswith("tokenizer.") else _K + k, kind, req)
                                  for k, kind, req in (
    # generic hparams
    ("context_length", "u32", True),
    ("embedding_length", "u32", True),
    ("block_count", "u32", True),
    ("expert_count", "u32", True),
    ("expert_used_count", "u32", True),
    ("attention.head_count", "u32/arr", True),
    ("attention.head_count_kv", "u32/arr", False),
    ("attention.key_length", "u32", False),
    ("attention.value_length", "u32", False),
    ("rope.dimension_count", "u32", False),
    ("vocab_size", "u32", False),
    ("rope.freq_base", "f32", False),
    ("rope.scaling.type", "str", False),
    ("rope.scaling.factor", "f32", False),
    ("rope.scaling.original_context_length", "u32", False),
    ("rope.scaling.attn_factor", "f32", False),
    ("rope.scaling.finetuned", "bool", False),
    ("rope.scaling.yarn_ext_factor", "f32", False),
    ("rope.scaling.yarn_attn_factor", "f32", False),
    ("rope.scaling.yarn_beta_fast", "f32", False),
    ("rope.scaling.yarn_beta_slow", "f32", False),
    ("rope.scaling.yarn_log_multiplier", "f32", False),
    # the deepseek4 model's own
    ("attention.layer_norm_rms_epsilon", "f32", True),
    ("attention.q_lora_rank", "u32", True),
    ("attention.sliding_window", "u32", True),
    ("expert_feed_forward_length", "u32", True),
    ("expert_shared_count", "u32", True),
    ("expert_weights_scale", "f32", True),
    ("expert_weights_norm", "bool", True),
    ("swiglu_clamp_exp", "f32/arr", True),
    ("swiglu_clamp_shexp", "f32/arr", False),
    ("attention.indexer.head_count", "u32", True),
    ("attention.indexer.key_length", "u32", True),
    ("attention.indexer.top_k", "u32", True),
    ("attention.output_group_count", "u32", True),
    ("attention.output_lora_rank", "u32", True),
    ("attention.compress_rope_freq_base", "f32", True),
    ("attention.compress_ratios", "int-arr", True),
    ("hyper_connection.count", "u32", True),
    ("hyper_connection.sinkhorn_iterations", "u32", True),
    ("hyper_connection.epsilon", "f32", True),
    ("hash_layer_count", "u32", True),
    ("expert_gating_func", "u32", True),
    ("nextn_predict_layers", "u32", False),
    # the vocabulary
    ("tokenizer.ggml.model", "str", True),
    ("tokenizer.ggml.tokens", "str-arr", True),
    ("tokenizer.ggml.pre", "str", False),
    ("tokenizer.ggml.token_type", "i32-arr", False),
    ("tokenizer.ggml.scores", "f32-arr", False),
    ("tokenizer.ggml.bos_token_id", "u32", False),
    ("tokenizer.ggml.eos_token_id", "u32", False),
    ("tokenizer.ggml.padding_token_id", "u32", False),
    ("tokenizer.ggml.unknown_token_id", "u32", False),
    ("tokenizer.ggml.add_bos_token", "bool", False),
    ("tokenizer.ggml.add_eos_token", "bool", False),
))
KEY_RULES: Mapping[str, KeyRule] = {r.key: r for r in KEYS}

ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
TOKENIZER_MODELS = ("gpt2", "llama", "bert", "t5", "rwkv", "plamo2", "none", "no_vocab")
GATING_SQRT_SOFTPLUS = names.GATING_FUNC["sqrtsoftplus"]
COMPRESS_RATIOS = (0, 4, 128)
HC_COUNT = 4
INDEXER_DIM_MULTIPLE = 64


def _value(kv: Mapping[str, KV], key: str):
    v = kv.get(key)
    if v is None or not _type_ok(v, KEY_RULES[key]):
        return None
    return v.value


def _type_ok(v: KV, rule: KeyRule) -> bool:
    return any(v.type == t and (s is None or v.sub_type == s) for t, s in rule.types)


def _type_name(v: KV) -> str:
    return f"ARRAY of {v.sub_type.name}" if v.type == VT.ARRAY and v.sub_type is not None else v.type.name


def key_problems(kv: Mapping[str, KV]) -> list[str]:
    """Missing required keys and keys of a type llama.cpp's loader refuses."""
    out = []
    arch = kv.get(names.KEY_ARCH)
    if arch is None or arch.type != VT.STRING or arch.value != names.ARCH:
        out.append(f"{names.KEY_ARCH} must be the string {names.ARCH!r}")
    n_layer = _value(kv, names.KEY_BLOCK_COUNT)
    for r in KEYS:
        v = kv.get(r.key)
        if v is None:
            if r.required:
                out.append(f"{r.key} is missing ({r.type_text()})")
            continue
        if not _type_ok(v, r):
            out.append(f"{r.key} is {_type_name(v)}; llama.cpp reads {r.type_text()}")
        elif r.per_block and v.type == VT.ARRAY and n_layer is not None and len(v.value) != int(n_layer):
            out.append(f"{r.key} has {len(v.value)} entries; llama.cpp needs one per block ({n_layer})")
    return out


def _dim_ratios(kv):
    ratios = _value(kv, names.KEY_COMPRESS_RATIOS)
    n = _value(kv, names.KEY_BLOCK_COUNT)
    if ratios is None or n is None:
        return []
    ratios = [int(x) for x in ratios]
    out = []
    if len(ratios) < int(n):
        out.append(f"{names.KEY_COMPRESS_RATIOS} has {len(ratios)} entries for {n} blocks")
    bad = sorted({r for r in ratios[:int(n)] if r not in COMPRESS_RATIOS})
    if bad:
        out.append(f"compress ratio(s) {bad}: llama.cpp's DeepSeek-V4 graph runs {list(COMPRESS_RATIOS)} only")
    return out


def _dim_hc(kv):
    hc = _value(kv, _K + "hyper_connection.count")
    if hc is not None and int(hc) != HC_COUNT:
        return [f"{_K}hyper_connection.count = {hc}: llama.cpp's graph asserts {HC_COUNT}"]
    return []


def _dim_indexer(kv):
    d = _value(kv, _K + "attention.indexer.key_length")
    if d is not None and int(d) % INDEXER_DIM_MULTIPLE:
        return [f"{_K}attention.indexer.key_length = {d}: llama.cpp's indexer rotation needs a multiple of "
                f"{INDEXER_DIM_MULTIPLE}"]
    return []


def _dim_gating(kv):
    g = _value(kv, names.KEY_EXPERT_GATING_FUNC)
    if g is not None and int(g) != GATING_SQRT_SOFTPLUS:
        return [f"{names.KEY_EXPERT_GATING_FUNC} = {g}: llama.cpp's DeepSeek-V4 loader runs sqrtsoftplus "
                f"({GATING_SQRT_SOFTPLUS}) only"]
    return []


def _dim_rope(kv):
    t = _value(kv, names.KEY_ROPE_SCALING_TYPE)
    if t is not None and t not in ROPE_SCALING_TYPES:
        return [f"{names.KEY_ROPE_SCALING_TYPE} = {t!r}: llama.cpp knows {', '.join(ROPE_SCALING_TYPES)}"]
    return []


# the model's dimensions against the fixed set llama.cpp's graph is written for
DIMS: tuple[Callable[[Mapping[str, KV]], list[str]], ...] = (_dim_ratios, _dim_hc, _dim_indexer, _dim_gating,
                                                               _dim_rope)


def dim_problems(kv: Mapping[str, KV]) -> list[str]:
    return [p for rule in DIMS for p in rule(kv)]


def vocab_problems(kv: Mapping[str, KV], tensors: Mapping[str, tuple[str, Sequence[int]]]) -> list[str]:
    out = []
    model = _value(kv, names.KEY_TOK_MODEL)
    if model is not None and model not in TOKENIZER_MODELS:
        out.append(f"{names.KEY_TOK_MODEL} = {model!r} is not a vocabulary type llama.cpp knows")
    if model == "gpt2" and names.KEY_TOK_MERGES not in kv:
        out.append(f"{names.KEY_TOK_MERGES} is missing; llama.cpp needs it (an empty list will do) for model "
                   "'gpt2'")
    elif names.KEY_TOK_MERGES in kv and not _type_ok(kv[names.KEY_TOK_MERGES], _rule("m", "str-arr")):
        out.append(f"{names.KEY_TOK_MERGES} is {_type_name(kv[names.KEY_TOK_MERGES])}; llama.cpp reads ARRAY of "
                   "STRING")
    tokens = _value(kv, names.KEY_TOK_TOKENS)
    emb = tensors.get("token_embd.weight")
    if tokens is not None and emb is not None and len(emb[1]) == 2 and len(tokens) != int(emb[1][1]):
        out.append(f"{len(tokens)} tokens but token_embd.weight has {emb[1][1]} rows")
    return out


def expected_tensors(kv: Mapping[str, KV]) -> Optional[set[str]]:
    """The tensor names llama.cpp's DeepSeek-V4 loader creates for this header (None when the
    keys it depends on are unusable: they are reported by ``key_problems``)."""
    n = _value(kv, names.KEY_BLOCK_COUNT)
    ratios = _value(kv, names.KEY_COMPRESS_RATIOS)
    n_hash = _value(kv, names.KEY_HASH_LAYER_COUNT)
    if n is None or ratios is None or n_hash is None or len(ratios) < int(n):
        return None
    out = {"token_embd.weight", "output_norm.weight", "output.weight", "output_hc_fn.weight",
           "output_hc_base.weight", "output_hc_scale.weight"}
    per = ("attn_norm", "attn_sinks", "attn_q_a", "attn_q_a_norm", "attn_q_b", "attn_kv", "attn_kv_a_norm",
           "attn_output_a", "attn_output_b", "hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn",
           "hc_ffn_base", "hc_ffn_scale", "ffn_gate_inp", "ffn_norm", "ffn_gate_exps", "ffn_down_exps",
           "ffn_up_exps", "ffn_gate_shexp", "ffn_down_shexp", "ffn_up_shexp")
    comp = ("attn_compressor_kv", "attn_compressor_gate", "attn_compressor_ape", "attn_compressor_norm")
    idx = ("indexer.proj", "indexer.attn_q_b", "indexer_compressor_kv", "indexer_compressor_gate",
           "indexer_compressor_ape", "indexer_compressor_norm")
    for L in range(int(n)):
        r = int(ratios[L])
        stems = per + (comp if r != 0 else ()) + (idx if r == 4 else ())
        out |= {f"blk.{L}.{s}.weight" for s in stems}
        out.add(f"blk.{L}.ffn_gate_tid2eid.weight" if L < int(n_hash) else f"blk.{L}.exp_probs_b.bias")
    return out


def tensor_problems(kv: Mapping[str, KV], tensors: Mapping[str, tuple[str, Sequence[int]]]) -> list[str]:
    """Tensor types llama.cpp lacks, tensors it would not create or misses, shapes it refuses."""
    from ds4quant.artifact.ds4 import expert_shape, shape_problems
    from ds4quant.formats import QTYPES
    from ds4quant.formats.qtype import RT_LLAMA_CPP

    out = []
    foreign: dict[str, list[str]] = {}
    for name, (qtype, _) in tensors.items():
        q = QTYPES.get(qtype)
        if q is None or RT_LLAMA_CPP not in q.runtimes:
            foreign.setdefault(qtype, []).append(name)
    for qtype, ts in sorted(foreign.items()):
        out.append(f"{len(ts)} tensor(s) of type {qtype} (e.g. {ts[0]}): not a ggml type llama.cpp knows")
    want = expected_tensors(kv)
    if want is not None:
        extra, missing = sorted(set(tensors) - want), sorted(want - set(tensors))
        if extra:
            out.append(f"{len(extra)} tensor(s) llama.cpp's loader does not create (e.g. {extra[0]}); it refuses "
                       "a file with other tensors")
        if missing:
            out.append(f"{len(missing)} tensor(s) it needs are missing (e.g. {missing[0]})")
    H, F, E = (_value(kv, _K + k) for k in ("embedding_length", "expert_feed_forward_length", "expert_count"))
    for name, (_, shape) in tensors.items():
        sn = names.parse_stack(name)
        if sn is not None and not sn.compact and None not in (H, F, E):
            if tuple(shape) != expert_shape(sn.proj, int(H), int(F), int(E)):
                out.append(f"{name}: shape {list(shape)} is not {list(expert_shape(sn.proj, int(H), int(F), int(E)))}")
    out += [f"{name}: {detail}" for name, detail in shape_problems(kv, {n: s for n, (_, s) in tensors.items()})]
    return out


def llama_cpp_problems(kv: Mapping[str, KV], tensors: Mapping[str, tuple[str, Sequence[int]]]) -> list[str]:
    """Every reason llama.cpp's DeepSeek-V4 loader would refuse (or assert on) this GGUF; [] if none.

    kv: the GGUF's KVs (``KV`` records); tensors: name -> (ds4quant qtype, GGUF shape).
    """
    return key_problems(kv) + dim_problems(kv) + vocab_problems(kv, tensors) + tensor_problems(kv, tensors)
