"""Verify stage 2, codebooks: every table valid, every resident MIX tensor covered
exactly once, own table and Lucebox blobs agreeing (the rules are the view's);
then the runtimes key, which depends on the books."""

from __future__ import annotations

from ds4quant.verify._run import Context
from ds4quant.verify.structure import check_runtimes


def codebooks(ctx: Context) -> None:
    """Stage: codebook tables, then ``ds4quant.runtimes`` against the contents."""
    v = ctx.view
    ctx.fail_problems("codebooks")
    if v.mix_tensors or v.codebook_tables:
        ctx.passed_if_clean("codebooks", f"{len(v.mix_tensors)} MIX tensor(s), each covered exactly once by "
                                         f"{', '.join(v.codebook_tables) or 'no table'}", ctx.first)
    check_runtimes(ctx)
