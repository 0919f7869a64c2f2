"""Planning placements from a routing profile (pure functions; no I/O).

``plan_placement``: Lucebox's byte-budget placement
(``moe_hybrid_placement.cpp`` ``build_from_stats_with_layer_bytes``;
docs/usage.md#placement), generalized to an ordered list of owners:

1. Floor: on the first owner, the ``min_hot`` most selected experts of every
   layer (``RoutingProfile.ranked_experts``: count descending, lower id first).
   If they do not fit its budget the plan is refused.
2. Greedy: owners in the order given (skipping the cold owner) take, from
   every (layer, expert) not yet placed, the one with the most routed slots
   per byte (exact rational comparison; ties: more slots, lower layer, lower
   expert), whenever it fits the owner's remaining budget; an item that does
   not fit is skipped, smaller ones after it may still fit.
3. Cold: every expert still unplaced goes to the cold owner (an owner name,
   whose budget, if any, must hold them), to ``none`` (held outside this
   process) with ``cold="none"``, or the plan is refused (``cold=None``).

With ``speed_ratio`` R (Lucebox ``DFLASH_DS4_TP_CRITICAL_PATH_PLACEMENT``,
``MAIN_TO_PEER_RATE``), step 2 on the first owner also requires that moving an
expert from the peer branch (every other owner) to the main branch lowers the
layer's critical path ``max(main / R, peer)``, with work = routed slots and the
main branch also running the shared expert (one slot per token, i.e. the
layer's slots / n_expert_used).

Report: bytes and experts per owner; slot-resident rate = share of routed
slots whose expert is on the first owner; token-resident rate = share of
(token, layer) pairs whose whole top-k is on the first owner. From a profile
alone it is computed under an ASSUMPTION of independent slots (rate_L =
p_L ** k, p_L the layer's slot-resident rate; real top-k slots are distinct
experts and correlated, so this is an estimate); given per-token top-k samples
(``token_topk``, int (n_layer, T, k), e.g. ``RoutingRecorder.samples()``) it
is counted exactly on them. ``token_resident_method`` says which.

``plan_ranks``: cluster placements (Lucebox ``cluster_expert_placement.h``):
``uniform`` e -> e % N; ``balanced``: per layer, experts by hotness descending
each to the least-loaded rank that still has room, room keeping every rank's
count at floor(E'/N) or ceil(E'/N) (so |owned - E'/N| <= 1, E' = experts not
replicated); ``replicate_hot`` K: the K hottest experts of each layer are
replicated (every rank holds them; slot t goes to rank (expert + t) % N).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Optional, Sequence

import numpy as np

from ds4quant.errors import BadInputError, BudgetError, ShapeError
from ds4quant.calib.routing import RoutingProfile

from .owners.kinds import OwnerName
from .placement import MAX_RANKS, NONE, REPLICATED, STRATEGIES, Placement, RankPlacement

__all__ = ["PlacementReport", "RankReport", "plan_placement", "plan_ranks", "rank_report", "placement_report",
           "check_plan_options", "check_rank_options", "plan_for_rank"]

MAX_BUDGET = 1 << 62  # bytes; anything larger is a typo, not a machine


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


@dataclass(frozen=True)
class PlacementReport:
    """What a placement costs and serves on a profile (see the module doc).

    owners/budgets/bytes/experts: per owner, in placement order (budget None =
    unlimited). none_bytes/none_experts: held outside this process.
    slot_resident_rate, token_resident_rate: on the first owner, all layers;
    per_layer_slot_rate / per_layer_token_rate: float per layer.
    """

    owners: tuple[str, ...]
    budgets: tuple[Optional[int], ...]
    bytes: tuple[int, ...]
    experts: tuple[int, ...]
    none_bytes: int
    none_experts: int
    slot_resident_rate: float
    token_resident_rate: float
    token_resident_method: str  # "independence" | "samples"
    per_layer_slot_rate: tuple[float, ...]
    per_layer_token_rate: tuple[float, ...]
    min_hot: int = 0
    speed_ratio: Optional[float] = None
    cold: Optional[str] = None
    placement_sha256: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_json(self) -> dict:
        return {
            "kind": "owners", "placement_sha256": self.placement_sha256,
            "owners": [{"name": o, "budget": b, "bytes": n, "experts": e}
                       for o, b, n, e in zip(self.owners, self.budgets, self.bytes, self.experts)],
            "none": {"bytes": self.none_bytes, "experts": self.none_experts},
            "slot_resident_rate": self.slot_resident_rate, "token_resident_rate": self.token_resident_rate,
            "token_resident_method": self.token_resident_method,
            "per_layer_slot_rate": list(self.per_layer_slot_rate),
            "per_layer_token_rate": list(self.per_layer_token_rate),
            "min_hot": self.min_hot, "speed_ratio": self.speed_ratio, "cold": self.cold,
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class RankReport:
    """Per rank: experts held (own + replicated, summed over layers), bytes held
    (None without expert bytes), and share of all routed slots it computes
    (replicated experts' slots split evenly, as (expert + t) % N does on average)."""

    n_ranks: int
    strategy: str
    replicate_hot: int
    experts: tuple[int, ...]
    bytes: Optional[tuple[int, ...]]
    slot_share: tuple[float, ...]
    placement_sha256: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_json(self) -> dict:
        return {"kind": "ranks", "placement_sha256": self.placement_sha256, "n_ranks": self.n_ranks,
                "strategy": self.strategy, "replicate_hot": self.replicate_hot,
                "ranks": [{"rank": r, "experts": self.experts[r],
                           "bytes": None if self.bytes is None else self.bytes[r], "slot_share": self.slot_share[r]}
                          for r in range(self.n_ranks)],
                "notes": list(self.notes)}


# --------------------------------------------------------------------------
# checks


def _check_nbytes(profile: RoutingProfile, expert_nbytes: Any) -> np.ndarray:
    nb = np.asarray(expert_nbytes)
    if nb.shape != (profile.n_layer, profile.n_expert):
        raise ShapeError(f"expert bytes have shape {nb.shape}, the routing profile has "
                         f"({profile.n_layer}, {profile.n_expert}) (layers, experts)")
    if nb.dtype.kind not in "iu":
        raise BadInputError(f"expert bytes must be integers, got {nb.dtype}")
    if nb.size and (int(nb.min()) <= 0 or int(nb.max()) > MAX_BUDGET):
        raise BadInputError(f"expert bytes must be in 1..2^62, got {int(nb.min())}..{int(nb.max())}")
    return nb.astype(np.int64)


def _check_owners(owners: Sequence) -> tuple[list[str], list[Optional[int]]]:
    if not isinstance(owners, (list, tuple)) or not owners:
        raise BadInputError("give at least one owner (NAME=BYTES)", where="--owner")
    names, budgets = [], []
    for item in owners:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise BadInputError(f"owner must be (name, budget_bytes), got {item!r}", where="--owner")
        name, budget = item
        OwnerName.parse(name, where="--owner")
        if name in names:
            raise BadInputError(f"owner {name} given twice", where="--owner")
        if budget is not None and (not _is_int(budget) or budget < 0 or budget > MAX_BUDGET):
            raise BudgetError(f"budget of {name} must be an integer number of bytes in 0..2^62, got {budget!r}",
                              where="--owner")
        names.append(name)
        budgets.append(None if budget is None else int(budget))
    return names, budgets


# --------------------------------------------------------------------------
# plan_placement


def check_plan_options(profile: RoutingProfile, owners: Sequence, cold: Optional[str] = None, min_hot: int = 0,
                       speed_ratio: Optional[float] = None) -> tuple[list[str], list[Optional[int]]]:
    """The checks of plan_placement that need no expert bytes (so a CLI can run
    them before reading an artifact); returns (names, budgets)."""
    if not isinstance(profile, RoutingProfile):
        raise BadInputError(f"expected a RoutingProfile, got {type(profile).__name__}")
    names, budgets = _check_owners(owners)
    if cold is not None and cold != NONE and cold not in names:
        raise BadInputError(f"cold owner {cold!r} is not one of the owners {names} (or 'none')", where="--cold")
    if not _is_int(min_hot) or not 0 <= min_hot <= profile.n_expert:
        raise BadInputError(f"must be an integer in 0..n_expert ({profile.n_expert}), got {min_hot!r}",
                            where="--min-hot")
    if speed_ratio is not None:
        if isinstance(speed_ratio, bool) or not isinstance(speed_ratio, (int, float)) \
                or not np.isfinite(speed_ratio) or not 0 < speed_ratio <= 1e6:
            raise BadInputError(f"must be a finite number in (0, 1e6], got {speed_ratio!r}", where="--speed-ratio")
        if len(names) < 2 and cold != NONE:
            raise BadInputError("a speed ratio balances the first owner against the others; give two owners "
                                "or --cold none", where="--speed-ratio")
    return names, budgets


def plan_placement(profile: RoutingProfile, expert_nbytes: Any, owners: Sequence, cold: Optional[str] = None,
                   min_hot: int = 0, speed_ratio: Optional[float] = None, token_topk: Any = None,
                   artifact: Optional[str] = None, allowed: Any = None) -> tuple[Placement, PlacementReport]:
    """Plan a placement (see the module doc).

    profile: RoutingProfile (n_layer, n_expert counts). expert_nbytes: int
    (n_layer, n_expert) bytes per expert (gate+up+down). owners: [(name,
    budget_bytes or None)], first = hot/primary. cold: None (refuse
    leftovers), "none", or an owner name from ``owners``. token_topk: optional
    int (n_layer, T, k) samples for the token-resident rate. allowed: optional
    bool (n_layer, n_expert); experts outside it are ``none`` without planning
    (a cluster rank plans only its own experts: ``plan_for_rank``).

        p, rep = plan_placement(prof, nbytes, [("cuda:0", 8 << 30), ("cpu", None)], cold="cpu", min_hot=4)
    """
    names, budgets = check_plan_options(profile, owners, cold, min_hot, speed_ratio)
    nb = _check_nbytes(profile, expert_nbytes)
    L, E = profile.n_layer, profile.n_expert
    counts = [[int(v) for v in row] for row in profile.counts]
    where = np.full((L, E), -1, dtype=np.int64)  # owner index, -1 unplaced, -2 outside ``allowed``
    if allowed is not None:
        a = np.asarray(allowed)
        if a.shape != (L, E) or a.dtype != np.bool_:
            raise ShapeError(f"allowed must be bool ({L}, {E}), got {a.dtype} {a.shape}")
        where[~a] = -2
    inside = where != -2
    left = list(budgets)

    # 1. floor on the first owner
    if min_hot:
        floor = [(layer, e) for layer in range(L)
                 for e in [e for e in profile.ranked_experts(layer) if inside[layer, e]][:min_hot]]
        need = sum(int(nb[layer, e]) for layer, e in floor)
        if left[0] is not None and need > left[0]:
            raise BudgetError(f"the floor of {min_hot} hot experts per layer needs {need:,} bytes on {names[0]}, "
                              f"its budget is {left[0]:,}", where="--min-hot",
                              hint="raise the budget or lower --min-hot")
        for layer, e in floor:
            where[layer, e] = 0
        if left[0] is not None:
            left[0] -= need

    # 2. greedy by slots per byte, owners in order
    order = sorted(((layer, e) for layer in range(L) for e in range(E)),
                   key=lambda it: (-Fraction(counts[it[0]][it[1]], int(nb[it])), -counts[it[0]][it[1]], it))
    shared = [sum(row) // profile.n_expert_used for row in counts]
    # work on this process's branches only: experts outside ``allowed`` run elsewhere
    main = [shared[layer] + sum(c for e, c in enumerate(counts[layer]) if where[layer, e] == 0) for layer in range(L)]
    peer = [sum(c for e, c in enumerate(counts[layer]) if where[layer, e] == -1) for layer in range(L)]
    for oi, name in enumerate(names):
        if name == cold:
            continue
        for layer, e in order:
            if where[layer, e] != -1:
                continue
            b = int(nb[layer, e])
            if left[oi] is not None and b > left[oi]:
                continue
            if oi == 0 and speed_ratio is not None:
                c = counts[layer][e]
                r = Fraction(speed_ratio)
                if max(Fraction(main[layer] + c) / r, Fraction(peer[layer] - c)) >= \
                        max(Fraction(main[layer]) / r, Fraction(peer[layer])):
                    continue
                main[layer] += c
                peer[layer] -= c
            where[layer, e] = oi
            if left[oi] is not None:
                left[oi] -= b

    # 3. the cold owner / none / refuse
    rest = [(layer, e) for layer in range(L) for e in range(E) if where[layer, e] == -1]
    notes = []
    if rest:
        if cold is None:
            raise BudgetError(f"{len(rest)} experts fit no owner's budget ({sum(int(nb[x]) for x in rest):,} bytes)",
                              where="--owner", hint="raise a budget, or pass --cold none / --cold OWNER")
        if cold != NONE:
            ci = names.index(cold)
            need = sum(int(nb[x]) for x in rest)
            if left[ci] is not None and need > left[ci]:
                raise BudgetError(f"cold owner {cold} must take {len(rest)} experts ({need:,} bytes), "
                                  f"its budget has {left[ci]:,} left", where="--owner")
            for x in rest:
                where[x] = ci
        else:
            notes.append(f"{len(rest)} experts are held outside this process (cold none)")
    experts = [[[int(e) for e in np.nonzero(where[layer] == i)[0]] for i in range(len(names))] for layer in range(L)]
    none = [[int(e) for e in np.nonzero(where[layer] < 0)[0]] for layer in range(L)]
    p = Placement.build(L, E, profile.n_expert_used, names, experts, none, artifact=artifact)
    rep = placement_report(p, profile, nb, budgets=budgets, token_topk=token_topk, min_hot=min_hot,
                           speed_ratio=speed_ratio, cold=cold, notes=notes)
    return p, rep


def placement_report(p: Placement, profile: RoutingProfile, expert_nbytes: Any,
                     budgets: Optional[Sequence[Optional[int]]] = None, token_topk: Any = None, min_hot: int = 0,
                     speed_ratio: Optional[float] = None, cold: Optional[str] = None,
                     notes: Sequence[str] = ()) -> PlacementReport:
    """The PlacementReport of any placement ``p`` on ``profile`` (see the module doc)."""
    if (p.n_layer, p.n_expert) != (profile.n_layer, profile.n_expert):
        raise ShapeError(f"placement is {p.n_layer} layers x {p.n_expert} experts, the profile "
                         f"{profile.n_layer} x {profile.n_expert}")
    nb = _check_nbytes(profile, expert_nbytes)
    by = p.owner_bytes(nb)
    k = profile.n_expert_used
    slot_rates, tok_rates, hot_slots, all_slots = [], [], 0, 0
    hot_masks = []
    for layer in range(p.n_layer):
        hot = p.owner_of(layer) == 0
        hot_masks.append(hot)
        row = profile.counts[layer]
        h = sum(int(c) for c, m in zip(row, hot) if m)
        t = sum(int(c) for c in row)
        hot_slots, all_slots = hot_slots + h, all_slots + t
        rate = h / t if t else 0.0
        slot_rates.append(rate)
        tok_rates.append(rate ** k)
    method = "independence"
    if token_topk is not None:
        s = np.asarray(token_topk)
        if s.ndim != 3 or s.shape[0] != p.n_layer or s.dtype.kind not in "iu" or s.shape[1] == 0:
            raise ShapeError(f"token top-k samples must be int (n_layer={p.n_layer}, T>0, k), got {s.shape} {s.dtype}")
        if int(s.min()) < 0 or int(s.max()) >= p.n_expert:
            raise BadInputError(f"token top-k samples hold expert ids outside 0..{p.n_expert - 1}")
        tok_rates = [float(np.mean(np.all(hot_masks[layer][s[layer]], axis=1))) for layer in range(p.n_layer)]
        method = "samples"
    return PlacementReport(
        owners=p.owners, budgets=tuple(budgets) if budgets is not None else (None,) * len(p.owners),
        bytes=tuple(by[o] for o in p.owners),
        experts=tuple(sum(len(p.experts[layer][i]) for layer in range(p.n_layer)) for i in range(len(p.owners))),
        none_bytes=by[NONE], none_experts=sum(len(x) for x in p.none),
        slot_resident_rate=hot_slots / all_slots if all_slots else 0.0,
        token_resident_rate=float(np.mean(tok_rates)),
        token_resident_method=method, per_layer_slot_rate=tuple(slot_rates),
        per_layer_token_rate=tuple(float(x) for x in tok_rates),
        min_hot=min_hot, speed_ratio=speed_ratio, cold=cold, placement_sha256=p.content_sha256, notes=tuple(notes))


# --------------------------------------------------------------------------
# plan_ranks


def _balanced(row: Sequence[int], experts: Sequence[int], n: int) -> dict[int, int]:
    """LPT with a cardinality bound: experts (hottest first) to the least-loaded
    rank with room; ties to the lower rank."""
    m = len(experts)
    lo, n_hi = divmod(m, n)  # n_hi ranks get lo + 1, the rest lo
    load = [0] * n
    owned = [0] * n
    at_hi = 0
    out = {}
    for e in sorted(experts, key=lambda e: (-row[e], e)):
        best = None
        for r in range(n):
            room = owned[r] < lo or (owned[r] == lo and at_hi < n_hi)
            if room and (best is None or load[r] < load[best]):
                best = r
        out[e] = best
        if owned[best] == lo:
            at_hi += 1
        owned[best] += 1
        load[best] += row[e]
    return out


def check_rank_options(profile: RoutingProfile, n_ranks: int, strategy: str = "uniform", replicate_hot: int = 0,
                       owner: str = "cpu") -> None:
    """The checks of plan_ranks (no expert bytes needed)."""
    if not isinstance(profile, RoutingProfile):
        raise BadInputError(f"expected a RoutingProfile, got {type(profile).__name__}")
    if not _is_int(n_ranks) or not 1 <= n_ranks <= MAX_RANKS:
        raise BadInputError(f"must be an integer in 1..{MAX_RANKS}, got {n_ranks!r}", where="--ranks")
    if strategy not in STRATEGIES:
        raise BadInputError(f"must be one of {', '.join(STRATEGIES)}, got {strategy!r}", where="--strategy")
    E = profile.n_expert
    if not _is_int(replicate_hot) or not 0 <= replicate_hot <= E:
        raise BadInputError(f"must be an integer in 0..n_expert ({E}), got {replicate_hot!r}", where="--replicate-hot")
    OwnerName.parse(owner, where="--owner")


def plan_ranks(profile: RoutingProfile, n_ranks: int, strategy: str = "uniform", replicate_hot: int = 0,
               owner: str = "cpu", artifact: Optional[str] = None) -> Placement:
    """A rank placement (see the module doc); ``owner`` names the local owner
    ``for_rank`` puts a rank's experts on.

        p = plan_ranks(prof, 2, "balanced", replicate_hot=1); p.slot_rank(3, e, t)
    """
    check_rank_options(profile, n_ranks, strategy, replicate_hot, owner)
    E = profile.n_expert
    rows = []
    for layer in range(profile.n_layer):
        counts = [int(v) for v in profile.counts[layer]]
        rep = set(profile.hot_experts(layer, replicate_hot))
        rest = [e for e in range(E) if e not in rep]
        if strategy == "uniform":
            assign = {e: e % n_ranks for e in rest}
        else:
            assign = _balanced(counts, rest, n_ranks)
        rows.append(tuple(REPLICATED if e in rep else assign[e] for e in range(E)))
    ranks = RankPlacement(int(n_ranks), strategy, int(replicate_hot), tuple(rows))
    return Placement.build(profile.n_layer, E, profile.n_expert_used, [owner],
                           [[[]] for _ in range(profile.n_layer)], [list(range(E)) for _ in range(profile.n_layer)],
                           ranks=ranks, artifact=artifact)


def rank_report(p: Placement, profile: RoutingProfile, expert_nbytes: Any = None,
                notes: Sequence[str] = ()) -> RankReport:
    """The RankReport of rank placement ``p`` on ``profile``."""
    rk = p._need_ranks()
    if (p.n_layer, p.n_expert) != (profile.n_layer, profile.n_expert):
        raise ShapeError(f"placement is {p.n_layer} layers x {p.n_expert} experts, the profile "
                         f"{profile.n_layer} x {profile.n_expert}")
    nb = None if expert_nbytes is None else _check_nbytes(profile, expert_nbytes)
    n = rk.n_ranks
    held, byts, work = [0] * n, [0] * n, [Fraction(0)] * n
    total = 0
    for layer in range(p.n_layer):
        for e, r in enumerate(rk.owner[layer]):
            c = int(profile.counts[layer, e])
            total += c
            holders = range(n) if r == REPLICATED else (r,)
            for h in holders:
                held[h] += 1
                if nb is not None:
                    byts[h] += int(nb[layer, e])
            if r == REPLICATED:
                for h in range(n):
                    work[h] += Fraction(c, n)
            else:
                work[r] += c
    share = tuple(float(w / total) if total else 0.0 for w in work)
    return RankReport(n, rk.strategy, rk.replicate_hot, tuple(held), None if nb is None else tuple(byts), share,
                      placement_sha256=p.content_sha256, notes=tuple(notes))


def plan_for_rank(p: Placement, rank: int, profile: RoutingProfile, expert_nbytes: Any, owners: Sequence,
                  cold: Optional[str] = None, min_hot: int = 0, speed_ratio: Optional[float] = None,
                  ) -> tuple[Placement, PlacementReport]:
    """Rank ``rank``'s own and replicated experts of rank placement ``p`` planned
    over that rank's local ``owners`` (e.g. a GPU and a CPU); every other expert
    is ``none``. ``for_rank`` is the one-owner case."""
    rk = p._need_ranks()
    if not _is_int(rank) or not 0 <= rank < rk.n_ranks:
        raise BadInputError(f"rank must be in 0..{rk.n_ranks - 1}, got {rank!r}")
    own = np.array(rk.owner, dtype=np.int64)
    allowed = (own == rank) | (own == REPLICATED)
    return plan_placement(profile, expert_nbytes, owners, cold=cold, min_hot=min_hot, speed_ratio=speed_ratio,
                          artifact=p.artifact, allowed=allowed)
