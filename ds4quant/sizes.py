"""Byte sizes as users write them: ``1024``, ``512K``, ``512M``, ``50G``, ``1.5T``.

Binary units (K is 1024 bytes), a trailing ``B`` or ``iB`` allowed, exact
decimal arithmetic (``1.5K`` is 1536 bytes; a fraction of a byte is dropped).
The one parser behind ``--split-max-size``, ``--max-bytes`` and owner budgets.

    parse_size("50G")                              # 53687091200
    parse_size("0", "--max-bytes", positive=True)  # BadInputError: size must be positive
"""

from __future__ import annotations

import re
from fractions import Fraction
from numbers import Integral

from ds4quant.errors import BadInputError, BudgetError

__all__ = ["MAX_SIZE", "parse_size"]

MAX_SIZE = 1 << 62  # bytes; anything larger is a typo, not a machine

_SIZE_RE = re.compile(r"([+-]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)([KMGT]?)(I?B)?")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: object, where: str = "size", *, positive: bool = False) -> int:
    """Bytes from a size (text or an integer); ``where`` names the option in errors.

    Refused: text that is no size (``BadInputError``), a negative size or one
    over 2^62 bytes (``BudgetError``), and with ``positive`` zero or less
    (``BadInputError``)."""
    if isinstance(text, bool):
        raise BadInputError(f"bad size {text!r}", where=where)
    if isinstance(text, Integral):
        v = int(text)
    else:
        t = str(text).strip().upper()
        m = _SIZE_RE.fullmatch(t) if len(t) <= 40 else None
        if m is None:
            raise BadInputError(f"bad size {text!r}", where=where, hint="e.g. 1024, 512M or 50G")
        v = int(Fraction(m.group(2)) * _UNITS[m.group(3)])  # floor of exact bytes
        if m.group(1) == "-" and v:
            v = -v
    if positive and v <= 0:
        raise BadInputError(f"size must be positive, got {text!r}", where=where)
    if v < 0:
        raise BudgetError(f"size must not be negative, got {text!r}", where=where)
    if v > MAX_SIZE:
        raise BudgetError(f"size {text!r} is larger than 2^62 bytes", where=where)
    return v
