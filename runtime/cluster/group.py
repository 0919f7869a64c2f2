"""A persistent rank group: N ranks started once, serving every layer call.

    from ds4quant.runtime.cluster.group import RankGroup
    with RankGroup("out/art", "cluster.json", mode="exact") as grp:   # starts the ranks, waits for them
        model.model.layers[L].mlp.experts = grp.experts(L)             # transformers' experts call
        y = grp.run_layer(L, hidden, top_k_index, top_k_weights).out   # f32 [T, H]
        grp.ranks[1]["expert_bytes_read"], grp.stats()                 # what rank 1 read; call timings

``runtime.cluster.run_cluster_layers`` runs layers whose inputs are known up
front; a model's forward (verify's fidelity run) feeds each layer the last
one's output and calls the experts a few hundred times, and starting N
processes (imports, rendezvous, loading the shards: seconds) per call would
dominate it. So the ranks are started once, by the same launcher
(``cluster.start_ranks``: spawn or torchrun, the rank entry of
``ds4quant run --ranks N``), and serve calls until told to stop.

The caller (the "home": it holds the model, not a rank) talks to rank 0 over
one TCP connection on localhost (a token from the spec file, mode 0700
folder, proves it is the rank this group started); rank 0 broadcasts each
call (layer, hidden, routing) to every rank over torch.distributed, every
rank computes the slots ``slot_ranks`` gives it on its own experts, the
per-slot outputs are all_gathered (a status row per rank names a failed
one), and rank 0 combines all slots in canonical order with
``execute.combine`` (in both modes: the home needs one [T, H] result, and
the canonical combine keeps exact mode's one-process bytes) and replies.
While the home is idle rank 0 broadcasts keep-alives, so the collective
timeout bounds a peer's silence, not the home's think time.

A failed call (a rank's error, a rank that died or hung, the home gone) ends
every rank; the home raises one ``ClusterError`` line naming each rank's
part, kills by pid whatever is left after a grace period and removes the
temporary folder. gloo talks TCP: nothing is put in shared memory.
"""

from __future__ import annotations

import hmac
import json
import secrets
import select
import shutil
import socket
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np

from ds4quant.errors import BadInputError, Ds4quantError
from ds4quant.runtime.cluster.rank import ClusterError

__all__ = ["RankGroup", "ClusterCall", "serve_calls", "is_rank_placement"]

# the call header rank 0 broadcasts: [op, layer, T, K]
OP_STOP, OP_KEEPALIVE, OP_CALL = 0, 1, 2
MAX_HEADER = 1 << 20


@dataclass(frozen=True, eq=False)
class ClusterCall:
    """One layer call's result: the combined routed output and its timings (rank 0's)."""

    out: object  # torch.Tensor [T, H] float32
    wall_s: float
    compute_s: float
    exchange_s: float


def is_rank_placement(placement) -> bool:
    """Whether ``placement`` (a path, a Placement, or anything else) records ranks."""
    from os import PathLike

    from ds4quant.runtime.placement import Placement, read_placement

    if isinstance(placement, Placement):
        return placement.ranks is not None
    if isinstance(placement, (str, PathLike)):
        return read_placement(placement).ranks is not None
    return False


# --------------------------------------------------------------------------
# the wire between the home and rank 0: length-prefixed JSON + raw arrays


class _Wire:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, head: dict, blobs: Sequence[np.ndarray] = ()) -> None:
        hb = json.dumps({**head, "n_blobs": len(blobs)}).encode()
        parts: list = [struct.pack("<Q", len(hb)), hb]
        for b in blobs:
            mv = memoryview(np.ascontiguousarray(b)).cast("B")
            parts += [struct.pack("<Q", mv.nbytes), mv]
        self.sock.sendall(b"".join(parts))

    def readable(self, timeout_s: float) -> bool:
        r, _, _ = select.select([self.sock], [], [], max(0.0, timeout_s))
        return bool(r)

    def _exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(min(n - len(buf), 1 << 22))
            if not chunk:
                raise EOFError("connection closed")
            buf += chunk
        return bytes(buf)

    def recv(self, timeout_s: float) -> tuple[dict, list[bytes]]:
        """One message (call after ``readable``); EOFError when the peer closed."""
        self.sock.settimeout(timeout_s)
        (n,) = struct.unpack("<Q", self._exact(8))
        if n > MAX_HEADER:
            raise EOFError(f"message header of {n} bytes")
        head = json.loads(self._exact(n))
        blobs = []
        for _ in range(int(head.get("n_blobs", 0))):
            (m,) = struct.unpack("<Q", self._exact(8))
            blobs.append(self._exact(m))
        return head, blobs

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


# --------------------------------------------------------------------------
# the home side


class RankGroup:
    """The ranks of a rank placement over ``artifact``, started once and serving
    every ``run_layer`` call until ``close`` (a context manager).

    placement: a rank placement (``ds4quant place --ranks N``; a file or a
    Placement); its n_ranks ranks are started. timeout_s: the ranks' collective timeout (a
    dead or hung peer fails a call within about this); startup_s: extra
    time for imports, rendezvous and loading. expect_fingerprint: the
    artifact fingerprint the caller holds (every rank checks its own view
    against it). owners, launcher, env, threads: as ``run_cluster_layers``."""

    def __init__(self, artifact, placement, *, mode: str = "exact", timeout_s: float = 60.0,
                 startup_s: float = 120.0, launcher: str = "spawn", env: Optional[Mapping[str, str]] = None,
                 threads: Optional[int] = 1, owners: Optional[Sequence[str]] = None,
                 expect_fingerprint: Optional[str] = None) -> None:
        from ds4quant.runtime.owners.base import MODES
        from ds4quant.runtime.placement import Placement, read_placement

        if mode not in MODES:
            raise BadInputError(f"mode must be one of {', '.join(MODES)}, got {mode!r}", where="--mode")
        plc = placement if isinstance(placement, Placement) else read_placement(placement)
        if plc.ranks is None:
            raise BadInputError("placement has no ranks (plan it with ds4quant place --ranks N)",
                                where=str(placement))
        self.mode = mode
        self.n_ranks = int(plc.ranks.n_ranks)
        self.placement_sha256 = plc.content_sha256
        self.timeout_s = float(timeout_s)
        self.launcher = launcher
        self.ranks: tuple[dict, ...] = ()
        self.hidden = 0
        self.start_s = 0.0
        self._calls: list[tuple[float, float, float]] = []
        self._procs: list = []
        self._errs: list[Path] = []
        self._wire: Optional[_Wire] = None
        self._closed = False
        self._tmp = Path(tempfile.mkdtemp(prefix="ds4q-cluster-"))
        try:
            if isinstance(placement, Placement):  # the ranks read a file
                from ds4quant.runtime.placement import write_placement

                placement = write_placement(self._tmp / "placement.json", placement)
            self._start(str(artifact), str(placement), startup_s, env, threads, owners, expect_fingerprint)
        except BaseException:
            self._teardown()
            raise

    # -- start-up -------------------------------------------------------
    def _start(self, artifact, placement, startup_s, env, threads, owners, expect_fingerprint) -> None:
        from ds4quant.runtime.cluster.launch import start_ranks

        t0 = time.perf_counter()
        token = secrets.token_hex(16)  # proves the connecting process read our spec file
        srv = socket.create_server(("127.0.0.1", 0))
        try:
            job = {"artifact": artifact, "placement": placement, "mode": self.mode,
                   "owners": list(owners) if owners else None, "expect_fingerprint": expect_fingerprint}
            spec = {"serve": True, "jobs": [job], "backend": "gloo", "timeout_s": self.timeout_s,
                    "out_dir": str(self._tmp), "control": ["127.0.0.1", srv.getsockname()[1]], "token": token,
                    "keepalive_s": max(0.2, min(5.0, self.timeout_s / 4))}
            self._procs, self._errs = start_ranks(self._tmp, spec, self.n_ranks, launcher=self.launcher, env=env,
                                                  threads=threads)
            deadline = time.monotonic() + startup_s + self.timeout_s
            while self._wire is None:
                self._check_alive(deadline, "waiting for rank 0 to connect")
                r, _, _ = select.select([srv], [], [], 0.1)
                if not r:
                    continue
                conn, _ = srv.accept()
                wire = _Wire(conn)
                try:
                    if not wire.readable(self.timeout_s):
                        raise EOFError("no hello")
                    head, _ = wire.recv(self.timeout_s)
                except (EOFError, OSError, ValueError):
                    wire.close()
                    continue
                if head.get("op") == "hello" and hmac.compare_digest(str(head.get("token", "")), token):
                    self._wire = wire
                else:
                    wire.close()  # not ours
        finally:
            srv.close()
        head, _ = self._reply(deadline, "loading the shards")
        if head.get("op") != "ready":
            self._fail(f"rank 0 sent {head.get('op')!r} instead of ready")
        self.ranks = tuple(head["ranks"])
        self.hidden = int(head["hidden"])
        self.start_s = time.perf_counter() - t0

    def _check_alive(self, deadline: float, what: str) -> None:
        if any(p.poll() is not None for p in self._procs):
            self._fail(None)  # whatever exited, the others are given their grace, then named
        if time.monotonic() > deadline:
            self._fail(f"no answer from rank 0 while {what} within the deadline")

    def _reply(self, deadline: float, what: str) -> tuple[dict, list[bytes]]:
        """Rank 0's next message, or the failure of the group."""
        assert self._wire is not None
        while True:
            if self._wire.readable(0.1):
                try:
                    head, blobs = self._wire.recv(self.timeout_s)
                except (EOFError, OSError, ValueError):
                    self._fail(None)
                if head.get("op") == "error":
                    self._fail(str(head.get("error")))
                return head, blobs
            self._check_alive(deadline, what)

    # -- calls ----------------------------------------------------------
    def experts(self, layer: int):
        """torch.nn.Module with DeepseekV4Experts' call signature for ``layer``."""
        from ds4quant.runtime.experts import RuntimeExperts

        return RuntimeExperts(self, layer)

    def run_layer(self, layer: int, hidden, top_k_index, top_k_weights, shared=None) -> ClusterCall:
        """Routed experts of ``layer`` on the ranks: hidden f32 [T,H], top_k_index
        int64 [T,k], top_k_weights f32 [T,k] (torch) -> ``ClusterCall`` (out f32
        [T,H], the canonical combine of every slot, plus ``shared`` when given)."""
        import torch

        if self._closed:
            raise ClusterError("the cluster's ranks are gone (closed, or ended by an earlier failure)")
        x = np.ascontiguousarray(hidden.detach().to(torch.float32).cpu().numpy())
        idx = np.ascontiguousarray(top_k_index.detach().cpu().numpy().astype(np.int64))
        w = np.ascontiguousarray(top_k_weights.detach().to(torch.float32).cpu().numpy())
        if x.ndim != 2 or x.shape[1] != self.hidden or idx.ndim != 2 or idx.shape[0] != x.shape[0] \
                or w.shape != idx.shape:
            raise BadInputError(f"layer {layer}: hidden {x.shape} (width {self.hidden}), top_k_index {idx.shape} "
                                f"and top_k_weights {w.shape} must be [T, H], [T, k], [T, k]")
        T, K = idx.shape
        t0 = time.perf_counter()
        try:
            self._wire.send({"op": "call", "layer": int(layer), "T": T, "K": K}, [x, idx, w])
        except OSError:
            self._fail(None)
        # a call is bounded by the ranks' own collective timeouts; this catches rank 0 itself hanging
        head, blobs = self._reply(time.monotonic() + 2 * self.timeout_s + 10, f"computing layer {layer}")
        out = torch.from_numpy(np.frombuffer(blobs[0], dtype=np.float32).reshape(T, self.hidden).copy())
        wall = time.perf_counter() - t0
        self._calls.append((wall, float(head["compute_s"]), float(head["exchange_s"])))
        if shared is not None:  # as execute.combine: one fp32 add after the routed sum
            out = out + shared.to(torch.float32)
        return ClusterCall(out, wall, float(head["compute_s"]), float(head["exchange_s"]))

    def stats(self) -> dict:
        """Start-up and per-call figures (what starting once saves, and the exchange's share)."""
        walls = [c[0] for c in self._calls]
        return {"n_ranks": self.n_ranks, "launcher": self.launcher, "start_s": self.start_s, "calls": len(walls),
                "call_ms_mean": 1e3 * float(np.mean(walls)) if walls else 0.0,
                "call_ms_median": 1e3 * float(np.median(walls)) if walls else 0.0,
                "calls_s": float(sum(walls)), "rank0_compute_s": float(sum(c[1] for c in self._calls)),
                "rank0_exchange_s": float(sum(c[2] for c in self._calls)),
                "ranks": [{k: r[k] for k in ("rank", "expert_bytes_read", "share_bytes", "dense_bytes_read",
                                             "resident_bytes", "load_s")} for r in self.ranks]}

    # -- ending ---------------------------------------------------------
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Tell the ranks to stop, wait for them (a grace period), kill what is left, remove the folder."""
        if self._closed:
            return
        if self._wire is not None:
            try:
                self._wire.send({"op": "stop"})
            except OSError:
                pass
        from ds4quant.runtime.cluster.launch import grace_s

        until = time.monotonic() + grace_s(self.timeout_s)
        while any(p.poll() is None for p in self._procs) and time.monotonic() < until:
            time.sleep(0.02)
        self._teardown()

    def _teardown(self) -> None:
        from ds4quant.runtime.cluster.launch import _kill

        self._closed = True
        if self._wire is not None:
            self._wire.close()
        _kill(self._procs)
        shutil.rmtree(self._tmp, ignore_errors=True)

    def _fail(self, reason: Optional[str]):
        """End every rank and raise one ClusterError naming each one's part."""
        from ds4quant.runtime.cluster.launch import failure_lines, grace_s

        until = time.monotonic() + grace_s(self.timeout_s)
        while any(p.poll() is None for p in self._procs) and time.monotonic() < until:
            time.sleep(0.05)
        hung = [i for i, p in enumerate(self._procs) if p.poll() is None]
        from ds4quant.runtime.cluster.launch import _kill

        _kill(self._procs)
        lines = failure_lines(self._tmp, self._procs, self._errs, hung, self.launcher)
        if reason and not any(reason in ln for ln in lines):
            lines.insert(0, reason)
        self._teardown()
        raise ClusterError(f"cluster of {self.n_ranks} ranks failed: " +
                           ("; ".join(lines) if lines else "rank 0 closed the connection"))


# --------------------------------------------------------------------------
# the rank side (``cluster_rank.serve`` calls this for a spec with "serve")


def _connect(spec: dict) -> _Wire:
    host, port = spec["control"]
    sock = socket.create_connection((host, int(port)), timeout=float(spec.get("timeout_s", 60)))
    wire = _Wire(sock)
    wire.send({"op": "hello", "token": spec["token"]})
    return wire


def serve_calls(g, spec: dict, dog) -> int:
    """Open this rank's shard, then serve calls until the home says stop (or
    goes away). Rank 0 relays each call and replies; a failure on any rank is
    raised on every rank (rank 0 sends it to the home first)."""
    import torch

    from ds4quant.runtime.cluster.rank import open_shard

    job = spec["jobs"][0]
    mode = job.get("mode", "exact")
    rank, n = g.rank, g.size
    wire = _connect(spec) if rank == 0 else None
    keepalive_s = float(spec.get("keepalive_s", 5.0))
    shard = None
    home_gone = False
    if rank == 0:
        dog.orphan_dir = spec.get("out_dir")  # the home's folder, should the home die first
    try:
        shard = open_shard(g, job, mode, dog.beat)
        h = shard.view.header
        H = int(h.hidden)
        reports = g.gather_objects("ready", shard.report(rank, n, g.backend, mode))
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


def _serve_one(g, shard, wire, msg, L: int, T: int, K: int, H: int, mode: str) -> None:
    """One call on this rank: receive it, compute this rank's slots, exchange; rank 0 combines and replies."""
    import torch

    from ds4quant.runtime.cluster.rank import inject_fault, my_slots
    from ds4quant.runtime.execute import combine

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
        said = g.gather_objects(f"layer {L} errors", line)
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
