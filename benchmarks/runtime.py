"""Benchmark the bundled runtime's MoE layer against two anchors.

    python benchmarks/runtime.py                      # DS4 layer shapes: hidden 4096, expert 2048, 256 experts, top-6
    python benchmarks/runtime.py --quick              # tiny shapes (a smoke run of the script)
    python benchmarks/runtime.py --recipes rocmfp2-strix --owner torch-cpu:0 --json
    python benchmarks/runtime.py --load-only --experts 8 --work /tmp/rt8   # load time / peak RSS at DS4 shapes

Steps, all in one run:

1. a synthetic DS4 source of two layers (layer 0 hash-routed, layer 1 top-k;
   samples/make_synthetic.py) converted with each recipe (rocmfp2-strix,
   adaptive);
2. in a child process per artifact: ``runtime.load`` time and peak RSS
   (VmRSS after load and after one call, VmHWM peak of the child) against the
   bytes the placement makes resident (``--load-only``: only this step);
3. MoE layer latency (routed experts of layer 1, seeded routing) at batch 1
   and 64 for the owner in fast and exact mode, beside the anchors measured
   in the same process over the same experts and routing:
   - upper: numpy float32 products over weights decoded in advance (12x
     the bytes of a 2.7-bit artifact, resident as float32);
   - lower: ``formats.decode`` of every selected expert, then the products,
     on every call;
4. the worker owner (``worker:0``) per call against the same owner kind in
   process, when the build has it.

``--load-only`` converts (or reuses, with ``--work``) the artifacts and
reports only step 2, for every placement kind that changes what load reads:
one owner holding every expert (contiguous memmap slices), two owners
interleaving experts (copies of the non-contiguous ids) and a hot half plus
``none`` (a shard reads half). ``--experts`` sets the experts per layer of
the conversion path too (256 at DS4 shapes does not fit a small host).

``--direct`` skips the conversion (too slow at DS4 shapes on a small host):
the owner's stacks are built straight from ``formats.encode`` of a 64-row
seeded chunk per (expert, projection), tiled to the full per-expert shape
(DS4's 2048 x 4096 / 4096 x 2048), ``--experts`` experts in one layer
(memory: the predecoded anchor is 12x the bytes), recipes ``strix``
(rocmfp2 gate/up, rocmfp3 down) and ``mix`` (rocmfp2_mix gate/up,
rocmfp3_mix down, the MIX qtypes adaptive assigns). Times are the best of
``--repeat`` in process CPU seconds and wall seconds (CPU time is the
robust one on a shared host); pin threads with NUMBA_NUM_THREADS and
OPENBLAS_NUM_THREADS for a like-for-like comparison.

Ratios printed: fast / upper (target >= 0.5 at batch 1, >= 0.8 at 64),
fast vs lower (target >= 5x faster at batch 1), exact / fast (target <= 3).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "samples"))

FULL = dict(layers=2, experts=256, hidden=4096, moe_inter=2048, topk=6, hash_layers=1)
QUICK = dict(layers=2, experts=16, hidden=256, moe_inter=128, topk=4, hash_layers=1)
LAYER = 1  # the top-k routed layer


def _default_owner() -> str:
    return "cpu:0" if importlib.util.find_spec("ds4quant.runtime.owners.cpu") else "torch-cpu:0"


def make_artifacts(work: Path, dims: dict, recipes: list[str]) -> dict[str, Path]:
    import make_synthetic
    from ds4quant.plan import AdaptiveOptions
    from ds4quant.convert import convert

    src = work / "source"
    if not src.exists():
        make_synthetic.make_synthetic(src, make_synthetic.preset("tiny", **dims))
    out = {}
    for r in recipes:
        art = work / r
        if not art.exists():
            opts = (AdaptiveOptions(target_bpw=2.7, granularity="expert", fit_iterations=1, fit_restarts=0,
                                    fit_max_rows=64, cache_dir=str(work / "cache")) if r == "adaptive" else None)
            convert(src, art, r, adaptive=opts)
        out[r] = art
    return out


def _routing(n_expert: int, k: int, T: int, seed: int):
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.permutation(n_expert)[:k] for _ in range(T)]).astype(np.int64)
    w = rng.random((T, k)).astype(np.float32)
    return idx, w / w.sum(1, keepdims=True) * np.float32(1.5)


def _timeit(fn, repeat: int, cpu: bool = True) -> float:
    """Best of ``repeat`` after a warm-up (numba compiles, page-ins): this
    process's CPU seconds (robust on a shared host; pin NUMBA_NUM_THREADS /
    OPENBLAS_NUM_THREADS to 1 so CPU time is latency), or wall seconds."""
    fn()
    clock = time.process_time if cpu else time.perf_counter
    best = float("inf")
    for _ in range(repeat):
        t = clock()
        fn()
        best = min(best, clock() - t)
    return best


def _swiglu(g, u, L):
    gc = np.minimum(g, L)
    return gc / (1 + np.exp(-gc)) * np.clip(u, -L, L)


def _anchors(view, layer: int, x, idx, w, limit: float, repeat: int) -> dict:
    """Upper (predecoded float32) and lower (decode every call) anchors over the same routing."""
    from ds4quant import formats

    used = sorted(set(int(e) for e in idx.reshape(-1)))

    def decoded(e):
        ws = []
        for proj in ("gate", "up", "down"):
            st = next(s for s in view.stacks_for(layer, proj) if e in s.expert_ids)
            data = view.expert_data(st.name, [e])[0]
            if formats.QTYPES[st.qtype].is_mix:
                ent = view.book_entry(st.name)
                g = ent.global_ids.index(e)
                ws.append(formats.decode(st.qtype, data, st.cols, codebooks=ent.books[g], modes=int(ent.modes[g])))
            else:
                ws.append(formats.decode(st.qtype, data, st.cols))
        return ws

    pre = {e: decoded(e) for e in used}

    def run(get):
        out = np.zeros_like(x)
        for e in sorted(set(int(v) for v in idx.reshape(-1))):
            t, k = np.nonzero(idx == e)
            wg, wu, wd = get(e)
            xs = x[t]
            y = _swiglu(xs @ wg.T, xs @ wu.T, limit) @ wd.T
            np.add.at(out, t, w[t, k][:, None] * y)
        return out

    upper = _timeit(lambda: run(pre.__getitem__), repeat)
    lower = _timeit(lambda: run(decoded), max(1, repeat // 2))
    return {"upper_s": upper, "lower_s": lower,
            "upper_bytes": int(sum(a.nbytes for v in pre.values() for a in v)),
            "lower_bytes": int(sum(view.expert_nbytes()[layer][e] for e in used))
            if hasattr(view, "expert_nbytes") else None}


def bench_artifact(art: Path, owner: str, batches: list[int], repeat: int) -> dict:
    import torch
    from ds4quant import runtime

    res = {"artifact": art.name, "owner": owner}
    h = _header(art)
    plc = {L: {owner: tuple(range(h.n_expert))} for L in range(h.n_layer)}
    outs = {}
    for mode in ("fast", "exact"):
        with runtime.load(art, placement=plc, mode=mode) as rt:
            res["resident_bytes"] = int(sum(rt.resident_bytes().values()))
            for T in batches:
                idx, w = _routing(h.n_expert, h.n_expert_used, T, seed=T)
                x = np.random.default_rng(100 + T).standard_normal((T, h.hidden)).astype(np.float32)
                xt, it, wt = torch.from_numpy(x), torch.from_numpy(idx), torch.from_numpy(w)
                res[f"{mode}_b{T}_s"] = _timeit(lambda: rt.run_layer(LAYER, xt, it, wt), repeat)
                if mode == "fast" and T == 1:  # the worker's comparison is in wall time
                    res["fast_b1_wall_s"] = _timeit(lambda: rt.run_layer(LAYER, xt, it, wt), repeat, cpu=False)
                outs[(mode, T)] = rt.run_layer(LAYER, xt, it, wt).out.numpy()
                if mode == "fast":
                    res.update({f"{k}_b{T}" if k.endswith("_s") else k: v
                                for k, v in _anchors(rt.view, LAYER, x, idx, w, h.swiglu_limit, repeat).items()})
    for T in batches:  # fast mode's distance from exact, reported beside its speed
        f, e = outs[("fast", T)], outs[("exact", T)]
        res[f"fast_vs_exact_rel_b{T}"] = float(np.linalg.norm(f - e) / max(np.linalg.norm(e), 1e-30))
    if importlib.util.find_spec("ds4quant.runtime.owners.worker"):
        wplc = {L: {"worker:0": tuple(range(h.n_expert))} for L in range(h.n_layer)}
        with runtime.load(art, placement=wplc, mode="fast") as rt:
            idx, w = _routing(h.n_expert, h.n_expert_used, 1, seed=1)
            x = torch.randn((1, h.hidden))
            # wall time: the work happens in the child process
            res["worker_b1_s"] = _timeit(lambda: rt.run_layer(LAYER, x, torch.from_numpy(idx),
                                                                torch.from_numpy(w)), repeat, cpu=False)
    return res


def _header(art):
    from ds4quant.artifact.view import open_artifact

    with open_artifact(art) as view:
        return view.header


def _placements(n_layer: int, n_expert: int, owner: str) -> dict:
    other = owner.rsplit(":", 1)[0] + ":1"
    half = tuple(range(n_expert // 2))
    return {
        "one owner": {L: {owner: tuple(range(n_expert))} for L in range(n_layer)},
        "two owners interleaved": {L: {owner: tuple(range(0, n_expert, 2)), other: tuple(range(1, n_expert, 2))}
                                   for L in range(n_layer)},
        "hot half + none": {L: {owner: half, "none": tuple(range(n_expert // 2, n_expert))} for L in range(n_layer)},
    }


def _rss_kb(field: str = "VmRSS") -> int:
    """This process's resident set (VmRSS) or its peak (VmHWM), KiB, -1 where
    /proc has none. Not ru_maxrss: Linux carries that across exec, so a child
    would report its parent's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def _child_load(art: str, owner: str, which: str = "one owner") -> None:
    from ds4quant import runtime

    h = _header(art)
    plc = _placements(h.n_layer, h.n_expert, owner)[which]
    base = _rss_kb("VmHWM")
    rss0 = _rss_kb()
    t = time.perf_counter()
    with runtime.load(art, placement=plc, mode="fast") as rt:
        dt = time.perf_counter() - t
        resident = int(sum(rt.resident_bytes().values()))
        after = _rss_kb()
        # one call per owner touching every resident page of layer LAYER (the memmap pages come
        # in); numpy straight to the owners: importing torch here would count its libraries
        for o in rt.owners.values():
            ids = np.asarray(o.experts(LAYER), dtype=np.int64)
            if ids.size:
                o.run_slots(LAYER, np.zeros((ids.size, h.hidden), np.float32), ids, "fast")
        used = _rss_kb()
    peak = _rss_kb("VmHWM")
    print(json.dumps({"placement": which, "load_s": dt, "resident_bytes": resident, "rss_before_kb": base,
                      "rss_start_kb": rss0, "rss_after_load_kb": after, "rss_after_call_kb": used,
                      "peak_rss_kb": peak}))


def measure_load(art: Path, owner: str, which: str = "one owner") -> dict:
    r = subprocess.run([sys.executable, __file__, "--child-load", str(art), "--owner", owner, "--placement-kind", which],
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def _ratios(r: dict, batches: list[int]) -> dict:
    out = {}
    for T in batches:
        f, e = r[f"fast_b{T}_s"], r[f"exact_b{T}_s"]
        out[f"b{T} fast speed / upper"] = r[f"upper_s_b{T}"] / f
        out[f"b{T} fast speed / lower"] = r[f"lower_s_b{T}"] / f
        out[f"b{T} exact time / fast"] = e / f
        out[f"b{T} fast vs exact relative L2"] = r[f"fast_vs_exact_rel_b{T}"]
    if "worker_b1_s" in r:
        out["b1 worker time / in-process (wall)"] = r["worker_b1_s"] / r.get("fast_b1_wall_s", r["fast_b1_s"])
    return out


DIRECT_RECIPES = {"strix": {"gate": "rocmfp2", "up": "rocmfp2", "down": "rocmfp3"},
                  "mix": {"gate": "rocmfp2_mix", "up": "rocmfp2_mix", "down": "rocmfp3_mix"}}


def _direct_stacks(recipe: str, experts: int, hidden: int, ffn: int, layer: int = LAYER):
    """(stacks, books [(tensor, ids, entry)], decode kwargs {(proj, e): (qtype, data, cols, kw)})."""
    from ds4quant import formats
    from ds4quant.codebooks import CodebookEntry
    from ds4quant.names import Proj, stack_name
    from ds4quant.runtime.owners.base import ExpertStack

    chunk = 64
    stacks, books, dec = [], [], {}
    for proj, qt in DIRECT_RECIPES[recipe].items():
        rows, cols = (ffn, hidden) if proj != "down" else (hidden, ffn)
        datas, bks = [], []
        for e in range(experts):
            r = np.random.default_rng([e, len(proj), cols])
            w = (r.standard_normal((chunk, cols)) * 0.02).astype(np.float32)
            kw = {}
            if formats.QTYPES[qt].is_mix:
                L = formats.QTYPES[qt].codebook_levels
                while True:  # bf16 rounding can merge neighbours; books must be strictly increasing
                    b = formats.bf16_round(np.sort(r.uniform(-1, 1, (2, L)), axis=-1).astype(np.float32))
                    if np.all(np.diff(b, axis=-1) > 0):
                        break
                kw = dict(codebooks=b, mode=1)
            q = formats.encode(qt, w, **kw)
            datas.append(np.tile(q, (rows // chunk, 1)))
            bks.append(kw.get("codebooks"))
            dec[(proj, e)] = (qt, datas[-1], cols, dict(codebooks=bks[-1], modes=1) if kw else {})
        name = stack_name(layer, Proj(proj), qt)
        st = ExpertStack(name, layer, proj, qt, rows, cols, tuple(range(experts)), np.stack(datas))
        stacks.append(st)
        if bks[0] is not None:
            books.append((name, st.expert_ids, CodebookEntry(name, qt, np.ones(experts, np.uint8), np.stack(bks),
                                                             expert_ids=st.expert_ids, n_global=experts)))
    return stacks, books, dec


def _cpu_best(fn, repeat: int) -> tuple[float, float]:
    fn()
    cpu = wall = float("inf")
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        fn()
        cpu, wall = min(cpu, time.process_time() - c), min(wall, time.perf_counter() - t)
    return cpu, wall


def bench_direct(recipe: str, experts: int, hidden: int, ffn: int, topk: int, batches: list[int], repeat: int,
                 worker: bool) -> dict:
    from ds4quant import formats
    from ds4quant.runtime.owners.cpu import CpuOwner

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    stacks, books, dec = _direct_stacks(recipe, experts, hidden, ffn)
    build_s = time.perf_counter() - t0
    o = CpuOwner("cpu:0")
    t0 = time.perf_counter()
    for st in stacks:
        o.add_stack(st)
    for b in books:
        o.register_books(*b)
    res = {"artifact": f"direct-{recipe}", "owner": "cpu:0", "experts": experts, "hidden": hidden, "ffn": ffn,
           "topk": topk, "build_s": build_s, "load_s": time.perf_counter() - t0,
           "resident_bytes": int(o.resident_bytes()), "rss_before_kb": rss0,
           "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}

    def decode(e):
        return [formats.decode(dec[(p, e)][0], dec[(p, e)][1], dec[(p, e)][2], **dec[(p, e)][3])
                for p in ("gate", "up", "down")]

    for T in batches:
        r = np.random.default_rng(T)
        idx = np.stack([r.permutation(experts)[:topk] for _ in range(T)]).reshape(-1)
        xs = np.repeat(r.standard_normal((T, hidden)).astype(np.float32), topk, axis=0)
        used = sorted(set(idx.tolist()))
        outs = {}
        for mode in ("fast", "exact"):
            res[f"{mode}_b{T}_cpu_s"], res[f"{mode}_b{T}_s"] = _cpu_best(
                lambda: outs.__setitem__(mode, o.run_slots(LAYER, xs, idx, mode)), repeat)
        pre = {e: decode(e) for e in used}

        def run(get):
            out = np.zeros_like(xs)
            for e in used:
                rows = np.flatnonzero(idx == e)
                wg, wu, wd = get(e)
                out[rows] = _swiglu(xs[rows] @ wg.T, xs[rows] @ wu.T, np.float32(10.0)) @ wd.T
            return out

        res[f"upper_cpu_s_b{T}"], res[f"upper_s_b{T}"] = _cpu_best(lambda: run(pre.__getitem__), repeat)
        res["upper_bytes"] = max(res.get("upper_bytes", 0), int(sum(a.nbytes for v in pre.values() for a in v)))
        del pre
        res[f"lower_cpu_s_b{T}"], res[f"lower_s_b{T}"] = _cpu_best(lambda: run(decode), 1)
        res["lower_bytes"] = int(sum(st.data[0].nbytes for st in stacks) * experts)
        f, e = outs["fast"], outs["exact"]
        res[f"fast_vs_exact_rel_b{T}"] = float(np.linalg.norm(f - e) / max(np.linalg.norm(e), 1e-30))
    res["span_cache_bytes"] = o.span_cache_bytes()
    o.close()
    if worker and importlib.util.find_spec("ds4quant.runtime.owners.worker"):
        from ds4quant.runtime.owners.worker import measure_call_cost

        for mode in ("fast", "exact"):
            for c in measure_call_cost("cpu", stacks, LAYER, books=books, batches=batches, repeats=repeat, mode=mode):
                res[f"worker_{mode}_b{c.batch}"] = {"in_process_us": c.in_process_us, "worker_us": c.worker_us,
                                                     "overhead_us": c.overhead_us, "identical": c.identical}
    return res


def _print_direct(r: dict, batches: list[int]) -> None:
    print(f"== {r['artifact']}: {r['experts']} experts x (gate/up {r['ffn']}x{r['hidden']}, down "
          f"{r['hidden']}x{r['ffn']}), top-{r['topk']}; resident {r['resident_bytes'] / 2**20:.1f} MiB, "
          f"predecoded anchor {r['upper_bytes'] / 2**20:.1f} MiB, span cache {r['span_cache_bytes'] / 2**10:.0f} KiB")
    for T in batches:
        f, e, u, lo = (r[f"fast_b{T}_cpu_s"], r[f"exact_b{T}_cpu_s"], r[f"upper_cpu_s_b{T}"], r[f"lower_cpu_s_b{T}"])
        print(f"  batch {T:3d} (CPU ms): fast {f * 1e3:9.2f}  exact {e * 1e3:9.2f}  upper {u * 1e3:9.2f}  "
              f"lower {lo * 1e3:9.2f} | fast/upper {u / f:.2f}  fast vs lower {lo / f:.1f}x  exact/fast {e / f:.2f}"
              f"  fast-vs-exact rel L2 {r[f'fast_vs_exact_rel_b{T}']:.2e}")
        print(f"            (wall ms): fast {r[f'fast_b{T}_s'] * 1e3:9.2f}  exact {r[f'exact_b{T}_s'] * 1e3:9.2f}  "
              f"upper {r[f'upper_s_b{T}'] * 1e3:9.2f}  lower {r[f'lower_s_b{T}'] * 1e3:9.2f}")
    for k, v in r.items():
        if k.startswith("worker_"):
            print(f"  {k}: in process {v['in_process_us']:.0f} us, worker {v['worker_us']:.0f} us, "
                  f"overhead {v['overhead_us']:.0f} us, identical {v['identical']}")
    print(f"  add_stack+register {r['load_s']:.3f} s, peak RSS {r['peak_rss_kb'] / 1024:.1f} MiB "
          f"(before {r['rss_before_kb'] / 1024:.1f} MiB), resident {r['resident_bytes'] / 2**20:.1f} MiB")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run)")
    ap.add_argument("--recipes", default="rocmfp2-strix,adaptive")
    ap.add_argument("--owner", default=None, help="owner name (default cpu:0, torch-cpu:0 without the CPU owner)")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--work", default=None, help="folder for the source and artifacts (kept; default a temp dir)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child-load", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--placement-kind", default="one owner", help=argparse.SUPPRESS)
    ap.add_argument("--load-only", action="store_true", help="only load time and peak RSS (step 2), per placement kind")
    ap.add_argument("--direct", action="store_true", help="stacks from formats.encode, no conversion (see above)")
    ap.add_argument("--experts", type=int, default=None,
                    help="experts per layer (--direct: default 16; conversion: default the shape's 256 / 16)")
    ap.add_argument("--no-worker", action="store_true", help="--direct: skip the worker cost")
    a = ap.parse_args(argv)
    if a.direct:
        dims = QUICK if a.quick else FULL
        batches = [int(b) for b in a.batches.split(",")]
        recipes = [r for r in a.recipes.split(",") if r in DIRECT_RECIPES] or list(DIRECT_RECIPES)
        rep = [bench_direct(r, a.experts or 16, dims["hidden"], dims["moe_inter"], dims["topk"], batches, a.repeat,
                            not a.no_worker) for r in recipes]
        if a.json:
            print(json.dumps(rep, indent=1))
        else:
            for r in rep:
                _print_direct(r, batches)
        return 0
    owner = a.owner or _default_owner()
    if a.child_load:
        _child_load(a.child_load, owner, a.placement_kind)
        return 0
    batches = [int(b) for b in a.batches.split(",")]
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="ds4q-rt-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    dims = dict(QUICK if a.quick else FULL)
    if a.experts:
        dims["experts"] = a.experts
    t0 = time.perf_counter()
    arts = make_artifacts(work, dims, a.recipes.split(","))
    convert_s = time.perf_counter() - t0
    if a.load_only:
        rep = []
        for name, art in arts.items():
            files = sum(p.stat().st_size for p in art.glob("*.gguf"))
            for which in _placements(2, 2, owner):
                r = measure_load(art, owner, which)
                r.update(artifact=name, gguf_bytes=files, convert_s=convert_s, dims=dims)
                rep.append(r)
        if a.json:
            print(json.dumps(rep, indent=1))
            return 0
        print(f"load-only: {dims['experts']} experts/layer, hidden {dims['hidden']}, expert ffn {dims['moe_inter']}, "
              f"{dims['layers']} layers (conversion {convert_s:.0f} s)")
        for r in rep:
            M = 2 ** 20
            print(f"  {r['artifact']:14s} {r['placement']:24s} load {r['load_s']:6.2f} s  resident "
                  f"{r['resident_bytes'] / M:8.1f} MiB  RSS start {r['rss_start_kb'] / 1024:7.1f}  after load "
                  f"{r['rss_after_load_kb'] / 1024:7.1f}  after a call {r['rss_after_call_kb'] / 1024:7.1f}  peak "
                  f"{r['peak_rss_kb'] / 1024:7.1f} MiB  (peak - start {(r['peak_rss_kb'] - r['rss_start_kb']) / 1024:7.1f}"
                  f" MiB; GGUF {r['gguf_bytes'] / M:.1f} MiB)")
        return 0
    report = []
    for name, art in arts.items():
        r = bench_artifact(art, owner, batches, a.repeat)
        r.update(measure_load(art, owner))
        r["convert_s"] = convert_s
        r["ratios"] = _ratios(r, batches)
        report.append(r)
    if a.json:
        print(json.dumps(report, indent=1))
        return 0
    for r in report:
        print(f"== {r['artifact']} on {r['owner']}: resident {r['resident_bytes'] / 2**20:.1f} MiB "
              f"(predecoded anchor {r['upper_bytes'] / 2**20:.1f} MiB for the experts used)")
        for T in batches:
            print(f"  batch {T:3d} (CPU): fast {r[f'fast_b{T}_s'] * 1e3:9.2f} ms  exact {r[f'exact_b{T}_s'] * 1e3:9.2f} ms"
                  f"  upper {r[f'upper_s_b{T}'] * 1e3:9.2f} ms  lower {r[f'lower_s_b{T}'] * 1e3:9.2f} ms")
        if "worker_b1_s" in r:
            print(f"  worker batch 1: {r['worker_b1_s'] * 1e3:.2f} ms (wall)")
        print(f"  load {r['load_s']:.2f} s, peak RSS {r['peak_rss_kb'] / 1024:.1f} MiB "
              f"(before load {r['rss_before_kb'] / 1024:.1f} MiB), resident {r['resident_bytes'] / 2**20:.1f} MiB")
        for k, v in r["ratios"].items():
            print(f"  {k}: {v:.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
