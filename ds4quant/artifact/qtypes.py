"""What a ggml type id or a qtype name means inside an artifact, and its size.

Two sources, consulted in this order:

1. ``ds4quant.formats`` (the codec registry): a registered qtype is
   authoritative for its ggml id, variant and block geometry, and is
   decodable. It is the only size table for ROCmFPX ids 100-107 (docs/formats.md,
   one section per qtype; tests/artifact/test_qtypes.py
   pins each entry to those field sums and the golden lengths). 107 has
   three meanings (default, affine, S40) and 105/106 collide with TurboQuant
   in other forks, which is why artifacts carry explicit tags (``tags.py``).
2. standard ggml types from ``gguf.GGML_QUANT_SIZES``; a standard type is
   named by its lowercase ggml name ("f32", "q8_0", "q4_k"), which is also
   the ds4quant qtype name where one is registered.

A standard type that resolves only through gguf's table is readable and sized,
but ``decodable`` is False: ds4quant has no codec for it in this build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import gguf

from ds4quant.errors import UnknownQTypeError

# Lucebox ggml type ids (docs/formats.md, the qtype section headings).
ROCMFPX_IDS = range(100, 108)
ID_AMBIGUOUS = 107  # default / affine / S40 (docs/formats.md#type-107)

# The names a user may give for an untagged type-107 tensor.
VARIANTS_107 = ("rocmfp2", "rocmfp2_affine", "rocmfp2_s40")


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


def _registered_for_id(ggml_type: int) -> list:
    from ds4quant.formats.qtype import qtypes_for_ggml_type

    return qtypes_for_ggml_type(ggml_type)


def ggml_type_name(ggml_type: int) -> Optional[str]:
    """The lowercase ggml name of a standard type id, or None if unknown."""
    try:
        t = gguf.GGMLQuantizationType(ggml_type)
    except ValueError:
        return None
    if t not in gguf.GGML_QUANT_SIZES:
        return None
    return t.name.lower()


def type_ref(name: str) -> TypeRef:
    """Resolve a qtype name (registered in the codec registry, or a lowercase
    standard ggml name) to a TypeRef. Unknown names raise UnknownQTypeError."""
    qt = _registered(name)
    if qt is not None and qt.ggml_type is not None:
        geometry = (qt.block_size, qt.block_bytes)
        if qt.ggml_type not in ROCMFPX_IDS and ggml_type_name(qt.ggml_type) is not None:
            # a standard ggml type's layout is ggml's, whatever the codec's blocking
            geometry = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qt.ggml_type)]
        return TypeRef(qt.name, int(qt.ggml_type), qt.variant, geometry[0], geometry[1], True, qt.is_mix)
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
        hint="use a registered qtype, a ROCmFPX name (" + ", ".join(_rocmfpx_names())
        + ") or a lowercase ggml type name such as f32, q8_0",
    )


def _rocmfpx_names() -> list:
    return [q.name for i in ROCMFPX_IDS for q in _registered_for_id(i)]


def untagged_ref(ggml_type: int, variant_107: Optional[str] = None) -> Optional[TypeRef]:
    """The reading of an untagged ggml id: standard ids and 100-106 (one
    registered codec each) resolve uniquely; 107 resolves only through
    ``variant_107``; else None."""
    if ggml_type == ID_AMBIGUOUS:
        return type_ref(variant_107) if variant_107 is not None else None
    if ggml_type in ROCMFPX_IDS:
        regs = _registered_for_id(ggml_type)
        return type_ref(regs[0].name) if len(regs) == 1 else None
    name = ggml_type_name(ggml_type)
    return type_ref(name) if name is not None else None


def tensor_nbytes(qtype: "str | TypeRef", shape: "tuple[int, ...] | list[int]") -> int:
    """Payload bytes of a tensor of GGUF shape ``shape`` (ne[0] innermost).

    ROCmFPX sizes come from the codec registry (``ds4quant.formats``),
    standard ggml types from ``gguf.GGML_QUANT_SIZES`` (``type_ref``).
    ``shape[0]`` must be a multiple of the block size.
    """
    ref = qtype if isinstance(qtype, TypeRef) else type_ref(qtype)
    n = 1
    for d in shape:
        n *= int(d)
    return ref.nbytes(n)


def id_geometry(ggml_type: int) -> Optional[tuple[int, int]]:
    """(block_size, block_bytes) of a ggml id, or None if the id is unknown.

    Every reading of an ambiguous id has the same geometry (all 107 codecs
    are 10 B / 32; test_qtypes.py checks it), so a file's layout can be
    checked before its tags are. A ROCmFPX id with no registered codec is unknown.
    """
    if ggml_type in ROCMFPX_IDS:
        regs = _registered_for_id(ggml_type)
        return (regs[0].block_size, regs[0].block_bytes) if regs else None
    name = ggml_type_name(ggml_type)
    if name is None:
        return None
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]


def row_rule_problem(qtype: str, ne0: int) -> Optional[str]:
    """Why a tensor of ``qtype`` cannot have ``ne0`` weights per row, or None.

    A row must hold whole blocks, and some codecs group rows further (rocmfp2_mix
    needs 128: its codebook index words span four blocks); otherwise the tensor's
    byte size cannot match what the codec decodes. verify's shapes check and
    inspect both ask this."""
    from ds4quant.formats import QTYPES

    qt = QTYPES.get(qtype)
    if qt is None:
        return None  # a standard ggml type: the reader already held ne[0] to its block
    need = max(qt.block_size, qt.row_multiple)
    if ne0 % need:
        return f"ne[0] = {ne0} is not a multiple of {need}, which {qt.name} rows need"
    return None
