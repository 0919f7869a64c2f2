"""Train samples/ds4-copy: a small DeepSeek-V4 whose routed experts must work to copy.

    python samples/train_ds4_copy.py --device cuda --out samples/ds4-copy     # the shipped sample (seed 3)
    python samples/train_ds4_copy.py --smoke --out /tmp/ds4-copy-smoke   # a few CPU steps, tiny config
    python samples/train_ds4_copy.py --device cuda --engine-shape --seed 4 --threads 3 --out samples/ds4-copy-engine

``--engine-shape`` trains in DeepSeek-V4's proportions where other engines fix
them (``ENGINE_SHAPE``: four hyper-connection streams, CSA 4 / HCA 128, an
indexer head dim of 64), so llama.cpp's loader accepts the converted artifact.

The task (runtime/fidelity.py, CopyTask "recode"): the prompt holds a line of
Python after ">>> " and asks for it recoded; the answer is the line with every
character of ALPHABET replaced through a seeded substitution table keyed by the
line's two previous characters (--order 2: 38 x 38 permutations of the
37-letter alphabet, 53,428 entries), other characters copied. Why this task: a
plain echo runs through attention (a probe at hidden 256 / 16 experts kept
54-55/60 with 2-bit experts), and any per-character substitution is still
linear, so attention's value path can absorb it. A table lookup on a character
pair or triple is not linear in the embeddings: it has to be memorised by the
FFNs, and here the FFNs are almost all routed experts (32 experts of width 128,
one per token: hash-routed layers 0-1, score-routed layers 2-3), with a narrow
attention path (2 heads, o_lora_rank 32) beside them. The earlier shapes (top-4
experts of width 256 and the order-1 table: 2-bit experts still copied 60/60)
and what each lever gave are in samples/ds4-copy/README.md.

A run can be continued as a later stage: --init-from a checkpoint this script
wrote (with the same shape flags), --data-stream naming the stage's own example
stream, --qat-frac 1.0 to keep QAT on throughout, a short --warmup (a fresh
AdamW at full learning rate moves every weight by ~lr on its first steps, which
wrecks a trained FP4 model).

Training: AdamW with warm-up and cosine decay over --steps, batches drawn from
the seed (the protocol's identifiers are excluded); the last QAT_FRAC of the
steps fake-quantize every routed expert to FP4 e2m1 with E8M0 per-32 scales
and every FP8-stored dense projection to e4m3 with 128x128 E8M0 scales
(straight-through estimator), so the official-layout checkpoint copies as well
as the float model. The checkpoint is written with make_ds4_tiny's official
writers (store_dense / store_expert / write_official), plus tokenizer.json
(byte-level: ids 0-2 bos/eos/pad, byte b at 3+b), tokenizer_config.json,
task.json and train_report.json (steps, seconds, losses, protocol scores of the
float and the stored model).

Deterministic from --seed on a given device and thread count (the CPU smoke
test checks identical bytes twice; on CUDA through PyTorch's deterministic
kernels: two H100 runs of the engine-shape seed 4 wrote identical bytes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_ds4_tiny as tiny  # noqa: E402  (the official-layout writers)

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789_"
QAT_FRAC = 0.3
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
SPECIALS = ("<bos>", "<eos>", "<pad>")
BOS, EOS, PAD = 0, 1, 2

# hidden 128 and widths 64/128/256 keep every FP8 tensor dim <= 128 or a multiple
# of 128 (docs/reference-model.md#loading); 32 experts x 3 x 256 x 128 per layer
# hold ~97% of the parameters.
FULL = {
    "vocab_size": 264, "hidden_size": 128, "moe_intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "q_lora_rank": 64,
    "partial_rotary_factor": 0.25,
    "num_experts_per_tok": 1, "n_routed_experts": 32, "n_shared_experts": 1,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "sliding_attention",
                    "heavily_compressed_attention"],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "sliding_window": 256, "hc_mult": 2, "hc_sinkhorn_iters": 20,
    "o_groups": 2, "o_lora_rank": 32,
    "index_n_heads": 2, "index_head_dim": 32, "index_topk": 4,
    "max_position_embeddings": 1024, "num_nextn_predict_layers": 0,
    "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD,
}
SMOKE = dict(FULL, hidden_size=64, moe_intermediate_size=64, num_hidden_layers=2, n_routed_experts=8, num_experts_per_tok=2,
             layer_types=["sliding_attention", "compressed_sparse_attention"], mlp_layer_types=["hash_moe", "moe"],
             q_lora_rank=32, o_lora_rank=16, head_dim=32, index_head_dim=16)


# DeepSeek-V4's proportions where engines fix them (docs/runtimes.md): llama.cpp asserts four
# hyper-connection streams, compress ratios 0 / 4 / 128 and an indexer head dim that is a
# multiple of 64. The shipped sample (hc 2, HCA 16, indexer 32) breaks all three.
ENGINE_SHAPE = {"hc_mult": 4, "index_head_dim": 64,
                "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}}
# the smoke config in that shape keeps one layer of each attention kind
SMOKE_ENGINE = dict(SMOKE, **ENGINE_SHAPE, num_hidden_layers=3,
                    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
                    mlp_layer_types=["hash_moe", "moe", "moe"])


def config_for(args) -> dict:
    if args.smoke:
        return SMOKE_ENGINE if args.engine_shape else SMOKE
    kw = dict(FULL, **ENGINE_SHAPE) if args.engine_shape else dict(FULL)
    for opt, key in (("experts", "n_routed_experts"), ("expert_width", "moe_intermediate_size"),
                     ("topk", "num_experts_per_tok")):
        if getattr(args, opt):
            kw[key] = getattr(args, opt)
    return kw


def native_config(kw: dict) -> dict:
    """The native DeepSeek config.json for HF kwargs ``kw`` (keys as make_ds4_tiny writes them)."""
    c = dict(tiny.NATIVE_CONFIG)
    for k in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "num_experts_per_tok",
              "n_routed_experts", "n_shared_experts", "sliding_window", "hc_mult", "hc_sinkhorn_iters",
              "index_n_heads", "index_head_dim", "index_topk", "max_position_embeddings",
              "bos_token_id", "eos_token_id", "pad_token_id"):
        c[k] = kw[k]
    c["qk_rope_head_dim"] = int(kw["head_dim"] * kw["partial_rotary_factor"])
    c["num_hash_layers"] = kw["mlp_layer_types"].count("hash_moe")
    # layer_types, not compress_ratios: the native ratio 128 for an HCA layer would
    # contradict its real rate (compress_rate_hca) and its compressor's rows
    c["layer_types"] = list(kw["layer_types"])
    c["compress_rate_csa"] = kw["compress_rates"]["compressed_sparse_attention"]
    c["compress_rate_hca"] = kw["compress_rates"]["heavily_compressed_attention"]
    return c


# --------------------------------------------------------------------------
# tokenizer


def _byte_chars() -> list[str]:
    """The byte-level alphabet: printable Latin-1 bytes stand for themselves, the
    others are shifted above 255, so every byte is one visible character (the
    convention of byte-level BPE tokenizers, which tokenizers' ByteLevel uses)."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers import AddedToken

    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for b, ch in enumerate(_byte_chars()):
        vocab[ch] = len(SPECIALS) + b
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    return tok


def encode(text: str) -> list[int]:
    """The tokenizer's ids, computed directly (byte b -> 3 + b); the smoke test checks they agree."""
    return [len(SPECIALS) + b for b in text.encode("utf-8")]


# --------------------------------------------------------------------------
# data


def make_example(rng: random.Random, task, excluded: frozenset):
    """-> (ids, weights): a recode trial (85%) or structured text (15%)."""
    from ds4quant.runtime import fidelity as fd

    if rng.random() < 0.15:
        text = "\n".join(fd.filler_lines(rng, rng.randint(3, 8))) + "\n"
        ids = [BOS] + encode(text) + [EOS]
        return ids, [1.0] * (len(ids) - 1)
    while True:
        ident = fd.make_identifier(rng)
        if ident not in excluded:
            break
    tr = fd.make_trial(task, rng, ident, rng.choice(fd.TEMPLATES))
    prompt = [BOS] + encode(tr.prompt)
    answer = encode(tr.expected + "\n") + [EOS]
    ids = prompt + answer
    # targets are ids[1:]; the answer (and its end) carries the weight
    w = [0.1] * (len(prompt) - 1) + [1.0] * len(answer)
    return ids, w


def make_batch(rng: random.Random, task, excluded, n: int, torch):
    ex = [make_example(rng, task, excluded) for _ in range(n)]
    width = max(len(i) for i, _ in ex)
    ids = torch.full((n, width), PAD, dtype=torch.long)
    wts = torch.zeros((n, width - 1), dtype=torch.float32)
    for k, (i, w) in enumerate(ex):
        ids[k, :len(i)] = torch.tensor(i)
        wts[k, :len(w)] = torch.tensor(w)
    return ids, wts


# --------------------------------------------------------------------------
# fake quantization (straight-through)

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def fake_fp4(w, torch):
    """FP4 e2m1 with a pow2 scale >= absmax/6 per 32 inputs (last dim), as encode_fp4 stores it."""
    shape = w.shape
    b = w.reshape(*shape[:-1], shape[-1] // 32, 32)
    amax = b.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -100)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 6.0)))
    scale = torch.where(6.0 * scale < amax, scale * 2, scale)
    v = (b / scale).abs()
    grid = torch.tensor(_E2M1, dtype=w.dtype, device=w.device)
    mids = (grid[1:] + grid[:-1]) / 2
    q = grid[torch.bucketize(v, mids)] * torch.sign(b) * scale
    return q.reshape(shape)


def fake_fp8(w, torch):
    """e4m3 with a pow2 scale >= absmax/448 per 128x128 block (dims <= 128 or multiples of 128)."""
    rows, cols = w.shape
    br, bc = min(rows, 128), min(cols, 128)
    b = w.reshape(rows // br, br, cols // bc, bc)
    amax = b.abs().amax(dim=(1, 3), keepdim=True).clamp_min(2.0 ** -100)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    scale = torch.where(448.0 * scale < amax, scale * 2, scale)
    q = (b / scale).to(torch.float8_e4m3fn).to(w.dtype) * scale
    return q.reshape(rows, cols)


def _ste_module(fn, torch):
    class STE(torch.nn.Module):
        def forward(self, w):
            return w + (fn(w.detach(), torch) - w.detach())

    return STE()


_FP8_HF = ("q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj", "shared_experts.gate_proj",
           "shared_experts.up_proj", "shared_experts.down_proj", "indexer.q_b_proj")


def start_qat(model, torch) -> int:
    """Parametrize routed experts (FP4) and FP8-stored dense weights (FP8); returns how many."""
    from torch.nn.utils import parametrize

    n = 0
    for name, mod in model.named_modules():
        if type(mod).__name__ == "DeepseekV4Experts":
            for p in ("gate_up_proj", "down_proj"):
                parametrize.register_parametrization(mod, p, _ste_module(fake_fp4, torch))
                n += 1
        elif isinstance(mod, torch.nn.Linear) and name.endswith(_FP8_HF) and ".compressor.kv_proj" not in name:
            parametrize.register_parametrization(mod, "weight", _ste_module(fake_fp8, torch))
            n += 1
    return n


def end_qat(model) -> None:
    from torch.nn.utils import parametrize

    for mod in list(model.modules()):
        if parametrize.is_parametrized(mod):
            for p in list(mod.parametrizations.keys()):
                parametrize.remove_parametrizations(mod, p, leave_parametrized=False)


# --------------------------------------------------------------------------
# model, export


def build_model(kw: dict, seed: int, torch):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**kw))
    g = np.random.default_rng(seed)
    for layer in model.model.layers:
        gate = layer.mlp.gate
        if hasattr(gate, "tid2eid"):  # zero-initialised: each token gets k distinct experts
            table = np.stack([g.choice(kw["n_routed_experts"], kw["num_experts_per_tok"], replace=False)
                              for _ in range(kw["vocab_size"])])
            gate.tid2eid.copy_(torch.from_numpy(table.astype(np.int64)))
    return model


def load_stage(path: str, kw: dict, torch):
    """The model of an earlier stage's checkpoint (FP4 experts / FP8 dense dequantized exactly);
    its config must be the one these flags give."""
    from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config

    # dequantize=True: with a GPU present transformers would otherwise keep the FP8
    # projections as float8 tensors, which cannot be trained (or fake-quantized)
    model = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                  quantization_config=FineGrainedFP8Config(dequantize=True))
    odd = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
    if odd:
        raise SystemExit(f"{path}: parameters loaded as {odd}, not float32")
    for k in ("hidden_size", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok", "num_hidden_layers"):
        if getattr(model.config, k) != kw[k]:
            raise SystemExit(f"{path}: {k} is {getattr(model.config, k)}, these flags give {kw[k]}")
    return model


def _shard_of(n_layers: int):
    def shard(name: str) -> str:
        if name.startswith("layers."):
            return SHARDS[0] if int(name.split(".")[1]) < n_layers // 2 else SHARDS[1]
        return SHARDS[0] if name == "embed.weight" else SHARDS[1]

    return shard


def export(model, kw: dict, out: Path, torch) -> dict:
    """Write the official-layout checkpoint; returns the exactly dequantized HF state dict."""
    stored, exact = {}, {}
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    for hf, t in sd.items():
        if ".experts.gate_up_proj" in hf or ".experts.down_proj" in hf:
            layer = hf.split(".")[2]
            inter = kw["moe_intermediate_size"]
            for e in range(t.shape[0]):
                pre = f"layers.{layer}.ffn.experts.{e}"
                w = t[e].numpy()
                if hf.endswith("gate_up_proj"):
                    tiny.store_expert(f"{pre}.w1.weight", np.ascontiguousarray(w[:inter]), stored, exact, torch)
                    tiny.store_expert(f"{pre}.w3.weight", np.ascontiguousarray(w[inter:]), stored, exact, torch)
                else:
                    tiny.store_expert(f"{pre}.w2.weight", np.ascontiguousarray(w), stored, exact, torch)
            continue
        name = tiny._official_name(hf)
        if name.endswith("tid2eid"):
            v = model.state_dict()[hf].cpu().numpy().astype(np.int64)
            stored[name] = torch.from_numpy(v)
            exact[name] = v
            continue
        tiny.store_dense(name, np.ascontiguousarray(t.numpy()), stored, exact, torch)
    cfg = native_config(kw)
    tiny.write_official(out, stored, cfg, SHARDS, _shard_of(kw["num_hidden_layers"]))
    hf_sd = {}
    for hf in sd:
        if ".experts.gate_up_proj" in hf or ".experts.down_proj" in hf:
            layer = hf.split(".")[2]
            pre = f"layers.{layer}.ffn.experts"
            if hf.endswith("gate_up_proj"):
                hf_sd[hf] = np.stack([np.concatenate([exact[f"{pre}.{e}.w1.weight"], exact[f"{pre}.{e}.w3.weight"]])
                                      for e in range(kw["n_routed_experts"])])
            else:
                hf_sd[hf] = np.stack([exact[f"{pre}.{e}.w2.weight"] for e in range(kw["n_routed_experts"])])
        else:
            hf_sd[hf] = exact[tiny._official_name(hf)]
    return hf_sd


def write_tokenizer(out: Path) -> None:
    (out / "tokenizer.json").write_text(build_tokenizer().to_str(pretty=True) + "\n")
    tiny._write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "model_max_length": 1024, "clean_up_tokenization_spaces": False})


# --------------------------------------------------------------------------
# train


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))


def train(args) -> dict:
    import torch
    import transformers

    from ds4quant.runtime import fidelity as fd

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        # TF32 matmuls for speed; the stored model is judged in fp32 (QAT makes it robust to that)
        torch.backends.cuda.matmul.allow_tf32 = True
        # same seed, same bytes on a GPU too: atomics-based backward kernels (index_add,
        # scatter_add, embedding) otherwise sum in arrival order, and two runs of one seed
        # scored 50 and 56 / 60; cuBLAS needs a fixed workspace for deterministic results.
        # warn_only: an op without a deterministic kernel is named in the log, not fatal
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    kw = config_for(args)
    task = fd.CopyTask.substitution(args.seed, ALPHABET, order=args.order)
    excluded = frozenset(fd.protocol_identifiers())
    if args.init_from:  # a later stage: continue from a checkpoint this script wrote (same flags)
        model = load_stage(args.init_from, kw, torch).to(dev).train()
    else:
        model = build_model(kw, args.seed, torch).to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    # a later stage draws other examples than the first (same task table: it comes from the seed)
    rng = random.Random(f"ds4-copy/{args.seed}/data" + (f"/{args.data_stream}" if args.data_stream else ""))
    qat_from = int(args.steps * (1 - args.qat_frac))
    log, t0, qat_n = [], time.perf_counter(), 0
    done = 0
    for step in range(args.steps):
        if step == qat_from:
            qat_n = start_qat(model, torch)
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        ids, wts = make_batch(rng, task, excluded, args.batch, torch)
        ids, wts = ids.to(dev), wts.to(dev)
        logits = model(ids, use_cache=False).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                reduction="none")
        loss = (nll * wts.reshape(-1)).sum() / wts.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        done = step + 1
        if step % args.log_every == 0 or step == args.steps - 1:
            with torch.no_grad():  # teacher-forced accuracy on the answer tokens (weight 1)
                hit = (logits.argmax(-1) == ids[:, 1:]).float()
                ans = (wts == 1.0).float()
                acc = float((hit * ans).sum() / ans.sum())
            log.append({"step": step, "loss": round(float(loss.detach()), 5), "answer_acc": round(acc, 5),
                        "s": round(time.perf_counter() - t0, 1)})
            if not args.quiet:
                print(json.dumps(log[-1]), flush=True)
        if args.max_seconds and time.perf_counter() - t0 > args.max_seconds:
            break
    train_s = time.perf_counter() - t0
    model.eval()
    # the float score is judged with the fake quantizers off (a pure float model) only
    # when no QAT ran; after QAT the trained weights' own float view is reported too
    with torch.no_grad():
        qat_score = fd.exact_copy(model, fd.ByteTokenizer(), task).passes if qat_n else None
    end_qat(model)
    with torch.no_grad():
        float_res = fd.exact_copy(model, fd.ByteTokenizer(), task)
    if not args.quiet:
        print(json.dumps({"exact_copy_float_qat": qat_score, "exact_copy_float": float_res.passes}), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for p in out.glob("model-*.safetensors"):
        p.unlink()
    hf_sd = export(model, kw, out, torch)
    write_tokenizer(out)
    tiny._write_json(out / "task.json", task.to_json())
    stored = build_model(kw, args.seed, torch).eval()
    stored.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in hf_sd.items()}, strict=True)
    stored.set_experts_implementation("eager")
    stored = stored.to(dev)
    with torch.no_grad():
        stored_res = fd.exact_copy(stored, fd.ByteTokenizer(), task)
    report = {
        "seed": args.seed, "device": str(dev), "steps_asked": args.steps, "steps": done, "batch": args.batch,
        "lr": args.lr, "warmup": args.warmup, "qat_from_step": qat_from, "init_from": args.init_from or None,
        "data_stream": args.data_stream or None, "order": args.order,
        "shape": {k: kw[k] for k in ("n_routed_experts", "moe_intermediate_size", "num_experts_per_tok")}, "qat_tensors": qat_n,
        "config": ("smoke" if args.smoke else "full") + ("-engine-shape" if args.engine_shape else ""),
        "params": sum(v.size for v in hf_sd.values()),
        "expert_params": sum(v.size for k, v in hf_sd.items() if ".experts." in k),
        "train_seconds": round(train_s, 1), "torch": torch.__version__, "transformers": transformers.__version__,
        "exact_copy": {"float_qat": qat_score, "float": float_res.passes, "stored_fp4_fp8": stored_res.passes,
                       "trials": stored_res.trials},
        "stored_failures": stored_res.to_json()["failed"][:5],
        "log": log,
    }
    if args.write_report:
        tiny._write_json(out / "train_report.json", report)
    return report


PROBE_STEPS = 30


def steps_for_budget(args) -> int:
    """Steps that fit in args.time_budget seconds, from a timed probe (QAT on for the
    second half of it: fake quantization makes a step slower)."""
    import torch

    from ds4quant.runtime import fidelity as fd

    torch.set_num_threads(args.threads)
    kw = config_for(args)
    dev = torch.device(args.device)

    task = fd.CopyTask.substitution(args.seed, ALPHABET, order=args.order)
    model = build_model(kw, args.seed, torch).to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = random.Random("probe")
    times = []
    for step in range(PROBE_STEPS):
        if step == PROBE_STEPS // 2:
            start_qat(model, torch)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        ids, _ = make_batch(rng, task, frozenset(), args.batch, torch)
        ids = ids.to(dev)
        loss = model(ids, use_cache=False).logits.float().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    half = PROBE_STEPS // 2
    plain = float(np.median(times[2:half]))
    qat = float(np.median(times[half + 2:]))
    per = (1 - QAT_FRAC) * plain + QAT_FRAC * qat
    steps = int(args.time_budget / per)
    print(json.dumps({"probe_s_per_step": round(plain, 4), "probe_qat_s_per_step": round(qat, 4),
                      "steps": steps}), flush=True)
    return steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--steps", type=int, default=1025)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "ds4-copy"))
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--order", type=int, default=2, help="previous characters keying the substitution")
    ap.add_argument("--experts", type=int, default=0, help="routed experts (default: the FULL config's)")
    ap.add_argument("--expert-width", type=int, default=0, help="moe_intermediate_size (default: FULL's)")
    ap.add_argument("--topk", type=int, default=0, help="experts per token (default: FULL's)")
    ap.add_argument("--qat-frac", type=float, default=QAT_FRAC, help="share of the steps trained QAT (at the end)")
    ap.add_argument("--init-from", default="", help="continue from this checkpoint (a later training stage)")
    ap.add_argument("--data-stream", default="", help="name of this stage's example stream (a later stage's own)")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--max-seconds", type=float, default=0.0,
                    help="stop early after this many training seconds (the steps done are recorded)")
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="time PROBE_STEPS steps first, then train for as many steps as fit in this many seconds "
                         "(the chosen --steps is printed and recorded, so the run can be repeated exactly)")
    ap.add_argument("--engine-shape", action="store_true",
                    help="hc 4, CSA 4 / HCA 128, indexer head dim 64: the proportions other engines fix")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny config, a few steps on the CPU unless --device is given (CI smoke test)")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--no-report", dest="write_report", action="store_false",
                    help="do not write train_report.json (it holds timings, which differ run to run)")
    args = ap.parse_args(argv)
    if args.smoke:  # on the CPU unless --device names another (the GPU determinism test)
        given = argv if argv is not None else sys.argv[1:]
        args.batch, args.warmup = 4, 2
        if "--device" not in given:
            args.device = "cpu"
        if "--steps" not in given:
            args.steps = 4
    if args.time_budget:
        args.steps = steps_for_budget(args)
    rep = train(args)
    print(json.dumps({k: rep[k] for k in ("steps", "train_seconds", "exact_copy", "params", "expert_params")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
