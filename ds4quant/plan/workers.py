"""How wide the adaptive measure stage runs, and on which device: experts in parallel.

Every expert's measurement is a pure function of its matrix, importance,
options and seed ("tensor/expert"), so the experts can run on any number of
worker threads: ``ordered_map`` hands them out and gives the results back in
the input order, and the caller records them in that order, so plans, errors,
books and bytes never depend on the worker count. A worker runs numba's
kernels on one thread (numba's thread count is per Python thread), the
parallelism is across experts, not inside a matrix.

``--device cuda`` moves the searches to the GPU (``AdaptiveOptions.backend``:
the Triton tier of ``formats.search``), bit-identical to the numba kernels,
each search one launch: the MIX encoder's search (every candidate scale and
book of every half, for the codebook fitter's Lloyd steps, its error
evaluations and the final MIX encode) and the non-MIX candidates' scale
search and decode (rocmfp2/3/4/4_fast). An expert matrix is uploaded once
for all its candidates (``job.Resident``) and what the plan needs of it
comes back as figures: the fitter's error evaluations (the search, the
float64 terms and ``np.sum``'s pairwise total) and every candidate's error
sums run on the device in the host's order, so no decoded matrix or terms
array crosses the link. Matrices under ``job.DEVICE_MIN_WEIGHTS`` weights
stay on the CPU cores, where they are cheaper (the same bytes). Without
Triton (or on torch's CPU device, ``torch-cpu``) the same searches run as
torch operations (the torch tier, whose MIX batch the workers share). Each
worker queues its kernels on its own CUDA stream (``worker_stream``). What
stays on the CPU: the Lloyd steps' level sums and totals on the fitter's
sampled rows (``search.terms_stats``: the level sums in element order, a
sequential float64 sum per level a GPU would have to run one lane a level),
the rows' energies of the importance weights (a sequential float32 sum,
once a matrix), the reference fitter's histogram Lloyd and the book
projection.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from contextlib import nullcontext
from typing import Callable, Iterable, Iterator, Optional, TypeVar

from ds4quant.formats.search import Backend, DeviceKind

T = TypeVar("T")
R = TypeVar("R")

_STREAMS = threading.local()


def worker_stream(backend: Backend):
    """The calling thread's own CUDA stream on ``backend``'s device as a
    context (a null context elsewhere): the workers' kernels queue and their
    copies to the host wait on their own streams, not on every worker's work
    in the default stream. A search that another worker's thread runs for
    this one (the MIX batcher) ends in a copy to the host on that thread's
    stream, which this worker waits for, so nothing it hands over is freed
    while in use."""
    if backend.device is not DeviceKind.CUDA:
        return nullcontext()
    import torch

    device = backend.torch_device
    key = str(device)
    streams = getattr(_STREAMS, "by_device", None)
    if streams is None:
        streams = _STREAMS.by_device = {}
    if key not in streams:
        streams[key] = torch.cuda.Stream(device=device)
    return torch.cuda.stream(streams[key])


def default_jobs() -> int:
    """The measure stage's workers when --jobs is not given: convert's numba threads."""
    import numba

    return max(1, int(numba.get_num_threads()))


def _pool_safe() -> bool:
    """numba's workqueue layer must not be entered from two threads at once:
    launch one parallel kernel and ask which layer loaded."""
    import numba
    import numpy as np

    from ds4quant.metrics import error_sums  # a parallel kernel

    error_sums(np.zeros((2, 4), np.float32), np.zeros((2, 4), np.float32))
    return numba.threading_layer() != "workqueue"


def ordered_map(items: Iterable[tuple[object, Optional[T]]], fn: Callable[[T], R], jobs: int
                ) -> Iterator[tuple[object, Optional[R]]]:
    """(key, fn(payload)) for each (key, payload) of ``items``, in input order;
    a None payload gives (key, None) without a call. Up to ``jobs`` calls run
    at once on worker threads (numba on one thread each), at most 2 * jobs
    payloads are held; ``items`` is consumed on the calling thread only. The
    first failure in input order is raised."""
    if jobs <= 1 or not _pool_safe():
        for key, p in items:
            yield key, (None if p is None else fn(p))
        return
    from concurrent.futures import ThreadPoolExecutor

    def call(p):
        import numba

        numba.set_num_threads(1)
        return fn(p)

    window: deque = deque()
    ex = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="ds4quant-measure")
    try:
        it = iter(items)
        done = False
        while True:
            while not done and len(window) < 2 * jobs:
                try:
                    key, p = next(it)
                except StopIteration:
                    done = True
                    break
                window.append((key, None if p is None else ex.submit(call, p)))
            if not window:
                return
            key, fut = window.popleft()
            yield key, (None if fut is None else fut.result())
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
