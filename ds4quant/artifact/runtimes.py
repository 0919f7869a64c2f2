"""Which runtimes can load an artifact: one decision from its whole header and tensor list.

convert writes the answer into ``ds4quant.runtimes`` (and prints it); the
artifact view decides again from what it reads; verify fails an artifact
whose key claims a runtime the decision does not allow; inspect and the
model card print the decision, and for every engine left out, why.

Each engine is a rule in ``ENGINES`` (registry order is the order runtimes
are listed in); a rule returns the runtime names it allows and, when it
allows none, the reasons:

- ``ds4quant``: every tensor's qtype is one ds4quant decodes;
- ``lucebox``: every qtype is a type some Lucebox build knows, no compact
  per-expert stacks (ds4quant's own layout), the header keys its loader
  requires (``ds4.check_ds4_header``), and for MIX tensors (105/106)
  codebook blobs covering each of them. The names say which build:

  ========================  ======================================================
  name                      a Lucebox build ...
  ========================  ======================================================
  lucebox                   without ROCMFP2_AFFINE (type 107 read as rocmfp2)
  lucebox-affine            with ROCMFP2_AFFINE (107 read as rocmfp2_affine)
  lucebox-mix[-affine]      with the MIX types; codebooks from the loose files
                            ``NAME.gguf.{gumix,p4mix,dmix}.bin``, which every
                            MIX-capable loader reads
  lucebox-mix[-affine]-     with the MIX types, whose loader reads the codebooks
  embedded                  embedded in the GGUF (``deepseek4.*.sidecar``); loaders
                            that read only the loose files cannot load it
  ========================  ======================================================

  An artifact without type 107 loads in builds with and without
  ROCMFP2_AFFINE, so it lists both names; one with both 107 codecs in it
  loads in neither.
- ``llama.cpp``: ``llama_cpp.llama_cpp_problems`` is empty (keys and types,
  the fixed model dims, the vocabulary, the tensor set, shapes and types);
- ``gguf-py``: every qtype is one gguf-py reads, no compact stacks.

``NEEDS`` says in words what each name requires. docs/runtimes.md is the
user's page for all of this.

    d = decide(view.kv, {name: (qtype, shape, compact)}, LuceboxBooks(any=True, loose=True))
    d.runtimes, d.excluded      # ("ds4quant", "lucebox-mix"), {"llama.cpp": ("...",), ...}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping, Optional, Sequence

from ds4quant.formats import QTYPES
from ds4quant.formats.qtype import RT_DS4QUANT, RT_GGUF_PY, RT_LLAMA_CPP, RT_LUCEBOX, RT_LUCEBOX_AFFINE

RT_LUCEBOX_MIX = "lucebox-mix"
RT_LUCEBOX_MIX_AFFINE = "lucebox-mix-affine"
RT_LUCEBOX_MIX_EMBEDDED = "lucebox-mix-embedded"
RT_LUCEBOX_MIX_AFFINE_EMBEDDED = "lucebox-mix-affine-embedded"
ENGINE_LUCEBOX = "lucebox"  # the engine whose build the lucebox* names pick

_LOOSE = "codebooks from the loose NAME.gguf.{gumix,p4mix,dmix}.bin files beside the GGUF (every MIX-capable loader " \
         "reads these)"
_EMBEDDED = "whose loader reads the codebooks embedded in the GGUF (deepseek4.*.sidecar KVs); loaders that read " \
            "only the loose NAME.gguf.*.bin files register nothing and fail at the first decode"
NEEDS = MappingProxyType({
    RT_DS4QUANT: "ds4quant's bundled runtime",
    RT_LUCEBOX: "a Lucebox build without ROCMFP2_AFFINE (the default build: ggml type 107 decodes as rocmfp2)",
    RT_LUCEBOX_AFFINE: "a Lucebox build with ROCMFP2_AFFINE (-DLUCE_ROCMFP2_AFFINE=ON: type 107 decodes as "
                       "rocmfp2_affine)",
    RT_LUCEBOX_MIX: "a MIX-capable Lucebox build (ggml types 105/106) without ROCMFP2_AFFINE; " + _LOOSE,
    RT_LUCEBOX_MIX_AFFINE: "a MIX-capable Lucebox build (types 105/106) with ROCMFP2_AFFINE; " + _LOOSE,
    RT_LUCEBOX_MIX_EMBEDDED: "a MIX-capable Lucebox build (types 105/106) without ROCMFP2_AFFINE " + _EMBEDDED,
    RT_LUCEBOX_MIX_AFFINE_EMBEDDED: "a MIX-capable Lucebox build (types 105/106) with ROCMFP2_AFFINE " + _EMBEDDED,
    RT_LLAMA_CPP: "llama.cpp with DeepSeek-V4 support (LLM_ARCH_DEEPSEEK4), e.g. llama-cpp-python 0.3.36",
    RT_GGUF_PY: "gguf-py's reader and dequantizer",
})
_LUCEBOX_NAMES = frozenset({RT_LUCEBOX, RT_LUCEBOX_AFFINE, RT_LUCEBOX_MIX, RT_LUCEBOX_MIX_AFFINE,
                            RT_LUCEBOX_MIX_EMBEDDED, RT_LUCEBOX_MIX_AFFINE_EMBEDDED})


def needs(runtime: str) -> str:
    """What a runtime name in ``ds4quant.runtimes`` requires, in words."""
    return NEEDS.get(runtime, "unknown runtime")


def engine_of(runtime: str) -> str:
    """The engine a runtime name belongs to (every lucebox* name is the engine ``lucebox``)."""
    return ENGINE_LUCEBOX if runtime in _LUCEBOX_NAMES else runtime


@dataclass(frozen=True)
class LuceboxBooks:
    """Where Lucebox codebook blobs cover every resident MIX tensor.

    any: the blobs a loader that prefers embedded KVs finds (embedded, else the loose file);
    loose: the loose ``NAME.gguf.*.bin`` files alone.
    """

    any: bool = False
    loose: bool = False


@dataclass(frozen=True)
class Tensor:
    """What the decision reads of one tensor."""

    qtype: str
    shape: tuple[int, ...]
    compact: bool = False


@dataclass(frozen=True)
class Decision:
    """runtimes: names that load the artifact, in ``ENGINES`` order; excluded: engine -> why not."""

    runtimes: tuple[str, ...]
    excluded: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def claim_problems(self, stored: Sequence[str]) -> list[str]:
        """Why a stored key claiming ``stored`` claims more than this decision allows ([] if it does not)."""
        out = []
        for r in stored:
            if r in self.runtimes:
                continue
            eng = engine_of(r)
            why = self.excluded.get(eng)
            if r not in NEEDS:
                out.append(f"{r!r} is not a runtime name ds4quant knows")
            elif why:
                out.append(f"{r}: {'; '.join(why)}")
            else:
                allowed = [x for x in self.runtimes if engine_of(x) == eng]
                out.append(f"{r}: {needs(r)}; the contents need {', '.join(allowed)}")
        return out

    def to_json(self) -> dict:
        return {"runtimes": list(self.runtimes), "excluded": {k: list(v) for k, v in self.excluded.items()}}


Rule = Callable[[Mapping, Mapping[str, Tensor], LuceboxBooks], tuple[tuple[str, ...], tuple[str, ...]]]
ENGINES: dict[str, Rule] = {}


def engine(name: str):
    """Register an engine's rule (registry order = listing order)."""
    def add(fn: Rule) -> Rule:
        ENGINES[name] = fn
        return fn
    return add


def _qtype_problems(tensors: Mapping[str, Tensor], ok: Callable[[object], bool], who: str) -> list[str]:
    bad: dict[str, list[str]] = {}
    for n, t in tensors.items():
        q = QTYPES.get(t.qtype)
        if q is None or not ok(q):
            bad.setdefault(t.qtype, []).append(n)
    return [f"{len(ns)} tensor(s) of type {q} (e.g. {ns[0]}): {who} has no such type" for q, ns in sorted(bad.items())]


def _row_problems(tensors: Mapping[str, Tensor]) -> list[str]:
    """Tensors whose row length breaks their qtype's row rule: their byte size cannot
    match what the codec decodes, so no engine (ds4quant's included) loads them."""
    from ds4quant.artifact.qtypes import row_rule_problem

    out = []
    for n, t in tensors.items():
        why = row_rule_problem(t.qtype, t.shape[0]) if t.shape else None
        if why:
            out.append(f"tensor {n}: {why}")
    return out


def _compact_problems(tensors: Mapping[str, Tensor]) -> list[str]:
    n = [k for k, t in tensors.items() if t.compact]
    return [f"{len(n)} compact per-expert stack(s) (e.g. {n[0]}): ds4quant's own layout"] if n else []


@engine(RT_DS4QUANT)
def _ds4quant(kv, tensors, books):
    why = _qtype_problems(tensors, lambda q: RT_DS4QUANT in q.runtimes, "ds4quant")
    return (() if why or not tensors else (RT_DS4QUANT,)), tuple(why)


@engine(ENGINE_LUCEBOX)
def _lucebox(kv, tensors, books):
    from ds4quant.artifact.ds4 import check_ds4_header

    lucebox = {RT_LUCEBOX, RT_LUCEBOX_AFFINE}
    why = _qtype_problems(tensors, lambda q: bool(lucebox & set(q.runtimes)), "Lucebox")
    why += _compact_problems(tensors)
    why += check_ds4_header(kv) if tensors else ["no tensors"]
    plain107 = affine107 = mix = False
    for t in tensors.values():
        q = QTYPES.get(t.qtype)
        if q is None:
            continue
        mix = mix or q.is_mix
        if q.ggml_type == 107 and RT_LUCEBOX in q.runtimes:
            plain107 = True
        elif q.ggml_type == 107 and RT_LUCEBOX_AFFINE in q.runtimes:
            affine107 = True
    if plain107 and affine107:
        why.append("type 107 holds both rocmfp2 and rocmfp2_affine tensors; a Lucebox build decodes 107 one way")
    if mix and not books.any:
        why.append("MIX tensors (105/106) without Lucebox codebook blobs (GUMIXs1/P4MIXv1/dmix) covering each")
    if why:
        return (), tuple(why)
    builds = [a for a in (False, True) if not (a and plain107) and not (not a and affine107)]
    out = []
    for affine in builds:
        if not mix:
            out.append(RT_LUCEBOX_AFFINE if affine else RT_LUCEBOX)
        elif books.loose:
            out.append(RT_LUCEBOX_MIX_AFFINE if affine else RT_LUCEBOX_MIX)
        else:
            out.append(RT_LUCEBOX_MIX_AFFINE_EMBEDDED if affine else RT_LUCEBOX_MIX_EMBEDDED)
    return tuple(out), ()


@engine(RT_LLAMA_CPP)
def _llama_cpp(kv, tensors, books):
    from ds4quant.artifact.llama_cpp import llama_cpp_problems

    why = _compact_problems(tensors) + llama_cpp_problems(kv, {n: (t.qtype, t.shape) for n, t in tensors.items()})
    return (() if why else (RT_LLAMA_CPP,)), tuple(why)


@engine(RT_GGUF_PY)
def _gguf_py(kv, tensors, books):
    why = _qtype_problems(tensors, lambda q: RT_GGUF_PY in q.runtimes, "gguf-py") + _compact_problems(tensors)
    return (() if why or not tensors else (RT_GGUF_PY,)), tuple(why)


def decide(kv: Mapping, tensors: Mapping[str, "Tensor | tuple"], books: Optional[LuceboxBooks] = None) -> Decision:
    """The runtimes that load a GGUF with these KVs (``KV`` records) and tensors
    (name -> ``Tensor`` or (qtype, shape, compact)), and why each other engine cannot."""
    ts = {n: (t if isinstance(t, Tensor) else Tensor(t[0], tuple(t[1]), bool(t[2]))) for n, t in tensors.items()}
    books = books or LuceboxBooks()
    runtimes: list[str] = []
    excluded: dict[str, tuple[str, ...]] = {}
    rows = tuple(_row_problems(ts))
    for name, rule in ENGINES.items():
        got, why = rule(kv, ts, books)
        if rows:
            got, why = (), rows + tuple(why)
        runtimes += got
        if not got:
            excluded[name] = why or ("no tensors",)
    return Decision(tuple(runtimes), MappingProxyType(excluded))
