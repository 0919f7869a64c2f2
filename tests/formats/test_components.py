"""formats.components: recomposing codes x levels x scales is decode, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from ds4quant import formats
from ds4quant.errors import UnsupportedFormatError
from ds4quant.formats.components import decode_row_nb, row_kind, row_lut

QTYPES = ("rocmfp2", "rocmfp2_affine", "rocmfp2_s40", "rocmfp3", "rocmfp4", "rocmfp4_fast", "rocmfp6",
          "rocmfp8", "rocmfp2_mix", "rocmfp3_mix", "mxfp4", "q8_0", "bf16", "f16", "f32")
COLS = 256


def _mix_kw(qt, rng, n):
    books = np.sort(rng.uniform(-1, 1, (n, 2, qt.codebook_levels)), axis=-1).astype(np.float32)
    books = formats.bf16_round(books)
    books[:, :, 0] = -1.0  # keep the books strictly increasing after bf16 rounding
    books[:, :, -1] = 1.0
    return dict(codebooks=books, modes=np.array([1, 0, 1][:n]))


def _explain(a: np.ndarray, b: np.ndarray) -> str:
    ua, ub = a.view(np.uint32), b.view(np.uint32)
    bad = np.argwhere(ua != ub)
    r, c = bad[0]
    return f"{len(bad)} differing values; first at {r, c}: {ua[r, c]:#010x} vs {ub[r, c]:#010x}"


def _cases(name):
    qt = formats.QTYPES[name]
    rng = np.random.default_rng(sum(name.encode()) * 7919)
    rows = 6
    kw = _mix_kw(qt, rng, 3) if qt.is_mix else {}
    random_bytes = rng.integers(0, 256, (rows, qt.row_bytes(COLS)), dtype=np.uint8)
    yield "random", random_bytes, kw
    w = (rng.standard_normal((rows, COLS)) * 0.1).astype(np.float32)
    w[0, :32] = 0.0
    if qt.is_mix:
        per = rows // 3
        enc = np.concatenate([formats.encode(name, w[i * per:(i + 1) * per], codebooks=kw["codebooks"][i],
                                             mode=int(kw["modes"][i])) for i in range(3)])
    else:
        enc = formats.encode(name, w)
    yield "encoded", enc, kw
    yield "zero", np.zeros_like(random_bytes), kw


@pytest.mark.parametrize("name", QTYPES)
def test_recompose_is_decode(name):
    for case, data, kw in _cases(name):
        ref = formats.decode(name, data, COLS, **kw)
        comp = formats.components(name, data, COLS, **kw)
        got = comp.recompose()
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), f"{name} {case}: {_explain(got, ref)}"


@pytest.mark.parametrize("name", QTYPES)
def test_numba_row_decoder_is_decode(name):
    qt = formats.QTYPES[name]
    kind, p0, p1 = row_kind(name)
    out = np.empty(COLS, np.float32)
    for case, data, kw in _cases(name):
        ref = formats.decode(name, data, COLS, **kw)
        per = data.shape[0] // 3
        for r in range(data.shape[0]):
            books = kw["codebooks"][r // per] if qt.is_mix else None
            mode = int(kw["modes"][r // per]) if qt.is_mix else 1
            decode_row_nb(kind, p0, p1, data[r], COLS, row_lut(name, books, mode), mode, out, out.view(np.uint32))
            assert np.array_equal(out.view(np.uint32), ref[r].view(np.uint32)), f"{name} {case} row {r}"


def test_components_structure():
    # levels are small integers for the scale formats; scales are UE4M3 multiples of 2^-10
    w = np.random.default_rng(3).standard_normal((4, COLS)).astype(np.float32)
    c = formats.components("rocmfp3", formats.encode("rocmfp3", w), COLS)
    assert c.group == 16 and c.codes.shape == (4, COLS) and c.scale.shape == (4, COLS // 16)
    assert set(np.unique(c.levels[0, :8])) <= {-4, -2, -1, 0, 1, 2, 4}
    assert np.all(np.mod(c.scale * 1024, 1) == 0)
    mant, exp = formats.exact_parts(c.scale)
    assert np.array_equal(np.ldexp(mant.astype(np.float64), exp.astype(np.int32)), c.scale.astype(np.float64))
    assert np.all((mant == 0) | (mant % 2 != 0))


def test_exact_parts_refuses_nonfinite_and_non_weight_qtypes():
    with pytest.raises(UnsupportedFormatError):
        formats.exact_parts(np.array([1.0, np.inf], np.float32))
    with pytest.raises(UnsupportedFormatError):
        formats.components("i32", np.zeros((1, 4), np.uint8), 1)
