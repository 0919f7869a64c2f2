"""Routing-profile capture: count routed slots while tokens run.

``RoutingRecorder`` counts, per layer and expert, the routed slots (token x
top-k slot) of every ``top_k_index`` it is given: the same counts ``ds4quant
calibrate`` derives from the experts' ``top_k_index`` (so hash layers count
like scored ones), written with the same writers (``ds4quant.routing``).
It can also keep the first ``keep_samples`` tokens' top-k rows per layer,
which ``plan_placement(token_topk=...)`` uses for an exact token-resident rate.

    rec = RoutingRecorder(n_layer=4, n_expert=16, top_k=4)
    rec.record(layer, top_k_index)            # torch or numpy int [T, k]
    write_routing_csv("routing.csv", rec.profile())

``hook_routers(model, rec)`` records a transformers DeepseekV4 model's router
outputs (forward hooks on every ``mlp.gate``) until the returned handle's
``remove()``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np

from ds4quant.errors import BadInputError, ShapeError
from ds4quant.routing import RoutingProfile

__all__ = ["RoutingRecorder", "hook_routers"]


def _as_numpy(idx: Any) -> np.ndarray:
    if hasattr(idx, "detach"):  # torch tensor, without importing torch here
        idx = idx.detach().cpu().numpy()
    return np.asarray(idx)


class RoutingRecorder:
    """Per-layer, per-expert routed-slot counts (uint64) and tokens per layer."""

    def __init__(self, n_layer: int, n_expert: int, top_k: int, keep_samples: int = 0):
        for nm, v in (("n_layer", n_layer), ("n_expert", n_expert), ("top_k", top_k)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise BadInputError(f"{nm} must be an int >= 1, got {v!r}")
        if top_k > n_expert:
            raise BadInputError(f"top_k {top_k} exceeds n_expert {n_expert}")
        if isinstance(keep_samples, bool) or not isinstance(keep_samples, int) or keep_samples < 0:
            raise BadInputError(f"keep_samples must be an int >= 0, got {keep_samples!r}")
        self.n_layer, self.n_expert, self.top_k, self.keep_samples = n_layer, n_expert, top_k, keep_samples
        self.counts = np.zeros((n_layer, n_expert), dtype=np.uint64)
        self.tokens = np.zeros(n_layer, dtype=np.int64)
        self._samples: list[list[np.ndarray]] = [[] for _ in range(n_layer)]
        self._kept = [0] * n_layer

    def record(self, layer: int, top_k_index: Any) -> None:
        """Count one batch of layer ``layer``: int [T, k] expert ids (T tokens)."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.n_layer:
            raise BadInputError(f"layer must be an int in 0..{self.n_layer - 1}, got {layer!r}")
        idx = _as_numpy(top_k_index)
        if idx.ndim != 2 or idx.shape[1] != self.top_k or idx.dtype.kind not in "iu":
            raise ShapeError(f"top_k_index must be int [T, {self.top_k}], got {idx.dtype} {idx.shape}",
                             where=f"layer {layer}")
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= self.n_expert):
            raise BadInputError(f"top_k_index holds ids outside 0..{self.n_expert - 1}", where=f"layer {layer}")
        self.counts[layer] += np.bincount(idx.reshape(-1).astype(np.int64), minlength=self.n_expert).astype(np.uint64)
        self.tokens[layer] += idx.shape[0]
        want = self.keep_samples - self._kept[layer]
        if want > 0 and idx.shape[0]:
            part = np.array(idx[:want], dtype=np.int64)
            self._samples[layer].append(part)
            self._kept[layer] += part.shape[0]

    def samples(self) -> np.ndarray:
        """int64 (n_layer, S, k): the first S kept tokens' top-k rows (S = the
        fewest any layer kept, so every layer has the same tokens)."""
        s = min(self._kept)
        return np.stack([np.concatenate(p)[:s] if p else np.zeros((0, self.top_k), np.int64)
                         for p in self._samples]).reshape(self.n_layer, s, self.top_k)

    def profile(self, source: Optional[Mapping[str, Any]] = None) -> RoutingProfile:
        """The counts as a RoutingProfile; tokens = tokens seen (every layer must
        have seen the same number)."""
        if len(set(int(t) for t in self.tokens)) != 1:
            raise BadInputError(f"layers saw different token counts {self.tokens.tolist()}; "
                                "record every layer of every batch")
        return RoutingProfile(self.n_layer, self.n_expert, self.top_k, self.counts.copy(),
                              tokens=int(self.tokens[0]), source=dict(source or {}))


class _Handles:
    def __init__(self, handles):
        self._handles = handles

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


def hook_routers(model, recorder: RoutingRecorder) -> _Handles:
    """Record every ``model.model.layers[L].mlp.gate`` output's top-k index
    (the routers return (logits, weights, indices)) into ``recorder``."""
    layers = model.model.layers
    if len(layers) != recorder.n_layer:
        raise ShapeError(f"model has {len(layers)} layers, the recorder {recorder.n_layer}")
    handles = []
    for i, layer in enumerate(layers):
        def hook(_mod, _args, out, i=i):
            recorder.record(i, out[2])

        handles.append(layer.mlp.gate.register_forward_hook(hook))
    return _Handles(handles)
