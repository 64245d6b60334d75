"""LPLB+ baseline (the ReLibra paper's baselines): a fixed intra-node replica topology, copies chosen from the batch's
loads, and a per-micro-batch LP token split.

DeepSeek's LPLB keeps at most one redundant copy per expert on a fixed topology and redistributes
tokens per batch with an LP. The paper's LPLB+ gives it the true loads of the batch. Here:

- topology: a ring inside each node, GPU g's ``r`` replica slots mirror experts of its predecessor
  ``p(g) = node * P + (g - 1) mod P`` (so every expert has at most one copy, always in its home's node);
- copies: per layer, the ``r`` experts of ``p(g)`` with the most tokens in the whole batch (the same
  copies for every micro-batch: the topology and its contents are fixed for the batch);
- split: per micro-batch and layer, the exact LP with the replicas fixed (``split.solve_split_lp``),
  or the water-filling heuristic (``split="fast"``) when the cells are too many for an LP each.

The splits are "replicate" tasks (chunks of cells) on the planning executor (``executor.TaskExecutor``), so
``Planner(strategy="lplb")`` gets its deadline and per-task fallback: a failed chunk's cells get no replicas.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..errors import PlanError
from ..plan import Placement, ReplicaPlan, SamplePlacement
from ..specs import ClusterSpec, ModelSpec
from ..validate import check_index_range, check_int
from . import baselines
from .context import PlanContext, baseline_samples
from .executor import FallbackLog, TaskExecutor, default_executor
from .replicate import CellResult, map_cells
from .split import fast_split, solve_split_lp

if TYPE_CHECKING:
    from ..trace import TraceBatch

__all__ = ["lplb_copies", "lplb_batch_copies", "lplb_replicas", "lplb_cells_task", "lplb_homes", "lplb_parts"]


def lplb_copies(expert_gpu: np.ndarray, expert_load: np.ndarray, num_gpus: int, gpus_per_node: int,
                replica_slots: int) -> np.ndarray:
    """int32 ``[G, r]`` the ring topology's copies for one layer.

    Args:
        expert_gpu: ``[E]`` homes; expert_load: ``[E]`` tokens of each expert in the batch.
        num_gpus: G; gpus_per_node: P (with P = 1 there is nowhere to copy: every slot stays empty).
        replica_slots: r copies per GPU (fewer when the predecessor homes fewer experts).
    """
    expert_gpu = np.asarray(expert_gpu, dtype=np.int64)
    expert_load = np.asarray(expert_load, dtype=np.float64)
    if expert_load.shape != expert_gpu.shape:
        raise PlanError(f"expert_load has shape {expert_load.shape}, expected {expert_gpu.shape}")
    check_int("replica_slots", replica_slots, 0)
    G = int(num_gpus)
    if G % gpus_per_node:
        raise PlanError(f"num_gpus={G} is not a multiple of gpus_per_node={gpus_per_node}")
    check_index_range("expert_gpu", expert_gpu, 0, G)
    out = np.full((G, replica_slots), -1, np.int32)
    if gpus_per_node < 2 or replica_slots <= 0:
        return out
    for g in range(G):
        node, rail = divmod(g, gpus_per_node)
        pred = node * gpus_per_node + (rail - 1) % gpus_per_node
        mine = np.flatnonzero(expert_gpu == pred)
        mine = mine[np.argsort(-expert_load[mine], kind="stable")][:replica_slots]
        mine = mine[expert_load[mine] > 0]
        out[g, :len(mine)] = mine
    return out


def lplb_batch_copies(expert_gpu: np.ndarray, expert_load: np.ndarray, num_gpus: int, gpus_per_node: int,
                      replica_slots: int) -> np.ndarray:
    """int32 ``[L, G, r]``: ``lplb_copies`` of every layer (homes ``expert_gpu [L, E]``, the batch's tokens of each
    expert ``expert_load [L, E]``), the same for every micro-batch."""
    return np.stack([lplb_copies(expert_gpu[l], expert_load[l], num_gpus, gpus_per_node, replica_slots)
                     for l in range(len(expert_gpu))])


def lplb_replicas(placement: Placement, samples: SamplePlacement, batch: TraceBatch, model: ModelSpec,
                  cluster: ClusterSpec, replica_slots: int = 1, split: str = "lp", workers: int = 1, *,
                  executor: TaskExecutor | None = None, fallbacks: FallbackLog | None = None) -> ReplicaPlan:
    """LPLB+ replicas and per-micro-batch token splits for a batch.

    The copies of each layer are chosen here (from the whole batch's loads); the splits, one per micro-batch
    and layer, run as "replicate" tasks of chunks of cells on the executor, as the replication pass of relibra.

    Args:
        placement: homes ``[L, E]``; samples: micro-batch and GPU of every sample.
        batch: the ``TraceBatch`` (its ``loads`` give ``x [M, L, G, E]``).
        replica_slots: r copies per GPU (the baseline's extra memory; one copy per expert at most).
        split: "lp" (exact LP per cell) or "fast" (water-filling heuristic).
        workers: processes over the cells when no ``executor`` is given (1: in this process).
        executor: runs chunks of cells (``executor.TaskExecutor``); a chunk that does not finish leaves its
            cells without replicas (every token at its home), recorded in ``fallbacks``.
    """
    if split not in ("lp", "fast"):
        raise PlanError(f"split={split!r} is not 'lp' or 'fast'")
    check_int("replica_slots", replica_slots, 0)
    check_int("workers", workers, 1)
    G = cluster.num_gpus
    M, L = int(samples.num_micro_batches), placement.num_layers
    loads = np.asarray(batch.loads(samples.gpu, G, samples.micro_batch), dtype=np.float64)
    if loads.shape[0] < M:
        loads = np.concatenate([loads, np.zeros((M - loads.shape[0],) + loads.shape[1:])])
    if replica_slots <= 0:
        return ReplicaPlan.empty(M, L, G, 0)
    if executor is None:
        executor = default_executor(workers)
    homes = placement.expert_gpu
    copies = lplb_batch_copies(homes, loads.sum(axis=(0, 2)), G, cluster.gpus_per_node, replica_slots)
    cells = [(m, l) for l in range(L) for m in range(M)]
    n_chunks = 1 if executor.workers == 1 else min(len(cells), 4 * executor.workers)
    return map_cells(executor, lplb_cells_task, cells, np.array_split(np.arange(len(cells)), max(1, n_chunks)),
                     lambda ms, ls: (loads[ms, ls], homes[ls], copies[ls], model, cluster, split),
                     fallbacks, M, L, G, replica_slots)


def lplb_cells_task(loads: np.ndarray, expert_gpu: np.ndarray, copies: np.ndarray, model: ModelSpec,
                    cluster: ClusterSpec, split: str) -> list[CellResult]:
    """One executor task: the split of cells ``loads [C, G, E]`` (tokens) with homes ``expert_gpu [C, E]`` and their
    layer's fixed copies ``[C, G, r]``; ``split`` "lp" (``split.solve_split_lp``) or "fast" (``split.fast_split``)."""
    solve = solve_split_lp if split == "lp" else fast_split
    out = []
    for i in range(len(loads)):
        sol = solve(loads[i], expert_gpu[i], copies[i], model, cluster)
        out.append(CellResult(copies[i], sol.rows, sol.share, sol.t_moe))
    return out


def lplb_homes(ctx: PlanContext, x: np.ndarray | None = None) -> np.ndarray:
    """int64 ``[L, E]`` LPLB+'s homes: EPLB+ without redundant experts on the batch's true per-layer loads
    (``x``: ``ctx.loads(ctx.micro_batch, ctx.sample_gpu)`` when the caller has it; its per-expert sums are the
    same on every sample placement)."""
    if x is None:
        x = ctx.loads(ctx.micro_batch, ctx.sample_gpu)
    return baselines.eplb(x.sum(axis=(0, 2)), ctx.cluster.num_gpus, ctx.cluster.gpus_per_node, 0,
                          ctx.options.num_groups)[0]


def lplb_parts(ctx: PlanContext, expert_gpu: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, ReplicaPlan]:
    """LPLB+'s plan on ``ctx``: (homes [L, E] (``expert_gpu``, default ``lplb_homes``), micro_batch [N], gpu [N],
    replicas): the ring's copies and the exact LP split of every cell (``lplb_replicas``) on ``ctx.executor``."""
    eg = lplb_homes(ctx) if expert_gpu is None else expert_gpu
    mb, sg = baseline_samples(ctx, eg)
    replicas = lplb_replicas(Placement(eg), SamplePlacement(mb, sg, ctx.num_micro_batches), ctx.batch_for(mb),
                             ctx.model, ctx.cluster, replica_slots=ctx.replica_slots, executor=ctx.executor,
                             fallbacks=ctx.fallbacks)
    return eg, mb, sg, replicas
