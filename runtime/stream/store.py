"""Where the hidden states of a streamed run live between layers.

``RamStore`` keeps each batch's streams as a tensor; ``MemmapStore`` keeps them
in one float32 file per batch inside a work folder (memory-mapped: the OS
pages them in while the batch runs), for runs whose hidden states exceed the
memory budget (``memory.plan_memory`` decides). Both hand back a tensor on the
device asked for and take a layer's output in place of its input.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ds4quant.errors import BadInputError

__all__ = ["MemmapStore", "RamStore"]


class RamStore:
    """Hidden states as tensors in memory (on the device they were put from)."""

    kind = "ram"

    def __init__(self):
        self._data: dict[int, object] = {}

    def put(self, index: int, hidden) -> None:
        self._data[index] = hidden

    def get(self, index: int, device=None):
        t = self._data[index]
        return t if device is None else t.to(device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._data.values())

    def close(self) -> None:
        self._data.clear()


class MemmapStore:
    """Hidden states as float32 files ``hidden-<index>.f32`` in ``work_dir``
    (created if missing; the files are removed by ``close``)."""

    kind = "memmap"

    def __init__(self, work_dir: "str | os.PathLike[str]"):
        self.dir = Path(work_dir)
        if self.dir.exists() and not self.dir.is_dir():
            raise BadInputError("exists and is not a folder", where=str(self.dir))
        self.dir.mkdir(parents=True, exist_ok=True)
        self._shapes: dict[int, tuple[int, ...]] = {}

    def _path(self, index: int) -> Path:
        return self.dir / f"hidden-{index}.f32"

    def put(self, index: int, hidden) -> None:
        import torch

        arr = hidden.detach().to("cpu", torch.float32).contiguous().numpy()
        shape = tuple(arr.shape)
        if self._shapes.get(index) != shape:
            mm = np.lib.format.open_memmap(self._path(index), mode="w+", dtype=np.float32, shape=shape)
        else:
            mm = np.lib.format.open_memmap(self._path(index), mode="r+")
        mm[...] = arr
        mm.flush()
        del mm
        self._shapes[index] = shape

    def get(self, index: int, device=None):
        import torch

        mm = np.lib.format.open_memmap(self._path(index), mode="r")
        t = torch.from_numpy(np.array(mm))  # a private copy: the layer writes its output to the same file
        return t if device is None else t.to(device)

    def nbytes(self) -> int:
        return sum(4 * int(np.prod(s)) for s in self._shapes.values())

    def close(self) -> None:
        for i in list(self._shapes):
            self._path(i).unlink(missing_ok=True)
        self._shapes.clear()
