"""artifact.qtypes sizes come from the codec registry; each ROCmFPX entry is
pinned here to docs/formats.md's field sums and to the golden vectors' lengths.

The field lists are read from docs/formats.md (section per row) and
written out field by field, so a wrong codec entry, a wrong reading and
a golden file that disagrees each fail a different assertion.
"""

from __future__ import annotations

import pytest

from ds4quant import formats
from ds4quant.artifact.qtypes import (
    ID_AMBIGUOUS, ROCMFPX_IDS, VARIANTS_107, id_geometry, tensor_nbytes, type_ref, untagged_ref,
)
from ds4quant.errors import UnknownQTypeError
from tests.golden import FORMAT_TO_QTYPE, load_cases

# qtype -> (ggml id, variant tag, docs section, fields (name, bytes) of one 32-weight block)
SPEC = {
    "rocmfp4": (100, "fp4-cb10-h16", "docs/formats.md#rocmfp4", (("qs", 16), ("e half scales", 2))),
    "rocmfp4_fast": (101, "fp4-cb10-b32", "docs/formats.md#rocmfp4", (("qs", 16), ("e block scale", 1))),
    "rocmfp6": (102, "fp6", "docs/formats.md#rocmfp6", (("qs", 24), ("e half scales", 2))),
    "rocmfp8": (103, "fp8", "docs/formats.md#rocmfp8", (("qs", 32), ("e block scale", 1))),
    "rocmfp3": (104, "fp3", "docs/formats.md#rocmfp3", (("qs", 12), ("e half scales", 2))),
    "rocmfp3_mix": (105, "mix105-7s1c", "docs/formats.md#mix (= #rocmfp3 wire)", (("qs", 12), ("meta per half", 2))),
    "rocmfp2_mix": (106, "mix106-7s1c", "docs/formats.md#mix (= #rocmfp2 wire)", (("qs", 8), ("meta per half", 2))),
    "rocmfp2": (107, "fp2-default", "docs/formats.md#rocmfp2", (("qs", 8), ("e half scales", 2))),
    # docs/formats.md#rocmfp2-affine: e[0] is the scale byte, e[1] the offset byte (one each per 32 weights)
    "rocmfp2_affine": (107, "fp2-affine", "docs/formats.md#rocmfp2-affine", (("qs", 8), ("scale", 1), ("offset", 1))),
    # not Lucebox; shares id 107 and its geometry (docs/formats.md#type-107)
    "rocmfp2_s40": (107, "fp2-s40", "other forks", (("qs", 8), ("e half scales", 2))),
}
# docs/formats.md section headings: bytes per 32 weights
SPEC_HEADING_BYTES = {100: 18, 101: 17, 102: 26, 103: 33, 104: 14, 105: 14, 106: 10, 107: 10}


def _registered_rocmfpx() -> dict:
    return {q.name: q for q in formats.QTYPES.values() if q.ggml_type in ROCMFPX_IDS}


def test_every_rocmfpx_codec_is_pinned():
    assert set(_registered_rocmfpx()) == set(SPEC)
    assert {gid for gid, *_ in SPEC.values()} == set(ROCMFPX_IDS)


@pytest.mark.parametrize("name", list(SPEC))
def test_codec_registry_entry_matches_spec_field_sum(name):
    gid, variant, _section, fields = SPEC[name]
    total = sum(n for _f, n in fields)
    assert total == SPEC_HEADING_BYTES[gid]
    q = formats.QTYPES[name]
    assert (q.ggml_type, q.variant, q.block_size, q.block_bytes) == (gid, variant, 32, total)
    ref = type_ref(name)
    assert (ref.ggml_type, ref.variant, ref.block_size, ref.block_bytes) == (gid, variant, 32, total)
    assert ref.decodable and ref.needs_codebooks == (gid in (105, 106))
    assert id_geometry(gid) == (32, total)
    assert tensor_nbytes(name, (96, 5, 3)) == 96 * 5 * 3 // 32 * total


def test_golden_lengths_match():
    seen = set()
    for case in load_cases():
        r = case.record
        if "block_bytes" not in r or r.get("block_bytes") is None:
            continue
        name = FORMAT_TO_QTYPE[r["format"]]
        assert r["ggml_type"] == SPEC[name][0], case.id
        assert r["block_bytes"] == type_ref(name).block_bytes == formats.QTYPES[name].block_bytes, case.id
        assert r["row_bytes"] == tensor_nbytes(name, (r["k"],)), case.id
        seen.add(name)
    assert seen == set(SPEC) - {"rocmfp2_s40"}  # the golden set has no S40 cases


def test_ambiguous_id_shares_one_geometry():
    regs = formats.qtypes_for_ggml_type(ID_AMBIGUOUS)
    assert sorted(q.name for q in regs) == sorted(VARIANTS_107)
    assert {(q.block_size, q.block_bytes) for q in regs} == {(32, 10)}


def test_untagged_ids():
    for gid in ROCMFPX_IDS:
        ref = untagged_ref(gid)
        if gid == ID_AMBIGUOUS:
            assert ref is None  # must be named
            for v in VARIANTS_107:
                assert untagged_ref(gid, v).name == v
        else:
            (name,) = [n for n, s in SPEC.items() if s[0] == gid]
            assert ref.name == name
    assert untagged_ref(8).name == "q8_0" and untagged_ref(12).name == "q4_k"
    assert not untagged_ref(12).decodable
    assert untagged_ref(99) is None and id_geometry(99) is None


def test_unknown_names():
    with pytest.raises(UnknownQTypeError, match="unknown qtype 'rocmfp5'") as e:
        type_ref("rocmfp5")
    assert "rocmfp4, rocmfp4_fast, rocmfp6" in str(e.value) and "rocmfp2_s40" in str(e.value)
    with pytest.raises(UnknownQTypeError, match="has no ggml type id"):
        type_ref("e8m0")
