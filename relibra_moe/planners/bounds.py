"""Lower bounds the portfolio prunes with: a candidate whose bound already reaches the best score cannot win
and is not built (docs/method.md, "The portfolio")."""

from __future__ import annotations

import numpy as np

from ..plan import Placement
from ..timing import attention_backward, attention_forward, layer_step_seconds, moe_forward_seconds, moe_step_seconds
from .context import PlanContext
from .split import cell_weights, lower_bound_terms

__all__ = ["replicated_step_lower_bound", "global_replica_step_lower_bound"]


def replicated_step_lower_bound(ctx: PlanContext, expert_gpu: np.ndarray, micro_batch: np.ndarray,
                                sample_gpu: np.ndarray, x: np.ndarray, previous: Placement,
                                optimizer_bytes_per_param: float) -> float:
    """A lower bound (seconds) on the portfolio score (``portfolio_score`` under ``ctx.options``) of any plan
    with homes ``expert_gpu [L, E]``, samples ``micro_batch`` / ``sample_gpu [N]`` (loads ``x [M, L, G, E]``) and
    any intra-node replicas: ``L sum_m (A_fwd + A_bwd)`` + ``sum_{m, l} (3 comp_lb + 2 comm_lb)``
    (``split.lower_bound_terms``; ``timing.moe_step_seconds``) + the re-layout from ``previous``
    (``ctx.evaluator.relayout_seconds``; 0 with ``migration=False``); replica traffic counts 0. Under the cluster's
    overlap the cells are ``timing.layer_step_seconds(A_fwd, comp_lb, comm_lb, overlap)`` instead, as the simulator
    charges them (the rule is non-decreasing in each term, so it stays a bound; the back-to-back sum is not one
    there). With ``step_objective=False`` the score is the sum of T_MoE: ``sum_{m, l} (comp_lb + comm_lb)``."""
    comp, comm = lower_bound_terms(x, np.asarray(expert_gpu)[None], ctx.model, ctx.cluster)
    return _step_bound(ctx, comp, comm, expert_gpu, micro_batch, sample_gpu, previous, optimizer_bytes_per_param)


def global_replica_step_lower_bound(ctx: PlanContext, expert_gpu: np.ndarray, micro_batch: np.ndarray,
                                    sample_gpu: np.ndarray, x: np.ndarray, previous: Placement,
                                    optimizer_bytes_per_param: float) -> float:
    """As :func:`replicated_step_lower_bound`, for any plan with these homes and samples and ``ctx.replica_slots``
    replicas per GPU anywhere in the cluster (scope ``"global"``: ``locality_replicas``' candidates). Per cell
    ``comp_lb`` is the cell's pairs over G; a pair of source j stays on j only for an expert j homes or holds in
    one of its r slots, so at least ``out_j`` = its other pairs less its r largest leave j, each over NVLink or
    RDMA (or both: cross-rail): ``max(w_nv nv_tx, w_rdma rdma_tx) >= out_j w_nv w_rdma / (w_nv + w_rdma)`` in
    the token units of ``split.cell_weights``, so ``comm_lb = max_j`` of that."""
    x = np.asarray(x, dtype=np.float64)
    G, r = ctx.cluster.num_gpus, int(ctx.replica_slots)
    w = cell_weights(ctx.model, ctx.cluster)
    comp = x.sum(axis=(-2, -1)) / G * w.sec_per_token  # [M, L]
    at_home = np.asarray(expert_gpu)[None, :, None, :] == np.arange(G)[None, None, :, None]  # [1, L, G, E]
    away = np.sort(np.where(at_home, 0.0, x), axis=-1)  # [M, L, G, E] ascending
    out = away[..., :away.shape[-1] - r].sum(axis=-1) if r else away.sum(axis=-1)  # [M, L, G]
    harmonic = w.w_nv * w.w_rdma / (w.w_nv + w.w_rdma) if w.w_nv + w.w_rdma > 0 else 0.0
    comm = out.max(axis=-1) * harmonic * w.sec_per_token
    return _step_bound(ctx, comp, comm, expert_gpu, micro_batch, sample_gpu, previous, optimizer_bytes_per_param)


def _step_bound(ctx: PlanContext, comp: np.ndarray, comm: np.ndarray, expert_gpu: np.ndarray,
                micro_batch: np.ndarray, sample_gpu: np.ndarray, previous: Placement,
                optimizer_bytes_per_param: float) -> float:
    """The portfolio-score bound of the bounds above from the cells' ``comp`` / ``comm`` lower bounds ``[M, L]``
    (seconds): attention, the cells' MoE under the cluster's overlap rule, the re-layout when moves are priced."""
    if not ctx.options.step_objective:
        return float(np.sum(moe_forward_seconds(comp, comm)))
    a_fwd = attention_forward(ctx.lengths, micro_batch, sample_gpu, ctx.num_micro_batches, ctx.model, ctx.cluster)
    relayout = 0.0
    if ctx.options.migration:
        relayout = ctx.evaluator.relayout_seconds(previous, Placement(expert_gpu), ctx.model, ctx.cluster,
                                                  optimizer_bytes_per_param)
    if ctx.cluster.overlap != "none":
        return float(layer_step_seconds(a_fwd[:, None], comp, comm, ctx.cluster.overlap).sum() + relayout)
    return float(ctx.model.num_layers * (a_fwd + attention_backward(a_fwd)).sum()
                 + moe_step_seconds(comp, comm).sum() + relayout)

