"""Planted kernels for the machine-code rules (run without TRITON_INTERPRET):

    python -m tests.aot._planted TARGET...

compiles each kernel below for each target with and without fp fusion and
prints, as JSON, the ``asm_rules`` findings (BITS rules: no fused multiply-add,
no approximation) of every (kernel, fusion, target)."""

from __future__ import annotations

import json
import sys

import triton
import triton.language as tl


@triton.jit
def planted_fma(a, b, c, o, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o + i, tl.load(a + i) * tl.load(b + i) + tl.load(c + i))


@triton.jit
def planted_fma64(a, b, c, o, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(a + i).to(tl.float64)
    tl.store(o + i, (x * tl.load(b + i).to(tl.float64) + tl.load(c + i).to(tl.float64)).to(tl.float32))


@triton.jit
def planted_exp(a, b, c, o, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o + i, tl.exp(tl.load(a + i)))


@triton.jit
def planted_div(a, b, c, o, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o + i, tl.load(a + i) / tl.load(b + i))


@triton.jit
def ieee_ops(a, b, c, o, N: tl.constexpr):
    """Correctly rounded division and square root, float32 and float64: never a finding."""
    i = tl.arange(0, N)
    x = tl.load(a + i)
    y = tl.load(b + i)
    d = tl.math.div_rn(x, y) + tl.math.sqrt_rn(y)
    x64 = x.to(tl.float64)
    d64 = x64 / (1.0 + y.to(tl.float64))
    tl.store(o + i, d + d64.to(tl.float32) + (tl.load(c + i) % 7).to(tl.float32))


KERNELS = {k.__name__: k for k in (planted_fma, planted_fma64, planted_exp, planted_div, ieee_ops)}


def run(targets) -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ds4quant.runtime.kernels import aot, asm_rules

    out = {}
    for name, fn in KERNELS.items():
        sig = {"a": "*fp32", "b": "*fp32", "c": "*fp32", "o": "*fp32", "N": "constexpr"}
        if name == "ieee_ops":
            sig["c"] = "*i32"
        for fusion in (True, False):
            for t in targets:
                k = triton.compile(ASTSource(fn, sig, constexprs={"N": 64}), target=GPUTarget(*aot.target(t)),
                                   options={"enable_fp_fusion": fusion})
                found = asm_rules.findings(k.asm, no_fma=True, no_approx=True)
                out[f"{name}|{fusion}|{t}"] = sorted({f.kind for f in found})
    return out


if __name__ == "__main__":
    sys.stdout.write(json.dumps(run(sys.argv[1:])) + "\n")
