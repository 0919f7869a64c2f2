"""Measure what expert quantization costs samples/ds4-copy on the exact-copy protocol.

    python samples/measure_ds4_copy.py --work /tmp/ds4-copy-measure   # prints one JSON line per artifact

1. calibrate the FP4 source on copy-task prompts (training distribution, a
   calibration seed; never the protocol's identifiers) -> imatrix + routing;
2. convert it: rocmfp2-strix (rocmfp2 gate/up + rocmfp3 down), rocmfp2 on every
   routed expert (rocmfp2-strix with the down experts overridden; with the
   imatrix, and without it: "rocmfp2-no-imatrix"), mxfp4
   (lossless repack), adaptive at rocmfp2-strix's expert bits per weight
   (allocated by predicted KL from the calibration's sensitivity.json, and
   once more without it: "adaptive-unweighted");
3. decode each artifact's routed experts with ds4quant.formats.decode (MIX
   tensors with their books from the artifact's codebook table) into the
   transformers model loaded from the source (dense weights stay the source's),
   and run the exact-copy protocol (runtime/fidelity.py) on it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
SAMPLE = HERE / "ds4-copy"
STRIX_BPW = (2 * 2.5 + 3.5) / 3  # rocmfp2 (2.5 bpw) gate/up + rocmfp3 (3.5 bpw) down


def calibration_tokens(task, n: int, seed: int) -> list[list[int]]:
    import train_ds4_copy as tr
    from ds4quant.runtime import fidelity as fd

    rng = random.Random(f"ds4-copy/calibration/{seed}")
    excluded = frozenset(fd.protocol_identifiers())
    out = []
    while len(out) < n:
        ids, _ = tr.make_example(rng, task, excluded)
        if len(ids) > 40:  # structured-text documents are short; keep copy prompts
            out.append(ids)
    return out


def load_model(src: Path):
    import torch
    import transformers
    from transformers import DeepseekV4ForCausalLM

    transformers.logging.set_verbosity_error()
    return DeepseekV4ForCausalLM.from_pretrained(str(src), dtype=torch.float32,
                                                 experts_implementation="eager").eval()


def decode_experts_into(model, art: Path) -> dict:
    """Overwrite every layer's routed experts with the artifact's decoded weights; -> qtypes per tensor."""
    import torch

    from ds4quant import formats
    from ds4quant.artifact import read_gguf_set
    from ds4quant.codebooks import read_table
    from ds4quant.names import KEY_CODEBOOKS, expert_ids_key

    gguf = next(p for p in sorted(art.iterdir()) if p.suffix == ".gguf")
    g = read_gguf_set(gguf)
    table = read_table(np.asarray(g.kv[KEY_CODEBOOKS].value, dtype=np.uint8).tobytes()) if KEY_CODEBOOKS in g.kv else None
    qtypes = {}
    seen = set()
    for name, info in g.tensors.items():
        parts = name.split(".")
        if len(parts) < 3 or not parts[2].endswith("_exps"):
            continue
        layer, surface = int(parts[1]), parts[2][len("ffn_"):-len("_exps")]
        key = expert_ids_key(name)
        ids = list(g.kv[key].value) if key in g.kv else list(range(info.shape[2]))
        cols = info.shape[0]
        data = np.asarray(g.tensor_data(name)).reshape(len(ids), -1)
        experts = model.model.layers[layer].mlp.experts
        inter = experts.intermediate_dim
        qtypes[name] = info.qtype
        for local, e in enumerate(ids):
            if formats.get_qtype(info.qtype).is_mix:
                entry = table[name]
                w = formats.decode(info.qtype, data[local], cols, entry.books[local], modes=int(entry.modes[local]))
            else:
                w = formats.decode(info.qtype, data[local], cols)
            t = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
            with torch.no_grad():
                if surface == "gate":
                    experts.gate_up_proj[e, :inter].copy_(t)
                elif surface == "up":
                    experts.gate_up_proj[e, inter:].copy_(t)
                else:
                    experts.down_proj[e].copy_(t)
            seen.add((layer, surface, e))
    n_layer = len(model.model.layers)
    n_exp = model.model.layers[0].mlp.experts.num_experts
    if len(seen) != n_layer * 3 * n_exp:
        raise SystemExit(f"{art}: the artifact covers {len(seen)} of {n_layer * 3 * n_exp} expert matrices")
    return qtypes


def main(argv=None) -> int:
    import torch

    from ds4quant.plan import AdaptiveOptions
    from ds4quant.calibrate import calibrate
    from ds4quant.convert import convert
    from ds4quant.runtime import fidelity as fd
    from ds4quant.runtime.copy_sets import copy_sets

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", default=str(SAMPLE))
    ap.add_argument("--work", required=True)
    ap.add_argument("--calib-seqs", type=int, default=48)
    ap.add_argument("--calib-seed", type=int, default=7)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--copy-sets", type=int, default=5,
                    help="seeded identifier sets of 60 trials, the protocol's own first (runtime/copy_sets.py)")
    ap.add_argument("--fit-iterations", type=int, default=None, help="MIX codebook fitting iterations (library default)")
    ap.add_argument("--fit-max-rows", type=int, default=None, help="rows the MIX fitter samples (library default)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    src, work = Path(args.source), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    task = fd.CopyTask.from_json(src / "task.json")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src))

    def score(model):
        """(the protocol's own set's result, the figures over --copy-sets identifier sets, seconds)."""
        t = time.perf_counter()
        sets, r = copy_sets(model, tok, task, args.copy_sets)
        lo, hi = sets.interval
        fig = {"exact_copy": r.score, "sets": list(sets.passes), "per60": round(sets.per60, 2),
               "interval95": [round(lo, 2), round(hi, 2)], "spread": [min(sets.passes), max(sets.passes)]}
        return r, fig, time.perf_counter() - t

    r, fig, s = score(load_model(src))
    print(json.dumps({"artifact": "source (FP4 experts, FP8 dense)", **fig, "seconds": round(s, 1)}), flush=True)
    calib = work / "calib"
    if not all((calib / f).exists() for f in ("imatrix.gguf", "sensitivity.json")):
        t = time.perf_counter()
        calibrate(src, calibration_tokens(task, args.calib_seqs, args.calib_seed), calib)
        print(json.dumps({"calibrate_seconds": round(time.perf_counter() - t, 1)}), flush=True)
    imx = calib / "imatrix.gguf"
    fit = {k: v for k, v in (("fit_iterations", args.fit_iterations), ("fit_max_rows", args.fit_max_rows))
           if v is not None}
    runs = {
        "mxfp4": dict(recipe="mxfp4"),
        "rocmfp2-strix": dict(recipe="rocmfp2-strix", imatrix=imx),
        "rocmfp2": dict(recipe="rocmfp2-strix", imatrix=imx, tensor_types=[r"ffn_down_exps=rocmfp2"]),
        # the uniform recipe as convert runs it without --imatrix
        "rocmfp2-no-imatrix": dict(recipe="rocmfp2-strix", tensor_types=[r"ffn_down_exps=rocmfp2"]),
        "adaptive": dict(recipe="adaptive", imatrix=imx, adaptive=AdaptiveOptions(
            target_bpw=STRIX_BPW, routing=str(calib / "routing.csv"), cache_dir=str(work / "cache"),
            sensitivity=str(calib / "sensitivity.json"), **fit)),
        # the same without the sensitivity gains: every tensor's weighted error counts the same
        "adaptive-unweighted": dict(recipe="adaptive", imatrix=imx, adaptive=AdaptiveOptions(
            target_bpw=STRIX_BPW, routing=str(calib / "routing.csv"), cache_dir=str(work / "cache"), **fit)),
    }
    for label, kw in runs.items():
        if args.only and label not in args.only:
            continue
        out = work / label
        t = time.perf_counter()
        rep = convert(src, out, kw.pop("recipe"), force=True, **kw)
        conv_s = time.perf_counter() - t
        model = load_model(src)
        qtypes = decode_experts_into(model, out)
        r, fig, s = score(model)
        print(json.dumps({"artifact": label, **fig, "bpw_experts": round(rep.bpw_experts, 4),
                          "expert_bytes": rep.expert_bytes, "codebook_bytes": rep.codebook_bytes,
                          "bytes": rep.bytes, "expert_weighted_sqnr_db": rep.to_json()["expert_weighted_sqnr_db"],
                          "convert_seconds": round(conv_s, 1), "protocol_seconds": round(s, 1),
                          "qtypes": sorted(set(qtypes.values())),
                          "failed_example": r.to_json()["failed"][:1]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
