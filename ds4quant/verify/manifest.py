"""Verify stage 3, manifest and sums: per-file and per-tensor sha256 (one read of
each file), ``manifest.json`` against the GGUF (files, tensors, the fields both
state, its canonical form), and ``SHA256SUMS`` when present."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Mapping, Optional

from ds4quant import names
from ds4quant.errors import CorruptDataError, Ds4quantError
from ds4quant.metrics import sqnr_db
from ds4quant.plan import plan_from_json
from ds4quant.records import MANIFEST
from ds4quant.verify._run import Context, show_digests

_CHUNK = 8 << 20


def hash_pass(gf) -> tuple[str, dict[str, str]]:
    """sha256 of one GGUF file and of every tensor payload in it, in one read."""
    spans = sorted((info.offset, info.offset + info.nbytes, name) for name, info in gf.tensors.items())
    fh = hashlib.sha256()
    th = {name: hashlib.sha256() for _, _, name in spans}
    pos = k = 0
    with open(gf.path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            view = memoryview(chunk)
            fh.update(view)
            end = pos + len(chunk)
            j = k
            while j < len(spans) and spans[j][0] < end:
                s, e, name = spans[j]
                if e > pos:
                    th[name].update(view[max(s, pos) - pos:min(e, end) - pos])
                j += 1
            while k < len(spans) and spans[k][1] <= end:
                k += 1
            pos = end
    if pos != gf.file_size:
        raise CorruptDataError(f"file changed while it was read ({gf.file_size} bytes, then {pos})",
                               where=str(gf.path), hint="verify it again")
    return fh.hexdigest(), {n: h.hexdigest() for n, h in th.items()}



def hashes(ctx: Context) -> None:
    """Stage: sha256 of every GGUF file and tensor payload (no check of its own)."""
    for s in ctx.view.gguf.splits:
        fsha, tsha = hash_pass(s)
        ctx.file_sha[ctx.view.rel(s.path)] = fsha
        ctx.tensor_sha.update(tsha)


def manifest_and_sums(ctx: Context) -> None:
    """Stage: manifest.json against the GGUF, then SHA256SUMS."""
    v = ctx.view
    if v.manifest is not None:
        _check_manifest(ctx)
    if v.sums is not None:
        _check_sums(ctx)
    if v.manifest is not None:
        _check_complete(ctx)


# Files a release may carry beside the artifact (publish's card and report), listed in
# SHA256SUMS but not in manifest.json. Hidden files, temp files and GGUF-set files never are.
def _release_extra(name: str) -> bool:
    parts = name.split("/")
    return not (any(p.startswith(".") for p in parts) or name.endswith((".tmp", ".gguf", ".bin")))


def _check_complete(ctx: Context) -> None:
    """Check ``complete``: a folder convert finished (SHA256SUMS, written last, present; no
    work folder left) holding nothing its manifest (or, for release extras, SHA256SUMS) does not list."""
    import os

    from ds4quant.names import LOCK_NAME, SUMS_NAME
    from ds4quant.names import WORK_DIR_NAME as WORK_DIR

    v = ctx.view
    if v.sums is None:
        ctx.fail("complete", "missing: convert writes SHA256SUMS last, so a folder without it is unfinished "
                             "(or the file was removed); rerun convert with --resume", SUMS_NAME)
    if (v.folder / WORK_DIR).exists():
        ctx.fail("complete", "a convert work folder is left: the run did not finish; rerun convert with --resume",
                 WORK_DIR)
    listed = {f.name for f in v.manifest.files} | {MANIFEST, SUMS_NAME}
    sums = v.sums or {}
    for dirpath, dirs, files in os.walk(v.folder):
        rel_dir = os.path.relpath(dirpath, v.folder)
        dirs[:] = sorted(d for d in dirs if not (rel_dir == "." and d == WORK_DIR))
        for fn in sorted(files):
            rel = fn if rel_dir == "." else f"{Path(rel_dir).as_posix()}/{fn}"
            if rel == LOCK_NAME and rel not in sums:
                continue  # convert's lock file stays in its output folder (the lock is an flock on it)
            if rel in listed or (rel in sums and _release_extra(rel)):
                continue
            ctx.fail("complete", "file is not listed in manifest.json" +
                     (" (a temp file of an interrupted write)" if fn.endswith(".tmp") else ""), rel)
    ctx.passed_if_clean("complete", "SHA256SUMS present, no work folder, every file listed", MANIFEST)


def _check_manifest(ctx: Context) -> None:
    from ds4quant.artifact import json_bytes, sha256_file

    run, v = ctx, ctx.view
    manifest, raw, g = v.manifest, v.manifest_bytes, v.gguf
    file_sha, tensor_sha = ctx.file_sha, ctx.tensor_sha

    # files: every listed file present with its size and hash; every artifact file listed
    listed = {f.name for f in manifest.files}
    for f in manifest.files:
        p = v.folder / f.name
        if not p.is_file():
            run.fail("manifest.files", "listed in manifest.json but missing", f.name)
            continue
        size = p.stat().st_size
        if size != f.bytes:
            run.fail("manifest.files", f"is {size} bytes, manifest.json says {f.bytes}", f.name)
        have = file_sha.get(f.name) or sha256_file(p)
        if have != f.sha256:
            a, b = show_digests(have, f.sha256)
            run.fail("manifest.files", f"sha256 {a} differs from manifest.json's {b}", f.name)
    for p in list(g.files) + list(v.sidecars):
        rel = v.rel(p)
        if rel not in listed:
            run.fail("manifest.files", "artifact file is not listed in manifest.json", rel)
    run.passed_if_clean("manifest.files", f"{len(manifest.files)} file(s): sizes and sha256 match", MANIFEST)

    # tensors: the same set, and each entry's fields and payload hash
    entries = {t.name: t for t in manifest.tensors}
    for name in sorted(set(entries) - set(g.tensors)):
        run.fail("manifest.tensors", "listed in manifest.json but not in the GGUF", MANIFEST, name)
    for name, info in g.tensors.items():
        f = Path(info.path).name
        t = entries.get(name)
        if t is None:
            run.fail("manifest.tensors", "in the GGUF but not listed in manifest.json", f, name)
            continue
        diffs = [f"{k} {a!r} vs {b!r}" for k, a, b in (
            ("qtype", info.qtype, t.qtype), ("variant", info.variant, t.variant),
            ("ggml_type", info.ggml_type, t.ggml_type), ("shape", list(info.shape), list(t.shape)),
            ("bytes", info.nbytes, t.bytes)) if a != b]
        if diffs:
            run.fail("manifest.tensors", "GGUF and manifest.json disagree: " + ", ".join(diffs), f, name)
        if tensor_sha.get(name) != t.sha256:
            a, b = show_digests(tensor_sha.get(name, "?"), t.sha256)
            run.fail("manifest.tensors", f"payload sha256 {a} differs from manifest.json's {b}", f, name)
    run.passed_if_clean("manifest.tensors", f"{len(entries)} tensors: qtype, variant, type, shape, bytes and "
                                            "payload sha256 match", MANIFEST)

    # what the manifest and the GGUF both state must agree
    def kv_str(key: str) -> Optional[str]:
        kv = g.kv.get(key)
        return kv.value if kv is not None and isinstance(kv.value, str) else None

    fp = kv_str(names.KEY_SOURCE_FINGERPRINT)
    if fp is not None and manifest.source.get("fingerprint") != fp:
        run.fail("manifest.consistency", f"source fingerprint {manifest.source.get('fingerprint')!r} differs from "
                                         f"the GGUF's {names.KEY_SOURCE_FINGERPRINT} {fp!r}", MANIFEST)
    tv = kv_str(names.KEY_TOOL_VERSION)
    if tv is not None and manifest.tool_version != tv:
        run.fail("manifest.consistency", f"tool_version {manifest.tool_version!r} differs from the GGUF's {tv!r}",
                 MANIFEST)
    rj = kv_str(names.KEY_RECIPE)
    if rj is not None:
        try:
            rk = json.loads(rj)
        except ValueError:
            run.fail("manifest.consistency", f"the GGUF's {names.KEY_RECIPE} is not JSON", ctx.first)
        else:
            mr = manifest.to_json()["recipe"]
            bad = sorted(k for k in (rk if isinstance(rk, dict) else {}) if mr.get(k) != rk[k])
            if bad or not isinstance(rk, dict):
                run.fail("manifest.consistency", f"recipe field(s) {', '.join(bad) or '(all)'} differ from the "
                                                 f"GGUF's {names.KEY_RECIPE}", MANIFEST)
    plan = manifest.recipe.get("plan")
    if isinstance(plan, (list, tuple)):
        bases = {names.base_name(n) for n in g.tensors}
        choices, problems = plan_from_json(plan)
        for p in problems:
            run.fail("manifest.consistency", f"recipe.plan has an entry that is no tensor choice: {p}", MANIFEST)
        for c in choices:
            n = c.name
            info = g.tensors.get(n)
            if info is None:
                if n not in bases:
                    run.fail("manifest.consistency", "recipe.plan names a tensor the GGUF lacks", MANIFEST, n)
                continue
            if c.qtype != info.qtype or list(c.shape) != list(info.shape):
                run.fail("manifest.consistency", f"recipe.plan says {c.qtype} {list(c.shape)}, "
                                                 f"the GGUF holds {info.qtype} {list(info.shape)}", MANIFEST, n)
            sn = names.parse_stack(n)
            got = {"layer": c.layer}
            want: dict = {"layer": names.layer_of(n)}
            if sn is not None:
                got.update(surface=c.surface, **{"class": c.tensor_class})
                want.update(surface=sn.proj.value, **{"class": "routed_expert"})
            bad = sorted(k for k, v in want.items() if got[k] != v)
            if bad:
                run.fail("manifest.consistency", f"recipe.plan field(s) {', '.join(bad)} contradict the tensor name",
                         MANIFEST, n)
    for t in manifest.tensors:
        why = _errors_inconsistent(t.errors)
        if why:
            run.fail("manifest.consistency", f"error figures disagree with each other: {why}", MANIFEST, t.name)
    try:
        canonical = json_bytes(json.loads(raw.decode("utf-8"))) == raw
    except (ValueError, Ds4quantError):
        canonical = False
    if not canonical:
        run.fail("manifest.consistency", "manifest.json is not in canonical form (sorted keys, 2-space indent, "
                                         "one trailing newline): it was edited or damaged", MANIFEST)
    run.passed_if_clean("manifest.consistency", "fingerprint, tool version, recipe, plan and error figures agree "
                                                "with the GGUF and with each other", MANIFEST)


def _errors_inconsistent(errors: Optional[Mapping[str, float]]) -> str:
    if not errors:
        return ""
    sse, ssx = errors.get("sse"), errors.get("ssx")
    for k in ("sse", "ssx", "weighted_sse", "weighted_ssx", "rel_mse"):
        if k in errors and errors[k] < 0:
            return f"{k} = {errors[k]} is negative"
    if ("weighted_sse" in errors) != ("weighted_ssx" in errors):
        return "weighted_sse and weighted_ssx come as a pair"
    if sse is None or ssx is None:
        return ""
    if "rel_mse" in errors:
        want = sse / ssx if ssx > 0 else 0.0
        if not math.isclose(errors["rel_mse"], want, rel_tol=1e-9, abs_tol=0.0):
            return f"rel_mse {errors['rel_mse']!r} but sse / ssx = {want!r}"
    if "sqnr_db" in errors:
        want = sqnr_db(sse, ssx)
        if not (math.isfinite(want) and math.isclose(errors["sqnr_db"], want, rel_tol=1e-9, abs_tol=1e-12)):
            return f"sqnr_db {errors['sqnr_db']!r} but 10 log10(ssx / sse) = {want!r}"
    elif sse > 0 and ssx > 0:
        return "sqnr_db is missing though sse > 0"
    return ""


def _check_sums(ctx: Context) -> None:
    from ds4quant.artifact import sha256_file
    from ds4quant.artifact.sums import SUMS_NAME, list_files

    run, folder, sums, file_sha = ctx, ctx.view.folder, ctx.view.sums, ctx.file_sha

    for name, want in sums.items():
        p = folder / name
        if not p.is_file():
            run.fail("sha256sums", "listed in SHA256SUMS but missing", name)
            continue
        have = file_sha.get(name) or sha256_file(p)
        if have != want:
            a, b = show_digests(have, want)
            run.fail("sha256sums", f"sha256 {a} differs from SHA256SUMS's {b}", name)
    try:
        present = list_files(folder)
    except Ds4quantError as e:
        run.fail("sha256sums", e.one_line(), SUMS_NAME)
        present = []
    for name in present:
        if name not in sums:
            run.fail("sha256sums", "file is not listed in SHA256SUMS", name)
    run.passed_if_clean("sha256sums", f"{len(sums)} file(s) listed, all present and matching; nothing unlisted",
                        SUMS_NAME)
