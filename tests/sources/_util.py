"""Helpers for source tests: the shipped sample, and hand-built safetensors files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "samples" / "ds4-tiny"
TOKENS = REPO / "samples" / "tokens.txt"


def copy_sample(tmp_path: Path) -> Path:
    dst = tmp_path / "ds4-tiny"
    shutil.copytree(SAMPLE, dst)
    return dst


def raw_header(path: Path) -> tuple[int, dict]:
    b = path.read_bytes()
    n = int.from_bytes(b[:8], "little")
    return n, json.loads(b[8:8 + n])


def write_raw(path: Path, header: "dict | bytes", data: bytes, *, length: "int | None" = None) -> None:
    """Write 8-byte length + header (JSON of ``header`` unless bytes) + data."""
    hb = header if isinstance(header, bytes) else json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    path.write_bytes((len(hb) if length is None else length).to_bytes(8, "little") + hb + data)


def write_safetensors(path: Path, tensors: dict, metadata: "dict | None" = None) -> None:
    """tensors: name -> (dtype tag, shape, raw bytes); laid out in name order."""
    header, blobs, pos = {}, [], 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name in sorted(tensors):
        tag, shape, raw = tensors[name]
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [pos, pos + len(raw)]}
        blobs.append(raw)
        pos += len(raw)
    write_raw(path, header, b"".join(blobs))


def tensor_bytes(arr: np.ndarray) -> bytes:
    return np.ascontiguousarray(arr).tobytes()
