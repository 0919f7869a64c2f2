"""One DS4 MoE layer on a GPU: the CUDA owner's Triton kernels beside anchors
measured in the same run.

    python benchmarks/runtime_gpu.py --out bench.json            # lent GPU, DS4 sizes
    TRITON_INTERPRET=1 python benchmarks/runtime_gpu.py --quick --device cpu   # smoke test

Layer: 256 experts (all resident), top-6, hidden 4096, expert 2048,
rocmfp2-strix (rocmfp2 gate/up, rocmfp3 down) from random valid bytes
(seeded; timing only). Batches 1 and 64 (distinct random experts per token).
Rows, per batch:

* triton graph: the two launches (gate+up+SwiGLU, down) replayed from a
  CUDA graph (device time of the decode step's expert FFN);
* triton eager: the same launches from Python (do_bench median);
* triton call: ``CudaOwner.fast_device`` (host planning + launches + gathers);
* bf16 grouped_mm: ``torch._grouped_mm`` over the same experts decoded to
  bf16 (gate|up as one matrix), SwiGLU, down;
* decode+matmul: ``TorchOwner`` fast mode (formats.decode_torch per expert);
* exact (batch 1): ``CudaOwner`` exact mode (the identity definition);
* copy: a 1 GiB device-to-device copy, bytes read + written per second.

The bytes of the selected experts over the measured copy rate give the
floor each row is compared with. Results go to --out as JSON, a table to stdout.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time

import numpy as np


# (rows per program, warps, columns per step); run 1 on the H200 measured the first two rows of each
TILES_B1 = [(32, 4, 256), (32, 4, 128), (64, 4, 64), (64, 8, 128), (16, 4, 256)]
TILES_BATCH = [(32, 4, 256), (32, 4, 64), (32, 4, 32), (16, 4, 64), (64, 4, 32)]


def _versions(torch):
    v = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        v["triton"] = triton.__version__
    except ImportError:
        v["triton"] = None
    if torch.cuda.is_available():
        v["device"] = torch.cuda.get_device_name(0)
        try:
            v["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                         capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            v["driver"] = None
    return v


def host_median(fn, reps, warm=3, before=None):
    """median seconds of fn() by the host clock; ``before(i)`` runs untimed before each call."""
    step = before or (lambda i: None)
    for i in range(warm):
        step(i)
        fn()
    ts = []
    for i in range(reps):
        step(i)
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def _timer(torch, dev, warm: int = 5):
    """median seconds of fn() over reps (device events on CUDA); ``before(i)`` runs
    untimed before each call (e.g. a new expert set copied into a graph's buffer)."""
    warm_default = warm

    def bench(fn, reps=50, warm=None, before=None):
        warm = warm_default if warm is None else min(warm, warm_default)
        if dev.type != "cuda":
            return host_median(fn, reps, warm, before)
        step = before or (lambda i: None)
        for i in range(warm):
            step(i)
            fn()
        torch.cuda.synchronize()
        ts = []
        for i in range(reps):
            step(i)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        return float(np.median(ts))

    return bench


def _random_stack(torch, qtype, n, rows, cols, gen, dev):
    """Valid random bytes: codes uniform, scale bytes in [0x18, 0x38] (2^-8 .. 0.5)."""
    from ds4quant import formats

    qt = formats.QTYPES[qtype]
    nb = cols // 32
    data = torch.randint(0, 256, (n, rows, nb, qt.block_bytes), generator=gen, dtype=torch.uint8, device=gen.device)
    ns = 2  # rocmfp2 / rocmfp3: e[2] at the end of the block
    data[..., -ns:] = torch.randint(0x18, 0x39, (n, rows, nb, ns), generator=gen, dtype=torch.uint8, device=gen.device)
    return data.reshape(n, rows, nb * qt.block_bytes).cpu().numpy()


def strix_layer(torch, dev, device: str, n_exp: int, H: int, I: int):
    """The benchmarks' layer: rocmfp2-strix stacks of ``n_exp`` experts (random
    valid bytes, seeded, made on the device) resident on a CudaOwner.
    Returns (stacks by projection, owner)."""
    from ds4quant.runtime.owners.base import ExpertStack
    from ds4quant.runtime.owners.cuda_owner import CudaOwner

    gen = torch.Generator(device=dev).manual_seed(7)  # random bytes made on the device: faster
    stacks = {p: ExpertStack(f"blk.0.ffn_{p}_exps.weight", 0, p, q, r, c, tuple(range(n_exp)),
                             _random_stack(torch, q, n_exp, r, c, gen, dev))
              for p, q, r, c in (("gate", "rocmfp2", I, H), ("up", "rocmfp2", I, H), ("down", "rocmfp3", H, I))}
    owner = CudaOwner(device, identity="cuda:0" if dev.type == "cuda" else "torch-cpu:5")
    for st in stacks.values():
        owner.add_stack(st)
    return stacks, owner


def copy_bytes_per_s(torch, dev, bench) -> float:
    """The device copy anchor: bytes read + written per second by a 1 GiB copy."""
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(big)
    return 2 * big.numel() / bench(lambda: dst.copy_(big), reps=20)  # both freed on return


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-exact", action="store_true")
    ap.add_argument("--no-torch", action="store_true", help="skip the decode+matmul (TorchOwner) and exact rows")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--reps", type=int, default=0, help="timed repetitions (default 50, --quick 3)")
    a = ap.parse_args(argv)

    from ds4quant.runtime.owners.torch_owner import TorchOwner

    dev = torch.device(a.device)
    n_exp, topk, H, I = (16, 6, 256, 128) if a.quick else (256, 6, 4096, 2048)
    reps = a.reps or (3 if a.quick else 50)
    bench = _timer(torch, dev, warm=min(5, reps))
    res = {"versions": _versions(torch), "shape": dict(n_expert=n_exp, topk=topk, hidden=H, expert=I),
           "recipe": "rocmfp2-strix (random valid bytes)", "rows": []}

    t0 = time.perf_counter()
    stacks, owner = strix_layer(torch, dev, a.device, n_exp, H, I)
    res["load_s"] = time.perf_counter() - t0
    per_expert = sum(st.nbytes for st in stacks.values()) // n_exp

    if dev.type == "cuda":
        res["copy_TBps"] = copy_bytes_per_s(torch, dev, bench) / 1e12
    copy_bps = res.get("copy_TBps", 0) * 1e12

    rng = np.random.default_rng(3)
    for B in (int(b) for b in a.batches.split(",")):
        ids = np.stack([rng.choice(n_exp, topk, replace=False) for _ in range(B)]).reshape(-1)
        n = ids.shape[0]
        x = torch.from_numpy(rng.standard_normal((n, H)).astype(np.float32)).to(dev)
        distinct = np.unique(ids)
        nbytes = int(len(distinct) * per_expert)
        flop = 2.0 * n * 3 * H * I

        def row(name, t, **kw):
            r = dict(batch=B, path=name, us=t * 1e6, bytes=nbytes, tflops=flop / t / 1e12, **kw)
            if copy_bps:
                r["floor_us"] = nbytes / copy_bps * 1e6
                r["of_copy_bw"] = nbytes / t / copy_bps
            res["rows"].append(r)
            print(f"batch {B:3d}  {name:28s} {t * 1e6:10.1f} us", flush=True)

        # the CUDA owner's kernels
        plan = owner.plan(0, ids)
        xs = x.index_select(0, plan.order).contiguous()
        h = torch.empty((n, I), dtype=torch.float32, device=dev)
        y = torch.empty_like(xs)
        owner.launch(plan, xs, h, y)
        row("triton eager (2 launches)", bench(lambda: owner.launch(plan, xs, h, y), reps=reps))
        if dev.type == "cuda":
            configs = TILES_B1 if B == 1 else TILES_BATCH
            best = None
            for bn, nw, bk in configs:
                owner.tile[plan.bt] = (bn, nw, bk)
                try:
                    owner.launch(plan, xs, h, y)
                    torch.cuda.synchronize()
                    s = torch.cuda.Stream()
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        owner.launch(plan, xs, h, y)
                    torch.cuda.current_stream().wait_stream(s)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        owner.launch(plan, xs, h, y)
                    t = bench(graph.replay, reps=reps)
                except Exception as exc:  # a tile that does not compile is reported, not fatal
                    res["rows"].append(dict(batch=B, path=f"triton graph {bn}x{nw}x{bk}", error=repr(exc)[:300]))
                    continue
                row(f"triton graph bn={bn} w={nw} bk={bk}", t, bn=bn, num_warps=nw, bk=bk)
                if best is None or t < best[0]:
                    best = (t, bn, nw, bk)
            if best:
                owner.tile[plan.bt] = best[1:]
                res.setdefault("best_tile", {})[str(B)] = dict(us=best[0] * 1e6, bn=best[1], num_warps=best[2],
                                                               bk=best[3])
        row("triton call (fast_device)", bench(lambda: owner.fast_device(0, x, ids), reps=reps))

        # bf16 grouped_mm over the same experts, decoded
        from ds4quant import formats

        order = np.argsort(ids, kind="stable")
        sids = ids[order]
        uniq, counts = np.unique(sids, return_counts=True)
        wgu = torch.stack([torch.cat([formats.decode_torch("rocmfp2", torch.from_numpy(stacks[p].data[e]).to(dev), H)
                                      for p in ("gate", "up")]) for e in uniq]).to(torch.bfloat16)
        wd = torch.stack([formats.decode_torch("rocmfp3", torch.from_numpy(stacks["down"].data[e]).to(dev), I)
                          for e in uniq]).to(torch.bfloat16)
        offs = torch.from_numpy(np.cumsum(counts).astype(np.int32)).to(dev)
        xb = x[torch.from_numpy(order).to(dev)].to(torch.bfloat16)

        def gmm():
            gu = torch._grouped_mm(xb, wgu.transpose(-2, -1), offs=offs)
            g, u = gu[:, :I], gu[:, I:]
            hb = torch.nn.functional.silu(torch.clamp(g, max=10.0)) * torch.clamp(u, -10.0, 10.0)
            return torch._grouped_mm(hb, wd.transpose(-2, -1), offs=offs)

        try:
            yb = gmm()
            row("bf16 grouped_mm", bench(gmm, reps=reps))
            # the kernels' result against the bf16 anchor (same weights): a sanity figure
            yk = owner.fast_device(0, x, ids)[torch.from_numpy(order).to(dev)]
            res["rows"][-1]["rel_vs_triton"] = float((yb.float() - yk).norm() / yk.norm())
        except Exception as exc:  # _grouped_mm is private: report, do not fail the run
            res["rows"].append(dict(batch=B, path="bf16 grouped_mm", error=repr(exc)[:300]))
        wgu = wd = gmm = None  # free the decoded experts before the next batch

        if a.no_torch:
            continue
        # decode then matmul (TorchOwner fast) and exact mode
        tor = TorchOwner(a.device, identity="cuda:1" if dev.type == "cuda" else "torch-cpu:6")
        for st in stacks.values():
            tor.add_stack(st)
        xn = x.cpu().numpy()
        row("decode+matmul (TorchOwner)", bench(lambda: tor.run_slots(0, xn, ids, "fast"), reps=min(3, reps), warm=1))
        if B == 1 and not a.no_exact:
            row("exact (CudaOwner)", bench(lambda: owner.run_slots(0, xn, ids, "exact"), reps=min(2, reps), warm=1))
        tor.close()

    res["load_s"] = round(res["load_s"], 2)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}))
    for r in res["rows"]:
        if "us" in r:
            print(f"{r['batch']:3d} {r['path']:30s} {r['us']:10.1f} us  {r.get('of_copy_bw', 0) * 100:5.1f}% copy bw"
                  f"  {r['tflops']:7.2f} TFLOP/s")
        else:
            print(f"{r['batch']:3d} {r['path']:30s} ERROR {r['error']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
