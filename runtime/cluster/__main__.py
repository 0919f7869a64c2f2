"""``python -m ds4quant.runtime.cluster``: one rank of a cluster job (under torchrun,
or a rank process ``launch`` started with ``--rank-spec``).

    torchrun --nproc-per-node 2 -m ds4quant.runtime.cluster ART --placement cluster.json \\
        --tokens 8 --out RESULT.json
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np

from ds4quant.errors import Ds4quantError
from ds4quant.runtime.cluster.entry import rank_entry
from ds4quant.runtime.cluster.jobs import ClusterRun, result_lines
from ds4quant.runtime.cluster.store import IFACE_ENV, STORE_ENV, parse_address
from ds4quant.runtime.mode import Mode


def _parser():
    import argparse

    ap = argparse.ArgumentParser(prog="python -m ds4quant.runtime.cluster",
                                 description="One rank of an expert-parallel cluster (start with torchrun).")
    ap.add_argument("artifact", nargs="?")
    ap.add_argument("--placement")
    ap.add_argument("--tokens", type=int, default=1, help="seeded synthetic tokens (hidden ~ N(0, 1))")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", default=None, help="comma-separated layers (default all)")
    ap.add_argument("--mode", default="exact", choices=[m.value for m in Mode])
    ap.add_argument("--owner", action="append", default=None, help="local owner name(s); {local_rank} substituted")
    ap.add_argument("--backend", default=None, choices=("gloo", "nccl"), help="default: nccl for cuda owners")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--out", default=None, help="rank 0 writes the result JSON here")
    ap.add_argument("--outputs", default=None, help="rank 0 writes the outputs (.npz) here")
    ap.add_argument("--store-address", default=None, metavar="HOST:PORT",
                    help="where rank 0's rendezvous store listens (several nodes: an address of the interface "
                         "the ranks share; default one node, loopback). Read docs/cluster-security.md first.")
    ap.add_argument("--interface", default=None, metavar="IFACE",
                    help="the network interface gloo/NCCL use between nodes (GLOO_SOCKET_IFNAME)")
    ap.add_argument("--no-verify-payloads", action="store_true",
                    help="skip hashing the artifact against its manifest (one rank per node does it)")
    ap.add_argument("--rank-spec", default=None, help=argparse.SUPPRESS)
    return ap




def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.rank_spec:
        return rank_entry(args.rank_spec)
    if not args.artifact or not args.placement:
        _parser().error("ARTIFACT and --placement are required")
    backend = args.backend or ("nccl" if any(o.startswith("cuda") for o in args.owner or ()) else "gloo")
    try:
        if args.store_address:
            parse_address(args.store_address)
            os.environ[STORE_ENV] = args.store_address
        if args.interface:
            os.environ[IFACE_ENV] = args.interface
    except Ds4quantError as e:
        sys.stderr.write(f"ds4quant: error: {e.one_line()}\n")
        return e.exit_code
    tmp = Path(tempfile.mkdtemp(prefix="ds4q-cluster-"))
    try:
        job = {"artifact": args.artifact, "placement": args.placement, "mode": args.mode, "owners": args.owner,
               "layers": [int(x) for x in args.layers.split(",")] if args.layers else None,
               "verify_payloads": not args.no_verify_payloads}
        # own_dir: this rank's folder; its watchdog removes it should torchrun die first
        spec = {"jobs": [job], "backend": backend, "tokens": args.tokens, "seed": args.seed,
                "timeout_s": args.timeout, "out_dir": str(tmp), "own_dir": True}
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
