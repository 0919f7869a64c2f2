"""DS4 routing: which experts each token's slots go to, and their weights.

Mirrors transformers' ``DeepseekV4TopKRouter`` and ``DeepseekV4HashRouter``
(modeling_deepseek_v4.py, transformers 5.24) op for op, so on CPU the outputs
are bitwise equal to theirs (tests/runtime/test_route.py builds both routers):

    logits  = F.linear(hidden, gate_weight)              # [T, E] fp32
    scores  = score_fn(logits)                           # sqrtsoftplus: sqrt(softplus(x))
    topk:     index = topk(scores + bias, k, sorted=False).indices   # bias selects only
    hash:     index = tid2eid[token_ids]                 # experts fixed by the token id
    weights = scores.gather(1, index)
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * routed_scale

The slot order of ``index`` (torch.topk with sorted=False) is the top-k slot
order the canonical combine uses; it is whatever torch returns, the same as
the reference. torch is imported lazily.
"""

from __future__ import annotations

from typing import Any

from ds4quant.errors import BadInputError, ShapeError

__all__ = ["route", "SCORING"]

SCORING = ("sqrtsoftplus", "sigmoid")


def _score(name: str, logits):
    import torch.nn.functional as F

    if name == "sqrtsoftplus":
        return F.softplus(logits).sqrt()  # transformers SqrtSoftplusActivation
    return logits.sigmoid()  # nn.Sigmoid


def route(hidden, token_ids, gate_weight, bias=None, tid2eid=None, top_k: int = 6, routed_scale: float = 1.5,
          scoring: str = "sqrtsoftplus") -> tuple[Any, Any]:
    """Route tokens of one MoE layer.

    hidden: float32 torch [T, H]; token_ids: int64 [T] (needed for hash
    layers; may be None otherwise); gate_weight: float32 [E, H]; bias: float32
    [E] selection bias (``e_score_correction_bias``) or None; tid2eid: int
    [vocab, k] for a hash-routed layer, else None. Returns (top_k_index int64
    [T, k], top_k_weights float32 [T, k]).

        idx, w = route(h, ids, gate.weight, gate.e_score_correction_bias, None, 4, 1.5)
    """
    import torch

    if scoring not in SCORING:
        raise BadInputError(f"scoring must be one of {list(SCORING)}, got {scoring!r}", where="route")
    for nm, t in (("hidden", hidden), ("gate_weight", gate_weight)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.ndim != 2:
            raise ShapeError(f"{nm} must be a float32 torch tensor [*, H], got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}", where="route")
    T, H = hidden.shape
    E = gate_weight.shape[0]
    if gate_weight.shape[1] != H:
        raise ShapeError(f"gate_weight is {tuple(gate_weight.shape)}, hidden has H={H}", where="route")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise BadInputError(f"top_k must be an int in 1..{E}, got {top_k!r}", where="route")
    if isinstance(routed_scale, bool) or not isinstance(routed_scale, (int, float)):
        raise BadInputError(f"routed_scale must be a number, got {routed_scale!r}", where="route")
    if bias is not None and tid2eid is None and (
            not isinstance(bias, torch.Tensor) or bias.dtype != torch.float32 or tuple(bias.shape) != (E,)):
        raise ShapeError(f"bias must be float32 [{E}], got {getattr(bias, 'dtype', type(bias).__name__)} "
                         f"{tuple(getattr(bias, 'shape', ()))}", where="route")
    with torch.no_grad():  # routing is inference only; the ops (and bits) are the reference's
        logits = torch.nn.functional.linear(hidden, gate_weight)
        scores = _score(scoring, logits)
        if tid2eid is None:
            sel = scores + bias if bias is not None else scores
            index = torch.topk(sel, top_k, dim=-1, sorted=False).indices
        else:
            index = _hash_index(tid2eid, token_ids, T, E, top_k)
        weights = scores.gather(1, index)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return index, weights * routed_scale


def _hash_index(tid2eid, token_ids, T: int, E: int, top_k: int):
    import torch

    if not isinstance(tid2eid, torch.Tensor) or tid2eid.ndim != 2 or tid2eid.shape[1] != top_k \
            or tid2eid.dtype.is_floating_point or tid2eid.dtype == torch.bool:
        raise ShapeError(f"tid2eid must be an integer tensor [vocab, {top_k}], got "
                         f"{getattr(tid2eid, 'dtype', type(tid2eid).__name__)} {tuple(getattr(tid2eid, 'shape', ()))}",
                         where="route")
    if not isinstance(token_ids, torch.Tensor) or token_ids.dtype != torch.int64 or token_ids.numel() != T:
        raise ShapeError(f"token_ids must be int64 with {T} entries for a hash-routed layer", where="route")
    ids = token_ids.reshape(-1)
    vocab = tid2eid.shape[0]
    if T and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise BadInputError(f"token ids must be in 0..{vocab - 1}, got {int(ids.min())}..{int(ids.max())}",
                            where="route")
    index = tid2eid[ids].long()
    if T and (int(index.min()) < 0 or int(index.max()) >= E):
        raise BadInputError(f"tid2eid names experts outside 0..{E - 1}", where="route")
    return index


def route_like(router, hidden, token_ids=None) -> tuple[Any, Any]:
    """``route`` with the parameters of a transformers DeepseekV4 router module
    (TopK or Hash); for tests and the reference swap."""
    tid = getattr(router, "tid2eid", None)
    bias = None if tid is not None else router.e_score_correction_bias
    name = type(router.score_fn).__name__
    scoring = "sqrtsoftplus" if "Sqrt" in name else "sigmoid"
    return route(hidden.reshape(-1, router.hidden_dim), token_ids, router.weight, bias, tid, router.top_k,
                 router.routed_scaling_factor, scoring)
