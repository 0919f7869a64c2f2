"""llama.cpp's KL figures on a hand-computed example, its chunking and its base quantization."""

import math

import numpy as np
import pytest

from ds4quant.errors import BadInputError
from ds4quant.runtime import kl_figures as K


def _hand():
    ref = np.log(np.array([[0.5, 0.25, 0.25], [0.2, 0.3, 0.5]]))
    cand = np.log(np.array([[0.25, 0.5, 0.25], [0.2, 0.3, 0.5]])) + 3.0  # logits: any shift
    return ref, cand, np.array([0, 2])


def test_hand_computed_example():
    ref, cand, targets = _hand()
    s = K.kl_summary(ref, cand, targets)
    ln2 = math.log(2)
    assert s.tokens == 2
    assert s.kld_mean == pytest.approx(0.125 * ln2, abs=1e-12)
    assert s.kld_median == pytest.approx(0.125 * ln2, abs=1e-12)  # even count: mean of the middle two
    assert s.kld_max == pytest.approx(0.25 * ln2, abs=1e-12)
    assert s.kld_p99 == pytest.approx(0.99 * 0.25 * ln2, abs=1e-12)  # linear at 0.99 * (n - 1)
    assert s.same_top1 == 0.5
    assert s.rms_dp == pytest.approx(math.sqrt(0.25 ** 2 / 2), abs=1e-12)
    assert s.ppl_ref == pytest.approx(2.0, abs=1e-12)
    assert s.ppl_cand == pytest.approx(math.sqrt(8.0), abs=1e-12)
    assert s.ppl_ratio == pytest.approx(math.sqrt(2.0), abs=1e-12)


def test_delta_p_sign_and_identity():
    ref, cand, targets = _hand()
    tf = K.token_figures(ref, cand, targets)
    assert tf.p_diff.tolist() == pytest.approx([-0.25, 0.0], abs=1e-12)  # candidate minus reference
    same = K.kl_summary(ref, ref, targets)
    assert same.kld_max == 0.0 and same.same_top1 == 1.0 and same.rms_dp == 0.0 and same.ppl_ratio == 1.0


def test_terms_below_the_floor_are_left_out():
    # reference log-prob -20 on token 1: llama.cpp leaves that KLD term out
    ref = np.array([[0.0, -20.0]])
    cand = np.array([[0.0, 0.0]])
    lp = K.log_softmax(ref)[0]
    want = math.exp(lp[0]) * (lp[0] - math.log(0.5))
    assert K.kl_summary(ref, cand, [0]).kld_mean == pytest.approx(want, abs=1e-12)


def test_top1_ties_take_the_first_index():
    ref = np.array([[1.0, 1.0, 0.0]])
    assert K.kl_summary(ref, np.array([[2.0, 2.0, 0.0]]), [0]).same_top1 == 1.0
    assert K.kl_summary(ref, np.array([[1.0, 2.0, 0.0]]), [0]).same_top1 == 0.0


def test_percentile_and_median_definitions():
    v = np.array([4.0, 1.0, 3.0, 2.0, 10.0])
    assert K.median(v) == 3.0
    assert K.percentile(v, 0.5) == 3.0
    assert K.percentile(v, 0.9) == pytest.approx(4.0 + 0.6 * 6.0)
    assert K.percentile(v, 0.0) == 1.0 and K.percentile(v, 1.0) == 10.0


def test_chunking_as_llama_cpp():
    toks = list(range(10, 33))  # 23 tokens, n_ctx 8 -> 2 chunks (the tail is dropped)
    ch = K.chunks(toks, 8, bos_id=1)
    assert ch == [[1] + list(range(11, 18)), [1] + list(range(19, 26))]
    assert list(K.scored_positions(8)) == [4, 5, 6]  # n_ctx - 1 - n_ctx // 2 tokens
    assert K.chunks(toks, 8, None)[1][0] == 18
    with pytest.raises(BadInputError, match="at least 16"):
        K.chunks(toks[:15], 8, 1)


def test_quantized_base_error_is_tiny():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 4, size=(16, 300)).astype(np.float32)
    err = K.storage_error(logits)
    assert 0 < err < 2e-4  # scale / 2 <= 8 / 65535 plus float32 rounding
    q = K.quantize_log_probs(logits)
    assert q.q.dtype == np.uint16 and q.scale.dtype == np.float32
    assert (q.argmax() == logits.argmax(-1)).all()
    cand = logits + rng.normal(0, 0.3, size=logits.shape).astype(np.float32)
    exact = K.kl_summary(logits, cand, logits.argmax(-1))
    stored = K.kl_summary(q, cand, logits.argmax(-1))
    assert abs(exact.kld_mean - stored.kld_mean) < 1e-3 * exact.kld_mean
    assert abs(exact.rms_dp - stored.rms_dp) < 1e-3 and exact.same_top1 == stored.same_top1
