"""DeepSeek-V4 GGUF conventions a Lucebox-style loader relies on.

docs/formats.md#ds4-gguf: ``general.architecture`` is ``deepseek4``; the
loader reads a fixed set of UINT32 keys (LOADER ``kRequiredU32Keys``, the
required rows of ``names.DS4_U32_KEYS``); routed expert stacks are
``blk.L.ffn_{gate,up,down}_exps.weight`` with GGUF shape ``[in, out, n_expert]``
(gate/up ``[4096, 2048, 256]``, down ``[2048, 4096, 256]`` for V4 Flash).
There is no fused gate_up tensor. Names and keys come from ``ds4quant.names``.

    problems = check_ds4_header(g.kv)     # [] when a Lucebox loader accepts the keys
"""

from __future__ import annotations

from typing import Mapping

from gguf import GGUFValueType as VT

from ds4quant import names
from ds4quant.artifact.gguf_values import KV
from ds4quant.names import ARCH, KEY_ARCH

# The keys the loader requires (names.DS4_U32_KEYS is the one table).
REQUIRED_U32_KEYS: tuple[str, ...] = names.LOADER_U32_KEYS


def expert_shape(proj: str, hidden: int, expert_ffn: int, n_expert: int) -> tuple[int, int, int]:
    """GGUF shape [in, out, n_expert] of a routed-expert stack."""
    p = names.as_proj(proj)
    return (expert_ffn, hidden, n_expert) if p == names.Proj.DOWN else (hidden, expert_ffn, n_expert)


def check_ds4_header(kv: Mapping[str, KV]) -> list[str]:
    """Every reason a Lucebox DS4 loader would refuse these KVs (empty if none)."""
    problems = []
    arch = kv.get(KEY_ARCH)
    if arch is None:
        problems.append(f"{KEY_ARCH} is missing")
    elif arch.type != VT.STRING or arch.value != ARCH:
        problems.append(f"{KEY_ARCH} must be the string {ARCH!r}, got {arch.value!r}")
    for key in REQUIRED_U32_KEYS:
        v = kv.get(key)
        if v is None:
            problems.append(f"{key} is missing")
        elif v.type != VT.UINT32:
            problems.append(f"{key} must be UINT32, got {v.type.name}")
    return problems


# ----------------------------------------------------------------------------
# tensor shapes from the deepseek4.* keys
#
# Every tensor of a DS4 model has a shape the header fixes (sources/naming.py
# has the tensor set, sources/config.py the sizes; the official layout is in
# docs/formats.md#ds4-checkpoint). Each rule below gives a tensor's GGUF shape
# (ne order: the official [out, in] reversed) as one (value, why) per dim, so a
# problem names the dim that disagrees and the key that says so. A dim whose
# key is absent or mistyped is not checked (the ds4_keys check reports the key).
# The compressor's position embedding (ape) has one row per compressed
# position: compress ratio r rows, 2 x head_dim wide when r == 4 (the CSA
# overlap), else head_dim; the indexer exists on ratio-4 layers only.

_K = names.ARCH + "."


def _kv_uint(kv: Mapping[str, KV], key: str):
    v = kv.get(key)
    if v is None or v.type not in (VT.UINT8, VT.UINT16, VT.UINT32, VT.UINT64, VT.INT32, VT.INT64):
        return None
    return int(v.value)


def _ratios(kv: Mapping[str, KV]):
    v = kv.get(_K + "attention.compress_ratios")
    if v is None or v.type != VT.ARRAY:
        return None
    try:
        return [int(x) for x in v.value]
    except (TypeError, ValueError):
        return None


def _dim(value, why):
    return (value, why) if value is not None else (None, why)


def _times(*parts):
    """(product, 'a x b') of (value, why) parts; None when any is unknown."""
    if any(p[0] is None for p in parts):
        return (None, "")
    out = 1
    for p in parts:
        out *= p[0]
    return (out, " x ".join(p[1] for p in parts))


def expected_shape(name: str, kv: Mapping[str, KV]):
    """The GGUF shape ``name`` must have as a tuple of (value | None, why) per
    dim, or None when no rule covers it (unknown tensors, routed-expert stacks:
    those are checked by the stack rules)."""
    def k(short):
        key = _K + short
        return (_kv_uint(kv, key), f"{key} = {_kv_uint(kv, key)}")

    H, V, nh, hd = k("embedding_length"), k("vocab_size"), k("attention.head_count"), k("attention.key_length")
    hc = k("hyper_connection.count")
    one = (1, "1")
    glob = {
        "token_embd.weight": (H, V),
        "output.weight": (H, V),
        "output_norm.weight": (H,),
        "output_hc_fn.weight": (_times(hc, H), hc),
        "output_hc_base.weight": (hc,),
        "output_hc_scale.weight": (one,),
    }
    if name in glob:
        return glob[name]
    layer = names.layer_of(name)
    if layer is None or names.parse_stack(name) is not None:
        return None
    stem = name.split(".", 2)[2]
    qr, orank, og = k("attention.q_lora_rank"), k("attention.output_lora_rank"), k("attention.output_group_count")
    nkv, E, F, K = k("attention.head_count_kv"), k("expert_count"), k("expert_feed_forward_length"), \
        k("expert_used_count")
    S, ih, ihd = k("expert_shared_count"), k("attention.indexer.head_count"), k("attention.indexer.key_length")
    ratios = _ratios(kv)
    r = (ratios[layer], f"{_K}attention.compress_ratios[{layer}] = {ratios[layer]}") \
        if ratios is not None and layer < len(ratios) else (None, "")
    coff = (None, "")
    if r[0] is not None:
        coff = (2 if r[0] == 4 else 1, "2 (ratio-4 overlap)" if r[0] == 4 else "1")
    heads = _times(nh, hd)
    group_in = (heads[0] // og[0], f"{heads[1]} / {og[1]}") if heads[0] is not None and og[0] else (None, "")
    hcm = (((2 + hc[0]) * hc[0]), f"(2 + {hc[1]}) x {hc[0]}") if hc[0] is not None else (None, "")
    shared = _times(S, F)
    rules = {
        "attn_norm.weight": (H,), "ffn_norm.weight": (H,),
        "attn_q_a.weight": (H, qr), "attn_q_a_norm.weight": (qr,), "attn_q_b.weight": (qr, heads),
        "attn_kv.weight": (H, _times(nkv, hd)), "attn_kv_a_norm.weight": (hd,),
        "attn_output_a.weight": (group_in, _times(og, orank)), "attn_output_b.weight": (_times(og, orank), H),
        "attn_sinks.weight": (nh,),
        "attn_compressor_ape.weight": (_times(coff, hd), r),
        "attn_compressor_kv.weight": (H, _times(coff, hd)), "attn_compressor_gate.weight": (H, _times(coff, hd)),
        "attn_compressor_norm.weight": (hd,),
        "indexer.attn_q_b.weight": (qr, _times(ih, ihd)), "indexer.proj.weight": (H, ih),
        "indexer_compressor_ape.weight": (_times(coff, ihd), r),
        "indexer_compressor_kv.weight": (H, _times(coff, ihd)), "indexer_compressor_gate.weight": (H, _times(coff, ihd)),
        "indexer_compressor_norm.weight": (ihd,),
        "hc_attn_fn.weight": (_times(hc, H), hcm), "hc_attn_base.weight": (hcm,), "hc_attn_scale.weight": ((3, "3"),),
        "hc_ffn_fn.weight": (_times(hc, H), hcm), "hc_ffn_base.weight": (hcm,), "hc_ffn_scale.weight": ((3, "3"),),
        "ffn_gate_inp.weight": (H, E), "exp_probs_b.bias": (E,), "ffn_gate_tid2eid.weight": (K, V),
        "ffn_gate_shexp.weight": (H, shared), "ffn_up_shexp.weight": (H, shared), "ffn_down_shexp.weight": (shared, H),
    }
    return rules.get(stem)


def shape_problems(kv: Mapping[str, KV], shapes: Mapping[str, "tuple[int, ...]"]) -> list[tuple[str, str]]:
    """(tensor, detail) for every tensor whose GGUF shape disagrees with the
    ``deepseek4.*`` keys, one entry per tensor naming each dim that disagrees;
    also compressor tensors on a layer whose compress ratio is 0, and
    indexer tensors on a layer whose ratio is not 4."""
    out = []
    ratios = _ratios(kv)
    for name, shape in shapes.items():
        layer = names.layer_of(name)
        stem = name.split(".", 2)[2] if layer is not None else ""
        if ratios is not None and layer is not None and layer < len(ratios):
            r = ratios[layer]
            key = f"{_K}attention.compress_ratios[{layer}] = {r}"
            if r == 0 and ("compressor" in stem or stem.startswith("indexer")):
                out.append((name, f"a compressor/indexer tensor on a layer without compression ({key})"))
                continue
            if r not in (0, 4) and stem.startswith("indexer"):
                out.append((name, f"an indexer tensor on a layer whose ratio is not 4 ({key}): only ratio-4 "
                                  "layers have an indexer"))
                continue
        want = expected_shape(name, kv)
        if want is None:
            continue
        shape = tuple(shape)
        if len(shape) != len(want):
            out.append((name, f"GGUF shape {list(shape)} has {len(shape)} dims; the deepseek4 keys give "
                              f"{len(want)}: [{', '.join(str(v) if v is not None else '?' for v, _ in want)}]"))
            continue
        bad = [f"ne[{i}] = {have}, but {why} gives {v}" if " = " in why or " x " in why or " / " in why
               else f"ne[{i}] = {have}, the rule gives {v}"
               for i, (have, (v, why)) in enumerate(zip(shape, want)) if v is not None and have != v]
        if bad:
            out.append((name, f"GGUF shape {list(shape)}: " + "; ".join(bad)))
    return out
