"""DeepSeek-V4 GGUF conventions a Lucebox-style loader relies on.

Spec ds4-and-lucebox.md §2: ``general.architecture`` is ``deepseek4``; the
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
