"""The adaptive recipe's measurement cache: figures and fitted books on disk.

Keyed by everything a measurement depends on (source, imatrix, fitter
settings; not the budget, the worker count or the device), so another target
reuses it and an interrupted measurement resumes. A damaged file is only lost
time: it is ignored and measured again.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from ds4quant.plan.records import Books

CACHE_VERSION = 2


@dataclass
class Cache:
    root: Optional[Path]
    key: str
    data: dict = field(default_factory=dict)  # "tensor|expert|qtype" -> list

    @property
    def file(self) -> Optional[Path]:
        return None if self.root is None else self.root / f"measure-{self.key[:24]}.json"

    def books_file(self, tensor: str) -> Optional[Path]:
        if self.root is None:
            return None
        return self.root / f"books-{self.key[:24]}" / f"{tensor}.npz"

    def load(self) -> None:
        f = self.file
        if f is None or not f.is_file():
            return
        try:
            d = json.loads(f.read_text())
            if d.get("version") == CACHE_VERSION and d.get("key") == self.key:
                self.data = dict(d["measures"])
        except (OSError, ValueError, KeyError, TypeError):
            self.data = {}  # a damaged cache is only lost time; measure again

    def save(self) -> None:
        if self.root is None:
            return
        from ds4quant.artifact.atomic import atomic_write_json

        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.file, {"version": CACHE_VERSION, "key": self.key, "measures": self.data})


def check_cache_dir(root: "str | os.PathLike", where: str = "--cache-dir") -> Path:
    """``root`` as a cache folder: absent (made on first save) or a folder, and no file on
    the way to it; anything else is one line naming it (before any measuring)."""
    from ds4quant.errors import BadInputError

    p = Path(root)
    for q in (p, *p.parents):
        if q.exists() or q.is_symlink():
            if not q.is_dir():
                what = "is" if q == p else f"lies under {q}, which is"
                raise BadInputError(f"the measurement cache {what} not a folder", where=f"{where} {p}",
                                    hint="point --cache-dir (or $DS4QUANT_CACHE) at a folder")
            break
    return p


def default_cache_dir() -> Path:
    base = os.environ.get("DS4QUANT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ds4quant")
    return Path(base)


def load_books(cache: Cache, tensor: str, books: "Books") -> None:
    """Fill ``books`` from the tensor's cache file; a damaged file is ignored."""
    f = cache.books_file(tensor)
    if f is None or not f.is_file():
        return
    try:
        with np.load(f) as z:
            for k in z.files:
                if k.endswith("|books"):
                    e, q, _ = k.split("|")
                    books.put(tensor, int(e), q, z[k].astype(np.float32), int(z[f"{e}|{q}|mode"]))
    except (OSError, ValueError, KeyError):
        return


def save_books(cache: Cache, tensor: str, experts, qtypes, books: "Books") -> None:
    f = cache.books_file(tensor)
    if f is None:
        return
    import io

    from ds4quant.artifact.atomic import atomic_write_bytes

    arrays = {}
    for e in experts:
        for q in qtypes:
            if (tensor, e, q) in books:
                b, mode = books.get(tensor, e, q)
                arrays[f"{e}|{q}|books"] = np.asarray(b, np.float32)
                arrays[f"{e}|{q}|mode"] = np.int64(mode)
    f.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    atomic_write_bytes(f, buf.getvalue())
