"""Lower bounds the portfolio prunes with: a candidate whose bound already reaches the best score cannot win
and is not built (docs/method.md, "The portfolio")."""

from __future__ import annotations

import functools

import numpy as np

from ..plan import Placement
from ..specs import ClusterSpec, ModelSpec
from ..timing import attention_backward, attention_forward, layer_step_seconds, moe_forward_seconds, moe_step_seconds
from .context import PlanContext
from .locality_replicas import node_left
from .split import cell_weights, lower_bound_terms

__all__ = ["replicated_step_lower_bound", "global_replica_step_lower_bound", "fixed_copy_terms", "ring_arcs"]


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
    micro-batch, in any node (EPLB+'s, LPLB+'s), under any split: ``fixed_copy_terms`` in place of the intra-node
    terms."""
    if replica_expert is None:
        comp, comm = lower_bound_terms(x, np.asarray(expert_gpu)[None], ctx.model, ctx.cluster)
    else:
        comp, comm = fixed_copy_terms(x, expert_gpu, replica_expert, ctx.model, ctx.cluster)
    return _step_bound(ctx, comp, comm, expert_gpu, micro_batch, sample_gpu, previous, optimizer_bytes_per_param)


def global_replica_step_lower_bound(ctx: PlanContext, expert_gpu: np.ndarray, micro_batch: np.ndarray,
                                    sample_gpu: np.ndarray, x: np.ndarray, previous: Placement,
                                    optimizer_bytes_per_param: float) -> float:
    """As :func:`replicated_step_lower_bound`, for any plan with these homes and samples and ``ctx.replica_slots``
    replicas per GPU anywhere in the cluster (scope ``"global"``: ``locality_replicas``' candidates). Per cell
    ``comp_lb`` is the cell's pairs over G; a pair of source j stays on j only for an expert j homes or holds in
    one of its r slots, so at least ``out_j`` = its other pairs less its r largest leave j, each over NVLink or
    RDMA (or both: cross-rail): ``max(w_nv nv_tx, w_rdma rdma_tx) >= out_j w_nv w_rdma / (w_nv + w_rdma)`` in
    the token units of ``split.cell_weights``, so ``comm_lb = max_j`` of that. On several nodes a node holds, besides
    its homes, at most ``P r`` experts homed elsewhere (its GPUs' slots), so the pairs its sources route to the
    other remote experts are served on another node and leave over RDMA from their source: at least
    ``locality_replicas.node_left`` (its remote pairs less its ``P r`` largest remote experts') over its P GPUs, and
    at least source j's remote pairs less its own ``P r`` largest; ``comm_lb`` is also at least ``w_rdma`` times
    the larger of the two (the RDMA send of the worst GPU)."""
    x = np.asarray(x, dtype=np.float64)
    expert_gpu = np.asarray(expert_gpu, dtype=np.int64)
    cluster = ctx.cluster
    G, P, r = cluster.num_gpus, cluster.gpus_per_node, int(ctx.replica_slots)
    w = cell_weights(ctx.model, cluster)
    comp = x.sum(axis=(-2, -1)) / G * w.sec_per_token  # [M, L]
    at_home = expert_gpu[None, :, None, :] == np.arange(G)[None, None, :, None]  # [1, L, G, E]
    away = np.sort(np.where(at_home, 0.0, x), axis=-1)  # [M, L, G, E] ascending
    out = away[..., :away.shape[-1] - r].sum(axis=-1) if r else away.sum(axis=-1)  # [M, L, G]
    harmonic = w.w_nv * w.w_rdma / (w.w_nv + w.w_rdma) if w.w_nv + w.w_rdma > 0 else 0.0
    comm_tokens = out.max(axis=-1) * harmonic  # [M, L]
    if cluster.nodes > 1:
        M, L, _, E = x.shape
        # [1, L, nodes, E]: expert e is homed off node n; indexed by each source's node: off source j's node
        remote = cluster.node_of(expert_gpu)[None, :, None, :] != np.arange(cluster.nodes)[None, None, :, None]
        per_source = node_left(x, remote[:, :, cluster.node_of(np.arange(G))], P * r).max(axis=-1)  # [M, L]
        xn = x.reshape(M, L, cluster.nodes, P, E).sum(axis=3)  # [M, L, nodes, E]
        per_node = node_left(xn, remote, P * r).max(axis=-1) / P  # [M, L]
        comm_tokens = np.maximum(comm_tokens, np.maximum(per_source, per_node) * w.w_rdma)
    comm = comm_tokens * w.sec_per_token
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


def fixed_copy_terms(x: np.ndarray, expert_gpu: np.ndarray, replica_expert: np.ndarray, model: ModelSpec,
                     cluster: ClusterSpec) -> tuple[np.ndarray, np.ndarray]:
    """``(comp_lb, comm_lb)`` seconds ``[M, L]`` for cells ``x [M, L, G, E]`` with homes ``expert_gpu [L, E]`` and the
    same copies ``replica_expert [L, G, r]`` (-1 empty) in every micro-batch, in any node, under any split of an
    expert's tokens over its holders (EPLB+'s and LPLB+'s plans): ``max_g comp >= comp_lb``, ``max_g comm >=
    comm_lb``, in the units of ``split.lower_bound_terms``, which they refine (a node is one of the sets below).

    For every arc ``T`` of consecutive GPUs on a node's ring (``ring_arcs``: one GPU, two, ..., the node), the
    experts whose holders all lie in ``T`` are computed by its ``|T|`` GPUs (``comp >= load / |T|``) and receive
    their tokens from other nodes there (``rdma_rx >= that / |T|``); ``comp >= sum / G`` always; a source sends
    cross-node the tokens of every expert with no holder in its node (``rdma_tx``). An expert held in several nodes
    lies in no arc."""
    x = np.asarray(x, dtype=np.float64)
    eg, rep = np.asarray(expert_gpu, dtype=np.int64), np.asarray(replica_expert, dtype=np.int64)
    (L, E), G, nodes = eg.shape, cluster.num_gpus, cluster.nodes
    held = np.zeros((L, E, G), bool)
    held[np.arange(L)[:, None], np.arange(E)[None, :], eg] = True
    ls, gs, ss = np.nonzero(rep >= 0)
    held[ls, rep[ls, gs, ss], gs] = True
    arcs = ring_arcs(cluster)  # [S, G]
    # holders outside each arc, as one 2-D product (the batched [L, E, G] @ [G, S] one is ~50x slower here)
    outside = held.reshape(L * E, G).astype(np.float64) @ (~arcs).T.astype(np.float64)
    inside = (outside.reshape(L, E, -1) == 0).astype(np.float64)  # [L, E, S]: every holder of e in arc s
    size = arcs.sum(axis=1)
    load = x.sum(axis=-2)  # [M, L, E]
    comp = np.maximum((np.einsum("mle,les->mls", load, inside) / size).max(axis=-1), load.sum(axis=-1) / G)
    src = cluster.node_of(np.arange(G))
    arc_node = cluster.node_of(arcs.argmax(axis=1))
    rx = np.zeros(load.shape[:2])
    for n in range(nodes):
        remote = load - x[:, :, src == n, :].sum(axis=-2)  # tokens from sources outside node n
        s = arc_node == n
        rx = np.maximum(rx, (np.einsum("mle,les->mls", remote, inside[:, :, s]) / size[s]).max(axis=-1))
    held_node = held.reshape(L, E, nodes, -1).any(axis=-1)  # [L, E, nodes]: a holder in node n (GPUs node-major)
    tx = np.einsum("mlje,lej->mlj", x, (~held_node[:, :, src]).astype(np.float64)).max(axis=-1)
    w = cell_weights(model, cluster)
    return comp * w.sec_per_token, w.w_rdma * np.maximum(tx, rx) * w.sec_per_token


@functools.lru_cache(maxsize=16)
def _ring_arcs(num_gpus: int, gpus_per_node: int) -> np.ndarray:
    G, P = num_gpus, gpus_per_node
    g, k, i = np.arange(G)[:, None, None], np.arange(1, P)[None, :, None], np.arange(P)[None, None, :]
    members = (g // P) * P + (g % P + i) % P  # [G, 1, P]: the node's GPUs from g on, around the ring
    arcs = np.zeros((P - 1, G, G), bool)
    kk, gg, ii = np.nonzero(np.broadcast_to(i < k, (G, P - 1, P)).transpose(1, 0, 2))
    arcs[kk, gg, members[gg, 0, ii]] = True
    nodes = np.arange(G)[None, :] // P == np.arange(G // P)[:, None]
    out = np.concatenate([arcs.reshape(-1, G), nodes])
    out.setflags(write=False)
    return out


def ring_arcs(cluster: ClusterSpec) -> np.ndarray:
    """bool ``[S, G]`` (read-only): the GPU sets of ``fixed_copy_terms``, every arc of 1 .. P - 1 consecutive GPUs on
    each node's ring (from every GPU, wrapping inside the node; by length, then first GPU) and every whole node."""
    return _ring_arcs(cluster.num_gpus, cluster.gpus_per_node)
