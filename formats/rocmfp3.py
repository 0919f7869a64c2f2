"""ROCmFP3 -- ggml type 104 (Q3_0_ROCMFPX), variant "fp3" (docs/formats.md#rocmfp3).

Block of 32 weights, 14 bytes::

    qs[12]  3-bit codes, weight i at bits 3i..3i+2 of the little-endian
            96-bit stream (codes straddle bytes: weight 2 = bits 6-7 of
            qs[0] and bit 0 of qs[1])
    e[2]    UE4M3 half scales (weights 0-15, 16-31)

Code bit 2 is the sign, bits 0-1 index magnitudes {0, 1, 2, 4}; code 4
("-0") decodes as +0. Encoder: docs/formats.md#scale-search per half with top = 4.
"""

from __future__ import annotations

from ds4quant.formats.scale_codecs import make_codec
from ds4quant.formats.qtype import RT_DS4QUANT, RT_LUCEBOX, QType, register
from ds4quant.formats.search.tables import FP3

_GROUP = 16


QTYPE = register(
    QType(
        name="rocmfp3",
        ggml_type=104,
        variant="fp3",
        block_size=32,
        block_bytes=12 + 2,
        layout="qs[12] 3-bit sign+magnitude codes + e[2] UE4M3 half scales",
        family="rocmfpx",
        runtimes=(RT_DS4QUANT, RT_LUCEBOX),
        description="ROCmFP3 sign + {0,1,2,4} x per-16 UE4M3 scale (Q3_0_ROCMFPX)",
    ),
    make_codec(FP3, _GROUP),
)
