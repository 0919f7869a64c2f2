"""What ``runtime.load`` returns: one executor interface, wherever the experts run.

    with runtime.load("out/art", placement, mode="exact") as ex:
        model.model.layers[L].mlp.experts = ex.experts(L)     # transformers' experts call
        z = ex.moe(L, hidden, token_ids)                       # routing + routed + shared expert
        y = ex.run_layer(L, hidden, top_k_index, top_k_weights).out
        ex.resident_bytes(), ex.stats()

Two executors implement it: ``in_process.Runtime`` (owners in this process
and its worker children) and ``cluster.group.RankGroup`` (the ranks of a
rank placement, started once). A caller never chooses between them: the
placement does. Routing and the shared expert run on the home process from
the artifact's dense tensors (here, for both), so a cluster's ranks read
expert bytes only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

import numpy as np

from ds4quant import names
from ds4quant.errors import BadInputError
from ds4quant.runtime.mode import Mode

__all__ = ["Executor", "LayerOutput", "route_rows", "call_figures"]


class LayerOutput(Protocol):
    """A ``run_layer`` result: ``out`` float32 [T, H] torch, the canonical combine of
    every slot (plus the shared expert when given). The in-process executor's
    ``execute.LayerResult`` adds the per-slot outputs; a rank group's adds timings."""

    out: Any


class Executor(ABC):
    """A loaded artifact on a placement (see the module docstring).

    view: the home's artifact view (routing, shared expert, header); mode:
    ``Mode``; placement: the ``Placement`` it runs; n_ranks: the cluster
    ranks it runs on (0: this process). A context manager; ``close`` is
    idempotent."""

    view: Any
    mode: Mode
    placement: Any
    n_ranks: int = 0

    @property
    def header(self):
        return self.view.header

    # -- what each executor does its own way ----------------------------
    @abstractmethod
    def run_layer(self, layer: int, hidden, top_k_index, top_k_weights, shared=None) -> LayerOutput:
        """Routed experts of ``layer``: hidden f32 [T,H], top_k_index int64 [T,k],
        top_k_weights f32 [T,k] (torch); ``shared`` f32 [T,H] is added after the
        routed sum (one fp32 add)."""

    @abstractmethod
    def resident_bytes(self) -> dict[str, int]:
        """Expert (and decode-table) bytes per owner (a cluster: per rank and owner)."""

    @abstractmethod
    def stats(self) -> dict:
        """Call figures as plain JSON values (a cluster adds start-up and per-rank reads)."""

    @abstractmethod
    def close(self) -> None:
        """Free every owner (or stop every rank); idempotent."""

    # -- the same for every executor ------------------------------------
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def check_layer(self, layer: int) -> None:
        if not 0 <= int(layer) < self.header.n_layer:
            raise BadInputError(f"layer {layer} outside 0..{self.header.n_layer - 1}")

    def experts(self, layer: int):
        """torch.nn.Module with DeepseekV4Experts' call signature for ``layer``."""
        from ds4quant.runtime.experts import RuntimeExperts

        self.check_layer(layer)
        return RuntimeExperts(self, layer)

    def route(self, layer: int, hidden, token_ids):
        """(top_k_index int64 [T,k], top_k_weights f32 [T,k]) from the artifact's router.

        fast: one batched ``route`` call (bitwise transformers' router on the
        batch); exact: ``route_rows`` (each token alone: batch-invariant)."""
        import torch

        from ds4quant.runtime.route import route

        v, h = self.view, self.header
        w = torch.from_numpy(np.ascontiguousarray(v.dense(names.router_name(layer)), dtype=np.float32))
        hashed = layer < h.hash_layers
        bias = None if hashed else torch.from_numpy(np.ascontiguousarray(v.dense(names.router_bias_name(layer)),
                                                                          dtype=np.float32))
        tid = torch.from_numpy(np.asarray(v.dense(names.tid2eid_name(layer))).astype(np.int64)) if hashed else None
        if self.mode is Mode.FAST:
            return route(hidden, token_ids, w, bias, tid, h.n_expert_used, h.routed_scale)
        return route_rows(hidden, token_ids, w, bias, tid, h.n_expert_used, h.routed_scale)

    def shared(self, layer: int, hidden):
        """The shared expert on the home process (exact mode: the exact definition)."""
        import torch

        from ds4quant.runtime.owners import torch_exact
        from ds4quant.runtime.swiglu import swiglu_fast

        ws = [torch.from_numpy(np.ascontiguousarray(self.view.dense(names.shared_name(layer, p)), dtype=np.float32))
              for p in ("gate", "up", "down")]
        x = hidden.to(torch.float32)
        L = self.header.swiglu_limit
        if self.mode is Mode.EXACT:
            return torch_exact.expert_exact(ws[0], ws[1], ws[2], x, L)
        return swiglu_fast(x @ ws[0].T, x @ ws[1].T, L) @ ws[2].T

    def moe(self, layer: int, hidden, token_ids):
        """Routing + routed experts + shared expert: float32 [T,H]."""
        import torch

        hidden = hidden.to(torch.float32)
        idx, w = self.route(layer, hidden, token_ids)
        return self.run_layer(layer, hidden, idx, w, shared=self.shared(layer, hidden)).out


def call_figures(walls: list[float]) -> dict:
    """Count, total seconds, mean and median milliseconds of ``walls`` (seconds per call)."""
    return {"calls": len(walls), "call_ms_mean": 1e3 * float(np.mean(walls)) if walls else 0.0,
            "call_ms_median": 1e3 * float(np.median(walls)) if walls else 0.0, "calls_s": float(sum(walls))}


def route_rows(hidden, token_ids, w, bias, tid, top_k: int, routed_scale: float):
    """Exact mode's routing: each token routed alone, so its experts and weights
    never depend on the other tokens of its batch.

    torch's float32 matmul (and its vectorised elementwise loops, whose scalar
    tails fall on different elements for different batch shapes) can give a row
    other bits inside another batch. Here every row is ``route`` of a fresh,
    allocator-aligned [1, H] copy on one torch thread: the same call, shape,
    alignment and thread count whatever the batch, so the bytes are those of
    transformers' router given that token alone (fast mode keeps the batched
    call, bitwise equal to transformers' router on the whole batch).
    """
    import torch

    from ds4quant.runtime.reference import torch_threads
    from ds4quant.runtime.route import route

    T = int(hidden.shape[0]) if hidden.ndim == 2 else 0
    if hidden.ndim != 2 or T == 0:  # route's own checks and empty-batch result
        with torch_threads(1):
            return route(hidden, token_ids, w, bias, tid, top_k, routed_scale)
    ids = token_ids.reshape(-1) if isinstance(token_ids, torch.Tensor) else None
    if tid is not None and (ids is None or ids.numel() != T):
        with torch_threads(1):  # route raises its one-line error for the bad token ids
            return route(hidden, token_ids, w, bias, tid, top_k, routed_scale)
    idx, wts = [], []
    with torch_threads(1):
        for t in range(T):
            i, v = route(hidden[t:t + 1].clone(memory_format=torch.contiguous_format),
                         None if ids is None else ids[t:t + 1].clone(), w, bias, tid, top_k, routed_scale)
            idx.append(i)
            wts.append(v)
    return torch.cat(idx), torch.cat(wts)

