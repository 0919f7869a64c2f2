"""The transformers DeepSeek-V4 reference model: loading, MoE blocks, expert swap and capture.

The runtime's floor: calibrate records importance and routing through it, and
fidelity replaces each layer's routed experts with the runtime's executor.
Facts this module relies on are in docs/reference-model.md:

- ``DeepseekV4ForCausalLM`` built from config.json holds the checkpoint's
  weights once they are dequantized exactly (the numbers ``from_pretrained``
  gives on a CPU host, docs/reference-model.md#loading); we decode them ourselves
  because transformers keeps FP8/FP4 quantized on recent GPUs.
- ``model.model.layers[L].mlp`` is a ``DeepseekV4SparseMoeBlock``; its
  ``experts`` module is called as ``experts(hidden[T,H], top_k_index[T,k] int64,
  top_k_weights[T,k]) -> [T,H]`` with positional arguments (docs/reference-model.md#experts).
- A replacement module doing the eager math in the same order matches
  ``experts_implementation="eager"`` bit for bit; bits also depend on the torch
  intra-op thread count (docs/reference-model.md#determinism), so golden runs pin both.

torch and transformers are imported inside the functions that need them, so
importing this module (or ``ds4quant --help``) stays light.

    model = load_reference("samples/ds4-tiny", threads=1)
    with capture_experts(model) as cap:
        model(input_ids=ids, use_cache=False)
    cap.calls[0].top_k_index.shape          # (T, k)
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from ds4quant.errors import BadInputError, CorruptDataError, MissingDependencyError
from ds4quant.runtime.torch_env import quiet_transformers, torch_threads  # noqa: F401  (public here too)
# the eager experts' rows and down-projection input, one definition (the stream's, which reads
# eager's stacked ``gate_up_proj`` too)
from ds4quant.runtime.stream.source import expert_rows  # noqa: F401  (public here too)

__all__ = [
    "ExpertCall", "ExpertCapture", "capture_experts", "check_dependencies", "expert_rows", "load_reference",
    "moe_blocks", "quiet_transformers", "swap_experts", "torch_threads",
]

_INSTALL_HINT = "pip install 'ds4quant[reference]'"


def check_dependencies(quantized: bool = False, needed_by: str = "the reference model") -> None:
    """Refuse early (MissingDependencyError) when torch or transformers is not
    installed. ``quantized`` (an FP8/FP4 checkpoint) needs nothing more: our own
    code dequantizes it."""
    need = [("torch", "the reference model"), ("transformers", "the DeepSeek-V4 reference model")]
    for module, what in need:
        if importlib.util.find_spec(module) is None:
            raise MissingDependencyError(f"{needed_by} needs {module} ({what})", hint=_INSTALL_HINT)


def _check_threads(threads: Optional[int]) -> None:
    if threads is None:
        return
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise BadInputError(f"threads must be an int >= 1, got {threads!r}", where="threads")


def _torch_dtype(dtype: Any):
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    got = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if not isinstance(got, torch.dtype) or not got.is_floating_point:
        raise BadInputError(f"dtype must be a torch floating dtype or its name (float32, bfloat16), got {dtype!r}",
                            where="dtype")
    return got


def load_reference(source_dir: "str | os.PathLike[str]", *, threads: Optional[int] = None,
                   dtype: Any = "float32", experts_implementation: str = "eager"):
    """``DeepseekV4ForCausalLM`` on the exactly dequantized weights of an
    official-layout checkpoint folder, in eval mode.

    The model is built from config.json on the meta device and every weight is
    decoded by our own code (``runtime.stream.SourceWeights``: FP8 e4m3 with
    128x128 E8M0 blocks, FP4 e2m1 with E8M0 per 32, bf16/f32 as is), never by
    transformers' quantizer, which keeps FP8/FP4 quantized on recent GPUs: the
    same numbers on every host.

    dtype: torch dtype (or its name) of the parameters (transformers' float32
    modules stay float32); experts_implementation: transformers' experts
    backend ("eager" for bitwise checks). threads: when given, torch's
    intra-op thread count is set to it for this process (it changes the
    model's bits; use ``torch_threads`` for a scoped setting). Refuses
    (Ds4quantError naming the folder) a GGUF or malformed source, a missing
    dependency, missing or mismatched weights, a model whose MoE shape differs
    from config.json, and a tid2eid entry that names no expert.

        model = load_reference("samples/ds4-tiny", threads=1)
        logits = model(input_ids=ids, use_cache=False).logits   # float32 [B, S, vocab]
    """
    from ds4quant.sources import open_official_source
    from ds4quant.sources.config import HASH_MOE

    _check_threads(threads)
    where = str(source_dir)
    with open_official_source(source_dir, "the transformers reference model") as src:
        cfg = src.config
    check_dependencies(False)
    torch_dtype = _torch_dtype(dtype)

    import torch

    from ds4quant.runtime.stream.config import build_skeleton, fresh_rotary, keep_fp32, reference_config
    from ds4quant.runtime.stream.source import SourceWeights

    if threads is not None:
        torch.set_num_threads(threads)
    config = reference_config(where, dtype=torch_dtype, experts_implementation=experts_implementation)
    with quiet_transformers():
        model = build_skeleton(config)
    with SourceWeights(where) as weights:
        state = _reference_state(weights)
    want = model.state_dict()
    missing = sorted(set(want) - set(state))
    if missing:
        raise CorruptDataError(f"the reference model has {len(missing)} missing keys (first: {missing[0]}); "
                               "the checkpoint is incomplete", where=where)
    for name in sorted(want):
        got, ref = state[name], want[name]
        if tuple(got.shape) != tuple(ref.shape):
            raise CorruptDataError(f"the reference model has mismatched keys (first: {name}: checkpoint "
                                   f"{tuple(got.shape)}, model {tuple(ref.shape)}); the checkpoint has the "
                                   "wrong shapes", where=where)
        if got.is_floating_point():
            state[name] = got.to(torch.float32 if keep_fp32(name) else torch_dtype)
    model.load_state_dict({k: state[k] for k in want}, strict=True, assign=True)
    fresh_rotary(model, config, "cpu")
    model.eval()
    hash_layers = tuple(i for i, t in enumerate(cfg.mlp_layer_types) if t == HASH_MOE)
    _check_model(model, (cfg.num_hidden_layers, cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size),
                 hash_layers, where)
    impl = getattr(model.config, "_experts_implementation", experts_implementation)
    if impl != experts_implementation:
        raise RuntimeError(f"reference model runs experts with {impl!r}, "
                           f"not {experts_implementation!r}")  # a bug, not user input
    return model


def _reference_state(weights) -> dict:
    """The whole model's state dict (transformers names) from a SourceWeights:
    routed experts stacked as ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]."""
    import torch

    state = {}
    for part in ("embed", "head"):
        state.update(weights.global_state(part))
    n_expert = int(weights.config.n_routed_experts)
    for layer in range(weights.n_layers):
        prefix = f"model.layers.{layer}."
        state.update({prefix + k: v for k, v in weights.layer_state(layer).items()})
        pairs = [weights.expert_weights(layer, e) for e in range(n_expert)]
        state[prefix + "mlp.experts.gate_up_proj"] = torch.stack([g for g, _ in pairs])
        state[prefix + "mlp.experts.down_proj"] = torch.stack([d for _, d in pairs])
        del pairs
    return state


def _check_model(model, shape: tuple[int, int, int, int], hash_layers: tuple[int, ...], where: str) -> None:
    """The loaded model must have config.json's MoE shape (n_layer, n_expert,
    moe_intermediate, hidden), and every tid2eid entry must name an expert:
    hooks and per-expert bookkeeping rely on both."""
    n_layer, n_expert, inter, hidden = shape
    layers = model.model.layers
    if len(layers) != n_layer:
        raise CorruptDataError(f"reference model has {len(layers)} layers, config.json says {n_layer}", where=where)
    for i, layer in enumerate(layers):
        ex = layer.mlp.experts
        if tuple(ex.gate_up_proj.shape) != (n_expert, 2 * inter, hidden):
            raise CorruptDataError(f"layer {i}: experts gate_up_proj {tuple(ex.gate_up_proj.shape)}, "
                                   f"expected {(n_expert, 2 * inter, hidden)}", where=where)
        if i in hash_layers:
            t = layer.mlp.gate.tid2eid
            lo, hi = int(t.min()), int(t.max())
            if lo < 0 or hi >= n_expert:
                bad = lo if lo < 0 else hi
                raise CorruptDataError(f"layers.{i}.ffn.gate.tid2eid holds expert id {bad}, outside 0..{n_expert - 1}",
                                       where=where)


# --------------------------------------------------------------------------
# MoE blocks and their routed experts


def moe_blocks(model) -> list:
    """[(layer index, DeepseekV4SparseMoeBlock)] in layer order (every
    DeepSeek-V4 layer has one; a layer whose ``mlp`` is another module is left out)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

    return [(i, layer.mlp) for i, layer in enumerate(model.model.layers)
            if isinstance(layer.mlp, DeepseekV4SparseMoeBlock)]


def swap_experts(model, layer: int, module):
    """Replace layer ``layer``'s routed experts (``mlp.experts``) with ``module``
    and return the module it replaces.

    ``module`` is a ``torch.nn.Module`` called as the eager experts are:
    ``module(hidden[T,H], top_k_index[T,k] int64, top_k_weights[T,k]) -> [T,H]``
    (transformers' experts_implementation dispatch no longer applies to it).
    Swap after loading: the state_dict names of the swapped layer change.

        old = swap_experts(model, 0, MyExperts(...)); ...; swap_experts(model, 0, old)
    """
    import torch

    blocks = dict(moe_blocks(model))
    if isinstance(layer, bool) or not isinstance(layer, int) or layer not in blocks:
        raise BadInputError(f"layer {layer!r} has no MoE block; MoE layers are {sorted(blocks)}", where="layer")
    if not isinstance(module, torch.nn.Module):
        raise BadInputError(f"experts replacement for layer {layer} is {type(module).__name__}, "
                            "not a torch.nn.Module", where="module")
    block = blocks[layer]
    old = block.experts
    block.experts = module
    return old


@dataclass(frozen=True)
class ExpertCall:
    """One call of a layer's routed experts: hidden float [T,H], top_k_index
    int64 [T,k], top_k_weights float [T,k] (detached copies)."""

    layer: int
    hidden: Any
    top_k_index: Any
    top_k_weights: Any


@dataclass
class ExpertCapture:
    """What ``capture_experts`` saw: ``calls`` in call order (empty when a
    callback consumed them)."""

    calls: list = field(default_factory=list)

    def for_layer(self, layer: int) -> list:
        return [c for c in self.calls if c.layer == layer]


@contextlib.contextmanager
def capture_experts(model, callback: Optional[Callable[..., None]] = None, *,
                    layers: Optional[list] = None) -> Iterator[ExpertCapture]:
    """Forward pre-hooks on every MoE layer's routed experts (or ``layers``).

    Without ``callback`` each call is kept as an ``ExpertCall`` in the yielded
    ``ExpertCapture.calls``. With one, ``callback(layer, experts_module, hidden,
    top_k_index, top_k_weights)`` runs inside the hook on the live tensors and
    nothing is kept. The hooks sit on the experts modules present on entry (a
    later ``swap_experts`` bypasses them) and are removed on exit.

        with capture_experts(model) as cap:
            model(input_ids=ids, use_cache=False)
    """
    blocks = moe_blocks(model)
    if layers is not None:
        known = {i for i, _ in blocks}
        missing = sorted(set(layers) - known)
        if missing:
            raise BadInputError(f"layers {missing} have no MoE block; MoE layers are {sorted(known)}", where="layers")
        blocks = [(i, b) for i, b in blocks if i in set(layers)]
    cap = ExpertCapture()

    def make_hook(layer_idx: int):
        def hook(module, args, kwargs):
            hidden = args[0] if len(args) > 0 else kwargs["hidden_states"]
            idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
            weights = args[2] if len(args) > 2 else kwargs["top_k_weights"]
            if callback is not None:
                callback(layer_idx, module, hidden, idx, weights)
            else:
                cap.calls.append(ExpertCall(layer_idx, hidden.detach().clone(), idx.detach().clone(),
                                            weights.detach().clone()))

        return hook

    handles = [block.experts.register_forward_pre_hook(make_hook(i), with_kwargs=True) for i, block in blocks]
    try:
        yield cap
    finally:
        for h in handles:
            h.remove()
