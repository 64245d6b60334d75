"""The annealers' parameters: ``ReorderParams`` (expert homes) and ``LocalityParams`` (sample placement).

Small frozen objects that the callers of the numba annealers (``reorder.reorder`` / ``anneal_layer``,
``locality.anneal_locality``) take, derived once from ``PlanOptions`` (``reorder_params``, ``locality_params``,
``baseline_locality_params``), so a planning pass hands one object down instead of a dozen keywords. Each
default is defined here once: the annealing temperatures, ``tol`` (``options.DEFAULT_TOL``) and the proposal
budgets (``default_iters``, ``default_locality_iters``, split over ``PlanOptions.rounds`` by the planning loop
with floors ``MIN_ROUND_ITERS`` / ``MIN_ROUND_LOCALITY_ITERS``; why: BENCHMARKS.md, "Planner defaults").

Units: ``iters`` are proposals (per layer and seed for the reorder, per pass for the locality), ``t0_frac`` /
``eps_frac`` the start / end temperature as fractions of the starting objective, ``tol`` a fraction over the
mean cell (0.05 = 5 %), ``beta`` the LSE sharpness, ``comp_weight`` the weight of the compute term (1: T_MoE).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

from ..cost import DEFAULT_BETA
from ..errors import PlanError
from ..validate import check_bool, check_choice, check_nonnegative, check_optional_int, check_positive
from .options import DEFAULT_TOL, OBJECTIVES, PlanOptions

__all__ = ["ReorderParams", "LocalityParams", "default_iters", "default_locality_iters", "reorder_params",
           "locality_params", "baseline_locality_params", "params_or_fields", "MIN_ROUND_ITERS",
           "MIN_ROUND_LOCALITY_ITERS"]

MIN_ROUND_ITERS = 300
"""Reorder proposals per layer, seed and round at least, when ``iters`` is the default split over the rounds."""
MIN_ROUND_LOCALITY_ITERS = 100
"""Sample-placement proposals per round at least, when ``locality_iters`` is the default split over the rounds."""


def default_iters(num_experts: int, num_gpus: int, num_micro_batches: int = 1, num_layers: int = 1,
                  budget: float = 5e7) -> int:
    """Default annealing proposals per layer and seed.

    40 per expert pair on different GPUs, but at most ``budget / (L M G)`` (a proposal costs O(M G); the
    budget bounds the whole reorder at a few seconds per seed), and at least 1000.
    """
    pairs = num_experts * (num_experts - num_experts // num_gpus) // 2
    cap = budget / max(1, num_layers * num_micro_batches * num_gpus)
    return int(max(min(40 * pairs, cap), 1000))


def default_locality_iters(num_samples: int, num_layers: int, num_gpus: int, repack: bool,
                           budget: float = 4.5e7) -> int:
    """Default proposals: 60 per sample (120 with repack), at most ``budget / (L G)`` (a proposal costs
    O(L G)), at least 200."""
    want = (120 if repack else 60) * num_samples
    return int(max(min(want, budget / max(1, num_layers * num_gpus)), 200))


def _check_annealing(t0_frac: float, eps_frac: float, comp_weight: float) -> None:
    """The checks both parameter objects share: temperatures and the compute weight finite and > 0."""
    check_positive("t0_frac", t0_frac)
    check_positive("eps_frac", eps_frac)
    check_positive("comp_weight", comp_weight)


@dataclass(frozen=True)
class ReorderParams:
    """How the expert homes are annealed (``reorder.anneal_layer``, one layer and seed), validated on construction.

    Attributes:
        objective: "batch" (sum over micro-batches of T_MoE) or "aggregate" (T_MoE of the summed loads).
        beta: LSE sharpness of the smoothed objective, > 0.
        iters: proposals per layer and seed, int >= 0 (None: ``iters_for``'s default, the whole-reorder budget).
        t0_frac, eps_frac: start / end temperature, fractions of the starting objective (geometric cooling).
        smooth: anneal the LSE-smoothed T_MoE (None: smoothed for "aggregate", exact for "batch").
        node_comp, skew_cap: the replication-aware cost of ``reorder.batch_cost`` (node-level compute, soft cap
            on its skew, a fraction).
        comp_weight: weight of the compute term of every cost (1: T_MoE; ``timing.STEP_COMP_WEIGHT``: the step).
    """

    objective: str = "batch"
    beta: float = DEFAULT_BETA
    iters: int | None = None
    t0_frac: float = 0.005
    eps_frac: float = 1e-5
    smooth: bool | None = None
    node_comp: bool = False
    skew_cap: float | None = None
    comp_weight: float = 1.0

    def __post_init__(self) -> None:
        check_choice("objective", self.objective, OBJECTIVES)
        check_positive("beta", self.beta)
        check_optional_int("iters", self.iters, 0)
        _check_annealing(self.t0_frac, self.eps_frac, self.comp_weight)
        if self.smooth is not None:
            check_bool("smooth", self.smooth)
        check_bool("node_comp", self.node_comp)
        if self.skew_cap is not None:
            check_nonnegative("skew_cap", self.skew_cap)

    @property
    def smoothed(self) -> bool:
        """Whether the annealer runs on the LSE-smoothed objective (``smooth``, or the objective's default)."""
        return self.objective == "aggregate" if self.smooth is None else bool(self.smooth)

    def iters_for(self, num_experts: int, num_gpus: int, num_micro_batches: int, num_layers: int = 1) -> int:
        """``iters``, or ``default_iters`` for M micro-batches (1 with the "aggregate" objective) and L layers."""
        if self.iters is not None:
            return int(self.iters)
        return default_iters(num_experts, num_gpus, num_micro_batches if self.objective == "batch" else 1,
                             num_layers)


@dataclass(frozen=True)
class LocalityParams:
    """How the samples are placed for frozen homes (``locality.anneal_locality``), validated on construction.

    Attributes:
        repack: also move samples between micro-batches (equal sample counts per micro-batch unless ``token_cap``).
        token_cap: with ``repack``, tokens per micro-batch at most this (int >= 1; None: sample counts kept).
        tol: attention-work tolerance over the mean (cell) work, a fraction >= 0 (``locality`` module docstring).
        iters: proposals, int >= 0 (None: ``iters_for``'s default).
        beta: LSE sharpness of the smoothed objective, > 0.
        t0_frac, eps_frac: start / end temperature, fractions of the starting objective.
        smooth: anneal the LSE-smoothed objective (default: the exact one, ~2.5x cheaper, same result).
        keep_cell_sizes: swaps only, so every (micro-batch, GPU) cell keeps its number of samples. Not with
            ``token_cap``.
        comp_weight: weight of the compute term (1: the sum of T_MoE; ``timing.STEP_COMP_WEIGHT``: the step).
        charge_attention: also charge every micro-batch's slowest GPU's local stage (attention + shared experts,
            ``timing.local_stage``) over the L layers at ``comp_weight``, as the step charges it (forward +
            backward, halved like the MoE terms); the attention caps still apply.
    """

    repack: bool = False
    token_cap: int | None = None
    tol: float = DEFAULT_TOL
    iters: int | None = None
    beta: float = DEFAULT_BETA
    t0_frac: float = 0.002
    eps_frac: float = 1e-6
    smooth: bool = False
    keep_cell_sizes: bool = False
    comp_weight: float = 1.0
    charge_attention: bool = False

    def __post_init__(self) -> None:
        check_nonnegative("tol", self.tol)
        check_optional_int("iters", self.iters, 0)
        check_optional_int("token_cap", self.token_cap, 1)
        check_positive("beta", self.beta)
        _check_annealing(self.t0_frac, self.eps_frac, self.comp_weight)
        for name in ("repack", "smooth", "keep_cell_sizes", "charge_attention"):
            check_bool(name, getattr(self, name))
        if self.keep_cell_sizes and self.token_cap is not None:
            raise PlanError(f"token_cap={self.token_cap} moves samples between micro-batches of different sizes; "
                            "keep_cell_sizes=True keeps every cell's sample count: drop one of them")

    def iters_for(self, num_samples: int, num_layers: int, num_gpus: int) -> int:
        """``iters``, or ``default_locality_iters`` for N samples, L layers and G GPUs."""
        if self.iters is not None:
            return int(self.iters)
        return default_locality_iters(num_samples, num_layers, num_gpus, self.repack)


P = TypeVar("P", ReorderParams, LocalityParams)


def params_or_fields(cls: type[P], params: P | None, fields: dict[str, Any]) -> P:
    """``params``, or ``cls(**fields)`` (the keyword convenience of the public annealers); PlanError when both
    are given."""
    if params is None:
        return cls(**fields)
    if fields:
        raise PlanError(f"give params= ({cls.__name__}) or its fields as keywords, not both: got "
                        f"{sorted(fields)} beside params")
    return params


def reorder_params(options: PlanOptions, num_experts: int, num_gpus: int, num_micro_batches: int,
                   num_layers: int, comp_weight: float | None = None) -> ReorderParams:
    """The reorder parameters of one round of the planning loop: the options' objective, smoothing and rank
    balance, ``options.comp_weight``, and ``iters`` (default: the whole-reorder budget split over
    ``options.rounds``, at least ``MIN_ROUND_ITERS``). ``comp_weight``: the caller's (the cluster's overlap rule,
    ``PlanContext.comp_weight``) instead of ``options.comp_weight``."""
    node_comp, skew_cap = options.rank_balance
    w = options.comp_weight if comp_weight is None else comp_weight
    p = ReorderParams(objective=options.objective, beta=options.beta, iters=options.iters, smooth=options.smooth,
                      node_comp=node_comp, skew_cap=skew_cap, comp_weight=w)
    if options.iters is None:
        whole = p.iters_for(num_experts, num_gpus, num_micro_batches, num_layers)
        p = dataclasses.replace(p, iters=max(whole // options.rounds, MIN_ROUND_ITERS))
    return p


def locality_params(options: PlanOptions, num_samples: int, num_layers: int, num_gpus: int,
                    comp_weight: float | None = None) -> LocalityParams:
    """The sample-placement parameters of one round of the planning loop (and of ``relocate``): the options'
    repacking, caps, ``locality_smooth`` and ``comp_weight``, and ``iters`` (default: the budget split over
    ``options.rounds``, at least ``MIN_ROUND_LOCALITY_ITERS``). ``comp_weight``: as for ``reorder_params``."""
    p = LocalityParams(repack=options.repack, token_cap=options.token_cap, tol=options.tol,
                       iters=options.locality_iters, beta=options.beta, smooth=options.locality_smooth,
                       keep_cell_sizes=options.keep_cell_sizes,
                       comp_weight=options.comp_weight if comp_weight is None else comp_weight,
                       charge_attention=options.step_objective)
    if options.locality_iters is None:
        whole = p.iters_for(num_samples, num_layers, num_gpus)
        p = dataclasses.replace(p, iters=max(whole // options.rounds, MIN_ROUND_LOCALITY_ITERS))
    return p


def baseline_locality_params(options: PlanOptions) -> LocalityParams:
    """The one repacking pass of a baseline with ``repack=True`` (``context.baseline_samples``): the options' caps
    and ``locality_iters`` (None: the whole default budget), the exact sum of T_MoE as the objective."""
    return LocalityParams(repack=True, token_cap=options.token_cap, tol=options.tol, iters=options.locality_iters,
                          keep_cell_sizes=options.keep_cell_sizes)
