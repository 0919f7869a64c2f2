"""Per-tensor qtype tags: written for every tensor, checked against the id on load."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFValueType as VT

from ds4quant import formats
from ds4quant.artifact import GGUFWriter, read_gguf, read_gguf_set, tag_kvs, tensor_nbytes
from ds4quant.errors import BadInputError, CorruptDataError, UnsupportedFormatError
from tests.artifact.hostile import F32, RawTensor, kv_str, kv_str_array, kv_u32, untagged


def _write(path, tensors, tags=True):
    w = GGUFWriter(path, tags=tags)
    for name, q, shape in tensors:
        w.add_tensor(name, q, shape, bytes(tensor_nbytes(q, shape)))
    w.write()
    return path


def test_tag_kvs_layout():
    kvs = tag_kvs({"blk.0.ffn_down_exps.weight": "rocmfp3", "blk.0.ffn_up_exps.weight": "rocmfp2_affine",
                   "output_norm.weight": "f32"})
    assert list(kvs) == ["ds4quant.format_version", "ds4quant.qtype_variants", "ds4quant.qtype.blk.0.ffn_down_exps.weight",
                         "ds4quant.qtype.blk.0.ffn_up_exps.weight", "ds4quant.qtype.output_norm.weight"]
    assert kvs["ds4quant.format_version"].type == VT.UINT32 and kvs["ds4quant.format_version"].value == 1
    table = kvs["ds4quant.qtype_variants"]
    assert table.type == VT.ARRAY and table.sub_type == VT.STRING
    assert table.value == tuple(sorted(f"{q}={formats.get_qtype(q).variant}"
                                       for q in ("rocmfp3", "rocmfp2_affine", "f32")))
    assert kvs["ds4quant.qtype.blk.0.ffn_up_exps.weight"].value == "rocmfp2_affine"


@pytest.mark.parametrize("variant", ["rocmfp2", "rocmfp2_affine", "rocmfp2_s40"])
def test_tagged_107_needs_no_variant(tmp_path, variant):
    p = _write(tmp_path / "t.gguf", [("w", variant, (64, 2))])
    info = read_gguf(p).tensors["w"]
    assert (info.qtype, info.ggml_type, info.qtype_source) == (variant, 107, "tag")


def test_untagged_107_is_refused_unless_named(tmp_path):
    p = _write(tmp_path / "u.gguf", [("blk.0.ffn_gate_exps.weight", "rocmfp2_affine", (64, 2))], tags=False)
    with pytest.raises(UnsupportedFormatError, match="ggml type 107 and no tag") as e:
        read_gguf(p)
    assert "variant_107" in str(e.value) and "blk.0.ffn_gate_exps.weight" in str(e.value)
    with pytest.raises(UnsupportedFormatError):
        read_gguf_set(p)
    for v in ("rocmfp2", "rocmfp2_affine", "rocmfp2_s40"):
        g = read_gguf(p, variant_107=v)
        info = g.tensors["blk.0.ffn_gate_exps.weight"]
        assert (info.qtype, info.qtype_source) == (v, "variant_107")
        assert any("untagged type 107" in n for n in g.notes)
    with pytest.raises(BadInputError, match="variant_107 must be one of"):
        read_gguf(p, variant_107="fp2")


def test_variant_107_contradicting_a_tag_is_refused(tmp_path):
    p = _write(tmp_path / "t.gguf", [("w", "rocmfp2_affine", (64, 2))])
    assert read_gguf(p, variant_107="rocmfp2_affine").tensors["w"].qtype == "rocmfp2_affine"
    with pytest.raises(BadInputError, match="tagged 'rocmfp2_affine', but variant_107='rocmfp2'"):
        read_gguf(p, variant_107="rocmfp2")


@pytest.mark.parametrize("qtype,gid", [("rocmfp3_mix", 105), ("rocmfp2_mix", 106)])
def test_untagged_mix_resolves_with_a_codebook_note(tmp_path, qtype, gid):
    p = _write(tmp_path / "m.gguf", [("blk.3.ffn_down_exps.weight", qtype, (64, 4, 2))], tags=False)
    g = read_gguf(p)
    info = g.tensors["blk.3.ffn_down_exps.weight"]
    assert (info.qtype, info.ggml_type, info.needs_codebooks, info.qtype_source) == (qtype, gid, True, "ggml_type")
    assert len(g.notes) == 1 and "codebooks" in g.notes[0] and "blk.3.ffn_down_exps.weight" in g.notes[0]


@pytest.mark.parametrize("qtype,gid", [("rocmfp4", 100), ("rocmfp4_fast", 101), ("rocmfp6", 102),
                                       ("rocmfp8", 103), ("rocmfp3", 104)])
def test_untagged_100_to_104_resolve_uniquely(tmp_path, qtype, gid):
    p = _write(tmp_path / "u.gguf", [("w", qtype, (64, 3))], tags=False)
    g = read_gguf(p)
    assert g.tensors["w"].qtype == qtype and g.tensors["w"].ggml_type == gid and g.notes == ()
    assert g.format_version is None


def test_untagged_standard_types(tmp_path):
    p = _write(tmp_path / "s.gguf", [("a", "f32", (3,)), ("b", "q8_0", (64,)), ("c", "bf16", (2,)),
                                     ("d", "i32", (5,)), ("e", "q4_k", (256,))], tags=False)
    g = read_gguf(p)
    got = {n: (t.qtype, t.decodable) for n, t in g.tensors.items()}
    assert got == {"a": ("f32", True), "b": ("q8_0", True), "c": ("bf16", True), "d": ("i32", True),
                   "e": ("q4_k", False)}  # ds4quant has no q4_k codec: readable, not decodable
    assert g.tensors["e"].nbytes == 144


def _raw_tagged(tmp_path, ggml_type, tag, variant, dims=(64,)):
    r = untagged([RawTensor("t", list(dims), ggml_type, 0)],
                 [kv_u32("ds4quant.format_version", 1), kv_str_array("ds4quant.qtype_variants", [f"{tag}={variant}"]),
                  kv_str("ds4quant.qtype.t", tag)])
    p = tmp_path / "r.gguf"
    p.write_bytes(r.build())
    return p


def test_wrong_tag_for_the_id_is_refused(tmp_path):
    p = _raw_tagged(tmp_path, 104, "rocmfp2_affine", "fp2-affine")
    with pytest.raises(CorruptDataError, match=r"tagged 'rocmfp2_affine' \(ggml type 107\) but stored as ggml type 104"):
        read_gguf(p)
    p = _raw_tagged(tmp_path, F32, "f16", "f16")
    with pytest.raises(CorruptDataError, match="stored as ggml type 0"):
        read_gguf(p)


def test_unknown_tag_and_foreign_variant_are_unsupported(tmp_path):
    p = _raw_tagged(tmp_path, 107, "rocmfp2_turbo", "x")
    with pytest.raises(UnsupportedFormatError, match="'rocmfp2_turbo', which this build does not know"):
        read_gguf(p)
    p = _raw_tagged(tmp_path, 104, "rocmfp3", "fp3-v9")
    with pytest.raises(UnsupportedFormatError, match="variant 'fp3-v9', this build's is 'fp3'"):
        read_gguf(p)


def test_future_format_version_is_unsupported(tmp_path):
    r = untagged([RawTensor("t", [8], F32, 0)], [kv_u32("ds4quant.format_version", 2),
                                                 kv_str_array("ds4quant.qtype_variants", ["f32=f32"]),
                                                 kv_str("ds4quant.qtype.t", "f32")])
    p = tmp_path / "f.gguf"
    p.write_bytes(r.build())
    with pytest.raises(UnsupportedFormatError, match="format_version is 2"):
        read_gguf(p)


def test_every_written_tensor_is_tagged(tmp_path):
    p = _write(tmp_path / "a.gguf", [("a", "f32", (4,)), ("b", "rocmfp3", (32,)), ("c", "q8_0", (32,))])
    g = read_gguf(p)
    assert {k[len("ds4quant.qtype."):] for k in g.kv if k.startswith("ds4quant.qtype.")} == set(g.tensors)
    assert all(t.qtype_source == "tag" for t in g.tensors.values())
    assert np.all([t.decodable for t in g.tensors.values()])
