"""Teacher-forced exact-copy equals token-by-token greedy decoding, trial for trial,
with the CSA indexer's ties broken by position (runtime/indexer_ties.py)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ds4quant.runtime import fidelity as fd  # noqa: E402
from ds4quant.runtime.indexer_ties import stable_indexer  # noqa: E402

COPY = Path(__file__).resolve().parents[2] / "samples" / "ds4-copy"


@pytest.fixture(scope="module")
def copy_model():
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    m = transformers.DeepseekV4ForCausalLM.from_pretrained(str(COPY), dtype=torch.float32,
                                                           experts_implementation="eager").eval()
    return m, transformers.AutoTokenizer.from_pretrained(str(COPY)), fd.CopyTask.from_json(COPY / "task.json")


@pytest.fixture(scope="module")
def tied_model(copy_model):
    """Every CSA index score zero: each query's choice among compressed entries is all ties."""
    import copy

    m = copy.deepcopy(copy_model[0])
    n = 0
    for mod in m.modules():
        if type(mod).__name__ == "DeepseekV4IndexerScorer":
            mod.weights_proj.weight.data.zero_()
            n += 1
    assert n > 0
    return m


def _pairs(res):
    return [(f.identifier, f.repeat, f.position, f.preferred) for f in res.failures]


@pytest.mark.parametrize("which", ["source", "tied"])
def test_teacher_forced_agrees_with_generation_trial_for_trial(copy_model, tied_model, which):
    model, tok, task = copy_model
    if which == "tied":
        model = tied_model
    tf = fd.exact_copy(model, tok, task, n=6)
    gen = fd.exact_copy(model, tok, task, n=6, generate=True)
    assert tf.trials == gen.trials == 18
    assert tf.passes == gen.passes and _pairs(tf) == _pairs(gen)
    for f in tf.failures:  # the first diverging position and the token preferred there
        trial = next(t for t in fd.protocol_trials(task, n=6) if (t.identifier, t.repeat) == (f.identifier, f.repeat))
        _, answer = fd.trial_ids(fd.as_tokenizer(tok), trial)
        assert 0 <= f.position < len(answer) and f.preferred != answer[f.position]


def test_the_tie_break_makes_a_prefix_independent_of_what_follows(copy_model, tied_model):
    _, tok, task = copy_model
    p, a = fd.trial_ids(fd.as_tokenizer(tok), fd.protocol_trials(task)[0])
    with torch.no_grad():
        def gap(ctx):
            with ctx as _:
                full = tied_model(torch.tensor([p + a]), use_cache=False).logits[0, :len(p)]
                short = tied_model(torch.tensor([p]), use_cache=False).logits[0]
            return float((full - short).abs().max())

        assert gap(contextlib.nullcontext()) > 1e-3  # transformers' topk: the trap
        with stable_indexer(tied_model) as ties:
            assert gap(contextlib.nullcontext()) < 1e-4
        assert ties.queries > 0


def test_untied_choices_are_bit_identical(copy_model):
    model, tok, task = copy_model
    ids = torch.tensor([fd.trial_ids(fd.as_tokenizer(tok), fd.protocol_trials(task)[1])[0][:8]])
    with torch.no_grad():
        plain = model(ids, use_cache=False).logits
        with stable_indexer(model) as ties:
            stable = model(ids, use_cache=False).logits
    if ties.queries == 0:
        assert torch.equal(plain, stable)
