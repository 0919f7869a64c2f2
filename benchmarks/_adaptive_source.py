"""benchmarks/adaptive.py's source: a synthetic checkpoint, its synthetic
importance profile (imatrix + routing), and the source's byte counts.

See benchmarks/adaptive.py's module doc, step 1, for what is synthesized.
"""

from __future__ import annotations

import hashlib
import math
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "samples"))

import make_synthetic  # noqa: E402

# "adaptive" (default) keeps the whole benchmark within ~5 minutes on 2 cores:
# cold measurement costs ~2.6 s per million expert weights on 2 idle cores
# (several times that when the cores are shared). 4x the routed-expert weights
# of samples/ds4-tiny (25 M), twice its experts, rows twice as long.
# "adaptive-large": 4x that again (100 M weights, 64 experts per layer).
EXTRA_PRESETS = {
    "adaptive": dict(layers=4, experts=32, hidden=512, moe_inter=128, vocab=1024, topk=6, hash_layers=1),
    "adaptive-large": dict(layers=4, experts=64, hidden=512, moe_inter=256, vocab=2048, topk=8, hash_layers=1,
                           shard_size=32 << 20),
}
_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.(weight|scale)$")


def make_source(args, work: Path) -> tuple[Path, dict]:
    """Generate the synthetic source; (path, generator facts)."""
    kw = dict(layers=args.layers, experts=args.experts, hidden=args.hidden, moe_inter=args.moe_inter,
              seed=args.seed)
    if args.preset in EXTRA_PRESETS:
        spec = make_synthetic.preset("tiny", **{**EXTRA_PRESETS[args.preset],
                                                **{k: v for k, v in kw.items() if v is not None}})
    else:
        spec = make_synthetic.preset(args.preset, **kw)
    path = work / f"synthetic-{args.preset}"
    info = make_synthetic.make_synthetic(path, spec, overwrite=True)
    return path, {"preset": args.preset, "seconds": info.seconds, "spec": info.to_json()["spec"]}


def _rng(seed: int, key: str) -> np.random.Generator:
    s = int.from_bytes(hashlib.sha256(f"ds4quant-bench-adaptive/{seed}/{key}".encode()).digest()[:8], "little")
    return np.random.Generator(np.random.PCG64(s))


def _heavy_columns(g: np.random.Generator, cols: int) -> np.ndarray:
    """Column importance E[x^2] > 0: log-normal (sigma 1) with ~1% outliers 20-100x."""
    v = np.exp(g.standard_normal(cols))
    n_out = max(1, cols // 100)
    v[g.choice(cols, size=n_out, replace=False)] *= g.uniform(20.0, 100.0, n_out)
    return v


def synthesize_importance(source: Path, out: Path, seed: int = 0, tokens: int = 4096,
                          zipf: float = 1.1) -> tuple[Path, Path, dict]:
    """Write OUT/imatrix.gguf and OUT/routing.csv (+ routing.json) for ``source``.

    Deterministic from ``seed`` (see the module doc). imatrix counts are the
    routing counts (tokens that reached each expert), sums = E[x^2] * count.
    """
    from ds4quant.calib.imatrix import make_imatrix, write_imatrix_gguf
    from ds4quant.calib.routing import RoutingProfile, write_routing_csv, write_routing_json
    from ds4quant.sources.official import open_source

    with open_source(source) as src:
        cfg = src.config
        n_layer, n_exp, topk = cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_experts_per_tok
        hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
    counts = np.zeros((n_layer, n_exp), dtype=np.uint64)
    sums = {}
    for L in range(n_layer):
        g = _rng(seed, f"routing/{L}")
        order = g.permutation(n_exp)
        p = 1.0 / np.arange(1, n_exp + 1) ** zipf
        p[-1] = 0.0  # the last-ranked expert is never routed to
        c = np.floor(tokens * topk * p / p.sum()).astype(np.int64)
        c[0] += tokens * topk - int(c.sum())  # every slot goes somewhere
        counts[L, order] = c.astype(np.uint64)
        cnt = counts[L].astype(np.float64)
        gi = _rng(seed, f"imatrix/{L}/input")
        base = _heavy_columns(gi, hidden)
        gain = np.exp(0.3 * gi.standard_normal(n_exp))
        x2 = base[None, :] * gain[:, None]  # gate and up read the same input
        for surface in ("gate", "up"):
            sums[f"blk.{L}.ffn_{surface}_exps.weight"] = ((x2 * cnt[:, None]).astype(np.float32), cnt)
        gd = _rng(seed, f"imatrix/{L}/down")
        h2 = np.stack([_heavy_columns(gd, inter) for _ in range(n_exp)])
        sums[f"blk.{L}.ffn_down_exps.weight"] = ((h2 * cnt[:, None]).astype(np.float32), cnt)
    out.mkdir(parents=True, exist_ok=True)
    im = make_imatrix(sums, datasets=("synthetic",), chunk_count=tokens // 64, chunk_size=64)
    imx = out / "imatrix.gguf"
    write_imatrix_gguf(imx, im)
    prof = RoutingProfile(n_layer, n_exp, topk, counts, tokens=tokens,
                          source={"generator": "benchmarks/adaptive.py", "seed": seed, "zipf": zipf})
    rcsv = out / "routing.csv"
    write_routing_csv(rcsv, prof)
    write_routing_json(out / "routing.json", prof)
    return imx, rcsv, {"synthetic": True, "seed": seed, "tokens": tokens, "zipf": zipf,
                       "unreached_per_layer": 1}


def source_facts(path: Path) -> dict:
    """Bytes of the source and of its FP4 routed experts (codes + scales)."""
    from ds4quant.sources.official import open_source

    with open_source(path) as src:
        infos = [src.info(n) for n in src.tensor_names()]
    expert = [i for i in infos if _EXPERT.search(i.name)]
    return {
        "path": str(path),
        "bytes": sum(i.nbytes for i in infos),
        "expert_bytes": sum(i.nbytes for i in expert),
        "expert_weights": sum(math.prod(i.shape_logical) for i in expert if i.name.endswith(".weight")),
    }
