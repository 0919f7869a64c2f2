"""ROCmFP6 -- ggml type 102 (Q6_0_ROCMFPX), variant "fp6" (docs/formats.md#rocmfp6).

Block of 32 weights, 26 bytes::

    qs[24]  6-bit codes, weight i at bits 6i..6i+5 of the little-endian stream
    e[2]    UE4M3 half scales (weights 0-15, 16-31)

Code bit 5 is the sign, bits 0-4 the magnitude m in 0..31 (V = +-m; code 32
decodes as +0). Element quantiser m = lroundf(min(|x/S|, 31)). Encoder:
docs/formats.md#scale-search per half with top = 31.
"""

from __future__ import annotations

from ds4quant.formats.scale_codecs import make_codec
from ds4quant.formats.qtype import RT_DS4QUANT, RT_LUCEBOX, QType, register
from ds4quant.formats.search.tables import FP6

_GROUP = 16


QTYPE = register(
    QType(
        name="rocmfp6",
        ggml_type=102,
        variant="fp6",
        block_size=32,
        block_bytes=24 + 2,
        layout="qs[24] 6-bit sign+magnitude codes + e[2] UE4M3 half scales",
        family="rocmfpx",
        runtimes=(RT_DS4QUANT, RT_LUCEBOX),
        description="ROCmFP6 sign + 0..31 x per-16 UE4M3 scale (Q6_0_ROCMFPX)",
    ),
    make_codec(FP6, _GROUP),
)
