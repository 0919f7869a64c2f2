"""The torch tier's MIX search (``formats.search.torch_mix``, and its shared
batch ``torch_batch``) gives the numba search's books, bytes, codes and
refusals bit for bit: on torch's CPU device always, on CUDA where present.

- whatever a request is batched with, and from several threads;
- ``search.encode_mix`` on it: the codec's bytes and refusals;
- the mode-0 search over its window of bytes equals the pre-speed-up kernel
  (``benchmarks/_legacy_kernels.py``, every byte evaluated) on inputs built
  to defeat the window (zero-weight peaks, mixed magnitudes in a tile, huge
  and subnormal values).
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import _legacy_kernels
from ds4quant import formats
from ds4quant.codebooks import fit_reference
from ds4quant.formats import search
from ds4quant.formats.search import Backend, Tier, numba_mix

torch = pytest.importorskip("torch")
from ds4quant.formats.search import torch_mix  # noqa: E402

F = np.float32
CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


def _torch(dev) -> Backend:
    return Backend(Tier.TORCH, dev)


def _data(rng, rows, cols, kind):
    if kind == "zeros":  # zero halves and exact ties
        x = (rng.integers(-2, 3, (rows, cols)) * 2.0**-7).astype(F)
        x[:, :16] = 0
        return x
    x = (0.02 * rng.standard_t(3, (rows, cols))).astype(F)
    if kind == "wide":  # magnitudes over 2^-30..2^10 within one tile
        x *= (2.0 ** rng.integers(-30, 10, (rows, cols // 16))).repeat(16, axis=1).astype(F)
    if kind == "bad":
        x[1, 40] = np.inf
        x[2, 3] = np.nan
        x[3, 7] = F(1e38)
    return x


def _books(x, L, q):
    return fit_reference([np.nan_to_num(x, nan=0, posinf=0, neginf=0) + F(1e-3)], L, q)[0]


def _same_choice(a, b):
    ok = a[3] == 0  # a refused half's codes are garbage; its status must agree
    return np.array_equal(a[3], b[3]) and all(np.array_equal(u[ok], v[ok]) for u, v in zip(a[:3], b[:3]))



@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("mode", [1, 0])
@pytest.mark.parametrize("rows,cols,kind", [(17, 256, "t3"), (5, 128, "zeros"), (9, 384, "wide"), (4, 128, "bad")])
def test_torch_search_equals_numba(dev, bits, mode, rows, cols, kind):
    check_search(lambda x, imp, books: torch_mix.choose(*search.to_device(x, imp, _torch(dev)), books, mode, bits),
                 np.random.default_rng(rows * 7 + bits + mode), rows, cols, kind, mode, bits)


def check_search(choose, rng, rows, cols, kind, mode, bits):
    """choose(x, importance, books) == numba's search, with and without importance."""
    x = _data(rng, rows, cols, kind)
    q = np.exp(rng.standard_normal(cols)).astype(F)
    q[rng.random(cols) < 0.1] = 0
    books = _books(x, 4 if bits == 2 else 8, q)
    for imp in (q, None):
        want = numba_mix.choose(x, imp, books, mode, bits)
        assert _same_choice(want, choose(x, imp, books)), (kind, imp is None)
    if kind == "bad":
        assert set(np.unique(want[3])) == {0, 1, 2}  # both refusals were exercised


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("mode", [1, 0])
def test_batched_search_equals_numba_whatever_it_is_batched_with(dev, bits, mode):
    """Requests of several shapes, books, weights (and none) and refusals in
    one batch, and again from 6 threads through the queue: each one's slice
    is the numba search of it alone."""
    from concurrent.futures import ThreadPoolExecutor

    from ds4quant.formats.search.torch_batch import _Request, _run_group, choose_batched

    rng = np.random.default_rng(40 + bits + mode)
    L = 4 if bits == 2 else 8
    cases = []
    for rows, cols, kind in ((17, 256, "t3"), (5, 128, "zeros"), (9, 384, "wide"), (4, 128, "bad"), (33, 128, "t3")):
        x = _data(rng, rows, cols, kind)
        q = np.exp(rng.standard_normal(cols)).astype(F)
        q[rng.random(cols) < 0.1] = 0
        books = _books(x, L, q)
        for imp in (q, None):
            cases.append((x, imp, books))
    books0 = cases[0][2].copy()
    books0[1] = 0  # a book whose max level is 0 has no candidates
    cases.append((cases[0][0], cases[0][1], books0))
    want = [numba_mix.choose(x, imp, b, mode, bits) for x, imp, b in cases]
    reqs = [_Request(*search.to_device(x, imp, _torch(dev)), b, mode, bits) for x, imp, b in cases]
    _run_group(reqs)
    for r, w in zip(reqs, want):
        assert _same_choice(w, r.result)
    with ThreadPoolExecutor(6) as ex:
        got = list(ex.map(lambda c: choose_batched(*search.to_device(c[0], c[1], _torch(dev)), c[2], mode, bits),
                          cases * 3))
    for g, w in zip(got, want * 3):
        assert _same_choice(w, g)


def test_encode_mix_refuses_like_the_codec():
    books = np.array([[-1, -0.25, 0.25, 1], [-1, -0.5, 0.5, 1]], F)
    for value, what in ((np.inf, "non-finite value at row 1, column 40"),
                        (F(3e38), "row 1, block 1 (half 0)")):  # every candidate's error overflows
        x = np.full((3, 128), 0.01, F)
        x[1, 40] = value
        msgs = []
        for enc in (lambda: formats.encode("rocmfp2_mix", x, None, books),
                    lambda: search.encode_mix("rocmfp2_mix", x, None, books, 1, _torch("cpu"))):
            with pytest.raises(Exception) as e:
                enc()
            msgs.append(str(e.value))
        assert msgs[0] == msgs[1] and what in msgs[0], msgs


def _legacy(qtype, x, imp, books, mode):
    """The codec's bytes from the pre-speed-up kernel, which evaluates every byte."""
    qt = formats.get_qtype(qtype)
    return _legacy_kernels.encode(x, imp, books, qt=qt, bits=2 if qt.codebook_levels == 4 else 3, mode=mode)


@pytest.mark.parametrize("qtype", ["rocmfp2_mix", "rocmfp3_mix"])
@pytest.mark.parametrize("case", ["zero_weight_peak", "wide", "huge", "subnormal", "negative", "t3"])
def test_windowed_fixed_search_equals_the_full_scan(qtype, case):
    rng = np.random.default_rng(hash(case) % 1000)
    rows, cols = 24, 256
    x = _data(rng, rows, cols, "wide" if case == "wide" else "t3")
    q = np.exp(rng.standard_normal(cols)).astype(F)
    if case == "zero_weight_peak":  # the clipping bound is 0: the bytes below must be scanned
        peak = np.abs(x).reshape(rows, -1, 16).argmax(-1)
        for r in range(0, rows, 2):
            q[(np.arange(cols // 16) * 16 + peak[r])[: cols // 32]] = 0
    elif case == "huge":
        x = (x * F(2.0**100)).astype(F)
    elif case == "subnormal":
        x = (x * F(2.0**-120)).astype(F)
    elif case == "negative":
        x = -np.abs(x)
    books = _books(x, formats.get_qtype(qtype).codebook_levels, q)
    for imp in (q, None):
        try:
            want = _legacy(qtype, x, imp, books, 0)
        except Exception as e:  # noqa: BLE001  (a refusal must be the same refusal)
            with pytest.raises(type(e)):
                formats.encode(qtype, x, imp, books, mode=0)
            with pytest.raises(type(e)):
                search.encode_mix(qtype, x, imp, books, 0, _torch("cpu"))
            continue
        assert np.array_equal(formats.encode(qtype, x, imp, books, mode=0), want)
        for dev in DEVICES:  # the device search's own window
            assert np.array_equal(search.encode_mix(qtype, x, imp, books, 0, _torch(dev)), want), dev
