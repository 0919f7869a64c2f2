"""The exact-copy protocol and the logit metrics (runtime/fidelity.py).

What users rely on: the protocol's 60 trials are fixed by a seed and put each
identifier in three different contexts; a model that copies (samples/ds4-copy,
loaded from its FP4 source) scores >= 59/60 and one that cannot (the random
samples/ds4-tiny) about 0/60; the teacher-forced check agrees with greedy
decoding; the metrics give the KL / top-1 / perplexity of hand-made logits.
"""

from __future__ import annotations

import hashlib
import math
import random
from pathlib import Path

import numpy as np
import pytest

from ds4quant.errors import BadInputError
from ds4quant.runtime import fidelity as fd

ROOT = Path(__file__).resolve().parents[2]
COPY = ROOT / "samples" / "ds4-copy"
TINY = ROOT / "samples" / "ds4-tiny"

torch = pytest.importorskip("torch")


# ---------------------------------------------------------------- protocol shape


def test_protocol_is_20_identifiers_by_3_distinct_contexts_and_fixed_by_its_seed():
    trials = fd.protocol_trials()
    assert len(trials) == 60
    idents = [t.identifier for t in trials]
    assert len(set(idents)) == 20 and idents == [x for x in fd.protocol_identifiers() for _ in range(3)]
    for i in range(0, 60, 3):
        group = trials[i:i + 3]
        assert len({t.prompt for t in group}) == 3  # a repeat in the same context would prove nothing
        for t in group:
            assert t.identifier in t.prompt and t.identifier in t.expected  # plain echo
            assert t.prompt.endswith("# " + fd.ECHO.instruction + "\n>>> ")
            assert (">>> " + t.expected + "\n") in t.prompt
    assert fd.protocol_trials() == trials
    assert fd.protocol_trials(seed=fd.PROTOCOL_SEED + 1) != trials


def test_substitution_task_is_keyed_by_the_previous_character_and_round_trips_json(tmp_path):
    task = fd.CopyTask.substitution(3, "abc_")
    n = len(task.alphabet)
    # first character: the "no previous character" row; '=' and ' ' are copied
    line = "ab = ba_"
    got = task.transform(line)
    start = task.rows[n]
    assert got[0] == start[0]
    assert got[1] == task.rows[0][1]  # 'b' after 'a'
    assert got[2:5] == " = "
    assert got[5] == start[1] and got[6] == task.rows[1][0] and got[7] == task.rows[0][3]
    p = tmp_path / "task.json"
    p.write_text(__import__("json").dumps(task.to_json()))
    assert fd.CopyTask.from_json(p) == task
    assert fd.ECHO.transform(line) == line


def test_copy_task_refuses_rows_that_are_not_permutations():
    with pytest.raises(BadInputError, match="not a permutation"):
        fd.CopyTask("bad", "x", "ab", ("ab", "aa", "ba"))
    with pytest.raises(BadInputError, match="3 rows"):
        fd.CopyTask("bad", "x", "abc", ("abc", "bca", "cab"))


def test_the_training_corpus_excludes_the_protocol_identifiers(monkeypatch):
    import sys

    sys.path.insert(0, str(ROOT / "samples"))
    import train_ds4_copy as tr

    protocol = list(fd.protocol_identifiers())
    fresh = iter(protocol + ["zz_not_protocol_1"] * 1000)
    monkeypatch.setattr(fd, "make_identifier", lambda rng: next(fresh))
    rng = random.Random(0)
    seen = 0
    for _ in range(40):
        ids, _ = tr.make_example(rng, fd.ECHO, frozenset(protocol))
        text = bytes(i - 3 for i in ids if 3 <= i < 259).decode()
        assert not any(x in text for x in protocol)
        seen += "zz_not_protocol_1" in text
    assert seen > 0


# ---------------------------------------------------------------- metrics


def test_kl_top1_and_perplexity_on_hand_made_logits():
    ref = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1], [0.2, 0.8], [0.6, 0.4]], dtype=torch.float64))
    cand = torch.log(torch.tensor([[0.25, 0.75], [0.9, 0.1], [0.7, 0.3], [0.6, 0.4]], dtype=torch.float64))
    kl = fd.kl_per_token(ref, cand)
    want0 = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    want2 = 0.2 * math.log(0.2 / 0.7) + 0.8 * math.log(0.8 / 0.3)
    assert kl.tolist() == pytest.approx([want0, 0.0, want2, 0.0], abs=1e-12)
    targets = torch.tensor([1, 0, 1, 0])
    m = fd.logit_metrics(ref, cand, targets)
    assert m.tokens == 4
    assert m.kl_mean == pytest.approx((want0 + want2) / 4, abs=1e-12)
    assert m.kl_p99 == pytest.approx(float(np.quantile([want0, 0, want2, 0], 0.99)), abs=1e-12)
    # argmax: row 0 tie (index 0) vs 1, rows 1 and 3 agree, row 2 differs
    assert m.top1 == 0.5
    ppl_ref = math.exp(-(math.log(0.5) + math.log(0.9) + math.log(0.8) + math.log(0.6)) / 4)
    ppl_cand = math.exp(-(math.log(0.75) + math.log(0.9) + math.log(0.3) + math.log(0.6)) / 4)
    assert m.ppl_ratio == pytest.approx(ppl_cand / ppl_ref, rel=1e-12)
    same = fd.logit_metrics(ref, ref)
    assert same.kl_mean == 0.0 and same.top1 == 1.0 and math.isnan(same.ppl_ratio)


def test_metrics_accept_batched_logits_and_refuse_none():
    x = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0))
    m = fd.logit_metrics(x, x + 1.0)  # a constant shift changes no distribution
    assert m.tokens == 6 and m.kl_mean == pytest.approx(0.0, abs=1e-12) and m.top1 == 1.0
    with pytest.raises(BadInputError):
        fd.logit_metrics(torch.zeros(0, 4), torch.zeros(0, 4))


def test_response_hash_is_sha256_of_little_endian_int32_ids():
    ids = [0, 1, 258, 70000]
    assert fd.response_hash(ids) == hashlib.sha256(np.array(ids, "<i4").tobytes()).hexdigest()
    assert fd.response_hash([1, 2]) != fd.response_hash([2, 1])


# ---------------------------------------------------------------- on real models


def _load(path):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    return transformers.DeepseekV4ForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, experts_implementation="eager").eval()


@pytest.fixture(scope="module")
def copy_model():
    from transformers import AutoTokenizer

    return _load(COPY), AutoTokenizer.from_pretrained(str(COPY)), fd.CopyTask.from_json(COPY / "task.json")


def test_ds4_copy_copies_from_its_fp4_source(copy_model):
    model, tok, task = copy_model
    res = fd.exact_copy(model, tok, task)
    assert res.trials == 60 and res.passes >= 59, res.failures
    assert res.score == f"{res.passes}/60"
    # a plain echo is not what it was trained for: the harness tells the tasks apart
    assert fd.exact_copy(model, tok, fd.ECHO).passes < 10


def test_teacher_forced_check_agrees_with_greedy_decoding(copy_model):
    model, tok, task = copy_model
    t = fd.as_tokenizer(tok)
    for tr in fd.protocol_trials(task)[:4]:
        prompt, answer = fd.trial_ids(t, tr)
        got = fd.greedy(model, prompt, len(answer), t.eos_token_id)
        assert t.decode(got[:len(answer)]) == tr.expected + "\n"


def test_random_ds4_tiny_cannot_copy_and_its_failures_are_greedy_text():
    model = _load(TINY)
    tok = fd.ByteTokenizer()
    res = fd.exact_copy(model, tok, fd.ECHO)
    assert res.trials == 60 and res.passes <= 2 and len(res.failures) == 60 - res.passes
    f = res.failures[0]
    trial = next(t for t in fd.protocol_trials(fd.ECHO) if t.prompt == f.prompt)
    prompt, answer = fd.trial_ids(tok, trial)
    greedy = tok.decode(fd.greedy(model, prompt, len(answer), tok.eos_token_id))
    # the reported text is greedy's own, up to and including its first wrong token
    assert greedy.startswith(f.got) and f.got != (f.expected + "\n")[:len(f.got)]
