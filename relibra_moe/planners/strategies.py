"""The planning strategies by name, and ``plan_batch``: a TraceBatch in, a validated BatchPlan out.

========================  ======================================================================
name                      plan
========================  ======================================================================
``static``                Megatron-LM: expert e on GPU e // (E/G), samples round-robin
``lpt``                   greedy LPT reorder on the batch's true loads (Algorithm 1's start)
``eplb``                  DeepSeek EPLB on the true loads (EPLB+), r redundant experts per GPU
``balanced``              the bound: scored / simulated as a proven lower bound of every plan (docs/method.md)
``relibra-inter``         reorder (LPT + annealing) + sample locality (+ repacking), migration-aware
``lplb``                  LPLB+: EPLB+ reorder, per-micro-batch LP split over <= 1 copy per expert
``relibra``               relibra-inter + intra-node replication and token split (Algorithm 2), replicas
                          priced for their exposed push / pull, then the fastest of a portfolio
                          (``portfolio``); ``skew_cap``: rank-balance mode
``eplb-history``          EPLB from past batches' loads (option ``history``), as engines run it (``history``)
``online``                static homes + per-micro-batch replicas from the live loads, fetched after the
                          router (``online``; no replay)
========================  ======================================================================

The strategies share ``context`` (``PlanContext``, ``make_plan``, ``baseline_samples``,
``previous_expert_gpu``); the ones in their own modules (``history``, ``online``) are imported here and
registered in ``STRATEGIES`` like the others. The jobs of relibra-inter and relibra live in modules named for
them: ``annealing`` (the reorder / locality rounds, ``relibra_inter``), ``migration`` (``migrate``), ``portfolio``
(the candidates, judged through ``evaluation.StepEvaluator``) and ``bounds`` (the portfolio's lower bounds);
this module registers the strategies and runs one (``run_strategy``, ``plan_batch``).

Every strategy takes ``(ctx: PlanContext) -> BatchPlan``; its options are ``ctx.options``, one
``options.PlanOptions``, and its tasks run on ``ctx.executor`` (``executor.TaskExecutor``): ``plan_batch``
runs them inline or on a process pool, the ``Planner`` service on its own executor (deadlines, Ray), with
the same loop. ``repack=True`` lets the non-ReLibra
strategies repack samples too (routing-aware packing alone, experts as the strategy placed them), so
the effect of packing can be measured on its own.

Pricing what the plan moves (options, defaults on): ``migration`` (``migration.migrate``: relabel GPUs by the fabric's
symmetries towards the ``previous`` placement, default static, and keep a layer's previous homes where the
new ones do not pay for their move in step time) and ``price_replicas`` (``replica_pricing``: a cell's
replicas must pay for their push / pull not hidden behind their window, ``timing.replica_push_overlap``).
The sum of T_MoE alone charges neither; ``migration=False, price_replicas=False, portfolio=False,
step_objective=False`` plan for it (bench/planners.py's cost-model rows). relibra ends with the portfolio
(``portfolio.portfolio``: docs/method.md, "The portfolio").

``stats`` (``plan_stats.PlanStats``) hold strategy, seed, objective values and
fallbacks; wall-clock values go under ``stats.timing`` / ``stats.solve_seconds``, which
``BatchPlan.save`` leaves out of the file unless asked, so same inputs and seed give the same bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import PlanError
from ..evaluate import batch_sha1, check_batch_type
from ..plan import BatchPlan, Placement, ReplicaPlan, SamplePlacement, check_replica_slots
from ..specs import ClusterSpec, ModelSpec
from ..timing import attention_forward
from ..trace import TraceBatch
from . import baselines
from .annealing import anneal_inter, finish_inter, relibra_inter
from .context import (
    PlanContext,
    baseline_samples,
    eplb_layout,
    eplb_parts,
    make_plan,
    previous_expert_gpu,
    start_samples,
)
from .evaluation import StepEvaluator
from .executor import TaskExecutor, default_executor
from .history import strategy_eplb_history
from .lplb import lplb_parts
from .online import strategy_online
from .options import RELIBRA_STRATEGIES, REPLICA_STRATEGIES, PlanOptions
from .portfolio import portfolio
from .reorder import lpt_placement
from .replicate import replicate_batch

__all__ = ["STRATEGIES", "COMPARED_STRATEGIES", "REPACK_COMPARED", "REPLICA_STRATEGIES", "RELIBRA_STRATEGIES",
           "PlanContext", "make_context", "run_strategy", "plan_batch", "plan_with_options", "relibra_inter",
           "check_strategy", "previous_expert_gpu"]


def strategy_static(ctx: PlanContext) -> BatchPlan:
    """Megatron-LM: expert e on GPU e // (E/G) in every layer; samples round-robin (or repacked)."""
    eg = baselines.static_placement(ctx.model.num_layers, ctx.model.num_experts, ctx.cluster.num_gpus)
    return make_plan(ctx, eg, *baseline_samples(ctx, eg))


def strategy_lpt(ctx: PlanContext) -> BatchPlan:
    """Greedy LPT per layer on the batch-aggregated loads ``x.sum(m, j)`` (Algorithm 1's start)."""
    x = ctx.loads(ctx.micro_batch, ctx.sample_gpu)
    eg = np.stack([lpt_placement(x[:, l].sum(axis=(0, 1)), ctx.cluster.num_gpus) for l in range(x.shape[1])])
    return make_plan(ctx, eg, *baseline_samples(ctx, eg))


def strategy_eplb(ctx: PlanContext) -> BatchPlan:
    """EPLB+ on the true per-layer loads; with r > 0, r redundant experts per GPU split evenly per copy.
    The layout is one executor task: past the deadline the plan keeps ``fallback_homes`` without replicas
    (``context.eplb_layout``, ``context.eplb_parts``)."""
    return make_plan(ctx, *eplb_parts(ctx, eplb_layout(ctx)))


def strategy_balanced(ctx: PlanContext) -> BatchPlan:
    """The bound: a static plan that ``score_plan`` and ``simulate_step`` evaluate as the lower bound of every plan
    with ``replica_slots`` slots (``evaluate.bound_terms``, ``sim.bound_step``)."""
    eg = baselines.static_placement(ctx.model.num_layers, ctx.model.num_experts, ctx.cluster.num_gpus)
    return make_plan(ctx, eg, ctx.micro_batch, ctx.sample_gpu)


def strategy_relibra_inter(ctx: PlanContext) -> BatchPlan:
    """Reorder + locality (+ repacking) with migration pricing (``relibra_inter``), no replicas."""
    return make_plan(ctx, *relibra_inter(ctx))


def strategy_relibra(ctx: PlanContext) -> BatchPlan:
    """relibra-inter's reorder and locality (its migration pricing aware that replicas follow), then Algorithm 2
    per micro-batch and layer on ``ctx.executor``, replicas priced for their exposed push / pull
    (``replica_pricing``), then the portfolio (``portfolio``, option ``portfolio``): the fastest of this plan and
    the cheap alternatives under the simulator's step, so relibra is never slower than static, online, EPLB+, LPLB+
    or (with ``history``) eplb-history on the same evaluation and sample placements. ``skew_cap`` asks for
    rank-level balance instead."""
    eg0, mb0, sg0 = anneal_inter(ctx)
    node_comp = ctx.options.rank_balance[0]
    eg, mb, sg = finish_inter(ctx, eg0, mb0, sg0, ctx.migration_node_comp, ctx.stats)
    t0 = time.perf_counter()
    replicas = relibra_replicas(ctx, eg, mb, sg)
    ctx.stats.timings()["replicate_s"] = time.perf_counter() - t0
    if not ctx.options.portfolio or ctx.executor.expired:
        return make_plan(ctx, eg, mb, sg, replicas)
    t0 = time.perf_counter()
    plan = portfolio(ctx, {"relibra": (eg, mb, sg, replicas)}, (eg0, mb0, sg0, node_comp), STRATEGIES,
                     relibra_replicas)
    ctx.stats.timings()["portfolio_s"] = time.perf_counter() - t0
    return plan


def relibra_replicas(ctx: PlanContext, expert_gpu: np.ndarray, micro_batch: np.ndarray, sample_gpu: np.ndarray
                     ) -> ReplicaPlan:
    """Algorithm 2 per micro-batch and layer for homes ``[L, E]`` and samples ``[N]``, on ``ctx.executor``, priced
    with ``replica_pricing`` (the one fetch window of ``timing.replica_push_overlap``)."""
    samples = SamplePlacement(micro_batch, sample_gpu, ctx.num_micro_batches)
    return replicate_batch(Placement(expert_gpu), samples, ctx.batch_for(micro_batch), ctx.model, ctx.cluster,
                           ctx.replica_slots,
                           attn_fwd=replica_pricing(ctx.options, ctx.lengths, samples, ctx.model, ctx.cluster),
                           executor=ctx.executor, cell_chunk=ctx.options.cell_chunk, fallbacks=ctx.fallbacks,
                           options=ctx.options.replicate)


def strategy_lplb(ctx: PlanContext) -> BatchPlan:
    """LPLB+: EPLB+ homes (no redundant experts), at most one copy per expert on the intra-node ring, an
    exact LP split per micro-batch and layer; the splits run on ``ctx.executor`` (a failed chunk of cells
    gets no replicas and is counted in ``ctx.fallbacks``; ``lplb.lplb_parts``)."""
    return make_plan(ctx, *lplb_parts(ctx))


def replica_pricing(options: PlanOptions, lengths: np.ndarray, samples: SamplePlacement, model: ModelSpec,
                    cluster: ClusterSpec) -> np.ndarray | None:
    """``[M]`` attention-forward seconds that the replica transfers overlap (``timing.attention_forward``), so
    that replication prices its exposed push / pull; None with option ``price_replicas=False``."""
    if not options.price_replicas:
        return None
    return attention_forward(lengths, samples.micro_batch, samples.gpu, samples.num_micro_batches, model, cluster)


STRATEGIES: dict[str, Callable[[PlanContext], BatchPlan]] = {
    "static": strategy_static,
    "lpt": strategy_lpt,
    "eplb": strategy_eplb,
    "balanced": strategy_balanced,
    "relibra-inter": strategy_relibra_inter,
    "lplb": strategy_lplb,
    "relibra": strategy_relibra,
    "eplb-history": strategy_eplb_history,
    "online": strategy_online,
}
"""The strategy registry: name -> ``(PlanContext) -> BatchPlan``; the CLI's choices come from it."""

COMPARED_STRATEGIES = ("static", "eplb", "lplb", "relibra-inter", "relibra", "balanced")
"""The strategies a comparison reports (``relibra demo``), in table order; ``lpt`` is Algorithm 1's start."""
REPACK_COMPARED = ("static", "relibra-inter", "relibra")
"""The strategies a comparison also runs with ``repack=True``."""


def check_strategy(strategy: object) -> str:
    """``strategy``, or PlanError naming it and the known names."""
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise PlanError(f"unknown strategy {strategy!r}; known: {sorted(STRATEGIES)}")
    return strategy


def check_batch_fits(batch: TraceBatch, model: ModelSpec, cluster: ClusterSpec) -> None:
    """PlanError unless ``batch`` is a TraceBatch of the model's L and E and E divides over the GPUs."""
    check_batch_type(batch)
    if batch.num_experts != model.num_experts or batch.num_layers != model.num_layers:
        raise PlanError(f"batch has L={batch.num_layers}, E={batch.num_experts}; model {model.name} has "
                        f"L={model.num_layers}, E={model.num_experts}")
    if model.num_experts % cluster.num_gpus:
        raise PlanError(f"num_experts={model.num_experts} is not divisible by num_gpus={cluster.num_gpus}")


def make_context(batch: TraceBatch, model: ModelSpec, cluster: ClusterSpec, strategy: str, options: PlanOptions,
                 executor: TaskExecutor, micro_batch_size: int | None = None,
                 fallback_expert_gpu: np.ndarray | None = None, evaluator: StepEvaluator | None = None
                 ) -> PlanContext:
    """The ``PlanContext`` of one call: the batch (re-assigned to micro-batches of ``micro_batch_size`` when
    given), its per-sample counts, the samples' start (``context.start_samples``: the placement
    ``options.placement_for(strategy)``, or the trainer's ranks), the first ``stats`` and the judge of the
    portfolio's candidates (``evaluator``; None: the step simulator)."""
    check_replica_slots(options.replica_slots, model.num_experts, cluster.num_gpus)
    if micro_batch_size is not None:
        batch = batch.with_micro_batch_size(int(micro_batch_size))
    lengths = np.asarray(batch.lengths, dtype=np.int64)
    mb0 = batch.resolve_micro_batch()
    mb, sg = start_samples(options, strategy, lengths, mb0, cluster.num_gpus)
    ctx = PlanContext(batch=batch, model=model, cluster=cluster, counts=batch.sample_expert_counts(),
                      lengths=lengths, micro_batch=mb, num_micro_batches=int(mb0.max()) + 1, sample_gpu=sg,
                      options=options, executor=executor, fallback_expert_gpu=fallback_expert_gpu)
    if evaluator is not None:
        ctx.evaluator = evaluator
    st = ctx.stats
    st.strategy, st.seed, st.replica_slots, st.repack = strategy, options.seed, options.replica_slots, options.repack
    st.fallbacks, st.options = 0, options.strategy_options()
    if ctx.trainer_owned:  # absent in planner mode: its plans stay byte-identical to before the option existed
        st.sample_owner = "trainer"
    if cluster.overlap != "none":  # the objective's weights follow it (PlanContext.comp_weight); absent: none
        st.overlap = cluster.overlap
    placement = options.placement_for(strategy)
    if options.sample_gpu is None and placement != "round-robin":  # absent on round-robin: those plans stay
        st.sample_placement = placement  # byte-identical too
    return ctx


def run_strategy(ctx: PlanContext, strategy: str) -> BatchPlan:
    """Run ``strategy`` on ``ctx``; the validated BatchPlan with ``fallbacks``, ``solve_seconds``, ``batch_sha1``."""
    t0 = time.perf_counter()
    plan = STRATEGIES[strategy](ctx)
    plan.stats.fallbacks = ctx.fallbacks.count
    plan.stats.solve_seconds = time.perf_counter() - t0
    plan.stats.batch_sha1 = batch_sha1(ctx.batch)
    plan.validate(ctx.model, ctx.cluster, num_samples=ctx.batch.num_sequences)
    return plan


def plan_batch(batch: TraceBatch, model: ModelSpec, cluster: ClusterSpec, strategy: str, *, replica_slots: int = 0,
               seed: int = 0, workers: int = 1, repack: bool = False, micro_batch_size: int | None = None,
               **options: Any) -> BatchPlan:
    """Plan one global batch with a named strategy.

    Args:
        batch: a TraceBatch (with a micro-batch assignment unless ``micro_batch_size`` is given).
        strategy: a key of ``STRATEGIES``.
        replica_slots: r replica slots per GPU (the strategies of ``REPLICA_STRATEGIES``).
        seed: plan seed (same inputs and seed -> same plan).
        workers: processes for the parallel parts.
        repack: let samples change micro-batch (equal sample counts per micro-batch unless
            ``token_cap`` is in options).
        micro_batch_size: re-assign micro-batches as sample i -> i // B first.
        options: the fields of ``PlanOptions`` (each with its default, unit and check there).

    Raises:
        PlanError: unknown strategy or option, a bad option value (``PlanOptions``), a batch for another
            model, or E not divisible by G (the message names the field and the value).

    Returns:
        A validated BatchPlan; ``stats`` has ``strategy``, ``seed``, ``replica_slots``, ``repack``,
        ``options`` (those not at their default), objective values, ``fallbacks`` and (kept out of saved
        files) ``solve_seconds`` and ``timing``.
    """
    check_strategy(strategy)
    opts = PlanOptions.from_kwargs(replica_slots=replica_slots, seed=seed, workers=workers, repack=repack, **options)
    return plan_with_options(batch, model, cluster, strategy, opts, micro_batch_size=micro_batch_size)


def plan_with_options(batch: TraceBatch, model: ModelSpec, cluster: ClusterSpec, strategy: str,
                      options: PlanOptions, *, micro_batch_size: int | None = None,
                      executor: TaskExecutor | None = None, evaluator: StepEvaluator | None = None) -> BatchPlan:
    """``plan_batch`` with a built ``PlanOptions`` (what the CLI calls); tasks on ``executor`` (default:
    inline, or a process pool of ``options.workers``); the portfolio's candidates judged by ``evaluator``
    (``evaluation.StepEvaluator``; default the step simulator)."""
    check_strategy(strategy)
    options.check_for(strategy)
    check_batch_fits(batch, model, cluster)
    ctx = make_context(batch, model, cluster, strategy, options,
                       executor if executor is not None else default_executor(options.workers), micro_batch_size,
                       evaluator=evaluator)
    return run_strategy(ctx, strategy)
