"""Routed-expert math for calibration: per-expert weights, seeded noise, a
perturbed experts module and local output errors.

The sensitivity pass perturbs expert weights with seeded Gaussian noise
(``rel_std`` x each expert matrix's RMS) and needs, per expert, the perturbed
weights in two places: inside the layer (a module called as the eager
``DeepseekV4Experts`` is, so the perturbed model's bits equal those of the
whole model with its parameters overwritten) and beside it (the expert's own
output error on the rows routed to it). Weights are fetched one expert at a
time (``expert_weights``), so a layer of 256 experts never needs a second
dense copy.

Noise is seeded by names: ``TensorNoise`` draws one ``numpy`` stream per
tensor in expert order (the measurement ``--sensitivity-method per-tensor``
has always made, so its file keeps its bytes), ``ExpertNoise`` one torch
stream per (tensor, expert), so any expert's noise can be drawn alone.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Optional

import numpy as np

# the eager experts' rows and down-projection input: one definition, the stream's
from ds4quant.runtime.stream.source import down_input, expert_rows  # noqa: F401  (expert_rows re-exported)

__all__ = ["SURFACES", "ExpertNoise", "PerturbedExperts", "TensorNoise", "expert_output", "expert_rows", "expert_weights",
           "pert_weights", "rms", "surface_rows"]

SURFACES = ("gate", "up", "down")


def expert_weights(experts, e: int):
    """(gate_up [2I, H], down [H, I]) float32 of expert ``e``: the stream's
    ``SourceExperts`` hands them out one expert at a time; transformers' eager
    ``DeepseekV4Experts`` holds them as stacked parameters."""
    get = getattr(experts, "expert_weights", None)
    if get is not None:
        return get(e)
    return experts.gate_up_proj[e], experts.down_proj[e]


def surface_rows(surface: str, inter: int) -> slice:
    """The rows of one surface in its stored matrix (gate and up share gate_up)."""
    return {"gate": slice(0, inter), "up": slice(inter, 2 * inter), "down": slice(None)}[surface]


def _seed(text: str) -> int:
    return int.from_bytes(hashlib.sha256(f"ds4quant/sensitivity/{text}".encode()).digest()[:8], "little")


class TensorNoise:
    """One standard-normal stream per tensor, drawn expert after expert
    (expert e's draws follow experts 0..e-1's, so ask in ascending order)."""

    def __init__(self) -> None:
        self._rng: dict[str, tuple[np.random.Generator, int]] = {}

    def standard(self, tensor: str, e: int, shape: tuple[int, int]) -> np.ndarray:
        rng, nxt = self._rng.get(tensor) or (np.random.default_rng(_seed(tensor)), 0)
        if e != nxt:
            raise RuntimeError(f"{tensor}: noise for expert {e} asked after expert {nxt - 1}")  # a bug
        out = rng.standard_normal(shape)
        self._rng[tensor] = (rng, e + 1)
        return out


class ExpertNoise:
    """One standard-normal stream per (tensor, expert), drawn by torch's CPU
    generator in float32 (about 6x numpy's float64 rate here: a DeepSeek-V4
    Flash layer needs 6.4 G draws) whatever device the layer runs on, so the
    noise is the same on every host."""

    def draw(self, tensor: str, e: int, shape: tuple[int, int]):
        """The float32 draws (a CPU tensor); any thread may draw any expert."""
        import torch

        g = torch.Generator().manual_seed(_seed(f"{tensor}/{e}") >> 1)  # manual_seed takes < 2^63
        return torch.randn(shape, generator=g, dtype=torch.float32)


def rms(w) -> float:
    """The RMS of one expert matrix: numpy's float64 mean of squares (the
    per-tensor file's bytes depend on this exact reduction)."""
    a = w.detach().cpu().double().numpy()
    return float(np.sqrt(np.mean(a * a)))


def pert_weights(gu, down, d: dict):
    """(gate_up, down) with ``d``'s surfaces' noise (float64 ndarrays, or float64
    tensors already on the weights' device) added: the float64 sum stored as
    float32, as writing it into the model's parameter does."""
    import torch

    def on(x, dev):
        return (torch.from_numpy(x) if isinstance(x, np.ndarray) else x).to(dev)

    inter = gu.shape[0] // 2
    if "gate" in d or "up" in d:
        gu = gu.detach().clone()
        for s in ("gate", "up"):
            if s in d:
                r = surface_rows(s, inter)
                gu[r] = (gu[r].double() + on(d[s], gu.device)).to(gu.dtype)
    if "down" in d:
        down = (down.detach().double() + on(d["down"], down.device)).to(down.dtype)
    return gu, down


class PerturbedExperts:
    """Builds ``torch.nn.Module`` experts whose chosen surfaces carry noise.

    ``deltas(layer, e)`` -> {surface: float64 ndarray delta}; the perturbed
    weight is ``(w.double() + delta).float()``, as writing the sum into the
    model's float32 parameter gives."""

    def __init__(self, base, deltas: Callable[[int], dict]):
        self.base = base
        self.deltas = deltas

    def weights(self, e: int):
        gu, down = expert_weights(self.base, e)
        return pert_weights(gu, down, self.deltas(e))

    def module(self):
        return _Experts(self)


def _make_module_class():
    import torch
    import torch.nn.functional as F

    class Experts(torch.nn.Module):
        """The eager DeepseekV4Experts forward, op for op, over ``PerturbedExperts.weights``."""

        def __init__(self, src: PerturbedExperts):
            super().__init__()
            self.src = src
            self.num_experts = src.base.num_experts
            self.limit = src.base.limit
            self.act_fn = src.base.act_fn

        def forward(self, hidden_states, top_k_index, top_k_weights):
            final = torch.zeros_like(hidden_states)
            with torch.no_grad():
                mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
                hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
            for expert_idx in hit:
                expert_idx = expert_idx[0]
                if expert_idx == self.num_experts:
                    continue
                gu, down = self.src.weights(int(expert_idx))
                top_k_pos, token_idx = torch.where(mask[expert_idx])
                gate, up = F.linear(hidden_states[token_idx], gu).chunk(2, dim=-1)
                current = self.act_fn(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)
                current = F.linear(current, down) * top_k_weights[token_idx, top_k_pos, None]
                final.index_add_(0, token_idx, current.to(final.dtype))
            return final

    return Experts


_CLASS: Optional[type] = None


def _Experts(src: PerturbedExperts):
    global _CLASS
    if _CLASS is None:
        _CLASS = _make_module_class()
    return _CLASS(src)


def expert_output(experts_like, gu, down, x, w_rows):
    """An expert's contribution on its rows: down(act(gate_up x)) * routing weight (float32)."""
    import torch.nn.functional as F

    return F.linear(down_input(experts_like, x, gu), down) * w_rows[:, None]


