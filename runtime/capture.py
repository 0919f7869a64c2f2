"""Routing-profile capture: count routed slots while tokens run.

``RoutingRecorder`` counts, per layer and expert, the routed slots (token x
top-k slot) of every ``top_k_index`` it is given: the same counts ``ds4quant
calibrate`` derives from the experts' ``top_k_index`` (so hash layers count
like scored ones), written with the same writers (``ds4quant.calib.routing``).
It can also keep the first ``keep_samples`` tokens' top-k rows per layer,
which ``plan_placement(token_topk=...)`` uses for an exact token-resident rate.

    rec = RoutingRecorder(n_layer=4, n_expert=16, top_k=4)
    rec.record(layer, top_k_index)            # torch or numpy int [T, k]
    write_routing_csv("routing.csv", rec.profile())

``hook_routers(model, rec)`` records a transformers DeepseekV4 model's router
outputs (forward hooks on every ``mlp.gate``) until the returned handle's
``remove()``.

Capture through the runtime: ``profile_through_runtime(model, rt, seqs)``
runs each sequence (batch 1, one torch thread: calibrate's protocol) through
the model with every MoE block calling ``rt.moe`` (the artifact's router,
routed experts and shared expert), counts the routing ``rt.moe`` chose, and
``write_profile(out_dir, profile)`` writes the files ``ds4quant calibrate``
writes (routing.csv, the Lucebox hotness table, and routing.json)::

    with runtime.load("art", mode="exact") as rt:
        prof = profile_through_runtime(model, rt, seqs)          # follow="model"
    write_profile("calib-rt", prof)

``follow="model"`` keeps the model's own block output flowing to the next
layer (every layer routes the reference's activations: the profile is the
runtime's routing of calibrate's inputs, comparable count for count);
``follow="runtime"`` lets ``rt.moe``'s output flow (the artifact's MoE layers
drive the later layers' inputs, so a lossy artifact may route differently).
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

import numpy as np

from ds4quant.errors import BadInputError, ShapeError
from ds4quant.calib.routing import RoutingProfile, write_routing_csv, write_routing_json

__all__ = ["RoutingRecorder", "hook_routers", "through_runtime", "profile_through_runtime", "write_profile",
           "ROUTING_CSV", "ROUTING_JSON"]

#: calibrate's routing file names (ds4quant.calibrate.ROUTING_CSV / ROUTING_JSON; a test checks they agree)
ROUTING_CSV = "routing.csv"
ROUTING_JSON = "routing.json"
FOLLOW = ("model", "runtime")


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


# --------------------------------------------------------------------------
# capture through the runtime


@contextlib.contextmanager
def through_runtime(model, rt, follow: str = "model") -> Iterator[None]:
    """Inside the block, every MoE block of ``model`` (transformers
    DeepseekV4) calls ``rt.moe(layer, hidden, input_ids)``; its output or the
    block's own continues (``follow``, see the module docstring)."""
    from ds4quant.runtime.reference import moe_blocks

    if follow not in FOLLOW:
        raise BadInputError(f"follow must be one of {list(FOLLOW)}, got {follow!r}")
    blocks = moe_blocks(model)
    if len(model.model.layers) != rt.header.n_layer or len(blocks) != rt.header.n_layer:
        raise ShapeError(f"model has {len(model.model.layers)} layers ({len(blocks)} MoE blocks), the artifact "
                         f"{rt.header.n_layer}")

    def make(layer: int, block):
        orig = block.forward

        def forward(hidden_states, input_ids=None):
            shape = hidden_states.shape
            flat = hidden_states.reshape(-1, shape[-1])
            tok = None if input_ids is None else input_ids.reshape(-1)
            z = rt.moe(layer, flat, tok)
            if follow == "model":
                return orig(hidden_states, input_ids=input_ids)
            return z.to(hidden_states.dtype).reshape(shape)

        return forward

    for i, block in blocks:
        block.forward = make(i, block)  # an instance attribute shadows the class's forward
    try:
        yield
    finally:
        for _, block in blocks:
            block.__dict__.pop("forward", None)


def _tokens_sha256(seqs: Sequence[Sequence[int]]) -> str:
    # calibrate's definition: one line per sequence, ids joined by single spaces
    h = hashlib.sha256()
    for s in seqs:
        h.update((" ".join(str(int(t)) for t in s) + "\n").encode("ascii"))
    return h.hexdigest()


def profile_through_runtime(model, rt, seqs: Sequence[Sequence[int]], follow: str = "model",
                            source: Optional[Mapping[str, Any]] = None) -> RoutingProfile:
    """Run each token sequence through ``model`` with its MoE blocks on ``rt``
    (``through_runtime``), one sequence at a time on one torch thread as
    calibrate does, and return the routing ``rt.moe`` chose as a profile."""
    import torch

    from ds4quant.runtime.reference import torch_threads

    h = rt.header
    if not seqs or any(len(s) == 0 for s in seqs):
        raise BadInputError("profile_through_runtime needs non-empty token sequences")
    rec = RoutingRecorder(int(h.n_layer), int(h.n_expert), int(h.n_expert_used))
    old = rt.recorder
    rt.recorder = rec
    try:
        with torch_threads(1), torch.no_grad(), through_runtime(model, rt, follow):
            for ids in seqs:
                model(input_ids=torch.tensor([[int(t) for t in ids]], dtype=torch.long), use_cache=False)
    finally:
        rt.recorder = old
    info = {"artifact": Path(getattr(rt.view, "folder", "") or "").name, "mode": rt.mode, "follow": follow,
            "tokens_sha256": _tokens_sha256(seqs), "sequences": len(seqs),
            "reference": "ds4quant runtime rt.moe, transformers DeepseekV4ForCausalLM fp32 eager, batch 1"}
    return rec.profile(source={**info, **dict(source or {})})


def write_profile(out_dir: "str | Path", profile: RoutingProfile) -> dict[str, Path]:
    """routing.csv and routing.json into ``out_dir`` (an existing folder), as calibrate writes them."""
    out = Path(out_dir)
    if not out.is_dir():
        raise BadInputError("is not a folder", where=str(out))
    return {"routing_csv": write_routing_csv(out / ROUTING_CSV, profile),
            "routing_json": write_routing_json(out / ROUTING_JSON, profile)}
