"""Model sources: read-only, validated, one tensor at a time.

    from ds4quant.sources import open_source
    src = open_source("samples/ds4-tiny")       # official DeepSeek-V4 layout
    for name, w in src.iter_tensors(dequantize=True): ...

``naming`` maps official names to GGUF names and tensor classes and computes
the deepseek4.* GGUF keys; ``safetensors_file`` is the validating reader.
"""

from ds4quant.sources.config import Ds4Config, parse_config
from ds4quant.sources.naming import Kind, deepseek4_kvs, map_name, map_names
from ds4quant.sources.official import Source, TensorInfo, open_source
from ds4quant.sources.safetensors_file import SafetensorsFile

__all__ = [
    "Ds4Config",
    "Kind",
    "SafetensorsFile",
    "Source",
    "TensorInfo",
    "deepseek4_kvs",
    "map_name",
    "map_names",
    "open_source",
    "parse_config",
]
