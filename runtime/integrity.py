"""What ``runtime.load`` checks before any byte of an artifact reaches an owner.

``check_payloads(view)`` hashes every GGUF file (and loose codebook sidecar)
of the artifact and compares each with the sha256 that ``manifest.json``
(else ``SHA256SUMS``) records for it. A GGUF file's hash covers its header,
where the codebook tables live (``ds4quant.codebooks`` and the embedded
Lucebox blobs), and every tensor payload: the expert stacks, the router, the
shared expert and every other dense tensor the runtime reads. So one pass
checks every byte the runtime can use, both copies of every codebook
included; an identical damage to both copies cannot pass.

The files are hashed in parallel (threads: ``hashlib`` releases the GIL while
it hashes a large buffer); a file is one sequential sha256 stream, so the
wall time is that of the largest file at one core's rate when there are
enough threads (docs/performance.md, payload-hash, gives the measured rate). Only when a file's
hash differs are its tensors hashed one by one against the manifest's
per-tensor sha256, in parallel too, so that the refusal names every damaged
tensor, or says the damage is in the file's header (its keys and codebook
tables) when every payload matches.

    check_payloads(view)                  # IntegrityError naming the tensor, or None
    check_payloads(view, threads=1)

``check_structure(view)`` comes first and refuses, in one line, an artifact
whose expert stacks and model keys (``deepseek4.block_count``,
``expert_count``) disagree: a stack of a layer or an expert the keys do not
have, an expert in no stack or in several (what verify's experts check
reports); without it the loader would index past its tables.

An artifact with no recorded hashes (a bare ``.gguf``, a foreign file) is
refused: pass ``verify_payloads=False`` to ``runtime.load`` (or
``--no-verify-payloads``) to load it unchecked.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Mapping, Optional, Sequence

from ds4quant import names
from ds4quant.errors import IntegrityError

__all__ = ["check_payloads", "check_structure", "expected_hashes", "hash_file", "OPT_OUT"]

# what the refusals tell a user who has checked the folder some other way
OPT_OUT = "verify_payloads=False in the API, --no-verify-payloads on the command line"
_CHUNK = 16 << 20  # large enough that hashlib runs without the GIL most of the time
_SHOW = 4  # damaged tensors named in the one-line refusal before "and N more"


def hash_file(path: "str | os.PathLike", chunk_bytes: int = _CHUNK) -> str:
    """Hex sha256 of a file, read in ``chunk_bytes`` pieces into one reused buffer."""
    h = hashlib.sha256()
    buf = bytearray(chunk_bytes)
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(mv[:n])
    return h.hexdigest()


def _hash_span(path: Path, offset: int, nbytes: int, chunk_bytes: int = _CHUNK) -> str:
    h = hashlib.sha256()
    buf = bytearray(min(chunk_bytes, max(nbytes, 1)))
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        left = nbytes
        while left:
            n = f.readinto(mv[:min(left, len(buf))])
            if not n:
                break  # a short file: the hash differs, which is what gets reported
            h.update(mv[:n])
            left -= n
    return h.hexdigest()


def expected_hashes(view) -> tuple[str, dict[str, str], dict[str, str]]:
    """(where the hashes come from, {file relative to the folder: sha256},
    {tensor: payload sha256}); IntegrityError when the artifact records none."""
    man = view.manifest
    if man is None and view.layout.kind == "gguf":
        # a .gguf given by path inside its artifact folder: the folder's manifest still vouches for it
        from ds4quant.artifact.manifest import read_manifest

        beside = view.folder / names.MANIFEST_NAME
        if beside.is_file():
            m = read_manifest(beside)
            if any(f.name == view.rel(view.gguf.path) for f in m.files):
                man = m
    if man is not None:
        return (names.MANIFEST_NAME, {f.name: f.sha256 for f in man.files},
                {t.name: t.sha256 for t in man.tensors})
    if view.sums:
        return names.SUMS_NAME, dict(view.sums), {}
    raise IntegrityError("no manifest.json or SHA256SUMS records the sha256 of its files, so its payloads and "
                         "codebook tables cannot be checked before they are used", where=view.first_file,
                         hint=f"verify it yourself, then load it unchecked: {OPT_OUT}")


def _files(view) -> list[Path]:
    """Every file the runtime may read: the GGUF set and the loose codebook sidecars."""
    return [*view.gguf_paths, *view.sidecars]


def _table_keys(split) -> list[str]:
    keys = [names.KEY_CODEBOOKS, *(names.sidecar_key(k) for k in names.LUCEBOX_KINDS)]
    return [k for k in keys if k in split.kv]


def _damaged_tensors(view, path: Path, want_t: Mapping[str, str], pool: ThreadPoolExecutor) -> list[str]:
    """Tensors of the file at ``path`` whose payload hash differs from the recorded one."""
    split = next((s for s in view.gguf.splits if Path(s.path) == path), None)
    if split is None:
        return []
    todo = [(n, i) for n, i in split.tensors.items() if n in want_t]
    got = pool.map(lambda ni: _hash_span(path, ni[1].offset, ni[1].nbytes), todo)
    return [n for (n, _), sha in zip(todo, got) if sha != want_t[n]]


def check_payloads(view, threads: Optional[int] = None, files: Optional[Sequence[Path]] = None,
                   progress=None) -> None:
    """Refuse (IntegrityError, one line naming the damaged tensors, or the file
    and the codebook tables of its header) unless every file of ``view`` the
    runtime may read hashes to the recorded sha256. threads: default
    min(files, cores); files: a subset (default all); progress: a ProgressFn
    told of each hashed file (stage "payload check", its bytes the work), since
    a DS4 Flash artifact takes tens of seconds."""
    source, want_f, want_t = expected_hashes(view)
    paths = list(files) if files is not None else _files(view)
    unlisted = [view.rel(p) for p in paths if view.rel(p) not in want_f]
    if unlisted:
        raise IntegrityError(f"{source} records no sha256 for it, so it cannot be checked before it is used",
                             where=unlisted[0], hint=f"verify the folder yourself, then load it unchecked: {OPT_OUT}")
    n = max(1, min(len(paths), threads or (os.cpu_count() or 1)))
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="ds4q-hash") as pool:
        if progress is None:
            have = list(pool.map(hash_file, paths))
        else:
            have = _hash_with_progress(pool, paths, view, progress)
        bad = [p for p, sha in zip(paths, have) if sha != want_f[view.rel(p)]]
        if not bad:
            return
        tensors: list[str] = []
        for p in bad:
            tensors += _damaged_tensors(view, Path(p), want_t, pool)
    where = view.rel(bad[0])
    if tensors:
        more = f" and {len(tensors) - _SHOW} more" if len(tensors) > _SHOW else ""
        raise IntegrityError(f"payload sha256 of tensor(s) {', '.join(tensors[:_SHOW])}{more} differs from "
                             f"{source}'s: the artifact is damaged, nothing was loaded", where=where,
                             hint="fetch or convert it again; ds4quant verify lists every damaged tensor")
    split = next((s for s in view.gguf.splits if Path(s.path) == Path(bad[0])), None)
    tables = _table_keys(split) if split is not None else []
    what = (f"its header (metadata keys and codebook tables {', '.join(tables)})" if tables
            else "its header (metadata keys)" if split is not None else "the codebook sidecar")
    raise IntegrityError(f"sha256 differs from {source}'s while every tensor payload matches: {what} is damaged, "
                         "nothing was loaded", where=where, hint="fetch or convert it again")


def _hash_with_progress(pool: ThreadPoolExecutor, paths: Sequence[Path], view, progress) -> list[str]:
    """``hash_file`` of every path on the pool, in path order, one STEP event per
    finished file (in the order they finish)."""
    from concurrent.futures import as_completed

    from ds4quant.progress import Meter

    sizes = [os.path.getsize(p) for p in paths]
    meter = Meter("payload check", total=len(paths), unit="file", total_work=float(sum(sizes)) or 1.0)
    futures = {pool.submit(hash_file, p): k for k, p in enumerate(paths)}
    have: list[str] = [""] * len(paths)
    for f in as_completed(futures):
        k = futures[f]
        have[k] = f.result()
        progress(meter.step(view.rel(paths[k]), work=float(sizes[k]), bytes=sizes[k]))
    progress(meter.finish())
    return have


def check_structure(view) -> None:
    """Refuse (BadInputError, one line naming the tensor) an artifact whose routed-expert
    stacks and model keys disagree (see the module docstring)."""
    from ds4quant.errors import BadInputError

    h, first = view.header, view.first_file
    missing = [k for k, v in ((names.KEY_BLOCK_COUNT, h.n_layer), (names.KEY_EXPERT_COUNT, h.n_expert)) if v is None]
    if missing:
        raise BadInputError(f"no usable {' or '.join(missing)} key: the runtime cannot size its expert tables",
                            where=first)
    bad = [s for s in view.stacks if s.layer >= h.n_layer or any(e >= h.n_expert for e in s.expert_ids)]
    if bad:
        s = bad[0]
        raise BadInputError(f"stack of layer {s.layer} with experts up to {max(s.expert_ids, default=-1)}, but "
                            f"{names.KEY_BLOCK_COUNT} = {h.n_layer} and {names.KEY_EXPERT_COUNT} = {h.n_expert}"
                            + (f" ({len(bad) - 1} more such stack(s))" if len(bad) > 1 else ""),
                            where=f"{first}: {s.name}", hint="the stacks and the model keys disagree; re-convert")
    probs = [p for p in view.problems() if p.check == "experts"]
    if probs:
        p = probs[0]
        more = f" ({len(probs) - 1} more such problem(s))" if len(probs) > 1 else ""
        where = f"{p.file or first}: {p.tensor}" if p.tensor else p.file or first
        raise BadInputError(f"{p.detail}{more}", where=where,
                            hint="the stacks and the model keys disagree; ds4quant verify lists every problem")
