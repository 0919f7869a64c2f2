"""Routing approximations on samples/ds4-tiny (top-4 of 16, hash-routed first layers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ds4quant.errors import BadInputError  # noqa: E402
from ds4quant.runtime.reference import capture_experts, load_reference, moe_blocks  # noqa: E402
from ds4quant.runtime.routing_approx import approximate_routing, read_drop_file  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "samples" / "ds4-tiny"


@pytest.fixture(scope="module")
def tiny():
    m = load_reference(TINY, threads=1)
    ids = torch.arange(3, 3 + 40).reshape(2, 20) * 7 % 500
    with torch.no_grad():
        base = m(ids, use_cache=False).logits
    return m, ids, base


def test_model_k_and_empty_drop_are_bit_identical(tiny, tmp_path):
    m, ids, base = tiny
    empty = tmp_path / "none.json"
    empty.write_text("{}")
    with torch.no_grad(), approximate_routing(m, m.config.num_experts_per_tok, read_drop_file(empty)) as a:
        got = m(ids, use_cache=False).logits
    assert torch.equal(got, base) and a.describe().startswith("top-4")


def test_fewer_experts_and_dropped_experts_change_the_output(tiny, tmp_path):
    m, ids, base = tiny
    learned = [i for i, b in moe_blocks(m) if not b.is_hash]
    hashed = [i for i, b in moe_blocks(m) if b.is_hash]
    with torch.no_grad(), approximate_routing(m, 2) as a, capture_experts(m) as cap:
        got = m(ids, use_cache=False).logits
    assert not torch.equal(got, base) and a.hash_layers == tuple(hashed)
    for c in cap.calls:
        assert c.top_k_index.shape[1] == (2 if c.layer in learned else m.config.num_experts_per_tok)
    drop = {learned[0]: (0, 1, 2), **({hashed[0]: (0, 1)} if hashed else {})}
    f = tmp_path / "drop.json"
    f.write_text(json.dumps({str(k): list(v) for k, v in drop.items()}))
    with torch.no_grad(), approximate_routing(m, None, read_drop_file(f)), capture_experts(m) as cap:
        got = m(ids, use_cache=False).logits
    assert not torch.equal(got, base)
    for c in cap.for_layer(learned[0]):
        assert not set(c.top_k_index.unique().tolist()) & {0, 1, 2}
        assert torch.allclose(c.top_k_weights.sum(-1), cap.for_layer(learned[0])[0].top_k_weights.sum(-1)[0])
    for c in cap.for_layer(hashed[0]) if hashed else ():
        w = c.top_k_weights.masked_fill(~torch.isin(c.top_k_index, torch.tensor([0, 1])), 0)
        assert float(w.abs().max()) == 0.0  # dropped experts carry no weight
    # restored afterwards
    with torch.no_grad():
        assert torch.equal(m(ids, use_cache=False).logits, base)


def test_refusals_name_the_problem(tiny, tmp_path):
    m, _, _ = tiny
    with pytest.raises(BadInputError, match="--experts-per-token"):
        with approximate_routing(m, 17):
            pass
    with pytest.raises(BadInputError, match="expert 16 outside"):
        with approximate_routing(m, None, {1: (16,)}):
            pass
    bad = tmp_path / "bad.json"
    bad.write_text('{"x": [1]}')
    with pytest.raises(BadInputError, match="not an integer"):
        read_drop_file(bad)
