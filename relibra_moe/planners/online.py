"""``online``: per-micro-batch replication planned at run time from the live routing, without replay.

What MoonEP, Megatron's ECHO prototype and UltraEP do: experts keep their static homes (no reorder: without
routing replay nothing is known about the batch before it runs), samples run where the data loader puts them
(round-robin, no locality), and for every micro-batch and MoE layer, once that layer's router has produced
the top-k choice, hot experts are copied into spare slots of GPUs inside the home's node (NVLink domain) and
their tokens split between home and copies; the replica weight gradients are reduced home in the backward.

The model here (docs/baselines.md, "online"):

- rule: the same greedy replication + token split as relibra (Algorithm 2, ``replicate.replicate_cell_greedy``)
  on the cell's *true* loads, with r slots per GPU: the strongest rule this library has, so the baseline is
  not handicapped by a weaker heuristic (MoonEP's "exactly S x K tokens per rank" is a constraint on the same
  split; it cannot lower the compute maximum below the node's mean, which the greedy + split already
  approaches, and it ignores the communication term);
- timing: the replica weight fetch can start only after the router has run, so it overlaps the token
  dispatch of that layer (the slowest GPU's dispatch, half of ``max_g comm``) and not the attention; the
  gradient push home overlaps the attention backward like relibra's. The simulator charges this with
  ``replica_mode="after-router"`` (plan stat ``replica_fetch``; the formula is ``timing.cell_step_seconds`` with
  ``fetch="after-router"``), so ``online_step_seconds`` below and
  ``sim.simulate_loads`` agree;
- pricing: as relibra's cells, a replica set whose exposed fetch costs more than it saves is dropped: the
  greedy is run with 0 .. r slots and the set with the lowest forward + backward seconds wins;
- the planning time is not charged (the authors plan on the GPU in microseconds; our CPU solve seconds are
  reported apart).

Nothing is moved between batches, so the steady state has no reorder traffic.
"""

from __future__ import annotations

import time

import numpy as np

from ..plan import BatchPlan, Placement, ReplicaPlan, SamplePlacement
from ..specs import ClusterSpec, ModelSpec
from ..timing import attention_backward, attention_forward, cell_step_seconds, replica_push_overlap
from ..validate import check_int
from .baselines import static_placement
from .context import PlanContext, baseline_samples, make_plan
from .executor import FallbackLog, TaskExecutor, default_executor
from .replicate import CellResult, map_cells, slot_count_variants

REPLICA_FETCH = "after-router"
"""``BatchPlan.stats.replica_fetch`` of an online plan: the simulator's replica mode for it (and the
``timing.REPLICA_FETCHES`` value its cells are priced with)."""


def online_step_seconds(comp: float, comm: float, push: float, attn_fwd: float) -> float:
    """Forward + backward seconds of one cell of an online plan, as ``sim`` charges it (replica mode
    ``after-router``): ``timing.cell_step_seconds`` with the fetch after the router, i.e. ``3 comp + 2 comm``
    plus the replica fetch not hidden behind the dispatch (``comm / 2``) and the gradient push not hidden
    behind the attention backward (``2 attn_fwd``). Seconds in, seconds out."""
    return cell_step_seconds(comp, comm, push, attn_fwd, fetch=REPLICA_FETCH)


def online_cell(x: np.ndarray, expert_gpu: np.ndarray, model: ModelSpec, cluster: ClusterSpec,
                replica_slots: int, attn_fwd: float) -> CellResult:
    """One micro-batch and layer: the greedy + split with 0 .. ``replica_slots`` slots per GPU, the one with the
    lowest ``online_step_seconds`` (ties keep more replicas).

    Args:
        x: ``[G, E]`` true tokens per (source GPU, expert) of the cell; expert_gpu: ``[E]`` homes.
        attn_fwd: seconds of the micro-batch's attention forward per layer (``timing.attention_forward``).
    """
    x = np.ascontiguousarray(x, dtype=np.float64)
    eg = np.ascontiguousarray(expert_gpu, dtype=np.int64)
    best, best_t = None, np.inf
    for c, cand, comp, comm, push in slot_count_variants(x, eg, model, cluster, replica_slots,
                                                         range(replica_slots, -1, -1)):
        t = online_step_seconds(comp, comm, push, attn_fwd)
        if c == 0:
            cand = cand._replace(t_moe=comp + comm)
        if t < best_t * (1 - 1e-12):
            best, best_t = cand, t
        if (c == replica_slots and push <= replica_push_overlap(attn_fwd, comm, REPLICA_FETCH)
                and push <= attention_backward(attn_fwd)):
            break  # fully hidden: fewer replicas cannot be faster
    assert best is not None
    return best


def online_cells_task(loads: np.ndarray, expert_gpu: np.ndarray, model: ModelSpec, cluster: ClusterSpec,
                      replica_slots: int, attn: np.ndarray) -> list[CellResult]:
    """One executor task: ``online_cell`` on cells ``loads [C, G, E]`` with homes ``expert_gpu [C, E]`` and
    ``attn [C]`` seconds."""
    return [online_cell(loads[i], expert_gpu[i], model, cluster, replica_slots, float(attn[i]))
            for i in range(len(loads))]


def online_replicas(placement: Placement, samples: SamplePlacement, x: np.ndarray, model: ModelSpec,
                    cluster: ClusterSpec, replica_slots: int, attn_fwd: np.ndarray, workers: int = 1, *,
                    executor: TaskExecutor | None = None, fallbacks: FallbackLog | None = None) -> ReplicaPlan:
    """``online_cell`` for every micro-batch and layer: a ReplicaPlan (scope "node").

    Args:
        x: ``[M, L, G, E]`` true loads under ``samples``; attn_fwd: ``[M]`` seconds (``timing.attention_forward``).
        workers: processes over the cells when no ``executor`` is given (1: in this process).
        executor: runs chunks of cells (``executor.TaskExecutor``, as the replication pass of relibra); a chunk
            that does not finish leaves its cells without replicas, recorded in ``fallbacks``.
    """
    M, L, G, _ = x.shape
    check_int("replica_slots", replica_slots, 0)
    if executor is None:
        executor = default_executor(check_int("workers", workers, 1))
    cells = [(m, l) for m in range(M) for l in range(L)]
    homes = placement.expert_gpu
    n_chunks = 1 if executor.workers == 1 else min(len(cells), 4 * executor.workers)
    return map_cells(executor, online_cells_task, cells, np.array_split(np.arange(len(cells)), max(1, n_chunks)),
                     lambda ms, ls: (x[ms, ls], homes[ls], model, cluster, replica_slots, np.asarray(attn_fwd)[ms]),
                     fallbacks, M, L, G, replica_slots)


def strategy_online(ctx: PlanContext) -> BatchPlan:
    """Static homes, round-robin samples (or repacked with ``repack``), per-cell replicas from the true loads
    with the fetch after the router (module docstring); the cells run on ``ctx.executor``."""
    eg = static_placement(ctx.model.num_layers, ctx.model.num_experts, ctx.cluster.num_gpus)
    mb, sg = baseline_samples(ctx, eg)
    ctx.stats.replica_fetch = REPLICA_FETCH
    if ctx.replica_slots == 0:
        return make_plan(ctx, eg, mb, sg)
    t0 = time.perf_counter()
    samples = SamplePlacement(mb, sg, ctx.num_micro_batches)
    attn = attention_forward(ctx.lengths, mb, sg, ctx.num_micro_batches, ctx.model, ctx.cluster)
    x = np.asarray(ctx.loads(mb, sg), dtype=np.float64)
    replicas = online_replicas(Placement(eg), samples, x, ctx.model, ctx.cluster, ctx.replica_slots, attn,
                               executor=ctx.executor, fallbacks=ctx.fallbacks)
    ctx.stats.timings()["online_replicate_s"] = time.perf_counter() - t0
    return make_plan(ctx, eg, mb, sg, replicas)
