"""The expert-parallel cluster on torch.distributed (see ``launch``)."""

from ds4quant.runtime.cluster.launch import (  # noqa: F401
    FAULT_ENV,
    ClusterError,
    ClusterRun,
    launch,
    main,
    result_lines,
    run_cluster_jobs,
    run_cluster_layers,
)
