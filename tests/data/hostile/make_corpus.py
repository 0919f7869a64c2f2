#!/usr/bin/env python
"""Write the hostile-input corpus: malformed files every ds4quant reader must refuse.

Each case is a file (or a source folder) plus its expected outcome in
``expected.json``: the reader that opens it, the Ds4quantError subclass it
must raise, and a fragment of the one-line message. The expectations are
written here by hand from the formats' rules, not copied from the readers.

    gguf/         GGUF files (the builders of tests/artifact/hostile.py, cuts
                  of a valid file, split sets, tags, versions)
    safetensors/  truncations, huge header lengths, bad JSON, offsets, dtypes, names
    sidecar/      GUMIXs1, P4MIXv1, DMIXs1 and DS4QCBT (ds4quant's own table) blobs
    manifest/     manifest.json: bad JSON, wrong schema, duplicates, bad hashes
    sums/         SHA256SUMS lists
    imatrix/      importance matrices (legacy .dat and GGUF)
    source/       DeepSeek-V4 checkpoint folders (config.json + index + shards)

Deterministic: the same script writes the same bytes. From the repository root:

    python tests/data/hostile/make_corpus.py          # rewrite the corpus here
    python tests/data/hostile/make_corpus.py --check  # rebuild in a temp folder and compare
"""

from __future__ import annotations

import argparse
import filecmp
import json
import shutil
import struct
import sys
import tempfile
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Callable, Union

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO))

from tests.artifact.hostile import (  # noqa: E402
    ARRAY,
    F32,
    HOSTILE_CASES,
    ROCMFP2,
    ROCMFP3,
    UINT8,
    RawTensor,
    base,
    ds4_tags,
    kv_array,
    kv_i32,
    kv_str,
    kv_str_array,
    kv_u16,
    kv_u32,
    truncations,
    untagged,
)

SAMPLE_CONFIG = REPO / "samples" / "ds4-tiny" / "config.json"
Content = Union[bytes, dict]  # a file's bytes, or a folder: relative name -> bytes
CASES: list[tuple[str, str, str, str, Callable[[], Content]]] = []


def add(path: str, reader: str, error: str, fragment: str, fn: Callable[[], Content]) -> None:
    CASES.append((path, reader, error, fragment, fn))


# ----------------------------------------------------------------------------
# GGUF


for _name, (_builder, _fragment) in HOSTILE_CASES.items():
    add(f"gguf/{_name}.gguf", "gguf", "CorruptDataError", _fragment, _builder)

_CUTS = {  # field of the valid base() file -> what the reader says when the file ends there
    "magic@2": "file ends inside the magic",
    "version@6": "file ends inside the version",
    "n_tensors@12": "file ends inside the tensor count",
    "n_kv@20": "file ends inside the KV count",
    "kv0.key_len@28": "cannot fit",
    "kv0.value@64": "cannot fit",
    "kv2.value@163": "cannot fit",
    "ti0.name@": "name length 8 runs past the end of the file",
    "ti1.offset@": "file ends inside",
    "data@": "past the end",
}
_TRUNC = dict(truncations())
for _key, _fragment in _CUTS.items():
    _hit = sorted(k for k in _TRUNC if k == _key or (_key.endswith("@") and k.startswith(_key)))[0]
    add(f"gguf/cut_{_hit.replace('@', '_at_').replace('.', '_')}.gguf", "gguf", "CorruptDataError", _fragment,
        lambda _hit=_hit: _TRUNC[_hit])


def _one(t: RawTensor, kvs=None, **kw) -> bytes:
    return untagged([t], kvs, **kw).build()


def _cut_last_tensor() -> bytes:
    # gguf-py's reader accepts a file cut inside its last tensor; ours must not
    raw, spans = base().build_with_fields()
    data_start = [s for s in spans if s[0] == "data"][0][1]
    return raw[:data_start + 32 + 84 - 1]  # b.weight: 6 ROCmFP3 blocks of 14 B at offset 32


add("gguf/last_tensor_cut_by_one_byte.gguf", "gguf", "CorruptDataError", "runs past the end", _cut_last_tensor)


add("gguf/version_1.gguf", "gguf", "UnsupportedFormatError", "GGUF version 1 is not supported",
    lambda: replace(base(), version=1).build())
add("gguf/big_endian.gguf", "gguf", "UnsupportedFormatError", "big-endian GGUF",
    lambda: replace(base(), version=3 << 24).build())
add("gguf/nested_array.gguf", "gguf", "UnsupportedFormatError", "nested array",
    lambda: _one(RawTensor("t", [32], F32, 0), [kv_str("general.architecture", "x"),
                                                kv_array("k", ARRAY, 1, struct.pack("<IQ", UINT8, 0))]))
add("gguf/untagged_107.gguf", "gguf", "UnsupportedFormatError", "has ggml type 107 and no tag",
    lambda: _one(RawTensor("t", [32], ROCMFP2, 0)))
add("gguf/tag_unknown_qtype.gguf", "gguf", "UnsupportedFormatError", "which this build does not know",
    lambda: _one(RawTensor("t", [32], F32, 0), [kv_u32("ds4quant.format_version", 1),
                                                kv_str_array("ds4quant.qtype_variants", ["rocmfp9=x"]),
                                                kv_str("ds4quant.qtype.t", "rocmfp9")]))
add("gguf/tag_variant_differs.gguf", "gguf", "UnsupportedFormatError", "is variant 'fp3-old'",
    lambda: _one(RawTensor("t", [32], ROCMFP3, 0), [kv_u32("ds4quant.format_version", 1),
                                                    kv_str_array("ds4quant.qtype_variants", ["rocmfp3=fp3-old"]),
                                                    kv_str("ds4quant.qtype.t", "rocmfp3")]))
add("gguf/format_version_2.gguf", "gguf", "UnsupportedFormatError", "ds4quant.format_version is 2",
    lambda: _one(RawTensor("t", [32], F32, 0), [kv_u32("ds4quant.format_version", 2)]))
_SPLIT = [kv_u16("split.no", 0), kv_u16("split.count", 2), kv_i32("split.tensors.count", 2)]
add("gguf/split_missing-00001-of-00002.gguf", "gguf", "CorruptDataError", "split 2 of 2 is missing",
    lambda: _one(RawTensor("t", [32], F32, 0), _SPLIT))
add("gguf/split_keys_plain_name.gguf", "gguf", "CorruptDataError", "its name is not NAME-0000k-of-0000n.gguf",
    lambda: _one(RawTensor("t", [32], F32, 0), _SPLIT))
add("gguf/split_name_no_keys-00001-of-00002.gguf", "gguf", "CorruptDataError", "has no split keys",
    lambda: _one(RawTensor("t", [32], F32, 0)))
add("gguf/split_name_disagrees-00002-of-00002.gguf", "gguf", "CorruptDataError", "name says split 2 of 2",
    lambda: _one(RawTensor("t", [32], F32, 0), _SPLIT))
add("gguf/mix_tag_on_wrong_id.gguf", "gguf", "CorruptDataError", "(ggml type 106) but stored as ggml type 107",
    lambda: _one(RawTensor("t", [128], ROCMFP2, 0), [kv_str("general.architecture", "x")]
                 + ds4_tags({"t": "rocmfp2_mix"})))
add("gguf/not_gguf_safetensors.gguf", "gguf", "CorruptDataError", "not a GGUF file",
    lambda: (2).to_bytes(8, "little") + b"{}")


# ----------------------------------------------------------------------------
# safetensors


def st(header: "dict | bytes", data: bytes = b"", length: "int | None" = None, pad: bool = True) -> bytes:
    hb = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    if pad:
        hb += b" " * (-len(hb) % 8)
    return (len(hb) if length is None else length).to_bytes(8, "little") + hb + data


def ent(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


_ST = "safetensors"
_OK = {"a": ent("F32", [2], 0, 8), "b": ent("BF16", [4], 8, 16)}
for _p, _e, _frag, _fn in [
    ("empty", "CorruptDataError", "too short for a safetensors header", lambda: b""),
    ("seven_bytes", "CorruptDataError", "too short for a safetensors header", lambda: b"\x08\x00\x00\x00\x00\x00\x00"),
    ("header_len_max_u64", "CorruptDataError", "runs past the end of the file", lambda: st(b"{}", length=2**64 - 1)),
    ("header_len_past_end", "CorruptDataError", "runs past the end of the file", lambda: st(b"{}", length=4096)),
    ("header_len_cuts_json", "CorruptDataError", "header is not valid JSON",
     lambda: st(json.dumps(_OK).encode()[:-3], bytes(16), pad=False)),
    ("header_not_utf8", "CorruptDataError", "header is not UTF-8", lambda: st(b'{"\xff":1}')),
    ("header_not_object", "CorruptDataError", "header does not start with '{'", lambda: st(b"[1, 2]")),
    ("header_bad_json", "CorruptDataError", "header is not valid JSON", lambda: st(b'{"a": {"dtype": }')),
    ("header_deep_nesting", "CorruptDataError", "header is not valid JSON", lambda: st(b"{" + b'"a":[' * 5000)),
    ("duplicate_name", "CorruptDataError", "names tensor 'a' twice",
     lambda: st(b'{"a":' + json.dumps(ent("F32", [1], 0, 4)).encode() + b',"a":'
                + json.dumps(ent("F32", [1], 4, 8)).encode() + b"}", bytes(8))),
    ("metadata_not_strings", "CorruptDataError", "__metadata__ must map strings to strings",
     lambda: st({"__metadata__": {"k": 1}, **_OK}, bytes(16))),
    ("entry_not_object", "CorruptDataError", "entry is not an object", lambda: st({"a": [1, 2]})),
    ("entry_missing_offsets", "CorruptDataError", "exactly dtype, shape, data_offsets",
     lambda: st({"a": {"dtype": "F32", "shape": [1]}}, bytes(4))),
    ("entry_extra_key", "CorruptDataError", "exactly dtype, shape, data_offsets",
     lambda: st({"a": {**ent("F32", [1], 0, 4), "x": 1}}, bytes(4))),
    ("dtype_unknown", "CorruptDataError", "unknown dtype 'F7'", lambda: st({"a": ent("F7", [1], 0, 4)}, bytes(4))),
    ("dtype_size_wrong", "CorruptDataError", "byte length 8 != 4 for F32 (1,)",
     lambda: st({"a": ent("F32", [1], 0, 8)}, bytes(8))),
    ("bf16_odd_bytes", "CorruptDataError", "byte length 3 != 2 for BF16 (1,)",
     lambda: st({"a": ent("BF16", [1], 0, 3)}, bytes(3))),
    ("f4_odd_last_dim", "CorruptDataError", "F4 last dimension 3 must be even",
     lambda: st({"a": ent("F4", [2, 3], 0, 3)}, bytes(3))),
    ("shape_negative", "CorruptDataError", "shape must be a list of non-negative ints",
     lambda: st({"a": ent("F32", [-1], 0, 4)}, bytes(4))),
    ("shape_bool", "CorruptDataError", "shape must be a list of non-negative ints",
     lambda: st({"a": ent("F32", [True], 0, 4)}, bytes(4))),
    ("shape_overflows_u64", "CorruptDataError", "byte length 4 != ",
     lambda: st({"a": ent("F32", [2**32, 2**32], 0, 4)}, bytes(4))),
    ("offsets_reversed", "CorruptDataError", "data_offsets must be [begin, end]",
     lambda: st({"a": ent("F32", [0], 4, 0)}, bytes(4))),
    ("offsets_float", "CorruptDataError", "data_offsets must be [begin, end]",
     lambda: st({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4.0]}}, bytes(4))),
    ("offsets_past_end", "CorruptDataError", "lies outside the 4-byte buffer",
     lambda: st({"a": ent("F32", [2], 0, 8)}, bytes(4))),
    ("offsets_huge", "CorruptDataError", "lies outside",
     lambda: st({"a": ent("U8", [4], 2**64 - 4, 2**64)}, bytes(4))),
    ("offsets_overlap", "CorruptDataError", "overlaps tensor 'a'",
     lambda: st({"a": ent("F32", [2], 0, 8), "b": ent("F32", [1], 4, 8)}, bytes(8))),
    ("offsets_same_start", "CorruptDataError", "overlaps tensor",
     lambda: st({"a": ent("F32", [1], 0, 4), "b": ent("F32", [1], 0, 4)}, bytes(4))),
    ("offsets_hole", "CorruptDataError", "leaves a hole of 4 bytes",
     lambda: st({"a": ent("F32", [1], 0, 4), "b": ent("F32", [1], 8, 12)}, bytes(12))),
    ("trailing_bytes", "CorruptDataError", "4 bytes after the last tensor are not covered",
     lambda: st(_OK, bytes(20))),
    ("data_truncated", "CorruptDataError", "lies outside the 12-byte buffer", lambda: st(_OK, bytes(12))),
]:
    add(f"{_ST}/{_p}.safetensors", _ST, _e, _frag, _fn)


# ----------------------------------------------------------------------------
# codebook sidecars


def u32s(*v: int) -> bytes:
    return struct.pack(f"<{len(v)}I", *v)


def bf16(*v: float) -> bytes:
    return b"".join(struct.pack("<f", x)[2:] for x in v)


_B4 = bf16(-1.0, -0.25, 0.25, 1.0) * 2  # one expert: two increasing 4-level books
_B8 = bf16(-1, -0.5, -0.25, -0.125, 0.125, 0.25, 0.5, 1) * 2


def gumix(entries: bytes, n: int = 1, magic: bytes = b"GUMIXs1\x00") -> bytes:
    return magic + u32s(n, 0) + entries


def gu_entry(layer=0, surface=0, E=1, out=4, in_=128, C=2, K=4, modes=b"\x01", books=_B4) -> bytes:
    return u32s(layer, surface, E, out, in_, C, K) + modes + books


def p4mix(entries: bytes, n: int = 1, magic: bytes = b"P4MIXv1\x00") -> bytes:
    return magic + u32s(n, 0) + entries


def p4_entry(layer=0, E=1, out=4, in_=32, C=2, K=8, modes=b"\x01", rot=b"\x00", books=_B8) -> bytes:
    return u32s(layer, E, out, in_, C, K) + modes + rot + books


def dmix(entries: bytes, n: int = 1) -> bytes:
    return b"DMIXs1\x00\x00" + u32s(n, 0) + entries


def dm_entry(layer=0, cls=0, qtype=106, nslices=1, C=2, K=4, mode=1, books=_B4) -> bytes:
    return u32s(layer, cls, qtype, nslices, C, K) + bytes([mode, 0, 0, 0]) + books


def table(entries: bytes, n: int = 1, version: int = 1, flags: int = 0, crc: "int | None" = None,
          tail: bytes = b"") -> bytes:
    body = b"DS4QCBT\x00" + u32s(version, n, flags) + entries
    return body + u32s(zlib.crc32(body) if crc is None else crc) + tail


def tb_entry(name: bytes = b"blk.0.ffn_gate_exps.weight", qtype: bytes = b"rocmfp2_mix", L: int = 4,
             has_ids: int = 0, reserved: int = 0, E: int = 1, n_global: int = 1, ids: bytes = b"",
             modes: bytes = b"\x01", books: bytes = _B4) -> bytes:
    return (struct.pack("<H", len(name)) + name + bytes([len(qtype)]) + qtype + bytes([L, has_ids, reserved])
            + u32s(E, n_global) + ids + modes + books)


_SC = "sidecar"
for _p, _r, _e, _frag, _fn in [
    ("gumix_empty.bin", "gumix", "CorruptDataError", "magic needs 8 bytes", lambda: b""),
    ("gumix_bad_magic.bin", "gumix", "CorruptDataError", "bad magic", lambda: gumix(gu_entry(), magic=b"GUMIXs2\x00")),
    ("gumix_fused_v1.bin", "gumix", "CorruptDataError", "fused GUMIXv1 blobs are not supported",
     lambda: gumix(gu_entry(), magic=b"GUMIXv1\x00")),
    ("gumix_header_cut.bin", "gumix", "CorruptDataError", "n_entries needs 4 bytes", lambda: b"GUMIXs1\x00\x01\x00"),
    ("gumix_count_huge.bin", "gumix", "CorruptDataError", "n_entries = 4294967295 needs",
     lambda: gumix(gu_entry(), n=2**32 - 1)),
    ("gumix_c_k_wrong.bin", "gumix", "CorruptDataError", "GUMIXs1 needs C = 2, K = 4",
     lambda: gumix(gu_entry(K=8, books=_B8))),
    ("gumix_e_zero.bin", "gumix", "CorruptDataError", "E = 0 outside 1..65536",
     lambda: gumix(gu_entry(E=0) + bytes(64))),
    ("gumix_e_huge.bin", "gumix", "CorruptDataError", "E = 4294967295 outside", lambda: gumix(gu_entry(E=2**32 - 1))),
    ("gumix_out_zero.bin", "gumix", "CorruptDataError", "out = 0", lambda: gumix(gu_entry(out=0))),
    ("gumix_in_not_128.bin", "gumix", "CorruptDataError", "in = 96 is not a multiple of 128",
     lambda: gumix(gu_entry(in_=96))),
    ("gumix_surface_3.bin", "gumix", "CorruptDataError", "surface must be 0 (gate), 1 (up) or 2 (down)",
     lambda: gumix(gu_entry(surface=3))),
    ("gumix_duplicate.bin", "gumix", "CorruptDataError", "(layer, surface) appears twice",
     lambda: gumix(gu_entry() * 2, n=2)),
    ("gumix_tables_cut.bin", "gumix", "CorruptDataError", "tables for 2 experts needs",
     lambda: gumix(gu_entry(E=2))),
    ("gumix_mode_2.bin", "gumix", "CorruptDataError", "has mode 2; modes are 0 or 1",
     lambda: gumix(gu_entry(modes=b"\x02"))),
    ("gumix_books_not_increasing.bin", "gumix", "CodebookError", "not finite and strictly increasing",
     lambda: gumix(gu_entry(books=bf16(-1.0, 0.25, -0.25, 1.0) * 2))),
    ("gumix_books_nan.bin", "gumix", "CodebookError", "not finite and strictly increasing",
     lambda: gumix(gu_entry(books=bf16(-1.0, float("nan"), 0.25, 1.0) * 2))),
    ("gumix_trailing.bin", "gumix", "CorruptDataError", "3 trailing bytes", lambda: gumix(gu_entry()) + b"xyz"),
    ("p4mix_bad_magic.bin", "p4mix", "CorruptDataError", "bad magic", lambda: p4mix(p4_entry(), magic=b"P4MIXv2\x00")),
    ("p4mix_count_huge.bin", "p4mix", "CorruptDataError", "n_entries = 65536 needs",
     lambda: p4mix(p4_entry(), n=65536)),
    ("p4mix_k_wrong.bin", "p4mix", "CorruptDataError", "P4MIXv1 needs C = 2, K = 8",
     lambda: p4mix(p4_entry(K=4))),
    ("p4mix_in_not_32.bin", "p4mix", "CorruptDataError", "in = 48 is not a multiple of 32",
     lambda: p4mix(p4_entry(in_=48))),
    ("p4mix_in_huge.bin", "p4mix", "CorruptDataError", "outside 1..1048576", lambda: p4mix(p4_entry(in_=2**21))),
    ("p4mix_rotation.bin", "p4mix", "CodebookError", "rotation not implemented",
     lambda: p4mix(p4_entry(rot=b"\x01"))),
    ("p4mix_duplicate_layer.bin", "p4mix", "CorruptDataError", "layer appears twice",
     lambda: p4mix(p4_entry() * 2, n=2)),
    ("p4mix_truncated.bin", "p4mix", "CorruptDataError", "truncated at offset 40: entry 0 (layer 0) tables for 2",
     lambda: p4mix(p4_entry(E=2))),
    ("p4mix_trailing.bin", "p4mix", "CorruptDataError", "1 trailing bytes", lambda: p4mix(p4_entry()) + b"\x00"),
    ("dmix_bad_magic.bin", "dmix", "CorruptDataError", "bad magic",
     lambda: b"DMIXs2\x00\x00" + u32s(1, 0) + dm_entry()),
    ("dmix_cls_5.bin", "dmix", "CorruptDataError", "cls must be < 5", lambda: dmix(dm_entry(cls=5))),
    ("dmix_qtype_104.bin", "dmix", "CorruptDataError", "qtype 104 is not 105 or 106",
     lambda: dmix(dm_entry(qtype=104))),
    ("dmix_k_mismatch.bin", "dmix", "CorruptDataError", "qtype 105 needs C = 2, K = 8",
     lambda: dmix(dm_entry(qtype=105))),
    ("dmix_nslices_0.bin", "dmix", "CorruptDataError", "nslices = 0 outside 1..4096",
     lambda: dmix(dm_entry(nslices=0))),
    ("dmix_mode_3.bin", "dmix", "CorruptDataError", "mode 3; modes are 0 or 1", lambda: dmix(dm_entry(mode=3))),
    ("dmix_duplicate.bin", "dmix", "CorruptDataError", "(layer, cls) appears twice", lambda: dmix(dm_entry() * 2, n=2)),
    ("dmix_trailing.bin", "dmix", "CorruptDataError", "2 trailing bytes", lambda: dmix(dm_entry()) + b"\x00\x00"),
    ("table_bad_magic.bin", "table", "CorruptDataError", "bad magic",
     lambda: b"DS4QCBX\x00" + table(tb_entry())[8:]),
    ("table_version_2.bin", "table", "CorruptDataError", "version 2 is not supported",
     lambda: table(tb_entry(), version=2)),
    ("table_flags_set.bin", "table", "CorruptDataError", "flags 0x00000001 set", lambda: table(tb_entry(), flags=1)),
    ("table_count_huge.bin", "table", "CorruptDataError", "n_entries = 4294967295 needs",
     lambda: table(tb_entry(), n=2**32 - 1)),
    ("table_name_len_0.bin", "table", "CorruptDataError", "name_len 0 outside 1..1024",
     lambda: table(tb_entry(name=b"") + bytes(40))),
    ("table_name_not_utf8.bin", "table", "CorruptDataError", "name is not UTF-8",
     lambda: table(tb_entry(name=b"b\xfe"))),
    ("table_names_duplicate.bin", "table", "CorruptDataError", "duplicate name", lambda: table(tb_entry() * 2, n=2)),
    ("table_names_unsorted.bin", "table", "CorruptDataError", "names are not in increasing order",
     lambda: table(tb_entry(name=b"b") + tb_entry(name=b"a"), n=2)),
    ("table_qtype_not_mix.bin", "table", "CorruptDataError", "qtype 'rocmfp3' is not a MIX qtype",
     lambda: table(tb_entry(qtype=b"rocmfp3"))),
    ("table_levels_wrong.bin", "table", "CorruptDataError", "L = 8 but rocmfp2_mix has 4 levels",
     lambda: table(tb_entry(L=8, books=_B8))),
    ("table_has_ids_2.bin", "table", "CorruptDataError", "has_ids = 2", lambda: table(tb_entry(has_ids=2))),
    ("table_global_below_e.bin", "table", "CorruptDataError", "n_global = 1 invalid for E = 2",
     lambda: table(tb_entry(E=2, n_global=1, has_ids=1, ids=u32s(0, 1), modes=b"\x01\x01", books=_B4 * 2))),
    ("table_ids_not_increasing.bin", "table", "CorruptDataError", "expert ids must be strictly increasing",
     lambda: table(tb_entry(E=2, n_global=8, has_ids=1, ids=u32s(3, 3), modes=b"\x01\x01", books=_B4 * 2))),
    ("table_crc_mismatch.bin", "table", "IntegrityError", "crc32", lambda: table(tb_entry(), crc=0)),
    ("table_trailing.bin", "table", "CorruptDataError", "4 trailing bytes",
     lambda: table(tb_entry(), tail=b"\x00" * 4)),
    ("table_books_not_increasing.bin", "table", "CodebookError", "not finite and strictly increasing",
     lambda: table(tb_entry(books=bf16(1.0, 0.5, 0.25, 0.0) * 2))),
]:
    add(f"{_SC}/{_p}", _r, _e, _frag, _fn)


# ----------------------------------------------------------------------------
# manifest.json


def manifest_obj(**over) -> dict:
    obj = {"schema_version": 1, "tool": "ds4quant", "tool_version": "0.1.0",
           "command": ["ds4quant", "convert", "src", "out"], "source": {"fingerprint": "f" * 64},
           "recipe": {"name": "rocmfp2-strix"},
           "files": [{"name": "m.gguf", "bytes": 64, "sha256": "a" * 64}],
           "tensors": [{"name": "t", "qtype": "f32", "variant": "f32", "ggml_type": 0, "shape": [8],
                        "bytes": 32, "sha256": "b" * 64}]}
    obj.update(over)
    return obj


def mj(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def _t(**kw) -> dict:
    t = dict(manifest_obj()["tensors"][0])
    t.update(kw)
    return t


_MF = "manifest"
for _p, _e, _frag, _fn in [
    ("empty", "CorruptDataError", "not valid JSON", lambda: b""),
    ("bad_json", "CorruptDataError", "not valid JSON", lambda: mj(manifest_obj())[:-20]),
    ("not_utf8", "CorruptDataError", "not valid JSON", lambda: b'{"tool": "\xff"}'),
    ("nan_constant", "CorruptDataError", "NaN is not JSON",
     lambda: mj(manifest_obj()).replace(b'"bytes": 32', b'"bytes": NaN')),
    ("top_level_list", "CorruptDataError", "must be an object, got list", lambda: b"[]"),
    ("schema_version_2", "UnsupportedFormatError", "schema_version 2 is not supported",
     lambda: mj(manifest_obj(schema_version=2))),
    ("schema_version_string", "CorruptDataError", "schema_version: must be an integer",
     lambda: mj(manifest_obj(schema_version="1"))),
    ("missing_files", "CorruptDataError", "missing key(s) files",
     lambda: mj({k: v for k, v in manifest_obj().items() if k != "files"})),
    ("unknown_key", "CorruptDataError", "unknown key(s) extra", lambda: mj(manifest_obj(extra=1))),
    ("wrong_tool", "CorruptDataError", "must be 'ds4quant'", lambda: mj(manifest_obj(tool="other"))),
    ("duplicate_tensor", "CorruptDataError", "duplicate tensor 't'",
     lambda: mj(manifest_obj(tensors=[_t(), _t()]))),
    ("duplicate_file", "CorruptDataError", "duplicate file 'm.gguf'",
     lambda: mj(manifest_obj(files=manifest_obj()["files"] * 2))),
    ("sha_uppercase", "CorruptDataError", "must be 64 lowercase hex digits",
     lambda: mj(manifest_obj(tensors=[_t(sha256="B" * 64)]))),
    ("sha_short", "CorruptDataError", "must be 64 lowercase hex digits",
     lambda: mj(manifest_obj(tensors=[_t(sha256="b" * 63)]))),
    ("bytes_negative", "CorruptDataError", "must be an integer >= 0, got -1",
     lambda: mj(manifest_obj(tensors=[_t(bytes=-1)]))),
    ("bytes_bool", "CorruptDataError", "must be an integer >= 0, got True",
     lambda: mj(manifest_obj(tensors=[_t(bytes=True)]))),
    ("shape_zero_dim", "CorruptDataError", "must be an integer >= 1, got 0",
     lambda: mj(manifest_obj(tensors=[_t(shape=[8, 0])]))),
    ("shape_five_dims", "CorruptDataError", "must have 1..4 dims",
     lambda: mj(manifest_obj(tensors=[_t(shape=[1] * 5)]))),
    ("file_outside_folder", "CorruptDataError", "must be a relative path inside the artifact folder",
     lambda: mj(manifest_obj(files=[{"name": "../m.gguf", "bytes": 1, "sha256": "a" * 64}]))),
    ("file_absolute", "CorruptDataError", "must be a relative path inside the artifact folder",
     lambda: mj(manifest_obj(files=[{"name": "/etc/passwd", "bytes": 1, "sha256": "a" * 64}]))),
    ("errors_infinite", "CorruptDataError", "must be a finite number, got inf",
     lambda: mj(manifest_obj(tensors=[_t(errors={"sse": 1.0})])).replace(b'"sse": 1.0', b'"sse": 1e999')),
    ("command_not_strings", "CorruptDataError", "command[1]: must be a string",
     lambda: mj(manifest_obj(command=["ds4quant", 7]))),
]:
    add(f"{_MF}/{_p}.json", _MF, _e, _frag, _fn)


# ----------------------------------------------------------------------------
# SHA256SUMS

_SUMS = "sums"
for _p, _e, _frag, _fn in [
    ("empty", "CorruptDataError", "does not end with a newline", lambda: b""),
    ("no_final_newline", "CorruptDataError", "does not end with a newline", lambda: ("a" * 64 + "  x").encode()),
    ("one_space", "CorruptDataError", "line 1 is not a sha256", lambda: ("a" * 64 + " x\n").encode()),
    ("uppercase_hash", "CorruptDataError", "line 1 is not", lambda: ("A" * 64 + "  x\n").encode()),
    ("parent_path", "CorruptDataError", "is not a plain relative path", lambda: ("a" * 64 + "  ../x\n").encode()),
    ("absolute_path", "CorruptDataError", "is not a plain relative path", lambda: ("a" * 64 + "  /x\n").encode()),
    ("duplicate", "CorruptDataError", "line 2 lists 'x' again", lambda: ("a" * 64 + "  x\n").encode() * 2),
    ("not_utf8", "CorruptDataError", "is not UTF-8 text", lambda: b"\xff\n"),
    ("blank_line", "CorruptDataError", "line 2 is not", lambda: ("a" * 64 + "  x\n\n").encode()),
]:
    add(f"{_SUMS}/{_p}.SHA256SUMS", _SUMS, _e, _frag, _fn)


# ----------------------------------------------------------------------------
# imatrix

_IM = "imatrix"


def dat_entry(name: bytes, ncall: int, vals: list) -> bytes:
    return (struct.pack("<i", len(name)) + name + struct.pack("<ii", ncall, len(vals))
            + struct.pack(f"<{len(vals)}f", *vals))


for _p, _e, _frag, _fn in [
    ("empty.dat", "CorruptDataError", "empty file, not an imatrix", lambda: b""),
    ("count_huge.dat", "CorruptDataError", "entry count 2147483647 does not fit",
     lambda: struct.pack("<i", 2**31 - 1) + bytes(40)),
    ("count_negative.dat", "CorruptDataError", "entry count -1 does not fit",
     lambda: struct.pack("<i", -1) + bytes(40)),
    ("name_len_huge.dat", "CorruptDataError", "name length 1000000 is not within",
     lambda: struct.pack("<ii", 1, 1000000) + bytes(20)),
    ("value_count_past_end.dat", "CorruptDataError", "value count 100 does not fit",
     lambda: struct.pack("<i", 1) + struct.pack("<i", 1) + b"t" + struct.pack("<ii", 1, 100) + bytes(8)),
    ("duplicate_name.dat", "CorruptDataError", "duplicate tensor name",
     lambda: struct.pack("<i", 2) + dat_entry(b"t", 1, [1.0]) * 2),
    ("tail_garbage.dat", "CorruptDataError", "trailing garbage",
     lambda: struct.pack("<i", 1) + dat_entry(b"t", 1, [1.0]) + struct.pack("<ii", 1, 9) + b"ab"),
    ("gguf_not_imatrix.gguf", "CorruptDataError", "not 'imatrix'",
     lambda: _one(RawTensor("t.in_sum2", [8], F32, 0), [kv_str("general.type", "model")])),
    ("gguf_no_counts.gguf", "CorruptDataError", "has no matching 't.counts'",
     lambda: _one(RawTensor("t.in_sum2", [8], F32, 0), [kv_str("general.type", "imatrix")])),
    ("gguf_truncated.gguf", "CorruptDataError", "runs past the end",
     lambda: _one(RawTensor("t.in_sum2", [8], F32, 0), [kv_str("general.type", "imatrix")])[:-20]),
]:
    add(f"{_IM}/{_p}", _IM, _e, _frag, _fn)


# ----------------------------------------------------------------------------
# source folders (config.json + index + shards)


def _config(**over) -> bytes:
    cfg = json.loads(SAMPLE_CONFIG.read_text())
    cfg.update(over)
    return (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()


def sf(tensors: dict) -> bytes:
    """A valid safetensors file: name -> (dtype, shape, bytes), laid out in name order."""
    header, data, pos = {}, b"", 0
    for name in sorted(tensors):
        dt, shape, raw = tensors[name]
        header[name] = ent(dt, list(shape), pos, pos + len(raw))
        data += raw
        pos += len(raw)
    return st(header, data)


def index(weight_map: dict) -> bytes:
    return (json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n").encode()


_NORM = {"norm.weight": ("F32", [256], bytes(1024))}
_SRC = "source"
for _p, _e, _frag, _fn in [
    ("index_names_missing_shard", "CorruptDataError",
     "shard 'model-00002-of-00002.safetensors' (holding 'x.weight') does not exist",
     lambda: {"config.json": _config(), "model.safetensors.index.json": index(
         {"norm.weight": "model-00001-of-00002.safetensors", "x.weight": "model-00002-of-00002.safetensors"}),
         "model-00001-of-00002.safetensors": sf(_NORM)}),
    # problems are reported in name order: these names sort before the (missing) experts
    ("shape_disagrees_with_config", "ShapeError",
     "'hc_head_base': shape (3,) does not match config.json: expected (2,)",
     lambda: {"config.json": _config(), "model.safetensors": sf({"hc_head_base": ("F32", [3], bytes(12))})}),
    ("layer_shape_disagrees", "ShapeError", "shape (128,) does not match config.json: expected (256,) from hidden_size",
     lambda: {"config.json": _config(),
              "model.safetensors": sf({"layers.0.attn_norm.weight": ("F32", [128], bytes(512))})}),
    ("experts_missing", "ShapeError", "missing: config.json has n_routed_experts=16 (and 191 more problem(s))",
     lambda: {"config.json": _config(), "model.safetensors": sf(_NORM)}),
    ("index_lists_tensor_not_in_shard", "CorruptDataError",
     "index lists tensor 'x.weight' in 'a.safetensors', which does not hold it",
     lambda: {"config.json": _config(), "model.safetensors.index.json": index(
         {"norm.weight": "a.safetensors", "x.weight": "a.safetensors"}), "a.safetensors": sf(_NORM)}),
    ("shard_holds_unlisted_tensor", "CorruptDataError", "holds tensor 'y.weight' but the index does not list it",
     lambda: {"config.json": _config(), "model.safetensors.index.json": index({"norm.weight": "a.safetensors"}),
              "a.safetensors": sf({**_NORM, "y.weight": ("F32", [1], bytes(4))})}),
    ("shard_name_escapes_folder", "CorruptDataError", "shard name '../a.safetensors' is not a plain file name",
     lambda: {"config.json": _config(), "model.safetensors.index.json": index({"norm.weight": "../a.safetensors"})}),
    ("index_without_weight_map", "CorruptDataError", "index has no weight_map object",
     lambda: {"config.json": _config(), "model.safetensors.index.json": b'{"metadata": {}}\n'}),
    ("index_bad_json", "CorruptDataError", "model.safetensors.index.json is not valid JSON",
     lambda: {"config.json": _config(), "model.safetensors.index.json": b'{"weight_map": '}),
    ("config_bad_json", "CorruptDataError", "config.json is not valid JSON",
     lambda: {"config.json": _config()[:-30], "model.safetensors": sf(_NORM)}),
    ("config_missing_hidden_size", "BadInputError", "config has no 'hidden_size'",
     lambda: {"config.json": _config().replace(b'"hidden_size"', b'"hidden_sizes"'), "model.safetensors": sf(_NORM)}),
    ("config_wrong_model_type", "UnsupportedFormatError", "model_type 'llama' is not DeepSeek-V4",
     lambda: {"config.json": _config(model_type="llama"), "model.safetensors": sf(_NORM)}),
    ("no_weights", "BadInputError", "has neither model.safetensors.index.json nor model.safetensors",
     lambda: {"config.json": _config()}),
    ("scale_without_weight", "CorruptDataError", "scale tensor without its weight",
     lambda: {"config.json": _config(), "model.safetensors": sf({**_NORM, "x.scale": ("F8_E8M0", [1], b"\x7f")})}),
    ("f4_weight_without_scale", "CorruptDataError", "F4 weight without its .scale",
     lambda: {"config.json": _config(), "model.safetensors": sf({**_NORM, "x.weight": ("F4", [2], b"\x00")})}),
    ("fp4_scale_shape_wrong", "ShapeError", "needs scale (4, 2)",
     lambda: {"config.json": _config(), "model.safetensors": sf({**_NORM, "x.weight": ("I8", [4, 32], bytes(128)),
                                                                 "x.scale": ("F8_E8M0", [4, 1], bytes(4))})}),
    ("shard_truncated", "CorruptDataError", "lies outside the",
     lambda: {"config.json": _config(), "model.safetensors": sf(_NORM)[:-8]}),
]:
    add(f"{_SRC}/{_p}", _SRC, _e, _frag, _fn)


# ----------------------------------------------------------------------------


def write_corpus(root: Path) -> dict:
    expected = {}
    for path, reader, error, fragment, fn in CASES:
        if path in expected:
            raise SystemExit(f"duplicate corpus path {path}")
        content = fn()
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, dict):
            target.mkdir()
            for name, data in sorted(content.items()):
                (target / name).write_bytes(data)
        else:
            target.write_bytes(content)
        expected[path] = {"reader": reader, "error": error, "message": fragment}
    (root / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    return expected


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="rebuild in a temp folder and compare with the committed corpus")
    args = ap.parse_args(argv)
    kinds = sorted({p.split("/")[0] for p, *_ in CASES})
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            write_corpus(Path(tmp))
            bad = _compare(Path(tmp), HERE, kinds)
        print("corpus matches" if not bad else "corpus differs: " + ", ".join(bad[:10]))
        return 1 if bad else 0
    for k in kinds:
        shutil.rmtree(HERE / k, ignore_errors=True)
    exp = write_corpus(HERE)
    print(f"wrote {len(exp)} cases under {HERE}")
    return 0


def _compare(a: Path, b: Path, kinds: list) -> list:
    bad = []
    files = sorted(str(p.relative_to(a)) for k in kinds for p in (a / k).rglob("*") if p.is_file())
    for rel in ["expected.json"] + files:
        if not (b / rel).is_file() or not filecmp.cmp(a / rel, b / rel, shallow=False):
            bad.append(rel)
    extra = [str(p.relative_to(b)) for k in kinds for p in (b / k).rglob("*")
             if p.is_file() and not (a / p.relative_to(b)).is_file()]
    return bad + extra


if __name__ == "__main__":
    sys.exit(main())
