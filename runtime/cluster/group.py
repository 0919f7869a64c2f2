"""A persistent rank group: N ranks started once, serving every layer call; the
``Executor`` ``runtime.load`` returns for a rank placement.

    with runtime.load("out/art", "cluster.json", mode="exact") as grp:   # a RankGroup: starts the ranks
        model.model.layers[L].mlp.experts = grp.experts(L)               # transformers' experts call
        y = grp.run_layer(L, hidden, top_k_index, top_k_weights).out     # f32 [T, H]
        grp.ranks[1]["expert_bytes_read"], grp.stats()                   # what rank 1 read; call timings

``cluster.run_cluster_layers`` runs layers whose inputs are known up front;
a model's forward (verify's fidelity run) feeds each layer the last one's
output and calls the experts a few hundred times, and starting N processes
(imports, rendezvous, loading the shards: seconds) per call would dominate
it. So the ranks are started once, by the same launcher (``launch.start_ranks``:
spawn or torchrun, the rank entry of ``ds4quant run --ranks N``), and serve
calls (``serve``) until told to stop.

The caller (the "home": it holds the model and the artifact's dense tensors,
so routing and the shared expert run here, as in process) talks to rank 0
over one TCP connection on localhost (``wire``; a token from the spec file,
mode 0700 folder, proves it is the rank this group started).

A failed call (a rank's error, a rank that died or hung, the home gone) ends
every rank; the home raises one ``ClusterError`` line naming each rank's
part, kills by pid whatever is left after a grace period and removes the
temporary folder. gloo talks TCP: nothing is put in shared memory.
"""

from __future__ import annotations

import hmac
import secrets
import select
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np

from ds4quant.errors import BadInputError
from ds4quant.runtime.cluster.launch import ClusterError, failure_lines, grace_s, kill_ranks, start_ranks
from ds4quant.runtime.cluster.wire import Wire
from ds4quant.runtime.executor import Executor, call_figures
from ds4quant.runtime.mode import Mode
from ds4quant.runtime.placement import Placement, write_placement

__all__ = ["RankGroup", "ClusterCall", "ClusterOptions"]


@dataclass(frozen=True, eq=False)
class ClusterCall:
    """One layer call's result: the combined routed output and its timings (rank 0's)."""

    out: object  # torch.Tensor [T, H] float32
    wall_s: float
    compute_s: float
    exchange_s: float


@dataclass(frozen=True)
class ClusterOptions:
    """How ``runtime.load`` starts the ranks of a rank placement.

    timeout_s: the ranks' collective timeout (a dead or hung peer fails a call
    within about this); startup_s: extra time for imports, rendezvous and
    loading; launcher: spawn | torchrun; env: variables added to each rank's
    environment; threads: each rank's thread count; owners: each rank's local
    owner names (``{local_rank}`` substituted; default the placement's)."""

    timeout_s: float = 60.0
    startup_s: float = 120.0
    launcher: str = "spawn"
    env: Optional[Mapping[str, str]] = None
    threads: Optional[int] = 1
    owners: Optional[Sequence[str]] = None


class RankGroup(Executor):
    """The ranks of a rank placement over an artifact, started once and serving
    every ``run_layer`` call until ``close`` (an ``Executor``; ``runtime.load``
    makes it for a placement that records ranks).

    view: the home's open artifact view (the ranks open the same artifact and
    check its fingerprint: ``expect_fingerprint``, by default the view's);
    own_view: close the view with the group; placement: a rank placement
    (``ds4quant place --ranks N``), whose n_ranks ranks are started;
    options: ``ClusterOptions``."""

    def __init__(self, view, placement: Placement, mode: Mode = Mode.EXACT, *, own_view: bool = False,
                 options: ClusterOptions = ClusterOptions(), expect_fingerprint: Optional[str] = None) -> None:
        if placement.ranks is None:
            raise BadInputError("placement has no ranks (plan it with ds4quant place --ranks N)", where="placement")
        self.view = view
        self._own_view = own_view
        self.placement = placement
        self.mode = Mode(mode)
        self.n_ranks = int(placement.ranks.n_ranks)
        self.placement_sha256 = placement.content_sha256
        self.timeout_s = float(options.timeout_s)
        self.launcher = options.launcher
        self.ranks: tuple[dict, ...] = ()
        self.hidden = 0
        self.start_s = 0.0
        self._calls: list[tuple[float, float, float]] = []
        self._procs: list = []
        self._errs: list[Path] = []
        self._wire: Optional[Wire] = None
        self._closed = False
        self._tmp = Path(tempfile.mkdtemp(prefix="ds4q-cluster-"))
        try:
            path = write_placement(self._tmp / "placement.json", placement)  # the ranks read a file
            fp = expect_fingerprint if expect_fingerprint is not None else view.fingerprint()
            self._start(str(view.layout.path), str(path), options, fp)
        except BaseException:
            self._teardown()
            raise

    # -- start-up -------------------------------------------------------
    def _start(self, artifact: str, placement: str, options: ClusterOptions, expect_fingerprint: str) -> None:
        t0 = time.perf_counter()
        token = secrets.token_hex(16)  # proves the connecting process read our spec file
        srv = socket.create_server(("127.0.0.1", 0))
        try:
            job = {"artifact": artifact, "placement": placement, "mode": self.mode.value,
                   "owners": list(options.owners) if options.owners else None,
                   "expect_fingerprint": expect_fingerprint,
                   # runtime.load checked the files at home (or was told not to); the ranks read the same
                   "verify_payloads": False}
            spec = {"serve": True, "jobs": [job], "backend": "gloo", "timeout_s": self.timeout_s,
                    "out_dir": str(self._tmp), "control": ["127.0.0.1", srv.getsockname()[1]], "token": token,
                    "keepalive_s": max(0.2, min(5.0, self.timeout_s / 4))}
            self._procs, self._errs = start_ranks(self._tmp, spec, self.n_ranks, launcher=self.launcher,
                                                  env=options.env, threads=options.threads)
            deadline = time.monotonic() + options.startup_s + self.timeout_s
            while self._wire is None:
                self._check_alive(deadline, "waiting for rank 0 to connect")
                r, _, _ = select.select([srv], [], [], 0.1)
                if not r:
                    continue
                conn, _ = srv.accept()
                wire = Wire(conn)
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
    def run_layer(self, layer: int, hidden, top_k_index, top_k_weights, shared=None) -> ClusterCall:
        """Routed experts of ``layer`` on the ranks: hidden f32 [T,H], top_k_index
        int64 [T,k], top_k_weights f32 [T,k] (torch) -> ``ClusterCall`` (out f32
        [T,H], the canonical combine of every slot, plus ``shared`` when given)."""
        import torch

        if self._closed:
            raise ClusterError("the cluster's ranks are gone (closed, or ended by an earlier failure)")
        self.check_layer(layer)
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
        calls = call_figures([c[0] for c in self._calls])
        return {"n_ranks": self.n_ranks, "launcher": self.launcher, "start_s": self.start_s, "calls": calls["calls"],
                "call_ms_mean": calls["call_ms_mean"], "call_ms_median": calls["call_ms_median"],
                "calls_s": calls["calls_s"], "rank0_compute_s": float(sum(c[1] for c in self._calls)),
                "rank0_exchange_s": float(sum(c[2] for c in self._calls)),
                "ranks": [{k: r[k] for k in ("rank", "expert_bytes_read", "share_bytes", "dense_bytes_read",
                                             "resident_bytes", "load_s")} for r in self.ranks]}

    def resident_bytes(self) -> dict[str, int]:
        """Expert (and decode-table) bytes per rank and owner ("rank 1 cpu:0")."""
        return {f"rank {r['rank']} {o}": int(b) for r in self.ranks for o, b in r["resident_bytes"].items()}

    # -- ending ---------------------------------------------------------
    def close(self) -> None:
        """Tell the ranks to stop, wait for them (a grace period), kill what is left, remove the
        folder; then close the home's view when the group owns it."""
        if not self._closed:
            if self._wire is not None:
                try:
                    self._wire.send({"op": "stop"})
                except OSError:
                    pass
            until = time.monotonic() + grace_s(self.timeout_s)
            while any(p.poll() is None for p in self._procs) and time.monotonic() < until:
                time.sleep(0.02)
            self._teardown()  # an earlier failure has done this already
        if self._own_view:
            self._own_view = False
            self.view.close()

    def _teardown(self) -> None:
        self._closed = True
        if self._wire is not None:
            self._wire.close()
        kill_ranks(self._procs)
        shutil.rmtree(self._tmp, ignore_errors=True)

    def _fail(self, reason: Optional[str]):
        """End every rank and raise one ClusterError naming each one's part."""
        until = time.monotonic() + grace_s(self.timeout_s)
        while any(p.poll() is None for p in self._procs) and time.monotonic() < until:
            time.sleep(0.05)
        hung = [i for i, p in enumerate(self._procs) if p.poll() is None]
        kill_ranks(self._procs)
        lines = failure_lines(self._tmp, self._procs, self._errs, hung, self.launcher)
        if reason and not any(reason in ln for ln in lines):
            lines.insert(0, reason)
        self._teardown()
        raise ClusterError(f"cluster of {self.n_ranks} ranks failed: " +
                           ("; ".join(lines) if lines else "rank 0 closed the connection"))
