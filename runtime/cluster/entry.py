"""A rank process's entry: the spec file ``launch`` wrote, run on this rank.

``rank_entry`` (``python -m ds4quant.runtime.cluster --rank-spec FILE``)
joins the process group, then runs the spec's one-shot jobs
(``rank.run_job``; rank 0 writes the results) or, for a persistent group's
spec, serves its calls (``serve.serve_calls``). Errors become one stderr
line and the exit status.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from ds4quant.errors import Ds4quantError
from ds4quant.runtime.cluster.launch import ClusterError
from ds4quant.runtime.cluster.rank import Group, Watchdog, run_job
from ds4quant.runtime.cluster.serve import serve_calls
from ds4quant.runtime.cluster.store import HOME_ENV, open_process_group

__all__ = ["serve", "rank_entry"]


def _inputs_from(spec: dict, header) -> dict:
    import torch

    if spec.get("inputs"):
        z = np.load(spec["inputs"], allow_pickle=False)
        out = {"token_ids": z["token_ids"]}
        if "hidden" in z.files:
            out["hidden_all"] = z["hidden"]
        for k in z.files:
            if k.startswith("hidden_"):
                out.setdefault("hidden", {})[int(k.split("_")[1])] = z[k]
            if k.startswith("idx_"):
                L = int(k.split("_")[1])
                out.setdefault("routing", {})[L] = (z[k], z[f"w_{L}"])
        return out
    T, seed = int(spec.get("tokens", 1)), int(spec.get("seed", 0))
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn((T, header.hidden), generator=gen, dtype=torch.float32)
    ids = torch.randint(0, max(1, int(header.vocab or 1)), (T,), generator=gen, dtype=torch.int64)
    return {"hidden_all": hidden.numpy(), "token_ids": ids.numpy()}


def serve(spec: dict) -> int:
    """Run ``spec`` (jobs, inputs, backend, timeout_s, out_dir) on this rank.
    Rank 0 writes ``job{j}.json`` (every rank's report) and ``job{j}.npz``
    (outputs) to out_dir. Returns 0; raises on failure."""
    import torch
    import torch.distributed as dist

    timeout_s = float(spec.get("timeout_s", 60))
    rank = int(os.environ.get("RANK", "0"))
    # progress is marked per layer, and one layer of a big batch on a CPU owner can take
    # minutes: the watchdog waits far longer than a collective does
    dog = Watchdog(float(spec.get("watchdog_s") or 10 * timeout_s), rank)
    backend = spec.get("backend") or "gloo"
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if os.environ.get(HOME_ENV) or spec.get("own_dir"):
        # the run's folder, should its owner die first: the watchdog removes it on the way out
        dog.orphan_dir = spec.get("out_dir")
    try:
        open_process_group(backend, timeout_s)
    except Ds4quantError:
        raise
    except Exception as e:
        raise ClusterError(f"rank {rank}: rendezvous failed (timeout {timeout_s:g}s): "
                           f"{type(e).__name__}: {' '.join(str(e).split())[:300]}") from None
    g = Group(backend, timeout_s, device)
    try:
        from ds4quant.artifact.view import open_artifact

        if spec.get("serve"):  # a persistent group serving layer calls (cluster.group's RankGroup)
            return serve_calls(g, spec, dog)
        out_dir = Path(spec["out_dir"])
        inputs = None
        for j, job in enumerate(spec["jobs"]):
            if inputs is None:
                with open_artifact(job["artifact"]) as v:
                    inputs = _inputs_from(spec, v.header)
            res = run_job(g, job, inputs, dog)
            reports = g.gather_json("report", res["report"])
            if g.rank == 0:
                np.savez(out_dir / f"job{j}.npz", **{f"out_{L}": a for L, a in res["outputs"].items()})
                (out_dir / f"job{j}.json").write_text(json.dumps({"ranks": reports}, default=str))
        g.gather_json("finish", None)  # nobody leaves while a peer still needs it
        return 0
    finally:
        dog.stop()
        try:
            dist.destroy_process_group()
        except Exception:  # a dead peer can make the teardown raise; the error that matters is already raised
            pass


def _say(spec: dict, line: str) -> None:
    """The rank's error: one stderr line, and ``rank{R}.error`` in the run's folder, where
    the launcher reads it whatever the launcher did with the rank's stderr (torchrun)."""
    sys.stderr.write(f"ds4quant: error: {line}\n")
    out = spec.get("out_dir")
    if out and Path(out).is_dir():
        try:
            (Path(out) / f"rank{os.environ.get('RANK', '0')}.error").write_text(line + "\n")
        except OSError:
            pass


def rank_entry(spec_path: str) -> int:
    """Run the spec file on this rank; errors become one stderr line and exit 2."""
    spec: dict = {}
    try:
        spec = json.loads(Path(spec_path).read_text())
        serve(spec)
        return 0
    except Ds4quantError as e:
        line = e.one_line()
        rank = os.environ.get("RANK", "?")
        _say(spec, line if line.startswith(("rank ", "cluster rank ")) else f"rank {rank}: {line}")
        return e.exit_code
    except BaseException as e:  # noqa: BLE001 - one line per rank beats a traceback per rank
        if os.environ.get("DS4QUANT_DEBUG"):
            raise
        _say(spec, f"rank {os.environ.get('RANK', '?')}: {type(e).__name__}: {e}")
        return 1
