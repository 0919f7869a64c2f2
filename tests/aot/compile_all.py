"""The ahead-of-time compile check's command line (run without TRITON_INTERPRET):

    python tests/aot/compile_all.py [--targets hip:gfx1151,cuda:90] [--scenarios a,b]
                                    [--first] [--jobs N] [--json OUT]

Captures the catalogue's specialisations (``runtime/kernels/catalog.py``),
compiles each for each target and checks the machine-code rules; writes the
results as JSON and exits 1 when a compile fails or a rule is broken.
``--first``: one specialisation per (kernel, scenario), the always-on subset."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict


def main(argv=None) -> int:
    from ds4quant.runtime.kernels import aot, catalog

    ap = argparse.ArgumentParser(prog="tests/aot/compile_all.py")
    ap.add_argument("--targets", default=",".join(map(catalog.target_name, catalog.TARGETS)))
    ap.add_argument("--scenarios", default="")
    ap.add_argument("--first", action="store_true")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--json", default="")
    ap.add_argument("--capture-only", action="store_true", help="list the specialisations, compile nothing")
    ap.add_argument("--exclude", default="", help="kernels to leave out (comma-separated names)")
    a = ap.parse_args(argv)
    targets = [aot.target(t) for t in a.targets.split(",") if t]
    t0 = time.perf_counter()
    specs = catalog.capture([s for s in a.scenarios.split(",") if s] or None)
    if a.first:
        specs = aot.representative(specs)
    specs = [s for s in specs if s.kernel not in set(a.exclude.split(","))]
    results = [] if a.capture_only else aot.compile_specs(specs, targets, a.jobs)
    doc = dict(seconds=round(time.perf_counter() - t0, 2), specs=len(specs),
               targets=[catalog.target_name(t) for t in targets],
               captured=[dict(module=s.module, kernel=s.kernel, label=s.label, scenario=s.scenario) for s in specs],
               results=[asdict(r) for r in results])
    if a.json:
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, a.json)
    bad = [r for r in results if not r.ok or r.findings]
    for r in bad:
        sys.stderr.write(f"{r.target} {r.label}: {r.error or '; '.join(r.findings[:3])}\n")
    sys.stdout.write(f"{len(results)} compiles of {len(specs)} specialisations in {doc['seconds']} s, "
                     f"{len(bad)} failing\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
