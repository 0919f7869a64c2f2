"""The reference fitter (docs/formats.md#mix-fitter) against the golden fit cases, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4quant import formats
from ds4quant.codebooks import Histogram, fit_reference, fit_reference_result
from ds4quant.codebooks.histogram import _bf16_repair
from ds4quant.errors import BadInputError, CodebookError, Ds4quantError
from tests.golden import load_cases

F = np.float32
FIT_CASES = [c for c in load_cases() if c.kind == "fit"]
FITTED_MIX = [c for c in load_cases() if c.record.get("books_name") == "fitted"]


def _bits(books):
    return (np.asarray(books, dtype=F).view(np.uint32) >> 16).astype(np.uint16).reshape(-1)


def test_public_split_has_the_fit_cases():
    assert len(FIT_CASES) == 4 and len(FITTED_MIX) >= 10


@pytest.mark.parametrize("impl", ["ref", "fast"])
@pytest.mark.parametrize("case", FIT_CASES, ids=lambda c: c.id)
def test_golden_fit_case(case, impl):
    rec = case.record
    mats = [case.array(f"matrix{i}") for i in range(rec["n_matrices"])]
    imp = case.array("imatrix") if case.has("imatrix") else None
    if rec["expect"] == "reject":
        with pytest.raises(CodebookError):
            fit_reference_result(mats, rec["levels"], imp, impl=impl)
        return
    r = fit_reference_result(mats, rec["levels"], imp, impl=impl)
    assert np.array_equal(_bits(r.books), case.array("books")), f"{_bits(r.books)} != {case.array('books')}"
    assert list(r.repaired) == rec["repaired"]
    assert list(r.population_mass) == rec["population_mass"]  # exact doubles
    books, repaired = fit_reference(mats, rec["levels"], imp, impl=impl)
    assert np.array_equal(books.view(np.uint32), r.books.view(np.uint32)) and repaired == r.repaired


@pytest.mark.parametrize("case", FITTED_MIX, ids=lambda c: c.id)
def test_golden_mix_books_refit_from_their_input(case):
    # the 'fitted' MIX cases carry books the oracle fitted on the case's input
    imp = case.array("imatrix") if case.has("imatrix") else None
    L = formats.get_qtype(case.qtype).codebook_levels
    books, _ = fit_reference([case.array("input")], L, imp)
    assert np.array_equal(books.view(np.uint32), case.books().view(np.uint32))


def test_importance_forms_and_order():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 8, 64)).astype(F)
    q = np.exp(rng.standard_normal(64)).astype(F)
    one = fit_reference_result([a, b], 4, q)
    assert np.array_equal(one.books, fit_reference_result([a, b], 4, [q, q]).books)
    mixed = fit_reference_result([a, b], 4, [q, None])
    h = Histogram()
    h.add(a, q)
    h.add(b)
    assert np.array_equal(mixed.books, h.fit(4).books) and mixed.population_mass == h.population_mass
    # zero/NaN/negative importance columns add nothing; a zero half adds 16.0 unweighted
    z = np.zeros((1, 32), dtype=F)
    z[0, 16:] = 1.0
    qz = np.full(32, np.nan, dtype=F)
    qz[16:] = [0, -1, 2] + [0] * 13
    hz = Histogram()
    hz.add(z, qz)
    bins = hz.bins
    assert bins[0, 2048] == 16.0 and bins.sum() == 18.0 and bins[1, 4096] == 2.0


def test_rejections():
    x = np.ones((2, 32), dtype=F)
    x[1, 7] = np.inf
    with pytest.raises(CodebookError, match="matrix 0 has a non-finite value at row 1, column 7"):
        fit_reference([x], 4)
    with pytest.raises(CodebookError, match="empty codebook histogram"):
        fit_reference([np.ones((2, 32), F)], 8, np.zeros(32, F))
    with pytest.raises(BadInputError, match="levels"):
        fit_reference([np.ones((2, 32), F)], 5)
    with pytest.raises(BadInputError):
        fit_reference(np.ones((2, 32), F), 4)  # one array, not a list
    with pytest.raises(BadInputError):
        fit_reference([np.ones((2, 32), F)], 4, [None, None])
    with pytest.raises(Ds4quantError):
        fit_reference([np.ones((2, 24), F)], 4)
    with pytest.raises(CodebookError, match="not finite"):
        _bf16_repair(np.array([-1, 0, 0.5, np.nan], F), 0)
    with pytest.raises(CodebookError, match="not finite"):
        _bf16_repair(np.array([-1, 0, 0.5, 1.5], F), 1)


def test_repair_examples_from_the_spec():
    # a +-1 input gives [-1, -0.99609375, 0.99609375, 1] for L = 4 (docs/formats.md#mix-fitter)
    bits, repaired = _bf16_repair(np.array([-1, -1, 1, 1], F), 0)
    assert (np.asarray(bits, np.uint32) << 16).view(np.float32).tolist() == [-1, -0.99609375, 0.99609375, 1]
    assert repaired
    bits, repaired = _bf16_repair(np.array([0, 0, 0, 0], F), 0)
    assert bits.tolist() == [0x0000, 0x0080, 0x0081, 0x0082] and repaired


def _matrices(seed, kind, rows, cols):
    rng = np.random.default_rng(seed)
    if kind == "gauss":
        x = rng.standard_normal((rows, cols))
    elif kind == "t2":
        x = rng.standard_t(2, (rows, cols))
    elif kind == "ternary":
        x = rng.integers(-1, 2, (rows, cols)) * 0.5
    else:
        x = rng.standard_normal((rows, cols)) * (rng.random((rows, cols)) < 0.1)
    return x.astype(F)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    kind=st.sampled_from(["gauss", "t2", "ternary", "sparse"]),
    levels=st.sampled_from([4, 8]),
    rows=st.integers(1, 6),
    weighted=st.booleans(),
)
def test_property_books_valid_and_deterministic(seed, kind, levels, rows, weighted):
    x = _matrices(seed, kind, rows, 64)
    q = np.abs(_matrices(seed + 1, "gauss", 1, 64)[0]) if weighted else None
    try:
        r = fit_reference_result([x], levels, q, impl="fast")
    except CodebookError as e:
        assert "empty" in str(e)
        return
    books = r.books
    assert books.shape == (2, levels) and books.dtype == np.float32
    assert np.all(np.diff(books, axis=1) > 0)
    assert np.all(np.abs(books) <= 1)
    assert np.array_equal(formats.bf16_round(books).view(np.uint32), books.view(np.uint32))
    again = fit_reference_result([x], levels, q, impl="ref")
    assert np.array_equal(again.books.view(np.uint32), books.view(np.uint32))
    assert again.repaired == r.repaired and again.population_mass == r.population_mass
    formats.check_codebooks(formats.get_qtype("rocmfp2_mix" if levels == 4 else "rocmfp3_mix"), books)


def test_fast_histogram_bits_equal_reference_on_a_large_matrix():
    x = _matrices(5, "t2", 300, 512)
    x[7, 32:48] = 0
    q = np.exp(_matrices(6, "gauss", 1, 512)[0]).astype(F)
    q[::9] = 0
    a, b = Histogram(impl="ref"), Histogram(impl="fast")
    for h in (a, b):
        h.add(x, q)
        h.add(x[:40])
    assert np.array_equal(a.bins.view(np.uint64), b.bins.view(np.uint64))
