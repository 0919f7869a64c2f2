"""Which tier runs a search, and on which device: one ``Backend`` passed down.

A search has three tiers that give the same bytes (each tier's module says
why): numba kernels on the host, torch operations on a torch device, and one
Triton launch per search. The caller picks a ``Backend`` once (the measure
stage from ``--device``; a test or benchmark by hand) and hands it to every
call of ``formats.search``; nothing else chooses a tier::

    NUMBA                                    the host's numba kernels (the default)
    Backend(Tier.TORCH, DeviceKind.CPU)      torch operations on torch's CPU device
    Backend.for_device("cuda", 0)            Triton on CUDA where it imports, torch otherwise
    Backend(Tier.TRITON, DeviceKind.CPU)     the Triton kernels under Triton's interpreter (tests)

Also here: the copies between the host and a backend's device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum
from typing import Optional

import numpy as np

from ds4quant.errors import BadInputError
from ds4quant.formats.search.tables import HALF


class Tier(str, Enum):
    NUMBA = "numba"
    TORCH = "torch"
    TRITON = "triton"


class DeviceKind(str, Enum):
    CPU = "cpu"
    CUDA = "cuda"


@dataclass(frozen=True)
class Backend:
    """tier: which implementation runs; device / index: the torch device of
    the torch and Triton tiers (the numba tier runs on the host: CPU, no index).

    JSON: {"tier": "triton", "device": "cuda", "index": 0}
    """

    tier: Tier = Tier.NUMBA
    device: DeviceKind = DeviceKind.CPU
    index: Optional[int] = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "tier", Tier(self.tier))
            object.__setattr__(self, "device", DeviceKind(self.device))
        except ValueError:
            raise BadInputError(f"no search backend {self.tier!r} on {self.device!r}") from None
        if self.index is not None and (self.device is not DeviceKind.CUDA or self.index < 0):
            raise BadInputError(f"a device index needs a CUDA device, got {self.device.value}:{self.index}")
        if self.tier is Tier.NUMBA and (self.device is not DeviceKind.CPU or self.index is not None):
            raise BadInputError("the numba tier runs on the host CPU")

    @classmethod
    def for_device(cls, device: "str | DeviceKind", index: Optional[int] = None) -> "Backend":
        """The tier the searches take on a torch device: on CUDA the Triton
        kernels where triton imports (never its interpreter, which only tests
        ask for by name), torch operations otherwise."""
        kind = DeviceKind(device)
        if kind is DeviceKind.CUDA and _compiled_triton():
            return cls(Tier.TRITON, kind, index)
        return cls(Tier.TORCH, kind, index)

    @property
    def on_device(self) -> bool:
        return self.tier is not Tier.NUMBA

    @property
    def torch_device(self):
        """The torch.device of the torch and Triton tiers."""
        import torch

        if not self.on_device:
            raise BadInputError("the numba tier has no torch device")
        return torch.device(self.device.value if self.index is None else f"{self.device.value}:{self.index}")

    def __str__(self) -> str:
        if not self.on_device:
            return self.tier.value
        where = self.device.value if self.index is None else f"{self.device.value}:{self.index}"
        return f"{self.tier.value} on {where}"

    def to_json(self) -> dict:
        return {"tier": self.tier.value, "device": self.device.value, "index": self.index}

    @classmethod
    def from_json(cls, d: dict) -> "Backend":
        return cls(d["tier"], d["device"], d.get("index"))


NUMBA = Backend()


def _compiled_triton() -> bool:
    if os.environ.get("TRITON_INTERPRET"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def to_host(t) -> np.ndarray:
    """A device tensor as a numpy array, through pinned memory where the device
    is a GPU (a pageable copy goes at a fraction of the link's speed)."""
    import torch

    if t.device.type == "cpu":
        return t.numpy()
    h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    h.copy_(t)  # synchronous: waits for this thread's stream only
    return h.numpy()


def to_device(x: np.ndarray, importance, backend: Backend):
    """A MIX search's inputs on ``backend``'s device: (X (rows, cols/16, 16),
    W (1, cols/16, 16) or None), float32."""
    import torch

    dev = backend.torch_device
    rows, cols = x.shape
    X = torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(dev).reshape(rows, cols // HALF, HALF)
    W = None
    if importance is not None:
        W = torch.from_numpy(np.ascontiguousarray(importance, np.float32)).to(dev).reshape(1, cols // HALF, HALF)
    return X, W
