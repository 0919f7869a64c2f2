"""Writes the hostile placement corpus: placement files, routing profiles and
option sets that `read_placement`, `place` and `ds4quant place` must refuse,
plus index.json (case -> reader, error class, message substring).

    python tests/data/hostile_placement/make_corpus.py          # (re)write
    python tests/data/hostile_placement/make_corpus.py --check  # exit 1 if anything differs

Deterministic: no randomness; a valid 4-layer x 16-expert placement is built
by hand and each case breaks one thing (re-hashing where the case is not
about the hash, so the intended check is the one that fires).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
L, E, K = 4, 16, 4


def _canon(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _valid() -> dict:
    return {"schema": "ds4quant.placement", "version": 1, "n_layer": L, "n_expert": E, "n_expert_used": K,
            "owners": ["cuda:0", "cpu"],
            "layers": [{"cuda:0": [0, 1, 2, 3], "cpu": list(range(4, 14)), "none": [14, 15]} for _ in range(L)],
            "ranks": None, "artifact": None}


def _hashed(obj: dict) -> dict:
    return {**obj, "content_sha256": hashlib.sha256(_canon(obj)).hexdigest()}


def _text(obj) -> bytes:
    return (json.dumps(obj, sort_keys=True) + "\n").encode()


def _case_files() -> dict[str, tuple[bytes, str, str, str]]:
    """name -> (bytes, reader, error class, message substring)."""
    out: dict[str, tuple[bytes, str, str, str]] = {}

    def pl(name, obj, err, msg, hashed=True):
        out[f"placement/{name}.json"] = (_text(_hashed(obj) if hashed else obj), "placement", err, msg)

    v = _valid()
    pl("wrong_schema", {**v, "schema": "ds4quant.plan"}, "CorruptDataError", "schema is 'ds4quant.plan'")
    pl("wrong_version", {**v, "version": 2}, "UnsupportedFormatError", "placement version 2")
    pl("version_string", {**v, "version": "1"}, "CorruptDataError", "version must be an integer")
    pl("too_few_layers", {**v, "layers": v["layers"][:3]}, "CorruptDataError", "n_layer=4")
    pl("n_layer_mismatch", {**v, "n_layer": 5}, "CorruptDataError", "n_layer=5")
    pl("n_expert_huge", {**v, "n_expert": 10**9}, "CorruptDataError", "n_expert must be an integer in 1..65536")
    pl("n_layer_string", {**v, "n_layer": "4"}, "CorruptDataError", "n_layer must be an integer")
    pl("n_layer_float", {**v, "n_layer": 4.0}, "CorruptDataError", "n_layer must be an integer")
    pl("n_used_over_n_expert", {**v, "n_expert_used": 17}, "CorruptDataError", "exceeds n_expert")
    lay = json.loads(json.dumps(v["layers"]))
    lay[2]["cpu"] = lay[2]["cpu"] + [16]
    pl("expert_out_of_range", {**v, "layers": lay}, "CorruptDataError", "expert 16, outside 0..15")
    lay = json.loads(json.dumps(v["layers"]))
    lay[1]["cuda:0"] = [-1, 0, 1, 2, 3]
    pl("negative_id", {**v, "layers": lay}, "CorruptDataError", "expert -1, outside 0..15")
    lay = json.loads(json.dumps(v["layers"]))
    lay[0]["cpu"] = [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 3]
    pl("placed_twice", {**v, "layers": lay}, "CorruptDataError", "expert 3 placed twice (cuda:0 and cpu)")
    lay = json.loads(json.dumps(v["layers"]))
    lay[3]["none"] = [0, 14, 15]
    pl("placed_twice_in_none", {**v, "layers": lay}, "CorruptDataError", "expert 0 placed twice (cuda:0 and none)")
    lay = json.loads(json.dumps(v["layers"]))
    lay[2]["none"] = [15]
    pl("placed_nowhere", {**v, "layers": lay}, "CorruptDataError", "1 experts placed nowhere (e.g. [14])")
    lay = json.loads(json.dumps(v["layers"]))
    lay[0]["cpu"] = ["4"] + lay[0]["cpu"][1:]
    pl("id_string", {**v, "layers": lay}, "CorruptDataError", "holds '4', not an integer expert id")
    lay = json.loads(json.dumps(v["layers"]))
    lay[0]["cpu"] = [4.0] + lay[0]["cpu"][1:]
    pl("id_float", {**v, "layers": lay}, "CorruptDataError", "holds 4.0, not an integer expert id")
    lay = json.loads(json.dumps(v["layers"]))
    lay[0]["cpu"] = [True] + lay[0]["cpu"][1:]
    pl("id_bool", {**v, "layers": lay}, "CorruptDataError", "holds True, not an integer expert id")
    lay = json.loads(json.dumps(v["layers"]))
    lay[1]["cpu"] = list(reversed(lay[1]["cpu"]))
    pl("ids_not_ascending", {**v, "layers": lay}, "CorruptDataError", "is not in ascending order")
    lay = json.loads(json.dumps(v["layers"]))
    lay[0]["cpu"] = {"4": 1}
    pl("ids_not_list", {**v, "layers": lay}, "CorruptDataError", "must be a list of at most n_expert=16")
    pl("unknown_owner_name", {**v, "owners": ["gpu0", "cpu"],
                              "layers": [{"gpu0": [0, 1, 2, 3], "cpu": list(range(4, 14)), "none": [14, 15]}] * L},
       "CorruptDataError", "unknown owner name 'gpu0'")
    pl("owner_not_listed", {**v, "owners": ["cpu"]}, "CorruptDataError", "names owners ['cuda:0'] not in owners")
    pl("owners_repeat", {**v, "owners": ["cpu", "cpu"]}, "CorruptDataError", "owner names repeat")
    pl("unknown_field", {**v, "hot": 3}, "CorruptDataError", "unknown fields ['hot']")
    pl("missing_field", {k: x for k, x in v.items() if k != "owners"}, "CorruptDataError", "missing fields ['owners']")
    pl("artifact_not_string", {**v, "artifact": 5}, "CorruptDataError", "artifact must be null or a fingerprint")
    ranks = {"n_ranks": 2, "strategy": "uniform", "replicate_hot": 0, "owner": [[e % 2 for e in range(E)]] * L}
    rv = {**v, "owners": ["cpu"], "layers": [{"cpu": [], "none": list(range(E))}] * L}
    bad = json.loads(json.dumps(ranks))
    bad["owner"][1][3] = 2
    pl("rank_out_of_range", {**rv, "ranks": bad}, "CorruptDataError", "ranks.owner[1][3] = 2 is not a rank")
    bad = json.loads(json.dumps(ranks))
    bad["owner"][0][0] = -1
    pl("replicated_count", {**rv, "ranks": bad}, "CorruptDataError", "has 1 replicated experts, replicate_hot says 0")
    pl("n_ranks_huge", {**rv, "ranks": {**ranks, "n_ranks": 10**6}}, "CorruptDataError",
       "ranks.n_ranks must be an integer in 1..4096")
    pl("strategy_unknown", {**rv, "ranks": {**ranks, "strategy": "random"}}, "CorruptDataError",
       "ranks.strategy must be one of")
    pl("ranks_with_local_experts", {**v, "ranks": ranks}, "CorruptDataError", "a rank placement holds no experts")
    # the hash
    h = _hashed(v)
    h["layers"][0]["cuda:0"], h["layers"][0]["cpu"] = [0, 1, 2], [3] + h["layers"][0]["cpu"]
    out["placement/hash_mismatch.json"] = (_text(h), "placement", "IntegrityError", "does not match the content")
    pl("hash_missing", v, "CorruptDataError", "content_sha256 must be 64 lowercase hex digits", hashed=False)
    pl("hash_not_hex", {**v, "content_sha256": "xyz"}, "CorruptDataError", "content_sha256 must be 64", hashed=False)
    # not JSON / not an object
    good = _text(_hashed(v))
    out["placement/truncated.json"] = (good[: len(good) // 2], "placement", "CorruptDataError", "not valid JSON")
    out["placement/empty.json"] = (b"", "placement", "CorruptDataError", "not valid JSON")
    out["placement/not_utf8.json"] = (b'{"schema": "\xff"}', "placement", "CorruptDataError", "byte 12 is not UTF-8")
    out["placement/top_level_list.json"] = (b"[1, 2]\n", "placement", "CorruptDataError", "top level is not a JSON object")
    out["placement/nan.json"] = (good.replace(b'"n_expert": 16', b'"n_expert": NaN'), "placement",
                                 "CorruptDataError", "NaN is not a JSON number")
    out["placement/huge_int_literal.json"] = (good.replace(b'"n_expert": 16', b'"n_expert": ' + b"9" * 5000),
                                              "placement", "CorruptDataError", "integer literal of 5000 digits")
    out["placement/deep_nesting.json"] = (b"[" * 20000 + b"]" * 20000, "placement", "CorruptDataError",
                                          "nested too deeply")
    # routing profiles (read through place with 4 x 16 experts)
    rows = [",".join(str(10 + e + 3 * layer) for e in range(E)) for layer in range(L)]
    head = f"# hotness table: n_layer={L} n_expert={E} n_expert_used={K}\n"

    def rt(name, text: bytes, err, msg, ext="csv"):
        out[f"routing/{name}.{ext}"] = (text, "routing", err, msg)

    rt("wrong_layers", (f"# hotness table: n_layer=3 n_expert={E} n_expert_used={K}\n" + "\n".join(rows[:3])
                        + "\n").encode(), "ShapeError", "routing profile is 3 layers x 16 experts")
    rt("wrong_experts", ("\n".join(",".join(r.split(",")[:15]) for r in rows) + "\n").encode(), "ShapeError",
       "routing profile is 4 layers x 15 experts")
    rt("negative_count", (head + "\n".join(["-5" + rows[0][2:]] + rows[1:]) + "\n").encode(), "CorruptDataError",
       "'-5' is not an unsigned integer count")
    rt("fractional_count", (head + "\n".join(["1.5," + rows[0]] + rows[1:]) + "\n").encode(), "CorruptDataError",
       "'1.5' is not an unsigned integer count")
    rt("non_numeric", (head + "\n".join(["abc" + rows[0][2:]] + rows[1:]) + "\n").encode(), "CorruptDataError",
       "'abc' is not an unsigned integer count")
    rt("count_past_uint64", (head + "\n".join([str(2**64) + rows[0][2:]] + rows[1:]) + "\n").encode(), "CorruptDataError",
       "does not fit uint64")
    rt("ragged_row", (head + "\n".join([rows[0] + ",7"] + rows[1:]) + "\n").encode(), "CorruptDataError",
       "has 17 counts, expected 16")
    rt("header_layers_disagree", (f"# hotness table: n_layer=5 n_expert={E} n_expert_used={K}\n"
                                  + "\n".join(rows) + "\n").encode(), "CorruptDataError", "header says n_layer=5")
    rt("no_rows", head.encode(), "CorruptDataError", "no data rows")
    prof = {"schema": "ds4quant.routing_profile", "version": 1, "n_layer": L, "n_expert": E, "n_expert_used": K,
            "tokens": 64, "source": {}, "counts": [[int(x) for x in r.split(",")] for r in rows]}
    rt("json_truncated", _text(prof)[:100], "CorruptDataError", "not valid JSON", ext="json")
    rt("json_wrong_schema", _text({**prof, "schema": "lucebox.hotness"}), "CorruptDataError",
       "schema is 'lucebox.hotness'", ext="json")
    bad = json.loads(json.dumps(prof))
    bad["counts"][2][5] = "many"
    rt("json_non_numeric", _text(bad), "CorruptDataError", "counts[2][5] = 'many' is not an integer", ext="json")
    bad = json.loads(json.dumps(prof))
    bad["counts"][0][0] = -1
    rt("json_negative", _text(bad), "CorruptDataError", "counts[0][0] = -1 is not an integer", ext="json")
    rt("json_n_layer_huge", _text({**prof, "n_layer": 2**40}), "CorruptDataError", "n_layer must be an integer",
       ext="json")
    return out


# Option sets for place() on a 4 x 16 profile with 1000 bytes per expert (no file).
OPTIONS = {
    "options/negative_budget": ({"owners": ["cpu=-5G"]}, "BudgetError", "size must not be negative"),
    "options/huge_budget": ({"owners": ["cpu=99999999T"]}, "BudgetError", "larger than 2^62 bytes"),
    "options/non_numeric_budget": ({"owners": ["cpu=lots"]}, "BadInputError", "bad size 'lots'"),
    "options/nan_budget": ({"owners": ["cpu=nan"]}, "BadInputError", "bad size 'nan'"),
    "options/unknown_owner": ({"owners": ["gpu=1G"]}, "BadInputError", "unknown owner name 'gpu'"),
    "options/owner_twice": ({"owners": ["cpu=1G", "cpu=2G"]}, "BadInputError", "owner cpu given twice"),
    "options/floor_does_not_fit": ({"owners": ["cuda:0=7999", "cpu"], "cold": "cpu", "min_hot": 2}, "BudgetError",
                                   "the floor of 2 hot experts per layer needs 8,000 bytes on cuda:0"),
    "options/leftovers_without_cold": ({"owners": ["cuda:0=10000"]}, "BudgetError", "54 experts fit no owner"),
    "options/cold_budget_too_small": ({"owners": ["cuda:0=10000", "cpu=1000"], "cold": "cpu"}, "BudgetError",
                                      "cold owner cpu must take 54 experts"),
    "options/cold_unknown": ({"owners": ["cpu=1G"], "cold": "hip:0"}, "BadInputError",
                             "cold owner 'hip:0' is not one of the owners"),
    "options/min_hot_over_n_expert": ({"owners": ["cpu"], "min_hot": 17}, "BadInputError", "--min-hot"),
    "options/speed_ratio_negative": ({"owners": ["cuda:0=1G", "cpu"], "speed_ratio": -3.0}, "BadInputError",
                                     "--speed-ratio"),
    "options/speed_ratio_one_owner": ({"owners": ["cuda:0=1G"], "speed_ratio": 3.0}, "BadInputError",
                                      "give two owners"),
    "options/ranks_zero": ({"ranks": 0}, "BadInputError", "--ranks"),
    "options/ranks_huge": ({"ranks": 10**7}, "BadInputError", "--ranks"),
    "options/replicate_over_n_expert": ({"ranks": 2, "replicate_hot": 17}, "BadInputError", "--replicate-hot"),
    "options/rank_budget_too_small": ({"ranks": 2, "owners": ["cpu=31999"]}, "BudgetError",
                                      "rank 0 holds 32,000 bytes"),
    "options/ranks_with_min_hot": ({"ranks": 2, "min_hot": 2}, "BadInputError", "do not apply with --ranks"),
}

# Refused only once the expert bytes are known (ds4quant place reads the artifact
# first); every other case is refused before the artifact is opened.
NEEDS_ARTIFACT = {"routing/wrong_layers.csv", "routing/wrong_experts.csv", "options/floor_does_not_fit",
                  "options/leftovers_without_cold", "options/cold_budget_too_small", "options/rank_budget_too_small"}


def build() -> dict[str, bytes]:
    files = {}
    index = {}
    for name, (data, reader, err, msg) in _case_files().items():
        files[name] = data
        index[name] = {"reader": reader, "error": err, "message": msg, "needs_artifact": name in NEEDS_ARTIFACT}
    for name, (opts, err, msg) in OPTIONS.items():
        index[name] = {"reader": "options", "options": opts, "error": err, "message": msg,
                       "needs_artifact": name in NEEDS_ARTIFACT}
    files["index.json"] = (json.dumps(index, indent=1, sort_keys=True) + "\n").encode()
    return files


def main(argv) -> int:
    check = "--check" in argv
    bad = []
    for name, data in build().items():
        p = HERE / name
        if check:
            if not p.exists() or p.read_bytes() != data:
                bad.append(name)
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
    if bad:
        print("differs:", ", ".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
