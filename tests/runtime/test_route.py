"""runtime/route.py against transformers' DeepseekV4 routers, bit for bit (CPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
mdl = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

from ds4quant.errors import BadInputError, ShapeError  # noqa: E402
from ds4quant.runtime.route import route, route_like  # noqa: E402

# The tiny config of docs/reference-model.md#tiny-models.
TINY = {
    "vocab_size": 512, "hidden_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "q_lora_rank": 128,
    "partial_rotary_factor": 0.25, "num_experts_per_tok": 4, "n_routed_experts": 16, "n_shared_experts": 1,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention"],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "sliding_window": 16, "hc_mult": 2, "hc_sinkhorn_iters": 20, "o_groups": 2, "o_lora_rank": 64,
    "index_n_heads": 4, "index_head_dim": 32, "index_topk": 4, "max_position_embeddings": 4096,
    "num_nextn_predict_layers": 0, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
}


def _cfg(**over):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**{**TINY, **over})


def _topk_router(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    r = mdl.DeepseekV4TopKRouter(cfg)
    with torch.no_grad():
        r.weight.copy_(torch.randn(r.weight.shape, generator=g) * 0.1)
        r.e_score_correction_bias.copy_(torch.randn(r.num_experts, generator=g) * 0.05)
    return r


def _hash_router(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    r = mdl.DeepseekV4HashRouter(cfg)
    with torch.no_grad():
        r.weight.copy_(torch.randn(r.weight.shape, generator=g) * 0.1)
        tid = torch.stack([torch.randperm(r.num_experts, generator=g)[: r.top_k] for _ in range(cfg.vocab_size)])
        r.tid2eid.copy_(tid)
    return r


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype.is_floating_point:
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    else:
        assert torch.equal(a, b)


@pytest.mark.parametrize("T", [1, 7, 64, 130])
@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid"])
def test_topk_router_bitwise(T, scoring):
    cfg = _cfg(scoring_func=scoring)
    r = _topk_router(cfg, 11 + T)
    h = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        _, w_ref, i_ref = r(h)
        idx, w = route(h, None, r.weight.detach(), r.e_score_correction_bias, None, cfg.num_experts_per_tok,
                       cfg.routed_scaling_factor, scoring)
        idx2, w2 = route_like(r, h)
    _same_bits(idx, i_ref)
    _same_bits(w, w_ref)
    _same_bits(idx2, i_ref)
    _same_bits(w2, w_ref)
    # the bias changes selection only: the weights are the unbiased scores of the chosen experts
    scores = torch.nn.functional.softplus(h @ r.weight.detach().T).sqrt() if scoring == "sqrtsoftplus" \
        else torch.sigmoid(h @ r.weight.detach().T)
    assert torch.allclose(w.sum(-1), torch.full((T,), cfg.routed_scaling_factor), atol=1e-5)
    assert torch.allclose(w / w.sum(-1, keepdim=True), scores.gather(1, idx) / scores.gather(1, idx).sum(-1, keepdim=True),
                          atol=1e-5)


def test_bias_changes_selection():
    cfg = _cfg()
    r = _topk_router(cfg, 3)
    h = torch.randn(32, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    big = torch.zeros(cfg.n_routed_experts)
    big[[3, 9, 12, 15]] = 100.0  # forces these four experts
    with torch.no_grad():
        idx, _ = route(h, None, r.weight.detach(), big, None, 4, 1.5)
    assert all(sorted(row) == [3, 9, 12, 15] for row in idx.tolist())


@pytest.mark.parametrize("T", [1, 9, 64])
def test_hash_router_bitwise(T):
    cfg = _cfg()
    r = _hash_router(cfg, 5 + T)
    g = torch.Generator().manual_seed(100 + T)
    h = torch.randn(T, cfg.hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    with torch.no_grad():
        _, w_ref, i_ref = r(h, ids)
        idx, w = route(h, ids, r.weight.detach(), None, r.tid2eid, 4, cfg.routed_scaling_factor)
    _same_bits(idx, i_ref)
    _same_bits(w, w_ref)
    assert torch.equal(idx, r.tid2eid[ids])


def test_route_refuses_bad_inputs():
    cfg = _cfg()
    r = _hash_router(cfg, 1)
    h = torch.randn(4, cfg.hidden_size)
    w = r.weight.detach()
    with pytest.raises(ShapeError):
        route(h.double(), None, w, None, None, 4, 1.5)
    with pytest.raises(ShapeError):
        route(h[:, :10], None, w, None, None, 4, 1.5)
    with pytest.raises(BadInputError):
        route(h, None, w, None, None, 17, 1.5)
    with pytest.raises(ShapeError):
        route(h, None, w, torch.zeros(3), None, 4, 1.5)
    with pytest.raises(BadInputError):
        route(h, torch.tensor([0, 1, 2, 512]), w, None, r.tid2eid, 4, 1.5)
    bad = r.tid2eid.clone()
    bad[7, 0] = 16
    with pytest.raises(BadInputError):
        route(h, torch.tensor([0, 7, 2, 3]), w, None, bad, 4, 1.5)
    with pytest.raises(BadInputError):
        route(h, None, w, None, None, 4, 1.5, scoring="softmax")
