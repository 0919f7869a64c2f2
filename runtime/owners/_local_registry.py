"""Stand-in for R1's ``runtime/registry.py`` until it is merged (delete then).

The same surface and the rules of the session plan: register(tensor, stack,
ids, entry), lookup(owner_identity, tensor), unregister, unregister_all.
"""

from __future__ import annotations

import numpy as np

from ds4quant.errors import CodebookError


class UnregisteredTableError(CodebookError):
    """A MIX tensor decoded without a registered table on this owner."""


class LocalRegistry:
    def __init__(self, owner_identity: str):
        self.owner_identity = owner_identity
        self._tables: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def register(self, tensor, stack, expert_ids, entry) -> None:
        ids = tuple(int(i) for i in expert_ids)
        if stack is None:
            if ids:
                raise CodebookError(f"expert ids {list(ids)} given for no tensor", where=tensor)
            return
        if not ids:
            raise CodebookError("a resident tensor registered with no expert ids", where=tensor)
        if entry.qtype != stack.qtype:
            raise CodebookError(f"table qtype {entry.qtype} != tensor qtype {stack.qtype}", where=tensor)
        if len(set(ids)) != len(ids) or ids != tuple(stack.expert_ids):
            raise CodebookError(f"expert ids {list(ids)} do not cover the resident {list(stack.expert_ids)} "
                                "exactly once", where=tensor)
        pos = {g: i for i, g in enumerate(entry.global_ids)}
        missing = [i for i in ids if i not in pos]
        if missing:
            raise CodebookError(f"expert ids {missing} are not in the table's {list(entry.global_ids)}",
                                where=tensor)
        take = [pos[i] for i in ids]
        self._tables[tensor] = (np.ascontiguousarray(entry.books[take]), np.ascontiguousarray(entry.modes[take]))

    def lookup(self, owner_identity: str, tensor: str):
        if owner_identity != self.owner_identity or tensor not in self._tables:
            raise UnregisteredTableError(f"no decode table registered on {owner_identity}", where=tensor)
        return self._tables[tensor]

    def unregister(self, tensor: str) -> None:
        self._tables.pop(tensor, None)

    def unregister_all(self) -> None:
        self._tables.clear()

    def resident_bytes(self) -> int:
        return sum(b.nbytes + m.nbytes for b, m in self._tables.values())
