"""Codebook fitting, validation, and the out-of-band tables' wire formats.

    fit_reference(matrices, levels, importance)   the Lucebox fitter, bit-exact (docs/formats.md#mix-fitter)
    fit_optimized(matrices, qtype, importance)    ours: Lloyd against the MIX encoder
    CodebookEntry / CodebookTable                 ds4quant's name-keyed table
    read_table / write_table / check_coverage     its wire and the exact-cover rule
    p4mix, gumix, dmix                            Lucebox sidecars (docs/formats.md#p4mix, #gumix, #dmix)
    to_lucebox / from_lucebox                     table <-> Lucebox sidecars
"""

from ds4quant.codebooks import dmix, gumix, p4mix
from ds4quant.codebooks.histogram import FitResult, Histogram, fit_reference, fit_reference_result
from ds4quant.codebooks.optimize import OptimizedFit, fit_optimized
from ds4quant.codebooks.lucebox import FromLucebox, LuceboxBlobs, from_lucebox, to_lucebox
from ds4quant.codebooks.routed import MixEntry
from ds4quant.codebooks.dmix import DmixEntry
from ds4quant.codebooks.table import CodebookEntry, CodebookTable, check_coverage, read_table, write_table

__all__ = [
    "fit_reference",
    "fit_reference_result",
    "FitResult",
    "fit_optimized",
    "OptimizedFit",
    "Histogram",
    "CodebookEntry",
    "CodebookTable",
    "read_table",
    "write_table",
    "check_coverage",
    "MixEntry",
    "DmixEntry",
    "p4mix",
    "gumix",
    "dmix",
    "to_lucebox",
    "from_lucebox",
    "LuceboxBlobs",
    "FromLucebox",
]
