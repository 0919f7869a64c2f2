"""One DS4 MoE layer on a GPU: the CUDA owner's Triton kernels, fast and exact
mode, beside anchors measured in the same run.

    python benchmarks/runtime_gpu.py --out bench.json            # lent GPU, DS4 sizes
    TRITON_INTERPRET=1 python benchmarks/runtime_gpu.py --quick --device cpu   # smoke test

Layer: 256 experts (all resident), top-6, hidden 4096, expert 2048,
rocmfp2-strix (rocmfp2 gate/up, rocmfp3 down) from random valid bytes
(seeded; timing only). Batches 1 and 64 (distinct random experts per token).
Rows, per batch (device time: CUDA-graph replays timed with CUDA events;
host calls by the host clock; medians):

* fast (headline): the kernels ``CudaOwner.run_slots`` takes — at batch 1
  the decode-step kernels (``kernels/gemv_triton``) from a CUDA graph, a new
  expert set copied in before each timed replay (``runtime_gpu_step``'s
  rotation) and the same experts every replay; at batch 64 the grouped form
  (same experts); then ``run_slots`` end to end;
* exact: ``kernels/exact_triton`` (quantize, gate+up, float64 SwiGLU +
  quantize, down) from a CUDA graph (rotated at batch 1, same experts) and
  eager, ``run_slots`` end to end, the definition's path
  (``TorchOwner``'s torch_exact: ``exact_kernels=False``), whether the two
  give the same bytes, and the exact / fast ratios;
* tl.dot kernels: ``CudaOwner.launch`` of the planned path (``--sweep``: a
  tile sweep);
* bf16 grouped_mm: ``torch._grouped_mm`` over the same experts decoded to
  bf16 (gate|up as one matrix), SwiGLU, down;
* decode+matmul: ``TorchOwner`` fast mode (formats.decode_torch per expert);
* copy: a 1 GiB device-to-device copy, bytes read + written per second.

The bytes of the selected experts over the measured copy rate give the
floor each row is compared with. Results go to --out as JSON, a table to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


ROOT = Path(__file__).resolve().parents[1]
N_ROT = 16  # expert sets the rotated replays cycle through
# (rows per program, warps, columns per step) of the tl.dot kernels' sweep (--sweep); run 1 on the H200
# measured the first two rows of each
TILES_B1 = [(32, 4, 256), (32, 4, 128), (64, 4, 64), (64, 8, 128), (16, 4, 256)]
TILES_BATCH = [(32, 4, 256), (32, 4, 64), (32, 4, 32), (16, 4, 64), (64, 4, 32)]
# exact kernels' sweep (--exact-sweep, batch 1): (rows per program, words per step, warps, prefetch)
EXACT_TILES = {"gu": [(8, 64, 4, True), (8, 32, 2, True), (16, 64, 8, True), (4, 64, 2, True), (8, 64, 4, False)],
               "down": [(16, 64, 8, True), (8, 32, 2, True), (16, 32, 4, True), (8, 64, 4, True)]}


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


def _fast_rows(torch, owner, x, ids, sets, bench, reps, row):
    """The fast path run_slots takes: (device seconds, same-experts device seconds, run_slots seconds)."""
    from runtime_gpu_step import _graph

    from ds4quant.runtime.owners.cuda_owner import group_t

    dev, n = x.device, ids.shape[0]
    cuda = dev.type == "cuda"
    xn = x.cpu().numpy()
    t_dev = t_same = None
    if n <= owner.gemv_max_slots and owner.gemv_set(0) is not None:
        xT = torch.from_numpy(group_t(xn)).to(dev)
        ids_buf = torch.from_numpy(ids).to(dev)

        def step():
            return owner.gemv_device(0, xT, ids_buf)

        if cuda:
            g = _graph(torch, step)
            t_same = bench(g.replay, reps=reps)
            row("fast: decode-step graph, same experts", t_same)
            t_dev = bench(g.replay, reps=reps, before=lambda i: ids_buf.copy_(sets[i % len(sets)]))
            row("fast: decode-step graph, rotated experts (headline)", t_dev)
            ids_buf.copy_(torch.from_numpy(ids))
        else:
            t_dev = t_same = bench(step, reps=reps)
            row("fast: decode-step kernels, eager", t_dev)
    else:
        gp = owner.grouped_plan(0, ids)
        if gp is not None:
            order, groups = gp
            xT = torch.from_numpy(group_t(xn[order])).to(dev)
            dg = torch.from_numpy(groups).to(dev)

            def grouped():
                return owner.grouped_device(0, xT, dg)

            t_dev = t_same = bench(_graph(torch, grouped).replay if cuda else grouped, reps=reps)
            row(f"fast: grouped gemv {'graph' if cuda else 'eager'}, same experts (headline)", t_dev)
    t_rs = host_median(lambda: owner.run_slots(0, xn, ids, "fast"), reps)
    row("fast: run_slots (pinned staging + kernels)", t_rs)
    return t_dev, t_same, t_rs


def _exact_rows(torch, owner, x, ids, sets, bench, reps, row, definition=True, sweep=False):
    """Exact mode through the kernels and through the definition: a dict of the figures.
    ``sweep`` (CUDA): try EXACT_TILES per stage first, keep the fastest; every tile's bytes
    must equal the default tile's (the sums are exact in any order)."""
    import hashlib

    from runtime_gpu_step import _graph

    dev = x.device
    cuda = dev.type == "cuda"
    xn = x.cpu().numpy()
    ids_buf = torch.from_numpy(ids).to(dev)
    out = {}

    def step():
        return owner.exact_device(0, x, ids_buf)

    y, bad = step()
    out["bad_pairs"] = int(bad[0])
    y0 = y.cpu().numpy().view(np.uint32).copy()
    if sweep and cuda:
        same = True
        for stage in ("gu", "down"):
            best = None
            for tile in EXACT_TILES[stage]:
                owner.exact_tile[stage] = tile
                try:
                    yt = step()[0].cpu().numpy().view(np.uint32)
                    t = bench(_graph(torch, step).replay, reps=reps)
                except Exception as exc:  # a tile that does not compile is reported, not fatal
                    out.setdefault("sweep_errors", []).append(f"{stage} {tile}: {repr(exc)[:200]}")
                    continue
                same = same and bool(np.array_equal(yt, y0))
                row(f"exact: sweep {stage} tile {tile}", t, tile=list(tile), stage=stage)
                if best is None or t < best[0]:
                    best = (t, tile)
            owner.exact_tile[stage] = best[1]
        out["sweep_tiles_identical_bytes"] = same
        out["best_tile"] = {k: list(v) for k, v in owner.exact_tile.items()}
    if cuda:
        g = _graph(torch, step)
        out["graph_same_s"] = bench(g.replay, reps=reps)
        row("exact: kernels graph, same experts", out["graph_same_s"])
        if x.shape[0] == sets[0].shape[0]:
            out["graph_rot_s"] = bench(g.replay, reps=reps, before=lambda i: ids_buf.copy_(sets[i % len(sets)]))
            row("exact: kernels graph, rotated experts", out["graph_rot_s"])
        ids_buf.copy_(torch.from_numpy(ids))
    out["eager_s"] = bench(step, reps=reps)
    row("exact: kernels eager (4 launches)", out["eager_s"])
    stats0 = dict(owner.exact_stats)
    out["run_slots_s"] = host_median(lambda: owner.run_slots(0, xn, ids, "exact"), reps)
    row("exact: run_slots (end to end)", out["run_slots_s"])
    yk = owner.run_slots(0, xn, ids, "exact")
    out["reruns"] = owner.exact_stats["rerun"] - stats0["rerun"]
    out["patched_calls"] = owner.exact_stats["patched"] - stats0["patched"]
    out["sha256"] = hashlib.sha256(yk.tobytes()).hexdigest()
    if definition:
        owner.exact_kernels = False
        try:
            yd = owner.run_slots(0, xn, ids, "exact")
            out["definition_s"] = host_median(lambda: owner.run_slots(0, xn, ids, "exact"), min(2, reps), warm=0)
        finally:
            owner.exact_kernels = True
        row("exact: definition (TorchOwner torch_exact)", out["definition_s"])
        out["identical_to_definition"] = bool(np.array_equal(yk.view(np.uint32), yd.view(np.uint32)))
    return out


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-exact", action="store_true")
    ap.add_argument("--no-torch", action="store_true",
                    help="skip the decode+matmul (TorchOwner) row and exact mode's definition row")
    ap.add_argument("--sweep", action="store_true", help="a tile sweep of the tl.dot kernels")
    ap.add_argument("--exact-sweep", action="store_true", help="a tile sweep of the exact kernels (batch 1)")
    ap.add_argument("--batches", default=None, help="default 1,64 (--quick: 1,3)")
    ap.add_argument("--reps", type=int, default=0, help="timed repetitions (default 50, --quick 3)")
    a = ap.parse_args(argv)

    if os.environ.get("TRITON_INTERPRET"):  # the CPU smoke run: the tests' interpreter patch
        sys.path.insert(0, str(ROOT))
        from tests.runtime._interp import patch_interpreter

        patch_interpreter()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from runtime_gpu_step import expert_sets

    from ds4quant.runtime.owners.torch_owner import TorchOwner

    dev = torch.device(a.device)
    n_exp, topk, H, I = (16, 6, 256, 128) if a.quick else (256, 6, 4096, 2048)
    reps = a.reps or (3 if a.quick else 50)
    batches = [int(b) for b in (a.batches or ("1,3" if a.quick else "1,64")).split(",")]
    bench = _timer(torch, dev, warm=min(5, reps))
    res = {"versions": _versions(torch), "shape": dict(n_expert=n_exp, topk=topk, hidden=H, expert=I),
           "recipe": "rocmfp2-strix (random valid bytes)", "rows": [], "exact": {}}

    t0 = time.perf_counter()
    stacks, owner = strix_layer(torch, dev, a.device, n_exp, H, I)
    res["load_s"] = time.perf_counter() - t0
    per_expert = sum(st.nbytes for st in stacks.values()) // n_exp
    if dev.type == "cpu":  # the interpreter's cost is per program: whole-matrix row blocks
        big = {"gu": (I, 8, 1, 1, True, True), "down": (H, 4, 1, 1, True, True)}
        owner.gemv_tile, owner.group_tile = dict(big), dict(big)
        owner.exact_tile = {k: (v[0], v[1], 1, True) for k, v in big.items()}
        owner.tile = {bt: (max(H, I), 1, 64) for bt in (1, owner.bt)}

    if dev.type == "cuda":
        res["copy_TBps"] = copy_bytes_per_s(torch, dev, bench) / 1e12
    copy_bps = res.get("copy_TBps", 0) * 1e12

    rng = np.random.default_rng(3)
    for B in batches:
        ids = np.stack([rng.choice(n_exp, topk, replace=False) for _ in range(B)]).reshape(-1)
        n = ids.shape[0]
        x = torch.from_numpy(rng.standard_normal((n, H)).astype(np.float32)).to(dev)
        distinct = np.unique(ids)
        nbytes = int(len(distinct) * per_expert)
        flop = 2.0 * n * 3 * H * I
        sets = [torch.from_numpy(e).to(dev) for e in expert_sets(rng, n_exp, topk, B, N_ROT)]

        def row(name, t, **kw):
            r = dict(batch=B, path=name, us=t * 1e6, bytes=nbytes, tflops=flop / t / 1e12, **kw)
            if copy_bps:
                r["floor_us"] = nbytes / copy_bps * 1e6
                r["of_copy_bw"] = nbytes / t / copy_bps
            res["rows"].append(r)
            print(f"batch {B:3d}  {name:52s} {t * 1e6:10.1f} us", flush=True)

        # the CUDA owner's fast path (what run_slots takes), then exact mode
        f_dev, f_same, f_rs = _fast_rows(torch, owner, x, ids, sets, bench, reps, row)
        if not a.no_exact:
            ex = _exact_rows(torch, owner, x, ids, sets, bench, reps, row, definition=not a.no_torch,
                             sweep=a.exact_sweep and B == 1)
            ex["exact_over_fast"] = {"run_slots": ex["run_slots_s"] / f_rs}
            if f_same and "graph_same_s" in ex:
                ex["exact_over_fast"]["device_same_experts"] = ex["graph_same_s"] / f_same
            if f_dev and "graph_rot_s" in ex:
                ex["exact_over_fast"]["device_rotated"] = ex["graph_rot_s"] / f_dev
            if f_same and dev.type != "cuda":
                ex["exact_over_fast"]["eager"] = ex["eager_s"] / f_same
            if "definition_s" in ex:
                ex["definition_over_kernels_run_slots"] = ex["definition_s"] / ex["run_slots_s"]
            res["exact"][str(B)] = ex
            print(f"batch {B:3d}  exact / fast: " + ", ".join(f"{k} {v:.2f}x" for k, v in
                                                             ex["exact_over_fast"].items())
                  + f"; same bytes as the definition: {ex.get('identical_to_definition')}", flush=True)

        # the planned path's tl.dot kernels (before the decode-step kernels)
        plan = owner.plan(0, ids)
        xs = x.index_select(0, plan.order).contiguous()
        h = torch.empty((n, I), dtype=torch.float32, device=dev)
        y = torch.empty_like(xs)
        owner.launch(plan, xs, h, y)
        row("tl.dot kernels eager (2 launches)", bench(lambda: owner.launch(plan, xs, h, y), reps=reps))
        if dev.type == "cuda":
            from runtime_gpu_step import _graph

            configs = (TILES_B1 if B == 1 else TILES_BATCH) if a.sweep else [owner.tile.get(plan.bt, (0, 0, 0))]
            for bn, nw, bk in configs:
                owner.tile[plan.bt] = (bn, nw, bk)
                try:
                    t = bench(_graph(torch, lambda: owner.launch(plan, xs, h, y)).replay, reps=reps)
                except Exception as exc:  # a tile that does not compile is reported, not fatal
                    res["rows"].append(dict(batch=B, path=f"tl.dot graph {bn}x{nw}x{bk}", error=repr(exc)[:300]))
                    continue
                row(f"tl.dot kernels graph bn={bn} w={nw} bk={bk}", t, bn=bn, num_warps=nw, bk=bk)
            owner.tile.pop(plan.bt, None)  # back to the kernels' defaults

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
        tor = TorchOwner(a.device, identity="cuda:1" if dev.type == "cuda" else "torch-cpu:6")
        for st in stacks.values():
            tor.add_stack(st)
        xn = x.cpu().numpy()
        row("decode+matmul (TorchOwner)", bench(lambda: tor.run_slots(0, xn, ids, "fast"), reps=min(3, reps), warm=1))
        tor.close()

    res["load_s"] = round(res["load_s"], 2)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k not in ("rows", "exact")}))
    for r in res["rows"]:
        if "us" in r:
            print(f"{r['batch']:3d} {r['path']:52s} {r['us']:10.1f} us  {r.get('of_copy_bw', 0) * 100:5.1f}% copy bw"
                  f"  {r['tflops']:7.2f} TFLOP/s")
        else:
            print(f"{r['batch']:3d} {r['path']:52s} ERROR {r['error']}")
    for B, ex in res["exact"].items():
        print(f"exact, batch {B}: " + json.dumps({k: v for k, v in ex.items() if k != "sha256"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
