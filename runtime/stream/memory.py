"""How a streamed run fits a memory budget.

Peak memory of a streamed run is, whatever the layer count: the process
itself (python, torch, transformers), the largest piece materialized at once
(a decoder layer's dense tensors with at least one decoded routed expert, or
the embedding, or the head), one batch's working set through a layer, and the
hidden states. ``plan_memory`` adds these up against ``max_memory``:

- a piece that cannot fit even with the hidden states on disk is refused up
  front (``BudgetError`` naming the layer and the bytes it needs);
- hidden states that do not fit beside the largest piece go to a memmap in the
  work folder (``store_kind`` "memmap"), else they stay in RAM;
- what is left bounds the decoded routed experts a layer keeps
  (``expert_cache``; None: no bound).

On a CUDA device a layer whose weights and working set exceed the GPU's free
memory runs on the CPU (``layer_devices``); a layer on the GPU has its working
set there, so the host budget counts only its weights in transit and one
batch's hidden states. A layer on the GPU keeps its decoded experts there (as
bfloat16 when they are FP4: exact), so their bound is what the GPU has left
beside the layer (``gpu_expert_cache``), and the host holds only the expert
in transit.

The working set is an estimate from the shapes (eager attention's score
matrices dominate: heads x S x (S + compressed entries) floats, a few
copies); ``benchmarks/scale.py`` measures the real peak against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ds4quant.errors import BudgetError
from ds4quant.sizes import parse_size

__all__ = ["MemoryPlan", "plan_memory", "PROCESS_BYTES", "working_bytes"]

# python + numpy + torch + transformers' DeepSeek-V4 modeling code, resident before
# any weight: measured 387 MiB on the CPU build (importing the modeling module alone
# costs 150 MiB); rounded up for the source's mapped pages and allocator slack.
PROCESS_BYTES = 512 << 20
_GIB = float(1 << 30)


def _gib(n: int) -> str:
    return f"{n / _GIB:.2f} GiB"


@dataclass(frozen=True)
class MemoryPlan:
    """Where a streamed run keeps what (bytes; see the module docstring)."""

    budget: Optional[int]
    device: str
    layer_bytes: tuple[int, ...]  # dense tensors + one decoded routed expert, per layer
    all_experts_bytes: tuple[int, ...]  # every routed expert of the layer decoded, per layer
    global_bytes: int  # the larger of embedding and head
    hidden_bytes: int  # every batch's streams
    batch_hidden_bytes: int  # the largest batch's streams
    working_bytes: int  # one batch through one layer (estimate)
    store_kind: str  # "ram" | "memmap"
    expert_cache: Optional[int]  # decoded routed experts a layer may keep; None: all
    layer_devices: tuple[str, ...]
    reserved_bytes: int = 0  # what the caller holds beside the stream (calibrate's statistics)
    gpu_expert_cache: Optional[int] = None  # decoded experts a layer on the GPU keeps there; None: all

    def expert_cache_for(self, device: Any) -> Optional[int]:
        """The expert cache bound of a layer run on ``device``."""
        return self.expert_cache if str(device) == "cpu" else self.gpu_expert_cache

    @property
    def _host_cache(self) -> int:
        if all(d != "cpu" for d in self.layer_devices) and self.layer_devices:
            return 0
        return self.expert_cache if self.expert_cache is not None else max(self.all_experts_bytes, default=0)

    @property
    def largest_layer(self) -> int:
        return max(range(len(self.layer_bytes)), key=lambda i: self.layer_bytes[i]) if self.layer_bytes else 0

    @property
    def peak_bytes(self) -> int:
        """Host bytes the plan expects at most."""
        hidden = self.hidden_bytes if self.store_kind == "ram" else 2 * self.batch_hidden_bytes
        piece = max(max(self.layer_bytes, default=0) + self._host_cache, self.global_bytes)
        # a layer on the GPU keeps its working set there
        work = self.working_bytes if any(d == "cpu" for d in self.layer_devices) else 0
        return PROCESS_BYTES + self.reserved_bytes + piece + work + hidden

    def make_store(self, work_dir=None):
        """The hidden-state store the plan chose (a memmap needs ``work_dir``)."""
        from ds4quant.runtime.stream.store import MemmapStore, RamStore

        if self.store_kind == "ram":
            return RamStore()
        if work_dir is None:
            raise BudgetError(f"the hidden states ({_gib(self.hidden_bytes)}) exceed --max-memory "
                              f"{_gib(self.budget or 0)} beside the largest layer and need a work folder",
                              where="--max-memory", hint="give a work folder for the memmap")
        return MemmapStore(work_dir)

    def to_json(self) -> dict:
        return {"budget": self.budget, "device": self.device, "layer_bytes": list(self.layer_bytes),
                "all_experts_bytes": list(self.all_experts_bytes), "global_bytes": self.global_bytes,
                "hidden_bytes": self.hidden_bytes, "working_bytes": self.working_bytes,
                "store": self.store_kind, "expert_cache": self.expert_cache, "peak_bytes": self.peak_bytes,
                "layer_devices": list(self.layer_devices), "reserved_bytes": self.reserved_bytes,
                "gpu_expert_cache": self.gpu_expert_cache}


def working_bytes(config, batch: int, seq: int) -> int:
    """Estimated bytes one [batch, seq] batch needs inside one decoder layer."""
    c = config
    heads, hd = int(c.num_attention_heads), int(c.head_dim)
    hc, h = int(c.hc_mult), int(c.hidden_size)
    ratios = [int(v) for v in (getattr(c, "compress_rates", None) or {}).values() if int(v) > 0]
    kv = seq + (seq // min(ratios) if ratios else 0)
    tokens = batch * seq
    scores = 3 * batch * heads * seq * kv * 4  # eager attention: scores, softmax, the matmul's copy
    index = 2 * batch * int(getattr(c, "index_n_heads", 0) or 0) * seq * (seq // min(ratios) if ratios else 0) * 4
    per_token = 4 * (4 * heads * hd + 8 * hc * h + 3 * int(c.num_experts_per_tok) * int(c.moe_intermediate_size)
                     + int(getattr(c, "q_lora_rank", 0) or 0) + 2 * int(getattr(c, "o_lora_rank", 0) or 0)
                     * int(getattr(c, "o_groups", 1) or 1))
    return scores + index + tokens * per_token


def _free_gpu(device: str) -> int:
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


def plan_memory(weights, batch_shapes: Sequence[tuple[int, int]], max_memory: Any = None, device: str = "cpu",
                *, gpu_free: Optional[int] = None, reserved: int = 0, gpu_reserved: int = 0) -> MemoryPlan:
    """Fit a run of ``batch_shapes`` ([(B, S)] per batch, e.g. ``[b.shape for b in
    sm.batches(...)]``) over ``weights`` into ``max_memory`` (bytes, a size text
    such as "6G", or None for no bound) on ``device``.

    Refuses (BudgetError) a layer, embedding or head that cannot fit even with
    the hidden states in a memmap, naming it and the bytes it needs.
    gpu_free: the free bytes of the CUDA device (default: asked of torch).
    reserved: host bytes the caller holds beside the stream for the whole run
    (calibrate's per-expert statistics), counted like the process's own;
    gpu_reserved: what it holds on the CUDA device (taken off its free bytes)."""
    from ds4quant.runtime.stream.model import parse_device

    device = parse_device(device)
    budget = None if max_memory is None else parse_size(max_memory, "--max-memory", positive=True)
    cfg = weights.config
    hc, h = int(cfg.hc_mult), int(cfg.hidden_size)
    shapes = [(int(b), int(s)) for b, s in batch_shapes]
    batch_hidden = [4 * b * s * hc * h for b, s in shapes]
    hidden_total, batch_max = sum(batch_hidden), max(batch_hidden, default=0)
    work = max((working_bytes(cfg, b, s) for b, s in shapes), default=0)
    one_expert = [int(weights.expert_bytes(L)) for L in range(weights.n_layers)]
    all_layer = [int(weights.layer_bytes(L)) for L in range(weights.n_layers)]
    n_exp = int(cfg.n_routed_experts)
    dense = [a - e * n_exp if e else a for a, e in zip(all_layer, one_expert)]
    layer_min = tuple(d + e for d, e in zip(dense, one_expert))
    all_experts = tuple(e * n_exp for e in one_expert)
    glob = max(int(weights.global_bytes("embed")), int(weights.global_bytes("head")))
    store, cache = "ram", None
    base = PROCESS_BYTES + int(reserved)
    devices = tuple(device for _ in layer_min)
    free = None
    if device.startswith("cuda"):
        free = (gpu_free if gpu_free is not None else _free_gpu(device)) - int(gpu_reserved)
        devices = tuple(device if need + work + 2 * batch_max <= free else "cpu" for need in layer_min)
    # a layer on the GPU has its working set there: the host holds its weights in transit and
    # one batch's hidden states, not the attention scores
    host_work = [work if d == "cpu" else 0 for d in devices]
    if budget is not None:
        for L, need in enumerate(layer_min):
            floor_l = base + host_work[L] + 2 * batch_max
            if floor_l + need > budget:
                raise BudgetError(f"layer {L} needs {_gib(floor_l + need)} ({_gib(need)} of weights with one decoded "
                                  f"expert, {_gib(host_work[L])} working set, {_gib(2 * batch_max)} of one batch's "
                                  f"hidden states, {_gib(base)} for the process and what it keeps), more than "
                                  f"--max-memory {_gib(budget)}", where="--max-memory")
        work_h = max(host_work, default=0)
        floor = base + work_h + 2 * batch_max
        if floor + glob > budget:
            raise BudgetError(f"the embedding/head needs {_gib(floor + glob)} ({_gib(glob)} of weights), more than "
                              f"--max-memory {_gib(budget)}", where="--max-memory")
        piece = max(max(layer_min, default=0), glob)
        if base + piece + work_h + hidden_total <= budget:
            left = budget - (base + work_h + hidden_total + max(layer_min, default=0))
        else:
            store = "memmap"
            left = budget - (floor + max(layer_min, default=0))
        # Decoding an expert briefly holds its three matrices twice (the values and the
        # gate/up concatenation), and the allocator keeps some slack: the cache stops
        # short of the budget by that much.
        left -= 2 * max(one_expert, default=0) + budget // 16
        need_all = max(all_experts, default=0)
        cache = None if left >= need_all else max(0, left)
    gpu_cache = None
    if free is not None:
        on_gpu = [L for L, d in enumerate(devices) if d != "cpu"]
        if on_gpu:
            # FP4 experts are kept as bfloat16 there (half their float32 bytes); the
            # same slack as the host's for the decode's temporaries and the allocator.
            narrow = all(weights.experts_fp4(L) for L in on_gpu)
            need_all = max(all_experts[L] for L in on_gpu) // (2 if narrow else 1)
            left = free - (max(layer_min[L] for L in on_gpu) + work + 2 * batch_max)
            left -= 3 * max(one_expert, default=0) + free // 16
            gpu_cache = None if left >= need_all else max(0, left)
    return MemoryPlan(budget, device, layer_min, all_experts, glob, hidden_total, batch_max, work, store, cache,
                      devices, int(reserved), gpu_cache)
