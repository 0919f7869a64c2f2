"""``ds4quant place``: plan where an artifact's routed experts live.

Reads the bytes of every expert from the artifact (``ArtifactView.expert_nbytes``)
and a routing profile (Lucebox hotness CSV or ds4quant JSON), plans with
``runtime.planning`` and optionally writes the placement file.

    p, rep = place("out/tiny", "calib/routing.csv", ["cuda:0=8G", "cpu"], cold="cpu", min_hot=2,
                   out="placement.json")
    p, rep = place("out/tiny", "calib/routing.csv", ranks=2, strategy="balanced", replicate_hot=1)

``place_from_bytes`` is the same without an artifact (expert bytes given).
Owner budgets are sizes (``ds4quant.sizes.parse_size``: 1024, 512M, 50G; 0
allowed).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np

from ds4quant.errors import BadInputError, BudgetError, ShapeError
from ds4quant.calib.routing import RoutingProfile, read_routing
from ds4quant.runtime.owners.kinds import OwnerName
from ds4quant.runtime.placement import Placement, read_placement, write_placement
from ds4quant.runtime.planning import (
    check_plan_options,
    check_rank_options,
    PlacementReport,
    RankReport,
    placement_report,
    plan_placement,
    plan_ranks,
    rank_report,
)
from ds4quant.sizes import parse_size

__all__ = ["place", "place_from_bytes", "check_placement", "parse_owner", "artifact_fingerprint"]

OwnerSpec = Union[str, tuple]


def parse_owner(spec: OwnerSpec) -> tuple[str, Optional[int]]:
    """'cuda:0=8G' -> ('cuda:0', 8589934592); 'cpu' -> ('cpu', None) (no budget);
    a (name, budget) pair passes through checked."""
    if isinstance(spec, (tuple, list)) and len(spec) == 2:
        name, budget = spec
        OwnerName.parse(name, where="--owner")
        return name, None if budget is None else parse_size(budget, f"--owner {name}")
    if not isinstance(spec, str):
        raise BadInputError(f"expected NAME=BYTES, got {spec!r}", where="--owner")
    name, eq, size = spec.partition("=")
    name = name.strip()
    OwnerName.parse(name, where="--owner")
    return name, parse_size(size, f"--owner {name}") if eq else None


def artifact_fingerprint(view) -> str:
    """The artifact identity a placement is planned for (``ArtifactView.fingerprint``)."""
    return view.fingerprint()


def _profile(routing: Any) -> tuple[RoutingProfile, str]:
    if isinstance(routing, RoutingProfile):
        return routing, "routing profile"
    if not isinstance(routing, (str, os.PathLike)):
        raise BadInputError(f"routing must be a path or a RoutingProfile, got {type(routing).__name__}",
                            where="--routing")
    return read_routing(routing), str(routing)


def _check_options(prof: RoutingProfile, owners, cold, min_hot, speed_ratio, ranks, strategy, replicate_hot):
    """Every option check that needs no expert bytes; returns the parsed owners."""
    parsed = [parse_owner(o) for o in owners]
    if ranks is not None:
        if min_hot or speed_ratio is not None or cold is not None:
            raise BadInputError("--min-hot, --speed-ratio and --cold plan owners inside one process; "
                                "they do not apply with --ranks", where="--ranks")
        if len(parsed) > 1:
            raise BadInputError("with --ranks give at most one --owner (each rank's local owner)", where="--owner")
        check_rank_options(prof, ranks, strategy, replicate_hot, parsed[0][0] if parsed else "cpu")
    else:
        if strategy != "uniform" or replicate_hot:
            raise BadInputError("--strategy and --replicate-hot need --ranks N", where="--strategy")
        check_plan_options(prof, parsed, cold, min_hot, speed_ratio)
    return parsed


def place_from_bytes(routing: Any, expert_nbytes: Any, owners: Sequence[OwnerSpec] = (), *,
                     cold: Optional[str] = None, min_hot: int = 0, speed_ratio: Optional[float] = None,
                     ranks: Optional[int] = None, strategy: str = "uniform", replicate_hot: int = 0,
                     token_topk: Any = None, n_expert_used: Optional[int] = None,
                     artifact_fp: Optional[str] = None, out: "str | os.PathLike[str] | None" = None,
                     ) -> tuple[Placement, Union[PlacementReport, RankReport]]:
    """Plan from expert bytes int64 (n_layer, n_expert) and a routing profile
    (path or RoutingProfile); see ``place`` for the options."""
    prof, where = _profile(routing)
    nb = np.asarray(expert_nbytes)
    if nb.shape != (prof.n_layer, prof.n_expert):
        raise ShapeError(f"routing profile is {prof.n_layer} layers x {prof.n_expert} experts, the artifact "
                         f"{nb.shape[0] if nb.ndim >= 1 else '?'} x {nb.shape[1] if nb.ndim >= 2 else '?'}",
                         where=where, hint="profile the same model the artifact was made from")
    notes = []
    if n_expert_used is not None and n_expert_used != prof.n_expert_used:
        notes.append(f"profile says top-{prof.n_expert_used}, the artifact top-{n_expert_used}; "
                     f"using top-{n_expert_used}")
        prof = RoutingProfile(prof.n_layer, prof.n_expert, n_expert_used, prof.counts, prof.tokens, prof.source)
    parsed = _check_options(prof, owners, cold, min_hot, speed_ratio, ranks, strategy, replicate_hot)
    if ranks is not None:
        local, budget = parsed[0] if parsed else ("cpu", None)
        p = plan_ranks(prof, ranks, strategy, replicate_hot, owner=local, artifact=artifact_fp)
        rep = rank_report(p, prof, nb, notes=notes)
        if budget is not None and max(rep.bytes) > budget:
            worst = int(np.argmax(rep.bytes))
            raise BudgetError(f"rank {worst} holds {rep.bytes[worst]:,} bytes, more than {local}'s budget "
                              f"{budget:,}", where="--owner", hint="add ranks or raise the budget")
    else:
        p, rep = plan_placement(prof, nb, parsed, cold=cold, min_hot=min_hot, speed_ratio=speed_ratio,
                                token_topk=token_topk, artifact=artifact_fp)
        if notes:
            rep = dataclasses.replace(rep, notes=tuple(notes) + rep.notes)
    if out is not None:
        write_placement(out, p)
    return p, rep


def place(artifact: "str | os.PathLike[str]", routing: Any, owners: Sequence[OwnerSpec] = (), *,
          cold: Optional[str] = None, min_hot: int = 0, speed_ratio: Optional[float] = None,
          ranks: Optional[int] = None, strategy: str = "uniform", replicate_hot: int = 0,
          token_topk: Any = None, out: "str | os.PathLike[str] | None" = None,
          variant_107: Optional[str] = None) -> tuple[Placement, Union[PlacementReport, RankReport]]:
    """Plan a placement of ``artifact``'s routed experts from ``routing``.

    owners: ['NAME=BYTES' | 'NAME' | (name, bytes)], first = hot/primary.
    cold: None (refuse experts that fit nowhere), 'none', or an owner name.
    ranks/strategy/replicate_hot: a cluster placement instead (docs/usage.md#placement).
    out: write the placement file there (atomic). Returns (Placement, report).
    """
    # User input first (profile, budgets, options), so its errors never wait on an artifact read.
    routing, _ = _profile(routing)
    owners = _check_options(routing, owners, cold, min_hot, speed_ratio, ranks, strategy, replicate_hot)
    nb, used, fp = _artifact_facts(artifact, variant_107)
    return place_from_bytes(routing, nb, owners, cold=cold, min_hot=min_hot, speed_ratio=speed_ratio, ranks=ranks,
                            strategy=strategy, replicate_hot=replicate_hot, token_topk=token_topk,
                            n_expert_used=used, artifact_fp=fp, out=out)


def _artifact_facts(artifact, variant_107) -> tuple[np.ndarray, int, str]:
    if not Path(artifact).exists():
        raise BadInputError("no such artifact", where=str(artifact))
    from ds4quant.artifact.view import open_artifact

    with open_artifact(artifact, variant_107=variant_107) as v:
        return np.asarray(v.expert_nbytes(), dtype=np.int64), int(v.header.n_expert_used), artifact_fingerprint(v)


def check_placement(artifact: "str | os.PathLike[str]", routing: Any, placement: "str | os.PathLike[str]", *,
                    token_topk: Any = None, variant_107: Optional[str] = None,
                    ) -> tuple[Placement, Union[PlacementReport, RankReport]]:
    """Read an existing placement file, check it fits ``artifact`` (shape and
    fingerprint) and report it on ``routing``."""
    p = read_placement(placement)
    if not Path(artifact).exists():
        raise BadInputError("no such artifact", where=str(artifact))
    from ds4quant.artifact.view import open_artifact
    from ds4quant.runtime.placement import check_fits

    with open_artifact(artifact, variant_107=variant_107) as v:
        check_fits(p, v, where=str(placement))  # the one check runtime.load makes too
        nb = np.asarray(v.expert_nbytes(), dtype=np.int64)
    prof, where = _profile(routing)
    if (prof.n_layer, prof.n_expert) != (p.n_layer, p.n_expert):
        raise ShapeError(f"routing profile is {prof.n_layer} x {prof.n_expert}, the placement "
                         f"{p.n_layer} x {p.n_expert} (layers x experts)", where=where)
    if p.ranks is not None:
        return p, rank_report(p, prof, nb)
    return p, placement_report(p, prof, nb, token_topk=token_topk)
