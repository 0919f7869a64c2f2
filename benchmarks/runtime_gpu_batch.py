"""One DS4 MoE layer on a GPU at batch 64 and a 2048-token prefill: the CUDA
owner's kernels beside bf16 ``torch._grouped_mm``, in one run.

    python benchmarks/runtime_gpu_batch.py --out batch.json      # lent GPU, DS4 sizes

Layer as in benchmarks/runtime_gpu.py (256 experts, top-6 distinct per
token, hidden 4096, expert 2048, rocmfp2-strix from seeded random valid
bytes). Per batch, CUDA-graph replays of the device work (the host plan is
timed apart):

* grouped gemv (``kernels/gemv_triton``, grouped form): slots sorted by
  expert, one program decodes an expert's row block once for up to ``tb``
  of its tokens; a tile / tb sweep;
* the tl.dot kernels (``kernels/moe_triton``, the path before this change);
* bf16 ``torch._grouped_mm`` over the same experts decoded (gate|up as one
  matrix), SwiGLU, down;
* ``CudaOwner.run_slots`` end to end (host plan, pinned copies, launches).
Latency, TFLOP/s (2 x tokens x 6 x 3 x 4096 x 2048), bytes of the distinct
experts over the measured copy rate, and each kernel's output against the
tl.dot kernels' (relative norm).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import runtime_gpu as base  # noqa: E402
from runtime_gpu_step import _graph  # noqa: E402

# (rows per program, words per step, warps, stages, prefetch, computed scales), same for gate/up and
# down (run 1: tb 2 at (8, 32, 2) led at batch 64, tb 4 at (32, 8, 1) at 2048 tokens)
TILES = [(8, 32, 2, 1, True, True), (8, 32, 2, 1, True, False), (16, 32, 2, 1, False, True), (32, 8, 1, 1, True, True)]


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", default="64,2048")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test)")
    a = ap.parse_args(argv)

    from ds4quant import formats
    from ds4quant.runtime.kernels import gemv_triton as gk
    from ds4quant.runtime.owners.cuda_owner import group_t

    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    n_exp, topk, H, I = (16, 6, 256, 128) if a.quick else (256, 6, 4096, 2048)
    reps = a.reps
    bench = base._timer(torch, dev, warm=3)
    res = {"versions": base._versions(torch), "shape": dict(n_expert=n_exp, topk=topk, hidden=H, expert=I),
           "recipe": "rocmfp2-strix (random valid bytes)", "rows": []}
    stacks, owner = base.strix_layer(torch, dev, a.device, n_exp, H, I)
    per_expert = sum(st.nbytes for st in stacks.values()) // n_exp
    copy_bps = 0.0
    if cuda:
        copy_bps = base.copy_bytes_per_s(torch, dev, bench)
        res["copy_TBps"] = copy_bps / 1e12
    # every expert decoded to bf16 once (the anchor's weights)
    wgu_all = wd_all = None
    if cuda:
        t0 = time.perf_counter()
        wgu_all = torch.stack([torch.cat([formats.decode_torch("rocmfp2", torch.from_numpy(stacks[p].data[e]).to(dev),
                                                               H).to(torch.bfloat16) for p in ("gate", "up")])
                               for e in range(n_exp)])
        wd_all = torch.stack([formats.decode_torch("rocmfp3", torch.from_numpy(stacks["down"].data[e]).to(dev),
                                                   I).to(torch.bfloat16) for e in range(n_exp)])
        res["bf16_decode_s"] = round(time.perf_counter() - t0, 2)
    gem = owner.gemv_set(0)
    lg, lu, ld, loc, loc_h = gem
    rng = np.random.default_rng(11)
    for B in (int(b) for b in a.batches.split(",")):
        ids = np.stack([rng.choice(n_exp, topk, replace=False) for _ in range(B)]).reshape(-1)
        n = ids.shape[0]
        x = torch.from_numpy(rng.standard_normal((n, H)).astype(np.float32)).to(dev)
        xn = x.cpu().numpy()
        uniq, counts = np.unique(ids, return_counts=True)
        nbytes = int(len(uniq) * per_expert)
        flop = 2.0 * n * 3 * H * I
        res[f"batch_{B}"] = dict(slots=n, distinct=len(uniq), mean_tokens=float(counts.mean()),
                                 max_tokens=int(counts.max()), bytes=nbytes)

        def row(name, t, **kw):
            r = dict(batch=B, path=name, us=t * 1e6, tflops=flop / max(t, 1e-12) / 1e12, **kw)
            if copy_bps:
                r["floor_us"] = nbytes / copy_bps * 1e6
            res["rows"].append(r)
            print(f"batch {B:5d}  {name:58s} {t * 1e6:11.1f} us {r['tflops']:7.2f} TFLOP/s", flush=True)

        # before: the tl.dot kernels
        bt = 16 if B <= 64 else 64
        owner.bt = bt
        owner.tile[bt] = (64, 4, 32)
        plan = owner.plan(0, ids)
        xs = x.index_select(0, plan.order).contiguous()
        h = torch.empty((n, I), dtype=torch.float32, device=dev)
        y = torch.empty_like(xs)
        owner.launch(plan, xs, h, y)
        y_dot = y.clone()
        if cuda:
            row(f"tl.dot kernels (bt {bt}, 64x32), graph", bench(_graph(torch, lambda: owner.launch(plan, xs, h, y)).replay,
                                                             reps=reps))
        # grouped gemv: plan once (timed), sweep tb x tiles
        best = None
        for tb in ((2,) if B <= 64 else (4,)):
            order, groups = gk.groups_for(ids, loc_h, tb)
            assert np.array_equal(order, plan.order.cpu().numpy())  # the same sort (stable, by expert)
            gd = torch.from_numpy(groups).to(dev)
            xT = torch.from_numpy(group_t(xn[order])).to(dev)
            owner.group_tb = tb
            for tile in (TILES if cuda else TILES[:1]):
                owner.group_tile = {"gu": tile, "down": tile}
                try:
                    yg = owner.grouped_device(0, xT, gd)
                    err = float((yg - y_dot).norm() / y_dot.norm())
                    t = bench(_graph(torch, lambda: owner.grouped_device(0, xT, gd)).replay, reps=reps) if cuda else 0.0
                except Exception as exc:  # a tile that does not compile is reported, not fatal
                    res["rows"].append(dict(batch=B, path=f"grouped gemv tb {tb} {tile}", error=repr(exc)[:300]))
                    continue
                row(f"grouped gemv tb {tb} tile {tile}, graph", t, tb=tb, tile=list(tile), groups=len(groups),
                    rel_vs_tl_dot=err)
                if best is None or t < best[0]:
                    best = (t, tb, tile)
        res[f"batch_{B}"]["best"] = dict(us=best[0] * 1e6, tb=best[1], tile=list(best[2]))
        row("host plan: groups_for (numpy)", base.host_median(lambda: gk.groups_for(ids, loc_h, best[1]), reps))
        # anchor: bf16 grouped_mm over the same experts
        if cuda:
            sel = torch.from_numpy(uniq).to(dev)
            wgu, wd = wgu_all.index_select(0, sel), wd_all.index_select(0, sel)
            offs = torch.from_numpy(np.cumsum(counts).astype(np.int32)).to(dev)
            xb = xs.to(torch.bfloat16)

            def gmm():
                gu = torch._grouped_mm(xb, wgu.transpose(-2, -1), offs=offs)
                hb = torch.nn.functional.silu(torch.clamp(gu[:, :I], max=10.0)) * torch.clamp(gu[:, I:], -10.0, 10.0)
                return torch._grouped_mm(hb, wd.transpose(-2, -1), offs=offs)

            try:
                yb = gmm()
                row("anchor: bf16 grouped_mm", bench(gmm, reps=reps),
                    rel_vs_tl_dot=float((yb.float() - y_dot).norm() / y_dot.norm()))
                row("anchor: bf16 grouped_mm, graph", bench(_graph(torch, gmm).replay, reps=reps))
            except Exception as exc:  # _grouped_mm is private: report, do not fail the run
                res["rows"].append(dict(batch=B, path="anchor: bf16 grouped_mm", error=repr(exc)[:300]))
            wgu = wd = gmm = None
        # end to end through the owner (host plan + copies + the best path)
        owner.group_tb, owner.group_tile = best[1], {"gu": best[2], "down": best[2]}
        if cuda:
            row("CudaOwner.run_slots (host plan + copies + kernels)",
                base.host_median(lambda: owner.run_slots(0, xn, ids, "fast"), max(3, reps // 4)),
                path_taken="grouped" if owner.grouped_plan(0, ids) is not None else "tl.dot")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
