"""transformers' DeepSeek-V4 configuration and empty modules, without its loader.

``from_pretrained`` hands FP8/FP4 checkpoints to transformers' quantizer, which
on GPUs of compute capability 8.9 and newer keeps them quantized instead of
dequantizing. The reference never goes through it: the configuration comes
from config.json with the quantization keys dropped (our own code dequantizes,
``source.SourceWeights``), and modules are built on the meta device, so a
model or a layer costs no memory until its weights are assigned.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ds4quant.errors import CorruptDataError

__all__ = ["build_skeleton", "empty_layer", "fresh_rotary", "reference_config"]

# Keys that make transformers quantize or that describe the stored encodings
# (ours to decode), never the model's architecture.
_ENCODING_KEYS = ("quantization_config", "expert_dtype")
# Modules transformers keeps in float32 whatever the load dtype (its
# _keep_in_fp32_modules_strict); a reduced-precision reference follows it.
_KEEP_FP32 = ("attn_hc", "ffn_hc", "hc_head", "sinks", "position_bias", "e_score_correction_bias", "q_a_norm",
              "kv_norm", "input_layernorm", "post_attention_layernorm", "norm")


def reference_config(source_dir: "str | os.PathLike[str]", dtype: Any = None, experts_implementation: str = "eager"):
    """``DeepseekV4Config`` of an official-layout folder, with eager attention and
    ``experts_implementation`` set and the quantization keys dropped.

    dtype: the torch dtype recorded on the config (default float32)."""
    import torch
    from transformers import DeepseekV4Config

    path = Path(source_dir) / "config.json"
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CorruptDataError(f"cannot read config.json: {e}", where=str(path)) from None
    for k in _ENCODING_KEYS:
        obj.pop(k, None)
    obj.pop("torch_dtype", None)
    obj["dtype"] = str(dtype or torch.float32).replace("torch.", "")
    from ds4quant.runtime.torch_env import quiet_transformers

    with quiet_transformers():
        try:
            cfg = DeepseekV4Config.from_dict(obj)
        except (TypeError, ValueError, KeyError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CorruptDataError(f"transformers refuses the configuration: {first[:300]}", where=str(path)) from None
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = experts_implementation
    return cfg


def fresh_rotary(module, config, device) -> None:
    """Rebuild every rotary embedding inside ``module`` on ``device``: their
    inverse frequencies are non-persistent buffers computed from the config,
    which a meta-built module leaves empty."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    for name, sub in list(module.named_modules()):
        if isinstance(sub, DeepseekV4RotaryEmbedding):
            parent_name, _, attr = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            new = DeepseekV4RotaryEmbedding(config).to(device)
            if parent is module and not attr:
                raise RuntimeError("fresh_rotary needs a module that contains the rotary embedding")  # a bug
            setattr(parent, attr, new)


def keep_fp32(name: str) -> bool:
    """Whether transformers keeps the parameter ``name`` in float32 at any load dtype."""
    parts = name.split(".")
    return any(k in parts for k in _KEEP_FP32)


def build_skeleton(config):
    """``DeepseekV4ForCausalLM`` of ``config`` on the meta device (no memory, no init)."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    with torch.device("meta"):
        return DeepseekV4ForCausalLM._from_config(config, dtype=config.dtype)


def empty_layer(config, layer: int, device="cpu", experts=None):
    """``DeepseekV4DecoderLayer`` ``layer`` with uninitialized storage on ``device``
    (rotary buffers computed); ``experts`` replaces its routed experts module
    before storage is allocated (so the routed experts' dense stacks never are)."""
    import torch
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer

    with torch.device("meta"):
        mod = DeepseekV4DecoderLayer(config, layer)
    if experts is not None:
        mod.mlp.experts = torch.nn.Module()  # a placeholder while the rest moves
    mod = mod.to_empty(device=device)
    fresh_rotary(mod, config, device)
    if experts is not None:
        mod.mlp.experts = experts
    return mod
