"""Compile the fast-mode MoE kernel (kernels/moe_triton.py) ahead of time for
sm_90 on a machine without a GPU: Triton's real code generator, TTIR through
PTX to a cubin with the wheel's ptxas. The interpreter tests check the
kernels' arithmetic but not that the GPU compiler accepts them (constexpr
branches, shapes); this does, for the launch shapes CudaOwner uses.

Run in a process without TRITON_INTERPRET (triton.jit reads it when it
decorates): ``python tests/runtime/_compile_sm90.py QTYPE...``; exits 0 and
writes one line per compiled variant, or raises."""

from __future__ import annotations

import os
import sys


def compile_all(qtypes) -> list[str]:
    if os.environ.get("TRITON_INTERPRET"):
        raise RuntimeError("run without TRITON_INTERPRET: the interpreter has no compiler")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ds4quant.runtime.kernels import layout, moe_triton

    kern = moe_triton._moe_linear_kernel
    names = list(kern.arg_names)
    u8 = {"a_ptr", "b_ptr", "s_ptr", "o_ptr", "a2_ptr", "b2_ptr", "s2_ptr", "o2_ptr"}
    i32 = {"groups_ptr", "tab_ptr", "tab2_ptr"}
    lines = []
    for q in qtypes:
        f = layout.kernel_format(q)
        for bt in (1, 16):  # the matrix-vector tile and the tl.dot tile, at linear()'s default shapes
            const = dict(ABITS=f.abits, BBITS=f.bbits, G=f.group, MIX=f.mix, NLEV=f.nlev, LV=f.lv_mode,
                         AFF=f.affine, DUAL=True, BT=bt, BN=32 if bt == 1 else 64,
                         BK=256 if bt == 1 else max(32, f.group), PREC="tf32x3")
            sig = {}
            for n in names:
                if n in const:
                    sig[n] = "constexpr"
                elif n.endswith("_ptr"):
                    sig[n] = "*u8" if n in u8 else ("*i32" if n in i32 else "*fp32")
                else:
                    sig[n] = "fp32" if n == "limit" else "i32"
            src = ASTSource(fn=kern, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
            if not k.asm.get("cubin"):
                raise RuntimeError(f"{q} bt={bt}: no cubin")
            lines.append(f"{q} bt={bt} ptx={len(k.asm['ptx'])} shared={k.metadata.shared}")
    return lines


if __name__ == "__main__":
    sys.stdout.write("\n".join(compile_all(sys.argv[1:])) + "\n")
