"""ROCmFPX and interchange codecs: a QType registry plus encode/decode.

Public surface::

    QTYPES                      name -> QType (frozen dataclass)
    encode(qtype, x, importance=None, codebooks=None, **options)
    decode(qtype, data, cols, codebooks=None, modes=None)
    decode_torch(qtype, data, cols, codebooks=None, modes=None)
    components(qtype, data, cols, codebooks=None, modes=None) -> Components
    exact_parts(values) -> (mant, exp)   float32 as odd integer x 2^exp

and the public modules ``components`` (the parts of a decoded weight, the
runtime's row decoders), ``bits`` (bit packing), ``checks`` (the argument
checks) and ``search`` (the measure stage's search engine and its tiers).

Example::

    from ds4quant import formats
    q = formats.encode("rocmfp2", w)            # uint8 (rows, cols // 32 * 10)
    w2 = formats.decode("rocmfp2", q, w.shape[1])

Arguments are validated here, once (``checks``); a codec module only ever sees float32
C-contiguous (rows, cols) input whose cols are a multiple of its block.
Importing this package does not import torch.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import MappingProxyType
from typing import Any, Optional

import numpy as np

from ds4quant.errors import BadInputError, CodebookError, ShapeError, UnsupportedFormatError
from ds4quant.formats.checks import (as_blocks, bf16_round, check_codebooks, check_cols, check_modes, encode_input,
                                     numba_threads, split_experts)
from ds4quant.formats.qtype import Codec, QType, all_qtypes, get_codec, get_qtype, qtypes_for_ggml_type

# Modules in this package that are infrastructure, not codecs.
_NOT_CODECS = {"qtype", "ue4m3", "bits", "checks", "components"}


def _load_codecs() -> None:
    # Every public module in this folder is a codec that registers itself on
    # import; sorted so registration order (and `formats` listing) is stable.
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.ispkg or info.name.startswith("_") or info.name in _NOT_CODECS:
            continue
        importlib.import_module(f"{__name__}.{info.name}")


_load_codecs()

QTYPES: "MappingProxyType[str, QType]" = MappingProxyType(all_qtypes())

__all__ = [
    "QTYPES",
    "QType",
    "Codec",
    "encode",
    "decode",
    "decode_torch",
    "get_qtype",
    "qtypes_for_ggml_type",
    "check_codebooks",
    "bf16_round",
    "components",
    "Components",
    "exact_parts",
]


# --------------------------------------------------------------------------
# public API


def encode(
    qtype: "str | QType",
    x: Any,
    importance: Any = None,
    codebooks: Any = None,
    *,
    impl: str = "auto",
    nonfinite: str = "reject",
    threads: Optional[int] = None,
    **options: Any,
) -> np.ndarray:
    """Encode float32 ``x`` (rows, cols) into uint8 (rows, row_bytes).

    importance: float32 (cols,), >= 0, per-column imatrix weights.
    codebooks: MIX only, float32 (2, L) for all rows, or (E, 2, L) with the
        rows split evenly over E experts in order.
    impl: "auto" (fast path when there is one), "ref" or "fast"; bytes agree.
    nonfinite: "reject" (default) refuses NaN/Inf; "reference" encodes them
        as the reference codec does (ignored in the scale search, zero code).
        MIX types always refuse them, as the reference does.
    threads: numba threads for the fast path; never changes the bytes.
    options: codec-specific switches (e.g. ``fp2s=True`` for rocmfp2).
    """
    qt = get_qtype(qtype)
    codec = get_codec(qt.name)
    if not qt.can_encode or codec.encode_ref is None:
        raise UnsupportedFormatError(f"{qt.name} is a decode-only format")
    unknown = set(options) - set(codec.encode_options)
    if unknown:
        allowed = ", ".join(codec.encode_options) or "none"
        raise BadInputError(f"{qt.name} encoder has no option {sorted(unknown)} (options: {allowed})")
    arr, imp = encode_input(qt, x, importance, nonfinite)
    rows, cols = arr.shape
    fn = _pick(codec.encode_ref, codec.encode_fast, impl, qt.name, "encoder")
    with numba_threads(threads):
        if qt.is_mix:
            books = check_codebooks(qt, codebooks)
            if books.ndim == 2:
                out = fn(arr, imp, books, **options)
            else:
                per = split_experts(rows, books.shape[0], f"{qt.name} input")
                out = np.concatenate(
                    [fn(arr[i * per:(i + 1) * per], imp, books[i], **options) for i in range(books.shape[0])]
                ) if rows else np.zeros((0, qt.row_bytes(cols)), np.uint8)
        else:
            if codebooks is not None:
                raise CodebookError(f"{qt.name} takes no codebooks")
            out = fn(arr, imp, None, **options)
    return out


def _pick(ref, fast, impl: str, name: str, what: str):
    if impl == "ref":
        return ref
    if impl == "fast":
        if fast is None:
            raise UnsupportedFormatError(f"{name} has no fast {what}")
        return fast
    if impl == "auto":
        return fast or ref
    raise BadInputError(f"impl must be 'auto', 'ref' or 'fast', got {impl!r}")


def decode(
    qtype: "str | QType",
    data: Any,
    cols: int,
    codebooks: Any = None,
    modes: Any = None,
    *,
    impl: str = "auto",
) -> np.ndarray:
    """Decode uint8 ``data`` (rows, row_bytes) or flat into float32 (rows, cols).

    MIX types need ``codebooks`` (2, L) or (E, 2, L) and optional ``modes``
    (0 fixed levels, 1 codebook; an int or one per expert; default 1).
    """
    qt = get_qtype(qtype)
    codec = get_codec(qt.name)
    blocks = as_blocks(data, qt, cols)
    fn = _pick(codec.decode_ref, codec.decode_fast, impl, qt.name, "decoder")
    if not qt.is_mix:
        if codebooks is not None or modes is not None:
            raise CodebookError(f"{qt.name} takes no codebooks or modes")
        return fn(blocks, cols, None, None)
    books = check_codebooks(qt, codebooks)
    if books.ndim == 2:
        m = check_modes(modes, 1)
        return fn(blocks, cols, books, int(m[0]))
    n = books.shape[0]
    m = check_modes(modes, n)
    per = split_experts(blocks.shape[0], n, f"{qt.name} decode")
    out = np.empty((blocks.shape[0], cols), dtype=np.float32)
    for i in range(n):
        out[i * per:(i + 1) * per] = fn(blocks[i * per:(i + 1) * per], cols, books[i], int(m[i]))
    return out


def decode_torch(
    qtype: "str | QType",
    data: Any,
    cols: int,
    codebooks: Any = None,
    modes: Any = None,
):
    """``decode`` on a torch uint8 tensor, on its device; bitwise equal to decode.

    Returns torch.float32 (rows, cols) on ``data.device``.
    """
    import torch

    qt = get_qtype(qtype)
    codec = get_codec(qt.name)
    if codec.decode_torch is None:
        raise UnsupportedFormatError(f"{qt.name} has no torch decoder")
    t = data if isinstance(data, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(data))
    if t.dtype != torch.uint8:
        raise BadInputError(f"{qt.name} data must be uint8, got {t.dtype}")
    check_cols(qt, cols, f"{qt.name} decode")
    rb = qt.row_bytes(cols)
    if t.numel() % rb:
        raise ShapeError(f"{qt.name} data of {t.numel()} bytes is not a whole number of {rb}-byte rows ({cols} columns)")
    t = t.reshape(-1, rb).contiguous()
    if not qt.is_mix:
        if codebooks is not None or modes is not None:
            raise CodebookError(f"{qt.name} takes no codebooks or modes")
        return codec.decode_torch(t, cols, None, None)
    books_np = check_codebooks(
        qt, codebooks.detach().cpu().numpy() if isinstance(codebooks, torch.Tensor) else codebooks
    )
    books = torch.from_numpy(np.array(books_np, copy=True)).to(t.device)  # torch warns on a read-only array
    if books_np.ndim == 2:
        m = check_modes(modes, 1)
        return codec.decode_torch(t, cols, books, int(m[0]))
    n = books_np.shape[0]
    m = check_modes(modes.detach().cpu().numpy() if isinstance(modes, torch.Tensor) else modes, n)
    per = split_experts(t.shape[0], n, f"{qt.name} decode")
    parts = [codec.decode_torch(t[i * per:(i + 1) * per], cols, books[i], int(m[i])) for i in range(n)]
    return torch.cat(parts) if parts else torch.empty((0, cols), dtype=torch.float32, device=t.device)


# After the codecs: components imports one codec module (mxfp4) itself, which
# must not register ahead of the sorted order above.
from ds4quant.formats.components import Components, components, exact_parts  # noqa: E402
