"""manifest.json: frozen records, canonical JSON, strict validation."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from ds4quant.artifact import (
    FileEntry,
    GGUFWriter,
    Manifest,
    TensorEntry,
    read_gguf_set,
    read_manifest,
    sha256_bytes,
    sha256_file,
    tensor_entries,
    write_manifest,
)
from ds4quant.errors import BadInputError, CorruptDataError, UnsupportedFormatError

SHA = "ab" * 32


def _manifest(**kw) -> Manifest:
    base = dict(
        tool_version="0.1.0",
        command=("ds4quant", "convert", "--recipe", "r.json"),
        source={"path": "/m/ds4", "config_sha256": SHA, "files": [{"name": "a.safetensors", "bytes": 10}]},
        recipe={"rules": [{"match": "ffn_down_exps", "qtype": "rocmfp3"}], "budget_bpw": 2.8},
        files=(FileEntry("m.gguf", 1234, SHA),),
        tensors=(TensorEntry("blk.0.ffn_down_exps.weight", "rocmfp3", "fp3", 104, (2048, 4096, 256), 10, SHA,
                             codebook=None, errors={"rmse": 0.125, "max_abs": 2}),
                 TensorEntry("blk.0.ffn_up_exps.weight", "rocmfp2_mix", "mix106-7s1c", 106, [4096, 2048, 256], 10,
                             SHA, codebook="gumix:blk.0.ffn_up_exps.weight")),
    )
    base.update(kw)
    return Manifest(**base)


def test_round_trip_and_canonical_bytes(tmp_path):
    m = _manifest()
    p = write_manifest(tmp_path / "manifest.json", m)
    m2 = read_manifest(p)
    assert m2 == m
    assert m2.tensors[1].shape == (4096, 2048, 256)  # lists become tuples
    assert m2.tensor("blk.0.ffn_up_exps.weight").codebook == "gumix:blk.0.ffn_up_exps.weight"
    first = p.read_bytes()
    write_manifest(tmp_path / "manifest.json", m2)
    assert p.read_bytes() == first  # same data, same bytes
    obj = json.loads(first)
    assert obj["schema_version"] == 1 and obj["tool"] == "ds4quant"
    assert "codebook" not in obj["tensors"][0] and "errors" not in obj["tensors"][1]


def test_records_are_frozen():
    m = _manifest()
    with pytest.raises(Exception):
        m.tool_version = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        m.recipe["budget_bpw"] = 3  # type: ignore[index]
    with pytest.raises(TypeError):
        m.tensors[0].errors["rmse"] = 1.0  # type: ignore[index]
    with pytest.raises(BadInputError):
        m.tensor("nope")


def _write_obj(tmp_path, mutate):
    obj = _manifest().to_json()
    mutate(obj)
    p = tmp_path / "m.json"
    p.write_text(json.dumps(obj))
    return p


@pytest.mark.parametrize("mutate,match", [
    (lambda o: o.update(schema_version="1"), "schema_version: must be an integer"),
    (lambda o: o.pop("recipe"), "missing key"),
    (lambda o: o.update(extra=1), "unknown key"),
    (lambda o: o.update(tool="other"), "tool: must be 'ds4quant'"),
    (lambda o: o.update(command="ds4quant convert"), "command: must be a list"),
    (lambda o: o.update(source=[]), "source: must be an object"),
    (lambda o: o["files"].append(dict(o["files"][0])), "duplicate file 'm.gguf'"),
    (lambda o: o["files"][0].update(name="../x"), "relative path"),
    (lambda o: o["files"][0].update(bytes=-1), "files\\[0\\].bytes: must be an integer >= 0"),
    (lambda o: o["files"][0].update(sha256="AB" * 32), "64 lowercase hex"),
    (lambda o: o["tensors"].append(dict(o["tensors"][0])), "duplicate tensor"),
    (lambda o: o["tensors"][0].update(shape=[0, 1]), "shape\\[0\\]"),
    (lambda o: o["tensors"][0].update(shape=[1] * 5), "1..4 dims"),
    (lambda o: o["tensors"][0].update(ggml_type=True), "ggml_type"),
    (lambda o: o["tensors"][0].update(errors={"rmse": "high"}), "errors.rmse"),
    (lambda o: o["tensors"][0].update(variant=""), "variant"),
    (lambda o: o["tensors"][0].pop("sha256"), "missing key"),
])
def test_invalid_manifests_refused(tmp_path, mutate, match):
    p = _write_obj(tmp_path, mutate)
    with pytest.raises(CorruptDataError, match=match) as e:
        read_manifest(p)
    assert str(p) in str(e.value)


def test_unknown_schema_version_unsupported(tmp_path):
    p = _write_obj(tmp_path, lambda o: o.update(schema_version=2))
    with pytest.raises(UnsupportedFormatError, match="schema_version 2"):
        read_manifest(p)


@pytest.mark.parametrize("text", [b"{", b"\xff\xfe", b'{"x": NaN}', b"[]"])
def test_not_json_or_not_an_object(tmp_path, text):
    p = tmp_path / "m.json"
    p.write_bytes(text)
    with pytest.raises(CorruptDataError):
        read_manifest(p)


def test_write_refuses_what_read_would_refuse(tmp_path):
    bad = _manifest(files=(FileEntry("m.gguf", 1, "nothex"),))
    with pytest.raises(CorruptDataError, match="64 lowercase hex"):
        write_manifest(tmp_path / "m.json", bad)
    with pytest.raises(BadInputError, match="JSON"):
        write_manifest(tmp_path / "m.json", _manifest(recipe={"x": float("inf")}))
    assert not (tmp_path / "m.json").exists()


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * 4096 + 5])
def test_sha256_file_streams(tmp_path, size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    p = tmp_path / "d.bin"
    p.write_bytes(data)
    assert sha256_file(p, chunk_bytes=4096) == hashlib.sha256(data).hexdigest()
    assert FileEntry.of(p) == FileEntry("d.bin", size, hashlib.sha256(data).hexdigest())


def test_tensor_entries_hash_payloads(tmp_path):
    w = GGUFWriter(tmp_path / "m.gguf", split_max_bytes=32)
    a = np.arange(16, dtype=np.uint8).repeat(2)
    w.add_tensor("a", "rocmfp3", (32, 2), a[:28])
    w.add_tensor("b", "f32", (3,), np.array([1, 2, 3], np.float32))
    w.write()
    s = read_gguf_set(tmp_path / "m-00001-of-00002.gguf")
    entries = tensor_entries(s, errors={"a": {"rmse": 0.5}})
    assert [e.name for e in entries] == ["a", "b"]
    assert entries[0].sha256 == hashlib.sha256(a[:28].tobytes()).hexdigest()
    assert entries[1].sha256 == sha256_bytes(np.array([1, 2, 3], np.float32))
    assert (entries[0].qtype, entries[0].variant, entries[0].ggml_type, entries[0].shape, entries[0].bytes) == \
        ("rocmfp3", "fp3", 104, (32, 2), 28)
    assert dict(entries[0].errors) == {"rmse": 0.5} and entries[1].errors is None
    m = _manifest(files=tuple(FileEntry.of(p) for p in s.files), tensors=entries)
    assert read_manifest(write_manifest(tmp_path / "manifest.json", m)) == m
