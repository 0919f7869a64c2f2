"""Where and how wide the adaptive measure stage runs: experts in parallel, a device.

Every expert's measurement is a pure function of its matrix, importance,
options and seed ("tensor/expert"), so the experts can run on any number of
worker threads: ``ordered_map`` hands them out and gives the results back in
the input order, and the caller records them in that order, so plans, errors,
books and bytes never depend on the worker count. A worker runs numba's
kernels on one thread (numba's thread count is per Python thread), the
parallelism is across experts, not inside a matrix.

``--device cuda`` moves the MIX encoder's search (every candidate scale and
book of every half, the work of the codebook fitter's Lloyd steps, its error
evaluations and the final MIX encode) to the GPU through torch
(``formats._mix_search_torch``, bit-identical to the numba kernels); the
workers' searches share launches (``formats._mix_search_batch``: the queued
searches of all workers run as one). What
stays on the CPU, because its float64 sums are sequential or numpy's pairwise
order and a GPU reduction would round differently: the fitter's error totals
and Lloyd level sums (``formats._mix_search_fit.terms_stats_nb``), the error sums
of every candidate (``metrics.error_sums``), the reference fitter's histogram
Lloyd and the book projection; and, not ported yet, the non-MIX candidates'
scale search (rocmfp2/3/4/4_fast encoders) and the decodes.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Callable, Iterable, Iterator, Optional, TypeVar

from ds4quant.errors import BadInputError

T = TypeVar("T")
R = TypeVar("R")

# "torch-cpu": the torch search on torch's CPU device, the device path that
# CI (no GPU) can run end to end against the numba path
DEVICES = ("cpu", "cuda", "cuda:N", "torch-cpu")


def check_device(device: str) -> str:
    """One of ``DEVICES`` (no torch import: that waits for ``resolve_device``)."""
    d = str(device)
    if d in ("cpu", "cuda", "torch-cpu") or (d.startswith("cuda:") and d[5:].isdigit()):
        return d
    raise BadInputError(f"--device must be cpu, cuda, cuda:N or torch-cpu, got {device!r}")


def resolve_device(device: str):
    """None for the CPU path, else a torch.device that exists."""
    d = check_device(device)
    if d == "cpu":
        return None
    try:
        import torch
    except ImportError:
        raise BadInputError(f"--device {d} needs torch", hint="pip install torch") from None
    if d == "torch-cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise BadInputError(f"--device {d}: torch sees no CUDA device")
    dev = torch.device(d)
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise BadInputError(f"--device {d}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return dev


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
