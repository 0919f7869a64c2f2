"""The validating safetensors reader: good files read exactly, hostile files are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ds4quant.errors import BadInputError, CorruptDataError
from ds4quant.sources.safetensors_file import SafetensorsFile
from tests.sources._util import SAMPLE, raw_header, write_raw, write_safetensors


def _good(tmp_path):
    p = tmp_path / "x.safetensors"
    a = np.arange(6, dtype="<f4").reshape(2, 3)
    b = np.array([[1, -2]], dtype=np.int8)
    write_safetensors(p, {
        "a": ("F32", (2, 3), a.tobytes()),
        "b": ("I8", (1, 2), b.tobytes()),
        "e": ("F32", (0, 4), b""),
        "f4": ("F4", (2, 4), bytes([0x21, 0x43, 0x65, 0x87])),
        "s": ("F8_E8M0", (3,), bytes([127, 128, 0])),
    }, metadata={"format": "pt"})
    return p, a, b


def test_reads_tensors_exactly_and_lazily(tmp_path):
    p, a, b = _good(tmp_path)
    with SafetensorsFile(p) as f:
        assert f.names() == ["a", "b", "e", "f4", "s"]
        assert f.metadata == {"format": "pt"}
        got = f.read("a")
        assert got.dtype == np.float32 and np.array_equal(got, a)
        assert not got.flags.writeable
        assert isinstance(got.base, np.ndarray)  # a view into the file map, not a copy
        assert np.array_equal(f.read("b"), b)
        assert f.read("e").shape == (0, 4)
        f4 = f.read("f4")
        assert f4.shape == (2, 2) and f4.dtype == np.uint8 and f4[0, 0] == 0x21
        assert f.read("s").tolist() == [127, 128, 0]
        with pytest.raises(BadInputError, match="no such tensor"):
            f.read("zzz")


def test_sample_shards_validate():
    for p in sorted(SAMPLE.glob("*.safetensors")):
        f = SafetensorsFile(p)
        assert len(f) > 100
        assert {f.entry(n).dtype for n in f.names()} <= {"F32", "BF16", "I8", "I64", "F8_E4M3", "F8_E8M0"}


def _hostile_cases():
    """(name, writer, message regex): one hand-built file per failure kind."""
    ok = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    data = bytes(8)
    return [
        ("short", lambda p: p.write_bytes(b"\x01\x00"), "too short"),
        ("header_past_end", lambda p: write_raw(p, {"a": ok}, data, length=10_000), "past the end"),
        ("not_utf8", lambda p: write_raw(p, b"{\xff\xfe}", b""), "not UTF-8"),
        ("not_json", lambda p: write_raw(p, b"{nope", b""), "not valid JSON"),
        ("not_object", lambda p: write_raw(p, b"[1, 2]", b""), "start with"),
        ("duplicate", lambda p: write_raw(
            p, b'{"a": ' + json.dumps(ok).encode() + b', "a": ' + json.dumps(ok).encode() + b"}", data), "twice"),
        ("unknown_dtype", lambda p: write_raw(p, {"a": {**ok, "dtype": "F7"}}, data), "unknown dtype"),
        ("extra_field", lambda p: write_raw(p, {"a": {**ok, "x": 1}}, data), "exactly dtype"),
        ("negative_dim", lambda p: write_raw(p, {"a": {**ok, "shape": [-2]}}, data), "non-negative"),
        ("float_dim", lambda p: write_raw(p, {"a": {**ok, "shape": [2.0]}}, data), "non-negative ints"),
        ("bool_offset", lambda p: write_raw(p, {"a": {**ok, "data_offsets": [False, 8]}}, data), "data_offsets"),
        ("reversed_offsets", lambda p: write_raw(p, {"a": {**ok, "data_offsets": [8, 0]}}, data), "begin <= end"),
        ("wrong_length", lambda p: write_raw(p, {"a": {**ok, "shape": [3]}}, data), "byte length 8 != 12"),
        ("huge_shape", lambda p: write_raw(p, {"a": {**ok, "shape": [2**40, 2**40]}}, data), "byte length"),
        ("outside", lambda p: write_raw(p, {"a": {**ok, "data_offsets": [8, 16]}}, data), "outside"),
        ("overlap", lambda p: write_raw(p, {"a": ok, "b": {**ok, "data_offsets": [4, 12]}}, bytes(12)), "overlaps"),
        ("hole", lambda p: write_raw(p, {"a": {**ok, "data_offsets": [4, 12]}}, bytes(12)), "hole of 4"),
        ("trailing", lambda p: write_raw(p, {"a": ok}, bytes(12)), "not covered"),
        ("odd_f4", lambda p: write_raw(p, {"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 1]}}, bytes(1)),
         "whole number of bytes"),
        ("bad_metadata", lambda p: write_raw(p, {"__metadata__": {"k": 1}, "a": ok}, data), "__metadata__"),
    ]


HOSTILE = {c[0]: c for c in _hostile_cases()}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_files_are_refused_naming_file_and_tensor(tmp_path, case):
    name, write, msg = HOSTILE[case]
    p = tmp_path / f"{name}.safetensors"
    write(p)
    with pytest.raises(CorruptDataError, match=msg) as ei:
        SafetensorsFile(p)
    text = str(ei.value)
    assert str(p) in text and "\n" not in text
    if name in ("unknown_dtype", "wrong_length", "outside", "overlap", "hole", "negative_dim"):
        assert "tensor 'a'" in text or "tensor 'b'" in text


def test_truncated_sample_shard_is_refused(tmp_path):
    src = sorted(SAMPLE.glob("*.safetensors"))[0]
    p = tmp_path / src.name
    p.write_bytes(src.read_bytes()[:-100])
    with pytest.raises(CorruptDataError, match="outside|not covered") as ei:
        SafetensorsFile(p)
    assert "tensor" in str(ei.value)


def test_header_hash_and_sizes(tmp_path):
    src = sorted(SAMPLE.glob("*.safetensors"))[0]
    f = SafetensorsFile(src)
    n, header = raw_header(src)
    assert f.data_start == 8 + n and f.file_size == src.stat().st_size
    assert len(f) == len([k for k in header if k != "__metadata__"])


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(BadInputError, match="not found"):
        SafetensorsFile(tmp_path / "nope.safetensors")
    with pytest.raises(BadInputError, match="directory"):
        SafetensorsFile(tmp_path)
