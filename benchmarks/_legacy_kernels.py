"""The measure stage's kernels from before its speed-up: the anchor that
benchmarks/adaptive.py times the current ones against, in the same run.

- ``_encode_nb`` (mode 1, docs/formats.md#mix-encoder) and ``_encode_fixed_nb`` (mode 0): the MIX
  encode one row per prange iteration with a binary-search NL, every byte
  of mode 0 evaluated. The same bytes and refusals as the library's
  vectorised search (``ds4quant.formats.search``); ``encode`` wraps them as
  the codec's fast encoder. A refused row gets status 1 (a non-finite half)
  or 2 (no finite-error candidate) and the index of the half in fail_half.
- ``legacy_kernels()``: the whole measure stage on them, as a context: MIX
  encodes through these kernels, the codebook fitter's encode + decode +
  unpack per Lloyd step (``fit_optimized(impl="legacy")``), and the
  reference fitter's Lloyd and bf16 repair in numpy (its ``impl="ref"``
  steps). The same figures, books and plan; slower.

Nothing in the library reads these: the context swaps them in from here.
"""

from __future__ import annotations

import dataclasses
import functools
from contextlib import contextmanager

import numba
import numpy as np

from ds4quant.formats.search import numba_mix, numba_pack
from ds4quant.formats.search.numba_mix import fixed_code_nb as _fixed_code_nb
from ds4quant.formats.search.tables import fixed_levels
from ds4quant.formats.ue4m3 import UE4M3, UE4M3_INV, nearest_nb


@numba.njit(cache=True, nogil=True)
def _nl_nb(v, split):
    lo = 0
    hi = split.shape[0]
    while lo < hi:
        mid = (lo + hi) // 2
        if v <= split[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo


@numba.njit(cache=True, nogil=True)
def _put_code(qs, i, code, bits):
    # LE bit stream: code bit j -> stream bit bits*i + j (docs/formats.md#rocmfp2, #rocmfp3)
    pos = bits * i
    byte = pos >> 3
    sh = pos & 7
    qs[byte] |= np.uint8((code << sh) & 0xFF)
    if sh + bits > 8:
        qs[byte + 1] |= np.uint8(code >> (8 - sh))


@numba.njit(cache=True, inline="always")
def _scan_half(x, r, c0, w, has_w):
    """One half's max |x|, whether all 16 values are finite, and whether every
    importance weight is finite and >= 0 (docs/formats.md#mix-encoder steps 1-3)."""
    zero_f = np.float32(0.0)
    m = zero_f
    finite = True
    w_ok = True
    for i in range(16):
        v = x[r, c0 + i]
        if not np.isfinite(v):
            finite = False
        a = abs(v)
        if a > m:
            m = a
        if has_w:
            q = w[c0 + i]
            if not (np.isfinite(q) and q >= zero_f):
                w_ok = False
    return m, finite, w_ok


@numba.njit(cache=True, parallel=True, nogil=True)
def _encode_nb(x, w, has_w, books, split, ml, bits, out, status, fail_half):
    rows, cols = x.shape
    nb = cols // 32
    qs_bytes = 32 * bits // 8
    bb = qs_bytes + 2
    inf = np.float32(np.inf)
    zero_f = np.float32(0.0)
    for r in numba.prange(rows):
        for blk in range(nb):
            o = blk * bb
            for hh in range(2):
                c0 = blk * 32 + hh * 16
                m, finite, w_ok = _scan_half(x, r, c0, w, has_w)
                if not finite:
                    status[r] = 1
                    fail_half[r] = blk * 2 + hh
                    break
                if m == zero_f:
                    bk = 0
                    be = 0
                else:
                    best = inf
                    bk = 0
                    be = 1
                    for b in range(2):
                        if not (ml[b] > zero_f):
                            continue
                        centre = nearest_nb(np.float32(m / ml[b]))
                        for delta in range(-2, 3):
                            e = centre + delta
                            if e < 1 or e > 126:
                                continue
                            s = UE4M3[e]
                            inv = UE4M3_INV[e]
                            err = zero_f
                            for i in range(16):
                                xi = x[r, c0 + i]
                                j = _nl_nb(np.float32(xi * inv), split[b])
                                d = np.float32(xi - np.float32(s * books[b, j]))
                                wi = w[c0 + i] if has_w else np.float32(1.0)
                                err = np.float32(err + np.float32(np.float32(wi * d) * d))
                            if not w_ok:
                                err = inf
                            if err < best or (err == best and (b < bk or (b == bk and e < be))):
                                best = err
                                bk = b
                                be = e
                    if best == inf:
                        status[r] = 2
                        fail_half[r] = blk * 2 + hh
                        break
                inv = UE4M3_INV[be]
                for i in range(16):
                    v = np.float32(x[r, c0 + i] * inv) if be > 0 else zero_f
                    _put_code(out[r, o:o + qs_bytes], hh * 16 + i, _nl_nb(v, split[bk]), bits)
                out[r, o + qs_bytes + hh] = np.uint8(be | (bk << 7))
            if status[r] != 0:
                break


@numba.njit(cache=True, parallel=True, nogil=True)
def _encode_fixed_nb(x, w, has_w, fixed, bits, out, status, fail_half):
    rows, cols = x.shape
    nb = cols // 32
    qs_bytes = 32 * bits // 8
    bb = qs_bytes + 2
    inf = np.float32(np.inf)
    zero_f = np.float32(0.0)
    for r in numba.prange(rows):
        for blk in range(nb):
            o = blk * bb
            for hh in range(2):
                c0 = blk * 32 + hh * 16
                m, finite, w_ok = _scan_half(x, r, c0, w, has_w)
                if not finite:
                    status[r] = 1
                    fail_half[r] = blk * 2 + hh
                    break
                be = 0
                if m != zero_f:
                    best = inf
                    be = 1
                    if w_ok:
                        for e in range(1, 127):
                            s = UE4M3[e]
                            inv = UE4M3_INV[e]
                            err = zero_f
                            for i in range(16):
                                xi = x[r, c0 + i]
                                y = np.float32(s * fixed[_fixed_code_nb(np.float32(xi * inv), bits)])
                                d = np.float32(xi - y)
                                wi = w[c0 + i] if has_w else np.float32(1.0)
                                err = np.float32(err + np.float32(np.float32(wi * d) * d))
                            if err < best:
                                best = err
                                be = e
                    if best == inf:
                        status[r] = 2
                        fail_half[r] = blk * 2 + hh
                        break
                inv = UE4M3_INV[be]
                for i in range(16):
                    v = np.float32(x[r, c0 + i] * inv) if be > 0 else zero_f
                    _put_code(out[r, o:o + qs_bytes], hh * 16 + i, _fixed_code_nb(v, bits), bits)
                out[r, o + qs_bytes + hh] = np.uint8(be)
            if status[r] != 0:
                break


def encode(x: np.ndarray, importance, books: np.ndarray, *, qt, bits: int, mode: int = 1) -> np.ndarray:
    """The MIX codec's fast encoder on these kernels: its bytes and refusals."""
    from ds4quant.errors import BadInputError

    if mode not in (0, 1):
        raise BadInputError(f"{qt.name} encoder: mode must be 0 or 1, got {mode!r}")
    rows, cols = x.shape
    out = np.zeros((rows, qt.row_bytes(cols)), dtype=np.uint8)
    status = np.zeros(rows, dtype=np.int8)
    fail_half = np.zeros(rows, dtype=np.int64)
    has_w = importance is not None
    w = importance if has_w else np.zeros(1, dtype=np.float32)
    books = np.ascontiguousarray(books, dtype=np.float32)
    if mode == 1:
        _encode_nb(x, w, has_w, books, np.ascontiguousarray(numba_mix.splits(books)), numba_mix.max_level(books),
                   bits, out, status, fail_half)
    else:
        _encode_fixed_nb(x, w, has_w, fixed_levels(bits), bits, out, status, fail_half)
    bad = np.flatnonzero(status)
    if len(bad):
        r = int(bad[0])
        hidx = int(fail_half[r])
        numba_pack.refuse(qt.name, int(status[r]), r, hidx // 2, hidx % 2)
    return out


@contextmanager
def legacy_kernels():
    """Run the measure stage (and convert's MIX encodes) on the kernels above
    while the block runs; see the module docstring."""
    from ds4quant import codebooks
    from ds4quant.codebooks import histogram
    from ds4quant.formats import get_qtype, qtype
    from ds4quant.formats.search import NUMBA

    codecs = qtype._REGISTRY.codecs
    saved = {n: codecs[n] for n in ("rocmfp2_mix", "rocmfp3_mix")}
    fit = codebooks.fit_optimized
    lloyd, repair = histogram._lloyd_fast, histogram._bf16_repair_fast

    @functools.wraps(fit)
    def fit_legacy(*a, **k):
        return fit(*a, **{**k, "impl": "legacy", "backend": NUMBA, "inputs": None})

    try:
        for n, c in saved.items():
            qt = get_qtype(n)
            codecs[n] = dataclasses.replace(
                c, encode_fast=functools.partial(encode, qt=qt, bits=2 if qt.codebook_levels == 4 else 3))
        codebooks.fit_optimized = fit_legacy
        histogram._lloyd_fast, histogram._bf16_repair_fast = histogram._lloyd, histogram._bf16_repair
        yield
    finally:
        codecs.update(saved)
        codebooks.fit_optimized = fit
        histogram._lloyd_fast, histogram._bf16_repair_fast = lloyd, repair
