"""A deterministic, length-independent tie-break for the CSA indexer's top-k.

transformers' ``DeepseekV4Indexer`` picks each query's compressed entries with
``index_scores.topk(k)``. Its scores are sums of ReLUs, so equal (often zero)
scores are common, and ``topk`` chooses among equal values in an order that
depends on the tensor's length (and so on padding): the logits of a prefix
could then differ between one full-sequence pass and token-by-token decoding,
and a teacher-forced exact copy would not be the greedy one.

``stable_indexer(model)`` makes every indexer of ``model`` choose by (score
descending, entry index ascending): the entries it keeps are those ``topk``
keeps whenever the k-th and (k+1)-th scores differ (so untied runs are
bit-identical), and a tie always goes to the earlier entry. Entries after a
query's causal limit are -inf for that query, so its choice never depends on
how many tokens follow it. The context also counts the queries whose choice
was decided by such a tie (``TieCount.queries``).

    with stable_indexer(model) as ties:
        model(ids, use_cache=False)
    ties.queries   # queries where a tie at the k-th entry was broken by position
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator


@dataclass
class TieCount:
    queries: int = 0


def _stable_class(counter: TieCount):
    import torch

    class StableTopk(torch.Tensor):
        """Index scores whose ``topk`` breaks ties by position (see the module doc)."""

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.topk or func is torch.topk:
                return _topk(counter, *args, **kwargs)
            return super().__torch_function__(func, types, args, kwargs)

    return StableTopk


def _topk(counter: TieCount, x, k, dim=-1, largest=True, sorted=True):
    import torch

    with torch._C.DisableTorchFunctionSubclass():
        x = x.as_subclass(torch.Tensor)
        if not largest:  # not the indexer's call: torch's own smallest-k, untouched
            return torch.topk(x, k, dim=dim, largest=False, sorted=sorted)
        s = torch.sort(x, dim=dim, descending=True, stable=True)
        values, indices = s.values.narrow(dim, 0, k), s.indices.narrow(dim, 0, k)
        n = x.shape[dim]
        if 0 < k < n:
            kth, nxt = s.values.select(dim, k - 1), s.values.select(dim, k)
            counter.queries += int(((kth == nxt) & torch.isfinite(kth)).sum())
    return torch.return_types.topk((values, indices))


@contextlib.contextmanager
def stable_indexer(model) -> Iterator[TieCount]:
    """Inside the block every CSA indexer of ``model`` breaks top-k ties by position.

    A model that is no torch module (another engine's adapter) has no indexer
    of ours to patch: the block changes nothing and counts no ties."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Indexer

    counter = TieCount()
    cls = _stable_class(counter)
    handles = []
    for mod in (model.modules() if hasattr(model, "modules") else ()):
        if isinstance(mod, DeepseekV4Indexer):
            handles.append(mod.scorer.register_forward_hook(lambda m, a, out: out.as_subclass(cls)))
    try:
        yield counter
    finally:
        for h in handles:
            h.remove()
