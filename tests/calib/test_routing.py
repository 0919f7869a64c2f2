"""Routing profiles: the Lucebox hotness CSV (exact header, what Lucebox's
loader accepts, hostile files refused with one line naming file and line),
the schema-versioned JSON, and the frequency / hot-expert helpers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ds4quant.errors import BadInputError, CorruptDataError, Ds4quantError, ShapeError, UnsupportedFormatError
from ds4quant.calib.routing import (
    CSV_FORMAT_LINE,
    RoutingProfile,
    read_routing,
    read_routing_csv,
    read_routing_json,
    routing_csv_text,
    write_routing_csv,
    write_routing_json,
)

U64MAX = 2**64 - 1


def _profile(tokens=None, source=None):
    counts = np.array([[3, 0, 5, 1, 7], [0, 0, 16, 0, 0], [4, 4, 4, 2, 2]], dtype=np.uint64)
    return RoutingProfile(3, 5, 2, counts, tokens=tokens, source=source or {})


# --------------------------------------------------------------------------
# CSV


def test_csv_text_is_lucebox_save_csv_byte_for_byte():
    assert routing_csv_text(_profile()) == (
        "# hotness table: n_layer=3 n_expert=5 n_expert_used=2\n"
        "# format: one row per layer, columns are expert activation counts (expert 0..N-1)\n"
        "3,0,5,1,7\n"
        "0,0,16,0,0\n"
        "4,4,4,2,2\n"
    )
    assert CSV_FORMAT_LINE == "# format: one row per layer, columns are expert activation counts (expert 0..N-1)"


def test_csv_round_trip(tmp_path):
    p = _profile(tokens=8, source={"model": "x"})
    path = write_routing_csv(tmp_path / "r.csv", p)
    back = read_routing_csv(path)
    # the CSV keeps shape and counts; tokens and source are JSON-only
    assert back == RoutingProfile(p.n_layer, p.n_expert, p.n_expert_used, p.counts)
    assert back.tokens is None and dict(back.source) == {}
    assert back.counts.dtype == np.uint64 and not back.counts.flags.writeable
    assert read_routing(path) == back
    assert path.read_text() == routing_csv_text(p)


def test_csv_uint64_extremes_round_trip(tmp_path):
    counts = np.array([[U64MAX, 0], [0, 0]], dtype=np.uint64)
    p = RoutingProfile(2, 2, 1, counts)
    back = read_routing_csv(write_routing_csv(tmp_path / "r.csv", p))
    assert int(back.counts[0, 0]) == U64MAX


@pytest.mark.parametrize(
    "text, shape, used, row0",
    [
        # whitespace-separated legacy rows (Lucebox keeps them loadable)
        ("# hotness table: n_layer=2 n_expert=4 n_expert_used=2\n1 2 3 4\n5\t6 7\t8\n", (2, 4), 2, [1, 2, 3, 4]),
        # header without n_expert_used: 8, capped at n_expert
        ("# hotness table: n_layer=1 n_expert=16\n" + ",".join(["1"] * 16) + "\n", (1, 16), 8, [1] * 16),
        ("# hotness table: n_layer=1 n_expert=3\n1,2,3\n", (1, 3), 3, [1, 2, 3]),
        # no header: shape from the rows
        ("7,8\n9,10\n11,12\n", (3, 2), 2, [7, 8]),
        # CRLF, blank lines, other comments, spaces around values, no final newline
        ("# hotness table: n_layer=2 n_expert=2 n_expert_used=1\r\n\r\n# note\r\n 1 , 2\r\n3,4", (2, 2), 1, [1, 2]),
    ],
)
def test_csv_accepts_what_lucebox_accepts(tmp_path, text, shape, used, row0):
    path = tmp_path / "in.csv"
    path.write_bytes(text.encode())
    p = read_routing_csv(path)
    assert (p.n_layer, p.n_expert) == shape and p.n_expert_used == used
    assert p.counts[0].tolist() == row0


HDR = "# hotness table: n_layer=2 n_expert=3 n_expert_used=2\n"


@pytest.mark.parametrize(
    "text, needle",
    [
        (HDR + "1,2,3\n1,-1,3\n", "line 3: column 1: '-1' is not an unsigned integer"),
        (HDR + "1,2,3\n1,1.5,3\n", "line 3: column 1: '1.5'"),
        (HDR + "1,2,3\n1,1e3,3\n", "line 3: column 1: '1e3'"),
        (HDR + "1,2,3\n+1,2,3\n", "line 3: column 0: '+1'"),
        (HDR + "1,2,3,\n1,2,3\n", "line 2: column 3: an empty value"),
        (HDR + "1,,3\n1,2,3\n", "line 2: column 1: an empty value"),
        (HDR + "1,2,nan\n1,2,3\n", "'nan'"),
        (HDR + "1,2,3\n1,2\n", "line 3: row of layer 1 has 2 counts, expected 3"),
        (HDR + "1,2,3\n", "n_layer=2 but the file has 1 rows"),
        (HDR + "1,2,3\n1,2,3\n1,2,3\n", "n_layer=2 but the file has 3 rows"),
        (HDR + f"1,2,{2**64}\n1,2,3\n", "does not fit uint64"),
        (HDR + f"{U64MAX},1,0\n1,2,3\n", "line 2: counts of layer 0 sum past uint64"),
        ("# hotness table: n_layer=1 n_expert=3 n_expert_used=4\n1,2,3\n", "line 1: header n_expert_used=4"),
        ("# hotness table: n_layer=1 n_expert=3 n_expert_used=0\n1,2,3\n", "n_expert_used=0"),
        ("# hotness table: n_layer=0 n_expert=3\n", "is not a valid shape"),
        ("# hotness table: n_layer=1 n_expert=99999999999999999999\n1\n", "is not a valid shape"),
        ("# hotness table: n_layer=-1 n_expert=3\n1,2,3\n", "line 1: malformed header"),
        ("# hotness table: n_layer=1, n_expert=3\n1,2,3\n", "malformed header"),
        (HDR + HDR + "1,2,3\n1,2,3\n", "line 2: a second"),
        ("1,2,3\n" + HDR + "1,2,3\n", "line 2: the header comes after data rows"),
        ("", "no data rows"),
        ("# only comments\n\n", "no data rows"),
    ],
)
def test_hostile_csv_refused_with_file_and_line(tmp_path, text, needle):
    path = tmp_path / "hostile.csv"
    path.write_text(text)
    with pytest.raises(CorruptDataError) as ei:
        read_routing_csv(path)
    msg = str(ei.value)
    assert needle in msg
    assert str(path) in msg and "\n" not in msg


def test_binary_csv_refused(tmp_path):
    path = tmp_path / "bin.csv"
    path.write_bytes(b"1,2\n\xff\xfe,3\n")
    with pytest.raises(CorruptDataError, match="not UTF-8"):
        read_routing_csv(path)


def test_missing_file_is_bad_input(tmp_path):
    with pytest.raises(BadInputError, match="cannot read"):
        read_routing_csv(tmp_path / "nope.csv")
    with pytest.raises(BadInputError, match="cannot read"):
        read_routing(tmp_path / "nope.csv")


# --------------------------------------------------------------------------
# JSON


def test_json_round_trip_keeps_everything(tmp_path):
    p = _profile(tokens=8, source={"model": "ds4-tiny", "hash_layers": [0, 1]})
    path = write_routing_json(tmp_path / "r.json", p)
    back = read_routing_json(path)
    assert back == p and back.tokens == 8 and back.source["hash_layers"] == [0, 1]
    assert read_routing(path) == p
    doc = json.loads(path.read_text())
    assert doc["schema"] == "ds4quant.routing_profile" and doc["version"] == 1
    assert doc["counts"][1] == [0, 0, 16, 0, 0]
    # canonical bytes: writing again gives the same file
    again = write_routing_json(tmp_path / "r2.json", back)
    assert again.read_bytes() == path.read_bytes()


def _doc(**over):
    d = _profile(tokens=8).to_json()
    d.update(over)
    return d


@pytest.mark.parametrize(
    "doc, err, needle",
    [
        (_doc(schema="other"), CorruptDataError, "schema is 'other'"),
        (_doc(version=2), UnsupportedFormatError, "version 2"),
        (_doc(version="1"), CorruptDataError, "version must be an integer"),
        (_doc(n_layer=True), CorruptDataError, "n_layer must be an integer"),
        (_doc(n_expert_used=6), CorruptDataError, "n_expert_used 6 exceeds n_expert 5"),
        (_doc(tokens=-1), CorruptDataError, "tokens must be null"),
        (_doc(counts=[[1, 2, 3, 4, 5]] * 2), CorruptDataError, "n_layer=3 rows, got 2"),
        (_doc(counts=[[1, 2, 3, 4, 5], [1, 2, 3, 4], [1, 2, 3, 4, 5]]), CorruptDataError, "counts[1] must be a list"),
        (_doc(counts=[[1, 2, 3, 4, 5], [1, 2, -3, 4, 5], [0] * 5]), CorruptDataError, "counts[1][2] = -3"),
        (_doc(counts=[[1, 2, 3, 4, 5.0], [0] * 5, [0] * 5]), CorruptDataError, "counts[0][4] = 5.0"),
        (_doc(counts=[[True, 2, 3, 4, 5], [0] * 5, [0] * 5]), CorruptDataError, "counts[0][0] = True"),
        (_doc(counts=[[U64MAX, 1, 0, 0, 0], [0] * 5, [0] * 5]), CorruptDataError, "counts[0] sum past"),
        (_doc(extra=1), CorruptDataError, "unknown fields ['extra']"),
        (_doc(source=[1]), CorruptDataError, "source must be an object"),
        ([1, 2], CorruptDataError, "not a JSON object"),
    ],
)
def test_hostile_json_refused(tmp_path, doc, err, needle):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(err) as ei:
        read_routing_json(path)
    assert needle in str(ei.value) and str(path) in str(ei.value)


def test_json_refuses_nan_and_garbage(tmp_path):
    path = tmp_path / "nan.json"
    path.write_text(json.dumps(_doc()).replace('"tokens": 8', '"tokens": NaN'))
    with pytest.raises(CorruptDataError, match="not valid JSON"):
        read_routing_json(path)
    path.write_text("{not json")
    with pytest.raises(CorruptDataError, match="not valid JSON"):
        read_routing(path)


# --------------------------------------------------------------------------
# the record and its helpers


def test_frequencies_are_shares_of_routed_slots():
    counts = np.array([[1, 3, 0, 0], [0, 0, 0, 0]], dtype=np.uint64)
    p = RoutingProfile(2, 4, 2, counts)
    f = p.frequencies()
    assert f.dtype == np.float64
    assert f[0].tolist() == [0.25, 0.75, 0.0, 0.0]
    assert f[1].tolist() == [0.0] * 4  # a layer that saw no slot
    assert p.layer_totals().tolist() == [4, 0]


def test_hot_experts_rank_by_count_ties_to_lower_id():
    p = _profile()
    assert p.ranked_experts(0) == (4, 2, 0, 3, 1)
    assert p.hot_experts(0, 2) == (4, 2)
    assert p.hot_experts(2, 3) == (0, 1, 2)  # 4,4,4 tie: lower id first
    assert p.hot_experts(2, 99) == p.ranked_experts(2)
    assert p.hot_experts(1, 0) == () and p.hot_experts(1, -3) == ()
    assert p.unreached(1) == (0, 1, 3, 4) and p.unreached(2) == ()
    big = RoutingProfile(1, 3, 1, np.array([[2**62, 2**63, 0]], dtype=np.uint64))
    assert big.hot_experts(0, 1) == (1,)
    with pytest.raises(BadInputError, match="layer must be an int in 0..2"):
        p.hot_experts(3, 1)
    with pytest.raises(BadInputError, match="k must be an int"):
        p.hot_experts(0, 1.5)


def test_record_refuses_bad_values():
    with pytest.raises(ShapeError, match=r"shape \(2, 5\), expected \(3, 5\)"):
        RoutingProfile(3, 5, 2, np.zeros((2, 5), np.uint64))
    with pytest.raises(BadInputError, match=">= 0"):
        RoutingProfile(1, 2, 1, np.array([[1, -1]], np.int64))
    with pytest.raises(BadInputError, match="unsigned integer array"):
        RoutingProfile(1, 2, 1, np.array([[1.0, 2.0]]))
    with pytest.raises(BadInputError, match="exceeds n_expert"):
        RoutingProfile(1, 2, 3, np.zeros((1, 2), np.uint64))
    with pytest.raises(BadInputError, match="n_layer must be an int"):
        RoutingProfile(0, 2, 1, np.zeros((0, 2), np.uint64))
    with pytest.raises(BadInputError, match="sum past"):
        RoutingProfile(1, 2, 1, np.array([[U64MAX, 1]], np.uint64))
    with pytest.raises(BadInputError, match="JSON"):
        RoutingProfile(1, 2, 1, np.zeros((1, 2), np.uint64), source={"x": float("nan")})
    # plain lists are accepted and frozen
    p = RoutingProfile(1, 2, 1, [[1, 2]])
    assert p.counts.dtype == np.uint64 and not p.counts.flags.writeable


def test_write_into_missing_folder_is_refused(tmp_path):
    with pytest.raises(BadInputError, match="does not exist"):
        write_routing_csv(tmp_path / "no" / "r.csv", _profile())


# --------------------------------------------------------------------------
# shape errors name the file


def test_read_profiles_remember_their_file(tmp_path):
    p = _profile()
    csv, js = tmp_path / "r.csv", tmp_path / "r.json"
    write_routing_csv(csv, p)
    write_routing_json(js, p)
    assert read_routing(csv).path == str(csv) and read_routing(js).path == str(js)
    assert read_routing(csv) == p  # the path is not part of equality
    assert "path" not in read_routing(js).to_json()
    assert p.path is None and p.where == "routing profile"


def test_shape_error_names_the_file(tmp_path):
    csv = tmp_path / "hot.csv"
    write_routing_csv(csv, _profile())
    prof = read_routing(csv)
    prof.check_shape(3, 5)
    with pytest.raises(ShapeError) as ei:
        prof.check_shape(3, 16)
    assert str(csv) in ei.value.one_line()
    assert "3 layers x 5 experts" in ei.value.one_line() and "3 x 16" in ei.value.one_line()


def test_adaptive_convert_names_a_misshapen_profile(tmp_path):
    """The adaptive recipe's expert-count check (16 experts in the sample, 15 in
    the profile) names the profile file."""
    from ds4quant.plan import AdaptiveOptions
    from ds4quant.convert import convert

    bad = tmp_path / "routing-15.csv"
    write_routing_csv(bad, RoutingProfile(4, 15, 4, np.ones((4, 15), np.uint64)))
    opts = AdaptiveOptions(target_bpw=3.0, candidates=("rocmfp2", "rocmfp3"), routing=str(bad),
                           cache_dir=str(tmp_path / "cache"))
    with pytest.raises(Ds4quantError) as ei:
        convert("samples/ds4-tiny", tmp_path / "out", "adaptive", adaptive=opts)
    line = ei.value.one_line()
    assert str(bad) in line and "15" in line and "16" in line
