"""Builders for hand-made (often malformed) GGUF files, reusable by a corpus generator.

``RawGGUF`` writes exactly the fields it is given, with no checks, and
records where every header field lies (``build_with_fields``), so a test can
truncate at each field. ``HOSTILE_CASES`` maps a case name to
``(builder, expected message fragment)``; every builder returns the bytes of
a file that ``read_gguf`` must refuse with one CorruptDataError.

    data = HOSTILE_CASES["dims_overflow_u64"][0]()
    Path("x.gguf").write_bytes(data)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Union

# GGUF value type ids (gguf.GGUFValueType); spelled out so this file reads
# like the wire.
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
F32, F16, Q8_0 = 0, 1, 8
ROCMFP3, ROCMFP2_MIX, ROCMFP2 = 104, 106, 107

# (block size, block bytes) for the types used here (docs/formats.md, gguf sizes)
SIZES = {F32: (1, 4), F16: (1, 2), Q8_0: (32, 34), 100: (32, 18), 101: (32, 17), 102: (32, 26),
         103: (32, 33), 104: (32, 14), 105: (32, 14), 106: (32, 10), 107: (32, 10)}

Bytes = Union[bytes, str]


def b(s: Bytes) -> bytes:
    return s.encode("utf-8") if isinstance(s, str) else s


def gstr(s: Bytes, length: Optional[int] = None) -> bytes:
    """A GGUF string: u64 length (overridable) + bytes."""
    raw = b(s)
    return struct.pack("<Q", len(raw) if length is None else length) + raw


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


@dataclass
class RawKV:
    """One KV: key (length overridable), u32 type, and the raw value bytes."""

    key: Bytes
    vtype: int
    value: bytes
    key_len: Optional[int] = None

    def fields(self, i: int) -> list[tuple[str, bytes]]:
        kb = b(self.key)
        return [(f"kv{i}.key_len", u64(len(kb) if self.key_len is None else self.key_len)),
                (f"kv{i}.key", kb), (f"kv{i}.type", u32(self.vtype)), (f"kv{i}.value", self.value)]


def kv_u32(key: Bytes, v: int) -> RawKV:
    return RawKV(key, UINT32, u32(v))


def kv_u16(key: Bytes, v: int) -> RawKV:
    return RawKV(key, UINT16, struct.pack("<H", v))


def kv_i32(key: Bytes, v: int) -> RawKV:
    return RawKV(key, INT32, struct.pack("<i", v))


def kv_u64(key: Bytes, v: int) -> RawKV:
    return RawKV(key, UINT64, u64(v))


def kv_str(key: Bytes, s: Bytes, length: Optional[int] = None) -> RawKV:
    return RawKV(key, STRING, gstr(s, length))


def kv_bool(key: Bytes, byte: int) -> RawKV:
    return RawKV(key, BOOL, bytes([byte]))


def kv_array(key: Bytes, sub: int, count: int, payload: bytes) -> RawKV:
    return RawKV(key, ARRAY, u32(sub) + u64(count) + payload)


def kv_str_array(key: Bytes, items: list[Bytes]) -> RawKV:
    return kv_array(key, STRING, len(items), b"".join(gstr(s) for s in items))


@dataclass
class RawTensor:
    """One tensor info; ``n_dims`` and ``name_len`` override the honest values."""

    name: Bytes
    dims: list[int]
    ggml_type: int
    offset: int
    n_dims: Optional[int] = None
    name_len: Optional[int] = None

    def nbytes(self) -> int:
        bs, bb = SIZES.get(self.ggml_type, (1, 1))
        n = 1
        for d in self.dims:
            n *= d
        return n // bs * bb

    def fields(self, i: int) -> list[tuple[str, bytes]]:
        nb = b(self.name)
        return [(f"ti{i}.name_len", u64(len(nb) if self.name_len is None else self.name_len)),
                (f"ti{i}.name", nb),
                (f"ti{i}.n_dims", u32(len(self.dims) if self.n_dims is None else self.n_dims)),
                (f"ti{i}.dims", b"".join(u64(d) for d in self.dims)),
                (f"ti{i}.type", u32(self.ggml_type)), (f"ti{i}.offset", u64(self.offset))]


@dataclass
class RawGGUF:
    """A GGUF file spelled field by field. ``data`` None: a zero data section
    just long enough for every tensor (padded to ``alignment``)."""

    kvs: list[RawKV] = field(default_factory=list)
    tensors: list[RawTensor] = field(default_factory=list)
    magic: bytes = b"GGUF"
    version: int = 3
    n_tensors: Optional[int] = None
    n_kv: Optional[int] = None
    alignment: int = 32
    data: Optional[bytes] = None
    trailing: bytes = b""

    def header_fields(self) -> list[tuple[str, bytes]]:
        out = [("magic", self.magic), ("version", u32(self.version)),
               ("n_tensors", u64(len(self.tensors) if self.n_tensors is None else self.n_tensors)),
               ("n_kv", u64(len(self.kvs) if self.n_kv is None else self.n_kv))]
        for i, kv in enumerate(self.kvs):
            out += kv.fields(i)
        for i, t in enumerate(self.tensors):
            out += t.fields(i)
        return out

    def build_with_fields(self) -> tuple[bytes, list[tuple[str, int, int]]]:
        """The file bytes and [(field name, start, end)] of every header field."""
        parts, spans, pos = [], [], 0
        for name, raw in self.header_fields():
            parts.append(raw)
            spans.append((name, pos, pos + len(raw)))
            pos += len(raw)
        pad = -pos % self.alignment
        parts.append(bytes(pad))
        if self.data is None:
            end = max((t.offset + t.nbytes() for t in self.tensors), default=0)
            # a hostile shape can ask for more bytes than exist; keep the file small
            data = bytes(end + (-end % self.alignment)) if self.tensors and end <= 1 << 20 else bytes(128 * bool(self.tensors))
        else:
            data = self.data
        spans.append(("data", pos + pad, pos + pad + len(data)))
        parts += [data, self.trailing]
        return b"".join(parts), spans

    def build(self) -> bytes:
        return self.build_with_fields()[0]


def ds4_tags(qtypes: dict[str, str]) -> list[RawKV]:
    """The ds4quant tag KVs (tags.py) for tensor -> qtype, with variants as the
    registry names them."""
    variants = {"f32": "f32", "f16": "f16", "q8_0": "q8_0", "rocmfp3": "fp3", "rocmfp2": "fp2-default",
                "rocmfp2_affine": "fp2-affine", "rocmfp2_mix": "mix106-7s1c"}
    table = sorted(f"{q}={variants[q]}" for q in set(qtypes.values()))
    return ([kv_u32("ds4quant.format_version", 1), kv_str_array("ds4quant.qtype_variants", table)]
            + [kv_str(f"ds4quant.qtype.{n}", q) for n, q in qtypes.items()])


def base() -> RawGGUF:
    """A small valid file: typed KVs, an F32 and a ROCmFP3 tensor, tagged."""
    return RawGGUF(
        kvs=[kv_str("general.architecture", "deepseek4"), kv_u32("deepseek4.block_count", 2),
             kv_str_array("tokenizer.ggml.tokens", ["a", "bc", "\u00fc"]),
             kv_array("deepseek4.p4mix.sidecar", UINT8, 5, b"P4MIX"), kv_bool("flag", 1)]
        + ds4_tags({"a.weight": "f32", "b.weight": "rocmfp3"}),
        tensors=[RawTensor("a.weight", [4, 2], F32, 0), RawTensor("b.weight", [64, 3], ROCMFP3, 32)],
    )


def untagged(tensors: list[RawTensor], kvs: Optional[list[RawKV]] = None, **kw) -> RawGGUF:
    return RawGGUF(kvs=kvs if kvs is not None else [kv_str("general.architecture", "x")], tensors=tensors, **kw)


def _with_kv(kv: RawKV) -> bytes:
    return untagged([RawTensor("t", [32], F32, 0)], [kv_str("general.architecture", "x"), kv]).build()


def _with_tensors(*ts: RawTensor, data: Optional[bytes] = None, trailing: bytes = b"", kvs=None) -> bytes:
    return untagged(list(ts), kvs, data=data, trailing=trailing).build()


def _truncate_data() -> bytes:
    raw = base().build()
    return raw[:-40]


def _data_past_end() -> bytes:
    raw, spans = base().build_with_fields()
    info_end = [s for s in spans if s[0] == "ti1.offset"][0][2]
    return raw[:info_end]


def _dup_key() -> bytes:
    return untagged([RawTensor("t", [32], F32, 0)], [kv_u32("k", 1), kv_u32("k", 2)]).build()


def _tag_mismatch() -> bytes:
    r = untagged([RawTensor("t", [32], ROCMFP2, 0)], [kv_str("general.architecture", "x")] + ds4_tags({"t": "rocmfp3"}))
    return r.build()


def _tags_without_version() -> bytes:
    return _with_tensors(RawTensor("t", [32], F32, 0), kvs=[kv_str("ds4quant.qtype.t", "f32")])


def _stale_tag() -> bytes:
    return _with_tensors(RawTensor("t", [32], F32, 0), kvs=ds4_tags({"t": "f32", "gone": "f32"}))


def _missing_tag() -> bytes:
    tags = ds4_tags({"t": "f32"})
    return _with_tensors(RawTensor("t", [32], F32, 0), RawTensor("u", [32], F32, 128), kvs=tags)


def _bad_variant_table() -> bytes:
    return _with_tensors(RawTensor("t", [32], F32, 0), kvs=[kv_u32("ds4quant.format_version", 1),
                                                            kv_str_array("ds4quant.qtype_variants", ["f32"]),
                                                            kv_str("ds4quant.qtype.t", "f32")])


def _variant_table_missing_entry() -> bytes:
    return _with_tensors(RawTensor("t", [32], F32, 0), kvs=[kv_u32("ds4quant.format_version", 1),
                                                            kv_str_array("ds4quant.qtype_variants", ["f16=f16"]),
                                                            kv_str("ds4quant.qtype.t", "f32")])


# name -> (builder, fragment the CorruptDataError message must contain)
HOSTILE_CASES: dict[str, tuple[Callable[[], bytes], str]] = {
    # magic / version / counts
    "empty_file": (lambda: b"", "file ends inside the magic"),
    "bad_magic": (lambda: replace(base(), magic=b"GGUX").build(), "bad magic"),
    "magic_only": (lambda: b"GGUF", "file ends inside the version"),
    "version_0": (lambda: replace(base(), version=0).build(), "unknown GGUF version 0"),
    "version_4": (lambda: replace(base(), version=4).build(), "unknown GGUF version 4"),
    "version_max": (lambda: replace(base(), version=0xFFFFFFFF).build(), "unknown GGUF version"),
    "n_tensors_huge": (lambda: replace(base(), n_tensors=2**64 - 1).build(), "cannot fit"),
    "n_kv_huge": (lambda: replace(base(), n_kv=2**64 - 1).build(), "cannot fit"),
    "counts_sum_overflow": (lambda: replace(base(), n_kv=2**63, n_tensors=2**63).build(), "cannot fit"),
    "n_kv_one_too_many": (lambda: replace(base(), n_kv=len(base().kvs) + 1).build(), "runs past the end"),
    # KV keys
    "key_len_huge": (lambda: _with_kv(RawKV("k", UINT32, u32(1), key_len=2**64 - 1)), "exceeds 65535"),
    "key_len_past_end": (lambda: _with_kv(RawKV("k", UINT32, u32(1), key_len=1000)), "runs past the end"),
    "key_empty": (lambda: _with_kv(RawKV("", UINT32, u32(1))), "empty key"),
    "key_bad_utf8": (lambda: _with_kv(RawKV(b"k\xff", UINT32, u32(1))), "not valid UTF-8"),
    "key_duplicate": (_dup_key, "duplicate KV key 'k'"),
    "kv_type_unknown": (lambda: _with_kv(RawKV("k", 13, u32(1))), "unknown value type 13"),
    "kv_type_max": (lambda: _with_kv(RawKV("k", 0xFFFFFFFF, u32(1))), "unknown value type"),
    # KV values
    "string_len_huge": (lambda: _with_kv(kv_str("k", "abc", length=2**64 - 1)), "runs past the end"),
    "string_overlong_utf8": (lambda: _with_kv(kv_str("k", b"\xc0\x80")), "not valid UTF-8"),
    "string_surrogate_utf8": (lambda: _with_kv(kv_str("k", b"\xed\xa0\x80")), "not valid UTF-8"),
    "bool_not_0_1": (lambda: _with_kv(kv_bool("k", 2)), "not 0 or 1"),
    "array_count_huge": (lambda: _with_kv(kv_array("k", UINT8, 2**64 - 1, b"\x00")), "cannot fit"),
    "array_u64_count_overflow": (lambda: _with_kv(kv_array("k", UINT64, 2**61, b"")), "cannot fit"),
    "array_string_count_huge": (lambda: _with_kv(kv_array("k", STRING, 2**62, b"")), "cannot fit"),
    "array_elem_type_unknown": (lambda: _with_kv(kv_array("k", 99, 1, b"\x00")), "unknown array element type 99"),
    "array_string_len_huge": (lambda: _with_kv(kv_array("k", STRING, 1, gstr("a", 2**63))), "runs past the end"),
    "array_string_bad_utf8": (lambda: _with_kv(kv_array("k", STRING, 2, gstr("ok") + gstr(b"\xfe"))),
                              "not valid UTF-8"),
    "array_bool_not_0_1": (lambda: _with_kv(kv_array("k", BOOL, 3, b"\x00\x01\x07")), "not 0 or 1"),
    # alignment
    "alignment_not_pow2": (lambda: _with_kv(kv_u32("general.alignment", 48)), "not a power of two"),
    "alignment_zero": (lambda: _with_kv(kv_u32("general.alignment", 0)), "not a power of two"),
    "alignment_wrong_type": (lambda: _with_kv(kv_u64("general.alignment", 32)), "must be UINT32"),
    # tensor infos
    "tensor_name_len_huge": (lambda: _with_tensors(RawTensor("t", [32], F32, 0, name_len=2**64 - 1)),
                             "runs past the end"),
    "tensor_name_empty": (lambda: _with_tensors(RawTensor("", [32], F32, 0)), "empty name"),
    "tensor_name_bad_utf8": (lambda: _with_tensors(RawTensor(b"t\x80", [32], F32, 0)), "not valid UTF-8"),
    "tensor_name_too_long": (lambda: _with_tensors(RawTensor("n" * 64, [32], F32, 0)), "ggml allows 63"),
    "tensor_name_duplicate": (lambda: _with_tensors(RawTensor("t", [32], F32, 0), RawTensor("t", [32], F32, 128)),
                              "duplicate tensor name 't'"),
    "n_dims_zero": (lambda: _with_tensors(RawTensor("t", [], F32, 0)), "n_dims 0"),
    "n_dims_five": (lambda: _with_tensors(RawTensor("t", [1, 1, 1, 1, 1], F32, 0)), "n_dims 5"),
    "n_dims_huge": (lambda: _with_tensors(RawTensor("t", [32], F32, 0, n_dims=0xFFFFFFFF)), "n_dims 4294967295"),
    "dim_zero": (lambda: _with_tensors(RawTensor("t", [32, 0], F32, 0)), "ne[1] = 0"),
    "dims_overflow_u64": (lambda: _with_tensors(RawTensor("t", [2**32, 2**32], F32, 0)), "more than 2^63"),
    "dims_product_2_63": (lambda: _with_tensors(RawTensor("t", [2**31, 2**32], F32, 0)), "more than 2^63"),
    "dim_max_u64": (lambda: _with_tensors(RawTensor("t", [2**64 - 1], F32, 0)), "more than 2^63"),
    "ggml_type_unknown": (lambda: _with_tensors(RawTensor("t", [32], 99, 0)), "unknown ggml type 99"),
    "ggml_type_removed_q4_2": (lambda: _with_tensors(RawTensor("t", [32], 4, 0)), "unknown ggml type 4"),
    "ggml_type_max": (lambda: _with_tensors(RawTensor("t", [32], 0xFFFFFFFF, 0)), "unknown ggml type"),
    "q8_0_row_not_block": (lambda: _with_tensors(RawTensor("t", [33, 2], Q8_0, 0)), "not a multiple"),
    "rocmfp3_row_not_block": (lambda: _with_tensors(RawTensor("t", [48, 2], ROCMFP3, 0)), "not a multiple"),
    # spans
    "offset_unaligned": (lambda: _with_tensors(RawTensor("t", [32], F32, 1), data=bytes(160)), "not a multiple"),
    "offset_past_end": (lambda: _with_tensors(RawTensor("t", [32], F32, 2**40), data=bytes(128)), "runs past the end"),
    "offset_near_u64_max": (lambda: _with_tensors(RawTensor("t", [32], F32, 2**64 - 32), data=bytes(128)),
                            "runs past the end"),
    "tensor_partly_past_end": (lambda: _with_tensors(RawTensor("t", [64], F32, 0), data=bytes(128)),
                               "runs past the end"),
    "tensors_overlap": (lambda: _with_tensors(RawTensor("t", [32], F32, 0), RawTensor("u", [32], F32, 64)),
                        "overlaps"),
    "tensors_same_offset": (lambda: _with_tensors(RawTensor("t", [32], F32, 0), RawTensor("u", [8], F32, 0)),
                            "same offset"),
    "zero_size_offset_reuse": (lambda: _with_tensors(RawTensor("t", [0], F32, 0), RawTensor("u", [0], F32, 0),
                                                     data=b""), "ne[0] = 0"),
    "data_section_past_end": (_data_past_end, "past the end"),
    "data_truncated": (_truncate_data, "runs past the end"),
    "trailing_garbage": (lambda: _with_tensors(RawTensor("t", [32], F32, 0), trailing=b"x"), "unexplained bytes"),
    "trailing_block": (lambda: _with_tensors(RawTensor("t", [8], F32, 0), data=bytes(64)), "unexplained bytes"),
    "trailing_no_tensors": (lambda: untagged([], trailing=bytes(64)).build(), "unexplained bytes"),
    # split keys
    "split_keys_incomplete": (lambda: _with_kv(kv_u16("split.no", 0)), "split keys incomplete"),
    "split_no_not_below_count": (lambda: _with_tensors(RawTensor("t", [32], F32, 0), kvs=[
        kv_u16("split.no", 2), kv_u16("split.count", 2), kv_i32("split.tensors.count", 1)]), "not below"),
    "split_count_wrong_type": (lambda: _with_tensors(RawTensor("t", [32], F32, 0), kvs=[
        kv_u16("split.no", 0), kv_u32("split.count", 2), kv_i32("split.tensors.count", 1)]), "must be UINT16"),
    "split_tensors_count_low": (lambda: _with_tensors(RawTensor("t", [32], F32, 0), kvs=[
        kv_u16("split.no", 0), kv_u16("split.count", 2), kv_i32("split.tensors.count", 0)]), "is below"),
    # tags
    "tag_not_string": (lambda: _with_tensors(RawTensor("t", [32], F32, 0), kvs=[
        kv_u32("ds4quant.format_version", 1), kv_str_array("ds4quant.qtype_variants", ["f32=f32"]),
        kv_u32("ds4quant.qtype.t", 0)]), "must be a STRING"),
    "tag_contradicts_id": (_tag_mismatch, "tagged 'rocmfp3' (ggml type 104) but stored as ggml type 107"),
    "tags_without_version": (_tags_without_version, "no ds4quant.format_version"),
    "tag_names_no_tensor": (_stale_tag, "names no tensor"),
    "tag_missing": (_missing_tag, "has no ds4quant.qtype.<name> tag"),
    "variant_table_bad_entry": (_bad_variant_table, "is not 'qtype=variant'"),
    "variant_table_missing_entry": (_variant_table_missing_entry, "has no entry for qtype 'f32'"),
}


def truncations() -> list[tuple[str, bytes]]:
    """The valid ``base()`` file cut inside and at the start of every header
    field and at the start of its data section: each must be refused."""
    raw, spans = base().build_with_fields()
    out = []
    for name, start, end in spans:
        cuts = {start} | ({start + (end - start) // 2} if end - start > 1 else set())
        for cut in sorted(cuts):
            if cut < len(raw):
                out.append((f"{name}@{cut}", raw[:cut]))
    return out
