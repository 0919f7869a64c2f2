"""ROCmFP2 S40 -- ggml type 107 in other forks, variant "fp2-s40".

Not Lucebox (docs/formats.md#rocmfp2-s40, #type-107). The layout and
encoder here follow the public fork sources found in the code index:
``ggml/rocmfpx/rocmfpx.{c,h}`` of ``halo-box/strix-llama.cpp`` (commits
``b6a3f392`` and ``463bc10e``) and an identical copy in another llama.cpp fork
("ROCmFP2 S40 uses the frozen MORD code order {-4, -1, +1, +4}"). Facts only;
the code is ours.

Block of 32 weights, 10 bytes (the 107 wire of docs/formats.md#rocmfp2)::

    qs[8]  2-bit codes, weight i at bits 2*(i%4) of qs[i//4]
    e[2]   UE4M3 half scales (weights 0-15, 16-31); e > 0x7E decodes as 0,
           bit 7 is not a mirror

Levels by code: 0 -> -4, 1 -> -1, 2 -> +1, 3 -> +4 (no zero level), so
a weight decodes as ``level * S(e)``.

Element quantiser (fork ``rocmfpx_quantize_fp2_code``): a non-finite x or a
zero scale gives code 0 (the -4 level, times 0 when e = 0); otherwise the
magnitude is outer (4) when ``|x/S| > 2.5`` (ties inner) and the sign comes
from ``signbit(x)``, so -0.0 gives -1 and +0.0 gives +1.

Scale search per half: docs/formats.md#scale-search with top = 4, with the fork's own weighting:
sigma^2 is the plain float32 sum of finite x^2 over k (no double fallback)
and ``w = q * sqrtf(sigma^2 + x*x)`` is not clamped to FLT_MAX, so an infinite
weight can make a candidate's error NaN; such a candidate is never chosen.
The fork's walk starts from ``(+inf, N_fork(max/4))``, its binary-search
nearest byte (no float32 collapse). ``zero_seed=True`` reproduces the later
fork revision (``463bc10e``) that first scores scale byte 0 (every weight
decodes to -0, error sum(w*x*x)) and lets 1..126 beat it, ties keeping 0;
it helps halves far below the smallest scale, where the default must pick
e = 1 and amplify every value to +-2^-10.
"""

from __future__ import annotations

from ds4quant.formats.scale_codecs import make_codec
from ds4quant.formats.qtype import RT_DS4QUANT, QType, register
from ds4quant.formats.search.tables import S40

_GROUP = 16


QTYPE = register(
    QType(
        name="rocmfp2_s40",
        ggml_type=107,
        variant="fp2-s40",
        block_size=32,
        block_bytes=8 + 2,
        layout="qs[8] 2-bit codes + e[2] UE4M3 half scales",
        family="rocmfpx",
        runtimes=(RT_DS4QUANT,),
        description="ROCmFP2 S40 {-4,-1,1,4} x per-16 UE4M3 scale: the 107 of the ROCmFPX "
        "llama.cpp forks (halo-box/strix-llama.cpp and kin), not Lucebox; option zero_seed=True "
        "follows the fork revision that also scores scale 0",
    ),
    make_codec(S40, _GROUP, options={"zero_seed": "zero_seed"}),
)
