"""Which files form an artifact: a folder (with ``manifest.json``, and
``SHA256SUMS`` for a release) or a bare ``.gguf``; read from names alone,
before any file is opened (``artifact/view.py`` opens them)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ds4quant import names
from ds4quant.errors import BadInputError

__all__ = ["Layout", "locate"]

MANIFEST = names.MANIFEST_NAME
SUMS = names.SUMS_NAME


@dataclass(frozen=True)
class Layout:
    """Which files form the artifact. kind: "gguf" (a bare file: no manifest or
    sums), "artifact" (folder) or "release" (folder with SHA256SUMS)."""

    path: Path
    kind: str
    folder: Path
    gguf: Path  # the first (or only) GGUF file
    manifest: Optional[Path]
    sums: Optional[Path]

    def rel(self, path: "str | os.PathLike") -> str:
        """``path`` relative to the folder (posix), else its file name."""
        p = Path(path)
        try:
            return p.relative_to(self.folder).as_posix()
        except ValueError:
            return p.name


def _split_stem(p: Path) -> str:
    from ds4quant.artifact.gguf_writer import SPLIT_NAME

    m = SPLIT_NAME.match(p.name)
    return m.group("stem") if m else p.stem


def locate(path: "str | os.PathLike") -> Layout:
    """The layout of a folder or ``.gguf``; reads no file content.

    Raises BadInputError for a missing path, a folder without a .gguf, or a
    folder holding several GGUF artifacts.
    """
    p = Path(path)
    if p.is_dir():
        ggufs = sorted(q for q in p.iterdir() if q.suffix == ".gguf" and q.is_file())
        if not ggufs:
            raise BadInputError("no .gguf file in the folder", where=str(p))
        stems = {_split_stem(q) for q in ggufs}
        if len(stems) > 1:
            raise BadInputError(f"several GGUF artifacts in one folder: {sorted(stems)}", where=str(p),
                                hint="pass one .gguf file")
        man = p / MANIFEST
        sums = p / SUMS
        sums_p = sums if sums.is_file() else None
        return Layout(p, "release" if sums_p else "artifact", p, ggufs[0], man if man.is_file() else None, sums_p)
    if not p.exists():
        raise BadInputError("no such file or folder", where=str(p))
    return Layout(p, "gguf", p.parent, p, None, None)
