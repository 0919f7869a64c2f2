"""Benchmark the adaptive recipe: stage speed, and error against bits per weight.

    python benchmarks/adaptive.py                          # synthetic "adaptive" preset, 25 M expert weights
    python benchmarks/adaptive.py --source samples/ds4-tiny \\
        --imatrix samples/ds4-tiny-calib/imatrix.gguf --routing samples/ds4-tiny-calib/routing.csv
    python benchmarks/adaptive.py --preset medium --cold-threads-check --json --out /tmp/adaptive-bench

Steps, all in this process through ``ds4quant.convert.convert`` (the function
behind ``ds4quant convert``; every run's equivalent command line is printed):

1. the source: generated with samples/make_synthetic.py (default), or --source.
   A synthetic source gets a synthetic importance profile (there is no model to
   calibrate it with in reasonable time): per layer a seeded, heavy-tailed
   column importance E[x^2] (log-normal, sigma 1, plus ~1% outlier columns
   20-100x; gate and up share it, as they share their input; down gets its own
   per expert) and Zipf-like routing counts (exponent 1.1 over a seeded expert
   order; the last-ranked expert of every layer gets no token, so the
   "unreached expert" path runs), written with
   ``ds4quant.imatrix.write_imatrix_gguf`` and ``ds4quant.routing`` writers;
2. a warm-up conversion of a tiny source (numba code loads, imports), so the
   stage times below are the pipeline's own;
3. cold run: ``--recipe adaptive --target-bpw B`` (B = the routed-expert bpw
   of rocmfp2-strix) with an empty measurement cache; stage seconds from the
   progress events: measure (first measure event to the last), allocate (the
   last measure event to the start of encoding: allocation, plan rewrite,
   journal), encode (every tensor), assemble (GGUF, manifest, SHA256SUMS);
   seconds per GB of FP4 routed-expert source (codes + scales);
4. warm rerun at --target-bpw 2.7: the cache answers, measure seconds ~0;
5. the curve: adaptive at every --targets value, per granularity (warm cache),
   and the uniform recipes as points, all on one metric: importance-weighted,
   routing-weighted SQNR in dB (``predicted_weighted_sqnr_db``: 10 log10 of
   sum_e f_e sum_c imp_c x^2 over sum_e f_e sum_c imp_c (x - x')^2 over routed
   experts, f_e the routing weight). Uniform points come from the measurement
   cache (every candidate is measured on every expert); rocmfp2-strix, rocmfp3,
   rocmfp4_fast and rocmfp4 are also converted for real. Cross-check: the
   measured errors of each plan's qtypes, summed without routing weights over
   the experts the imatrix reached, against the written artifact's own
   ``expert_weighted_sqnr_db``;
6. the reference codebook fitter (``--fitter reference``, its own cache) at B,
   against the optimized fitter;
7. determinism: sha256 of the GGUF at B for each granularity with 1 and 2
   threads (warm cache) against the first run; with --cold-threads-check also a
   cold run with 1 thread (measurement included) from an empty cache.

Writes ``adaptive-curve.png`` (matplotlib Agg, no timestamps) and
``adaptive-bench.json`` into --out (default: a new temp folder, printed).

Before the curve, ``measure_cost`` (alone with ``--cost-only``) times the
measure stage per GB of FP4 source: the pre-issue-14 kernels
(``ds4quant.adaptive.legacy_kernels()``) on 1 thread as the anchor, then the
current ones on 1 and all threads, each from an empty cache at 2.8333 bpw and
warm at 2.7, with the weighted SQNR of both plans and a check that plans,
errors and GGUF bytes agree.

Where the measure stage spends its time (issue 14; cProfile, 1 thread,
samples/ds4-tiny with its calibration, --fit-effort 6,1,512, 192 expert
matrices x 6 candidates; a shared 2-core machine, so shares, not seconds):

    before (57 s)                                         share
    MIX encoder kernel, 8,960 calls (the optimized fitter's
      Lloyd steps and error evaluations, ~23 per MIX fit)  44 %
    per Lloyd step: unpack codes, decode, float64 error
      sums, bincount of the level sums (numpy)             30 %
    mode-0 (fixed levels) encoder, 126 scales per half      8 %
    book projection + bf16 repair (Python loops)            6 %
    reference fitter's Lloyd (numpy, 2 books per fit)       4 %
    non-MIX candidates (scale search), MIX decode,
      codebook validation, Python glue                      8 %

    after (17 CPU s, the same plan, errors and bytes)
    vectorised MIX search (SIMD lanes over 64 halves)       23 %
    book projection (numba) + fit glue                      ~15 %
    non-MIX candidate encodes (unchanged)                    7 %
    the measurement cache's JSON, rewritten per tensor       8 %
    mode-0 search (vectorised), fused error / level sums     9 %

The 1-thread speedup measured with --cost-only on that machine (load ~15):
4.8x CPU seconds per GB (14,514 -> 3,024), 5.4x wall.
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
from pathlib import Path
from typing import Optional

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "samples"))

import make_synthetic  # noqa: E402

DEFAULT_TARGETS = (2.5, 2.6, 2.7, 17 / 6, 3.0, 3.25, 3.5, 4.0)
# recipe -> its uniform point label
UNIFORM_RECIPES = {"rocmfp2-strix": "rocmfp2-strix", "rocmfp3": "rocmfp3", "rocmfp4-fast": "rocmfp4_fast",
                   "rocmfp4": "rocmfp4"}
# Uniform points read from the measurement cache: label -> qtype per surface.
UNIFORM_POINTS = {
    "rocmfp2": {"gate": "rocmfp2", "up": "rocmfp2", "down": "rocmfp2"},
    "rocmfp2_mix": {"gate": "rocmfp2_mix", "up": "rocmfp2_mix", "down": "rocmfp2_mix"},
    "rocmfp2-strix": {"gate": "rocmfp2", "up": "rocmfp2", "down": "rocmfp3"},
    "rocmfp3": {"gate": "rocmfp3", "up": "rocmfp3", "down": "rocmfp3"},
    "rocmfp3_mix": {"gate": "rocmfp3_mix", "up": "rocmfp3_mix", "down": "rocmfp3_mix"},
    "rocmfp4_fast": {"gate": "rocmfp4_fast", "up": "rocmfp4_fast", "down": "rocmfp4_fast"},
    "rocmfp4": {"gate": "rocmfp4", "up": "rocmfp4", "down": "rocmfp4"},
}
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
# Uniform points Lucebox cannot load (it takes rocmfp3_mix on down experts only).
NOT_LUCEBOX = {"rocmfp3_mix"}
_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.(weight|scale)$")
_SURFACE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.")
_READ = 8 << 20


# --------------------------------------------------------------------------
# the source and its importance profile


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
    from ds4quant.imatrix import make_imatrix, write_imatrix_gguf
    from ds4quant.routing import RoutingProfile, write_routing_csv, write_routing_json
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


# --------------------------------------------------------------------------
# one conversion


class Runner:
    """Runs conversions in this process and records what each one did."""

    def __init__(self, source: Path, work: Path, imatrix: Optional[Path], routing: Optional[Path],
                 candidates: Optional[tuple[str, ...]]):
        self.source, self.work, self.imatrix, self.routing = source, work, imatrix, routing
        self.candidates = candidates
        self.n = 0

    def command(self, recipe: str, out: Path, target=None, granularity=None, fitter=None, cache=None,
                threads=None) -> str:
        parts = ["ds4quant", "convert", str(self.source), str(out), "--recipe", recipe]
        if target is not None:
            parts += ["--target-bpw", repr(float(target))]
        if granularity is not None:
            parts += ["--granularity", granularity]
        if fitter is not None:
            parts += ["--fitter", fitter]
        if self.imatrix is not None:
            parts += ["--imatrix", str(self.imatrix)]
        if target is not None and self.routing is not None:
            parts += ["--routing", str(self.routing)]
        if target is not None and self.candidates:
            parts += ["--candidates", ",".join(self.candidates)]
        if cache is not None:
            parts += ["--cache-dir", str(cache)]
        if threads is not None:
            parts += ["--threads", str(threads)]
        return " ".join(parts + ["--json"])

    def convert(self, recipe: str = "adaptive", target=None, granularity: str = "tensor",
                fitter: str = "optimized", cache: Optional[Path] = None, threads: Optional[int] = None,
                keep: bool = False, legacy: bool = False) -> dict:
        import contextlib

        from ds4quant.adaptive import DEFAULT_CANDIDATES, AdaptiveOptions, legacy_kernels
        from ds4quant.convert import convert

        self.n += 1
        out = self.work / f"run-{self.n:02d}"
        shutil.rmtree(out, ignore_errors=True)
        adaptive = None
        if recipe == "adaptive":
            adaptive = AdaptiveOptions(target_bpw=float(target), candidates=self.candidates or DEFAULT_CANDIDATES,
                                       granularity=granularity, fitter=fitter,
                                       routing=str(self.routing) if self.routing else None,
                                       cache_dir=str(cache))
        events = {"measure": [], "encode": []}

        def progress(ev):
            events.setdefault(ev.stage, []).append((time.perf_counter(), ev.elapsed, time.process_time()))

        load0 = os.getloadavg()[0]
        c0 = time.process_time()
        t0 = time.perf_counter()
        with legacy_kernels() if legacy else contextlib.nullcontext():
            rep = convert(self.source, out, recipe, threads=threads,
                          imatrix=str(self.imatrix) if self.imatrix else None, adaptive=adaptive,
                          command=["benchmarks/adaptive.py"], progress=progress)
        t1 = time.perf_counter()
        c1 = time.process_time()
        j = rep.to_json()
        kinds = [c.tensor_class for c in rep.plan]
        enc = events["encode"]
        enc_start = enc[0][0] - enc[0][1] if enc else t0
        meas = events["measure"]
        meas_end = meas[-1][0] if meas else t0
        d = {
            "command": self.command(recipe, out, target if recipe == "adaptive" else None,
                                    granularity if recipe == "adaptive" else None,
                                    fitter if recipe == "adaptive" else None,
                                    cache if recipe == "adaptive" else None, threads),
            "recipe": recipe, "target_bpw": target, "granularity": granularity if adaptive else None,
            "legacy_kernels": legacy,
            "fitter": fitter if adaptive else None, "threads": threads,
            "bpw_experts": j["bpw_experts"], "expert_bytes": j["expert_bytes"], "bytes": j["bytes"],
            "expert_sqnr_db": j["expert_sqnr_db"], "expert_weighted_sqnr_db": j["expert_weighted_sqnr_db"],
            "expert_weighted_error": j["expert_weighted_error"],
            "gguf_sha256": _gguf_sha(j["files"]), "runtimes": j["runtimes"],
            "plan": [c for c in j["plan"] if c["class"] == "routed_expert"],
            "adaptive": j["adaptive"],
            "seconds": {
                "total": t1 - t0,
                "measure": (j["adaptive"] or {}).get("measure_seconds", 0.0),
                "allocate": max(0.0, enc_start - meas_end) if adaptive else 0.0,
                "encode": (enc[-1][0] - enc_start) if enc else 0.0,
                "encode_experts": sum(r.seconds for r, k in zip(rep.results, kinds) if k == "routed_expert"),
                "assemble": t1 - (enc[-1][0] if enc else t0),
            },
            # CPU seconds of this process (all threads): less sensitive than wall
            # time to other work on a shared machine
            "cpu_seconds": {"total": c1 - c0, "measure": (meas[-1][2] - c0) if (adaptive and meas) else 0.0},
            "load_average": [load0, os.getloadavg()[0]],
        }
        if not keep:
            shutil.rmtree(out, ignore_errors=True)
        return d


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(_READ):
            h.update(b)
    return h.hexdigest()


def _gguf_sha(files) -> str:
    """sha256 of the GGUF (a hash of the per-file hashes when split)."""
    ggufs = sorted((Path(p) for p in files if str(p).endswith(".gguf")), key=lambda p: p.name)
    if len(ggufs) == 1:
        return _sha256(ggufs[0])
    h = hashlib.sha256()
    for p in ggufs:
        h.update(p.name.encode() + b"\0" + _sha256(p).encode())
    return h.hexdigest()


# --------------------------------------------------------------------------
# the measurement cache as data


class Measured:
    """The cached measures of one fitter setting: (tensor, expert, qtype) ->
    (nbytes, sse, ssx, wsse, wssx, ref_wsse), plus routing weights f_e and the
    experts the imatrix reached."""

    def __init__(self, cache: Path, routing: Optional[Path], imatrix: Optional[Path]):
        from ds4quant.adaptive import expert_weights

        files = sorted(cache.glob("measure-*.json"))
        if len(files) != 1:
            raise SystemExit(f"{cache}: expected one measurement file, found {len(files)}")
        raw = json.loads(files[0].read_text())["measures"]
        self.m = {}
        for k, v in raw.items():
            t, e, q = k.split("|")
            self.m[(t, int(e), q)] = v
        self.tensors = sorted({t for t, _, _ in self.m}, key=_tensor_order)
        self.n_exp = {t: 1 + max(e for tt, e, _ in self.m if tt == t) for t in self.tensors}
        counts = None
        if routing is not None:
            from ds4quant.routing import read_routing

            counts = read_routing(routing).counts
        self.w = {t: expert_weights(None if counts is None else counts[_layer(t)], self.n_exp[t])
                  for t in self.tensors}
        self.reached = {t: np.ones(self.n_exp[t], bool) for t in self.tensors}
        if imatrix is not None:
            from ds4quant.imatrix import importance_for, read_imatrix

            im = read_imatrix(imatrix)
            for t in self.tensors:
                self.reached[t] = np.array([importance_for(im, t, e) is not None for e in range(self.n_exp[t])])

    def errors(self, pick) -> dict:
        """Sums for a choice ``pick(tensor, expert) -> qtype`` over all experts:
        routing-weighted (err, energy), imatrix-only over reached experts
        (err, energy), and payload bytes."""
        re_ = rs = ie = is_ = 0.0
        nb = 0
        for t in self.tensors:
            for e in range(self.n_exp[t]):
                v = self.m[(t, e, pick(t, e))]
                nb += int(v[0])
                re_ += self.w[t][e] * v[3]
                rs += self.w[t][e] * v[4]
                if self.reached[t][e]:
                    ie, is_ = ie + v[3], is_ + v[4]
        return {"bytes": nb, "routed": (re_, rs), "imatrix": (ie, is_)}

    def qtypes(self) -> set:
        return {q for _, _, q in self.m}

    def fitter_gain(self) -> Optional[dict]:
        """Reference vs optimized books on every measured MIX expert the imatrix
        reached, per qtype, routing-weighted. (Unreached experts are left out:
        their cached reference error is unweighted while their own error uses
        the fallback column weights, so the two are not comparable.)"""
        out = {}
        for q in sorted(self.qtypes()):
            ref = ours = 0.0
            n = 0
            for (t, e, qq), v in self.m.items():
                if qq == q and v[5] is not None and self.reached[t][e]:
                    ref += self.w[t][e] * v[5]
                    ours += self.w[t][e] * v[3]
                    n += 1
            if n:
                out[q] = {"experts": n, "reference_weighted_error": ref, "optimized_weighted_error": ours,
                          "gain_db": _db(ours, ref)}
        return out or None


def _layer(tensor: str) -> int:
    return int(_SURFACE.match(tensor).group(1))


def _surface(tensor: str) -> str:
    return _SURFACE.match(tensor).group(2)


def _tensor_order(t: str):
    return (_layer(t), ("gate", "up", "down").index(_surface(t)))


def _db(err: float, energy: float) -> Optional[float]:
    return 10.0 * math.log10(energy / err) if err > 0 and energy > 0 else None


def plan_choice(plan: list[dict]):
    """pick(tensor, expert) -> qtype from a routed-expert plan (compact stacks too)."""
    by = {}
    for c in plan:
        base = c["name"] if "experts" not in c else c["name"].rsplit(".", 2)[0] + ".weight"
        ids = c.get("experts", range(c["shape"][2]))
        for e in ids:
            by[(base, int(e))] = c["qtype"]
    return lambda t, e: by[(t, e)]


def uniform_points(meas: Measured, expert_weights: int) -> dict:
    out = {}
    have = meas.qtypes()
    for label, per in UNIFORM_POINTS.items():
        if not set(per.values()) <= have:
            continue
        s = meas.errors(lambda t, e, per=per: per[_surface(t)])
        out[label] = {"bpw": 8.0 * s["bytes"] / expert_weights, "bytes": s["bytes"],
                      "weighted_sqnr_db": _db(*s["routed"]), "imatrix_sqnr_db": _db(*s["imatrix"])}
    return out


def cross_check(run: dict, meas: Measured) -> dict:
    """The run's plan priced from the cache, against what the run reported."""
    s = meas.errors(plan_choice(run["plan"]))
    return {"bytes": s["bytes"], "predicted_db": _db(*s["routed"]), "imatrix_predicted_db": _db(*s["imatrix"]),
            "imatrix_actual_db": run["expert_weighted_sqnr_db"]}


# --------------------------------------------------------------------------
# the benchmark


def strix_bpw() -> float:
    """Routed-expert bpw of rocmfp2-strix: rocmfp2 gate/up, rocmfp3 down (equal sizes)."""
    from ds4quant.formats import get_qtype

    b = lambda q: 8.0 * get_qtype(q).nbytes(256) / 256  # noqa: E731
    return (2 * b("rocmfp2") + b("rocmfp3")) / 3


def measure_cost(run: "Runner", work: Path, facts: dict, threads: int) -> dict:
    """The measure stage's cost per GB of FP4 source, before and after issue 14,
    in this run: the pre-change kernels (``legacy_kernels()``) on 1 thread, the
    current ones on 1 thread and on ``threads``; each from an empty cache at
    2.8333 bpw, then 2.7 from the warm cache. Plans and errors must agree."""
    gb = facts["expert_bytes"] / 1e9
    out = {"fp4_source_gb": gb, "threads_all": threads, "paths": {}}
    plans = {}
    for label, legacy, t in (("before (legacy kernels), 1 thread", True, 1), ("after, 1 thread", False, 1),
                             (f"after, {threads} threads", False, threads)):
        cache = work / f"cache-cost-{len(out['paths'])}"
        r = run.convert(target=17 / 6, cache=cache, threads=t, legacy=legacy)
        w = run.convert(target=2.7, cache=cache, threads=t, legacy=legacy)
        sec, cpu = r["seconds"]["measure"], r["cpu_seconds"]["measure"]
        out["paths"][label] = {
            "threads": t, "legacy_kernels": legacy, "measure_s": sec, "measure_cpu_s": cpu,
            "s_per_gb": sec / gb, "cpu_s_per_gb": cpu / gb, "load_average": r["load_average"],
            "db_2.8333": r["adaptive"]["predicted_weighted_sqnr_db"], "error_2.8333": r["adaptive"]["predicted_weighted_error"],
            "db_2.7": w["adaptive"]["predicted_weighted_sqnr_db"], "error_2.7": w["adaptive"]["predicted_weighted_error"],
            "gguf_sha256_2.8333": r["gguf_sha256"], "command": r["command"],
        }
        plans[label] = ([(c["name"], c["qtype"]) for c in r["plan"]], [(c["name"], c["qtype"]) for c in w["plan"]],
                        r["gguf_sha256"])
        out["same_plans_and_bytes"] = len({json.dumps(v) for v in plans.values()}) == 1
    p = out["paths"]
    b, a1 = p["before (legacy kernels), 1 thread"], p["after, 1 thread"]
    out["speedup_1_thread"] = b["s_per_gb"] / a1["s_per_gb"]
    out["cpu_speedup_1_thread"] = b["cpu_s_per_gb"] / a1["cpu_s_per_gb"]
    return out


def benchmark(args) -> dict:
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="ds4-adaptive-bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="work-", dir=out_dir))
    threads = args.threads or max(2, os.cpu_count() or 1)
    t_bench = time.perf_counter()
    result: dict = {"out": str(out_dir), "threads": threads}
    try:
        # 1. source and importance
        imatrix = Path(args.imatrix) if args.imatrix else None
        routing = Path(args.routing) if args.routing else None
        if args.source:
            source = Path(args.source)
            result["generated"] = None
        else:
            source, result["generated"] = make_source(args, work)
        result["importance"] = {"imatrix": str(imatrix) if imatrix else None,
                                "routing": str(routing) if routing else None, "synthetic": False}
        if not args.source and not args.no_importance and imatrix is None and routing is None:
            imatrix, routing, info = synthesize_importance(source, out_dir / "importance", seed=args.seed or 0)
            result["importance"] = {"imatrix": str(imatrix), "routing": str(routing), **info}
        facts = source_facts(source)
        result["source"] = facts
        cands = tuple(args.candidates.split(",")) if args.candidates else None
        run = Runner(source, work, imatrix, routing, cands)
        B = strix_bpw()
        result["strix_bpw"] = B

        # 2. warm-up: imports and numba code, on a one-layer tiny source
        t0 = time.perf_counter()
        tiny = work / "warmup-source"
        make_synthetic.make_synthetic(tiny, make_synthetic.preset("tiny", layers=2, experts=4), overwrite=True)
        Runner(tiny, work / "warmup", None, None, cands).convert(target=B, cache=work / "cache-warmup")
        result["warmup_seconds"] = time.perf_counter() - t0

        result["cost"] = measure_cost(run, work, facts, threads)
        if args.cost_only:
            return result
        cache = {"optimized": work / "cache-optimized", "reference": work / "cache-reference"}
        runs = {}

        # 3. cold run at B, 4. warm rerun at 2.7
        cold = run.convert(target=B, granularity="tensor", cache=cache["optimized"], threads=threads)
        warm = run.convert(target=2.7, granularity="tensor", cache=cache["optimized"], threads=threads)
        result["timing"] = _timing(cold, warm, facts)
        meas = Measured(cache["optimized"], routing, imatrix)

        # 5. the curve
        grans = args.granularity.split(",")
        targets = sorted(set(args.targets))
        curve = {g: [] for g in grans}
        for g in grans:
            for t in targets:
                r = cold if (g == "tensor" and t == B) else run.convert(
                    target=t, granularity=g, cache=cache["optimized"], threads=threads)
                runs[(g, t)] = r
                curve[g].append(_point(r, t, meas))
        if (("tensor", 2.7) not in runs) and "tensor" in grans:
            runs[("tensor", 2.7)] = warm
        result["curve"] = curve
        result["uniform"] = uniform_points(meas, facts["expert_weights"])
        real = {}
        for rec, label in UNIFORM_RECIPES.items():
            r = run.convert(rec, threads=threads)
            real[label] = {"command": r["command"], "bpw": r["bpw_experts"], "expert_sqnr_db": r["expert_sqnr_db"],
                           "imatrix_actual_db": r["expert_weighted_sqnr_db"],
                           "imatrix_predicted_db": result["uniform"].get(label, {}).get("imatrix_sqnr_db")}
        result["uniform_converted"] = real

        # the questions of issue 4, per granularity
        checks = {}
        for g in grans:
            rb = runs.get((g, B)) or run.convert(target=B, granularity=g, cache=cache["optimized"], threads=threads)
            runs[(g, B)] = rb
            r27 = runs.get((g, 2.7)) or run.convert(target=2.7, granularity=g, cache=cache["optimized"],
                                                    threads=threads)
            a, u = rb["adaptive"], rb["adaptive"]["uniform"].get("rocmfp2-strix", {})
            under = (2.7 - r27["bpw_experts"]) / 2.7
            checks[g] = {
                "at_strix": {"command": rb["command"], "bpw_experts": rb["bpw_experts"],
                             "adaptive_db": a["predicted_weighted_sqnr_db"],
                             "strix_db": u.get("weighted_sqnr_db"), "strix_bpw": u.get("bpw"),
                             "gain_db": (a["predicted_weighted_sqnr_db"] - u["weighted_sqnr_db"]) if u else None,
                             "adaptive_bytes": a["allocated_bytes"], "strix_bytes": u.get("bytes"),
                             "qtype_share": a["qtype_share"], "fitter_comparison": a.get("fitter_comparison")},
                "at_2.7": {"command": r27["command"], "bpw_experts": r27["bpw_experts"], "under_fraction": under,
                           "within_0.5%_under": 0.0 <= under <= 0.005, "slack": r27["adaptive"]["slack"],
                           "budget_bytes": r27["adaptive"]["budget_bytes"],
                           "allocated_bytes": r27["adaptive"]["allocated_bytes"],
                           "n_items": _n_items(r27["plan"], g)},
            }
        result["checks"] = checks

        # 6. reference fitter
        if not args.skip_reference:
            ref = run.convert(target=B, granularity="tensor", fitter="reference", cache=cache["reference"],
                              threads=threads)
            opt = runs[("tensor", B)] if ("tensor", B) in runs else cold
            result["fitter"] = {
                "reference_run": {"command": ref["command"],
                                  "predicted_db": ref["adaptive"]["predicted_weighted_sqnr_db"],
                                  "bpw": ref["bpw_experts"], "measure_seconds": ref["seconds"]["measure"],
                                  "qtype_share": ref["adaptive"]["qtype_share"]},
                "optimized_run": {"predicted_db": opt["adaptive"]["predicted_weighted_sqnr_db"],
                                  "bpw": opt["bpw_experts"], "measure_seconds": cold["seconds"]["measure"],
                                  "qtype_share": opt["adaptive"]["qtype_share"]},
                "same_books_all_experts": meas.fitter_gain(),
                "in_plan": opt["adaptive"].get("fitter_comparison"),
            }

        # 7. determinism
        det = {}
        for g in grans:
            first = runs[(g, B)]
            shas = {f"threads={first['threads']} (first)": first["gguf_sha256"]}
            for t in (1, 2):
                r = run.convert(target=B, granularity=g, cache=cache["optimized"], threads=t)
                shas[f"threads={t} (rerun)"] = r["gguf_sha256"]
            if args.cold_threads_check and g == "tensor":
                r = run.convert(target=B, granularity=g, cache=work / "cache-cold-t1", threads=1)
                shas["threads=1 (cold cache)"] = r["gguf_sha256"]
                det["cold_t1_measure_seconds"] = r["seconds"]["measure"]
                det["cold_t1_cache_identical"] = _same_measures(work / "cache-cold-t1", cache["optimized"])
            det[g] = {"sha256": shas, "identical": len(set(shas.values())) == 1}
        result["determinism"] = det
        result["runs"] = [{k: v for k, v in r.items() if k != "plan"} for r in _unique(runs.values(), cold, warm)]
        result["seconds"] = time.perf_counter() - t_bench
        result["png"] = str(out_dir / "adaptive-curve.png")
        plot(result, Path(result["png"]))
        (out_dir / "adaptive-bench.json").write_text(json.dumps(result, indent=2, default=_jsonable) + "\n")
        return result
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def _unique(rs, *more):
    seen, out = set(), []
    for r in list(more) + list(rs):
        if id(r) not in seen:
            seen.add(id(r))
            out.append(r)
    return out


def _n_items(plan: list[dict], g: str) -> int:
    return len(plan) if g == "tensor" else sum(len(c.get("experts", range(c["shape"][2]))) for c in plan)


def _same_measures(a: Path, b: Path) -> bool:
    fa, fb = sorted(a.glob("measure-*.json")), sorted(b.glob("measure-*.json"))
    return len(fa) == len(fb) == 1 and fa[0].read_bytes() == fb[0].read_bytes()


def _timing(cold: dict, warm: dict, facts: dict) -> dict:
    gb = facts["expert_bytes"] / 1e9
    s = cold["seconds"]
    mae = s["measure"] + s["allocate"] + s["encode"]
    return {
        "cold": s, "warm": warm["seconds"], "cold_cpu": cold["cpu_seconds"],
        "cold_load_average": cold["load_average"],
        "cpu_s_per_gb_measure": cold["cpu_seconds"]["measure"] / gb,
        "warm_measures_reused": warm["adaptive"]["measures_reused"],
        "cold_measures_reused": cold["adaptive"]["measures_reused"],
        "fp4_source_gb": gb,
        "s_per_gb": {"measure": s["measure"] / gb, "allocate": s["allocate"] / gb, "encode": s["encode"] / gb,
                     "measure+allocate+encode": mae / gb, "total": s["total"] / gb},
        "warm_s_per_gb": {"measure": warm["seconds"]["measure"] / gb,
                          "measure+allocate+encode": (warm["seconds"]["measure"] + warm["seconds"]["allocate"]
                                                      + warm["seconds"]["encode"]) / gb},
        "cold_command": cold["command"], "warm_command": warm["command"],
    }


def _point(r: dict, target: float, meas: Measured) -> dict:
    a = r["adaptive"]
    return {"target_bpw": target, "bpw": r["bpw_experts"], "predicted_db": a["predicted_weighted_sqnr_db"],
            "slack": a["slack"], "method": a["method"], "qtype_share": a["qtype_share"],
            "cross_check": cross_check(r, meas), "gguf_sha256": r["gguf_sha256"], "command": r["command"]}


def _jsonable(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(type(o).__name__)


# --------------------------------------------------------------------------
# output


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=110)
    style = {"tensor": ("C0", "o", "-"), "expert": ("C3", "s", "--")}
    for g, pts in r["curve"].items():
        c, m, ls = style.get(g, ("C2", "^", ":"))
        ax.plot([p["bpw"] for p in pts], [p["predicted_db"] for p in pts], color=c, marker=m, ls=ls,
                label=f"adaptive, granularity {g}")
    for label, u in sorted(r["uniform"].items(), key=lambda kv: kv[1]["bpw"]):
        if u["weighted_sqnr_db"] is None:
            continue
        ax.scatter([u["bpw"]], [u["weighted_sqnr_db"]], color="k", marker="x", zorder=3)
        ax.annotate(label + ("*" if label in NOT_LUCEBOX else ""), (u["bpw"], u["weighted_sqnr_db"]),
                    textcoords="offset points", xytext=(5, -11), fontsize=8)
    ax.axvline(r["strix_bpw"], color="0.7", lw=0.8, ls=":")
    ax.set_xlabel("routed-expert bits per weight (tensor payload)")
    ax.set_ylabel("importance- and routing-weighted SQNR (dB)")
    src = r["generated"]["preset"] + " synthetic" if r["generated"] else Path(r["source"]["path"]).name
    ax.set_title(f"ds4quant adaptive vs uniform recipes: {src} "
                 f"({r['source']['expert_weights'] / 1e6:.1f} M expert weights)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.text(0.01, 0.99, "x: uniform recipes (priced from the same measurements); *: not loadable by Lucebox",
            transform=ax.transAxes, fontsize=7, color="0.35", va="top")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    # no Software/date chunks: the same numbers give the same file
    fig.savefig(path, format="png", metadata={"Software": None})
    plt.close(fig)


def _f(v, fmt=".2f") -> str:
    return "-" if v is None else format(v, fmt)


def _table(rows: list[tuple]) -> str:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(v).rjust(w) for v, w in zip(row, widths)) for row in rows)


def print_cost(r: dict) -> None:
    c = r["cost"]
    print(f"\nmeasure stage per GB of FP4 source ({c['fp4_source_gb'] * 1e3:.2f} MB; warm-up excluded; "
          f"wall and CPU seconds; the 1-min load average beside each, the machine may be shared):")
    rows = [("path", "threads", "s", "s/GB", "CPU s/GB", "load", "dB @2.7", "dB @2.8333")]
    for label, v in c["paths"].items():
        rows.append((label, v["threads"], _f(v["measure_s"]), _f(v["s_per_gb"], ",.0f"), _f(v["cpu_s_per_gb"], ",.0f"),
                     f"{v['load_average'][0]:.1f}", _f(v["db_2.7"], ".4f"), _f(v["db_2.8333"], ".4f")))
    print(_table(rows))
    print(f"speedup at 1 thread: {c['speedup_1_thread']:.1f}x wall, {c['cpu_speedup_1_thread']:.1f}x CPU; "
          f"plans, errors and GGUF bytes identical across paths: {c['same_plans_and_bytes']}")


def print_report(r: dict) -> None:
    if "curve" not in r:
        s = r["source"]
        print(f"source   {s['path']}: FP4 routed experts {s['expert_bytes'] / 1e6:,.2f} MB "
              f"({s['expert_weights'] / 1e6:,.2f} M weights)")
        print_cost(r)
        return
    s = r["source"]
    g = r["generated"]
    how = f"synthetic {g['preset']} preset, seed {g['spec']['seed']}" if g else "given with --source"
    print(f"source   {s['path']} ({how})")
    print(f"         {s['bytes'] / 1e6:,.1f} MB; FP4 routed experts {s['expert_bytes'] / 1e6:,.2f} MB "
          f"({s['expert_weights'] / 1e6:,.2f} M weights)")
    imp = r["importance"]
    print(f"importance imatrix {imp['imatrix']}, routing {imp['routing']}"
          + (" (synthesized: heavy-tailed columns, Zipf routing, 1 unreached expert/layer)" if imp.get("synthetic")
             else ""))
    t = r["timing"]
    c, w = t["cold"], t["warm"]
    print(f"\nstages (cold cache, threads {r['threads']}; warm-up {r['warmup_seconds']:.1f} s excluded):")
    print(_table([
        ("stage", "cold s", "cold s/GB", "warm s (2.7)", "warm s/GB"),
        ("measure", _f(c["measure"]), _f(t["s_per_gb"]["measure"], ",.0f"), _f(w["measure"]),
         _f(t["warm_s_per_gb"]["measure"], ",.1f")),
        ("allocate", _f(c["allocate"]), _f(t["s_per_gb"]["allocate"], ",.1f"), _f(w["allocate"]), ""),
        ("encode", _f(c["encode"]), _f(t["s_per_gb"]["encode"], ",.0f"), _f(w["encode"]), ""),
        ("measure+allocate+encode", _f(c["measure"] + c["allocate"] + c["encode"]),
         _f(t["s_per_gb"]["measure+allocate+encode"], ",.0f"), _f(w["measure"] + w["allocate"] + w["encode"]),
         _f(t["warm_s_per_gb"]["measure+allocate+encode"], ",.0f")),
        ("whole convert", _f(c["total"]), _f(t["s_per_gb"]["total"], ",.0f"), _f(w["total"]), ""),
    ]))
    print(f"cold measure: {t['cold_cpu']['measure']:.1f} CPU s ({t['cpu_s_per_gb_measure']:,.0f} CPU s/GB); "
          f"1-min load average {t['cold_load_average'][0]:.2f} before, {t['cold_load_average'][1]:.2f} after "
          f"(the machine is shared: wall times grow with others' load)")
    print(f"measures reused: cold {t['cold_measures_reused']}, warm {t['warm_measures_reused']} (expert matrices)")
    print_cost(r)
    print(f"  cold: {t['cold_command']}\n  warm: {t['warm_command']}")

    print("\nerror vs bpw (dB = importance- and routing-weighted SQNR; 'imatrix' columns: no routing "
          "weights, reached experts only, predicted from measures vs the written artifact):")
    rows = [("kind", "target", "bpw", "dB", "slack %", "imatrix pred", "imatrix actual", "shares")]
    for gname, pts in r["curve"].items():
        for p in pts:
            x = p["cross_check"]
            rows.append((f"adaptive/{gname}", f"{p['target_bpw']:.4f}", f"{p['bpw']:.4f}", _f(p["predicted_db"]),
                         f"{100 * p['slack']:.3f}", _f(x["imatrix_predicted_db"], ".4f"),
                         _f(x["imatrix_actual_db"], ".4f"),
                         " ".join(f"{q}:{v:.2f}" for q, v in p["qtype_share"].items())))
    for label, u in sorted(r["uniform"].items(), key=lambda kv: kv[1]["bpw"]):
        real = r["uniform_converted"].get(label)
        rows.append((f"uniform {label}" + ("*" if label in NOT_LUCEBOX else ""), "", f"{u['bpw']:.4f}",
                     _f(u["weighted_sqnr_db"]), "",
                     _f(u["imatrix_sqnr_db"], ".4f"), _f(real["imatrix_actual_db"], ".4f") if real else "(cache)", ""))
    print(_table(rows))
    print("(cache): priced from the measurement cache only (MIX with the optimized books); "
          "*: not loadable by Lucebox (rocmfp3_mix on gate/up), so outside the tensor-granularity choices")

    print("\nissue 4 checks:")
    for gname, ch in r["checks"].items():
        a, b = ch["at_strix"], ch["at_2.7"]
        print(f"  [{gname}] target {r['strix_bpw']:.6f} (rocmfp2-strix): adaptive {_f(a['adaptive_db'], '.3f')} dB "
              f"at {a['bpw_experts']:.4f} bpw ({a['adaptive_bytes']:,} B) vs rocmfp2-strix "
              f"{_f(a['strix_db'], '.3f')} dB at {_f(a['strix_bpw'], '.4f')} bpw ({a['strix_bytes']:,} B): "
              f"{_f(a['gain_db'], '+.3f')} dB")
        print(f"  [{gname}] target 2.7: {b['bpw_experts']:.6f} bpw, {100 * b['under_fraction']:.3f}% under 2.7 "
              f"(allocator slack {100 * b['slack']:.3f}% of {b['budget_bytes']:,} B; {b['n_items']} items): "
              f"{'within 0.5% under' if b['within_0.5%_under'] else 'NOT within 0.5% under'}")
    f = r.get("fitter")
    if f:
        print("\nMIX codebook fitter, reference vs optimized:")
        for q, v in (f["same_books_all_experts"] or {}).items():
            print(f"  {q}: all {v['experts']} reached experts, same encoder: reference "
                  f"{v['reference_weighted_error']:.6g}, optimized {v['optimized_weighted_error']:.6g} "
                  f"weighted error ({_f(v['gain_db'], '+.3f')} dB)")
        ip = f["in_plan"]
        if ip:
            print(f"  in the plan at B ({ip['experts']} MIX experts): reference {ip['reference_weighted_error']:.6g}, "
                  f"optimized {ip['optimized_weighted_error']:.6g} ({_f(ip['gain_db'], '+.3f')} dB)")
        rr, oo = f["reference_run"], f["optimized_run"]
        print(f"  whole plan at B: --fitter reference {_f(rr['predicted_db'], '.3f')} dB (measure "
              f"{rr['measure_seconds']:.1f} s), --fitter optimized {_f(oo['predicted_db'], '.3f')} dB (measure "
              f"{oo['measure_seconds']:.1f} s)\n  {rr['command']}")
    print("\ndeterminism (sha256 of the GGUF at B):")
    for gname, d in r["determinism"].items():
        if not isinstance(d, dict):
            continue
        print(f"  [{gname}] {'identical' if d['identical'] else 'DIFFERENT'}: "
              + ", ".join(f"{k} {v[:16]}" for k, v in d["sha256"].items()))
    if "cold_t1_cache_identical" in r["determinism"]:
        print(f"  cold 1-thread measurement cache byte-identical to the 2-thread one: "
              f"{r['determinism']['cold_t1_cache_identical']}")
    print(f"\nbenchmark {r['seconds']:.0f} s; PNG {r['png']}; JSON {Path(r['out']) / 'adaptive-bench.json'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", help="an official-layout checkpoint folder (default: generate one)")
    ap.add_argument("--imatrix", help="imatrix for --source (GGUF or .dat)")
    ap.add_argument("--routing", help="routing profile for --source (Lucebox CSV or ds4quant JSON)")
    ap.add_argument("--preset", default="adaptive", choices=sorted({*make_synthetic.PRESETS, *EXTRA_PRESETS}),
                    help="synthetic size preset (default adaptive: 25 M expert weights, a few minutes on 2 cores)")
    for k in ("layers", "experts", "hidden", "moe-inter", "seed"):
        ap.add_argument(f"--{k}", type=int, help="override the preset")
    ap.add_argument("--no-importance", action="store_true",
                    help="synthetic source: no synthetic imatrix/routing (weight-only error)")
    ap.add_argument("--targets", type=lambda s: [float(x) for x in s.split(",")], default=list(DEFAULT_TARGETS),
                    help="adaptive --target-bpw values of the curve (comma-separated)")
    ap.add_argument("--granularity", default="tensor,expert", help="tensor,expert (default both)")
    ap.add_argument("--candidates", help="adaptive --candidates (default: the recipe's)")
    ap.add_argument("--threads", type=int, help="threads of the timed runs (default max(2, cores))")
    ap.add_argument("--skip-reference", action="store_true", help="skip the --fitter reference run")
    ap.add_argument("--cost-only", action="store_true",
                    help="only the measure-stage cost (before/after, 1 and all threads) and its plans' dB")
    ap.add_argument("--cold-threads-check", action="store_true",
                    help="also measure again from an empty cache with 1 thread and compare bytes")
    ap.add_argument("--out", help="folder for the PNG and JSON (default: a new temp folder)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (sources, caches)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = ap.parse_args(argv)
    if args.source and (args.layers or args.experts or args.hidden or args.moe_inter):
        ap.error("--layers/--experts/--hidden/--moe-inter describe a synthetic source, not --source")
    for g in args.granularity.split(","):
        if g not in ("tensor", "expert"):
            ap.error(f"--granularity: {g!r} is not tensor or expert")
    result = benchmark(args)
    if args.json:
        print(json.dumps(result, indent=2, default=_jsonable))
    else:
        print_report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
