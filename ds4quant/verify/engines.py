"""Other engines as fidelity checks: the candidate run by llama.cpp (``verify --fidelity --engine llama.cpp``).

The fidelity stage measures the artifact through ds4quant's runtime; with
``engines=("llama.cpp",)`` it also loads the artifact's GGUF in llama.cpp
(through llama-cpp-python) and measures the same figures against the same
transformers reference, over the same tokens: KL and top-1 of next-token
distributions, perplexity ratio, the greedy response and its sha256, and
the exact-copy protocol. ``LlamaCppLM`` gives llama.cpp the face of a causal
LM that ``runtime.fidelity`` already drives (``model(ids).logits``,
``generate``), so every figure is computed by the same code for both engines.

An engine is checked before anything is measured (``check_engines``):
llama-cpp-python must be installed (``scripts/interop.sh`` builds and
caches it: it has no CPU wheel for every platform and compiles for a long
time) and the artifact must be one llama.cpp loads (``ds4quant.runtimes``
decision; the refusal says why not).

    with open_llama(view) as lm:
        logits = lm(ids).logits            # torch float32 [B, T, vocab]
"""

from __future__ import annotations

import contextlib
import importlib.util
from types import MappingProxyType, SimpleNamespace
from typing import Any, Iterator, Optional, Sequence

from ds4quant.errors import BadInputError
from ds4quant.records import EngineFigures, ExactCopyScore, LogitFigures

LLAMA_CPP = "llama.cpp"
ENGINES = (LLAMA_CPP,)
INSTALL_HINT = "bash scripts/interop.sh installs llama-cpp-python 0.3.36 into .venv (a long compile, cached)"
N_CTX = 2048  # longest evaluation document, prompt and copy trial of the shipped samples, with room


def check_engines(view, engines: Sequence[str]) -> None:
    """Refuse, before the reference runs, an engine we do not drive, one that is not
    installed, or an artifact the engine cannot load."""
    for e in engines:
        if e not in ENGINES:
            raise BadInputError(f"unknown engine {e!r} (known: {', '.join(ENGINES)})", where="--engine")
        if importlib.util.find_spec("llama_cpp") is None:
            raise BadInputError("llama-cpp-python is not installed", where="--engine llama.cpp", hint=INSTALL_HINT)
        if LLAMA_CPP not in view.runtimes:
            why = "; ".join(view.runtimes_excluded.get(LLAMA_CPP, ())) or "its runtimes decision excludes it"
            raise BadInputError(f"llama.cpp cannot load this artifact: {why}", where=str(view.layout.path),
                                hint="see docs/runtimes.md for the shape and keys llama.cpp needs")


class LlamaCppLM:
    """A llama.cpp context as the causal LM ``runtime.fidelity`` drives.

    llm: a ``llama_cpp.Llama`` made with ``logits_all=True`` (or anything with
    ``reset()``, ``eval(tokens)``, ``scores`` (rows = evaluated tokens) and
    ``n_tokens``). Each row of a batch is evaluated from an empty context, so
    rows never see each other.
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def parameters(self) -> Iterator[Any]:
        import torch

        yield torch.zeros(1)  # runtime.fidelity places inputs on the model's device: the CPU

    def _row(self, ids: Sequence[int]):
        import numpy as np

        self.llm.reset()
        self.llm.eval([int(t) for t in ids])
        return np.array(self.llm.scores[: len(ids)], dtype=np.float32)

    def __call__(self, ids, use_cache: bool = False, **_: Any):
        import numpy as np
        import torch

        rows = [self._row(r) for r in ids.tolist()]
        return SimpleNamespace(logits=torch.from_numpy(np.stack(rows)))

    def generate(self, ids, max_new_tokens: int, do_sample: bool = False, eos_token_id: Optional[int] = None,
                 pad_token_id: Optional[int] = None, **_: Any):
        """Greedy continuation (temperature 0), stopping after eos, like transformers' generate."""
        import numpy as np
        import torch

        if do_sample:
            raise BadInputError("the engine check decodes greedily only", where="generate")
        out = []
        for row in ids.tolist():
            seq = [int(t) for t in row]
            self.llm.reset()
            self.llm.eval(seq)
            for _ in range(max_new_tokens):
                nxt = int(np.argmax(np.asarray(self.llm.scores[self.llm.n_tokens - 1])))
                seq.append(nxt)
                if eos_token_id is not None and nxt == eos_token_id:
                    break
                self.llm.eval([nxt])
            out.append(seq)
        width = max(len(s) for s in out)
        pad = eos_token_id if pad_token_id is None else pad_token_id
        return torch.tensor([s + [pad or 0] * (width - len(s)) for s in out], dtype=torch.long)


def _new_llama(path: str, n_ctx: int):
    from llama_cpp import Llama

    return Llama(model_path=path, n_ctx=n_ctx, n_threads=1, n_threads_batch=1, n_gpu_layers=0, logits_all=True,
                 seed=0, verbose=False)


@contextlib.contextmanager
def open_llama(view, n_ctx: int = N_CTX) -> Iterator[LlamaCppLM]:
    """The artifact's (first) GGUF loaded in llama.cpp, on the CPU, one thread."""
    llm = _new_llama(str(view.gguf_paths[0]), n_ctx)
    try:
        yield LlamaCppLM(llm)
    finally:
        close = getattr(llm, "close", None)
        if close is not None:
            close()


def measure_engine(view, engine: str, ref_logits, rows, cols, targets, seqs, pad: int, prompt, tok, task,
                   protocol: Optional[str], response_tokens: int, ref_copy_passes: Optional[int],
                   ref_response_sha256: str, ref_sets=None) -> EngineFigures:
    """The fidelity figures of ``engine`` running the artifact, against the reference's logits;
    with ``ref_sets`` (the source's ``copy_sets.CopySets``) the exact-copy protocol runs over
    the same seeded identifier sets as the runtime's candidate, so both carry one interval."""
    import time

    from ds4quant.runtime import fidelity as fd
    from ds4quant.runtime.copy_sets import METHOD, copy_sets
    import ds4quant.verify._candidate as C

    t0 = time.perf_counter()
    sets = None
    with open_llama(view) as lm:
        logits = C.logits_of(lm, seqs, pad)[rows, cols]
        resp = fd.greedy_response(lm, prompt, response_tokens, tok.eos_token_id)
        if protocol != "exact-copy":
            copy = None
        elif ref_sets is not None:
            sets, copy = copy_sets(lm, tok, task, len(ref_sets.seeds))
        else:
            copy = fd.exact_copy(lm, tok, task)
    m = fd.logit_metrics(ref_logits, logits, targets)
    ec = None
    if copy is not None:
        c = copy.to_json()
        base = (c["passes"], c["trials"], tuple(MappingProxyType(f) for f in c["failed"]), c["task"],
                ref_copy_passes)
        ec = ExactCopyScore(*base) if sets is None else ExactCopyScore(
            *base, sets.passes, ref_sets.passes, sets.per60, sets.interval, ref_sets.per60, ref_sets.interval, METHOD)
    return EngineFigures(engine, LogitFigures(m.kl_mean, m.kl_p99, m.top1, m.ppl_ratio), tuple(resp.token_ids),
                         resp.sha256, resp.sha256 == ref_response_sha256, ec, time.perf_counter() - t0)
