"""ROCmFP4 -- ggml types 100 (Q4_0_ROCMFP4, "fp4-cb10-h16", 18 B) and
101 (Q4_0_ROCMFP4_FAST, "fp4-cb10-b32", 17 B) (docs/formats.md#rocmfp4).

Blocks of 32 weights::

    qs[16]  4-bit codes in split order: qs[j] low nibble = weight j,
            high nibble = weight j+16 (not adjacent pairs)
    e[2]    (100) UE4M3 half scales, weights 0-15 / 16-31
    e       (101) one UE4M3 scale for all 32

Code bit 3 is the sign, bits 0-2 index the Codebook10 magnitudes
{0, 1, 2, 3, 4, 6, 8, 10}; code 8 ("-0") decodes as +0. Encoder: docs/formats.md#scale-search with
top = 10 per half (100) or per block (101), and the FP4 rule: a candidate
whose error is >= FLT_MAX is never chosen; if none is below, e = 0.
"""

from __future__ import annotations

from ds4quant.formats.scale_codecs import make_codec
from ds4quant.formats.qtype import RT_DS4QUANT, RT_LUCEBOX, QType, register
from ds4quant.formats.search.tables import FP4


QTYPE = register(
    QType(
        name="rocmfp4",
        ggml_type=100,
        variant="fp4-cb10-h16",
        block_size=32,
        block_bytes=16 + 2,
        layout="qs[16] split-nibble Codebook10 codes + e[2] UE4M3 half scales",
        family="rocmfpx",
        runtimes=(RT_DS4QUANT, RT_LUCEBOX),
        description="ROCmFP4 sign + {0,1,2,3,4,6,8,10} x per-16 UE4M3 scale (Q4_0_ROCMFP4)",
    ),
    make_codec(FP4, 16),
)

QTYPE_FAST = register(
    QType(
        name="rocmfp4_fast",
        ggml_type=101,
        variant="fp4-cb10-b32",
        block_size=32,
        block_bytes=16 + 1,
        layout="qs[16] split-nibble Codebook10 codes + e UE4M3 block scale",
        family="rocmfpx",
        runtimes=(RT_DS4QUANT, RT_LUCEBOX),
        description="ROCmFP4 FAST sign + {0,1,2,3,4,6,8,10} x per-32 UE4M3 scale (Q4_0_ROCMFP4_FAST)",
    ),
    make_codec(FP4, 32),
)
