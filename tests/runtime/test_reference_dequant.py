"""load_reference dequantizes with our own code, never through transformers' loader.

On GPUs of compute capability 8.9 and newer transformers keeps an FP8/FP4
checkpoint quantized instead of dequantizing it; the reference must not care.
These tests (a) show the model built from config.json + our dequantization
is bit-identical, state dict and logits, to what ``from_pretrained`` gives on
this CPU host, on both samples, and (b) make ``from_pretrained`` and
transformers' quantizers unusable and show the reference still loads, every
FP8/FP4 weight decoded by ``OfficialSource.read_dequantized``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ds4quant.runtime.reference import load_reference, quiet_transformers, torch_threads  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = [ROOT / "samples" / "ds4-tiny", ROOT / "samples" / "ds4-copy"]


def _ids(vocab: int) -> "torch.Tensor":
    rng = np.random.default_rng(11)
    return torch.from_numpy(rng.integers(3, vocab, (2, 40))).to(torch.long)


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
def test_bit_identical_to_from_pretrained_on_cpu(sample):
    pytest.importorskip("accelerate", reason="transformers' own loader needs accelerate for FP8/FP4")
    from transformers import DeepseekV4ForCausalLM

    with torch_threads(1):
        ours = load_reference(sample)
        with quiet_transformers():
            theirs = DeepseekV4ForCausalLM.from_pretrained(str(sample), dtype=torch.float32,
                                                           experts_implementation="eager").eval()
        a, b = ours.state_dict(), theirs.state_dict()
        assert sorted(a) == sorted(b)
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        buf_b = dict(theirs.named_buffers())
        for k, v in ours.named_buffers():  # non-persistent rotary frequencies too
            assert torch.equal(v, buf_b[k]), k
        ids = _ids(ours.config.vocab_size)
        with torch.no_grad():
            assert torch.equal(ours(ids, use_cache=False).logits, theirs(ids, use_cache=False).logits)
    assert ours.config._experts_implementation == "eager" and ours.config._attn_implementation == "eager"
    assert getattr(ours.config, "quantization_config", None) is None


def test_never_uses_transformers_loader_or_quantizer(monkeypatch):
    """The 'kept quantized' host: whatever transformers' loader or FP8 quantizer
    would do, the reference is built without them, by our dequantization."""
    import transformers
    from transformers import DeepseekV4ForCausalLM, PreTrainedModel

    from ds4quant.sources.official import ENC_FP4, ENC_FP8, OfficialSource

    def refuse(*a, **k):
        raise AssertionError("transformers' loader/quantizer was used")

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr(DeepseekV4ForCausalLM, "from_pretrained", classmethod(refuse))
    import transformers.quantizers.auto as qauto

    monkeypatch.setattr(qauto.AutoHfQuantizer, "from_config", classmethod(refuse))
    monkeypatch.setattr(qauto.AutoHfQuantizer, "from_pretrained", classmethod(refuse))
    decoded: list[str] = []
    orig = OfficialSource.read_dequantized

    def counting(self, name):
        decoded.append(name)
        return orig(self, name)

    monkeypatch.setattr(OfficialSource, "read_dequantized", counting)
    model = load_reference(SAMPLES[0], threads=1)
    from ds4quant.sources import open_source

    with open_source(SAMPLES[0]) as src:
        quantized = {n for n in src.weight_names() if src.info(n).encoding in (ENC_FP4, ENC_FP8)}
        n_fp4 = sum(src.info(n).encoding == ENC_FP4 for n in quantized)
    assert quantized and n_fp4 and quantized <= set(decoded)
    assert isinstance(model, transformers.DeepseekV4ForCausalLM)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # the experts hold exactly our FP4 decode of expert 5's w1 in layer 2
    with open_source(SAMPLES[0]) as src:
        w1 = src.read_dequantized("layers.2.ffn.experts.5.w1.weight")
    inter = model.config.moe_intermediate_size
    assert np.array_equal(model.model.layers[2].mlp.experts.gate_up_proj[5, :inter].detach().numpy(), w1)
