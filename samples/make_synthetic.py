"""Write a synthetic DeepSeek-V4 checkpoint (official layout) of any size, on the fly.

    python samples/make_synthetic.py --preset medium              # into a new temp folder
    python samples/make_synthetic.py /tmp/syn --preset bench --seed 3
    python samples/make_synthetic.py /tmp/syn --layers 4 --experts 32 --hidden 1024 --moe-inter 512

    from make_synthetic import make_synthetic, preset        # with samples/ on sys.path
    info = make_synthetic("/tmp/syn", preset("tiny"))

It holds what samples/ds4-tiny holds (facts: shared/spec/ds4-and-lucebox.md §2,
the same tensor names, dtypes and encodings; the tiny sample's writing helpers
are imported from make_ds4_tiny.py), at a size set by the options, for
benchmarks and allocation tests. It is generated, never committed:

- config.json with the native DeepSeek keys (plus a ``ds4quant_synthetic``
  object recording the generator settings), model.safetensors.index.json and
  N shards of at most ``shard_size`` bytes (a tensor is never split);
- routed experts as I8 FP4 e2m1 pairs (even element in the low nibble) with an
  F8_E8M0 scale per 32 inputs (smallest power of two >= absmax/6, codes rounded
  to nearest, ties to the even code: the rule of make_ds4_tiny.encode_fp4);
  dense attention and shared experts F8_E4M3 with 128x128 E8M0 block scales;
  embeddings, head, router and compressor projections bf16; norms, hyper-
  connection parameters, sinks, ape and router bias fp32; hash layers with a
  filled int64 tid2eid (distinct experts per token, Zipf-like popularity).

Routed experts are heavy-tailed so that adaptive allocation has something to
find: entry = t * expert_scale * matrix_jitter * row_scale[r] * col_scale[c],
with t Student-t (df 4, unit variance), expert_scale log-normal (sigma 0.5),
row/column scales log-normal, a few 3-8x outlier input columns shared by the
experts of a (layer, surface) (as activation outliers are), and a few
near-dead experts per layer (scale x 1e-3).

Determinism: every tensor's values come from a numpy Generator seeded with
sha256(seed, tensor identity), so generation order and worker count never change
bytes and regenerating gives byte-identical files. Streaming: each shard's
header is planned first, then tensors are generated (a few at a time, on
``workers`` threads) and appended in order, so memory stays at a few tensors
whatever the model size.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Optional

import numba
import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import make_ds4_tiny as tiny  # noqa: E402  (the tiny sample's encoders and config)

GENERATOR = "ds4quant-synthetic/1"
INDEX = "model.safetensors.index.json"
FP4_BLOCK = 32
FP8_BLOCK = 128


# --------------------------------------------------------------------------
# what to generate


@dataclass(frozen=True)
class SyntheticSpec:
    """Dimensions and knobs of a synthetic checkpoint (native DeepSeek-V4 meanings).

    compress_ratios: native per-layer codes (0 sliding, 4 CSA, 128 HCA); empty
    means [0, 4, 128, 4, 128, ...]. Hash-routed layers are the first
    ``hash_layers``. ``dead_fraction`` of each layer's experts (at least one)
    get magnitude x ``dead_scale``.
    """

    layers: int = 3
    experts: int = 8
    hidden: int = 256
    moe_inter: int = 128
    vocab: int = 512
    seed: int = 0
    shard_size: int = 64 << 20
    topk: int = 4
    hash_layers: int = 1
    shared_experts: int = 1
    heads: int = 4
    head_dim: int = 64
    rope_dim: int = 16
    q_lora_rank: int = 128
    o_groups: int = 2
    o_lora_rank: int = 64
    index_heads: int = 4
    index_head_dim: int = 32
    index_topk: int = 4
    hc_mult: int = 2
    sliding_window: int = 16
    compress_rate_csa: int = 4
    compress_rate_hca: int = 16
    compress_ratios: tuple[int, ...] = ()
    t_df: float = 4.0  # fixed: the inverse CDF below is the closed form for df 4
    expert_scale: float = 0.02
    expert_sigma: float = 0.5
    dead_fraction: float = 0.04
    dead_scale: float = 1e-3

    def ratios(self) -> tuple[int, ...]:
        if self.compress_ratios:
            return tuple(self.compress_ratios)
        return tuple(0 if i == 0 else (4 if i % 2 else 128) for i in range(self.layers))

    def validate(self) -> None:
        """Raise ValueError naming the first setting the layout cannot hold."""
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        for k in ("layers", "experts", "hidden", "moe_inter", "vocab", "topk", "heads", "head_dim",
                  "q_lora_rank", "o_groups", "o_lora_rank", "index_heads", "index_head_dim", "hc_mult",
                  "shard_size", "shared_experts"):
            need(isinstance(getattr(self, k), int) and getattr(self, k) >= 1, f"{k} must be a positive integer")
        # rocmfp2_mix rows need 128+ values and FP8 scales come per 128x128 block
        need(self.hidden % 128 == 0, f"hidden {self.hidden} must be a multiple of 128")
        need(self.moe_inter % 128 == 0, f"moe_inter {self.moe_inter} must be a multiple of 128")
        need(self.topk <= self.experts, f"topk {self.topk} exceeds experts {self.experts}")
        need(0 <= self.hash_layers <= self.layers, f"hash_layers must be in [0, {self.layers}]")
        need((self.heads * self.head_dim) % self.o_groups == 0, "heads * head_dim must divide by o_groups")
        need(self.rope_dim <= self.head_dim, "rope_dim exceeds head_dim")
        need(len(self.ratios()) == self.layers and all(r in (0, 4, 128) for r in self.ratios()),
             "compress_ratios needs one of 0/4/128 per layer")
        need(self.t_df == 4.0, "t_df is fixed at 4 (closed-form inverse CDF)")
        need(0.0 <= self.dead_fraction < 1.0 and 0.0 < self.dead_scale <= 1.0, "bad dead_fraction/dead_scale")

    def native_config(self) -> dict:
        """config.json: the tiny sample's native DeepSeek config with these dims."""
        cfg = json.loads(json.dumps(tiny.NATIVE_CONFIG))
        cfg.update({
            "vocab_size": self.vocab, "hidden_size": self.hidden, "moe_intermediate_size": self.moe_inter,
            "num_hidden_layers": self.layers, "num_attention_heads": self.heads, "num_key_value_heads": 1,
            "head_dim": self.head_dim, "q_lora_rank": self.q_lora_rank, "qk_rope_head_dim": self.rope_dim,
            "o_groups": self.o_groups, "o_lora_rank": self.o_lora_rank, "num_experts_per_tok": self.topk,
            "n_routed_experts": self.experts, "n_shared_experts": self.shared_experts,
            "num_hash_layers": self.hash_layers, "compress_ratios": list(self.ratios()),
            "compress_rate_csa": self.compress_rate_csa, "compress_rate_hca": self.compress_rate_hca,
            "sliding_window": self.sliding_window, "hc_mult": self.hc_mult, "index_n_heads": self.index_heads,
            "index_head_dim": self.index_head_dim, "index_topk": self.index_topk,
            "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
        })
        gen = asdict(self)
        gen["compress_ratios"] = list(self.ratios())
        cfg["ds4quant_synthetic"] = {"generator": GENERATOR, **gen}
        return cfg


def _dims(hidden: int, moe_inter: int) -> dict:
    """Attention and hyper-connection sizes that scale with hidden (DS4 proportions, smaller)."""
    big = hidden >= 1024
    return {
        "heads": max(4, hidden // 256), "head_dim": 128 if big else 64, "rope_dim": 32 if big else 16,
        "q_lora_rank": hidden // 2, "o_groups": 4 if big else 2, "o_lora_rank": hidden // 8,
        "index_heads": 8 if big else 4, "index_head_dim": 64 if big else 32,
        "hc_mult": 4 if big else 2, "sliding_window": 128 if big else 16,
        "compress_rate_hca": 128 if big else 16,
    }


PRESETS = {
    # seconds: tests
    "tiny": dict(layers=3, experts=8, hidden=256, moe_inter=128, vocab=512, topk=4, hash_layers=1),
    # ~95 MB (67 MB FP4 experts): larger tests
    "medium": dict(layers=4, experts=20, hidden=1024, moe_inter=512, vocab=2048, topk=6, hash_layers=1,
                   shard_size=32 << 20),
    # ~0.96 GB of FP4 expert data (1.81 G weights): benchmarks/convert.py
    "bench": dict(layers=6, experts=48, hidden=2048, moe_inter=1024, vocab=8192, topk=6, hash_layers=2,
                  shard_size=256 << 20),
}


def preset(name: str, **overrides) -> SyntheticSpec:
    """A SyntheticSpec from a preset ("tiny", "medium", "bench") with overrides;
    attention sizes follow ``hidden`` unless given."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    kw = dict(PRESETS[name])
    kw.update({k: v for k, v in overrides.items() if v is not None})
    dims = _dims(kw["hidden"], kw["moe_inter"])
    dims.update(kw)
    spec = SyntheticSpec(**dims)
    if spec.hash_layers >= spec.layers and spec.layers > 1:
        spec = replace(spec, hash_layers=spec.layers - 1)  # keep one score-routed layer (router bias)
    spec.validate()
    return spec


# --------------------------------------------------------------------------
# the tensor list (official names; shapes as ds4quant.sources.official checks them)


@dataclass(frozen=True)
class TensorPlan:
    name: str
    dtype: str  # safetensors tag
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * {"I8": 1, "F8_E8M0": 1, "F8_E4M3": 1, "BF16": 2, "F32": 4, "I64": 8}[self.dtype]


@dataclass(frozen=True)
class Unit:
    """Tensors made together (a weight and its scale), by ``kind``."""

    kind: str  # "expert" | "fp8" | "bf16" | "f32" | "tid2eid"
    tensors: tuple[TensorPlan, ...]
    layer: Optional[int] = None
    expert: Optional[int] = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _fp8(name: str, rows: int, cols: int) -> Unit:
    grid = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    return Unit("fp8", (TensorPlan(name + ".scale", "F8_E8M0", grid), TensorPlan(name + ".weight", "F8_E4M3", (rows, cols))))


def _plain(kind: str, name: str, *shape: int) -> Unit:
    return Unit(kind, (TensorPlan(name, {"bf16": "BF16", "f32": "F32"}[kind], tuple(shape)),))


def plan_units(spec: SyntheticSpec) -> list[Unit]:
    """Every tensor of the checkpoint, grouped into units, in file order:
    embed, then each layer (dense tensors, then experts 0..E-1), then head/norm."""
    H, V, I, E = spec.hidden, spec.vocab, spec.moe_inter, spec.experts
    hc, nh, hd = spec.hc_mult, spec.heads, spec.head_dim
    nhc = (2 + hc) * hc
    units = [_plain("bf16", "embed.weight", V, H)]
    for L, code in enumerate(spec.ratios()):
        p = f"layers.{L}."
        u = [
            _plain("f32", p + "attn.attn_sink", nh),
            _plain("f32", p + "attn.kv_norm.weight", hd),
            _plain("f32", p + "attn.q_norm.weight", spec.q_lora_rank),
            _fp8(p + "attn.wkv", hd, H),
            _fp8(p + "attn.wo_a", spec.o_groups * spec.o_lora_rank, nh * hd // spec.o_groups),
            _fp8(p + "attn.wo_b", H, spec.o_groups * spec.o_lora_rank),
            _fp8(p + "attn.wq_a", spec.q_lora_rank, H),
            _fp8(p + "attn.wq_b", nh * hd, spec.q_lora_rank),
        ]
        if code:
            csa = code == 4
            rate = spec.compress_rate_csa if csa else spec.compress_rate_hca
            coff = 2 if csa else 1  # CSA windows overlap: kv/gate/ape twice as wide
            u += [
                _plain("f32", p + "attn.compressor.ape", rate, coff * hd),
                _plain("f32", p + "attn.compressor.norm.weight", hd),
                _plain("bf16", p + "attn.compressor.wgate.weight", coff * hd, H),
                _plain("bf16", p + "attn.compressor.wkv.weight", coff * hd, H),
            ]
            if csa:
                ihd = spec.index_head_dim
                u += [
                    _plain("f32", p + "attn.indexer.compressor.ape", rate, 2 * ihd),
                    _plain("f32", p + "attn.indexer.compressor.norm.weight", ihd),
                    _plain("bf16", p + "attn.indexer.compressor.wgate.weight", 2 * ihd, H),
                    _plain("bf16", p + "attn.indexer.compressor.wkv.weight", 2 * ihd, H),
                    _plain("bf16", p + "attn.indexer.weights_proj.weight", spec.index_heads, H),
                    _fp8(p + "attn.indexer.wq_b", spec.index_heads * ihd, spec.q_lora_rank),
                ]
        Is = I * spec.shared_experts
        u += [
            _plain("f32", p + "attn_norm.weight", H),
            _plain("f32", p + "ffn_norm.weight", H),
            _plain("bf16", p + "ffn.gate.weight", E, H),
            (Unit("tid2eid", (TensorPlan(p + "ffn.gate.tid2eid", "I64", (V, spec.topk)),), layer=L)
             if L < spec.hash_layers else _plain("f32", p + "ffn.gate.bias", E)),
            _fp8(p + "ffn.shared_experts.w1", Is, H),
            _fp8(p + "ffn.shared_experts.w2", H, Is),
            _fp8(p + "ffn.shared_experts.w3", Is, H),
            _plain("f32", p + "hc_attn_base", nhc),
            _plain("f32", p + "hc_attn_fn", nhc, hc * H),
            _plain("f32", p + "hc_attn_scale", 3),
            _plain("f32", p + "hc_ffn_base", nhc),
            _plain("f32", p + "hc_ffn_fn", nhc, hc * H),
            _plain("f32", p + "hc_ffn_scale", 3),
        ]
        units += u
        for e in range(E):
            for w, (rows, cols) in (("w1", (I, H)), ("w2", (H, I)), ("w3", (I, H))):
                n = f"{p}ffn.experts.{e}.{w}"
                units.append(Unit("expert", (TensorPlan(n + ".scale", "F8_E8M0", (rows, cols // FP4_BLOCK)),
                                             TensorPlan(n + ".weight", "I8", (rows, cols // 2))), layer=L, expert=e))
    units += [
        _plain("bf16", "head.weight", V, H),
        _plain("f32", "hc_head_base", hc),
        _plain("f32", "hc_head_fn", hc, hc * H),
        _plain("f32", "hc_head_scale", 1),
        _plain("f32", "norm.weight", H),
    ]
    return units


def shard_units(units: list[Unit], shard_size: int) -> list[list[Unit]]:
    """Greedy split in file order: a shard closes before a unit that would overflow it."""
    shards: list[list[Unit]] = [[]]
    size = 0
    for u in units:
        if shards[-1] and size + u.nbytes > shard_size:
            shards.append([])
            size = 0
        shards[-1].append(u)
        size += u.nbytes
    return shards


# --------------------------------------------------------------------------
# deterministic values


def rng_for(seed: int, key: str) -> np.random.Generator:
    """The Generator for one identity (tensor name, or a shared per-layer key)."""
    s = int.from_bytes(hashlib.sha256(f"{GENERATOR}/{seed}/{key}".encode()).digest()[:8], "little")
    return np.random.Generator(np.random.PCG64(s))


def _t4_quantile(p: np.ndarray) -> np.ndarray:
    """Student-t (df 4) inverse CDF, closed form: alpha = 4p(1-p),
    q = cos(arccos(sqrt(alpha))/3)/sqrt(alpha), t = sign(p-1/2) 2 sqrt(q-1)."""
    p = np.asarray(p, dtype=np.float64)
    sa = np.sqrt(4.0 * p * (1.0 - p))
    q = np.cos(np.arccos(sa) / 3.0) / sa
    return np.sign(p - 0.5) * 2.0 * np.sqrt(np.maximum(q - 1.0, 0.0))


def _t_tables() -> tuple[np.ndarray, np.ndarray]:
    """Inverse-CDF tables for a 32-bit uniform u = hi << 16 | lo, unit variance (t4 / sqrt 2).

    MAIN[lo]: quantile at p = (lo + 0.5) / 2^16 (lo = 1 .. 65534);
    TAIL[hi]: quantile at p = (hi + 0.5) / 2^32, the lowest 1/2^16 of the
    distribution resolved 65536-fold (down to |t| ~ 280), used when lo == 0
    (and negated when lo == 65535), so the heavy tail is sampled, not cut off.
    """
    k = np.arange(65536, dtype=np.float64)
    main = (_t4_quantile((k + 0.5) / 65536.0) / math.sqrt(2.0)).astype(np.float32)
    tail = (_t4_quantile((k + 0.5) / 4294967296.0) / math.sqrt(2.0)).astype(np.float32)
    main.setflags(write=False)
    tail.setflags(write=False)
    return main, tail


T_MAIN, T_TAIL = _t_tables()


@numba.njit(cache=True, nogil=True)
def _fp4_encode_nb(u, main, tail, row_scale, col_scale, packed, scales):
    """Draw entries t(u) * row_scale[r] * col_scale[c] (float32) and encode them
    the DeepSeek way: per 32 inputs k = min{k : 6 * 2^k >= absmax}, code =
    e2m1 magnitude nearest to |x| / 2^k (ties to the even code), sign bit 8
    unless the magnitude is 0; even element in the low nibble; scale byte k + 127.
    Returns the number of scale exponents outside E8M0's range (must be 0)."""
    rows = u.shape[0]
    nb = u.shape[1] // 32
    x = np.empty(32, np.float32)
    bad = 0
    for r in range(rows):
        rs = row_scale[r]
        for b in range(nb):
            amax = np.float32(0.0)
            for j in range(32):
                c = b * 32 + j
                v = u[r, c]
                lo = v & 0xFFFF
                if lo == 0:
                    t = tail[v >> 16]
                elif lo == 0xFFFF:
                    t = -tail[v >> 16]
                else:
                    t = main[lo]
                w = t * rs * col_scale[c]
                x[j] = w
                a = abs(w)
                if a > amax:
                    amax = a
            k = 0
            if amax > 0:
                m, e = math.frexp(np.float64(amax) / 6.0)
                k = e - 1 if m == 0.5 else e
            if k + 127 < 0 or k + 127 > 254:
                bad += 1
                k = 0
            scales[r, b] = np.uint8(k + 127)
            inv = np.float32(math.ldexp(1.0, -k))
            for j in range(0, 32, 2):
                byte = 0
                for h in range(2):
                    y = x[j + h] * inv
                    a = abs(y)
                    # e2m1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; a tie goes to the even code
                    mag = ((a > 0.25) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
                           + (a > 2.5) + (a >= 3.5) + (a > 5.0))
                    code = mag | (8 if (y < 0 and mag > 0) else 0)
                    byte |= code << (4 * h)
                packed[r, b * 16 + j // 2] = np.uint8(byte)
    return bad


def _col_scale(spec: SyntheticSpec, layer: int, which: str, cols: int) -> np.ndarray:
    """Per input column of one (layer, surface), shared by its experts: log-normal
    spread plus a few 3-8x outlier columns (what an imatrix sees)."""
    g = rng_for(spec.seed, f"layers.{layer}.ffn.experts.{which}/columns")
    s = np.exp(0.35 * g.standard_normal(cols))
    n_out = max(1, cols // 128)
    s[g.choice(cols, size=n_out, replace=False)] *= g.uniform(3.0, 8.0, n_out)
    return s.astype(np.float32)


def _dead_experts(spec: SyntheticSpec, layer: int) -> frozenset:
    g = rng_for(spec.seed, f"layers.{layer}.ffn.experts/dead")
    n = max(1, round(spec.dead_fraction * spec.experts)) if spec.dead_fraction > 0 else 0
    return frozenset(int(e) for e in g.choice(spec.experts, size=min(n, spec.experts), replace=False))


def _expert_scale(spec: SyntheticSpec, layer: int, expert: int) -> float:
    g = rng_for(spec.seed, f"layers.{layer}.ffn.experts.{expert}/scale")
    s = spec.expert_scale * math.exp(spec.expert_sigma * float(g.standard_normal()))
    return s * (spec.dead_scale if expert in _dead_experts(spec, layer) else 1.0)


def _expert_draws(spec: SyntheticSpec, layer: int, expert: int, which: str):
    """(uniform uint32 (rows, cols), row scale float32 (rows,), column scale float32 (cols,))."""
    rows, cols = (spec.hidden, spec.moe_inter) if which == "w2" else (spec.moe_inter, spec.hidden)
    g = rng_for(spec.seed, f"layers.{layer}.ffn.experts.{expert}.{which}.weight")
    jitter = math.exp(0.15 * float(g.standard_normal()))
    row = (_expert_scale(spec, layer, expert) * jitter * np.exp(0.2 * g.standard_normal(rows))).astype(np.float32)
    u = g.bit_generator.random_raw(rows * cols // 2).view("<u4").reshape(rows, cols)
    return u, row, _col_scale(spec, layer, which, cols)


def expert_values(spec: SyntheticSpec, layer: int, expert: int, which: str) -> np.ndarray:
    """float32 (rows, cols): the values expert_fp4 encodes (numpy reference, for tests)."""
    u, row, col = _expert_draws(spec, layer, expert, which)
    lo, hi = u & 0xFFFF, u >> 16
    t = np.where(lo == 0, T_TAIL[hi], np.where(lo == 0xFFFF, -T_TAIL[hi], T_MAIN[lo]))
    return (t * row[:, None]) * col[None, :]


def expert_fp4(spec: SyntheticSpec, layer: int, expert: int, which: str) -> tuple[np.ndarray, np.ndarray]:
    """One routed expert matrix: (int8 (rows, cols/2) packed e2m1, uint8 (rows, cols/32) E8M0)."""
    u, row, col = _expert_draws(spec, layer, expert, which)
    rows, cols = u.shape
    packed = np.empty((rows, cols // 2), np.uint8)
    scales = np.empty((rows, cols // FP4_BLOCK), np.uint8)
    bad = _fp4_encode_nb(u, T_MAIN, T_TAIL, row, col, packed, scales)
    if bad:
        raise ValueError(f"expert {layer}/{expert}/{which}: {bad} scale exponents outside E8M0; lower dead_scale")
    return packed.view(np.int8), scales


def tid2eid(spec: SyntheticSpec, layer: int) -> np.ndarray:
    """int64 (vocab, topk): distinct experts per token, drawn without replacement
    (Gumbel top-k) from Zipf-like popularity, so hash routing is skewed."""
    g = rng_for(spec.seed, f"layers.{layer}.ffn.gate.tid2eid")
    E = spec.experts
    logp = np.empty(E)
    logp[g.permutation(E)] = -0.8 * np.log(np.arange(1, E + 1))
    out = np.empty((spec.vocab, spec.topk), np.int64)
    for lo in range(0, spec.vocab, 8192):
        hi = min(spec.vocab, lo + 8192)
        keys = logp[None, :] + g.gumbel(size=(hi - lo, E))
        out[lo:hi] = np.argsort(-keys, axis=1, kind="stable")[:, : spec.topk]
    return out


def _dense(spec: SyntheticSpec, name: str, shape: tuple[int, ...]) -> np.ndarray:
    # tiny's per-role initializer (norms ~1, hc scales ~1, projections 0.02 t6, ...);
    # the "synthetic-<seed>." prefix keeps the role suffix and makes the values seed-dependent.
    return tiny._init_value(f"synthetic-{spec.seed}.{name}", shape)


def make_unit(spec: SyntheticSpec, unit: Unit) -> list[np.ndarray]:
    """The arrays of one unit, in ``unit.tensors`` order (raw little-endian words)."""
    if unit.kind == "expert":
        which = unit.tensors[1].name.split(".")[-2]
        packed, scales = expert_fp4(spec, unit.layer, unit.expert, which)
        return [scales, packed]
    if unit.kind == "tid2eid":
        return [tid2eid(spec, unit.layer)]
    t = unit.tensors[-1]
    w = _dense(spec, t.name, t.shape)
    if unit.kind == "f32":
        return [w]
    if unit.kind == "bf16":
        from ds4quant.formats import bf16_round

        return [(bf16_round(w).view(np.uint32) >> np.uint32(16)).astype(np.uint16)]
    import torch  # tiny's FP8 encoder rounds through torch.float8_e4m3fn

    q, s = tiny.encode_fp8(w, torch)
    return [s, q]


# --------------------------------------------------------------------------
# streaming safetensors writer


def _header(units: list[Unit]) -> tuple[bytes, list[tuple[int, int]]]:
    entries, spans, off = {}, [], 0
    for u in units:
        for t in u.tensors:
            entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
            spans.append((off, off + t.nbytes))
            off += t.nbytes
    doc = {"__metadata__": {"format": "pt"}}
    doc.update(sorted(entries.items(), key=lambda kv: _natural_key(kv[0])))
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # data starts 8-aligned, as safetensors writes it
    return len(raw).to_bytes(8, "little") + raw, spans


def _natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _ordered(fn: Callable, items: list, workers: int) -> Iterator:
    """fn over items on ``workers`` threads, yielded in order, at most 2*workers in flight."""
    if workers <= 1:
        for it in items:
            yield fn(it)
        return
    with ThreadPoolExecutor(workers) as pool:
        pending = []
        for it in items:
            pending.append(pool.submit(fn, it))
            if len(pending) >= 2 * workers:
                yield pending.pop(0).result()
        for f in pending:
            yield f.result()


@dataclass(frozen=True)
class SyntheticInfo:
    """What make_synthetic wrote."""

    path: Path
    spec: SyntheticSpec
    files: tuple[Path, ...]
    total_bytes: int  # tensor bytes in all shards
    expert_bytes: int  # routed-expert codes + scales
    expert_weights: int
    largest_tensor: tuple[str, int]  # (name, stored bytes)
    largest_values: tuple[str, int]  # (name, number of values) of the largest weight
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {
            "path": str(self.path), "files": [p.name for p in self.files], "total_bytes": self.total_bytes,
            "expert_bytes": self.expert_bytes, "expert_weights": self.expert_weights,
            "largest_tensor": list(self.largest_tensor), "largest_values": list(self.largest_values),
            "seconds": self.seconds, "spec": asdict(self.spec),
        }


def describe(spec: SyntheticSpec) -> SyntheticInfo:
    """Sizes of the checkpoint ``spec`` describes, without writing it."""
    units = plan_units(spec)
    tensors = [t for u in units for t in u.tensors]
    experts = [t for u in units if u.kind == "expert" for t in u.tensors]
    big = max(tensors, key=lambda t: t.nbytes)
    weights = [t for t in tensors if not t.name.endswith(".scale")]
    vals = max(weights, key=lambda t: math.prod(t.shape) * (2 if t.dtype == "I8" else 1))
    n_vals = math.prod(vals.shape) * (2 if vals.dtype == "I8" else 1)
    n_shards = len(shard_units(units, spec.shard_size))
    files = tuple(Path(f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors") for i in range(n_shards))
    return SyntheticInfo(Path("."), spec, files, sum(t.nbytes for t in tensors), sum(t.nbytes for t in experts),
                         sum(math.prod(t.shape) * 2 for t in experts if t.dtype == "I8"),
                         (big.name, big.nbytes), (vals.name, n_vals))


def make_synthetic(out: "str | os.PathLike", spec: SyntheticSpec, *, workers: Optional[int] = None,
                   overwrite: bool = False) -> SyntheticInfo:
    """Write the checkpoint ``spec`` describes into folder ``out`` (created; an
    existing non-empty folder is refused unless ``overwrite``). Byte-identical
    for the same spec whatever ``workers``."""
    t0 = time.perf_counter()
    spec.validate()
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out}: folder is not empty (pass overwrite=True / --force)")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    workers = max(1, workers if workers is not None else min(2, os.cpu_count() or 1))
    shards = shard_units(plan_units(spec), spec.shard_size)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for name, units in zip(names, shards):
        head, spans = _header(units)
        want = [t for u in units for t in u.tensors]
        tmp = out / (name + ".partial")
        with open(tmp, "wb") as f:
            f.write(head)
            i = 0
            for arrays in _ordered(lambda u: make_unit(spec, u), units, workers):
                for a in arrays:
                    t = want[i]
                    b = np.ascontiguousarray(a)
                    if b.nbytes != spans[i][1] - spans[i][0]:  # a bug here, not a user error
                        raise RuntimeError(f"{t.name}: made {b.nbytes} bytes, planned {t.nbytes}")
                    f.write(memoryview(b).cast("B"))
                    weight_map[t.name] = name
                    i += 1
        os.replace(tmp, out / name)
        total += spans[-1][1] if spans else 0
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    tiny._write_json(out / INDEX, index)
    tiny._write_json(out / "config.json", spec.native_config())
    info = describe(spec)
    return replace(info, path=out, files=tuple(out / n for n in names), seconds=time.perf_counter() - t0)


# --------------------------------------------------------------------------
# CLI


def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("B")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    v = int(float(t) * mult)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return v


def add_spec_args(ap: argparse.ArgumentParser, default_preset: str) -> None:
    """The generator options (shared with benchmarks/convert.py)."""
    ap.add_argument("--preset", default=default_preset, choices=sorted(PRESETS),
                    help=f"size preset (default {default_preset}); the options below override it")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--experts", type=int)
    ap.add_argument("--hidden", type=int, help="multiple of 128")
    ap.add_argument("--moe-inter", type=int, help="expert intermediate size, multiple of 128")
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--shard-size", type=parse_size, help="max shard size, e.g. 256M")


def spec_from_args(args) -> SyntheticSpec:
    return preset(args.preset, layers=args.layers, experts=args.experts, hidden=args.hidden,
                  moe_inter=args.moe_inter, vocab=args.vocab, seed=args.seed, shard_size=args.shard_size)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", help="output folder (default: a new folder under the temp dir)")
    add_spec_args(ap, "medium")
    ap.add_argument("--workers", type=int, help="generator threads (bytes do not depend on it)")
    ap.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    try:
        spec = spec_from_args(args)
    except (ValueError, TypeError) as e:
        ap.error(str(e))
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="ds4-synthetic-"))
    try:
        info = make_synthetic(out, spec, workers=args.workers, overwrite=args.force)
    except FileExistsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info.to_json(), indent=2))
    else:
        mb = info.total_bytes / 1e6
        print(f"wrote {out}: {len(info.files)} shard(s), {mb:,.1f} MB ({info.expert_bytes / 1e6:,.1f} MB FP4 experts, "
              f"{info.expert_weights / 1e9:.3f} G expert weights) in {info.seconds:.1f} s "
              f"({mb / max(info.seconds, 1e-9):,.0f} MB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
