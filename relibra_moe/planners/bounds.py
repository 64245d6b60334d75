"""Lower bounds the portfolio prunes with: a candidate whose bound already reaches the best score cannot win
and is not built (docs/method.md, "The portfolio")."""

from __future__ import annotations

import numpy as np

from ..plan import Placement
from ..timing import attention_backward, attention_forward, layer_step_seconds, moe_forward_seconds, moe_step_seconds
from .context import PlanContext
from .split import lower_bound_terms

__all__ = ["replicated_step_lower_bound"]


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

