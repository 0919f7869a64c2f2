"""Atomic file and folder writes.

A write goes to a temp file in the target folder, is flushed and fsynced,
renamed over the target, and the folder is fsynced (DESIGN.md "Writes").
A crash or an exception leaves either the old file or the complete new one,
never a torn file; on an exception the temp file is removed.

    with atomic_write("out/model.gguf") as f:     # binary, streaming
        f.write(header); f.write(chunk) ...
    atomic_write_json("out/manifest.json", obj)

    with publish_dir("release/v1") as tmp:        # a whole folder
        atomic_write_bytes(tmp / "a.bin", b"...")
    clear_stale_partials("release/v1")            # a killed build's release/v1.partial-<pid>
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from dataclasses import dataclass
from typing import IO, Any, Callable, Iterator, Optional, Union

from ds4quant.errors import BadInputError

PathLike = Union[str, "os.PathLike[str]"]


def _umask() -> int:
    # Read without changing it (os.umask() sets it, racing other threads).
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def fsync_dir(folder: PathLike) -> None:
    """fsync a folder so a rename inside it is durable (no-op where unsupported)."""
    try:
        fd = os.open(os.fspath(folder), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory; the rename still happened
    finally:
        os.close(fd)


class AtomicFile:
    """A temp file beside ``path`` that becomes ``path`` on ``commit()``.

    ``finish()`` flushes, fsyncs and closes; ``commit()`` renames and fsyncs
    the folder; ``abort()`` removes the temp file. Several AtomicFiles can be
    finished first and committed together (GGUF split sets).
    """

    def __init__(self, path: PathLike):
        self.path = Path(path)
        folder = self.path.parent
        if not folder.is_dir():
            raise BadInputError(f"folder {folder} does not exist", where=str(self.path),
                                hint="create the output folder first")
        if self.path.is_dir():
            raise BadInputError("is a folder; cannot write a file there", where=str(self.path))
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=folder)
        self.tmp_path = Path(tmp)
        try:
            os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual mode
            self.file: IO[bytes] = os.fdopen(fd, "wb")
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        self._state = "open"

    def finish(self) -> None:
        if self._state != "open":
            return
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        self._state = "finished"

    def commit(self) -> Path:
        self.finish()
        if self._state != "finished":
            raise RuntimeError(f"cannot commit an AtomicFile in state {self._state}")
        os.replace(self.tmp_path, self.path)
        self._state = "committed"
        fsync_dir(self.path.parent)
        return self.path

    def abort(self) -> None:
        if self._state in ("committed", "aborted"):
            return
        with contextlib.suppress(OSError):
            self.file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp_path)
        self._state = "aborted"


def with_path(e: OSError, path: PathLike) -> OSError:
    """``e`` naming ``path`` when it names no file (a write() failing with ENOSPC names none)."""
    if e.filename is not None:
        return e
    return type(e)(e.errno, e.strerror or str(e), os.fspath(path))


@contextlib.contextmanager
def atomic_write(path: PathLike) -> Iterator[IO[bytes]]:
    """Binary file handle whose content replaces ``path`` only if the block
    exits normally; on an exception the temp file is removed and any old
    ``path`` is untouched. An OSError without a file name gets ``path``'s."""
    af = AtomicFile(path)
    try:
        yield af.file
        af.commit()
    except OSError as e:
        af.abort()
        if e.filename is None:
            raise with_path(e, path) from e
        raise
    except BaseException:
        af.abort()
        raise


def atomic_write_bytes(path: PathLike, data: "bytes | bytearray | memoryview") -> Path:
    """Write ``data`` to ``path`` atomically; returns the path."""
    with atomic_write(path) as f:
        f.write(data)
    return Path(path)


def json_bytes(obj: Any) -> bytes:
    """Canonical JSON text: UTF-8, 2-space indent, sorted keys, newline-terminated.
    NaN/Inf are refused (not JSON)."""
    try:
        text = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise BadInputError(f"value cannot be written as JSON: {e}") from None
    return (text + "\n").encode("utf-8")


def atomic_write_json(path: PathLike, obj: Any) -> Path:
    """Write ``obj`` as canonical JSON (see ``json_bytes``) atomically."""
    return atomic_write_bytes(path, json_bytes(obj))


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def _check_target(out: Path, overwrite: bool, may_replace: Optional[Callable[[Path], Optional[str]]] = None) -> None:
    if out.exists() or out.is_symlink():
        if not out.is_dir() or out.is_symlink():
            raise BadInputError("exists and is not a folder", where=str(out), hint="choose another output path")
        if any(out.iterdir()):
            if not overwrite:
                raise BadInputError("folder exists and is not empty", where=str(out),
                                    hint="choose a new folder, or ask to overwrite it")
            why = may_replace(out) if may_replace is not None else None
            if why is not None:
                raise BadInputError(f"will not replace this folder: {why}", where=str(out),
                                    hint="move it away or choose another output folder")


# A folder being built carries this file (its builder's pid) until it is renamed into place: a
# later run removes a stale one only if it finds this mark, so it never deletes a folder of
# the same name that it did not make.
PARTIAL_MARK = ".ds4quant-partial"


@dataclass(frozen=True)
class StalePartial:
    """A leftover ``OUT.partial-<pid>`` of an earlier (killed) build: removed, or kept and why."""

    path: Path
    removed: bool
    why: str

    def one_line(self) -> str:
        return f"{'removed' if self.removed else 'left'} {self.path}: {self.why}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def _try_lock_dir(folder: Path) -> Optional[int]:
    """An fd holding an exclusive flock on ``folder``, or None when another process holds it."""
    import fcntl

    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _settle_old(out: Path, old: Path, pid: int, may_remove_old) -> StalePartial:
    if old.is_symlink() or not old.is_dir():
        return StalePartial(old, False, "not a folder a replace moved aside; not removed")
    if pid != os.getpid() and _pid_alive(pid):
        return StalePartial(old, False, f"pid {pid} is still replacing {out.name}")
    if not os.path.lexists(out):
        try:
            os.rename(old, out)
        except OSError as e:
            return StalePartial(old, False, f"cannot move it back to {out.name} ({e.strerror})")
        return StalePartial(old, False, f"moved back to {out.name}: the replace by pid {pid} was killed before "
                                        "the new folder came in")
    why = may_remove_old(old) if may_remove_old is not None else "no rule says it may be removed"
    if why:
        return StalePartial(old, False, f"the folder an interrupted replace moved aside; not removed: {why}")
    try:
        shutil.rmtree(old)
    except OSError as e:
        return StalePartial(old, False, f"cannot remove it ({e.strerror})")
    return StalePartial(old, True, f"the earlier folder a finished replace by pid {pid} (gone) left aside")


def clear_stale_partials(out: PathLike,
                         may_remove_old: Optional[Callable[[Path], Optional[str]]] = None) -> tuple[StalePartial, ...]:
    """Find ``OUT.partial-<pid>`` folders beside ``out``: remove each one a build marked as its
    own whose pid is dead and whose lock is free; report every other one (in use, or not ours).

    An ``OUT.old-<pid>`` is the whole earlier folder a replace killed between its two renames
    had moved aside (``publish_dir``). With its pid gone: when ``OUT`` is missing (killed before
    the new folder came in) it is renamed back to ``OUT``; when ``OUT`` is there (the new folder
    came in) it is removed if ``may_remove_old(old)`` gives no reason against it (the caller's
    rule for what it may replace), else reported."""
    out = Path(out)
    found = []
    if not out.parent.is_dir():
        return ()
    prefix = f"{out.name}.partial-"
    for p in sorted(out.parent.iterdir()):
        if p.name.startswith(f"{out.name}.old-") and p.name[len(out.name) + 5:].isdigit():
            found.append(_settle_old(out, p, int(p.name[len(out.name) + 5:]), may_remove_old))
            continue
        if not p.name.startswith(prefix):
            continue
        tail = p.name[len(prefix):]
        if p.is_symlink() or not p.is_dir():
            found.append(StalePartial(p, False, "not a folder a build made"))
            continue
        if not tail.isdigit():
            found.append(StalePartial(p, False, "not a build's name"))
            continue
        mark = p / PARTIAL_MARK
        try:
            marked = mark.is_file() and not mark.is_symlink() and mark.read_text(encoding="ascii").strip() == tail
        except (OSError, UnicodeDecodeError):
            marked = False
        if not marked:
            found.append(StalePartial(p, False, f"it has no {PARTIAL_MARK} mark of pid {tail}: not removed"))
            continue
        if int(tail) != os.getpid() and _pid_alive(int(tail)):
            found.append(StalePartial(p, False, f"pid {tail} is still running"))
            continue
        try:
            fd = _try_lock_dir(p)
        except OSError as e:
            found.append(StalePartial(p, False, f"cannot open it ({e.strerror})"))
            continue
        if fd is None:
            found.append(StalePartial(p, False, "another process is building it (locked)"))
            continue
        try:
            shutil.rmtree(p)
        except OSError as e:
            found.append(StalePartial(p, False, f"cannot remove it ({e.strerror})"))
        else:
            found.append(StalePartial(p, True, f"a killed build's leftover (pid {tail} is gone)"))
        finally:
            os.close(fd)
    return tuple(found)


def _unmark(partial: Path) -> None:
    os.unlink(partial / PARTIAL_MARK)
    fsync_dir(partial)  # a crash must not bring the mark back inside the finished folder


@contextlib.contextmanager
def publish_dir(out: PathLike, *, overwrite: bool = False,
                may_replace: Optional[Callable[[Path], Optional[str]]] = None) -> Iterator[Path]:
    """Build a folder as ``OUT.partial-<pid>`` and rename it to ``OUT`` at the end.

    Yields the partial folder to write into. On an exception it is removed and
    ``OUT`` is untouched. An existing empty ``OUT`` is replaced; a non-empty
    one is refused (before any work and again at the end) unless
    ``overwrite=True`` and ``may_replace(OUT)`` (when given) returns no reason
    against it, in which case it is moved aside, the new folder renamed in,
    and the old one deleted (the one non-atomic moment is the gap between
    those two renames).

    While it is built, the partial folder holds ``PARTIAL_MARK`` (this pid) and
    an flock on it, so ``clear_stale_partials`` can tell a killed build's
    leftover from a live one; the mark is removed before the rename.
    """
    out = Path(out)
    if not out.parent.is_dir():
        raise BadInputError(f"folder {out.parent} does not exist", where=str(out),
                            hint="create the parent folder first")
    _check_target(out, overwrite, may_replace)
    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
    if partial.is_symlink():
        raise BadInputError("is a symbolic link where the build folder goes; not followed", where=str(partial))
    if partial.exists():  # left by an earlier crashed run of this same pid
        shutil.rmtree(partial)
    partial.mkdir()
    lock_fd = None
    try:
        lock_fd = _try_lock_dir(partial)
        fd = os.open(partial / PARTIAL_MARK, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(f"{os.getpid()}\n")
        yield partial
        _fsync_tree(partial)
        _check_target(out, overwrite, may_replace)
        # The mark leaves the partial only just before its own rename: a run killed after
        # moving OUT aside leaves a marked partial the next run removes (and OUT.old-<pid>,
        # which it moves back), not a finished but unmarked folder nobody may remove.
        if out.exists():
            if any(out.iterdir()):
                old = out.with_name(f"{out.name}.old-{os.getpid()}")
                if old.exists():
                    shutil.rmtree(old)
                os.replace(out, old)
                _unmark(partial)
                os.replace(partial, out)
                fsync_dir(out.parent)
                shutil.rmtree(old)
            else:
                out.rmdir()
                _unmark(partial)
                os.replace(partial, out)
        else:
            _unmark(partial)
            os.replace(partial, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
