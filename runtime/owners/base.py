"""What every owner is: one compute place that holds resident expert tensors,
a decode-table registry, and runs the routed-expert FFN on rows routed to it.

The loader (``runtime.load``) reads the artifact through ``ArtifactView``,
slices each expert stack down to the experts a placement gives an owner, and
hands the owner one ``ExpertStack`` per (layer, projection, source stack);
then registers the MIX decode tables of exactly those experts in the owner's
registry. The executor calls ``run_slots`` with the rows routed to the owner.

The per-slot contract (both modes; DS4 clamped SwiGLU, transformers'
``DeepseekV4Experts`` math)::

    y = down( silu(min(gate @ x, limit)) * clamp(up @ x, -limit, limit) )

unweighted: the home owner applies the top-k weights and combines in
canonical order. ``exact`` mode defines every step so that any owner on any
device kind gives the same bits (``runtime/exact.py`` states the
definition); ``fast`` mode is the owner's best speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from ds4quant.runtime.mode import Mode


@dataclass(frozen=True, eq=False)
class ExpertStack:
    """Resident bytes of some experts of one routed-expert stack.

    tensor: the artifact tensor the bytes come from (full or compact name).
    layer, proj: block index and "gate" / "up" / "down".
    qtype: ds4quant qtype name (ROCmFPX, MIX, mxfp4, q8_0, bf16, f16, f32).
    rows, cols: output and input features of one expert (GGUF ne[1], ne[0]).
    expert_ids: global expert ids in local order (strictly increasing).
    data: uint8 (len(expert_ids), rows, row_bytes), the artifact's encoded
        rows of those experts, in local order (a memmap slice or a copy).
    """

    tensor: str
    layer: int
    proj: str
    qtype: str
    rows: int
    cols: int
    expert_ids: tuple[int, ...]
    data: np.ndarray

    @property
    def n_experts(self) -> int:
        return len(self.expert_ids)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


@runtime_checkable
class Owner(Protocol):
    """One compute place. ``identity`` is its runtime identity ("cpu:0",
    "cuda:0", "hip:0", "worker:0/cpu:0"); registry keys include it. ``owners/kinds.py`` maps
    each owner name to its owner module's ``owner_for``."""

    identity: str

    def add_stack(self, stack: ExpertStack) -> None:
        """Make ``stack`` resident (MIX stacks are unusable until registered)."""

    def register_books(self, tensor: str, expert_ids: Sequence[int], entry) -> None:
        """Register the decode table of resident ``tensor`` for exactly
        ``expert_ids`` from a ``codebooks.CodebookEntry`` (global or compact)."""

    def experts(self, layer: int) -> tuple[int, ...]:
        """Global ids of the experts resident for ``layer`` (gate, up and down)."""

    def run_slots(self, layer: int, x: np.ndarray, expert_ids: np.ndarray, mode: Mode) -> np.ndarray:
        """Per-slot unweighted expert outputs.

        x: float32 (n, hidden), row i routed to global expert expert_ids[i]
        (int64 (n,)); returns float32 (n, hidden). A row of exact mode depends
        only on x[i] and the expert's weights, never on the other rows. An
        owner called directly takes the mode's text too (``Mode.parse``).
        """

    # Optional (overlapped submission, runtime/overlap.py): an owner that stages
    # its input asynchronously may define
    #     run_slots_staged(layer, x, expert_ids, mode, ready) -> same as run_slots
    # calling ready.fire() exactly when its input copy is enqueued (before its
    # compute is), and returning the same bytes as run_slots. A failure before
    # the fire just raises (the executor wakes the waiter with it).

    # Optional (rows that stay on a device, docs/gpu.md#device): an owner with a torch
    # ``device`` may define
    #     run_slots_device(layer, x, expert_ids, mode) -> torch.Tensor
    # taking x as a float32 tensor on that device and returning run_slots' bytes there.
    # runtime.execute.run_layer calls it when the hidden states are on that device.

    def resident_bytes(self) -> int:
        """Bytes of expert data (and decode tables) this owner holds."""

    def close(self) -> None:
        """Unregister every decode table, then free the tensors. Idempotent."""


def distinct(ids: np.ndarray) -> int:
    """How many different expert ids ``ids`` (int64) holds: a count over ``bincount`` (16 us
    against ``np.unique``'s 173 us at 12,288 slots on the 2-core box), ``np.unique`` for ids
    bincount cannot take."""
    if ids.size == 0:
        return 0
    if ids.min() < 0:
        return int(np.unique(ids).shape[0])
    return int(np.count_nonzero(np.bincount(ids)))
