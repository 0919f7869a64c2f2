"""Owner names and the owner-kind registry: the one parser of an owner name and
the one table that turns a name into an owner.

A placement names its owners; the names are the runtime contract::

    cpu, cpu:N          the numba CPU owner            (owners/cpu.py)
    torch-cpu:N         a torch owner on the CPU       (owners/torch_owner.py)
    cuda:N, hip:N       a CUDA / ROCm device owner     (owners/cuda_owner.py)
    worker:N            a child process hosting a CPU owner (owners/worker.py)
    worker:N/OWNER      a child process hosting OWNER (cpu, cpu:N, torch-cpu:N, cuda:N
                        or hip:N): the second vendor's runtime on a mixed host

N is 0 or a number of at most four digits without leading zeros, so every
owner has exactly one spelling.

    name = OwnerName.parse("worker:1/cuda:0")
    name.kind is OwnerKind.WORKER_HOSTED; name.index == 1; str(name.hosted) == "cuda:0"
    owner = make_owner(name, swiglu_limit=10.0)

The registry maps each kind to a ``"module:function"`` factory imported on
first use: naming or parsing an owner imports neither torch nor numba, and
the worker child builds its hosted owner through the same table.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any, Callable, Optional

from ds4quant.errors import BadInputError

__all__ = ["OwnerKind", "OwnerName", "OWNER_NAMES", "FACTORIES", "owner_factory", "make_owner", "check_device"]

OWNER_NAMES = "cpu, cpu:N, cuda:N, hip:N, torch-cpu:N, worker:N or worker:N/OWNER"
MAX_INDEX_DIGITS = 4


class OwnerKind(str, Enum):
    CPU = "cpu"
    TORCH_CPU = "torch-cpu"
    CUDA = "cuda"
    HIP = "hip"
    WORKER = "worker"
    WORKER_HOSTED = "worker-hosted"

    @property
    def hostable(self) -> bool:
        """Whether a worker process can host an owner of this kind (a worker cannot host a worker)."""
        return self in (OwnerKind.CPU, OwnerKind.TORCH_CPU, OwnerKind.CUDA, OwnerKind.HIP)


@dataclass(frozen=True)
class OwnerName:
    """A parsed owner name (see the module docstring).

    kind: the owner kind; index: N (None for the bare ``cpu``); hosted: the
    owner a ``worker:N/OWNER`` child hosts (None for every other kind).
    ``str(name)`` gives the name back exactly as written.
    """

    kind: OwnerKind
    index: Optional[int]
    hosted: Optional["OwnerName"] = None

    @classmethod
    def parse(cls, text: Any, where: Optional[str] = None) -> "OwnerName":
        """The owner name ``text`` spells (an OwnerName passes through); anything
        else is one BadInputError line naming ``where``."""
        if isinstance(text, cls):
            return text
        got = _parse(text) if isinstance(text, str) else None
        if got is None:
            raise BadInputError(f"unknown owner name {text!r}; expected {OWNER_NAMES}", where=where)
        return got

    def __str__(self) -> str:
        if self.kind is OwnerKind.WORKER_HOSTED:
            return f"worker:{self.index}/{self.hosted}"
        return self.kind.value if self.index is None else f"{self.kind.value}:{self.index}"

    @property
    def identity(self) -> str:
        """The runtime identity of the owner this name makes (the bare ``cpu`` is ``cpu:0``)."""
        return f"{self.kind.value}:0" if self.index is None else str(self)


def _index(text: str) -> Optional[int]:
    ok = text.isascii() and text.isdigit() and len(text) <= MAX_INDEX_DIGITS and (text == "0" or text[0] != "0")
    return int(text) if ok else None


def _local(text: str) -> Optional[OwnerName]:
    """A name of a kind that runs in this process (every kind but the two worker kinds)."""
    if text == "cpu":
        return OwnerName(OwnerKind.CPU, None)
    kind, sep, num = text.partition(":")
    if not sep or kind not in ("cpu", "torch-cpu", "cuda", "hip"):
        return None
    i = _index(num)
    return None if i is None else OwnerName(OwnerKind(kind), i)


def _parse(text: str) -> Optional[OwnerName]:
    head, slash, inner = text.partition("/")
    if head.startswith("worker:"):
        i = _index(head[len("worker:"):])
        if i is None:
            return None
        if not slash:
            return OwnerName(OwnerKind.WORKER, i)
        hosted = _local(inner)
        return None if hosted is None else OwnerName(OwnerKind.WORKER_HOSTED, i, hosted)
    return None if slash else _local(text)


# --------------------------------------------------------------------------
# the registry: kind -> "module:function"; each function takes (name, *, identity, **options)

FACTORIES = MappingProxyType({
    OwnerKind.CPU: "ds4quant.runtime.owners.cpu:owner_for",
    OwnerKind.TORCH_CPU: "ds4quant.runtime.owners.torch_owner:owner_for",
    # torch names ROCm devices cuda too: one device owner for both
    OwnerKind.CUDA: "ds4quant.runtime.owners.cuda_owner:owner_for",
    OwnerKind.HIP: "ds4quant.runtime.owners.cuda_owner:owner_for",
    OwnerKind.WORKER: "ds4quant.runtime.owners.worker:owner_for",
    OwnerKind.WORKER_HOSTED: "ds4quant.runtime.owners.worker:owner_for",
})


def owner_factory(kind: OwnerKind) -> Callable[..., Any]:
    """The factory registered for ``kind`` (its module is imported here)."""
    module, _, func = FACTORIES[OwnerKind(kind)].partition(":")
    return getattr(importlib.import_module(module), func)


def make_owner(name: "OwnerName | str", *, identity: Optional[str] = None, **options) -> Any:
    """The owner ``name`` names, with runtime identity ``identity`` (default
    ``name.identity``); options (``swiglu_limit``, ...) go to its constructor."""
    name = OwnerName.parse(name)
    if name.kind in (OwnerKind.CUDA, OwnerKind.HIP):
        check_device(name)
    return owner_factory(name.kind)(name, identity=identity or name.identity, **options)


def check_device(name: "OwnerName | str") -> None:
    """Refuse (one BadInputError line naming the owner) a ``cuda:N`` / ``hip:N``
    owner this process's torch cannot run: no GPU build or device, a ROCm
    owner on a CUDA build, or N past the devices there are. torch's own
    refusal is an AssertionError deep in its lazy init."""
    name = OwnerName.parse(name)
    if name.kind not in (OwnerKind.CUDA, OwnerKind.HIP):
        return
    import torch

    where = f"owner {name}"
    build = "ROCm" if getattr(torch.version, "hip", None) else "CUDA" if torch.version.cuda else None
    if build is None:
        raise BadInputError(f"this torch {torch.__version__} is a CPU-only build; a {name.kind.value} owner needs "
                            "a CUDA or ROCm build of torch", where=where, hint="use cpu, torch-cpu:N or worker:N")
    if name.kind is OwnerKind.HIP and build != "ROCm":
        raise BadInputError(f"this torch is a {build} build; hip:N names a ROCm device (host it in a worker "
                            "with a ROCm torch: worker:N/hip:M)", where=where)
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not n:
        raise BadInputError(f"this {build} build of torch sees no GPU device", where=where,
                            hint="check the driver and CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES")
    if (name.index or 0) >= n:
        raise BadInputError(f"device {name.index} does not exist: this process sees {n} device(s) "
                            f"(0..{n - 1})", where=where)
