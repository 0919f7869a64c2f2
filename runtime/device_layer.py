"""One DS4 MoE layer in fast mode entirely on a CUDA/HIP owner's device:
routing (top-k scoring or the hash layers' token table), the routed experts
through the owner's kernels, the canonical combine and the shared expert, with
no host work and no read-back per call, so a decode step of ``T`` tokens can be
captured as one CUDA graph (``DeviceLayer.graph``).

The routing is ``route.route``'s op sequence on the device (the same torch
ops, so on one device the same bits as ``route`` there), without its host-side
checks: the token ids and the hash table are checked once at construction
(every table entry names an expert this owner holds); a token id outside the
table is the caller's error (the embedding lookup before the layer already
failed on it). The routed experts take the decode-step kernels
(``gemv_triton``) when the slots fit ``gemv_max_slots`` and the layer has the
word layout, else the tensor-core prefill (``prefill_triton``); the owner must
hold every expert of the layer (a placement with the whole layer on one GPU).
The combine is the canonical order (``execute.combine``: the slot products and
sums in top-k order, each rounded once: separate torch ops never fuse), then
the shared expert (fast mode's ``swiglu_fast`` over float32 matmuls, as the
home process computes it) is added last.

    dl = DeviceLayer(owner, layer, gate_w, bias, None, top_k=6, routed_scale=1.5,
                     shared=(wg, wu, wd), limit=10.0)
    out = dl(hidden, token_ids)            # float32 [T, H] on the device
    g, fn = dl.graph(hidden_buf, ids_buf)  # replay: g.replay(); fn() reads the output
"""

from __future__ import annotations

from typing import Optional

from ds4quant.errors import BadInputError, ShapeError
from ds4quant.runtime.route import SCORING, _score


class DeviceLayer:
    """See the module docstring."""

    def __init__(self, owner, layer: int, gate_weight, bias=None, tid2eid=None, *, top_k: int = 6,
                 routed_scale: float = 1.5, scoring: str = "sqrtsoftplus", shared: Optional[tuple] = None,
                 limit: float = 10.0):
        import torch

        if scoring not in SCORING:
            raise BadInputError(f"scoring must be one of {list(SCORING)}, got {scoring!r}", where="device layer")
        dev = owner.device
        self.owner, self.layer, self.top_k = owner, int(layer), int(top_k)
        self.routed_scale, self.scoring, self.limit = float(routed_scale), scoring, float(limit)
        self.gate_weight = gate_weight.to(device=dev, dtype=torch.float32).contiguous()
        E, H = self.gate_weight.shape
        self.bias = None if bias is None or tid2eid is not None else bias.to(device=dev, dtype=torch.float32)
        self.tid2eid = None
        if tid2eid is not None:
            t = torch.as_tensor(tid2eid).to(torch.int64)
            if t.ndim != 2 or t.shape[1] != self.top_k:
                raise ShapeError(f"tid2eid must be [vocab, {self.top_k}], got {tuple(t.shape)}", where="device layer")
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= E):
                raise BadInputError(f"tid2eid names experts outside 0..{E - 1}", where="device layer")
            self.tid2eid = t.to(dev)
        held = owner.single_stacks(self.layer)
        if held is None or held[4].shape[0] < E or (held[4][:E] < 0).any():
            raise BadInputError(f"layer {layer}: the device layer needs all {E} experts on {owner.identity} "
                                "in one stack a projection", where="device layer")
        self.shared = None
        if shared is not None:
            self.shared = tuple(w.to(device=dev, dtype=torch.float32).contiguous() for w in shared)
        self.hidden = H

    def route(self, hidden, token_ids):
        """(index int64 [T, k], weights float32 [T, k]): ``route.route``'s ops, on the device."""
        import torch

        logits = torch.nn.functional.linear(hidden, self.gate_weight)
        scores = _score(self.scoring, logits)
        if self.tid2eid is None:
            sel = scores + self.bias if self.bias is not None else scores
            index = torch.topk(sel, self.top_k, dim=-1, sorted=False).indices
        else:
            index = self.tid2eid.index_select(0, token_ids.reshape(-1))
        weights = scores.gather(1, index)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return index, weights * self.routed_scale

    def routed(self, hidden, index):
        """float32 [T, k, H]: every slot's expert output (slot s = token s // k, its s % k-th expert)."""
        o = self.owner
        T, H = hidden.shape
        n = T * self.top_k
        ids = index.reshape(-1)
        x = hidden.repeat_interleave(self.top_k, dim=0)
        if 0 < n <= o.gemv_max_slots and o.gemv_set(self.layer) is not None:
            y = o.gemv_device(self.layer, x.view(n, H // 16, 16).transpose(1, 2).contiguous(), ids)
        else:
            y = o.prefill_device(self.layer, x, ids)
            if y is None:
                raise BadInputError(f"layer {self.layer}: a stack has no exact bf16 form for the prefill kernels",
                                    where="device layer")
        return y.view(T, self.top_k, H)

    def __call__(self, hidden, token_ids=None):
        """float32 [T, H] on the device: routed experts combined canonically, plus the shared expert."""
        import torch

        from ds4quant.runtime.swiglu import swiglu_fast

        hidden = hidden.to(torch.float32)
        if hidden.ndim != 2 or hidden.shape[1] != self.hidden:
            raise ShapeError(f"hidden must be [T, {self.hidden}], got {tuple(hidden.shape)}", where="device layer")
        if self.tid2eid is not None and (token_ids is None or token_ids.numel() != hidden.shape[0]):
            raise ShapeError(f"a hash-routed layer needs {hidden.shape[0]} token ids", where="device layer")
        index, w = self.route(hidden, token_ids)
        y = self.routed(hidden, index)
        acc = w[:, 0:1] * y[:, 0]
        for j in range(1, self.top_k):  # the canonical order, one rounding an op
            acc = acc + w[:, j:j + 1] * y[:, j]
        if self.shared is not None:
            wg, wu, wd = self.shared
            acc = acc + swiglu_fast(hidden @ wg.T, hidden @ wu.T, self.limit) @ wd.T
        return acc

    def graph(self, hidden, token_ids=None):
        """(CUDA graph, output tensor) of one call on the static buffers ``hidden`` / ``token_ids``:
        copy new inputs into them, ``graph.replay()``, read the output."""
        import torch

        side = torch.cuda.Stream(self.owner.device)
        side.wait_stream(torch.cuda.current_stream(self.owner.device))
        with torch.cuda.stream(side):  # compiles the kernels outside the capture
            self(hidden, token_ids)
        torch.cuda.current_stream(self.owner.device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            out = self(hidden, token_ids)
        return g, out

