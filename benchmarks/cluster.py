"""Benchmark the expert-parallel cluster: MoE layer latency at batch 1
and 64 and bytes resident per rank for 1, 2 and 4 gloo ranks on localhost.

    python benchmarks/cluster.py            # DS4 layer shapes (hidden 4096, expert 2048, top-6), 32 experts
    python benchmarks/cluster.py --quick    # tiny shapes (hidden 256, expert 128, top-4, 16 experts): a smoke run
    python benchmarks/cluster.py --ranks 1,2 --batches 1,64 --repeat 5 --json

A synthetic DS4-shaped source (samples/make_synthetic.py; two layers, layer
1 top-k routed; the expert count is smaller than DS4's 256 so it fits a
workstation, and is printed) is converted with rocmfp2-strix; each rank
count gets a uniform rank placement (e -> e % N). Per (ranks, batch) one
process group runs layer 1 ``repeat`` + 1 times on seeded hidden states;
the first call is dropped (warm-up), the median of the rest is reported,
as the slowest rank's time per call (route on rank 0 + broadcast, the
rank's slots, the all_gather exchange, the canonical combine). The
exchange time includes waiting for the slowest peer (load imbalance), so
its share is an upper bound on the transfer's cost. Fast mode runs beside
exact at each point and its relative distance from exact is printed.
All ranks share one host's cores here: with N ranks on C cores each rank
gets C // N threads, so this measures the protocol, not N machines.

The second table is the persistent rank group (``runtime.cluster.group``,
what ``verify --fidelity --placement cluster.json`` uses): the ranks' start-up
(imports, rendezvous, loading the shards) paid once, then the median wall
time of one layer call as the caller sees it (hidden and routing to rank 0,
broadcast, slots, all_gather, combine, result back) at each batch.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "samples"))

FULL = dict(layers=2, experts=32, hidden=4096, moe_inter=2048, topk=6, hash_layers=1)
QUICK = dict(layers=2, experts=16, hidden=256, moe_inter=128, topk=4, hash_layers=1)
LAYER = 1


def make_artifact(work: Path, dims: dict) -> Path:
    import make_synthetic
    from ds4quant.convert import convert

    src, art = work / "source", work / "strix"
    if not src.exists():
        make_synthetic.make_synthetic(src, make_synthetic.preset("tiny", **dims))
    if not art.exists():
        convert(src, art, "rocmfp2-strix")
    return art


def placement(art: Path, n: int, work: Path) -> Path:
    from ds4quant.artifact.view import open_artifact
    from ds4quant.deploy.place import artifact_fingerprint
    from ds4quant.calib.routing import RoutingProfile
    from ds4quant.runtime.placement import write_placement
    from ds4quant.runtime.planning import plan_ranks

    with open_artifact(art) as v:
        h, fp = v.header, artifact_fingerprint(v)
    prof = RoutingProfile(h.n_layer, h.n_expert, h.n_expert_used, np.ones((h.n_layer, h.n_expert), np.uint64))
    return write_placement(work / f"ranks{n}.json", plan_ranks(prof, n, "uniform", 0, owner="torch-cpu:0",
                                                               artifact=fp))


def _median(run, key: str) -> float:
    per_call = [max(r["layers"][i][key] for r in run.ranks) for i in range(1, len(run.ranks[0]["layers"]))]
    return float(np.median(per_call))


def bench(art: Path, plc: Path, n: int, batch: int, repeat: int, timeout: float) -> dict:
    from ds4quant.runtime.cluster import run_cluster_jobs

    job = {"artifact": art, "placement": plc, "layers": [LAYER] * (repeat + 1)}
    exact, fast = run_cluster_jobs([job, {**job, "mode": "fast"}], n, tokens=batch, seed=batch, timeout_s=timeout)
    a, b = fast.outputs[LAYER], exact.outputs[LAYER]
    tot = _median(exact, "total_s")
    xch = _median(exact, "exchange_s")
    return {"ranks": n, "batch": batch, "exact_ms": 1e3 * tot, "exchange_ms": 1e3 * xch,
            "exchange_share": xch / tot if tot else 0.0, "fast_ms": 1e3 * _median(fast, "total_s"),
            "fast_rel_distance": float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)),
            "sha256": exact.sha256[LAYER],
            "resident_bytes": [sum(r["resident_bytes"].values()) for r in exact.ranks],
            "expert_bytes_read": [r["expert_bytes_read"] for r in exact.ranks],
            "dense_bytes_read": [r["dense_bytes_read"] for r in exact.ranks]}


def bench_group(art: Path, plc: Path, n: int, batches, repeat: int, timeout: float) -> list[dict]:
    import time

    import torch

    from ds4quant import runtime
    from ds4quant.runtime.cluster import ClusterOptions

    rows = []
    t0 = time.perf_counter()
    with runtime.load(art, plc, "exact", cluster=ClusterOptions(timeout_s=timeout, threads=None)) as grp:
        start = time.perf_counter() - t0
        from ds4quant.artifact.view import open_artifact

        with open_artifact(art) as v:
            h = v.header
        for b in batches:
            g = torch.Generator().manual_seed(b)
            x = torch.randn((b, h.hidden), generator=g)
            idx = torch.stack([torch.randperm(h.n_expert, generator=g)[:h.n_expert_used] for _ in range(b)])
            w = torch.rand((b, h.n_expert_used), generator=g)
            walls = [grp.run_layer(LAYER, x, idx, w).wall_s for _ in range(repeat + 1)][1:]
            rows.append({"ranks": n, "batch": b, "start_s": start, "call_ms": 1e3 * float(np.median(walls)),
                         "expert_bytes_read": [r["expert_bytes_read"] for r in grp.ranks]})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes")
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--work", default=None, help="folder for the source and artifact (kept; default: a temp dir)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    dims = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory(prefix="ds4q-bench-cluster-") as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        art = make_artifact(work, dims)
        rows, group = [], []
        batches = [int(v) for v in args.batches.split(",")]
        for n in [int(v) for v in args.ranks.split(",")]:
            plc = placement(art, n, work)
            for b in batches:
                rows.append(bench(art, plc, n, b, args.repeat, args.timeout))
            group += bench_group(art, plc, n, batches, args.repeat, args.timeout)
    same = {b: len({r["sha256"] for r in rows if r["batch"] == b}) == 1 for b in {r["batch"] for r in rows}}
    out = {"dims": dims, "layer": LAYER, "rows": rows, "group": group, "exact_bytes_equal_across_ranks": same}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"synthetic DS4-shaped layer: {dims} (layer {LAYER}, rocmfp2-strix, torch-cpu owners, gloo)")
    print(f"{'ranks':>5} {'batch':>5} {'exact ms':>9} {'exchange':>9} {'share':>6} {'fast ms':>8} "
          f"{'fast dist':>9}  resident / expert bytes read per rank")
    for r in rows:
        print(f"{r['ranks']:>5} {r['batch']:>5} {r['exact_ms']:>9.2f} {r['exchange_ms']:>9.2f} "
              f"{100 * r['exchange_share']:>5.1f}% {r['fast_ms']:>8.2f} {r['fast_rel_distance']:>9.2e}  "
              f"{r['resident_bytes']} / {r['expert_bytes_read']}")
    print(f"exact-mode sha256 equal across rank counts per batch: {same}")
    print("persistent rank group (verify's path): start-up once, then per layer call as the caller sees it")
    print(f"{'ranks':>5} {'batch':>5} {'start s':>8} {'call ms':>9}")
    for r in group:
        print(f"{r['ranks']:>5} {r['batch']:>5} {r['start_s']:>8.2f} {r['call_ms']:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
