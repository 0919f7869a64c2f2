"""``sensitivity.json``: how many nats of next-token KL one unit of weighted
error costs, per routed-expert tensor.

The adaptive recipe ranks candidates by the imatrix-weighted weight error
``sum_e f_e sum_rc imp_ec dw_rc^2``; those sums are not comparable across
tensors (an error in layer 0 passes through every later layer, one in a gate
or up projection through SwiGLU and the down projection first). A gain per
tensor, ``KL / weighted error``, puts them in one unit: ``sum_t gain_t *
error_t`` predicts the KL of a whole plan, which the allocator then
minimises. The calibrate stage measures the gains
(``ds4quant.calibrate.sensitivity``); this module is the file::

    {"schema": "ds4quant.sensitivity", "version": 1,
     "source_fingerprint": "...", "tokens_sha256": "...",
     "sequences": 8, "tokens": 320, "rel_std": 0.3,
     "tensors": {"blk.0.ffn_gate_exps.weight": {"gain": ..., "kl": ..., "weighted_error": ...}, ...}}

A file of the streamed method (``ds4quant calibrate``'s default) also says
how its KL figures were predicted: ``"method": "streamed"``, per tensor the
``local_error`` (mean squared change of the routed experts' output per token
under the noise) and per layer and probe group (surfaces perturbed together,
e.g. ``"gate+up+down"``) the ``coefficient`` (KL per unit of local error; a
tensor's ``kl = coefficient * local_error``) with the whole-layer probes it
was fitted on (``"probes": [{"scale", "kl", "local_error"}]``, empty for a
layer whose coefficient is interpolated between probed ones). Without ``method``
the KL of every tensor was measured by its own perturbed run (the per-tensor
method).

``ds4quant calibrate`` writes it beside the imatrix; ``convert --sensitivity``
reads it (``read_sensitivity``), refusing one measured on another source.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping, Optional

from ds4quant.errors import BadInputError, CorruptDataError

__all__ = ["Sensitivity", "read_sensitivity", "write_sensitivity", "SENSITIVITY_FILE"]

SENSITIVITY_FILE = "sensitivity.json"
SCHEMA = "ds4quant.sensitivity"
VERSION = 1


@dataclass(frozen=True)
class Sensitivity:
    """gains: tensor name -> KL nats per token per unit of weighted error.
    kl / weighted_error: the measured pair behind each gain."""

    gains: Mapping[str, float]
    kl: Mapping[str, float]
    weighted_error: Mapping[str, float]
    fingerprint: Optional[str]
    tokens_sha256: Optional[str]
    sequences: int
    tokens: int
    rel_std: float
    path: Optional[str] = None
    method: Optional[str] = None
    local_error: Optional[Mapping[str, float]] = None
    layers: Optional[Mapping[int, Mapping]] = None

    def gain(self, tensor: str) -> float:
        """The tensor's gain; a tensor the file does not cover is an error naming both."""
        try:
            return self.gains[tensor]
        except KeyError:
            raise BadInputError(f"the sensitivity file has no gain for {tensor}",
                                where=self.path or SENSITIVITY_FILE) from None

    def to_json(self) -> dict:
        out = {
            "schema": SCHEMA, "version": VERSION,
            "source_fingerprint": self.fingerprint, "tokens_sha256": self.tokens_sha256,
            "sequences": self.sequences, "tokens": self.tokens, "rel_std": self.rel_std,
            "tensors": {t: {"gain": self.gains[t], "kl": self.kl[t], "weighted_error": self.weighted_error[t]}
                        for t in sorted(self.gains)},
        }
        if self.method is not None:  # a per-tensor file keeps the fields (and bytes) it always had
            out["method"] = self.method
            for t, rec in out["tensors"].items():
                rec["local_error"] = self.local_error[t]
            out["layers"] = {str(L): {"probed": v["probed"], "groups": {
                g: {"coefficient": c["coefficient"], "probes": [dict(p) for p in c["probes"]]}
                for g, c in v["groups"].items()}} for L, v in sorted(self.layers.items())}
        return out


def write_sensitivity(path: "str | os.PathLike[str]", s: Sensitivity) -> Path:
    from ds4quant.artifact.atomic import atomic_write_json

    return atomic_write_json(Path(path), s.to_json())


def _number(v, what: str, where: str, positive: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise CorruptDataError(f"{what} must be a finite {'positive' if positive else 'non-negative'} number, "
                               f"got {v!r}", where=where)
    return float(v)


def read_sensitivity(path: "str | os.PathLike[str]", *, fingerprint: Optional[str] = None) -> Sensitivity:
    """Read and validate a sensitivity file; ``fingerprint``, when given, must
    equal the source fingerprint the file was measured on."""
    where = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BadInputError(f"cannot read the sensitivity file: {e}", where=where) from None

    def refuse(c):
        raise ValueError(f"{c} is not a number")

    try:
        obj = json.loads(text, parse_constant=refuse)
    except ValueError as e:
        raise CorruptDataError(f"not valid JSON: {e}", where=where) from None
    if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
        raise CorruptDataError(f"not a ds4quant sensitivity file (schema {SCHEMA!r} missing)", where=where)
    if obj.get("version") != VERSION:
        raise CorruptDataError(f"sensitivity file version {obj.get('version')!r}; this tool reads {VERSION}",
                               where=where)
    stored = obj.get("source_fingerprint")
    if fingerprint is not None and stored is not None and stored != fingerprint:
        raise BadInputError(f"the sensitivity file was measured on another source (fingerprint {str(stored)[:12]}, "
                            f"this source {fingerprint[:12]})", where=where)
    tensors = obj.get("tensors")
    if not isinstance(tensors, dict) or not tensors:
        raise CorruptDataError("no tensors", where=where)
    gains, kls, errs = {}, {}, {}
    from ds4quant.names import parse_stack

    for name, rec in tensors.items():
        if parse_stack(name) is None:
            raise CorruptDataError(f"{name!r} is not a routed-expert tensor name", where=where)
        if not isinstance(rec, dict):
            raise CorruptDataError(f"{name}: entry is not an object", where=where)
        gains[name] = _number(rec.get("gain"), f"{name}: gain", where, positive=True)
        kls[name] = _number(rec.get("kl"), f"{name}: kl", where)
        errs[name] = _number(rec.get("weighted_error"), f"{name}: weighted_error", where, positive=True)
    seqs_n, toks = obj.get("sequences"), obj.get("tokens")
    for v, what in ((seqs_n, "sequences"), (toks, "tokens")):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise CorruptDataError(f"{what} must be an int >= 1, got {v!r}", where=where)
    rel = _number(obj.get("rel_std"), "rel_std", where, positive=True)
    method, locs, layers = obj.get("method"), None, None
    if method is not None:
        if method != "streamed":
            raise CorruptDataError(f"unknown sensitivity method {method!r}", where=where)
        locs = {name: _number(rec.get("local_error"), f"{name}: local_error", where) for name, rec in tensors.items()}
        raw = obj.get("layers")
        if not isinstance(raw, dict):
            raise CorruptDataError("a streamed sensitivity file needs a layers object", where=where)
        layers = {}
        for key, rec in raw.items():
            if not (isinstance(key, str) and key.isdigit() and isinstance(rec, dict)):
                raise CorruptDataError(f"layers: entry {key!r} is not a layer index with an object", where=where)
            groups = rec.get("groups")
            if not isinstance(groups, dict) or not groups:
                raise CorruptDataError(f"layer {key}: groups must be a non-empty object", where=where)
            parsed = {}
            for g, c in groups.items():
                probes = c.get("probes") if isinstance(c, dict) else None
                if not isinstance(probes, list) or not all(isinstance(p, dict) for p in probes):
                    raise CorruptDataError(f"layer {key}, group {g}: probes must be a list of objects", where=where)
                parsed[g] = MappingProxyType({
                    "coefficient": _number(c.get("coefficient"), f"layer {key}, group {g}: coefficient", where,
                                           positive=True),
                    "probes": tuple(MappingProxyType(dict(p)) for p in probes)})
            layers[int(key)] = MappingProxyType({"probed": bool(rec.get("probed")),
                                                 "groups": MappingProxyType(parsed)})
        locs, layers = MappingProxyType(locs), MappingProxyType(layers)
    return Sensitivity(MappingProxyType(gains), MappingProxyType(kls), MappingProxyType(errs), stored,
                       obj.get("tokens_sha256"), seqs_n, toks, rel, path=where, method=method, local_error=locs,
                       layers=layers)
