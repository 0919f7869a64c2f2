"""Atomic writes: the old file or the complete new one, never a torn one."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest

from ds4quant.artifact import (
    GGUFWriter,
    atomic_write,
    atomic_write_bytes,
    atomic_write_json,
    publish_dir,
    read_gguf,
)
from ds4quant.errors import BadInputError


class Boom(Exception):
    pass


def test_write_then_replace(tmp_path):
    p = tmp_path / "f.bin"
    atomic_write_bytes(p, b"old")
    with atomic_write(p) as f:
        f.write(b"new ")
        f.write(memoryview(b"bytes"))
    assert p.read_bytes() == b"new bytes"
    assert os.listdir(tmp_path) == ["f.bin"]


def test_exception_mid_write_keeps_old_file_and_leaves_no_temp(tmp_path):
    p = tmp_path / "f.bin"
    atomic_write_bytes(p, b"old")
    with pytest.raises(Boom):
        with atomic_write(p) as f:
            f.write(b"x" * 100_000)
            raise Boom
    assert p.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f.bin"]


def test_exception_on_a_new_file_leaves_nothing(tmp_path):
    with pytest.raises(Boom):
        with atomic_write(tmp_path / "new.bin") as f:
            f.write(b"partial")
            raise Boom
    assert os.listdir(tmp_path) == []


def test_mode_follows_umask(tmp_path):
    old = os.umask(0o027)
    try:
        p = atomic_write_bytes(tmp_path / "m.bin", b"1")
    finally:
        os.umask(old)
    assert stat.S_IMODE(p.stat().st_mode) == 0o640


def test_missing_folder_and_folder_target_refused(tmp_path):
    with pytest.raises(BadInputError, match="does not exist"):
        atomic_write_bytes(tmp_path / "nope" / "f.bin", b"")
    (tmp_path / "d").mkdir()
    with pytest.raises(BadInputError, match="is a folder"):
        atomic_write_bytes(tmp_path / "d", b"")


def test_json_is_canonical_and_refuses_nan(tmp_path):
    p = atomic_write_json(tmp_path / "a.json", {"b": [1, 2], "a": "\u00fc"})
    assert p.read_bytes() == '{\n  "a": "\u00fc",\n  "b": [\n    1,\n    2\n  ]\n}\n'.encode()
    assert json.loads(p.read_text("utf-8")) == {"a": "\u00fc", "b": [1, 2]}
    with pytest.raises(BadInputError, match="JSON"):
        atomic_write_json(tmp_path / "n.json", {"x": float("nan")})
    assert not (tmp_path / "n.json").exists()


def test_gguf_writer_failure_mid_stream_keeps_old_artifact(tmp_path):
    path = tmp_path / "m.gguf"
    w = GGUFWriter(path)
    w.add_tensor("a", "f32", (4,), np.ones(4, np.float32))
    w.write()
    before = path.read_bytes()

    def exploding():
        yield np.zeros(2, np.float32)
        raise Boom("producer died")

    w = GGUFWriter(path)
    w.add_tensor("a", "f32", (4,), np.zeros(4, np.float32))
    w.add_tensor("b", "f32", (4,), exploding)
    with pytest.raises(Boom):
        w.write()
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["m.gguf"]
    assert read_gguf(path).tensors["a"].nbytes == 16


def test_split_set_failure_in_a_later_split_writes_no_split(tmp_path):
    w = GGUFWriter(tmp_path / "m.gguf", split_max_bytes=32)
    w.add_tensor("a", "f32", (8,), np.zeros(8, np.float32))
    w.add_tensor("b", "f32", (8,), np.zeros(8, np.float32))
    w.add_tensor("c", "f32", (8,), lambda: (_ for _ in ()).throw(Boom()))
    with pytest.raises(Boom):
        w.write()
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- folders


def test_publish_dir_new(tmp_path):
    out = tmp_path / "release"
    with publish_dir(out) as tmp:
        assert tmp.name == f"release.partial-{os.getpid()}"
        atomic_write_bytes(tmp / "a.bin", b"a")
        (tmp / "sub").mkdir()
        atomic_write_bytes(tmp / "sub" / "b.bin", b"b")
        assert not out.exists()
    assert (out / "a.bin").read_bytes() == b"a" and (out / "sub" / "b.bin").read_bytes() == b"b"
    assert sorted(os.listdir(tmp_path)) == ["release"]


def test_publish_dir_exception_leaves_old_folder(tmp_path):
    out = tmp_path / "release"
    out.mkdir()
    (out / "old.txt").write_text("keep")
    with pytest.raises(Boom):
        with publish_dir(out, overwrite=True) as tmp:
            atomic_write_bytes(tmp / "new.bin", b"n")
            raise Boom
    assert os.listdir(out) == ["old.txt"]
    assert sorted(os.listdir(tmp_path)) == ["release"]


def test_publish_dir_refuses_a_non_empty_folder(tmp_path):
    out = tmp_path / "release"
    out.mkdir()
    (out / "theirs.txt").write_text("x")
    with pytest.raises(BadInputError, match="not empty"):
        with publish_dir(out):
            pass  # pragma: no cover - refused before the block
    assert os.listdir(out) == ["theirs.txt"]


def test_publish_dir_rechecks_at_the_end(tmp_path):
    out = tmp_path / "release"
    with pytest.raises(BadInputError, match="not empty"):
        with publish_dir(out) as tmp:
            atomic_write_bytes(tmp / "a.bin", b"a")
            out.mkdir()
            (out / "raced.txt").write_text("x")  # someone else got there first
    assert os.listdir(out) == ["raced.txt"]
    assert sorted(os.listdir(tmp_path)) == ["release"]


def test_publish_dir_replaces_empty_and_overwrites_when_asked(tmp_path):
    out = tmp_path / "release"
    out.mkdir()
    with publish_dir(out) as tmp:
        atomic_write_bytes(tmp / "one.bin", b"1")
    assert os.listdir(out) == ["one.bin"]
    with publish_dir(out, overwrite=True) as tmp:
        atomic_write_bytes(tmp / "two.bin", b"2")
    assert os.listdir(out) == ["two.bin"]
    assert sorted(os.listdir(tmp_path)) == ["release"]


def test_publish_dir_refuses_a_file_target(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(BadInputError, match="not a folder"):
        with publish_dir(tmp_path / "f", overwrite=True):
            pass  # pragma: no cover
