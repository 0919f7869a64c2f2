"""runtime/capture.py: RoutingRecorder counts and profiles; agreement with the shipped calibration."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ds4quant.errors import BadInputError, ShapeError
from ds4quant.routing import read_routing, write_routing_csv, write_routing_json
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
        from ds4quant.calibrate import _load_model as _load
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
