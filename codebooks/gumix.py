"""``GUMIXs1``: Lucebox's split sidecar of qtype-106 routed codebooks (docs/formats.md#gumix).

Wire (little-endian, no padding, no checksum, no trailing bytes)::

    0   magic     8 B  "GUMIXs1\\0"  47 55 4D 49 58 73 31 00
    8   u32 n_entries       (the converter writes 2 * layers: gate, up per layer)
    12  u32 reserved        (written 0, ignored on read)
    16  entries, back to back:
        u32 layer, u32 surface (0 gate, 1 up, 2 down), u32 E, u32 out, u32 in,
        u32 C (=2), u32 K (=4)                                       28 B
        u8  mode[E]                                                  E B
        u16 books[E*C*K]    bf16, expert-major                       16E B

There is no rotation field. Entry size = 28 + 17E; DS4 Flash (E = 256,
86 entries) is 376,696 B. The fused ``GUMIXv1`` form is refused. Reader
checks as P4MIXv1 (docs/formats.md#p4mix) per (layer, surface), plus surface <= 2 and
in % 128 == 0 (qtype 106's row rule, docs/formats.md#mix).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

from ds4quant.codebooks._wire import MAX_DIM, MAX_EXPERTS, open_blob, bf16_to_f32, check_books, check_modes, f32_to_bf16
from ds4quant.codebooks.routed import SURFACES, MixEntry, check_routed_coverage
from ds4quant.errors import CodebookError

MAGIC = b"GUMIXs1\x00"
FUSED_MAGIC = b"GUMIXv1\x00"
HEADER_BYTES = 16
ENTRY_HEADER_BYTES = 28
C, K = 2, 4


def entry_nbytes(n_experts: int) -> int:
    """28 B header + mode[E] + books[E*2*4] bf16."""
    return ENTRY_HEADER_BYTES + n_experts + 2 * n_experts * C * K


def nbytes(expert_counts: Iterable[int]) -> int:
    """Blob size for entries with these expert counts (no allocation)."""
    return HEADER_BYTES + sum(entry_nbytes(int(e)) for e in expert_counts)


def write_gumix(entries: Sequence[MixEntry]) -> bytes:
    """Serialize 4-level entries (unique (layer, surface)) in the given order."""
    seen = set()
    parts = [MAGIC, np.array([len(entries), 0], dtype="<u4").tobytes()]
    for e in entries:
        where = f"GUMIXs1 entry layer {e.layer} surface {e.surface}"
        if e.levels != K:
            raise CodebookError("GUMIXs1 carries only 4-level (qtype 106) books", where=where)
        if e.key in seen:
            raise CodebookError("(layer, surface) appears twice", where=where)
        if e.in_dim % 128:
            raise CodebookError(f"in = {e.in_dim} is not a multiple of 128", where=where)
        if e.rotations is not None and np.any(e.rotations):
            raise CodebookError("GUMIXs1 has no rotation field; rotations must be 0", where=where)
        seen.add(e.key)
        parts.append(np.array([e.layer, e.surface, e.n_experts, e.out_dim, e.in_dim, C, K], dtype="<u4").tobytes())
        parts.append(e.modes.tobytes())
        parts.append(f32_to_bf16(e.books, where).astype("<u2").tobytes())
    return b"".join(parts)


def read_gumix(data: Any, *, n_layers: Optional[int] = None, what: str = "GUMIXs1 blob") -> tuple[MixEntry, ...]:
    """Parse and validate a GUMIXs1 blob; entries in wire order.

    n_layers: when given, every layer must be < n_layers.
    Raises CorruptDataError for malformed bytes, CodebookError for bad books.
    """
    cur, n = open_blob(data, what, MAGIC, entry_nbytes(1),
                       {FUSED_MAGIC: "fused GUMIXv1 blobs are not supported; export the split form GUMIXs1"})
    entries, seen = [], set()
    fields = ("layer", "surface", "E", "out", "in", "C", "K")
    for i in range(n):
        layer, surface, E, out, in_, c, k = (cur.u32(f"entry {i} {f}") for f in fields)
        at = f"entry {i} (layer {layer} surface {surface})"
        if surface >= len(SURFACES):
            cur.fail(f"{at}: surface must be 0 (gate), 1 (up) or 2 (down)")
        if c != C or k != K:
            cur.fail(f"{at}: C = {c}, K = {k}; GUMIXs1 needs C = 2, K = 4")
        if not 1 <= E <= MAX_EXPERTS:
            cur.fail(f"{at}: E = {E} outside 1..{MAX_EXPERTS}")
        if not (1 <= out <= MAX_DIM and 1 <= in_ <= MAX_DIM):
            cur.fail(f"{at}: out = {out}, in = {in_} outside 1..{MAX_DIM}")
        if in_ % 128:
            cur.fail(f"{at}: in = {in_} is not a multiple of 128")
        if n_layers is not None and layer >= n_layers:
            cur.fail(f"{at}: layer >= n_layers = {n_layers}")
        if (layer, surface) in seen:
            cur.fail(f"{at}: (layer, surface) appears twice")
        seen.add((layer, surface))
        cur.need(entry_nbytes(E) - ENTRY_HEADER_BYTES, f"{at} tables for {E} experts")
        modes = cur.array("u1", E, f"{at} modes")
        bits = cur.array("<u2", E * C * K, f"{at} books")
        check_modes(modes, f"{what} {at}")
        books = bf16_to_f32(bits).reshape(E, C, K)
        check_books(books, modes, f"{what} {at}")
        entries.append(MixEntry(layer, surface, out, in_, modes, books))
    cur.finish()
    return tuple(entries)


def check_gumix_coverage(entries: Sequence[MixEntry], resident: Mapping[tuple[int, int], tuple[int, int, int]]) -> None:
    """Every resident 106 tensor, (layer, surface) -> (E, out, in), covered exactly once."""
    check_routed_coverage(entries, resident, "GUMIXs1 blob")
