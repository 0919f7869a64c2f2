"""The plan: which qtype every tensor gets, from a recipe or measured under a budget.

    Recipe, get_recipe, RECIPES, Override      recipes and --tensor-type rules (``recipes``)
    TensorSpec, TensorChoice, plan_tensors     a recipe applied to a source's tensors
    plan_from_json                             a recorded plan back as TensorChoice records

The adaptive recipe, in the order it runs::

    AdaptiveOptions (Granularity, Fitter, Device)   how to measure and allocate (``options``)
    plan_adaptive(src, plan, members, opts, ...)    measure, allocate, write the plan (``planner``)
    measure(...) -> Measurements                    every candidate on every expert (``measure``)
    measure_candidates / measure_matrix, ExpertJob  one expert matrix's candidates (``job``)
    ordered_map, worker_stream, default_jobs        the stage's workers (``workers``)
    Measure, Books, Decision, expert_weights        its records (``records``; cache: ``cache``)
    resolve, allowed_candidates                     measurements -> allocation items -> decisions
    Candidate, Item, Allocation, allocate           the budgeted knapsack (``allocate``)
    PlanSummary, weighted_error                     the plan's summary for the report (``summary``)

Example::

    from ds4quant.plan import AdaptiveOptions, get_recipe
    opts = AdaptiveOptions(target_bpw=2.7, granularity="expert").validate()
"""

from ds4quant.plan.allocate import Allocation, Candidate, Item, allocate
from ds4quant.plan.job import DEVICE_MIN_WEIGHTS, ExpertJob, measure_candidates, measure_matrix
from ds4quant.plan.measure import fits, measure
from ds4quant.plan.options import DEFAULT_CANDIDATES, AdaptiveOptions, Device, Fitter, Granularity
from ds4quant.plan.planner import allowed_candidates, plan_adaptive, resolve
from ds4quant.plan.recipes import (RECIPES, Override, Recipe, TensorChoice, TensorSpec, get_recipe, plan_from_json,
                                   plan_tensors)
from ds4quant.plan.records import Books, Decision, Measure, Measurements, expert_weights
from ds4quant.plan.summary import FitterComparison, Objective, PlanSummary, UniformPoint, weighted_error
from ds4quant.plan.workers import default_jobs, ordered_map, worker_stream

__all__ = [
    "Recipe", "get_recipe", "RECIPES", "Override", "TensorSpec", "TensorChoice", "plan_tensors", "plan_from_json",
    "AdaptiveOptions", "Granularity", "Fitter", "Device", "DEFAULT_CANDIDATES",
    "plan_adaptive", "measure", "fits", "measure_candidates", "measure_matrix", "ExpertJob", "DEVICE_MIN_WEIGHTS",
    "ordered_map", "worker_stream", "default_jobs",
    "Measure", "Measurements", "Books", "Decision", "expert_weights",
    "resolve", "allowed_candidates", "Candidate", "Item", "Allocation", "allocate",
    "PlanSummary", "UniformPoint", "FitterComparison", "Objective", "weighted_error",
]
