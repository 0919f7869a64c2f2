"""Decode-table registry: one per owner, keyed by (owner identity, tensor).

A resident MIX tensor is usable only after its books and modes are registered
for exactly the experts the owner holds, gathered from the codebook entry's
local order (global ids, or a compact stack's id list) to the stack's local
order. Lucebox ``ds4_register_compact_mix_tensor`` semantics:

    stack None, ids empty  -> ok, nothing registered (an absent cold owner)
    stack None, ids given  -> error (ids with no tensor)
    stack, ids empty       -> error (a tensor with no expert ids)
    qtype differs from the entry's, ids != stack.expert_ids, a duplicate id,
    an id the entry does not hold -> error naming the tensor and the ids

Re-registering a tensor replaces its table; ``unregister`` before the tensor
is freed. ``lookup`` takes the asking owner's identity, so one owner can never
resolve another's entry: it raises ``UnregisteredTableError``, and nothing
falls back to fixed levels.

Example::

    reg = DecodeTableRegistry("cpu:0")
    reg.register(stack.tensor, stack, stack.expert_ids, entry)
    books, modes = reg.lookup("cpu:0", stack.tensor)   # (n, 2, L) f32, (n,) u8
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ds4quant.errors import CodebookError, UnregisteredTableError
from ds4quant.formats import QTYPES


def _ids_text(ids: Sequence[int], limit: int = 12) -> str:
    ids = list(ids)
    head = ", ".join(str(i) for i in ids[:limit])
    return f"[{head}{', ...' if len(ids) > limit else ''}] ({len(ids)} ids)"


class DecodeTableRegistry:
    """MIX decode tables of one owner (``owner_identity``, e.g. "cpu:0")."""

    def __init__(self, owner_identity: str):
        if not isinstance(owner_identity, str) or not owner_identity:
            raise CodebookError("a registry needs a non-empty owner identity")
        self.owner_identity = owner_identity
        self._tables: dict[tuple[str, str], tuple[np.ndarray, np.ndarray, tuple[int, ...]]] = {}

    def register(self, tensor: str, stack, expert_ids: Sequence[int], entry) -> None:
        """Register ``entry``'s books for exactly ``expert_ids`` of ``stack``."""
        ids = tuple(int(i) for i in expert_ids)
        where = f"{self.owner_identity}: decode table of {tensor!r}"
        if stack is None:
            if ids:
                raise CodebookError(f"expert ids {_ids_text(ids)} given for no resident tensor", where=where)
            return
        if not ids:
            raise CodebookError("a resident tensor needs its expert ids (got none)", where=where)
        if stack.tensor != tensor:
            raise CodebookError(f"the stack holds tensor {stack.tensor!r}, not this one", where=where)
        if entry is None:
            raise CodebookError(f"no codebook entry for experts {_ids_text(ids)}", where=where)
        qt = QTYPES.get(stack.qtype)
        if qt is None or not qt.is_mix:
            raise CodebookError(f"tensor qtype {stack.qtype!r} takes no decode table", where=where)
        if entry.qtype != stack.qtype:
            raise CodebookError(f"entry qtype {entry.qtype!r} differs from the tensor's {stack.qtype!r}", where=where)
        if entry.name != tensor:
            raise CodebookError(f"the entry is for tensor {entry.name!r}", where=where)
        seen: set[int] = set()
        dup = sorted({i for i in ids if i in seen or seen.add(i)})
        if dup:
            raise CodebookError(f"duplicate expert ids {_ids_text(dup)} in {_ids_text(ids)}", where=where)
        if len(ids) != stack.n_experts or ids != tuple(stack.expert_ids):
            missing = sorted(set(stack.expert_ids) - set(ids))
            extra = sorted(set(ids) - set(stack.expert_ids))
            raise CodebookError(
                f"expert ids {_ids_text(ids)} do not cover the resident experts {_ids_text(stack.expert_ids)} "
                f"exactly (missing {_ids_text(missing)}, not resident {_ids_text(extra)})", where=where)
        pos = {g: k for k, g in enumerate(entry.global_ids)}
        unknown = [i for i in ids if i not in pos]
        if unknown:
            raise CodebookError(f"the codebook entry has no books for expert ids {_ids_text(unknown)}", where=where)
        take = np.array([pos[i] for i in ids], dtype=np.int64)
        books = np.ascontiguousarray(entry.books[take], dtype=np.float32)
        modes = np.ascontiguousarray(entry.modes[take], dtype=np.uint8)
        books.setflags(write=False)
        modes.setflags(write=False)
        self._tables[(self.owner_identity, tensor)] = (books, modes, ids)  # replaces any earlier table

    def lookup(self, owner_identity: str, tensor: str) -> tuple[np.ndarray, np.ndarray]:
        """(books float32 (n, 2, L), modes uint8 (n,)) in the stack's local order."""
        hit = self._tables.get((owner_identity, tensor))
        if hit is None:
            if owner_identity != self.owner_identity:
                why = f"this registry belongs to owner {self.owner_identity!r}"
            else:
                why = "no decode table is registered for it (decoding it without one is refused)"
            raise UnregisteredTableError(why, where=f"{owner_identity}: MIX tensor {tensor!r}")
        return hit[0], hit[1]

    def expert_ids(self, tensor: str) -> Optional[tuple[int, ...]]:
        hit = self._tables.get((self.owner_identity, tensor))
        return None if hit is None else hit[2]

    def registered(self) -> tuple[str, ...]:
        return tuple(sorted(t for (_, t) in self._tables))

    def unregister(self, tensor: str) -> None:
        if self._tables.pop((self.owner_identity, tensor), None) is None:
            raise UnregisteredTableError("not registered, cannot unregister", where=f"{self.owner_identity}: {tensor!r}")

    def unregister_all(self) -> None:
        self._tables.clear()

    def nbytes(self) -> int:
        return sum(b.nbytes + m.nbytes for b, m, _ in self._tables.values())
