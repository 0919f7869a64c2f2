"""The fast path's kernels of one DS4 MoE layer, run once each inside a profiler
window, for Nsight Compute (the counters say which limit a kernel sits at: memory,
issue, latency; timing tables cannot).

    ncu --clock-control none --profile-from-start off --set detailed \\
        python3 benchmarks/gpu_profile.py --batches 1,64,2048      # lent GPU
    TRITON_INTERPRET=1 python benchmarks/gpu_profile.py --quick --device cpu  # smoke test

The layer and the routing are ``runtime_gpu_table.py``'s (seeded). Each batch's
device work (``runtime_gpu_table.fast_kernel``: the call ``CudaOwner.run_slots``
makes) runs three times untimed (compiles, caches), then once between
``torch.cuda.profiler.start()`` and ``stop()``. Prints the path and the
milliseconds of one more run per batch, so a profile reads beside its time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> int:
    import torch

    from runtime_gpu_prefill import set_fast_tile
    from runtime_gpu_table import fast_kernel, make_layer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--recipe", default="rocmfp2-strix")
    ap.add_argument("--batches", default="1,64,2048")
    ap.add_argument("--prefill-tile", default=None,
                    help="bm,bn,bk,warps,stages,swap,n_first,x16 (runtime_gpu_prefill.py's tile) for both launches")
    ap.add_argument("--host", type=int, default=0, metavar="N",
                    help="also run the owner's own run_slots (host arrays) N times a batch under cProfile "
                         "and print where the host's time goes (the batch-1 calls of the plane-layout "
                         "qtypes measured 10x their kernel)")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        sys.path.insert(0, str(ROOT))
        from tests.runtime._interp import patch_interpreter

        patch_interpreter()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    n_exp, topk, H, I = (8, 6, 128, 64) if a.quick else (256, 6, 4096, 2048)
    _, owner, _ = make_layer(torch, dev, a.device, a.recipe, n_exp, H, I)
    if a.prefill_tile:
        set_fast_tile(owner, tuple(int(v) for v in a.prefill_tile.split(",")))
    if not cuda:
        big = {"gu": (I, 8, 1, 1, True, True), "down": (H, 4, 1, 1, True, True)}
        owner.gemv_tile, owner.group_tile = dict(big), dict(big)
    rng = np.random.default_rng(3)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for B in (int(b) for b in a.batches.split(",")):
        ids = np.stack([rng.choice(n_exp, topk, replace=False) for _ in range(B)]).reshape(-1)
        x = torch.from_numpy(rng.standard_normal((ids.shape[0], H)).astype(np.float32)).to(dev)
        label, fn = fast_kernel(torch, owner, x, ids)
        for _ in range(3):
            fn()
        sync()
        if cuda:
            torch.cuda.profiler.start()
        fn()
        sync()
        if cuda:
            torch.cuda.profiler.stop()
        t = time.perf_counter()
        fn()
        sync()
        print(f"{a.recipe} batch {B}: {label}, {(time.perf_counter() - t) * 1e3:.3f} ms (one run, eager)", flush=True)
        if a.host:
            host_profile(owner, x.cpu().numpy(), ids, a.host, sync)
    return 0


def host_profile(owner, x: np.ndarray, ids: np.ndarray, n: int, sync) -> None:
    """``owner.run_slots`` (fast mode, host arrays) ``n`` times under cProfile: the mean per
    call and the functions that took the most time of their own."""
    import cProfile
    import io
    import pstats

    owner.run_slots(0, x, ids, "fast")  # warm: graphs, plans, pinned buffers
    sync()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for _ in range(n):
        owner.run_slots(0, x, ids, "fast")
    prof.disable()
    sync()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
    print(f"  run_slots (host arrays): {(time.perf_counter() - t) / n * 1e6:.1f} us a call over {n} calls "
          f"(under cProfile)", flush=True)
    print("\n".join("  " + line for line in out.getvalue().splitlines() if line.strip()), flush=True)


if __name__ == "__main__":
    sys.exit(main())
