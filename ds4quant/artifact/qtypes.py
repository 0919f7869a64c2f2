"""What a ggml type id or a qtype name means inside an artifact, and its size.

Two sources, consulted in this order:

1. ``ds4quant.formats`` (the codec registry): a registered qtype is
   authoritative for its ggml id, variant, block geometry, and is decodable.
2. Fallback tables for what the registry does not (yet) hold:
   - ROCmFPX ids 100-107 from spec rocmfpx-codecs.md §0 (ids) and §3-§9
     (block bytes per 32 weights). 107 has three meanings (default, affine,
     S40) and 105/106 collide with TurboQuant in other forks, which is why
     artifacts carry explicit tags (``tags.py``).
   - standard ggml types from ``gguf.GGML_QUANT_SIZES``; a standard type is
     named by its lowercase ggml name ("f32", "q8_0", "q4_k"), which is also
     the ds4quant qtype name where one is registered.

A type that resolves only through a fallback table is readable and sized, but
``decodable`` is False: ds4quant has no codec for it in this build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import gguf

from ds4quant.errors import UnknownQTypeError

# Lucebox ggml type ids (spec rocmfpx-codecs.md §0).
ROCMFPX_IDS = range(100, 108)
ID_AMBIGUOUS = 107  # default / affine / S40 (spec §0 "Two cautions", §13.7)
ID_MIX = (105, 106)  # need out-of-band codebooks (spec §9.2)

# The names a user may give for an untagged type-107 tensor.
VARIANTS_107 = ("rocmfp2", "rocmfp2_affine", "rocmfp2_s40")


@dataclass(frozen=True)
class _Spec:
    name: str
    ggml_type: int
    variant: str
    block_size: int
    block_bytes: int
    needs_codebooks: bool = False


# Fallback for ROCmFPX qtypes not registered in this build (variant strings
# as the codec modules register them). Block bytes are
# the field sums of the spec sections cited. The S40 size is not in the spec;
# it shares id 107 and is taken as 10 B / 32 like the other 107 codecs.
_ROCMFPX_SPEC: tuple[_Spec, ...] = (
    _Spec("rocmfp4", 100, "fp4-cb10-h16", 32, 16 + 2),  # §8: qs[16] + e[2]
    _Spec("rocmfp4_fast", 101, "fp4-cb10-b32", 32, 16 + 1),  # §8: qs[16] + e
    _Spec("rocmfp6", 102, "fp6", 32, 24 + 2),  # §6: qs[24] + e[2]
    _Spec("rocmfp8", 103, "fp8", 32, 32 + 1),  # §7: qs[32] + e
    _Spec("rocmfp3", 104, "fp3", 32, 12 + 2),  # §5: qs[12] + e[2]
    _Spec("rocmfp3_mix", 105, "mix105-7s1c", 32, 12 + 2, True),  # §9.1 = §5 wire
    _Spec("rocmfp2_mix", 106, "mix106-7s1c", 32, 8 + 2, True),  # §9.1 = §3 wire
    _Spec("rocmfp2", 107, "fp2-default", 32, 8 + 2),  # §3: qs[8] + e[2]
    _Spec("rocmfp2_affine", 107, "fp2-affine", 32, 8 + 2),  # §4
    _Spec("rocmfp2_s40", 107, "fp2-s40", 32, 8 + 2),  # other forks
)
_SPEC_BY_NAME = {s.name: s for s in _ROCMFPX_SPEC}
# The unique reading of an untagged id (107 has none: it must be named).
_UNTAGGED_DEFAULT = {100: "rocmfp4", 101: "rocmfp4_fast", 102: "rocmfp6", 103: "rocmfp8",
                     104: "rocmfp3", 105: "rocmfp3_mix", 106: "rocmfp2_mix"}


@dataclass(frozen=True)
class TypeRef:
    """A resolved tensor format: name, ggml id, variant tag and block geometry.

    ``nbytes(n)`` is the payload size of ``n`` weights (``n % block_size == 0``).
    """

    name: str
    ggml_type: int
    variant: str
    block_size: int
    block_bytes: int
    decodable: bool
    needs_codebooks: bool

    def nbytes(self, n_elements: int) -> int:
        return (n_elements // self.block_size) * self.block_bytes


def _registered(name: str):
    # Imported lazily: the registry fills as codec modules land, and this
    # module must not pin what it saw at import time.
    from ds4quant.formats.qtype import all_qtypes

    return all_qtypes().get(name)


def ggml_type_name(ggml_type: int) -> Optional[str]:
    """The lowercase ggml name of a standard type id, or None if unknown."""
    try:
        t = gguf.GGMLQuantizationType(ggml_type)
    except ValueError:
        return None
    if t not in gguf.GGML_QUANT_SIZES:
        return None
    return t.name.lower()


def is_known_ggml_type(ggml_type: int) -> bool:
    return ggml_type in ROCMFPX_IDS or ggml_type_name(ggml_type) is not None


def type_ref(name: str) -> TypeRef:
    """Resolve a qtype name (registered, ROCmFPX fallback, or a lowercase
    standard ggml name) to a TypeRef. Unknown names raise UnknownQTypeError."""
    qt = _registered(name)
    if qt is not None and qt.ggml_type is not None:
        geometry = (qt.block_size, qt.block_bytes)
        if qt.ggml_type not in ROCMFPX_IDS and ggml_type_name(qt.ggml_type) is not None:
            # a standard ggml type's layout is ggml's, whatever the codec's blocking
            geometry = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qt.ggml_type)]
        return TypeRef(qt.name, int(qt.ggml_type), qt.variant, geometry[0], geometry[1], True, qt.is_mix)
    spec = _SPEC_BY_NAME.get(name)
    if spec is not None:
        return TypeRef(spec.name, spec.ggml_type, spec.variant, spec.block_size, spec.block_bytes,
                       False, spec.needs_codebooks)
    try:
        t = gguf.GGMLQuantizationType[name.upper()]
    except KeyError:
        t = None
    if t is not None and t in gguf.GGML_QUANT_SIZES and name == t.name.lower():
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[t]
        return TypeRef(name, int(t), name, block_size, block_bytes, False, False)
    if qt is not None:
        raise UnknownQTypeError(f"qtype {name!r} has no ggml type id, so it cannot be stored in GGUF")
    raise UnknownQTypeError(
        f"unknown qtype {name!r}",
        hint="use a registered qtype, a ROCmFPX name (" + ", ".join(_SPEC_BY_NAME)
        + ") or a lowercase ggml type name such as f32, q8_0",
    )


def untagged_ref(ggml_type: int, variant_107: Optional[str] = None) -> Optional[TypeRef]:
    """The reading of an untagged ggml id: standard ids and 100-106 resolve
    uniquely; 107 resolves only through ``variant_107``; else None."""
    if ggml_type == ID_AMBIGUOUS:
        return type_ref(variant_107) if variant_107 is not None else None
    if ggml_type in _UNTAGGED_DEFAULT:
        return type_ref(_UNTAGGED_DEFAULT[ggml_type])
    name = ggml_type_name(ggml_type)
    return type_ref(name) if name is not None else None


def tensor_nbytes(qtype: "str | TypeRef", shape: "tuple[int, ...] | list[int]") -> int:
    """Payload bytes of a tensor of GGUF shape ``shape`` (ne[0] innermost).

    ROCmFPX sizes come from ``ds4quant.formats`` when the qtype is registered
    (``get_qtype(name).nbytes``), else from the spec table; standard ggml
    types from ``gguf.GGML_QUANT_SIZES``. ``shape[0]`` must be a multiple of
    the block size.
    """
    ref = qtype if isinstance(qtype, TypeRef) else type_ref(qtype)
    n = 1
    for d in shape:
        n *= int(d)
    qt = _registered(ref.name)
    if qt is not None and ref.ggml_type in ROCMFPX_IDS:
        return int(qt.nbytes(n))
    return ref.nbytes(n)


def id_geometry(ggml_type: int) -> Optional[tuple[int, int]]:
    """(block_size, block_bytes) of a ggml id, or None if the id is unknown.

    Every reading of an ambiguous id has the same geometry (all 107 codecs
    are 10 B / 32), so a file's layout can be checked before its tags are.
    """
    from ds4quant.formats.qtype import qtypes_for_ggml_type

    if ggml_type in ROCMFPX_IDS:
        regs = qtypes_for_ggml_type(ggml_type)
        if regs:
            return regs[0].block_size, regs[0].block_bytes
        spec = next(s for s in _ROCMFPX_SPEC if s.ggml_type == ggml_type)
        return spec.block_size, spec.block_bytes
    name = ggml_type_name(ggml_type)
    if name is None:
        return None
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
