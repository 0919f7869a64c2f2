"""The worker-process owner: another owner hosted in a child process.

CUDA and ROCm builds of torch cannot share one process, so on a mixed host
the second vendor's owner lives in a child started by the runtime (no
daemon), possibly under another interpreter (``python=``, the CLI's
``--worker-python PATH``; it must have ds4quant installed). Linux only.

Wire protocol (the child is our own code, so frames are pickles):

* control: the child's stdin/stdout pipes carry frames of an 8-byte
  little-endian length then a pickle (protocol 5). Every request gets one
  reply: ``("ok", result)`` or ``("err", type, message, where, traceback)``.
  The child moves its frame descriptors aside at start and points fd 1 at
  stderr, so a stray print in the hosted owner cannot corrupt a frame.
* descriptors: a Unix socket passed to the child carries the shared-memory
  segments (``runtime.arena``): the expert bytes of each ``add_stack``
  (the child keeps that mapping as the resident data: one copy, no pipe
  traffic) and the two arenas of ``run_slots``.
* ``run_slots``: the primary writes x and the expert ids into the input
  arena, sends one small frame, waits once, copies the output out of the
  output arena. An arena too small for a batch is replaced by a bigger one
  first (one extra round trip, only on growth).

Failure: every wait has a deadline (``timeout_s``) and polls the pipe, so a
child that dies, hangs or raises becomes a ``WorkerError`` naming the call,
the child's pid and exit status or its exception in one line (the full
traceback on ``.remote_traceback``). After any failure the worker is killed,
reaped and its arenas released; the owner is closed and the caller's process
keeps working. The child exits on its own when its stdin closes (the primary
died) or a reply cannot be written.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from ds4quant.errors import BadInputError, ShapeError, WorkerError
from ds4quant.runtime.arena import Arena, SharedBuffer, send_fd
from ds4quant.runtime.mode import Mode
from ds4quant.runtime.owners.base import ExpertStack
from ds4quant.runtime.owners.kinds import OwnerKind, OwnerName, make_owner

PICKLE_PROTOCOL = 5
MAX_FRAME = 1 << 31
_HEADER = struct.Struct("<Q")
_CHUNK = 1 << 20
_ALIGN = 64


def owner_for(name: OwnerName, *, identity: str, **options) -> "WorkerOwner":
    """The owner of a ``worker:N`` (hosting a CPU owner) or ``worker:N/OWNER`` name
    (``owners/kinds.py``'s registry); options go to the hosted owner."""
    if name.kind is OwnerKind.WORKER_HOSTED:
        return WorkerOwner(identity=identity, owner=str(name.hosted), inner_identity=identity, **options)
    return WorkerOwner(identity=identity, **options)


def owner_class(path: str):
    """The owner class a ``"package.module:Class"`` path names (a plug-in owner a
    worker hosts, e.g. the tests' fake)."""
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise BadInputError(f"unknown owner {path!r}", where="worker owner",
                            hint="use an owner name (cpu, cpu:N, torch-cpu:N, cuda:N, hip:N) or a "
                                 "'package.module:Class' path")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def hosted_name(spec: str) -> Optional[OwnerName]:
    """The owner name ``spec`` spells, or None for a ``"package.module:Class"`` path;
    a name a worker cannot host (a worker) is refused."""
    try:
        name = OwnerName.parse(spec)
    except BadInputError:
        return None
    if not name.kind.hostable:
        raise BadInputError(f"owner {spec!r} cannot be hosted by a worker process (cpu, cpu:N, torch-cpu:N, "
                            "cuda:N, hip:N)", where="worker owner")
    return name


def hosted_owner(spec: str, identity: str, kwargs: dict):
    """Construct the owner a worker hosts, with runtime identity ``identity``: an owner
    name through the owner-kind registry, or a plug-in class (given ``identity``
    when its constructor takes one)."""
    name = hosted_name(spec)
    if name is not None:
        return make_owner(name, identity=identity, **kwargs)
    cls = owner_class(spec)
    kwargs = dict(kwargs)
    if "identity" not in kwargs:
        try:
            params = inspect.signature(cls).parameters
        except (TypeError, ValueError):
            params = {}
        if "identity" in params:
            kwargs["identity"] = identity
    return cls(**kwargs)


def ids_offset(n: int, hidden: int) -> int:
    """Byte offset of the int64 expert ids after the float32 rows in the input arena."""
    return -(-n * hidden * 4 // _ALIGN) * _ALIGN


def encode_frame(obj) -> bytes:
    body = pickle.dumps(obj, protocol=PICKLE_PROTOCOL)
    return _HEADER.pack(len(body)) + body


class _Gone(Exception):
    """The child closed its pipe (died or exited)."""


class _Late(Exception):
    """The deadline passed."""


def _signal_name(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class _Connection:
    """The primary's side of one child: process, pipes, socket, arenas.

    Holds no reference to the WorkerOwner, so ``weakref.finalize`` can shut
    it down when the owner is collected or the interpreter exits.
    """

    def __init__(self, identity: str, python: str, timeout_s: float, env: dict | None):
        self.identity = identity
        self.timeout_s = timeout_s
        self.closed = False
        self.failure: str | None = None
        self.arenas = {"in": Arena("in"), "out": Arena("out")}
        # stderr goes to a nameless temp file: never a pipe to drain, and its
        # tail explains a child that died before it could reply.
        self.stderr = tempfile.TemporaryFile()
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock = parent_sock
        try:
            self.proc = subprocess.Popen(
                [python, "-m", "ds4quant.runtime.owners.worker_main", "--fd-socket", str(child_sock.fileno())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.stderr,
                pass_fds=(child_sock.fileno(),),
                close_fds=True,
                env=None if env is None else {**os.environ, **env},
            )
        except OSError as e:
            parent_sock.close()
            self.stderr.close()
            self.closed = True
            raise WorkerError(
                f"cannot start the worker interpreter {python!r}: {e.strerror or e}",
                where=identity,
                hint="--worker-python must name an existing Python with ds4quant installed",
                op="start",
            ) from e
        finally:
            child_sock.close()
        self.wfd = self.proc.stdin.fileno()
        self.rfd = self.proc.stdout.fileno()
        os.set_blocking(self.wfd, False)
        self.out_poll = select.poll()
        self.out_poll.register(self.wfd, select.POLLOUT)
        self.in_poll = select.poll()
        self.in_poll.register(self.rfd, select.POLLIN | select.POLLHUP | select.POLLERR)

    # -- one request, one reply ------------------------------------------------

    def require_open(self, op: str) -> None:
        if self.closed:
            raise WorkerError(
                f"{op} on a closed worker" + (f" (it failed earlier: {self.failure})" if self.failure else ""),
                where=self.identity,
                hint="start a new WorkerOwner",
                op=op,
            )

    def call(self, op: str, payload: Any = None, fd: int | None = None, timeout_s: float | None = None,
             sent=None):
        self.require_open(op)
        try:
            frame = encode_frame((op, payload))
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            # Nothing was sent, so the connection is still good.
            raise BadInputError(f"cannot send {op} to the worker: {e}", where=self.identity) from e
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        try:
            if fd is not None:
                try:
                    send_fd(self.sock, fd)
                except (BrokenPipeError, ConnectionResetError):
                    raise _Gone from None
            self._write(frame, deadline)
            if sent is not None:
                sent()  # the request is on its way (overlapped submission's readiness)
            reply = self._read_frame(deadline)
        except _Gone:
            raise self._fail(op, self._death_message(op)) from None
        except _Late:
            raise self._fail(op, f"worker process {self.proc.pid} did not answer {op} within {limit:g} s; killed it") from None
        except (OSError, pickle.UnpicklingError, EOFError) as e:
            raise self._fail(op, f"worker process {self.proc.pid} broke the protocol during {op}: {e}") from e
        except BaseException:
            # KeyboardInterrupt and the like: a reply may still be in flight,
            # so this connection can never be trusted again.
            self._fail(op, f"{op} interrupted")
            raise
        if reply[0] == "ok":
            return reply[1]
        _, rtype, message, at, tb = reply
        summary = f"{rtype}: {message}" + (f" (at {at})" if at else "")
        raise self._fail(op, f"{op} failed in worker process {self.proc.pid}: {summary}", rtype, tb)

    def _write(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        poller = self.out_poll
        while view:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Late
            events = poller.poll(max(1, int(left * 1000)))
            if not events:
                continue
            if any(ev & (select.POLLERR | select.POLLHUP) for _, ev in events):
                raise _Gone
            try:
                n = os.write(self.wfd, view[:_CHUNK])
            except BlockingIOError:
                continue
            except BrokenPipeError:
                raise _Gone from None
            view = view[n:]

    def _read_exact(self, n: int, deadline: float, poller) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Late
            if not poller.poll(max(1, int(left * 1000))):
                continue
            chunk = os.read(self.rfd, min(_CHUNK, n - len(buf)))
            if not chunk:
                raise _Gone
            buf += chunk
        return bytes(buf)

    def _read_frame(self, deadline: float):
        poller = self.in_poll
        (length,) = _HEADER.unpack(self._read_exact(_HEADER.size, deadline, poller))
        if length > MAX_FRAME:
            raise OSError(f"frame of {length} bytes")
        return pickle.loads(self._read_exact(length, deadline, poller))

    def _death_message(self, op: str) -> str:
        try:
            code = self.proc.wait(timeout=min(2.0, self.timeout_s))
        except subprocess.TimeoutExpired:
            code = None
        text = f"worker process {self.proc.pid} died during {op} ({_signal_name(code)})"
        tail = self._stderr_tail()
        return f"{text}: {tail}" if tail else text

    def _stderr_tail(self) -> str:
        try:
            self.stderr.seek(0)
            lines = [ln.strip() for ln in self.stderr.read()[-8192:].decode("utf-8", "replace").splitlines()]
        except (OSError, ValueError):
            return ""
        lines = [ln for ln in lines if ln]
        return lines[-1][:300] if lines else ""

    def _fail(self, op: str, message: str, rtype: str | None = None, tb: str | None = None) -> WorkerError:
        self.failure = message
        self.shutdown(graceful=False)
        return WorkerError(
            message, where=self.identity, hint="the worker is closed; start a new WorkerOwner", op=op,
            remote_type=rtype, remote_traceback=tb,
        )

    # -- arenas ----------------------------------------------------------------

    def ensure_arena(self, slot: str, nbytes: int) -> SharedBuffer:
        self.require_open("run")
        arena = self.arenas[slot]
        fresh = arena.ensure(nbytes)
        if fresh is not None:
            try:
                self.call("map", {"slot": slot, "nbytes": fresh.nbytes, "gen": arena.generation}, fd=fresh.fd)
            finally:
                fresh.close_fd()
        return arena.buffer

    # -- shutdown --------------------------------------------------------------

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the child (politely when ``graceful``), reap it, free everything."""
        if self.closed:
            return
        if graceful:
            try:
                self.call("close", timeout_s=min(self.timeout_s, 10.0))
            except WorkerError:
                return  # call() already shut down after the failure
        self.closed = True
        proc = self.proc
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=min(self.timeout_s, 5.0) if graceful else 0.2)
        except subprocess.TimeoutExpired:
            proc.kill()
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:  # unkillable (D state); the OS reaps it later
                pass
        for arena in self.arenas.values():
            arena.close()
        self.sock.close()
        self.stderr.close()


class WorkerOwner:
    """An owner hosted in a child process (see the module docstring).

    identity: this owner's runtime identity ("worker:0").
    owner: the hosted owner, an owner name ("cpu", "torch-cpu:0", "cuda:0")
        or a plug-in's "pkg.mod:Class".
    python: the child's interpreter (default: this one).
    timeout_s: the longest any one call may take before the child is killed.
    start_timeout_s: the same for starting the child and constructing its
        owner (imports of numba, torch or ROCm can take many seconds);
        default max(timeout_s, 60).
    env: variables added to the child's environment (e.g. HIP_VISIBLE_DEVICES).
    owner_kwargs: passed to the hosted owner's constructor (pickled).

    Example::

        w = WorkerOwner("worker:0", owner="cpu")
        w.add_stack(stack); y = w.run_slots(3, x, ids, "exact"); w.close()
        g = WorkerOwner("worker:1", owner="cuda:0",
                        env={"CUDA_VISIBLE_DEVICES": "0"})   # a CudaOwner in the child
    """

    def __init__(self, identity: str = "worker:0", owner: str = "cpu", python: str | None = None,
                 timeout_s: float = 60.0, start_timeout_s: float | None = None, env: dict | None = None,
                 inner_identity: str | None = None, **owner_kwargs):
        start_timeout_s = max(timeout_s, 60.0) if start_timeout_s is None else start_timeout_s
        if not (timeout_s > 0 and start_timeout_s > 0):
            raise BadInputError(f"timeouts must be positive, got {timeout_s!r} and {start_timeout_s!r}", where=identity)
        self.identity = identity
        self.owner = owner
        self.python = python or sys.executable
        self._lock = threading.Lock()
        conn = _Connection(identity, self.python, float(timeout_s), env)
        self._conn = conn
        self._finalizer = weakref.finalize(self, conn.shutdown)
        if inner_identity is None:
            name = hosted_name(owner)
            inner_identity = f"{identity}/{name.identity if name is not None else owner.rpartition(':')[2]}"
        try:
            info = conn.call("init", {"owner": owner, "identity": inner_identity, "kwargs": owner_kwargs},
                             timeout_s=float(start_timeout_s))
        except BaseException:
            conn.shutdown(graceful=False)
            raise
        self.inner_identity: str = info["identity"]
        self.pid: int = info["pid"]

    def _call(self, op: str, payload: Any = None, fd: int | None = None):
        with self._lock:
            return self._conn.call(op, payload, fd)

    @property
    def closed(self) -> bool:
        return self._conn.closed

    def add_stack(self, stack: ExpertStack) -> None:
        data = np.ascontiguousarray(stack.data, dtype=np.uint8)
        meta = {
            "tensor": stack.tensor, "layer": stack.layer, "proj": stack.proj, "qtype": stack.qtype,
            "rows": stack.rows, "cols": stack.cols, "expert_ids": tuple(int(e) for e in stack.expert_ids),
            "shape": data.shape,
        }
        self._conn.require_open("add_stack")
        if data.nbytes == 0:
            self._call("add_stack", meta)
            return
        blob = SharedBuffer.create(data.nbytes)
        try:
            blob.array(np.uint8, data.shape)[...] = data
            blob.unmap()  # the child keeps its own mapping; ours is not needed
            self._call("add_stack", meta, fd=blob.fd)
        finally:
            blob.close()

    def register_books(self, tensor: str, expert_ids: Sequence[int], entry) -> None:
        self._call("register_books", {"tensor": tensor, "expert_ids": tuple(int(e) for e in expert_ids), "entry": entry})

    def experts(self, layer: int) -> tuple[int, ...]:
        return tuple(self._call("experts", int(layer)))

    def resident_bytes(self) -> int:
        return int(self._call("resident_bytes"))

    def run_slots(self, layer: int, x: np.ndarray, expert_ids: np.ndarray, mode: Mode) -> np.ndarray:
        """Per-slot unweighted outputs, float32 (n, hidden); see ``Owner.run_slots``."""
        return self.run_slots_staged(layer, x, expert_ids, mode, None)

    def run_slots_staged(self, layer: int, x, expert_ids, mode: Mode, ready) -> np.ndarray:
        """run_slots; ``ready.fire()`` once the rows are in the input arena and the
        request is sent (runtime/overlap.py), before waiting for the child."""
        x = np.asarray(x)
        ids = np.asarray(expert_ids)
        where = f"{self.identity} run_slots layer {layer}"
        mode = Mode.parse(mode, where=where)
        if x.dtype != np.float32 or x.ndim != 2:
            raise ShapeError(f"x must be float32 (n, hidden), got {x.dtype} {x.shape}", where=where)
        if ids.ndim != 1 or ids.shape[0] != x.shape[0] or ids.dtype.kind not in "iu":
            raise ShapeError(f"expert_ids must be integer ({x.shape[0]},), got {ids.dtype} {ids.shape}", where=where)
        n, hidden = x.shape
        if n == 0:
            return np.zeros((0, hidden), np.float32)
        off = ids_offset(n, hidden)
        with self._lock:
            conn = self._conn
            inp = conn.ensure_arena("in", off + n * 8)
            out = conn.ensure_arena("out", n * hidden * 4)
            inp.array(np.float32, (n, hidden))[...] = x
            inp.array(np.int64, (n,), off)[...] = ids
            conn.call("run", {"layer": int(layer), "n": n, "hidden": hidden, "mode": mode.value,
                              "gen": (conn.arenas["in"].generation, conn.arenas["out"].generation)},
                      sent=None if ready is None else ready.fire)
            return out.array(np.float32, (n, hidden)).copy()

    def close(self) -> None:
        """Tell the child to unregister and free, wait, kill if needed; idempotent."""
        with self._lock:
            self._finalizer()

    def __enter__(self) -> "WorkerOwner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class CallCost:
    """One batch size: median microseconds per run_slots call in process and
    through the worker, and whether their outputs had the same bytes."""

    batch: int
    hidden: int
    in_process_us: float
    worker_us: float
    overhead_us: float
    identical: bool


def measure_call_cost(owner: str, stacks: Sequence[ExpertStack], layer: int, *, books: Sequence[tuple] = (),
                      batches: Sequence[int] = (1, 64), repeats: int = 30, mode: Mode = Mode.EXACT,
                      seed: int = 0, python: str | None = None, env: dict | None = None,
                      **owner_kwargs) -> tuple[CallCost, ...]:
    """The worker's cost per run_slots call against the same owner in process.

    stacks: the layer's gate/up/down ExpertStacks; books: (tensor, ids, entry)
    for MIX stacks. x is seeded normal noise, slots cycle over the resident experts.
    """
    local = hosted_owner(owner, "bench/local", owner_kwargs)
    worker = WorkerOwner("worker:bench", owner=owner, python=python, env=env, **owner_kwargs)
    try:
        for o in (local, worker):
            for s in stacks:
                o.add_stack(s)
            for tensor, ids, entry in books:
                o.register_books(tensor, ids, entry)
        experts = np.asarray(local.experts(layer), np.int64)
        hidden = next(s.cols for s in stacks if s.proj != "down")
        rng = np.random.default_rng(seed)
        costs = []
        for batch in batches:
            x = rng.standard_normal((batch, hidden)).astype(np.float32)
            ids = experts[np.arange(batch) % len(experts)]
            pair = (("local", local), ("worker", worker))
            outs = {name: o.run_slots(layer, x, ids, mode) for name, o in pair}  # warm-up, arena growth
            ts: dict[str, list[float]] = {"local": [], "worker": []}
            for _ in range(repeats):  # interleaved, so load on the host hits both alike
                for name, o in pair:
                    t0 = time.perf_counter()
                    o.run_slots(layer, x, ids, mode)
                    ts[name].append(time.perf_counter() - t0)
            timings = {name: float(np.median(v)) * 1e6 for name, v in ts.items()}
            costs.append(CallCost(batch, hidden, timings["local"], timings["worker"],
                                  timings["worker"] - timings["local"],
                                  outs["local"].tobytes() == outs["worker"].tobytes()))
        return tuple(costs)
    finally:
        worker.close()
        local.close()
