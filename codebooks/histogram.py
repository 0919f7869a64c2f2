"""The reference codebook fitter (Lucebox ``HistogramFitter``), docs/formats.md#mix-fitter.

One fitter per (layer, expert, book group): gate rows then up rows for the
106 gate/up books, down rows for the 105 books. Values are added half by half
(16 weights) into two populations of 4097 double bins over [-1, 1]; each
population's histogram is fitted with 24 Lloyd iterations and rounded to bf16
with the "bf16-epsilon-v1" repair. Bits match the reference: every double sum
runs in the reference's order (halves in row order, bins in index order).

Example::

    books, repaired = fit_reference([w1, w3], levels=4, importance=[q_gate, q_up])
    # books: float32 (2, 4), book 0 = peaky population, book 1 = flat
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numba
import numpy as np

from ds4quant.errors import BadInputError, CodebookError, ShapeError

BINS = 4097  # bin b sits at coord(b) = -1 + 2b/4096
_HALF = 16
_ZERO_HALF_MASS = 16.0  # a zero half adds 16.0 to population 0, bin 2048 (docs/formats.md#mix-fitter)
_PEAKY_RATIO = 0.52  # rms/max below this -> population 0
LLOYD_ITERATIONS = 24
_REF_ROWS = 256  # rows per numpy-reference chunk

# coord(b) as float32 (exact: 2b/4096 and the subtraction are exact).
COORDS = (np.float32(-1.0) + (np.float32(2.0) * np.arange(BINS, dtype=np.float32)) / np.float32(4096.0)).astype(
    np.float32
)
COORDS.setflags(write=False)


@dataclass(frozen=True)
class FitResult:
    """Output of the reference fitter.

    books: float32 (2, levels), bf16-exact, strictly increasing per book.
    repaired: per book, whether the forward bf16 repair moved a level.
    population_mass: per population, the histogram's total (double, in bin
        order) before the empty-population fallback.
    """

    books: np.ndarray
    repaired: tuple[bool, bool]
    population_mass: tuple[float, float]


# --------------------------------------------------------------------------
# histogram accumulation


def _check_matrix(m, i: int) -> np.ndarray:
    arr = np.asarray(m)
    if arr.dtype.kind != "f":
        raise BadInputError(f"codebook fit: matrix {i} must be float, got dtype {arr.dtype}")
    if arr.ndim != 2 or arr.shape[1] % _HALF:
        raise ShapeError(f"codebook fit: matrix {i} must be 2-D with cols % 16 == 0, got shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype=np.float32)


def _check_importance(q, cols: int, i: int) -> Optional[np.ndarray]:
    if q is None:
        return None
    arr = np.asarray(q)
    if arr.dtype.kind not in "fiu":
        raise BadInputError(f"codebook fit: importance for matrix {i} must be numeric, got dtype {arr.dtype}")
    arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(-1)
    if arr.shape != (cols,):
        raise ShapeError(f"codebook fit: importance for matrix {i} must have length {cols}, got {arr.shape[0]}")
    return arr


def _first_nonfinite(x: np.ndarray, i: int):
    r, c = np.argwhere(~np.isfinite(x))[0]
    raise CodebookError(
        f"codebook fit: matrix {i} has a non-finite value at row {r}, column {c}",
        hint="the reference converter aborts here; clean the source tensor",
    )


def _bins_ref(x: np.ndarray, q: Optional[np.ndarray]):
    """Per element of x float32 (rows, cols): flat bin index pop*4097+bin and the
    double weight to add (0.0 when the element adds nothing), in add order."""
    h = x.reshape(-1, _HALF)
    m = np.abs(h).max(axis=1)
    sumsq = np.zeros(h.shape[0], dtype=np.float64)
    for i in range(_HALF):  # double sum in element order
        v = h[:, i].astype(np.float64)
        sumsq = sumsq + v * v
    zero = ~(m > 0)
    m = np.where(zero, np.float32(1.0), m)  # zero halves are replaced below
    ratio = np.sqrt(sumsq / 16.0) / m.astype(np.float64)
    pop = np.where(ratio < _PEAKY_RATIO, 0, 1)
    n = np.clip(h / m[:, None], np.float32(-1.0), np.float32(1.0)).astype(np.float32)
    t = (((n + np.float32(1.0)) * np.float32(0.5)) * np.float32(4096.0)).astype(np.float32)
    # round_half_away on t >= 0: floor(t + 0.5) in double is exact for float32 t
    b = np.clip(np.floor(t.astype(np.float64) + 0.5), 0, 4096).astype(np.int64)
    if q is None:
        w = np.ones(h.shape, dtype=np.float64)
    else:
        qq = np.tile(q.reshape(-1, _HALF), (x.shape[0], 1)).astype(np.float64)
        w = np.where((qq > 0) & np.isfinite(qq), qq, 0.0)
    idx = pop[:, None] * BINS + b
    # a zero half adds one 16.0 to pop 0 bin 2048, at its own place in the order
    idx[zero] = 2048
    w[zero] = 0.0
    w[zero, 0] = _ZERO_HALF_MASS
    return idx.reshape(-1), w.reshape(-1)


@numba.njit(cache=True, nogil=True)
def _add_nb(hist, x, q, has_q):
    # Sequential on purpose: double bins must see the reference's add order.
    rows, cols = x.shape
    for r in range(rows):
        for c0 in range(0, cols, 16):
            m = np.float32(0.0)
            sumsq = 0.0
            for i in range(16):
                v = x[r, c0 + i]
                a = abs(v)
                if a > m:
                    m = a
                sumsq += np.float64(v) * np.float64(v)
            if not (m > np.float32(0.0)):
                hist[2048] += 16.0
                continue
            ratio = np.sqrt(sumsq / 16.0) / np.float64(m)
            base = 0 if ratio < 0.52 else 4097
            for i in range(16):
                n = np.float32(x[r, c0 + i] / m)
                if n < np.float32(-1.0):
                    n = np.float32(-1.0)
                if n > np.float32(1.0):
                    n = np.float32(1.0)
                t = np.float32(np.float32(np.float32(n + np.float32(1.0)) * np.float32(0.5)) * np.float32(4096.0))
                b = np.int64(np.floor(np.float64(t) + 0.5))
                if b < 0:
                    b = 0
                if b > 4096:
                    b = 4096
                w = np.float64(q[c0 + i]) if has_q else 1.0
                if w > 0.0 and np.isfinite(w):
                    hist[base + b] += w


class Histogram:
    """The fitter's two 4097-bin double histograms; add matrices in order.

    >>> h = Histogram(); h.add(w1, q_gate); h.add(w3, q_up)
    >>> fit = h.fit(4)  # FitResult: books (2, 4), repaired, population_mass
    """

    def __init__(self, *, impl: str = "auto") -> None:
        if impl not in ("auto", "ref", "fast"):
            raise BadInputError(f"impl must be 'auto', 'ref' or 'fast', got {impl!r}")
        self._impl = impl
        self._hist = np.zeros(2 * BINS, dtype=np.float64)  # pop 0 bins, then pop 1 bins
        self._n = 0

    def add(self, matrix, importance=None) -> None:
        """Add float32 (rows, cols) rows in order; importance float32 (cols,) or None."""
        x = _check_matrix(matrix, self._n)
        q = _check_importance(importance, x.shape[1], self._n)
        if not np.all(np.isfinite(x)):
            _first_nonfinite(x, self._n)
        if self._impl == "ref":
            for r0 in range(0, x.shape[0], _REF_ROWS):  # chunks bound memory; order is kept
                idx, w = _bins_ref(x[r0:r0 + _REF_ROWS], q)
                np.add.at(self._hist, idx, w)  # unbuffered, in element order
        else:
            _add_nb(self._hist, x, q if q is not None else np.zeros(1, np.float32), q is not None)
        self._n += 1

    @property
    def bins(self) -> np.ndarray:
        """float64 (2, 4097) copy of the population histograms."""
        return self._hist.reshape(2, BINS).copy()

    @property
    def population_mass(self) -> tuple[float, float]:
        h = self._hist.reshape(2, BINS)
        return (_seq_sum(h[0]), _seq_sum(h[1]))

    def fit(self, levels: int) -> FitResult:
        """Fit (2, levels) bf16 books: Lloyd per population, then the repair."""
        if levels not in (4, 8):
            raise BadInputError(f"codebook fit: levels must be 4 (106) or 8 (105), got {levels}")
        h = self._hist.reshape(2, BINS)
        fallback = h[0] + h[1]
        books, repaired = [], []
        for p in range(2):
            hp = h[p] if _seq_sum(h[p]) > 0 else fallback
            if self._impl == "ref":
                centres = _lloyd(hp, levels)
                bits, rep = _bf16_repair(centres, p)
            else:
                centres = _lloyd_fast(hp, levels)
                bits, rep = _bf16_repair_fast(centres, p)
            books.append(bits)
            repaired.append(rep)
        out = (np.stack(books).astype(np.uint32) << 16).view(np.float32)
        return FitResult(books=out, repaired=(repaired[0], repaired[1]), population_mass=self.population_mass)


# --------------------------------------------------------------------------
# Lloyd on one histogram


def _seq_sum(a: np.ndarray) -> float:
    """Double sum in index order (np.sum would pair terms)."""
    return float(np.add.accumulate(a)[-1]) if len(a) else 0.0


def _lloyd(h: np.ndarray, levels: int) -> np.ndarray:
    """The Lloyd iteration (docs/formats.md#mix-fitter): quantile init, 24 iterations, sorted float32 (levels,) centres."""
    mass = _seq_sum(h)
    if not (mass > 0):
        raise CodebookError(
            "cannot fit an empty codebook histogram",
            hint="every importance weight was 0 and no half was all zero; give some columns weight",
        )
    running = np.add.accumulate(h[:4096])
    c = np.empty(levels, dtype=np.float32)
    for j in range(levels):
        target = mass * (j + 0.5) / levels
        hit = np.flatnonzero(running >= target)
        c[j] = COORDS[hit[0] if len(hit) else 4096]
    x = COORDS.astype(np.float64)
    hx = h * x
    for _ in range(LLOYD_ITERATIONS):
        # the reference walks bins with a monotone cluster pointer; with
        # sorted centres that equals counting the boundaries below x
        bounds = (np.float32(0.5) * (c[:-1] + c[1:])).astype(np.float32)
        cluster = np.searchsorted(bounds, COORDS, side="left")
        edges = np.searchsorted(cluster, np.arange(levels + 1), side="left")
        for j in range(levels):
            lo, hi = edges[j], edges[j + 1]
            if hi > lo:
                wt = _seq_sum(h[lo:hi])
                if wt > 0:
                    c[j] = np.float32(_seq_sum(hx[lo:hi]) / wt)
        c.sort()
    return c


@numba.njit(cache=True, nogil=True)
def _lloyd_nb(h, levels, coords):
    """Numba twin of _lloyd after its mass check: every double sum in index
    order, the cluster of a bin = the count of boundaries below its coord."""
    n = h.shape[0]
    mass = 0.0
    for b in range(n):
        mass += h[b]
    c = np.empty(levels, dtype=np.float32)
    for j in range(levels):
        target = mass * (j + 0.5) / levels
        run = 0.0
        hit = 4096
        for b in range(4096):
            run += h[b]
            if run >= target:
                hit = b
                break
        c[j] = coords[hit]
    hx = np.empty(n)
    for b in range(n):
        hx[b] = h[b] * np.float64(coords[b])
    bounds = np.empty(levels - 1, dtype=np.float32)
    wt = np.empty(levels)
    sx = np.empty(levels)
    # only the occupied bins: an empty bin adds +0 to a cluster's mass and +-0
    # to its sum, which changes neither (both start at +0 and never become -0),
    # and a level is updated only where its mass is > 0 (FP4 sources occupy few bins)
    nz = np.empty(n, np.int64)
    m = 0
    for b in range(n):
        if h[b] != 0.0:
            nz[m] = b
            m += 1
    for _ in range(24):
        for j in range(levels - 1):
            bounds[j] = np.float32(np.float32(0.5) * np.float32(c[j] + c[j + 1]))
        wt[:] = 0.0
        sx[:] = 0.0
        seen = np.zeros(levels, dtype=np.bool_)
        cl = 0
        for t in range(m):
            b = nz[t]
            while cl < levels - 1 and bounds[cl] < coords[b]:
                cl += 1
            wt[cl] += h[b]
            sx[cl] += hx[b]
            seen[cl] = True
        for j in range(levels):
            if seen[j] and wt[j] > 0:
                c[j] = np.float32(sx[j] / wt[j])
        c.sort()
    return c


def _lloyd_fast(h: np.ndarray, levels: int) -> np.ndarray:
    """``_lloyd`` in numba (same centres bit for bit)."""
    if not (_seq_sum(h) > 0):
        return _lloyd(h, levels)  # raises the reference's message
    return _lloyd_nb(np.ascontiguousarray(h, dtype=np.float64), levels, COORDS)


# --------------------------------------------------------------------------
# bf16 rounding and the bf16-epsilon-v1 repair


def _bf16_value(bits: int) -> float:
    return float(np.array([bits << 16], dtype=np.uint32).view(np.float32)[0])


def _step_up(b: int) -> int:
    if b & 0x7FFF == 0:
        return 0x0080
    return b + 1 if b < 0x8000 else b - 1


def _step_down(b: int) -> int:
    if b & 0x7FFF == 0:
        return 0x8080
    return b - 1 if b < 0x8000 else b + 1


def _bf16_repair(c: np.ndarray, population: int) -> tuple[np.ndarray, bool]:
    """bf16 RNE of sorted centres, forward repair (flagged), clamp-to-1 backward pass."""
    if not (np.all(np.isfinite(c)) and np.all(np.abs(c) <= 1.0)):
        raise CodebookError(f"codebook fit: population {population} centres {c.tolist()} are not finite in [-1, 1]")
    u = c.view(np.uint32).astype(np.uint64)
    bits = [int(v) for v in ((u + 0x7FFF + ((u >> 16) & 1)) >> 16)]
    repaired = False
    for j in range(1, len(bits)):
        if _bf16_value(bits[j]) <= _bf16_value(bits[j - 1]):
            bits[j] = _step_up(bits[j - 1])
            repaired = True
    if _bf16_value(bits[-1]) > 1.0:
        bits[-1] = 0x3F80
        for j in range(len(bits) - 1, 0, -1):  # not flagged as a repair (docs/formats.md#mix-fitter)
            if _bf16_value(bits[j - 1]) >= _bf16_value(bits[j]):
                bits[j - 1] = _step_down(bits[j])
    vals = [_bf16_value(b) for b in bits]
    ok = all(np.isfinite(v) and -1.0 <= v <= 1.0 for v in vals) and all(a < b for a, b in zip(vals, vals[1:]))
    if not ok:
        raise CodebookError(
            f"cannot separate adaptive codebook levels in BF16 (population {population}: {vals})"
        )
    return np.array(bits, dtype=np.uint16), repaired


@numba.njit(cache=True, nogil=True)
def _bf16_val_nb(b):
    return np.array([np.uint32(b) << np.uint32(16)], dtype=np.uint32).view(np.float32)[0]


@numba.njit(cache=True, nogil=True)
def _step_up_nb(b):
    if b & 0x7FFF == 0:
        return 0x0080
    return b + 1 if b < 0x8000 else b - 1


@numba.njit(cache=True, nogil=True)
def _step_down_nb(b):
    if b & 0x7FFF == 0:
        return 0x8080
    return b - 1 if b < 0x8000 else b + 1


@numba.njit(cache=True, nogil=True)
def _bf16_repair_nb(c):
    """Numba twin of _bf16_repair's arithmetic: (bits int64 (L,), repaired, ok)."""
    n = c.shape[0]
    bits = np.empty(n, np.int64)
    u = c.view(np.uint32)
    for j in range(n):
        v = np.uint64(u[j])
        bits[j] = np.int64((v + np.uint64(0x7FFF) + ((v >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16))
    repaired = False
    for j in range(1, n):
        if _bf16_val_nb(bits[j]) <= _bf16_val_nb(bits[j - 1]):
            bits[j] = _step_up_nb(bits[j - 1])
            repaired = True
    if _bf16_val_nb(bits[n - 1]) > np.float32(1.0):
        bits[n - 1] = 0x3F80
        for j in range(n - 1, 0, -1):
            if _bf16_val_nb(bits[j - 1]) >= _bf16_val_nb(bits[j]):
                bits[j - 1] = _step_down_nb(bits[j])
    ok = True
    for j in range(n):
        v = _bf16_val_nb(bits[j])
        if not (np.isfinite(v) and v >= np.float32(-1.0) and v <= np.float32(1.0)):
            ok = False
        if j > 0 and not (_bf16_val_nb(bits[j - 1]) < v):
            ok = False
    return bits, repaired, ok


def _bf16_repair_fast(c: np.ndarray, population: int) -> tuple[np.ndarray, bool]:
    """``_bf16_repair`` with the loop in numba: the same bits, flag and refusals."""
    c = np.ascontiguousarray(c, dtype=np.float32)
    if not (np.all(np.isfinite(c)) and np.all(np.abs(c) <= 1.0)):
        return _bf16_repair(c, population)  # raises the reference's message
    bits, repaired, ok = _bf16_repair_nb(c)
    if not ok:
        return _bf16_repair(c, population)  # raises the reference's message
    return bits.astype(np.uint16), bool(repaired)


# --------------------------------------------------------------------------
# public entry point


def _importance_list(importance, n: int) -> list:
    if importance is None:
        return [None] * n
    if isinstance(importance, (list, tuple)):
        if len(importance) != n:
            raise BadInputError(f"codebook fit: {len(importance)} importance vectors for {n} matrices")
        return list(importance)
    return [importance] * n


def fit_reference_result(
    matrices: Sequence[np.ndarray], levels: int, importance=None, *, impl: str = "auto"
) -> FitResult:
    """``fit_reference`` with the population masses (a ``FitResult``)."""
    if isinstance(matrices, np.ndarray):
        raise BadInputError("codebook fit: pass a list of (rows, cols) matrices, not one array")
    if levels not in (4, 8):
        raise BadInputError(f"codebook fit: levels must be 4 (106) or 8 (105), got {levels}")
    mats = list(matrices)
    hist = Histogram(impl=impl)
    for m, q in zip(mats, _importance_list(importance, len(mats))):
        hist.add(m, q)
    return hist.fit(levels)


def fit_reference(matrices: Sequence[np.ndarray], levels: int, importance=None, *, impl: str = "auto"):
    """Fit one expert's two books exactly like the Lucebox converter (docs/formats.md#mix-fitter).

    matrices: float32 (rows, cols) arrays added in order (gate then up for 106,
        down for 105); cols % 16 == 0.
    levels: 4 (rocmfp2_mix) or 8 (rocmfp3_mix).
    importance: None, one float32 (cols,) vector for every matrix, or a list
        with a vector (or None) per matrix; raw weights, <= 0 / NaN columns skip.
    Returns (books float32 (2, levels), repaired (bool, bool)).
    Raises CodebookError on non-finite input, an empty histogram, or levels
    that bf16 cannot separate.
    """
    r = fit_reference_result(matrices, levels, importance, impl=impl)
    return r.books, r.repaired
