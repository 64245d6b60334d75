"""relibra-inter's annealing loop: reorder (experts) and locality (samples) rounds, then the migration pricing
and the locality pass for the homes actually kept (docs/method.md, "The planning loop").

``anneal_inter`` runs the rounds on ``ctx.executor``; ``finish_inter`` prices the moves (``migration.migrate``)
and, where layers went back to their previous homes, re-anneals the samples (``relocate``); ``relibra_inter``
is the two in a row. ``locality_task`` / ``locality_args`` are one locality pass as a picklable executor task.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from ..plan_stats import PlanStats, RelocateStats
from ..specs import ClusterSpec, ModelSpec
from .context import PlanContext
from .executor import TaskFailed
from .locality import anneal_locality
from .migration import migrate
from .params import LocalityParams
from .reorder import reorder

__all__ = ["locality_task", "locality_args", "relibra_inter", "anneal_inter", "finish_inter", "relocate"]


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
    return finish_inter(ctx, eg, mb, sg, ctx.options.rank_balance[0] or replicated, ctx.stats, credit=True)


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
    timing = ctx.stats.timings()
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
            ctx.stats.objective = linfo["objective"]
        timing[f"reorder_s_{rnd}"] = t1 - t0
        timing[f"locality_s_{rnd}"] = time.perf_counter() - t1
        objectives.append({"reorder": rinfo, "locality": linfo})
    if o.final_reorder and not ctx.executor.expired:
        t0 = time.perf_counter()
        final = dataclasses.replace(params, iters=o.final_iters_for(params.iters))
        eg, ctx.stats.final_reorder = reorder(ctx.loads(mb, sg), ctx.model, ctx.cluster, final,
                                              seed=ctx.seed + o.rounds, init=eg, **reorder_kw)
        timing["reorder_s_final"] = time.perf_counter() - t0
    ctx.stats.rounds = objectives
    return eg, np.asarray(mb, dtype=np.int64), np.asarray(sg, dtype=np.int64)


def finish_inter(ctx: PlanContext, expert_gpu: np.ndarray, micro_batch: np.ndarray, sample_gpu: np.ndarray,
                 node_comp: bool, stats: PlanStats, credit: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The end of relibra-inter for annealed homes ``[L, E]`` and samples ``[N]``: ``migrate`` (``credit``: with
    option ``move_horizon``'s credit), then, where the migration pricing put some layers back on their previous
    homes, the sample placement re-annealed for the homes actually used (``relocate``). Writes ``stats.migration``
    (and ``stats.relocate``); returns (homes [L, E], micro_batch [N], gpu [N]), int64."""
    o = ctx.options
    timing = ctx.stats.timings()
    t0 = time.perf_counter()
    mo = o.replace(migration=False) if ctx.executor.expired else o  # past the deadline: the fallbacks stand
    eg, sg, info = migrate(expert_gpu, micro_batch, sample_gpu, ctx.batch, ctx.num_micro_batches, ctx.model,
                           ctx.cluster, mo, node_comp, samples_fixed=ctx.trainer_owned, credit=credit)
    stats.migration = info
    timing["migration_s"] = timing.get("migration_s", 0.0) + time.perf_counter() - t0
    mb = np.asarray(micro_batch, dtype=np.int64)
    if info.enabled and not ctx.executor.expired and not ctx.trainer_owned:
        perm = np.asarray(info.relabel, dtype=np.int64)
        if (eg != perm[np.asarray(expert_gpu, dtype=np.int64)]).any():
            t0 = time.perf_counter()
            mb, sg, stats.relocate = relocate(ctx, eg, mb, sg)
            timing["relocate_s"] = timing.get("relocate_s", 0.0) + time.perf_counter() - t0
    return eg, np.asarray(mb, dtype=np.int64), np.asarray(sg, dtype=np.int64)


def relocate(ctx: PlanContext, expert_gpu: np.ndarray, micro_batch: np.ndarray, sample_gpu: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, RelocateStats]:
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
    return best[0], best[1], RelocateStats(chosen=chosen, **info)

