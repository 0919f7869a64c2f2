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
from typing import Any, Iterator, Sequence

from ds4quant.errors import BadInputError

__all__ = ["Stream", "open_stream"]


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


@dataclass(frozen=True)
class Stream:
    source: Path
    device: str
    plan: Any  # runtime.stream.MemoryPlan

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
                max_memory: "int | str | None" = None) -> Stream:
    """Check ``device`` and fit sequences of ``seq_lens`` tokens (batch 1 each)
    into ``max_memory`` (bytes or SIZE text; None: no bound) for ``source``."""
    from ds4quant.runtime.reference import check_dependencies
    from ds4quant.runtime.stream import SourceWeights, plan_memory

    check_dependencies(cfg.expert_dtype is not None or cfg.fp8_block is not None, needed_by="calibrate")
    name = _check_device(device)
    from ds4quant.calibrate.collect import statistics_bytes

    with SourceWeights(source) as weights:
        plan = plan_memory(weights, [(1, n) for n in seq_lens], max_memory, name,
                           reserved=statistics_bytes(weights.config))
    return Stream(Path(source), name, plan)


