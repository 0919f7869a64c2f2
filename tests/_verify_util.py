"""Artifacts for verify/publish tests, built from the shipped tiny checkpoint.

``strix_artifact`` converts the sample with the uniform rocmfp2-strix recipe.
``mix_artifact`` rewrites such an artifact into an adaptive one the way the
MIX storage convention says (DESIGN.md item 4):

- blk.1 gate/up: rocmfp2_mix full stacks (Lucebox GUMIXs1-representable);
  blk.1 gate expert 3 in mode 0 (fixed levels);
- blk.2 down: rocmfp3_mix full stack (P4MIXv1);
- blk.3 gate: per-expert granularity, two compact stacks
  ``blk.3.ffn_gate_exps.rocmfp2_mix.weight`` (experts MIX_IDS) and
  ``blk.3.ffn_gate_exps.rocmfp2.weight`` (the rest), each with its
  ``ds4quant.expert_ids.<name>`` list;
- the own table in KV ``ds4quant.codebooks``; the Lucebox blobs embedded as
  ``deepseek4.{p4mix,gumix}.sidecar`` and, optionally, a loose
  ``NAME.gguf.gumix.bin``; a manifest with every hash and error figure.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np
from gguf import GGUFValueType as VT

from ds4quant import formats
from ds4quant.artifact import (
    FileEntry,
    GGUFWriter,
    Manifest,
    read_gguf_set,
    read_manifest,
    tensor_entries,
    write_manifest,
)
from ds4quant.artifact.tags import RESERVED_KEYS, TAG_PREFIX
from ds4quant.codebooks import CodebookEntry, CodebookTable, fit_reference, to_lucebox, write_table
from ds4quant.sources.official import open_source

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "samples" / "ds4-tiny"
MIX_IDS = (0, 2, 5, 7, 11)
MODE0_EXPERTS = (3,)  # blk.1 gate experts stored in MIX mode 0 (fixed levels)
N_EXPERTS = 16


def gguf_of(folder: Path) -> Path:
    return next(p for p in sorted(Path(folder).iterdir()) if p.suffix == ".gguf")


def strix_artifact(out: Path) -> Path:
    from ds4quant.convert import convert

    convert(SAMPLE, out, "rocmfp2-strix", threads=1, command=["ds4quant", "convert", "samples/ds4-tiny", str(out)])
    return out


def _errors(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    d = x.astype(np.float64) - y.astype(np.float64)
    return float(np.sum(d * d)), float(np.sum(x.astype(np.float64) ** 2))


def _errors_json(sse: float, ssx: float) -> dict:
    d = {"rel_mse": sse / ssx if ssx > 0 else 0.0, "sse": sse, "ssx": ssx}
    if sse > 0 and ssx > 0:
        d["sqnr_db"] = 10.0 * float(np.log10(ssx / sse))
    return d


def _encode_mix(src, layer: int, which: str, qtype: str, ids, mode0=()) -> tuple[bytes, np.ndarray, np.ndarray,
                                                                               float, float]:
    """Encode experts ``ids`` of one stack with per-expert fitted books.

    mode0: local experts stored in mode 0 (fixed levels, docs/formats.md#mix): for
    rocmfp2_mix their blocks are rocmfp2 blocks (without fp2s, bit 7 clear)."""
    levels = formats.QTYPES[qtype].codebook_levels
    w = {"gate": "w1", "up": "w3", "down": "w2"}[which]
    xs = [src.read_dequantized(f"layers.{layer}.ffn.experts.{e}.{w}.weight") for e in ids]
    books = np.stack([fit_reference([x], levels)[0] for x in xs]).astype(np.float32)
    modes = np.ones(len(ids), np.uint8)
    x = np.concatenate(xs)
    q = formats.encode(qtype, x, codebooks=books)
    rows = xs[0].shape[0]
    for i in mode0:
        modes[i] = 0
        q[i * rows:(i + 1) * rows] = formats.encode("rocmfp2", xs[i])
    y = formats.decode(qtype, q, x.shape[1], books, modes)
    sse, ssx = _errors(x, y)
    return q.tobytes(), books, modes, sse, ssx


def mix_artifact(strix: Path, out: Path, *, loose_gumix: bool = False, lucebox: bool = True, compact: bool = True,
                 split_max_size: Optional[int] = None) -> Path:
    """Rewrite the strix artifact ``strix`` into an adaptive artifact in ``out``
    (``compact=False``: no per-expert stacks, so Lucebox blobs can cover every MIX tensor)."""
    out.mkdir(parents=True, exist_ok=True)
    g = read_gguf_set(gguf_of(strix))
    man = read_manifest(strix / "manifest.json")
    src = open_source(SAMPLE)
    try:
        replaced: dict[str, tuple[str, tuple, bytes]] = {}
        entries: list[CodebookEntry] = []
        errors: dict[str, dict] = {t.name: dict(t.errors) for t in man.tensors if t.errors}
        full_ids = tuple(range(N_EXPERTS))
        for layer, which, qtype in ((1, "gate", "rocmfp2_mix"), (1, "up", "rocmfp2_mix"), (2, "down", "rocmfp3_mix")):
            name = f"blk.{layer}.ffn_{which}_exps.weight"
            mode0 = MODE0_EXPERTS if (layer, which) == (1, "gate") else ()
            data, books, modes, sse, ssx = _encode_mix(src, layer, which, qtype, full_ids, mode0)
            replaced[name] = (qtype, g.tensors[name].shape, data)
            entries.append(CodebookEntry(name, qtype, modes, books))
            errors[name] = _errors_json(sse, ssx)
        # blk.3 gate: per-expert granularity, two compact stacks
        base = "blk.3.ffn_gate_exps.weight" if compact else "(none)"
        info = g.tensors["blk.3.ffn_gate_exps.weight"]
        rest = tuple(i for i in full_ids if i not in MIX_IDS)
        per = info.nbytes // N_EXPERTS
        raw = bytes(g.tensor_data("blk.3.ffn_gate_exps.weight"))
        data, books, modes, sse, ssx = _encode_mix(src, 3, "gate", "rocmfp2_mix", MIX_IDS)
        mix_name = "blk.3.ffn_gate_exps.rocmfp2_mix.weight"
        rest_name = "blk.3.ffn_gate_exps.rocmfp2.weight"
        stacks = {
            mix_name: ("rocmfp2_mix", info.shape[:2] + (len(MIX_IDS),), data, MIX_IDS),
            rest_name: ("rocmfp2", info.shape[:2] + (len(rest),), b"".join(raw[i * per:(i + 1) * per] for i in rest),
                        rest),
        }
        if compact:
            entries.append(CodebookEntry(mix_name, "rocmfp2_mix", modes, books, MIX_IDS, N_EXPERTS))
            errors[mix_name] = _errors_json(sse, ssx)
        xs = [src.read_dequantized(f"layers.3.ffn.experts.{e}.w1.weight") for e in rest]
        x = np.concatenate(xs)
        y = formats.decode("rocmfp2", np.frombuffer(stacks[rest_name][2], np.uint8), x.shape[1])
        errors[rest_name] = _errors_json(*_errors(x, y))
        errors.pop(base, None)
    finally:
        src.close()

    table = CodebookTable(tuple(entries))
    name = gguf_of(strix).name
    w = GGUFWriter(out / name, split_max_bytes=split_max_size)
    for key, kv in g.kv.items():
        if key.startswith(TAG_PREFIX) or key in RESERVED_KEYS or key.startswith("split.") or key == "general.alignment":
            continue
        value = kv.value
        if key == "ds4quant.runtimes":
            # what the contents allow (artifact.runtimes.decide): compact stacks load in ds4quant only,
            # Lucebox needs its blobs to cover every MIX tensor; the p4mix blob is embedded only, so only
            # loaders that read embedded blobs qualify; the strix base holds rocmfp2 (107): no affine build
            value = ("ds4quant", "lucebox-mix-embedded") if lucebox and not compact else ("ds4quant",)
        w.add_kv(key, value, kv.type, kv.sub_type)
    w.add_blob("ds4quant.codebooks", write_table(table))
    full = CodebookTable(tuple(e for e in entries if e.expert_ids is None))
    dims = {e.name: (g.tensors[e.name].shape[1], g.tensors[e.name].shape[0]) for e in full.entries}
    blobs = to_lucebox(full, dims)
    if lucebox:
        w.add_blob("deepseek4.p4mix.sidecar", blobs.p4mix)
        w.add_blob("deepseek4.gumix.sidecar", blobs.gumix)
    for cname, (_, _, _, ids) in (stacks.items() if base in g.tensors else ()):
        w.add_array(f"ds4quant.expert_ids.{cname}", np.array(ids, np.uint32), VT.UINT32)
    for tname, tinfo in g.tensors.items():
        if tname in replaced:
            q, shape, data = replaced[tname]
            w.add_tensor(tname, q, shape, data)
        elif tname == base:
            for cname, (q, shape, data, _) in stacks.items():
                w.add_tensor(cname, q, shape, data)
        else:
            w.add_tensor(tname, tinfo.qtype, tinfo.shape, bytes(g.tensor_data(tname)))
    files = list(w.write())
    if loose_gumix:
        p = files[0].with_name(files[0].name + ".gumix.bin")
        p.write_bytes(blobs.gumix)
        files.append(p)
    g2 = read_gguf_set(files[0])
    recipe = json.loads(json.dumps(man.to_json()["recipe"]))
    for c in recipe.get("plan", []):
        if c["name"] in replaced:
            c["qtype"] = replaced[c["name"]][0]
    m2 = Manifest(man.tool_version, man.command, man.to_json()["source"], recipe,
                  tuple(FileEntry.of(p, p.relative_to(out).as_posix()) for p in files),
                  tensor_entries(g2, codebooks={e.name: "ds4quant.codebooks" for e in entries}, errors=errors))
    write_manifest(out / "manifest.json", m2)
    write_artifact_sums(out)
    return out


def write_artifact_sums(out: Path) -> None:
    """SHA256SUMS over the manifest's files and manifest.json, as convert writes it last."""
    from ds4quant.artifact.sums import write_sums

    man = read_manifest(out / "manifest.json")
    write_sums(out, names=[f.name for f in man.files] + ["manifest.json"])


def flip(path: Path, offset: int, mask: int = 0x01) -> None:
    """XOR one byte of a file in place (apply twice to restore)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


_DROP = object()


def rewrite(folder: Path, out: Path, *, kv: Optional[dict] = None, qtypes: Optional[dict] = None,
            payloads: Optional[dict] = None, loose: Optional[dict] = None, manifest_edit=None,
            tags: bool = True, shapes: Optional[dict] = None) -> Path:
    """Copy an artifact with edits, then write a manifest that matches the new
    files (so only the check aimed at fails).

    kv: key -> (value, type, sub_type) to set, or None to drop the key;
    qtypes: tensor -> qtype to tag it with (payload kept); payloads: tensor ->
    new payload bytes; loose: suffix (".gumix.bin") -> bytes, or None to drop;
    manifest_edit: fn(dict) -> None applied to the manifest JSON object;
    tags=False writes a foreign-style GGUF without ds4quant qtype tags;
    shapes: tensor -> new GGUF shape (give a payload of its size too).
    """
    out.mkdir(parents=True, exist_ok=True)
    src_gguf = gguf_of(folder)
    g = read_gguf_set(src_gguf)
    man = read_manifest(folder / "manifest.json")
    kv = dict(kv or {})
    qtypes = qtypes or {}
    payloads = payloads or {}
    if qtypes and "ds4quant.runtimes" in g.kv and "ds4quant.runtimes" not in kv:
        # retagging changes which runtimes can load it: keep the key true to the contents
        from ds4quant.artifact.runtimes import LuceboxBooks, Tensor, decide
        from ds4quant.artifact.view import open_artifact
        from ds4quant.names import parse_stack

        v0 = open_artifact(folder)
        rts = decide(g.kv, {n: Tensor(qtypes.get(n, i.qtype), tuple(i.shape),
                                      bool(parse_stack(n) and parse_stack(n).compact))
                            for n, i in g.tensors.items()},
                     LuceboxBooks(v0.lucebox_books, v0.lucebox_loose_books)).runtimes
        kv["ds4quant.runtimes"] = (list(rts), VT.ARRAY, VT.STRING)
    w = GGUFWriter(out / src_gguf.name, tags=tags)
    for key, v in g.kv.items():
        if key.startswith(TAG_PREFIX) or key in RESERVED_KEYS or key.startswith("split.") or key == "general.alignment":
            continue
        if key in kv:
            if kv[key] is not None:
                w.add_kv(key, *kv[key])
            continue
        w.add_kv(key, v.value, v.type, v.sub_type)
    for key, v in kv.items():
        if key not in g.kv and v is not None:
            w.add_kv(key, *v)
    for name, info in g.tensors.items():
        w.add_tensor(name, qtypes.get(name, info.qtype), (shapes or {}).get(name, info.shape),
                     payloads.get(name, bytes(g.tensor_data(name))))
    files = list(w.write())
    for p in folder.iterdir():
        if p.suffix == ".bin":
            suffix = p.name[len(src_gguf.name):]
            data = (loose or {}).get(suffix, p.read_bytes())
            if data is not None:
                (out / p.name).write_bytes(data)
                files.append(out / p.name)
    for suffix, data in (loose or {}).items():
        p = out / (src_gguf.name + suffix)
        if data is not None and p not in files:
            p.write_bytes(data)
            files.append(p)
    g2 = read_gguf_set(files[0], variant_107=None if tags else "rocmfp2")
    obj = man.to_json()
    for c in obj["recipe"].get("plan", []):
        if c["name"] in qtypes:
            c["qtype"] = qtypes[c["name"]]
        if c["name"] in (shapes or {}):
            c["shape"] = list(shapes[c["name"]])
    old = {t["name"]: t for t in obj["tensors"]}
    m2 = Manifest(obj["tool_version"], obj["command"], obj["source"], obj["recipe"],
                  tuple(FileEntry.of(p, p.relative_to(out).as_posix()) for p in files),
                  tensor_entries(g2, codebooks={n: t["codebook"] for n, t in old.items() if "codebook" in t},
                                 errors={n: t["errors"] for n, t in old.items() if "errors" in t}))
    obj = m2.to_json()
    if manifest_edit is not None:
        manifest_edit(obj)
    from ds4quant.artifact import atomic_write_json

    atomic_write_json(out / "manifest.json", obj)
    try:
        write_artifact_sums(out)
    except Exception:  # a manifest_edit made it unreadable on purpose: no sums then
        (out / "SHA256SUMS").unlink(missing_ok=True)
    return out
