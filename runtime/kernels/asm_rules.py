"""What the machine code of a kernel that promises the CPU's bits may not contain.

Exact mode's quantize and SwiGLU steps and the measure stage's searches and
sums are specified one IEEE operation at a time (``docs/exact-mode.md#no-fusion``,
``docs/formats.md#conventions``): a multiply contracted with an add into a
fused multiply-add rounds once instead of twice, and a hardware approximation
of a division, a square root or an exponential is not the correctly rounded
value. Triton decides both at compile time (``enable_fp_fusion``, which
library call an operator becomes), so the check reads the generated code:

* PTX (``cuda:*``): no ``fma.*`` / ``mad.*`` on floats, and no float ``mul`` or
  ``add``/``sub`` without an explicit rounding mode (``mul.f32`` may still be
  contracted by ptxas; ``mul.rn.f32`` may not); no ``*.approx`` or
  ``div.full`` (Triton's ``/`` on float32), ``rcp.approx``, ``ex2.approx``.
  PTX's ``div.rn`` and ``sqrt.rn`` are single correctly rounded instructions.
* AMDGCN (``hip:*``): no ``v_fma*`` / ``v_fmac*`` / ``v_mad*`` / ``v_mac*`` /
  ``v_pk_fma*`` on floats (VOPD dual-issue halves ``v_dual_fmac_f32`` included),
  except inside a correctly rounded division or square root: the IEEE
  expansions (``v_div_scale`` / ``v_rcp`` / ``v_rsq`` / ``v_sqrt`` refined by
  fused steps, then ``v_div_fmas`` / ``v_div_fixup``) consist of FMAs by
  design; so do the compiler's integer divisions and int64 conversions
  (``v_rcp_iflag_f32``, FMAs by 2^32), recognised by their constants. A
  register written by one of those seeds, or by an arithmetic instruction
  reading such a register, is "in an expansion" until it is
  overwritten; an FMA reading one belongs to the expansion, any other FMA is
  a contraction. A ``v_rcp`` / ``v_rsq`` / ``v_sqrt`` whose result no FMA
  refines is an approximation; ``v_exp_*``, ``v_log_*``, ``v_sin_*``,
  ``v_cos_*`` always are.

Integer multiply-adds (``v_mad_u32_u24``, ``v_mad_u64_u32``, ``mad.lo.s32``)
are address arithmetic and never flagged. The check is conservative in one
direction only: it may accept an FMA that reads an expansion's value and
also adds user terms (none of the checked kernels does that), it never
rejects a correctly rounded expansion. A planted ``a * b + c`` kernel that
Triton fuses must fail it (``tests/aot``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# -- PTX -------------------------------------------------------------------
_PTX_FMA = re.compile(r"^\s*(?:@!?%p\d+\s+)?(fma|mad)(\.[a-z0-9]+)*\.f(16|32|64)\b", re.M)
_PTX_LOOSE = re.compile(r"^\s*(?:@!?%p\d+\s+)?(mul|add|sub)(\.ftz|\.sat)*\.f(32|64)\b", re.M)
_PTX_APPROX = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z0-9]+(?:\.[a-z0-9]+)*\.approx(?:\.[a-z0-9]+)*|div\.full\.f32)\b",
                         re.M)

# -- AMDGCN ----------------------------------------------------------------
_AMD_FMA = re.compile(r"^v_(?:dual_|pk_)?(?:fma|fmac|mad|mac|fmamk|fmaak|fmamk)(?:_mix(?:lo|hi)?)?"
                      r"(?:_legacy)?_f(?:16|32|64)")
_AMD_SEED = re.compile(r"^v_(?:rcp|rsq|sqrt|div_scale)(?:_clamp)?_f(?:16|32|64)")
_AMD_REFINE_END = re.compile(r"^v_div_(?:fmas|fixup)_f(?:16|32|64)")
_AMD_ALWAYS_APPROX = re.compile(r"^v_(?:exp|log|sin|cos)(?:_legacy)?_f(?:16|32|64)")
_AMD_PROPAGATE = re.compile(r"^v_(?:dual_|pk_)?(?:mul|fma|fmac|mad|mac|fmamk|fmaak|ldexp|add|sub|subrev)"
                            r"(?:_legacy)?_f(?:16|32|64)")
# the compiler's own integer lowering on AMDGCN: 32/64-bit integer division through a float
# reciprocal (``v_rcp_iflag_f32``, scaled by 2^32 / 2^-32 / 0x5f7ffffc) and int64 <-> float
# conversions (hi * 2^32 + lo as one FMA): exact integer results by construction, recognised
# by these immediates (float32 2^32, -2^32, 2^-32, the reciprocal's bias; float64 +-2^32 and
# 2^-32 as high words)
_INT_IMM = {0x4F800000, 0xCF800000, 0x2F800000, 0x5F7FFFFC, 0x41F00000, 0xC1F00000, 0x3DF00000}
_IMM = re.compile(r"0x([0-9a-fA-F]+)")
_REG = re.compile(r"\bv\[(\d+):(\d+)\]|\bv(\d+)\b")


@dataclass(frozen=True)
class Finding:
    kind: str  # "fma" or "approx"
    line: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.line.strip()}"


def _regs(text: str) -> set:
    out = set()
    for m in _REG.finditer(text):
        if m.group(3) is not None:
            out.add(int(m.group(3)))
        else:
            out.update(range(int(m.group(1)), int(m.group(2)) + 1))
    return out


def ptx_findings(ptx: str, no_fma: bool, no_approx: bool) -> list:
    out = []
    if no_fma:
        out += [Finding("fma", m.group(0)) for m in _PTX_FMA.finditer(ptx)]
        out += [Finding("fma", m.group(0) + " (no rounding mode: contractible)") for m in _PTX_LOOSE.finditer(ptx)]
    if no_approx:
        out += [Finding("approx", m.group(0)) for m in _PTX_APPROX.finditer(ptx)]
    return out


def _amd_ops(gcn: str):
    """(mnemonic, dst registers, src registers, line) of every VALU instruction; a VOPD
    line (``a :: b``) gives two."""
    for line in gcn.splitlines():
        s = line.split(";")[0].strip()
        if not s.startswith("v_"):
            continue
        for part in s.split("::"):
            part = part.strip()
            op, _, rest = part.partition(" ")
            args = [a.strip() for a in rest.split(",")] if rest else []
            dst = _regs(args[0]) if args else set()
            src = set().union(*(_regs(a) for a in args[1:])) if len(args) > 1 else set()
            int_idiom = any(int(m, 16) in _INT_IMM for m in _IMM.findall(rest))
            yield op, dst, src, int_idiom, line


def amdgcn_findings(gcn: str, no_fma: bool, no_approx: bool) -> list:
    out = []
    # register -> the approximation seeds (line numbers) its value derives from, for the
    # registers holding a value of a division / square-root expansion
    lineage: dict = {}
    seeds: dict = {}  # seed line number -> line
    refined: set = set()
    for i, (op, dst, src, int_idiom, line) in enumerate(_amd_ops(gcn)):
        if no_approx and _AMD_ALWAYS_APPROX.match(op):
            out.append(Finding("approx", line))
        from_exp = set().union(*(lineage[r] for r in src if r in lineage)) if src & set(lineage) else None
        if int_idiom:  # integer lowering: exempt, and it consumes the reciprocal it reads
            refined |= from_exp or set()
            for r in dst:
                lineage.pop(r, None)
            continue
        is_fma = bool(_AMD_FMA.match(op))
        if is_fma:
            if from_exp is None:
                if no_fma:
                    out.append(Finding("fma", line))
            else:
                refined |= from_exp
        if _AMD_SEED.match(op):
            own = frozenset() if op.startswith("v_div_scale") else frozenset([i])
            if own:
                seeds[i] = line
            for r in dst:
                lineage[r] = own | (from_exp or frozenset())
        elif from_exp is not None and _AMD_PROPAGATE.match(op):
            for r in dst:
                lineage[r] = frozenset(from_exp)
        else:
            if from_exp is not None and _AMD_REFINE_END.match(op):
                refined |= from_exp
            for r in dst:
                lineage.pop(r, None)
    if no_approx:
        out += [Finding("approx", ln + " (never refined)") for i, ln in seeds.items() if i not in refined]
    return out


def findings(asm: dict, no_fma: bool, no_approx: bool) -> list:
    """The violations in a compiled kernel's ``asm`` dict (Triton's ``CompiledKernel.asm``)."""
    if "ptx" in asm:
        return ptx_findings(asm["ptx"], no_fma, no_approx)
    if "amdgcn" in asm:
        return amdgcn_findings(asm["amdgcn"], no_fma, no_approx)
    raise ValueError("no PTX or AMDGCN in the compiled kernel")
