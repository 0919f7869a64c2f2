"""Fidelity figures for a causal LM: the exact-copy protocol and logit metrics.

The exact-copy protocol (docs/usage.md#exact-copy): 20
identifiers x 3 repeats at temperature 0; the model is shown an
identifier-bearing line of Python and asked to repeat it, and a trial passes
only on a verbatim copy. Each repeat puts the same identifier in a different
prompt context (greedy decoding is deterministic, so repeating one prompt would
prove nothing). The identifiers come from a fixed seed; a training corpus must
leave them out (``protocol_identifiers`` gives the set to exclude).

A ``CopyTask`` says what "repeat" means: the plain echo (``ECHO``), or an echo
through a fixed character substitution keyed by the previous source character
(``CopyTask.from_json``: the task of samples/ds4-copy, whose experts store the
substitution table).

Prompt form, one trial::

    <filler lines: "key: value" structured text>
    >>> <the identifier-bearing Python line>
    # <task.instruction>
    >>> <- the model continues here; expected: task.transform(line) + "\\n"

Greedy decoding emits ``expected`` exactly when, fed the prompt followed by
``expected``, the argmax at every answer position is the next expected token
(each greedy step sees the same prefix as the teacher-forced one). The harness
checks that in one batched forward; for a failing trial the reported output is
greedy's own text up to and including its first wrong token, or the whole
greedy continuation with ``generate_failures=True``.

torch/transformers are imported inside the functions that need them.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from ds4quant.errors import BadInputError

PROTOCOL_SEED = 20260805  # DS4.md's measurement date; any fixed value would do
N_IDENTIFIERS = 20
N_REPEATS = 3

_SYLLABLES = ("ka", "lo", "mi", "ru", "ve", "zo", "qua", "ther", "nix", "pol", "dra", "sen", "bu", "fy",
              "gle", "wor", "tam", "ix", "oc", "ul", "jen", "hap", "cor", "vex", "sly", "mun", "trez", "bo")

# Lines the identifier is placed in; "{x}" is the identifier. Every template
# gives a different context for the same identifier.
TEMPLATES = (
    "{x} = {n}",
    "def {x}(a, b):",
    "return {x} + {n}",
    "self.{x} = None",
    "print({x})",
    "for {x} in range({n}):",
    "if {x} > {n}:",
    "import {x}",
    "{x}.append({n})",
    "while not {x}:",
    "assert {x} == {n}",
    "y = {x}[{n}]",
)

_FILLER_KEYS = ("name", "size", "mode", "path", "count", "level", "owner", "kind", "rate", "step")


def make_identifier(rng: random.Random) -> str:
    """A snake_case identifier of 2-3 syllable words, sometimes with digits (8-20 chars)."""
    while True:
        words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(2, 3))]
        if rng.random() < 0.5:
            words[-1] += str(rng.randint(0, 99))
        x = "_".join(words)
        if 8 <= len(x) <= 20:
            return x


def filler_lines(rng: random.Random, k: int) -> list[str]:
    """k lines of simple structured text ("key: value"), never holding '>>>'."""
    out = []
    for _ in range(k):
        key = rng.choice(_FILLER_KEYS)
        if rng.random() < 0.5:
            val = str(rng.randint(0, 9999))
        else:
            val = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9)))
        out.append(f"{key}: {val}")
    return out


def python_line(rng: random.Random, ident: str, template: str) -> str:
    return template.format(x=ident, n=rng.randint(0, 99))


@dataclass(frozen=True)
class CopyTask:
    """What the model is asked to do with the line.

    alphabet / rows: the substitution; a character c at position i of the line
    that is in ``alphabet`` becomes ``rows[r][alphabet.index(c)]`` where r is
    the key of the ``order`` previous characters of the line: each one's
    alphabet index, or ``len(alphabet)`` when there is none or it is outside
    the alphabet, as digits base len(alphabet)+1 (the nearest one last). Other
    characters are copied. With ``rows`` empty the task is the plain echo.
    """

    name: str
    instruction: str
    alphabet: str = ""
    rows: tuple[str, ...] = ()
    order: int = 1

    def __post_init__(self):
        if self.rows:
            want = (len(self.alphabet) + 1) ** self.order
            if len(self.rows) != want:
                raise BadInputError(f"copy task {self.name!r}: {len(self.rows)} rows for an alphabet of "
                                    f"{len(self.alphabet)} at order {self.order} (want {want})")
            for r in self.rows:
                if sorted(r) != sorted(self.alphabet):
                    raise BadInputError(f"copy task {self.name!r}: a row is not a permutation of the alphabet")
        if "\n" in self.instruction:
            raise BadInputError(f"copy task {self.name!r}: the instruction must be one line")

    def transform(self, line: str) -> str:
        if not self.rows:
            return line
        index = {c: i for i, c in enumerate(self.alphabet)}
        base = len(self.alphabet) + 1
        out = []
        for pos, c in enumerate(line):
            i = index.get(c)
            if i is None:
                out.append(c)
                continue
            r = 0
            for back in range(self.order, 0, -1):
                prev = line[pos - back] if pos - back >= 0 else None
                r = r * base + index.get(prev, base - 1)
            out.append(self.rows[r][i])
        return "".join(out)

    def to_json(self) -> dict:
        d = {"schema": "ds4quant.copy-task", "version": 1, "name": self.name, "instruction": self.instruction,
             "alphabet": self.alphabet, "rows": list(self.rows)}
        if self.order != 1:
            d["order"] = self.order
        return d

    @classmethod
    def from_json(cls, path: "str | Path") -> "CopyTask":
        p = Path(path)
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise BadInputError(f"{p}: cannot read the copy task: {e}") from None
        if not isinstance(d, dict) or d.get("schema") != "ds4quant.copy-task" or d.get("version") != 1:
            raise BadInputError(f"{p}: not a ds4quant.copy-task version 1 file")
        return cls(d["name"], d["instruction"], d.get("alphabet", ""), tuple(d.get("rows", ())),
                   int(d.get("order", 1)))

    @classmethod
    def substitution(cls, seed: int, alphabet: str, name: str = "recode", order: int = 1) -> "CopyTask":
        """A seeded substitution: one random permutation of ``alphabet`` per key of ``order`` previous characters."""
        rng = random.Random(f"copy-task/{seed}" if order == 1 else f"copy-task/{seed}/order{order}")
        rows = []
        for _ in range((len(alphabet) + 1) ** order):
            r = list(alphabet)
            rng.shuffle(r)
            rows.append("".join(r))
        return cls(name, "recode the >>> line", alphabet, tuple(rows), order)


ECHO = CopyTask("echo", "repeat the >>> line")


@dataclass(frozen=True)
class Trial:
    identifier: str
    repeat: int
    prompt: str
    expected: str  # without the closing newline


def build_prompt(task: CopyTask, line: str, before: Sequence[str], after: Sequence[str]) -> str:
    parts = list(before) + [">>> " + line] + list(after) + ["# " + task.instruction, ">>> "]
    return "\n".join(parts)


def make_trial(task: CopyTask, rng: random.Random, ident: str, template: str, repeat: int = 0) -> Trial:
    line = python_line(rng, ident, template)
    before = filler_lines(rng, rng.randint(0, 3))
    after = filler_lines(rng, rng.randint(0, 1))
    return Trial(ident, repeat, build_prompt(task, line, before, after), task.transform(line))


def protocol_identifiers(seed: int = PROTOCOL_SEED, n: int = N_IDENTIFIERS) -> tuple[str, ...]:
    rng = random.Random(f"exact-copy/{seed}/identifiers")
    out: list[str] = []
    while len(out) < n:
        x = make_identifier(rng)
        if x not in out:
            out.append(x)
    return tuple(out)


def novel_trials(task: CopyTask, rng: random.Random) -> Iterator[Trial]:
    """Endless seeded trials of ``task`` on identifiers that are not the protocol's
    (calibration and evaluation text must never contain them). The caller may draw
    from ``rng`` between trials: the stream is the one a plain loop would give."""
    banned = set(protocol_identifiers())
    while True:
        ident = make_identifier(rng)
        if ident not in banned:
            yield make_trial(task, rng, ident, rng.choice(TEMPLATES))


def protocol_trials(task: CopyTask = ECHO, seed: int = PROTOCOL_SEED, n: int = N_IDENTIFIERS,
                    repeats: int = N_REPEATS) -> tuple[Trial, ...]:
    """n identifiers x repeats trials; the repeats of one identifier use distinct templates and fillers."""
    rng = random.Random(f"exact-copy/{seed}/contexts")
    trials = []
    for ident in protocol_identifiers(seed, n):
        for r, template in enumerate(rng.sample(TEMPLATES, repeats)):
            trials.append(make_trial(task, rng, ident, template, r))
    return tuple(trials)


# --------------------------------------------------------------------------
# tokenizers


class ByteTokenizer:
    """Bytes as token ids ``offset + byte``; bos/eos ids below the offset.

    For models without a tokenizer (samples/ds4-tiny: vocab 512, 0 bos, 1 eos).
    """

    def __init__(self, offset: int = 3, bos_token_id: int = 0, eos_token_id: int = 1):
        self.offset, self.bos_token_id, self.eos_token_id = offset, bos_token_id, eos_token_id

    def encode(self, text: str) -> list[int]:
        return [self.offset + b for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes to text; bos/eos dropped, any other non-byte id shown as "<id>" (a random
        model emits them, and a failure report must show them)."""
        out, run = [], bytearray()
        for i in ids:
            if self.offset <= i < self.offset + 256:
                run.append(i - self.offset)
                continue
            out.append(run.decode("utf-8", "replace"))
            run = bytearray()
            if i not in (self.bos_token_id, self.eos_token_id):
                out.append(f"<{i}>")
        out.append(run.decode("utf-8", "replace"))
        return "".join(out)


class _HFTokenizer:
    """transformers tokenizer -> encode/decode without added special tokens."""

    def __init__(self, tok):
        self.tok = tok
        self.bos_token_id = tok.bos_token_id
        self.eos_token_id = tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


def as_tokenizer(tok) -> Any:
    """A ByteTokenizer-like object (encode, decode, bos_token_id, eos_token_id) for ``tok``."""
    if isinstance(tok, ByteTokenizer) or isinstance(tok, _HFTokenizer):
        return tok
    return _HFTokenizer(tok)


# --------------------------------------------------------------------------
# the protocol


@dataclass(frozen=True)
class FailedTrial:
    """A trial greedy decoding gets wrong: ``position`` is the index of the first
    answer token that differs, ``preferred`` the token id the model chose there."""

    identifier: str
    repeat: int
    prompt: str
    expected: str
    got: str
    position: int = -1
    preferred: int = -1


@dataclass(frozen=True)
class ExactCopyResult:
    """passes of trials; failures in trial order (got: greedy's text, see the module doc)."""

    task: str
    seed: int
    passes: int
    trials: int
    failures: tuple[FailedTrial, ...] = field(default_factory=tuple)

    @property
    def score(self) -> str:
        return f"{self.passes}/{self.trials}"

    def to_json(self) -> dict:
        return {"task": self.task, "seed": self.seed, "passes": self.passes, "trials": self.trials,
                "failed": [{"identifier": f.identifier, "repeat": f.repeat, "prompt": f.prompt,
                            "expected": f.expected, "got": f.got, "position": f.position,
                            "preferred_token": f.preferred} for f in self.failures]}


def _device_of(model):
    return next(model.parameters()).device


def trial_ids(tok, trial: Trial) -> tuple[list[int], list[int]]:
    """(prompt ids with bos first, answer ids: expected + newline)."""
    t = as_tokenizer(tok)
    prompt = [t.bos_token_id] + t.encode(trial.prompt)
    return prompt, t.encode(trial.expected + "\n")


def check_trials(model, tok, trials: Sequence[Trial], batch: int = 64, pad_id: int = 0):
    """Teacher-forced check: per trial (passed, index of the first wrong answer token, the argmax there)."""
    import torch

    dev = _device_of(model)
    out = []
    for s in range(0, len(trials), batch):
        chunk = trials[s:s + batch]
        pairs = [trial_ids(tok, tr) for tr in chunk]
        width = max(len(p) + len(a) for p, a in pairs)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        for i, (p, a) in enumerate(pairs):
            ids[i, :len(p) + len(a)] = torch.tensor(p + a)
        with torch.no_grad():
            logits = model(ids.to(dev), use_cache=False).logits
        pred = logits.argmax(-1).cpu()
        for i, (p, a) in enumerate(pairs):
            got = pred[i, len(p) - 1:len(p) - 1 + len(a)].tolist()
            wrong = [k for k in range(len(a)) if got[k] != a[k]]
            out.append((not wrong, wrong[0] if wrong else -1, got[wrong[0]] if wrong else -1))
    return out


def greedy(model, prompt_ids: Sequence[int], max_new_tokens: int, eos_token_id: Optional[int] = None) -> list[int]:
    """Greedy continuation token ids (temperature 0), stopping after eos."""
    import torch

    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=_device_of(model))
    with torch.no_grad():
        # the mask says every prompt token is real: generate would otherwise take
        # a prompt token equal to the pad id (bos 0 when no eos is given) for padding
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos_token_id,
                             pad_token_id=eos_token_id if eos_token_id is not None else 0)
    return out[0, ids.shape[1]:].tolist()


def generated_trials(model, tok, trials: Sequence[Trial]):
    """Token-by-token greedy decoding per trial: (passed, first wrong index, the token there)
    as ``check_trials`` reports them (for small models: every step is a forward)."""
    t = as_tokenizer(tok)
    out = []
    for tr in trials:
        prompt, answer = trial_ids(t, tr)
        got = greedy(model, prompt, len(answer), None)
        got = got + [-1] * (len(answer) - len(got))
        wrong = [k for k in range(len(answer)) if got[k] != answer[k]]
        out.append((not wrong, wrong[0] if wrong else -1, got[wrong[0]] if wrong else -1))
    return out


def exact_copy(model, tok, task: CopyTask = ECHO, *, seed: int = PROTOCOL_SEED, n: int = N_IDENTIFIERS,
               repeats: int = N_REPEATS, generate_failures: bool = False, batch: int = 64,
               generate: bool = False) -> ExactCopyResult:
    """Run the exact-copy protocol on a causal LM (``model(ids).logits``; ``generate`` if
    ``generate_failures`` or ``generate``). ``tok``: a transformers tokenizer or a ByteTokenizer.

    Teacher-forced (one forward of prompt + answer per trial) unless ``generate``:
    then every trial is decoded token by token (small models; both agree trial for
    trial, the CSA indexer's ties broken alike: ``indexer_ties.stable_indexer``).

        res = exact_copy(model, AutoTokenizer.from_pretrained(d), CopyTask.from_json(d + "/task.json"))
        print(res.score)  # e.g. "60/60"
    """
    t = as_tokenizer(tok)
    trials = protocol_trials(task, seed, n, repeats)
    with _stable(model):
        if generate:
            checks = generated_trials(model, t, trials)
        else:
            checks = check_trials(model, t, trials, batch=batch, pad_id=t.eos_token_id or 0)
        return copy_result(t, task, seed, trials, checks, generate_failures, model)


def _stable(model):
    """``indexer_ties.stable_indexer`` for a DeepSeek-V4 model; nothing for another."""
    import contextlib

    try:
        from ds4quant.runtime.indexer_ties import stable_indexer

        return stable_indexer(model)
    except ImportError:
        return contextlib.nullcontext()


def copy_result(t, task: CopyTask, seed: int, trials: Sequence[Trial], checks, generate_failures: bool = False,
                model=None) -> ExactCopyResult:
    """The protocol's result from per-trial (passed, first wrong index, the token there);
    ``model`` decodes a failure greedily when ``generate_failures``."""
    failures = []
    for tr, (ok, k, tok_k) in zip(trials, checks):
        if ok:
            continue
        prompt, answer = trial_ids(t, tr)
        if generate_failures:
            got = t.decode(greedy(model, prompt, len(answer) + 4, t.eos_token_id))
        else:
            got = t.decode(answer[:k] + ([tok_k] if tok_k >= 0 else []))
        failures.append(FailedTrial(tr.identifier, tr.repeat, tr.prompt, tr.expected, got, k, tok_k))
    return ExactCopyResult(task.name, seed, len(trials) - len(failures), len(trials), tuple(failures))


# --------------------------------------------------------------------------
# logit metrics


@dataclass(frozen=True)
class LogitMetrics:
    """Candidate vs reference next-token distributions over the same tokens.

    kl_mean / kl_p99: KL(ref || cand) per token in nats; top1: share of tokens
    where both argmaxes agree; ppl_ratio: candidate / reference perplexity of
    the targets (nan when no targets were given).
    """

    tokens: int
    kl_mean: float
    kl_p99: float
    top1: float
    ppl_ratio: float


def _flat(logits):
    import torch

    x = torch.as_tensor(logits).to(torch.float64)
    return x.reshape(-1, x.shape[-1])


def kl_per_token(ref_logits, cand_logits):
    """KL(P_ref || P_cand) per token (float64 tensor, nats); logits (..., vocab)."""
    import torch

    lp = torch.log_softmax(_flat(ref_logits), -1)
    lq = torch.log_softmax(_flat(cand_logits), -1)
    return (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)


def top1_agreement(ref_logits, cand_logits) -> float:
    return float((_flat(ref_logits).argmax(-1) == _flat(cand_logits).argmax(-1)).to(float).mean())


def perplexity(logits, targets) -> float:
    """exp(mean NLL) of ``targets`` (..., int) under ``logits`` (..., vocab)."""
    import torch

    lp = torch.log_softmax(_flat(logits), -1)
    t = torch.as_tensor(targets).reshape(-1).long()
    return float(torch.exp(-lp[torch.arange(t.numel()), t].mean()))


def logit_metrics(ref_logits, cand_logits, targets=None) -> LogitMetrics:
    """KL mean/p99, top-1 agreement and perplexity ratio (see LogitMetrics)."""
    import torch

    kl = kl_per_token(ref_logits, cand_logits)
    if kl.numel() == 0:
        raise BadInputError("logit metrics need at least one token")
    p99 = float(torch.quantile(kl, 0.99)) if kl.numel() > 1 else float(kl[0])
    ratio = float("nan") if targets is None else perplexity(cand_logits, targets) / perplexity(ref_logits, targets)
    return LogitMetrics(int(kl.numel()), float(kl.mean()), p99, top1_agreement(ref_logits, cand_logits), ratio)


@dataclass(frozen=True)
class Response:
    token_ids: tuple[int, ...]
    sha256: str


def response_hash(token_ids: Sequence[int]) -> str:
    """sha256 of the ids as little-endian int32 (the response's identity across runs)."""
    import numpy as np

    return hashlib.sha256(np.asarray(list(token_ids), dtype="<i4").tobytes()).hexdigest()


def greedy_response(model, prompt_ids: Sequence[int], max_new_tokens: int = 32,
                    eos_token_id: Optional[int] = None) -> Response:
    with _stable(model):
        ids = greedy(model, prompt_ids, max_new_tokens, eos_token_id)
    return Response(tuple(ids), response_hash(ids))


