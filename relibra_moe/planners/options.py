"""``PlanOptions``: every plan option, its default, unit and check, in one place.

``plan_batch(**options)``, ``Planner(**options)`` and ``relibra plan`` all build one ``PlanOptions``; the
strategies read its fields and nothing else. Construction validates every field (``PlanError`` naming
the option and the value); ``check_for(strategy)`` adds the rules that depend on the strategy.

Units: counts are plain ints (proposals, rounds, seeds, slots, tokens), ``tol`` / ``skew_cap`` are
fractions (0.05 = 5 %), ``beta`` is the LSE sharpness (dimensionless), ``optimizer_bytes_per_param`` is
bytes per expert parameter. ``None`` means "the default rule", documented on the field.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..cost import DEFAULT_BETA
from ..errors import PlanError
from ..plan import Placement
from ..sample_placements import SAMPLE_PLACEMENTS
from ..timing import DEFAULT_OPTIMIZER_BYTES_PER_PARAM, STEP_COMP_WEIGHT
from ..validate import (
    check_bool,
    check_choice,
    check_int,
    check_nonnegative,
    check_optional_int,
    check_positive,
    check_token_counts,
)

__all__ = ["PlanOptions", "ReplicateOptions", "OBJECTIVES", "SAMPLE_OWNERS", "SAMPLE_PLACEMENTS", "DEFAULT_ROUNDS",
           "DEFAULT_TOL", "DEFAULT_CANDIDATES", "FINAL_ITERS_FACTOR", "RELIBRA_STRATEGIES", "REPLICA_STRATEGIES",
           "HISTORY_STRATEGIES"]

OBJECTIVES = ("batch", "aggregate")
SAMPLE_OWNERS = ("planner", "trainer")
"""Who places the samples: the planner (micro-batch and GPU of every sample are planned) or the trainer (its
assignment is an input; the planner chooses only expert homes, replicas and splits for it)."""
DEFAULT_ROUNDS = 2
"""Reorder + locality rounds of relibra / relibra-inter."""
DEFAULT_TOL = 0.05
"""Attention-work tolerance of the sample placement over the mean per (micro-batch, GPU) cell."""
FINAL_ITERS_FACTOR = 8
"""``final_iters`` default: this many times a round's reorder proposals (BENCHMARKS.md, "Planner defaults")."""

REPLICA_STRATEGIES = ("eplb", "lplb", "relibra", "eplb-history", "online", "balanced")
"""The strategies that read ``replica_slots``: those that place replicas, and ``balanced`` (the bound of plans with
that many slots, ``evaluate.bound_terms``)."""
RELIBRA_STRATEGIES = ("relibra", "relibra-inter")
"""The ReLibra strategies: reorder + locality (+ replication); they read ``skew_cap`` / ``node_comp``."""
HISTORY_STRATEGIES = ("eplb-history", "relibra")
"""The strategies that plan from past batches' loads (read ``history``)."""

DEFAULT_CANDIDATES = 4
"""``ReplicateOptions.candidates`` default up to 16 GPUs (2 beyond): experts tried per greedy move."""


@dataclass(frozen=True)
class ReplicateOptions:
    """How Algorithm 2 replicates one cell (``replicate.replicate_cell``), validated on construction; the option
    ``PlanOptions.replicate`` (a dict of these fields is accepted there and converted, an unknown field is a
    PlanError naming it).

    Attributes:
        candidates: experts tried per move on each bottleneck, int >= 1 (None: ``DEFAULT_CANDIDATES`` up to 16
            GPUs, 2 beyond; 1 with ``comm_candidates=False`` is the paper's loop).
        comm_candidates: also try replicas that relieve the communication bottleneck.
        passes: water-filling passes after each move over the replicated experts sharing a GPU, int >= 0.
        polish: re-solve the final split with the exact LP and keep the better (None: only on cells of at most 16
            GPUs whose greedy T_MoE is more than ``polish_tol`` above ``split.lower_bound``).
        polish_tol: that tolerance, a fraction >= 0 (0.005 = 0.5 %).
    """

    candidates: int | None = None
    comm_candidates: bool = True
    passes: int = 0
    polish: bool | None = None
    polish_tol: float = 0.005

    def __post_init__(self) -> None:
        check_optional_int("candidates", self.candidates, 1)
        check_bool("comm_candidates", self.comm_candidates)
        check_int("passes", self.passes, 0)
        if self.polish is not None:
            check_bool("polish", self.polish)
        check_nonnegative("polish_tol", self.polish_tol)

    @classmethod
    def of(cls, value: ReplicateOptions | Mapping[str, Any] | None, name: str = "replicate") -> ReplicateOptions:
        """``value`` as a ReplicateOptions: itself, the defaults for None, or a dict of its fields (PlanError
        naming ``name``, the unknown field and the known ones; or a value that is neither)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise PlanError(f"{name}={value!r} must be a dict of ReplicateOptions fields (replicate_cell keywords) "
                            "or a ReplicateOptions")
        known = tuple(f.name for f in dataclasses.fields(cls))
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise PlanError(f"unknown {name} option {unknown[0]}={value[unknown[0]]!r}; known: {list(known)}")
        return cls(**value)

    def kwargs(self) -> dict[str, Any]:
        """The fields as ``replicate_cell`` keywords."""
        return dataclasses.asdict(self)


_BOOLS = ("repack", "final_reorder", "locality_smooth", "migration", "price_replicas", "keep_cell_sizes", "portfolio",
          "step_objective", "resident_replicas", "portfolio_balancers")
_OPTIONAL_BOOLS = ("node_comp", "smooth")


@dataclass(frozen=True)
class PlanOptions:
    """Every option of a planning call (``plan_batch``, ``Planner``, ``relibra plan``), validated on construction.

    Attributes:
        replica_slots: r replica slots per GPU (``REPLICA_STRATEGIES``), int >= 0, at most ``E - E/G``
            (``plan.max_replica_slots``, checked when the model and cluster are known).
        seed: plan seed, int >= 0 (same inputs and seed -> same plan).
        workers: processes for the parallel parts, int >= 1.
        repack: let samples change micro-batch (equal sample counts per micro-batch unless ``token_cap``).
        iters: annealing proposals per layer, seed and round (None: ``params.default_iters`` over ``rounds``).
        locality_iters: sample-placement proposals per round (None: ``params.default_locality_iters`` over
            ``rounds``).
        num_seeds: annealing runs per layer, int >= 1 (None: one per worker).
        rounds: reorder + locality rounds of relibra*, int >= 1.
        objective: reorder objective, "batch" (sum over micro-batches of T_MoE) or "aggregate".
        smooth: anneal the reorder on the LSE-smoothed T_MoE (None: the objective's default).
        locality_smooth: anneal the sample placement on the smoothed T_MoE.
        beta: LSE sharpness of the smoothed objectives, > 0.
        tol: attention-work tolerance of the sample placement (fraction over the mean), >= 0.
        token_cap: with ``repack``, tokens per micro-batch at most this (int >= 1; None: sample counts kept).
        num_groups: EPLB expert groups, int >= 1 (None: no hierarchy).
        migration: price expert moves against ``previous`` (relibra*): relabel by the fabric's symmetries and
            keep a layer's previous homes where the new ones do not pay for their move.
        move_horizon: the batches a re-layout of the experts is expected to serve, int >= 1 (relibra*; with
            ``migration`` and ``step_objective``). With more than 1 and ``previous_loads``, a move is credited
            ``move_horizon - 1`` times what its homes are expected to save on each later batch, judged on the
            previous batch, which they were not planned for: in the migration pricing per layer
            (``migration.horizon_gains``), in relibra's portfolio per candidate (its simulated saving over the
            best plan that keeps the homes, scaled by ``migration.carry_over``; candidate ``relibra-horizon``).
            The simulator still charges the whole re-layout to the step that moves, which may be slower than
            staying by up to the credit. 1 (default), or no ``previous_loads`` (the first batch of a run): no
            credit, a move pays for itself on its own step (docs/method.md, "Moves that pay over several
            batches").
        previous_loads: with ``move_horizon > 1``, the previous batch's loads as it ran: tokens ``[M', L, G, E]``
            per (micro-batch, layer, source GPU, expert) under its plan's sample placement
            (``evaluate.plan_loads``; finite, >= 0; the shape against the model and cluster is checked when
            planning). None: no earlier batch.
        previous: placement before this batch (a ``Placement`` or int ``[L, E]``; None: the static one).
        history: eplb-history's past loads, tokens per (layer, expert): ``[L, E]`` of one batch or ``[W, L, E]``
            of a window of W >= 1 batches (finite, >= 0; None: no batch seen yet, the trivial layout). The
            shape against the model is checked by the strategy (``history.history_weights``).
        optimizer_bytes_per_param: optimizer-state bytes that move with each expert parameter, >= 0.
        price_replicas: replicas must pay for their push / pull not hidden behind their window
            (``timing.replica_push_overlap``; relibra).
        node_comp: replication-aware reorder cost (None: on exactly when ``skew_cap`` is set).
        skew_cap: rank-balance mode, soft cap on the node-level compute skew (fraction, >= 0; None: off).
        final_reorder: re-anneal the homes once more after the last locality pass.
        final_iters: proposals of that pass, int >= 0 (None: ``FINAL_ITERS_FACTOR`` x a round's ``iters``).
        cell_chunk: replication cells per executor task, int >= 1 (None: about 16 tasks per worker).
        replicate: how Algorithm 2 replicates a cell (``ReplicateOptions``; a dict of its fields, e.g.
            ``{"candidates": 2}``, is converted, an unknown field is a PlanError).
        sample_owner: who places the samples (``SAMPLE_OWNERS``): "planner" (default: the strategy chooses every
            sample's GPU, and its micro-batch with ``repack``) or "trainer" (the trainer's assignment is kept as
            given: ``micro_batch`` of the batch and ``sample_gpu``; the strategy chooses expert homes, replicas
            and splits only; ``repack`` is refused).
        sample_placement: the samples' placement before planning (``sample_placements.SAMPLE_PLACEMENTS``):
            "round-robin" (Megatron's order), "length-balanced" (verl's ``balance_batch``: equal sample counts per
            rank, workloads balanced over the whole batch; samples change micro-batch) or "longest-first" (per
            micro-batch, longest sample onto the GPU with the fewest tokens). The strategies that do not place samples
            run on it; relibra*'s locality starts from it; with ``sample_owner="trainer"`` it is the trainer's
            placement, kept as given. None: ``placement_for`` (relibra* planning the samples start from
            "length-balanced", everything else runs on "round-robin"). Not with ``sample_gpu``.
        keep_cell_sizes: the sample placement only swaps samples, so every (micro-batch, GPU) cell keeps the
            number of samples of the start (round-robin: B / G each): what a trainer with a fixed per-rank
            micro-batch size (verl, slime without dynamic batching) needs to follow the plan through
            ``sample_order``. Not with ``token_cap``.
        sample_gpu: with ``sample_owner="trainer"``, the trainer's rank of every sample, int ``[N]`` in ``[0, G)``
            (None: ``plan.round_robin_gpus`` of the micro-batches, what a trainer that does not reorder does);
            must be None with "planner". Length and range are checked against the batch when planning.
        step_objective: relibra*'s reorder and locality anneal the simulated step's MoE weighting,
            ``w x comp + comm`` with ``w`` from the cluster's overlap rule (``timing.step_comp_weight``; without
            overlap ``timing.STEP_COMP_WEIGHT``: 3 comp + 2 comm, halved); False: T_MoE (comp + comm).
        portfolio: relibra ends with a portfolio (its plan, the previous homes with replicas, relibra-inter and the
            cheap baselines, each simulated with the moves charged against ``previous``; the fastest wins).
        resident_replicas: relibra may choose replicas that stay resident for the whole batch
            (``ReplicaPlan.resident``: the portfolio's resident locality-replica candidate, ``locality_replicas``,
            and any other candidate whose slots hold the same experts in every micro-batch). Memory: a resident
            plan keeps every layer's slots filled, ``L x r`` extra experts' weights per GPU (and their gradients
            until the last micro-batch's backward), ``L x r x ModelSpec.expert_bytes`` bytes, against ``r``
            experts for the per-layer replica buffer. False (GPUs without that memory): no resident candidate is
            built or chosen.
        portfolio_balancers: the portfolio also judges EPLB+ and LPLB+ on every sample placement (each built only
            when its lower bound is below the best score so far); False leaves them out, and with them the
            guarantee that relibra is never slower than they are (LPLB+'s LP split is the costly one).
    """

    replica_slots: int = 0
    seed: int = 0
    workers: int = 1
    repack: bool = False
    iters: int | None = None
    locality_iters: int | None = None
    num_seeds: int | None = None
    rounds: int = DEFAULT_ROUNDS
    objective: str = "batch"
    smooth: bool | None = None
    locality_smooth: bool = False
    beta: float = DEFAULT_BETA
    tol: float = DEFAULT_TOL
    token_cap: int | None = None
    num_groups: int | None = None
    migration: bool = True
    move_horizon: int = 1
    previous_loads: Any = None
    previous: Any = None
    history: Any = None
    optimizer_bytes_per_param: float = DEFAULT_OPTIMIZER_BYTES_PER_PARAM
    price_replicas: bool = True
    node_comp: bool | None = None
    skew_cap: float | None = None
    final_reorder: bool = False
    final_iters: int | None = None
    cell_chunk: int | None = None
    replicate: ReplicateOptions = ReplicateOptions()
    sample_owner: str = "planner"
    sample_gpu: Any = None
    sample_placement: str | None = None
    keep_cell_sizes: bool = False
    portfolio: bool = True
    step_objective: bool = True
    resident_replicas: bool = True
    portfolio_balancers: bool = True

    def __post_init__(self) -> None:
        check_int("replica_slots", self.replica_slots, 0)
        check_int("seed", self.seed, 0)
        check_int("workers", self.workers, 1)
        for name, lo in (("iters", 0), ("locality_iters", 0), ("final_iters", 0), ("num_seeds", 1),
                         ("num_groups", 1), ("token_cap", 1), ("cell_chunk", 1)):
            check_optional_int(name, getattr(self, name), lo)
        check_int("rounds", self.rounds, 1)
        check_int("move_horizon", self.move_horizon, 1)
        check_choice("objective", self.objective, OBJECTIVES)
        for name in _BOOLS:
            check_bool(name, getattr(self, name))
        for name in _OPTIONAL_BOOLS:
            if getattr(self, name) is not None:
                check_bool(name, getattr(self, name))
        check_positive("beta", self.beta)
        check_nonnegative("tol", self.tol)
        check_nonnegative("optimizer_bytes_per_param", self.optimizer_bytes_per_param)
        if self.skew_cap is not None:
            check_nonnegative("skew_cap", self.skew_cap)
            if self.node_comp is False:
                raise PlanError(f"skew_cap={self.skew_cap!r} caps the node-level compute skew of node_comp: it "
                                "needs node_comp=True (or leave node_comp unset)")
        if self.keep_cell_sizes and self.token_cap is not None:
            raise PlanError(f"token_cap={self.token_cap!r} lets micro-batches change their sample counts; "
                            "keep_cell_sizes=True keeps every (micro-batch, GPU) cell's count: drop one of them")
        if self.move_horizon != 1 and not self.migration:
            raise PlanError(f"move_horizon={self.move_horizon!r} credits expert moves with their later savings; "
                            "migration=False (--migration free) plans them free: drop one of them")
        if self.move_horizon != 1 and not self.step_objective:
            raise PlanError(f"move_horizon={self.move_horizon!r} credits expert moves against the step they are "
                            "charged to; step_objective=False ranks plans by the sum of T_MoE, which charges no "
                            "move: drop one of them")
        if self.previous_loads is not None:
            if self.move_horizon == 1:
                raise PlanError(f"previous_loads (shape {np.shape(self.previous_loads)}) only informs "
                                "move_horizon > 1; with move_horizon=1 a move pays for itself on its own step")
            pl = np.asarray(self.previous_loads)
            if pl.ndim != 4 or pl.size == 0 or pl.dtype.kind not in "iuf":
                raise PlanError(f"previous_loads must be [M, L, G, E] token counts (numbers), got shape {pl.shape} "
                                f"of dtype {pl.dtype}")
            check_token_counts("previous_loads", pl)
        if self.token_cap is not None and not self.repack:
            raise PlanError(f"token_cap={self.token_cap!r} only applies with repack=True (--repack)")
        object.__setattr__(self, "replicate", ReplicateOptions.of(self.replicate))
        if self.history is not None:
            h = np.asarray(self.history)
            if h.ndim not in (2, 3) or h.size == 0 or h.dtype.kind not in "iuf":
                raise PlanError(f"history must be [L, E] or [W, L, E] expert loads (numbers, W >= 1), got shape "
                                f"{h.shape} of dtype {h.dtype}")
            check_token_counts("history", h)
        check_choice("sample_owner", self.sample_owner, SAMPLE_OWNERS)
        if self.sample_owner == "trainer" and self.repack:
            raise PlanError("repack=True lets the planner move samples between micro-batches; with "
                            "sample_owner='trainer' the trainer's assignment is kept as given: drop one of them")
        if self.sample_gpu is not None:
            if self.sample_owner != "trainer":
                raise PlanError(f"sample_gpu= (the trainer's rank of each sample, shape {np.shape(self.sample_gpu)}) "
                                f"only applies with sample_owner='trainer', not {self.sample_owner!r}")
            sg = np.asarray(self.sample_gpu)
            if sg.ndim != 1 or (sg.size and sg.dtype.kind not in "iu"):
                raise PlanError(f"sample_gpu must be an int [N] array of ranks, got shape {sg.shape} of dtype "
                                f"{sg.dtype}")
        if self.sample_placement is not None:
            check_choice("sample_placement", self.sample_placement, SAMPLE_PLACEMENTS)
            if self.sample_gpu is not None:
                raise PlanError(f"sample_placement={self.sample_placement!r} computes the trainer's ranks, sample_gpu= "
                                "gives them: drop one of them")
        if self.previous is not None and not isinstance(self.previous, (Placement, np.ndarray, list, tuple)):
            raise PlanError(f"previous must be a Placement or an int [L, E] array (or None), got "
                            f"{type(self.previous).__name__}")

    # ------------------------------------------------------------------ construction
    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every option name, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, **options: Any) -> PlanOptions:
        """``PlanOptions(**options)``, but an unknown name is a PlanError that lists the known ones."""
        unknown = sorted(set(options) - set(cls.names()))
        if unknown:
            raise PlanError(f"unknown plan option {unknown[0]}={options[unknown[0]]!r}; known: {sorted(cls.names())}")
        return cls(**options)

    def replace(self, **changes: Any) -> PlanOptions:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ derived values
    @property
    def comp_weight(self) -> float:
        """Compute weight of relibra*'s reorder and locality objectives (``step_objective``) without overlap;
        ``PlanContext.comp_weight`` derives it from the cluster's overlap rule."""
        return STEP_COMP_WEIGHT if self.step_objective else 1.0

    @property
    def rank_balance(self) -> tuple[bool, float | None]:
        """``(node_comp, skew_cap)`` of the reorder: node_comp defaults to "on exactly when skew_cap is set"."""
        node_comp = self.skew_cap is not None if self.node_comp is None else bool(self.node_comp)
        return node_comp, None if self.skew_cap is None else float(self.skew_cap)

    def placement_for(self, strategy: str) -> str:
        """The sample placement a plan of ``strategy`` starts from (option ``sample_placement``; None: relibra*
        planning the samples start from "length-balanced", what a verl user's trainer already does; every other
        strategy, and the trainer's own default, is "round-robin")."""
        if self.sample_placement is not None:
            return self.sample_placement
        if strategy in RELIBRA_STRATEGIES and self.sample_owner == "planner":
            return "length-balanced"
        return "round-robin"

    def final_iters_for(self, iters: int) -> int:
        """Proposals of the ``final_reorder`` pass for a round's ``iters``."""
        return int(self.final_iters or FINAL_ITERS_FACTOR * iters)

    def check_for(self, strategy: str) -> None:
        """Raise PlanError for an option that does not apply to ``strategy``."""
        for name in ("skew_cap", "node_comp"):
            if getattr(self, name) is not None and strategy not in RELIBRA_STRATEGIES:
                raise PlanError(f"{name}={getattr(self, name)!r} only applies to {' and '.join(RELIBRA_STRATEGIES)}, "
                                f"not strategy {strategy!r}")
        if self.move_horizon != 1 and strategy not in RELIBRA_STRATEGIES:
            raise PlanError(f"move_horizon={self.move_horizon!r} only applies to {' and '.join(RELIBRA_STRATEGIES)} "
                            f"(they price their moves), not strategy {strategy!r}")
        if self.history is not None and strategy not in HISTORY_STRATEGIES:
            raise PlanError(f"history= (past loads of shape {np.shape(self.history)}) only applies to strategy "
                            f"{' and '.join(map(repr, HISTORY_STRATEGIES))}, not {strategy!r}")

    def strategy_options(self) -> dict[str, Any]:
        """The strategy options that differ from their defaults (``stats.options`` of a plan): JSON-ready,
        ``previous`` recorded as the SHA-1 of its int64 ``[L, E]`` homes, ``history`` and ``previous_loads`` as the
        SHA-1 of their float64 loads and their shape."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in ("replica_slots", "seed", "workers", "repack", "cell_chunk", "replicate"):
                continue
            v = getattr(self, f.name)
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            if v is None and default is None or (v is not None and default is not None and v == default
                                                   and type(v) is type(default)):
                continue
            if f.name == "previous":
                homes = np.asarray(getattr(v, "expert_gpu", v), dtype=np.int64)
                v = "sha1:" + hashlib.sha1(np.ascontiguousarray(homes).data).hexdigest()
            elif f.name == "sample_gpu":
                sg = np.ascontiguousarray(v, dtype=np.int64)
                v = f"sha1:{hashlib.sha1(sg.data).hexdigest()} shape {list(sg.shape)}"
            elif f.name in ("history", "previous_loads"):
                h = np.ascontiguousarray(v, dtype=np.float64)
                v = f"sha1:{hashlib.sha1(h.data).hexdigest()} shape {list(h.shape)}"
            out[f.name] = v
        return dict(sorted(out.items()))
