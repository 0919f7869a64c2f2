"""A drop-in for transformers' ``DeepseekV4Experts`` backed by the runtime.

    model.model.layers[L].mlp.experts = rt.experts(L)

The call is the one the sparse-MoE block makes (docs/reference-model.md#experts):
``experts(hidden[T,H], top_k_index[T,k] int64, top_k_weights[T,k])``
with flattened tokens and weights that already include the top-k
renormalisation x routed scale; it returns the weighted routed sum [T,H]
(the block adds the shared expert itself).
"""

from __future__ import annotations


def _module_base():
    import torch

    return torch.nn.Module


class RuntimeExperts(_module_base()):
    """Routed experts of one layer of a loaded ``Executor``, in process or on cluster ranks (no
    parameters of its own)."""

    def __init__(self, runtime, layer: int):
        super().__init__()
        self._runtime = runtime
        self.layer = int(layer)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        import torch

        res = self._runtime.run_layer(self.layer, hidden_states.to(torch.float32), top_k_index,
                                      top_k_weights.to(torch.float32))
        return res.out.to(device=hidden_states.device, dtype=hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, mode={self._runtime.mode}"
