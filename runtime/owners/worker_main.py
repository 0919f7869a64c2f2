"""The child side of a worker-process owner (``python -m ds4quant.runtime.owners.worker_main``).

Started by ``WorkerOwner`` only; the protocol is in ``worker.py``'s
docstring. Serves one request at a time until ``close`` or until its stdin
closes (the primary died or let go), then closes the hosted owner and exits.
"""

from __future__ import annotations

import argparse
import os
import pickle
import signal
import socket
import sys
import traceback

import numpy as np

from ds4quant.runtime.arena import SharedBuffer, recv_fd
from ds4quant.runtime.owners.base import ExpertStack
from ds4quant.runtime.owners.worker import _HEADER, MAX_FRAME, encode_frame, hosted_owner, ids_offset


class _Server:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.owner = None
        self.arenas: dict[str, tuple[int, SharedBuffer]] = {}

    def init(self, p):
        self.owner = hosted_owner(p["owner"], p["identity"], p["kwargs"])
        return {"identity": getattr(self.owner, "identity", p["identity"]), "pid": os.getpid(),
                "python": sys.version.split()[0]}

    def add_stack(self, p):
        shape = tuple(p.pop("shape"))
        count = int(np.prod(shape, dtype=np.int64))
        if count == 0:
            data = np.zeros(shape, np.uint8)
        else:
            # The received segment *is* the resident copy: read-only, like the artifact memmap.
            data = SharedBuffer.attach(recv_fd(self.sock), count, writable=False).array(np.uint8, shape)
        self.owner.add_stack(ExpertStack(data=data, **p))

    def register_books(self, p):
        self.owner.register_books(p["tensor"], p["expert_ids"], p["entry"])

    def experts(self, layer):
        return tuple(int(e) for e in self.owner.experts(layer))

    def resident_bytes(self, _):
        return int(self.owner.resident_bytes())

    def map(self, p):
        fresh = SharedBuffer.attach(recv_fd(self.sock), p["nbytes"])
        old = self.arenas.get(p["slot"])
        self.arenas[p["slot"]] = (p["gen"], fresh)
        if old is not None:
            old[1].close()

    def run(self, p):
        n, hidden = p["n"], p["hidden"]
        (gin, inp), (gout, out) = self.arenas["in"], self.arenas["out"]
        if (gin, gout) != tuple(p["gen"]):
            raise RuntimeError(f"arena generations {(gin, gout)} != the primary's {tuple(p['gen'])}")
        x = inp.array(np.float32, (n, hidden))
        ids = inp.array(np.int64, (n,), ids_offset(n, hidden))
        y = np.asarray(self.owner.run_slots(p["layer"], x, ids, p["mode"]))
        if y.dtype != np.float32 or y.shape != (n, hidden):
            raise TypeError(f"hosted owner returned {y.dtype} {y.shape}, expected float32 {(n, hidden)}")
        out.array(np.float32, (n, hidden))[...] = y

    def close(self, _=None):
        owner, self.owner = self.owner, None
        if owner is not None:
            owner.close()
        for _gen, buf in self.arenas.values():
            buf.close()
        self.arenas.clear()


_OPS = frozenset({"init", "add_stack", "register_books", "experts", "resident_bytes", "map", "run", "close"})


def _read_exact(f, n: int) -> bytes | None:
    data = f.read(n)
    if len(data) < n:
        return None  # EOF: the primary closed our stdin
    return data


def _error_reply(e: BaseException):
    frames = traceback.extract_tb(e.__traceback__)
    at = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    one_line = getattr(e, "one_line", None)
    message = one_line() if callable(one_line) else " ".join(str(e).split())
    return ("err", type(e).__name__, message[:500], at, "".join(traceback.format_exception(e)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="ds4quant.runtime.owners.worker_main")
    ap.add_argument("--fd-socket", type=int, required=True)
    args = ap.parse_args(argv)
    # Terminal Ctrl-C is the primary's to handle; it closes us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Frames get private descriptors; fd 0 becomes /dev/null and fd 1 stderr,
    # so nothing the hosted owner (or a C library) prints reaches the pipe.
    rfd, wfd = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    reader = os.fdopen(rfd, "rb")
    writer = os.fdopen(wfd, "wb")
    server = _Server(socket.socket(fileno=args.fd_socket))
    try:
        while True:
            header = _read_exact(reader, _HEADER.size)
            if header is None:
                break
            (length,) = _HEADER.unpack(header)
            body = _read_exact(reader, length) if length <= MAX_FRAME else None
            if body is None:
                break
            op, payload = pickle.loads(body)
            try:
                if op not in _OPS:
                    raise ValueError(f"unknown worker op {op!r}")
                handler = getattr(server, op)
                reply = ("ok", handler(payload))
            except Exception as e:  # reported to the primary, which closes us
                reply = _error_reply(e)
            try:
                writer.write(encode_frame(reply))
                writer.flush()
            except BrokenPipeError:
                break
            if op == "close":
                break
    finally:
        try:
            server.close()
        except Exception:
            traceback.print_exc()
    return 0


if __name__ == "__main__":
    sys.exit(main())
