"""Stage 1 of convert: from a source to a validated plan (one TensorChoice per output tensor).

Nothing here writes: bad input is refused before OUTDIR is touched.
"""

from __future__ import annotations

import hashlib
import json
from typing import Optional, Sequence

import numpy as np

from ds4quant.version import VERSION
from ds4quant.plan import Books, Recipe, TensorChoice, TensorSpec
from ds4quant.errors import BadInputError
from ds4quant.formats import QTYPES, get_qtype
from ds4quant.names import Proj, layer_of, parse_stack, stack_name
from ds4quant.progress import Meter, ProgressFn
from ds4quant.sources.base import Source
from ds4quant.sources.naming import Mapped


def tensor_specs(src: Source) -> list[tuple[TensorSpec, tuple[Mapped, ...]]]:
    """(spec, source members) per output tensor, in a stable order."""
    out = []
    n_exp = src.config.n_routed_experts
    for gguf, members in sorted(src.names.by_gguf().items(), key=lambda kv: _gguf_order(kv[0])):
        first = members[0]
        info = src.info(first.name)
        logical = tuple(info.shape_logical)
        if first.stacked:
            if len(members) != n_exp:
                raise BadInputError(f"has {len(members)} experts, config says {n_exp}", where=gguf)
            shape = tuple(reversed(logical)) + (n_exp,)
        else:
            shape = tuple(reversed(logical)) if logical else (1,)
        spec = TensorSpec(gguf, str(first.kind.value), shape, info.dtype, first.which, first.layer)
        out.append((spec, members))
    return out


def _gguf_order(name: str):
    # token_embd first, then blocks in numeric order, then the output tensors.
    layer = layer_of(name)
    if layer is not None:
        return (1, layer, name.split(".", 2)[2])
    return (0 if name.startswith("token_embd") else 2, 0, name)


def plan_fingerprint(recipe: Recipe, plan: Sequence[TensorChoice], imatrix_sha: Optional[str],
                     extra: Optional[dict]) -> str:
    """sha256 over everything that decides tensor bytes (the journal's last guard)."""
    blob = json.dumps(
        {
            "tool_version": VERSION,
            "recipe": recipe.to_json(),
            "plan": [c.to_json() for c in plan],
            "imatrix": imatrix_sha,
            "extra": extra,
        },
        sort_keys=True,
    ).encode()
    return hashlib.sha256(blob).hexdigest()


def members_of(choice: TensorChoice, members: dict) -> tuple[Mapped, ...]:
    """The source members one planned tensor encodes (a compact stack: its experts only)."""
    ms = members[choice.base]
    if choice.experts is None:
        return ms
    by_id = {m.expert: m for m in ms}
    return tuple(by_id[e] for e in choice.experts)


def importance(imatrix, name: str, expert: Optional[int], cols: int) -> Optional[np.ndarray]:
    if imatrix is None:
        return None
    from ds4quant.calib.imatrix import importance_for

    return importance_for(imatrix, name, expert, cols=cols)


def load(src: Source, m: Mapped, cols: int) -> np.ndarray:
    """One member as float32 (rows, cols), a private copy."""
    x = src.read_dequantized(m.name)
    return np.ascontiguousarray(x.reshape(-1, cols), dtype=np.float32)


def fit_fixed_mix_books(plan, members, src: Source, imx, books: Books, joint_gate_up: bool = False,
                        progress: Optional[ProgressFn] = None) -> None:
    """MIX qtypes chosen outright (--tensor-type ...=rocmfp2_mix): the reference
    fitter per expert, as the Lucebox converter does.

    joint_gate_up=False fits each surface's matrix on its own. True fits, for
    every expert whose gate and up are both the same MIX qtype, one book pair
    over the gate rows then the up rows (each with its own importance) and
    gives it to both, which is the rule of Lucebox's converter for its 106
    gate/up tensors: its GUMIXs1 sidecar repeats the one pair for both
    surfaces. Matrices without such a partner are fitted alone.

    progress gets a "codebooks" ProgressEvent per expert matrix (one fitted
    with its partner counts as done with it).
    """
    from ds4quant.codebooks import fit_reference

    mix = []
    for c in plan:
        qt = get_qtype(c.qtype) if c.qtype in QTYPES else None
        if qt is not None and qt.is_mix:
            mix.append((c, qt))
    partner: dict[tuple[str, Optional[int], str], tuple] = {}
    if joint_gate_up:
        # (gate base, expert, qtype) -> the up matrix's (choice, member)
        for c, qt in mix:
            sn = parse_stack(c.base)
            if sn is not None and sn.proj == Proj.UP:
                for m in members_of(c, members):
                    partner[(stack_name(sn.layer, Proj.GATE), m.expert, qt.name)] = (c, m)
    done = set()
    todo = [(c, qt, m) for c, qt in mix for m in members_of(c, members)]
    meter = Meter("codebooks", len(todo), "matrix", then=("encoding",))
    for c, qt, m in todo:
        item = f"{c.base} expert {m.expert}"
        if (c.base, m.expert, qt.name) in done:  # fitted with its gate partner: its work was counted there
            if progress is not None:
                progress(meter.step(item, work=0, qtype=qt.name))
            continue
        x = load(src, m, c.shape[0])
        imp = importance(imx, c.base, m.expert, c.shape[0])
        up = partner.get((c.base, m.expert, qt.name))
        if up is None:
            b, _ = fit_reference([x], qt.codebook_levels, imp)
            books.put(c.base, m.expert, qt.name, b, 1)
        else:
            uc, um = up
            xu = load(src, um, uc.shape[0])
            b, _ = fit_reference([x, xu], qt.codebook_levels,
                                 [imp, importance(imx, uc.base, um.expert, uc.shape[0])])
            for base in (c.base, uc.base):
                books.put(base, m.expert, qt.name, b, 1)
            done.add((uc.base, um.expert, qt.name))
            src.release(um.name)
        src.release(m.name)
        if progress is not None:
            progress(meter.step(item, work=1 if up is None else 2, qtype=qt.name))
