"""The main job on the shipped sample (``bash scripts/demo.sh`` runs this).

Converts samples/ds4-tiny uniform (rocmfp2-strix) and adaptive at the same
expert size (with the sample's calibration imatrix and routing profile),
verifies both against the source, publishes the adaptive one, and prints a
side-by-side table with the paths of the reports.

    python scripts/demo.py [--out DIR] [--json]

A script, not part of the library: it prints and sets the exit status.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "samples" / "ds4-tiny"
CALIB = ROOT / "samples" / "ds4-tiny-calib"


def run(out: Path) -> dict:
    """Run the pipeline into ``out``; return the rows of the summary table."""
    from ds4quant.adaptive import AdaptiveOptions
    from ds4quant.convert import convert
    from ds4quant.publish import publish
    from ds4quant.report import write_report
    from ds4quant.verify import verify

    imatrix = CALIB / "imatrix.gguf"
    routing = CALIB / "routing.csv"
    out.mkdir(parents=True, exist_ok=True)
    rows = []

    t0 = time.perf_counter()
    strix = convert(SAMPLE, out / "uniform", "rocmfp2-strix", imatrix=imatrix, force=True,
                    command=["ds4quant", "convert", str(SAMPLE), str(out / "uniform"), "--recipe", "rocmfp2-strix",
                             "--imatrix", str(imatrix)])
    t_strix = time.perf_counter() - t0
    target = strix.bpw_experts
    t0 = time.perf_counter()
    adaptive = convert(
        SAMPLE, out / "adaptive", "adaptive", imatrix=imatrix, force=True,
        adaptive=AdaptiveOptions(target_bpw=target, routing=str(routing), cache_dir=str(out / ".measure-cache")),
        command=["ds4quant", "convert", str(SAMPLE), str(out / "adaptive"), "--recipe", "adaptive",
                 "--target-bpw", f"{target!r}", "--imatrix", str(imatrix), "--routing", str(routing)],
    )
    t_adaptive = time.perf_counter() - t0

    for label, rep, secs in (("uniform rocmfp2-strix", strix, t_strix), ("adaptive (same size)", adaptive, t_adaptive)):
        report_dir = out / "reports" / rep.artifact.name
        report_dir.parent.mkdir(parents=True, exist_ok=True)
        v = verify(rep.artifact, source=SAMPLE, imatrix=imatrix)
        write_report(v, report_dir)
        s = v.summary
        j = rep.to_json()
        rows.append({
            "artifact": label,
            "path": str(rep.artifact),
            "bpw_experts": rep.bpw_experts,
            "bytes": rep.bytes,
            "expert_sqnr_db": s["expert_sqnr_db"],
            "weighted_rel_error": s["expert_weighted_rel_error"],
            "weighted_sqnr_db": j["expert_weighted_sqnr_db"],
            "convert_seconds": secs,
            "verify_ok": v.ok,
            "report": str(report_dir / "report.md"),
            "runtimes": list(rep.runtimes),
        })
    release = publish(adaptive.artifact, out / "release-adaptive", source=SAMPLE, imatrix=imatrix, overwrite=True)
    routed = adaptive.adaptive or {}
    return {"rows": rows, "release": str(release.release),
            "adaptive_plan": {"qtype_share": routed.get("qtype_share"), "slack": routed.get("slack"),
                              "fitter_comparison": routed.get("fitter_comparison")}}


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/demo.py", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "out" / "demo"), help="output folder (default out/demo)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    from ds4quant.errors import Ds4quantError

    try:
        res = run(Path(args.out))
    except Ds4quantError as exc:
        print(f"demo: error: {exc.one_line()}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    hdr = f"{'artifact':<24} {'expert bpw':>10} {'bytes':>11} {'SQNR dB':>8} {'wSQNR dB':>9} {'w.rel.err':>10} {'seconds':>8}  verify"
    print(hdr)
    print("-" * len(hdr))
    for r in res["rows"]:
        print(f"{r['artifact']:<24} {r['bpw_experts']:>10.4f} {r['bytes']:>11,} {_fmt(r['expert_sqnr_db'], '8.2f')} "
              f"{_fmt(r['weighted_sqnr_db'], '9.2f')} {_fmt(r['weighted_rel_error'], '10.5f')} "
              f"{r['convert_seconds']:>8.1f}  {'ok' if r['verify_ok'] else 'FAILED'}")
    print()
    for r in res["rows"]:
        print(f"{r['artifact']}: {r['path']} (loadable by {', '.join(r['runtimes'])}); report {r['report']}")
    print(f"release (adaptive): {res['release']}")
    share = res["adaptive_plan"]["qtype_share"] or {}
    print("adaptive qtype share: " + ", ".join(f"{q} {100 * v:.0f}%" for q, v in share.items()))
    return 0 if all(r["verify_ok"] for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
