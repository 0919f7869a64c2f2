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
   ``ds4quant.calib.imatrix.write_imatrix_gguf`` and ``ds4quant.calib.routing`` writers;
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
measure stage per GB of FP4 source: the pre-speed-up kernels
(``_legacy_kernels.legacy_kernels()``) on 1 thread as the anchor, then the
current ones on 1 and all threads, each from an empty cache at 2.8333 bpw and
warm at 2.7, with the weighted SQNR of both plans and a check that plans,
errors and GGUF bytes agree.

Where the measure stage spends its time (cProfile, 1 thread,
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

    with the vectorised MIX search (17 CPU s, the same plan, errors and bytes)
    vectorised MIX search (SIMD lanes over 64 halves)       23 %
    book projection (numba) + fit glue                      ~15 %
    non-MIX candidate encodes (unchanged)                    7 %
    the measurement cache's JSON, rewritten per tensor       8 %
    mode-0 search (vectorised), fused error / level sums     9 %

    with windowed searches (12 CPU s under load 8; cProfile shares)
    mode-1 MIX search, 8,576 calls (~22 per MIX fit: 3 starts
      x <= 6 Lloyd steps, the final errors, the encode)     37 %
    non-MIX candidate encodes (scale search), 832 calls     10 %
    the fitter's fused error / Lloyd sums                    5 %
    convert's fsyncs (cache, books, artifact)                5 %
    book projection + bf16 repair                            4 %
    mode-0 search (a window of bytes, not 126)               4 %
    numpy sums, reference fitter, error_sums, glue          35 %

    with the fitter's sums fused (8.5 CPU s under load 2.5; the same plans and bytes)
    mode-1 search + the fitter's float64 terms, Lloyd sums and np.sum's
      pairwise order in one numba call, 8,064 calls         47 %
    non-MIX candidate encodes (scale search), 832 calls     16 %
    mode-0 search, 384 calls                                 5 %
    error sums (metrics.error_sums)                          6 %
    book projection, histogram Lloyd (occupied bins only),
      fit glue, convert's fsyncs and JSON                   26 %
    (the final MIX encode of the chosen books is gone: the fitter's
    own choices are decoded)

At DS4 Flash shapes (--ds4-shape 1: gate/up 2048 x 4096, down 4096 x 2048,
the Lloyd steps on 512 sampled rows, the final evaluations on all rows):
mode-1 search 36 %, non-MIX encodes 27 %, the fitter's sums 11 %, mode-0
search 11 %, decodes 3 %, error sums 2 %: the full-row evaluations and the
non-MIX candidates weigh more than on the sample. Fused sums (1 core, 20 s for
one expert under load 3): mode-1 search with its sums 36 %, non-MIX encodes
32 %, mode-0 search 12 % and its sums 6 %, the final encode 4 %.

Measured with --cost-only on the 2-core machine (load 8-13): 1 core 5.5x
fewer CPU s/GB than the anchor (16,580 -> 3,013), 7.5x wall; 2 cores
(--jobs 2) 14.4x wall; plans, errors and GGUF bytes identical. With the
fitter's sums fused (load 2.0-2.7):
1 core 6.5x fewer CPU s/GB (16,055 -> 2,463), 6.8x wall; at load 3.1-4.1
(benchmarks/results/adaptive_measure_ds4tiny_2core.json): 1 core 6.5x CPU, 8.6x wall, 2 cores 14.3x, --fit-effort
3,0,512 on 2 cores 22.2x (the same plans, 0.2 dB less).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "samples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, however it is loaded

import make_synthetic  # noqa: E402
from _adaptive_measured import Measured, cross_check, uniform_points  # noqa: E402
from _adaptive_report import plot, print_report  # noqa: E402
from _adaptive_source import EXTRA_PRESETS, make_source, source_facts, synthesize_importance  # noqa: E402

DEFAULT_TARGETS = (2.5, 2.6, 2.7, 17 / 6, 3.0, 3.25, 3.5, 4.0)
# recipe -> its uniform point label
UNIFORM_RECIPES = {"rocmfp2-strix": "rocmfp2-strix", "rocmfp3": "rocmfp3", "rocmfp4-fast": "rocmfp4_fast",
                   "rocmfp4": "rocmfp4"}
_READ = 8 << 20


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
                threads=None, jobs=None, device="cpu", effort=None) -> str:
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
        if jobs is not None:
            parts += ["--jobs", str(jobs)]
        if device != "cpu":
            parts += ["--device", device]
        if effort is not None:
            parts += ["--fit-effort", ",".join(map(str, effort))]
        return " ".join(parts + ["--json"])

    def convert(self, recipe: str = "adaptive", target=None, granularity: str = "tensor",
                fitter: str = "optimized", cache: Optional[Path] = None, threads: Optional[int] = None,
                keep: bool = False, legacy: bool = False, jobs: Optional[int] = None, device: str = "cpu",
                effort: Optional[tuple] = None) -> dict:
        import contextlib

        from _legacy_kernels import legacy_kernels

        from ds4quant.plan import DEFAULT_CANDIDATES, AdaptiveOptions
        from ds4quant.convert import convert

        self.n += 1
        out = self.work / f"run-{self.n:02d}"
        shutil.rmtree(out, ignore_errors=True)
        adaptive = None
        if recipe == "adaptive":
            eff = {} if effort is None else dict(fit_iterations=effort[0], fit_restarts=effort[1],
                                                 fit_max_rows=effort[2])
            adaptive = AdaptiveOptions(target_bpw=float(target), candidates=self.candidates or DEFAULT_CANDIDATES,
                                       granularity=granularity, fitter=fitter,
                                       routing=str(self.routing) if self.routing else None,
                                       cache_dir=str(cache), jobs=jobs, device=device, **eff)
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
                                    cache if recipe == "adaptive" else None, threads, jobs, device, effort),
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
# the benchmark


def strix_bpw() -> float:
    """Routed-expert bpw of rocmfp2-strix: rocmfp2 gate/up, rocmfp3 down (equal sizes)."""
    from ds4quant.formats import get_qtype

    b = lambda q: 8.0 * get_qtype(q).nbytes(256) / 256  # noqa: E731
    return (2 * b("rocmfp2") + b("rocmfp3")) / 3


def measure_cost(run: "Runner", work: Path, facts: dict, threads: int, devices=(), efforts=(),
                 anchor: bool = True, one_core: bool = True, partial: Optional[Path] = None) -> dict:
    """The measure stage's cost per GB of FP4 source, before and after its speed-up,
    in this run: the pre-change kernels (``legacy_kernels()``, 1 thread, the
    anchor), the current ones on 1 core and on ``threads`` cores (``--jobs``
    experts at once), on each of ``devices`` (``--device``), and at each of
    ``efforts`` (a named ``--fit-effort`` trade-off); each from an empty cache
    at 2.8333 bpw, then 2.7 from the warm cache. Plans, errors and bytes must
    agree across the default-effort paths."""
    gb = facts["expert_bytes"] / 1e9
    out = {"fp4_source_gb": gb, "threads_all": threads, "paths": {}}
    plans = {}
    paths = [("before (legacy kernels), 1 thread", dict(legacy=True, threads=1, jobs=1))] if anchor else []
    paths += [("after, 1 core", dict(threads=1, jobs=1))] if one_core else []
    paths += [(f"after, {threads} cores", dict(threads=threads, jobs=threads))]
    paths += [(f"after, {d} + {threads} cores", dict(threads=threads, jobs=threads, device=d)) for d in devices]
    paths += [(f"after, {threads} cores, --fit-effort {','.join(map(str, e))}",
               dict(threads=threads, jobs=threads, effort=tuple(e))) for e in efforts]
    for label, kw in paths:
        cache = work / f"cache-cost-{len(out['paths'])}"
        r = run.convert(target=17 / 6, cache=cache, **kw)
        w = run.convert(target=2.7, cache=cache, **kw)
        sec, cpu = r["seconds"]["measure"], r["cpu_seconds"]["measure"]
        out["paths"][label] = {
            "threads": kw["threads"], "jobs": kw["jobs"], "legacy_kernels": kw.get("legacy", False),
            "device": kw.get("device", "cpu"), "fit_effort": kw.get("effort"),
            "measure_s": sec, "measure_cpu_s": cpu,
            "s_per_gb": sec / gb, "cpu_s_per_gb": cpu / gb, "load_average": r["load_average"],
            "db_2.8333": r["adaptive"]["predicted_weighted_sqnr_db"], "error_2.8333": r["adaptive"]["predicted_weighted_error"],
            "db_2.7": w["adaptive"]["predicted_weighted_sqnr_db"], "error_2.7": w["adaptive"]["predicted_weighted_error"],
            "gguf_sha256_2.8333": r["gguf_sha256"], "command": r["command"],
        }
        got = ([(c["name"], c["qtype"]) for c in r["plan"]], [(c["name"], c["qtype"]) for c in w["plan"]],
               r["gguf_sha256"], r["adaptive"]["predicted_weighted_error"], w["adaptive"]["predicted_weighted_error"])
        if "effort" in kw:
            ref = next(iter(plans.values()), None)
            out["paths"][label]["same_plans_as_default"] = ref is not None and got[:2] == ref[:2]
        else:
            plans[label] = got
        if partial is not None:  # what a run cut short still reports
            partial.write_text(json.dumps(out, indent=2, default=_jsonable) + "\n")
    out["same_plans_and_bytes"] = len({json.dumps(v) for v in plans.values()}) == 1
    p = out["paths"]
    if anchor and one_core:
        b = p["before (legacy kernels), 1 thread"]
        out["speedup"] = {k: b["s_per_gb"] / v["s_per_gb"] for k, v in p.items() if k != next(iter(p))}
        out["speedup_1_thread"] = out["speedup"]["after, 1 core"]
        out["cpu_speedup_1_thread"] = b["cpu_s_per_gb"] / p["after, 1 core"]["cpu_s_per_gb"]
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
        for d in args.device:  # the device's context and kernels load here, not in a timed run
            Runner(tiny, work / "warmup", None, None, cands).convert(target=B, cache=work / f"cache-warmup-{d}",
                                                                      device=d)
        result["warmup_seconds"] = time.perf_counter() - t0

        if not args.ds4_only:
            result["cost"] = measure_cost(run, work, facts, threads, devices=args.device, efforts=args.fit_effort,
                                          anchor=not args.skip_anchor, one_core=not args.skip_one_core,
                                          partial=out_dir / "cost-partial.json")
        if args.ds4_shape:
            from _adaptive_ds4shape import ds4_expert_cost

            result["ds4_shape"] = ds4_expert_cost(threads, devices=args.device, candidates=cands,
                                                  experts=args.ds4_shape, one_core=not args.skip_one_core,
                                                  partial=out_dir / "ds4shape-partial.json",
                                                  device_first=args.device_first,
                                                  device_anchor=args.device_anchor, device_only=args.device_only,
                                                  reads=args.ds4_reads)
        if args.cost_only:
            (out_dir / "adaptive-bench.json").write_text(json.dumps(result, indent=2, default=_jsonable) + "\n")
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

        # allocation checks per granularity: the gain at rocmfp2-strix's size, the 2.7 bpw budget
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
    ap.add_argument("--device", action="append", default=[], metavar="DEV",
                    help="also time the measure stage with --device DEV (cuda, torch-cpu); repeatable")
    ap.add_argument("--fit-effort", action="append", default=[],
                    type=lambda s: tuple(int(v) for v in s.split(",")), metavar="ITER,RESTARTS,ROWS",
                    help="also time the measure stage at this --fit-effort (a trade-off row); repeatable")
    ap.add_argument("--skip-anchor", action="store_true", help="skip the pre-change (legacy kernels) anchor")
    ap.add_argument("--skip-one-core", action="store_true", help="skip the 1-core rows (and so the anchor ratio)")
    ap.add_argument("--ds4-only", action="store_true", help="only the --ds4-shape rows (no sample conversions)")
    ap.add_argument("--device-first", action="store_true", help="--ds4-shape: time the --device rows first")
    ap.add_argument("--device-only", action="store_true",
                    help="--ds4-shape: no CPU row (compare the digests with a CPU run of the same N)")
    ap.add_argument("--device-anchor", action="store_true",
                    help="--ds4-shape: also time each --device row with every search as torch operations "
                         "(the device path before the Triton kernels)")
    ap.add_argument("--ds4-shape", type=int, default=0, metavar="N",
                    help="also time measure_matrix on N synthetic experts at DeepSeek-V4 Flash shapes")
    ap.add_argument("--ds4-reads", action="store_true",
                    help="--ds4-shape: hold the experts as FP4 codes and scales and dequantize each on the "
                         "calling thread, as the measure stage reads a checkpoint")
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
