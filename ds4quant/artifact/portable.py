"""Paths as an artifact records them: never an absolute path of the machine that made it.

A manifest, a model card or a report that ships in a release is read on other
machines and uploaded to the hub; an absolute path would give away the maker's
folders (their home folder) and would make the same inputs give other bytes on
another machine. So a recorded path is relative to the artifact when it lies
inside it, else the file or folder's name (its content is identified by the
sha256 or fingerprint recorded beside it). A relative path that stays below the
working folder carries nothing of the machine and is kept.

    portable_path("/home/me/models/ds4", "/home/me/out/tiny")    # "ds4"
    portable_path("/home/me/out/tiny/a.gguf", "/home/me/out/tiny")  # "a.gguf"
    portable_command(["ds4quant", "convert", "/home/me/ckpt", "out", "--imatrix=/x/i.gguf"])
    # ("ds4quant", "convert", "ckpt", "out", "--imatrix=i.gguf")
"""

from __future__ import annotations

import os
from pathlib import PurePath
from typing import Iterable, Optional

__all__ = ["portable_path", "portable_command", "portable_manifest_json", "is_leaky"]


def is_leaky(p: str) -> bool:
    """Does ``p`` say where something lies on this machine (absolute, ``~``, or climbing with ``..``)?"""
    return p.startswith(("/", "~")) or ".." in PurePath(p).parts


def portable_path(p: "Optional[str | os.PathLike]", inside: "Optional[str | os.PathLike]" = None) -> Optional[str]:
    """``p`` relative to the folder ``inside`` when it lies there, kept when it is a plain
    relative path, else its name. None stays None."""
    if p is None:
        return None
    s = os.fspath(p)
    if inside is not None and os.path.isabs(s):
        base = os.path.realpath(os.fspath(inside))
        real = os.path.realpath(s)
        if real == base or real.startswith(base + os.sep):
            rel = os.path.relpath(real, base)
            return rel
    if not is_leaky(s):
        return s
    name = PurePath(s.rstrip("/\\")).name
    return name or s.strip("/\\") or "."


def portable_command(argv: Iterable[str]) -> tuple[str, ...]:
    """A command line with every path argument (``--opt=PATH`` too) made portable (``portable_path``)."""
    out = []
    for a in argv:
        a = str(a)
        if a.startswith("--") and "=" in a:
            opt, val = a.split("=", 1)
            out.append(f"{opt}={portable_path(val)}")
        else:
            out.append(portable_path(a))
    return tuple(out)


def portable_manifest_json(d: dict) -> dict:
    """A manifest's JSON object with its recorded paths made portable: the command line, the
    source path, the imatrix path and the adaptive options' routing and sensitivity files
    (manifests written before convert recorded them so)."""
    import copy

    d = copy.deepcopy(d)
    if isinstance(d.get("command"), list):
        d["command"] = list(portable_command(d["command"]))
    src = d.get("source")
    if isinstance(src, dict) and isinstance(src.get("path"), str):
        src["path"] = portable_path(src["path"])
    rec = d.get("recipe")
    if isinstance(rec, dict):
        imx = rec.get("imatrix")
        if isinstance(imx, dict) and isinstance(imx.get("path"), str):
            imx["path"] = portable_path(imx["path"])
        opts = (rec.get("allocation") or {}).get("options") if isinstance(rec.get("allocation"), dict) else None
        if isinstance(opts, dict):
            for k in ("routing", "sensitivity"):
                if isinstance(opts.get(k), str):
                    opts[k] = portable_path(opts[k])
    return d
