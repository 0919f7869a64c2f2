"""Starting, watching and ending the rank processes of a cluster.

``start_ranks`` starts one process per rank (or one torchrun) in its own
session with stderr to a file in one temporary folder; ``launch`` runs a
spec's jobs to the end under a deadline; a failed rank's peers get
``grace_s`` to report their own error, then whatever is left is killed by
pid (``kill_ranks``: only the processes this launcher started) and
``failure_lines`` names each rank's part in one line. gloo uses TCP on
localhost (no shared memory).
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
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np

from ds4quant.errors import BadInputError, Ds4quantError
from ds4quant.runtime.cluster.store import HOME_ENV, STORE_ENV, home_token

__all__ = ["ClusterError", "LAUNCHERS", "NCCL_ENV", "start_ranks", "kill_ranks", "grace_s", "failure_lines", "launch"]

LAUNCHERS = ("spawn", "torchrun")
# NVLink SHARP multicast stays off on every rank (device notes: it needs a
# fabric set-up these hosts do not have, and hangs NCCL init without it)
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}


class ClusterError(Ds4quantError):
    """A cluster run failed: a rank's error, a peer that died or hung, a mismatch."""


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


def _common_env(store_port: int, threads: int, extra: Optional[Mapping[str, str]]) -> dict:
    """What every rank (and torchrun) gets: the loopback store rank 0 binds, the home
    the ranks answer to (``store``), thread count, NCCL settings, the caller's extras."""
    env = dict(os.environ)
    env.update({STORE_ENV: f"127.0.0.1:{store_port}", HOME_ENV: home_token()})
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: gloo's own connections stay on loopback too
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")  # and NCCL's bootstrap (its data goes over NVLink / PCIe)
    for k, v in NCCL_ENV.items():
        env.setdefault(k, v)
    env.update(extra or {})
    return env


def _rank_env(rank: int, n: int, base: Mapping[str, str]) -> dict:
    env = dict(base)
    env.update({"RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(n)})
    return env


def kill_ranks(procs) -> None:
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
    in its own session, so ``kill_ranks`` can end exactly what this started."""
    if not isinstance(n_ranks, int) or not 1 <= n_ranks <= 256:
        raise BadInputError(f"must be an integer in 1..256, got {n_ranks!r}", where="--ranks")
    if launcher not in LAUNCHERS:
        raise BadInputError(f"must be one of {', '.join(LAUNCHERS)}, got {launcher!r}", where="--launcher")
    procs: list[subprocess.Popen] = []
    errs: list[Path] = []
    (tmp / "spec.json").write_text(json.dumps(spec, default=str))
    threads = threads or max(1, (os.cpu_count() or 1) // n_ranks)
    cmd = [sys.executable, "-m", "ds4quant.runtime.cluster", "--rank-spec", str(tmp / "spec.json")]
    base = _common_env(_free_port(), threads, env)
    try:
        if launcher == "spawn":
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
                    procs.append(subprocess.Popen(cmd, env=_rank_env(r, n_ranks, base),
                                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                  stderr=fe, start_new_session=True))
        else:
            errs.append(tmp / "torchrun.err")
            # static rendezvous on loopback: the dynamic (c10d) one --standalone uses keeps its
            # state in the store as a pickle, which torchrun unpickles (docs/cluster-security.md)
            trun = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=static", "--nnodes=1",
                    "--node-rank=0", "--master-addr=127.0.0.1", f"--master-port={_free_port()}",
                    f"--nproc-per-node={n_ranks}", "--max-restarts=0", "--monitor-interval=0.5", "--redirects=3",
                    f"--log-dir={tmp / 'logs'}", *cmd[1:]]
            with open(errs[-1], "wb") as fe:
                procs.append(subprocess.Popen(trun, env=base, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                              stderr=fe, start_new_session=True))
    except BaseException:
        kill_ranks(procs)
        raise
    return procs, errs


def grace_s(timeout_s: float) -> float:
    """How long the peers of a failed rank get to report their own error."""
    return min(float(timeout_s), 15.0) + 2.0


def failure_lines(tmp: Path, procs, errs, hung, launcher: str) -> list[str]:
    """One phrase per failed rank (its own error line, its signal, or 'still running')."""
    lines = []
    # each rank writes its error line to the run's folder (entry._say), whatever the launcher
    # did with its stderr: torchrun's own report is a banner, not the rank's error
    for f in sorted(tmp.glob("rank*.error"), key=lambda q: int(q.stem[4:]) if q.stem[4:].isdigit() else 0):
        m = _last_error(f) or f.read_text(errors="replace").strip()[:300]
        if m:
            lines.append(m)
    if launcher == "torchrun" and not lines:
        for f in sorted((tmp / "logs").rglob("stderr.log")) if (tmp / "logs").exists() else []:
            m = _last_error(f)
            if m:
                lines.append(m)
    for i, p in enumerate(procs):
        rc = p.returncode
        if rc == 0:
            continue
        if launcher == "torchrun" and lines:
            continue  # the ranks named themselves; torchrun's exit adds nothing
        m = _last_error(errs[i])
        if launcher == "spawn" and any(ln.startswith(f"rank {i}:") for ln in lines):
            continue
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
        kill_ranks(procs)
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
        kill_ranks(procs)
        shutil.rmtree(tmp, ignore_errors=True)
