"""Recipes: which qtype each tensor of a DS4 checkpoint gets.

A recipe is data (a frozen ``Recipe``). ``plan_tensors`` applies it to the
source's tensor list, then the user's ``--tensor-type REGEX=QTYPE`` overrides
in order (last match wins), and returns one ``TensorChoice`` per output
tensor recording what was asked and what it got, so reports can show both.

Dense policy, shared by every recipe: the router, norms, hash tables,
hyper-connection parameters and sinks keep their source precision (FP8 and
FP4 sources widen losslessly to bf16, since GGUF has no FP8); attention
projections and shared experts take ``dense_qtype`` (default bf16).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterable, Mapping, Optional

from ds4quant.errors import BadInputError, ShapeError, UnknownQTypeError
from ds4quant.formats import get_qtype
from ds4quant.names import base_name

SURFACES = ("gate", "up", "down")

# Tensor classes (see ds4quant.sources.naming) that keep source precision.
KEEP_SOURCE_CLASSES = frozenset({"router", "norm", "hash_table", "hc", "sink", "bias", "embedding", "output", "other"})
# Tensor classes that take the recipe's dense qtype.
DENSE_CLASSES = frozenset({"attention", "shared_expert"})

# Attention-class tensors that are not projections (sinks, compressor position
# biases) keep source precision like norms do.
_KEEP_NAMES = re.compile(r"(attn_sinks|_ape)\.weight$")

# What "source precision" becomes in GGUF, per source dtype.
_KEEP = {
    "F32": "f32",
    "F16": "f16",
    "BF16": "bf16",
    "F8_E4M3": "bf16",  # e4m3 x power-of-two scale is exact in bf16
    "F8_E8M0": "bf16",
    "I8": "bf16",  # packed FP4 (e2m1) widens exactly too
    "I32": "i32",
    "I64": "i32",  # tid2eid: expert ids, always < 2^31
    "U8": "i32",
    # GGUF sources: a block-quantized tensor kept at source precision is its
    # stored bytes, copied (convert never decodes and re-encodes it)
    "Q8_0": "q8_0",
    "MXFP4": "mxfp4",
}


@dataclass(frozen=True)
class Recipe:
    """A named conversion recipe.

    experts: surface ("gate" | "up" | "down") -> qtype for routed experts, or
    the special value "mxfp4-lossless" (bit-exact repack of the FP4 source).
    gate_up_books: how MIX codebooks of qtypes chosen outright (``--tensor-type
    ...=rocmfp2_mix``) are fitted for an expert's gate and up: "separate" (one
    book pair per matrix, the default) or "joint" (one pair fitted over both
    and shared, as Lucebox's converter does; GATE_UP_BOOKS).
    """

    name: str
    description: str
    experts: Mapping[str, str]
    dense_qtype: str = "bf16"
    adaptive: bool = False
    gate_up_books: str = "separate"

    def expert_qtype(self, surface: str) -> str:
        return self.experts[surface]

    def to_json(self) -> dict:
        d = {
            "name": self.name,
            "description": self.description,
            "experts": dict(self.experts),
            "dense_qtype": self.dense_qtype,
            "adaptive": self.adaptive,
        }
        if self.gate_up_books != "separate":  # the default leaves the recipe's bytes as they were
            d["gate_up_books"] = self.gate_up_books
        return d


GATE_UP_BOOKS = ("separate", "joint")


def _uniform(name: str, qtype: str, description: str) -> Recipe:
    return Recipe(name, description, MappingProxyType({s: qtype for s in SURFACES}))


RECIPES: Mapping[str, Recipe] = MappingProxyType(
    {
        r.name: r
        for r in (
            Recipe(
                "mxfp4",
                "routed experts repacked bit-exactly from the FP4 source as GGUF MXFP4 (lossless)",
                MappingProxyType({s: "mxfp4-lossless" for s in SURFACES}),
            ),
            Recipe(
                "rocmfp2-strix",
                "rocmfp2 (107) gate/up + rocmfp3 (104) down: the Lucebox ROCMFP2-STRIX layout",
                MappingProxyType({"gate": "rocmfp2", "up": "rocmfp2", "down": "rocmfp3"}),
            ),
            _uniform("rocmfp3", "rocmfp3", "rocmfp3 (104) for all routed experts"),
            _uniform("rocmfp4", "rocmfp4", "rocmfp4 (100) for all routed experts"),
            _uniform("rocmfp4-fast", "rocmfp4_fast", "rocmfp4_fast (101) for all routed experts"),
            _uniform("rocmfp8", "rocmfp8", "rocmfp8 (103) for all routed experts"),
            Recipe(
                "adaptive",
                "measured qtype per tensor (or expert) under --target-bpw / --max-bytes; MIX codebooks out of band",
                MappingProxyType({s: "adaptive" for s in SURFACES}),
                adaptive=True,
            ),
        )
    }
)


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise BadInputError(
            f"unknown recipe {name!r}", where="--recipe", hint=f"known recipes: {', '.join(RECIPES)}"
        ) from None


@dataclass(frozen=True)
class Override:
    """One ``--tensor-type REGEX=QTYPE`` rule (matched with re.search on GGUF names)."""

    pattern: str
    qtype: str
    regex: re.Pattern = field(compare=False, repr=False)

    @classmethod
    def parse(cls, text: str) -> "Override":
        pattern, sep, qtype = text.rpartition("=")
        if not sep or not pattern or not qtype:
            raise BadInputError(f"expected REGEX=QTYPE, got {text!r}", where="--tensor-type")
        try:
            regex = re.compile(pattern)
        except re.error as exc:
            raise BadInputError(f"bad regular expression {pattern!r}: {exc}", where="--tensor-type") from None
        qtype = qtype.strip()
        if qtype != "source":
            try:
                get_qtype(qtype)
            except UnknownQTypeError as exc:
                raise BadInputError(exc.message, where="--tensor-type", hint=exc.hint) from None
        return cls(pattern, qtype, regex)


@dataclass(frozen=True)
class TensorChoice:
    """The plan for one output tensor.

    asked: the qtype the recipe or an override asked for ("source" means keep
    source precision); qtype: the qtype it gets; rule: where the choice came
    from ("recipe", "dense-policy", "keep-source", or "override:<pattern>").
    """

    name: str
    tensor_class: str
    shape: tuple[int, ...]  # GGUF order: ne[0] (row length) first
    source_dtype: str
    asked: str
    qtype: str
    rule: str
    surface: Optional[str] = None
    layer: Optional[int] = None
    experts: Optional[tuple[int, ...]] = None  # global ids of a compact expert stack
    predicted_error: Optional[float] = None  # adaptive: routing-weighted imatrix error

    @property
    def base(self) -> str:
        """The layer tensor a compact stack belongs to (its own name otherwise)."""
        return self.name if self.experts is None else base_name(self.name)

    def to_json(self) -> dict:
        d = {
            "name": self.name,
            "class": self.tensor_class,
            "shape": list(self.shape),
            "source_dtype": self.source_dtype,
            "asked": self.asked,
            "qtype": self.qtype,
            "rule": self.rule,
            "surface": self.surface,
            "layer": self.layer,
        }
        if self.experts is not None:
            d["experts"] = list(self.experts)
        if self.predicted_error is not None:
            d["predicted_error"] = self.predicted_error
        return d

    @classmethod
    def from_json(cls, d) -> "TensorChoice":
        """The inverse of ``to_json``; a BadInputError names the first field
        that is missing or of the wrong type (a damaged or edited manifest)."""
        if not isinstance(d, Mapping):
            raise BadInputError(f"a plan entry must be an object, got {type(d).__name__}")
        name = d.get("name")
        where = name if isinstance(name, str) else None

        def get(key: str, kind, optional: bool = False):
            v = d.get(key)
            if (v is None and not optional) or (v is not None and not isinstance(v, kind)) or isinstance(v, bool):
                raise BadInputError(f"plan entry field {key!r} is {v!r}", where=where)
            return v

        def ints(key: str, optional: bool = False):
            v = get(key, (list, tuple), optional)  # a read manifest holds frozen tuples
            if v is not None and not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
                raise BadInputError(f"plan entry field {key!r} is {v!r}", where=where)
            return None if v is None else tuple(v)

        pe = get("predicted_error", (int, float), optional=True)
        return cls(get("name", str), get("class", str), ints("shape"), get("source_dtype", str), get("asked", str),
                   get("qtype", str), get("rule", str), get("surface", str, True), get("layer", int, True),
                   ints("experts", True), None if pe is None else float(pe))


def plan_from_json(entries) -> tuple[list[TensorChoice], list[str]]:
    """The tensor choices of a recorded plan (a manifest's ``recipe.plan``),
    and one problem line per entry that is not one, in order."""
    choices, problems = [], []
    for i, d in enumerate(entries):
        try:
            choices.append(TensorChoice.from_json(d))
        except BadInputError as e:
            problems.append(f"entry {i}{'' if e.where is None else ' (' + e.where + ')'}: {e.message}")
    return choices, problems


@dataclass(frozen=True)
class TensorSpec:
    """What the planner needs to know about one output tensor."""

    name: str
    tensor_class: str
    shape: tuple[int, ...]  # GGUF order
    source_dtype: str
    surface: Optional[str] = None
    layer: Optional[int] = None


def keep_source_qtype(source_dtype: str) -> str:
    try:
        return _KEEP[source_dtype]
    except KeyError:
        raise BadInputError(f"no GGUF type keeps source dtype {source_dtype}") from None


def plan_tensors(
    recipe: Recipe, tensors: Iterable[TensorSpec], overrides: Iterable[Override] = ()
) -> list[TensorChoice]:
    """Apply ``recipe`` then ``overrides`` (last match wins) to every tensor.

    Raises ShapeError naming the tensor when a chosen qtype's block does not
    divide the tensor's row length.
    """
    overrides = list(overrides)
    matched: set[int] = set()
    out = []
    for t in tensors:
        if t.tensor_class == "routed_expert":
            asked, rule = recipe.expert_qtype(t.surface), "recipe"
        elif t.tensor_class in DENSE_CLASSES and not _KEEP_NAMES.search(t.name):
            asked, rule = recipe.dense_qtype, "dense-policy"
        else:
            asked, rule = "source", "keep-source"
        for k, ov in enumerate(overrides):
            if ov.regex.search(t.name):
                asked, rule = ov.qtype, f"override:{ov.pattern}"
                matched.add(k)
        if rule.startswith("override:") and asked != "source" and keeps_source_precision(t):
            qt = get_qtype(asked)
            if qt.block_size != 1:
                raise BadInputError(
                    f"{asked} is a block type; this tensor ({t.tensor_class}) must keep source precision, "
                    f"so only a float type (f32, f16, bf16) or 'source' may be asked for it", where=t.name,
                    hint=f"narrow the --tensor-type pattern '{rule[len('override:'):]}'")
        if asked == "adaptive":
            # decided later by ds4quant.plan.planner (measure + allocate)
            out.append(TensorChoice(t.name, t.tensor_class, t.shape, t.source_dtype, asked, "adaptive", rule,
                                    t.surface, t.layer))
            continue
        if asked == "mxfp4-lossless":
            qtype = "mxfp4"
            if t.source_dtype not in ("I8", "MXFP4"):  # official FP4 experts, or a GGUF's MXFP4 stacks
                raise BadInputError(
                    f"the mxfp4 recipe repacks FP4 experts, but this tensor is {t.source_dtype}", where=t.name
                )
        elif asked == "source":
            qtype = keep_source_qtype(t.source_dtype)
        else:
            qtype = asked
        _check_fits(t, qtype)
        out.append(TensorChoice(t.name, t.tensor_class, t.shape, t.source_dtype, asked, qtype, rule, t.surface, t.layer))
    # a pattern that selects nothing is a typo, not a no-op: refuse it (an error, not a warning,
    # so a recipe never silently differs from what the user asked for)
    for k, ov in enumerate(overrides):
        if k not in matched:
            raise BadInputError(f"pattern '{ov.pattern}' matches no tensor", where="--tensor-type",
                                hint="patterns are regular expressions searched in GGUF names such as "
                                     "blk.3.ffn_down_exps.weight; ds4quant inspect lists them")
    return out


# Tensors that must keep source precision whatever the recipe: norms, attention
# sinks, the router's bias and the hash-routing tables (their values are read
# one by one, never as a quantized matrix). A block qtype on them is refused.
_PRECISION_CLASSES = frozenset({"norm", "hash_table"})
_PRECISION_NAMES = re.compile(r"(attn_sinks\.weight|exp_probs_b\.bias)$")


def keeps_source_precision(t: TensorSpec) -> bool:
    """True for norms, sinks, router bias and hash tables (see ``_PRECISION_CLASSES``)."""
    return t.tensor_class in _PRECISION_CLASSES or bool(_PRECISION_NAMES.search(t.name))


def _check_fits(t: TensorSpec, qtype: str) -> None:
    qt = get_qtype(qtype)
    row = t.shape[0]
    need = max(qt.block_size, qt.row_multiple)
    if row % need:
        raise ShapeError(
            f"{qtype} needs a row length that is a multiple of {need}, but the row length is {row}",
            where=t.name,
            hint="pick another qtype for it with --tensor-type",
        )
    if qt.is_mix and t.tensor_class != "routed_expert":
        raise BadInputError(
            f"{qtype} needs per-expert codebooks and is only supported on routed experts", where=t.name
        )
