"""samples/make_synthetic.py --preset ds4-flash / ds4-flash-mini: DS4 Flash's layout at its real dims.

The full preset is described, not written (its 2-layer slice is 8.6 GB); the
mini preset is written and opened. Large plain tensors are generated in row
blocks: forced onto a small model, the blocks make a valid, deterministic
checkpoint, and tensors under the threshold keep their one-piece bytes.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "samples"))

import _synthetic_values as sv  # noqa: E402
import make_synthetic as ms  # noqa: E402

from ds4quant.sources.config import CSA, HASH_MOE, HCA, MOE, SLIDING  # noqa: E402
from ds4quant.sources.official import ENC_FP4, ENC_FP8, open_source  # noqa: E402


def test_flash_preset_has_the_real_dimensions():
    spec = ms.preset("ds4-flash", layers=4)
    cfg = spec.native_config()
    want = {"hidden_size": 4096, "n_routed_experts": 256, "moe_intermediate_size": 2048, "num_experts_per_tok": 6,
            "n_shared_experts": 1, "num_hash_layers": 3, "num_attention_heads": 64, "head_dim": 512,
            "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_lora_rank": 1024, "o_groups": 8, "index_n_heads": 64,
            "index_head_dim": 128, "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20, "vocab_size": 129280,
            "compress_rate_csa": 4, "compress_rate_hca": 128, "sliding_window": 128, "expert_dtype": "fp4"}
    assert {k: cfg[k] for k in want} == want
    assert cfg["compress_ratios"] == [0, 0, 4, 128] and cfg["layer_types"] == [SLIDING, SLIDING, CSA, HCA]
    assert ms.preset("ds4-flash", 41, layers=2).ratios() == (128, 4)
    with pytest.raises(ValueError, match="outside DS4 Flash's 43 layers"):
        ms.preset("ds4-flash", 42, layers=2)
    # DS4 Flash's first 3 layers are hash-routed: a slice holds those of them it covers, a slice of
    # two or more layers keeps one score-routed layer, and a one-layer slice is possible
    got = {(n, off): ms.preset("ds4-flash", off, layers=n).hash_layers
           for n, off in ((1, 0), (2, 0), (4, 0), (2, 2), (2, 3), (1, 5))}
    assert got == {(1, 0): 1, (2, 0): 1, (4, 0): 3, (2, 2): 1, (2, 3): 0, (1, 5): 0}
    assert ms.preset("ds4-flash-mini", 0, layers=1).native_config()["num_hash_layers"] == 1
    shapes = {t.name: (t.dtype, t.shape) for u in ms.plan_units(spec) for t in u.tensors}
    assert shapes["layers.2.attn.wq_b.weight"] == ("F8_E4M3", (32768, 1024))
    assert shapes["layers.2.attn.wq_b.scale"] == ("F8_E8M0", (256, 8))
    assert shapes["layers.2.attn.wo_a.weight"] == ("F8_E4M3", (8192, 4096))
    assert shapes["layers.2.attn.indexer.wq_b.weight"] == ("F8_E4M3", (8192, 1024))
    assert shapes["layers.0.ffn.experts.255.w2.weight"] == ("I8", (4096, 1024))
    assert shapes["layers.0.ffn.experts.255.w2.scale"] == ("F8_E8M0", (4096, 64))
    assert shapes["layers.2.ffn.gate.tid2eid"] == ("I64", (129280, 6)) and "layers.3.ffn.gate.bias" in shapes
    assert shapes["embed.weight"] == ("BF16", (129280, 4096))
    info = ms.describe(ms.preset("ds4-flash", layers=2))
    assert 8.0e9 < info.total_bytes < 9.5e9 and info.expert_weights == 2 * 256 * 3 * 4096 * 2048


def test_mini_writes_and_opens(tmp_path):
    out = tmp_path / "mini"
    ms.make_synthetic(out, ms.preset("ds4-flash-mini", layers=4), workers=1)
    with open_source(out) as src:
        c = src.config
        assert c.mlp_layer_types == (HASH_MOE, HASH_MOE, HASH_MOE, MOE) and c.hc_mult == 4
        assert src.info("layers.3.ffn.experts.0.w1.weight").encoding == ENC_FP4
        assert src.info("layers.3.attn.wq_b.weight").encoding == ENC_FP8


def test_row_blocks(tmp_path, monkeypatch):
    spec = ms.preset("tiny", layers=2)
    whole = tmp_path / "whole"
    ms.make_synthetic(whole, spec, workers=1)
    monkeypatch.setattr(sv, "CHUNK_VALUES", 100_000)  # embed/head 512 x 256 = 131,072 values: in blocks
    blocks_a, blocks_b = tmp_path / "a", tmp_path / "b"
    ms.make_synthetic(blocks_a, spec, workers=1)
    ms.make_synthetic(blocks_b, spec, workers=2)

    def digest(p):
        return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(p.iterdir())}

    assert digest(blocks_a) == digest(blocks_b) != digest(whole)
    with open_source(blocks_a) as a, open_source(whole) as w:
        emb = a.read_dequantized("embed.weight")
        assert emb.shape == (512, 256) and 0.005 < float(emb.std()) < 0.05
        for name in w.tensor_names():
            if name not in ("embed.weight", "head.weight"):
                assert (a.read(name) == w.read(name)).all(), name
