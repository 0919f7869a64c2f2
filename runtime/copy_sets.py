"""Exact-copy scores over several seeded identifier sets, with an interval.

One set of 60 trials cannot separate artifacts a few trials apart: different
identifier sets drawn the same way move a score by several trials. With teacher
forcing a trial costs one forward pass, so ``copy_sets`` runs ``n_sets`` sets
of the protocol (the protocol's own seed first, then ``PROTOCOL_SEED + i``:
same task, same 20 x 3 form, their own identifiers and contexts) and reports
the per-set passes, the pooled mean per 60 trials and its 95% Wilson score
interval on the pooled proportion, scaled to 60 trials.

Why the default of 5 sets: the Wilson half-width at 300 trials is under
2 trials per 60 for pass rates of 90% and above (1.7 at 93%), the range the
samples' artifacts score in; at 50% it would take about 15 sets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ds4quant.errors import BadInputError

DEFAULT_SETS = 5
Z95 = 1.959963984540054  # two-sided 95% normal quantile
PER = 60  # a protocol set's trials: the unit scores are quoted in
METHOD = "Wilson score interval (95%) on the pooled proportion, scaled to 60 trials"


def wilson(passes: int, trials: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of passes / trials (proportions)."""
    if trials <= 0 or not 0 <= passes <= trials:
        raise BadInputError(f"{passes} passes of {trials} trials")
    p = passes / trials
    d = 1 + z * z / trials
    c = (p + z * z / (2 * trials)) / d
    h = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / d
    return max(0.0, c - h), min(1.0, c + h)


@dataclass(frozen=True)
class CopySets:
    """Per-set passes (trials each) and the pooled figures per 60 trials."""

    seeds: tuple[int, ...]
    passes: tuple[int, ...]
    trials: int  # per set

    @property
    def pooled(self) -> tuple[int, int]:
        return sum(self.passes), self.trials * len(self.passes)

    @property
    def per60(self) -> float:
        k, n = self.pooled
        return PER * k / n

    @property
    def interval(self) -> tuple[float, float]:
        lo, hi = wilson(*self.pooled)
        return PER * lo, PER * hi


def check_sets(n_sets) -> int:
    if isinstance(n_sets, bool) or not isinstance(n_sets, int) or n_sets < 1:
        raise BadInputError(f"must be an int >= 1, got {n_sets!r}", where="--copy-sets")
    return n_sets


def copy_sets(model, tok, task, n_sets: int = DEFAULT_SETS, *, generate: bool = False):
    """(CopySets, the protocol's own set's ExactCopyResult) for ``model``."""
    from ds4quant.runtime import fidelity as fd

    check_sets(n_sets)
    seeds = tuple(fd.PROTOCOL_SEED + i for i in range(n_sets))
    results = [fd.exact_copy(model, tok, task, seed=s, generate=generate) for s in seeds]
    return CopySets(seeds, tuple(r.passes for r in results), results[0].trials), results[0]
