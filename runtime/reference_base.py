"""The reference base: what every later comparison needs from one reference pass.

A publisher who checks ten artifacts of one checkpoint runs the reference
once: ``ds4quant reference`` stores, per evaluated token, the reference's
full-vocabulary log-probabilities (llama.cpp's per-token uint16 quantization,
``kl_figures.quantize_log_probs``: at most 1.2e-4 nats off per kept log-prob),
its argmax and the target token; the evaluation sequences and scored
positions; with the exact-copy protocol the reference's passes per identifier
set; and the reference's greedy response.

File layout (little-endian)::

    b"DS4QBASE"  u64 header length  header (UTF-8 JSON)
    the arrays named in header["arrays"], in that order, raw
    sha256 of every byte before it (32 bytes)

The header (``schema`` "ds4quant.reference-base", ``version``) carries the
source fingerprint, the evaluation tokens' sha256, the protocol, the model
config, the tool version and the arrays' dtypes and shapes. ``read_base``
refuses (CorruptDataError, exit 2) a file whose length or sha256 does not
match before anything in it is used, and ``check_base`` refuses a base made
for another source, tokens, protocol, config or version, naming the
difference. Writes are atomic (a temporary file renamed into place).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

from ds4quant.errors import BadInputError, CorruptDataError, OutputError

MAGIC = b"DS4QBASE"
SCHEMA = "ds4quant.reference-base"
VERSION = 1
_DTYPES = {"int32": "<i4", "uint16": "<u2", "float32": "<f4", "uint8": "u1"}
CONFIG_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "n_routed_experts", "num_experts_per_tok",
               "moe_intermediate_size", "max_position_embeddings")


def tokens_sha256(seqs) -> str:
    """sha256 over the evaluation sequences (each: int32 length, then int32 ids)."""
    h = hashlib.sha256()
    for s in seqs:
        a = np.asarray(list(s), dtype="<i4")
        h.update(struct.pack("<i", a.size))
        h.update(a.tobytes())
    return h.hexdigest()


def model_config(cfg) -> dict:
    """The config values a base depends on (a transformers config or a mapping)."""
    get = cfg.get if isinstance(cfg, Mapping) else (lambda k: getattr(cfg, k, None))
    return {k: get(k) for k in CONFIG_KEYS}


@dataclass(frozen=True)
class Base:
    header: Mapping[str, Any]
    arrays: Mapping[str, np.ndarray]

    def seqs(self) -> list[list[int]]:
        ids, lens = self.arrays["tokens"], self.arrays["lengths"]
        out, at = [], 0
        for n in lens.tolist():
            out.append(ids[at:at + n].tolist())
            at += n
        return out


def write_base(path: "str | os.PathLike", header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> Path:
    """Write atomically; ``header`` gets schema, version and the arrays' layout."""
    p = Path(path)
    spec, blobs = [], []
    for name, a in arrays.items():
        kind = str(np.asarray(a).dtype)
        if kind not in _DTYPES:
            raise TypeError(f"array {name}: dtype {kind} is not stored")  # a bug, not user input
        b = np.ascontiguousarray(np.asarray(a).astype(_DTYPES[kind], copy=False)).tobytes()
        spec.append([name, kind, list(np.asarray(a).shape)])
        blobs.append(b)
    head = json.dumps({"schema": SCHEMA, "version": VERSION, **dict(header), "arrays": spec},
                      sort_keys=True).encode()
    body = MAGIC + struct.pack("<Q", len(head)) + head + b"".join(blobs)
    tmp = p.with_name(p.name + ".tmp")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(body)
            f.write(hashlib.sha256(body).digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write the reference base: {e}", where=str(p)) from None
    return p


def read_base(path: "str | os.PathLike") -> Base:
    """The whole base, checked (length, sha256, layout) before any of it is returned."""
    p = Path(path)
    where = str(p)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise BadInputError(f"cannot read the reference base: {e}", where=where) from None
    if len(data) < len(MAGIC) + 8 + 32 or data[:len(MAGIC)] != MAGIC:
        raise CorruptDataError("not a ds4quant reference base (made by `ds4quant reference`)", where=where)
    body, digest = data[:-32], data[-32:]
    if hashlib.sha256(body).digest() != digest:
        raise CorruptDataError("the reference base is truncated or corrupt (its sha256 does not match); "
                               "make it again with `ds4quant reference`", where=where)
    (n,) = struct.unpack_from("<Q", body, len(MAGIC))
    at = len(MAGIC) + 8
    try:
        header = json.loads(body[at:at + n].decode())
    except (UnicodeDecodeError, ValueError):
        raise CorruptDataError("the reference base's header is not JSON", where=where) from None
    if not isinstance(header, dict) or header.get("schema") != SCHEMA:
        raise CorruptDataError(f"not a {SCHEMA} file", where=where)
    if header.get("version") != VERSION:
        raise BadInputError(f"reference base version {header.get('version')!r}; this tool reads version {VERSION}",
                            where=where, hint="make it again with `ds4quant reference`")
    at += n
    arrays = {}
    for name, kind, shape in header["arrays"]:
        size = int(np.prod(shape)) * np.dtype(_DTYPES[kind]).itemsize
        if at + size > len(body):
            raise CorruptDataError(f"array {name} runs past the end of the reference base", where=where)
        arrays[name] = np.frombuffer(body, dtype=_DTYPES[kind], count=int(np.prod(shape)), offset=at).reshape(shape)
        at += size
    if at != len(body):
        raise CorruptDataError(f"{len(body) - at} bytes after the last array", where=where)
    return Base(header, arrays)


def check_base(base: Base, where: str, *, source_fingerprint: str, tokens_sha: str, protocol: Optional[str],
               config: Mapping[str, Any], tool_version: str, ctx_size: Optional[int]) -> None:
    """Refuse a base made for something else, naming the first difference."""
    h = base.header
    want = (("source", "source_fingerprint", source_fingerprint), ("evaluation tokens", "tokens_sha256", tokens_sha),
            ("protocol", "protocol", protocol), ("chunk size (--ctx)", "ctx_size", ctx_size),
            ("model config", "config", dict(config)), ("tool version", "tool_version", tool_version))
    for what, key, value in want:
        got = h.get(key)
        if got != value:
            if isinstance(value, dict) and isinstance(got, dict):
                k = next(k for k in sorted(set(value) | set(got)) if value.get(k) != got.get(k))
                detail = f"{k} {got.get(k)!r} in the base, {value.get(k)!r} here"
            else:
                detail = f"{got!r} in the base, {value!r} here"
            raise BadInputError(f"the reference base was made for another {what}: {detail}", where=where,
                                hint="make it again with `ds4quant reference` for this source and evaluation")
