"""The bundled runtime: decode-table registry, owners, placement, MoE execution.

    from ds4quant import runtime
    with runtime.load("out/art", placement="placement.json", mode="exact") as rt:
        y = rt.experts(layer)(hidden, top_k_index, top_k_weights)  # [T,H] f32, [T,k] i64, [T,k] f32
        z = rt.moe(layer, hidden, token_ids)                       # routing + routed + shared expert

``load`` opens the artifact through the artifact view, builds one owner per
owner name of the placement (None: one CPU owner holding every expert),
gives each owner memmap slices of exactly the experts it holds
(``view.expert_data``), registers the MIX decode tables of exactly those
experts, and checks the exact cover; on any failure everything registered so
far is unregistered and every owner closed. Importing this package does not
import torch.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from os import PathLike
from typing import Mapping, Optional

import numpy as np

from ds4quant import names
from ds4quant.errors import BadInputError, CodebookError
from ds4quant.runtime.execute import NONE, LayerResult, combine, run_layer
from ds4quant.runtime.owners.base import MODES, ExpertStack

__all__ = ["load", "Runtime", "LayerResult", "combine", "DictPlacement", "make_owner"]


# --------------------------------------------------------------------------
# the pieces (lazy imports: importing this package pulls in no torch or numba)


def _open_view(artifact):
    if hasattr(artifact, "expert_data"):
        return artifact, False  # an open view: the caller closes it
    from ds4quant.artifact.view import open_artifact

    return open_artifact(artifact), True


def _read_placement(path):
    from ds4quant.runtime import placement as _placement

    return _placement.read_placement(path)


def make_owner(name: str, swiglu_limit: float = 10.0):
    """An owner for a placement owner name: cpu[:N], torch-cpu:N, cuda:N, hip:N, worker:N,
    worker:N/OWNER (a child process hosting OWNER, e.g. worker:1/cuda:0)."""
    from ds4quant.runtime.placement import check_owner_name

    kind, _, num = check_owner_name(name).partition(":")
    if kind == "cpu":
        from ds4quant.runtime.owners.cpu import CpuOwner

        return CpuOwner(identity=name if num else "cpu:0", swiglu_limit=swiglu_limit)
    if kind == "worker":
        from ds4quant.runtime.owners.worker import WorkerOwner

        inner = name.partition("/")[2]
        if not inner:
            return WorkerOwner(identity=name, swiglu_limit=swiglu_limit)
        spec, kwargs = _hosted(inner)
        return WorkerOwner(identity=name, owner=spec, inner_identity=name, swiglu_limit=swiglu_limit, **kwargs)
    if kind == "torch-cpu":
        from ds4quant.runtime.owners.torch_owner import TorchOwner

        return TorchOwner("cpu", identity=name if num else "torch-cpu:0", swiglu_limit=swiglu_limit)
    if kind in ("cuda", "hip"):
        # Triton kernels for fast mode, TorchOwner's exact path; torch names ROCm devices cuda too
        from ds4quant.runtime.owners.cuda_owner import CudaOwner

        return CudaOwner(f"cuda:{num or 0}", identity=name if num else f"{kind}:0", swiglu_limit=swiglu_limit)
    raise BadInputError(f"unknown owner name {name!r} (cpu[:N], torch-cpu:N, cuda:N, hip:N, worker:N, "
                        "worker:N/OWNER, none)")


def _hosted(inner: str) -> tuple[str, dict]:
    """(worker owner spec, constructor kwargs) for the owner a worker:N/OWNER name hosts."""
    kind, _, num = inner.partition(":")
    if kind == "cpu":
        return "cpu", {}
    if kind == "torch-cpu":
        return "torch", {"device": "cpu"}
    if kind in ("cuda", "hip"):
        return "cuda", {"device": f"cuda:{num or 0}"}
    raise BadInputError(f"owner {inner!r} cannot be hosted by a worker process (cpu, cpu:N, torch-cpu:N, "
                        "cuda:N, hip:N)")


# --------------------------------------------------------------------------
# placements


@dataclass(frozen=True)
class DictPlacement:
    """The smallest placement: per layer, expert ids per owner name (``none`` allowed).

    DictPlacement({0: {"cpu:0": (0, 1), "torch-cpu:1": (2, 3)}}, n_expert=4).
    Layers not listed go to ``default``."""

    layers: Mapping[int, Mapping[str, tuple]]
    n_expert: int
    default: Optional[str] = None

    def owner_of(self, layer: int) -> tuple[str, ...]:
        spec = self.layers.get(layer)
        if spec is None:
            if self.default is None:
                raise BadInputError(f"placement has no layer {layer}")
            return (self.default,) * self.n_expert
        table: list[Optional[str]] = [None] * self.n_expert
        for owner, ids in spec.items():
            for e in ids:
                if not 0 <= int(e) < self.n_expert:
                    raise BadInputError(f"placement: layer {layer} expert {e} outside 0..{self.n_expert - 1}")
                if table[int(e)] is not None:
                    raise BadInputError(f"placement: layer {layer} expert {e} placed on {table[int(e)]} and {owner}")
                table[int(e)] = owner
        if None in table:
            raise BadInputError(f"placement: layer {layer} experts {[i for i, t in enumerate(table) if t is None]} "
                                "are placed nowhere (use 'none' for experts held elsewhere)")
        return tuple(table)


def _resolve_placement(placement, n_expert: int):
    if placement is None:
        return DictPlacement({}, n_expert, default="cpu:0")
    if isinstance(placement, (str, PathLike)):
        return _read_placement(placement)
    if isinstance(placement, Mapping):
        return DictPlacement({int(k): dict(v) for k, v in placement.items()}, n_expert)
    if hasattr(placement, "owner_of"):
        return placement
    raise BadInputError(f"placement must be None, a path, a mapping or a Placement, got {type(placement).__name__}")


def _table(placement, layer: int, n_expert: int) -> tuple[str, ...]:
    t = placement.owner_of(layer)
    names_ = getattr(placement, "owners", None)
    if isinstance(t, np.ndarray) and t.dtype.kind in "iu" and names_ is not None:
        # R2's Placement: index into placement.owners per expert, -1 = none
        t = [NONE if i < 0 else names_[int(i)] for i in t]
    if isinstance(t, Mapping):
        t = [t.get(e, NONE) for e in range(n_expert)]
    t = tuple(NONE if n is None else str(n) for n in t)
    if len(t) != n_expert:
        raise BadInputError(f"placement layer {layer} places {len(t)} experts, the artifact has {n_expert}")
    return t


# --------------------------------------------------------------------------
# the runtime


class Runtime:
    """A loaded artifact on a placement. Use ``load``; see the module docstring."""

    def __init__(self, view, own_view: bool, placement, tables, owners, mode: str, recorder=None,
                 overlap: bool = False):
        self.view = view
        self._own_view = own_view
        self.placement = placement
        self.tables = tables  # layer -> owner name per expert
        self.owners = owners  # owner name -> Owner
        self.mode = mode
        self.header = view.header
        self.recorder = recorder
        # overlapped owner submission (runtime/overlap.py); off until measured on the
        # user's hardware; the bytes are the same either way
        self.overlap = bool(overlap)
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(owners)), thread_name_prefix="ds4q-owner")
        self._closed = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        _close_all(self.owners)
        if self._own_view and hasattr(self.view, "close"):
            self.view.close()

    def resident_bytes(self) -> dict[str, int]:
        """Expert (and decode-table) bytes per owner name."""
        return {n: int(o.resident_bytes()) for n, o in self.owners.items()}

    def experts(self, layer: int):
        """torch.nn.Module with DeepseekV4Experts' call signature for ``layer``."""
        from ds4quant.runtime.experts import RuntimeExperts

        self._check_layer(layer)
        return RuntimeExperts(self, layer)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= int(layer) < self.header.n_layer:
            raise BadInputError(f"layer {layer} outside 0..{self.header.n_layer - 1}")

    def run_layer(self, layer: int, hidden, top_k_index, top_k_weights, shared=None) -> LayerResult:
        """Routed experts of ``layer`` for given routing; per-slot outputs and the combine."""
        if self._closed:
            raise BadInputError("runtime is closed")
        self._check_layer(layer)
        if self.recorder is not None:
            self.recorder.record(layer, top_k_index)
        return run_layer(layer, hidden, top_k_index, top_k_weights, self.owners, self.tables[layer],
                         self.mode, self._pool, shared=shared, overlap=self.overlap)

    # -- the whole MoE block --------------------------------------------
    def route(self, layer: int, hidden, token_ids):
        """(top_k_index int64 [T,k], top_k_weights f32 [T,k]) from the artifact's router.

        fast: one batched ``route`` call (bitwise transformers' router on the
        batch); exact: ``route_rows`` (each token alone: batch-invariant)."""
        import torch

        v, h = self.view, self.header
        w = torch.from_numpy(np.ascontiguousarray(v.dense(names.router_name(layer)), dtype=np.float32))
        hashed = layer < h.hash_layers
        bias = None if hashed else torch.from_numpy(np.ascontiguousarray(v.dense(names.router_bias_name(layer)),
                                                                          dtype=np.float32))
        tid = torch.from_numpy(np.asarray(v.dense(names.tid2eid_name(layer))).astype(np.int64)) if hashed else None
        from ds4quant.runtime.route import route

        if self.mode != "exact":
            return route(hidden, token_ids, w, bias, tid, h.n_expert_used, h.routed_scale)
        return route_rows(hidden, token_ids, w, bias, tid, h.n_expert_used, h.routed_scale)

    def shared(self, layer: int, hidden):
        """The shared expert on the home process (exact mode: the exact definition)."""
        import torch
        from ds4quant.runtime.owners import torch_exact

        ws = [torch.from_numpy(np.ascontiguousarray(self.view.dense(names.shared_name(layer, p)), dtype=np.float32))
              for p in ("gate", "up", "down")]
        x = hidden.to(torch.float32)
        L = self.header.swiglu_limit
        if self.mode == "exact":
            return torch_exact.expert_exact(ws[0], ws[1], ws[2], x, L)
        hmid = torch.nn.functional.silu(torch.clamp(x @ ws[0].T, max=L)) * torch.clamp(x @ ws[1].T, min=-L, max=L)
        return hmid @ ws[2].T

    def moe(self, layer: int, hidden, token_ids):
        """Routing + routed experts + shared expert: float32 [T,H]."""
        import torch

        hidden = hidden.to(torch.float32)
        idx, w = self.route(layer, hidden, token_ids)
        return self.run_layer(layer, hidden, idx, w, shared=self.shared(layer, hidden)).out


def route_rows(hidden, token_ids, w, bias, tid, top_k: int, routed_scale: float):
    """Exact mode's routing: each token routed alone, so its experts and weights
    never depend on the other tokens of its batch.

    torch's float32 matmul (and its vectorised elementwise loops, whose scalar
    tails fall on different elements for different batch shapes) can give a row
    other bits inside another batch. Here every row is ``route`` of a fresh,
    allocator-aligned [1, H] copy on one torch thread: the same call, shape,
    alignment and thread count whatever the batch, so the bytes are those of
    transformers' router given that token alone (fast mode keeps the batched
    call, bitwise equal to transformers' router on the whole batch).
    """
    import torch

    from ds4quant.runtime.reference import torch_threads
    from ds4quant.runtime.route import route

    T = int(hidden.shape[0]) if hidden.ndim == 2 else 0
    if hidden.ndim != 2 or T == 0:  # route's own checks and empty-batch result
        with torch_threads(1):
            return route(hidden, token_ids, w, bias, tid, top_k, routed_scale)
    ids = token_ids.reshape(-1) if isinstance(token_ids, torch.Tensor) else None
    if tid is not None and (ids is None or ids.numel() != T):
        with torch_threads(1):  # route raises its one-line error for the bad token ids
            return route(hidden, token_ids, w, bias, tid, top_k, routed_scale)
    idx, wts = [], []
    with torch_threads(1):
        for t in range(T):
            i, v = route(hidden[t:t + 1].clone(memory_format=torch.contiguous_format),
                         None if ids is None else ids[t:t + 1].clone(), w, bias, tid, top_k, routed_scale)
            idx.append(i)
            wts.append(v)
    return torch.cat(idx), torch.cat(wts)


def _close_all(owners) -> None:
    for o in owners.values():
        try:
            o.close()
        except Exception:  # closing the rest matters more than one owner's close error
            pass


def load(artifact, placement=None, mode: str = "exact", owners: Optional[Mapping[str, object]] = None,
         recorder=None, overlap: bool = False) -> Runtime:
    """Load ``artifact`` (folder, .gguf, first split, or an open view) onto ``placement``.

    placement: None (one CPU owner), a placement file path, a Placement, or a
    mapping {layer: {owner name: expert ids}}; owners: prebuilt owners by
    name (the rest are made from their names); recorder: a
    ``runtime.capture.RoutingRecorder`` (routing capture); overlap: overlapped
    owner submission (``runtime.overlap``, off by default). Returns a Runtime
    (a context manager).
    """
    if mode not in MODES:
        raise BadInputError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    view, own_view = _open_view(artifact)
    made: dict[str, object] = {}
    try:
        h = view.header
        plc = _resolve_placement(placement, h.n_expert)
        rk = getattr(plc, "ranks", None)
        if rk is not None:
            # a whole cluster placement in one process would hold no expert of the other
            # ranks' shards and give their slots as zeros
            raise BadInputError(f"the placement plans {rk.n_ranks} ranks: run it with `ds4quant run --ranks "
                                f"{rk.n_ranks}` (or verify --placement), or load one rank's part "
                                "(Placement.for_rank(r))", where=str(placement) if isinstance(placement, (str, PathLike)) else "placement")
        tables = {L: _table(plc, L, h.n_expert) for L in range(h.n_layer)}
        wanted = sorted({n for t in tables.values() for n in t if n != NONE})
        given = dict(owners or {})
        for n in wanted:
            made[n] = given[n] if n in given else make_owner(n, swiglu_limit=h.swiglu_limit)
        _make_resident(view, tables, made)
        return Runtime(view, own_view, plc, tables, made, mode, recorder, overlap=overlap)
    except BaseException:
        _close_all(made)  # close unregisters every table registered so far, then frees
        if own_view and hasattr(view, "close"):
            view.close()
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
