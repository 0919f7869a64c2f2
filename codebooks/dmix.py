"""``DMIXs1``: Lucebox's sidecar for dense (attention) MIX tensors (docs/formats.md#dmix).

Wire (little-endian, defined by Lucebox's reader; ours is the only writer)::

    0   magic     8 B  "DMIXs1\\0\\0"  44 4D 49 58 73 31 00 00
    8   u32 n_entries
    12  u32 reserved        (written 0, ignored on read)
    16  entries, back to back:
        u32 layer, u32 cls, u32 qtype (105/106), u32 nslices, u32 C, u32 K   24 B
        u8  mode, u8 pad[3] (written 0, ignored on read)                     4 B
        u16 book[C*K]       bf16: book 0 levels, then book 1                 2CK B

One book pair per tensor; the loader replicates it over ``nslices``
registrations. Classes: 0 attn_q_a, 1 attn_q_b, 2 attn_kv, 3 attn_output_a,
4 attn_output_b. Reader checks: layer < n_layers (when given), cls < 5,
qtype in {105, 106}, C == 2, K == 8 for 105 / 4 for 106, 1 <= nslices <= 4096,
mode <= 1, no duplicate (layer, cls), mode-1 books finite and strictly
increasing, nothing after the last entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

from ds4quant.codebooks._wire import open_blob, bf16_to_f32, check_books, f32_to_bf16, frozen
from ds4quant.errors import CodebookError

MAGIC = b"DMIXs1\x00\x00"
HEADER_BYTES = 16
ENTRY_HEADER_BYTES = 28  # 24 B of u32 fields + mode + pad[3]
CLASSES = ("attn_q_a", "attn_q_b", "attn_kv", "attn_output_a", "attn_output_b")
LEVELS = {105: 8, 106: 4}
MAX_SLICES = 4096


@dataclass(frozen=True, eq=False)
class DmixEntry:
    """One dense MIX tensor ``blk.{layer}.{CLASSES[cls]}``: one book pair and mode.

    books: float32 (2, L) bf16-exact, L = 8 (qtype 105) or 4 (106).
    """

    layer: int
    cls: int
    qtype: int
    nslices: int
    mode: int
    books: np.ndarray

    def __post_init__(self) -> None:
        where = f"DMIXs1 entry layer {self.layer} cls {self.cls}"
        books = np.asarray(self.books, dtype=np.float32)
        if self.qtype not in LEVELS:
            raise CodebookError(f"qtype {self.qtype} is not 105 or 106", where=where)
        if books.shape != (2, LEVELS[self.qtype]):
            raise CodebookError(f"books must have shape (2, {LEVELS[self.qtype]}), got {books.shape}", where=where)
        if not 0 <= self.cls < len(CLASSES) or self.layer < 0:
            raise CodebookError("layer must be >= 0 and cls 0..4", where=where)
        if not 1 <= self.nslices <= MAX_SLICES:
            raise CodebookError(f"nslices {self.nslices} outside 1..{MAX_SLICES}", where=where)
        if self.mode not in (0, 1):
            raise CodebookError(f"mode {self.mode} is not 0 or 1", where=where)
        check_books(books[None], np.array([self.mode]), where)
        object.__setattr__(self, "books", frozen(books))

    @property
    def key(self) -> tuple[int, int]:
        return (self.layer, self.cls)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DmixEntry):
            return NotImplemented
        return (self.layer, self.cls, self.qtype, self.nslices, self.mode) == (
            other.layer, other.cls, other.qtype, other.nslices, other.mode
        ) and np.array_equal(self.books.view(np.uint32), other.books.view(np.uint32))

    __hash__ = None


def entry_nbytes(levels: int) -> int:
    return ENTRY_HEADER_BYTES + 2 * 2 * levels


def nbytes(levels: Iterable[int]) -> int:
    """Blob size for entries with these level counts (4 or 8 each)."""
    return HEADER_BYTES + sum(entry_nbytes(int(k)) for k in levels)


def write_dmix(entries: Sequence[DmixEntry]) -> bytes:
    """Serialize dense entries (unique (layer, cls)) in the given order."""
    seen = set()
    parts = [MAGIC, np.array([len(entries), 0], dtype="<u4").tobytes()]
    for e in entries:
        where = f"DMIXs1 entry layer {e.layer} cls {e.cls}"
        if e.key in seen:
            raise CodebookError("(layer, cls) appears twice", where=where)
        seen.add(e.key)
        k = LEVELS[e.qtype]
        parts.append(np.array([e.layer, e.cls, e.qtype, e.nslices, 2, k], dtype="<u4").tobytes())
        parts.append(bytes([e.mode, 0, 0, 0]))
        parts.append(f32_to_bf16(e.books, where).astype("<u2").tobytes())
    return b"".join(parts)


def read_dmix(data: Any, *, n_layers: Optional[int] = None, what: str = "DMIXs1 blob") -> tuple[DmixEntry, ...]:
    """Parse and validate a DMIXs1 blob; entries in wire order.

    Raises CorruptDataError for malformed bytes, CodebookError for bad books.
    """
    cur, n = open_blob(data, what, MAGIC, entry_nbytes(4))
    entries, seen = [], set()
    for i in range(n):
        layer, cls, qtype, nslices, c, k = (
            cur.u32(f"entry {i} {f}") for f in ("layer", "cls", "qtype", "nslices", "C", "K")
        )
        at = f"entry {i} (layer {layer} cls {cls})"
        if n_layers is not None and layer >= n_layers:
            cur.fail(f"{at}: layer >= n_layers = {n_layers}")
        if cls >= len(CLASSES):
            cur.fail(f"{at}: cls must be < {len(CLASSES)}")
        if qtype not in LEVELS:
            cur.fail(f"{at}: qtype {qtype} is not 105 or 106")
        if c != 2 or k != LEVELS[qtype]:
            cur.fail(f"{at}: C = {c}, K = {k}; qtype {qtype} needs C = 2, K = {LEVELS[qtype]}")
        if not 1 <= nslices <= MAX_SLICES:
            cur.fail(f"{at}: nslices = {nslices} outside 1..{MAX_SLICES}")
        if (layer, cls) in seen:
            cur.fail(f"{at}: (layer, cls) appears twice")
        seen.add((layer, cls))
        mode = cur.u8(f"{at} mode")
        cur.raw(3, f"{at} pad")
        if mode > 1:
            cur.fail(f"{at}: mode {mode}; modes are 0 or 1")
        books = bf16_to_f32(cur.array("<u2", 2 * k, f"{at} book")).reshape(2, k)
        check_books(books[None], np.array([mode]), f"{what} {at}")
        entries.append(DmixEntry(layer, cls, qtype, nslices, mode, books))
    cur.finish()
    return tuple(entries)


def check_dmix_coverage(
    entries: Sequence[DmixEntry], resident: Mapping[tuple[int, int], tuple[int, int, int, int]]
) -> None:
    """Lucebox's dense load rule. resident: (layer, cls) -> (qtype, ne0, ne1, nbytes).

    Each resident tensor needs an entry of its qtype with ne0 % 128 == 0,
    ne1 % nslices == 0 and nbytes % nslices == 0. Raises CodebookError
    listing every offender.
    """
    by_key = {e.key: e for e in entries}
    problems = []
    for key, (qtype, ne0, ne1, nb) in sorted(resident.items()):
        name = f"blk.{key[0]}.{CLASSES[key[1]]}"
        e = by_key.get(key)
        if e is None:
            problems.append(f"{name} has no entry")
            continue
        if e.qtype != qtype:
            problems.append(f"{name} is qtype {qtype} but its entry says {e.qtype}")
        if ne0 % 128:
            problems.append(f"{name} ne0 = {ne0} is not a multiple of 128")
        if ne1 % e.nslices or nb % e.nslices:
            problems.append(f"{name} (ne1 = {ne1}, {nb} bytes) does not split into {e.nslices} slices")
    if problems:
        raise CodebookError(f"{len(problems)} coverage problem(s): " + "; ".join(problems), where="DMIXs1 blob")
