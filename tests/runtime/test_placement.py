"""Placement files, planning rules, ds4quant place, and the hostile placement corpus."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ds4quant.cli import cli
from ds4quant.errors import BadInputError, BudgetError, CorruptDataError, Ds4quantError, IntegrityError
from ds4quant.deploy.place import parse_owner, place_from_bytes
from ds4quant.calib.routing import RoutingProfile, read_routing
from ds4quant.runtime.placement import (
    NONE,
    REPLICATED,
    Placement,
    placement_for_one_owner,
    read_placement,
    write_placement,
)
from ds4quant.runtime.planning import _balanced, placement_report, plan_placement, plan_ranks, rank_report

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "data" / "hostile_placement"
INDEX: dict = json.loads((CORPUS / "index.json").read_text())
SAMPLE_ROUTING = ROOT / "samples" / "ds4-tiny-calib" / "routing.csv"


def _profile(seed=0, L=4, E=16, k=4, skew=1.3):
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, E + 1) ** skew
    counts = np.stack([rng.multinomial(1000 * k, rng.permutation(w) / w.sum()) for _ in range(L)])
    return RoutingProfile(L, E, k, counts.astype(np.uint64), tokens=1000)


def _nbytes(L=4, E=16, seed=0, lo=800, hi=1200):
    return np.random.default_rng(seed).integers(lo, hi, size=(L, E)).astype(np.int64)


# --------------------------------------------------------------------------
# the file


def test_round_trip_hash_and_owner_of(tmp_path):
    prof = _profile()
    p, _ = plan_placement(prof, _nbytes(), [("cuda:0", 20000), ("cpu", 15000)], cold="none", min_hot=2,
                          artifact="sha256:" + "a" * 64)
    f = write_placement(tmp_path / "p.json", p)
    q = read_placement(f)
    assert q == p and q.content_sha256 == p.content_sha256
    raw = json.loads(f.read_text())
    assert raw["schema"] == "ds4quant.placement" and raw["version"] == 1
    assert raw["content_sha256"] == p.content_sha256
    for layer in range(p.n_layer):
        own = p.owner_of(layer)
        assert own.shape == (16,) and own.dtype == np.int64
        for i, o in enumerate(p.owners):
            assert tuple(np.nonzero(own == i)[0]) == p.experts_of(o, layer)
        assert tuple(np.nonzero(own == -1)[0]) == p.none[layer]
    # any edit of the content changes the hash and is refused on read
    raw["layers"][0]["cpu"], raw["layers"][0][NONE] = raw["layers"][0][NONE], raw["layers"][0]["cpu"]
    (tmp_path / "e.json").write_text(json.dumps(raw))
    with pytest.raises(Ds4quantError):
        read_placement(tmp_path / "e.json")


def test_a_placement_that_cannot_be_written_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """A full disk under ``ds4quant place --out``: one line naming the file, exit 2, no file."""
    import errno

    import ds4quant.runtime.placement as placement_mod
    from ds4quant.convert import convert

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    art = tmp_path / "art"
    convert(ROOT / "samples" / "ds4-tiny", art, "rocmfp3", threads=1)
    monkeypatch.setattr(placement_mod, "atomic_write_bytes", full)
    out = tmp_path / "p.json"
    r = CliRunner().invoke(cli, ["place", str(art), "--routing", str(SAMPLE_ROUTING), "--owner", "cpu",
                                 "--out", str(out)])
    assert r.exit_code == 2, (r.output, r.exception)
    (line,) = [x for x in r.output.splitlines() if x.strip()]
    assert "No space left on device" in line and str(out) in line and "nothing was written" in line
    assert not out.exists()


def test_a_mapping_is_the_same_placement_as_its_file(tmp_path):
    """The mapping a caller (or a JSON document) writes and the file ``ds4quant place``
    writes are one type: equal records, equal hashes, the same owner of every expert."""
    prof = _profile(3)
    p, _ = plan_placement(prof, _nbytes(seed=3), [("cuda:0", 6000), ("worker:1/cpu", 6000), ("cpu", None)],
                          cold="none", min_hot=1)
    f = read_placement(write_placement(tmp_path / "p.json", p))
    mapping = {L: {**{o: f.experts_of(o, L) for o in f.owners}, NONE: f.none[L]} for L in range(f.n_layer)}
    m = Placement.from_mapping(mapping, f.n_layer, f.n_expert, f.n_expert_used)
    assert m == f and m.content_sha256 == f.content_sha256
    # JSON's string layer keys, lists, and owners listed in another order per layer
    as_json = json.loads(json.dumps({str(L): dict(reversed(list(v.items()))) for L, v in mapping.items()}))
    j = Placement.from_mapping(as_json, f.n_layer, f.n_expert, f.n_expert_used)
    assert all(j.owner_names(L) == f.owner_names(L) for L in range(f.n_layer))
    assert j.owner_names(0) == tuple(NONE if i < 0 else f.owners[i] for i in f.owner_of(0))


@pytest.mark.parametrize("mapping, says", [
    ({0: {"cpu:0": (0, 1, 2)}}, "placement has no layer 1"),
    ({0: {"cpu:0": (0, 1, 2, 3)}, 1: {"cpu:0": (0, 1, 2, 3)}, 2: {"cpu:0": ()}}, "names layer 2"),
    ({0: {"cpu:0": (0, 1, 2)}, 1: {"cpu:0": (0, 1, 2, 3)}}, "layer 0 experts [3] are placed nowhere"),
    ({0: {"cpu:0": (0, 1, 2, 3), "cpu:1": (3,)}, 1: {"cpu:0": (0, 1, 2, 3)}}, "expert 3 placed on cpu:0 and cpu:1"),
    ({0: {"cpu:0": (0, 1, 2, 4)}, 1: {"cpu:0": (0, 1, 2, 3)}}, "expert 4 outside 0..3"),
    ({0: {"gpu:0": (0, 1, 2, 3)}, 1: {"cpu:0": (0, 1, 2, 3)}}, "unknown owner name 'gpu:0'"),
    ({"x": {"cpu:0": (0, 1, 2, 3)}}, "names layer 'x'"),
    ([(0, 1)], "must be a mapping"),
])
def test_a_bad_mapping_is_one_line(mapping, says):
    with pytest.raises(BadInputError) as ei:
        Placement.from_mapping(mapping, 2, 4)
    assert says in ei.value.one_line() and "\n" not in ei.value.one_line()


def test_one_owner_placement(tmp_path):
    p = placement_for_one_owner(3, 5, owner="torch-cpu:1")
    assert p.owners == ("torch-cpu:1",) and all(p.experts[L][0] == tuple(range(5)) for L in range(3))
    assert all(not n for n in p.none)
    assert read_placement(write_placement(tmp_path / "p.json", p)) == p
    with pytest.raises(Ds4quantError):
        placement_for_one_owner(3, 5, owner="gpu")


def test_same_content_same_hash_and_file_bytes(tmp_path):
    prof = _profile(3)
    a, _ = plan_placement(prof, _nbytes(), [("cuda:0", 9000), ("cpu", None)], cold="cpu")
    b, _ = plan_placement(prof, _nbytes(), [("cuda:0", 9000), ("cpu", None)], cold="cpu")
    write_placement(tmp_path / "a.json", a)
    write_placement(tmp_path / "b.json", b)
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


# --------------------------------------------------------------------------
# plan_placement rules


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget", [0, 5000, 23456, 64 * 1000])
def test_bytes_within_budget_and_every_expert_once(seed, budget):
    prof, nb = _profile(seed), _nbytes(seed=seed)
    p, rep = plan_placement(prof, nb, [("cuda:0", budget), ("cpu:0", 7000), ("cpu:1", None)], cold="cpu:1")
    by = p.owner_bytes(nb)
    assert by["cuda:0"] <= budget and by["cpu:0"] <= 7000 and by[NONE] == 0
    assert rep.bytes == (by["cuda:0"], by["cpu:0"], by["cpu:1"])
    assert sum(rep.bytes) == int(nb.sum())
    for layer in range(4):
        ids = sorted(itertools.chain(*p.experts[layer]))
        assert ids == list(range(16))


@pytest.mark.parametrize("min_hot", [1, 3, 16])
def test_floor_honoured(min_hot):
    prof, nb = _profile(1), _nbytes(seed=1)
    need = sum(int(nb[L, e]) for L in range(4) for e in prof.hot_experts(L, min_hot))
    p, _ = plan_placement(prof, nb, [("cuda:0", need), ("cpu", None)], cold="cpu", min_hot=min_hot)
    for L in range(4):
        assert set(prof.hot_experts(L, min_hot)) <= set(p.experts_of("cuda:0", L))
    with pytest.raises(BudgetError, match="floor"):
        plan_placement(prof, nb, [("cuda:0", need - 1), ("cpu", None)], cold="cpu", min_hot=min_hot)


def test_greedy_order_is_slots_per_byte():
    # layer 0: expert 0 has the most slots but costs 4x; 1 and 2 give more slots per byte
    counts = np.array([[400, 300, 200, 100]], dtype=np.uint64)
    nb = np.array([[4000, 1000, 1000, 1000]], dtype=np.int64)
    prof = RoutingProfile(1, 4, 1, counts)
    p, rep = plan_placement(prof, nb, [("cuda:0", 3000), ("cpu", None)], cold="cpu")
    assert p.experts_of("cuda:0", 0) == (1, 2, 3)  # 0.3, 0.2, 0.1 slots/byte > 0.1 (tie: more slots first)
    p, _ = plan_placement(prof, nb, [("cuda:0", 4500), ("cpu", None)], cold="cpu")
    assert p.experts_of("cuda:0", 0) == (1, 2, 3)  # 0 does not fit after them; skipped
    # 0 and 3 tie at 0.1 slots/byte; the tie goes to more slots: 0 before 3, and then 3 no longer fits
    p, _ = plan_placement(prof, nb, [("cuda:0", 6000), ("cpu", None)], cold="cpu")
    assert p.experts_of("cuda:0", 0) == (0, 1, 2)
    assert rep.slot_resident_rate == pytest.approx(600 / 1000)


def test_greedy_spans_layers_and_matches_a_brute_force_order():
    prof, nb = _profile(5, L=3, E=6), _nbytes(3, 6, seed=5)
    p, _ = plan_placement(prof, nb, [("cuda:0", 6000), ("cpu", None)], cold="cpu")
    # an independent statement of the rule: sort by count/bytes with exact cross-multiplication
    items = [(L, e) for L in range(3) for e in range(6)]
    import functools

    def cmp(a, b):
        ca, cb = int(prof.counts[a]), int(prof.counts[b])
        x, y = ca * int(nb[b]), cb * int(nb[a])
        if x != y:
            return -1 if x > y else 1
        if ca != cb:
            return -1 if ca > cb else 1
        return -1 if a < b else 1

    left, hot = 6000, set()
    for it in sorted(items, key=functools.cmp_to_key(cmp)):
        if int(nb[it]) <= left:
            hot.add(it)
            left -= int(nb[it])
    assert {(L, e) for L in range(3) for e in p.experts_of("cuda:0", L)} == hot


def test_cold_none_and_refusals():
    prof, nb = _profile(2), _nbytes(seed=2)
    p, rep = plan_placement(prof, nb, [("cuda:0", 10000)], cold="none")
    assert rep.none_experts == 64 - rep.experts[0] and rep.none_bytes + rep.bytes[0] == int(nb.sum())
    with pytest.raises(BudgetError, match="fit no owner"):
        plan_placement(prof, nb, [("cuda:0", 10000)])
    with pytest.raises(BudgetError):
        plan_placement(prof, nb, [("cuda:0", -1)], cold="none")
    with pytest.raises(Ds4quantError, match="unknown owner"):
        plan_placement(prof, nb, [("gpu:0", 1)], cold="none")


def test_speed_ratio_lowers_the_critical_path():
    prof, nb = _profile(4), np.full((4, 16), 1000, dtype=np.int64)
    owners = [("cuda:0", None), ("cpu", None)]
    plain, _ = plan_placement(prof, nb, owners, cold="cpu")
    assert all(len(plain.experts_of("cuda:0", L)) == 16 for L in range(4))  # unlimited budget: all hot
    for ratio in (1.0, 3.4, 100.0):
        p, _ = plan_placement(prof, nb, owners, cold="cpu", speed_ratio=ratio, min_hot=1)
        for L in range(4):
            row = [int(c) for c in prof.counts[L]]
            shared = sum(row) // 4
            hot = set(p.experts_of("cuda:0", L))
            main = shared + sum(row[e] for e in hot)
            peer = sum(row) - sum(row[e] for e in hot)
            crit = max(main / ratio, peer)
            # no single further move of a peer expert to main would lower it (greedy fixed point)
            for e in set(range(16)) - hot:
                assert max((main + row[e]) / ratio, peer - row[e]) >= crit - 1e-9
            assert set(prof.hot_experts(L, 1)) <= hot
        if ratio == 100.0:
            assert all(len(p.experts_of("cuda:0", L)) > 8 for L in range(4))


def test_token_resident_rate_independence_and_samples():
    prof = RoutingProfile(1, 4, 2, np.array([[50, 50, 0, 0]], dtype=np.uint64))
    nb = np.full((1, 4), 10, dtype=np.int64)
    p, rep = plan_placement(prof, nb, [("cuda:0", 10), ("cpu", None)], cold="cpu")
    assert rep.token_resident_method == "independence"
    assert rep.slot_resident_rate == 0.5 and rep.token_resident_rate == 0.25
    samples = np.array([[[0, 1], [0, 1], [1, 0], [0, 1]]])
    hot = p.experts_of("cuda:0", 0)[0]
    rep2 = placement_report(p, prof, nb, token_topk=samples)
    assert rep2.token_resident_method == "samples" and rep2.token_resident_rate == 0.0  # never both on one owner
    p3, _ = plan_placement(prof, nb, [("cuda:0", 20), ("cpu", None)], cold="cpu")
    assert placement_report(p3, prof, nb, token_topk=samples).token_resident_rate == 1.0
    assert hot in (0, 1)


# --------------------------------------------------------------------------
# ranks


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_uniform_ranks(n):
    prof = _profile(0)
    p = plan_ranks(prof, n, "uniform")
    for L in range(4):
        assert list(p.rank_owner(L)) == [e % n for e in range(16)]
    assert all(p.experts[L] == ((),) and p.none[L] == tuple(range(16)) for L in range(4))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n,k", [(2, 0), (3, 0), (4, 2), (5, 1), (3, 3)])
def test_balanced_ranks_count_bound_and_lpt(seed, n, k):
    prof = _profile(seed, skew=1.6)
    p = plan_ranks(prof, n, "balanced", replicate_hot=k)
    u = plan_ranks(prof, n, "uniform", replicate_hot=k)
    for L in range(4):
        own = p.rank_owner(L)
        assert sorted(np.nonzero(own == REPLICATED)[0]) == sorted(prof.hot_experts(L, k))
        m = 16 - k
        for r in range(n):
            assert abs(int(np.sum(own == r)) - m / n) <= 1
        row = prof.counts[L].astype(np.int64)
        load = [int(row[own == r].sum()) for r in range(n)]
        uload = [int(row[u.rank_owner(L) == r].sum()) for r in range(n)]
        # LPT: the n hottest non-replicated experts land on n distinct ranks
        rest = [e for e in prof.ranked_experts(L) if own[e] != REPLICATED]
        assert len({int(own[e]) for e in rest[:n]}) == min(n, len(rest))
        assert sum(load) == sum(uload)


def test_balanced_beats_uniform_on_the_shipped_profile():
    prof = read_routing(SAMPLE_ROUTING)
    for n in (2, 4):
        for L in range(prof.n_layer):
            row = prof.counts[L].astype(np.int64)
            b = plan_ranks(prof, n, "balanced").rank_owner(L)
            u = plan_ranks(prof, n, "uniform").rank_owner(L)
            bl = max(int(row[b == r].sum()) for r in range(n))
            ul = max(int(row[u == r].sum()) for r in range(n))
            assert bl <= ul and bl - int(row.sum()) / n <= int(row.max())


def test_lpt_against_brute_force_optimum():
    rng = np.random.default_rng(11)
    for _ in range(30):
        row = [int(x) for x in rng.integers(0, 100, size=7)]
        got = _balanced(row, list(range(7)), 2)
        load = [sum(row[e] for e, r in got.items() if r == q) for q in range(2)]
        best = min(max(sum(row[e] for e in s), sum(row) - sum(row[e] for e in s))
                   for c in (3, 4) for s in itertools.combinations(range(7), c))
        assert max(load) <= best * 4 / 3 + max(row) / 3 + 1e-9  # LPT bound, with the cardinality slack


def test_replication_rule_and_for_rank(tmp_path):
    prof = _profile(8)
    n, k = 3, 2
    p = plan_ranks(prof, n, "balanced", replicate_hot=k, owner="cpu")
    q = read_placement(write_placement(tmp_path / "c.json", p))
    assert q == p and q.ranks.n_ranks == 3 and q.ranks.replicate_hot == 2
    idx = np.array([[prof.hot_experts(0, 1)[0]] * 4] * 7)  # 7 tokens all on the hottest (replicated) expert
    sr = p.slot_ranks(0, idx)
    hot = prof.hot_experts(0, 1)[0]
    assert [int(sr[t, 0]) for t in range(7)] == [(hot + t) % n for t in range(7)]
    assert p.slot_rank(0, hot, 4) == (hot + 4) % n
    # each slot computed by exactly one rank; every rank holds what it computes
    idx = np.array([prof.ranked_experts(0)[:4]] * 9)
    sr = p.slot_ranks(0, idx)
    for r in range(n):
        local = p.for_rank(r)
        held = set(local.experts_of("cpu", 0))
        assert held | set(local.none[0]) == set(range(16)) and not held & set(local.none[0])
        assert set(idx[sr == r].tolist()) <= held
        assert set(prof.hot_experts(0, k)) <= held
    rep = rank_report(p, prof, np.full((4, 16), 10, dtype=np.int64))
    assert sum(rep.slot_share) == pytest.approx(1.0)
    assert sum(rep.experts) == 4 * (16 - k) + 4 * k * n


# --------------------------------------------------------------------------
# place(), sizes, CLI


def test_parse_owner():
    assert parse_owner("cuda:0=8G") == ("cuda:0", 8 << 30) and parse_owner("cpu") == ("cpu", None)
    assert parse_owner("cpu=0") == ("cpu", 0) and parse_owner(("cuda:0", "1K")) == ("cuda:0", 1024)
    with pytest.raises(Ds4quantError, match="--owner cpu: bad size 'lots'"):
        parse_owner("cpu=lots")


def test_place_from_bytes_on_the_shipped_profile(tmp_path):
    nb = np.full((4, 16), 3 * 128 * 256 // 4, dtype=np.int64)
    p, rep = place_from_bytes(SAMPLE_ROUTING, nb, ["cuda:0=300K", "cpu"], cold="cpu", min_hot=2,
                              out=tmp_path / "p.json")
    assert read_placement(tmp_path / "p.json") == p
    assert 196608 <= rep.bytes[0] <= 300 << 10 and rep.bytes[0] + rep.bytes[1] == int(nb.sum())
    prof = read_routing(SAMPLE_ROUTING)
    hot_slots = sum(int(prof.counts[L, e]) for L in range(4) for e in p.experts_of("cuda:0", L))
    assert rep.slot_resident_rate == hot_slots / int(prof.counts.sum())
    p2, rep2 = place_from_bytes(SAMPLE_ROUTING, nb, [], ranks=2, strategy="balanced", replicate_hot=1)
    assert rep2.n_ranks == 2 and p2.ranks.strategy == "balanced"


def _options_call(opts):
    nb = np.full((4, 16), 1000, dtype=np.int64)
    prof = RoutingProfile(4, 16, 4, (np.arange(64).reshape(4, 16) + 1).astype(np.uint64))
    o = dict(opts)
    owners = o.pop("owners", [])
    return place_from_bytes(prof, nb, owners, **o)


def _bounded_refusal(fn, *args):
    t0 = time.perf_counter()
    try:
        fn(*args)
    except Ds4quantError as e:
        assert time.perf_counter() - t0 < 2.0, "a refusal must be quick"
        return e
    return None


@pytest.mark.parametrize("case", sorted(INDEX))
def test_hostile_corpus_refused_with_one_line(case):
    exp = INDEX[case]
    if exp["reader"] == "placement":
        err = _bounded_refusal(read_placement, CORPUS / case)
    elif exp["reader"] == "routing":
        err = _bounded_refusal(place_from_bytes, CORPUS / case, np.full((4, 16), 1000, dtype=np.int64), ["cpu"])
    else:
        err = _bounded_refusal(_options_call, exp["options"])
    assert err is not None, f"{case} was accepted"
    line = err.one_line()
    assert type(err).__name__ == exp["error"], (case, line)
    assert exp["message"] in line, (case, line)
    assert "\n" not in line and str(err) == line
    if exp["reader"] != "options":
        assert case.split("/")[-1] in line  # names the file


def test_corpus_regenerates_byte_for_byte():
    assert len(INDEX) >= 60
    for rel, exp in INDEX.items():
        assert exp["reader"] == "options" or (CORPUS / rel).exists(), rel
    res = subprocess.run([sys.executable, str(CORPUS / "make_corpus.py"), "--check"], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def _exit_2_one_line(res, msg):
    assert res.exit_code == 2, res.output
    out = res.output.strip()
    assert "\n" not in out and out.startswith("ds4quant: error:") and "Traceback" not in out, out
    assert msg in out, out


def _cli_args(opts):
    args = []
    for o in opts.get("owners", []):
        args += ["--owner", o]
    for key, flag in (("cold", "--cold"), ("min_hot", "--min-hot"), ("speed_ratio", "--speed-ratio"),
                      ("ranks", "--ranks"), ("replicate_hot", "--replicate-hot")):
        if key in opts:
            args += [flag, str(opts[key])]
    return args


# Cases refused before the artifact is read (no artifact view needed).
_EARLY = [c for c, e in INDEX.items() if not e["needs_artifact"]]


@pytest.mark.parametrize("case", sorted(_EARLY))
def test_cli_exit_2_without_traceback(case, tmp_path):
    exp = INDEX[case]
    art = tmp_path / "art"
    art.mkdir()
    runner = CliRunner()
    routing = str(SAMPLE_ROUTING)
    if exp["reader"] == "placement":
        args = ["place", str(art), "--routing", routing, "--check", str(CORPUS / case)]
    elif exp["reader"] == "routing":
        args = ["place", str(art), "--routing", str(CORPUS / case), "--owner", "cpu", "--out", str(tmp_path / "p")]
    else:
        args = ["place", str(art), "--routing", routing, *_cli_args(exp["options"]), "--out", str(tmp_path / "p")]
    _exit_2_one_line(runner.invoke(cli, args), exp["message"])
    assert not (tmp_path / "p").exists()


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory):
    pytest.importorskip("ds4quant.artifact.view")
    from ds4quant.convert import convert

    out = tmp_path_factory.mktemp("art") / "tiny"
    convert(str(ROOT / "samples" / "ds4-tiny"), str(out), "rocmfp2-strix")
    return out


@pytest.mark.parametrize("case", sorted(set(INDEX) - set(_EARLY)))
def test_cli_exit_2_with_an_artifact(case, tiny_artifact, tmp_path):
    exp = INDEX[case]
    routing = str(CORPUS / case) if exp["reader"] == "routing" else str(SAMPLE_ROUTING)
    opts = exp.get("options", {"owners": ["cpu"]})
    # the tiny artifact's experts are not 1000 bytes: scale the budgets the corpus states
    args = ["place", str(tiny_artifact), "--routing", routing, *_cli_args(opts), "--out", str(tmp_path / "p")]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2 and "Traceback" not in res.output and "\n" not in res.output.strip(), res.output


def test_cli_plans_writes_and_checks(tiny_artifact, tmp_path):
    from ds4quant.artifact.view import open_artifact

    with open_artifact(tiny_artifact) as v:
        nb = v.expert_nbytes()
    budget = int(nb.sum()) // 4
    out = tmp_path / "p.json"
    res = CliRunner().invoke(cli, ["place", str(tiny_artifact), "--routing", str(SAMPLE_ROUTING), "--owner",
                                   f"cuda:0={budget}", "--owner", "cpu", "--cold", "cpu", "--min-hot", "1",
                                   "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    j = json.loads(res.output)
    p = read_placement(out)
    assert j["placement_sha256"] == p.content_sha256 and j["owners"][0]["bytes"] <= budget
    assert p.artifact is not None
    res = CliRunner().invoke(cli, ["place", str(tiny_artifact), "--routing", str(SAMPLE_ROUTING), "--check", str(out)])
    assert res.exit_code == 0 and "checked" in res.output, res.output
    res = CliRunner().invoke(cli, ["place", str(tiny_artifact), "--routing", str(SAMPLE_ROUTING), "--ranks", "2",
                                   "--strategy", "balanced", "--replicate-hot", "1", "--out", str(out)])
    assert res.exit_code == 0 and "rank" in res.output, res.output
    assert read_placement(out).ranks.n_ranks == 2


def test_cli_places_on_a_worker_hosted_device_owner(tiny_artifact, tmp_path):
    """worker:N/OWNER names a child process hosting OWNER (a second vendor's runtime):
    place writes it, the file reads back, and runtime.load runs it."""
    from ds4quant import runtime
    from ds4quant.artifact.view import open_artifact

    with open_artifact(tiny_artifact) as v:
        budget = int(v.expert_nbytes().sum()) // 3
    out = tmp_path / "p.json"
    res = CliRunner().invoke(cli, ["place", str(tiny_artifact), "--routing", str(SAMPLE_ROUTING), "--owner",
                                   f"worker:1/torch-cpu:0={budget}", "--owner", "torch-cpu:1", "--cold",
                                   "torch-cpu:1", "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    p = read_placement(out)
    assert p.owners == ("worker:1/torch-cpu:0", "torch-cpu:1")
    with runtime.load(tiny_artifact, placement=out) as rt:
        assert rt.owners["worker:1/torch-cpu:0"].inner_identity == "worker:1/torch-cpu:0"
        assert rt.owners["worker:1/torch-cpu:0"].experts(0)
    res = CliRunner().invoke(cli, ["place", str(tiny_artifact), "--routing", str(SAMPLE_ROUTING), "--owner",
                                   "worker:1/worker:2=1G", "--out", str(tmp_path / "q.json")])
    assert res.exit_code == 2 and "unknown owner name" in res.output and not (tmp_path / "q.json").exists()


def test_cli_missing_artifact_is_exit_2(tmp_path):
    # without the artifact view the command refuses cleanly (exit 2 or a missing-module error only if absent)
    res = CliRunner().invoke(cli, ["place", str(tmp_path / "missing"), "--routing", str(SAMPLE_ROUTING),
                                   "--owner", "cpu", "--out", str(tmp_path / "p.json")])
    _exit_2_one_line(res, "no such artifact")


def test_placement_build_refuses_programmatic_garbage():
    with pytest.raises(CorruptDataError, match="placed twice"):
        Placement.build(1, 3, 1, ["cpu", "cuda:0"], [[[0, 1], [1, 2]]])
    with pytest.raises(CorruptDataError, match="placed nowhere"):
        Placement.build(1, 3, 1, ["cpu"], [[[0, 1]]])
    with pytest.raises(Ds4quantError):
        Placement.build(1, 3, 1, ["cpu"], [[[0, 1], [2]]])
    assert IntegrityError.__mro__  # the hash class exists under the base


def test_check_matches_shape_and_fingerprint():
    p = placement_for_one_owner(4, 16, artifact="sha256:" + "b" * 64)
    p.check_matches(4, 16, "sha256:" + "b" * 64)
    p.check_matches(4, 16, None)
    with pytest.raises(Ds4quantError, match="4 layers x 16 experts"):
        p.check_matches(4, 8, where="x.json")
    with pytest.raises(IntegrityError, match="planned for artifact"):
        p.check_matches(4, 16, "layout:" + "c" * 64, where="x.json")


def test_plan_for_rank_places_only_the_ranks_experts():
    from ds4quant.runtime.planning import plan_for_rank

    prof, nb = _profile(9), _nbytes(seed=9)
    cl = plan_ranks(prof, 2, "balanced", replicate_hot=1)
    for r in range(2):
        local, rep = plan_for_rank(cl, r, prof, nb, [("cuda:0", 6000), ("cpu", None)], cold="cpu", min_hot=1)
        one = cl.for_rank(r)
        for L in range(4):
            mine = set(one.experts_of("cpu", L))
            assert set(local.experts_of("cuda:0", L)) | set(local.experts_of("cpu", L)) == mine
            assert set(local.none[L]) == set(range(16)) - mine
            hottest_mine = [e for e in prof.ranked_experts(L) if e in mine][0]
            assert hottest_mine in local.experts_of("cuda:0", L)
        assert rep.bytes[0] <= 6000



def test_load_takes_a_cluster_placement_to_its_ranks_not_into_one_process(tiny_artifact, tmp_path):
    """A placement planned for N ranks is the ranks' to run (``runtime.load`` starts them:
    tests/runtime/test_cluster.py); in-process options on it, or cluster options on a
    placement without ranks, are refused before anything starts; one rank's part loads
    in process."""
    from ds4quant import runtime
    from ds4quant.deploy.place import place
    from ds4quant.runtime.cluster import ClusterOptions
    from ds4quant.runtime.owners.torch_owner import TorchOwner

    plc, _ = place(tiny_artifact, str(SAMPLE_ROUTING), ranks=2, strategy="uniform", out=tmp_path / "c.json")
    mine = TorchOwner("cpu", identity="torch-cpu:0")
    with pytest.raises(BadInputError, match="plans 2 ranks: prebuilt owners"):
        runtime.load(tiny_artifact, placement=tmp_path / "c.json", owners={"torch-cpu:0": mine})
    with pytest.raises(BadInputError, match="plans 2 ranks"):
        runtime.load(tiny_artifact, placement=plc, overlap=True)
    with pytest.raises(BadInputError, match="cluster options need a placement that records ranks"):
        runtime.load(tiny_artifact, placement=plc.for_rank(0), cluster=ClusterOptions())
    with runtime.load(tiny_artifact, placement=plc.for_rank(0)) as rt:
        assert rt.n_ranks == 0 and sum(rt.resident_bytes().values()) > 0
