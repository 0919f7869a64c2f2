"""The MIX blocks from a search's choices, and the encoder's refusals.

Every tier's search gives per half a book, a scale byte, 16 codes and a
status (0 chosen, ``NONFINITE``, ``NO_CANDIDATE``); ``pack`` refuses the
matrix at its first refused half in row order, with the reference encoder's
message (``refuse``, which the reference calls too), and packs the rest
into blocks on the host (``pack_choices_nb``, docs/formats.md#rocmfp2, #rocmfp3 bit streams).
"""

from __future__ import annotations

import numba
import numpy as np

from ds4quant.errors import EncodeRejectedError
from ds4quant.formats.search.tables import HALF

# A half's status: 0 chosen, else why the encoder refuses it (the reference's reasons).
NONFINITE, NO_CANDIDATE = 1, 2


def refuse(qt_name: str, status: int, row: int, block: int, half: int):
    """Raise the encoder's refusal of one half (``status`` NONFINITE or NO_CANDIDATE)."""
    if status == NONFINITE:
        why = "has a NaN or Inf value"
        fix = "clean the source tensor"
    else:
        why = "has no finite-error candidate (an overflowing outlier, or negative/non-finite importance)"
        fix = "clip the outlier or fix the importance vector"
    raise EncodeRejectedError(
        f"{qt_name} encoder rejects row {row}, block {block} (half {half}): the half {why}",
        hint=fix,
    )


def check_status(qt, status: np.ndarray, hpr: int) -> None:
    """Refuse (``refuse``) at the first refused half in row order, as the
    reference stops there; ``hpr``: halves per row."""
    bad = np.flatnonzero(status)
    if len(bad):
        g = int(bad[0])
        refuse(qt.name, int(status[g]), g // hpr, (g % hpr) // 2, g % 2)


@numba.njit(cache=True, parallel=True, nogil=True)
def pack_choices_nb(codes, out_b, out_e, mode, bits, out):
    """Blocks from per-half codes (G, 16) and (book, byte): out (rows, row_bytes)."""
    rows = out.shape[0]
    qs_bytes = 32 * bits // 8
    bb = qs_bytes + 2
    nb = out.shape[1] // bb
    for r in numba.prange(rows):
        for blk in range(nb):
            o = blk * bb
            g = (r * nb + blk) * 2
            if bits == 2:  # weight i at bits 2i..2i+1 (docs/formats.md#rocmfp2)
                for j in range(8):
                    hh = j // 4
                    c = (j % 4) * 4
                    out[r, o + j] = np.uint8(codes[g + hh, c] | (codes[g + hh, c + 1] << 2)
                                             | (codes[g + hh, c + 2] << 4) | (codes[g + hh, c + 3] << 6))
            else:  # 96-bit LE stream, weight i at bits 3i..3i+2 (docs/formats.md#rocmfp3): 8 codes per 3 bytes
                for q in range(4):
                    hh = q // 2
                    c = (q % 2) * 8
                    word = np.uint32(0)
                    for i in range(8):
                        word |= np.uint32(codes[g + hh, c + i]) << np.uint32(3 * i)
                    out[r, o + 3 * q] = np.uint8(word & 0xFF)
                    out[r, o + 3 * q + 1] = np.uint8((word >> 8) & 0xFF)
                    out[r, o + 3 * q + 2] = np.uint8((word >> 16) & 0xFF)
            for hh in range(2):
                be = out_e[g + hh]
                out[r, o + qs_bytes + hh] = np.uint8(be | (out_b[g + hh] << 7)) if mode == 1 else np.uint8(be)


def pack(qt, choices, mode: int, bits: int, rows: int, cols: int) -> np.ndarray:
    """The blocks uint8 (rows, row_bytes) of ``choices`` (book, byte, codes,
    status per half, as ``choose`` gives them on any tier), after refusing a
    refused half as the reference does."""
    out_b, out_e, codes, st = choices
    check_status(qt, st, cols // HALF)
    out = np.zeros((rows, qt.row_bytes(cols)), dtype=np.uint8)
    pack_choices_nb(codes, out_b, out_e, mode, bits, out)
    return out
