"""The model calibrate runs through: the layer-streamed reference on a device.

``open_stream`` checks the device and the memory budget before any work and
returns a handle whose ``open()`` gives the streamed model with torch pinned
to one intra-op thread (the reference's bits depend on the thread count).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from ds4quant.errors import BadInputError

__all__ = ["Stream", "open_stream", "parse_device"]

_DEVICE = re.compile(r"cpu|cuda(?::(\d+))?")


def parse_device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N`` -> the canonical name (``cuda`` is ``cuda:0``);
    a CUDA device this host lacks is refused, naming what it has."""
    m = _DEVICE.fullmatch(str(text).strip())
    if m is None:
        raise BadInputError(f"must be cpu, cuda or cuda:N, got {text!r}", where="--device")
    if text == "cpu":
        return "cpu"
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(m.group(1) or 0)
    if index >= n:
        raise BadInputError(f"{text} is not available (this host has {n} CUDA device(s))", where="--device")
    return f"cuda:{index}"


@dataclass(frozen=True)
class Stream:
    source: Path
    device_name: str
    max_memory: Optional[int]

    @property
    def device(self) -> str:
        return self.device_name

    @contextlib.contextmanager
    def open(self) -> Iterator:
        from ds4quant.calibrate._model_stream import ModelStream
        from ds4quant.runtime.reference import torch_threads

        with torch_threads(1):
            yield ModelStream(self.source, device=self.device_name, threads=1)


def open_stream(source: Path, cfg, device: str = "cpu", max_memory=None) -> Stream:
    """Check ``device`` and ``max_memory`` (bytes, or SIZE text) for ``source``."""
    from ds4quant.runtime.reference import check_dependencies
    from ds4quant.sizes import parse_size

    check_dependencies(cfg.expert_dtype is not None or cfg.fp8_block is not None, needed_by="calibrate")
    name = parse_device(device)
    budget = None if max_memory is None else parse_size(max_memory, "--max-memory", positive=True)
    return Stream(Path(source), name, budget)
