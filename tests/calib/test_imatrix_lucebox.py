"""The Lucebox imatrix layout: written, read back in that layout, and taken by
``importance_for`` (what convert, adaptive and verify call) like the llama.cpp
files.

``_lucebox_load`` below is an independent restatement of the checks Lucebox's
``ds4_mix_converter`` makes when it loads and uses an imatrix (its
``load_imatrix`` + ``require_imatrix``): entry count 1..10^6, name length
1..4096, ``ncall > 0``, 1..2^24 values, every value finite and >= 0, no
duplicate, **no byte after the last entry**, and for each target tensor
exactly ``in`` values.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest

from ds4quant.errors import BadInputError, ShapeError
from ds4quant.calib.imatrix import (
    importance_for,
    make_imatrix,
    read_imatrix,
    write_imatrix_dat,
    write_imatrix_gguf,
    write_imatrix_lucebox,
)

F32 = np.float32
GATE = "blk.1.ffn_gate_exps.weight"
DOWN = "blk.1.ffn_down_exps.weight"
DENSE = "blk.1.attn_q_a.weight"
NEVER = "blk.2.ffn_up_exps.weight"
HIDDEN, FFN, N_EXP = 64, 32, 5
FFN_TINY = 128  # samples/ds4-tiny moe_intermediate_size


class LuceboxRefusal(Exception):
    pass


def _lucebox_load(raw: bytes) -> dict[str, tuple[int, np.ndarray]]:
    pos = 0

    def i32() -> int:
        nonlocal pos
        if pos + 4 > len(raw):
            raise LuceboxRefusal("truncated")
        (v,) = struct.unpack_from("<i", raw, pos)
        pos += 4
        return v

    count = i32()
    if not 0 < count <= 1_000_000:
        raise LuceboxRefusal("invalid imatrix entry count")
    out: dict[str, tuple[int, np.ndarray]] = {}
    for _ in range(count):
        n = i32()
        if not 0 < n <= 4096:
            raise LuceboxRefusal("invalid imatrix name length")
        name = raw[pos:pos + n].decode()
        pos += n
        calls, nval = i32(), i32()
        if calls <= 0 or not 0 < nval <= 1 << 24:
            raise LuceboxRefusal(f"invalid imatrix entry dimensions for {name}")
        if pos + 4 * nval > len(raw):
            raise LuceboxRefusal("truncated values")
        vals = np.frombuffer(raw, "<f4", nval, pos).astype(F32)
        pos += 4 * nval
        if not np.all(np.isfinite(vals) & (vals >= 0)):
            raise LuceboxRefusal(f"invalid imatrix value for {name}")
        if name in out:
            raise LuceboxRefusal(f"duplicate imatrix entry {name}")
        out[name] = (calls, vals)
    if pos != len(raw):
        raise LuceboxRefusal("trailing bytes in imatrix")
    return out


def _lucebox_require(entries, name: str, cols: int) -> np.ndarray:
    if name not in entries:
        raise LuceboxRefusal(f"imatrix is missing required entry {name}")
    vals = entries[name][1]
    if vals.size != cols:
        raise LuceboxRefusal(f"imatrix entry {name} has {vals.size} values, expected {cols}")
    return vals


def _calibration_like():
    """Per-expert sums as calibrate builds them: expert 3 never routed."""
    rng = np.random.default_rng(7)
    counts = np.array([11, 4, 9, 0, 2], np.float64)
    gate = (rng.random((N_EXP, HIDDEN)) * counts[:, None] * 3).astype(F32)
    down = (rng.random((N_EXP, FFN)) * counts[:, None]).astype(F32)
    dense = (rng.random(HIDDEN) * 40).astype(F32)
    return make_imatrix(
        {GATE: (gate, counts), DOWN: (down, counts), DENSE: (dense, [40]),
         NEVER: (np.zeros((N_EXP, HIDDEN), F32), np.zeros(N_EXP))},
        datasets=("tokens.txt",), chunk_count=3, chunk_size=16,
    )


def _pooled(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    return (values.astype(np.float64).sum(axis=0) / counts.sum()).astype(F32)


def test_lucebox_file_is_what_lucebox_loads(tmp_path):
    im = _calibration_like()
    p = tmp_path / "imatrix.lucebox.dat"
    skipped = write_imatrix_lucebox(p, im)
    assert skipped == (NEVER,)  # no token: Lucebox needs ncall > 0
    entries = _lucebox_load(p.read_bytes())
    assert sorted(entries) == sorted([GATE, DOWN, DENSE])
    g = _lucebox_require(entries, GATE, HIDDEN)
    d = _lucebox_require(entries, DOWN, FFN)
    q = _lucebox_require(entries, DENSE, HIDDEN)
    e = im.entries
    # the stored values are the mean E[x^2] (Lucebox uses them as stored), ncall 1
    assert all(entries[n][0] == 1 for n in entries)
    assert np.array_equal(g, _pooled(e[GATE].values, e[GATE].counts))
    assert np.array_equal(d, _pooled(e[DOWN].values, e[DOWN].counts))
    assert np.array_equal(q, (e[DENSE].values / F32(40)).astype(F32))


def test_llama_cpp_files_are_refused_by_lucebox_and_kept(tmp_path):
    """Today's file keeps its llama.cpp layout (tail, n_expert * cols) -- the
    two things Lucebox refuses -- and still reads as format 'dat'."""
    im = _calibration_like()
    p = tmp_path / "imatrix.dat"
    write_imatrix_dat(p, im)
    with pytest.raises(LuceboxRefusal, match="trailing bytes"):
        _lucebox_load(p.read_bytes())
    body = p.read_bytes()[:-(8 + len("tokens.txt"))]  # even without its tail
    with pytest.raises(LuceboxRefusal, match=f"has {N_EXP * HIDDEN} values, expected {HIDDEN}"):
        _lucebox_require(_lucebox_load(body), GATE, HIDDEN)
    back = read_imatrix(p)
    assert back.format == "dat" and back.chunk_count == 3
    assert back.entries[GATE].values.shape == (N_EXP * HIDDEN,)


def test_read_back_in_the_lucebox_layout(tmp_path):
    im = _calibration_like()
    p = tmp_path / "imatrix.lucebox.dat"
    write_imatrix_lucebox(p, im)
    back = read_imatrix(p)
    assert back.format == "lucebox"
    assert back.chunk_count is None and back.datasets == ()
    assert back.names == tuple(sorted([GATE, DOWN, DENSE]))
    assert back.entries[GATE].values.shape == (HIDDEN,)
    assert back.entries[DOWN].values.shape == (FFN,)
    assert back.entries[GATE].counts.tolist() == [1.0]


def test_importance_for_takes_both_layouts(tmp_path):
    """What convert / adaptive / verify call: every expert of a stack gets the
    one Lucebox vector; llama.cpp and GGUF files keep their per-expert vectors."""
    im = _calibration_like()
    luce, gguf, dat = tmp_path / "l.dat", tmp_path / "i.gguf", tmp_path / "i.dat"
    write_imatrix_lucebox(luce, im)
    write_imatrix_gguf(gguf, im)
    write_imatrix_dat(dat, im)
    L, G, D = read_imatrix(luce), read_imatrix(gguf), read_imatrix(dat)
    pooled = _pooled(im.entries[GATE].values, im.entries[GATE].counts)
    for e in range(N_EXP):
        assert np.array_equal(importance_for(L, GATE, e, cols=HIDDEN), pooled)
        want = importance_for(im, GATE, e, cols=HIDDEN)
        got_g = importance_for(G, GATE, e, cols=HIDDEN)
        got_d = importance_for(D, GATE, e, cols=HIDDEN)
        if want is None:  # expert 3 saw no token
            assert got_g is None and e == 3
            continue
        assert np.array_equal(got_g, want)
        assert np.allclose(got_d, want, rtol=1e-6)
    assert np.array_equal(importance_for(L, DENSE, None, cols=HIDDEN), (im.entries[DENSE].values / F32(40)))
    assert importance_for(L, NEVER, 0, cols=HIDDEN) is None  # absent: weight-only error
    with pytest.raises(ShapeError, match="whole number"):
        importance_for(L, GATE, 0, cols=HIDDEN * 2 + 32)


def test_a_legacy_flat_stack_is_split_with_cols(tmp_path):
    """A llama.cpp .dat stack (n_expert * cols, one ncall) becomes one vector,
    the mean of its experts' means, when cols is given; Lucebox then takes it."""
    im = _calibration_like()
    dat = tmp_path / "i.dat"
    write_imatrix_dat(dat, im)
    legacy = read_imatrix(dat)
    p = tmp_path / "l.dat"
    write_imatrix_lucebox(p, legacy, cols={GATE: HIDDEN, DOWN: FFN})
    entries = _lucebox_load(p.read_bytes())
    g = _lucebox_require(entries, GATE, HIDDEN)
    e = legacy.entries[GATE]
    want = (e.values.astype(np.float64) / e.counts[0]).reshape(N_EXP, HIDDEN).mean(axis=0).astype(F32)
    assert np.array_equal(g, want)


def test_nothing_to_write_is_refused(tmp_path):
    im = make_imatrix({NEVER: (np.zeros((2, HIDDEN), F32), np.zeros(2))})
    with pytest.raises(BadInputError, match="no entry with data"):
        write_imatrix_lucebox(tmp_path / "x.dat", im)
    assert not (tmp_path / "x.dat").exists()


def test_sample_calibration_converts_to_a_lucebox_file(tmp_path):
    """The sample's calibrate output, rewritten for Lucebox: every routed stack
    of the tiny model present with its input length."""
    im = read_imatrix("samples/ds4-tiny-calib/imatrix.gguf")
    p = tmp_path / "imatrix.lucebox.dat"
    write_imatrix_lucebox(p, im)
    entries = _lucebox_load(p.read_bytes())
    stacks = [n for n in im.names if "_exps." in n]
    assert stacks
    for n in stacks:
        e = im.entries[n]
        if e.counts.sum() == 0:
            assert n not in entries
            continue
        vals = _lucebox_require(entries, n, e.values.shape[-1])
        assert math.isclose(float(vals.sum()), float(e.values.sum() / e.counts.sum()), rel_tol=1e-4)


def test_convert_takes_the_lucebox_file(tmp_path):
    """convert --imatrix with the Lucebox layout: every expert is encoded with
    its stack's one shared vector."""
    from ds4quant import formats
    from ds4quant.artifact import read_gguf_set
    from ds4quant.convert import convert
    from ds4quant.sources.official import open_source

    lb = tmp_path / "imatrix.lucebox.dat"
    write_imatrix_lucebox(lb, read_imatrix("samples/ds4-tiny-calib/imatrix.gguf"))
    out = tmp_path / "out"
    convert("samples/ds4-tiny", out, "rocmfp3", threads=1, imatrix=lb)
    g = read_gguf_set(next(p for p in sorted(out.iterdir()) if p.suffix == ".gguf"))
    shared = read_imatrix(lb)
    src = open_source("samples/ds4-tiny")
    name = "blk.3.ffn_down_exps.weight"
    data = np.asarray(g.tensor_data(name)).reshape(16, -1)
    q = importance_for(shared, name, 0, cols=FFN_TINY)
    assert q is not None
    for e in (0, 9, 15):
        w = src.read_dequantized(f"layers.3.ffn.experts.{e}.w2.weight")
        assert np.array_equal(data[e], formats.encode("rocmfp3", w, q).reshape(-1))
