"""Write the joint gate+up codebook vector: two experts' gate and up matrices, their importance,
and the book pair Lucebox's DS4 MIX converter fits for each expert's gate and up together.

    python tests/data/gateup_joint/make_vector.py      # rewrites vector.npz beside this file

The books come from this file's own plain implementation of the converter's rule (no ds4quant
code), so the test compares ds4quant's fitter against an independent reading of that rule.
The rule, as the converter states it for its qtype-106 gate/up tensors:

1. one fitter per expert: the gate (w1) rows are added first, then the up (w3) rows, each row
   in order, in halves of 16 values, each value weighted by its column's importance (the
   tensor's own imatrix entry: ``blk.L.ffn_gate_exps.weight`` for gate, ``..._up_exps...`` for up);
2. a half: m = max |v| (float), sumsq = sum v*v in double; an all-zero half adds 16.0 to
   population 0, bin 2048; else population 0 if sqrt(sumsq/16)/m < 0.52, else 1; each value
   n = clamp(v/m, -1, 1) (float) goes to bin lround((n + 1) * 0.5 * 4096) (float arithmetic,
   halves away from zero), adding its weight when the weight is > 0 and finite;
3. per population (an empty one takes the sum of both): 4 levels, Lloyd over the 4097 bin
   coordinates -1 + 2b/4096: start at the mass quantiles (j + 0.5)/4, then 24 rounds of
   "a bin joins the cluster whose midpoint bound it does not exceed, centre = weighted mean
   (double)", sorted after each round;
4. centres to bf16 (round to nearest even); a level not above its predecessor steps one bf16
   ulp up; a top level above 1 becomes 1.0 and lower levels step down below their successor;
5. the pair (population 0, population 1) is the expert's books for BOTH gate and up (the
   GUMIXs1 sidecar repeats it for the two surfaces).

The encoded bytes stored beside the books are ds4quant's rocmfp2_mix encoding with those
books and each tensor's importance (the encoder is checked against the reference codec by the
golden vectors); they pin the whole joint path's output.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
BINS = 4097
LEVELS = 4
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def source(seed: int = 106):
    """Two experts' gate/up (8 x 128 each) as FP4 e2m1 x power-of-two scale values (the DS4
    source's form), with a zero half and a zero-weight column; and the two importance rows."""
    rng = np.random.default_rng(seed)
    def matrix():
        codes = rng.integers(0, 16, size=(8, 128))
        scales = 2.0 ** rng.integers(-9, -5, size=(8, 128 // 32)).repeat(32, axis=1)
        return (np.array(E2M1)[codes] * scales).astype(np.float32)
    gate = np.stack([matrix(), matrix()])
    up = np.stack([matrix(), matrix()])
    gate[0, 3, 16:32] = 0.0  # an all-zero half
    imp_g = rng.gamma(2.0, 1.0, 128).astype(np.float32)
    imp_u = rng.gamma(2.0, 1.0, 128).astype(np.float32)
    imp_g[5] = 0.0  # a column that adds nothing
    return gate, up, imp_g, imp_u


def add_rows(hist, x, w):
    for row in x:
        for c0 in range(0, len(row), 16):
            half = [float(v) for v in row[c0:c0 + 16]]
            m = max(abs(v) for v in half)
            sumsq = 0.0
            for v in half:
                sumsq += v * v
            if not m > 0.0:
                hist[0][2048] += 16.0
                continue
            pop = 0 if math.sqrt(sumsq / 16.0) / m < 0.52 else 1
            for i, v in enumerate(half):
                n = max(-1.0, min(1.0, f32(v / m)))
                t = f32(f32(f32(n + 1.0) * 0.5) * 4096.0)
                b = min(BINS - 1, max(0, int(math.floor(t + 0.5))))  # lround: t >= 0
                wt = float(w[c0 + i])
                if wt > 0.0 and math.isfinite(wt):
                    hist[pop][b] += wt


def coord(b: int) -> float:
    return f32(-1.0 + f32(f32(2.0 * b) / 4096.0))


def lloyd(h, k):
    mass = 0.0
    for v in h:
        mass += v
    c = []
    for j in range(k):
        target = mass * (j + 0.5) / k
        run, b = 0.0, 0
        while b < BINS - 1:
            run += h[b]
            if run >= target:
                break
            b += 1
        c.append(coord(b))
    for _ in range(24):
        sums, wts = [0.0] * k, [0.0] * k
        cl = 0
        for b in range(BINS):
            x = coord(b)
            while cl + 1 < k and x > f32(0.5 * f32(c[cl] + c[cl + 1])):
                cl += 1
            sums[cl] += h[b] * x
            wts[cl] += h[b]
        c = [f32(sums[j] / wts[j]) if wts[j] > 0.0 else c[j] for j in range(k)]
        c.sort()
    return c


def bf16_bits(x: float) -> int:
    u = struct.unpack("<I", struct.pack("<f", x))[0]
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def bf16_val(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b << 16))[0]


def step(b: int, up: bool) -> int:
    if b & 0x7FFF == 0:
        return 0x0080 if up else 0x8080
    return b + (1 if up != bool(b & 0x8000) else -1)


def round_books(c):
    bits = [bf16_bits(x) for x in c]
    for i in range(1, len(bits)):
        if bf16_val(bits[i]) <= bf16_val(bits[i - 1]):
            bits[i] = step(bits[i - 1], True)
    if bf16_val(bits[-1]) > 1.0:
        bits[-1] = bf16_bits(1.0)
        for i in range(len(bits) - 1, 0, -1):
            if bf16_val(bits[i - 1]) >= bf16_val(bits[i]):
                bits[i - 1] = step(bits[i], False)
    return bits


def joint_books(gate, up, imp_g, imp_u):
    hist = [[0.0] * BINS, [0.0] * BINS]
    add_rows(hist, gate, imp_g)
    add_rows(hist, up, imp_u)
    both = [a + b for a, b in zip(*hist)]
    out = []
    for p in range(2):
        total = 0.0
        for v in hist[p]:
            total += v
        out += round_books(lloyd(hist[p] if total > 0.0 else both, LEVELS))
    return np.array(out, dtype=np.uint16).reshape(2, LEVELS)


def main() -> None:
    gate, up, imp_g, imp_u = source()
    books = np.stack([joint_books(gate[e], up[e], imp_g, imp_u) for e in range(2)])
    from ds4quant import formats

    fl = (books.astype(np.uint32) << 16).view(np.float32)
    enc_g = np.stack([formats.encode("rocmfp2_mix", gate[e], imp_g, fl[e]) for e in range(2)])
    enc_u = np.stack([formats.encode("rocmfp2_mix", up[e], imp_u, fl[e]) for e in range(2)])
    np.savez_compressed(HERE / "vector.npz", gate=gate, up=up, imp_gate=imp_g, imp_up=imp_u, books_bf16=books,
                        encoded_gate=enc_g, encoded_up=enc_u)
    print(books)


if __name__ == "__main__":
    main()
