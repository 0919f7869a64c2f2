"""The two models fidelity compares, and the runs over them.

- reference: transformers ``DeepseekV4ForCausalLM`` over the source, exactly
  dequantized, eager experts (``runtime.reference.load_reference``);
- candidate: the same architecture with every dense parameter and buffer
  overwritten by the artifact's decoded tensor (``view.dense``, GGUF name ->
  official name -> transformers name through ``sources.naming``) and every
  layer's routed experts swapped for the executor's experts module over the
  artifact (``runtime.load(...).experts(L)``, in process or on cluster ranks
  alike). A wrong dense conversion is therefore caught as well as a wrong expert.

torch and transformers are imported inside the functions.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from ds4quant import names


@contextlib.contextmanager
def blas_threads(n: int) -> Iterator[None]:
    """numpy's OpenBLAS limited to ``n`` threads inside the block.

    Why: with torch's OpenMP pool and numba's workers in the same process,
    OpenBLAS's own spinning threads oversubscribe a small machine; a 64x128x256
    product measured 40 ms instead of 0.3 ms on 2 loaded cores (the runtime's
    fast mode does about a hundred per layer). Linux only; elsewhere a no-op.
    """
    libs = []
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({ln.split()[-1] for ln in f if "openblas" in ln.lower() and ln.split()[-1].startswith("/")})
        for p in paths:
            lib = ctypes.CDLL(p)
            for get, put in (("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
                             ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
                             ("openblas_get_num_threads", "openblas_set_num_threads")):
                if hasattr(lib, get) and hasattr(lib, put):
                    libs.append((getattr(lib, put), int(getattr(lib, get)())))
                    break
    except OSError:
        libs = []
    for put, _ in libs:
        put(ctypes.c_int(n))
    try:
        yield
    finally:
        for put, old in libs:
            put(ctypes.c_int(old))


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch, numpy's BLAS and numba on one thread inside the block.

    Why: the reference's bits depend on torch's thread count
    (docs/reference-model.md#determinism), so one fixed count makes the response hash
    the same on every machine; and on a small, shared machine spinning worker
    pools cost more than they give: a 32-token greedy response took 37.6 s
    with 2 torch threads and 2.1 s with 1 (2 cores, load 15).
    """
    import numba

    from ds4quant.runtime.reference import torch_threads

    old = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        with torch_threads(1), blas_threads(1):
            yield
    finally:
        numba.set_num_threads(old)


def dense_into(model, view) -> list[str]:
    """Overwrite every non-expert tensor of ``model`` with the artifact's decoded
    one. Returns problems (one line each, naming the tensor): an artifact tensor
    with no model parameter, a shape mismatch, a model tensor the artifact lacks."""
    import torch

    from ds4quant.sources.naming import hf_name, official_name

    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    expert_params = {n for n in params if ".mlp.experts." in n}
    covered: set[str] = set()
    problems: list[str] = []
    for name in view.tensors:
        if names.parse_stack(name) is not None:
            continue
        off = official_name(name)
        if off is None:
            problems.append(f"{name}: no official tensor name maps to it")
            continue
        hf, _ = hf_name(off)
        p = params.get(hf)
        if p is None:
            problems.append(f"{name}: the model has no parameter {hf}")
            continue
        got = np.asarray(view.dense(name))
        if tuple(got.shape) != tuple(p.shape):
            squeeze = tuple(d for d in got.shape if d != 1) == tuple(d for d in p.shape if d != 1)
            if squeeze:
                got = got.reshape(tuple(p.shape))  # only unit dimensions differ ([n] vs [1, n])
            else:
                problems.append(f"{name}: shape {list(got.shape)} in the artifact, {list(p.shape)} in the model ({hf})")
                continue
        with torch.no_grad():
            p.copy_(torch.from_numpy(np.ascontiguousarray(got)).to(p.dtype))
        covered.add(hf)
    for hf in sorted(set(params) - covered - expert_params):
        if hf.endswith(("rotary_emb.inv_freq", "original_inv_freq")) or "rotary" in hf:
            continue  # computed from the config, never stored
        problems.append(f"{hf}: the artifact holds no tensor for this model parameter")
    return problems


@dataclass
class MoeTrace:
    """MoE block inputs/outputs of one forward, per layer in call order."""

    inputs: dict = field(default_factory=dict)  # layer -> [(hidden, input_ids)]
    outputs: dict = field(default_factory=dict)  # layer -> [out]
    routed: list = field(default_factory=list)  # [(layer, routed experts output)] in call order


@contextlib.contextmanager
def trace_moe(model, keep_inputs: bool = False, routed: bool = False) -> Iterator[MoeTrace]:
    """Forward hooks on every MoE block (and, with ``routed``, its experts module)."""
    from ds4quant.runtime.reference import moe_blocks

    tr = MoeTrace()
    handles = []
    for i, block in moe_blocks(model):
        def hook(mod, args, kwargs, out, i=i):
            if keep_inputs:
                h = args[0] if args else kwargs["hidden_states"]
                ids = kwargs.get("input_ids", args[1] if len(args) > 1 else None)
                tr.inputs.setdefault(i, []).append((h.detach().clone(), None if ids is None else ids.clone()))
            tr.outputs.setdefault(i, []).append(out.detach().clone())

        handles.append(block.register_forward_hook(hook, with_kwargs=True))
        if routed:
            def rhook(mod, args, out, i=i):
                tr.routed.append((i, out.detach().to("cpu").contiguous()))

            handles.append(block.experts.register_forward_hook(rhook))
    try:
        yield tr
    finally:
        for h in handles:
            h.remove()


def rel_error(ref, cand) -> float:
    import torch

    r = torch.cat([x.reshape(-1).double() for x in ref])
    c = torch.cat([x.reshape(-1).double() for x in cand])
    den = float(torch.linalg.vector_norm(r))
    num = float(torch.linalg.vector_norm(c - r))
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def routed_sha256(routed: Sequence) -> str:
    """sha256 over every routed-experts output (float32 bytes), layers in call order."""
    h = hashlib.sha256()
    for layer, out in routed:
        h.update(int(layer).to_bytes(4, "little"))
        h.update(np.ascontiguousarray(out.to(dtype=__import__("torch").float32).numpy()).tobytes())
    return h.hexdigest()


def logits_of(model, batch, pad_id: int):
    """Logits of a list of token sequences, right-padded into one batch."""
    import torch

    width = max(len(s) for s in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    for i, s in enumerate(batch):
        ids[i, :len(s)] = torch.tensor(list(s), dtype=torch.long)
    with torch.no_grad():
        return model(ids, use_cache=False).logits.float()


def valid_positions(batch) -> list[tuple[int, int]]:
    """(row, position) pairs whose next token is inside the sequence."""
    return [(i, t) for i, s in enumerate(batch) for t in range(len(s) - 1)]


def local_moe_error(cand, ref_trace: MoeTrace, cand_layers) -> dict[int, float]:
    """Each candidate MoE block on the reference's own block input: the error a
    layer adds by itself (a damaged layer stands out; propagated error does not
    blur it)."""
    import torch

    from ds4quant.runtime.reference import moe_blocks

    blocks = dict(moe_blocks(cand))
    out = {}
    with torch.no_grad():
        for layer in cand_layers:
            got = [blocks[layer](h, input_ids=ids) for h, ids in ref_trace.inputs.get(layer, [])]
            out[layer] = rel_error(ref_trace.outputs[layer], got)
    return out


def swap_all(model, rt) -> Any:
    """Every MoE layer's routed experts -> the executor's; returns the old modules."""
    from ds4quant.runtime.reference import moe_blocks, swap_experts

    return {i: swap_experts(model, i, rt.experts(i)) for i, _ in moe_blocks(model)}


def restore(model, old: dict) -> None:
    from ds4quant.runtime.reference import swap_experts

    for i, m in old.items():
        swap_experts(model, i, m)


def placement_label(given, plc) -> str:
    """How the figures name the placement ``given`` (what the caller passed; ``plc``
    the Placement it names): its file, else "placement"; with the gloo ranks a rank
    placement runs on, or "cpu:0 (one CPU owner)" when none was given."""
    from os import PathLike

    if given is None:
        return "cpu:0 (one CPU owner)"
    where = str(given) if isinstance(given, (str, PathLike)) else "placement"
    return where if plc.ranks is None else f"{where} ({plc.ranks.n_ranks} gloo ranks)"


def source_tokenizer(source) -> Optional[Any]:
    """transformers' tokenizer of the source when it ships tokenizer.json, else None."""
    from pathlib import Path

    if not (Path(source) / "tokenizer.json").is_file():
        return None
    from transformers import AutoTokenizer

    from ds4quant.runtime.reference import quiet_transformers

    with quiet_transformers():
        return AutoTokenizer.from_pretrained(str(source))
