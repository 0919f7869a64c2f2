"""The rank side of the expert-parallel cluster (see ``runtime.cluster``).

One process per rank, started by ``torchrun`` or by ``cluster.launch``
(the same environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).
Per job (artifact + rank placement):

1. rendezvous: every rank opens the artifact and the placement, and the
   ranks all_gather (status, artifact fingerprint, placement sha256); any
   local failure or any difference is the same clear error on every rank;
2. load: ``runtime.load`` on a counting view with the rank's placement
   (its own and the replicated experts on its local owners, the rest
   ``none``), so it reads and registers exactly its experts;
3. per layer: routing on every rank from the same inputs (its sha256 is
   all_gathered and compared), each rank runs the slots ``slot_ranks``
   gives it and the shared expert of token rows t % N == rank, the
   per-slot and shared outputs are all_gathered (one padded buffer per
   rank, its last row a status flag so a rank that failed is named), and
   every rank combines all slots in canonical order with
   ``execute.combine``. Fast mode all_reduces per-rank partial sums.

A peer that dies makes the collectives raise (gloo: connection closed, or
the process-group timeout); a watchdog thread ends a rank that makes no
progress for twice the timeout or whose launcher is gone. Library code:
nothing here prints (the process entry is ``entry``).
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ds4quant import names
from ds4quant.errors import BadInputError, Ds4quantError, IntegrityError
from ds4quant.runtime.cluster.launch import ClusterError
from ds4quant.runtime.mode import Mode

FAULT_ENV = "DS4QUANT_CLUSTER_FAULT"  # "RANK:LAYER:kill|hang|raise" (tests inject a rank failure mid-layer)


# --------------------------------------------------------------------------
# the counting view: what a rank reads


class CountingView:
    """Wraps an ArtifactView and counts the tensor bytes a rank asks for:
    expert rows through ``expert_data`` and decoded dense tensors (each read
    once: decoded dense tensors are cached, so a layer's router and shared
    expert are not re-read every call)."""

    def __init__(self, view) -> None:
        self._v = view
        self.expert_bytes = 0
        self.expert_reads: list[tuple[str, tuple[int, ...]]] = []
        self.dense_bytes = 0
        self._dense: dict[str, np.ndarray] = {}

    def __getattr__(self, name: str):
        return getattr(self._v, name)

    def expert_data(self, stack_name: str, ids=None):
        a = self._v.expert_data(stack_name, ids)
        self.expert_bytes += int(a.nbytes)
        self.expert_reads.append((stack_name, tuple(int(e) for e in (ids if ids is not None else ()))))
        return a

    def tensor_data(self, name: str):
        a = self._v.tensor_data(name)
        if names.parse_stack(name) is not None:
            self.expert_bytes += int(a.nbytes)  # a whole stack: counted against the rank's share
        else:
            self.dense_bytes += int(a.nbytes)
        return a

    def dense(self, name: str):
        if name not in self._dense:
            self._dense[name] = self._v.dense(name)
            self.dense_bytes += int(self._v.tensor(name).nbytes)
        return self._dense[name]

    def close(self) -> None:
        self._dense.clear()
        self._v.close()


# --------------------------------------------------------------------------
# collectives with clear errors


class Group:
    def __init__(self, backend: str, timeout_s: float, device) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.backend = backend
        self.timeout_s = timeout_s
        self.device = device  # where collective tensors live (cuda:N for NCCL)

    def _call(self, what: str, fn, *a):
        try:
            return fn(*a)
        except Ds4quantError:
            raise
        except Exception as e:  # gloo/NCCL raise RuntimeError/DistBackendError subclasses
            msg = " ".join(str(e).split())[:300]
            raise ClusterError(f"rank {self.rank}: {what} failed: a peer rank died, hung or left "
                               f"(timeout {self.timeout_s:g}s): {type(e).__name__}: {msg}") from None

    def gather_json(self, what: str, obj) -> list:
        """Every rank's ``obj`` (JSON values: tuples come back as lists, keys as
        strings), exchanged as uint8 tensors of its JSON text: ranks never send
        each other pickles (all_gather_object would unpickle whatever a peer,
        or anyone who reached the store, sent; docs/cluster-security.md)."""
        import json

        import torch

        raw = json.dumps(obj, default=str, separators=(",", ":")).encode()
        sizes = self.all_gather(what, torch.tensor([len(raw)], dtype=torch.int64, device=self.device))
        m = max(int(s.item()) for s in sizes)
        buf = torch.zeros(max(m, 1), dtype=torch.uint8)
        buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else buf[:0]
        parts = self.all_gather(what, buf.to(self.device))
        return [json.loads(bytes(p.cpu()[: int(s.item())].numpy().tobytes())) for p, s in zip(parts, sizes)]

    def all_gather(self, what: str, t) -> list:
        import torch

        out = [torch.empty_like(t) for _ in range(self.size)]
        self._call(what, self.dist.all_gather, out, t)
        return out

    def broadcast(self, what: str, t, src: int = 0):
        self._call(what, self.dist.broadcast, t, src)
        return t

    def all_reduce(self, what: str, t):
        self._call(what, self.dist.all_reduce, t)
        return t


def _agree(g: Group, what: str, err: Optional[BaseException], payload) -> list:
    """All ranks exchange (error line or None, payload); any rank's error is raised on every rank."""
    line = None if err is None else (err.one_line() if isinstance(err, Ds4quantError) else
                                     f"{type(err).__name__}: {err}")
    got = g.gather_json(what, [line, payload])
    bad = [(r, m) for r, (m, _) in enumerate(got) if m is not None]
    if bad:
        if err is not None and isinstance(err, Ds4quantError):
            raise err
        raise ClusterError(f"{what}: " + "; ".join(f"rank {r}: {m}" for r, m in bad)) from err
    return [p for _, p in got]


# --------------------------------------------------------------------------
# watchdog


class Watchdog:
    """Ends this rank (exit 3, one line on stderr) if no progress is made for
    ``idle_s`` seconds or the launching parent process, or the home process
    that ``store.HOME_ENV`` names (torchrun's ranks are torchrun's children), is
    gone, removing the run's folder (``orphan_dir``) in the second case; a hang
    outside a collective (or inside one with no timeout) cannot outlive it.
    (Peers of a hung rank fail sooner, at their collective timeout.)"""

    def __init__(self, idle_s: float, rank: int) -> None:
        self.idle_s = float(idle_s)
        self.rank = rank
        self._last = time.monotonic()
        self._ppid = os.getppid()
        self._stop = threading.Event()
        self.orphan_dir: Optional[str] = None  # removed when the launcher dies without cleaning up
        self._t = threading.Thread(target=self._run, name="ds4q-cluster-watchdog", daemon=True)
        self._t.start()

    def beat(self) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        from ds4quant.runtime.cluster.store import HOME_ENV, home_alive

        home = os.environ.get(HOME_ENV)
        while not self._stop.wait(0.5):
            why = None
            if os.getppid() != self._ppid:
                why = "its launcher exited"
            elif home and not home_alive(home):
                why = "the process that started the cluster exited"
            elif time.monotonic() - self._last > self.idle_s:
                why = f"no progress for {self.idle_s:g}s (hung)"
            if why:
                if self.orphan_dir and not why.startswith("no progress"):
                    import shutil

                    shutil.rmtree(self.orphan_dir, ignore_errors=True)
                sys.stderr.write(f"ds4quant: error: cluster rank {self.rank}: {why}; exiting\n")
                sys.stderr.flush()
                os._exit(3)


# --------------------------------------------------------------------------
# one job on this rank


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def _fault(rank: int, layer: int) -> Optional[str]:
    spec = os.environ.get(FAULT_ENV, "")
    parts = spec.split(":")
    if len(parts) == 3 and parts[0] == str(rank) and parts[1] == str(layer):
        return parts[2]
    return None


def _local_placement(plc, rank: int, local_owners: tuple[str, ...]):
    """Rank ``rank``'s experts (own + replicated) over its local owners
    (interleaved), the rest ``none``."""
    if len(local_owners) == 1:
        return plc.for_rank(rank, owner=local_owners[0])
    from ds4quant.runtime.placement import Placement

    own = plc.for_rank(rank)
    n = len(local_owners)
    return Placement.build(plc.n_layer, plc.n_expert, plc.n_expert_used, local_owners,
                           [[own.experts[L][0][j::n] for j in range(n)] for L in range(plc.n_layer)],
                           own.none, artifact=plc.artifact)


@dataclass
class Shard:
    """What one rank holds for a job: its counting view, runtime and placement."""

    view: CountingView
    rt: object  # runtime.Runtime over for_rank's placement
    plc: object  # the rank Placement
    fingerprint: str
    placement_sha256: str
    share_bytes: int
    load_s: float

    def close(self) -> None:
        try:
            self.rt.close()  # an open view given to load stays open: closed below
        finally:
            self.view.close()

    def report(self, rank: int, n: int, backend: str, mode: Mode) -> dict:
        h, rt = self.view.header, self.rt
        return {"rank": rank, "n_ranks": n, "backend": backend, "mode": mode.value, "fingerprint": self.fingerprint,
                "placement_sha256": self.placement_sha256, "owners": list(rt.owners), "load_s": self.load_s,
                "experts": [sorted(int(e) for o in rt.owners.values() for e in o.experts(L)) for L in range(h.n_layer)],
                "expert_bytes_read": self.view.expert_bytes, "share_bytes": self.share_bytes,
                "dense_bytes_read": self.view.dense_bytes, "resident_bytes": rt.resident_bytes(),
                "tables": _tables(rt)}


def _tables(rt) -> dict:
    """{owner: {MIX tensor: expert ids registered}}: the decode tables this rank holds."""
    out = {}
    for name, o in rt.owners.items():
        reg = getattr(o, "registry", None)
        if reg is not None:
            out[name] = {t: [int(e) for e in reg.expert_ids(t)] for t in reg.registered()}
    return out


def open_shard(g: Group, job: dict, mode: Mode, beat=lambda: None) -> Shard:
    """Rendezvous (fingerprint and placement hash agree on every rank, and with
    ``job["expect_fingerprint"]`` when given) and load this rank's experts.
    Any rank's failure is raised on every rank."""
    from ds4quant import runtime
    from ds4quant.artifact.view import open_artifact
    from ds4quant.runtime.placement import Placement, read_placement

    rank, n = g.rank, g.size
    view = rt = None
    try:
        err, fp, psha, plc = None, None, None, None
        try:
            view = CountingView(open_artifact(job["artifact"]))
            fp = view.fingerprint()
            p = job["placement"]
            plc = p if isinstance(p, Placement) else read_placement(p)
            psha = plc.content_sha256
            if plc.ranks is None:
                raise BadInputError("placement has no ranks (plan it with ds4quant place --ranks N)",
                                    where=str(job["placement"]))
            if plc.ranks.n_ranks != n:
                raise BadInputError(f"placement is for {plc.ranks.n_ranks} ranks, this cluster has {n}",
                                    where=str(job["placement"]))
            plc.check_matches(view.header.n_layer, view.header.n_expert, fp, where=str(job["placement"]))
            want = job.get("expect_fingerprint")
            if want is not None and want != fp:
                raise IntegrityError(f"artifact fingerprint {fp[:23]}... is not the caller's {want[:23]}...",
                                     where=str(job["artifact"]), hint="the caller and every rank must open the same artifact")
        except Exception as e:  # every rank must hear of it, or the others wait at the gather
            err = e
        got = _agree(g, "rendezvous", err, (fp, psha))
        for what, k in (("artifact fingerprint", 0), ("placement sha256", 1)):
            vals = [x[k] for x in got]
            if len(set(vals)) != 1:
                raise IntegrityError(f"{what} differs across ranks: " +
                                     ", ".join(f"rank {r} {v[:23]}" for r, v in enumerate(vals)),
                                     where=f"rank {rank}", hint="give every rank the same artifact and placement")
        beat()
        # this rank's shard
        err = None
        local = tuple(o.replace("{local_rank}", os.environ.get("LOCAL_RANK", str(rank)))
                      for o in (job.get("owners") or (plc.owners[0],)))
        t0 = time.perf_counter()
        try:
            # one rank per node hashes the files it reads (ranks of a node read the same
            # files); a home that checked them already says so in the job
            verify = bool(job.get("verify_payloads", True)) and os.environ.get("LOCAL_RANK", str(rank)) == "0"
            rt = runtime.load(view, placement=_local_placement(plc, rank, local), mode=mode,
                              verify_payloads=verify)
        except Exception as e:
            err = e
        _agree(g, "load", err, None)
        load_s = time.perf_counter() - t0
        beat()
        h = view.header
        nb = view.expert_nbytes()
        share = int(sum(int(nb[L, e]) for L in range(h.n_layer) for e in range(h.n_expert)
                        if plc.ranks.owner[L][e] in (rank, -1)))
        return Shard(view, rt, plc, fp, psha, share, load_s)
    except BaseException:
        if rt is not None:
            rt.close()
        if view is not None:
            view.close()
        raise


def inject_fault(rank: int, layer: int) -> None:
    """The test hook (FAULT_ENV): this rank dies, hangs or raises on ``layer``."""
    fault = _fault(rank, layer)
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "hang":
        time.sleep(10 ** 6)
    elif fault == "raise":
        raise BadInputError(f"injected failure on layer {layer}", where=f"rank {rank}")


def my_slots(rt, rank: int, layer: int, xs: np.ndarray, flat: np.ndarray, tok_of: np.ndarray,
             mine_sel: np.ndarray, mode: Mode) -> np.ndarray:
    """This rank's slots ``mine_sel`` (indices into the flat [T*K] slots) of
    ``layer``: f32 [len(mine_sel), H], each owner's branch on the runtime's pool."""
    from ds4quant.runtime.execute import NONE

    y = np.zeros((mine_sel.shape[0], xs.shape[1]), np.float32)
    table = rt.tables[layer]
    who = np.asarray(table, dtype=object)[flat[mine_sel]] if mine_sel.size else np.zeros(0, object)
    if np.any(who == NONE):
        bad = sorted({int(e) for e in flat[mine_sel][who == NONE]})
        raise BadInputError(f"layer {layer}: this rank computes slots of experts {bad} it does not hold",
                            where=f"rank {rank}")
    owners = rt.owners

    def branch(o):
        s = np.nonzero(who == o)[0]
        return s, owners[o].run_slots(layer, xs[tok_of[mine_sel[s]]], flat[mine_sel[s]], mode)

    futs = [rt._pool.submit(branch, o) for o in sorted({str(o) for o in who})]
    for f in futs:
        s, ys = f.result()
        y[s] = np.asarray(ys, dtype=np.float32)
    return y


def run_job(g: Group, job: dict, inputs: dict, dog: Optional[Watchdog] = None) -> dict:
    """Run one job on this rank; returns {outputs: {L: f32 [T,H]}, report: dict}.

    job: artifact, placement (path), mode, layers (None = all), owners
    (local owner names, ``{local_rank}`` substituted; default the
    placement's owner), route (broadcast: rank 0 routes | local: every
    rank routes, digests compared), holdings (report held-byte digests).
    inputs: hidden {L: f32 [T,H]} or hidden_all f32 [T,H]; token_ids int64
    [T]; routing {L: (idx, w)} optional."""
    import torch

    from ds4quant.runtime.execute import combine

    beat = dog.beat if dog is not None else (lambda: None)
    rank, n = g.rank, g.size
    mode = Mode(job.get("mode", Mode.EXACT))  # the launcher parsed it
    shard = open_shard(g, job, mode, beat)
    try:
        view, rt, plc = shard.view, shard.rt, shard.plc
        h = view.header
        layers = job.get("layers") or list(range(h.n_layer))
        tok = torch.as_tensor(np.asarray(inputs["token_ids"], dtype=np.int64))
        outputs, timings = {}, []
        for L in layers:
            L = int(L)
            beat()
            x = inputs["hidden"][L] if "hidden" in inputs else inputs["hidden_all"]
            x = torch.as_tensor(np.asarray(x, dtype=np.float32))
            T, H = x.shape
            t_start = time.perf_counter()
            K = int(h.n_expert_used)
            if inputs.get("routing") and L in inputs["routing"]:
                idx_np, w_np = inputs["routing"][L]
                idx = torch.as_tensor(np.asarray(idx_np, dtype=np.int64))
                w = torch.as_tensor(np.asarray(w_np, dtype=np.float32))
                K = idx.shape[1]
            elif job.get("route", "broadcast") == "broadcast":
                # rank 0 routes and sends it: the router's float32 matmul depends on BLAS and
                # thread count, so ranks on different hardware could otherwise disagree
                buf = torch.zeros((T, 2 * K), dtype=torch.float64)
                if rank == 0:
                    i0, w0 = rt.route(L, x, tok)
                    buf[:, :K], buf[:, K:] = i0.to(torch.float64), w0.to(torch.float64)  # both exact in f64
                buf = g.broadcast(f"layer {L} routing", buf.to(g.device)).cpu()
                idx, w = buf[:, :K].to(torch.int64), buf[:, K:].to(torch.float32)
            else:  # every rank routes; the digests must agree
                idx, w = rt.route(L, x, tok)
                mine = _digest(idx.numpy().astype(np.int64)) + _digest(w.numpy().astype(np.float32))
                dig = torch.frombuffer(bytearray(bytes.fromhex(mine)), dtype=torch.uint8).to(g.device)
                alld = g.all_gather(f"layer {L} routing check", dig)
                if any(not torch.equal(d, alld[0]) for d in alld):
                    raise IntegrityError(f"layer {L}: routing differs across ranks (the inputs, the router "
                                         "tensors or their BLAS differ; use route=broadcast)", where=f"rank {rank}")
            t_route = time.perf_counter()
            sr = plc.slot_ranks(L, idx.numpy()).reshape(-1)
            flat = idx.numpy().reshape(-1).astype(np.int64)
            tok_of = np.repeat(np.arange(T), K)
            counts = np.bincount(sr, minlength=n)
            mine_sel = np.nonzero(sr == rank)[0]
            xs = x.numpy()
            my_rows = np.arange(rank, T, n)
            ms = (T + n - 1) // n
            shared = torch.zeros((T, H), dtype=torch.float32)
            sh_mine = torch.zeros((0, H), dtype=torch.float32)
            err, y = None, np.zeros((mine_sel.shape[0], H), np.float32)
            try:
                inject_fault(rank, L)
                y = my_slots(rt, rank, L, xs, flat, tok_of, mine_sel, mode)
                # the shared expert, split by token rows (t % N): exact mode's value of a row does
                # not depend on its batch, so the split keeps the one-process bytes
                if my_rows.size:
                    sh_mine = rt.shared(L, x[torch.from_numpy(my_rows)])
            except Exception as e:
                err = e
            t_comp = time.perf_counter()
            if mode is Mode.EXACT:
                m = int(counts.max()) if counts.size else 0
                buf = torch.zeros((m + ms + 1, H), dtype=torch.float32)
                if err is None:
                    buf[: y.shape[0]] = torch.from_numpy(y)
                    buf[m:m + my_rows.size] = sh_mine
                buf[m + ms, 0] = 0.0 if err is None else 1.0
                parts = [p.cpu() for p in g.all_gather(f"layer {L} exchange", buf.to(g.device))]
                failed = [r for r in range(n) if float(parts[r][m + ms, 0]) != 0.0]
            else:
                part = torch.zeros((T + 1, H), dtype=torch.float32)
                if err is None and y.shape[0]:
                    terms = w.reshape(-1)[torch.from_numpy(mine_sel)][:, None] * torch.from_numpy(y)
                    part[:T].index_add_(0, torch.from_numpy(tok_of[mine_sel]), terms)
                if err is None and my_rows.size:
                    part[torch.from_numpy(my_rows)] += sh_mine
                part[T, 0] = 0.0 if err is None else 1.0
                red = g.all_reduce(f"layer {L} exchange", part.to(g.device)).cpu()
                failed = [] if float(red[T, 0]) == 0.0 else ["?"]
            t_x = time.perf_counter()
            if err is not None:
                raise err
            if failed:
                raise ClusterError(f"layer {L}: rank(s) {failed} failed computing their slots (see their errors)",
                                   where=f"rank {rank}")
            if mode is Mode.EXACT:
                slots = torch.zeros((T * K, H), dtype=torch.float32)
                for r in range(n):
                    sel = torch.from_numpy(np.nonzero(sr == r)[0])
                    slots[sel] = parts[r][: int(counts[r])]
                    rows = torch.from_numpy(np.arange(r, T, n))
                    shared[rows] = parts[r][m:m + rows.shape[0]]
                out = combine(w, slots.reshape(T, K, H), shared=shared)
            else:
                out = red[:T]
            t_end = time.perf_counter()
            outputs[L] = out.numpy()
            timings.append({"layer": L, "sha256": _digest(outputs[L].astype(np.float32)),
                            "slots": int(mine_sel.shape[0]), "route_s": t_route - t_start,
                            "compute_s": t_comp - t_route, "exchange_s": t_x - t_comp,
                            "combine_s": t_end - t_x, "total_s": t_end - t_start})
        report = {**shard.report(rank, n, g.backend, mode), "layers": timings}
        if job.get("holdings"):
            report["holdings"] = _holdings(rt, h.n_layer)
        return {"outputs": outputs, "report": report}
    finally:
        shard.close()


def _holdings(rt, n_layer: int) -> dict:
    """{layer: {owner: {expert: {proj: sha256 of held bytes}}}} (identity checks)."""
    out: dict = {}
    for L in range(n_layer):
        out[L] = {}
        for name, o in rt.owners.items():
            out[L][name] = {int(e): {p: _digest(np.asarray(o.held_bytes(L, p, int(e))))[:32]
                                     for p in ("gate", "up", "down")} for e in o.experts(L)}
    return out
