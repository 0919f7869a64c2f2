"""Which runtimes can load an artifact: one rule, decided from its contents.

convert writes the answer into ``ds4quant.runtimes``; the artifact view
recomputes it from the tensors it reads, verify fails an artifact whose key
disagrees, and inspect and the model card print the view's answer.

The rule, in order:

1. start from the runtimes every tensor's qtype lists (``QType.runtimes``);
2. MIX tensors need out-of-band codebooks: Lucebox builds load them only
   from Lucebox blobs that cover every MIX tensor; llama.cpp and gguf-py never;
3. compact per-expert stacks (expert granularity) load in ds4quant only;
4. a Lucebox build must know every ggml type the artifact uses: the MIX types
   (105/106) exist only in MIX-capable builds, so an artifact with them names
   ``lucebox-mix`` instead of ``lucebox``; ``rocmfp2_affine`` (107 affine)
   needs the ROCMFP2_AFFINE build, ``lucebox-affine``. Artifacts without those
   types keep the plain ``lucebox`` (so their key's bytes are unchanged).

``NEEDS`` says in words what each runtime name requires; inspect and the
model card print it.

    loadable_by([("rocmfp2", False), ("rocmfp3", False)], lucebox_books=False)  # ("ds4quant", "lucebox")
    loadable_by([("rocmfp3", True)], lucebox_books=False)                      # ("ds4quant",)
    loadable_by([("rocmfp2_mix", False)], lucebox_books=True)                  # ("ds4quant", "lucebox-mix")
"""

from __future__ import annotations

from typing import Iterable

from ds4quant.formats import QTYPES
from ds4quant.formats.qtype import RT_DS4QUANT, RT_GGUF_PY, RT_LLAMA_CPP, RT_LUCEBOX, RT_LUCEBOX_AFFINE

RT_LUCEBOX_MIX = "lucebox-mix"  # a Lucebox build with the MIX types 105/106 and their sidecars

_LUCEBOX_BUILDS = frozenset({RT_LUCEBOX, RT_LUCEBOX_AFFINE})

NEEDS = {
    RT_DS4QUANT: "ds4quant's bundled runtime",
    RT_LUCEBOX: "any Lucebox build",
    RT_LUCEBOX_MIX: "a MIX-capable Lucebox build (ggml types 105/106 with GUMIXs1/P4MIXv1 codebooks); "
                    "builds without them refuse 'type 106 (unknown)'",
    RT_LUCEBOX_AFFINE: "a Lucebox build with ROCMFP2_AFFINE (type 107 as rocmfp2_affine)",
    RT_LLAMA_CPP: "upstream llama.cpp",
    RT_GGUF_PY: "gguf-py's reader and dequantizer",
}


def needs(runtime: str) -> str:
    """What a runtime name in ``ds4quant.runtimes`` requires, in words."""
    return NEEDS.get(runtime, "unknown runtime")
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
    if mix and RT_LUCEBOX in common:
        # only MIX-capable builds know 105/106: say so, in the place the plain build had
        common.discard(RT_LUCEBOX)
        common.add(RT_LUCEBOX_MIX)
        order = [RT_LUCEBOX_MIX if r == RT_LUCEBOX else r for r in order]
    return tuple(r for r in order if r in common)
