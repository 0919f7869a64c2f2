"""Where the measure stage's device path starts to pay.

``--device cuda`` gives the CPU path's bytes at any size, but each search is
a launch and a wait: on small matrices the workers' Python and the waits
cost more than the host's numba kernels. This times the measure stage at
full width (``_adaptive_ds4shape.ds4_expert_cost``: N synthetic experts,
gate/up (r, c), down (c, r), every default candidate) for each shape of
``--shapes`` on the CPU cores and on the device, checks that both give one
digest, and prints s/GB and the device's speed-up; the smallest shape where
the device wins sets ``ds4quant.plan.job.DEVICE_MIN_WEIGHTS``.

    python benchmarks/adaptive_crossover.py --device cuda --experts 16 --shapes 128x512,512x1024,1024x2048,2048x4096
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _adaptive_ds4shape import ds4_expert_cost  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--shapes", default="128x512,512x1024,1024x2048,2048x4096")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)

    from ds4quant.plan import job

    old = job.DEVICE_MIN_WEIGHTS
    job.DEVICE_MIN_WEIGHTS = 0  # every matrix on the device: the rule is what this measures
    rows = []
    try:
        for spec in args.shapes.split(","):
            r, c = (int(v) for v in spec.split("x"))
            d = ds4_expert_cost(args.threads, devices=[args.device], experts=args.experts, one_core=False,
                                shapes=((r, c), (c, r)))
            cpu = d["paths"][f"{args.threads} cores"]
            dev = d["paths"][f"{args.device} + {args.threads} cores"]
            row = {"shape": [r, c], "weights": r * c, "cpu_s_per_gb": cpu["s_per_gb"], "device_s_per_gb": dev["s_per_gb"],
                   "speedup": cpu["s"] / dev["s"], "identical": d["identical"]}
            rows.append(row)
            print(f"{r:5d} x {c:5d} ({r * c:>9,d} weights): {args.threads} cores {cpu['s_per_gb']:8.1f} s/GB, "
                  f"{args.device} {dev['s_per_gb']:8.1f} s/GB, device {row['speedup']:5.2f}x, identical {d['identical']}",
                  flush=True)
    finally:
        job.DEVICE_MIN_WEIGHTS = old
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": args.threads, "experts": args.experts, "rows": rows},
                                              indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
