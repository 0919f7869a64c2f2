"""The QType record and the registry every codec module adds itself to.

A codec module states its layout once (a ``QType``) and hands the registry a
``Codec`` with its numpy reference, numba fast path and torch decode. The
public functions in ``ds4quant.formats`` validate arguments once, here, and
dispatch by name; codec modules only see well-formed (rows, cols) arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from ds4quant.errors import UnknownQTypeError

# Runtimes that can load a tensor of a given qtype. Names are stable strings
# written into manifests and shown by `ds4quant formats`.
RT_DS4QUANT = "ds4quant"  # the bundled runtime (CPU/CUDA/HIP, exact + fast)
RT_LUCEBOX = "lucebox"  # Luce-Org/lucebox default build
RT_LUCEBOX_AFFINE = "lucebox-affine"  # lucebox built with ROCMFP2_AFFINE
RT_LLAMA_CPP = "llama.cpp"  # upstream ggml
RT_GGUF_PY = "gguf-py"  # gguf-py's reader + dequantize


@dataclass(frozen=True)
class QType:
    """One tensor format.

    ``layout`` is the block written as a sum of fields, e.g.
    ``"qs[8] 2-bit codes + e[2] UE4M3 half scales"``; ``block_bytes`` must equal
    that sum (a test checks each entry against docs/formats.md and the golden lengths).
    ``variant`` is the explicit tag written per tensor into artifacts, because
    ggml type ids collide between forks (107 has three meanings).
    """

    name: str
    ggml_type: Optional[int]
    variant: str
    block_size: int
    block_bytes: int
    layout: str
    family: str
    runtimes: tuple[str, ...] = ()
    row_multiple: int = 32
    codebook_levels: int = 0  # L per book for MIX types (2 books per expert)
    can_encode: bool = True
    lossy: bool = True
    description: str = ""

    @property
    def bpw(self) -> float:
        """Bits per weight, block overhead included."""
        return 8.0 * self.block_bytes / self.block_size

    @property
    def is_mix(self) -> bool:
        return self.codebook_levels > 0

    def row_bytes(self, cols: int) -> int:
        """Bytes of one encoded row of ``cols`` weights (cols % block_size == 0)."""
        return (cols // self.block_size) * self.block_bytes

    def nbytes(self, n_weights: int) -> int:
        return (n_weights // self.block_size) * self.block_bytes

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "ggml_type": self.ggml_type,
            "variant": self.variant,
            "block_size": self.block_size,
            "block_bytes": self.block_bytes,
            "bpw": round(self.bpw, 6),
            "layout": self.layout,
            "family": self.family,
            "row_multiple": self.row_multiple,
            "codebook_levels": self.codebook_levels,
            "can_encode": self.can_encode,
            "lossy": self.lossy,
            "runtimes": list(self.runtimes),
            "description": self.description,
        }


@dataclass(frozen=True)
class Codec:
    """The implementations of one qtype. Every callable takes validated input.

    encode_ref(x, importance, codebooks, **options) -> uint8 (rows, row_bytes)
        x: float32 (rows, cols), C-contiguous; importance: float32 (cols,) or None;
        codebooks: float32 (2, L) or None.
    encode_fast: same signature and bytes as encode_ref (numba), or None.
    decode_ref(data, cols, codebooks, modes) -> float32 (rows, cols)
        data: uint8 (rows, row_bytes); codebooks float32 (2, L) or None;
        modes: int 0/1 (MIX only).
    decode_fast: same as decode_ref (numba), or None.
    decode_torch(data, cols, codebooks, modes) -> torch.float32 on data.device
        data: torch.uint8 (rows, row_bytes); codebooks: torch.float32 (2, L).
    """

    encode_ref: Optional[Callable] = None
    encode_fast: Optional[Callable] = None
    decode_ref: Optional[Callable] = None
    decode_fast: Optional[Callable] = None
    decode_torch: Optional[Callable] = None
    encode_options: tuple[str, ...] = ()  # keyword options the encoder accepts


@dataclass
class _Registry:
    qtypes: dict[str, QType] = field(default_factory=dict)
    codecs: dict[str, Codec] = field(default_factory=dict)


_REGISTRY = _Registry()


def register(qtype: QType, codec: Codec) -> QType:
    """Add a qtype and its codec. Names are unique; re-registration is a bug."""
    if qtype.name in _REGISTRY.qtypes:
        raise RuntimeError(f"qtype {qtype.name!r} registered twice")
    if qtype.block_bytes <= 0 or qtype.block_size <= 0:
        raise RuntimeError(f"qtype {qtype.name!r}: bad block geometry")
    _REGISTRY.qtypes[qtype.name] = qtype
    _REGISTRY.codecs[qtype.name] = codec
    return qtype


def get_qtype(name: "str | QType") -> QType:
    """Look a qtype up by name (or pass a QType through)."""
    if isinstance(name, QType):
        return name
    try:
        return _REGISTRY.qtypes[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY.qtypes))
        raise UnknownQTypeError(
            f"unknown qtype {name!r}", hint=f"known qtypes: {known}"
        ) from None


def get_codec(name: str) -> Codec:
    return _REGISTRY.codecs[get_qtype(name).name]


def all_qtypes() -> dict[str, QType]:
    return dict(_REGISTRY.qtypes)


def qtypes_for_ggml_type(ggml_type: int) -> list[QType]:
    """Every registered qtype that uses ``ggml_type`` (ids are ambiguous)."""
    return [q for q in _REGISTRY.qtypes.values() if q.ggml_type == ggml_type]
