"""ds4quant.sizes: the one size parser (--split-max-size, --max-bytes, owner budgets)."""

from __future__ import annotations

import numpy as np
import pytest

from ds4quant.errors import BadInputError, BudgetError, Ds4quantError
from ds4quant.sizes import MAX_SIZE, parse_size


def test_units_are_binary_and_exact():
    assert parse_size("1024") == 1024 and parse_size("512M") == 512 << 20 and parse_size("50G") == 50 << 30
    assert parse_size("1.5K") == 1536 and parse_size("2GiB") == 2 << 30 and parse_size("0") == 0
    assert parse_size(" 64k ") == 64 << 10 and parse_size("1.5T") == 3 << 39 and parse_size("7b") == 7
    assert parse_size("0.1K") == 102  # floor of 102.4 bytes, from exact decimal arithmetic
    assert parse_size(np.int64(4096)) == 4096 and parse_size(MAX_SIZE) == MAX_SIZE


@pytest.mark.parametrize("bad", ["", "G", "1e3", "inf", "nan", "1..2G", "5X", "50 G", "x" * 50, True])
def test_text_that_is_no_size_is_refused_naming_the_option(bad):
    with pytest.raises(BadInputError, match="--split-max-size: bad size"):
        parse_size(bad, "--split-max-size")


def test_negative_and_huge_sizes_are_budget_errors():
    with pytest.raises(BudgetError, match="size must not be negative"):
        parse_size("-5G", "--owner cpu")
    with pytest.raises(BudgetError, match="larger than 2"):
        parse_size("99999999T")
    with pytest.raises(BudgetError, match="larger than 2"):
        parse_size(MAX_SIZE + 1)


@pytest.mark.parametrize("text", ["0", "-1", "0.0001K", 0])
def test_positive_refuses_zero_and_less(text):
    with pytest.raises(BadInputError, match="--max-bytes: size must be positive"):
        parse_size(text, "--max-bytes", positive=True)
    assert parse_size("1", positive=True) == 1


def test_every_refusal_is_one_user_error():
    for bad in ("lots", "-1", "1e99T"):
        with pytest.raises(Ds4quantError):
            parse_size(bad)
