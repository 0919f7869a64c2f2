"""ROCmFP8 -- ggml type 103 (Q8_0_ROCMFPX), variant "fp8" (docs/formats.md#rocmfp8).

Block of 32 weights, 33 bytes::

    qs[32]  int8 codes (two's complement), -128 never produced
    e       one UE4M3 scale for the whole block

Decode ``qs_i * S(e)``. Element quantiser q = lroundf(clamp(x/S, -127, 127)).
Without importance there is **no search**: ``e = N(max_abs / 127)`` (docs/formats.md#ue4m3 N,
with its float32 collapse towards 1 for huge targets). With importance,
docs/formats.md#scale-search over the 32-block with top = 127.
"""

from __future__ import annotations

from ds4quant.formats.scale_codecs import make_codec
from ds4quant.formats.qtype import RT_DS4QUANT, RT_LUCEBOX, QType, register
from ds4quant.formats.search.tables import FP8

_GROUP = 32


QTYPE = register(
    QType(
        name="rocmfp8",
        ggml_type=103,
        variant="fp8",
        block_size=32,
        block_bytes=32 + 1,
        layout="qs[32] int8 codes + e UE4M3 block scale",
        family="rocmfpx",
        runtimes=(RT_DS4QUANT, RT_LUCEBOX),
        description="ROCmFP8 int8 in [-127,127] x per-32 UE4M3 scale (Q8_0_ROCMFPX); "
        "nearest scale without importance, scale search with it",
    ),
    make_codec(FP8, _GROUP, fp8_nearest=True),
)
