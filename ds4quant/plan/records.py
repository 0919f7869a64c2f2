"""The measure stage's records: what one candidate of one expert measured,
all of them with the routing weights, the fitted MIX books, and the
allocation's decision per tensor.

A ``Measure`` is stored in the measurement cache as its JSON list
``[nbytes, sse, ssx, wsse, wssx, ref_wsse]``; convert records the chosen
candidate's figures instead of decoding the encoding again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np


@dataclass(frozen=True)
class Measure:
    """One (tensor, expert, qtype): payload bytes and float64 error sums.

    wsse/wssx are weighted per column by importance (ones without any);
    ref_wsse: for MIX with the optimized fitter, the same error with the
    reference fitter's books (None otherwise)."""

    nbytes: int
    sse: float
    ssx: float
    wsse: float
    wssx: float
    ref_wsse: Optional[float] = None

    def to_json(self) -> list:
        return [self.nbytes, self.sse, self.ssx, self.wsse, self.wssx, self.ref_wsse]

    @classmethod
    def from_json(cls, v: list) -> "Measure":
        return cls(int(v[0]), *map(float, v[1:5]), None if v[5] is None else float(v[5]))


@dataclass(frozen=True)
class Measurements:
    """All measures: (tensor, expert, qtype) -> Measure, and the routing weights."""

    measures: Mapping[tuple[str, int, str], Measure]
    weights: Mapping[str, np.ndarray]  # tensor -> f_e per expert
    seconds: float
    reused: int


@dataclass(frozen=True)
class Decision:
    """The allocation outcome for one routed-expert tensor: qtype per expert
    (a single qtype at tensor granularity) and its predicted weighted error."""

    name: str
    qtypes: tuple[str, ...]  # per expert, global order
    predicted_error: float
    nbytes: int


def expert_weights(counts: Optional[np.ndarray], n_expert: int) -> np.ndarray:
    """Routing weights f_e (mean 1) from one layer's activation counts:
    f_e = E * (count_e + 1) / (sum counts + E), so never-routed experts still
    count a little; ones without counts."""
    if counts is None:
        return np.ones(n_expert)
    c = np.asarray(counts, dtype=np.float64)
    return n_expert * (c + 1.0) / (c.sum() + n_expert)


class Books:
    """Fitted MIX codebooks: (tensor, expert, qtype) -> (books (2, L), mode)."""

    def __init__(self) -> None:
        self._m: dict[tuple[str, int, str], tuple[np.ndarray, int]] = {}

    def put(self, tensor: str, expert: int, qtype: str, books: np.ndarray, mode: int) -> None:
        self._m[(tensor, expert, qtype)] = (np.asarray(books, np.float32), int(mode))

    def get(self, tensor: str, expert: int, qtype: str) -> tuple[np.ndarray, int]:
        return self._m[(tensor, expert, qtype)]

    def __contains__(self, k) -> bool:
        return k in self._m
