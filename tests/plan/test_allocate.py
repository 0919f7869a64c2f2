"""The budgeted allocator: never over budget, optimal where it can be checked."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ds4quant.plan import Candidate, Item, allocate
from ds4quant.errors import BudgetError

BPW = {"rocmfp2": 2.5, "rocmfp3": 3.5, "rocmfp4_fast": 4.25, "rocmfp4": 4.5}


def _items(errors: np.ndarray, weights: list[int]) -> list[Item]:
    return [
        Item(f"t{i}", tuple(Candidate(q, int(BPW[q] * n / 8), float(errors[i, j])) for j, q in enumerate(BPW)))
        for i, n in enumerate(weights)
    ]


def _brute(items, budget):
    best = None
    for combo in itertools.product(*[it.candidates for it in items]):
        b = sum(c.bytes for c in combo)
        if b <= budget:
            e = sum(c.error for c in combo)
            if best is None or e < best[0]:
                best = (e, b)
    return best


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(2, 5), st.floats(2.5, 4.5))
def test_exact_on_small_problems(seed, n, bpw):
    rng = np.random.default_rng(seed)
    # error falls with bits, with item-specific sensitivity
    sens = rng.lognormal(0, 1, size=n)
    errors = sens[:, None] * 2.0 ** (-2 * np.array(list(BPW.values())))[None, :] * rng.uniform(0.8, 1.2, (n, 4))
    weights = [int(w) * 32 for w in rng.integers(1, 64, size=n)]
    items = _items(errors, weights)
    budget = int(bpw * sum(weights) / 8)
    a = allocate(items, budget)
    assert a.bytes <= budget
    e, _ = _brute(items, budget)
    assert a.error == pytest.approx(e, rel=1e-12)


def test_lagrange_path_stays_under_budget_and_lands_close():
    rng = np.random.default_rng(1)
    n = 3000  # big enough that the exact DP gives way
    sens = rng.lognormal(0, 1.5, size=n)
    errors = sens[:, None] * 2.0 ** (-2 * np.array(list(BPW.values())))[None, :]
    weights = [4096 * 2048] * n
    items = _items(errors, weights)
    for target in (2.6, 2.7, 3.1, 4.0):
        budget = int(target * sum(weights) / 8)
        a = allocate(items, budget)
        assert a.bytes <= budget
        assert a.slack < 0.005, (target, a.slack, a.method)


def test_more_budget_never_raises_error():
    rng = np.random.default_rng(2)
    errors = rng.lognormal(0, 1, (40, 1)) * 2.0 ** (-2 * np.array(list(BPW.values())))[None, :]
    items = _items(errors, [1 << 20] * 40)
    prev = np.inf
    for target in np.linspace(2.5, 4.5, 9):
        a = allocate(items, int(target * 40 * (1 << 20) / 8))
        assert a.error <= prev + 1e-12
        prev = a.error


def test_impossible_budget_is_a_clear_error():
    items = _items(np.ones((3, 4)), [1024] * 3)
    with pytest.raises(BudgetError, match="below the smallest possible size"):
        allocate(items, 100)


def test_dominated_and_nonfinite_candidates_are_ignored():
    items = [Item("a", (Candidate("x", 10, 5.0), Candidate("y", 20, 6.0), Candidate("z", 5, float("nan"))))]
    a = allocate(items, 100)
    assert a.choice == {"a": "x"}
