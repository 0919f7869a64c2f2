"""What a fidelity measurement evaluates: the protocols, the evaluation
token sequences (a token file, a text, llama.cpp's chunking of either, or the
built-in copy-task documents), the scored positions and the source's
tokenizer. Shared by verify's whole-model, streamed and reference-base paths
(``verify/fidelity.py``, ``verify/streamed.py``, ``verify/reference_side.py``)
and by ``ds4quant reference``, so a base and a verify read the same tokens.
"""

from __future__ import annotations

import random
from pathlib import Path

from ds4quant.errors import BadInputError

EVAL_SEED = "ds4quant/verify/fidelity/eval"
EVAL_DOCS = 4
PROTOCOLS = ("exact-copy",)


def copy_task(source: Path):
    from ds4quant.runtime import fidelity as fd

    p = Path(source) / "task.json"
    return fd.CopyTask.from_json(p) if p.is_file() else fd.ECHO


def builtin_docs(task) -> list[str]:
    """EVAL_DOCS documents: filler, a copy-task prompt with its answer, more filler."""
    from ds4quant.runtime import fidelity as fd

    rng = random.Random(EVAL_SEED)
    docs = []
    for _, tr in zip(range(EVAL_DOCS), fd.novel_trials(task, rng)):
        docs.append(tr.prompt + tr.expected + "\n" + "\n".join(fd.filler_lines(rng, 2)))
    return docs


def eval_tokens(o, tok, vocab: int, max_len: int) -> tuple[list[list[int]], str]:
    if o.ctx_size is not None:
        return _chunked(o, tok, vocab, max_len)
    if o.tokens is not None:
        from ds4quant.calibrate import read_tokens

        return [list(s) for s in read_tokens(o.tokens, vocab, max_len)], f"token file {o.tokens}"
    if o.text is not None:
        try:
            text = Path(o.text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise BadInputError(f"cannot read the evaluation text: {e}", where=str(o.text)) from None
        docs = [d for d in text.split("\n\n") if d.strip()]
        what = f"text file {o.text}"
    else:
        docs = builtin_docs(copy_task(o.source))
        what = f"{EVAL_DOCS} built-in copy-task documents"
    seqs = [[tok.bos_token_id] + tok.encode(d) for d in docs]
    for i, s in enumerate(seqs):
        bad = [t for t in s if not 0 <= t < vocab]
        if bad or len(s) > max_len:
            raise BadInputError(f"document {i} tokenizes to ids outside the vocabulary or beyond "
                                f"{max_len} tokens", where=what)
    if not seqs:
        raise BadInputError("no evaluation documents", where=what)
    return seqs, what


def _chunked(o, tok, vocab: int, max_len: int) -> tuple[list[list[int]], str]:
    """llama.cpp's chunks of the whole evaluation text (tokenized once, BOS first)
    or of the token file's sequences joined in order."""
    from ds4quant.runtime import kl_figures as K

    n = o.ctx_size
    if n > max_len:
        raise BadInputError(f"context {n} exceeds the model's {max_len} positions", where="--ctx")
    if o.tokens is not None:
        from ds4quant.calibrate import read_tokens

        stream = [t for s in read_tokens(o.tokens, vocab, max_len) for t in s]
        what = f"token file {o.tokens}"
    else:
        if o.text is not None:
            try:
                text = Path(o.text).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise BadInputError(f"cannot read the evaluation text: {e}", where=str(o.text)) from None
            what = f"text file {o.text}"
        else:
            text = "\n".join(builtin_docs(copy_task(o.source)))
            what = f"{EVAL_DOCS} built-in copy-task documents"
        stream = [tok.bos_token_id] + tok.encode(text)
        if any(not 0 <= t < vocab for t in stream):
            raise BadInputError("the text tokenizes to ids outside the vocabulary", where=what)
    try:
        seqs = K.chunks(stream, n, tok.bos_token_id)
    except BadInputError as e:
        raise BadInputError(e.message, where=what) from None
    return seqs, f"{what}, {len(seqs)} chunks of {n} (llama.cpp's perplexity chunking, second halves scored)"


def scored_positions(o, seqs) -> list[tuple[int, int]]:
    """(row, position) pairs whose logits are scored: every position with a next
    token, or with ``ctx_size`` the second half of each chunk, as llama.cpp."""
    from ds4quant.runtime import kl_figures as K
    from ds4quant.verify._candidate import valid_positions

    if o.ctx_size is None:
        return valid_positions(seqs)
    return [(i, t) for i in range(len(seqs)) for t in K.scored_positions(o.ctx_size)]


def tokenizer_for(source: Path):
    from ds4quant.runtime import fidelity as fd
    from ds4quant.verify._candidate import source_tokenizer

    t = source_tokenizer(source)
    return (fd.as_tokenizer(t), "tokenizer.json") if t is not None else (fd.ByteTokenizer(), "byte ids")
