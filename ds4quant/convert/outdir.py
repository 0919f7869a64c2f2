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
3. One convert at a time per OUTDIR (``OutLock``): an exclusive ``fcntl`` lock
   on ``OUTDIR/.ds4quant.lock``, released by the kernel when the process dies;
   the file holds the holder's pid so a refusal can name it.

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

from ds4quant.errors import BadInputError, OutputError, OutputLockedError
from ds4quant.names import LOCK_NAME, LUCEBOX_KINDS, MANIFEST_NAME, SUMS_NAME, sidecar_suffix
from ds4quant.names import WORK_DIR_NAME as WORK_DIR


def _real(p: Path) -> Path:
    # resolve() follows every link of the existing prefix; a missing tail stays as given
    return Path(os.path.realpath(p))


def check_no_overlap(source: "str | os.PathLike", out: "str | os.PathLike") -> None:
    """Refuse an OUTDIR that is the source, inside it, or holds it (links resolved)."""
    s, o = _real(Path(source)), _real(Path(out))
    if s == o:
        why = "is the source itself"
    elif s in o.parents:
        why = f"is inside the source {s}"
    elif o in s.parents:
        why = f"holds the source {s}"
    else:
        return
    raise BadInputError(f"output folder {why} (real path {o}); writing there could destroy the checkpoint",
                        where=str(out), hint="choose an output folder outside the source")


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


class OutLock:
    """An exclusive lock on OUTDIR for the lifetime of one convert (see module doc)."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.path = self.out / LOCK_NAME
        self._fd: Optional[int] = None

    def _holder(self) -> str:
        try:
            pid = self.path.read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            pid = ""
        return f"pid {pid}" if pid.isdigit() else "another process"

    def acquire(self) -> "OutLock":
        import fcntl

        for _ in range(8):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise OutputError(f"cannot create the lock file ({e.strerror})", where=str(self.path)) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise OutputLockedError(f"another convert ({self._holder()}) is writing this folder",
                                            where=str(self.out),
                                            hint="wait for it to finish, or stop it and rerun with --resume") from None
                raise OutputError(f"cannot lock ({e.strerror})", where=str(self.path)) from None
            # the holder unlinks the file when it finishes: make sure we locked the file that is there now
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode("ascii"))
                self._fd = fd
                return self
            os.close(fd)
        raise OutputLockedError("the lock file keeps changing under this run", where=str(self.path))

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)  # while still held, so no other run locks a file about to vanish
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "OutLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
