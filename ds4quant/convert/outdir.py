"""The output folder of convert: what may be written there, what convert owns, and who holds it.

Rules, each checked before anything in OUTDIR is touched:

1. OUTDIR and the source never overlap: not the same folder, neither inside
   the other, links resolved (``check_no_overlap``). ``--force`` on an overlap
   would otherwise delete the checkpoint.
2. ``--force`` removes only what convert's own runs write (``own_files``):
   the GGUF or splits of the artifact's name, their loose sidecars and temp
   files, ``manifest.json``, ``SHA256SUMS``, the work folder, the lock file,
   and the files an existing ``manifest.json`` lists as its artifact. Any other
   entry makes ``--force`` refuse, naming it.
3. One convert at a time per OUTDIR (``OutLock``): exclusive ``flock`` locks on
   OUTDIR and on ``OUTDIR/.ds4quant.lock`` (never followed if it is a link),
   released by the kernel when the process dies; the file holds the holder's
   pid so a refusal can name it. Its existence is not the lock: deleting it by
   hand frees nothing, and a killed run's stale file blocks nothing.

    check_no_overlap(src, out)                        # BadInputError on overlap
    with OutLock(out):                                # OutputLockedError naming the pid
        clear_for_force(out, "tiny")                  # removes convert's own files only
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Optional

from ds4quant.artifact.overlap import check_no_overlap as check_no_overlap_of
from ds4quant.errors import BadInputError, OutputError, OutputLockedError
from ds4quant.names import LOCK_NAME, LUCEBOX_KINDS, MANIFEST_NAME, SUMS_NAME, sidecar_suffix
from ds4quant.names import WORK_DIR_NAME as WORK_DIR


def check_no_overlap(source: "str | os.PathLike", out: "str | os.PathLike",
                     imatrix: "str | os.PathLike | None" = None) -> None:
    """Refuse an OUTDIR that is the source (or the imatrix), lies inside it, or holds it:
    real paths and folder identities compared (``artifact.overlap``: symlinks, bind mounts)."""
    check_no_overlap_of(out, {"source": source, "imatrix": imatrix})


def own_file_re(art_name: str) -> re.Pattern:
    """File names a convert run of artifact ``art_name`` writes at the top of OUTDIR."""
    n = re.escape(art_name)
    gguf = rf"{n}(?:-\d{{5}}-of-\d{{5}})?\.gguf"
    side = "|".join(re.escape(sidecar_suffix(k)) for k in LUCEBOX_KINDS)
    final = rf"(?:{gguf}(?:{side})?|{re.escape(MANIFEST_NAME)}|{re.escape(SUMS_NAME)})"
    # AtomicFile temp names: ".<target>.<random>.tmp"
    return re.compile(rf"^(?:{final}|\.{final}\.[A-Za-z0-9_]+\.tmp|{re.escape(WORK_DIR)}|{re.escape(LOCK_NAME)})$")


def stale_temp_files(out: Path, art_name: str) -> list[Path]:
    """Temp files a killed write of this artifact left at the top of OUTDIR."""
    rx = own_file_re(art_name)
    return sorted(p for p in out.iterdir() if p.name.endswith(".tmp") and rx.match(p.name) and p.is_file())


def _manifest_listed(out: Path) -> set[str]:
    """Top-level names an existing manifest.json lists as its artifact's files (a
    earlier run under another name); unreadable manifests list nothing."""
    try:
        d = json.loads((out / MANIFEST_NAME).read_text(encoding="utf-8"))
        names = {str(f["name"]) for f in d.get("files", ())}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return set()
    return {n for n in names if "/" not in n and n not in ("", ".", "..")}


def own_files(out: Path, art_name: str) -> tuple[list[Path], list[str]]:
    """(entries of OUTDIR that convert wrote, names of every other entry)."""
    rx = own_file_re(art_name)
    listed = _manifest_listed(out)
    mine, other = [], []
    for p in sorted(out.iterdir()):
        stem_listed = any(p.name == n or p.name.startswith(f".{n}.") and p.name.endswith(".tmp") for n in listed)
        if (rx.match(p.name) or stem_listed) and not (p.is_symlink() and p.name == WORK_DIR):
            mine.append(p)
        else:
            other.append(p.name)
    return mine, other


def clear_for_force(out: Path, art_name: str) -> None:
    """``--force``: remove convert's own files; refuse (touching nothing) if others exist."""
    if not out.is_dir():
        return
    mine, other = own_files(out, art_name)
    if other:
        shown = ", ".join(other[:5]) + (f", ... ({len(other)} in all)" if len(other) > 5 else "")
        raise BadInputError(f"holds files convert did not write: {shown}", where=str(out),
                            hint="--force replaces only a convert's own artifact; move them away or choose "
                                 "another output folder")
    for p in mine:
        if p.name == LOCK_NAME:
            continue  # held by this run
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def make_out_dir(out: Path) -> bool:
    """Create the output folder ``out`` (parents too) when absent; whether this
    call created it. A folder that cannot be made is an OutputError naming it
    (exit 2), with nothing written."""
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create the output folder ({e.strerror or e}); nothing was written",
                          where=str(e.filename or out)) from None
    return created


class OutLock:
    """An exclusive lock on OUTDIR for the lifetime of one convert (see module doc).

    Two advisory ``flock`` locks, both released by the kernel when the holder dies:
    one on OUTDIR itself, one on ``OUTDIR/.ds4quant.lock``, a regular file that stays
    while the run holds it (it names the holder's pid). Deleting the file by hand
    therefore frees nothing: the folder's lock still keeps a second run out. The file is opened without
    following links (``O_NOFOLLOW``), and a lock path that is a link, or anything but
    a regular file, is refused: a planted link would otherwise make convert write
    its pid into a file outside OUTDIR.
    """

    def __init__(self, out: Path, command: str = "convert"):
        self.out = Path(out)
        self.command = command  # who holds it, in the messages (calibrate locks its OUT the same way)
        self.path = self.out / LOCK_NAME
        self._fd: Optional[int] = None
        self._dir_fd: Optional[int] = None
        self.created = False  # this run made the lock file (a refused run removes it again)

    def _holder(self) -> str:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return "another process"
        try:
            pid = os.read(fd, 32).decode("ascii", "replace").strip()
        except OSError:
            pid = ""
        finally:
            os.close(fd)
        return f"pid {pid}" if pid.isdigit() else "another process"

    def _busy(self) -> OutputLockedError:
        return OutputLockedError(f"another {self.command} ({self._holder()}) is writing this folder", where=str(self.out),
                                 hint="wait for it to finish, or stop it and rerun with --resume")

    def _open_file(self) -> int:
        import stat

        if self.path.is_symlink():
            raise OutputError(f"the lock file is a symbolic link; {self.command} never follows one (it would write "
                              "outside the output folder)", where=str(self.path),
                              hint="remove the link, or choose another output folder")
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            try:
                fd = os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o644)
                self.created = True
            except FileExistsError:
                fd = os.open(self.path, flags)
        except OSError as e:
            if e.errno == errno.ELOOP:  # became a link between the check and the open
                raise OutputError(f"the lock file is a symbolic link; {self.command} never follows one",
                                  where=str(self.path)) from None
            raise OutputError(f"cannot create the lock file ({e.strerror})", where=str(self.path)) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OutputError("the lock path is not a regular file", where=str(self.path),
                              hint="remove it, or choose another output folder")
        return fd

    def acquire(self) -> "OutLock":
        import fcntl

        try:
            dfd = os.open(self.out, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC)
        except OSError as e:
            raise OutputError(f"cannot open the output folder ({e.strerror})", where=str(self.out)) from None
        try:
            fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(dfd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise self._busy() from None
            raise OutputError(f"cannot lock the output folder ({e.strerror})", where=str(self.out)) from None
        try:
            fd = self._open_file()
        except BaseException:
            os.close(dfd)
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            os.close(dfd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise self._busy() from None
            raise OutputError(f"cannot lock ({e.strerror})", where=str(self.path)) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode("ascii"))
        self._fd, self._dir_fd = fd, dfd
        return self

    def release(self, *, remove: bool = False, remove_created: bool = False) -> None:
        """Unlock. The file's existence is not the lock, so it may stay (a killed run's
        does); ``remove`` removes it (a finished run leaves a clean folder), and
        ``remove_created`` removes it only if this run made it (a run refused before it
        wrote anything leaves the folder as it found it). Removing happens while the
        folder's lock is still held, so no other run can have the file open."""
        if (remove or (remove_created and self.created)) and self._fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        for fd in (self._fd, self._dir_fd):
            if fd is not None:
                os.close(fd)
        self._fd = self._dir_fd = None

    def __enter__(self) -> "OutLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
