"""The bundled runtime: decode-table registry, owners, placement, MoE execution.

    from ds4quant import runtime
    with runtime.load("out/art", placement="placement.json", mode="exact") as rt:
        y = rt.experts(layer)(hidden, top_k_index, top_k_weights)  # [T,H] f32, [T,k] i64, [T,k] f32
        z = rt.moe(layer, hidden, token_ids)                       # routing + routed + shared expert

``load`` is the one door: it opens the artifact through the artifact view,
turns what names the placement into a ``Placement`` (``as_placement``), and
returns one ``Executor`` whatever runs the experts: the owners of the
placement in this process (``in_process.Runtime``), or, for a placement
that records ranks, that many cluster ranks started once
(``cluster.RankGroup``). Owner names are ``OwnerName``s (``owners/kinds.py``
parses them and maps each kind to its owner); the numeric mode is a ``Mode``.
Importing this package does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Mapping, Optional

from ds4quant.errors import BadInputError
from ds4quant.runtime.mode import Mode

if TYPE_CHECKING:
    from ds4quant.runtime.cluster.group import ClusterOptions
    from ds4quant.runtime.executor import Executor

# The public face, imported on first use: ``ds4quant --help`` takes ``Mode``'s
# values from here without paying for numpy and the artifact reader.
_FACE = {
    "Executor": "ds4quant.runtime.executor",
    "Runtime": "ds4quant.runtime.in_process",
    "OwnerName": "ds4quant.runtime.owners.kinds",
    "OwnerKind": "ds4quant.runtime.owners.kinds",
    "make_owner": "ds4quant.runtime.owners.kinds",
    "Placement": "ds4quant.runtime.placement",
    "as_placement": "ds4quant.runtime.placement",
    "read_placement": "ds4quant.runtime.placement",
    "LayerResult": "ds4quant.runtime.execute",
    "combine": "ds4quant.runtime.execute",
}

__all__ = ["load", "Mode", *_FACE]


def __getattr__(name: str):
    if name in _FACE:
        return getattr(importlib.import_module(_FACE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


def load(artifact, placement: Any = None, mode: "Mode | str" = Mode.EXACT,
         owners: Optional[Mapping[str, object]] = None, recorder=None, overlap: bool = False,
         cluster: "Optional[ClusterOptions]" = None, verify_payloads: bool = True, progress=None) -> "Executor":
    """Load ``artifact`` (folder, .gguf, first split, or an open view) onto ``placement``.

    placement: None (one CPU owner, ``cpu:0``), a placement file path, a
    ``Placement``, or a mapping {layer: {owner name: expert ids}} (see
    ``as_placement``); mode: ``Mode`` or its name. In-process only: owners
    (prebuilt owners by name; the rest are made from their names), recorder
    (a ``runtime.capture.RoutingRecorder``), overlap (overlapped owner
    submission, ``runtime.overlap``). A placement that records ranks starts
    them (``cluster``: a ``cluster.ClusterOptions``). verify_payloads: hash
    every file the runtime may read (expert, router, shared-expert and other
    dense payloads, codebook tables) against ``manifest.json`` first and refuse
    a mismatch naming the tensor (``runtime.integrity``); False only for a
    folder the caller has checked itself (``ds4quant verify``); progress: a
    ProgressFn for that check (``ds4quant.progress``). Returns an ``Executor``
    (a context manager).
    """
    mode = Mode.parse(mode)
    own_view = not hasattr(artifact, "expert_data")
    if own_view:
        from ds4quant.artifact.view import open_artifact

        view = open_artifact(artifact)
    else:
        view = artifact  # an open view: the caller closes it
    try:
        from ds4quant.runtime.integrity import check_payloads, check_structure
        from ds4quant.runtime.placement import as_placement

        check_structure(view)  # before anything sizes a table from the keys
        plc = as_placement(placement, view)
        if verify_payloads:
            check_payloads(view, progress=progress)
        if plc.ranks is None:
            if cluster is not None:
                raise BadInputError("cluster options need a placement that records ranks (ds4quant place --ranks N)",
                                    where="cluster")
            from ds4quant.runtime.in_process import open_runtime

            return open_runtime(view, own_view, plc, mode, owners, recorder, overlap)
        if owners or recorder is not None or overlap:
            raise BadInputError(f"the placement plans {plc.ranks.n_ranks} ranks: prebuilt owners, a routing "
                                "recorder and overlapped submission belong to an in-process placement",
                                where="placement")
        from ds4quant.runtime.cluster.group import ClusterOptions, RankGroup

        return RankGroup(view, plc, mode, own_view=own_view, options=cluster or ClusterOptions())
    except BaseException:
        if own_view:
            view.close()
        raise

