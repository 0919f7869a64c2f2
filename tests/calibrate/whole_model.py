"""The anchor: calibration files computed the way calibrate computed them
before it streamed, from the whole reference model in one piece
(``load_reference``, hooks on every layer, ``model(input_ids)`` per sequence;
the per-tensor sensitivity perturbing the model's own parameters).

Tests compare the streamed calibrate's files with these bytes. The files are
written by the library's writers (their bytes are the files' formats, not
what is being compared); the numbers come from here.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from types import MappingProxyType

import numpy as np

_DENSE = (
    ("self_attn.q_a_proj", "attn_q_a"), ("self_attn.q_b_proj", "attn_q_b"), ("self_attn.kv_proj", "attn_kv"),
    ("self_attn.o_a_proj", "attn_output_a"), ("self_attn.o_b_proj", "attn_output_b"),
    ("self_attn.compressor.kv_proj", "attn_compressor_kv"), ("self_attn.compressor.gate_proj", "attn_compressor_gate"),
    ("self_attn.compressor.indexer.q_b_proj", "indexer.attn_q_b"),
    ("self_attn.compressor.indexer.kv_proj", "indexer_compressor_kv"),
    ("self_attn.compressor.indexer.gate_proj", "indexer_compressor_gate"),
    ("self_attn.compressor.indexer.scorer.weights_proj", "indexer.proj"),
    ("mlp.shared_experts.gate_proj", "ffn_gate_shexp"), ("mlp.shared_experts.up_proj", "ffn_up_shexp"),
    ("mlp.shared_experts.down_proj", "ffn_down_shexp"),
)
SURFACES = ("gate", "up", "down")


def _sum_sq(x) -> np.ndarray:
    return np.square(x.detach().numpy().astype(np.float64)).sum(axis=0)


def _sums(model, seqs):
    """Per-sequence sums with hooks on the whole model, folded in sequence order."""
    import torch

    from ds4quant.runtime.reference import capture_experts, expert_rows

    cfg = model.config
    n_layer, n_exp = len(model.model.layers), cfg.n_routed_experts
    slots = np.zeros((n_layer, n_exp), dtype=np.int64)
    rows = np.zeros((n_layer, n_exp), dtype=np.int64)
    hidden = np.zeros((n_layer, n_exp, cfg.hidden_size), dtype=np.float64)
    act = np.zeros((n_layer, n_exp, cfg.moe_intermediate_size), dtype=np.float64)
    dense: dict = {}
    part: dict = {}

    def on_experts(layer, module, h, idx, _w):
        flat = idx.reshape(-1)
        part["slots"][layer] += torch.bincount(flat[flat < n_exp], minlength=n_exp).numpy()
        for e in torch.unique(flat).tolist():
            _p, tok, x, a = expert_rows(module, h, idx.transpose(0, 1), e)
            part["experts"][(layer, e)] = (int(tok.shape[0]), _sum_sq(x), _sum_sq(a))

    handles = []

    def add(mod, name):
        def hook(_m, args):
            r = args[0].detach().reshape(-1, args[0].shape[-1])
            slot = part["dense"].setdefault(name, [0, np.zeros(r.shape[1], dtype=np.float64)])
            slot[0] += int(r.shape[0])
            slot[1] += _sum_sq(r)
        handles.append(mod.register_forward_pre_hook(hook))

    for i, layer in enumerate(model.model.layers):
        for path, stem in _DENSE:
            try:
                add(layer.get_submodule(path), f"blk.{i}.{stem}.weight")
            except AttributeError:
                pass
    add(model.lm_head, "output.weight")
    with capture_experts(model, on_experts), torch.no_grad():
        for ids in seqs:
            part.update(slots=np.zeros((n_layer, n_exp), dtype=np.int64), experts={}, dense={})
            model(input_ids=torch.tensor([list(ids)]), use_cache=False)
            slots += part["slots"]
            for (L, e), (r, sh, sa) in sorted(part["experts"].items()):
                rows[L, e] += r
                hidden[L, e] += sh
                act[L, e] += sa
            for name, (r, s) in sorted(part["dense"].items()):
                slot = dense.setdefault(name, [0, np.zeros_like(s)])
                slot[0] += r
                slot[1] += s
    for h in handles:
        h.remove()
    return slots, rows, hidden, act, dense


def _seed(tensor: str) -> int:
    return int.from_bytes(hashlib.sha256(f"ds4quant/sensitivity/{tensor}".encode()).digest()[:8], "little")


def _sensitivity(model, seqs, im, counts, rel_std=0.3):
    """Gains per routed tensor: its parameters overwritten with seeded noise, the KL at the logits."""
    import torch

    from ds4quant.calib.imatrix import importance_for
    from ds4quant.calib.sensitivity import Sensitivity
    from ds4quant.plan import expert_weights

    inputs = [torch.tensor([list(s)]) for s in seqs]
    with torch.no_grad():
        refs = [torch.log_softmax(model(input_ids=x, use_cache=False).logits[0].double(), dim=-1) for x in inputs]
    n_tok = sum(int(r.shape[0]) for r in refs)
    gains, kls, errs = {}, {}, {}
    for layer, block in enumerate(model.model.layers):
        ex = block.mlp.experts
        inter = ex.gate_up_proj.shape[1] // 2
        for surface in SURFACES:
            name = f"blk.{layer}.ffn_{surface}_exps.weight"
            param = ex.down_proj if surface == "down" else ex.gate_up_proj
            rs = slice(None) if surface == "down" else (slice(0, inter) if surface == "gate" else slice(inter, None))
            w0 = param.data[:, rs, :].clone()
            base = w0.double().numpy()
            rms = np.sqrt(np.mean(base * base, axis=(1, 2)))
            delta = np.random.default_rng(_seed(name)).standard_normal(base.shape) * (rel_std * rms)[:, None, None]
            n_exp, cols = base.shape[0], base.shape[2]
            f = expert_weights(counts[layer], n_exp)
            imps = [importance_for(im, name, e, cols=cols) for e in range(n_exp)]
            seen = [q for q in imps if q is not None]
            fallback = np.mean(np.stack(seen), axis=0) if seen else np.ones(cols)
            err = 0.0
            for e in range(n_exp):
                imp = (imps[e] if imps[e] is not None else fallback).astype(np.float64)
                err += float(f[e]) * float(np.sum((delta[e] * delta[e]) @ imp))
            try:
                param.data[:, rs, :] = (w0.double() + torch.from_numpy(delta)).to(w0.dtype)
                total = 0.0
                with torch.no_grad():
                    for x, ref in zip(inputs, refs):
                        cand = torch.log_softmax(model(input_ids=x, use_cache=False).logits[0].double(), dim=-1)
                        total += float((ref.exp() * (ref - cand)).sum(-1).sum())
            finally:
                param.data[:, rs, :] = w0
            kl = total / n_tok
            assert math.isfinite(kl) and err > 0
            gains[name], kls[name], errs[name] = kl / err, kl, err
    return Sensitivity(MappingProxyType(gains), MappingProxyType(kls), MappingProxyType(errs), None, None,
                       len(seqs), n_tok, rel_std)


def whole_model_files(source, seqs, out: Path, *, tokens_file: str, sensitivity_seqs: int) -> None:
    """Write imatrix.gguf, imatrix.lucebox.dat, routing.csv/json and (when
    ``sensitivity_seqs``) sensitivity.json as the whole-model path made them."""
    from ds4quant.calib.imatrix import make_imatrix, write_imatrix_gguf, write_imatrix_lucebox
    from ds4quant.calib.routing import RoutingProfile, write_routing_csv, write_routing_json
    from ds4quant.calib.sensitivity import write_sensitivity
    from ds4quant.runtime.reference import load_reference, torch_threads
    from ds4quant.sources import open_official_source
    from ds4quant.sources.config import HASH_MOE

    with open_official_source(source, "test") as src:
        cfg, fp = src.config, src.fingerprint()
    out.mkdir(parents=True, exist_ok=True)
    with torch_threads(1):
        model = load_reference(source)
        slots, rows, hidden, act, dense = _sums(model, seqs)
        sums = {}
        for L in range(cfg.num_hidden_layers):
            c = rows[L].astype(np.float64)
            sums[f"blk.{L}.ffn_gate_exps.weight"] = (hidden[L].astype(np.float32), c)
            sums[f"blk.{L}.ffn_up_exps.weight"] = (hidden[L].astype(np.float32), c)
            sums[f"blk.{L}.ffn_down_exps.weight"] = (act[L].astype(np.float32), c)
        for name in sorted(dense):
            sums[name] = (dense[name][1].astype(np.float32), [dense[name][0]])
        lens = {len(s) for s in seqs}
        im = make_imatrix(sums, datasets=(tokens_file,), chunk_count=len(seqs),
                          chunk_size=next(iter(lens)) if len(lens) == 1 else None)
        write_imatrix_gguf(out / "imatrix.gguf", im)
        write_imatrix_lucebox(out / "imatrix.lucebox.dat", im)
        h = hashlib.sha256()  # the report's canonical token text: one line per sequence
        for q in seqs:
            h.update((" ".join(str(t) for t in q) + "\n").encode("ascii"))
        sha = h.hexdigest()
        hash_layers = [i for i, t in enumerate(cfg.mlp_layer_types) if t == HASH_MOE]
        prof = RoutingProfile(cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_experts_per_tok,
                              slots.astype(np.uint64), tokens=sum(len(s) for s in seqs),
                              source={"model": Path(source).name, "fingerprint": fp, "tokens_file": tokens_file,
                                      "tokens_sha256": sha, "sequences": len(seqs), "hash_layers": hash_layers,
                                      "reference": "transformers DeepseekV4ForCausalLM fp32 eager, batch 1"})
        write_routing_json(out / "routing.json", prof)
        write_routing_csv(out / "routing.csv", prof)
        if sensitivity_seqs:
            s = _sensitivity(model, seqs[:sensitivity_seqs], im, slots)
            s = type(s)(s.gains, s.kl, s.weighted_error, fp, sha, s.sequences, s.tokens, s.rel_std)
            write_sensitivity(out / "sensitivity.json", s)
