"""``SHA256SUMS``: the checksum list of a release folder, as ``sha256sum -c`` reads it.

Format (GNU coreutils, text mode)::

    <64 lowercase hex>  <path relative to the folder, "/" separated>\\n

one line per file, sorted by path; the list never names itself. Names that
coreutils would have to escape (a backslash or a newline) are refused on both
sides, as are absolute paths and ``..``.

    write_sums(folder)                      # lists every file under folder
    for name, digest in read_sums(folder / "SHA256SUMS"): ...
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterable

from ds4quant.artifact.atomic import PARTIAL_MARK, atomic_write_bytes
from ds4quant.artifact.manifest import sha256_file
from ds4quant.errors import BadInputError, CorruptDataError
from ds4quant.names import SUMS_NAME

MAX_SUMS_BYTES = 16 << 20  # a release lists a few hundred files at most
_LINE = re.compile(r"^(?P<sha>[0-9a-f]{64}) (?P<mode>[ *])(?P<name>.+)$")


def _check_name(name: str, where: str, cls=BadInputError) -> str:
    parts = name.split("/")
    if (not name or name.startswith("/") or "\\" in name or "\n" in name or "\r" in name or "\x00" in name
            or any(p in ("", ".", "..") for p in parts)):
        raise cls(f"file name {name!r} is not a plain relative path", where=where)
    return name


def list_files(folder: "str | os.PathLike") -> list[str]:
    """Every regular file under ``folder`` (relative, "/" separated, sorted),
    except ``SHA256SUMS`` itself (and the mark of a folder being built, ``PARTIAL_MARK``). Symlinks and other non-files are refused."""
    root = Path(folder)
    out = []
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]):
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if p.is_symlink() or not p.is_file():
                raise BadInputError("is not a regular file (links are not allowed in a release)", where=str(p))
            if rel not in (SUMS_NAME, PARTIAL_MARK):  # the mark of a folder being built goes before its rename
                out.append(_check_name(rel, str(p)))
    return sorted(out)


def format_sums(entries: Iterable[tuple[str, str]]) -> bytes:
    """Lines for (relative name, hex sha256) pairs, sorted by name."""
    lines = []
    for name, digest in sorted(entries):
        _check_name(name, SUMS_NAME)
        if not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise BadInputError(f"bad sha256 {digest!r} for {name!r}", where=SUMS_NAME)
        lines.append(f"{digest}  {name}\n")
    return "".join(lines).encode("utf-8")


def write_sums(folder: "str | os.PathLike", known: "dict[str, str] | None" = None,
               names: "Iterable[str] | None" = None) -> Path:
    """Write ``folder/SHA256SUMS`` over every file under ``folder`` (or only ``names``,
    folder-relative: an artifact lists its own files, never a stray one), atomically.

    known: name -> sha256 already computed (e.g. while copying), reused as is.
    """
    root = Path(folder)
    known = known or {}
    listed = list_files(root) if names is None else sorted({_check_name(n, SUMS_NAME) for n in names} - {SUMS_NAME})
    entries = [(n, known.get(n) or sha256_file(root / n)) for n in listed]
    return atomic_write_bytes(root / SUMS_NAME, format_sums(entries))


def read_sums(path: "str | os.PathLike") -> tuple[tuple[str, str], ...]:
    """Parse a SHA256SUMS file into (name, sha256) pairs, in file order.

    Raises CorruptDataError naming the line for anything ``sha256sum -c``
    would not read the same way, a duplicate name, or an empty list.
    """
    p = Path(path)
    where = str(p)
    try:
        size = p.stat().st_size
        if size > MAX_SUMS_BYTES:
            raise CorruptDataError(f"is {size} bytes; a checksum list is at most {MAX_SUMS_BYTES}", where=where)
        raw = p.read_bytes()
    except FileNotFoundError:
        raise BadInputError("no such file", where=where) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptDataError(f"is not UTF-8 text (byte {e.start})", where=where) from None
    if not text.endswith("\n"):
        raise CorruptDataError("does not end with a newline (truncated?)", where=where)
    out, seen = [], set()
    for i, line in enumerate(text[:-1].split("\n"), 1):
        m = _LINE.match(line)
        if not m:
            raise CorruptDataError(f"line {i} is not a sha256 (64 lowercase hex digits), two spaces and a file name: "
                                   f"{line[:80]!r}", where=where)
        name = _check_name(m.group("name"), f"{where}: line {i}", CorruptDataError)
        if name in seen:
            raise CorruptDataError(f"line {i} lists {name!r} again", where=where)
        seen.add(name)
        out.append((name, m.group("sha")))
    if not out:
        raise CorruptDataError("lists no files", where=where)
    return tuple(out)
