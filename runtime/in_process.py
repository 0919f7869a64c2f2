"""The in-process executor: the owners of a placement in this process (and
their worker children), each holding exactly the experts placed on it.

``open_runtime`` builds one owner per owner name of the placement (through
the owner-kind registry, unless the caller gives that owner), gives each
owner memmap slices of exactly the experts it holds (``view.expert_data``),
registers the MIX decode tables of exactly those experts, and checks the
exact cover; on any failure everything registered so far is unregistered and
every owner closed. ``runtime.load`` is the door; this is what it opens for
a placement without ranks.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping, Optional

from ds4quant import names
from ds4quant.errors import BadInputError, CodebookError
from ds4quant.runtime.execute import NONE, LayerResult, run_layer
from ds4quant.runtime.executor import Executor, call_figures
from ds4quant.runtime.mode import Mode
from ds4quant.runtime.owners.base import ExpertStack
from ds4quant.runtime.owners.kinds import make_owner
from ds4quant.runtime.placement import Placement

__all__ = ["Runtime", "open_runtime"]


class Runtime(Executor):
    """Owners in this process on a placement (``Executor``). Use ``runtime.load``.

    tables: layer -> owner name of each expert (``none``: held elsewhere);
    owners: owner name -> Owner."""

    def __init__(self, view, own_view: bool, placement: Placement, tables: Mapping[int, tuple[str, ...]],
                 owners: Mapping[str, object], mode: Mode, recorder=None, overlap: bool = False):
        self.view = view
        self._own_view = own_view
        self.placement = placement
        self.tables = dict(tables)
        self.owners = dict(owners)
        self.mode = mode
        self.recorder = recorder
        # overlapped owner submission (runtime/overlap.py); off until measured on the
        # user's hardware; the bytes are the same either way
        self.overlap = bool(overlap)
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.owners)), thread_name_prefix="ds4q-owner")
        self._walls: list[float] = []
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        close_all(self.owners)
        if self._own_view:
            self.view.close()

    def resident_bytes(self) -> dict[str, int]:
        return {n: int(o.resident_bytes()) for n, o in self.owners.items()}

    def stats(self) -> dict:
        return {"owners": sorted(self.owners), **call_figures(self._walls)}

    def run_layer(self, layer: int, hidden, top_k_index, top_k_weights, shared=None) -> LayerResult:
        """Routed experts of ``layer`` for given routing; per-slot outputs and the combine."""
        if self._closed:
            raise BadInputError("runtime is closed")
        self.check_layer(layer)
        if self.recorder is not None:
            self.recorder.record(layer, top_k_index)
        t0 = time.perf_counter()
        res = run_layer(layer, hidden, top_k_index, top_k_weights, self.owners, self.tables[layer], self.mode,
                        self._pool, shared=shared, overlap=self.overlap)
        self._walls.append(time.perf_counter() - t0)
        return res


def close_all(owners) -> None:
    for o in owners.values():
        try:
            o.close()
        except Exception:  # closing the rest matters more than one owner's close error
            pass


def open_runtime(view, own_view: bool, placement: Placement, mode: Mode,
                 owners: Optional[Mapping[str, object]] = None, recorder=None, overlap: bool = False) -> Runtime:
    """The owners of ``placement`` (prebuilt ``owners`` by name, the rest made from
    their names) holding their experts of ``view``; see the module docstring."""
    h = view.header
    tables = {L: placement.owner_names(L) for L in range(h.n_layer)}
    made: dict[str, object] = {}
    try:
        given = dict(owners or {})
        for n in sorted({n for t in tables.values() for n in t if n != NONE}):
            made[n] = given[n] if n in given else make_owner(n, swiglu_limit=h.swiglu_limit)
        _make_resident(view, tables, made)
        return Runtime(view, own_view, placement, tables, made, mode, recorder, overlap=overlap)
    except BaseException:
        close_all(made)  # close unregisters every table registered so far, then frees
        raise


def _make_resident(view, tables, owners) -> None:
    from ds4quant import formats

    for st in view.stacks:
        table = tables[st.layer]
        for name, owner in owners.items():
            ids = tuple(e for e in st.expert_ids if table[e] == name)
            if not ids:
                continue
            data = view.expert_data(st.name, ids)
            proj = st.proj.value if isinstance(st.proj, names.Proj) else str(st.proj)
            owner.add_stack(ExpertStack(st.name, st.layer, proj, st.qtype, st.rows, st.cols, ids, data))
            if formats.QTYPES[st.qtype].is_mix:
                entry = view.book_entry(st.name)
                if entry is None:
                    raise CodebookError("MIX stack has no codebook entry in the artifact", where=st.name)
                owner.register_books(st.name, ids, entry)
    # exact cover: every expert placed on an owner is resident there for gate, up and down
    for L, table in tables.items():
        for name, owner in owners.items():
            want = tuple(e for e, n in enumerate(table) if n == name)
            got = tuple(owner.experts(L))
            if got != want:
                missing = sorted(set(want) - set(got))
                extra = sorted(set(got) - set(want))
                raise BadInputError(f"layer {L}: owner {name} holds experts {list(got)}, the placement says "
                                    f"{list(want)} (missing {missing}, extra {extra})")

