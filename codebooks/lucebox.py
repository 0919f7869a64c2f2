"""Convert ds4quant's name-keyed table to Lucebox's sidecar blobs and back.

Lucebox keys codebooks by layer and surface, not by name (docs/formats.md#gumix, #p4mix), using the
GGUF tensor names of its DeepSeek-V4 loader:

    blk.L.ffn_{gate,up}_exps.weight  rocmfp2_mix (106) -> GUMIXs1 surface 0/1
    blk.L.ffn_down_exps.weight       rocmfp3_mix (105) -> P4MIXv1
                                     rocmfp2_mix (106) -> GUMIXs1 surface 2
    blk.L.attn_{q_a,q_b,kv,output_a,output_b}.weight (one expert) -> DMIXs1

Anything else is not Lucebox-representable and is refused: 105 on gate/up,
compact expert stacks (Lucebox registers experts 0..E-1), other names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import ds4quant.codebooks.dmix as dmix
import ds4quant.codebooks.gumix as gumix
import ds4quant.codebooks.p4mix as p4mix
from ds4quant.codebooks.dmix import CLASSES, DmixEntry
from ds4quant.codebooks.routed import SURFACES, MixEntry
from ds4quant.codebooks.table import CodebookEntry, CodebookTable
from ds4quant.errors import CodebookError, UnsupportedFormatError
from ds4quant.formats import QTYPES

_ROUTED = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
_DENSE = re.compile(r"blk\.(\d+)\.(" + "|".join(CLASSES) + r")\.weight")
_BY_GGML = {q.ggml_type: name for name, q in QTYPES.items() if q.is_mix and q.family == "rocmfpx-mix"}


def routed_name(layer: int, surface: int) -> str:
    return f"blk.{layer}.ffn_{SURFACES[surface]}_exps.weight"


def dense_name(layer: int, cls: int) -> str:
    return f"blk.{layer}.{CLASSES[cls]}.weight"


@dataclass(frozen=True)
class LuceboxBlobs:
    """The three sidecars; None where the table has no tensor of that kind."""

    p4mix: Optional[bytes] = None
    gumix: Optional[bytes] = None
    dmix: Optional[bytes] = None


@dataclass(frozen=True)
class FromLucebox:
    """A table rebuilt from blobs, with what the blobs also carry.

    dims: routed tensor name -> (out, in); nslices: dense tensor name -> nslices.
    """

    table: CodebookTable
    dims: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    nslices: Mapping[str, int] = field(default_factory=dict)


def _full_stack(e: CodebookEntry) -> None:
    if e.global_ids != tuple(range(e.n_experts)) or e.n_global != e.n_experts:
        raise UnsupportedFormatError(
            f"a compact stack ({e.n_experts} of {e.n_global} experts) is not Lucebox-representable",
            where=e.name,
            hint="write full expert stacks for Lucebox artifacts",
        )


def to_lucebox(
    table: CodebookTable,
    dims: Mapping[str, tuple[int, int]],
    nslices: Optional[Mapping[str, int]] = None,
) -> LuceboxBlobs:
    """Blobs for every entry of ``table``.

    dims: routed tensor name -> (out, in) = (ne[1], ne[0]) per expert.
    nslices: dense tensor name -> DMIXs1 nslices (default 1).
    Raises UnsupportedFormatError for entries Lucebox cannot load.
    """
    nslices = nslices or {}
    down, gateup, dense = [], [], []
    for e in table.entries:
        qt = QTYPES[e.qtype]
        m = _ROUTED.fullmatch(e.name)
        if m:
            layer, surface = int(m.group(1)), SURFACES.index(m.group(2))
            _full_stack(e)
            if e.name not in dims:
                raise CodebookError("routed tensor has no (out, in) dims", where=e.name)
            out, in_ = (int(v) for v in dims[e.name])
            entry = MixEntry(layer, surface, out, in_, e.modes, e.books)
            if qt.ggml_type == 105 and surface == 2:
                down.append(entry)
            elif qt.ggml_type == 106:
                gateup.append(entry)
            else:
                raise UnsupportedFormatError(
                    f"{e.qtype} on {SURFACES[surface]} is not loadable by Lucebox (105 only on down experts)",
                    where=e.name,
                )
            continue
        m = _DENSE.fullmatch(e.name)
        if m:
            if e.n_experts != 1 or e.expert_ids not in (None, (0,)):
                raise UnsupportedFormatError("a dense MIX tensor has exactly one book pair", where=e.name)
            dense.append(
                DmixEntry(int(m.group(1)), CLASSES.index(m.group(2)), qt.ggml_type, int(nslices.get(e.name, 1)),
                          int(e.modes[0]), e.books[0])
            )
            continue
        raise UnsupportedFormatError(
            "tensor name is not one Lucebox keys codebooks by",
            where=e.name,
            hint="expected blk.L.ffn_{gate,up,down}_exps.weight or blk.L.attn_*.weight",
        )
    down.sort(key=lambda x: x.key)
    gateup.sort(key=lambda x: x.key)
    dense.sort(key=lambda x: x.key)
    return LuceboxBlobs(
        p4mix=p4mix.write_p4mix(down) if down else None,
        gumix=gumix.write_gumix(gateup) if gateup else None,
        dmix=dmix.write_dmix(dense) if dense else None,
    )


def from_lucebox(p4mix_blob: Any = None, gumix_blob: Any = None, dmix_blob: Any = None) -> FromLucebox:
    """Read the blobs given and rebuild the name-keyed table.

    A (layer, surface) in both P4MIXv1 and GUMIXs1 is refused (CodebookError).
    """
    entries, dims, slices = [], {}, {}
    routed = []
    if p4mix_blob is not None:
        routed += [(e, _BY_GGML[105]) for e in p4mix.read_p4mix(p4mix_blob)]
    if gumix_blob is not None:
        routed += [(e, _BY_GGML[106]) for e in gumix.read_gumix(gumix_blob)]
    for e, qtype in routed:
        name = routed_name(e.layer, e.surface)
        if name in dims:
            raise CodebookError("covered by both P4MIXv1 and GUMIXs1", where=name)
        dims[name] = (e.out_dim, e.in_dim)
        entries.append(CodebookEntry(name, qtype, e.modes, e.books))
    if dmix_blob is not None:
        for d in dmix.read_dmix(dmix_blob):
            name = dense_name(d.layer, d.cls)
            slices[name] = d.nslices
            entries.append(CodebookEntry(name, _BY_GGML[d.qtype], [d.mode], d.books[None]))
    return FromLucebox(CodebookTable(tuple(entries)), dims, slices)
