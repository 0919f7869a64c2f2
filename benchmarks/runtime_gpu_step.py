"""One DS4 MoE decode step on a GPU: where the time goes, before/after, overlap.

    python benchmarks/runtime_gpu_step.py --before old_gemv_triton.py --out step.json   # lent GPU
    TRITON_INTERPRET=1 python benchmarks/runtime_gpu_step.py --quick --device cpu   # smoke test

Layer as in benchmarks/runtime_gpu.py (256 experts resident, top-6, hidden
4096, expert 2048, rocmfp2-strix from seeded random valid bytes). In one run:

* before: a previous ``gemv_triton.py`` (``--before``, e.g. an earlier revision's) and
  the grouped tl.dot kernels, from CUDA graphs;
* after: the decode-step kernels (``kernels/gemv_triton``), a tile sweep per
  stage, every tile's output against a float64 product on the device;
* three figures for the best tiles: the same experts every replay (the
  optimistic figure: 53.5 MB is about the 50 MB L2, so some weights come
  from L2), the headline: a new expert set (16 disjoint sets cycled) copied
  into the graph's id buffer before each timed replay, and pipelined: one
  graph of 8 decode steps over 8 disjoint sets, time / 8;
* the parts: each launch alone (rotated), an empty graph; ``run_slots`` and
  ``run_layer`` on the host; bf16 ``torch._grouped_mm`` over the same experts
  decoded, the device copy bandwidth;
* with ``--overlap``: overlapped submission on and off (``runtime/overlap.py``),
  a cold owner holding 2 of the 6 selected experts beside the CUDA owner.
Batch 64 and prefill: ``benchmarks/runtime_gpu_batch.py``.
Medians; graph replays timed with CUDA events, host calls with perf_counter.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import runtime_gpu as base  # noqa: E402

# (rows per program, 16-weight words per step, warps, pipeline stages, prefetch, computed scales) of the
# decode-step kernels; an H200 sweep led with (8, 32, 2) for gate/up, (16, 32, 2, no prefetch) for down
TILES = [(8, 32, 2, 1, True, False), (8, 32, 2, 1, True, True), (16, 32, 2, 1, False, True),
         (16, 32, 2, 1, True, True), (8, 32, 4, 1, True, True), (16, 64, 8, 1, True, True),
         (8, 64, 4, 1, True, True), (16, 32, 4, 1, False, True), (8, 16, 2, 1, True, True), (4, 64, 2, 1, True, True)]
N_ROT = 16  # expert sets the rotated replays cycle through (16 x 53.5 MB >> the 50 MB L2)
N_PIPE = 8  # decode steps in the pipelined graph


def _load_before(path):
    """The kernel module of a previous version (a copied gemv_triton.py) for before/after."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ds4q_gemv_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _graph(torch, fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def expert_sets(rng, n_exp: int, topk: int, batch: int, n_sets: int):
    """int64 (batch * topk,) expert ids of ``n_sets`` routings for rotated replays: at batch 1
    disjoint sets (consecutive slices of one permutation, sorted), so a replay finds few of its
    weights in L2; else ``topk`` distinct random experts a token."""
    if batch == 1:
        perm = rng.permutation(n_exp)
        return [np.sort(perm[np.arange(i * topk, (i + 1) * topk) % n_exp]).astype(np.int64) for i in range(n_sets)]
    return [np.stack([rng.choice(n_exp, topk, replace=False) for _ in range(batch)]).reshape(-1).astype(np.int64)
            for _ in range(n_sets)]


def layout_ref(lp, e_loc):
    """float64 (n, rows, cols) weights of the local experts e_loc from the word layout."""
    from dataclasses import replace

    from ds4quant.runtime.kernels import layout

    sub = replace(lp, a=lp.a[e_loc], a2=None if lp.a2 is None else lp.a2[e_loc], s=lp.s[e_loc])
    return layout.linear_reference(sub).double()


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=0)
    ap.add_argument("--before", default=None, help="a previous gemv_triton.py to time beside this one")
    ap.add_argument("--overlap", action="store_true", help="also measure overlapped submission on/off")
    a = ap.parse_args(argv)

    from ds4quant import formats
    from ds4quant.runtime.execute import run_layer
    from ds4quant.runtime.overlap import overlap_stats
    from ds4quant.runtime.owners.base import ExpertStack
    from ds4quant.runtime.owners.torch_owner import TorchOwner

    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    n_exp, topk, H, I = (16, 6, 256, 128) if a.quick else (256, 6, 4096, 2048)
    reps = a.reps or (3 if a.quick else 100)
    bench = base._timer(torch, dev, warm=min(5, reps))
    res = {"versions": base._versions(torch), "shape": dict(n_expert=n_exp, topk=topk, hidden=H, expert=I),
           "recipe": "rocmfp2-strix (random valid bytes)", "rows": [], "overlap": []}

    def row(name, t, B=1, **kw):
        res["rows"].append(dict(batch=B, path=name, us=t * 1e6, **kw))
        print(f"batch {B:3d}  {name:52s} {t * 1e6:10.1f} us", flush=True)

    t0 = time.perf_counter()
    stacks, owner = base.strix_layer(torch, dev, a.device, n_exp, H, I)
    res["load_s"] = round(time.perf_counter() - t0, 2)
    per_expert = sum(st.nbytes for st in stacks.values()) // n_exp
    if cuda:
        res["copy_TBps"] = base.copy_bytes_per_s(torch, dev, bench) / 1e12

    rng = np.random.default_rng(3)
    ids = rng.choice(n_exp, topk, replace=False).astype(np.int64)
    x = torch.from_numpy(rng.standard_normal((topk, H)).astype(np.float32)).to(dev)
    xn = x.cpu().numpy()
    res["bytes_b1"] = int(topk * per_expert)
    if cuda:
        res["floor_b1_us"] = res["bytes_b1"] / (res["copy_TBps"] * 1e12) * 1e6

    # ---- before: an earlier decode-step kernel (--before: a copy of its gemv_triton.py), and the
    # grouped tl.dot kernels of moe_triton (the 112 us path)
    from ds4quant.runtime.kernels import gemv_triton as gk
    from ds4quant.runtime.owners.cuda_owner import group_t

    gem = owner.gemv_set(0)
    assert gem is not None, "the decode-step kernels do not cover this layer"
    lg, lu, ld, loc = gem[0], gem[1], gem[2], gem[3]
    ids_d = torch.from_numpy(ids).to(dev)
    xT = torch.from_numpy(group_t(xn)).to(dev)
    # rotation: N_ROT disjoint expert sets (16 x 6 of 256), one input row set
    sets = [torch.from_numpy(e).to(dev) for e in expert_sets(rng, n_exp, topk, 1, N_ROT)]
    ids_buf = ids_d.clone()

    def rotate(i):  # a new expert set before each timed replay (untimed)
        ids_buf.copy_(sets[i % len(sets)])

    hT = torch.empty((topk, 16, I // 16), dtype=torch.float32, device=dev)
    yy = torch.empty((topk, H), dtype=torch.float32, device=dev)

    def step(mod, tg, td, xin=xT, ib=ids_buf, h_=hT, y_=yy):
        kg = dict(bn=tg[0], bw=tg[1], num_warps=tg[2], num_stages=tg[3])
        kd = dict(bn=td[0], bw=td[1], num_warps=td[2], num_stages=td[3])
        if mod is gk:
            kg["pre"], kd["pre"], kg["sdec"], kd["sdec"] = tg[4], td[4], tg[5], td[5]
        mod.gemv(lg, xin, ib, loc, h_, lp2=lu, limit=owner.swiglu_limit, out_t=True, **kg)
        mod.gemv(ld, h_, ib, loc, y_, **kd)
        return y_

    # float64 reference of the fixed step on the device (weights from the word layout)
    with torch.no_grad():
        e_loc = loc[ids_d]
        Wg, Wu, Wd = (layout_ref(lp, e_loc) for lp in (lg, lu, ld))
        x64 = x.double()
        gc = torch.clamp(torch.einsum("sik,sk->si", Wg, x64), max=owner.swiglu_limit)
        uc = torch.clamp(torch.einsum("sik,sk->si", Wu, x64), -owner.swiglu_limit, owner.swiglu_limit)
        ref = torch.einsum("shi,si->sh", Wd, gc / (1 + torch.exp(-gc)) * uc)
        Wg = Wu = Wd = None

    def rel(y_):
        return float((y_.double() - ref).norm() / ref.norm())

    t1 = (16, 32, 2, 1)
    before = _load_before(a.before) if a.before else None
    if before is not None:
        ids_buf.copy_(ids_d)
        res["before_vs_f64_rel"] = rel(step(before, t1, t1).clone())
        if cuda:
            g = _graph(torch, lambda: step(before, t1, t1))
            row("before: decode-step graph, same experts every replay", bench(g.replay, reps=reps))
            row("before: decode-step graph, rotated experts (headline)",
                bench(g.replay, reps=reps, before=rotate))
            ids_buf.copy_(ids_d)
    plan = owner.plan(0, ids)
    xs = x.index_select(0, plan.order).contiguous()
    h = torch.empty((topk, I), dtype=torch.float32, device=dev)
    y = torch.empty_like(xs)
    owner.tile[1] = (32, 4, 256)
    if cuda:
        g = _graph(torch, lambda: owner.launch(plan, xs, h, y))
        row("before: grouped tl.dot kernels, graph, same experts", bench(g.replay, reps=reps))

    # ---- after: the decode-step kernels, tile sweep (same experts: the sweep compares tiles)
    ids_buf.copy_(ids_d)
    res["after_vs_f64_rel"] = rel(step(gk, owner.gemv_tile["gu"], owner.gemv_tile["down"]).clone())
    print(f"after vs float64: {res['after_vs_f64_rel']:.2e}, before: {res.get('before_vs_f64_rel')}", flush=True)
    if cuda:
        best = {}
        for stage in ("gu", "down"):
            for tile in TILES:
                tg = tile if stage == "gu" else owner.gemv_tile["gu"]
                td = tile if stage == "down" else owner.gemv_tile["down"]
                try:
                    err = rel(step(gk, tg, td))
                    g = _graph(torch, lambda: step(gk, tg, td))
                    t = bench(g.replay, reps=reps)
                except Exception as exc:  # a tile that does not compile is reported, not fatal
                    res["rows"].append(dict(batch=1, path=f"after {stage} {tile}", error=repr(exc)[:300]))
                    continue
                row(f"after: sweep {stage} tile {tile}", t, tile=list(tile), stage=stage, rel_f64=err)
                if err < 1e-5 and (stage not in best or t < best[stage][0]):
                    best[stage] = (t, tile)
            owner.gemv_tile[stage] = best[stage][1]
        res["best_tile"] = {k: list(v[1]) for k, v in best.items()}
        tg, td = owner.gemv_tile["gu"], owner.gemv_tile["down"]
        g = _graph(torch, lambda: step(gk, tg, td))
        row("after: decode-step graph, same experts every replay", bench(g.replay, reps=reps))
        row("after: decode-step graph, rotated experts (headline)", bench(g.replay, reps=reps, before=rotate))
        ids_buf.copy_(ids_d)
        res["after_best_vs_f64_rel"] = rel(step(gk, tg, td).clone())
        # pipelined: one graph of N_PIPE decode steps over N_PIPE disjoint expert sets
        bufs = [(s_.clone(), torch.empty_like(hT), torch.empty_like(yy)) for s_ in sets[:N_PIPE]]

        def pipe(mod, t_g, t_d):
            for ib, h_, y_ in bufs:
                step(mod, t_g, t_d, ib=ib, h_=h_, y_=y_)

        gp = _graph(torch, lambda: pipe(gk, tg, td))
        row(f"after: {N_PIPE} decode steps in one graph, disjoint experts, per step",
            bench(gp.replay, reps=reps) / len(bufs))
        if before is not None:
            gp = _graph(torch, lambda: pipe(before, t1, t1))
            row(f"before: {N_PIPE} decode steps in one graph, disjoint experts, per step",
                bench(gp.replay, reps=reps) / len(bufs))
        # the parts (rotated)
        g1 = _graph(torch, lambda: gk.gemv(lg, xT, ids_buf, loc, hT, lp2=lu, limit=owner.swiglu_limit, out_t=True,
                                           bn=tg[0], bw=tg[1], num_warps=tg[2], num_stages=tg[3], pre=tg[4],
                                           sdec=tg[5]))
        row("part: gate+up launch alone (graph, rotated)", bench(g1.replay, reps=reps, before=rotate),
            bytes=int(topk * (stacks["gate"].nbytes + stacks["up"].nbytes) // n_exp))
        g2 = _graph(torch, lambda: gk.gemv(ld, hT, ids_buf, loc, yy, bn=td[0], bw=td[1], num_warps=td[2],
                                           num_stages=td[3], pre=td[4], sdec=td[5]))
        row("part: down launch alone (graph, rotated)", bench(g2.replay, reps=reps, before=rotate),
            bytes=int(topk * (ld.a.nbytes + ld.a2.nbytes + ld.s.nbytes) // n_exp))
        tiny = torch.zeros(1, device=dev)
        g4 = _graph(torch, lambda: tiny.add_(1))
        row("part: graph of one tiny kernel", bench(g4.replay, reps=reps))
        ids_buf.copy_(ids_d)
    row("after: run_slots (pinned staging + graph)", base.host_median(lambda: owner.run_slots(0, xn, ids, "fast"), reps))
    idx = torch.from_numpy(ids.reshape(1, topk))
    wts = torch.full((1, topk), 1.0 / topk)
    xh = x[:1].cpu()
    table = ["cuda:0"] * n_exp
    owners = {"cuda:0": owner}
    row("after: run_layer (CUDA only, combine on the host)",
        base.host_median(lambda: run_layer(0, xh, idx, wts, owners, table, "fast"), reps))

    # ---- anchor: bf16 grouped_mm at batch 1 over the same experts (302 MB of bf16: no L2 reuse)
    if cuda:
        wgu = torch.stack([torch.cat([formats.decode_torch("rocmfp2", torch.from_numpy(stacks[p].data[e]).to(dev), H)
                                      for p in ("gate", "up")]) for e in np.sort(ids)]).to(torch.bfloat16)
        wd = torch.stack([formats.decode_torch("rocmfp3", torch.from_numpy(stacks["down"].data[e]).to(dev), I)
                          for e in np.sort(ids)]).to(torch.bfloat16)
        offs = torch.arange(1, topk + 1, dtype=torch.int32, device=dev)
        xb = x[torch.from_numpy(np.argsort(ids)).to(dev)].to(torch.bfloat16)

        def gmm():
            gu = torch._grouped_mm(xb, wgu.transpose(-2, -1), offs=offs)
            hb = torch.nn.functional.silu(torch.clamp(gu[:, :I], max=10.0)) * torch.clamp(gu[:, I:], -10.0, 10.0)
            return torch._grouped_mm(hb, wd.transpose(-2, -1), offs=offs)

        try:
            gmm()
            row("anchor: bf16 grouped_mm", bench(gmm, reps=reps))
            row("anchor: bf16 grouped_mm, graph replay", bench(_graph(torch, gmm).replay, reps=reps))
        except Exception as exc:
            res["rows"].append(dict(batch=1, path="anchor: bf16 grouped_mm", error=repr(exc)[:300]))
        wgu = wd = None

    # ---- overlapped submission, on and off
    if a.overlap:
        cold_ids = tuple(sorted(int(e) for e in ids[:2]))
        colds = []
        if cuda:
            from ds4quant.runtime.owners.worker import WorkerOwner

            root = Path(__file__).resolve().parents[1]
            env = {"PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
            colds.append(("worker:1", lambda: WorkerOwner("worker:1", owner=a.device, env=env,
                                                          timeout_s=120.0)))
        colds.append(("torch-cpu:1", lambda: TorchOwner("cpu", identity="torch-cpu:1", torch_decode=True)))
        for name, make in colds:
            cold = make()
            for st in stacks.values():
                local = [st.expert_ids.index(e) for e in cold_ids]
                cold.add_stack(ExpertStack(st.tensor, 0, st.proj, st.qtype, st.rows, st.cols, cold_ids,
                                           np.ascontiguousarray(st.data[local])))
            tab = [name if e in cold_ids else "cuda:0" for e in range(n_exp)]
            own = {name: cold, "cuda:0": owner}
            n_rep = 5 if name.startswith("torch-cpu") else min(reps, 50)
            outs, per = set(), {False: [], True: []}
            with ThreadPoolExecutor(2) as pool:
                for i in range(n_rep + 2):
                    for ov in (False, True):
                        tm = []
                        t = time.perf_counter()
                        r = run_layer(0, xh, idx, wts, own, tab, "fast", pool, home="cuda:0", overlap=ov, timings=tm)
                        dt = time.perf_counter() - t
                        outs.add(r.out.numpy().tobytes() + r.slots.numpy().tobytes())
                        if i >= 2:  # warm-up calls (arena growth, graph capture) left out
                            tc = next(q for q in tm if q.owner == name)
                            th = next(q for q in tm if q.owner == "cuda:0")
                            st_ = overlap_stats(tc, th)
                            per[ov].append((dt, st_.share, st_.start_gap, tc.busy, th.busy))
            for ov, vals in per.items():
                v = np.array(vals)
                rec = dict(cold=name, overlap=ov, reps=len(vals), layer_us=float(np.median(v[:, 0])) * 1e6,
                           share=float(np.median(v[:, 1])), start_gap_us=float(np.median(v[:, 2])) * 1e6,
                           cold_busy_us=float(np.median(v[:, 3])) * 1e6, hot_busy_us=float(np.median(v[:, 4])) * 1e6,
                           identical_bytes=len(outs) == 1)
                res["overlap"].append(rec)
                print(f"overlap {str(ov):5s} cold {name:12s} layer {rec['layer_us']:9.1f} us  share "
                      f"{rec['share']:.3f}  start gap {rec['start_gap_us']:8.1f} us  identical {len(outs) == 1}",
                      flush=True)
            cold.close()

    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k not in ("rows", "overlap")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
