"""make_synthetic.py's tensor values: seeded per tensor identity (so order and
worker count never change bytes), heavy-tailed routed experts encoded to FP4,
hash-routing tables, and the dense tensors through make_ds4_tiny's encoders."""

from __future__ import annotations

import hashlib
import math
import sys
from pathlib import Path

import numba
import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import make_ds4_tiny as tiny  # noqa: E402  (the tiny sample's encoders)
from _synthetic_spec import FP4_BLOCK, GENERATOR, SyntheticSpec, Unit  # noqa: E402


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


# A plain tensor with more values than this (DS4 Flash's 129,280 x 4096 embedding
# and head) is made in row blocks, each seeded by its rows, and written block by
# block, so generating it never holds more than a block. Smaller tensors (every
# tensor of the smaller presets) are made whole, as before.
CHUNK_VALUES = 1 << 26


class RowBlocks:
    """A large plain tensor as a lazy sequence of row blocks (raw words, in order).
    Each block is seeded by its own rows, so ``workers`` threads may make them
    (numpy's generators release the GIL) and the bytes stay the same: the
    embedding and head of DS4 Flash are 1 G values, most of a slice's time on
    one thread."""

    def __init__(self, spec: SyntheticSpec, kind: str, name: str, shape: tuple[int, ...], workers: int = 1):
        self.spec, self.kind, self.name, self.shape = spec, kind, name, shape
        self.rows = max(1, CHUNK_VALUES // max(1, math.prod(shape[1:])))
        self.workers = workers

    def _block(self, lo: int) -> np.ndarray:
        hi = min(self.shape[0], lo + self.rows)
        w = tiny._init_value(f"synthetic-{self.spec.seed}.rows{lo}-{hi}.{self.name}", (hi - lo,) + self.shape[1:])
        return _plain_words(self.kind, w)

    def __iter__(self):
        return ordered(self._block, range(0, self.shape[0], self.rows), self.workers)


def ordered(fn, items, workers: int):
    """fn over items on ``workers`` threads, yielded in order, at most 2*workers in flight."""
    if workers <= 1:
        yield from map(fn, items)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        pending = []
        for it in items:
            pending.append(pool.submit(fn, it))
            if len(pending) >= 2 * workers:
                yield pending.pop(0).result()
        for f in pending:
            yield f.result()


def _plain_words(kind: str, w: np.ndarray) -> np.ndarray:
    if kind == "f32":
        return w
    from ds4quant.formats import bf16_round

    return (bf16_round(w).view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def make_unit(spec: SyntheticSpec, unit: Unit, block_workers: int = 1) -> list:
    """The arrays of one unit, in ``unit.tensors`` order (raw little-endian words);
    a large plain tensor comes as ``RowBlocks`` made on ``block_workers`` threads."""
    if unit.kind in ("f32", "bf16") and math.prod(unit.tensors[-1].shape) > CHUNK_VALUES:
        t = unit.tensors[-1]
        return [RowBlocks(spec, unit.kind, t.name, t.shape, block_workers)]
    if unit.kind == "expert":
        which = unit.tensors[1].name.split(".")[-2]
        packed, scales = expert_fp4(spec, unit.layer, unit.expert, which)
        return [scales, packed]
    if unit.kind == "tid2eid":
        return [tid2eid(spec, unit.layer)]
    t = unit.tensors[-1]
    w = _dense(spec, t.name, t.shape)
    if unit.kind in ("f32", "bf16"):
        return [_plain_words(unit.kind, w)]
    import torch  # tiny's FP8 encoder rounds through torch.float8_e4m3fn

    q, s = tiny.encode_fp8(w, torch)
    return [s, q]
