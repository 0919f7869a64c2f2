"""One-shot cluster jobs: the MoE layers of an artifact on N ranks, inputs known up front.

    from ds4quant.runtime.cluster import run_cluster_layers
    run = run_cluster_layers("out/art", "cluster.json", tokens=8, n_ranks=2)   # gloo on localhost
    run.sha256[2], run.outputs[2]          # layer 2's MoE output: sha256, float32 [T, H]

This is ``ds4quant run ART --ranks N --placement P``; each rank runs
``rank.run_job`` (``entry`` starts it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ds4quant.errors import BadInputError
from ds4quant.runtime.cluster.launch import launch
from ds4quant.runtime.mode import Mode

__all__ = ["ClusterRun", "run_cluster_jobs", "run_cluster_layers", "result_lines"]


@dataclass(frozen=True)
class ClusterRun:
    """One job's result: per-layer MoE outputs (float32 [T, H]) and sha256,
    and each rank's report (experts held, bytes read/resident, per-layer
    timings: route, compute, exchange, combine)."""

    n_ranks: int
    mode: str  # the Mode's value
    outputs: Mapping[int, np.ndarray]
    sha256: Mapping[int, str]
    ranks: tuple[dict, ...]
    wall_s: float = 0.0
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_json(self) -> dict:
        """Without the outputs (they go to an .npz)."""
        return {"n_ranks": self.n_ranks, "mode": self.mode, "wall_s": self.wall_s,
                "fingerprint": self.ranks[0]["fingerprint"], "placement_sha256": self.ranks[0]["placement_sha256"],
                "layers": [{"layer": L, "sha256": self.sha256[L],
                            **{k: max(r["layers"][i][k] for r in self.ranks)
                               for k in ("total_s", "route_s", "compute_s", "exchange_s", "combine_s")}}
                           for i, L in enumerate(sorted(self.sha256))],
                "ranks": [{k: v for k, v in r.items() if k != "holdings"} for r in self.ranks],
                "notes": list(self.notes)}


def _inputs(hidden_by_layer, tokens, token_ids, routing, seed) -> tuple[dict, Optional[dict]]:
    """(spec fields, npz arrays)."""
    if hidden_by_layer is None:
        if tokens is None:
            raise BadInputError("give hidden_by_layer (with token_ids) or tokens (a count)")
        if not isinstance(tokens, int) or not 1 <= tokens <= 1 << 20:
            raise BadInputError(f"must be a token count in 1..2^20, got {tokens!r}", where="--tokens")
        if routing:
            raise BadInputError("routing needs explicit hidden_by_layer")
        return {"tokens": tokens, "seed": int(seed)}, None
    arrays: dict[str, np.ndarray] = {}
    if isinstance(hidden_by_layer, Mapping):
        for L, x in hidden_by_layer.items():
            arrays[f"hidden_{int(L)}"] = _np32(x)
        T = next(iter(arrays.values())).shape[0]
    else:
        arrays["hidden"] = _np32(hidden_by_layer)
        T = arrays["hidden"].shape[0]
    arrays["token_ids"] = (np.zeros(T, np.int64) if token_ids is None
                           else np.asarray(_np(token_ids), dtype=np.int64).reshape(-1))
    for L, (idx, w) in (routing or {}).items():
        arrays[f"idx_{int(L)}"] = np.asarray(_np(idx), dtype=np.int64)
        arrays[f"w_{int(L)}"] = _np32(w)
    return {}, arrays


def _np(x) -> np.ndarray:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def _np32(x) -> np.ndarray:
    a = np.ascontiguousarray(_np(x), dtype=np.float32)
    if a.ndim != 2:
        raise BadInputError(f"hidden must be [T, H], got shape {a.shape}")
    return a


def run_cluster_jobs(jobs: Sequence[Mapping[str, Any]], n_ranks: int, hidden_by_layer=None, tokens=None, *,
                     token_ids=None, routing=None, seed: int = 0, timeout_s: float = 60, backend: str = "gloo",
                     launcher: str = "spawn", env: Optional[Mapping[str, str]] = None,
                     threads: Optional[int] = None, rank_jobs=None, verify_payloads: bool = True,
                     progress=None) -> list[ClusterRun]:
    """Several jobs ({artifact, placement, mode, layers, owners, holdings}) in
    one process group (one start-up for many placements); see run_cluster_layers.
    verify_payloads: hash each artifact's files against its manifest here, once,
    before any rank starts (``runtime.integrity``; ``progress`` is told of each file);
    False: the caller checked them."""
    if backend not in ("gloo", "nccl"):
        raise BadInputError(f"must be gloo or nccl, got {backend!r}", where="--backend")
    clean = []
    for job in jobs:
        mode = Mode.parse(job.get("mode", Mode.EXACT), where="--mode")
        clean.append({"artifact": str(job["artifact"]), "placement": str(job["placement"]), "mode": mode.value,
                      "layers": list(job["layers"]) if job.get("layers") else None,
                      "owners": list(job["owners"]) if job.get("owners") else None,
                      "holdings": bool(job.get("holdings")), "route": job.get("route", "broadcast"),
                      "verify_payloads": False})  # checked below, once for every rank of this host
    if verify_payloads:
        from ds4quant.artifact.view import open_artifact
        from ds4quant.runtime.integrity import check_payloads

        for art in dict.fromkeys(j["artifact"] for j in clean):
            with open_artifact(art) as v:
                check_payloads(v, progress=progress)
    fields, arrays = _inputs(hidden_by_layer, tokens, token_ids, routing, seed)
    t0 = time.perf_counter()
    res = launch({"jobs": clean, "backend": backend, **fields}, n_ranks, inputs=arrays, timeout_s=timeout_s,
                 launcher=launcher, env=env, threads=threads, rank_jobs=rank_jobs)
    wall = time.perf_counter() - t0
    runs = []
    for job, r in zip(clean, res):
        ranks = tuple(r["ranks"])
        sha = {int(t["layer"]): t["sha256"] for t in ranks[0]["layers"]}
        runs.append(ClusterRun(n_ranks, job["mode"], r["outputs"], sha, ranks, wall_s=wall))
    return runs


def run_cluster_layers(artifact, placement, hidden_by_layer=None, tokens=None, n_ranks: int = 2,
                       mode: "Mode | str" = Mode.EXACT, timeout_s: float = 60, **kw) -> ClusterRun:
    """The MoE layers of ``artifact`` on ``n_ranks`` ranks of rank placement
    ``placement`` (a file): per-layer outputs, sha256 and rank reports.

    hidden_by_layer: {layer: f32 [T, H]} or one [T, H] for every layer (with
    ``token_ids`` [T] for the hash layers; ``routing`` {layer: (idx, w)}
    overrides the router, else rank 0 routes and broadcasts); or ``tokens``: a count of seeded synthetic
    tokens. kw: layers, owners (local owner names per rank, ``{local_rank}``
    substituted, e.g. ["cuda:{local_rank}"] or ["torch-cpu:0", "cpu:1"]),
    backend (gloo | nccl), launcher (spawn | torchrun), seed, env, threads,
    holdings (report digests of every held expert), verify_payloads (see
    ``run_cluster_jobs``). This is what verify's
    fidelity stage calls for ``--placement cluster.json``."""
    job_keys = ("layers", "owners", "holdings", "route")
    job = {"artifact": artifact, "placement": placement, "mode": mode, **{k: kw.pop(k) for k in job_keys if k in kw}}
    return run_cluster_jobs([job], n_ranks, hidden_by_layer, tokens, timeout_s=timeout_s, **kw)[0]


def result_lines(run: ClusterRun) -> list[str]:
    j = run.to_json()
    lines = [f"{run.n_ranks} ranks, {run.mode} mode, placement {j['placement_sha256'][:16]}"]
    for lay in j["layers"]:
        lines.append(f"layer {lay['layer']}: sha256 {lay['sha256']}  {1e3 * lay['total_s']:.2f} ms "
                     f"(exchange {1e3 * lay['exchange_s']:.2f} ms)")
    for r in j["ranks"]:
        lines.append(f"rank {r['rank']}: read {r['expert_bytes_read']:,} expert bytes (share {r['share_bytes']:,}) "
                     f"+ {r['dense_bytes_read']:,} dense; resident {sum(r['resident_bytes'].values()):,}")
    return lines
