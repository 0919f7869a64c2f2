"""Budgeted qtype allocation: pick one candidate per item under a byte budget.

A multiple-choice knapsack: every item (a layer x surface tensor, or one
expert of it) has candidates (qtype, bytes, measured error); choose one per
item minimising the total error with total bytes <= budget. Three stages:

1. drop dominated candidates (no fewer bytes and no lower error than another);
2. Lagrangian relaxation: binary search the price per byte ``lam`` so that
   ``argmin error + lam * bytes`` per item uses as many bytes as the budget
   allows; this is optimal on the lower convex hull of each item;
3. fill: spend what is left on the single upgrades with the best error drop
   per byte that still fit, until none fits. For small problems an exact
   dynamic programme over reachable byte totals replaces stages 2-3.

The result never exceeds the budget. ``Allocation.slack`` says how far under
it landed; callers that promise "within 0.5% under" check it and report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ds4quant.errors import BudgetError

# The exact DP gives way to stages 2-3 above this much work (state x candidate
# visits, in Python), so big problems never stall in it.
_DP_MAX_WORK = 1_000_000


@dataclass(frozen=True)
class Candidate:
    qtype: str
    bytes: int
    error: float


@dataclass(frozen=True)
class Item:
    key: str
    candidates: tuple[Candidate, ...]


@dataclass(frozen=True)
class Allocation:
    """choice: item key -> qtype. bytes/error: totals. budget: the cap.
    method: "dp" (exact) or "lagrange+fill"."""

    choice: Mapping[str, str]
    bytes: int
    error: float
    budget: int
    method: str

    @property
    def slack(self) -> float:
        """Fraction of the budget left unused (0 = exactly on budget)."""
        return (self.budget - self.bytes) / self.budget if self.budget else 0.0


def _pareto(cands: Sequence[Candidate]) -> list[Candidate]:
    """Candidates sorted by bytes with strictly falling error (ties: fewer bytes,
    then qtype name, so the choice is deterministic)."""
    out: list[Candidate] = []
    for c in sorted(cands, key=lambda c: (c.bytes, c.error, c.qtype)):
        if not np.isfinite(c.error):
            continue
        if out and c.error >= out[-1].error:
            continue
        if out and c.bytes == out[-1].bytes:
            continue
        out.append(c)
    return out


def allocate(items: Sequence[Item], budget: int) -> Allocation:
    """Choose one candidate per item; total bytes <= ``budget``.

    Raises BudgetError when even the smallest candidates exceed the budget.
    """
    if not items:
        raise BudgetError("nothing to allocate")
    keys = [it.key for it in items]
    if len(set(keys)) != len(keys):
        raise BudgetError("duplicate allocation item keys")
    fronts = []
    for it in items:
        f = _pareto(it.candidates)
        if not f:
            raise BudgetError("no usable candidate (all errors are non-finite)", where=it.key)
        fronts.append(f)
    floor = sum(f[0].bytes for f in fronts)
    if floor > budget:
        raise BudgetError(
            f"the budget of {budget:,} bytes is below the smallest possible size {floor:,} bytes",
            hint="raise --target-bpw / --max-bytes or add smaller --candidates",
        )
    pick = _dp(fronts, budget)
    method = "dp"
    if pick is None:
        pick = _fill(fronts, _lagrange(fronts, budget), budget)
        method = "lagrange+fill"
    total_b = sum(f[i].bytes for f, i in zip(fronts, pick))
    total_e = float(sum(f[i].error for f, i in zip(fronts, pick)))
    return Allocation({k: f[i].qtype for k, f, i in zip(keys, fronts, pick)}, total_b, total_e, budget, method)


def _matrices(fronts: list[list[Candidate]]) -> tuple[np.ndarray, np.ndarray]:
    """Bytes and errors as (items, width) arrays; missing slots never chosen."""
    n, width = len(fronts), max(len(f) for f in fronts)
    B = np.full((n, width), np.iinfo(np.int64).max // 4, dtype=np.int64)
    E = np.full((n, width), np.inf)
    for r, f in enumerate(fronts):
        B[r, : len(f)] = [c.bytes for c in f]
        E[r, : len(f)] = [c.error for c in f]
    return B, E


def _lagrange(fronts: list[list[Candidate]], budget: int) -> list[int]:
    B, E = _matrices(fronts)
    rows = np.arange(len(fronts))
    Bf = np.where(np.isfinite(E), B, 0).astype(np.float64)

    def choose(lam: float) -> tuple[np.ndarray, int]:
        cost = np.where(np.isfinite(E), E + lam * Bf, np.inf)
        pick = np.argmin(cost, axis=1)  # first minimum: the fewer bytes on ties
        return pick, int(B[rows, pick].sum())

    pick, used = choose(0.0)
    if used <= budget:
        return [int(i) for i in pick]
    lo, hi = 0.0, 1.0
    while choose(hi)[1] > budget and hi < 1e300:
        hi *= 4.0
    best = choose(hi)[0]
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        p, u = choose(mid)
        if u <= budget:
            hi, best = mid, p
        else:
            lo = mid
    return [int(i) for i in best]


def _fill(fronts: list[list[Candidate]], pick: list[int], budget: int) -> list[int]:
    """Greedy upgrades by error drop per byte, while they fit."""
    B, E = _matrices(fronts)
    n = len(fronts)
    pick = np.array(pick)
    rows = np.arange(n)
    used = int(B[rows, pick].sum())
    while True:
        cur_b = B[rows, pick][:, None]
        cur_e = E[rows, pick][:, None]
        db = B - cur_b
        de = E - cur_e
        ok = (db > 0) & (db <= budget - used) & (de < 0)
        if not ok.any():
            break
        gain = np.where(ok, -de / np.where(db > 0, db, 1), -np.inf)
        r, c = np.unravel_index(int(np.argmax(gain)), gain.shape)
        used += int(db[r, c])
        pick[r] = c
    return [int(i) for i in pick]


def _dp(fronts: list[list[Candidate]], budget: int):
    """Exact minimum error over reachable byte totals, or None when too big.

    States are byte totals with their best error; back-pointers per item
    rebuild the choice, so no state carries a growing path.
    """
    states: dict[int, float] = {0: 0.0}
    back: list[dict[int, tuple[int, int]]] = []
    work = 0
    for f in fronts:
        work += len(states) * len(f)
        if work > _DP_MAX_WORK:
            return None
        nxt: dict[int, float] = {}
        ptr: dict[int, tuple[int, int]] = {}
        for used, err in states.items():
            for i, c in enumerate(f):
                b = used + c.bytes
                if b > budget:
                    break  # fronts are sorted by bytes
                e = err + c.error
                old = nxt.get(b)
                if old is None or e < old:
                    nxt[b] = e
                    ptr[b] = (used, i)
        # keep only states not dominated by a cheaper state with lower error
        states, best = {}, np.inf
        for b in sorted(nxt):
            if nxt[b] < best:
                states[b] = best = nxt[b]
        back.append(ptr)
    b = min(states, key=lambda k: (states[k], k))
    pick = []
    for ptr in reversed(back):
        b, i = ptr[b]
        pick.append(i)
    return pick[::-1]
