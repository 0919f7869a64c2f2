"""Compile the catalogue's kernels ahead of time for HIP and CUDA targets, on a
machine without a GPU: Triton's real code generator (TTIR -> LLVM -> AMDGCN and
an HSACO with the wheel's ld.lld, or PTX and a cubin with the wheel's ptxas),
then the machine-code rules of the kernels that promise the CPU's bits
(``asm_rules``).

Must run without ``TRITON_INTERPRET`` (the interpreter has no compiler);
``tests/aot/compile_all.py`` is the command line (and what the test runs in a
subprocess). ``representative`` picks one specialisation per (kernel,
scenario): the subset the always-on test compiles.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from ds4quant.runtime.kernels import catalog

_MMA = re.compile(r"^\s*(?:wgmma\.mma_async|mma\.sync|v_wmma_|v_mfma_|v_smfmac_)", re.M)


@dataclass(frozen=True)
class Result:
    label: str
    module: str
    kernel: str
    target: str
    ok: bool
    binary: str  # "cubin" / "hsaco" / "" on failure
    seconds: float
    findings: tuple  # asm_rules violations as strings
    error: str = ""
    mma: int = 0  # matrix instructions in the code (wgmma / mma.sync, v_wmma / v_mfma): tl.dot on tensor cores


def target(name: str):
    backend, _, arch = name.partition(":")
    for t in catalog.TARGETS:
        if t[0] == backend and str(t[1]) == arch:
            return t
    raise ValueError(f"unknown target {name!r}; known: {', '.join(map(catalog.target_name, catalog.TARGETS))}")


def compile_one(spec: catalog.Spec, target: tuple) -> Result:
    """Compile one specialisation for one target and check its rules."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ds4quant.runtime.kernels import asm_rules

    t0 = time.perf_counter()
    name = catalog.target_name(target)
    try:
        fn = getattr(importlib.import_module(spec.module), spec.kernel)
        src = ASTSource(fn=fn, signature=dict(spec.signature), constexprs=dict(spec.constexprs))
        k = triton.compile(src, target=GPUTarget(*target), options=dict(spec.options))
        binary = "cubin" if k.asm.get("cubin") else ("hsaco" if k.asm.get("hsaco") else "")
        found = tuple(str(f) for f in asm_rules.findings(k.asm, spec.rules.no_fma, spec.rules.no_approx))
        ok = bool(binary)
        err = "" if ok else "no binary"
        code = k.asm.get("ptx") or k.asm.get("amdgcn") or ""
        mma = len(_MMA.findall(code))
    except Exception as exc:  # a compile failure is the result, reported per (spec, target)
        binary, found, ok, err, mma = "", (), False, f"{type(exc).__name__}: {str(exc)[-2000:]}", 0
    return Result(spec.label, spec.module, spec.kernel, name, ok, binary, round(time.perf_counter() - t0, 3),
                  found, err, mma)


def _job(args):
    return compile_one(*args)


def representative(specs) -> list:
    """The first specialisation of each (kernel, scenario, backends made for): a launch whose
    settings differ per backend (the tl.dot precision) is represented on each."""
    seen: dict = {}
    for s in specs:
        seen.setdefault((s.module, s.kernel, s.scenario, s.backends), s)
    return list(seen.values())


def compile_specs(specs, targets, jobs: int = 1) -> list:
    """Every (spec, target) pair whose backend the spec is made for, compiled; ``jobs`` worker
    processes (spawned without TRITON_INTERPRET)."""
    work = [(s, t) for s in specs for t in targets if t[0] in s.backends]
    if jobs <= 1:
        return [compile_one(*w) for w in work]
    import multiprocessing as mp

    with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as ex:
        return list(ex.map(_job, work, chunksize=max(1, len(work) // (4 * jobs))))
