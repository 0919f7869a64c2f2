"""Shared host buffers (arenas) between the primary process and a worker.

Linux only: segments travel between processes as file descriptors over a Unix
socket (SCM_RIGHTS), and the memory lives in tmpfs.

A segment is a file ``ds4quant-<pid>-<n>`` in ``/dev/shm`` (a temp dir where
``/dev/shm`` is missing or not writable) that is unlinked the moment it is
opened, before it is sized or sent: from then on only open descriptors and
mappings keep the memory alive, so a ``kill -9`` of either side, at any time
after those two syscalls, leaves no name behind and the kernel frees the
pages when the last mapping goes. The receiver maps the descriptor and closes
it; so does the sender once it has sent it.

An ``Arena`` is a growable segment owned by the primary: ``ensure(nbytes)``
keeps the current segment when it is big enough and otherwise replaces it
with a bigger one (sizes round up to a power of two), which the caller must
send to the worker before the next call uses it. Arenas never shrink, and a
segment is never resized in place, so a mapping the worker still holds can
never point past the end of its file.

Example::

    arena = Arena("in")
    fresh = arena.ensure(4096)      # a new SharedBuffer: send fresh.fd, then fresh.close_fd()
    arena.buffer.array(np.float32, (4, 256))[:] = x
"""

from __future__ import annotations

import itertools
import math
import mmap
import os
import socket
import tempfile
from pathlib import Path

import numpy as np

from ds4quant.errors import Ds4quantError

PREFIX = "ds4quant-"
MIN_ARENA_BYTES = 1 << 16
_counter = itertools.count()


def shm_dir() -> Path:
    """Where segments are created: /dev/shm, else the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return Path(tempfile.gettempdir())


def leftover_segments(directory: Path | None = None) -> list[Path]:
    """Names with the ds4quant prefix left in the segment directory (there
    should never be any: segments are unlinked as soon as they are opened)."""
    d = shm_dir() if directory is None else directory
    return sorted(p for p in d.iterdir() if p.name.startswith(PREFIX))


def _anonymous_fd(nbytes: int) -> int:
    d = shm_dir()
    for _ in range(1000):
        path = d / f"{PREFIX}{os.getpid()}-{next(_counter)}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:  # a name left by a process that died inside the window
            continue
        except OSError as e:
            raise Ds4quantError(f"cannot create a shared-memory segment: {e.strerror}", where=str(path)) from e
        # Unlink before anything that can fail or take time: the descriptor is the segment now.
        os.unlink(path)
        try:
            os.ftruncate(fd, nbytes)
        except OSError as e:
            os.close(fd)
            raise Ds4quantError(
                f"cannot size a {nbytes}-byte shared-memory segment: {e.strerror}",
                where=str(d),
                hint="free space in /dev/shm or make the batch smaller",
            ) from e
        return fd
    raise Ds4quantError("no free shared-memory segment name after 1000 tries", where=str(d))


class SharedBuffer:
    """One mapping of a shared segment.

    ``fd`` stays open only until ``close_fd()`` (after it has been sent);
    the mapping stays until ``close()``. Views from ``array`` must be dropped
    before ``close``; one that is not keeps the mapping alive until it dies.
    """

    def __init__(self, fd: int, nbytes: int, *, writable: bool = True, owns_fd: bool = True):
        if nbytes <= 0:
            raise ValueError(f"segment size must be positive, got {nbytes}")
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        self.nbytes = int(nbytes)
        self.writable = writable
        self.mm: mmap.mmap | None = mmap.mmap(fd, self.nbytes, access=access)
        self.fd: int | None = fd if owns_fd else None

    @classmethod
    def create(cls, nbytes: int) -> "SharedBuffer":
        """A fresh zero-filled segment of ``nbytes`` bytes, already nameless."""
        fd = _anonymous_fd(nbytes)
        try:
            return cls(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int, nbytes: int, *, writable: bool = True) -> "SharedBuffer":
        """Map a received descriptor, then close it (the mapping keeps the memory)."""
        try:
            buf = cls(fd, nbytes, writable=writable, owns_fd=False)
        finally:
            os.close(fd)
        return buf

    def array(self, dtype, shape, offset: int = 0) -> np.ndarray:
        """A view of ``shape`` ``dtype`` items starting at byte ``offset``."""
        if self.mm is None:
            raise ValueError("shared buffer is closed")
        dtype = np.dtype(dtype)
        count = math.prod(shape)
        if offset < 0 or offset + count * dtype.itemsize > self.nbytes:
            raise ValueError(f"view of {count} x {dtype} at {offset} exceeds the {self.nbytes}-byte segment")
        return np.frombuffer(self.mm, dtype=dtype, count=count, offset=offset).reshape(shape)

    def close_fd(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        self.close_fd()
        self.unmap()

    def unmap(self) -> None:
        """Drop this side's mapping (the fd, if still open, keeps the segment)."""
        mm, self.mm = self.mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                # A view still exists (e.g. held by a traceback); the mapping
                # goes when that view is collected. Nothing is named, so nothing leaks.
                pass


class Arena:
    """A growable shared segment, replaced (never resized) when too small."""

    def __init__(self, name: str, min_bytes: int = MIN_ARENA_BYTES):
        self.name = name
        self.min_bytes = int(min_bytes)
        self.buffer: SharedBuffer | None = None
        self.generation = 0

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.nbytes

    def ensure(self, nbytes: int) -> SharedBuffer | None:
        """Make the arena hold at least ``nbytes``. Returns the new buffer when
        it was replaced (send its ``fd`` to the peer, then ``close_fd()``),
        else None. The old mapping is closed here: only call between calls."""
        if self.buffer is not None and nbytes <= self.buffer.nbytes:
            return None
        size = max(self.min_bytes, 1 << max(0, int(nbytes) - 1).bit_length())
        fresh = SharedBuffer.create(size)
        old, self.buffer = self.buffer, fresh
        self.generation += 1
        if old is not None:
            old.close()
        return fresh

    def close(self) -> None:
        buf, self.buffer = self.buffer, None
        if buf is not None:
            buf.close()


def send_fd(sock: socket.socket, fd: int) -> None:
    """Send one descriptor (with a one-byte payload) over a Unix socket."""
    socket.send_fds(sock, [b"F"], [fd])


def recv_fd(sock: socket.socket) -> int:
    """Receive one descriptor sent by ``send_fd`` (blocking)."""
    msg, fds, _flags, _addr = socket.recv_fds(sock, 1, 1)
    if msg != b"F" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ConnectionError(f"expected one descriptor on the worker socket, got {len(fds)} and {msg!r}")
    return fds[0]
