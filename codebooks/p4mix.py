"""``P4MIXv1``: Lucebox's sidecar of qtype-105 routed down-expert codebooks (docs/formats.md#p4mix).

Wire (little-endian, no padding, no checksum, no trailing bytes)::

    0   magic     8 B  "P4MIXv1\\0"  50 34 4D 49 58 76 31 00
    8   u32 n_entries       (the converter writes the number of layers)
    12  u32 reserved        (written 0, ignored on read)
    16  entries, back to back:
        u32 layer, u32 E, u32 out, u32 in, u32 C (=2), u32 K (=8)   24 B
        u8  mode[E]                                                  E B
        u8  rot[E]          (must be 0: rotation is not implemented) E B
        u16 books[E*C*K]    bf16, expert-major: book 0 levels, book 1 2*E*C*K B

Entry size = 24 + 2E + 32E; DS4 Flash (E = 256, 43 layers) is 375,320 B.
Reader checks, in order, before any allocation: magic, n_entries against the
bytes left, C/K, 1 <= E <= 65536, 1 <= out, in <= 2^20, in % 32 == 0,
duplicate layers, the tables' length, mode <= 1, rot == 0, books of mode-1
experts finite and strictly increasing, nothing after the last entry.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

from ds4quant.codebooks._wire import MAX_DIM, MAX_EXPERTS, open_blob, bf16_to_f32, check_books, check_modes, f32_to_bf16
from ds4quant.codebooks.routed import MixEntry, check_routed_coverage
from ds4quant.errors import CodebookError

MAGIC = b"P4MIXv1\x00"
HEADER_BYTES = 16
ENTRY_HEADER_BYTES = 24
C, K = 2, 8
DOWN = 2  # MixEntry.surface of a P4MIX entry


def entry_nbytes(n_experts: int) -> int:
    """24 B header + mode[E] + rot[E] + books[E*2*8] bf16."""
    return ENTRY_HEADER_BYTES + 2 * n_experts + 2 * n_experts * C * K


def nbytes(expert_counts: Iterable[int]) -> int:
    """Blob size for entries with these expert counts (no allocation)."""
    return HEADER_BYTES + sum(entry_nbytes(int(e)) for e in expert_counts)


def write_p4mix(entries: Sequence[MixEntry]) -> bytes:
    """Serialize down-surface entries (L = 8, unique layers) in the given order."""
    seen = set()
    parts = [MAGIC, np.array([len(entries), 0], dtype="<u4").tobytes()]
    for e in entries:
        where = f"P4MIXv1 entry layer {e.layer}"
        if e.surface != DOWN or e.levels != K:
            raise CodebookError("P4MIXv1 carries only down-surface (surface 2) 8-level books", where=where)
        if e.layer in seen:
            raise CodebookError("layer appears twice", where=where)
        if e.in_dim % 32:
            raise CodebookError(f"in = {e.in_dim} is not a multiple of 32", where=where)
        seen.add(e.layer)
        rot = np.zeros(e.n_experts, np.uint8) if e.rotations is None else e.rotations
        if np.any(rot):
            raise CodebookError("rotations are not implemented; they must be 0", where=where)
        parts.append(np.array([e.layer, e.n_experts, e.out_dim, e.in_dim, C, K], dtype="<u4").tobytes())
        parts.append(e.modes.tobytes())
        parts.append(rot.tobytes())
        parts.append(f32_to_bf16(e.books, where).astype("<u2").tobytes())
    return b"".join(parts)


def read_p4mix(data: Any, *, n_layers: Optional[int] = None, what: str = "P4MIXv1 blob") -> tuple[MixEntry, ...]:
    """Parse and validate a P4MIXv1 blob; entries in wire order (surface 2).

    n_layers: when given, every layer must be < n_layers.
    Raises CorruptDataError for malformed bytes, CodebookError for bad books.
    """
    cur, n = open_blob(data, what, MAGIC, entry_nbytes(1))
    entries, seen = [], set()
    for i in range(n):
        at = f"entry {i}"
        layer, E, out, in_, c, k = (cur.u32(f"{at} {f}") for f in ("layer", "E", "out", "in", "C", "K"))
        at = f"entry {i} (layer {layer})"
        if c != C or k != K:
            cur.fail(f"{at}: C = {c}, K = {k}; P4MIXv1 needs C = 2, K = 8")
        if not 1 <= E <= MAX_EXPERTS:
            cur.fail(f"{at}: E = {E} outside 1..{MAX_EXPERTS}")
        if not (1 <= out <= MAX_DIM and 1 <= in_ <= MAX_DIM):
            cur.fail(f"{at}: out = {out}, in = {in_} outside 1..{MAX_DIM}")
        if in_ % 32:
            cur.fail(f"{at}: in = {in_} is not a multiple of 32")
        if n_layers is not None and layer >= n_layers:
            cur.fail(f"{at}: layer >= n_layers = {n_layers}")
        if layer in seen:
            cur.fail(f"{at}: layer appears twice")
        seen.add(layer)
        cur.need(entry_nbytes(E) - ENTRY_HEADER_BYTES, f"{at} tables for {E} experts")
        modes = cur.array("u1", E, f"{at} modes")
        rot = cur.array("u1", E, f"{at} rot")
        bits = cur.array("<u2", E * C * K, f"{at} books")
        check_modes(modes, f"{what} {at}")
        if np.any(rot):
            cur.fail(f"{at}: expert {int(np.flatnonzero(rot)[0])} has rot {int(rot[rot != 0][0])}; rotation not implemented", CodebookError)
        books = bf16_to_f32(bits).reshape(E, C, K)
        check_books(books, modes, f"{what} {at}")
        entries.append(MixEntry(layer, DOWN, out, in_, modes, books, rot))
    cur.finish()
    return tuple(entries)


def check_p4mix_coverage(entries: Sequence[MixEntry], resident: Mapping[int, tuple[int, int, int]]) -> None:
    """Every resident 105 down tensor, layer -> (E, out, in), covered exactly once."""
    check_routed_coverage(entries, {(layer, DOWN): d for layer, d in resident.items()}, "P4MIXv1 blob")
