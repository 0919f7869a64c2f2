"""Where one worker's measure stage spends its time on a device.

One DS4 Flash-shaped down matrix (4096 x 2048, FP4-grid values, log-normal
importance; ``_adaptive_ds4shape``), every default candidate through
``adaptive.measure_matrix`` on one thread: wall and CPU seconds per candidate
on the CPU (numba), on the device with the Triton kernels, and on the device
with the torch tier's searches, all after a warm-up in the same run; then a
cProfile of the Triton path (top functions by own time) and the device's
kernel time under torch's profiler. Prints the figures and the digests of
each path's measures (they must be equal).

    python benchmarks/adaptive_profile.py [--device cuda] [--surface down|gate] [--top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _adaptive_ds4shape import DOWN, GATE_UP, _measure_all, fp4_matrix, importance, torch_tier  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--surface", default="down", choices=("down", "gate"))
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)

    import numba
    import torch

    from ds4quant.formats.search import NUMBA
    from ds4quant.plan import DEFAULT_CANDIDATES, AdaptiveOptions

    numba.set_num_threads(1)
    dev = AdaptiveOptions(target_bpw=2.7, device=args.device).backend()
    shape = DOWN if args.surface == "down" else GATE_UP
    x = fp4_matrix(f"{args.surface}/0", shape)
    imp = importance(f"{args.surface}/0", shape[1])
    opts = AdaptiveOptions(target_bpw=2.7)

    def sync():
        if dev.on_device and dev.device.value == "cuda":
            torch.cuda.synchronize(dev.torch_device)

    def run(q, d):  # the benchmark's own call, one candidate
        return _measure_all(x, imp, (q,), opts, d)[0]

    paths = [("cpu (numba, 1 thread)", NUMBA), ("device, Triton kernels", dev),
             ("device, torch searches", torch_tier(dev))]
    for _, d in paths[1:]:  # warm-up: kernels compile, tables load
        for q in DEFAULT_CANDIDATES:
            run(q, d)
    sync()
    print(f"{args.surface} {shape[0]} x {shape[1]}, one worker, device {dev}")
    digests = {}
    for label, d in paths:
        got = []
        tot_w = tot_c = 0.0
        for q in DEFAULT_CANDIDATES:
            sync()
            c0, t0 = time.process_time(), time.perf_counter()
            got.append(run(q, d))
            sync()
            sw, sc = time.perf_counter() - t0, time.process_time() - c0
            tot_w += sw
            tot_c += sc
            print(f"  {label:36s} {q:13s} wall {sw:7.3f} s  cpu {sc:7.3f} s")
        digests[label] = hashlib.sha256(repr(got).encode()).hexdigest()
        print(f"  {label:36s} {'all':13s} wall {tot_w:7.3f} s  cpu {tot_c:7.3f} s  digest {digests[label][:16]}")
    print("identical:", len(set(digests.values())) == 1)

    pr = cProfile.Profile()
    pr.enable()
    for q in DEFAULT_CANDIDATES:
        run(q, dev)
    sync()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(args.top)
    print("cProfile, Triton path, all candidates (by own time):")
    print("\n".join(s.getvalue().splitlines()[:args.top + 12]))

    if dev.on_device and dev.device.value == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for q in DEFAULT_CANDIDATES:
                run(q, dev)
            sync()
        print("torch profiler, Triton path, all candidates (by device time):")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
