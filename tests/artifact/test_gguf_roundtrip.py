"""GGUF writer -> reader round trips: ROCmFPX and standard types, KVs, splits."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
from gguf import GGUFValueType as VT

from ds4quant import formats
from ds4quant.artifact import GGUFWriter, read_gguf, read_gguf_set, tensor_nbytes
from ds4quant.artifact.gguf_writer import align_up
from ds4quant.errors import BadInputError, CorruptDataError, ShapeError, UnknownQTypeError

# Documented sizes (docs/formats.md, one section per qtype): ggml id -> bytes per 32 weights.
SPEC_BLOCK_BYTES = {100: 18, 101: 17, 102: 26, 103: 33, 104: 14, 105: 14, 106: 10, 107: 10}
ROCMFPX = [("rocmfp4", 100), ("rocmfp4_fast", 101), ("rocmfp6", 102), ("rocmfp8", 103), ("rocmfp3", 104),
           ("rocmfp3_mix", 105), ("rocmfp2_mix", 106), ("rocmfp2", 107), ("rocmfp2_affine", 107),
           ("rocmfp2_s40", 107)]


def _payload(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@pytest.mark.parametrize("qtype,ggml_id", ROCMFPX)
def test_rocmfpx_sizes_match_spec(qtype, ggml_id):
    shape = (96, 5, 3)
    assert tensor_nbytes(qtype, shape) == 96 * 5 * 3 // 32 * SPEC_BLOCK_BYTES[ggml_id]


def test_rocmfpx_round_trip_bytes_tags_and_layout(tmp_path):
    path = tmp_path / "m.gguf"
    w = GGUFWriter(path)
    w.add_string("general.architecture", "deepseek4")
    expected = {}
    for i, (q, gid) in enumerate(ROCMFPX):
        shape = (64, 3 + i, 2)  # [in, out, n_expert]; odd sizes so padding varies
        data = _payload(64 * (3 + i) * 2 // 32 * SPEC_BLOCK_BYTES[gid], i)
        name = f"blk.{i}.ffn_down_exps.weight"
        w.add_tensor(name, q, shape, data)
        expected[name] = (q, gid, shape, data)
    plan = w.plan()
    (written,) = w.write()
    assert written == path and path.stat().st_size == plan.total_bytes
    g = read_gguf(path)
    assert g.version == 3 and g.format_version == 1 and g.alignment == 32
    assert list(g.tensors) == list(expected)
    for name, (q, gid, shape, data) in expected.items():
        info = g.tensors[name]
        assert (info.qtype, info.ggml_type, info.shape, info.qtype_source) == (q, gid, shape, "tag")
        assert info.variant == formats.get_qtype(q).variant
        assert info.offset % 32 == 0 and info.nbytes == data.size
        view = g.tensor_data(name)
        assert isinstance(view, np.memmap) and not view.flags.writeable
        assert np.array_equal(view, data)
        assert info.needs_codebooks == (gid in (105, 106))
    assert g.notes == ()
    planned = {t.name: t for t in plan.files[0].tensors}
    for name, info in g.tensors.items():
        assert info.offset == plan.files[0].data_offset + planned[name].offset


def test_real_rocmfp3_encode_survives_the_container(tmp_path):
    rng = np.random.default_rng(7)
    w = rng.standard_normal((2 * 6, 128)).astype(np.float32)  # 2 experts x 6 rows x 128 inputs
    enc = formats.encode("rocmfp3", w, impl="ref")  # numpy reference: no JIT warm-up in this test
    path = tmp_path / "r.gguf"
    gw = GGUFWriter(path)
    gw.add_tensor("blk.0.ffn_up_exps.weight", "rocmfp3", (128, 6, 2), enc)
    gw.write()
    g = read_gguf(path)
    raw = np.asarray(g.tensor_data("blk.0.ffn_up_exps.weight"))
    assert raw.tobytes() == enc.tobytes()
    back = formats.decode(g.tensors["blk.0.ffn_up_exps.weight"].qtype, raw, 128, impl="ref")
    assert np.array_equal(back.view(np.uint32), formats.decode("rocmfp3", enc, 128, impl="ref").view(np.uint32))


def test_every_kv_type_round_trips(tmp_path):
    path = tmp_path / "kv.gguf"
    w = GGUFWriter(path)
    scalars = {VT.UINT8: 255, VT.INT8: -128, VT.UINT16: 65535, VT.INT16: -32768, VT.UINT32: 2**32 - 1,
               VT.INT32: -(2**31), VT.UINT64: 2**64 - 1, VT.INT64: -(2**63), VT.FLOAT32: 1.5,
               VT.FLOAT64: -2.25e300, VT.BOOL: True}
    for t, v in scalars.items():
        w.add_kv(f"s.{t.name}", v, t)
    w.add_string("s.str", "d\u00e9j\u00e0 \u2713 \x00 nul")
    w.add_string("s.empty", "")
    w.add_array("a.str", ["", "x", "\u00fc" * 3], VT.STRING)
    w.add_array("a.empty", [], VT.INT32)
    w.add_array("a.bool", [True, False, True], VT.BOOL)
    w.add_array("a.f32", np.array([1.0, -0.0, np.inf], np.float32), VT.FLOAT32)
    w.add_array("a.i64", [-(2**63), 0, 2**63 - 1], VT.INT64)
    blob = bytes(range(256)) * 3
    w.add_blob("deepseek4.p4mix.sidecar", blob)
    w.add_tensor("t", "f32", (8,), np.zeros(8, np.float32))
    w.write()
    g = read_gguf(path)
    for t, v in scalars.items():
        kv = g.kv[f"s.{t.name}"]
        assert kv.type == t and kv.value == v and type(kv.value) is type(v)
    assert g.kv_value("s.str") == "d\u00e9j\u00e0 \u2713 \x00 nul" and g.kv_value("s.empty") == ""
    assert g.kv_value("a.str") == ("", "x", "\u00fc\u00fc\u00fc")
    assert g.kv["a.empty"].sub_type == VT.INT32 and g.kv_value("a.empty").size == 0
    assert g.kv_value("a.bool").tolist() == [True, False, True]
    assert g.kv_value("a.f32").view(np.uint32).tolist() == np.array([1.0, -0.0, np.inf], np.float32).view(np.uint32).tolist()
    assert g.kv_value("a.i64").tolist() == [-(2**63), 0, 2**63 - 1]
    assert g.blob("deepseek4.p4mix.sidecar") == blob
    assert not g.kv_value("a.i64").flags.writeable
    assert list(g.kv)[:len(scalars)] == [f"s.{t.name}" for t in scalars]  # insertion order kept


@pytest.mark.parametrize("bad", [
    ("k", 256, VT.UINT8), ("k", -1, VT.UINT32), ("k", True, VT.INT32), ("k", 1.5, VT.INT32),
    ("k", 1e39, VT.FLOAT32), ("k", 1, VT.STRING), ("k", "\ud800", VT.STRING), ("k", 1, VT.BOOL),
])
def test_kv_values_are_checked(tmp_path, bad):
    w = GGUFWriter(tmp_path / "x.gguf")
    with pytest.raises(BadInputError):
        w.add_kv(*bad)


def test_writer_refuses_bad_input(tmp_path):
    w = GGUFWriter(tmp_path / "x.gguf")
    w.add_tensor("t", "f32", (4,), np.zeros(4, np.float32))
    with pytest.raises(BadInputError, match="added twice"):
        w.add_tensor("t", "f32", (4,), np.zeros(4, np.float32))
    with pytest.raises(ShapeError, match="multiple of"):
        w.add_tensor("u", "rocmfp3", (48, 2), bytes(42))
    with pytest.raises(ShapeError, match="1..4 dims"):
        w.add_tensor("u", "f32", (1, 1, 1, 1, 1), bytes(4))
    with pytest.raises(ShapeError, match=r"\[1, 2\^63\)"):
        w.add_tensor("u", "f32", (0,), b"")
    with pytest.raises(BadInputError, match="63 bytes"):
        w.add_tensor("n" * 64, "f32", (4,), bytes(16))
    with pytest.raises(UnknownQTypeError):
        w.add_tensor("u", "rocmfp9", (32,), bytes(10))
    for key in ("general.alignment", "split.count", "ds4quant.qtype.t", "ds4quant.format_version"):
        with pytest.raises(BadInputError, match="set by the writer"):
            w.add_uint32(key, 1)
    with pytest.raises(BadInputError, match="power of two"):
        GGUFWriter(tmp_path / "y.gguf", alignment=48)
    with pytest.raises(BadInputError, match=r"\.gguf"):
        GGUFWriter(tmp_path / "y.bin")


def test_payload_size_mismatch_writes_nothing(tmp_path):
    path = tmp_path / "x.gguf"
    w = GGUFWriter(path)
    w.add_tensor("t", "rocmfp3", (64,), bytes(27))
    with pytest.raises(ShapeError, match="27 bytes, rocmfp3 .* needs 28"):
        w.write()
    assert os.listdir(tmp_path) == []
    w = GGUFWriter(path)
    w.add_tensor("t", "f32", (4,), np.zeros(5, np.float32))
    with pytest.raises(ShapeError, match="longer than"):
        w.write()
    w = GGUFWriter(path)
    w.add_tensor("t", "f16", (4,), np.zeros(4, ">f2"))
    with pytest.raises(BadInputError, match="little-endian"):
        w.write()
    assert os.listdir(tmp_path) == []


def test_callbacks_stream_one_tensor_at_a_time(tmp_path):
    events = []

    def producer(i):
        def make():
            events.append(("start", i))
            for part in range(3):  # chunks, produced lazily
                events.append(("chunk", i, part))
                yield np.full(32, i * 10 + part, np.uint8)
            events.append(("end", i))
        return make

    w = GGUFWriter(tmp_path / "s.gguf")
    for i in range(3):
        w.add_tensor(f"t{i}", "i8", (96,), producer(i))
    w.plan()
    assert events == []  # nothing produced before write
    w.write()
    assert events == [e for i in range(3) for e in
                      [("start", i), ("chunk", i, 0), ("chunk", i, 1), ("chunk", i, 2), ("end", i)]]
    g = read_gguf(tmp_path / "s.gguf")
    assert g.tensors["t1"].qtype == "i8" and not g.tensors["t1"].decodable
    assert np.asarray(g.tensor_data("t2"))[64] == 22


def test_state_machine(tmp_path):
    w = GGUFWriter(tmp_path / "s.gguf")
    w.add_tensor("t", "f32", (4,), np.zeros(4, np.float32))
    w.plan()
    with pytest.raises(RuntimeError, match="planned"):
        w.add_string("k", "v")
    w.write()
    with pytest.raises(RuntimeError, match="written"):
        w.write()


def test_same_inputs_same_bytes_and_custom_alignment(tmp_path):
    def build(path):
        w = GGUFWriter(path, alignment=64)
        w.add_string("general.architecture", "deepseek4")
        w.add_tensor("a", "rocmfp2_affine", (32, 3), _payload(30, 1))
        w.add_tensor("b", "q8_0", (64,), _payload(68, 2))
        return w.write()[0]

    a, b = build(tmp_path / "a.gguf"), build(tmp_path / "b.gguf")
    assert a.read_bytes() == b.read_bytes()
    g = read_gguf(a)
    assert g.alignment == 64 and g.kv["general.alignment"].type == VT.UINT32
    assert all(t.offset % 64 == 0 for t in g.tensors.values())
    assert g.file_size == align_up(g.tensors["b"].offset + 68, 64)


def test_empty_file_without_tensors(tmp_path):
    w = GGUFWriter(tmp_path / "e.gguf")
    w.add_string("general.name", "nothing")
    w.write()
    g = read_gguf(tmp_path / "e.gguf")
    assert g.tensors == {} and g.kv_value("general.name") == "nothing" and g.file_size == g.data_offset


# ---------------------------------------------------------------- splits


def _split_set(tmp_path, max_bytes=300):
    w = GGUFWriter(tmp_path / "model.gguf", split_max_bytes=max_bytes)
    w.add_string("general.architecture", "deepseek4")
    w.add_uint32("deepseek4.block_count", 4)
    data = {}
    for i in range(4):
        q, shape = [("rocmfp3", (64, 4, 2)), ("f32", (20,)), ("rocmfp2_affine", (32, 10)), ("rocmfp2_mix", (64, 8))][i]
        n = tensor_nbytes(q, shape)
        data[f"blk.{i}.w"] = (q, shape, _payload(n, 10 + i))
        w.add_tensor(f"blk.{i}.w", q, shape, data[f"blk.{i}.w"][2])
    return w, data


def test_split_names_keys_and_merged_view(tmp_path):
    w, data = _split_set(tmp_path)
    plan = w.plan()
    paths = w.write()
    n = len(paths)
    assert n == 3  # 224 | 96 + 128 | 160 with a 300-byte budget
    assert [p.name for p in paths] == [f"model-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    assert paths == tuple(f.path for f in plan.files)
    for i, p in enumerate(paths):
        g = read_gguf(p)  # each split is valid on its own, with its own tags
        assert (g.split_no, g.split_count) == (i, n)
        assert g.kv["split.no"].type == VT.UINT16 and g.kv["split.tensors.count"].type == VT.INT32
        assert g.kv_value("split.tensors.count") == 4
        assert ("general.architecture" in g.kv) == (i == 0)  # user KVs live in the first split
        assert len(g.kv_value("ds4quant.qtype_variants")) == 4  # the full table everywhere
    for start in (paths[0], paths[1], paths[-1]):
        s = read_gguf_set(start)
        assert s.files == paths and list(s.tensors) == list(data)
        assert s.kv_value("general.architecture") == "deepseek4" and "split.no" not in s.kv
        for name, (q, shape, payload) in data.items():
            assert s.tensors[name].qtype == q and s.tensors[name].shape == shape
            assert np.array_equal(s.tensor_data(name), payload)
    assert s.total_bytes == sum(p.stat().st_size for p in paths)


def test_unsplit_set_is_one_file(tmp_path):
    w, data = _split_set(tmp_path, max_bytes=10**9)
    (p,) = w.write()
    assert p.name == "model.gguf"
    s = read_gguf_set(p)
    assert s.files == (p,) and "split.count" not in s.kv and list(s.tensors) == list(data)


def test_a_tensor_larger_than_the_budget_gets_its_own_split(tmp_path):
    w = GGUFWriter(tmp_path / "m.gguf", split_max_bytes=64)
    w.add_tensor("big", "f32", (100,), np.zeros(100, np.float32))
    w.add_tensor("small", "f32", (4,), np.zeros(4, np.float32))
    paths = w.write()
    assert [list(read_gguf(p).tensors) for p in paths] == [["big"], ["small"]]


def test_missing_split_refused(tmp_path):
    paths = _split_set(tmp_path)[0].write()
    paths[1].unlink()
    with pytest.raises(CorruptDataError, match="split 2 of 3 is missing"):
        read_gguf_set(paths[0])


def test_renamed_split_refused(tmp_path):
    paths = _split_set(tmp_path)[0].write()
    other = tmp_path / "renamed.gguf"
    paths[1].rename(other)
    with pytest.raises(CorruptDataError, match="name is not NAME-0000k-of-0000n"):
        read_gguf_set(other)
    paths[2].unlink()
    other.rename(paths[2])  # split 2's bytes under split 3's name
    with pytest.raises(CorruptDataError, match="name says split 3 of 3, keys say split.no = 1"):
        read_gguf_set(paths[2])


def test_inconsistent_kv_across_splits_refused(tmp_path):
    w = GGUFWriter(tmp_path / "m.gguf", split_max_bytes=32)
    w.add_tensor("a", "f32", (8,), np.zeros(8, np.float32))
    w.add_tensor("b", "f32", (8,), np.zeros(8, np.float32))
    paths = w.write()
    # rewrite split 2 with a different variants table entry set: same keys, other value
    w2 = GGUFWriter(tmp_path / "n.gguf", split_max_bytes=32)
    w2.add_tensor("a", "f32", (8,), np.zeros(8, np.float32))
    w2.add_tensor("b", "f16", (16,), np.zeros(16, np.float16))
    other = w2.write()
    other[1].replace(paths[1])
    with pytest.raises(CorruptDataError, match="ds4quant.qtype_variants' differs"):
        read_gguf_set(paths[0])


def _two_splits(path, names):
    w = GGUFWriter(path, split_max_bytes=32)
    for name in names:
        w.add_tensor(name, "f32", (8,), np.zeros(8, np.float32))
    return w.write()


def test_duplicate_tensor_across_splits_refused(tmp_path):
    paths = _two_splits(tmp_path / "m.gguf", ["a", "b"])
    other = _two_splits(tmp_path / "z.gguf", ["q", "a"])  # its split 2 holds another "a"
    other[1].replace(paths[1])
    with pytest.raises(CorruptDataError, match="tensor 'a' is also in m-00001-of-00002.gguf"):
        read_gguf_set(paths[0])


def _patch_tensor_count(path, value):
    raw = bytearray(path.read_bytes())
    at = raw.index(b"split.tensors.count") + len(b"split.tensors.count") + 4  # skip the type
    raw[at:at + 4] = struct.pack("<i", value)
    path.write_bytes(bytes(raw))


def test_split_tensor_count_must_match_the_set(tmp_path):
    paths = _two_splits(tmp_path / "m.gguf", ["a", "b"])
    _patch_tensor_count(paths[1], 3)
    with pytest.raises(CorruptDataError, match="'split.tensors.count' differs"):
        read_gguf_set(paths[0])
    _patch_tensor_count(paths[0], 3)
    with pytest.raises(CorruptDataError, match="split.tensors.count = 3 but the 2 splits hold 2"):
        read_gguf_set(paths[0])


def test_split_named_but_without_split_keys(tmp_path):
    w = GGUFWriter(tmp_path / "m.gguf")
    w.add_tensor("a", "f32", (8,), np.zeros(8, np.float32))
    (p,) = w.write()
    named = tmp_path / "m-00001-of-00002.gguf"
    p.rename(named)
    with pytest.raises(CorruptDataError, match="has no split keys"):
        read_gguf_set(named)
    one = tmp_path / "k-00001-of-00001.gguf"
    named.rename(one)
    assert list(read_gguf_set(one).tensors) == ["a"]


def test_file_changed_after_reading_is_refused(tmp_path):
    w = GGUFWriter(tmp_path / "m.gguf")
    w.add_tensor("a", "f32", (8,), np.zeros(8, np.float32))
    (p,) = w.write()
    g = read_gguf(p)
    with open(p, "ab") as f:
        f.write(b"\0" * 32)
    with pytest.raises(CorruptDataError, match="changed since it was read"):
        g.tensor_data("a")


def test_writer_hashes_each_file_while_streaming(tmp_path):
    """The sha256 the writer reports is the finished file's (convert's manifest uses it
    instead of reading the GGUF back)."""
    import hashlib

    from ds4quant.artifact import GGUFWriter

    w = GGUFWriter(tmp_path / "m.gguf", split_max_bytes=4096)
    for i in range(3):
        w.add_tensor(f"t{i}", "f32", (1024,), data=np.arange(1024, dtype=np.float32) * (i + 1))
    paths = w.write()
    assert len(paths) > 1 and set(w.sha256) == set(paths)
    for p in paths:
        assert w.sha256[p] == hashlib.sha256(p.read_bytes()).hexdigest()
