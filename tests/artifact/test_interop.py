"""Interop with gguf-py 0.19: each side reads what the other writes."""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGUFValueType as VT

from ds4quant.artifact import GGUFWriter, read_gguf, read_gguf_set


def _q8_0_rows(rows: int, cols: int, seed: int) -> np.ndarray:
    # Q8_0 block: f16 scale + 32 int8; any bytes are a valid payload
    return np.random.default_rng(seed).integers(0, 256, (rows, cols // 32 * 34), dtype=np.uint8)


def test_gguf_py_reads_our_standard_type_file(tmp_path):
    path = tmp_path / "ours.gguf"
    f32 = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    f16 = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float16)
    q8 = _q8_0_rows(2, 64, 2)
    w = GGUFWriter(path)
    w.add_string("general.architecture", "deepseek4")
    w.add_uint32("deepseek4.block_count", 43)
    w.add_float32("deepseek4.expert_weights_scale", 1.5)
    w.add_array("tokenizer.ggml.tokens", ["<s>", "a", "\u00fc"], VT.STRING)
    w.add_blob("deepseek4.p4mix.sidecar", b"P4MIXv1\0" + bytes(8))
    w.add_tensor("output_norm.weight", "f32", (8, 3), f32)  # GGUF order: ne[0] = 8
    w.add_tensor("blk.0.attn_norm.weight", "f16", (4, 5), f16)
    w.add_tensor("blk.0.ffn_gate_shexp.weight", "q8_0", (64, 2), q8)
    w.write()

    r = gguf.GGUFReader(path)
    assert r.fields["general.architecture"].contents() == "deepseek4"
    assert r.fields["deepseek4.block_count"].contents() == 43
    assert r.fields["deepseek4.expert_weights_scale"].contents() == 1.5
    assert r.fields["tokenizer.ggml.tokens"].contents() == ["<s>", "a", "\u00fc"]
    assert bytes(r.fields["deepseek4.p4mix.sidecar"].contents()) == b"P4MIXv1\0" + bytes(8)
    assert r.fields["ds4quant.qtype.blk.0.ffn_gate_shexp.weight"].contents() == "q8_0"
    ours = read_gguf(path)
    assert set(r.fields) == set(ours.kv) | {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    by_name = {t.name: t for t in r.tensors}
    for name, expect, ttype in [("output_norm.weight", f32, gguf.GGMLQuantizationType.F32),
                                ("blk.0.attn_norm.weight", f16, gguf.GGMLQuantizationType.F16),
                                ("blk.0.ffn_gate_shexp.weight", q8, gguf.GGMLQuantizationType.Q8_0)]:
        t = by_name[name]
        assert t.tensor_type == ttype
        assert list(t.shape) == list(ours.tensors[name].shape)
        assert t.data_offset == ours.tensors[name].offset
        assert np.asarray(t.data).tobytes() == expect.tobytes()


def test_we_read_a_gguf_py_file(tmp_path):
    path = tmp_path / "theirs.gguf"
    f32 = np.arange(24, dtype=np.float32).reshape(3, 8)
    f16 = np.linspace(-1, 1, 20).astype(np.float16).reshape(5, 4)
    q8 = _q8_0_rows(2, 64, 3)
    gw = gguf.GGUFWriter(path, "deepseek4")
    gw.add_uint32("deepseek4.block_count", 43)
    gw.add_int64("x.i64", -5)
    gw.add_bool("x.flag", True)
    gw.add_array("tokenizer.ggml.tokens", ["<s>", "b"])
    gw.add_array("tokenizer.ggml.scores", [0.5, -1.0])
    gw.add_tensor("output_norm.weight", f32)
    gw.add_tensor("blk.0.attn_norm.weight", f16)
    gw.add_tensor("blk.0.ffn_gate_shexp.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    gw.write_header_to_file()
    gw.write_kv_data_to_file()
    gw.write_tensors_to_file()
    gw.close()

    g = read_gguf(path)
    assert g.format_version is None  # a foreign file: resolved by id
    assert g.kv_value("general.architecture") == "deepseek4"
    assert g.kv["deepseek4.block_count"].type == VT.UINT32 and g.kv_value("deepseek4.block_count") == 43
    assert g.kv_value("x.i64") == -5 and g.kv_value("x.flag") is True
    assert g.kv_value("tokenizer.ggml.tokens") == ("<s>", "b")
    assert g.kv_value("tokenizer.ggml.scores").tolist() == [0.5, -1.0]
    t = g.tensors
    assert (t["output_norm.weight"].qtype, t["output_norm.weight"].shape) == ("f32", (8, 3))
    assert (t["blk.0.attn_norm.weight"].qtype, t["blk.0.attn_norm.weight"].shape) == ("f16", (4, 5))
    assert (t["blk.0.ffn_gate_shexp.weight"].qtype, t["blk.0.ffn_gate_shexp.weight"].shape) == ("q8_0", (64, 2))
    assert all(i.qtype_source == "ggml_type" for i in t.values())
    assert np.asarray(g.tensor_data("output_norm.weight")).tobytes() == f32.tobytes()
    assert np.asarray(g.tensor_data("blk.0.attn_norm.weight")).tobytes() == f16.tobytes()
    assert np.asarray(g.tensor_data("blk.0.ffn_gate_shexp.weight")).tobytes() == q8.tobytes()


def test_we_read_gguf_py_split_sets_and_empty_files(tmp_path):
    gw = gguf.GGUFWriter(tmp_path / "sp.gguf", "deepseek4", split_max_tensors=1)
    gw.add_tensor("a", np.arange(8, dtype=np.float32))
    gw.add_tensor("b", np.arange(3, dtype=np.float32))
    gw.write_header_to_file()
    gw.write_kv_data_to_file()
    gw.write_tensors_to_file()
    gw.close()
    s = read_gguf_set(tmp_path / "sp-00002-of-00002.gguf")
    assert [p.name for p in s.files] == ["sp-00001-of-00002.gguf", "sp-00002-of-00002.gguf"]
    assert list(s.tensors) == ["a", "b"] and s.kv_value("split.count") == 2
    assert np.asarray(s.tensor_data("b")).view(np.float32).tolist() == [0.0, 1.0, 2.0]

    gw = gguf.GGUFWriter(tmp_path / "empty.gguf", "deepseek4")
    gw.write_header_to_file()
    gw.write_kv_data_to_file()
    gw.write_tensors_to_file()
    gw.close()
    g = read_gguf(tmp_path / "empty.gguf")
    assert g.tensors == {} and g.file_size == g.data_offset
