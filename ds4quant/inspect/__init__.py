"""``ds4quant inspect``: what an artifact (or any GGUF) holds, per tensor (``tensors``)."""

from ds4quant.inspect.tensors import Inspection, TensorRow, inspect_artifact

__all__ = ["inspect_artifact", "Inspection", "TensorRow"]
