"""One MoE layer over several owners: split slots, run branches, combine.

    res = run_layer(layer, hidden, top_k_index, top_k_weights, owners, table, mode, pool)
    res.out            # float32 [T, H] torch: the canonical combine of the slots held here
    res.slots          # float32 [T, k, H] torch: unweighted per-slot expert outputs (0 where not held)
    res.held           # bool [T, k] numpy: False where the expert is on ``none``
    res.missing        # ((token, slot, expert), ...) held outside this process

Canonical combine (docs/exact-mode.md#combine): per token
acc = fl32(w0 * y0); acc = fl32(acc + fl32(wk * yk)) for k = 1..K-1 in the
token's top-k slot order; out = fl32(acc + shared). Slots on ``none`` are
skipped here; a cluster combines the per-slot outputs of every rank with
``combine`` so N processes give the one-process bytes. Partial sums per
owner are never formed, in either mode (fast mode could, but one combine
keeps the two modes' difference down to the expert math).
"""

from __future__ import annotations

import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np

from ds4quant.errors import BadInputError, ShapeError
from ds4quant.runtime.mode import Mode

NONE = "none"


@dataclass(frozen=True, eq=False)
class LayerResult:
    out: object  # torch.Tensor [T, H] float32
    slots: object  # torch.Tensor [T, k, H] float32
    held: np.ndarray  # bool [T, k]
    missing: tuple[tuple[int, int, int], ...]


def combine(weights, slots, held: Optional[np.ndarray] = None, shared=None):
    """The canonical fp32 combine. weights [T,k] f32, slots [T,k,H] f32 (torch);
    held bool [T,k] (default all); shared [T,H] f32 or None -> [T,H] f32.

    Each op is one numpy ufunc on float32 arrays, so every product and every
    sum is rounded once (no fused multiply-add), the same bits as the torch
    ops it replaced at a twentieth of the host time (about 25 us against 520
    for one DS4 token: the largest host cost of a decode step)."""
    import torch

    w = np.ascontiguousarray(_np32(weights))
    y = _np32(slots)
    keep = None if held is None else np.asarray(held, dtype=bool)
    if keep is not None and keep.all():
        keep = None
    with np.errstate(all="ignore"):  # inf / nan follow IEEE, as the torch ops did, without warnings
        acc = _canonical_sum(w, y, keep)
        if shared is not None:
            acc = acc + _np32(shared)
    return torch.from_numpy(np.ascontiguousarray(acc, dtype=np.float32))


def combine_on_device(weights, slots, held: Optional[np.ndarray] = None, shared=None):
    """``combine`` on the slots' device (torch ops, one kernel each: every product and every
    sum rounded once, as numpy's ufuncs round them), so the same bits without a host copy."""
    import torch

    y = slots.to(torch.float32)
    w = weights.to(device=y.device, dtype=torch.float32)
    keep = None
    if held is not None and not np.asarray(held, dtype=bool).all():
        keep = torch.from_numpy(np.ascontiguousarray(held, dtype=bool)).to(y.device)
    acc = _canonical_sum(w, y, keep, torch)
    if shared is not None:
        acc = acc + shared.to(device=y.device, dtype=torch.float32)
    return acc.contiguous()


def _canonical_sum(w, y, keep, xp=np):
    """The canonical sum over a token's slots; xp: numpy (host arrays) or torch (tensors)."""
    T, K = w.shape[0], w.shape[1]
    if K == 0:
        return np.zeros((T, y.shape[2]), np.float32) if xp is np else y.new_zeros((T, y.shape[2]))
    if keep is None:
        acc = w[:, 0:1] * y[:, 0, :]
        for k in range(1, K):
            acc = acc + w[:, k:k + 1] * y[:, k, :]
        return acc
    acc = xp.zeros_like(y[:, 0, :])
    started = keep[:, 0:1] & False
    for k in range(K):
        term = w[:, k:k + 1] * y[:, k, :]
        # a token's first held slot starts its sum as fl32(w*y), never 0 + fl32(w*y)
        # (which would turn -0 into +0); a slot held elsewhere is skipped
        nxt = xp.where(started, acc + term, term)
        hk = keep[:, k:k + 1]
        acc = xp.where(hk, nxt, acc)
        started = started | hk
    return acc


def _np32(t) -> np.ndarray:
    """float32 numpy view/copy of a torch tensor or array (values converted once, like .to(float32))."""
    if hasattr(t, "detach"):
        import torch

        return t.detach().to(device="cpu", dtype=torch.float32).numpy()
    return np.asarray(t, dtype=np.float32)


def _submit_order(names: Sequence[str], home: str) -> list[str]:
    # the home owner last: the cold branches start first and overlap with it
    return sorted(names, key=lambda n: (n == home, n))


def run_layer(layer: int, hidden, top_k_index, top_k_weights, owners: Mapping[str, object],
              table: Sequence[str], mode: Mode, pool: Optional[Executor] = None, *,
              home: Optional[str] = None, shared=None, overlap: bool = False,
              timings: Optional[list] = None, device_rows: Optional[bool] = None) -> LayerResult:
    """Run one layer's routed experts.

    hidden float32 [T,H], top_k_index int64 [T,k], top_k_weights float32 [T,k]
    (torch); owners: owner name -> Owner; table[e]: owner name of expert e
    (``none``: held outside this process); pool: runs each owner's branch
    (one worker per owner); shared: float32 [T,H] added after the routed sum.
    overlap: overlapped submission (``runtime.overlap``; same bytes either way);
    timings: a list that receives one ``overlap.BranchTiming`` per branch.
    device_rows: keep the rows on ``hidden``'s device (each owner's ``run_slots_device``,
    the combine there; the same bytes). None: when ``hidden`` is on a GPU and every owner
    of the call runs there; True: required (refused when an owner does not run there).
    """
    import torch

    if hidden.ndim != 2:
        raise ShapeError(f"hidden must be [T, H], got {tuple(hidden.shape)}")
    T, H = hidden.shape
    idx = top_k_index.detach().cpu().numpy().astype(np.int64)
    if idx.ndim != 2 or idx.shape[0] != T or tuple(top_k_weights.shape) != idx.shape:
        raise ShapeError(f"layer {layer}: top_k_index {tuple(top_k_index.shape)} / top_k_weights "
                         f"{tuple(top_k_weights.shape)} must both be [{T}, k]")
    n_expert = len(table)
    if idx.size and (idx.min() < 0 or idx.max() >= n_expert):
        raise BadInputError(f"layer {layer}: expert ids must be in 0..{n_expert - 1}, got {idx.min()}..{idx.max()}")
    K = idx.shape[1]
    x = hidden.detach().to(torch.float32).cpu().contiguous().numpy()
    flat = idx.reshape(-1)
    who = np.asarray(table, dtype=object)[flat] if flat.size else np.zeros(0, dtype=object)
    held = (who != NONE).reshape(T, K)
    slots = np.zeros((T * K, H), dtype=np.float32)
    tok = np.repeat(np.arange(T), K)
    names = sorted({str(n) for n in who if n != NONE})
    unknown = [n for n in names if n not in owners]
    if unknown:
        raise BadInputError(f"layer {layer}: the placement names owners {unknown} this runtime does not have")
    home = home if home is not None else (names[0] if names else None)
    dev = hidden.device
    takes = all(_takes_device(owners[n], dev) for n in names)
    if device_rows and not takes:
        raise BadInputError(f"layer {layer}: device rows need every owner of the call on {dev}, "
                            f"got {[n for n in names if not _takes_device(owners[n], dev)]}")
    if takes and (device_rows or (device_rows is None and dev.type != "cpu")):
        return _run_on_device(layer, hidden, idx, top_k_weights, owners, names, who, held, mode, shared, timings)

    import ds4quant.runtime.overlap as ov

    raw: list = []
    sels = {n: np.nonzero(who == n)[0] for n in names}

    def branch(name: str, ready=None):
        sel = sels[name]
        t0 = time.perf_counter()
        if ready is None:
            y = owners[name].run_slots(layer, x[tok[sel]], flat[sel], mode)
            if timings is not None:
                raw.append((name, t0, t0, time.perf_counter()))
        else:
            y = ov.run_staged(owners[name], layer, x[tok[sel]], flat[sel], mode, ready)
        return sel, np.asarray(y, dtype=np.float32)

    order = _submit_order(names, home)
    if pool is None or len(order) < 2:
        results = [branch(n) for n in order]
    elif overlap:
        results = ov.submit_overlapped(order, branch, pool, raw if timings is not None else None)
    else:
        futures = [pool.submit(branch, n) for n in order]
        results = [f.result() for f in futures]  # join every branch; the first error propagates
    if timings is not None:
        timings.extend(ov.timings_of(raw, {n: len(s) for n, s in sels.items()}))
    for sel, y in results:
        if y.shape != (sel.shape[0], H):
            raise ShapeError(f"layer {layer}: an owner returned {y.shape} for {sel.shape[0]} slots of width {H}")
        slots[sel] = y
    slots_t = torch.from_numpy(slots.reshape(T, K, H))
    out = combine(top_k_weights.detach().cpu(), slots_t, held=None if held.all() else held, shared=shared)
    miss = tuple((int(t), int(k), int(idx[t, k])) for t, k in zip(*np.nonzero(~held)))
    return LayerResult(out=out, slots=slots_t, held=held, missing=miss)


def _takes_device(owner, dev) -> bool:
    """Whether ``owner`` runs slots on device tensors of ``dev`` (its optional
    ``run_slots_device``, docs/gpu.md#device)."""
    from ds4quant.runtime.owners.torch_owner import same_device

    where = getattr(owner, "device", None)
    return getattr(owner, "run_slots_device", None) is not None and where is not None and same_device(where, dev)


def _run_on_device(layer, hidden, idx, top_k_weights, owners, names, who, held, mode, shared, timings):
    """run_layer with the hidden states on a device every owner of the call runs on: each
    owner's rows are gathered, run and scattered there, the canonical combine runs there,
    and no row crosses the host; the bytes are the host path's."""
    import torch

    T, K = idx.shape
    H = hidden.shape[1]
    dev = hidden.device
    x = hidden.detach().to(torch.float32).contiguous()
    flat = idx.reshape(-1)
    tok = torch.arange(T, device=dev).repeat_interleave(K)
    slots = torch.zeros((T * K, H), dtype=torch.float32, device=dev)
    raw, counts = [], {}  # (owner, start, fired, end) on the host clock, as overlap's timings take them
    for name in names:  # one device: the owners' launches queue on it in turn
        sel = np.nonzero(who == name)[0]
        seld = torch.from_numpy(sel).to(dev)
        t0 = time.perf_counter()
        y = owners[name].run_slots_device(layer, x.index_select(0, tok.index_select(0, seld)), flat[sel], mode)
        if tuple(y.shape) != (sel.shape[0], H):
            raise ShapeError(f"layer {layer}: an owner returned {tuple(y.shape)} for {sel.shape[0]} slots of "
                             f"width {H}")
        slots.index_copy_(0, seld, y.to(torch.float32))
        raw.append((name, t0, t0, time.perf_counter()))
        counts[name] = sel.shape[0]
    if timings is not None:
        import ds4quant.runtime.overlap as ov

        timings.extend(ov.timings_of(raw, counts))
    slots = slots.view(T, K, H)
    out = combine_on_device(top_k_weights.detach(), slots, held=None if held.all() else held, shared=shared)
    miss = tuple((int(t), int(k), int(idx[t, k])) for t, k in zip(*np.nonzero(~held)))
    return LayerResult(out=out, slots=slots, held=held, missing=miss)
