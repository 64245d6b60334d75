"""Lower bounds the portfolio prunes with: a candidate whose bound already reaches the best score cannot win
and is not built (docs/method.md, "The portfolio")."""

from __future__ import annotations

import numpy as np

from ..plan import Placement
from ..specs import ClusterSpec, ModelSpec
from ..timing import attention_backward, attention_forward, layer_step_seconds, moe_forward_seconds, moe_step_seconds
from .context import PlanContext
from .split import cell_weights, lower_bound_terms

__all__ = ["replicated_step_lower_bound", "fixed_copy_terms"]


def replicated_step_lower_bound(ctx: PlanContext, expert_gpu: np.ndarray, micro_batch: np.ndarray,
                                sample_gpu: np.ndarray, x: np.ndarray, previous: Placement,
                                optimizer_bytes_per_param: float, replica_expert: np.ndarray | None = None) -> float:
    """A lower bound (seconds) on the portfolio score (``portfolio_score`` under ``ctx.options``) of any plan
    with homes ``expert_gpu [L, E]``, samples ``micro_batch`` / ``sample_gpu [N]`` (loads ``x [M, L, G, E]``) and
    any intra-node replicas: ``L sum_m (A_fwd + A_bwd)`` + ``sum_{m, l} (3 comp_lb + 2 comm_lb)``
    (``split.lower_bound_terms``; ``timing.moe_step_seconds``) + the re-layout from ``previous``
    (``ctx.evaluator.relayout_seconds``; 0 with ``migration=False``); replica traffic counts 0. Under the cluster's
    overlap the cells are ``timing.layer_step_seconds(A_fwd, comp_lb, comm_lb, overlap)`` instead, as the simulator
    charges them (the rule is non-decreasing in each term, so it stays a bound; the back-to-back sum is not one
    there). With ``step_objective=False`` the score is the sum of T_MoE: ``sum_{m, l} (comp_lb + comm_lb)``.

    With ``replica_expert [L, G, r]`` (-1 empty) the bound is that of plans holding exactly these copies in every
    micro-batch, in any node (EPLB+'s), under any split: ``fixed_copy_terms`` in place of the intra-node terms."""
    if replica_expert is None:
        comp, comm = lower_bound_terms(x, np.asarray(expert_gpu)[None], ctx.model, ctx.cluster)
    else:
        comp, comm = fixed_copy_terms(x, expert_gpu, replica_expert, ctx.model, ctx.cluster)
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


def fixed_copy_terms(x: np.ndarray, expert_gpu: np.ndarray, replica_expert: np.ndarray, model: ModelSpec,
                     cluster: ClusterSpec) -> tuple[np.ndarray, np.ndarray]:
    """``(comp_lb, comm_lb)`` seconds ``[M, L]``: ``split.lower_bound_terms``'s two terms for cells ``x [M, L, G, E]``
    with homes ``expert_gpu [L, E]`` and the same copies ``replica_expert [L, G, r]`` (-1 empty) in every
    micro-batch, in any node, under any split of an expert's tokens over its holders. An expert held in one node
    only is computed by that node's P GPUs and receives its cross-node tokens there, as there; one held in
    several nodes counts in the total compute (``comp >= sum / G``) and, from a source in a node that holds no copy
    of it, in that source's cross-node sends. With every copy in its home's node these are the intra-node terms."""
    x = np.asarray(x, dtype=np.float64)
    eg, rep = np.asarray(expert_gpu, dtype=np.int64), np.asarray(replica_expert, dtype=np.int64)
    (L, E), G, P, nodes = eg.shape, cluster.num_gpus, cluster.gpus_per_node, cluster.nodes
    held = np.zeros((L, E, nodes), bool)
    held[np.arange(L)[:, None], np.arange(E)[None, :], cluster.node_of(eg)] = True
    ls, gs, ss = np.nonzero(rep >= 0)
    held[ls, rep[ls, gs, ss], cluster.node_of(gs)] = True
    only = (held & (held.sum(axis=-1) == 1)[..., None]).astype(np.float64)  # [L, E, nodes]
    xn = x @ only  # [M, L, G, nodes]: tokens of source j for the experts held in node n only
    comp = np.maximum(xn.sum(axis=-2).max(axis=-1) / P, x.sum(axis=(-2, -1)) / G)
    src = cluster.node_of(np.arange(G))
    tx = np.einsum("mlje,lej->mlj", x, (~held[:, :, src]).astype(np.float64)).max(axis=-1)
    rx = (xn * (src[:, None] != np.arange(nodes)[None, :])).sum(axis=-2).max(axis=-1) / P
    w = cell_weights(model, cluster)
    return comp * w.sec_per_token, w.w_rdma * np.maximum(tx, rx) * w.sec_per_token
