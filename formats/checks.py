"""The argument checks of the codec API, each once: input rows, column counts,
importance, MIX codebooks and modes, the split of rows over experts, block
arrays, and numba's thread count for one call.

``formats.encode`` / ``decode`` / ``components`` and the measure stage's
device search (``formats.search``) call these before any codec sees data,
so every entry refuses bad input with the same message.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import numpy as np

from ds4quant.errors import BadInputError, CodebookError, ShapeError
from ds4quant.formats.qtype import QType




def as_rows(x: Any, what: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.kind != "f":
        raise BadInputError(f"{what} must be a floating-point array, got dtype {arr.dtype}")
    if arr.ndim == 1:
        arr = arr.reshape(1, -1)
    if arr.ndim != 2:
        raise ShapeError(f"{what} must be 2-D (rows, cols), got shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype=np.float32)


def check_cols(qt: QType, cols: int, what: str) -> None:
    if cols <= 0 or cols % qt.block_size or cols % qt.row_multiple:
        need = max(qt.block_size, qt.row_multiple)
        raise ShapeError(
            f"{what}: {qt.name} needs a column count that is a positive multiple of {need}, got {cols}"
        )


def bf16_round(values: Any) -> np.ndarray:
    """Round float32 values to bf16 (nearest-even) and back; float32 array."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32)


def check_codebooks(qt: QType, codebooks: Any, what: str = "codebooks") -> np.ndarray:
    """Validate MIX books: float32 (2, L) or (E, 2, L), finite, bf16-exact,
    strictly increasing within each book. Returns a float32 C array."""
    if codebooks is None:
        raise CodebookError(f"{qt.name} needs codebooks of shape (2, {qt.codebook_levels})", where=what)
    books = np.asarray(codebooks)
    if books.dtype.kind != "f":
        raise CodebookError(f"codebooks must be float, got dtype {books.dtype}", where=what)
    books = np.ascontiguousarray(books, dtype=np.float32)
    L = qt.codebook_levels
    if books.shape[-2:] != (2, L) or books.ndim not in (2, 3):
        raise CodebookError(f"{qt.name} codebooks must have shape (2, {L}) or (E, 2, {L}), got {books.shape}", where=what)
    if not np.all(np.isfinite(books)):
        raise CodebookError("codebook levels must be finite", where=what)
    if not np.array_equal(bf16_round(books).view(np.uint32), books.view(np.uint32)):
        raise CodebookError("codebook levels must be exactly representable in bf16", where=what)
    if not np.all(np.diff(books, axis=-1) > 0):
        raise CodebookError("codebook levels must be strictly increasing within each book", where=what)
    return books


def check_modes(modes: Any, n_experts: int, what: str = "modes") -> np.ndarray:
    if modes is None:
        return np.ones(n_experts, dtype=np.uint8)
    m = np.asarray(modes)
    if m.ndim == 0:
        m = np.full(n_experts, int(m), dtype=np.int64)
    if m.shape != (n_experts,) or m.dtype.kind not in "iub":
        raise CodebookError(f"modes must be an int or {n_experts} ints, got {np.asarray(modes)!r}", where=what)
    if np.any((m != 0) & (m != 1)):
        raise CodebookError("modes must be 0 (fixed levels) or 1 (codebook)", where=what)
    return m.astype(np.uint8)


def check_importance(importance: Any, cols: int) -> Optional[np.ndarray]:
    if importance is None:
        return None
    imp = np.asarray(importance)
    if imp.dtype.kind not in "fiu":
        raise BadInputError(f"importance must be numeric, got dtype {imp.dtype}")
    imp = np.ascontiguousarray(imp, dtype=np.float32).reshape(-1)
    if imp.shape != (cols,):
        raise ShapeError(f"importance must have length {cols} (one per column), got {np.asarray(importance).shape}")
    if not np.all(np.isfinite(imp)):
        raise BadInputError("importance contains NaN or Inf")
    if np.any(imp < 0):
        raise BadInputError(f"importance must be >= 0; column {int(np.argmax(imp < 0))} is {float(imp[imp < 0][0])}")
    return imp


def split_experts(rows: int, n_experts: int, what: str) -> int:
    if n_experts <= 0 or rows % n_experts:
        raise ShapeError(f"{what}: {rows} rows cannot be split evenly over {n_experts} experts")
    return rows // n_experts


@contextlib.contextmanager
def numba_threads(threads: Optional[int]):
    if threads is None:
        yield
        return
    import numba

    if threads < 1:
        raise BadInputError(f"threads must be >= 1, got {threads}")
    old = numba.get_num_threads()
    numba.set_num_threads(min(int(threads), numba.config.NUMBA_NUM_THREADS))
    try:
        yield
    finally:
        numba.set_num_threads(old)



def encode_input(qt: QType, x: Any, importance: Any = None, nonfinite: str = "reject"):
    """``encode``'s checks of its input: (float32 rows, importance or None),
    or the refusal ``encode`` gives (also for encoders outside the registry,
    such as the measure stage's device search)."""
    arr = as_rows(x, f"{qt.name} input")
    rows, cols = arr.shape
    check_cols(qt, cols, f"{qt.name} input")
    if nonfinite not in ("reject", "reference"):
        raise BadInputError(f"nonfinite must be 'reject' or 'reference', got {nonfinite!r}")
    if (nonfinite == "reject" or qt.is_mix) and not np.all(np.isfinite(arr)):
        bad = np.argwhere(~np.isfinite(arr))[0]
        raise BadInputError(
            f"{qt.name} input has a non-finite value at row {bad[0]}, column {bad[1]}",
            hint="clean the source, or pass nonfinite='reference' to encode it as the reference codec does",
        )
    return arr, check_importance(importance, cols)


def as_blocks(data: Any, qt: QType, cols: int) -> np.ndarray:
    arr = np.asarray(data)
    if arr.dtype != np.uint8:
        raise BadInputError(f"{qt.name} data must be uint8, got dtype {arr.dtype}")
    check_cols(qt, cols, f"{qt.name} decode")
    rb = qt.row_bytes(cols)
    if arr.size % rb:
        raise ShapeError(f"{qt.name} data of {arr.size} bytes is not a whole number of {rb}-byte rows ({cols} columns)")
    return np.ascontiguousarray(arr.reshape(-1, rb))
