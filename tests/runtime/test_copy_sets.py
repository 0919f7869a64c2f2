"""Seeded identifier sets and the Wilson interval of their pooled score."""

import math

import pytest

from ds4quant.errors import BadInputError
from ds4quant.runtime import copy_sets as cs
from ds4quant.runtime import fidelity as fd


def test_wilson_by_hand():
    # p = 0.9, n = 100, z = 1.96: centre (0.9 + 0.019208) / 1.038416, half 1.96*sqrt(0.0009+0.00009604)/1.038416
    lo, hi = cs.wilson(90, 100)
    z = cs.Z95
    c = (0.9 + z * z / 200) / (1 + z * z / 100)
    h = z * math.sqrt(0.09 / 100 + z * z / 40000) / (1 + z * z / 100)
    assert (lo, hi) == pytest.approx((c - h, c + h), abs=1e-12)
    assert cs.wilson(0, 10)[0] == pytest.approx(0.0, abs=1e-15) and cs.wilson(10, 10)[1] == pytest.approx(1.0)
    with pytest.raises(BadInputError):
        cs.wilson(3, 0)


def test_default_sets_give_about_two_trials_per_60():
    s = cs.CopySets(tuple(range(cs.DEFAULT_SETS)), (56,) * cs.DEFAULT_SETS, 60)
    lo, hi = s.interval
    assert s.per60 == 56 and lo < 56 < hi and (hi - lo) / 2 < 2.0


def test_sets_are_their_own_seeds_in_the_protocol_form():
    a, b = fd.protocol_trials(fd.ECHO, fd.PROTOCOL_SEED), fd.protocol_trials(fd.ECHO, fd.PROTOCOL_SEED + 1)
    assert len(a) == len(b) == 60
    assert not set(t.identifier for t in a) & set(t.identifier for t in b)


    def __init__(self, tok, task):
        self.tok, self.task = tok, task


def test_refuses_bad_counts():
    for bad in (0, -1, True, 1.5):
        with pytest.raises(BadInputError, match="--copy-sets"):
            cs.check_sets(bad)
