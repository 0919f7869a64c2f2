"""How the adaptive recipe measures and allocates: one frozen record, parsed once.

``AdaptiveOptions`` is built by the CLI (or a caller) and read, unchanged,
by every step of the planner: the measure stage and its per-expert jobs, the
cache key, the allocation and the plan summary. Its choices are str-enums
(``Granularity``, ``Fitter``, ``Device``), so a value that is no choice is
refused where the record is made, with the option's name; ``validate``
checks what depends on more than one field or on the qtype registry.
``backend()`` turns the device into the one ``formats.search.Backend`` the
searches take.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from ds4quant.errors import BadInputError, UnknownQTypeError
from ds4quant.formats import get_qtype
from ds4quant.formats.search import NUMBA, Backend, DeviceKind, Tier

DEFAULT_CANDIDATES = ("rocmfp2", "rocmfp2_mix", "rocmfp3", "rocmfp3_mix", "rocmfp4_fast", "rocmfp4")


class Granularity(str, Enum):
    TENSOR = "tensor"  # one qtype per layer x surface (the Lucebox layout)
    EXPERT = "expert"  # a qtype per expert: a layer's experts form compact stacks per qtype


class Fitter(str, Enum):
    OPTIMIZED = "optimized"  # codebooks.fit_optimized: Lloyd against the MIX encoder itself
    REFERENCE = "reference"  # codebooks.fit_reference: the Lucebox fitter, bit for bit


class Device(str, Enum):
    CPU = "cpu"  # numba on the host's cores
    CUDA = "cuda"  # the searches on a CUDA device (Triton where it imports)
    TORCH_CPU = "torch-cpu"  # the device path on torch's CPU device: what CI runs of it


def _choice(enum, value, option: str):
    try:
        return enum(value)
    except ValueError:
        allowed = tuple(m.value for m in enum)
        raise BadInputError(f"{option} must be one of {allowed}, got {value!r}") from None


def _device(value, index: Optional[int]) -> tuple[Device, Optional[int]]:
    """``--device``: cpu, cuda, cuda:N or torch-cpu (no torch import here)."""
    if isinstance(value, Device):
        return value, index
    d = str(value)
    if d.startswith("cuda:") and d[5:].isdigit() and index is None:
        return Device.CUDA, int(d[5:])
    try:
        return Device(d), index
    except ValueError:
        raise BadInputError(f"--device must be cpu, cuda, cuda:N or torch-cpu, got {value!r}") from None


@dataclass(frozen=True)
class AdaptiveOptions:
    """How to measure and allocate.

    target_bpw: routed-expert bits per weight to land on (tensor payload);
    max_bytes: or a cap on all tensor data plus codebook tables, in bytes;
    lucebox: keep the result loadable by Lucebox at tensor granularity (no
    rocmfp3_mix on gate/up); fit_*: fit_optimized effort per expert;
    sensitivity: a ``sensitivity.json`` (``ds4quant.calib.sensitivity``) whose
    per-tensor KL gains turn the weighted errors into predicted KL before
    allocating (without it every tensor's weighted error counts the same).
    jobs: experts measured at once (None: convert's threads); device (and
    device_index, or "cuda:N"): where the MIX and scale searches run
    (``ds4quant.plan.workers`` says what moves). Neither changes a figure, a
    plan or a byte.
    """

    target_bpw: Optional[float] = None
    max_bytes: Optional[int] = None
    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    granularity: Granularity = Granularity.TENSOR
    fitter: Fitter = Fitter.OPTIMIZED
    routing: Optional[str] = None
    cache_dir: Optional[str] = None
    lucebox: bool = True
    fit_iterations: int = 6
    fit_restarts: int = 1
    fit_max_rows: int = 512
    sensitivity: Optional[str] = None
    jobs: Optional[int] = None
    device: Device = Device.CPU
    device_index: Optional[int] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "granularity", _choice(Granularity, self.granularity, "--granularity"))
        object.__setattr__(self, "fitter", _choice(Fitter, self.fitter, "--fitter"))
        device, index = _device(self.device, self.device_index)
        if index is not None and (device is not Device.CUDA or index < 0):
            raise BadInputError(f"--device {device.value} takes no device index, got {index}")
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "device_index", index)

    @property
    def device_name(self) -> str:
        """The ``--device`` value: cpu, cuda, cuda:N or torch-cpu."""
        return self.device.value if self.device_index is None else f"{self.device.value}:{self.device_index}"

    def validate(self) -> "AdaptiveOptions":
        if (self.target_bpw is None) == (self.max_bytes is None):
            raise BadInputError("the adaptive recipe needs exactly one of --target-bpw or --max-bytes")
        if self.target_bpw is not None and not (0 < self.target_bpw < 64):
            raise BadInputError(f"--target-bpw must be in (0, 64), got {self.target_bpw}")
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise BadInputError(f"--max-bytes must be positive, got {self.max_bytes}")
        if not self.candidates:
            raise BadInputError("--candidates is empty")
        for q in self.candidates:
            try:
                qt = get_qtype(q)
            except UnknownQTypeError as exc:
                raise BadInputError(exc.message, where="--candidates", hint=exc.hint) from None
            if not qt.can_encode or qt.block_size != 32:
                raise BadInputError(f"{q} cannot be an expert candidate", where="--candidates")
        if len(set(self.candidates)) != len(self.candidates):
            raise BadInputError("--candidates lists a qtype twice")
        if self.jobs is not None and self.jobs < 1:
            raise BadInputError(f"--jobs must be >= 1, got {self.jobs}")
        if self.cache_dir is not None:
            from ds4quant.plan.cache import check_cache_dir

            check_cache_dir(self.cache_dir)
        return self

    def key(self) -> dict:
        """What a measurement depends on (not the budget: targets share it)."""
        d = {"candidates": sorted(self.candidates), "fitter": self.fitter.value}
        if self.fitter is Fitter.OPTIMIZED:
            d.update(iterations=self.fit_iterations, restarts=self.fit_restarts, max_rows=self.fit_max_rows)
        return d

    def backend(self) -> Backend:
        """The searches' ``formats.search.Backend`` for ``device``: numba on the
        host for cpu, else a torch device that exists (torch imported here)."""
        if self.device is Device.CPU:
            return NUMBA
        try:
            import torch
        except ImportError:
            raise BadInputError(f"--device {self.device_name} needs torch", hint="pip install torch") from None
        if self.device is Device.TORCH_CPU:
            return Backend(Tier.TORCH, DeviceKind.CPU)
        if not torch.cuda.is_available():
            raise BadInputError(f"--device {self.device_name}: torch sees no CUDA device")
        if self.device_index is not None and self.device_index >= torch.cuda.device_count():
            raise BadInputError(f"--device {self.device_name}: torch sees {torch.cuda.device_count()} CUDA device(s)")
        return Backend.for_device(DeviceKind.CUDA, self.device_index)
