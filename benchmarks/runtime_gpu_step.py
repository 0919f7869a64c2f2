"""One DS4 MoE decode step on a GPU: where the time goes, before/after, overlap.

    python benchmarks/runtime_gpu_step.py --out step.json          # lent GPU, DS4 sizes
    TRITON_INTERPRET=1 python benchmarks/runtime_gpu_step.py --quick --device cpu   # smoke test

Layer as in benchmarks/runtime_gpu.py (256 experts resident, top-6, hidden
4096, expert 2048, rocmfp2-strix from seeded random valid bytes). In one run:

* before: the grouped kernels (``CudaOwner.plan`` + ``launch``, the 112 us
  path of runtime_gpu_h200_run1) replayed from a CUDA graph, and
  ``run_slots`` through host planning;
* after: the decode-step kernels (``kernels/gemv_triton``) replayed from a
  graph, a tile sweep per stage, and ``run_slots`` (pinned staging + graph);
* the profile by parts: each launch alone, the input transpose + expert
  lookup, an empty graph, host planning, the combine, ``run_layer`` whole;
* anchors in the same run: bf16 ``torch._grouped_mm`` over the same experts
  decoded, the device copy bandwidth; batch 64 (grouped kernels vs bf16);
* overlapped submission on and off (``runtime/overlap.py``), a cold owner
  holding 2 of the 6 selected experts beside the CUDA owner: a worker
  process hosting a CudaOwner, and the torch-cpu owner. Per mode: layer
  latency, overlap share (both busy / the slower owner's busy time), start
  gap, and whether every output has the same bytes.
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

# (rows per program, 16-weight words per step, warps) of the decode-step kernels
# (run 1 on the H200 swept (32|64|16, 16|32|64 words, 2|4|8 warps) at 3 stages: 16x32x2 and
# 32x32x4 led, within 1 us of each other)
TILES = [(16, 32, 2, 3), (32, 32, 4, 3), (16, 32, 2, 1), (64, 16, 2, 3), (16, 64, 2, 3), (32, 16, 2, 3)]


def _host_median(fn, reps, warm=3):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


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


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=0)
    ap.add_argument("--no-b64", action="store_true")
    ap.add_argument("--no-overlap", action="store_true")
    a = ap.parse_args(argv)

    from ds4quant import formats
    from ds4quant.runtime.execute import combine, run_layer
    from ds4quant.runtime.overlap import overlap_stats
    from ds4quant.runtime.owners.base import ExpertStack
    from ds4quant.runtime.owners.cuda_owner import CudaOwner
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

    gen = torch.Generator(device=dev).manual_seed(7)
    t0 = time.perf_counter()
    spec = (("gate", "rocmfp2", I, H), ("up", "rocmfp2", I, H), ("down", "rocmfp3", H, I))
    stacks = {p: ExpertStack(f"blk.0.ffn_{p}_exps.weight", 0, p, q, r, c, tuple(range(n_exp)),
                             base._random_stack(torch, q, n_exp, r, c, gen, dev)) for p, q, r, c in spec}
    owner = CudaOwner(a.device, identity="cuda:0" if cuda else "torch-cpu:5")
    for st in stacks.values():
        owner.add_stack(st)
    res["load_s"] = round(time.perf_counter() - t0, 2)
    per_expert = sum(st.nbytes for st in stacks.values()) // n_exp
    if cuda:
        big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(big)
        res["copy_TBps"] = 2 * big.numel() / bench(lambda: dst.copy_(big), reps=20) / 1e12
        del big, dst

    rng = np.random.default_rng(3)
    ids = rng.choice(n_exp, topk, replace=False).astype(np.int64)
    x = torch.from_numpy(rng.standard_normal((topk, H)).astype(np.float32)).to(dev)
    xn = x.cpu().numpy()
    res["bytes_b1"] = int(topk * per_expert)
    if cuda:
        res["floor_b1_us"] = res["bytes_b1"] / (res["copy_TBps"] * 1e12) * 1e6

    # ---- before: grouped kernels, host plan
    plan = owner.plan(0, ids)
    xs = x.index_select(0, plan.order).contiguous()
    h = torch.empty((topk, I), dtype=torch.float32, device=dev)
    y = torch.empty_like(xs)
    owner.tile[1] = (32, 4, 256)
    owner.launch(plan, xs, h, y)
    y_before = y.index_select(0, torch.argsort(plan.order)).clone()
    if cuda:
        g = _graph(torch, lambda: owner.launch(plan, xs, h, y))
        row("before: grouped kernels, graph replay", bench(g.replay, reps=reps))
    row("before: host plan() alone", _host_median(lambda: owner.plan(0, ids), reps))
    old = CudaOwner(a.device, identity="cuda:7" if cuda else "torch-cpu:7", gemv_max_slots=0)
    for st in stacks.values():
        old.add_stack(st)
    old.tile[1] = (32, 4, 256)
    row("before: run_slots (plan + launches + copies)", _host_median(lambda: old.run_slots(0, xn, ids, "fast"), reps))
    old.close()

    # ---- after: decode-step kernels
    gem = owner.gemv_set(0)
    assert gem is not None, "the decode-step kernels do not cover this layer"
    from ds4quant.runtime.owners.cuda_owner import group_t

    ids_d = torch.from_numpy(ids).to(dev)
    xT = torch.from_numpy(group_t(xn)).to(dev)
    y_after = owner.gemv_device(0, xT, ids_d)
    rel = float((y_after - y_before).norm() / y_before.norm())
    res["after_vs_before_rel"] = rel
    print(f"after vs before: relative difference {rel:.2e}", flush=True)
    if cuda:
        best = {}
        for stage in ("gu", "down"):
            for tile in TILES:
                owner.gemv_tile[stage] = tile
                try:
                    owner.gemv_device(0, xT, ids_d)
                    g = _graph(torch, lambda: owner.gemv_device(0, xT, ids_d))
                    t = bench(g.replay, reps=reps)
                except Exception as exc:  # a tile that does not compile is reported, not fatal
                    res["rows"].append(dict(batch=1, path=f"after {stage} {tile}", error=repr(exc)[:300]))
                    continue
                row(f"after: decode-step graph, {stage} tile {tile}", t, tile=list(tile), stage=stage)
                if stage not in best or t < best[stage][0]:
                    best[stage] = (t, tile)
            owner.gemv_tile[stage] = best[stage][1]
        res["best_tile"] = {k: list(v[1]) for k, v in best.items()}
        g = _graph(torch, lambda: owner.gemv_device(0, xT, ids_d))
        row("after: decode-step graph replay (best tiles)", bench(g.replay, reps=reps))
        # the parts
        from ds4quant.runtime.kernels import gemv_triton as gk

        lg, lu, ld, loc = gem[0], gem[1], gem[2], gem[3]
        hT = torch.empty((topk, 16, I // 16), dtype=torch.float32, device=dev)
        yy = torch.empty((topk, H), dtype=torch.float32, device=dev)
        bn, bw, nw, ns = owner.gemv_tile["gu"]
        g1 = _graph(torch, lambda: gk.gemv(lg, xT, ids_d, loc, hT, lp2=lu, limit=10.0, out_t=True, bn=bn, bw=bw,
                                           num_warps=nw, num_stages=ns))
        row("part: gate+up launch alone (graph)", bench(g1.replay, reps=reps),
            bytes=int(topk * (stacks["gate"].nbytes + stacks["up"].nbytes) // n_exp))
        bn2, bw2, nw2, ns2 = owner.gemv_tile["down"]
        g2 = _graph(torch, lambda: gk.gemv(ld, hT, ids_d, loc, yy, bn=bn2, bw=bw2, num_warps=nw2, num_stages=ns2))
        row("part: down launch alone (graph)", bench(g2.replay, reps=reps),
            bytes=int(topk * (ld.a.nbytes + ld.a2.nbytes + ld.s.nbytes) // n_exp))
        tiny = torch.zeros(1, device=dev)
        g4 = _graph(torch, lambda: tiny.add_(1))
        row("part: graph of one tiny kernel", bench(g4.replay, reps=reps))
    row("after: run_slots (pinned staging + graph)", _host_median(lambda: owner.run_slots(0, xn, ids, "fast"), reps))
    idx = torch.from_numpy(ids.reshape(1, topk))
    wts = torch.full((1, topk), 1.0 / topk)
    xh = x[:1].cpu()
    table = ["cuda:0"] * n_exp
    owners = {"cuda:0": owner}
    row("after: run_layer (CUDA only, combine on the host)",
        _host_median(lambda: run_layer(0, xh, idx, wts, owners, table, "fast"), reps))
    slots = torch.zeros((1, topk, H))
    row("part: combine alone (host)", _host_median(lambda: combine(wts, slots), reps))

    # ---- anchors: bf16 grouped_mm (batch 1 and 64), batch-64 grouped kernels
    for B in ((1,) if a.no_b64 or a.quick else (1, 64)):
        bids = ids if B == 1 else np.stack([rng.choice(n_exp, topk, replace=False) for _ in range(B)]).reshape(-1)
        xb32 = x if B == 1 else torch.from_numpy(rng.standard_normal((bids.shape[0], H)).astype(np.float32)).to(dev)
        order = np.argsort(bids, kind="stable")
        uniq, counts = np.unique(bids[order], return_counts=True)
        if cuda:
            wgu = torch.stack([torch.cat([formats.decode_torch("rocmfp2", torch.from_numpy(stacks[p].data[e]).to(dev),
                                                               H) for p in ("gate", "up")]) for e in uniq])
            wgu = wgu.to(torch.bfloat16)
            wd = torch.stack([formats.decode_torch("rocmfp3", torch.from_numpy(stacks["down"].data[e]).to(dev), I)
                              for e in uniq]).to(torch.bfloat16)
            offs = torch.from_numpy(np.cumsum(counts).astype(np.int32)).to(dev)
            xb = xb32[torch.from_numpy(order).to(dev)].to(torch.bfloat16)

            def gmm():
                gu = torch._grouped_mm(xb, wgu.transpose(-2, -1), offs=offs)
                hb = torch.nn.functional.silu(torch.clamp(gu[:, :I], max=10.0)) * torch.clamp(gu[:, I:], -10.0, 10.0)
                return torch._grouped_mm(hb, wd.transpose(-2, -1), offs=offs)

            try:
                gmm()
                row("anchor: bf16 grouped_mm", bench(gmm, reps=reps), B=B)
                row("anchor: bf16 grouped_mm, graph replay", bench(_graph(torch, gmm).replay, reps=reps), B=B)
            except Exception as exc:
                res["rows"].append(dict(batch=B, path="anchor: bf16 grouped_mm", error=repr(exc)[:300]))
            wgu = wd = None
        if B == 64 and cuda:
            owner.tile[16] = (64, 4, 32)
            p64 = owner.plan(0, bids)
            x64 = xb32.index_select(0, p64.order).contiguous()
            h64 = torch.empty((bids.shape[0], I), dtype=torch.float32, device=dev)
            y64 = torch.empty_like(x64)
            owner.launch(p64, x64, h64, y64)
            row("grouped kernels (tl.dot), graph replay (unchanged)",
                bench(_graph(torch, lambda: owner.launch(p64, x64, h64, y64)).replay, reps=20), B=64)

    # ---- overlapped submission, on and off
    if not a.no_overlap:
        cold_ids = tuple(sorted(int(e) for e in ids[:2]))
        colds = []
        if cuda:
            from ds4quant.runtime.owners.worker import WorkerOwner

            root = Path(__file__).resolve().parents[1]
            env = {"PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
            colds.append(("worker:1", lambda: WorkerOwner("worker:1", owner="cuda", device=a.device, env=env,
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
