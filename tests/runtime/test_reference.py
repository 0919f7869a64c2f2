"""runtime.reference on the shipped sample (samples/ds4-tiny, FP8/FP4, dequantized by our own code).

The swap test builds its own experts module from the documented formula
(down(silu(clamp(gate, max=limit)) * clamp(up, +-limit)) * w,
docs/reference-model.md#experts) in the eager forward's order, so it checks swap_experts against
transformers' eager experts, not against runtime code.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402

from ds4quant.errors import BadInputError  # noqa: E402
from ds4quant.runtime.reference import (  # noqa: E402
    capture_experts, load_reference, moe_blocks, swap_experts, torch_threads,
)

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "ds4-tiny"
N_LAYER, N_EXPERT, K, HIDDEN, INTER, VOCAB = 4, 16, 4, 256, 128, 512
HASH_LAYERS = (0, 1)

pytestmark = pytest.mark.skipif(not (SAMPLE / "config.json").exists(), reason="samples/ds4-tiny absent")


class _SpecExperts(torch.nn.Module):
    """Routed experts recomputed from the documented formula, in the eager order:
    experts ascending, each expert's rows in (top-k slot, token) order, index_add_."""

    def __init__(self, eager):
        super().__init__()
        self.gate_up = eager.gate_up_proj
        self.down = eager.down_proj
        self.limit = float(eager.limit)
        self.calls = 0

    def forward(self, hidden, top_k_index, top_k_weights):
        self.calls += 1
        out = torch.zeros_like(hidden)
        slots = top_k_index.transpose(0, 1)  # [k, T]
        for e in torch.unique(top_k_index).tolist():
            pos, tok = torch.where(slots == e)
            gate, up = F.linear(hidden[tok], self.gate_up[e]).chunk(2, dim=-1)
            act = F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)
            out.index_add_(0, tok, F.linear(act, self.down[e]) * top_k_weights[tok, pos, None])
        return out


class _Zero(torch.nn.Module):
    def forward(self, hidden, top_k_index, top_k_weights):
        return torch.zeros_like(hidden)


@pytest.fixture(scope="module")
def model():
    return load_reference(SAMPLE)


def _ids(batch: int = 2, seq: int = 24) -> "torch.Tensor":
    rng = np.random.default_rng(5)
    return torch.from_numpy(rng.integers(3, VOCAB, (batch, seq))).to(torch.long)


def _logits(model, ids):
    with torch_threads(1), torch.no_grad():  # bits depend on the thread count (docs/reference-model.md#determinism)
        return model(input_ids=ids, use_cache=False).logits


def test_load_reference_is_the_eager_fp32_model(model):
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.config._experts_implementation == "eager"
    blocks = moe_blocks(model)
    assert [i for i, _ in blocks] == list(range(N_LAYER))
    for i, block in blocks:
        assert block is model.model.layers[i].mlp
        assert tuple(block.experts.gate_up_proj.shape) == (N_EXPERT, 2 * INTER, HIDDEN)
        assert tuple(block.experts.down_proj.shape) == (N_EXPERT, HIDDEN, INTER)


def test_swapping_in_the_spec_math_keeps_logits_bitwise(model):
    ids = _ids()
    want = _logits(model, ids)
    olds, mine = {}, {}
    try:
        for i, block in moe_blocks(model):
            mine[i] = _SpecExperts(block.experts)
            olds[i] = swap_experts(model, i, mine[i])
            assert model.model.layers[i].mlp.experts is mine[i]
        got = _logits(model, ids)
    finally:
        for i, old in olds.items():
            assert swap_experts(model, i, old) is mine[i]
    assert all(m.calls == 1 for m in mine.values())  # every layer ran the replacement, once
    assert type(olds[0]).__name__ == "DeepseekV4Experts"
    assert torch.equal(got, want)
    assert torch.equal(_logits(model, ids), want)  # restored


def test_swap_takes_effect_and_is_undone(model):
    """The negative control: a module that drops the routed experts changes the
    logits, so the bitwise test above can fail."""
    ids = _ids(1, 16)
    want = _logits(model, ids)
    old = swap_experts(model, 2, _Zero())
    try:
        got = _logits(model, ids)
    finally:
        swap_experts(model, 2, old)
    assert not torch.equal(got, want)
    assert torch.equal(_logits(model, ids), want)


def test_swap_refusals(model):
    with pytest.raises(BadInputError, match=r"layer 9 has no MoE block; MoE layers are \[0, 1, 2, 3\]"):
        swap_experts(model, 9, _Zero())
    with pytest.raises(BadInputError, match="layer 1 is function, not a torch.nn.Module"):
        swap_experts(model, 1, lambda h, i, w: h)
    assert type(model.model.layers[1].mlp.experts).__name__ == "DeepseekV4Experts"


def test_capture_sees_each_layers_routed_inputs(model):
    batch, seq = 2, 24
    ids = _ids(batch, seq)
    with capture_experts(model) as cap:
        out = _logits(model, ids)
    assert [c.layer for c in cap.calls] == list(range(N_LAYER))  # one call per layer, in layer order
    for c in cap.calls:
        assert tuple(c.hidden.shape) == (batch * seq, HIDDEN) and c.hidden.dtype == torch.float32
        assert tuple(c.top_k_index.shape) == (batch * seq, K) and c.top_k_index.dtype == torch.int64
        assert tuple(c.top_k_weights.shape) == (batch * seq, K) and c.top_k_weights.dtype == torch.float32
        assert int(c.top_k_index.min()) >= 0 and int(c.top_k_index.max()) < N_EXPERT
        # the k experts of a token are distinct; weights are renormalised x routed_scaling_factor
        assert all(len(set(row)) == K for row in c.top_k_index.tolist())
        np.testing.assert_allclose(c.top_k_weights.sum(dim=1).numpy(), 1.5, rtol=1e-5)
    for layer in HASH_LAYERS:  # hash-routed: experts straight from tid2eid[token]
        tid2eid = model.model.layers[layer].mlp.gate.tid2eid
        assert torch.equal(cap.for_layer(layer)[0].top_k_index, tid2eid[ids.reshape(-1)])
    # replaying a captured call through the layer's experts gives the routed output the model used
    block = model.model.layers[3].mlp
    c = cap.for_layer(3)[0]
    with torch_threads(1), torch.no_grad():
        routed = block.experts(c.hidden, c.top_k_index, c.top_k_weights)
    assert tuple(routed.shape) == (batch * seq, HIDDEN) and torch.isfinite(routed).all()
    # the hooks are gone after the block
    n = len(cap.calls)
    _logits(model, ids)
    assert len(cap.calls) == n and torch.equal(_logits(model, ids), out)


def test_capture_with_callback_and_layer_subset(model):
    ids = _ids(1, 12)
    seen = []

    def cb(layer, module, hidden, idx, weights):
        seen.append((layer, module, tuple(hidden.shape), tuple(idx.shape), tuple(weights.shape)))

    with capture_experts(model, cb, layers=[2, 0]) as cap:
        _logits(model, ids)
    assert cap.calls == []  # the callback consumed them
    assert [(s[0], s[2], s[3], s[4]) for s in seen] == [(0, (12, HIDDEN), (12, K), (12, K)),
                                                        (2, (12, HIDDEN), (12, K), (12, K))]
    assert seen[1][1] is model.model.layers[2].mlp.experts
    with pytest.raises(BadInputError, match=r"layers \[7\] have no MoE block"):
        with capture_experts(model, layers=[1, 7]):
            pass


def test_load_reference_refusals(tmp_path):
    with pytest.raises(BadInputError, match="threads must be an int >= 1"):
        load_reference(SAMPLE, threads=0)
    with pytest.raises(BadInputError, match="no such folder"):
        load_reference(tmp_path / "nope")
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF")
    with pytest.raises(BadInputError, match="is a GGUF; the transformers reference model needs the official"):
        load_reference(g)
    with pytest.raises(BadInputError, match="dtype must be a torch floating dtype"):
        load_reference(SAMPLE, dtype="int8")
