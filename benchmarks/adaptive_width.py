"""Where the measure stage's time goes at full width on a device.

One worker measures a DS4 Flash matrix several times faster than the same
worker does among 16, so the workers contend for something. This runs N
DS4-shaped experts (``_adaptive_ds4shape``: gate, up, down) through
``ds4quant.plan.ordered_map`` as ``benchmarks/adaptive.py --ds4-shape``
does, at each width of ``--widths``, and reports per matrix the seconds the
workers spent inside the named phases below (inclusive: a phase's time
contains the phases it calls; launches return when queued, so the GPU's
time shows in the phase that waits for it, a copy to the host), the CPU
use, and a GIL probe: a thread that sleeps 1 ms in a loop and records how
late it wakes (a busy GIL makes it wait for the interpreter's switch
interval). A phase whose seconds per matrix grow with the width is where
the workers contend. Every width must give one digest.

    python benchmarks/adaptive_width.py --device cuda --experts 16 --widths 1,16
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _adaptive_ds4shape import DOWN, GATE_UP, _measure_all, fp4_matrix, importance  # noqa: E402

# (module, attribute, label): where the device path's work happens
PHASES = (
    ("ds4quant.plan.job", "ExpertJob._fit", "MIX: the whole codebook fit"),
    ("ds4quant.plan.job", "ExpertJob.histogram", "MIX: reference fitter's histogram (host, once a matrix)"),
    ("ds4quant.formats.search", "terms_stats", "MIX: Lloyd sums (host)"),
    ("ds4quant.formats.search", "pairwise_sum", "MIX: Lloyd step totals (host)"),
    ("ds4quant.formats.search.torch_batch", "choose_batched", "MIX: Lloyd step search + copies"),
    ("ds4quant.formats.search.triton_mix", "search_device", "MIX: search launch"),
    ("ds4quant.formats.search.triton_mix", "terms_device", "MIX: terms launch"),
    ("ds4quant.formats.search.triton_sums", "pairwise_total", "MIX: error total (leaves, host tree)"),
    ("ds4quant.formats.search.triton_mix", "decode_device", "MIX: decode of the choices"),
    ("ds4quant.formats.search", "measure_scale", "scale search + decode launch"),
    ("ds4quant.plan.job", "encode_input", "input checks (host)"),
    ("ds4quant.formats.search.triton_sums", "error_sums_device", "error sums (device rows, host combine)"),
    ("ds4quant.formats.search", "to_host", "copies to the host (waits for the stream)"),
    ("ds4quant.formats.search.triton_mix", "to_host", "copies to the host (waits for the stream)"),
    ("ds4quant.formats.search.torch_batch", "to_host", "copies to the host (waits for the stream)"),
    ("ds4quant.plan.job", "_upload", "uploads (pinned staging)"),
    ("ds4quant.plan.job", "Resident.sigma2", "importance row energies (host)"),
)


class Phases:
    def __init__(self):
        self.t = defaultdict(float)
        self.n = defaultdict(int)
        self.lock = threading.Lock()
        self.undo = []

    def wrap(self):
        for mod, attr, label in PHASES:
            owner = importlib.import_module(mod)
            *path, attr = attr.split(".")
            for p in path:
                owner = getattr(owner, p)
            fn = getattr(owner, attr)

            def timed(*a, _fn=fn, _label=label, **k):
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    dt = time.perf_counter() - t0
                    with self.lock:
                        self.t[_label] += dt
                        self.n[_label] += 1

            setattr(owner, attr, timed)
            self.undo.append((owner, attr, fn))

    def unwrap(self):
        for owner, attr, fn in reversed(self.undo):
            setattr(owner, attr, fn)
        self.undo.clear()


class GilProbe(threading.Thread):
    """Sleeps 1 ms in a loop; records how much later than asked it runs again."""

    def __init__(self):
        super().__init__(daemon=True)
        self.late = []
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            t0 = time.perf_counter()
            time.sleep(0.001)
            self.late.append(time.perf_counter() - t0 - 0.001)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--widths", default="1,16")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)

    import numpy as np

    from ds4quant.formats import numba_threads
    from ds4quant.plan import DEFAULT_CANDIDATES, AdaptiveOptions, ordered_map, worker_stream

    opts = AdaptiveOptions(target_bpw=2.7, device=args.device)
    dev = opts.backend()
    mats = []
    for e in range(args.experts):
        imp_in, imp_down = importance(f"in/{e}", GATE_UP[1]), importance(f"down/{e}", DOWN[1])
        for which, shape, imp in (("gate", GATE_UP, imp_in), ("up", GATE_UP, imp_in), ("down", DOWN, imp_down)):
            mats.append((f"{which}/{e}", fp4_matrix(f"{which}/{e}", shape), imp))
    gb = sum(x.size for _, x, _ in mats) * (0.5 + 1 / 32) / 1e9

    def work(p):
        x, imp = p
        with worker_stream(dev):
            return _measure_all(x, imp, DEFAULT_CANDIDATES, opts, dev)

    with numba_threads(1):  # warm-up: kernels compile, tables load
        _ = [work((x, imp)) for _, x, imp in mats[:3]]
    out = {"device": opts.device_name, "experts": args.experts, "matrices": len(mats), "fp4_gb": gb, "widths": {}}
    for width in [int(w) for w in args.widths.split(",")]:
        ph = Phases()
        ph.wrap()
        probe = GilProbe()
        probe.start()
        try:
            with numba_threads(width):
                c0, t0 = time.process_time(), time.perf_counter()
                got = list(ordered_map(((k, (x, imp)) for k, x, imp in mats), work, width))
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        finally:
            probe.stop.set()
            probe.join()
            ph.unwrap()
        late = np.array(probe.late) * 1e3
        row = {"wall_s": wall, "s_per_gb": wall / gb, "cores_busy": cpu / wall,
               "gil_probe_ms": {"mean": float(late.mean()), "p90": float(np.percentile(late, 90))},
               "digest": hashlib.sha256(repr([g for _, g in got]).encode()).hexdigest(),
               "phases_s_per_matrix": {k: ph.t[k] / len(mats) for k in sorted(ph.t, key=ph.t.get, reverse=True)},
               "calls_per_matrix": {k: ph.n[k] / len(mats) for k in ph.n}}
        out["widths"][width] = row
        print(f"width {width:2d}: {wall:7.2f} s  {wall / gb:7.1f} s/GB  {cpu / wall:5.1f} cores busy  "
              f"GIL probe late {late.mean():.2f} ms (p90 {np.percentile(late, 90):.2f})  digest {row['digest'][:16]}")
        for k, v in row["phases_s_per_matrix"].items():
            print(f"    {k:46s} {v * 1e3:9.1f} ms/matrix  ({ph.n[k] / len(mats):6.1f} calls)")
    out["identical"] = len({r["digest"] for r in out["widths"].values()}) == 1
    print("identical:", out["identical"])
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
