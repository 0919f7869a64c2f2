"""The measure stage's search engine: the MIX and scale searches, the codebook
fitter's evaluations and the float64 sums, in three tiers behind this face.

The adaptive recipe measures every candidate qtype of every expert matrix,
and the codebook fitter evaluates ~22 book pairs per matrix. Whatever the
tier, a search gives the codec's bytes and a sum the host's float64 figure,
bit for bit (each tier's module says why). One ``Backend`` picks the tier,
once, and every call takes it::

    Backend, Tier, DeviceKind, NUMBA       the tier and its device (numba on the host by default)
    to_device(x, importance, backend)      a MIX search's inputs on the backend's device
    to_host(t)                             a device tensor as numpy

MIX (docs/formats.md#mix-encoder mode 1; mode 0 is ds4quant's own), per half of 16 weights::

    choose_mix(x, importance, books, mode, bits, backend)    book, byte, codes, status (numpy)
    encode_mix(qtype, x, importance, books, mode, backend)   ``formats.encode``'s bytes and refusals
    check_status(qt, status, halves_per_row)                 the encoder's refusal of a refused half
    decode_mix_choices(qt, choices, shape, books, mode)      the values the choices' blocks decode to
    book_tables, evaluate_books, one_pass                    the fitter's one-pass evaluation (host)
    terms_stats                                              the fitter's float64 terms and Lloyd sums (host)
    mix_error_on_device(X, W, books, mode, qt, backend)      an error, all on the device (Triton)
    FIXED_105, FIXED_106, fixed_levels(bits)                 mode 0's levels

the scale search (docs/formats.md#scale-search) of rocmfp2, rocmfp3, rocmfp4, rocmfp4_fast (``SCALE_SEARCHES``)::

    scale_covers(qtype, options)                             whether the device tiers run it
    scale_inputs(qtype, x, importance, backend)              (X, Q, sigma2): checked, on the device
    search_scale(qtype, X, Q, sigma2, backend)               (scale bytes, codes) on the device
    encode_scale(qtype, x, importance, backend)              ``formats.encode``'s bytes
    measure_scale(qtype, X, Q, sigma2, backend)              (payload bytes, decoded values on the device)
    row_energies(x)                                          sigma^2 of the weights per row (host)

float64 sums in the host's order::

    pairwise_sum(a)                  ``np.sum(a)`` of a float64 array, by numba (other threads run meanwhile)
    pairwise_total(t)                the same of a device tensor (Triton)
    error_sums_on_device(X, Y, w)    ``metrics.error_sums`` of device tensors (Triton)

Example::

    from ds4quant.formats import search
    b = search.Backend.for_device("cuda")
    X, W = search.to_device(x, q, b)
    book, byte, codes, status = search.choose_mix(X, W, books, 1, 2, b)

Importing this package imports neither torch nor triton.
"""

from __future__ import annotations

import numpy as np

from ds4quant.errors import BadInputError
from ds4quant.formats.checks import check_codebooks, encode_input
from ds4quant.formats.qtype import get_qtype
from ds4quant.formats.search import numba_mix, numba_pack
from ds4quant.formats.search.backend import NUMBA, Backend, DeviceKind, Tier, to_device, to_host
from ds4quant.formats.search.numba_fit import book_tables_nb as book_tables
from ds4quant.formats.search.numba_fit import decode_choices as _decode_choices_host
from ds4quant.formats.search.numba_fit import eval_books_nb as evaluate_books
from ds4quant.formats.search.numba_fit import pairwise_sum_nb
from ds4quant.formats.search.numba_fit import terms_stats_nb as terms_stats
from ds4quant.formats.search.numba_mix import serial as one_pass
from ds4quant.formats.search.numba_pack import check_status
from ds4quant.formats.search.numba_scale import row_energies
from ds4quant.formats.search.tables import FIXED_105, FIXED_106, HALF, SCALE_SEARCHES, fixed_levels

__all__ = [
    "Backend", "Tier", "DeviceKind", "NUMBA", "to_device", "to_host", "HALF",
    "choose_mix", "encode_mix", "check_status", "decode_mix_choices", "book_tables", "evaluate_books",
    "one_pass", "terms_stats", "mix_error_on_device", "FIXED_105", "FIXED_106", "fixed_levels",
    "SCALE_SEARCHES", "scale_covers", "scale_inputs", "search_scale", "encode_scale", "measure_scale",
    "row_energies", "pairwise_sum", "pairwise_total", "error_sums_on_device", "column_square_sums_on_device",
]


def _only(backend: Backend, *tiers: Tier, what: str) -> None:
    if backend.tier not in tiers:
        raise BadInputError(f"{what} runs on the {' or '.join(t.value for t in tiers)} tier, not {backend}")


def _bits(qt) -> int:
    return 2 if qt.codebook_levels == 4 else 3


# --------------------------------------------------------------------------
# MIX


def choose_mix(x, importance, books: np.ndarray, mode: int, bits: int, backend: Backend = NUMBA):
    """Per half: book int64 (G,), scale byte int64 (G,), codes uint8 (G, 16),
    status int8 (G,) (1 non-finite, 2 no finite candidate; a refused half's
    codes are garbage). On the numba tier x float32 (rows, cols) and
    importance (cols,) or None are numpy; on the device tiers they are
    ``to_device``'s tensors. The torch tier shares launches between threads."""
    if backend.tier is Tier.NUMBA:
        return numba_mix.choose(x, importance, books, mode, bits)
    books = np.asarray(books, np.float32)
    if backend.tier is Tier.TORCH:
        from ds4quant.formats.search import torch_batch

        return torch_batch.choose_batched(x, importance, books, int(mode), int(bits))
    from ds4quant.formats.search import triton_mix

    return triton_mix.choose(x, importance, books, int(mode), int(bits))


def encode_mix(qtype, x, importance, books: np.ndarray, mode: int, backend: Backend = NUMBA) -> np.ndarray:
    """``formats.encode(qtype, x, importance, books, mode=mode)`` with the
    search on ``backend`` and the packing on the host: the same bytes and the
    same refusals. One (2, L) book pair."""
    qt = get_qtype(qtype)
    x, importance = encode_input(qt, x, importance)
    books = check_codebooks(qt, books)
    if books.ndim != 2 or mode not in (0, 1):
        raise BadInputError(f"{qt.name} device encoder: one (2, L) book pair and mode 0 or 1")
    rows, cols = x.shape
    inputs = (x, importance) if backend.tier is Tier.NUMBA else to_device(x, importance, backend)
    return numba_pack.pack(qt, choose_mix(*inputs, books, mode, _bits(qt), backend), mode, _bits(qt), rows, cols)


def decode_mix_choices(qt, choices, shape, books: np.ndarray, mode: int):
    """The values the blocks of ``choices`` (book, byte, codes per half)
    decode to, bit for bit: float32 ``shape`` on the host for numpy choices,
    float32 (G, 16) on their device for device tensors (``mix_error_on_device``'s)."""
    if isinstance(choices[0], np.ndarray):
        return _decode_choices_host(qt, choices, shape, books, mode)
    from ds4quant.formats.search import triton_mix

    return triton_mix.decode_device(choices, books, mode, _bits(qt))


def mix_error_on_device(X, W, books: np.ndarray, mode: int, qt, backend: Backend):
    """The fitter's error of (books, mode) on ``to_device``'s X, W with
    nothing but the figure crossing the link: the search, the float64 terms
    (x - y)^2 w and their ``np.sum`` order (Triton). Returns (error, the
    choices (book, byte, codes) left on the device); refuses as the encoder."""
    _only(backend, Tier.TRITON, what="an error on the device")
    from ds4quant.formats.search import triton_mix, triton_sums

    bits = _bits(qt)
    ch = triton_mix.search_device(X, W, books, mode, bits)
    check_status(qt, to_host(ch[3]), X.shape[1])
    return triton_sums.pairwise_total(triton_mix.terms_device(X, W, books, mode, bits, ch)), ch[:3]


# --------------------------------------------------------------------------
# the scale search


def scale_covers(qtype: str, options: "dict | None" = None) -> bool:
    """Whether the device tiers search ``qtype`` (with no encode options)."""
    return qtype in SCALE_SEARCHES and not options


def scale_inputs(qtype: str, x, importance, backend: Backend, nonfinite: str = "reject"):
    """``encode``'s checks, then (X float32 (rows, cols), Q (cols,) or None,
    sigma2 (rows,) or None) on the backend's device."""
    import torch

    x, importance = encode_input(get_qtype(qtype), x, importance, nonfinite=nonfinite)
    x = np.ascontiguousarray(x, np.float32)
    dev = backend.torch_device
    X = torch.from_numpy(x).to(dev)
    if importance is None:
        return X, None, None
    Q = torch.from_numpy(np.ascontiguousarray(importance, np.float32)).to(dev)
    return X, Q, torch.from_numpy(row_energies(x)).to(dev)


def search_scale(qtype: str, X, Q, sigma2, backend: Backend, stats: "dict | None" = None):
    """Scale bytes int64 (rows, cols // group) and codes uint8 (rows, cols) on
    the device for ``scale_inputs``'s tensors. ``stats`` (a dict, torch tier
    only): counts of its window proofs."""
    import torch

    _only(backend, Tier.TORCH, Tier.TRITON, what="the device scale search")
    fmt, group = SCALE_SEARCHES[qtype]
    with torch.no_grad():
        if backend.tier is Tier.TRITON:
            if stats is not None:
                raise BadInputError("stats count the torch tier's window proofs; the Triton tier has none")
            from ds4quant.formats.search import triton_scale

            e, codes, _ = triton_scale.search(fmt, group, X, Q, sigma2)
            return e, codes
        from ds4quant.formats.search import torch_scale

        return torch_scale.search(fmt, group, X, Q, sigma2, stats)


def encode_scale(qtype: str, x, importance, backend: Backend, nonfinite: str = "reject",
                 stats: "dict | None" = None) -> np.ndarray:
    """``formats.encode(qtype, x, importance, nonfinite=...)`` with the search
    on ``backend`` (a device tier) and the packing on the host: the same
    bytes, the same refusals."""
    import torch

    from ds4quant.formats.scale_codecs import pack_ref

    _only(backend, Tier.TORCH, Tier.TRITON, what="the device scale search")
    X, Q, s2 = scale_inputs(qtype, x, importance, backend, nonfinite)
    fmt, group = SCALE_SEARCHES[qtype]
    if X.shape[0] == 0:
        return np.zeros((0, get_qtype(qtype).row_bytes(X.shape[1])), np.uint8)
    e, codes = search_scale(qtype, X, Q, s2, backend, stats)
    return pack_ref(fmt, e.to(torch.uint8).cpu().numpy(), codes.cpu().numpy(), group)


def measure_scale(qtype: str, X, Q, sigma2, backend: Backend):
    """What the measure stage needs of ``encode`` then ``decode`` for
    ``scale_inputs``'s tensors: (payload bytes, the decoded float32 (rows,
    cols) on the device); the bytes are never packed."""
    import torch

    _only(backend, Tier.TORCH, Tier.TRITON, what="the device scale search")
    fmt, group = SCALE_SEARCHES[qtype]
    rows, cols = X.shape
    nbytes = rows * get_qtype(qtype).row_bytes(cols)
    if rows == 0:
        return nbytes, torch.zeros((rows, cols), dtype=torch.float32, device=X.device)
    with torch.no_grad():
        if backend.tier is Tier.TRITON:
            from ds4quant.formats.search import triton_scale

            return nbytes, triton_scale.search(fmt, group, X, Q, sigma2, codes=False, decode=True)[2]
        from ds4quant.formats.search import torch_scale

        e, codes = torch_scale.search(fmt, group, X, Q, sigma2)
        return nbytes, torch_scale.decode_chosen(fmt, group, e, codes)


# --------------------------------------------------------------------------
# float64 sums in the host's order


def pairwise_sum(a: np.ndarray) -> float:
    """``float(np.sum(a))`` of a contiguous float64 array, in numpy's pairwise
    order, by numba (which, unlike numpy's reduction, lets other threads run)."""
    return 0.0 + pairwise_sum_nb(a.reshape(-1), 0, a.size)


def pairwise_total(t) -> float:
    """``float(np.sum(a))`` for a float64 device tensor holding a's values (Triton)."""
    from ds4quant.formats.search import triton_sums

    return triton_sums.pairwise_total(t)


def error_sums_on_device(X, Y, w=None):
    """``metrics.error_sums(x, y, w)`` of float32 device tensors X, Y (rows,
    cols) and float64 w (cols,) or None: the same Sums bit for bit, 64 bytes a
    row copied back (Triton)."""
    from ds4quant.formats.search import triton_sums

    return triton_sums.error_sums_device(X, Y, w)


def column_square_sums_on_device(X):
    """``np.square(x.astype(np.float64)).sum(axis=0)`` of a float32 device tensor X
    (rows, cols) as float64 (cols,) on its device, bit for bit (Triton)."""
    from ds4quant.formats.search import triton_sums

    return triton_sums.column_square_sums(X)
