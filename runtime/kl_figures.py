"""KL figures defined as llama.cpp's perplexity tool defines them.

A user puts a ds4quant artifact on the same ladder as GGUF quants measured with
``llama-perplexity --kl-divergence-base`` / ``--kl-divergence`` only when every
figure means the same thing. The definitions (docs/fidelity-figures.md):

- chunking: the token stream (tokenized once, BOS first) is cut into
  ``len // n_ctx`` chunks of ``n_ctx`` tokens; each chunk's first token is
  replaced by BOS; only the second half is scored: the logits at positions
  ``n_ctx // 2 .. n_ctx - 2`` predict the tokens after them
  (``n_ctx - 1 - n_ctx // 2`` tokens per chunk). At least ``2 * n_ctx`` tokens.
- the reference's per-token log-probabilities are stored as uint16 with a
  per-token float32 scale and minimum (``quantize_log_probs``): the range kept
  is the 16 nats below the top logit; anything lower reads as that floor.
- KLD per token: sum over the vocabulary of p_ref * (log p_ref - log p_cand),
  with terms whose reference log-prob is at most -16 left out.
- same top-1: the candidate's argmax equals the reference's (first index on ties).
- Δp: the candidate's probability of the correct next token minus the
  reference's; RMS Δp = sqrt(mean Δp²).
- PPL: exp(mean negative log-likelihood of the correct next token), for both;
  the ratio is exp(mean nll_cand - mean nll_ref).
- median: the mean of the two middle values for an even count; percentiles
  interpolate linearly at ``fraction * (n - 1)`` of the sorted values.

numpy only; logits may be any array-like (a torch tensor is converted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ds4quant.errors import BadInputError
from ds4quant.records import KlFigures

LOG_PROB_RANGE = 16.0  # nats kept below the top logit, and the KLD term floor
LEVELS = 65535  # uint16 steps over that range


def chunks(tokens: Sequence[int], n_ctx: int, bos_id: Optional[int]) -> list[list[int]]:
    """llama.cpp's chunks of a token stream: ``len // n_ctx`` chunks, each one's
    first token replaced by ``bos_id`` (when not None)."""
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 4:
        raise BadInputError(f"context size must be an int >= 4, got {n_ctx!r}", where="--ctx")
    toks = list(tokens)
    if len(toks) < 2 * n_ctx:
        raise BadInputError(f"{len(toks)} tokens; a context of {n_ctx} needs at least {2 * n_ctx} "
                            "(two chunks, as llama.cpp's perplexity tool)", where="--ctx")
    out = []
    for i in range(len(toks) // n_ctx):
        c = toks[i * n_ctx:(i + 1) * n_ctx]
        if bos_id is not None:
            c[0] = bos_id
        out.append(c)
    return out


def scored_positions(n_ctx: int) -> range:
    """Positions of a chunk whose logits are scored (each predicts the next token)."""
    return range(n_ctx // 2, n_ctx - 1)


def _as2d(x) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().double().numpy()
    a = np.asarray(x, dtype=np.float64)
    return a.reshape(-1, a.shape[-1])


def log_softmax(logits) -> np.ndarray:
    """float64 log-probabilities [N, V] of logits (..., V)."""
    x = _as2d(logits)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@dataclass(frozen=True)
class QuantizedLogProbs:
    """Per-token log-probabilities as llama.cpp's KL base stores them:
    log p[i] = scale * q[i] + min_log_prob (float32 scale/min, uint16 q)."""

    scale: np.ndarray  # float32 [N]
    min_log_prob: np.ndarray  # float32 [N]
    q: np.ndarray  # uint16 [N, V]

    def log_probs(self) -> np.ndarray:
        return self.scale.astype(np.float64)[:, None] * self.q + self.min_log_prob.astype(np.float64)[:, None]

    def argmax(self) -> np.ndarray:
        return self.q.argmax(-1)


def quantize_log_probs(logits) -> QuantizedLogProbs:
    """The per-token uint16 quantization (see the module doc). Storage error: at
    most scale/2 <= 8/65535 (1.3e-4 nats) on every log-prob kept, plus float32
    rounding of the per-token minimum; log-probs more than 16 nats below the top
    read as the floor (probability below 1.2e-7 of the top token's)."""
    x = _as2d(logits).astype(np.float32)
    mx = x.max(-1)
    mn = np.maximum(x.min(-1), mx - np.float32(LOG_PROB_RANGE))
    lse = np.log(np.exp((x - mx[:, None]).astype(np.float64)).sum(-1)).astype(np.float32)
    min_log_prob = (mn - mx - lse).astype(np.float32)
    scale = ((mx - mn) / np.float32(LEVELS)).astype(np.float32)
    q = np.zeros(x.shape, dtype=np.uint16)
    nz = scale > 0
    if nz.any():
        v = (x[nz] - mn[nz, None]) / scale[nz, None]
        q[nz] = np.where(x[nz] > mn[nz, None], np.clip(np.rint(v), 0, LEVELS), 0).astype(np.uint16)
    return QuantizedLogProbs(scale, min_log_prob, q)


def storage_error(logits) -> float:
    """Largest |stored - exact| log-prob over the kept range (nats) for ``logits``."""
    exact = log_softmax(logits)
    got = quantize_log_probs(logits).log_probs()
    keep = exact > exact.max(-1, keepdims=True) - LOG_PROB_RANGE
    return float(np.abs(got - exact)[keep].max())


@dataclass(frozen=True)
class TokenFigures:
    """Per scored token: KLD, Δp, whether top-1 agrees, and both NLLs."""

    kld: np.ndarray
    p_diff: np.ndarray
    same_top: np.ndarray
    nll_cand: np.ndarray
    nll_ref: np.ndarray


def token_figures(reference, cand_logits, targets) -> TokenFigures:
    """Per-token figures. ``reference``: a QuantizedLogProbs (a stored base) or
    reference logits [N, V] (then its exact log-softmax is the base)."""
    if isinstance(reference, QuantizedLogProbs):
        lp, top_ref = reference.log_probs(), reference.argmax()
    else:
        lp = log_softmax(reference)
        top_ref = lp.argmax(-1)
    lq = log_softmax(cand_logits)
    t = np.asarray(targets.cpu() if hasattr(targets, "cpu") else targets, dtype=np.int64).reshape(-1)
    if lp.shape != lq.shape or t.shape[0] != lp.shape[0]:
        raise BadInputError(f"reference {lp.shape}, candidate {lq.shape} and {t.shape[0]} targets do not line up")
    if lp.shape[0] == 0:
        raise BadInputError("KL figures need at least one token")
    keep = lp > -LOG_PROB_RANGE
    kld = np.where(keep, np.exp(lp) * (lp - lq), 0.0).sum(-1)
    rows = np.arange(t.shape[0])
    nll_ref, nll_cand = -lp[rows, t], -lq[rows, t]
    p_diff = np.exp(-nll_cand) - np.exp(-nll_ref)
    return TokenFigures(kld, p_diff, lq.argmax(-1) == top_ref, nll_cand, nll_ref)


def percentile(values: np.ndarray, fraction: float) -> float:
    """Linear interpolation at fraction * (n - 1) of the sorted values."""
    v = np.sort(np.asarray(values, dtype=np.float64))
    if fraction <= 0:
        return float(v[0])
    if fraction >= 1:
        return float(v[-1])
    p = fraction * (len(v) - 1)
    i = int(p)
    p -= i
    return float((1 - p) * v[i] + p * v[min(i + 1, len(v) - 1)])


def median(values: np.ndarray) -> float:
    v = np.sort(np.asarray(values, dtype=np.float64))
    n = len(v)
    return float(v[n // 2]) if n % 2 else float(0.5 * (v[n // 2] + v[n // 2 - 1]))


def summarise(tf: TokenFigures, chunking: str = "every next token") -> KlFigures:
    """The figures over all scored tokens (shares as fractions, KLD in nats);
    chunking: which tokens were scored, in words."""
    return KlFigures(int(tf.kld.shape[0]), float(tf.kld.mean()), median(tf.kld), percentile(tf.kld, 0.99),
                     float(tf.kld.max()), float(tf.same_top.mean()), float(np.sqrt((tf.p_diff ** 2).mean())),
                     float(np.exp(tf.nll_ref.mean())), float(np.exp(tf.nll_cand.mean())), chunking)


def kl_summary(reference, cand_logits, targets, chunking: str = "every next token") -> KlFigures:
    """``summarise(token_figures(...), chunking)``."""
    return summarise(token_figures(reference, cand_logits, targets), chunking)
