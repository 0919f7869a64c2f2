"""Which runtimes can load an artifact: one rule, decided from its contents.

convert writes the answer into ``ds4quant.runtimes``; the artifact view
recomputes it from the tensors it reads, verify fails an artifact whose key
disagrees, and inspect and the model card print the view's answer.

The rule, in order:

1. start from the runtimes every tensor's qtype lists (``QType.runtimes``);
2. MIX tensors need out-of-band codebooks: Lucebox builds load them only
   from Lucebox blobs that cover every MIX tensor; llama.cpp and gguf-py never;
3. compact per-expert stacks (expert granularity) load in ds4quant only.

    loadable_by([("rocmfp2", False), ("rocmfp3", False)], lucebox_books=False)  # ("ds4quant", "lucebox")
    loadable_by([("rocmfp3", True)], lucebox_books=False)                      # ("ds4quant",)
"""

from __future__ import annotations

from typing import Iterable

from ds4quant.formats import QTYPES
from ds4quant.formats.qtype import RT_DS4QUANT, RT_GGUF_PY, RT_LLAMA_CPP, RT_LUCEBOX, RT_LUCEBOX_AFFINE

_LUCEBOX_BUILDS = frozenset({RT_LUCEBOX, RT_LUCEBOX_AFFINE})
_NO_SIDECARS = frozenset({RT_LLAMA_CPP, RT_GGUF_PY})


def loadable_by(tensors: Iterable[tuple[str, bool]], lucebox_books: bool) -> tuple[str, ...]:
    """Runtimes that can load every tensor, in the order the qtypes list them.

    tensors: (qtype name, is a compact stack) for every tensor of the artifact.
    lucebox_books: Lucebox codebook blobs (embedded or loose) cover every MIX tensor.
    An unknown qtype loads nowhere.
    """
    order: list[str] = []
    common = None
    mix = compact = False
    for qtype, is_compact in tensors:
        q = QTYPES.get(qtype)
        rts = tuple(q.runtimes) if q is not None else ()
        order += [r for r in rts if r not in order]
        common = set(rts) if common is None else common & set(rts)
        mix = mix or (q is not None and q.is_mix)
        compact = compact or bool(is_compact)
    common = common or set()
    if mix:
        common -= _NO_SIDECARS
        if not lucebox_books:
            common -= _LUCEBOX_BUILDS
    if compact:
        common &= {RT_DS4QUANT}
    return tuple(r for r in order if r in common)
