"""Layer-streamed execution of the DeepSeek-V4 model with bounded memory.

The whole-model reference (``runtime.reference.load_reference``) holds every
layer's weights at once: about 1.1 TB in float32 for DeepSeek-V4 Flash. The
streamed forward holds every sequence's hidden state (the hyper-connection
streams) and goes through the decoder one layer at a time: it materializes
that layer's weights (transformers' own ``DeepseekV4DecoderLayer``, so the
numbers are the reference's), runs it on every batch, releases it, goes on;
then the final norm and head. Peak memory is the largest layer plus the hidden
states plus one layer's working set, whatever the layer count.

    from ds4quant.runtime.stream import SourceWeights, StreamedModel, stream_forward
    with SourceWeights("samples/ds4-tiny") as w:
        sm = StreamedModel(w)
        logits = stream_forward(sm, sm.batches([[0, 5, 9], [0, 7]]))   # [B,S,V] per batch

Weight providers: ``SourceWeights`` (the source, dequantized by our own exact
code) and ``ArtifactWeights`` (the artifact's dense tensors decoded, routed
experts run by the runtime's executor on a placement). ``Observer`` sees each
layer, batch and routed-experts call; ``plan_memory`` fits the run into a
``--max-memory`` budget (hidden states in RAM or in a memmap). Importing this
package does not import torch.
"""

from __future__ import annotations

import importlib

_FACE = {
    "reference_config": "ds4quant.runtime.stream.config",
    "empty_layer": "ds4quant.runtime.stream.config",
    "WeightProvider": "ds4quant.runtime.stream.source",
    "SourceWeights": "ds4quant.runtime.stream.source",
    "SourceExperts": "ds4quant.runtime.stream.source",
    "EagerExperts": "ds4quant.runtime.stream.source",
    "expert_rows": "ds4quant.runtime.stream.source",
    "down_input": "ds4quant.runtime.stream.source",
    "rows_by_expert": "ds4quant.runtime.stream.source",
    "ArtifactWeights": "ds4quant.runtime.stream.artifact",
    "Batch": "ds4quant.runtime.stream.model",
    "Observer": "ds4quant.runtime.stream.model",
    "StreamedModel": "ds4quant.runtime.stream.model",
    "stream_forward": "ds4quant.runtime.stream.model",
    "RamStore": "ds4quant.runtime.stream.store",
    "MemmapStore": "ds4quant.runtime.stream.store",
    "MemoryPlan": "ds4quant.runtime.stream.memory",
    "plan_memory": "ds4quant.runtime.stream.memory",
}

__all__ = sorted(_FACE)


def __getattr__(name: str):
    if name in _FACE:
        return getattr(importlib.import_module(_FACE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
