"""imatrix readers/writers: hand-built legacy .dat and GGUF files, round trips,
the mean E[x^2], and hostile files refused with one CorruptDataError."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest

from ds4quant.errors import BadInputError, CorruptDataError, Ds4quantError, ShapeError, UnsupportedFormatError
from ds4quant.calib.imatrix import (
    Imatrix,
    importance_for,
    make_imatrix,
    read_imatrix,
    write_imatrix_dat,
    write_imatrix_gguf,
)

EXPS = "blk.0.ffn_down_exps.weight"
DENSE = "blk.0.attn_q_a.weight"


# --------------------------------------------------------------------------
# hand-built files (independent of the module's writers)


def _dat_bytes(entries, tail=(3, "wiki.train.raw")):
    """entries: [(name, ncall, values)]; tail: None, (chunks,), (chunks, dataset)."""
    out = struct.pack("<i", len(entries))
    for name, ncall, vals in entries:
        raw = name.encode()
        vals = np.asarray(vals, "<f4")
        out += struct.pack("<i", len(raw)) + raw + struct.pack("<ii", ncall, vals.size) + vals.tobytes()
    if tail is not None:
        out += struct.pack("<i", tail[0])
        if len(tail) > 1:
            out += struct.pack("<i", len(tail[1].encode())) + tail[1].encode()
    return out


DAT_ENTRIES = [
    (DENSE, 4, np.array([4.0, 8.0, 0.0, 2.0] * 8, np.float32)),
    (EXPS, 2, np.arange(3 * 16, dtype=np.float32)),  # 3 experts x 16 columns, flat
]


def _gstr(s: str) -> bytes:
    return struct.pack("<Q", len(s.encode())) + s.encode()


def _gguf_bytes(kvs, tensors, *, version=3, alignment=32, n_tensors=None, n_kv=None, offsets=None):
    """Raw GGUF: kvs [(key, type, payload bytes)], tensors [(name, dims, type, data bytes)]."""
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    for key, vtype, payload in kvs:
        head += _gstr(key) + struct.pack("<I", vtype) + payload
    data, off = b"", 0
    for i, (name, dims, gtype, raw) in enumerate(tensors):
        o = off if offsets is None else offsets[i]
        head += _gstr(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        head += struct.pack("<IQ", gtype, o)
        pad = -len(raw) % alignment
        data += raw + b"\0" * pad
        off += len(raw) + pad
    head += b"\0" * (-len(head) % alignment)
    return head + data


def _kv_str(key, s):
    return (key, 8, _gstr(s))


def _kv_u32(key, v):
    return (key, 4, struct.pack("<I", v))


def _kv_strs(key, items):
    return (key, 9, struct.pack("<IQ", 8, len(items)) + b"".join(_gstr(s) for s in items))


SUMS = np.arange(3 * 16, dtype=np.float32).reshape(3, 16) * np.float32(0.5)
COUNTS = np.array([4.0, 0.0, 2.0], np.float32)
DENSE_SUMS = np.linspace(0, 3, 32).astype(np.float32)


def _std_kvs():
    return [
        _kv_str("general.type", "imatrix"),
        _kv_strs("imatrix.datasets", ["a.txt", "b.txt"]),
        _kv_u32("imatrix.chunk_count", 7),
        _kv_u32("imatrix.chunk_size", 512),
    ]


def _std_tensors():
    return [
        (DENSE + ".counts", [1], 0, np.array([6.0], "<f4").tobytes()),
        (DENSE + ".in_sum2", [32], 0, DENSE_SUMS.astype("<f4").tobytes()),
        (EXPS + ".counts", [1, 3], 0, COUNTS.astype("<f4").tobytes()),
        (EXPS + ".in_sum2", [16, 3], 0, SUMS.astype("<f4").tobytes()),
    ]


def _write(tmp_path: Path, name: str, data: bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _refused(path: Path, *needles: str, error=CorruptDataError) -> Ds4quantError:
    with pytest.raises(error) as ei:
        read_imatrix(path)
    msg = str(ei.value)
    assert "\n" not in msg and str(path) in msg
    for n in needles:
        assert n in msg, msg
    return ei.value


def _same(a: Imatrix, b: Imatrix) -> None:
    assert a.names == b.names
    assert (a.datasets, a.chunk_count) == (b.datasets, b.chunk_count)
    for n in a.names:
        ea, eb = a.entries[n], b.entries[n]
        assert ea.values.shape == eb.values.shape and ea.values.dtype == eb.values.dtype == np.float32
        assert np.array_equal(ea.values.view(np.uint32), eb.values.view(np.uint32))
        assert np.array_equal(ea.counts, eb.counts)


# --------------------------------------------------------------------------
# legacy imatrix.dat


def test_read_dat(tmp_path):
    p = _write(tmp_path, "imatrix.dat", _dat_bytes(DAT_ENTRIES))
    im = read_imatrix(p)
    assert (im.format, im.path, im.names) == ("dat", str(p), (DENSE, EXPS))
    assert (im.chunk_count, im.chunk_size, im.datasets) == (3, None, ("wiki.train.raw",))
    e = im.entries[EXPS]
    assert e.values.shape == (48,) and np.array_equal(e.counts, [2.0])
    assert not e.values.flags.writeable
    # legacy values are mean * ncall
    assert np.array_equal(importance_for(im, DENSE), np.array([1.0, 2.0, 0.0, 0.5] * 8, np.float32))
    assert np.array_equal(importance_for(im, EXPS, 2, cols=16), np.arange(32, 48, dtype=np.float32) / 2)
    assert importance_for(im, EXPS, cols=48).shape == (48,)


def test_dat_round_trip_is_byte_exact(tmp_path):
    raw = _dat_bytes(DAT_ENTRIES)
    im = read_imatrix(_write(tmp_path, "in.dat", raw))
    assert write_imatrix_dat(tmp_path / "out.dat", im) == ()
    assert (tmp_path / "out.dat").read_bytes() == raw
    # and through GGUF: same values, counts and means
    write_imatrix_gguf(tmp_path / "out.gguf", im)
    back = read_imatrix(tmp_path / "out.gguf")
    _same(im, back)
    assert back.format == "gguf"


@pytest.mark.parametrize("tail", [None, (5,), (0, "")])
def test_dat_older_tails(tmp_path, tail):
    im = read_imatrix(_write(tmp_path, "t.dat", _dat_bytes(DAT_ENTRIES, tail=tail)))
    assert im.chunk_count == (None if tail is None else tail[0])
    assert im.datasets == ()


def test_dat_every_truncation_refused(tmp_path):
    raw = _dat_bytes(DAT_ENTRIES)
    body = len(_dat_bytes(DAT_ENTRIES, tail=None))
    ok = {body, body + 4}  # the tail-less and chunk-only older forms
    for cut in range(len(raw)):
        p = _write(tmp_path, f"cut{cut}.dat", raw[:cut])
        if cut in ok:
            read_imatrix(p)
        else:
            _refused(p)


def _dat_with(**patch):
    """One-entry .dat with a field replaced by raw bytes."""
    name = patch.get("name", b"blk.1.attn_k.weight")
    parts = {
        "n": patch.get("n", struct.pack("<i", 1)),
        "len": patch.get("len", struct.pack("<i", len(name))),
        "name": name,
        "ncall": patch.get("ncall", struct.pack("<i", 2)),
        "nval": patch.get("nval", struct.pack("<i", 4)),
        "vals": patch.get("vals", np.ones(4, "<f4").tobytes()),
        "tail": patch.get("tail", struct.pack("<ii", 1, 0)),
    }
    return b"".join(parts.values())


@pytest.mark.parametrize(
    "patch, needle",
    [
        (dict(n=struct.pack("<i", 2**31 - 1)), "entry count"),
        (dict(n=struct.pack("<i", 0)), "entry count"),
        (dict(n=struct.pack("<i", -5)), "entry count"),
        (dict(len=struct.pack("<i", 2**31 - 1)), "name length"),
        (dict(len=struct.pack("<i", -1)), "name length"),
        (dict(len=struct.pack("<i", 0)), "name length"),
        (dict(nval=struct.pack("<i", 2**30)), "value count"),
        (dict(nval=struct.pack("<i", -4)), "value count"),
        (dict(nval=struct.pack("<i", 0)), "value count"),
        (dict(ncall=struct.pack("<i", -1)), "negative call count"),
        (dict(vals=np.array([1, np.nan, 1, 1], "<f4").tobytes()), "'blk.1.attn_k.weight'"),
        (dict(vals=np.array([1, 1, -2, 1], "<f4").tobytes()), "value 2"),
        (dict(vals=np.array([1, 1, 1, np.inf], "<f4").tobytes()), "value 3"),
        (dict(name=b"\xff\xfe bad"), "UTF-8"),
        (dict(tail=struct.pack("<ii", 1, 0) + b"junk"), "trailing garbage"),
        (dict(tail=struct.pack("<ii", 1, 10) + b"abc"), "dataset name length"),
        (dict(tail=struct.pack("<ii", -1, 0)), "negative chunk count"),
        (dict(tail=b"\x01\x00"), "chunk count"),
    ],
)
def test_dat_hostile(tmp_path, patch, needle):
    _refused(_write(tmp_path, "bad.dat", _dat_with(**patch)), needle)


def test_dat_duplicate_name(tmp_path):
    raw = _dat_bytes([DAT_ENTRIES[0], DAT_ENTRIES[0]])
    _refused(_write(tmp_path, "dup.dat", raw), "duplicate")


@pytest.mark.parametrize(
    "data",
    [b"", b"\x00", b"hello, this is a text file and not an imatrix\n", bytes(range(256)) * 4, b"GGML" + b"\0" * 60],
)
def test_not_an_imatrix(tmp_path, data):
    _refused(_write(tmp_path, "junk.bin", data))


def test_missing_file_is_bad_input(tmp_path):
    with pytest.raises(BadInputError, match="cannot open"):
        read_imatrix(tmp_path / "nope.dat")


# --------------------------------------------------------------------------
# GGUF imatrix


def _check_std(im: Imatrix) -> None:
    assert im.names == (DENSE, EXPS)
    assert (im.datasets, im.chunk_count, im.chunk_size) == (("a.txt", "b.txt"), 7, 512)
    e = im.entries[EXPS]
    assert e.values.shape == (3, 16) and e.n_mat == 3
    assert np.array_equal(e.values, SUMS) and np.array_equal(e.counts, COUNTS)
    assert im.entries[DENSE].values.shape == (32,)


def test_read_gguf_hand_built(tmp_path):
    im = read_imatrix(_write(tmp_path, "im.gguf", _gguf_bytes(_std_kvs(), _std_tensors())))
    assert im.format == "gguf"
    _check_std(im)


def test_read_gguf_written_by_gguf_py(tmp_path):
    gguf = pytest.importorskip("gguf")
    p = tmp_path / "by_gguf_py.gguf"
    w = gguf.GGUFWriter(str(p), arch="deepseek4")
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", ["a.txt", "b.txt"])
    w.add_uint32("imatrix.chunk_count", 7)
    w.add_uint32("imatrix.chunk_size", 512)
    w.add_tensor(DENSE + ".in_sum2", DENSE_SUMS)
    w.add_tensor(DENSE + ".counts", np.array([6.0], np.float32))
    w.add_tensor(EXPS + ".in_sum2", SUMS)
    w.add_tensor(EXPS + ".counts", COUNTS.reshape(3, 1))
    w.add_tensor(EXPS + ".in_sum", SUMS)  # optional first moment: ignored
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _check_std(read_imatrix(p))


def test_gguf_round_trip_and_gguf_py_reads_ours(tmp_path):
    gguf = pytest.importorskip("gguf")
    im = read_imatrix(_write(tmp_path, "in.gguf", _gguf_bytes(_std_kvs(), _std_tensors())))
    write_imatrix_gguf(tmp_path / "out.gguf", im)
    back = read_imatrix(tmp_path / "out.gguf")
    _same(im, back)
    assert back.chunk_size == 512
    r = gguf.GGUFReader(str(tmp_path / "out.gguf"))
    tensors = {t.name: t for t in r.tensors}
    assert list(tensors) == [DENSE + ".in_sum2", DENSE + ".counts", EXPS + ".in_sum2", EXPS + ".counts"]
    assert list(tensors[EXPS + ".in_sum2"].shape) == [16, 3]
    assert np.array_equal(np.asarray(tensors[EXPS + ".in_sum2"].data).reshape(3, 16), SUMS)
    assert np.array_equal(np.asarray(tensors[EXPS + ".counts"].data).reshape(-1), COUNTS)
    f = r.fields["general.type"]
    assert bytes(f.parts[f.data[0]]).decode() == "imatrix"


def test_gguf_to_dat_like_llama_imatrix(tmp_path):
    im = make_imatrix(
        {EXPS: (SUMS, COUNTS), DENSE: (DENSE_SUMS, 1030), "blk.9.unused.weight": (np.zeros(8), 0)},
        datasets=("a.txt", "b.txt"),
        chunk_count=7,
        chunk_size=512,
    )
    skipped = write_imatrix_dat(tmp_path / "conv.dat", im)
    assert skipped == ("blk.9.unused.weight",)
    dat = read_imatrix(tmp_path / "conv.dat")
    assert dat.names == (DENSE, EXPS) and dat.datasets == ("b.txt",) and dat.chunk_count == 7
    # ncall = ceil(max count / chunk size); the means survive (float32 rounding)
    assert np.array_equal(dat.entries[DENSE].counts, [3.0])
    assert np.allclose(importance_for(dat, DENSE), importance_for(im, DENSE), rtol=1e-6, atol=0)
    assert np.array_equal(dat.entries[EXPS].counts, [1.0])
    got = [importance_for(dat, EXPS, e, cols=16) for e in range(3)]
    assert np.allclose(got[0], SUMS[0] / 4) and np.allclose(got[2], SUMS[2] / 2)
    assert np.array_equal(got[1], np.ones(16, np.float32))  # llama.cpp's "no data" mean


def _gguf_variant(**kw):
    kvs = kw.pop("kvs", _std_kvs())
    tensors = kw.pop("tensors", _std_tensors())
    return _gguf_bytes(kvs, tensors, **kw)


def test_gguf_every_truncation_refused(tmp_path):
    raw = _gguf_variant()
    last = _std_tensors()[-1]
    data_end = len(raw) - (-len(last[3]) % 32)  # the final padding may be missing
    for cut in range(0, len(raw), 3):
        p = _write(tmp_path, f"cut{cut}.gguf", raw[:cut])
        if cut >= data_end:
            read_imatrix(p)
        else:
            _refused(p)


def _tensors_with(i, **changes):
    ts = [list(t) for t in _std_tensors()]
    for k, v in changes.items():
        ts[i][["name", "dims", "type", "raw"].index(k)] = v
    return [tuple(t) for t in ts]


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(version=7), "version 7"),
        (dict(n_tensors=2**63), "fit"),
        (dict(n_kv=2**40), "fit"),
        (dict(kvs=[("general.type", 8, struct.pack("<Q", 2**62) + b"imatrix")]), "string length"),
        (dict(kvs=[("imatrix.datasets", 9, struct.pack("<IQ", 8, 2**61))]), "imatrix.datasets"),
        (dict(kvs=[("general.x", 9, struct.pack("<IQ", 12, 2**61))]), "array of"),
        (dict(kvs=[("general.x", 77, b"")]), "unknown value type"),
        (dict(kvs=_std_kvs() + [_kv_u32("imatrix.chunk_size", 1)]), "duplicate"),
        (dict(kvs=[_kv_str("general.type", "model")]), "not an importance matrix"),
        (dict(kvs=[_kv_u32("general.alignment", 12)]), "alignment"),
        (dict(kvs=[_kv_str("imatrix.chunk_count", "7")]), "imatrix.chunk_count"),
        (dict(tensors=_tensors_with(3, dims=[2**62, 2**62])), EXPS + ".in_sum2"),
        (dict(tensors=_tensors_with(3, dims=[16, 0])), EXPS + ".in_sum2"),
        (dict(tensors=_tensors_with(3, dims=[16, 3, 1, 1, 1])), EXPS + ".in_sum2"),
        (dict(tensors=_tensors_with(3, type=1, raw=SUMS.astype("<f2").tobytes())), "must be F32"),
        (dict(tensors=_tensors_with(3, type=9999)), "unknown ggml type"),
        (dict(tensors=_tensors_with(3, raw=np.where(SUMS == 1, np.nan, SUMS).astype("<f4").tobytes())), EXPS),
        (dict(tensors=_tensors_with(3, raw=(-SUMS).astype("<f4").tobytes())), "value 1"),
        (dict(tensors=_tensors_with(2, raw=np.array([4, 0.5, 2], "<f4").tobytes())), "whole numbers"),
        (dict(tensors=_tensors_with(2, raw=np.array([4, np.nan, 2], "<f4").tobytes())), "count 1"),
        (dict(tensors=_tensors_with(2, dims=[3], raw=COUNTS.astype("<f4").tobytes())), "expected [1, 3]"),
        (dict(tensors=_tensors_with(2, dims=[1, 2], raw=COUNTS[:2].astype("<f4").tobytes())), "expected [1, 3]"),
        (dict(tensors=_std_tensors()[:3]), "no matching"),
        (dict(tensors=_std_tensors()[1:]), "no matching"),
        (dict(tensors=_tensors_with(1, name=EXPS + ".in_sum2")), "duplicate tensor"),
        (dict(tensors=[("output.weight", [32], 0, DENSE_SUMS.tobytes())]), "no '<name>.in_sum2'"),
        (dict(offsets=[0, 32, 64, 96]), "overlaps"),
        (dict(offsets=[0, 32, 192, 200]), "not a multiple"),
        (dict(offsets=[0, 32, 192, 2**60]), "past the end"),
    ],
)
def test_gguf_hostile(tmp_path, kw, needle):
    _refused(_write(tmp_path, "bad.gguf", _gguf_variant(**kw)), needle)


@pytest.mark.parametrize("version", [1, 3 << 24])
def test_gguf_unsupported_versions(tmp_path, version):
    _refused(_write(tmp_path, "v.gguf", _gguf_variant(version=version)), "not supported", error=UnsupportedFormatError)


def test_gguf_trailing_garbage(tmp_path):
    _refused(_write(tmp_path, "tail.gguf", _gguf_variant() + b"\0" * 32), "unexplained bytes")


def test_gguf_ignores_other_tensors_but_checks_them(tmp_path):
    extra = ("blk.0.something_new", [4], 0, np.ones(4, "<f4").tobytes())
    im = read_imatrix(_write(tmp_path, "x.gguf", _gguf_variant(tensors=_std_tensors() + [extra])))
    assert im.names == (DENSE, EXPS)
    bad = ("blk.0.something_new", [4], 0, np.ones(4, "<f4").tobytes())
    raw = _gguf_variant(tensors=_std_tensors() + [bad], offsets=[0, 32, 160, 192, 10**6])
    _refused(_write(tmp_path, "y.gguf", raw), "something_new")


# --------------------------------------------------------------------------
# the mean E[x^2]


def test_importance_for_gguf(tmp_path):
    im = read_imatrix(_write(tmp_path, "im.gguf", _gguf_variant()))
    assert np.array_equal(importance_for(im, EXPS, 0), SUMS[0] / np.float32(4))
    assert np.array_equal(importance_for(im, EXPS, 2, cols=16), SUMS[2] / np.float32(2))
    assert importance_for(im, EXPS, 1) is None  # expert never routed: weight-only error
    assert importance_for(im, "blk.7.not_there.weight") is None
    q = importance_for(im, DENSE, cols=32)
    assert q.dtype == np.float32 and np.array_equal(q, DENSE_SUMS / np.float32(6))
    with pytest.raises(BadInputError, match="pass expert"):
        importance_for(im, EXPS)
    with pytest.raises(ShapeError, match="out of range"):
        importance_for(im, EXPS, 3)
    with pytest.raises(ShapeError, match="columns"):
        importance_for(im, EXPS, 0, cols=32)
    with pytest.raises(BadInputError):
        importance_for(im, EXPS, -1)


def test_importance_for_legacy_stack_needs_cols(tmp_path):
    im = read_imatrix(_write(tmp_path, "im.dat", _dat_bytes(DAT_ENTRIES)))
    with pytest.raises(BadInputError, match="pass cols"):
        importance_for(im, EXPS, 1)
    with pytest.raises(ShapeError):
        importance_for(im, EXPS, 1, cols=10)
    with pytest.raises(ShapeError, match="out of range"):
        importance_for(im, EXPS, 3, cols=16)
    zero = read_imatrix(_write(tmp_path, "z.dat", _dat_bytes([(DENSE, 0, np.zeros(8))])))
    assert importance_for(zero, DENSE) is None  # ncall 0: no data


def test_importance_feeds_the_codecs(tmp_path):
    from ds4quant import formats

    im = read_imatrix(_write(tmp_path, "im.gguf", _gguf_variant()))
    q = importance_for(im, DENSE, cols=32)
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
    assert formats.encode("rocmfp2_affine", x, q).shape == (2, 10)


# --------------------------------------------------------------------------
# building and writing


def test_make_imatrix_validates():
    with pytest.raises(BadInputError, match="counts"):
        make_imatrix({EXPS: (SUMS, [1, 2])})
    with pytest.raises(BadInputError, match="finite"):
        make_imatrix({DENSE: (np.array([1.0, np.nan]), 1)})
    with pytest.raises(BadInputError, match="whole numbers"):
        make_imatrix({DENSE: (np.ones(4), 1.5)})
    with pytest.raises(BadInputError, match="chunk_size"):
        make_imatrix({DENSE: (np.ones(4), 1)}, chunk_size=-1)
    im = make_imatrix({DENSE: (np.ones((1, 4)), [2])})
    assert im.entries[DENSE].values.shape == (4,)
    with pytest.raises(TypeError):
        im.entries[DENSE] = None  # read-only mapping


def test_writes_are_atomic(tmp_path):
    im = make_imatrix({DENSE: (DENSE_SUMS, 6)})
    target = tmp_path / "im.gguf"
    target.write_bytes(b"old contents")
    write_imatrix_gguf(target, im)
    assert read_imatrix(target).names == (DENSE,)
    assert sorted(os.listdir(tmp_path)) == ["im.gguf"]  # no temp file left
    # a count float32 cannot hold: refused before anything is written
    bad = make_imatrix({DENSE: (DENSE_SUMS, 2**25 + 1)})
    with pytest.raises(BadInputError, match="float32"):
        write_imatrix_gguf(target, bad)
    assert read_imatrix(target).names == (DENSE,)
    with pytest.raises(BadInputError, match="does not exist"):
        write_imatrix_dat(tmp_path / "no_such_dir" / "x.dat", im)
    assert sorted(os.listdir(tmp_path)) == ["im.gguf"]


def test_write_dat_refuses_empty():
    im = make_imatrix({DENSE: (np.zeros(4), 0)})
    with pytest.raises(BadInputError, match="no entry with data"):
        write_imatrix_dat("/nonexistent/never-written.dat", im)
