"""Inter-batch expert reordering (Algorithm 1): greedy LPT start + swap annealing (docs/method.md, "Reorder").

Pure functions of arrays. The unit of work is one layer and one seed (``anneal_layer``): picklable
arguments in, ``(expert_gpu [E], exact objective)`` out, so a process pool (or the Planner service)
can farm out layer x seed tasks and fall back per cell. ``reorder`` runs all of them and keeps, per
layer, the candidate (LPT start included) with the lowest exact objective.

Two objectives to anneal on:

- ``"batch"`` (default): the true batch cost, the sum over the M micro-batches of the layer's T_MoE
  (LSE-smoothed while annealing). A swap is evaluated in O(M G).
- ``"aggregate"``: the paper's, T_MoE of the batch-aggregated loads ``x.sum(0)``: O(G) per swap.

The winner of a layer is always chosen by the exact batch cost (sum over micro-batches of the exact
T_MoE, the formulas of ``cost.moe_cost``). "batch" is the default: it gives the lower sum of T_MoE on
most bench scenarios (BENCHMARKS.md, "Planner defaults").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..cost_terms import link_masks
from ..errors import PlanError
from ..specs import ClusterSpec, ModelSpec
from ..validate import check_int, check_nonnegative, check_token_counts
from . import _kernels
from .executor import FallbackLog, TaskExecutor, TaskFailed, default_executor
from .params import ReorderParams, params_or_fields


def cluster_constants(model: ModelSpec, cluster: ClusterSpec, comp_weight: float = 1.0
                      ) -> tuple[np.ndarray, np.ndarray, float, float, float]:
    """``(nvm [G, G], rdm [G, G], cc, tnv, trd)`` for the numba kernels.

    nvm / rdm: float64 masks of source -> target pairs carried by NVLink ({nv, cr}) / RDMA ({sr, cr});
    cc: seconds of expert compute per (token, expert) pair, times ``comp_weight`` (1: the kernels' objective is
    T_MoE = comp + comm; ``timing.STEP_COMP_WEIGHT``: the step's 3 comp + 2 comm, halved); tnv / trd: seconds
    per pair on NVLink / RDMA (the dispatcher's copies per pair included), all from ``ClusterSpec.rates``.
    """
    nvm, rdm = link_masks(cluster.link_classes)
    r = cluster.rates(model)
    return (nvm, rdm, float(comp_weight * r.sec_per_pair), float(r.nvlink_sec_per_pair),
            float(r.rdma_sec_per_pair))


def lpt_placement(expert_load: np.ndarray, num_gpus: int) -> np.ndarray:
    """Greedy LPT: experts by descending load onto the least-loaded GPU with a free slot.

    Args:
        expert_load: ``[E]`` total tokens of each expert (ties broken by expert id).
        num_gpus: G; every GPU gets exactly E / G experts (ties go to the lowest GPU id).

    Returns:
        int64 ``[E]`` home GPU of each expert.
    """
    w = np.asarray(expert_load, dtype=np.float64)
    if w.ndim != 1:
        raise PlanError(f"expert_load must be [E], got shape {w.shape}")
    check_token_counts("expert_load", w)
    E = w.shape[0]
    if num_gpus <= 0 or E % num_gpus:
        raise PlanError(f"num_experts={E} is not divisible by num_gpus={num_gpus}")
    cap = E // num_gpus
    order = np.lexsort((np.arange(E), -w))
    gpu_load = np.zeros(num_gpus)
    gpu_count = np.zeros(num_gpus, np.int64)
    out = np.empty(E, np.int64)
    for e in order:
        free = np.flatnonzero(gpu_count < cap)
        g = free[np.argmin(gpu_load[free])]
        out[e] = g
        gpu_load[g] += w[e]
        gpu_count[g] += 1
    return out


def _as_layer_loads(x_layer: np.ndarray, model: ModelSpec, cluster: ClusterSpec) -> np.ndarray:
    x = np.asarray(x_layer, dtype=np.float64)
    if x.ndim == 2:
        x = x[None]
    if x.ndim != 3 or x.shape[1:] != (cluster.num_gpus, model.num_experts):
        raise PlanError(f"x_layer has shape {np.shape(x_layer)}, expected [M, G={cluster.num_gpus}, "
                        f"E={model.num_experts}]")
    if (x < 0).any():
        raise PlanError("x_layer holds negative token counts")
    return np.ascontiguousarray(x)


def batch_cost(x_layer: np.ndarray, expert_gpu: np.ndarray, model: ModelSpec, cluster: ClusterSpec,
               node_comp: bool = False, skew_cap: float | None = None, comp_weight: float = 1.0) -> float:
    """Exact batch cost of one layer: sum over micro-batches of T_MoE (seconds) for ``x_layer [M, G, E]``.

    Computed by the numba evaluator (the same formulas as ``cost.moe_cost``; the tests check they agree).
    ``node_comp``: the replication-aware variant, whose compute term is the busiest *node's* mean GPU load
    (``cc max_n mean_{g in n} load[g]``) instead of the busiest GPU's: what intra-node replicas can level
    the compute down to (used when replication follows the reorder). ``skew_cap`` (with ``node_comp``): a
    soft cap on that node-level compute skew: each micro-batch's compute term gains
    ``SKEW_PENALTY x max(0, node max - (1 + skew_cap) x GPU mean)``. ``comp_weight``: the compute term's weight
    (``cluster_constants``; ``timing.STEP_COMP_WEIGHT`` ranks as the simulated step's MoE time).
    """
    x = _as_layer_loads(x_layer, model, cluster)
    eg = np.asarray(expert_gpu, dtype=np.int64)
    if eg.shape != (model.num_experts,) or eg.min() < 0 or eg.max() >= cluster.num_gpus:
        raise PlanError(f"expert_gpu must be [E={model.num_experts}] GPUs in [0, {cluster.num_gpus}), got {eg}")
    nvm, rdm, cc, tnv, trd = cluster_constants(model, cluster, comp_weight)
    return float(_kernels.batch_objective_exact(x, eg, nvm, rdm, cc, tnv, trd, *_comp_model(cluster, node_comp,
                                                                                               skew_cap)))


SKEW_PENALTY = 50.0


def _comp_model(cluster: ClusterSpec, node_comp: bool, skew_cap: float | None) -> tuple[int, float, float]:
    """``(ns, cap, pen)`` of the numba kernels' compute term."""
    if skew_cap is not None:
        check_nonnegative("skew_cap", skew_cap)
    ns = int(cluster.gpus_per_node) if node_comp and cluster.nodes > 1 else 1
    if node_comp and skew_cap is not None:
        return ns, float(skew_cap), SKEW_PENALTY
    return ns, 0.0, 0.0


def node_balanced_start(x_layer: np.ndarray, cluster: ClusterSpec, seed: int = 0, iters: int = 20000) -> np.ndarray:
    """Homes ``[E]`` whose *nodes* balance the compute of every micro-batch, for the replication-aware reorder.

    Experts are first assigned to nodes (E / nodes each) by LPT on the batch loads, then annealed by swaps
    on ``sum_m max_n load[m, n]`` (the per-micro-batch node loads, communication ignored); inside each node
    they go to its GPUs by LPT. Replicas cannot leave a node, so this node balance is what bounds the rank
    skew after replication; the reorder then anneals communication from here.

    Args:
        x_layer: ``[M, G, E]`` (or ``[G, E]``) tokens per micro-batch, source GPU and expert.
        seed, iters: of the node-level annealing.
    """
    x = np.asarray(x_layer, dtype=np.float64)
    if x.ndim == 2:
        x = x[None]
    G, P, nodes = cluster.num_gpus, cluster.gpus_per_node, cluster.nodes
    xm = x.sum(axis=1)  # [M, E]
    E = xm.shape[1]
    if E % G:
        raise PlanError(f"num_experts={E} is not divisible by num_gpus={G}")
    node = lpt_placement(xm.sum(axis=0), nodes)
    if nodes > 1:
        xs = np.zeros((xm.shape[0], nodes, E))
        xs[:, 0] = xm  # one source row: with zero link masks only the node loads count
        z = np.zeros((nodes, nodes))
        node, _, _ = _kernels.anneal_experts(xs, node, z, z, 1.0, 0.0, 0.0, 10.0, False, 0.005, 1e-5, int(iters),
                                             int(seed) & 0x7FFFFFFF)
    out = np.empty(E, np.int64)
    w = xm.sum(axis=0)
    for n in range(nodes):
        members = np.flatnonzero(node == n)
        out[members] = n * P + lpt_placement(w[members], P)
    return out


def anneal_layer(x_layer: np.ndarray, model: ModelSpec, cluster: ClusterSpec, seed: int,
                 init: np.ndarray | None = None, params: ReorderParams | None = None, **param_fields: Any
                 ) -> tuple[np.ndarray, float]:
    """Anneal the expert homes of one layer from ``init`` (default: LPT on the layer's expert loads).

    Args:
        x_layer: ``[M, G, E]`` (or ``[G, E]``) tokens per micro-batch, source GPU and expert.
        seed: RNG seed of this run (same inputs and seed -> same result).
        params: the annealing parameters (``params.ReorderParams``: objective, beta, iters, temperatures,
            smoothing, ``node_comp`` / ``skew_cap``, ``comp_weight``); or give its fields as keywords
            (``param_fields``). ``iters`` None: ``ReorderParams.iters_for`` this layer's M. Smoothing default:
            smoothed for "aggregate" (one max, plateaus), exact for "batch": the sum over micro-batches already
            has no plateaus, and the exact evaluation is ~4x cheaper at the same final cost (measured).

    Returns:
        (int64 ``[E]`` home GPU of each expert, exact batch cost in seconds = sum over micro-batches of
        the exact T_MoE, or of its node-compute variant with ``node_comp``).
    """
    p = params_or_fields(ReorderParams, params, param_fields)
    x = _as_layer_loads(x_layer, model, cluster)
    G, E = cluster.num_gpus, model.num_experts
    if init is None:
        init = lpt_placement(x.sum(axis=(0, 1)), G)
    init = np.asarray(init, dtype=np.int64)
    if init.shape != (E,):
        raise PlanError(f"init has shape {init.shape}, expected [E={E}]")
    iters = p.iters_for(E, G, x.shape[0])
    smooth = p.smoothed
    nvm, rdm, cc, tnv, trd = cluster_constants(model, cluster, p.comp_weight)
    xa = x if p.objective == "batch" else np.ascontiguousarray(x.sum(axis=0)[None])
    best, obj, _ = _kernels.anneal_experts(xa, init, nvm, rdm, cc, tnv, trd, float(p.beta), smooth,
                                           float(p.t0_frac), float(p.eps_frac), int(iters), int(seed) & 0x7FFFFFFF,
                                           *_comp_model(cluster, p.node_comp, p.skew_cap))
    if p.objective == "batch" and not smooth:
        return best, float(obj)  # the kernel's objective is already the exact batch cost
    return best, batch_cost(x, best, model, cluster, p.node_comp, p.skew_cap, p.comp_weight)


def better_start(x_layer: np.ndarray, lpt: np.ndarray, model: ModelSpec, cluster: ClusterSpec, seed: int,
                  layer: int, skew_cap: float | None = None, comp_weight: float = 1.0) -> np.ndarray:
    """The better of ``lpt`` (any start) and ``node_balanced_start`` under the replication-aware batch cost."""
    nb = node_balanced_start(x_layer, cluster, seed=layer_seeds(seed, 1, layer)[0])
    if batch_cost(x_layer, nb, model, cluster, True, skew_cap, comp_weight) < \
            batch_cost(x_layer, lpt, model, cluster, True, skew_cap, comp_weight):
        return nb
    return lpt


def anneal_layer_task(x_layer: np.ndarray, model: ModelSpec, cluster: ClusterSpec, seed: int, init: np.ndarray,
                      params: ReorderParams) -> tuple[np.ndarray, float]:
    """One reorder task for an executor: ``anneal_layer(x_layer, model, cluster, seed, init, params)``."""
    return anneal_layer(x_layer, model, cluster, seed, init, params)


def layer_seeds(seed: int, num_seeds: int, layer: int) -> list[int]:
    """The annealing seeds of one layer: distinct, derived deterministically from the plan seed."""
    ss = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(layer)])
    return [int(v) for v in ss.generate_state(num_seeds, dtype=np.uint32) & 0x7FFFFFFF]


def reorder(x: np.ndarray, model: ModelSpec, cluster: ClusterSpec, params: ReorderParams | None = None, *,
            seed: int = 0, num_seeds: int | None = None, workers: int = 1, init: np.ndarray | None = None,
            layers: Sequence[int] | None = None, executor: TaskExecutor | None = None,
            fallback: np.ndarray | None = None, fallbacks: FallbackLog | None = None,
            **param_fields: Any) -> tuple[np.ndarray, dict]:
    """Algorithm 1 on every layer: LPT start, ``num_seeds`` annealing runs, best by exact batch cost.

    Args:
        x: ``[M, L, G, E]`` tokens per micro-batch, layer, source GPU and expert.
        params: the annealing parameters (``params.ReorderParams``; the planning loop passes
            ``params.reorder_params(options, ...)``), or give its fields as keywords (``param_fields``:
            ``objective``, ``beta``, ``iters``, ...). ``iters`` None: ``ReorderParams.iters_for`` with the
            whole-reorder budget. With ``node_comp`` (replication-aware objective, ``batch_cost``) the start of
            a layer is the better of ``init`` (default LPT) and ``node_balanced_start`` under that objective.
        seed: plan seed (per-layer seeds derive from it).
        num_seeds: annealing runs per layer (default: one per worker of the executor).
        workers: processes (1 = in this process) when no ``executor`` is given.
        init: optional ``[L, E]`` starting homes (default: LPT per layer); it is always a candidate.
        layers: restrict to these layers (others keep ``init``/LPT).
        executor: runs the layer x seed tasks (``executor.TaskExecutor``; default ``default_executor(workers)``).
        fallback: ``[L, E]`` homes a layer keeps when none of its tasks finished (default: its start).
        fallbacks: records those layers (``FallbackLog.reorder``).

    Returns:
        (int64 ``[L, E]`` homes, info dict with ``objective_start`` / ``objective`` = exact sum of
        T_MoE over layers and micro-batches before / after, and ``objective_name``).
    """
    x = np.asarray(x)
    if x.ndim != 4 or x.shape[2:] != (cluster.num_gpus, model.num_experts):
        raise PlanError(f"x has shape {x.shape}, expected [M, L, G={cluster.num_gpus}, E={model.num_experts}]")
    M, L, G, E = x.shape
    check_int("workers", workers, 1)
    if executor is None:
        executor = default_executor(workers)
    if num_seeds is not None:
        check_int("num_seeds", num_seeds, 1)
    p = params_or_fields(ReorderParams, params, param_fields)
    node_comp, skew_cap, comp_weight = p.node_comp, p.skew_cap, p.comp_weight
    xl = np.ascontiguousarray(np.moveaxis(x, 1, 0), dtype=np.float64)  # [L, M, G, E]
    if init is None:
        start = np.stack([lpt_placement(xl[l].sum(axis=(0, 1)), G) for l in range(L)])
    else:
        start = np.asarray(init, dtype=np.int64)
        if start.shape != (L, E):
            raise PlanError(f"init has shape {start.shape}, expected [L={L}, E={E}]")
    if node_comp and cluster.nodes > 1:
        start = np.stack([better_start(xl[l], start[l], model, cluster, seed, l, skew_cap, comp_weight)
                          for l in range(L)])
    if num_seeds is None:
        num_seeds = max(1, executor.workers)
    p = dataclasses.replace(p, iters=p.iters_for(E, G, M, L))
    todo = list(range(L)) if layers is None else [int(l) for l in layers]
    best = start.copy()
    best_obj = np.array([batch_cost(xl[l], start[l], model, cluster, node_comp, skew_cap, comp_weight)
                         for l in range(L)])
    obj_start = float(best_obj.sum())
    keys = [("reorder", (l, s)) for l in todo for s in layer_seeds(seed, num_seeds, l)]
    results = executor.map(anneal_layer_task, [(xl[l], model, cluster, s, start[l], p) for _, (l, s) in keys], keys)
    done = set()
    for (_, (l, _s)), res in zip(keys, results):  # task order is deterministic: ties keep the earlier candidate
        if isinstance(res, TaskFailed):
            continue
        done.add(l)
        eg, obj = res
        if obj < best_obj[l]:
            best_obj[l] = obj
            best[l] = eg
    for l in sorted(set(todo) - done):  # no seed of the layer finished: keep the fallback homes
        if fallback is not None:
            best[l] = np.asarray(fallback, dtype=np.int64)[l]
            best_obj[l] = batch_cost(xl[l], best[l], model, cluster, node_comp, skew_cap, comp_weight)
        if fallbacks is not None:
            fallbacks.reorder.append(int(l))
    info = {"objective_name": p.objective, "objective_start": obj_start, "objective": float(best_obj.sum()),
            "num_seeds": num_seeds, "iters": int(p.iters)}
    return best, info
