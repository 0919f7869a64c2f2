"""Malformed GGUF files: each refused with one CorruptDataError, fast, small."""

from __future__ import annotations

import tempfile
import time
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4quant.artifact import read_gguf, read_gguf_set
from ds4quant.errors import CorruptDataError, Ds4quantError, UnsupportedFormatError
from tests.artifact import hostile
from tests.artifact.hostile import (
    ARRAY,
    F32,
    HOSTILE_CASES,
    UINT8,
    RawTensor,
    base,
    kv_array,
    kv_str,
    kv_u32,
    truncations,
    u32,
    u64,
    untagged,
)

import ds4quant.formats  # noqa: E402,F401  (load the codec registry outside the measured reads)

TIME_LIMIT_S = 2.0
PEAK_LIMIT_BYTES = 8 << 20


def _refused(path: Path) -> CorruptDataError:
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(CorruptDataError) as info:
            read_gguf(path)
    finally:
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert elapsed < TIME_LIMIT_S, f"took {elapsed:.2f}s"
    assert peak < PEAK_LIMIT_BYTES, f"peak {peak} bytes"
    assert type(info.value) is CorruptDataError
    return info.value


def test_there_are_many_hostile_cases():
    assert len(HOSTILE_CASES) >= 40


@pytest.mark.parametrize("name", sorted(HOSTILE_CASES))
def test_hostile_case_refused(tmp_path, name):
    build, fragment = HOSTILE_CASES[name]
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(build())
    err = _refused(path)
    msg = str(err)
    assert fragment in msg
    assert str(path) in msg  # names the file
    assert "at byte" in msg  # and where in it
    assert "\n" not in msg


def test_base_file_is_valid(tmp_path):
    path = tmp_path / "base.gguf"
    path.write_bytes(base().build())
    g = read_gguf(path)
    assert list(g.tensors) == ["a.weight", "b.weight"]
    assert g.tensors["b.weight"].qtype == "rocmfp3"
    assert g.kv_value("tokenizer.ggml.tokens") == ("a", "bc", "\u00fc")
    assert g.blob("deepseek4.p4mix.sidecar") == b"P4MIX"
    assert g.kv_value("flag") is True


@pytest.mark.parametrize("name,data", truncations(), ids=[n for n, _ in truncations()])
def test_truncated_at_every_header_field(tmp_path, name, data):
    path = tmp_path / "t.gguf"
    path.write_bytes(data)
    msg = str(_refused(path))
    assert any(k in msg for k in ("end of the file", "file ends inside", "past the end", "cannot fit"))


def test_truncations_cover_every_field():
    names = {n.split("@")[0] for n, _ in truncations()}
    assert {"magic", "version", "n_tensors", "n_kv", "kv0.key_len", "kv0.key", "kv0.type", "kv0.value",
            "ti1.name_len", "ti1.name", "ti1.n_dims", "ti1.dims", "ti1.type", "ti1.offset", "data"} <= names


def test_nested_array_is_unsupported_not_corrupt(tmp_path):
    inner = u32(UINT8) + u64(1) + b"\x01"
    r = untagged([RawTensor("t", [32], F32, 0)], [kv_array("k", ARRAY, 1, inner)])
    path = tmp_path / "n.gguf"
    path.write_bytes(r.build())
    with pytest.raises(UnsupportedFormatError, match="nested array"):
        read_gguf(path)


@pytest.mark.parametrize("version,match", [(1, "version 1 is not supported"), (3 << 24, "big-endian")])
def test_old_and_big_endian_versions_are_unsupported(tmp_path, version, match):
    path = tmp_path / "v.gguf"
    r = base()
    r.version = version
    path.write_bytes(r.build())
    with pytest.raises(UnsupportedFormatError, match=match):
        read_gguf(path)


def test_version_2_is_read(tmp_path):
    path = tmp_path / "v2.gguf"
    r = base()
    r.version = 2
    path.write_bytes(r.build())
    assert read_gguf(path).version == 2


def test_padding_after_last_tensor_is_optional(tmp_path):
    # 8 F32 = 32 bytes, alignment 32: the padded end equals the end; make an
    # odd-size tensor so the writer's padding can be present or absent.
    r = untagged([RawTensor("t", [3], F32, 0)])
    full = r.build()
    path = tmp_path / "p.gguf"
    path.write_bytes(full)
    g = read_gguf(path)
    end = g.tensors["t"].offset + 12
    path.write_bytes(full[:end])  # no padding after the last tensor
    assert read_gguf(path).tensors["t"].nbytes == 12
    path.write_bytes(full[:end - 1])
    _refused(path)


def test_zero_size_spans_may_not_share_an_offset():
    # dims >= 1 means a GGUF tensor is never empty; the span rule still
    # treats an empty span as occupying its first byte.
    from ds4quant.artifact.gguf_reader import _check_spans, _Cursor

    cur = _Cursor(b"", 0, "x.gguf")
    _check_spans(cur, [("a", 64, 0, 10), ("b", 96, 32, 20)])  # fine
    with pytest.raises(CorruptDataError, match="same offset"):
        _check_spans(cur, [("a", 64, 0, 10), ("b", 64, 0, 20)])
    with pytest.raises(CorruptDataError, match="same offset"):
        _check_spans(cur, [("a", 64, 0, 10), ("b", 64, 32, 20)])


def test_gaps_between_tensors_and_any_order_are_allowed(tmp_path):
    r = untagged([RawTensor("late", [8], F32, 128), RawTensor("early", [8], F32, 0)])
    path = tmp_path / "g.gguf"
    path.write_bytes(r.build())
    g = read_gguf(path)
    assert g.tensors["late"].offset - g.tensors["early"].offset == 128


# ---------------------------------------------------------------- fuzz

_BASE = base().build()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    edits=st.lists(st.tuples(st.integers(0, len(_BASE) - 1), st.integers(0, 255)), min_size=1, max_size=6),
    cut=st.one_of(st.none(), st.integers(0, len(_BASE))),
)
def test_fuzz_mutations_give_a_file_or_a_ds4quant_error(edits, cut):
    data = bytearray(_BASE)
    for pos, val in edits:
        data[pos] = val
    if cut is not None:
        data = data[:cut]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "f.gguf"
        path.write_bytes(bytes(data))
        try:
            g = read_gguf(path, variant_107="rocmfp2")
        except Ds4quantError:
            return
        # accepted: everything it claims must hold
        for info in g.tensors.values():
            assert info.offset % g.alignment == 0
            assert info.offset + info.nbytes <= g.file_size
            assert g.tensor_data(info.name).shape == (info.nbytes,)
        read_gguf_set(path, variant_107="rocmfp2")


def test_hostile_module_builds_valid_tags():
    # the tag builder the corpus reuses must agree with the reader
    r = untagged([RawTensor("t", [32], F32, 0)], hostile.ds4_tags({"t": "f32"}) + [kv_str("x", "y"), kv_u32("n", 1)])
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "ok.gguf"
        p.write_bytes(r.build())
        g = read_gguf(p)
        assert g.format_version == 1 and g.tensors["t"].qtype_source == "tag"
