"""The model calibrate runs through: the layer-streamed reference on a device.

``open_stream`` checks the device, fits the run into the memory budget
(``runtime.stream.plan_memory``: a layer that cannot fit is refused up front,
naming it and the bytes it needs) and returns a handle whose ``open()`` gives
the ``StreamedModel`` over the source's weights (dequantized by our own
code), with torch pinned to one intra-op thread: the reference's bits depend
on the thread count, and calibrate's own sums and perturbations run between
the model's calls.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from ds4quant.errors import BadInputError

__all__ = ["GPU_BATCHES", "Stream", "open_stream", "pick_batch"]


def _check_device(text: str) -> str:
    """The canonical device name; a CUDA device this host lacks is refused, naming what it has."""
    from ds4quant.runtime.stream.model import parse_device

    name = parse_device(text)
    if name == "cpu":
        return name
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(name.split(":")[1]) if ":" in name else 0
    if index >= n:
        raise BadInputError(f"{text} is not available (this host has {n} CUDA device(s))", where="--device")
    return f"cuda:{index}"


#: the batches ``open_stream`` tries on a GPU when none is given, largest first
GPU_BATCHES = (8, 4, 2, 1)


@dataclass(frozen=True)
class Stream:
    source: Path
    device: str
    plan: Any  # runtime.stream.MemoryPlan
    batch: int = 1  # sequences the main pass runs together (``walk.batch_groups``)

    def layer_device(self, layer: int) -> str:
        """Where layer ``layer`` runs (the CPU when a GPU is too small for it)."""
        return str(self.plan.layer_devices[layer])

    @contextlib.contextmanager
    def open(self) -> Iterator:
        from ds4quant.runtime.reference import torch_threads
        from ds4quant.runtime.stream import SourceWeights, StreamedModel

        with torch_threads(1), SourceWeights(self.source) as weights:
            sm = StreamedModel(weights, device=self.device, threads=1)
            try:
                yield sm
            finally:
                sm.close()


def open_stream(source: Path, cfg, seq_lens: Sequence[int], device: str = "cpu",
                max_memory: "int | str | None" = None, *, batch: Optional[int] = None, split: int = 0,
                sensitivity=None) -> Stream:
    """Check ``device`` and fit sequences of ``seq_lens`` tokens into
    ``max_memory`` (bytes or SIZE text; None: no bound) for ``source``, in
    batches of ``batch`` that keep the first ``split`` (the sensitivity
    sequences) apart (``walk.batch_groups``), with calibrate's statistics and,
    given ``sensitivity`` (its method), the sensitivity pass's memory over the
    first ``split`` sequences reserved. batch None: 1 on the CPU (the whole
    model's bits); on a GPU the largest of ``GPU_BATCHES`` that keeps every
    layer and its decoded experts where batch 1 keeps them."""
    from ds4quant.runtime.reference import check_dependencies
    from ds4quant.runtime.stream import SourceWeights, plan_memory

    check_dependencies(cfg.expert_dtype is not None or cfg.fp8_block is not None, needed_by="calibrate")
    name = _check_device(device)
    if batch is not None and (not isinstance(batch, int) or isinstance(batch, bool) or batch < 1):
        raise BadInputError(f"the batch size must be an int >= 1, got {batch!r}", where="--batch-size")
    from ds4quant.calibrate.collect import statistics_bytes
    from ds4quant.calibrate.sensitivity import sensitivity_bytes
    from ds4quant.calibrate.walk import batch_groups

    def plan_for(b: int):
        shapes = [(len(g), seq_lens[g[0]]) for g in batch_groups(seq_lens, split, b)]
        host, dev = (0, 0) if sensitivity is None else sensitivity_bytes(weights.config, seq_lens[:split],
                                                                          sensitivity, name)
        return plan_memory(weights, shapes, max_memory, name, reserved=statistics_bytes(weights.config) + host,
                           gpu_reserved=dev)

    with SourceWeights(source) as weights:
        if batch is not None or name == "cpu":
            b = batch or 1
            return Stream(Path(source), name, plan_for(b), b)
        b, plan = pick_batch(plan_for)
        return Stream(Path(source), name, plan, b)


def pick_batch(plan_for, batches: Sequence[int] = GPU_BATCHES) -> tuple:
    """(batch, plan): the largest of ``batches`` whose plan (``plan_for(b)``,
    a ``MemoryPlan``) fits the budget and keeps every layer and its decoded
    experts where batch 1 keeps them (a batch that pushes a layer to the CPU
    or evicts decoded experts costs more than it saves); else 1."""
    from ds4quant.errors import BudgetError

    one = plan_for(1)
    for b in sorted(set(batches), reverse=True):
        if b <= 1:
            break
        try:
            plan = plan_for(b)
        except BudgetError:
            continue
        if plan.layer_devices == one.layer_devices and plan.gpu_expert_cache == one.gpu_expert_cache:
            return b, plan
    return 1, one
