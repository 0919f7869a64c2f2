"""Separate vs joint gate+up MIX codebooks on the shipped samples (``convert --gate-up-books``).

Converts each sample with rocmfp2_mix forced on every routed gate and up (down stays the
recipe's rocmfp3) twice, with one book pair per matrix ("separate", the default) and one pair
per expert shared by its gate and up ("joint", Lucebox's converter's rule), and prints the
gate+up SQNR and importance-weighted SQNR of each, and their difference. With ``--fidelity``
it also runs ``verify --fidelity --protocol exact-copy`` on samples/ds4-copy (KL, top-1,
exact copies against the transformers reference; minutes on a small CPU).

    python benchmarks/gateup_books.py [--fidelity] [--threads N]
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = {
    "ds4-tiny": (ROOT / "samples" / "ds4-tiny", ROOT / "samples" / "ds4-tiny-calib" / "imatrix.gguf"),
    "ds4-copy": (ROOT / "samples" / "ds4-copy", None),
}
FORCE = [r"ffn_(gate|up)_exps=rocmfp2_mix"]


def _db(e: float, s: float) -> float:
    return 10 * math.log10(s / e) if e > 0 and s > 0 else float("inf")


def gate_up_figures(rep) -> tuple[float, float]:
    """(SQNR dB, weighted SQNR dB) over the routed gate and up stacks of a ConvertReport."""
    e = s = we = ws = 0.0
    for r in rep.results:
        if "_gate_exps" in r.name or "_up_exps" in r.name:
            e, s = e + r.sse, s + r.ssx
            if r.wsse is not None:
                we, ws = we + r.wsse, ws + r.wssx
    return _db(e, s), (_db(we, ws) if ws else float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fidelity", action="store_true", help="also verify --fidelity on ds4-copy (slow)")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    from ds4quant.convert import convert
    from ds4quant.verify import verify

    with tempfile.TemporaryDirectory() as tmp:
        for sample, (src, imx) in SAMPLES.items():
            row = {}
            for how in ("separate", "joint"):
                out = Path(tmp) / f"{sample}-{how}"
                rep = convert(src, out, "rocmfp2-strix", threads=a.threads, imatrix=imx, tensor_types=FORCE,
                              gate_up_books=how)
                row[how] = gate_up_figures(rep)
                line = f"{sample:9s} {how:8s} gate+up SQNR {row[how][0]:7.3f} dB  weighted {row[how][1]:7.3f} dB"
                if a.fidelity and sample == "ds4-copy":
                    f = verify(out, source=src, fidelity=True, protocol="exact-copy").fidelity
                    ec = f.get("exact_copy") or {}
                    line += (f"  KL {f['kl_mean']:.5f}  top-1 {100 * f['top1']:.2f}%  exact-copy "
                             f"{ec.get('passes')}/{ec.get('trials')} (source {ec.get('reference_passes')})")
                print(line, flush=True)
            d = row["joint"][0] - row["separate"][0]
            dw = row["joint"][1] - row["separate"][1]
            print(f"{sample:9s} joint - separate: SQNR {d:+.3f} dB, weighted {dw:+.3f} dB", flush=True)


if __name__ == "__main__":
    main()
