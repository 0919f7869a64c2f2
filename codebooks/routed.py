"""One routed-expert codebook record of a Lucebox blob, and the coverage rule.

P4MIXv1 (docs/formats.md#p4mix) and GUMIXs1 (docs/formats.md#gumix) both carry, per (layer, surface), a
3-D expert tensor's per-expert modes and book pairs. ``MixEntry`` is that
record; ``check_routed_coverage`` is the loader's rule that every resident
tensor is covered exactly once with matching dimensions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np

from ds4quant.codebooks._wire import MAX_DIM, MAX_EXPERTS, check_books, check_modes, frozen
from ds4quant.errors import CodebookError

SURFACES = ("gate", "up", "down")  # GUMIX surface ids 0, 1, 2


@dataclass(frozen=True, eq=False)
class MixEntry:
    """Per-expert MIX tables of one routed tensor ``blk.{layer}.ffn_{surface}_exps``.

    modes: uint8 (E,), 0 fixed levels / 1 codebook.
    books: float32 (E, 2, L), bf16-exact; book 0 then book 1 per expert.
    out_dim, in_dim: the tensor's ne[1] (rows per expert) and ne[0] (cols).
    rotations: uint8 (E,) (P4MIX only; must be 0) or None.
    """

    layer: int
    surface: int
    out_dim: int
    in_dim: int
    modes: np.ndarray
    books: np.ndarray
    rotations: Optional[np.ndarray] = None

    def __post_init__(self) -> None:
        where = f"codebook entry layer {self.layer} surface {self.surface}"
        modes = np.asarray(self.modes)
        books = np.asarray(self.books, dtype=np.float32)
        if modes.ndim != 1 or modes.dtype.kind not in "iub":
            raise CodebookError(f"modes must be a 1-D integer array, got {modes.dtype} {modes.shape}", where=where)
        if books.ndim != 3 or books.shape[:2] != (modes.shape[0], 2):
            raise CodebookError(f"books must have shape ({modes.shape[0]}, 2, L), got {books.shape}", where=where)
        if not 1 <= modes.shape[0] <= MAX_EXPERTS:
            raise CodebookError(f"expert count {modes.shape[0]} outside 1..{MAX_EXPERTS}", where=where)
        if not (0 <= self.surface < len(SURFACES)) or self.layer < 0:
            raise CodebookError("layer must be >= 0 and surface 0 (gate), 1 (up) or 2 (down)", where=where)
        if not (1 <= self.out_dim <= MAX_DIM and 1 <= self.in_dim <= MAX_DIM):
            raise CodebookError(f"dims out={self.out_dim} in={self.in_dim} outside 1..{MAX_DIM}", where=where)
        check_modes(modes, where, CodebookError)
        check_books(books, modes, where)
        object.__setattr__(self, "modes", frozen(modes.astype(np.uint8)))
        object.__setattr__(self, "books", frozen(books))
        if self.rotations is not None:
            rot = np.asarray(self.rotations)
            if rot.shape != modes.shape:
                raise CodebookError(f"rotations must have shape {modes.shape}, got {rot.shape}", where=where)
            object.__setattr__(self, "rotations", frozen(rot.astype(np.uint8)))

    @property
    def n_experts(self) -> int:
        return int(self.modes.shape[0])

    @property
    def levels(self) -> int:
        return int(self.books.shape[2])

    @property
    def key(self) -> tuple[int, int]:
        return (self.layer, self.surface)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MixEntry):
            return NotImplemented
        rot = lambda e: np.zeros(e.n_experts, np.uint8) if e.rotations is None else e.rotations  # noqa: E731
        return (
            (self.layer, self.surface, self.out_dim, self.in_dim) == (other.layer, other.surface, other.out_dim, other.in_dim)
            and np.array_equal(self.modes, other.modes)
            and np.array_equal(self.books.view(np.uint32), other.books.view(np.uint32))
            and np.array_equal(rot(self), rot(other))
        )

    __hash__ = None  # mutable-looking arrays inside: not hashable


def check_routed_coverage(
    entries: Sequence[MixEntry],
    resident: Mapping[tuple[int, int], tuple[int, int, int]],
    what: str,
) -> None:
    """Lucebox's load rule: every resident (layer, surface) -> (E, out, in)
    tensor has exactly one entry with equal (E, out, in); entries for tensors
    that are not resident are allowed (the loader seeks over them).

    Raises CodebookError listing every offender.
    """
    by_key: dict[tuple[int, int], list[MixEntry]] = {}
    for e in entries:
        by_key.setdefault(e.key, []).append(e)
    problems = []
    for key, dims in sorted(resident.items()):
        got = by_key.get(key, [])
        name = f"blk.{key[0]}.ffn_{SURFACES[key[1]]}_exps"
        if not got:
            problems.append(f"{name} has no entry")
        elif len(got) > 1:
            problems.append(f"{name} has {len(got)} entries")
        else:
            e = got[0]
            have = (e.n_experts, e.out_dim, e.in_dim)
            if have != tuple(dims):
                problems.append(f"{name} is (E, out, in) = {tuple(dims)} but its entry says {have}")
    for key, got in sorted(by_key.items()):
        if len(got) > 1 and key not in resident:
            problems.append(f"blk.{key[0]}.ffn_{SURFACES[key[1]]}_exps has {len(got)} entries")
    if problems:
        raise CodebookError(
            f"{len(problems)} coverage problem(s): " + "; ".join(problems),
            where=what,
            hint="every resident MIX expert tensor needs exactly one entry with its dimensions",
        )
