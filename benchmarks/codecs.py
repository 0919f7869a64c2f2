"""Codec throughput and quality against anchors, measured in one run.

For every registered qtype that can encode, on float32 input of --rows x
--cols (default 512 x 4096, 8 MiB):

* encode and decode throughput, single-thread and all-core, in MB/s of
  float32 input (MB = 1e6 bytes), each beside gguf-py's own
  numpy Q4_0 quantizer / dequantizer timed in the same run (ratio column);
* SQNR in dB on Gaussian and Laplace data, beside the Gaussian
  rate-distortion bound at the format's bits per weight (6.02 * bpw dB).

MIX qtypes get fixed books (106: {-1, -1/3, 1/3, 1} and {-1, -1/4, 1/4, 1};
105: eight levels), rounded to bf16. A codec that fails is reported with
its error and the run continues.

Usage::

    python benchmarks/codecs.py                   # table
    python benchmarks/codecs.py --rows 4096 --json
    python benchmarks/codecs.py --importance --only rocmfp2 rocmfp3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

import numba
import numpy as np

from ds4quant import formats

Q4_0_NAME = "gguf-py Q4_0"


@contextlib.contextmanager
def _threads(n: int):
    old = numba.get_num_threads()
    numba.set_num_threads(n)
    try:
        yield
    finally:
        numba.set_num_threads(old)


def _best_seconds(fn, repeat: int) -> float:
    best = math.inf
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _books(qt) -> np.ndarray | None:
    if not qt.is_mix:
        return None
    if qt.codebook_levels == 4:
        books = [[-1, -1 / 3, 1 / 3, 1], [-1, -0.25, 0.25, 1]]
    else:
        books = [np.linspace(-1, 1, 8), [-1, -0.6, -0.3, -0.1, 0.1, 0.3, 0.6, 1]]
    return formats.bf16_round(np.asarray(books, dtype=np.float32))


def sqnr_db(x: np.ndarray, y: np.ndarray) -> float:
    """10 log10(sum x^2 / sum (x - y)^2) in float64; inf when lossless."""
    x64 = x.astype(np.float64)
    noise = float(np.sum((x64 - y.astype(np.float64)) ** 2))
    return math.inf if noise == 0 else 10 * math.log10(float(np.sum(x64 * x64)) / noise)


def measure_q4_0(gauss: np.ndarray, laplace: np.ndarray, repeat: int) -> dict:
    """gguf-py's numpy Q4_0 (4.5 bpw), single-threaded: the anchor."""
    import gguf

    t = gguf.GGMLQuantizationType.Q4_0
    q = gguf.quants.quantize(gauss, t)
    enc = _best_seconds(lambda: gguf.quants.quantize(gauss, t), repeat)
    dec = _best_seconds(lambda: gguf.quants.dequantize(q, t), repeat)
    lap = gguf.quants.dequantize(gguf.quants.quantize(laplace, t), t)
    return {"bpw": 4.5, "encode_MBps": gauss.nbytes / enc / 1e6, "decode_MBps": gauss.nbytes / dec / 1e6,
            "sqnr_gauss_dB": sqnr_db(gauss, gguf.quants.dequantize(q, t)),
            "sqnr_laplace_dB": sqnr_db(laplace, lap), "rd_bound_dB": 6.02 * 4.5}


def measure(name: str, gauss: np.ndarray, laplace: np.ndarray, repeat: int, all_cores: int,
            importance: np.ndarray | None = None) -> dict:
    qt = formats.get_qtype(name)
    books = _books(qt)
    cols = gauss.shape[1]
    mb = gauss.nbytes / 1e6
    row = {"qtype": name, "ggml_type": qt.ggml_type, "variant": qt.variant, "bpw": qt.bpw,
           "rd_bound_dB": 6.02 * qt.bpw}
    # warm the JIT (and the numba cache) on a slice before timing
    formats.decode(name, formats.encode(name, gauss[:2], importance, codebooks=books), cols, codebooks=books)

    def enc(x, threads):
        return formats.encode(name, x, importance, codebooks=books, threads=threads)

    data = enc(gauss, all_cores)
    for label, n in (("1T", 1), ("all", all_cores)):
        row[f"encode_{label}_MBps"] = mb / _best_seconds(lambda: enc(gauss, n), repeat)
        with _threads(n):
            row[f"decode_{label}_MBps"] = mb / _best_seconds(
                lambda: formats.decode(name, data, cols, codebooks=books), repeat)
    row["sqnr_gauss_dB"] = sqnr_db(gauss, formats.decode(name, data, cols, codebooks=books))
    lap = enc(laplace, all_cores)
    row["sqnr_laplace_dB"] = sqnr_db(laplace, formats.decode(name, lap, cols, codebooks=books))
    return row


def run(rows: int, cols: int, repeat: int, only: list[str] | None = None, importance: bool = False) -> dict:
    rng = np.random.default_rng(20260731)
    gauss = rng.standard_normal((rows, cols), dtype=np.float32)
    laplace = rng.laplace(size=(rows, cols)).astype(np.float32)
    # an imatrix-like vector: log-normal per column
    imp = np.exp(1.5 * rng.standard_normal(cols)).astype(np.float32) if importance else None
    all_cores = numba.config.NUMBA_NUM_THREADS
    q4 = measure_q4_0(gauss, laplace, repeat)
    results = []
    for name, qt in formats.QTYPES.items():
        if not qt.can_encode or (only and name not in only):
            continue
        try:
            row = measure(name, gauss, laplace, repeat, all_cores, imp)
        except Exception as exc:  # a benchmark reports a broken codec and goes on
            row = {"qtype": name, "error": f"{type(exc).__name__}: {exc}"}
        for k in ("encode_1T", "encode_all", "decode_1T", "decode_all"):
            if f"{k}_MBps" in row:
                anchor = q4["encode_MBps" if k.startswith("encode") else "decode_MBps"]
                row[f"{k}_vs_q4_0"] = row[f"{k}_MBps"] / anchor
        results.append(row)
    return {"rows": rows, "cols": cols, "importance": importance, "input_MB": gauss.nbytes / 1e6, "cores": all_cores,
            "cpu_count": os.cpu_count(), "anchor": {Q4_0_NAME: q4}, "results": results}


def _finite(obj):
    """inf (a lossless SQNR) becomes null so the JSON stays standard."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _fmt_db(v: float) -> str:
    return "inf" if math.isinf(v) else f"{v:5.1f}"


def print_table(report: dict, out=sys.stdout) -> None:
    q4 = report["anchor"][Q4_0_NAME]
    print(f"input {report['rows']}x{report['cols']} float32 ({report['input_MB']:.1f} MB), "
          f"{'with' if report['importance'] else 'no'} importance vector, "
          f"all-core = {report['cores']} threads; MB/s of float32 input; "
          f"xQ4 = ratio to {Q4_0_NAME} (numpy, 1 thread): encode {q4['encode_MBps']:.0f} MB/s, "
          f"decode {q4['decode_MBps']:.0f} MB/s", file=out)
    head = (f"{'qtype':15s} {'bpw':>5s} | {'enc 1T':>7s} {'xQ4':>5s} {'enc all':>7s} {'xQ4':>5s} | "
            f"{'dec 1T':>7s} {'xQ4':>5s} {'dec all':>7s} {'xQ4':>5s} | "
            f"{'SQNR N':>6s} {'SQNR L':>6s} {'RD(N)':>6s}")
    print(head, file=out)
    print("-" * len(head), file=out)
    print(f"{'(Q4_0 anchor)':15s} {q4['bpw']:5.2f} | {q4['encode_MBps']:7.1f} {1:5.2f} {'':7s} {'':5s} | "
          f"{q4['decode_MBps']:7.1f} {1:5.2f} {'':7s} {'':5s} | {_fmt_db(q4['sqnr_gauss_dB']):>6s} "
          f"{_fmt_db(q4['sqnr_laplace_dB']):>6s} {q4['rd_bound_dB']:6.1f}", file=out)
    for r in report["results"]:
        if "error" in r:
            print(f"{r['qtype']:15s} error: {r['error']}", file=out)
            continue
        cells = []
        for k in ("encode_1T", "encode_all", "decode_1T", "decode_all"):
            cells.append(f"{r[f'{k}_MBps']:7.1f} {r[f'{k}_vs_q4_0']:5.2f}")
        print(f"{r['qtype']:15s} {r['bpw']:5.2f} | {cells[0]} {cells[1]} | {cells[2]} {cells[3]} | "
              f"{_fmt_db(r['sqnr_gauss_dB']):>6s} {_fmt_db(r['sqnr_laplace_dB']):>6s} "
              f"{r['rd_bound_dB']:6.1f}", file=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=4096, help="a multiple of 128")
    ap.add_argument("--repeat", type=int, default=3, help="best of N timed runs")
    ap.add_argument("--only", nargs="*", help="qtype names to measure (default: all)")
    ap.add_argument("--importance", action="store_true",
                    help="encode with a log-normal importance vector (imatrix-like)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    if args.cols <= 0 or args.cols % 128 or args.rows <= 0:
        ap.error("--rows must be positive and --cols a positive multiple of 128")
    report = run(args.rows, args.cols, args.repeat, args.only, args.importance)
    if args.json:
        print(json.dumps(_finite(report), indent=1, allow_nan=False))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
