"""Does an output path overlap an input? One check for every command that writes a folder.

An output folder that is an input, lies inside one, or holds one could have
that input deleted by ``--force`` (or overwritten by a plain write). Paths are
compared twice, so no route to the same place slips through:

- by real path (``os.path.realpath``: every symlink of the existing prefix
  resolved; a missing tail stays as given);
- by identity (``st_dev``, ``st_ino``) of the folder and of each existing
  ancestor: a bind mount shows the same directory under another real path but
  with the same device and inode.

Inputs may be folders (a checkpoint, an artifact) or files (an imatrix):
a file input overlaps when it lies inside the output, or is the output.
Hard links (``shared_files``) are a separate question, asked only of the files
a command is about to remove.

    check_no_overlap("release/v1", {"artifact": "out/tiny", "source": "ckpt"})   # BadInputError on overlap
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Mapping, Optional

from ds4quant.errors import BadInputError

__all__ = ["check_no_overlap", "overlap_reason", "shared_files", "real_path"]

_Id = tuple[int, int]


def real_path(p: "str | os.PathLike") -> Path:
    """``p`` with every link of its existing prefix resolved (a missing tail stays as given)."""
    return Path(os.path.realpath(os.path.abspath(os.fspath(p))))


def _ident(p: Path) -> Optional[_Id]:
    try:
        st = os.stat(p)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _ancestors(p: Path) -> list[_Id]:
    """Identities of every existing ancestor of ``p`` (not ``p`` itself), nearest first."""
    out = []
    for q in p.parents:
        i = _ident(q)
        if i is not None:
            out.append(i)
    return out


def overlap_reason(out: "str | os.PathLike", inp: "str | os.PathLike") -> Optional[str]:
    """Why output ``out`` overlaps input ``inp`` ("is", "is inside", "holds"), or None."""
    o, i = real_path(out), real_path(inp)
    if o == i:
        return "is"
    if i in o.parents:
        return "is inside"
    if o in i.parents:
        return "holds"
    oid, iid = _ident(o), _ident(i)
    if iid is not None and oid == iid:
        return "is"
    if iid is not None and iid in _ancestors(o):
        return "is inside"  # a bind mount (or another mount) of the input above the output
    if oid is not None and oid in _ancestors(i):
        return "holds"
    return None


def check_no_overlap(out: "str | os.PathLike", inputs: Mapping[str, "str | os.PathLike | None"], *,
                     what: str = "output folder") -> None:
    """Refuse ``out`` when it is, lies inside, or holds any of ``inputs`` (label -> path; None skipped).

    Raises BadInputError naming the output, the input and both real paths."""
    for label, inp in inputs.items():
        if inp is None:
            continue
        why = overlap_reason(out, inp)
        if why is None:
            continue
        the = f"the {label}" if why != "is" else f"the {label} itself"
        raise BadInputError(
            f"{what} {why} {the} (real paths {real_path(out)} and {real_path(inp)}); writing there could "
            f"destroy the {label}", where=str(out), hint=f"choose a {what} outside the {label}")


def _input_files(inputs: Iterable["str | os.PathLike"]) -> set[_Id]:
    ids: set[_Id] = set()
    for inp in inputs:
        p = Path(inp)
        if p.is_file():
            ids.add(_ident(p))  # type: ignore[arg-type]
        elif p.is_dir():
            for root, _dirs, files in os.walk(p):
                for f in files:
                    i = _ident(Path(root) / f)
                    if i is not None:
                        ids.add(i)
    ids.discard(None)  # type: ignore[arg-type]
    return ids


def shared_files(paths: Iterable["str | os.PathLike"], inputs: Iterable["str | os.PathLike | None"]) -> list[Path]:
    """Those of ``paths`` (files about to be removed or replaced) that are hard links to a file
    of ``inputs``. Only files with more than one link are looked at, so the inputs are walked
    only when such a file exists."""
    linked = []
    for p in paths:
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if st.st_nlink > 1 and not os.path.islink(p) and os.path.isfile(p):
            linked.append((Path(p), (st.st_dev, st.st_ino)))
    if not linked:
        return []
    ids = _input_files(i for i in inputs if i is not None)
    return [p for p, i in linked if i in ids]
