"""One DS4 MoE layer on a GPU, ONE table: every path beside its anchors, per
recipe and batch, measured in one run.

    python benchmarks/runtime_gpu_table.py --out table.json              # lent GPU, DS4 sizes
    TRITON_INTERPRET=1 python benchmarks/runtime_gpu_table.py --quick --device cpu   # smoke test

Layer: 256 experts (all resident), top-6, hidden 4096, expert 2048, from
seeded random valid bytes (timing only). Recipes: rocmfp2-strix (rocmfp2
gate/up, rocmfp3 down), an adaptive MIX plan (rocmfp2_mix gate/up with
registered books, rocmfp3_mix down), rocmfp4, mxfp4. Batches: 1, 64, 512,
2048 tokens (x 6 slots; distinct random experts per token).

Rows per (recipe, batch):

* ``fast kernel``: the device work of the path ``CudaOwner.run_slots`` takes
  for that call (decode-step graph / grouped matrix-vector / tensor-core
  prefill / the float32 tl.dot kernels), graphed where the path is graphable;
* ``fast run_slots``: the owner end to end (host staging, copies, kernels);
* ``fast run_slots_device``: the owner end to end on rows already on the
  device (``run_slots_device``: what a layer on the GPU hands it);
* ``exact kernel`` / ``exact run_slots``: exact mode the same way (per-slot
  kernels at decode sizes, the grouped kernels of ``exact_grouped`` at prefill
  sizes; the definition's path where no kernel applies);
* ``bf16 grouped_mm``: ``torch._grouped_mm`` over the same experts decoded
  to bf16, graphed;
* ``dense bf16``: one bf16 GEMV/GEMM per selected expert and projection
  (torch.mm), the loop captured in a CUDA graph: the honest dense anchor;
* ``ours fast whole layer``: ``runtime/device_layer.py``: routing, the routed
  experts, the canonical combine and a float32 shared expert on the device,
  from one CUDA graph (what a decode step of the layer costs);
* ``copy``: a 1 GiB device-to-device copy (bytes read + written per second).

Figures: latency (us), TB/s (the selected experts' weight bytes — quantized
for ours, bf16 for the anchors — per second), TFLOP/s (2 * slots * 3 * H * I
per second), and the bytes-over-copy-rate floor. Medians; graph replays
timed with CUDA events, host calls by the host clock. ``--budget`` seconds
stops starting new (recipe, batch) cells when spent (the table says which
were skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

RECIPES = {  # name -> (gate/up qtype, down qtype)
    "rocmfp2-strix": ("rocmfp2", "rocmfp3"),
    "adaptive-mix": ("rocmfp2_mix", "rocmfp3_mix"),
    "rocmfp4": ("rocmfp4", "rocmfp4"),
    "mxfp4": ("mxfp4", "mxfp4"),
}


def _scale_span(qtype: str):
    """(first scale byte in a block, count, low, high) of valid random scale bytes."""
    from ds4quant import formats

    bb = formats.QTYPES[qtype].block_bytes
    if qtype == "mxfp4":
        return 0, 1, 118, 127  # E8M0 2^-9 .. 1
    n = 1 if qtype in ("rocmfp4_fast", "rocmfp8") else 2
    return bb - n, n, 0x18, 0x38  # UE4M3 2^-8 .. 0.5 (MIX: book bit 7 random below)


def random_stack(torch, qtype: str, n: int, rows: int, cols: int, gen):
    """uint8 (n, rows, row_bytes) numpy: uniform codes, scale bytes in a sane range."""
    from ds4quant import formats

    qt = formats.QTYPES[qtype]
    nb = cols // 32
    dev = gen.device
    data = torch.randint(0, 256, (n, rows, nb, qt.block_bytes), generator=gen, dtype=torch.uint8, device=dev)
    first, cnt, lo, hi = _scale_span(qtype)
    sc = torch.randint(lo, hi + 1, (n, rows, nb, cnt), generator=gen, dtype=torch.uint8, device=dev)
    if qt.is_mix:
        sc |= (torch.randint(0, 2, sc.shape, generator=gen, dtype=torch.uint8, device=dev) << 7)
    data[..., first:first + cnt] = sc
    return data.reshape(n, rows, nb * qt.block_bytes).cpu().numpy()


def strictly_increasing_books(rng, n: int, L: int):
    """float32 (n, 2, L) bf16 books, each strictly increasing (redrawn until rounding keeps them so)."""
    from ds4quant import formats

    out = np.empty((n, 2, L), np.float32)
    for e in range(n):
        while True:
            b = formats.bf16_round(np.sort(rng.uniform(-1, 1, (2, L)), axis=-1).astype(np.float32))
            if np.all(np.diff(b, axis=-1) > 0):
                out[e] = b
                break
    return out


def make_layer(torch, dev, device: str, recipe: str, n_exp: int, H: int, I: int):
    """(stacks, owner, entries) of a recipe's layer resident on a CudaOwner."""
    from ds4quant import formats
    from ds4quant.codebooks import CodebookEntry
    from ds4quant.runtime.owners.base import ExpertStack
    from ds4quant.runtime.owners.cuda_owner import CudaOwner

    gen = torch.Generator(device=dev).manual_seed(11)
    qgu, qd = RECIPES[recipe]
    stacks, entries = {}, {}
    for p, q, r, c in (("gate", qgu, I, H), ("up", qgu, I, H), ("down", qd, H, I)):
        name = f"blk.0.ffn_{p}_exps.weight"
        stacks[p] = ExpertStack(name, 0, p, q, r, c, tuple(range(n_exp)), random_stack(torch, q, n_exp, r, c, gen))
        if formats.QTYPES[q].is_mix:
            L = formats.QTYPES[q].codebook_levels
            rng = np.random.default_rng(5)
            books = strictly_increasing_books(rng, n_exp, L)
            entries[name] = CodebookEntry(name, q, np.ones(n_exp, np.uint8), books)
    owner = CudaOwner(device, identity="cuda:0" if dev.type == "cuda" else "torch-cpu:5")
    for st in stacks.values():
        owner.add_stack(st)
    for t, ent in entries.items():
        owner.register_books(t, tuple(range(n_exp)), ent)
    return stacks, owner, entries


def fast_kernel(torch, owner, x, ids):
    """(label, callable) of the device work the fast run_slots takes for this call."""
    from ds4quant.runtime.owners.cuda_owner import group_t

    n = ids.shape[0]
    dev = x.device
    xn = x.cpu().numpy()
    di = torch.from_numpy(ids).to(dev)
    if 0 < n <= owner.gemv_max_slots and owner.gemv_set(0) is not None:
        xT = torch.from_numpy(group_t(xn)).to(dev)
        return "decode-step gemv", lambda: owner.gemv_device(0, xT, di)
    gp = owner.grouped_plan(0, ids)
    if gp is not None:
        order, groups = gp
        xT = torch.from_numpy(group_t(xn[order])).to(dev)
        dg = torch.from_numpy(groups).to(dev)
        return "grouped gemv", lambda: owner.grouped_device(0, xT, dg)
    if owner.prefill_wanted(0, ids) and owner.prefill_set(0) is not None:  # the owner's rule
        return "tensor-core prefill", lambda: owner.prefill_device(0, x, di)
    plan = owner.plan(0, ids)
    xs = x.index_select(0, plan.order).contiguous()
    h = torch.empty((n, owner.single_stacks(0)[0]["stack"].rows), dtype=torch.float32, device=dev)
    y = torch.empty_like(xs)
    from ds4quant.runtime.kernels.moe_triton import MV_TOKENS

    label = "float32 tl.dot" if plan.bt > MV_TOKENS else f"matrix-vector, {plan.bt} slots a group"
    return label, lambda: owner.launch(plan, xs, h, y)


def decoded_bf16(torch, stacks, uniq, dev, entries):
    """bf16 weights of the selected experts: {proj: (len(uniq), rows, cols)}."""
    from ds4quant import formats

    out = {}
    for p, st in stacks.items():
        ws = []
        for e in uniq:
            raw = torch.from_numpy(st.data[int(e)]).to(dev)
            kw = {}
            if st.tensor in entries:
                ent = entries[st.tensor]
                kw = dict(codebooks=ent.books[int(e)], modes=int(ent.modes[int(e)]))
            ws.append(formats.decode_torch(st.qtype, raw, st.cols, **kw).to(torch.bfloat16))
        out[p] = torch.stack(ws)
    return out


def grouped_mm_anchor(torch, stacks, entries, ids, x, I: int):
    """(bf16 weights of the selected experts, x sorted by expert in bf16, the bf16
    ``torch._grouped_mm`` layer over them: gate + up, SwiGLU, down)."""
    uniq, counts = np.unique(ids, return_counts=True)
    dev = x.device
    W = decoded_bf16(torch, stacks, uniq, dev, entries)
    order = np.argsort(ids, kind="stable")
    xb = x[torch.from_numpy(order).to(dev)].to(torch.bfloat16)
    offs = torch.from_numpy(np.cumsum(counts).astype(np.int32)).to(dev)
    wgu = torch.cat([W["gate"], W["up"]], dim=1)

    def gmm():
        gu = torch._grouped_mm(xb, wgu.transpose(-2, -1), offs=offs)
        hb = torch.nn.functional.silu(torch.clamp(gu[:, :I], max=10.0)) * torch.clamp(gu[:, I:], -10.0, 10.0)
        return torch._grouped_mm(hb, W["down"].transpose(-2, -1), offs=offs)

    return W, xb, gmm


def main(argv=None) -> int:
    import torch

    import runtime_gpu as base
    from runtime_gpu_step import _graph

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", default=None)
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--batches", default=None, help="tokens per call; default 1,64,512,2048 (--quick: 1,8)")
    ap.add_argument("--reps", type=int, default=0, help="timed repetitions (default 30, --quick 2)")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; later cells are skipped")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        sys.path.insert(0, str(ROOT))
        from tests.runtime._interp import patch_interpreter

        patch_interpreter()
    t_start = time.perf_counter()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    n_exp, topk, H, I = (8, 6, 128, 64) if a.quick else (256, 6, 4096, 2048)
    reps = a.reps or (2 if a.quick else 30)
    batches = [int(b) for b in (a.batches or ("1,8" if a.quick else "1,64,512,2048")).split(",")]
    bench = base._timer(torch, dev, warm=min(3, reps))
    res = {"versions": base._versions(torch), "shape": dict(n_expert=n_exp, topk=topk, hidden=H, expert=I),
           "rows": [], "skipped": []}
    copy_bps = base.copy_bytes_per_s(torch, dev, bench) if cuda else 0.0
    res["copy_TBps"] = copy_bps / 1e12
    rng = np.random.default_rng(3)

    for recipe in a.recipes.split(","):
        stacks, owner, entries = make_layer(torch, dev, a.device, recipe, n_exp, H, I)
        if not cuda:  # the interpreter's cost is per program: whole-matrix blocks
            owner.prefill_tile = {"gu": (max(H, I), 64, 4, 1, False), "down": (max(H, I), 64, 4, 1, False)}
            owner.prefill_tile_linear = owner.prefill_tile
            owner.exact_planes_tile = (max(H, I), 128, 4)
            owner.exact_grouped_tile = (max(H, I), 4, 1)
            big = {"gu": (I, 8, 1, 1, True, True), "down": (H, 4, 1, 1, True, True)}
            owner.gemv_tile, owner.group_tile = dict(big), dict(big)
            owner.exact_tile = {k: (v[0], v[1], 1, True) for k, v in big.items()}
        per_expert = sum(st.nbytes for st in stacks.values()) // n_exp
        for B in batches:
            if time.perf_counter() - t_start > a.budget:
                res["skipped"].append(dict(recipe=recipe, batch=B, why="time budget spent"))
                continue
            ids = np.stack([rng.choice(n_exp, topk, replace=False) for _ in range(B)]).reshape(-1)
            n = ids.shape[0]
            x = torch.from_numpy(rng.standard_normal((n, H)).astype(np.float32)).to(dev)
            xn = x.cpu().numpy()
            uniq, counts = np.unique(ids, return_counts=True)
            flop = 2.0 * n * 3 * H * I
            qbytes = int(len(uniq) * per_expert)
            bbytes = int(len(uniq) * 3 * H * I * 2)

            def row(path, t, nbytes, **kw):
                r = dict(recipe=recipe, batch=B, slots=n, path=path, us=t * 1e6, TBps=nbytes / t / 1e12,
                         TFLOPs=flop / t / 1e12, bytes=nbytes, **kw)
                if copy_bps:
                    r["floor_us"] = nbytes / copy_bps * 1e6
                    r["of_copy"] = nbytes / t / copy_bps
                res["rows"].append(r)
                print(f"{recipe:14s} {B:5d} {path:34s} {t * 1e6:11.1f} us {r['TBps']:7.3f} TB/s "
                      f"{r['TFLOPs']:8.2f} TFLOP/s", flush=True)

            def timed(path, fn, nbytes, graph=True, **kw):
                try:
                    fn()
                    f = _graph(torch, fn).replay if (cuda and graph) else fn
                    # host-timed calls at prefill sizes take up to seconds (the exact definition's path)
                    r = reps if graph or B < 512 else min(reps, 3)
                    row(path, bench(f, reps=r, warm=1 if r < reps else None), nbytes, graphed=bool(cuda and graph),
                        **kw)
                except Exception as exc:  # one failing cell is reported, the table goes on
                    res["rows"].append(dict(recipe=recipe, batch=B, path=path, error=repr(exc)[:300]))
                    print(f"{recipe:14s} {B:5d} {path:34s} ERROR {repr(exc)[:120]}", flush=True)

            label, fk = fast_kernel(torch, owner, x, ids)
            timed(f"ours fast kernel ({label})", fk, qbytes)
            timed("ours fast run_slots", lambda: owner.run_slots(0, xn, ids, "fast"), qbytes, graph=False)
            timed("ours fast run_slots_device", lambda: owner.run_slots_device(0, x, ids, "fast"), qbytes,
                  graph=False)
            ex = owner.exact_set(0, ids)
            if ex is not None:
                di = torch.from_numpy(ids).to(dev)
                timed(f"ours exact kernel ({ex[0]})", lambda: owner.exact_device(0, x, di, ex[0]), qbytes)
            timed("ours exact run_slots" + ("" if ex is not None else " (definition)"),
                  lambda: owner.run_slots(0, xn, ids, "exact"), qbytes, graph=False)
            if ex is not None:  # the definition's path takes seconds at prefill sizes: timed once above
                timed("ours exact run_slots_device", lambda: owner.run_slots_device(0, x, ids, "exact"), qbytes,
                      graph=False)

            # the whole layer on the device: routing + routed experts + combine + shared expert
            try:
                from ds4quant.runtime.device_layer import DeviceLayer

                r2 = np.random.default_rng(B)
                gw = torch.from_numpy((r2.standard_normal((n_exp, H)) * 0.02).astype(np.float32))
                sh = tuple(torch.from_numpy((r2.standard_normal(sz) * 0.02).astype(np.float32))
                           for sz in ((I, H), (I, H), (H, I)))
                dl = DeviceLayer(owner, 0, gw, torch.zeros(n_exp), top_k=topk, shared=sh)
                ht = torch.from_numpy(r2.standard_normal((B, H)).astype(np.float32)).to(dev)
                timed("ours fast whole layer (route+shared)", lambda: dl(ht), qbytes + 3 * H * I * 4)
                dl = None
            except Exception as exc:  # reported, the table goes on
                res["rows"].append(dict(recipe=recipe, batch=B, path="ours fast whole layer", error=repr(exc)[:300]))

            W, xb, gmm = grouped_mm_anchor(torch, stacks, entries, ids, x, I)

            if cuda:
                timed("bf16 grouped_mm", gmm, bbytes)
            starts = np.r_[0, np.cumsum(counts)[:-1]]

            def dense():
                outs = []
                for i, (s0, c) in enumerate(zip(starts, counts)):
                    xe = xb[int(s0):int(s0 + c)]
                    g = torch.mm(xe, W["gate"][i].T)
                    u = torch.mm(xe, W["up"][i].T)
                    hb = torch.nn.functional.silu(torch.clamp(g, max=10.0)) * torch.clamp(u, -10.0, 10.0)
                    outs.append(torch.mm(hb, W["down"][i].T))
                return outs

            timed("dense bf16 GEMV/GEMM per expert", dense, bbytes)
            W = wgu = xb = None
        owner.close()
    res["seconds"] = round(time.perf_counter() - t_start, 1)
    if a.out:
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1)
        os.replace(tmp, a.out)
    print(f"\ncopy {res['copy_TBps']:.2f} TB/s (read + write); {res['seconds']} s; skipped: {res['skipped']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
