"""Small synthetic expert layers for the runtime tests (hidden 256, ffn 128).

Seeds come from (qtype, layer, proj, expert), so every test builds the same
bytes. ``layer_stacks`` returns gate/up/down ExpertStacks of some experts and
the MIX codebook entries (mode 1 and mode 0 experts mixed) they need.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib

import numpy as np

from ds4quant import formats
from ds4quant.codebooks import CodebookEntry
from ds4quant.names import Proj, stack_name
from ds4quant.runtime.owners.base import ExpertStack

HIDDEN, FFN = 256, 128
GPU_RECORD_ENV = "DS4Q_GPU_RECORD"  # a path: the GPU tests append their hashes there as JSON lines
EXACT_QTYPES = ("rocmfp2", "rocmfp2_affine", "rocmfp2_s40", "rocmfp3", "rocmfp4", "rocmfp4_fast",
                "rocmfp6", "rocmfp8", "rocmfp2_mix", "rocmfp3_mix", "mxfp4", "q8_0", "bf16")


def rng_for(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def books_for(qtype: str, layer: int, expert: int) -> np.ndarray:
    L = formats.QTYPES[qtype].codebook_levels
    r = rng_for("books", qtype, layer, expert)
    while True:
        b = formats.bf16_round(np.sort(r.uniform(-1, 1, (2, L)), axis=-1).astype(np.float32))
        if np.all(np.diff(b, axis=-1) > 0):
            return b


def mode_for(qtype: str, expert: int) -> int:
    return 0 if expert % 3 == 2 else 1  # some fixed-level experts in every MIX stack


def weights(qtype: str, layer: int, proj: str, expert: int, rows: int, cols: int) -> np.ndarray:
    r = rng_for("w", qtype, layer, proj, expert)
    return (r.standard_normal((rows, cols)) * 0.05 * (1 + (expert % 4))).astype(np.float32)


def encode_expert(qtype: str, layer: int, proj: str, expert: int, rows: int, cols: int) -> np.ndarray:
    w = weights(qtype, layer, proj, expert, rows, cols)
    if formats.QTYPES[qtype].is_mix:
        return formats.encode(qtype, w, codebooks=books_for(qtype, layer, expert), mode=mode_for(qtype, expert))
    return formats.encode(qtype, w)


def layer_stacks(qtype: str, layer: int, experts, *, tensor_suffix: str = ""):
    """({proj: ExpertStack}, {tensor: CodebookEntry}) for the given global experts."""
    experts = tuple(int(e) for e in experts)
    stacks, entries = {}, {}
    for proj in ("gate", "up", "down"):
        rows, cols = (FFN, HIDDEN) if proj != "down" else (HIDDEN, FFN)
        data = np.stack([encode_expert(qtype, layer, proj, e, rows, cols) for e in experts])
        name = stack_name(layer, Proj(proj), qtype) + tensor_suffix
        stacks[proj] = ExpertStack(name, layer, proj, qtype, rows, cols, experts, data)
        if formats.QTYPES[qtype].is_mix:
            entries[name] = CodebookEntry(
                name, qtype, np.array([mode_for(qtype, e) for e in experts], np.uint8),
                np.stack([books_for(qtype, layer, e) for e in experts]), expert_ids=experts, n_global=64)
    return stacks, entries


def hold_layer(owner, qtype: str, layer: int, experts) -> dict:
    """Make ``layer_stacks(qtype, layer, experts)`` resident on ``owner`` with their MIX books
    registered; the stacks by projection."""
    stacks, entries = layer_stacks(qtype, layer, experts)
    return hold(owner, stacks, entries, experts)


def hold(owner, stacks: dict, entries: dict, experts) -> dict:
    """Make ``stacks`` resident on ``owner`` and register their MIX ``entries``; ``stacks``."""
    for st in stacks.values():
        owner.add_stack(st)
    for t, ent in entries.items():
        owner.register_books(t, tuple(int(e) for e in experts), ent)
    return stacks


def decoded(stack: ExpertStack, local: int) -> np.ndarray:
    """formats.decode of one resident expert (the independent path)."""
    qt = formats.QTYPES[stack.qtype]
    kw = {}
    if qt.is_mix:
        e = stack.expert_ids[local]
        kw = dict(codebooks=books_for(stack.qtype, stack.layer, e), modes=mode_for(stack.qtype, e))
    return formats.decode(stack.qtype, stack.data[local], stack.cols, **kw)


def tokens(n: int, seed: int = 0, hidden: int = HIDDEN) -> np.ndarray:
    r = rng_for("x", seed)
    return (r.standard_normal((n, hidden)) * np.exp(r.standard_normal((n, 1)))).astype(np.float32)


# ---------------------------------------------------------------------------
# identity-encoded experts: value = f(layer, expert, proj, row), so a held
# expert's bytes say which expert they are


def identity_rows(layer: int, expert: int, proj: int, rows: int, cols: int) -> np.ndarray:
    """One expert's rows: (layer, expert, proj, row % 256, row // 256) in the
    first columns, 0.5 elsewhere (bf16-exact small numbers)."""
    v = np.full((rows, cols), 0.5, np.float32)
    v[:, 0], v[:, 1], v[:, 2] = layer, expert, proj
    v[:, 3], v[:, 4] = np.arange(rows) % 256, np.arange(rows) // 256
    return v


def write_identity_artifact(artifact, out):
    """``artifact``'s GGUF with every routed expert rewritten as bf16 identity rows (a
    folder ``out`` holding ``ident.gguf`` and its manifest, so runtime.load can check
    its hashes); every other tensor and key kept."""
    from ds4quant.artifact import FileEntry, GGUFWriter, Manifest, read_gguf_set, tensor_entries, write_manifest
    from ds4quant.names import PROJS, parse_stack

    src = read_gguf_set(next(artifact.glob("*.gguf")))
    out.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(out / "ident.gguf")
    for key, kv in src.kv.items():
        if key in ("general.alignment", "ds4quant.format_version", "ds4quant.qtype_variants") \
                or key.startswith(("split.", "ds4quant.qtype.")):
            continue
        w.add_kv(key, kv.value, kv.type, kv.sub_type)
    for name, t in src.tensors.items():
        s = parse_stack(name)
        if s is None:
            w.add_tensor(name, t.qtype, t.shape, np.asarray(src.tensor_data(name)).tobytes())
            continue
        cols, rows, n = t.shape
        vals = np.concatenate([identity_rows(s.layer, e, PROJS.index(s.proj), rows, cols) for e in range(n)])
        w.add_tensor(name, "bf16", t.shape, formats.encode("bf16", vals).tobytes())
    w.write()
    made = read_gguf_set(out / "ident.gguf")
    write_manifest(out / "manifest.json", Manifest("test", ("identity",), {}, {},
                                                   files=(FileEntry.of(out / "ident.gguf"),),
                                                   tensors=tensor_entries(made)))
    return out


def moe_ref64(stacks, x, ids, limit: float = 10.0, bf16: bool = False) -> np.ndarray:
    """Each slot's expert in float64 from the independently decoded weights:
    down @ (silu(min(gate x, L)) * clip(up x, -L, L)). ``bf16``: the activations rounded
    to bf16 as the tensor-core prefill kernels feed them (x before gate/up, the SwiGLU
    output before down)."""
    W = {}

    def rnd(v):
        if not bf16:
            return v
        import torch

        return torch.from_numpy(v.astype(np.float32)).to(torch.bfloat16).to(torch.float64).numpy()

    def w(p, e):
        if (p, e) not in W:
            st = stacks[p]
            W[p, e] = decoded(st, list(st.expert_ids).index(e)).astype(np.float64)
        return W[p, e]

    out = np.empty((len(ids), x.shape[1]))
    for r, e in enumerate(int(e) for e in ids):
        xi = rnd(x[r].astype(np.float64))
        gc = np.minimum(w("gate", e) @ xi, limit)
        out[r] = w("down", e) @ rnd(gc / (1 + np.exp(-gc)) * np.clip(w("up", e) @ xi, -limit, limit))
    return out


def assert_rows_close(y, ref, ids, tol: float, what: str = "") -> None:
    """Every slot's largest error relative to its own largest reference value is below tol."""
    for r in range(len(ids)):
        err = np.abs(y[r] - ref[r]).max() / max(np.abs(ref[r]).max(), 1e-30)
        assert err < tol, f"{what} slot {r} (expert {ids[r]}): {err}"


def sha32(a) -> str:
    """sha256 of the float32 bytes of an array, a tensor (any device) or a nested list:
    the identity hash the runtime tests compare."""
    if hasattr(a, "detach"):
        a = a.detach().cpu().numpy()
    return hashlib.sha256(np.ascontiguousarray(np.asarray(a), dtype=np.float32).tobytes()).hexdigest()


def record_gpu(**kw) -> None:
    """Append one JSON line to $DS4Q_GPU_RECORD (the GPU results a closing note cites)."""
    path = os.environ.get(GPU_RECORD_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(kw) + "\n")
