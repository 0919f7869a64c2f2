"""A rank serving a persistent group's calls (``group.RankGroup`` is the home side).

Every rank opens its shard once, then loops: rank 0 waits for the home's
next message (broadcasting keep-alives while the home is idle, so the
collective timeout bounds a peer's silence, not the home's think time) and
broadcasts each call (layer, hidden, routing) to every rank; every rank
computes the slots ``slot_ranks`` gives it on its own experts; the per-slot
outputs are all_gathered (a status row per rank names a failed one); rank 0
combines all slots in canonical order with ``execute.combine`` (in both
modes: the home needs one [T, H] result, and the canonical combine keeps
exact mode's one-process bytes) and replies. A failure on any rank is raised
on every rank (rank 0 sends it to the home first).
"""

from __future__ import annotations

import shutil
import time

import numpy as np

from ds4quant.errors import Ds4quantError
from ds4quant.runtime.cluster.launch import ClusterError
from ds4quant.runtime.cluster.rank import inject_fault, my_slots, open_shard
from ds4quant.runtime.cluster.wire import OP_CALL, OP_KEEPALIVE, OP_STOP, connect
from ds4quant.runtime.execute import combine
from ds4quant.runtime.mode import Mode

__all__ = ["serve_calls"]


def serve_calls(g, spec: dict, dog) -> int:
    """Open this rank's shard, then serve calls until the home says stop (or
    goes away). Rank 0 relays each call and replies; a failure on any rank is
    raised on every rank (rank 0 sends it to the home first)."""
    import torch

    job = spec["jobs"][0]
    mode = Mode(job.get("mode", Mode.EXACT))  # the home parsed it
    rank, n = g.rank, g.size
    wire = connect(spec) if rank == 0 else None
    keepalive_s = float(spec.get("keepalive_s", 5.0))
    shard = None
    home_gone = False
    if rank == 0:
        dog.orphan_dir = spec.get("out_dir")  # the home's folder, should the home die first
    try:
        shard = open_shard(g, job, mode, dog.beat)
        h = shard.view.header
        H = int(h.hidden)
        reports = g.gather_json("ready", shard.report(rank, n, g.backend, mode))
        if wire is not None:
            wire.send({"op": "ready", "ranks": reports, "hidden": H})
        while True:
            dog.beat()
            head = torch.zeros(4, dtype=torch.int64)
            msg = None
            if wire is not None:
                if wire.readable(keepalive_s):
                    try:
                        msg = wire.recv(float(spec.get("timeout_s", 60)))
                    except (EOFError, OSError, ValueError):
                        msg = ({"op": "stop"}, [])  # the home is gone: end every rank
                        home_gone = True
                    op = {"stop": OP_STOP, "call": OP_CALL}.get(msg[0].get("op"), OP_STOP)
                    if op == OP_CALL:
                        head[:] = torch.tensor([OP_CALL, int(msg[0]["layer"]), int(msg[0]["T"]), int(msg[0]["K"])])
                    else:
                        head[0] = OP_STOP
                else:
                    head[0] = OP_KEEPALIVE
            head = g.broadcast("call header", head.to(g.device)).cpu()
            op, L, T, K = (int(v) for v in head)
            if op == OP_STOP:
                break
            if op == OP_KEEPALIVE:
                continue
            _serve_one(g, shard, wire, msg, L, T, K, H, mode)
        return 0
    except Ds4quantError as e:
        if wire is not None:
            try:
                wire.send({"op": "error", "error": e.one_line()})
            except OSError:
                pass
        raise
    finally:
        if shard is not None:
            shard.close()
        if wire is not None:
            wire.close()
        if home_gone and spec.get("out_dir"):  # nobody else will remove it
            shutil.rmtree(spec["out_dir"], ignore_errors=True)


def _serve_one(g, shard, wire, msg, L: int, T: int, K: int, H: int, mode: Mode) -> None:
    """One call on this rank: receive it, compute this rank's slots, exchange; rank 0 combines and replies."""
    import torch

    rank, n = g.rank, g.size
    x = torch.zeros((T, H), dtype=torch.float32)
    rw = torch.zeros((T, 2 * K), dtype=torch.float64)  # expert ids and float32 weights, both exact in f64
    if wire is not None:
        blobs = msg[1]
        x = torch.from_numpy(np.frombuffer(blobs[0], dtype=np.float32).reshape(T, H).copy())
        rw[:, :K] = torch.from_numpy(np.frombuffer(blobs[1], dtype=np.int64).reshape(T, K).astype(np.float64))
        rw[:, K:] = torch.from_numpy(np.frombuffer(blobs[2], dtype=np.float32).reshape(T, K).astype(np.float64))
    x = g.broadcast(f"layer {L} hidden", x.to(g.device)).cpu()
    rw = g.broadcast(f"layer {L} routing", rw.to(g.device)).cpu()
    idx, w = rw[:, :K].to(torch.int64), rw[:, K:].to(torch.float32)
    t0 = time.perf_counter()
    sr = shard.plc.slot_ranks(L, idx.numpy()).reshape(-1)
    flat = idx.numpy().reshape(-1).astype(np.int64)
    tok_of = np.repeat(np.arange(T), K)
    counts = np.bincount(sr, minlength=n)
    mine_sel = np.nonzero(sr == rank)[0]
    err, y = None, None
    try:
        inject_fault(rank, L)
        y = my_slots(shard.rt, rank, L, x.numpy(), flat, tok_of, mine_sel, mode)
    except Exception as e:
        err = e
    t1 = time.perf_counter()
    m = int(counts.max()) if counts.size else 0
    buf = torch.zeros((m + 1, H), dtype=torch.float32)
    if err is None:
        buf[: y.shape[0]] = torch.from_numpy(y)
    buf[m, 0] = 0.0 if err is None else 1.0
    parts = [p.cpu() for p in g.all_gather(f"layer {L} exchange", buf.to(g.device))]
    failed = [r for r in range(n) if float(parts[r][m, 0]) != 0.0]
    t2 = time.perf_counter()
    if failed:  # every rank knows; the failed ones say why, and every rank ends with the same line
        line = None if err is None else (err.one_line() if isinstance(err, Ds4quantError)
                                         else f"rank {rank}: {type(err).__name__}: {err}")
        said = g.gather_json(f"layer {L} errors", line)
        text = "; ".join(s for s in said if s)
        if err is not None and not isinstance(err, Ds4quantError):
            raise ClusterError(text) from err
        raise ClusterError(f"layer {L}: rank(s) {failed} failed computing their slots: {text}",
                           where=f"rank {rank}")
    if wire is None:
        return
    slots = torch.zeros((T * K, H), dtype=torch.float32)
    for r in range(n):
        sel = torch.from_numpy(np.nonzero(sr == r)[0])
        slots[sel] = parts[r][: int(counts[r])]
    out = combine(w, slots.reshape(T, K, H))
    wire.send({"op": "out", "compute_s": t1 - t0, "exchange_s": t2 - t1}, [out.numpy()])
