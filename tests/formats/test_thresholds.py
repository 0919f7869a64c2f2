"""Elements exactly on every decision threshold and tie, at exact power-of-two scales.

For every scale codec (rocmfp2 with and without the fp2s option, rocmfp2_s40,
rocmfp3, rocmfp4, rocmfp4_fast, rocmfp6, rocmfp8, rocmfp2_affine, and the MIX
codecs' fixed-level mode 0 and codebook mode 1) and both encoders, a group's
scale is pinned to a chosen power of two ``S`` and the other elements sit at
``q * S`` for every threshold ``q`` between two levels, its float32 neighbours
and ``+-0``. Then:

* the reference and the fast encoder give the same bytes;
* every group got the pinned scale byte;
* every probe decodes to the level docs/formats.md's tie rule gives (its
  sections: FP2 ties to the lower code, FP3 and FP4 to the lower magnitude,
  FP6 and FP8 round half away, S40 ties inner with the sign of signbit,
  affine floor(t + 0.5) ties up, MIX mode 0 as FP2 / FP3, MIX mode 1's
  nearest level NL ties to the lower level).

The oracle below is exact rational arithmetic on the level sets (Fraction),
not the codecs' comparisons, so a flipped ``>`` / ``>=`` in either encoder
changes a probe's level and fails here.

Pinning: with an importance vector, the pin element (``top * S``) has weight
> 0 and every probe weight 0, so only the pin decides the scale: ``S`` gives
error 0, a smaller scale clips the pin, and a larger scale at best ties, which
goes to the smaller byte (docs/formats.md#scale-search). Without importance, the probes count, so each
group holds one probe and fifteen or more exact pins; the test checks the
search still lands on ``S`` before it checks any probe.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Optional

import numpy as np
import pytest

from ds4quant import formats
from ds4quant.formats.ue4m3 import UE4M3
from tests.golden import describe_mismatch

F32 = np.float32

# Exact powers of two as UE4M3 bytes (docs/formats.md#ue4m3 landmarks): 2^-10 (the smallest,
# subnormal), 2^-7 (first normal), 0.5, 1, 4 and 128.
SCALE_BYTES = (0x01, 0x08, 0x38, 0x40, 0x58, 0x78)


def _pow2(e: int) -> float:
    s = float(UE4M3[e])
    m, _ = np.frexp(s)
    assert m == 0.5, f"scale byte {e:#x} is {s}, not a power of two"
    return s


# --------------------------------------------------------------------------
# the documented tie rules (docs/formats.md), on exact rationals


def _nearest(levels, q: Fraction, tie: str) -> Fraction:
    """The level of ``levels`` nearest to q; a tie goes to ``tie``:
    'low' (smaller value), 'lowmag' / 'highmag' (smaller / larger magnitude)."""
    best = min(abs(q - v) for v in levels)
    near = [v for v in levels if abs(q - v) == best]
    if len(near) == 1:
        return near[0]
    if tie == "low":
        return min(near)
    if tie == "lowmag":
        return min(near, key=abs)
    if tie == "highmag":
        return max(near, key=abs)
    raise ValueError(tie)


def _signed_mag(mags, tie: str) -> Callable[[float], Fraction]:
    """Sign + magnitude formats: the magnitude of |q| by ``tie``, the sign of x
    (a zero magnitude is +0: "-0" codes decode as +0, docs/formats.md#rocmfp3, #rocmfp6, #rocmfp4)."""

    def level(q: float) -> Fraction:
        m = _nearest(mags, abs(Fraction(q)), tie)
        return -m if q < 0 else m

    return level


def _fp2_level(q: float) -> Fraction:  # docs/formats.md#rocmfp2: {-1, 0, 1, 2}, ties to the lower code
    return _nearest([Fraction(v) for v in (-1, 0, 1, 2)], Fraction(q), "low")


def _s40_level(q: float) -> Fraction:
    # fork quantiser: {1, 4} by |q| <= 2.5 (ties inner), sign by signbit
    m = _nearest([Fraction(1), Fraction(4)], abs(Fraction(q)), "lowmag")
    return -m if np.signbit(q) else m


_FP3_MAGS = [Fraction(v) for v in (0, 1, 2, 4)]
_FP4_MAGS = [Fraction(v) for v in (0, 1, 2, 3, 4, 6, 8, 10)]


def _thresholds(values) -> list[float]:
    """Midpoints between consecutive levels (all exact in float32)."""
    vs = sorted(set(values))
    return [float((Fraction(a) + Fraction(b)) / 2) for a, b in zip(vs, vs[1:])]


def _probes(ts, extra=()) -> list[float]:
    """Each threshold, its float32 neighbours and its negation, plus +-0."""
    out = {0.0}
    for t in list(ts) + list(extra):
        t32 = F32(t)
        for v in (t32, np.nextafter(t32, F32(np.inf)), np.nextafter(t32, F32(-np.inf))):
            out.add(float(v))
            out.add(-float(v))
    vals = sorted(out)
    return [-0.0] + vals  # -0.0 sorts equal to 0.0 in a set: add it explicitly


@dataclass(frozen=True)
class Case:
    qtype: str
    group: int  # weights per scale byte
    top: float  # largest positive level: the pin is top * S
    level: Callable[[float], Fraction]  # the documented level for q = x / S
    probes: tuple[float, ...]
    pins: tuple[float, ...]  # exact levels for the unweighted layout
    options: tuple = ()  # encode keywords
    books: Optional[np.ndarray] = None  # MIX: any valid books (mode 0 ignores them)
    modes: Optional[int] = None
    scale_bytes: tuple[int, ...] = SCALE_BYTES
    cols_multiple: int = 32


_BOOK4 = np.array([[-1.0, -0.25, 0.5, 1.0], [-1.0, 0.0, 0.5, 1.0]], np.float32)
_BOOK8 = np.array([[-1.0, -0.75, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0]] * 2, np.float32)

_MIX4 = [Fraction(float(v)) for v in _BOOK4[0]]
_MIX8 = [Fraction(float(v)) for v in _BOOK8[0]]

_FP2_PINS = (2.0, 1.0, -1.0, 2.0, 0.0, 2.0, 1.0, 2.0, -1.0, 2.0, 1.0, 2.0, -1.0, 2.0, 1.0)


CASES = {
    "rocmfp2": Case("rocmfp2", 16, 2.0, _fp2_level, tuple(_probes(_thresholds([-1, 0, 1, 2]), [2.5, -1.5])),
                    _FP2_PINS),
    "rocmfp2+fp2s": Case("rocmfp2", 16, 2.0, _fp2_level, tuple(_probes(_thresholds([-1, 0, 1, 2]), [2.5, -1.5])),
                         _FP2_PINS, options=(("fp2s", True),)),
    "rocmfp2_s40": Case("rocmfp2_s40", 16, 4.0, _s40_level, tuple(_probes([2.5], [5.0])),
                        (4.0, -4.0, 1.0, -1.0, 4.0, 1.0, -4.0, -1.0, 4.0, 4.0, -4.0, 1.0, -1.0, 4.0, -4.0)),
    "rocmfp3": Case("rocmfp3", 16, 4.0, _signed_mag(_FP3_MAGS, "lowmag"),
                    tuple(_probes(_thresholds([0, 1, 2, 4]), [5.0])),
                    (4.0, -4.0, 2.0, -1.0, 4.0, 1.0, -2.0, 4.0, -4.0, 2.0, 1.0, 4.0, -1.0, 4.0, -4.0)),
    "rocmfp4": Case("rocmfp4", 16, 10.0, _signed_mag(_FP4_MAGS, "lowmag"),
                    tuple(_probes(_thresholds([0, 1, 2, 3, 4, 6, 8, 10]), [11.0])),
                    (10.0, -10.0, 3.0, -1.0, 10.0, 6.0, -2.0, 10.0, -10.0, 1.0, 3.0, 10.0, -6.0, 10.0, -10.0)),
    "rocmfp4_fast": Case("rocmfp4_fast", 32, 10.0, _signed_mag(_FP4_MAGS, "lowmag"),
                         tuple(_probes(_thresholds([0, 1, 2, 3, 4, 6, 8, 10]), [11.0])),
                         (10.0, -10.0, 3.0, -1.0, 10.0, 6.0, -2.0, 10.0, -10.0, 1.0, 3.0, 10.0, -6.0, 10.0, -10.0) * 2
                         + (10.0,)),
    "rocmfp6": Case("rocmfp6", 16, 31.0, _signed_mag([Fraction(m) for m in range(32)], "highmag"),
                    tuple(_probes(_thresholds(range(32)), [31.75])),
                    (31.0, -31.0, 1.0, -3.0, 31.0, 7.0, -13.0, 31.0, -31.0, 29.0, 1.0, 31.0, -17.0, 31.0, -31.0)),
    "rocmfp8": Case("rocmfp8", 32, 127.0, _signed_mag([Fraction(m) for m in range(128)], "highmag"),
                    tuple(_probes(_thresholds(range(128)), [127.75])),
                    (127.0, -127.0, 1.0, -3.0, 127.0, 7.0, -13.0, 127.0, -127.0, 29.0, 1.0, 127.0, -17.0, 127.0,
                     -127.0) * 2 + (127.0,)),
    "rocmfp2_mix/mode0": Case("rocmfp2_mix", 16, 2.0, _fp2_level,
                              tuple(_probes(_thresholds([-1, 0, 1, 2]), [2.5, -1.5])), _FP2_PINS,
                              options=(("mode", 0),), books=_BOOK4, modes=0, cols_multiple=128),
    "rocmfp3_mix/mode0": Case("rocmfp3_mix", 16, 4.0, _signed_mag(_FP3_MAGS, "lowmag"),
                              tuple(_probes(_thresholds([0, 1, 2, 4]), [5.0])),
                              (4.0, -4.0, 2.0, -1.0, 4.0, 1.0, -2.0, 4.0, -4.0, 2.0, 1.0, 4.0, -1.0, 4.0, -4.0),
                              options=(("mode", 0),), books=_BOOK8, modes=0),
    # mode 1 (docs/formats.md#mix-encoder): NL's binary search sends a tie to the lower level; book 1
    # is book 0 halved, so it only ever ties book 0, and ties go to book 0. The
    # search window is centred on N(max|x| / 1) over the whole half, weights or
    # not, so no probe lies past the top level here.
    "rocmfp2_mix/mode1": Case("rocmfp2_mix", 16, 1.0, lambda q: _nearest(_MIX4, Fraction(q), "low"),
                              tuple(_probes(_thresholds(_MIX4))),
                              (1.0, -1.0, 0.5, -0.25, 1.0, 0.5, -1.0, 1.0, -0.25, 1.0, 0.5, -1.0, 1.0, -1.0, 0.5),
                              options=(("mode", 1),), books=np.stack([_BOOK4[0], _BOOK4[0] * F32(0.5)]), modes=1,
                              cols_multiple=128),
    "rocmfp3_mix/mode1": Case("rocmfp3_mix", 16, 1.0, lambda q: _nearest(_MIX8, Fraction(q), "low"),
                              tuple(_probes(_thresholds(_MIX8))),
                              (1.0, -1.0, 0.5, -0.25, 1.0, 0.75, -0.5, 1.0, -0.75, 0.25, 0.5, 1.0, -1.0, 1.0, -0.25),
                              options=(("mode", 1),), books=np.stack([_BOOK8[0], _BOOK8[0] * F32(0.5)]), modes=1),
}


# --------------------------------------------------------------------------
# building the blocks


def _pad_rows(groups: np.ndarray, weights: np.ndarray, group: int, multiple: int):
    """Lay groups (G, group) out as rows of ``multiple`` columns; pad with whole
    copies of the first group so every row is full (the copies are checked too)."""
    per_row = multiple // group
    G = groups.shape[0]
    extra = -G % per_row
    groups = np.concatenate([groups, np.repeat(groups[:1], extra, axis=0)])
    return groups.reshape(-1, multiple), weights.reshape(-1)[:multiple].copy()


def _pinned_layout(case: Case, s: float, pins=None):
    """Importance-pinned: the first positions of every group are the pins
    (weight 1; default ``top``), the others are probes (weight 0). Returns x,
    importance, q = x / S per element, probe mask."""
    pins = [case.top] if pins is None else list(pins)
    n = case.group - len(pins)
    probes = list(case.probes)
    probes += [probes[0]] * (-len(probes) % n)
    q = np.array(probes, np.float32).reshape(-1, n)
    groups = np.concatenate([np.tile(np.array(pins, np.float32), (q.shape[0], 1)), q], axis=1)
    mult = max(32, case.cols_multiple)
    qx, _ = _pad_rows(groups, np.zeros(mult, np.float32), case.group, mult)
    w = np.zeros(case.group, np.float32)
    w[:len(pins)] = 1.0
    imp = np.tile(w, mult // case.group)
    probe = np.broadcast_to(imp == 0, qx.shape).copy()
    return (qx * F32(s)).astype(np.float32), imp, qx, probe


def _unweighted_layout(case: Case, s: float):
    """One probe per group at a position that walks through the group; the
    other positions hold the exact pins."""
    pins = list(case.pins)
    assert len(pins) == case.group - 1 and max(pins) == case.top
    rows = []
    # probes past the top level would move the scale up; the pinned layout has them
    probes = [p for p in case.probes if abs(p) <= case.top]
    for i, p in enumerate(probes):
        pos = i % case.group
        rows.append(pins[:pos] + [p] + pins[pos:])
    groups = np.array(rows, np.float32)
    mult = max(32, case.cols_multiple)
    qx, _ = _pad_rows(groups, np.zeros(mult, np.float32), case.group, mult)
    probe = np.zeros_like(qx, bool)
    flat = probe.reshape(-1, case.group)
    for i in range(flat.shape[0]):
        pos = i % case.group if i < len(probes) else 0
        flat[i, pos] = True
    return (qx * F32(s)).astype(np.float32), None, qx, probe


# --------------------------------------------------------------------------
# checks


def _encode_both(case: Case, x, imp):
    kw = dict(case.options)
    ref = formats.encode(case.qtype, x, imp, case.books, impl="ref", **kw)
    fast = formats.encode(case.qtype, x, imp, case.books, impl="fast", **kw)
    return ref, fast


def _scale_bytes(case: Case, data: np.ndarray) -> np.ndarray:
    qt = formats.get_qtype(case.qtype)
    blk = data.reshape(-1, qt.block_bytes)
    n = 32 // case.group
    return blk[:, qt.block_bytes - n:].reshape(-1)


def _check(case: Case, x, imp, qx, probe, e_want: int, flipped: bool, label: str):
    ref, fast = _encode_both(case, x, imp)
    qt = formats.get_qtype(case.qtype)
    assert np.array_equal(ref, fast), f"{label}: reference and fast bytes differ\n" + describe_mismatch(
        ref, fast, qt.block_bytes)
    got_e = _scale_bytes(case, ref)
    want = e_want | (0x80 if flipped else 0)
    bad = np.nonzero(got_e != want)[0]
    assert bad.size == 0, (f"{label}: {bad.size} groups did not get scale byte {want:#04x}; "
                           f"group {bad[0]} got {got_e[bad[0]]:#04x}")
    y = formats.decode(case.qtype, ref, x.shape[1], case.books, case.modes, impl="ref")
    s = F32(UE4M3[e_want])
    errors = []
    for r, c in zip(*np.nonzero(probe)):
        q = float(qx[r, c])
        if flipped:  # fp2s: a mirrored half decodes -(V(code(-x)) * S)
            lv = -_fp2_level(-q)
            expect = F32(float(_fp2_level(-q))) * F32(-s)
        else:
            lv = case.level(q)
            expect = F32(float(lv)) * s
        if y[r, c].view(np.uint32) != F32(expect).view(np.uint32):
            errors.append(f"x = {q!r} * S decodes to {float(y[r, c]) / float(s)!r} * S, the tie rule gives {lv}")
    assert not errors, f"{label}: {len(errors)} probes off the documented level, e.g.\n  " + "\n  ".join(errors[:8])


@pytest.mark.parametrize("e", SCALE_BYTES, ids=lambda e: f"e{e:#04x}")
@pytest.mark.parametrize("name", list(CASES))
def test_thresholds_pinned_by_importance(name, e):
    case = CASES[name]
    s = _pow2(e)
    x, imp, qx, probe = _pinned_layout(case, s)
    _check(case, x, imp, qx, probe, e, False, f"{name} S={s} importance-pinned")


# S40 has no zero level: a probe on its 2.5 threshold costs (1.5 S)^2 and
# always pulls an unweighted search off S; MIX mode 1's books have no level
# pins of many scales can share. The pinned test covers both.
UNWEIGHTED = [n for n in CASES if n != "rocmfp2_s40" and not n.endswith("mode1")]


@pytest.mark.parametrize("e", SCALE_BYTES, ids=lambda e: f"e{e:#04x}")
@pytest.mark.parametrize("name", UNWEIGHTED)
def test_thresholds_unweighted(name, e):
    case = CASES[name]
    s = _pow2(e)
    x, imp, qx, probe = _unweighted_layout(case, s)
    _check(case, x, imp, qx, probe, e, False, f"{name} S={s} unweighted")


@pytest.mark.parametrize("e", SCALE_BYTES, ids=lambda e: f"e{e:#04x}")
def test_fp2s_mirrored_half_ties(e):
    """A half with pins -2S and +S fits only the mirrored levels {1, 0, -1, -2}:
    bit 7 set, and every probe decodes as the mirror of the tie rule applied
    to -x (ties to the upper value)."""
    case = CASES["rocmfp2+fp2s"]
    s = _pow2(e)
    x, imp, qx, probe = _pinned_layout(case, s, pins=(-2.0, 1.0))
    _check(case, x, imp, qx, probe, e, True, f"rocmfp2 fp2s S={s} mirrored")


# --------------------------------------------------------------------------
# rocmfp2_affine: (x + o) / s + 0.5, floored; ties (t an integer) go up


AFFINE_PAIRS = ((0x40, 0x38), (0x38, 0x38), (0x08, 0x01), (0x58, 0x40), (0x40, 0x00))


def _affine_probes(s: float, o: float) -> list[float]:
    """x on every decision point (x + o)/s = k + 0.5 for k = -1..3, its float32
    neighbours, the levels themselves and +-0."""
    out = {0.0, -0.0}
    for k in range(-1, 4):
        t = F32((k + 0.5) * s - o)
        assert float(t) == (k + 0.5) * s - o
        for v in (t, np.nextafter(t, F32(np.inf)), np.nextafter(t, F32(-np.inf))):
            out.add(float(v))
    for k in range(4):
        out.add(k * s - o)
    return sorted(out) + [-0.0]


def _affine_code(x: float, s: float, o: float) -> int:
    # the float32 operations as docs/formats.md#rocmfp2-affine writes them
    t = F32(F32(F32(F32(x) + F32(o)) / F32(s)) + F32(0.5))
    return int(min(max(np.floor(t), 0), 3))


@pytest.mark.parametrize("se,oe", AFFINE_PAIRS, ids=lambda v: f"{v:#04x}")
@pytest.mark.parametrize("weighted", [True, False], ids=["importance", "unweighted"])
def test_affine_ties(se, oe, weighted):
    s, o = float(UE4M3[se]), float(UE4M3[oe])
    probes = _affine_probes(s, o)
    lo, hi = -o, 3 * s - o  # the pins: min = -o, max = 3s - o
    if weighted:
        n = 30
        probes += [probes[0]] * (-len(probes) % n)
        q = np.array(probes, np.float32).reshape(-1, n)
        x = np.concatenate([np.full((len(q), 1), lo, np.float32), np.full((len(q), 1), hi, np.float32), q], axis=1)
        imp = np.zeros(32, np.float32)
        imp[:2] = 1.0
        probe = np.ones_like(x, bool)
        probe[:, :2] = False
    else:
        # exact levels code*s - o fill the rest of each block, one probe each
        levels = [lo, hi] + [k * s - o for k in (1, 2, 1, 2, 0, 3)] * 5
        rows = [levels[:i % 32] + [p] + levels[i % 32:31] for i, p in enumerate(probes)]
        x = np.array(rows, np.float32)
        imp = None
        probe = np.zeros_like(x, bool)
        for i in range(len(rows)):
            probe[i, i % 32] = True
    x = x.astype(np.float32)
    ref = formats.encode("rocmfp2_affine", x, imp, impl="ref")
    fast = formats.encode("rocmfp2_affine", x, imp, impl="fast")
    assert np.array_equal(ref, fast), "affine reference and fast bytes differ\n" + describe_mismatch(ref, fast, 10)
    blk = ref.reshape(-1, 10)
    if weighted:
        assert np.all(blk[:, 8] == se) and np.all(blk[:, 9] == oe), (
            f"blocks did not get (scale, offset) = ({se:#04x}, {oe:#04x}): "
            f"{sorted(set(zip(blk[:, 8].tolist(), blk[:, 9].tolist())))[:4]}")
    else:
        # the probe's own error may move an unweighted block off (s, o): its
        # probe is then checked against the documented rule at the (s, o) it got
        assert np.any((blk[:, 8] == se) & (blk[:, 9] == oe))
    y = formats.decode("rocmfp2_affine", ref, 32, impl="ref")
    errors = []
    for r, c in zip(*np.nonzero(probe)):
        s, o = float(UE4M3[blk[r, 8]]), float(UE4M3[blk[r, 9]])
        v = float(x[r, c])
        code = _affine_code(v, s, o)
        k = (v + o) / s - 0.5  # exact: on a decision point when k is an integer
        if k == int(k) and -1 <= k <= 3:
            assert code == min(int(k) + 1, 3), f"x = {v!r}: on the tie t = {k + 1} the code must go up"
        expect = F32(F32(code) * F32(s)) - F32(o)
        if y[r, c].view(np.uint32) != F32(expect).view(np.uint32):
            errors.append(f"x = {v!r} decodes to {float(y[r, c])!r}, code {code} gives {float(expect)!r}")
    assert not errors, f"affine S={s} O={o}: {len(errors)} probes off, e.g.\n  " + "\n  ".join(errors[:8])


def test_probe_sets_cover_the_planted_fp3_threshold():
    """The FP3 threshold 3.0 (the mutation ``a > 3.0`` -> ``a >= 3.0``) is a
    probe, and docs/formats.md#rocmfp3 sends it to magnitude 2."""
    case = CASES["rocmfp3"]
    assert 3.0 in case.probes and -3.0 in case.probes
    assert case.level(3.0) == 2 and case.level(-3.0) == -2
    assert case.level(float(np.nextafter(F32(3.0), F32(4)))) == 4
