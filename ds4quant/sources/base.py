"""The ``Source`` protocol: what convert, adaptive and verify read from a model.

Both the official-layout folder (``official.OfficialSource``) and a GGUF
(``gguf_source.GgufSource``) implement it; callers type against this, never
against one of them, and never probe for optional methods.

    src: Source = open_any_source("samples/ds4-tiny")
    for m in src.names.mapped: x = src.read_dequantized(m.name); src.release(m.name)
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator, Optional, Protocol, runtime_checkable

import numpy as np

from ds4quant.sources.config import Ds4Config
from ds4quant.sources.naming import NameMap, Skipped


@runtime_checkable
class SourceTensor(Protocol):
    """What a source holds for one tensor (no data)."""

    name: str
    dtype: str  # upper-case storage type ("BF16", "F8_E4M3", "MXFP4", ...)
    shape: tuple[int, ...]
    shape_logical: tuple[int, ...]  # value shape, numpy order (out, in)
    nbytes: int


@runtime_checkable
class Source(Protocol):
    """An open, validated DeepSeek-V4 model, read one tensor at a time."""

    path: Path
    config: Ds4Config
    names: NameMap

    @property
    def format(self) -> str:
        """``deepseek-v4-official`` or ``deepseek-v4-gguf`` (written into the manifest)."""

    @property
    def name(self) -> str:
        """A short model name for default artifact names (folder or file stem)."""

    @property
    def skipped(self) -> tuple[Skipped, ...]: ...

    def tensor_names(self) -> list[str]: ...

    def weight_names(self) -> list[str]: ...

    def info(self, name: str) -> SourceTensor: ...

    def read(self, name: str) -> np.ndarray:
        """The stored bytes or values, read-only, no copy."""

    def read_dequantized(self, name: str) -> np.ndarray:
        """float32 values, exactly; a new writable array."""

    def iter_tensors(self, names: Optional[Iterable[str]] = None, *, dequantize: bool = False
                     ) -> Iterator[tuple[str, np.ndarray]]: ...

    def payload_qtype(self, name: str) -> Optional[str]:
        """The ds4quant qtype the stored bytes already are (convert copies them
        when the plan asks for it), or None when they are no ds4quant qtype."""

    def expert_fp4(self, layer: int, expert: int, which: str) -> tuple[np.ndarray, np.ndarray]:
        """Lossless FP4 of one routed expert: (int8 codes (out, in/2), uint8 E8M0 scales (out, in/32))."""

    def release(self, name: str) -> None:
        """Let the OS drop a tensor's pages after use (advice only)."""

    def fingerprint(self) -> str: ...

    def close(self) -> None: ...
