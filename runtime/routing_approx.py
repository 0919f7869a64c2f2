"""Runtimes' routing shortcuts, applied to a transformers DeepSeek-V4 model so
their fidelity can be priced: route top-K instead of the model's k, and drop
listed experts (never selected; the routing weights renormalised over the
experts that remain, as the model normalises its own top-k).

The learned router's definition (transformers ``DeepseekV4TopKRouter``):
scores = score_fn(x W^T); the k experts with the largest scores + correction
bias; weights = their scores / (sum + 1e-20) * routed_scaling_factor.
``approximate_routing`` runs exactly those operations in that order with K in
place of k and the dropped experts' selection scores at -inf, so K = k with
nothing dropped gives the model's bits. Hash-routed layers (a fixed token ->
experts table) keep their k experts: a dropped one gets weight 0 and the rest
are renormalised; K does not apply to them (``Approximation.hash_layers``
names them).

    drop = read_drop_file("drop.json")          # {"1": [3, 7], "2": [0]}
    with approximate_routing(model, experts_per_token=2, drop=drop):
        model(ids, use_cache=False)
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Iterator, Mapping, Optional

from ds4quant.errors import BadInputError


@dataclass(frozen=True)
class Approximation:
    """What was changed: K (None: the model's k), dropped experts per layer, and the
    hash-routed layers K did not apply to."""

    experts_per_token: Optional[int]
    drop: Mapping[int, tuple[int, ...]]
    hash_layers: tuple[int, ...] = ()

    def describe(self) -> str:
        parts = []
        if self.experts_per_token is not None:
            parts.append(f"top-{self.experts_per_token} routing")
        n = sum(len(v) for v in self.drop.values())
        if self.drop or n:
            parts.append(f"{n} experts dropped over {len([v for v in self.drop.values() if v])} layers")
        return ", ".join(parts) or "no change"


def read_drop_file(path: "str | Path") -> Mapping[int, tuple[int, ...]]:
    """A JSON object {layer: [expert, ...]} (an empty object drops nothing)."""
    p = Path(path)
    try:
        d = json.loads(p.read_text() or "{}")
    except (OSError, ValueError) as e:
        raise BadInputError(f"cannot read the dropped experts: {e}", where=str(p)) from None
    if not isinstance(d, dict):
        raise BadInputError('not a JSON object {"layer": [expert, ...]}', where=str(p))
    out = {}
    for k, v in d.items():
        try:
            layer = int(k)
        except ValueError:
            raise BadInputError(f"layer key {k!r} is not an integer", where=str(p)) from None
        if not isinstance(v, list) or not all(isinstance(e, int) and not isinstance(e, bool) for e in v):
            raise BadInputError(f"layer {k}: not a list of expert numbers", where=str(p))
        out[layer] = tuple(sorted(set(v)))
    return MappingProxyType(out)


def check(config, moe_layers: Mapping[int, bool], experts_per_token: Optional[int],
          drop: Mapping[int, tuple[int, ...]], where: str) -> Approximation:
    """Refuse K or dropped experts the model cannot take (naming ``where``).
    moe_layers: layer -> whether it is hash-routed."""
    n_exp = config.n_routed_experts
    k = config.num_experts_per_tok
    if experts_per_token is not None:
        if isinstance(experts_per_token, bool) or not isinstance(experts_per_token, int) \
                or not 1 <= experts_per_token <= n_exp:
            raise BadInputError(f"experts per token must be 1..{n_exp} (the model routes {k}), got "
                                f"{experts_per_token!r}", where="--experts-per-token")
    for layer, exps in drop.items():
        if layer not in moe_layers:
            raise BadInputError(f"layer {layer} has no MoE block (layers {sorted(moe_layers)})", where=where)
        bad = [e for e in exps if not 0 <= e < n_exp]
        if bad:
            raise BadInputError(f"layer {layer}: expert {bad[0]} outside 0..{n_exp - 1}", where=where)
        kk = k if experts_per_token is None else experts_per_token
        if not moe_layers[layer] and n_exp - len(exps) < kk:
            raise BadInputError(f"layer {layer}: {len(exps)} dropped leaves fewer than {kk} experts to route",
                                where=where)
    hashed = tuple(i for i, h in sorted(moe_layers.items()) if h)
    return Approximation(experts_per_token, MappingProxyType(dict(drop)), hashed if experts_per_token else ())


def moe_layers_of(config) -> dict[int, bool]:
    """layer -> hash-routed, from a transformers DeepseekV4Config (every layer has an MoE block)."""
    types = list(getattr(config, "mlp_layer_types", None) or ["moe"] * config.num_hidden_layers)
    return {i: t == "hash_moe" for i, t in enumerate(types)}


def _topk_forward(gate, k: int, dropped):
    import torch
    import torch.nn.functional as F

    def forward(hidden_states):
        flat = hidden_states.reshape(-1, gate.hidden_dim)
        logits = F.linear(flat, gate.weight)
        scores = gate.score_fn(logits)
        choice = scores + gate.e_score_correction_bias
        if dropped is not None:
            choice = choice.masked_fill(dropped, float("-inf"))
        indices = torch.topk(choice, k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, weights * gate.routed_scaling_factor, indices

    return forward


def _hash_forward(gate, dropped):
    import torch.nn.functional as F

    def forward(hidden_states, input_ids):
        flat = hidden_states.reshape(-1, gate.hidden_dim)
        logits = F.linear(flat, gate.weight)
        scores = gate.score_fn(logits)
        indices = gate.tid2eid[input_ids.reshape(-1)].long()
        weights = scores.gather(1, indices)
        if dropped is not None:
            weights = weights.masked_fill(dropped[indices], 0.0)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, weights * gate.routed_scaling_factor, indices

    return forward


@contextlib.contextmanager
def route_block(block, n_experts: int, experts_per_token: Optional[int] = None,
                dropped: tuple[int, ...] = ()) -> Iterator[None]:
    """One MoE block (``DeepseekV4SparseMoeBlock``) routes as the module doc says
    inside the block (checked by ``check`` beforehand)."""
    import torch

    gate = block.gate
    mask = None
    if dropped:
        mask = torch.zeros(n_experts, dtype=torch.bool, device=gate.weight.device)
        mask[list(dropped)] = True
    old = gate.__dict__.get("forward")
    gate.forward = _hash_forward(gate, mask) if block.is_hash else \
        _topk_forward(gate, experts_per_token or gate.top_k, mask)
    try:
        yield
    finally:
        if old is None:
            del gate.forward
        else:
            gate.forward = old


@contextlib.contextmanager
def approximate_routing(model, experts_per_token: Optional[int] = None,
                        drop: Mapping[int, tuple[int, ...]] = MappingProxyType({}),
                        where: str = "--drop-experts") -> Iterator[Approximation]:
    """Inside the block every MoE router of ``model`` routes as described in the module doc."""
    from ds4quant.runtime.reference import moe_blocks

    blocks = moe_blocks(model)
    approx = check(model.config, {i: b.is_hash for i, b in blocks}, experts_per_token, drop, where)
    with contextlib.ExitStack() as stack:
        for i, block in blocks:
            stack.enter_context(route_block(block, model.config.n_routed_experts, experts_per_token,
                                            tuple(drop.get(i, ()))))
        yield approx
