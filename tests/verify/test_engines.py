"""verify --fidelity --engine: the refusals before anything runs, and the llama.cpp adapter's glue.

llama-cpp-python itself is exercised by tests/interop (scripts/interop.sh); here a stand-in with
llama_cpp.Llama's surface (reset, eval, scores, n_tokens) wraps a small torch model, so the
adapter must give exactly that model's logits, greedy response and exact-copy score.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ds4quant.errors import BadInputError
from ds4quant.verify import engines as E

torch = pytest.importorskip("torch")


class Toy(torch.nn.Module):
    """A causal LM: logits at t depend on tokens 0..t (a running mean of embeddings)."""

    def __init__(self, vocab: int = 300, dim: int = 16):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.emb = torch.nn.Parameter(torch.randn(vocab, dim, generator=g))
        self.out = torch.nn.Parameter(torch.randn(dim, vocab, generator=g))

    def forward(self, ids, use_cache=False):
        h = self.emb[ids].cumsum(1) / torch.arange(1, ids.shape[1] + 1).view(1, -1, 1)
        return SimpleNamespace(logits=(h @ self.out).float())

    def generate(self, ids, max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=None, **_):
        seq = ids[0].tolist()
        for _ in range(max_new_tokens):
            nxt = int(self(torch.tensor([seq])).logits[0, -1].argmax())
            seq.append(nxt)
            if nxt == eos_token_id:
                break
        return torch.tensor([seq])


class FakeLlama:
    """llama_cpp.Llama's evaluation surface over a torch model (logits_all=True)."""

    def __init__(self, model, n_ctx: int = 512):
        self.model, self.tokens, self.scores = model, [], np.zeros((n_ctx, model.out.shape[1]), np.float32)

    @property
    def n_tokens(self):
        return len(self.tokens)

    def reset(self):
        self.tokens = []

    def eval(self, tokens):
        self.tokens += list(tokens)
        with torch.no_grad():
            self.scores[: len(self.tokens)] = self.model(torch.tensor([self.tokens])).logits[0].numpy()


def test_adapter_gives_the_engine_logits_greedy_and_exact_copy():
    from ds4quant.runtime import fidelity as fd
    from ds4quant.verify import _candidate as C

    toy = Toy()
    lm = E.LlamaCppLM(FakeLlama(toy))
    seqs = [[1, 5, 9, 200, 3], [4, 4, 17]]
    got = C.logits_of(lm, seqs, 0)
    want = C.logits_of(toy, seqs, 0)
    for i, s in enumerate(seqs):  # the positions fidelity reads (rows never see each other; a batched
        # product and a one-row product round differently in the last bits)
        assert torch.allclose(got[i, :len(s)], want[i, :len(s)], rtol=1e-5, atol=1e-5)
    assert fd.greedy_response(lm, [1, 2, 3], 12, eos_token_id=299) == fd.greedy_response(toy, [1, 2, 3], 12, 299)
    tok = fd.ByteTokenizer()
    a, b = fd.exact_copy(lm, tok), fd.exact_copy(toy, tok)
    assert (a.passes, a.trials) == (b.passes, b.trials) and a.trials == 60


def test_the_engine_runs_the_same_identifier_sets_as_the_reference(monkeypatch):
    """measure_engine's exact copy, given the source's sets: the same seeded sets on the engine
    (a stand-in over the toy model), the pooled score and interval beside the source's."""
    import contextlib

    from ds4quant.runtime import fidelity as fd
    from ds4quant.runtime.copy_sets import copy_sets

    toy = Toy()
    tok = fd.ByteTokenizer()
    ref_sets, ref = copy_sets(toy, tok, fd.ECHO, 3)
    monkeypatch.setattr(E, "open_llama", lambda view: contextlib.nullcontext(E.LlamaCppLM(FakeLlama(toy))))
    seqs = [[1, 5, 9, 200, 3]]
    ref_logits = toy(torch.tensor(seqs)).logits[0, :4].detach()
    rows, cols = np.zeros(4, dtype=np.int64), np.arange(4)
    fig = E.measure_engine(None, "llama.cpp", ref_logits, rows, cols, np.array(seqs[0][1:5]), seqs, 0, [1, 2, 3], tok,
                           fd.ECHO, "exact-copy", 4, ref.passes, "0" * 64, ref_sets)
    ec = fig.exact_copy
    assert ec.sets == ref_sets.passes and ec.reference_sets == ref_sets.passes and len(ec.sets) == 3
    assert ec.per60 == ref_sets.per60 and ec.interval == ref_sets.interval and ec.passes == ref.passes
    one = E.measure_engine(None, "llama.cpp", ref_logits, rows, cols, np.array(seqs[0][1:5]), seqs, 0, [1, 2, 3], tok,
                           fd.ECHO, "exact-copy", 4, ref.passes, "0" * 64)
    assert one.exact_copy.sets == () and one.exact_copy.passes == ref.passes  # no sets given: the protocol's own


def test_engines_are_refused_before_anything_runs(monkeypatch):
    view = SimpleNamespace(runtimes=("ds4quant", "lucebox"), layout=SimpleNamespace(path="out/a"),
                           runtimes_excluded={"llama.cpp": ("deepseek4.hyper_connection.count = 2: llama.cpp's "
                                                            "graph asserts 4",)})
    with pytest.raises(BadInputError, match="unknown engine"):
        E.check_engines(view, ("vllm",))
    monkeypatch.setattr(E.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(BadInputError, match="not installed") as e:
        E.check_engines(view, ("llama.cpp",))
    assert "scripts/interop.sh" in e.value.one_line()
    monkeypatch.setattr(E.importlib.util, "find_spec", lambda name: object())
    with pytest.raises(BadInputError, match="hyper_connection.count = 2"):
        E.check_engines(view, ("llama.cpp",))
    E.check_engines(SimpleNamespace(runtimes=("ds4quant", "llama.cpp")), ("llama.cpp",))


def test_verify_needs_fidelity_for_an_engine(tmp_path):
    from ds4quant.verify import verify

    with pytest.raises(BadInputError, match="--engine"):
        verify(tmp_path, engines=("llama.cpp",))
