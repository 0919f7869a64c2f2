"""runtime/capture.py: RoutingRecorder counts and profiles; agreement with the shipped calibration."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ds4quant.errors import BadInputError, ShapeError
from ds4quant.calib.routing import read_routing, write_routing_csv, write_routing_json
from ds4quant.runtime.capture import RoutingRecorder, hook_routers

ROOT = Path(__file__).resolve().parents[2]


def test_counts_equal_a_direct_bincount_and_round_trip(tmp_path):
    rng = np.random.default_rng(7)
    L, E, k = 3, 17, 5
    rec = RoutingRecorder(L, E, k, keep_samples=10)
    batches = {layer: [np.stack([rng.choice(E, k, replace=False) for _ in range(T)]) for T in (1, 6, 33)]
               for layer in range(L)}
    for i in range(3):
        for layer in range(L):
            rec.record(layer, batches[layer][i])
    prof = rec.profile(source={"what": "test"})
    for layer in range(L):
        allidx = np.concatenate(batches[layer]).reshape(-1)
        assert np.array_equal(prof.counts[layer], np.bincount(allidx, minlength=E).astype(np.uint64))
    assert prof.tokens == 40 and prof.n_expert_used == k
    assert int(prof.counts.sum()) == 40 * k * L
    s = rec.samples()
    assert s.shape == (L, 10, k)
    assert np.array_equal(s[1], np.concatenate(batches[1])[:10])
    write_routing_json(tmp_path / "r.json", prof)
    write_routing_csv(tmp_path / "r.csv", prof)
    assert read_routing(tmp_path / "r.json") == prof
    back = read_routing(tmp_path / "r.csv")  # CSV keeps counts and shape, not tokens/source
    assert np.array_equal(back.counts, prof.counts) and back.n_expert_used == k


def test_recorder_refuses_bad_batches():
    rec = RoutingRecorder(2, 8, 2)
    with pytest.raises(ShapeError):
        rec.record(0, np.zeros((4, 3), dtype=np.int64))
    with pytest.raises(BadInputError):
        rec.record(0, np.array([[0, 8]]))
    with pytest.raises(BadInputError):
        rec.record(2, np.array([[0, 1]]))
    with pytest.raises(ShapeError):
        rec.record(0, np.array([[0.0, 1.0]]))
    rec.record(0, np.array([[0, 1]]))
    with pytest.raises(BadInputError):
        rec.profile()  # layer 1 saw no tokens


def test_router_hooks_reproduce_the_shipped_routing_csv():
    """Recording mlp.gate outputs on samples/ds4-tiny over samples/tokens.txt (one
    sequence at a time, as calibrate runs) gives samples/ds4-tiny-calib/routing.csv."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    try:
        from ds4quant.runtime.reference import load_reference as _load  # once the loader moved there
    except ImportError:
        from ds4quant.calibrate.stage import _load_model as _load
    from ds4quant.calibrate import read_tokens

    want = read_routing(ROOT / "samples/ds4-tiny-calib/routing.csv")
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _load(str(ROOT / "samples/ds4-tiny"))
        cfg = model.config
        seqs = read_tokens(ROOT / "samples/tokens.txt", cfg.vocab_size, cfg.max_position_embeddings)
        rec = RoutingRecorder(cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_experts_per_tok)
        with hook_routers(model, rec), torch.no_grad():
            for ids in seqs:
                model(input_ids=torch.tensor([list(ids)]), use_cache=False)
    finally:
        torch.set_num_threads(old)
    got = rec.profile()
    assert got.tokens == sum(len(s) for s in seqs)
    assert np.array_equal(got.counts, want.counts), (got.counts - want.counts.astype(np.int64))


def test_capture_through_rt_moe_writes_calibrates_profile_files(tmp_path):
    """Tokens run through rt.moe (the artifact's routers, on the reference model's block
    inputs) give the routing files `ds4quant calibrate` writes for the same tokens, in
    exact and fast mode: routing.csv byte for byte, routing.json's counts and tokens."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from ds4quant import calibrate as C
    from ds4quant import runtime
    from ds4quant.convert import convert
    from ds4quant.runtime import capture
    from ds4quant.runtime.reference import load_reference

    assert (capture.ROUTING_CSV, capture.ROUTING_JSON) == (C.ROUTING_CSV, C.ROUTING_JSON)
    sample = ROOT / "samples/ds4-tiny"
    cfg = json.loads((sample / "config.json").read_text())
    seqs = C.read_tokens(ROOT / "samples/tokens.txt", cfg["vocab_size"], cfg["max_position_embeddings"])[:3]
    C.calibrate(sample, [list(s) for s in seqs], tmp_path / "cal")
    art = tmp_path / "art"
    convert(sample, art, "mxfp4", threads=1)
    model = load_reference(str(sample))
    want = read_routing(tmp_path / "cal" / C.ROUTING_JSON)
    for mode in ("exact", "fast"):
        out = tmp_path / mode
        out.mkdir()
        with runtime.load(art, mode=mode) as rt:
            prof = capture.profile_through_runtime(model, rt, seqs)
            assert rt.recorder is None  # the temporary recorder is gone
        files = capture.write_profile(out, prof)
        assert set(files) == {"routing_csv", "routing_json"}
        assert (out / C.ROUTING_CSV).read_bytes() == (tmp_path / "cal" / C.ROUTING_CSV).read_bytes(), mode
        got = read_routing(out / C.ROUTING_JSON)
        assert np.array_equal(got.counts, want.counts) and got.tokens == want.tokens == sum(len(s) for s in seqs)
        assert got.source["tokens_sha256"] == want.source["tokens_sha256"] and got.source["mode"] == mode
    # follow="runtime": the artifact's MoE outputs drive later layers; hash layers route by
    # token id alone, so they still agree; every layer still counts k slots per token
    with runtime.load(art, mode="fast") as rt:
        prof = capture.profile_through_runtime(model, rt, seqs[:1], follow="runtime")
    k = cfg["num_experts_per_tok"]
    assert prof.counts.sum(axis=1).tolist() == [len(seqs[0]) * k] * cfg["num_hidden_layers"]
    assert [len(s) for s in seqs[:1]] == [prof.tokens]
    assert all("forward" not in layer.mlp.__dict__ for layer in model.model.layers)  # blocks restored
    with pytest.raises(BadInputError, match="follow"):
        with runtime.load(art, mode="fast") as rt:
            capture.profile_through_runtime(model, rt, seqs[:1], follow="nobody")
