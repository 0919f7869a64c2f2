"""Expert-parallel cluster on torch.distributed: N ranks give the single-process bytes.

    from ds4quant.runtime.cluster import run_cluster_layers
    run = run_cluster_layers("out/art", "cluster.json", tokens=8, n_ranks=2)   # gloo on localhost
    run.sha256[2], run.outputs[2]          # layer 2's MoE output: sha256, float32 [T, H]
    run.ranks[1]["expert_bytes_read"]      # what rank 1 read (its share: run.ranks[1]["share_bytes"])

or, started by torchrun (one process per rank; rank 0 writes RESULT.json)::

    torchrun --nproc-per-node 2 -m ds4quant.runtime.cluster ART --placement cluster.json \
        --tokens 8 --out RESULT.json

``ds4quant run ART --ranks N --placement P`` starts torchrun itself. The
placement is a rank placement (``ds4quant place --ranks N [--strategy
uniform|balanced] [--replicate-hot K]``); each rank loads only its own and the
replicated experts (``Placement.for_rank``; the rest ``none``: hot-only
storage, cold owner None). What a rank does: ``runtime.cluster.rank``.

Exact mode: per-slot expert outputs are all_gathered (every rank needs the
layer output, and tokens are not sharded, so each rank's slots go to every
rank: all_gather, not all_to_all) and every rank combines all slots in
canonical order with ``execute.combine``; never per-rank partial sums, so the
bytes equal one process's for any N, strategy or replication. Fast mode
all_reduces per-rank partial sums (its distance from exact is measured by
the benchmark and the tests).

The launcher (``launch``) starts the ranks as child processes in their own
sessions with stderr to files in one temporary folder, waits with a
deadline, kills by pid whatever outlives a failed peer by a grace period,
and removes the folder; gloo uses TCP on localhost (no shared memory).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ds4quant.errors import BadInputError, Ds4quantError
from ds4quant.runtime.cluster.rank import FAULT_ENV, ClusterError

__all__ = ["ClusterError", "ClusterRun", "run_cluster_layers", "run_cluster_jobs", "launch", "main", "FAULT_ENV"]

MODES = ("exact", "fast")
LAUNCHERS = ("spawn", "torchrun")
# NVLink SHARP multicast stays off on every rank (device notes: it needs a
# fabric set-up these hosts do not have, and hangs NCCL init without it)
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}


@dataclass(frozen=True)
class ClusterRun:
    """One job's result: per-layer MoE outputs (float32 [T, H]) and sha256,
    and each rank's report (experts held, bytes read/resident, per-layer
    timings: route, compute, exchange, combine)."""

    n_ranks: int
    mode: str
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


# --------------------------------------------------------------------------
# launching


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _last_error(path: Path) -> Optional[str]:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return None
    errs = [ln for ln in lines if ln.startswith("ds4quant: error:")]
    if errs:
        return errs[0][len("ds4quant: error:"):].strip()
    return lines[-1][:300] if lines else None


def _rank_env(rank: int, n: int, port: int, threads: int, extra: Optional[Mapping[str, str]]) -> dict:
    env = dict(os.environ)
    env.update({"RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(n),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    env.setdefault("OMP_NUM_THREADS", str(threads))
    for k, v in NCCL_ENV.items():
        env.setdefault(k, v)
    env.update(extra or {})
    return env


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGKILL)  # by pid: only the processes this launcher started
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def start_ranks(tmp: Path, spec: dict, n_ranks: int, *, launcher: str = "spawn",
                env: Optional[Mapping[str, str]] = None, threads: Optional[int] = None,
                rank_jobs: Optional[Sequence[Mapping[int, Mapping]]] = None
                ) -> tuple[list[subprocess.Popen], list[Path]]:
    """Write ``spec`` to ``tmp`` and start the ranks (``launcher``: one child per
    rank, or one torchrun); returns (processes, stderr files). Each process is
    in its own session, so ``stop_ranks`` can end exactly what this started."""
    if not isinstance(n_ranks, int) or not 1 <= n_ranks <= 256:
        raise BadInputError(f"must be an integer in 1..256, got {n_ranks!r}", where="--ranks")
    if launcher not in LAUNCHERS:
        raise BadInputError(f"must be one of {', '.join(LAUNCHERS)}, got {launcher!r}", where="--launcher")
    procs: list[subprocess.Popen] = []
    errs: list[Path] = []
    (tmp / "spec.json").write_text(json.dumps(spec, default=str))
    threads = threads or max(1, (os.cpu_count() or 1) // n_ranks)
    cmd = [sys.executable, "-m", "ds4quant.runtime.cluster", "--rank-spec", str(tmp / "spec.json")]
    try:
        if launcher == "spawn":
            port = _free_port()
            for r in range(n_ranks):
                if rank_jobs and rank_jobs[r]:
                    jobs = [{**jb, **dict(rank_jobs[r].get(j, {}))} for j, jb in enumerate(spec["jobs"])]
                    own = {**spec, "jobs": jobs}
                    (tmp / f"spec{r}.json").write_text(json.dumps(own, default=str))
                    cmd[-1] = str(tmp / f"spec{r}.json")
                else:
                    cmd[-1] = str(tmp / "spec.json")
                errs.append(tmp / f"rank{r}.err")
                with open(errs[-1], "wb") as fe:
                    procs.append(subprocess.Popen(cmd, env=_rank_env(r, n_ranks, port, threads, env),
                                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                  stderr=fe, start_new_session=True))
        else:
            errs.append(tmp / "torchrun.err")
            tenv = dict(os.environ)
            tenv.setdefault("OMP_NUM_THREADS", str(threads))
            for k, v in NCCL_ENV.items():
                tenv.setdefault(k, v)
            tenv.update(env or {})
            trun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n_ranks}",
                    "--max-restarts=0", "--redirects=3", f"--log-dir={tmp / 'logs'}", *cmd[1:]]
            with open(errs[-1], "wb") as fe:
                procs.append(subprocess.Popen(trun, env=tenv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                              stderr=fe, start_new_session=True))
    except BaseException:
        _kill(procs)
        raise
    return procs, errs


def grace_s(timeout_s: float) -> float:
    """How long the peers of a failed rank get to report their own error."""
    return min(float(timeout_s), 15.0) + 2.0


def failure_lines(tmp: Path, procs, errs, hung, launcher: str) -> list[str]:
    """One phrase per failed rank (its own error line, its signal, or 'still running')."""
    lines = []
    if launcher == "torchrun":
        for f in sorted((tmp / "logs").rglob("stderr.log")) if (tmp / "logs").exists() else []:
            m = _last_error(f)
            if m:
                lines.append(m)
    for i, p in enumerate(procs):
        rc = p.returncode
        if rc == 0:
            continue
        m = None if launcher == "torchrun" and lines else _last_error(errs[i])
        who = f"rank {i}" if launcher == "spawn" else "torchrun"
        if i in hung:
            lines.append(f"{who}: still running at the deadline; killed")
        elif rc is not None and rc < 0:
            lines.append(f"{who}: killed by signal {-rc}" + (f" ({m})" if m else ""))
        elif m:
            lines.append(m if m.startswith("rank") else f"{who}: {m}")
        else:
            lines.append(f"{who}: exit code {rc}")
    return list(dict.fromkeys(lines))


def launch(spec: dict, n_ranks: int, *, inputs: Optional[Mapping[str, np.ndarray]] = None, timeout_s: float = 60,
           launcher: str = "spawn", env: Optional[Mapping[str, str]] = None, threads: Optional[int] = None,
           startup_s: float = 120.0, rank_jobs: Optional[Sequence[Mapping[int, Mapping]]] = None) -> list[dict]:
    """Run ``spec`` ({jobs: [...], backend, ...}) on ``n_ranks`` ranks; returns
    per job {ranks: [report...], outputs: {L: f32 [T,H]}}. Raises ClusterError
    naming each failed rank's error; no process or temporary file outlives it.

    timeout_s: the process-group (collective) timeout and the ranks' watchdog
    base; the whole run is given startup_s + timeout_s * (1 + jobs).
    rank_jobs[r]: {job index: fields} that rank r alone changes (spawn only;
    a deliberate mismatch between ranks, for the guard tests)."""
    tmp = Path(tempfile.mkdtemp(prefix="ds4q-cluster-"))
    procs: list[subprocess.Popen] = []
    try:
        spec = {**spec, "out_dir": str(tmp), "timeout_s": float(timeout_s)}
        if inputs is not None:
            np.savez(tmp / "inputs.npz", **inputs)
            spec["inputs"] = str(tmp / "inputs.npz")
        procs, errs = start_ranks(tmp, spec, n_ranks, launcher=launcher, env=env, threads=threads,
                                  rank_jobs=rank_jobs)
        deadline = time.monotonic() + startup_s + timeout_s * (1 + len(spec["jobs"]))
        grace_until = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if grace_until is None and any(p.poll() not in (None, 0) for p in procs):
                grace_until = now + grace_s(timeout_s)
            if now > deadline or (grace_until is not None and now > grace_until):
                break
            time.sleep(0.05)
        hung = [i for i, p in enumerate(procs) if p.poll() is None]
        _kill(procs)
        if any(p.returncode != 0 for p in procs):
            lines = failure_lines(tmp, procs, errs, hung, launcher)
            raise ClusterError(f"cluster of {n_ranks} ranks failed: " + "; ".join(lines))
        out = []
        for j in range(len(spec["jobs"])):
            rep = json.loads((tmp / f"job{j}.json").read_text())
            with np.load(tmp / f"job{j}.npz", allow_pickle=False) as z:
                outputs = {int(k.split("_")[1]): np.array(z[k]) for k in z.files}
            out.append({"ranks": rep["ranks"], "outputs": outputs})
        return out
    finally:
        _kill(procs)
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------
# the public functions


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise BadInputError(f"must be one of {', '.join(MODES)}, got {mode!r}", where="--mode")


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
                     threads: Optional[int] = None, rank_jobs=None) -> list[ClusterRun]:
    """Several jobs ({artifact, placement, mode, layers, owners, holdings}) in
    one process group (one start-up for many placements); see run_cluster_layers."""
    if backend not in ("gloo", "nccl"):
        raise BadInputError(f"must be gloo or nccl, got {backend!r}", where="--backend")
    clean = []
    for job in jobs:
        mode = job.get("mode", "exact")
        _check_mode(mode)
        clean.append({"artifact": str(job["artifact"]), "placement": str(job["placement"]), "mode": mode,
                      "layers": list(job["layers"]) if job.get("layers") else None,
                      "owners": list(job["owners"]) if job.get("owners") else None,
                      "holdings": bool(job.get("holdings")), "route": job.get("route", "broadcast")})
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
                       mode: str = "exact", timeout_s: float = 60, **kw) -> ClusterRun:
    """The MoE layers of ``artifact`` on ``n_ranks`` ranks of rank placement
    ``placement`` (a file): per-layer outputs, sha256 and rank reports.

    hidden_by_layer: {layer: f32 [T, H]} or one [T, H] for every layer (with
    ``token_ids`` [T] for the hash layers; ``routing`` {layer: (idx, w)}
    overrides the router, else rank 0 routes and broadcasts); or ``tokens``: a count of seeded synthetic
    tokens. kw: layers, owners (local owner names per rank, ``{local_rank}``
    substituted, e.g. ["cuda:{local_rank}"] or ["torch-cpu:0", "cpu:1"]),
    backend (gloo | nccl), launcher (spawn | torchrun), seed, env, threads,
    holdings (report digests of every held expert). This is what verify's
    fidelity stage calls for ``--placement cluster.json``."""
    job_keys = ("layers", "owners", "holdings", "route")
    job = {"artifact": artifact, "placement": placement, "mode": mode, **{k: kw.pop(k) for k in job_keys if k in kw}}
    return run_cluster_jobs([job], n_ranks, hidden_by_layer, tokens, timeout_s=timeout_s, **kw)[0]


# --------------------------------------------------------------------------
# `python -m ds4quant.runtime.cluster` (under torchrun, or a rank of launch)


def _parser():
    import argparse

    ap = argparse.ArgumentParser(prog="python -m ds4quant.runtime.cluster",
                                 description="One rank of an expert-parallel cluster (start with torchrun).")
    ap.add_argument("artifact", nargs="?")
    ap.add_argument("--placement")
    ap.add_argument("--tokens", type=int, default=1, help="seeded synthetic tokens (hidden ~ N(0, 1))")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", default=None, help="comma-separated layers (default all)")
    ap.add_argument("--mode", default="exact", choices=MODES)
    ap.add_argument("--owner", action="append", default=None, help="local owner name(s); {local_rank} substituted")
    ap.add_argument("--backend", default=None, choices=("gloo", "nccl"), help="default: nccl for cuda owners")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--out", default=None, help="rank 0 writes the result JSON here")
    ap.add_argument("--outputs", default=None, help="rank 0 writes the outputs (.npz) here")
    ap.add_argument("--rank-spec", default=None, help=argparse.SUPPRESS)
    return ap


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


def main(argv: Optional[list[str]] = None) -> int:
    from ds4quant.runtime.cluster.rank import rank_entry

    args = _parser().parse_args(argv)
    if args.rank_spec:
        return rank_entry(args.rank_spec)
    if not args.artifact or not args.placement:
        _parser().error("ARTIFACT and --placement are required")
    backend = args.backend or ("nccl" if any(o.startswith("cuda") for o in args.owner or ()) else "gloo")
    tmp = Path(tempfile.mkdtemp(prefix="ds4q-cluster-"))
    try:
        job = {"artifact": args.artifact, "placement": args.placement, "mode": args.mode, "owners": args.owner,
               "layers": [int(x) for x in args.layers.split(",")] if args.layers else None}
        spec = {"jobs": [job], "backend": backend, "tokens": args.tokens, "seed": args.seed,
                "timeout_s": args.timeout, "out_dir": str(tmp)}
        (tmp / "spec.json").write_text(json.dumps(spec))
        rc = rank_entry(str(tmp / "spec.json"))
        if rc == 0 and int(os.environ.get("RANK", "0")) == 0:
            rep = json.loads((tmp / "job0.json").read_text())["ranks"]
            with np.load(tmp / "job0.npz", allow_pickle=False) as z:
                outputs = {int(k.split("_")[1]): np.array(z[k]) for k in z.files}
            run = ClusterRun(len(rep), args.mode, outputs, {int(t["layer"]): t["sha256"] for t in rep[0]["layers"]},
                             tuple(rep))
            if args.out:
                Path(args.out).write_text(json.dumps(run.to_json(), indent=1) + "\n")
            if args.outputs:
                shutil.copyfile(tmp / "job0.npz", args.outputs)
            print("\n".join(result_lines(run)))
        return rc
    except Ds4quantError as e:
        sys.stderr.write(f"ds4quant: error: {e.one_line()}\n")
        return e.exit_code
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
