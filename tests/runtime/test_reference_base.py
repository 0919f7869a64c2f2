"""The reference base file: round trip, integrity, and refusals that name the difference."""

import numpy as np
import pytest

from ds4quant.errors import BadInputError, CorruptDataError
from ds4quant.runtime import kl_figures as K
from ds4quant.runtime import reference_base as B

CFG = {"vocab_size": 300, "hidden_size": 8, "num_hidden_layers": 2, "n_routed_experts": 4, "num_experts_per_tok": 1,
       "moe_intermediate_size": 4, "max_position_embeddings": 64}
EXPECT = dict(source_fingerprint="f" * 64, tokens_sha=B.tokens_sha256([[1, 2, 3], [4, 5]]), protocol="exact-copy",
              config=CFG, tool_version="0.1.0", ctx_size=None)


@pytest.fixture
def base(tmp_path):
    logits = np.random.default_rng(1).normal(0, 3, size=(3, 300)).astype(np.float32)
    q = K.quantize_log_probs(logits)
    header = {"source_fingerprint": "f" * 64, "tokens_sha256": EXPECT["tokens_sha"], "protocol": "exact-copy",
              "config": CFG, "tool_version": "0.1.0", "ctx_size": None, "response_sha256": "a" * 64}
    arrays = {"tokens": np.array([1, 2, 3, 4, 5], np.int32), "lengths": np.array([3, 2], np.int32),
              "scale": q.scale, "min_log_prob": q.min_log_prob, "q": q.q, "argmax": q.argmax().astype(np.int32)}
    return B.write_base(tmp_path / "ref.base", header, arrays), logits


def test_round_trip(base):
    path, logits = base
    b = B.read_base(path)
    B.check_base(b, str(path), **EXPECT)
    assert b.seqs() == [[1, 2, 3], [4, 5]]
    got = K.QuantizedLogProbs(b.arrays["scale"], b.arrays["min_log_prob"], b.arrays["q"]).log_probs()
    exact = K.log_softmax(logits)
    keep = exact > exact.max(-1, keepdims=True) - 16  # below that range a log-prob reads as the floor
    assert np.abs(got - exact)[keep].max() < 2e-4 and (got[~keep] <= exact.max(-1, keepdims=True).repeat(300, 1)[~keep] - 15.99).all()
    assert b.arrays["argmax"].tolist() == logits.argmax(-1).tolist()
    assert not (path.parent / "ref.base.tmp").exists()


@pytest.mark.parametrize("key,value,name", [
    ("source_fingerprint", "e" * 64, "another source"),
    ("tokens_sha", "0" * 64, "another evaluation tokens"),
    ("protocol", None, "another protocol"),
    ("ctx_size", 512, "another chunk size"),
    ("config", {**CFG, "num_experts_per_tok": 2}, "another model config: num_experts_per_tok 1 in the base, 2 here"),
    ("tool_version", "0.2.0", "another tool version"),
])
def test_each_mismatch_is_refused_by_name(base, key, value, name):
    path, _ = base
    with pytest.raises(BadInputError, match=name):
        B.check_base(B.read_base(path), str(path), **{**EXPECT, key: value})


def test_truncated_and_flipped_are_refused(base):
    path, _ = base
    data = path.read_bytes()
    for bad in (data[:-100], data[:len(data) // 2], data[:-1]):
        path.write_bytes(bad)
        with pytest.raises(CorruptDataError, match="truncated or corrupt") as e:
            B.read_base(path)
        assert e.value.exit_code == 2
    for at in (20, len(data) // 2, len(data) - 5):
        flipped = bytearray(data)
        flipped[at] ^= 0x01
        path.write_bytes(bytes(flipped))
        with pytest.raises(CorruptDataError):
            B.read_base(path)
    path.write_bytes(b"hello")
    with pytest.raises(CorruptDataError, match="not a ds4quant reference base"):
        B.read_base(path)


def test_another_format_version_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(B, "VERSION", 2)
    p = B.write_base(tmp_path / "v2.base", {}, {"tokens": np.array([1], np.int32)})
    monkeypatch.setattr(B, "VERSION", 1)
    with pytest.raises(BadInputError, match="version 2"):
        B.read_base(p)
