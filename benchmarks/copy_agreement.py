"""Teacher-forced vs token-by-token exact copy, trial for trial, on samples/ds4-copy
artifacts run through the bundled runtime (one CPU owner, fast mode).

    python benchmarks/copy_agreement.py [--out out/agree] [--sets 1]

Artifacts: the source itself, mxfp4, rocmfp2-strix, and rocmfp2 on every expert
(rocmfp2-strix with the down projections at rocmfp2 too). Prints, per artifact
and identifier set, both scores and whether every trial agrees (same pass/fail,
same first diverging position, same preferred token).
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPY = ROOT / "samples" / "ds4-copy"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "out" / "agree"))
    ap.add_argument("--sets", type=int, default=1)
    a = ap.parse_args()
    out = Path(a.out)
    from transformers import AutoTokenizer

    from ds4quant import runtime
    from ds4quant.artifact.view import ArtifactView, locate
    from ds4quant.convert import convert
    from ds4quant.runtime import fidelity as fd
    from ds4quant.runtime.reference import load_reference
    from ds4quant.verify import _candidate as C

    arts = {"mxfp4": ("mxfp4", ()), "rocmfp2-strix": ("rocmfp2-strix", ()),
            "rocmfp2 every expert": ("rocmfp2-strix", ("ffn_down_exps=rocmfp2",))}
    tok = AutoTokenizer.from_pretrained(str(COPY))
    task = fd.CopyTask.from_json(COPY / "task.json")
    with C.one_thread():
        ref = load_reference(COPY)
    runs = [("source", ref, None)]
    for name, (recipe, tt) in arts.items():
        p = out / name.replace(" ", "-")
        if not (p / "manifest.json").is_file():
            convert(COPY, p, recipe, tensor_types=tt, force=True, command=["benchmarks/copy_agreement.py"])
        runs.append((name, None, p))
    for name, model, path in runs:
        with C.one_thread():
            rt = None
            if path is not None:
                view = ArtifactView(locate(path))
                model = copy.deepcopy(ref)
                C.dense_into(model, view)
                rt = runtime.load(view, None, "fast")
                C.swap_all(model, rt.__enter__())
            for s in range(a.sets):
                seed = fd.PROTOCOL_SEED + s
                t0 = time.perf_counter()
                tf = fd.exact_copy(model, tok, task, seed=seed)
                t1 = time.perf_counter()
                gen = fd.exact_copy(model, tok, task, seed=seed, generate=True)
                t2 = time.perf_counter()
                key = lambda r: [(f.identifier, f.repeat, f.position, f.preferred) for f in r.failures]  # noqa: E731
                print(f"{name:22s} set {s}: teacher-forced {tf.score} ({t1 - t0:.1f} s), generated {gen.score} "
                      f"({t2 - t1:.1f} s), trial for trial {'agree' if key(tf) == key(gen) else 'DIFFER'}",
                      flush=True)
            if rt is not None:
                rt.__exit__(None, None, None)


if __name__ == "__main__":
    main()
