"""An adaptive budget the candidates cannot meet is refused before measuring, naming the range.

Before, ``--target-bpw 20`` was accepted and landed at 4.5 bpw (the only sign: "77.50% under"
budget), and a target below the cheapest candidate was refused only after the whole measurement.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from ds4quant.cli import cli
from ds4quant.errors import BudgetError
from ds4quant.plan import AdaptiveOptions
from ds4quant.plan.planner import check_reachable, reachable_bytes

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "ds4-tiny"


class _C:
    def __init__(self, name, surface, shape):
        self.name, self.surface, self.shape = name, surface, shape


@pytest.mark.parametrize("target, where", [("20", "above"), ("4.6", "above"), ("1.0", "below"), ("2.4", "below")])
def test_a_target_outside_the_reachable_range_is_one_line_before_any_measuring(tmp_path, target, where):
    out = tmp_path / "out"
    t0 = time.perf_counter()
    res = CliRunner().invoke(cli, ["convert", str(SAMPLE), str(out), "--recipe", "adaptive", "--target-bpw", target,
                                   "--cache-dir", str(tmp_path / "cache")])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and f"is {where} what the candidates" in lines[0]
    # the sample's default candidates: rocmfp2 (2.5 bpw) up to rocmfp4 (4.5 bpw)
    assert "2.5000 to 4.5000 bpw" in lines[0]
    assert not out.exists() and not (tmp_path / "cache").exists()  # nothing measured


def test_reachable_bytes_and_the_max_bytes_cap():
    opts = AdaptiveOptions(target_bpw=3.0, candidates=("rocmfp2", "rocmfp4"))
    todo = [(_C("a", "down", (256, 64, 4)), None), (_C("b", "gate", (128, 64, 4)), None)]
    n = 256 * 64 * 4 + 128 * 64 * 4
    lo, hi = reachable_bytes(todo, opts)
    assert (lo, hi) == (n * 10 // 32, n * 18 // 32)
    check_reachable(todo, opts, lo, 0, n)  # the cheapest everywhere: exactly reachable
    with pytest.raises(BudgetError, match="below the smallest possible size"):
        check_reachable(todo, opts, lo - 1, 0, n)
    at_top = AdaptiveOptions(target_bpw=4.5, candidates=("rocmfp2", "rocmfp4"))
    check_reachable(todo, at_top, hi, 0, n)
    cap = AdaptiveOptions(max_bytes=10**9, candidates=("rocmfp2", "rocmfp4"))
    check_reachable(todo, cap, 10**9, 0, n)  # a cap above the most they take simply holds
    with pytest.raises(BudgetError, match="--max-bytes"):
        check_reachable(todo, cap, lo - 1, 0, n)
