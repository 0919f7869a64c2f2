"""``ds4quant calibrate`` at DeepSeek-V4 Flash shapes: seconds per layer, peak
host RSS and peak GPU memory for slices of N layers, with and without the
streamed sensitivity pass (its cost as a ratio to the same run's reference
pass, the same-run anchor).

    python benchmarks/calibrate_scale.py --work /scratch/cal --preset ds4-flash --layers 2 4 \
        --seqs 64 --seq-len 2048 --device cuda
    python benchmarks/calibrate_scale.py --work /tmp/cal --preset ds4-flash-mini --layers 2 --seqs 4 --seq-len 64

Each slice is made by ``samples/make_synthetic.py`` (seeded; kept in WORK for
the next run); token ids are seeded uniform draws. Every calibrate runs in a
child process, so its peak RSS (``ru_maxrss``) is its own. Flat seconds per
layer and flat peaks across N are the goal; seconds per layer x 43 projects a
whole DS4 Flash calibration.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _child(src: str, tokens: str, out: str, device: str, sens: int, max_memory: str | None) -> None:
    sys.path.insert(0, str(ROOT))
    import ds4quant.runtime.stream.source  # noqa: F401  (torch and transformers imported before the clock starts)
    from ds4quant.calibrate import calibrate

    t0 = time.perf_counter()
    rep = calibrate(src, tokens, out, device=device, max_memory=max_memory, sensitivity_seqs=sens, force=True)
    gpu = None
    if device.startswith("cuda"):
        import torch

        gpu = torch.cuda.max_memory_allocated(torch.device(device))
    print(json.dumps({"seconds": time.perf_counter() - t0, "layers": rep.n_layer, "tokens": rep.tokens,
                      "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "gpu": gpu}))


def _slice(work: Path, preset: str, layers: int) -> Path:
    d = work / f"{preset}-{layers}"
    if not (d / "config.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "samples" / "make_synthetic.py"), str(d), "--preset", preset,
                        "--layers", str(layers)], check=True)
    return d


def _tokens(work: Path, vocab: int, seqs: int, seq_len: int) -> Path:
    import numpy as np

    p = work / f"tokens-{seqs}x{seq_len}.txt"
    if not p.is_file():
        rng = np.random.default_rng(2024)
        p.write_text("\n".join(" ".join(map(str, rng.integers(3, vocab, seq_len).tolist())) for _ in range(seqs)))
    return p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--preset", default="ds4-flash-mini")
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--sensitivity-seqs", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-memory", default=None)
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        src, tokens, out, device, sens, mm = a.child
        _child(src, tokens, out, device, int(sens), None if mm == "-" else mm)
        return 0
    a.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in a.layers:
        src = _slice(a.work, a.preset, n)
        vocab = json.loads((src / "config.json").read_text())["vocab_size"]
        toks = _tokens(a.work, vocab, a.seqs, a.seq_len)
        runs = {}
        for sens in (0, a.sensitivity_seqs):
            res = subprocess.run([sys.executable, __file__, "--work", str(a.work), "--child", str(src), str(toks),
                                  str(a.work / f"out-{n}-{sens}"), a.device, str(sens), a.max_memory or "-"],
                                 check=True, capture_output=True, text=True)
            runs[sens] = json.loads(res.stdout.strip().splitlines()[-1])
        base, full = runs[0], runs[a.sensitivity_seqs]
        rows.append((n, base, full))
    print(f"{a.preset}, {a.seqs} x {a.seq_len} tokens, device {a.device}, sensitivity {a.sensitivity_seqs} sequences")
    print(f"{'layers':>6} {'s/layer':>8} {'+sens s/layer':>13} {'sens/base':>9} {'peak RSS GiB':>12} {'peak GPU GiB':>12}")
    for n, base, full in rows:
        gpu = "-" if full["gpu"] is None else f"{full['gpu'] / 2**30:.2f}"
        print(f"{n:>6} {base['seconds'] / n:>8.2f} {full['seconds'] / n:>13.2f} "
              f"{full['seconds'] / base['seconds']:>9.2f} {max(base['rss'], full['rss']) / 2**30:>12.2f} {gpu:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
