"""The reference's weights: the source checkpoint, dequantized by our own code.

``SourceWeights`` reads an official-layout folder lazily, one layer at a time,
through ``sources.open_source`` (memory-mapped shards) and decodes every tensor
with ``read_dequantized`` (FP8 e4m3 with 128x128 E8M0 block scales, FP4 e2m1
with an E8M0 scale per 32 inputs, bf16/f32 as is: exact in float32). It never
asks transformers to load or dequantize anything, so the numbers are the same
on every host (transformers' own loader keeps FP8 quantized on recent GPUs).

Routed experts stay encoded until a token reaches them: ``SourceExperts``
decodes an expert on first use (kept while the layer lives, within a byte
budget) and computes the eager experts' math in eager's order, so its output
has the bits of ``experts_implementation="eager"`` over the dequantized stack.

    with SourceWeights("samples/ds4-tiny") as w:
        sd = w.layer_state(2)          # {"self_attn.q_a_proj.weight": tensor, ...}
        ex = w.experts_module(2)       # called like DeepseekV4Experts
"""

from __future__ import annotations

import os
from typing import Any, Optional, Protocol

import numpy as np

from ds4quant.errors import BadInputError, CorruptDataError

__all__ = ["EagerExperts", "SourceExperts", "SourceWeights", "WeightProvider", "down_input", "expert_rows",
           "rows_by_expert", "GLOBAL_PARTS"]

# The model's tensors outside the decoder layers, by the stage that uses them.
GLOBAL_PARTS = {
    "embed": ("model.embed_tokens.weight",),
    "head": ("model.hc_head.hc_fn", "model.hc_head.hc_base", "model.hc_head.hc_scale", "model.norm.weight",
             "lm_head.weight"),
}


class WeightProvider(Protocol):
    """What a streamed model reads its numbers from (see the package docstring)."""

    config: Any
    n_layers: int

    def layer_state(self, layer: int) -> dict: ...

    def experts_module(self, layer: int): ...

    def global_state(self, part: str) -> dict: ...

    def layer_bytes(self, layer: int) -> int: ...

    def experts_fp4(self, layer: int) -> bool: ...

    def close(self) -> None: ...


def _tensor(arr: np.ndarray, dtype=None):
    import torch

    t = torch.from_numpy(np.ascontiguousarray(arr))
    return t if dtype is None or not t.is_floating_point() else t.to(dtype)


class SourceWeights:
    """The source folder's weights per layer, dequantized exactly (a context manager).

    expert_cache: bytes of decoded routed experts a layer keeps (None: all of
    them; 0: decode on every call)."""

    def __init__(self, source_dir: "str | os.PathLike[str]", *, expert_cache: Optional[int] = None):
        from ds4quant.runtime.stream.config import reference_config
        from ds4quant.sources import open_official_source
        from ds4quant.sources.naming import hf_name

        self.where = str(source_dir)
        self.src = open_official_source(source_dir, "the reference model")
        try:
            self.config = reference_config(source_dir)
            c = self.src.config
            self.n_layers = c.num_hidden_layers
            self.expert_cache = expert_cache
            self._layers: dict[int, dict[str, str]] = {}
            self._globals: dict[str, str] = {}
            self._experts: dict[int, dict[tuple[int, str], str]] = {}
            for m in self.src.names.mapped:
                if m.role != "weight":
                    continue
                hf, part = hf_name(m.name)
                if part is not None:
                    self._experts.setdefault(m.layer, {})[part] = m.name
                elif m.layer is not None:
                    self._layers.setdefault(m.layer, {})[hf.split(".", 3)[3]] = m.name
                else:
                    self._globals[hf] = m.name
            if "lm_head.weight" not in self._globals and self.config.tie_word_embeddings:
                self._globals["lm_head.weight"] = self._globals.get("model.embed_tokens.weight", "")
        except BaseException:
            self.src.close()
            raise

    # -- reading ---------------------------------------------------------------

    def _read(self, name: str):
        info = self.src.info(name)
        if info.dtype in ("I64", "I32", "U8", "I8", "U32", "I16") and info.encoding == "plain":
            return _tensor(np.asarray(self.src.read(name)).astype(np.int64))
        arr = self.src.read_dequantized(name)
        self.src.release(name)
        return _tensor(arr)

    def layer_state(self, layer: int) -> dict:
        """{name inside the layer: float32 tensor} for every tensor but the routed experts."""
        names = self._layers.get(layer)
        if names is None:
            raise CorruptDataError(f"the checkpoint has no tensors for layer {layer}", where=self.where)
        return {k: self._read(v) for k, v in sorted(names.items())}

    def global_state(self, part: str) -> dict:
        """{model name: tensor} of ``part`` ("embed" or "head")."""
        out = {}
        for hf in GLOBAL_PARTS[part]:
            name = self._globals.get(hf)
            if not name:
                raise CorruptDataError(f"the checkpoint has no tensor for {hf}", where=self.where)
            out[hf] = self._read(name)
        return out

    def expert_names(self, layer: int) -> dict:
        """{(expert, "gate"|"up"|"down"): official name} of ``layer``."""
        return self._experts.get(layer, {})

    def experts_module(self, layer: int) -> "SourceExperts":
        return SourceExperts(self, layer, cache_bytes=self.expert_cache)

    def expert_weights(self, layer: int, e: int, device=None):
        """(gate_up [2I, H], down [H, I]) float32 of expert ``e``: w1 rows then w3 rows,
        the layout of transformers' ``gate_up_proj[e]``. device: where the values
        are wanted (default the host); on a GPU an FP4 expert's codes and scales
        travel encoded (an eighth of the float bytes) and are decoded there, to
        the same bits as the host decode."""
        import torch

        names = self._experts.get(layer, {})
        try:
            w1, w3, w2 = (names[(e, p)] for p in ("gate", "up", "down"))
        except KeyError:
            raise CorruptDataError(f"layer {layer} has no routed expert {e}", where=self.where) from None
        if device is not None and torch.device(device).type != "cpu":
            gate_up = torch.cat([self._read_on(w1, device), self._read_on(w3, device)], dim=0)
            return gate_up, self._read_on(w2, device)
        gate_up = torch.cat([self._read(w1), self._read(w3)], dim=0)
        return gate_up, self._read(w2)

    def experts_fp4(self, layer: int) -> bool:
        """Whether every routed expert tensor of ``layer`` is FP4 with E8M0 scales
        (then every decoded value is exact in bfloat16 as well)."""
        from ds4quant.sources.official import ENC_FP4

        names = self._experts.get(layer, {})
        return bool(names) and all(self.src.info(n).encoding == ENC_FP4 for n in names.values())

    def _read_on(self, name: str, device):
        """float32 values of ``name`` on ``device``: FP4 decoded there, anything else on the host."""
        import torch

        from ds4quant.formats.fp8 import check_e8m0_finite, dequant_e2m1_torch
        from ds4quant.sources.official import ENC_FP4

        info = self.src.info(name)
        if info.encoding != ENC_FP4:
            return self._read(name).to(device)
        scale = self.src.read(info.scale)
        check_e8m0_finite(scale, where=f"{self.where}: tensor {info.scale!r}")
        codes = torch.from_numpy(np.array(self.src.read(name)).view(np.uint8)).to(device)
        out = dequant_e2m1_torch(codes, torch.from_numpy(np.array(scale).view(np.uint8)).to(device))
        self.src.release(name)
        return out

    def layer_bytes(self, layer: int) -> int:
        """float32 bytes of the layer's dense tensors plus all its decoded routed experts."""
        total = 0
        for name in list(self._layers.get(layer, {}).values()) + list(self._experts.get(layer, {}).values()):
            shape = self.src.info(name).shape_logical
            total += 4 * int(np.prod(shape, dtype=np.int64))
        return total

    def expert_bytes(self, layer: int) -> int:
        """float32 bytes of one decoded routed expert (gate, up and down) of ``layer``."""
        names = self._experts.get(layer, {})
        return sum(4 * int(np.prod(self.src.info(names[(0, p)]).shape_logical, dtype=np.int64))
                   for p in ("gate", "up", "down") if (0, p) in names)

    def global_bytes(self, part: str) -> int:
        return sum(4 * int(np.prod(self.src.info(self._globals[h]).shape_logical, dtype=np.int64))
                   for h in GLOBAL_PARTS[part] if self._globals.get(h))

    def close(self) -> None:
        self.src.close()

    def __enter__(self) -> "SourceWeights":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _experts_base():
    import torch

    return torch.nn.Module


def rows_by_expert(top_k_index, num_experts: int) -> list:
    """[(e, top_k_pos [n], token_idx [n])] for every expert id below
    ``num_experts`` that ``top_k_index`` [T, k] reaches, in ascending id, each
    expert's rows in the order ``torch.where(top_k_index.T == e)`` lists them
    (the eager forward's): from one stable sort and one host synchronization
    per call instead of one per expert, which on a GPU kept the device idle
    between 256 small matrix products."""
    import torch

    n_tok = top_k_index.shape[0]
    flat = top_k_index.transpose(0, 1).reshape(-1)  # position p * T + t: where()'s row-major order
    order = torch.argsort(flat, stable=True)  # stable: each expert's rows stay in that order
    counts = torch.bincount(flat, minlength=num_experts + 1).tolist()
    pos, tok = order // n_tok, order % n_tok
    out, start = [], 0
    for e, c in enumerate(counts):
        if c and e < num_experts:  # eager skips the expert-parallel placeholder id
            out.append((e, pos[start:start + c], tok[start:start + c]))
        start += c
    return out


class _ExpertsLoop(_experts_base()):  # type: ignore[misc]
    """Routed experts called as transformers' ``DeepseekV4Experts``:
    ``(hidden [T,H], top_k_index [T,k] int64, top_k_weights [T,k]) -> [T,H]``,
    with the same math in the same order as its eager forward (experts in
    ascending id, rows in the one-hot mask's order, ``index_add_`` into zeros),
    so the same bits. Subclasses say where ``expert_weights(e)`` comes from.

    ``tap``: set before a call, ``tap(e, token_idx, x, act)`` sees each
    expert's rows and down-projection input as the call computes them (a
    calibration observer reads them instead of computing them again); it
    serves that one call and is cleared."""

    num_experts: int
    limit: float
    tap = None

    def expert_weights(self, e: int):  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, hidden_states, top_k_index, top_k_weights):
        import torch
        import torch.nn.functional as F

        tap, self.tap = self.tap, None
        out = torch.zeros_like(hidden_states)
        for e, pos, tok in rows_by_expert(top_k_index, self.num_experts):
            gate_up, down = self.expert_weights(e)  # once: a bounded cache's miss decodes all three
            x = hidden_states[tok]
            act = down_input(self, x, gate_up)
            if tap is not None:
                tap(e, tok, x, act)
            y = F.linear(act, down) * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


class EagerExperts(_ExpertsLoop):
    """Routed experts over stacked weights (``gate_up`` [E, 2I, H], ``down`` [E, H, I],
    transformers' layout), e.g. a perturbed copy of a layer's experts.

        ex = EagerExperts(gate_up, down, act_fn=src.act_fn, limit=src.limit)
    """

    def __init__(self, gate_up, down, act_fn, limit: float):
        super().__init__()
        if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0]:
            raise BadInputError(f"expert stacks must be [E, 2I, H] and [E, H, I], got {tuple(gate_up.shape)} "
                                f"and {tuple(down.shape)}", where="EagerExperts")
        self.gate_up, self.down = gate_up, down
        self.num_experts = int(gate_up.shape[0])
        self.act_fn, self.limit = act_fn, limit

    def expert_weights(self, e: int):
        return self.gate_up[e], self.down[e]


class SourceExperts(_ExpertsLoop):
    """A layer's routed experts, decoded from the source on first use (see
    ``_ExpertsLoop`` for the call); decoded experts are kept while the layer
    lives, within ``cache_bytes`` (None: all)."""

    def __init__(self, weights: SourceWeights, layer: int, *, cache_bytes: Optional[int] = None):
        super().__init__()
        from transformers.activations import ACT2FN

        cfg = weights.config
        self.weights = weights
        self.layer = layer
        self.num_experts = int(cfg.n_routed_experts)
        self.limit = cfg.swiglu_limit
        self.act_fn = ACT2FN[cfg.hidden_act]
        self.cache_bytes = cache_bytes
        self._cache: dict[int, tuple] = {}
        self._cached = 0
        self.decoded = 0  # experts decoded so far (a cache miss each)
        self.fp4 = weights.experts_fp4(layer)  # every decoded value exact in bfloat16

    def expert_weights(self, e: int):
        """(gate_up [2I,H], down [H,I]) float32 of expert ``e`` on this module's device.
        The tensors may be the cache's: clone before changing them."""
        import torch

        hit = self._cache.get(e)
        if hit is not None:
            return hit if hit[0].dtype == torch.float32 else (hit[0].float(), hit[1].float())
        dev = getattr(self, "device", None)
        gate_up, down = self.weights.expert_weights(self.layer, e, dev)
        if dev is not None:
            gate_up, down = gate_up.to(dev), down.to(dev)
        self.decoded += 1
        # On a GPU an FP4 layer's experts are kept as bfloat16, which holds every
        # FP4 x E8M0 value exactly (formats.fp8.dequant_e2m1_torch): twice the
        # experts in the same memory, widened back to the same float32 on use.
        # The host keeps float32: widening costs a CPU more than the cache saves.
        narrow = gate_up.device.type != "cpu" and self.fp4
        size = (2 if narrow else 4) * (gate_up.numel() + down.numel())
        # Once the budget is full nothing is evicted: every batch visits the experts
        # in ascending order, a cyclic scan that least-recently-used eviction would
        # turn into a miss on every call; keeping the first ones makes them hits.
        if self.cache_bytes is None or self._cached + size <= self.cache_bytes:
            self._cache[e] = (gate_up.bfloat16(), down.bfloat16()) if narrow else (gate_up, down)
            self._cached += size
        return gate_up, down

    def release(self) -> None:
        self._cache.clear()
        self._cached = 0


def expert_rows(experts, hidden, idx_t, e: int):
    """The rows routed to expert ``e`` and its down-projection input, exactly as the
    eager experts forward computes them, for a ``SourceExperts`` or an eager
    ``DeepseekV4Experts``.

    hidden: float32 [T, H]; idx_t: int64 [k, T] (top_k_index transposed). Returns
    (top_k_pos [n], token_idx [n], x = hidden[token_idx] [n, H], act [n, I]),
    act = ``down_input``.
    """
    import torch

    gate_up = experts.expert_weights(e)[0] if hasattr(experts, "expert_weights") else experts.gate_up_proj[e]
    pos, tok = torch.where(idx_t == e)
    x = hidden[tok]
    return pos, tok, x, down_input(experts, x, gate_up)


def down_input(experts, x, gate_up):
    """``silu(clamp(gate, max=limit)) * clamp(up, -limit, limit)`` of rows ``x``
    [n, H] through ``gate_up`` [2I, H], with the eager experts forward's ops."""
    import torch.nn.functional as F

    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return experts.act_fn(gate.clamp(max=experts.limit)) * up.clamp(min=-experts.limit, max=experts.limit)
