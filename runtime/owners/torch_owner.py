"""TorchOwner: routed experts on one torch device (``cuda:N``, ``hip:N``, or
the CPU device as ``torch-cpu:N``, the second exact implementation CI runs).

Quantized bytes stay resident (on the device; on the CPU device the artifact's
memmap slices themselves); each call decodes the experts its slots select,
once per expert per call, with ``formats.decode_torch``. ``fast`` multiplies
the decoded float32 weights with torch; ``exact`` runs ``torch_exact`` (the
identity definition of docs/exact-mode.md in torch ops only).

    o = TorchOwner("cpu")                 # identity "torch-cpu:0"
    o.add_stack(stack); o.register_books(stack.tensor, stack.expert_ids, entry)
    y = o.run_slots(layer, x, ids, "exact")
"""

from __future__ import annotations

import threading
import warnings
from typing import Optional, Sequence

import numpy as np

from ds4quant.errors import BadInputError, ShapeError
from ds4quant.runtime.mode import Mode
from ds4quant.runtime.owners.base import ExpertStack

DEFAULT_SWIGLU_LIMIT = 10.0


def owner_for(name, *, identity: str, **options) -> "TorchOwner":
    """The owner of a ``torch-cpu:N`` name (``owners/kinds.py``'s registry): the CPU device."""
    return TorchOwner("cpu", identity=identity, **options)


def torch_identity(device: str) -> str:
    """The runtime identity of a torch device, read from torch: "cuda:0",
    "hip:0" on a ROCm build, "torch-cpu:0" on the CPU device."""
    import torch

    dev = torch.device(device)
    if dev.type == "cpu":
        return f"torch-cpu:{dev.index or 0}"
    if dev.type == "cuda":
        kind = "hip" if getattr(torch.version, "hip", None) else "cuda"
        return f"{kind}:{dev.index if dev.index is not None else torch.cuda.current_device()}"
    return f"{dev.type}:{dev.index or 0}"


def make_registry(identity: str):
    """The owner's decode-table registry."""
    from ds4quant.runtime.registry import DecodeTableRegistry

    return DecodeTableRegistry(identity)


class TorchOwner:
    """Owner protocol on a torch device; see the module docstring."""

    def __init__(self, device: str = "cpu", identity: Optional[str] = None,
                 swiglu_limit: float = DEFAULT_SWIGLU_LIMIT, torch_decode: bool = False):
        import torch

        self.device = torch.device(device)
        self.identity = identity or torch_identity(device)
        self.swiglu_limit = float(swiglu_limit)
        # decode with formats.decode_torch on the CPU device too (other devices always do)
        self.torch_decode = bool(torch_decode)
        self.registry = make_registry(self.identity)
        # (layer, proj) -> {global expert id: (stack, local index, device bytes)}
        self._where: dict[tuple[int, str], dict[int, tuple]] = {}
        self._stacks: list[ExpertStack] = []
        # (layer, proj, expert) -> torch_exact.weight_spans of its decoded rows: a
        # property of resident bytes that never change, kept so exact mode sizes
        # each (token, row) sum once per expert, not once per call
        self._spans: dict[tuple[int, str, int], object] = {}
        self._lock = threading.Lock()
        self._closed = False

    # -- residency -------------------------------------------------------
    def add_stack(self, stack: ExpertStack) -> None:
        import torch

        if self._closed:
            raise BadInputError(f"owner {self.identity} is closed", where=stack.tensor)
        if stack.data.ndim != 3 or stack.data.shape[0] != stack.n_experts or stack.data.dtype != np.uint8:
            raise ShapeError(f"stack data must be uint8 ({stack.n_experts}, rows, row_bytes), got "
                             f"{stack.data.dtype} {stack.data.shape}", where=stack.tensor)
        if self.device.type == "cpu":
            dev_data = None  # the memmap slice is the resident copy
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only memmap: copied to the device
                dev_data = torch.from_numpy(np.ascontiguousarray(stack.data)).to(self.device)
        slot = self._where.setdefault((stack.layer, str(stack.proj)), {})
        for local, e in enumerate(stack.expert_ids):
            if e in slot:
                raise BadInputError(f"expert {e} of layer {stack.layer} {stack.proj} is already resident "
                                    f"on {self.identity} (from {slot[e][0].tensor})", where=stack.tensor)
            slot[e] = (stack, local, dev_data)
        self._stacks.append(stack)

    def register_books(self, tensor: str, expert_ids: Sequence[int], entry) -> None:
        stack = next((s for s in self._stacks if s.tensor == tensor), None)
        self.registry.register(tensor, stack, tuple(int(i) for i in expert_ids), entry)

    def experts(self, layer: int) -> tuple[int, ...]:
        sets = [set(self._where.get((layer, p), {})) for p in ("gate", "up", "down")]
        return tuple(sorted(sets[0] & sets[1] & sets[2]))

    def resident_bytes(self) -> int:
        return sum(s.nbytes for s in self._stacks) + int(self.registry.nbytes())

    def held_bytes(self, layer: int, proj: str, expert: int) -> np.ndarray:
        """The encoded rows this owner holds for one expert (for placement checks)."""
        stack, local, dev = self._where[(layer, proj)][expert]
        if dev is None:
            return np.asarray(stack.data[local])
        return dev[local].cpu().numpy()

    def close(self) -> None:
        if self._closed:
            return
        self.registry.unregister_all()  # unregister before free
        self._where.clear()
        self._stacks.clear()
        self._spans.clear()
        self._closed = True

    # -- compute ---------------------------------------------------------
    def _decode(self, layer: int, proj: str, e: int):
        import torch
        from ds4quant import formats

        try:
            stack, local, dev = self._where[(layer, proj)][e]
        except KeyError:
            raise BadInputError(f"expert {e} of layer {layer} {proj} is not resident on {self.identity}") from None
        qt = formats.QTYPES[stack.qtype]
        kw = {}
        if qt.is_mix:
            # raises for an unregistered tensor or another owner's entry: no fixed-level fallback
            books, modes = self.registry.lookup(self.identity, stack.tensor)
            kw = dict(codebooks=np.asarray(books[local]), modes=int(modes[local]))
        if dev is None and not self.torch_decode:
            # CPU device: the numba decoder (bitwise equal to decode_torch, and faster on small rows)
            return torch.from_numpy(formats.decode(stack.qtype, np.asarray(stack.data[local]), stack.cols, **kw))
        if dev is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only memmap, decoded, never written
                data = torch.from_numpy(np.asarray(stack.data[local]))
        else:
            data = dev[local]
        return formats.decode_torch(stack.qtype, data, stack.cols, **kw)

    def _weight_spans(self, layer: int, proj: str, e: int, w):
        from ds4quant.runtime.owners import torch_exact

        key = (layer, proj, e)
        if key not in self._spans:
            self._spans[key] = torch_exact.weight_spans(w)
        return self._spans[key]

    def run_slots(self, layer: int, x: np.ndarray, expert_ids: np.ndarray, mode: Mode) -> np.ndarray:
        import torch

        mode = Mode.parse(mode, where=self.identity)
        xt = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        xt = xt.to(device=self.device, dtype=torch.float32)
        return self.torch_slots(layer, xt, np.asarray(expert_ids, dtype=np.int64).reshape(-1), mode).cpu().numpy()

    def run_slots_device(self, layer: int, x, expert_ids, mode: Mode):
        """run_slots on rows already on this owner's device: x float32 (n, H) tensor there,
        expert_ids int64 (n,) -> float32 (n, H) tensor there, run_slots' bytes."""
        mode = Mode.parse(mode, where=self.identity)
        x, ids = device_rows(self, x, expert_ids)
        return self.torch_slots(layer, x, ids, mode)

    def torch_slots(self, layer: int, xt, ids: np.ndarray, mode: Mode):
        """run_slots on a float32 (n, H) tensor on this owner's device -> a tensor there:
        each selected expert decoded with ``formats.decode_torch`` (numba on the CPU device),
        then the definition's exact products or fast mode's matmuls."""
        import torch
        from ds4quant.runtime.owners import torch_exact
        from ds4quant.runtime.swiglu import swiglu_fast

        if xt.ndim != 2 or xt.shape[0] != ids.shape[0]:
            raise ShapeError(f"run_slots: x {tuple(xt.shape)} and {ids.shape[0]} expert ids disagree")
        out = torch.zeros_like(xt)
        with self._lock:
            for e in np.unique(ids):  # each selected expert decoded once per call
                rows = torch.from_numpy(np.nonzero(ids == e)[0]).to(self.device)
                wg, wu, wd = (self._decode(layer, p, int(e)) for p in ("gate", "up", "down"))
                xs = xt.index_select(0, rows)
                if mode is Mode.EXACT:
                    spans = tuple(self._weight_spans(layer, p, int(e), w)
                                  for p, w in zip(("gate", "up", "down"), (wg, wu, wd)))
                    y = torch_exact.expert_exact(wg, wu, wd, xs, self.swiglu_limit, spans)
                else:
                    y = swiglu_fast(xs @ wg.T, xs @ wu.T, self.swiglu_limit) @ wd.T
                out.index_copy_(0, rows, y)
        return out


def same_device(a, b) -> bool:
    """Whether torch devices a and b are one device ("cuda" is the current CUDA device)."""
    import torch

    def norm(d):
        d = torch.device(d)
        if d.index is None and d.type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return d

    return norm(a) == norm(b)


def device_rows(owner, x, expert_ids):
    """(x float32 contiguous, ids int64 (n,) host) for ``run_slots_device``; refuses rows that
    are not a tensor on ``owner.device`` or that disagree with the ids in number."""
    import torch

    if not isinstance(x, torch.Tensor) or not same_device(x.device, owner.device):
        where = x.device if isinstance(x, torch.Tensor) else "the host"
        raise BadInputError(f"run_slots_device: the rows are on {where}, this owner runs on {owner.device}",
                            where=owner.identity)
    ids = (expert_ids.detach().cpu().numpy() if isinstance(expert_ids, torch.Tensor)
           else np.asarray(expert_ids)).astype(np.int64, copy=False).reshape(-1)
    if x.ndim != 2 or x.shape[0] != ids.shape[0]:
        raise ShapeError(f"run_slots: x {tuple(x.shape)} and {ids.shape[0]} expert ids disagree")
    return x.to(torch.float32).contiguous(), ids
