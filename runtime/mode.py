"""The runtime's two numeric modes, parsed once where a mode enters.

    Mode.parse("exact") is Mode.EXACT       # a Mode passes through unchanged
    Mode.parse("approx")                    # BadInputError: unknown mode 'approx'; expected exact or fast

``exact``: bitwise-identical MoE outputs for any placement, owner kind and
rank count (``runtime/exact.py`` states the definition). ``fast``: each
owner's best speed; its distance from exact is measured, never assumed.

A ``Mode`` is a ``str`` (``Mode.EXACT == "exact"``), so JSON, pickles for a
worker child and the cluster's spec files carry its value as is.
"""

from __future__ import annotations

from enum import Enum
from typing import Optional

from ds4quant.errors import BadInputError

__all__ = ["Mode"]


class Mode(str, Enum):
    EXACT = "exact"
    FAST = "fast"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: object, where: Optional[str] = None) -> "Mode":
        """``value`` as a Mode (a Mode itself, or its name as text); anything else is
        one BadInputError line naming ``where``."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise BadInputError(f"unknown mode {value!r}; expected {' or '.join(m.value for m in cls)}",
                                where=where) from None
