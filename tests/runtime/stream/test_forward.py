"""The layer-streamed forward gives the whole-model reference's logits, bit for bit.

Both samples, one torch thread, sequences one per batch (calibrate's way) and
right-padded together (verify's way); the observer sees every layer, batch and
routed-experts call, with the same expert inputs the whole model's experts get.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ds4quant.errors import BadInputError  # noqa: E402
from ds4quant.runtime.reference import capture_experts, load_reference, torch_threads  # noqa: E402
from ds4quant.runtime.stream import (  # noqa: E402
    MemmapStore, Observer, SourceWeights, StreamedModel, expert_rows, stream_forward,
)

ROOT = Path(__file__).resolve().parents[3]
SAMPLES = [ROOT / "samples" / "ds4-tiny", ROOT / "samples" / "ds4-copy"]


def _seqs(vocab: int) -> list:
    rng = np.random.default_rng(3)
    return [[int(t) for t in rng.integers(3, vocab, n)] for n in (40, 33, 17)]


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
def test_streamed_logits_bit_identical(sample, tmp_path):
    with torch_threads(1):
        ref = load_reference(sample)
        seqs = _seqs(ref.config.vocab_size)
        pad = ref.config.pad_token_id
        with torch.no_grad():
            alone = [ref(torch.tensor([s]), use_cache=False).logits for s in seqs]
            ids = torch.full((len(seqs), max(map(len, seqs))), pad)
            for j, s in enumerate(seqs):
                ids[j, :len(s)] = torch.tensor(s)
            together = ref(ids, use_cache=False).logits
        with SourceWeights(sample) as w:
            sm = StreamedModel(w)
            got = stream_forward(sm, sm.batches(seqs))
            got_b = stream_forward(sm, sm.batches(seqs, batch_size=3), store=MemmapStore(tmp_path / "work"))
    assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(alone, got))
    assert torch.equal(together, got_b[0])


class _Seen(Observer):
    def __init__(self):
        self.events = []
        self.calls = []

    def on_layer_start(self, layer, module):
        self.events.append(("start", layer, type(module).__name__))

    def on_batch_start(self, layer, index, batch, hidden):
        self.events.append(("in", layer, index, tuple(hidden.shape)))

    def on_experts(self, layer, index, experts, hidden, top_k_index, top_k_weights):
        rows = expert_rows(experts, hidden, top_k_index.transpose(0, 1), int(top_k_index[0, 0]))
        self.calls.append((layer, index, hidden.clone(), top_k_index.clone(), top_k_weights.clone(), rows[3]))

    def on_layer_end(self, layer, module):
        self.events.append(("end", layer))

    def on_logits(self, index, batch, logits):
        self.events.append(("logits", index, tuple(logits.shape)))


def test_observer_sees_what_the_whole_model_experts_see():
    sample = SAMPLES[0]
    with torch_threads(1):
        ref = load_reference(sample)
        seqs = _seqs(ref.config.vocab_size)[:2]
        with capture_experts(ref) as cap, torch.no_grad():
            for s in seqs:
                ref(torch.tensor([s]), use_cache=False)
        obs = _Seen()
        with SourceWeights(sample) as w:
            sm = StreamedModel(w)
            assert stream_forward(sm, sm.batches(seqs), observer=obs, keep_logits=False) is None
    n_layer, hc, hidden = ref.config.num_hidden_layers, ref.config.hc_mult, ref.config.hidden_size
    assert obs.events[0] == ("start", 0, "DeepseekV4DecoderLayer")
    assert obs.events[1] == ("in", 0, 0, (1, 40, hc, hidden))
    assert [e for e in obs.events if e[0] == "end"] == [("end", L) for L in range(n_layer)]
    assert obs.events[-2:] == [("logits", 0, (1, 40, ref.config.vocab_size)),
                               ("logits", 1, (1, 33, ref.config.vocab_size))]
    # whole model: sequence-major; streamed: layer-major. Same calls, same bits.
    whole = {(c.layer, i // n_layer): c for i, c in enumerate(cap.calls)}
    assert len(obs.calls) == len(cap.calls) == n_layer * 2
    for layer, index, h, idx, wts, act in obs.calls:
        c = whole[(layer, index)]
        assert torch.equal(h, c.hidden) and torch.equal(idx, c.top_k_index) and torch.equal(wts, c.top_k_weights)
        e = int(idx[0, 0])
        with torch.no_grad(), torch_threads(1):
            ref_act = expert_rows(ref.model.layers[layer].mlp.experts, c.hidden, c.top_k_index.transpose(0, 1), e)[3]
        assert torch.equal(act, ref_act)


def test_refusals():
    with SourceWeights(SAMPLES[0]) as w:
        with pytest.raises(BadInputError, match="device must be cpu, cuda or cuda:N"):
            StreamedModel(w, device="tpu")
        sm = StreamedModel(w)
        with pytest.raises(BadInputError, match="token id 512 is outside 0..511"):
            sm.batches([[1, 512]])
        with pytest.raises(BadInputError, match="layer 9 is outside 0..3"):
            with sm.layer(9):
                pass
        if not torch.cuda.is_available():
            with pytest.raises(BadInputError, match="no CUDA device"):
                StreamedModel(w, device="cuda:0")


def test_eager_experts_and_repeated_layer_calls():
    """Within one materialized layer: run it twice, with the experts swapped for an
    EagerExperts over the same decoded stacks in between: the same bits each time."""
    from ds4quant.runtime.stream import EagerExperts

    with torch_threads(1), SourceWeights(SAMPLES[0]) as w:
        sm = StreamedModel(w, threads=1)
        batch = sm.batches([_seqs(512)[0]])[0]
        h = sm.embed(batch)
        with sm.layer(2) as layer:
            first = sm.run_layer(layer, batch, h)
            src = layer.mlp.experts
            pairs = [src.expert_weights(e) for e in range(src.num_experts)]
            layer.mlp.experts = EagerExperts(torch.stack([g for g, _ in pairs]), torch.stack([d for _, d in pairs]),
                                             src.act_fn, src.limit)
            second = sm.run_layer(layer, batch, h.clone())
            layer.mlp.experts = src
        assert torch.equal(first, second)
        with pytest.raises(BadInputError, match="expert stacks must be"):
            EagerExperts(torch.zeros(2, 4, 3), torch.zeros(3, 3, 2), src.act_fn, 10.0)


def test_bounded_expert_cache_changes_nothing_but_decodes():
    with torch_threads(1), SourceWeights(SAMPLES[0]) as w:
        sm = StreamedModel(w, threads=1)
        bs = sm.batches(_seqs(512)[:2])
        out, decoded = {}, {}
        one = w.expert_bytes(2)
        for cache in (None, 0, 3 * one):
            with sm.layer(2, expert_cache=cache) as layer:
                out[cache] = [sm.run_layer(layer, b, sm.embed(b)) for b in bs]
                decoded[cache] = layer.mlp.experts.decoded
                kept = len(layer.mlp.experts._cache)
                assert kept == {None: layer.mlp.experts.decoded, 0: 0}.get(cache, 3)
        assert all(torch.equal(a, b) for c in (0, 3 * one) for a, b in zip(out[None], out[c]))
        reached = decoded[None]  # each reached expert decoded once
        assert 4 < reached <= 16 and reached < decoded[3 * one] < decoded[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
def test_a_gpu_layer_decodes_its_experts_there_to_the_same_bits(sample):
    """On a GPU, FP4 experts travel encoded and are decoded there to the host decode's
    bits; kept as bfloat16 they widen back to the same float32, so a layer gives the same
    output whether its experts are kept or decoded again on every call."""
    with SourceWeights(sample) as w:
        sm = StreamedModel(w, device="cuda")
        L = w.n_layers - 1
        for e in (0, int(w.config.n_routed_experts) - 1):
            host, dev = w.expert_weights(L, e), w.expert_weights(L, e, "cuda")
            assert all(torch.equal(a, b.cpu()) for a, b in zip(host, dev))
        bs = sm.batches(_seqs(int(w.config.vocab_size))[:2])
        out = {}
        for cache in (None, 0):
            with sm.layer(L, expert_cache=cache) as layer:
                out[cache] = [sm.run_layer(layer, b, sm.embed(b)) for b in bs]
                kept = list(layer.mlp.experts._cache.values())
                if cache is None:
                    assert kept and all(t.dtype == (torch.bfloat16 if w.experts_fp4(L) else torch.float32)
                                        and t.device.type == "cuda" for pair in kept for t in pair)
        assert all(torch.equal(a, b) for a, b in zip(out[None], out[0]))
