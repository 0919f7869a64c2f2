"""The routed-codebook coverage rule (docs/formats.md#p4mix, #gumix: every resident MIX
expert tensor covered exactly once): duplicates, gaps and wrong dims refused."""

from __future__ import annotations

import numpy as np
import pytest

from ds4quant.codebooks.gumix import check_gumix_coverage
from ds4quant.codebooks.p4mix import check_p4mix_coverage
from ds4quant.codebooks.routed import MixEntry, check_routed_coverage
from ds4quant.errors import CodebookError

F = np.float32
E = 3
B4 = np.tile(np.array([-1.0, -0.25, 0.5, 1.0], F), (E, 2, 1))
B8 = np.tile(np.array([-1.0, -0.75, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0], F), (E, 2, 1))


def _gu(layer, surface, books=B4, out=64, in_=256):
    return MixEntry(layer, surface, out, in_, np.ones(E, np.uint8), books)


def _down(layer, books=B8):
    return MixEntry(layer, 2, 256, 64, np.ones(E, np.uint8), books)


RESIDENT = {(0, 0): (E, 64, 256), (0, 1): (E, 64, 256)}


def test_exact_cover_passes():
    check_routed_coverage([_gu(0, 0), _gu(0, 1)], RESIDENT, "blob")
    # an entry for a tensor that is not resident is skipped, like the loader does
    check_routed_coverage([_gu(0, 0), _gu(0, 1), _gu(5, 0)], RESIDENT, "blob")


@pytest.mark.parametrize("same_books", [True, False], ids=["identical", "different-books"])
def test_two_entries_for_one_resident_tensor_are_refused(same_books):
    other = B4 if same_books else (B4 * F(0.5)).astype(F)
    entries = [_gu(0, 0), _gu(0, 1), _gu(0, 1, books=other)]
    with pytest.raises(CodebookError) as ei:
        check_routed_coverage(entries, RESIDENT, "GUMIXs1 blob")
    msg = ei.value.one_line() if hasattr(ei.value, "one_line") else str(ei.value)
    assert "blk.0.ffn_up_exps has 2 entries" in msg
    assert "GUMIXs1 blob" in msg
    assert "ffn_gate_exps" not in msg  # the gate tensor is covered once: not an offender


def test_duplicates_through_the_blob_wrappers():
    with pytest.raises(CodebookError, match="blk.0.ffn_gate_exps has 2 entries"):
        check_gumix_coverage([_gu(0, 0), _gu(0, 0), _gu(0, 1)], RESIDENT)
    with pytest.raises(CodebookError, match="blk.4.ffn_down_exps has 2 entries"):
        check_p4mix_coverage([_down(4), _down(4)], {4: (E, 256, 64)})


def test_every_offender_is_listed():
    entries = [_gu(0, 0), _gu(0, 0), _gu(2, 1), _gu(2, 1)]  # dup resident, gap, dup non-resident
    with pytest.raises(CodebookError) as ei:
        check_routed_coverage(entries, RESIDENT, "blob")
    msg = str(ei.value)
    assert "3 coverage problem(s)" in msg
    for part in ("blk.0.ffn_gate_exps has 2 entries", "blk.0.ffn_up_exps has no entry",
                 "blk.2.ffn_up_exps has 2 entries"):
        assert part in msg


def test_wrong_dims_are_refused():
    with pytest.raises(CodebookError, match=r"blk.0.ffn_up_exps is \(E, out, in\) = \(3, 64, 256\) but its entry says \(3, 32, 256\)"):
        check_routed_coverage([_gu(0, 0), _gu(0, 1, out=32)], RESIDENT, "blob")
