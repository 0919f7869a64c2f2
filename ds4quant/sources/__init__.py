"""Model sources: read-only, validated, one tensor at a time.

    from ds4quant.sources import open_any_source
    src = open_any_source("samples/ds4-tiny")        # official DeepSeek-V4 layout
    src = open_any_source("ds4-tiny-mxfp4.gguf")     # a DeepSeek-V4 GGUF (or any file of a split set)
    for name, w in src.iter_tensors(dequantize=True): ...

Both kinds implement the ``Source`` protocol (``sources.base``: ``config``,
``names``, ``info``, ``read``, ``read_dequantized``, ``payload_qtype``,
``release``, ``expert_fp4``, ``fingerprint``, ``close``, ``path``, ``name``,
``format``). ``naming`` maps official names to GGUF names and tensor
classes (and back) and computes the deepseek4.* GGUF keys;
``safetensors_file`` is the validating safetensors reader.
"""

from __future__ import annotations

import os
from pathlib import Path

from ds4quant.errors import BadInputError
from ds4quant.sources.base import Source, SourceTensor
from ds4quant.sources.config import Ds4Config, parse_config
from ds4quant.sources.gguf_source import GgufSource, open_gguf_source
from ds4quant.sources.naming import Kind, deepseek4_kvs, map_name, map_names, official_name
from ds4quant.sources.official import CONFIG, OfficialSource, TensorInfo, open_source
from ds4quant.sources.safetensors_file import SafetensorsFile

__all__ = [
    "Ds4Config",
    "GgufSource",
    "Kind",
    "OfficialSource",
    "SafetensorsFile",
    "Source",
    "SourceTensor",
    "TensorInfo",
    "deepseek4_kvs",
    "map_name",
    "map_names",
    "official_name",
    "open_any_source",
    "open_gguf_source",
    "open_official_source",
    "open_source",
    "parse_config",
]


def open_any_source(path: "str | os.PathLike") -> Source:
    """Open a conversion source by what ``path`` is: a folder with
    config.json -> the official layout (``open_source``); a ``.gguf`` file
    (any file of a split set) -> ``open_gguf_source``. Anything else is a
    one-line BadInputError."""
    p = Path(path)
    if not p.exists():
        raise BadInputError("no such file or folder", where=str(p))
    if p.is_dir():
        if (p / CONFIG).is_file():
            return open_source(p)
        raise BadInputError(f"folder has no {CONFIG}", where=str(p),
                            hint="give an official DeepSeek-V4 checkpoint folder or a .gguf file")
    if p.is_file() and p.name.lower().endswith(".gguf"):
        return open_gguf_source(p)
    raise BadInputError("is neither a checkpoint folder (config.json + safetensors) nor a .gguf file",
                        where=str(p))


def open_official_source(path: "str | os.PathLike", why: str) -> OfficialSource:
    """``open_source`` for callers that need the official layout (``why`` says
    what for); a GGUF is refused with that reason rather than a layout error."""
    p = Path(path)
    if p.is_file() and p.name.lower().endswith(".gguf"):
        raise BadInputError(f"is a GGUF; {why} needs the official checkpoint folder (config.json + safetensors)",
                            where=str(p))
    return open_source(p)
