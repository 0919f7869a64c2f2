"""DeepSeek-V4 GGUF conventions a Lucebox-style loader relies on.

Spec ds4-and-lucebox.md §2: ``general.architecture`` is ``deepseek4``; the
loader reads a fixed set of UINT32 keys (LOADER ``kRequiredU32Keys``); routed
expert stacks are ``blk.L.ffn_{gate,up,down}_exps.weight`` with GGUF shape
``[in, out, n_expert]`` (gate/up ``[4096, 2048, 256]``, down
``[2048, 4096, 256]`` for V4 Flash). There is no fused gate_up tensor.

    problems = check_ds4_header(g.kv)     # [] when a Lucebox loader accepts the keys
"""

from __future__ import annotations

import re
from typing import Mapping, Optional

from gguf import GGUFValueType as VT

from ds4quant.artifact.gguf_values import KV
from ds4quant.errors import BadInputError

ARCH = "deepseek4"
KEY_ARCH = "general.architecture"

# LOADER kRequiredU32Keys, without the "deepseek4." prefix (spec §2).
REQUIRED_U32_KEYS: tuple[str, ...] = tuple(f"{ARCH}.{k}" for k in (
    "block_count",
    "embedding_length",
    "vocab_size",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.q_lora_rank",
    "attention.output_lora_rank",
    "attention.output_group_count",
    "attention.sliding_window",
    "attention.indexer.head_count",
    "attention.indexer.key_length",
    "attention.indexer.top_k",
    "rope.dimension_count",
    "expert_count",
    "expert_used_count",
    "expert_shared_count",
    "expert_feed_forward_length",
    "hash_layer_count",
    "hyper_connection.count",
    "hyper_connection.sinkhorn_iterations",
))

PROJECTIONS = ("gate", "up", "down")
EXPERT_TENSOR = re.compile(r"^blk\.(?P<layer>\d+)\.ffn_(?P<proj>gate|up|down)_exps\.weight$")


def expert_tensor_name(layer: int, proj: str) -> str:
    """``blk.<layer>.ffn_<proj>_exps.weight`` for proj in gate/up/down."""
    if proj not in PROJECTIONS:
        raise BadInputError(f"expert projection must be one of {', '.join(PROJECTIONS)}, got {proj!r}")
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise BadInputError(f"layer must be an int >= 0, got {layer!r}")
    return f"blk.{layer}.ffn_{proj}_exps.weight"


def parse_expert_tensor(name: str) -> Optional[tuple[int, str]]:
    """(layer, proj) of a routed-expert stack tensor name, else None."""
    m = EXPERT_TENSOR.match(name)
    return (int(m.group("layer")), m.group("proj")) if m else None


def expert_shape(proj: str, hidden: int, expert_ffn: int, n_expert: int) -> tuple[int, int, int]:
    """GGUF shape [in, out, n_expert] of a routed-expert stack."""
    if proj not in PROJECTIONS:
        raise BadInputError(f"expert projection must be one of {', '.join(PROJECTIONS)}, got {proj!r}")
    return (expert_ffn, hidden, n_expert) if proj == "down" else (hidden, expert_ffn, n_expert)


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
