"""The adaptive planner: measure every candidate, then allocate under a budget.

``plan_adaptive`` takes convert's plan and replaces its "adaptive"
routed-expert choices with measured, budgeted qtypes: it works out the byte
budget, reads the routing profile and the sensitivity file, measures
(``measure``), allocates (``resolve`` over ``allocate.allocate``) and
writes the plan's tensors, with the summary the report and the manifest
carry (``summary.PlanSummary``).

``resolve`` turns the measurements into items for ``allocate.allocate``:
one item per (layer, surface) with granularity "tensor" (one qtype per
tensor, the Lucebox layout), or per expert with granularity "expert" (a
layer's experts may differ; each qtype's experts form a compact stack).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

import numpy as np

from ds4quant.errors import BadInputError, BudgetError
from ds4quant.formats import get_qtype
from ds4quant.names import stack_name
from ds4quant.plan.allocate import Allocation, Candidate, Item, allocate
from ds4quant.plan.measure import fits, measure
from ds4quant.plan.options import AdaptiveOptions, Granularity
from ds4quant.plan.records import Books, Decision, Measure, Measurements
from ds4quant.plan.summary import PlanSummary, plan_summary
from ds4quant.progress import ProgressFn

if TYPE_CHECKING:
    from ds4quant.plan.recipes import TensorChoice
    from ds4quant.sources.base import Source


def allowed_candidates(opts: AdaptiveOptions, surface: str) -> tuple[str, ...]:
    """Lucebox loads rocmfp3_mix (105) on down experts only (P4MIXv1)."""
    if opts.granularity is Granularity.TENSOR and opts.lucebox and surface != "down":
        return tuple(q for q in opts.candidates if get_qtype(q).ggml_type != 105)
    return tuple(opts.candidates)


def reachable_bytes(expert_tensors: Sequence[tuple], opts: AdaptiveOptions) -> tuple[int, int]:
    """(fewest, most) payload bytes the candidates can give the routed experts left to decide:
    every tensor at its cheapest, or its largest, allowed candidate that fits its rows. Sizes
    depend on the qtypes only, so this is known before anything is measured."""
    lo = hi = 0
    for choice, _ in expert_tensors:
        n = int(np.prod(choice.shape))
        sizes = [get_qtype(q).nbytes(n) for q in allowed_candidates(opts, choice.surface) if fits(q, choice.shape[0])]
        if not sizes:
            raise BadInputError(f"no candidate qtype is allowed on {choice.surface} experts and fits row length "
                                f"{choice.shape[0]}", where=choice.name, hint="--candidates")
        lo, hi = lo + min(sizes), hi + max(sizes)
    return lo, hi


def check_reachable(expert_tensors: Sequence[tuple], opts: AdaptiveOptions, budget: int, fixed: int,
                    weights: int) -> None:
    """Refuse, before the (long) measurement, a budget the candidates cannot meet: below the
    cheapest choice everywhere, or (for --target-bpw, a point to land on) above the largest.
    A --max-bytes above the largest is a cap that simply holds, so it passes. The refusal
    names the reachable range."""
    lo, hi = reachable_bytes(expert_tensors, opts)
    bpw_lo, bpw_hi = 8 * (lo + fixed) / weights, 8 * (hi + fixed) / weights
    cands = ",".join(opts.candidates)
    if opts.target_bpw is not None:
        # the budget rounds down to whole bytes; a target a rounding above the top still lands on it
        if budget < lo or opts.target_bpw > bpw_hi + 1e-9:
            where = "below" if budget < lo else "above"
            raise BudgetError(
                f"--target-bpw {opts.target_bpw:g} is {where} what the candidates ({cands}) reach: "
                f"{bpw_lo:.4f} to {bpw_hi:.4f} bpw over the routed experts" +
                (" (the budget is below the smallest possible size)" if where == "below" else ""),
                hint=f"pass a --target-bpw from {bpw_lo:.4f} to {bpw_hi:.4f}, or change --candidates")
    elif budget < lo:
        raise BudgetError(f"--max-bytes {opts.max_bytes:,} leaves {budget:,} bytes for the routed experts, below "
                          f"the smallest possible size {lo:,} bytes the candidates ({cands}) reach "
                          f"({bpw_lo:.4f} bpw; the most they take is {hi:,} bytes, {bpw_hi:.4f} bpw)",
                          hint="raise --max-bytes, or change --candidates")


def resolve(expert_tensors: Sequence[tuple], meas: Measurements, opts: AdaptiveOptions,
            budget: int, gains: Optional[Mapping[str, float]] = None) -> tuple[dict[str, Decision], Allocation]:
    """Allocate qtypes under ``budget`` bytes of routed-expert payload,
    minimising the weighted error, or with ``gains`` (tensor -> KL per unit
    of weighted error) the predicted KL. Decisions keep the weighted error."""
    items = []
    for choice, members in expert_tensors:
        w = meas.weights[choice.name] * (1.0 if gains is None else gains[choice.name])
        allowed = tuple(q for q in allowed_candidates(opts, choice.surface)
                        if (choice.name, members[0].expert, q) in meas.measures)
        if not allowed:
            raise BadInputError(f"no candidate qtype is allowed on {choice.surface} experts", where="--candidates")
        if opts.granularity is Granularity.TENSOR:
            cands = []
            for q in allowed:
                ms = [meas.measures[(choice.name, m.expert, q)] for m in members]
                cands.append(Candidate(q, sum(x.nbytes for x in ms), float(sum(wi * x.wsse for wi, x in zip(w, ms)))))
            items.append(Item(choice.name, tuple(cands)))
        else:
            for i, m in enumerate(members):
                cands = tuple(Candidate(q, meas.measures[(choice.name, m.expert, q)].nbytes,
                                        float(w[i] * meas.measures[(choice.name, m.expert, q)].wsse)) for q in allowed)
                items.append(Item(f"{choice.name}#{m.expert}", cands))
    alloc = allocate(items, budget)
    out = {}
    for choice, members in expert_tensors:
        w = meas.weights[choice.name]
        if opts.granularity is Granularity.TENSOR:
            q = alloc.choice[choice.name]
            qs = tuple(q for _ in members)
        else:
            qs = tuple(alloc.choice[f"{choice.name}#{m.expert}"] for m in members)
        err = float(sum(wi * meas.measures[(choice.name, m.expert, q)].wsse for wi, m, q in zip(w, members, qs)))
        nb = sum(meas.measures[(choice.name, m.expert, q)].nbytes for m, q in zip(members, qs))
        out[choice.name] = Decision(choice.name, qs, err, nb)
    return out, alloc


def plan_adaptive(src: "Source", plan: "Sequence[TensorChoice]", members, opts: AdaptiveOptions, imatrix,
                  imatrix_sha, books: Books, progress: Optional[ProgressFn] = None
                  ) -> "tuple[list[TensorChoice], PlanSummary, Mapping[tuple[str, int, str], Measure]]":
    """Replace the plan's "adaptive" routed-expert choices with measured,
    budgeted qtypes; fitted MIX books go into ``books``. Returns (new plan,
    its summary, the measured figures: (tensor, expert, qtype) -> Measure,
    which convert records for the chosen encodings instead of decoding them
    again)."""
    routing = None
    if opts.routing is not None:
        from ds4quant.calib.routing import read_routing

        routing = read_routing(opts.routing)
        if routing.counts.shape[0] != src.config.num_hidden_layers:
            raise BadInputError(f"routing profile has {routing.counts.shape[0]} layers, the model "
                                f"{src.config.num_hidden_layers}", where=str(opts.routing))
    todo = [(c, members[c.name]) for c in plan if c.qtype == "adaptive"]
    if not todo:
        raise BadInputError("the adaptive recipe has no routed-expert tensor left to decide",
                            hint="a --tensor-type override fixed all of them")
    # a candidate must fit every tensor it may go to (rocmfp2_mix needs in % 128)
    for c, _ in todo:
        bad = [q for q in opts.candidates if not fits(q, c.shape[0])]
        if len(bad) == len(opts.candidates):
            raise BadInputError(f"no candidate qtype fits row length {c.shape[0]}", where=c.name)
    expert_weights_total = sum(int(np.prod(c.shape)) for c in plan if c.tensor_class == "routed_expert")
    fixed = sum(get_qtype(c.qtype).nbytes(int(np.prod(c.shape))) for c in plan
                if c.tensor_class == "routed_expert" and c.qtype != "adaptive")
    if opts.target_bpw is not None:
        budget = int(opts.target_bpw * expert_weights_total // 8) - fixed
        budget_what = f"target {opts.target_bpw} bpw over {expert_weights_total:,} routed-expert weights"
    else:
        dense = sum(get_qtype(c.qtype).nbytes(int(np.prod(c.shape))) for c in plan
                    if c.tensor_class != "routed_expert")
        n_exp = sum(c.shape[2] for c, _ in todo)
        books_bound = 2 * (33 * n_exp + 128 * len(todo)) + 4096  # own table + Lucebox blobs, upper bound
        budget = opts.max_bytes - dense - fixed - books_bound
        budget_what = f"max {opts.max_bytes:,} bytes minus {dense:,} dense, {books_bound:,} codebook bound"
    if budget <= 0:
        raise BudgetError(f"no bytes left for the routed experts ({budget_what})",
                          hint="raise --target-bpw / --max-bytes")
    check_reachable(todo, opts, budget, fixed, expert_weights_total)

    gains = None
    if opts.sensitivity is not None:
        from ds4quant.calib.sensitivity import read_sensitivity

        sens = read_sensitivity(opts.sensitivity, fingerprint=src.fingerprint())
        gains = {c.name: sens.gain(c.name) for c, _ in todo}
    meas = measure(src, todo, opts, imatrix, imatrix_sha, routing, books, progress)
    decisions, alloc = resolve(todo, meas, opts, budget, gains)

    new_plan = []
    for c in plan:
        if c.qtype != "adaptive":
            new_plan.append(c)
            continue
        d = decisions[c.name]
        rule = f"adaptive:{'bpw=' + str(opts.target_bpw) if opts.target_bpw is not None else 'bytes=' + str(opts.max_bytes)}"
        groups: dict[str, list[int]] = {}
        for m, q in zip(members[c.name], d.qtypes):
            groups.setdefault(q, []).append(m.expert)
        if len(groups) == 1:
            (q,) = groups
            new_plan.append(replace(c, qtype=q, rule=rule, predicted_error=d.predicted_error))
            continue
        w = meas.weights[c.name]
        for q in opts.candidates:  # a stable order: the candidate order
            if q not in groups:
                continue
            ids = tuple(groups[q])
            err = float(sum(w[e] * meas.measures[(c.name, e, q)].wsse for e in ids))
            new_plan.append(replace(c, name=stack_name(c.layer, c.surface, q), qtype=q, rule=rule, experts=ids,
                                    shape=(c.shape[0], c.shape[1], len(ids)), predicted_error=err))
    summary = plan_summary(todo, meas, opts, alloc, budget, budget_what, fixed, expert_weights_total, decisions,
                           imatrix, gains)
    return new_plan, summary, meas.measures
