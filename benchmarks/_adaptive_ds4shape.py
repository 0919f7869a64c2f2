"""The measure stage's cost at DeepSeek-V4 Flash shapes (benchmarks/adaptive.py --ds4-shape N).

The sample and the synthetic presets have small matrices (128 x 512 at most),
where per-call overheads weigh more and the fitter's row sample (512 rows)
covers every row. A DS4 Flash expert is gate/up 2048 x 4096 and down
4096 x 2048: the Lloyd steps run on 512 sampled rows and the final error
evaluations (reference books, refined books, fixed levels, the encode) on
all rows. This times ``ds4quant.plan.measure_candidates`` on N synthetic
experts at those shapes (FP4-grid values: E2M1 levels times a power-of-two
scale per 32, Student-t(3) before rounding; log-normal column importance),
through ``ds4quant.plan.ordered_map`` as the measure stage runs them, and
checks that every path gives the same figures and books.
"""

from __future__ import annotations

import hashlib
import os
import time

import numpy as np

GATE_UP = (2048, 4096)  # (rows = moe_intermediate, cols = hidden)
DOWN = (4096, 2048)
_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def _rng(key: str) -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little"))


def fp4_matrix(key: str, shape) -> np.ndarray:
    g = _rng(key)
    x = (0.02 * g.standard_t(3, shape)).astype(np.float32).reshape(shape[0], -1, 32)
    blk = np.abs(x).max(-1, keepdims=True)
    scale = (2.0 ** np.ceil(np.log2(np.maximum(blk, 1e-30) / 6.0))).astype(np.float32)
    v = np.abs(x) / scale
    mid = (_E2M1[1:] + _E2M1[:-1]) / 2  # nearest E2M1 level
    q = _E2M1[np.searchsorted(mid, v)]
    return (np.sign(x) * q * scale).reshape(shape).astype(np.float32)


def fp4_packed(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``fp4_matrix``'s values as the checkpoint stores them: E2M1 codes two a
    byte (the even element low) and one E8M0 byte a block of 32, so that
    ``dequant_e2m1_blocks`` gives x back bit for bit (-0.0 as code 8)."""
    rows, cols = x.shape
    blk = x.reshape(rows, -1, 32)
    mx = np.abs(blk).max(-1)
    # the smallest power of two with max|x| / 2^k among the E2M1 levels (<= 6)
    k = np.where(mx > 0, np.ceil(np.log2(np.maximum(mx, 1e-30) / 6.0)), -127).astype(np.int32)
    v = np.abs(blk) / (2.0 ** k)[..., None]
    code = np.searchsorted(_E2M1, v).astype(np.uint8) | np.where(np.signbit(blk), 8, 0).astype(np.uint8)
    code = code.reshape(rows, cols)
    return (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8), (k + 127).astype(np.uint8)


def importance(key: str, cols: int) -> np.ndarray:
    return np.exp(_rng(key).standard_normal(cols)).astype(np.float32)


def torch_tier(backend):
    """``backend``'s device with the torch tier: the device path before the
    Triton kernels (their anchor), the MIX and non-MIX searches as torch
    operations (the MIX batch shared by the workers)."""
    from ds4quant.formats.search import Backend, Tier

    return Backend(Tier.TORCH, backend.device, backend.index) if backend.on_device else backend


def _measure_all(x, imp, cands, opts, backend) -> list:
    """Every candidate's Measure (and books) of one matrix, as the measure
    stage takes them (``measure_candidates``: on a device the matrix is
    uploaded once for all of them)."""
    from ds4quant.plan import fits, measure_candidates

    qs = [q for q in cands if fits(q, x.shape[1])]
    return [(q, m, None if bk is None else (bk[0].tobytes(), bk[1]))
            for q, m, bk in measure_candidates(x, imp, imp.astype(np.float64), qs, opts, "ds4", backend)]


def ds4_expert_cost(threads: int, devices=(), candidates=None, experts: int = 1, one_core: bool = True,
                    partial=None, device_first: bool = False, device_anchor: bool = False,
                    device_only: bool = False, shapes=None, reads: bool = False) -> dict:
    from ds4quant.formats import numba_threads
    from ds4quant.plan import DEFAULT_CANDIDATES, AdaptiveOptions, ordered_map, worker_stream

    cands = tuple(candidates or DEFAULT_CANDIDATES)
    opts = AdaptiveOptions(target_bpw=2.7, candidates=cands)  # the default --fit-effort
    gate_up, down = shapes or (GATE_UP, DOWN)  # another (gate/up, down) pair: benchmarks/adaptive_crossover.py
    mats = []
    for e in range(experts):
        imp_in, imp_down = importance(f"in/{e}", gate_up[1]), importance(f"down/{e}", down[1])
        for which, shape, imp in (("gate", gate_up, imp_in), ("up", gate_up, imp_in), ("down", down, imp_down)):
            mats.append((f"{which}/{e}", fp4_matrix(f"{which}/{e}", shape), imp))
    if reads:  # hold the matrices as the checkpoint does; the calling thread dequantizes, as measure() does
        from ds4quant.formats.fp8 import dequant_e2m1_blocks

        packed = [(k, fp4_packed(x), imp) for k, x, imp in mats]
        assert all(np.array_equal(dequant_e2m1_blocks(*p).view(np.uint32), x.view(np.uint32))
                   for (_, p, _), (_, x, _) in zip(packed[:3], mats[:3]))
        weights = sum(x.size for _, x, _ in mats)
        mats = packed
    else:
        weights = sum(x.size for _, x, _ in mats)
    gb = weights * (0.5 + 1 / 32) / 1e9  # FP4 codes + one E8M0 byte per 32
    paths = ([("1 core", 1, "cpu", False)] if one_core else []) + \
        ([(f"{threads} cores", threads, "cpu", False)] if threads > 1 and not device_only else [])
    dev_paths = [(f"{d} + {threads} cores", threads, d, False) for d in devices]
    if device_anchor:  # the pre-change device path, timed in the same run
        dev_paths += [(f"{d} + {threads} cores, torch searches", threads, d, True) for d in devices]
    # device_first: a run with little time left measures the device before the CPU rows
    paths = dev_paths + paths if device_first else paths + dev_paths
    out = {"experts": experts, "shape_gate_up": list(gate_up), "shape_down": list(down), "fp4_gb": gb,
           "candidates": list(cands), "reads": reads, "paths": {}}
    results = {}
    for label, jobs, device, anchor in paths:
        dev = AdaptiveOptions(target_bpw=2.7, device=device).backend()
        if anchor:
            dev = torch_tier(dev)

        def items():
            for key, x, imp in mats:
                if reads:
                    x = dequant_e2m1_blocks(*x, where=key)
                yield key, (x, imp)

        def work(p, dev=dev):
            x, imp = p
            with worker_stream(dev):  # as the measure stage runs them
                return _measure_all(x, imp, cands, opts, dev)

        load = os.getloadavg()[0]
        with numba_threads(jobs):
            c0, t0 = time.process_time(), time.perf_counter()
            got = list(ordered_map(items(), work, jobs))
            sec, cpu = time.perf_counter() - t0, time.process_time() - c0
        results[label] = got
        out["paths"][label] = {"jobs": jobs, "device": device, "s": sec, "cpu_s": cpu, "s_per_gb": sec / gb,
                               "cpu_s_per_gb": cpu / gb, "load_average": load,
                               # the figures and books of every matrix: equal digests, equal results
                               "digest": hashlib.sha256(repr(got).encode()).hexdigest()}
        if partial is not None:  # what a run cut short still reports
            import json

            partial.write_text(json.dumps(out, indent=2) + "\n")
    out["identical"] = len({repr(v) for v in results.values()}) == 1
    return out
