"""Stage 4 of convert: the GGUF (or splits) from the pieces, the codebook tables, the manifest.

The runtimes key comes from ``artifact.runtimes.decide`` over the KVs and
planned tensors about to be written, the same decision the artifact view
makes when it reads the result, so convert, inspect, verify and the model
card cannot disagree. Whenever the artifact carries Lucebox codebook blobs
they are written twice, embedded and as loose ``NAME.gguf.*.bin`` files
(unless ``loose_sidecars=False``), because some Lucebox loaders read only the
loose files (docs/runtimes.md); the key then says ``lucebox-mix``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Iterator, Mapping, Optional

import numpy as np

from ds4quant.version import VERSION
from ds4quant.plan import Books, PlanSummary, Recipe
from ds4quant.artifact import FileEntry, GGUFWriter, Manifest, TensorEntry, atomic_write_bytes
from ds4quant.artifact.runtimes import Decision, LuceboxBooks, Tensor, decide
from ds4quant.errors import UnsupportedFormatError
from ds4quant.formats import QTYPES, get_qtype
from ds4quant.names import (
    KEY_CODEBOOKS,
    KEY_GUMIX,
    KEY_P4MIX,
    KEY_PLAN,
    KEY_RECIPE,
    KEY_RUNTIMES,
    KEY_SOURCE_FINGERPRINT,
    KEY_TOOL_VERSION,
    expert_ids_key,
    sidecar_suffix,
)
from ds4quant.sources.base import Source

_CHUNK = 8 << 20


def codebook_table(plan, books: Books, n_global: int):
    """ds4quant's own table: one entry per resident MIX tensor (None if none)."""
    from ds4quant.codebooks import CodebookEntry, CodebookTable

    entries = []
    for c in plan:
        qt = get_qtype(c.qtype) if c.qtype in QTYPES else None
        if qt is None or not qt.is_mix:
            continue
        ids = c.experts if c.experts is not None else tuple(range(c.shape[2]))
        got = [books.get(c.base, e, qt.name) for e in ids]
        entries.append(CodebookEntry(
            c.name, qt.name,
            modes=np.array([m for _, m in got], dtype=np.uint8),
            books=np.stack([b for b, _ in got]).astype(np.float32),
            expert_ids=c.experts, n_global=n_global if c.experts is not None else None,
        ))
    return CodebookTable(tuple(entries)) if entries else None


def _lucebox_blobs(plan, table):
    """Lucebox sidecars for the table, or None when there is no table or Lucebox cannot load it."""
    from ds4quant.codebooks import to_lucebox

    if table is None:
        return None
    dims = {c.name: (c.shape[1], c.shape[0]) for c in plan if c.tensor_class == "routed_expert"}
    try:
        return to_lucebox(table, dims)
    except UnsupportedFormatError:
        return None


def _file_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while True:
            b = f.read(_CHUNK)
            if not b:
                return
            yield b


def assemble(out: Path, art_name: str, rec: Recipe, plan, kvs, pieces: Path, split_bytes: Optional[int],
             source_fp: str, table, loose_sidecars: bool, adaptive_info: Optional[PlanSummary]):
    """Write the GGUF set (all splits or none) and loose sidecars;
    (files, codebook bytes, runtimes decision, oversize splits, file sha256s)."""
    # Files of an earlier attempt (this name or, on a resume under a new --name, the one its
    # manifest lists) and temp files a killed write left would confuse readers and the sums.
    from ds4quant.convert.outdir import LOCK_NAME, WORK_DIR, own_files

    for p in own_files(out, art_name)[0]:
        if p.name not in (WORK_DIR, LOCK_NAME) and not p.is_dir():
            p.unlink()
    w = GGUFWriter(out / f"{art_name}.gguf", split_max_bytes=split_bytes)
    for kv in kvs:
        w.add_kv(kv.key, kv.value, kv.type, kv.sub_type)
    w.add_string("general.name", art_name)
    w.add_uint32("general.quantization_version", 2)
    w.add_string(KEY_TOOL_VERSION, VERSION)
    w.add_string(KEY_RECIPE, json.dumps(rec.to_json(), sort_keys=True))
    w.add_string(KEY_SOURCE_FINGERPRINT, source_fp)
    if adaptive_info is not None:
        w.add_string(KEY_PLAN, json.dumps([c.to_json() for c in plan], sort_keys=True))
    cb_bytes = 0
    blobs = _lucebox_blobs(plan, table)
    if table is not None:
        from ds4quant.codebooks import write_table

        raw = write_table(table)
        w.add_blob(KEY_CODEBOOKS, raw)
        cb_bytes += len(raw)
        if blobs is not None:
            for key, blob in ((KEY_GUMIX, blobs.gumix), (KEY_P4MIX, blobs.p4mix)):
                if blob is not None:
                    w.add_blob(key, blob)
    loose = loose_sidecars and blobs is not None
    decision = decide(w.kv, {c.name: Tensor(c.qtype, tuple(c.shape), c.experts is not None) for c in plan},
                      LuceboxBooks(any=blobs is not None, loose=loose))
    from gguf import GGUFValueType as VT

    # sorted: the order artifacts have always stored (the decision lists them in engine order)
    w.add_array(KEY_RUNTIMES, sorted(decision.runtimes), VT.STRING)
    for c in plan:
        if c.experts is not None:
            w.add_array(expert_ids_key(c.name), list(c.experts), VT.UINT32)
    for i, choice in enumerate(plan):
        piece = pieces / f"{i:05d}.bin"
        w.add_tensor(choice.name, choice.qtype, choice.shape, data=(lambda p=piece: _file_chunks(p)))
    files = list(w.write())
    file_sha = dict(w.sha256)  # hashed while streaming
    oversize = w.oversize
    if loose:
        for kind, blob in (("gumix", blobs.gumix), ("p4mix", blobs.p4mix)):
            if blob is not None:
                side = files[0].with_name(files[0].name + sidecar_suffix(kind))
                atomic_write_bytes(side, blob)
                files.append(side)
                file_sha[side] = hashlib.sha256(blob).hexdigest()
    return files, cb_bytes, decision, oversize, file_sha


# Options that never change bytes (resume.MAY_CHANGE's output-side subset): dropped from the
# recorded command so the manifest, and so SHA256SUMS, are the same for the same inputs.
_NO_BYTES_FLAGS = ("--json", "--resume", "--force")
_NO_BYTES_VALUED = ("--threads", "--cache-dir", "--jobs", "--device")

def normalized_command(argv) -> tuple[str, ...]:
    """``argv`` without options that cannot change bytes (--threads N, --cache-dir D, --json,
    --resume, --force; ``--opt=value`` forms too)."""
    out, skip = [], False
    for a in argv:
        a = str(a)
        if skip:
            skip = False
            continue
        if a in _NO_BYTES_FLAGS or any(a.startswith(o + "=") for o in _NO_BYTES_VALUED):
            continue
        if a in _NO_BYTES_VALUED:
            skip = True
            continue
        out.append(a)
    return tuple(out)


def manifest(out: Path, files, src: Source, rec: Recipe, plan, results, overrides, imatrix, imx_sha, command,
             source_fp: str, runtimes, adaptive_info, table, file_sha: Optional[Mapping[Path, str]] = None) -> Manifest:
    """The manifest from the plan and the pieces: per-tensor payload hashes were taken while
    encoding, so the finished GGUF is not read back for them."""
    from ds4quant.artifact.portable import portable_command, portable_path
    from ds4quant.artifact.qtypes import type_ref

    mix_names = set(table.names) if table is not None else set()
    entries = []
    for choice, res in zip(plan, results):
        ref = type_ref(choice.qtype)
        entries.append(TensorEntry(choice.name, choice.qtype, ref.variant, ref.ggml_type,
                                   tuple(choice.shape), res.nbytes, res.sha256,
                                   KEY_CODEBOOKS if choice.name in mix_names else None, res.errors_json()))
    recipe = dict(rec.to_json())
    recipe["tensor_types"] = [o.pattern + "=" + o.qtype for o in overrides]
    # paths as names (or relative ones): no absolute path of this machine in the artifact (artifact.portable)
    recipe["imatrix"] = ({"path": portable_path(imatrix), "sha256": imx_sha} if imatrix is not None else None)
    recipe["runtimes"] = list(runtimes)
    if adaptive_info is not None:
        recipe["allocation"] = adaptive_info.artifact_json()
    recipe["plan"] = [c.to_json() for c in plan]
    return Manifest(
        tool_version=VERSION,
        command=portable_command(normalized_command(command if command is not None else sys.argv)),
        source={"path": portable_path(src.path), "fingerprint": source_fp, "format": src.format},
        recipe=recipe,
        files=tuple(FileEntry(p.relative_to(out).as_posix(), p.stat().st_size, file_sha[p])
                    if file_sha and p in file_sha else FileEntry.of(p, p.relative_to(out).as_posix())
                    for p in files),
        tensors=tuple(entries),
    )
