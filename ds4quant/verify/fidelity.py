"""Verify stage 5, fidelity through the runtime: where the runtime's measurements
(MoE layer outputs, logit KL and top-1, response hashes, identity across
placements; DESIGN.md "Fidelity") will be recorded.

Until the runtime provides them, the stage records that fidelity was not
requested and adds no check and no number: a report never shows figures that
were not measured.
"""

from __future__ import annotations

from ds4quant.verify._run import Context


def fidelity(ctx: Context) -> None:
    """Stage: record whether fidelity was measured (today: never requested)."""
    ctx.fidelity = {"requested": bool(ctx.options.fidelity), "measured": False,
                    "detail": "fidelity through the runtime is not measured by this version"}
