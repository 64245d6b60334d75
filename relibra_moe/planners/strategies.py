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
registered in ``STRATEGIES`` like the others.

Every strategy takes ``(ctx: PlanContext) -> BatchPlan``; its options are ``ctx.options``, one
``options.PlanOptions``, and its tasks run on ``ctx.executor`` (``executor.TaskExecutor``): ``plan_batch``
runs them inline or on a process pool, the ``Planner`` service on its own executor (deadlines, Ray), with
the same loop. ``repack=True`` lets the non-ReLibra
strategies repack samples too (routing-aware packing alone, experts as the strategy placed them), so
the effect of packing can be measured on its own.

Pricing what the plan moves (options, defaults on): ``migration`` (``migrate``: relabel GPUs by the fabric's
symmetries towards the ``previous`` placement, default static, and keep a layer's previous homes where the
new ones do not pay for their move in step time) and ``price_replicas`` (``replica_pricing``: a cell's
replicas must pay for their push / pull not hidden behind their window, ``timing.replica_push_overlap``).
The sum of T_MoE alone charges neither; ``migration=False, price_replicas=False, portfolio=False,
step_objective=False`` plan for it (bench/planners.py's cost-model rows). relibra ends with the portfolio
(``portfolio``: docs/method.md, "The portfolio").

``stats`` hold strategy, seed, objective values and
fallbacks; wall-clock values go under ``stats["timing"]`` / ``stats["solve_seconds"]``, which
``BatchPlan.save`` leaves out of the file unless asked, so same inputs and seed give the same bytes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import PlanError
from ..evaluate import batch_sha1, check_batch_type, placement_loads
from ..plan import BatchPlan, Placement, ReplicaPlan, SamplePlacement, check_replica_slots, round_robin_gpus
from ..sample_placements import SAMPLE_PLACEMENTS, place_samples
from ..sim import reorder_traffic, simulate_loads
from ..specs import ClusterSpec, ModelSpec
from ..timing import attention_backward, attention_forward, layer_step_seconds, moe_forward_seconds, moe_step_seconds
from ..trace import TraceBatch
from . import baselines
from .context import (
    PlanContext,
    baseline_samples,
    eplb_task,
    fallback_homes,
    make_plan,
    previous_expert_gpu,
    start_samples,
)
from .executor import TaskExecutor, TaskFailed, default_executor
from .history import strategy_eplb_history
from .locality import anneal_locality
from .lplb import lplb_replicas
from .migration import keep_previous_layers, relabel_to_previous, step_moe_seconds
from .online import strategy_online
from .options import RELIBRA_STRATEGIES, REPLICA_STRATEGIES, PlanOptions
from .params import LocalityParams
from .reorder import lpt_placement, reorder
from .replicate import replicate_batch
from .split import lower_bound_terms

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
    The layout is one executor task: past the deadline the plan keeps ``fallback_homes`` without replicas."""
    x = ctx.loads(ctx.micro_batch, ctx.sample_gpu)
    res = eplb_task(ctx, x.sum(axis=(0, 2)), "eplb")
    if res is None:
        eg = fallback_homes(ctx)
        return make_plan(ctx, eg, *baseline_samples(ctx, eg))
    eg, slots = res
    mb, sg = baseline_samples(ctx, eg)
    replicas = None
    if ctx.replica_slots > 0:
        xx = ctx.loads(mb, sg)
        replicas = baselines.even_split_replicas(eg, slots, xx)
        ctx.stats["eplb_replicas_dropped"] = int(ctx.replica_slots * ctx.cluster.num_gpus * ctx.model.num_layers
                                                 - (slots >= 0).sum())
    return make_plan(ctx, eg, mb, sg, replicas)


def strategy_balanced(ctx: PlanContext) -> BatchPlan:
    """The bound: a static plan that ``score_plan`` and ``simulate_step`` evaluate as the lower bound of every plan
    with ``replica_slots`` slots (``evaluate.bound_terms``, ``sim.bound_step``)."""
    eg = baselines.static_placement(ctx.model.num_layers, ctx.model.num_experts, ctx.cluster.num_gpus)
    return make_plan(ctx, eg, ctx.micro_batch, ctx.sample_gpu)


def locality_task(counts: np.ndarray, lengths: np.ndarray, micro_batch: np.ndarray, sample_gpu: np.ndarray,
                  expert_gpu: np.ndarray, model: ModelSpec, cluster: ClusterSpec, num_micro_batches: int, seed: int,
                  params: LocalityParams) -> tuple[np.ndarray, np.ndarray, dict]:
    """One locality task for an executor (picklable arguments): ``anneal_locality`` with ``params``."""
    return anneal_locality(counts, lengths, micro_batch, sample_gpu, expert_gpu, model, cluster, params,
                           num_micro_batches=num_micro_batches, seed=seed)


def locality_args(ctx: PlanContext, micro_batch: np.ndarray, sample_gpu: np.ndarray, expert_gpu: np.ndarray,
                  seed: int) -> tuple:
    """The ``locality_task`` arguments of one pass of the planning loop: the call's samples from ``micro_batch`` /
    ``sample_gpu [N]`` for homes ``expert_gpu [L, E]``, with ``ctx.locality_params``."""
    return (ctx.counts, ctx.lengths, micro_batch, sample_gpu, expert_gpu, ctx.model, ctx.cluster,
            ctx.num_micro_batches, seed, ctx.locality_params)


def relibra_inter(ctx: PlanContext, replicated: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """relibra-inter's plan: ``anneal_inter`` (reorder + locality rounds) then ``finish_inter`` (migration
    pricing, with ``node_comp`` or ``replicated``, and locality for the final homes). Returns (homes [L, E],
    micro_batch [N], gpu [N]), int64."""
    eg, mb, sg = anneal_inter(ctx)
    return finish_inter(ctx, eg, mb, sg, ctx.options.rank_balance[0] or replicated, ctx.stats)


def anneal_inter(ctx: PlanContext) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reorder + locality (+ repacking), ``rounds`` times: returns (homes [L, E], micro_batch [N], gpu [N]).

    The one planning loop: ``plan_batch`` and the ``Planner`` service both run it, on ``ctx.executor``.
    Each round re-anneals the experts for the sample placement of the previous round (``reorder``: layer x
    seed tasks), then the samples for the new homes (one locality task), with the parameters derived once from the
    options (``ctx.reorder_params``, ``ctx.locality_params``: ``params.reorder_params`` / ``locality_params``,
    whose default budgets are split over the rounds; why: BENCHMARKS.md, "Planner defaults").

    Rank-balance mode (options ``skew_cap`` / ``node_comp``, ``PlanOptions.rank_balance``; off by default):
    the reorder anneals the replication-aware cost (compute term = the busiest node's mean GPU load, with a
    soft cap ``skew_cap`` on that node-level skew; ``reorder.batch_cost``) from node-balanced starts:
    intra-node replicas level each node, so the node balance of the homes is what bounds relibra's rank skew.
    It buys rank balance with communication on multi-node clusters (BENCHMARKS.md, "Planner defaults").
    Option ``final_reorder`` re-anneals the homes once more after the last
    locality pass (useful with ``repack``), with ``final_iters`` proposals.

    ``finish_inter``'s ``node_comp`` (``replicated`` in ``relibra_inter``: replicas follow, relibra with r > 0):
    the migration pricing judges each layer's move by the replication-aware step estimate (compute levelled
    inside each node), whatever the reorder's objective: without it, a move looks worth its traffic for compute
    imbalance that the replicas would remove anyway (BENCHMARKS.md, "Planner defaults").

    Fallbacks (a task the executor reports as ``TaskFailed``): a reorder layer keeps ``ctx.fallback_expert_gpu``
    (else its start), a locality pass keeps the samples where they are; both go to ``ctx.fallbacks``. Past
    the executor's deadline the final reorder and the migration pricing are skipped.
    """
    o = ctx.options
    mb, sg = ctx.micro_batch, ctx.sample_gpu
    eg = None
    objectives: list[dict[str, Any]] = []
    timing = ctx.stats.setdefault("timing", {})
    params = ctx.reorder_params
    reorder_kw = dict(num_seeds=o.num_seeds, executor=ctx.executor, fallback=ctx.fallback_expert_gpu,
                      fallbacks=ctx.fallbacks)
    for rnd in range(o.rounds):
        t0 = time.perf_counter()
        eg, rinfo = reorder(ctx.loads(mb, sg), ctx.model, ctx.cluster, params, seed=ctx.seed + rnd, init=eg,
                            **reorder_kw)
        t1 = time.perf_counter()
        if ctx.trainer_owned:  # the trainer's samples stay where it put them: reorder rounds only
            timing[f"reorder_s_{rnd}"] = t1 - t0
            objectives.append({"reorder": rinfo, "locality": {"skipped": "sample_owner=trainer"}})
            continue
        (res,) = ctx.executor.map(locality_task, [locality_args(ctx, mb, sg, eg, ctx.seed + rnd)], [("locality", rnd)])
        if isinstance(res, TaskFailed):
            ctx.fallbacks.locality += 1
            linfo: dict[str, Any] = {"fallback": res.reason}
        else:
            mb, sg, linfo = res
            ctx.stats["objective"] = linfo["objective"]
        timing[f"reorder_s_{rnd}"] = t1 - t0
        timing[f"locality_s_{rnd}"] = time.perf_counter() - t1
        objectives.append({"reorder": rinfo, "locality": linfo})
    if o.final_reorder and not ctx.executor.expired:
        t0 = time.perf_counter()
        final = dataclasses.replace(params, iters=o.final_iters_for(params.iters))
        eg, ctx.stats["final_reorder"] = reorder(ctx.loads(mb, sg), ctx.model, ctx.cluster, final,
                                                 seed=ctx.seed + o.rounds, init=eg, **reorder_kw)
        timing["reorder_s_final"] = time.perf_counter() - t0
    ctx.stats["rounds"] = objectives
    return eg, np.asarray(mb, dtype=np.int64), np.asarray(sg, dtype=np.int64)


def finish_inter(ctx: PlanContext, expert_gpu: np.ndarray, micro_batch: np.ndarray, sample_gpu: np.ndarray,
                 node_comp: bool, stats: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The end of relibra-inter for annealed homes ``[L, E]`` and samples ``[N]``: ``migrate``, then, where the
    migration pricing put some layers back on their previous homes, the sample placement re-annealed for the
    homes actually used (``relocate``). Writes ``stats["migration"]`` (and ``stats["relocate"]``); returns
    (homes [L, E], micro_batch [N], gpu [N]), int64."""
    o = ctx.options
    timing = ctx.stats.setdefault("timing", {})
    t0 = time.perf_counter()
    mo = o.replace(migration=False) if ctx.executor.expired else o  # past the deadline: the fallbacks stand
    eg, sg, info = migrate(expert_gpu, micro_batch, sample_gpu, ctx.batch, ctx.num_micro_batches, ctx.model,
                           ctx.cluster, mo, node_comp, samples_fixed=ctx.trainer_owned)
    stats["migration"] = info
    timing["migration_s"] = timing.get("migration_s", 0.0) + time.perf_counter() - t0
    mb = np.asarray(micro_batch, dtype=np.int64)
    if info.get("enabled") and not ctx.executor.expired and not ctx.trainer_owned:
        perm = np.asarray(info["relabel"], dtype=np.int64)
        if (eg != perm[np.asarray(expert_gpu, dtype=np.int64)]).any():
            t0 = time.perf_counter()
            mb, sg, stats["relocate"] = relocate(ctx, eg, mb, sg)
            timing["relocate_s"] = timing.get("relocate_s", 0.0) + time.perf_counter() - t0
    return eg, np.asarray(mb, dtype=np.int64), np.asarray(sg, dtype=np.int64)


def relocate(ctx: PlanContext, expert_gpu: np.ndarray, micro_batch: np.ndarray, sample_gpu: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Sample locality for the final homes ``expert_gpu [L, E]``: one locality pass from the given samples (the
    annealed ones, permuted with the homes by the migration's relabelling) and one from the call's start
    (``ctx.micro_batch`` / ``ctx.sample_gpu``: its ``sample_placement``);
    the lower exact objective wins (ties: the given samples). Returns (micro_batch [N], gpu [N], info)."""
    starts = [("annealed", micro_batch, sample_gpu), ("start", ctx.micro_batch, ctx.sample_gpu)]
    args = [locality_args(ctx, m, g, expert_gpu, ctx.seed + ctx.options.rounds + 1) for _, m, g in starts]
    res = ctx.executor.map(locality_task, args, [("locality", ("relocate", n)) for n, _, _ in starts])
    best: tuple[np.ndarray, np.ndarray] = (micro_batch, sample_gpu)
    best_obj, chosen = np.inf, "annealed"
    info: dict[str, Any] = {}
    for (name, _, _), r in zip(starts, res):
        if isinstance(r, TaskFailed):
            ctx.fallbacks.locality += 1
            info[name] = {"fallback": r.reason}
            continue
        rm, rg, li = r
        info[name] = li["objective"]
        if li["objective"] < best_obj:
            best, best_obj, chosen = (rm, rg), li["objective"], name
    info["chosen"] = chosen
    return best[0], best[1], info


def migrate(expert_gpu: np.ndarray, micro_batch: np.ndarray, sample_gpu: np.ndarray, batch: TraceBatch,
            num_micro_batches: int, model: ModelSpec, cluster: ClusterSpec, options: PlanOptions, node_comp: bool,
            samples_fixed: bool = False) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Migration-aware finish of relibra-inter (``planners.migration``): relabel GPUs by the fabric's
    symmetries to keep the most experts at their previous homes (cost unchanged), then keep a layer's
    previous homes where the new ones do not pay for their move. Option ``migration=False`` skips both.

    ``samples_fixed`` (the trainer owns the samples): the relabelling may not move samples, so it is no longer
    free. Both the identity and the relabelling of the experts alone go through ``keep_previous_layers``; the
    one with the lower ``sum_l step_moe_seconds + relayout_s`` (forward + backward MoE seconds of the kept
    homes plus the re-layout) wins, the identity on ties. ``sample_gpu`` is returned unchanged.

    Returns (expert_gpu [L, E], sample_gpu [N], info).
    """
    if not options.migration:
        return expert_gpu, sample_gpu, {"enabled": False}
    prev = previous_expert_gpu(options, model, cluster)
    perm = relabel_to_previous(expert_gpu, prev, cluster)
    obpp = float(options.optimizer_bytes_per_param)
    if samples_fixed:
        sg = np.asarray(sample_gpu, dtype=np.int64)
        x = placement_loads(batch, micro_batch, sg, num_micro_batches, cluster.num_gpus)
        best: tuple[float, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]] | None = None
        for p in (np.arange(cluster.num_gpus), perm):
            eg_p = p[expert_gpu]
            kept, inf = keep_previous_layers(x, eg_p, prev, model, cluster, node_comp=node_comp,
                                             optimizer_bytes_per_param=obpp)
            total = sum(step_moe_seconds(x[:, l], kept[l], model, cluster, node_comp) for l in range(x.shape[1]))
            total += inf["relayout_s"]
            if best is None or total < best[0] * (1 - 1e-12):
                best = (total, p, eg_p, kept, inf)
        _, perm, eg_p, eg, info = best
        moved_before = int((eg_p != prev).sum())
        info["samples_fixed"] = True
    else:
        eg, sg = perm[expert_gpu], perm[np.asarray(sample_gpu, dtype=np.int64)]
        x = placement_loads(batch, micro_batch, sg, num_micro_batches, cluster.num_gpus)
        moved_before = int((eg != prev).sum())
        eg, info = keep_previous_layers(x, eg, prev, model, cluster, node_comp=node_comp,
                                        optimizer_bytes_per_param=obpp)
    info.update({"enabled": True, "relabel": perm.tolist(), "moved_after_relabel": moved_before,
                 "moved": int((eg != prev).sum())})
    return eg, sg, info


def strategy_relibra_inter(ctx: PlanContext) -> BatchPlan:
    """Reorder + locality (+ repacking) with migration pricing (``relibra_inter``), no replicas."""
    return make_plan(ctx, *relibra_inter(ctx))


def strategy_relibra(ctx: PlanContext) -> BatchPlan:
    """relibra-inter's reorder and locality (its migration pricing aware that replicas follow), then Algorithm 2
    per micro-batch and layer on ``ctx.executor``, replicas priced for their exposed push / pull
    (``replica_pricing``), then the portfolio (``portfolio``, option ``portfolio``): the fastest of this plan and
    the cheap alternatives under the simulator's step, so relibra is never slower than static, online or (with
    ``history``) eplb-history on the same evaluation. ``skew_cap`` asks for rank-level balance instead."""
    eg0, mb0, sg0 = anneal_inter(ctx)
    node_comp = ctx.options.rank_balance[0]
    eg, mb, sg = finish_inter(ctx, eg0, mb0, sg0, node_comp or ctx.replica_slots > 0, ctx.stats)
    t0 = time.perf_counter()
    replicas = relibra_replicas(ctx, eg, mb, sg)
    ctx.stats.setdefault("timing", {})["replicate_s"] = time.perf_counter() - t0
    if not ctx.options.portfolio or ctx.executor.expired:
        return make_plan(ctx, eg, mb, sg, replicas)
    t0 = time.perf_counter()
    plan = portfolio(ctx, {"relibra": (eg, mb, sg, replicas)}, (eg0, mb0, sg0, node_comp))
    ctx.stats["timing"]["portfolio_s"] = time.perf_counter() - t0
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


Candidate = tuple[np.ndarray, np.ndarray, np.ndarray, ReplicaPlan | None]
"""A portfolio candidate: (homes [L, E], micro_batch [N], gpu [N], replicas or None)."""


def portfolio_placements(ctx: PlanContext) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The sample placements the portfolio's baseline candidates run on, by candidate-name suffix: the trainer's
    (``""``) when it owns the samples; else round-robin (``""``) and every other placement of
    ``sample_placements.SAMPLE_PLACEMENTS`` (``"@" + name``; with ``keep_cell_sizes`` only those whose (micro-batch,
    GPU) cells hold equal counts, besides the call's start). Each ``(micro_batch [N], gpu [N])``, int64."""
    if ctx.trainer_owned:
        return {"": (ctx.micro_batch, ctx.sample_gpu)}
    mb0 = ctx.batch.resolve_micro_batch()
    G = ctx.cluster.num_gpus
    out = {"": (mb0, round_robin_gpus(mb0, G))}
    for name in SAMPLE_PLACEMENTS[1:]:
        mb, sg = place_samples(name, ctx.lengths, mb0, G)
        cells = np.bincount(mb * G + sg, minlength=ctx.num_micro_batches * G)
        if ctx.options.keep_cell_sizes and cells.min() != cells.max() and name != ctx.options.placement_for("relibra"):
            continue  # a trainer with a fixed per-rank micro-batch size could not follow it (sample_order)
        out["@" + name] = (mb, sg)
    return out


def portfolio_score(step: Any, options: PlanOptions) -> float:
    """A portfolio candidate's figure under the caller's options (seconds; ``step`` a ``sim.StepTime``): the
    simulated step, less the re-layout with ``migration=False`` (moves free) and less the exposed replica traffic
    with ``price_replicas=False`` (replicas free); with ``step_objective=False`` the sum of the forward T_MoE, the
    objective the planner was asked for."""
    if not options.step_objective:
        return float(step.t_moe_s)
    score = float(step.step_s)
    if not options.migration:
        score -= float(step.reorder_s)
    if not options.price_replicas:
        score -= float(step.replica_exposed_s)
    return score


def portfolio(ctx: PlanContext, own: dict[str, Candidate],
              annealed: tuple[np.ndarray, np.ndarray, np.ndarray, bool]) -> BatchPlan:
    """The end of ``relibra``: the best of ``own`` and the cheap alternatives, each simulated the way
    ``relibra compare`` / ``relibra simulate`` charge a plan (``sim.simulate_loads`` on the plan's loads, as
    ``sim.simulate_step`` and ``steady.evaluate_plan`` run it, moves charged against
    ``previous``, replica traffic by the one fetch rule of ``timing.replica_push_overlap``; the replicas of every
    candidate are fetched as relibra's, known from the replay) and scored under the caller's options
    (``portfolio_score``: moves and replicas free when the options say so).

    Candidates, in order: ``own`` (relibra's plan); ``relibra-inter`` (the annealed homes finished without the
    replication-aware migration pricing, no replicas); then, on every placement of ``portfolio_placements``
    (round-robin, verl's length-balanced, longest-first; the trainer's only when it owns the samples; the name
    suffix says which), the baselines' plans on the same batch and options: eplb-history (with option
    ``history``), static; then ``previous`` (the previous homes, relibra's priced replicas) and online (with
    replica slots and a previous placement other than static, where "previous" already dominates it), each built
    only when its lower bound (``replicated_step_lower_bound``) is below the best score so far (else
    ``stats["portfolio"]["pruned"]`` holds the bound). eplb and lplb are left out: never near relibra on the
    never-lose grid (BENCHMARKS.md, "Never lose"), lplb's LP ~10x relibra's whole plan at paper scale. The replay
    shows relibra the routing these baselines see, so each is a plan relibra may choose; their replicas are
    charged as relibra's (per layer), never more than the baseline's own after-router fetch. ``annealed`` is
    ``anneal_inter``'s (homes, micro_batch, gpu) and the option ``node_comp``.

    The chosen candidate (``least_moving_best``): the lowest score; among those within ``1e-9`` of it, the one that
    moves the fewest experts, then samples: a move must buy step time (on one node, where locality saves no RDMA
    traffic, a plan that only reshuffles does not win).
    Writes ``stats["portfolio"]``: ``chosen``, every simulated candidate's ``step_s`` (its score) and ``pruned``.
    Wall seconds per candidate go to ``stats["timing"]``.
    """
    L, G, M, o = ctx.model.num_layers, ctx.cluster.num_gpus, ctx.num_micro_batches, ctx.options
    prev, places = previous_expert_gpu(o, ctx.model, ctx.cluster), portfolio_placements(ctx)
    cands: dict[str, Candidate] = dict(own)
    timing = ctx.stats.setdefault("timing", {})

    def timed(name: str, make: Callable[[], Candidate]) -> None:
        t0 = time.perf_counter()
        cands[name] = make()
        timing[f"portfolio_{name}_s"] = time.perf_counter() - t0

    def baseline(name: str, suffix: str) -> Candidate:
        mb, sg = places[suffix]
        bp = STRATEGIES[name](dataclasses.replace(ctx, stats={}, micro_batch=mb, sample_gpu=sg))
        return bp.placement.expert_gpu, bp.samples.micro_batch, bp.samples.gpu, bp.replicas

    timed("relibra-inter", lambda: (*finish_inter(ctx, *annealed, {}), None))
    static = baselines.static_placement(L, ctx.model.num_experts, G)
    for suffix in places:
        if o.history is not None:
            timed("eplb-history" + suffix, lambda s=suffix: baseline("eplb-history", s))
        timed("static" + suffix, lambda s=suffix: baseline("static", s))
    previous = Placement(prev)
    opb = float(o.optimizer_bytes_per_param)
    steps: dict[str, float] = {}
    modes: dict[str, str] = {}
    loads: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (micro_batch, gpu, x): each placement once

    def loads_of(mb: np.ndarray, sg: np.ndarray) -> np.ndarray:
        x = next((x for m, g, x in loads if np.array_equal(m, mb) and np.array_equal(g, sg)), None)
        if x is None:
            x = ctx.loads(mb, sg)
            loads.append((mb, sg, x))
        return x

    def simulate(name: str) -> None:
        t0 = time.perf_counter()
        eg, mb, sg, reps = cands[name]
        plan = BatchPlan(placement=Placement(eg), samples=SamplePlacement(mb, sg, M),
                         replicas=padded(reps, M, L, G, ctx.replica_slots), num_gpus=G,
                         gpus_per_node=ctx.cluster.gpus_per_node, stats={})
        st = simulate_loads(plan, ctx.lengths, loads_of(mb, sg), ctx.model, ctx.cluster, previous=previous,
                            optimizer_bytes_per_param=opb, validate=False)
        steps[name], modes[name] = portfolio_score(st, o), st.replica_mode
        timing["portfolio_simulate_s"] = timing.get("portfolio_simulate_s", 0.0) + time.perf_counter() - t0

    for name in list(cands):
        simulate(name)
    # Candidates with replicas on fixed homes cost a replication pass each; one whose lower bound already reaches
    # the best score cannot win and is not built ("pruned": its bound).
    pruned: dict[str, float] = {}
    for suffix, (mb, sg) in places.items():
        for base, homes in (("previous", prev), ("online", static)):
            name = base + suffix
            if base == "online" and (not ctx.replica_slots or (np.array_equal(prev, static) and not ctx.repack and (
                    "previous" + suffix in pruned or modes.get("previous" + suffix) == "per-layer"))):
                # without slots online is the static plan; with the static homes as previous, "previous" is
                # online's homes and samples with relibra's priced replicas: per cell the same greedy with 0 .. r
                # slots, chosen by a window never shorter than online's and charged per layer, so never slower
                continue
            bound = replicated_step_lower_bound(ctx, homes, mb, sg, loads_of(mb, sg), previous, opb)
            if bound >= min(steps.values()) and not (base == "online" and ctx.repack):  # repack: online's samples
                pruned[name] = bound
                continue
            timed(name, (lambda m=mb, g=sg: (prev, m, g, relibra_replicas(ctx, prev, m, g) if ctx.replica_slots
                                               else None))
                  if base == "previous" else (lambda s=suffix: baseline("online", s)))
            simulate(name)
    chosen = least_moving_best(ctx, cands, steps, prev)
    ctx.stats["portfolio"] = {"chosen": chosen, "step_s": steps, **({"pruned": pruned} if pruned else {})}
    eg, mb, sg, reps = cands[chosen]
    return make_plan(ctx, eg, mb, sg, padded(reps, M, L, G, ctx.replica_slots))


def least_moving_best(ctx: PlanContext, cands: dict[str, Candidate], scores: dict[str, float],
                      previous: np.ndarray) -> str:
    """The portfolio's choice among the scored candidates: the lowest score; among those within ``1e-9`` of it
    (relative), the one that moves the fewest experts off ``previous [L, E]``, then the fewest samples off the
    call's start (``ctx.micro_batch`` / ``ctx.sample_gpu``), then the earlier in ``scores``."""
    best = min(scores.values())
    close = [k for k in scores if scores[k] <= best + 1e-9 * abs(best)]
    order = list(scores)
    return min(close, key=lambda k: (int((cands[k][0] != previous).sum()),
                                     int(((cands[k][1] != ctx.micro_batch) | (cands[k][2] != ctx.sample_gpu)).sum()),
                                     order.index(k)))


def replicated_step_lower_bound(ctx: PlanContext, expert_gpu: np.ndarray, micro_batch: np.ndarray,
                                sample_gpu: np.ndarray, x: np.ndarray, previous: Placement,
                                optimizer_bytes_per_param: float) -> float:
    """A lower bound (seconds) on the portfolio score (``portfolio_score`` under ``ctx.options``) of any plan
    with homes ``expert_gpu [L, E]``, samples ``micro_batch`` / ``sample_gpu [N]`` (loads ``x [M, L, G, E]``) and
    any intra-node replicas: ``L sum_m (A_fwd + A_bwd)`` + ``sum_{m, l} (3 comp_lb + 2 comm_lb)``
    (``split.lower_bound_terms``; ``timing.moe_step_seconds``) + the re-layout from ``previous``
    (``sim.reorder_traffic``; 0 with ``migration=False``); replica traffic counts 0. Under the cluster's overlap
    the cells are ``timing.layer_step_seconds(A_fwd, comp_lb, comm_lb, overlap)`` instead, as the simulator
    charges them (the rule is non-decreasing in each term, so it stays a bound; the back-to-back sum is not one
    there). With ``step_objective=False`` the score is the sum of T_MoE: ``sum_{m, l} (comp_lb + comm_lb)``."""
    comp, comm = lower_bound_terms(x, np.asarray(expert_gpu)[None], ctx.model, ctx.cluster)
    if not ctx.options.step_objective:
        return float(np.sum(moe_forward_seconds(comp, comm)))
    a_fwd = attention_forward(ctx.lengths, micro_batch, sample_gpu, ctx.num_micro_batches, ctx.model, ctx.cluster)
    relayout = 0.0
    if ctx.options.migration:
        relayout = reorder_traffic(previous, Placement(expert_gpu), ctx.model, ctx.cluster,
                                   optimizer_bytes_per_param)[0]
    if ctx.cluster.overlap != "none":
        return float(layer_step_seconds(a_fwd[:, None], comp, comm, ctx.cluster.overlap).sum() + relayout)
    return float(ctx.model.num_layers * (a_fwd + attention_backward(a_fwd)).sum()
                 + moe_step_seconds(comp, comm).sum() + relayout)


def padded(replicas: ReplicaPlan | None, num_micro_batches: int, num_layers: int, num_gpus: int,
           replica_slots: int) -> ReplicaPlan:
    """``replicas`` with ``replica_slots`` slots per GPU (empty ones appended; None: no replicas), so that every
    portfolio candidate has the ``[M, L, G, r]`` shape of relibra's plans."""
    if replicas is None:
        return ReplicaPlan.empty(num_micro_batches, num_layers, num_gpus, replica_slots)
    rep = replicas.replica_expert
    if rep.shape[-1] >= replica_slots:
        return replicas
    pad = np.full(rep.shape[:-1] + (replica_slots - rep.shape[-1],), -1, np.int32)
    return dataclasses.replace(replicas, replica_expert=np.concatenate([rep, pad], axis=-1))


def strategy_lplb(ctx: PlanContext) -> BatchPlan:
    """LPLB+: EPLB+ homes (no redundant experts), at most one copy per expert on the intra-node ring, an
    exact LP split per micro-batch and layer; the splits run on ``ctx.executor`` (a failed chunk of cells
    gets no replicas and is counted in ``ctx.fallbacks``)."""
    x = ctx.loads(ctx.micro_batch, ctx.sample_gpu)
    eg, _ = baselines.eplb(x.sum(axis=(0, 2)), ctx.cluster.num_gpus, ctx.cluster.gpus_per_node, 0,
                           ctx.options.num_groups)
    mb, sg = baseline_samples(ctx, eg)
    placement = Placement(eg)
    samples = SamplePlacement(mb, sg, ctx.num_micro_batches)
    replicas = lplb_replicas(placement, samples, ctx.batch_for(mb), ctx.model, ctx.cluster,
                             replica_slots=ctx.replica_slots, executor=ctx.executor, fallbacks=ctx.fallbacks)
    return make_plan(ctx, eg, mb, sg, replicas)


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
                 fallback_expert_gpu: np.ndarray | None = None) -> PlanContext:
    """The ``PlanContext`` of one call: the batch (re-assigned to micro-batches of ``micro_batch_size`` when
    given), its per-sample counts, the samples' start (``context.start_samples``: the placement
    ``options.placement_for(strategy)``, or the trainer's ranks) and the first ``stats``."""
    check_replica_slots(options.replica_slots, model.num_experts, cluster.num_gpus)
    if micro_batch_size is not None:
        batch = batch.with_micro_batch_size(int(micro_batch_size))
    lengths = np.asarray(batch.lengths, dtype=np.int64)
    mb0 = batch.resolve_micro_batch()
    mb, sg = start_samples(options, strategy, lengths, mb0, cluster.num_gpus)
    ctx = PlanContext(batch=batch, model=model, cluster=cluster, counts=batch.sample_expert_counts(),
                      lengths=lengths, micro_batch=mb, num_micro_batches=int(mb0.max()) + 1, sample_gpu=sg,
                      options=options, executor=executor, fallback_expert_gpu=fallback_expert_gpu)
    ctx.stats.update({"strategy": strategy, "seed": options.seed, "replica_slots": options.replica_slots,
                      "repack": options.repack, "fallbacks": 0, "options": options.strategy_options()})
    if ctx.trainer_owned:  # absent in planner mode: its plans stay byte-identical to before the option existed
        ctx.stats["sample_owner"] = "trainer"
    if cluster.overlap != "none":  # the objective's weights follow it (PlanContext.comp_weight); absent: none
        ctx.stats["overlap"] = cluster.overlap
    placement = options.placement_for(strategy)
    if options.sample_gpu is None and placement != "round-robin":  # absent on round-robin: those plans stay
        ctx.stats["sample_placement"] = placement  # byte-identical too
    return ctx


def run_strategy(ctx: PlanContext, strategy: str) -> BatchPlan:
    """Run ``strategy`` on ``ctx``; the validated BatchPlan with ``fallbacks``, ``solve_seconds``, ``batch_sha1``."""
    t0 = time.perf_counter()
    plan = STRATEGIES[strategy](ctx)
    plan.stats["fallbacks"] = ctx.fallbacks.count
    plan.stats["solve_seconds"] = time.perf_counter() - t0
    plan.stats["batch_sha1"] = batch_sha1(ctx.batch)
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
                      executor: TaskExecutor | None = None) -> BatchPlan:
    """``plan_batch`` with a built ``PlanOptions`` (what the CLI calls); tasks on ``executor`` (default:
    inline, or a process pool of ``options.workers``)."""
    check_strategy(strategy)
    options.check_for(strategy)
    check_batch_fits(batch, model, cluster)
    ctx = make_context(batch, model, cluster, strategy, options,
                       executor if executor is not None else default_executor(options.workers), micro_batch_size)
    return run_strategy(ctx, strategy)
