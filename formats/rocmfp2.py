"""ROCmFP2 default -- ggml type 107, variant "fp2-default" (docs/formats.md#rocmfp2).

Block of 32 weights, 10 bytes::

    qs[8]  2-bit codes, weight i at bits 2*(i%4) of qs[i//4]
    e[2]   half scales: e[0] weights 0-15, e[1] weights 16-31

A weight decodes as ``(code - 1) * H(e)``: levels {-1, 0, 1, 2} times the
half scale ``H(e) = S(e & 0x7F)``, negated when bit 7 is set (the fp2s
mirror: levels {1, 0, -1, -2}, zero code -> -0.0; ``e & 0x7F == 0x7F`` -> +-0).

The default encoder is the reference one (docs/formats.md#scale-search per half with
top = 2) and never sets bit 7. Its element quantiser picks the level with
the smallest float32 ``|x/S - V|``, ties to the lower code: the threshold (docs/formats.md#rocmfp2)
table, except that beyond |x/S| = 2^24 the distances collapse and the lower
code wins (an outlier of 1e20 at S = 2^-10 gets code 0, as the golden
overflow vectors show). ``fp2s=True`` is our own option (the fp2s
encoder is unpublished, docs/formats.md#rocmfp2): per half it also searches the mirrored level
set -- equivalently it encodes -x -- and sets bit 7 when the mirrored half's
(weighted) error is strictly lower, so it never raises a half's error.
"""

from __future__ import annotations

from ds4quant.formats.scale_codecs import make_codec
from ds4quant.formats.qtype import RT_DS4QUANT, RT_LUCEBOX, QType, register
from ds4quant.formats.search.tables import FP2

_GROUP = 16  # one scale per 16-weight half


QTYPE = register(
    QType(
        name="rocmfp2",
        ggml_type=107,
        variant="fp2-default",
        block_size=32,
        block_bytes=8 + 2,
        layout="qs[8] 2-bit codes + e[2] UE4M3 half scales (bit 7 = fp2s mirror)",
        family="rocmfpx",
        runtimes=(RT_DS4QUANT, RT_LUCEBOX),
        description="ROCmFP2 {-1,0,1,2} x per-16 UE4M3 scale, Lucebox default build; "
        "decodes fp2s mirrored halves; encode option fp2s=True picks the mirror per half",
    ),
    make_codec(FP2, _GROUP, options={"fp2s": "mirror"}),
)
