"""ds4quant's own name-keyed codebook table (every artifact carries one).

Unlike the Lucebox blobs (keyed by layer/surface, full expert stacks only),
this table is keyed by tensor name and can describe compact per-expert
stacks: a tensor holding only some of a layer's experts lists their global
expert ids in local order.

Wire, version 1 (little-endian, no padding)::

    0   magic     8 B  "DS4QCBT\\0"  44 53 34 51 43 42 54 00
    8   u32 version   (= 1)
    12  u32 n_entries
    16  u32 flags     (= 0; reserved, refused when set)
    20  entries, back to back, names strictly increasing (UTF-8 bytes):
        u16 name_len (1..1024), name[name_len] UTF-8 (no NUL)
        u8  qtype_len (1..32), qtype[qtype_len] ASCII, a MIX qtype name
        u8  L           levels per book (must equal the qtype's)
        u8  has_ids     0 = experts 0..E-1, 1 = an id list follows
        u8  reserved    (= 0)
        u32 E           experts in this tensor, 1..65536
        u32 n_global    experts in the full layer, E..65536 (= E without ids)
        u32 ids[E]      if has_ids: global ids, strictly increasing, < n_global
        u8  modes[E]    0 fixed levels / 1 codebook
        u16 books[E*2*L] bf16, expert-major: book 0 levels, then book 1
    end u32 crc32 of every byte before it (zlib.crc32)

The reader checks every field against the bytes that remain before it
allocates, then that nothing is left over, then the CRC, and only then the
books' values (finite, strictly increasing for mode-1 experts).

Example::

    t = CodebookTable([CodebookEntry("blk.3.ffn_down_exps.weight", "rocmfp3_mix", modes, books)])
    assert read_table(write_table(t)) == t
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

import numpy as np

from ds4quant.codebooks._wire import MAX_EXPERTS, Cursor, bf16_to_f32, check_books, check_modes, f32_to_bf16, frozen
from ds4quant.errors import CodebookError, CorruptDataError, IntegrityError
from ds4quant.formats import QTYPES

MAGIC = b"DS4QCBT\x00"
VERSION = 1
HEADER_BYTES = 20
MAX_NAME = 1024
MAX_QTYPE = 32


def _mix_levels(qtype: str, where: str, cls=CodebookError) -> int:
    qt = QTYPES.get(qtype)
    if qt is None or not qt.is_mix:
        mix = ", ".join(sorted(n for n, q in QTYPES.items() if q.is_mix))
        raise cls(f"qtype {qtype!r} is not a MIX qtype (MIX qtypes: {mix})", where=where)
    return qt.codebook_levels


@dataclass(frozen=True, eq=False)
class CodebookEntry:
    """Codebooks of one resident MIX tensor.

    name: the tensor name, e.g. ``blk.3.ffn_down_exps.weight``.
    qtype: a MIX qtype name (``rocmfp2_mix`` / ``rocmfp3_mix``).
    modes: uint8 (E,), 0 fixed levels / 1 codebook.
    books: float32 (E, 2, L), bf16-exact; mode-1 books strictly increasing.
    expert_ids: global expert ids of a compact stack in local order
        (strictly increasing), or None for experts 0..E-1.
    n_global: experts in the full layer (>= E); defaults to E.
    """

    name: str
    qtype: str
    modes: np.ndarray
    books: np.ndarray
    expert_ids: Optional[tuple[int, ...]] = None
    n_global: Optional[int] = None

    def __post_init__(self) -> None:
        where = f"codebook table entry {self.name!r}"
        if not isinstance(self.name, str) or not self.name or "\x00" in self.name:
            raise CodebookError("tensor name must be a non-empty string without NUL", where=where)
        if len(self.name.encode("utf-8")) > MAX_NAME:
            raise CodebookError(f"tensor name is longer than {MAX_NAME} bytes", where=where)
        levels = _mix_levels(self.qtype, where)
        modes = np.asarray(self.modes)
        if modes.ndim == 0 or modes.dtype.kind not in "iub":
            raise CodebookError(f"modes must be a 1-D integer array, got {modes.dtype} {modes.shape}", where=where)
        n = modes.shape[0]
        books = np.asarray(self.books)
        if books.dtype.kind != "f" or books.shape != (n, 2, levels):
            raise CodebookError(f"books must be float with shape ({n}, 2, {levels}), got {books.dtype} {books.shape}", where=where)
        books = books.astype(np.float32)
        if not 1 <= n <= MAX_EXPERTS:
            raise CodebookError(f"expert count {n} outside 1..{MAX_EXPERTS}", where=where)
        check_modes(modes, where, CodebookError)
        f32_to_bf16(books, where)
        check_books(books, modes, where)
        n_global = n if self.n_global is None else int(self.n_global)
        if not n <= n_global <= MAX_EXPERTS:
            raise CodebookError(f"n_global {n_global} must be in {n}..{MAX_EXPERTS}", where=where)
        ids = self.expert_ids
        if ids is not None:
            ids = tuple(int(i) for i in ids)
            if len(ids) != n:
                raise CodebookError(f"{len(ids)} expert ids for {n} experts", where=where)
            if any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < 0 or ids[-1] >= n_global:
                raise CodebookError(f"expert ids must be strictly increasing in 0..{n_global - 1}", where=where)
        elif n_global != n:
            raise CodebookError(f"a stack of {n} of {n_global} experts needs its expert ids", where=where)
        object.__setattr__(self, "modes", frozen(modes.astype(np.uint8)))
        object.__setattr__(self, "books", frozen(books))
        object.__setattr__(self, "expert_ids", ids)
        object.__setattr__(self, "n_global", n_global)

    @property
    def n_experts(self) -> int:
        return int(self.modes.shape[0])

    @property
    def levels(self) -> int:
        return int(self.books.shape[2])

    @property
    def global_ids(self) -> tuple[int, ...]:
        """Global expert id of each local expert."""
        return self.expert_ids if self.expert_ids is not None else tuple(range(self.n_experts))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CodebookEntry):
            return NotImplemented
        return (
            (self.name, self.qtype, self.global_ids, self.n_global)
            == (other.name, other.qtype, other.global_ids, other.n_global)
            and np.array_equal(self.modes, other.modes)
            and np.array_equal(self.books.view(np.uint32), other.books.view(np.uint32))
        )

    __hash__ = None


@dataclass(frozen=True)
class CodebookTable:
    """Name-keyed codebook entries, sorted by name, each name once."""

    entries: tuple[CodebookEntry, ...] = ()

    def __post_init__(self) -> None:
        entries = tuple(sorted(self.entries, key=lambda e: e.name.encode("utf-8")))
        for a, b in zip(entries, entries[1:]):
            if a.name == b.name:
                raise CodebookError(f"tensor {a.name!r} appears twice", where="codebook table")
        object.__setattr__(self, "entries", entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self):
        return iter(self.entries)

    def __contains__(self, name: object) -> bool:
        return any(e.name == name for e in self.entries)

    def __getitem__(self, name: str) -> CodebookEntry:
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)

    def to_bytes(self) -> bytes:
        return write_table(self)

    @classmethod
    def from_bytes(cls, data: Any, *, what: str = "codebook table") -> "CodebookTable":
        return read_table(data, what=what)


# --------------------------------------------------------------------------
# wire


def write_table(table: CodebookTable) -> bytes:
    """Serialize a CodebookTable (version 1); same table -> same bytes."""
    parts = [MAGIC, np.array([VERSION, len(table.entries), 0], dtype="<u4").tobytes()]
    for e in table.entries:
        name = e.name.encode("utf-8")
        q = e.qtype.encode("ascii")
        has_ids = e.expert_ids is not None
        parts.append(np.array([len(name)], dtype="<u2").tobytes() + name)
        parts.append(bytes([len(q)]) + q + bytes([e.levels, int(has_ids), 0]))
        parts.append(np.array([e.n_experts, e.n_global], dtype="<u4").tobytes())
        if has_ids:
            parts.append(np.array(e.expert_ids, dtype="<u4").tobytes())
        parts.append(e.modes.tobytes())
        parts.append(f32_to_bf16(e.books, e.name).astype("<u2").tobytes())
    body = b"".join(parts)
    return body + np.array([zlib.crc32(body)], dtype="<u4").tobytes()


def read_table(data: Any, *, what: str = "codebook table") -> CodebookTable:
    """Parse and validate a table written by ``write_table``.

    Raises CorruptDataError for malformed bytes, IntegrityError for a CRC
    mismatch, CodebookError for invalid books.
    """
    cur = Cursor(data, what)
    magic = cur.raw(8, "magic")
    if magic != MAGIC:
        cur.fail(f"bad magic {magic!r}, expected {MAGIC!r}")
    version = cur.u32("version")
    if version != VERSION:
        cur.fail(f"version {version} is not supported (this build reads version {VERSION})")
    n = cur.u32("n_entries")
    flags = cur.u32("flags")
    if flags:
        cur.fail(f"flags 0x{flags:08x} set; version 1 defines none")
    # lower bound per entry: 1-byte name and qtype, fixed fields, E = 1, L = 4
    least = (2 + 1) + (1 + 1) + 3 + 8 + 1 + 16
    if n * least + 4 > cur.remaining:
        cur.fail(f"n_entries = {n} needs at least {n * least + 4} bytes, only {cur.remaining} left")
    fields = []
    prev: Optional[bytes] = None
    for i in range(n):
        name_len = cur.u16(f"entry {i} name_len")
        if not 1 <= name_len <= MAX_NAME:
            cur.fail(f"entry {i}: name_len {name_len} outside 1..{MAX_NAME}")
        raw_name = cur.raw(name_len, f"entry {i} name")
        try:
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError:
            cur.fail(f"entry {i}: name is not UTF-8")
        if "\x00" in name:
            cur.fail(f"entry {i}: name contains NUL")
        at = f"entry {i} ({name!r})"
        if prev is not None and raw_name <= prev:
            cur.fail(f"{at}: {'duplicate name' if raw_name == prev else 'names are not in increasing order'}")
        prev = raw_name
        q_len = cur.u8(f"{at} qtype_len")
        if not 1 <= q_len <= MAX_QTYPE:
            cur.fail(f"{at}: qtype_len {q_len} outside 1..{MAX_QTYPE}")
        try:
            qtype = cur.raw(q_len, f"{at} qtype").decode("ascii")
        except UnicodeDecodeError:
            cur.fail(f"{at}: qtype name is not ASCII")
        levels = _mix_levels(qtype, f"{what} {at}", cls=CorruptDataError)
        L = cur.u8(f"{at} L")
        has_ids = cur.u8(f"{at} has_ids")
        reserved = cur.u8(f"{at} reserved")
        if L != levels:
            cur.fail(f"{at}: L = {L} but {qtype} has {levels} levels")
        if has_ids > 1 or reserved:
            cur.fail(f"{at}: has_ids = {has_ids}, reserved = {reserved}; expected 0/1 and 0")
        E = cur.u32(f"{at} E")
        n_global = cur.u32(f"{at} n_global")
        if not 1 <= E <= MAX_EXPERTS:
            cur.fail(f"{at}: E = {E} outside 1..{MAX_EXPERTS}")
        if not E <= n_global <= MAX_EXPERTS or (not has_ids and n_global != E):
            cur.fail(f"{at}: n_global = {n_global} invalid for E = {E} (has_ids = {has_ids})")
        cur.need(4 * E * has_ids + E + 2 * E * 2 * L, f"{at} tables for {E} experts")
        ids = None
        if has_ids:
            arr = cur.array("<u4", E, f"{at} ids")
            if np.any(arr[1:] <= arr[:-1]) or arr[-1] >= n_global:
                cur.fail(f"{at}: expert ids must be strictly increasing and < n_global = {n_global}")
            ids = tuple(int(v) for v in arr)
        modes = cur.array("u1", E, f"{at} modes")
        check_modes(modes, f"{what} {at}")
        books = bf16_to_f32(cur.array("<u2", E * 2 * L, f"{at} books")).reshape(E, 2, L)
        fields.append((name, qtype, modes, books, ids, n_global))
    end = cur.pos
    crc = cur.u32("crc32")
    cur.finish()
    want = zlib.crc32(bytes(cur.buf[:end]))
    if crc != want:
        raise IntegrityError(f"crc32 0x{crc:08x} does not match the content (0x{want:08x})", where=what)
    # the bytes are intact: now the books themselves (finite, increasing)
    return CodebookTable(tuple(CodebookEntry(*f) for f in fields))


# --------------------------------------------------------------------------
# coverage


def check_coverage(table: CodebookTable, resident: Mapping[str, tuple[str, int]], *, what: str = "codebook table") -> None:
    """Every resident MIX tensor, name -> (qtype, n_experts), has exactly one
    entry of that qtype and expert count; the table has no other entries.

    Raises CodebookError listing every offender.
    """
    problems = []
    by_name = {e.name: e for e in table.entries}
    for name, (qtype, n) in sorted(resident.items()):
        e = by_name.get(name)
        if e is None:
            problems.append(f"{name} has no entry")
        elif (e.qtype, e.n_experts) != (qtype, int(n)):
            problems.append(f"{name} is {qtype} with {n} experts but its entry says {e.qtype} with {e.n_experts}")
    extra = sorted(set(by_name) - set(resident))
    problems.extend(f"{name} is not a resident MIX tensor" for name in extra)
    if problems:
        raise CodebookError(
            f"{len(problems)} coverage problem(s): " + "; ".join(problems),
            where=what,
            hint="each resident MIX tensor needs exactly one entry and nothing else",
        )


def nbytes(entries: Iterable[tuple[str, str, int, bool]]) -> int:
    """Table size for (name, qtype, E, has_ids) entries, without building it."""
    total = HEADER_BYTES + 4
    for name, qtype, E, has_ids in entries:
        L = _mix_levels(qtype, "codebook table size")
        total += 2 + len(name.encode("utf-8")) + 1 + len(qtype) + 3 + 8 + 4 * E * bool(has_ids) + E + 4 * E * L
    return total
