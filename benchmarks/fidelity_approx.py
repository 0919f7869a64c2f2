"""Price runtimes' routing shortcuts on samples/ds4-tiny (top-4 of 16 experts):
verify --fidelity figures for K below and above the model's k and for 2 and 4
dropped experts per layer, for the mxfp4 and the adaptive artifact, each beside
the same artifact unmodified.

    python benchmarks/fidelity_approx.py [--out out/approx]

The dropped experts are the n highest-numbered of every MoE layer (hash-routed
layers keep their table; a dropped expert there gets weight 0).
Prints one table (markdown); same inputs -> same table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "samples" / "ds4-tiny"
CALIB = ROOT / "samples" / "ds4-tiny-calib"


def artifacts(out: Path) -> dict:
    arts = {"mxfp4": out / "mxfp4", "adaptive": out / "adaptive"}
    cmds = {"mxfp4": ["--recipe", "mxfp4"],
            "adaptive": ["--recipe", "adaptive", "--target-bpw", "2.8", "--imatrix", str(CALIB / "imatrix.gguf"),
                         "--routing", str(CALIB / "routing.csv")]}
    for name, path in arts.items():
        if not (path / "manifest.json").is_file():
            subprocess.run([sys.executable, "-m", "ds4quant", "convert", str(TINY), str(path), "--force", *cmds[name]],
                           check=True)
    return arts


def drop_file(out: Path, n: int) -> Path:
    cfg = json.loads((TINY / "config.json").read_text())
    n_exp = cfg["n_routed_experts"]
    layers = [i for i, t in enumerate(cfg.get("mlp_layer_types", [])) if t != "hash_moe"] or \
        list(range(cfg["num_hidden_layers"]))
    p = out / f"drop{n}.json"
    p.write_text(json.dumps({str(L): list(range(n_exp - n, n_exp)) for L in layers}))
    return p


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "out" / "approx"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from ds4quant.verify import verify

    rows = []
    for name, art in artifacts(out).items():
        for label, kw in (("K=2", {"experts_per_token": 2}), ("K=6", {"experts_per_token": 6}),
                          ("drop 2/layer", {"drop_experts": drop_file(out, 2)}),
                          ("drop 4/layer", {"drop_experts": drop_file(out, 4)})):
            f = verify(art, source=TINY, fidelity=True, mode="fast", **kw).fidelity
            k0, k1 = f.kl, f.approximation.kl
            rows.append(f"| {name} | {label} | {k0.kld_mean:.4f} -> {k1.kld_mean:.4f} | {100 * k0.same_top1:.2f} -> "
                        f"{100 * k1.same_top1:.2f} | {100 * k0.rms_dp:.3f} -> {100 * k1.rms_dp:.3f} | "
                        f"{k0.ppl_ratio:.4f} -> {k1.ppl_ratio:.4f} |")
            print(rows[-1], flush=True)
    print("| artifact | shortcut | KLD mean | same top-1 % | RMS dp % | PPL ratio |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
