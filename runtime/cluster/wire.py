"""The wire between a rank group's home and its rank 0: length-prefixed JSON
headers, each followed by its raw arrays, over one TCP connection on localhost.

    wire.send({"op": "call", "layer": 3, "T": T, "K": K}, [x, idx, w])
    head, blobs = wire.recv(timeout_s)      # after wire.readable(...)

Ops: home -> rank 0: hello (with the spec's token), call, stop; rank 0 ->
home: ready, out, error. Rank 0 relays a call to every rank as a header
tensor [op, layer, T, K] (``OP_*``).
"""

from __future__ import annotations

import json
import select
import socket
import struct
from typing import Sequence

import numpy as np

__all__ = ["Wire", "connect", "OP_STOP", "OP_KEEPALIVE", "OP_CALL", "MAX_HEADER"]

# the call header rank 0 broadcasts: [op, layer, T, K]
OP_STOP, OP_KEEPALIVE, OP_CALL = 0, 1, 2
MAX_HEADER = 1 << 20


class Wire:
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


def connect(spec: dict) -> Wire:
    """Rank 0's connection to the home named in ``spec``, introduced by the spec's token."""
    host, port = spec["control"]
    sock = socket.create_connection((host, int(port)), timeout=float(spec.get("timeout_s", 60)))
    wire = Wire(sock)
    wire.send({"op": "hello", "token": spec["token"]})
    return wire
