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

RT_LUCEBOX_MIX_AFFINE = "lucebox-mix-affine"  # both: MIX types and ROCMFP2_AFFINE

_LUCEBOX_BUILDS = frozenset({RT_LUCEBOX, RT_LUCEBOX_AFFINE})
_LUCEBOX_SLOT = "<lucebox>"  # where the Lucebox build goes in the order, before it is named

NEEDS = {
    RT_DS4QUANT: "ds4quant's bundled runtime",
    RT_LUCEBOX: "any Lucebox build",
    RT_LUCEBOX_MIX: "a MIX-capable Lucebox build (ggml types 105/106 with GUMIXs1/P4MIXv1 codebooks); "
                    "builds without them refuse 'type 106 (unknown)'",
    RT_LUCEBOX_AFFINE: "a Lucebox build with ROCMFP2_AFFINE (type 107 as rocmfp2_affine)",
    RT_LUCEBOX_MIX_AFFINE: "a Lucebox build with both the MIX types 105/106 and ROCMFP2_AFFINE",
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
    An unknown qtype loads nowhere. Lucebox appears once, as the build the
    artifact needs: ``lucebox``, ``lucebox-mix``, ``lucebox-affine`` or
    ``lucebox-mix-affine`` (rule 4).
    """
    order: list[str] = []
    common = None
    mix = compact = affine = False
    lucebox = True
    for qtype, is_compact in tensors:
        q = QTYPES.get(qtype)
        rts = tuple(q.runtimes) if q is not None else ()
        order += [r if r not in _LUCEBOX_BUILDS else _LUCEBOX_SLOT for r in rts if r not in order]
        others = set(rts) - _LUCEBOX_BUILDS
        common = others if common is None else common & others
        # every Lucebox build loads the plain types; the affine type needs the affine build
        lucebox = lucebox and bool(set(rts) & _LUCEBOX_BUILDS)
        affine = affine or (RT_LUCEBOX_AFFINE in rts and RT_LUCEBOX not in rts)
        mix = mix or (q is not None and q.is_mix)
        compact = compact or bool(is_compact)
    common = common or set()
    if common is not None and lucebox and order:
        common.add(_LUCEBOX_SLOT)
    if mix:
        common -= _NO_SIDECARS
        if not lucebox_books:
            common.discard(_LUCEBOX_SLOT)
    if compact:
        common &= {RT_DS4QUANT}
    build = {(False, False): RT_LUCEBOX, (True, False): RT_LUCEBOX_MIX, (False, True): RT_LUCEBOX_AFFINE,
             (True, True): RT_LUCEBOX_MIX_AFFINE}[(mix, affine)]
    seen: list[str] = []
    for r in order:
        if r in common and r not in seen:
            seen.append(r)
    return tuple(build if r == _LUCEBOX_SLOT else r for r in seen)
