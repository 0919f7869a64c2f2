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
storage, cold owner None). ``runtime.load`` on a rank placement starts a
persistent ``RankGroup`` instead (the executor verify's fidelity run uses).

The files, by job: ``launch`` (start, watch and end rank processes),
``jobs`` (one-shot layer jobs and their results), ``group`` (the home side
of a persistent group: an ``Executor``), ``wire`` (home <-> rank 0 frames),
``rank`` (what one rank holds and computes), ``serve`` (a rank serving a
group's calls), ``entry`` (a rank process's entry), ``__main__``
(``python -m ds4quant.runtime.cluster``).

Exact mode: per-slot expert outputs are all_gathered (every rank needs the
layer output, and tokens are not sharded, so each rank's slots go to every
rank: all_gather, not all_to_all) and every rank combines all slots in
canonical order with ``execute.combine``; never per-rank partial sums, so the
bytes equal one process's for any N, strategy or replication. Fast mode
all_reduces per-rank partial sums (its distance from exact is measured by
the benchmark and the tests).
"""

from ds4quant.runtime.cluster.group import ClusterCall, ClusterOptions, RankGroup
from ds4quant.runtime.cluster.jobs import ClusterRun, result_lines, run_cluster_jobs, run_cluster_layers
from ds4quant.runtime.cluster.launch import ClusterError, launch
from ds4quant.runtime.cluster.rank import FAULT_ENV

__all__ = ["ClusterError", "ClusterRun", "ClusterCall", "ClusterOptions", "RankGroup", "run_cluster_layers",
           "run_cluster_jobs", "result_lines", "launch", "FAULT_ENV"]
