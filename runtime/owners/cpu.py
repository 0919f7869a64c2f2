"""The CPU owner: numba kernels that decode inside the products, every qtype.

It holds ``ExpertStack``s (several per (layer, proj): expert granularity
gives one compact stack per qtype, and an owner may hold any subset of a
stack's experts), its ``DecodeTableRegistry``, and runs the routed-expert
FFN on the slots routed to it::

    exact: runtime/exact.py's definition (Q, exact D, fixed SWIGLU, one rounding)
    fast:  float32: few tokens per expert, a lane GEMV over the packed rows;
           more, a decoded tile of rows times BLAS (runtime/fast.py); numpy exp SwiGLU

Slots are grouped by expert, so each weight row is decoded once per call.
A MIX stack is unusable until its books are registered: ``run_slots`` on an
unregistered MIX expert raises ``UnregisteredTableError``; nothing falls back
to fixed levels. Threads (numba prange over rows) never change exact bytes:
every output is computed alone.

Example::

    owner = CpuOwner("cpu:0")
    owner.add_stack(stack)                      # gate, up, down of layer 3
    owner.register_books(stack.tensor, stack.expert_ids, entry)   # MIX only
    y = owner.run_slots(3, x, ids, "exact")     # float32 (n, hidden)
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ds4quant.errors import BadInputError, ShapeError
from ds4quant.formats import QTYPES, numba_threads
from ds4quant.formats.components import row_kind, row_lut
from ds4quant.runtime import exact as X
from ds4quant.runtime.fast import fast_matmul
from ds4quant.runtime.jit import readonly
from ds4quant.runtime.mode import Mode
from ds4quant.runtime.owners.base import ExpertStack
from ds4quant.runtime.registry import DecodeTableRegistry
from ds4quant.runtime.swiglu import swiglu_fast

_PROJS = ("gate", "up", "down")


def owner_for(name, *, identity: str, **options) -> "CpuOwner":
    """The owner of a ``cpu`` / ``cpu:N`` name (``owners/kinds.py``'s registry)."""
    return CpuOwner(identity=identity, **options)


class CpuOwner:
    """A CPU owner (see the module docstring). identity: "cpu" / "cpu:N"."""

    def __init__(self, identity: str = "cpu:0", threads: Optional[int] = None, swiglu_limit: float = 10.0):
        self.identity = identity
        self.threads = threads
        self.swiglu_limit = float(swiglu_limit)
        self.registry = DecodeTableRegistry(identity)
        self._stacks: dict[str, ExpertStack] = {}
        self._where: dict[tuple[int, str, int], tuple[str, int]] = {}  # (layer, proj, expert) -> (tensor, local)
        # (tensor, local) -> exact.row_spans: depends only on the weights (and a
        # MIX expert's books), so computed on an expert's first exact call, not per call
        self._spans: dict[tuple[str, int], tuple] = {}
        # (layer, proj, expert) -> _operand's tuple (read-only data view, level table):
        # built once, not per call (a batch-1 call is a few ms; Python per call adds up)
        self._ops: dict[tuple[int, str, int], tuple] = {}

    # ---------------------------------------------------------------- residency

    def add_stack(self, stack: ExpertStack) -> None:
        where = f"{self.identity}: stack {stack.tensor!r}"
        if stack.tensor in self._stacks:
            raise BadInputError("tensor is already resident", where=where)
        if stack.proj not in _PROJS:
            raise BadInputError(f"proj must be one of {_PROJS}, got {stack.proj!r}", where=where)
        qt = QTYPES.get(stack.qtype)
        if qt is None:
            raise BadInputError(f"unknown qtype {stack.qtype!r}", where=where)
        row_kind(qt.name)  # refuses qtypes that are not expert weight formats
        ids = tuple(int(i) for i in stack.expert_ids)
        if not ids or any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < 0:
            raise BadInputError(f"expert ids must be non-empty and strictly increasing, got {ids[:8]}", where=where)
        want = (len(ids), stack.rows, qt.row_bytes(stack.cols))
        if stack.data.dtype != np.uint8 or tuple(stack.data.shape) != want:
            raise ShapeError(f"data must be uint8 {want}, got {stack.data.dtype} {tuple(stack.data.shape)}", where=where)
        if stack.cols % 32:
            raise ShapeError(f"input features {stack.cols} are not a multiple of 32", where=where)
        clash = [e for e in ids if (stack.layer, stack.proj, e) in self._where]
        if clash:
            other = self._where[(stack.layer, stack.proj, clash[0])][0]
            raise BadInputError(f"experts {clash[:8]} are already resident from {other!r}", where=where)
        self._stacks[stack.tensor] = stack
        for k, e in enumerate(ids):
            self._where[(stack.layer, stack.proj, e)] = (stack.tensor, k)

    def register_books(self, tensor: str, expert_ids: Sequence[int], entry) -> None:
        self.registry.register(tensor, self._stacks.get(tensor), expert_ids, entry)
        self._drop_spans(tensor)  # new books, new decoded weights

    def _drop_spans(self, tensor: str) -> None:
        for k in [k for k in self._spans if k[0] == tensor]:
            del self._spans[k]
        for k in [k for k, (op, _) in self._ops.items() if op[7].tensor == tensor]:
            del self._ops[k]

    def remove_stack(self, tensor: str) -> None:
        """Unregister the tensor's decode table (if any), then free it."""
        stack = self._stacks.get(tensor)
        if stack is None:
            raise BadInputError("tensor is not resident", where=f"{self.identity}: {tensor!r}")
        if self.registry.expert_ids(tensor) is not None:
            self.registry.unregister(tensor)
        for e in stack.expert_ids:
            del self._where[(stack.layer, stack.proj, e)]
        del self._stacks[tensor]
        self._drop_spans(tensor)

    def experts(self, layer: int) -> tuple[int, ...]:
        sets = [{e for (l, p, e) in self._where if l == layer and p == proj} for proj in _PROJS]
        return tuple(sorted(sets[0] & sets[1] & sets[2]))

    def resident_bytes(self) -> int:
        return sum(s.nbytes for s in self._stacks.values()) + self.registry.nbytes()

    def span_cache_bytes(self) -> int:
        """Bytes of the exact-mode row spans cached so far (9 per row of an expert
        used in exact mode; not artifact bytes, so not in ``resident_bytes``)."""
        return sum(v.nbytes for sp in self._spans.values() for v in sp)

    def held_bytes(self, layer: int, proj: str, expert: int) -> np.ndarray:
        """The encoded rows this owner holds for one expert (placement checks)."""
        key = (layer, proj, expert)
        if key not in self._where:
            raise BadInputError(f"expert {expert} of layer {layer} ({proj}) is not resident", where=self.identity)
        tensor, local = self._where[key]
        return np.asarray(self._stacks[tensor].data[local])

    def close(self) -> None:
        self.registry.unregister_all()  # tables first, then the tensors
        self._stacks.clear()
        self._where.clear()
        self._spans.clear()
        self._ops.clear()

    # ---------------------------------------------------------------- compute

    def _operand(self, layer: int, proj: str, expert: int):
        """(kind, p0, p1, data (rows, row_bytes), cols, lut, mode, stack, (tensor, local)):
        decode_row_nb's arguments, cached until the tensor's books or residency change."""
        key = (layer, proj, expert)
        hit = self._ops.get(key)
        if hit is not None and hit[1] is not None:
            # a MIX operand is valid only while the very books it was built from are
            # registered (lookup raises once unregistered; a re-registration is new books)
            if self.registry.lookup(self.identity, hit[0][7].tensor)[0] is not hit[1]:
                self._drop_spans(hit[0][7].tensor)  # its exact-mode spans came from the old books too
                hit = None
        if hit is None:
            op = self._make_operand(layer, proj, expert)
            books = (self.registry.lookup(self.identity, op[7].tensor)[0]
                     if QTYPES[op[7].qtype].is_mix else None)
            hit = self._ops[key] = (op, books)
        return hit[0]

    def _make_operand(self, layer: int, proj: str, expert: int):
        hit = self._where.get((layer, proj, expert))
        if hit is None:
            raise BadInputError(f"expert {expert} of layer {layer} has no resident {proj} weights",
                                where=self.identity)
        stack = self._stacks[hit[0]]
        kind, p0, p1 = row_kind(stack.qtype)
        if QTYPES[stack.qtype].is_mix:
            all_books, modes = self.registry.lookup(self.identity, stack.tensor)  # raises when unregistered
            mode = int(modes[hit[1]])
            lut = row_lut(stack.qtype, all_books[hit[1]], mode)
        else:
            lut, mode = row_lut(stack.qtype), 1
        return kind, p0, p1, readonly(stack.data[hit[1]]), stack.cols, readonly(lut, np.float32), mode, stack, hit

    def _row_spans(self, op):
        spans = self._spans.get(op[8])
        if spans is None:
            spans = self._spans[op[8]] = X.row_spans(*op[:7])
        return spans

    def run_slots(self, layer: int, x: np.ndarray, expert_ids: np.ndarray, mode: Mode) -> np.ndarray:
        mode = Mode.parse(mode, where=self.identity)
        x = np.ascontiguousarray(x, dtype=np.float32)
        ids = np.asarray(expert_ids, dtype=np.int64).reshape(-1)
        if x.ndim != 2 or x.shape[0] != ids.shape[0]:
            raise ShapeError(f"x must be (n, hidden) with n = len(expert_ids) = {ids.shape[0]}, got {x.shape}",
                             where=self.identity)
        ops = {int(e): [self._operand(layer, p, int(e)) for p in _PROJS] for e in np.unique(ids)}
        hidden = x.shape[1]
        for e, (g, u, d) in ops.items():
            if g[4] != hidden or u[4] != hidden or g[7].rows != u[7].rows or d[4] != g[7].rows or d[7].rows != hidden:
                raise ShapeError(f"expert {e} of layer {layer}: gate/up/down shapes do not chain with hidden {hidden}",
                                 where=self.identity)
        out = np.empty_like(x)
        with numba_threads(self.threads):
            quant = X.quantize_rows(x, f"{self.identity} layer {layer} input") if mode is Mode.EXACT else None
            for e, (g, u, d) in ops.items():
                rows = np.flatnonzero(ids == e)
                out[rows] = self._expert(layer, e, g, u, d, x[rows], quant, rows, mode)
        return out

    def _expert(self, layer, e, g, u, d, xs, quant, rows, mode):
        if mode is Mode.FAST:
            gv = fast_matmul(*g[:7], xs)
            uv = fast_matmul(*u[:7], xs)
            return fast_matmul(*d[:7], swiglu_fast(gv, uv, self.swiglu_limit))
        sub = tuple(q[rows] for q in quant)
        gv = X.exact_matmul(*g[:7], xs, sub, what=g[7].tensor, spans=self._row_spans(g))
        uv = X.exact_matmul(*u[:7], xs, sub, what=u[7].tensor, spans=self._row_spans(u))
        h = X.swiglu(gv, uv, self.swiglu_limit)
        hq = X.quantize_rows(h, f"{self.identity} layer {layer} expert {e} SwiGLU output")
        return X.exact_matmul(*d[:7], h, hq, what=d[7].tensor, spans=self._row_spans(d))
