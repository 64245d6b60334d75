"""Step-time arithmetic, each formula defined once: attention, transfers, move bytes, the MoE step formula.

Every constant comes from ``ModelSpec`` and ``ClusterSpec.rates`` (``F`` = ``expert_flops``, ``F_attn`` =
``attention_flops``, ``B_nv`` = ``nvlink_bw``, ``B_rdma`` = ``rdma_bw``, ``alpha_nv`` / ``alpha_rdma`` =
``nvlink_latency`` / ``rdma_latency``; a cluster profile overrides them). The
simulator (``relibra_moe.sim``), the replication pass and the migration pricing of the planners all
charge time through these functions; docs/method.md ("Step time") derives them.

- **Attention** (one layer, one sequence of S tokens, forward FLOPs; h hidden, n_q / n_kv heads, d head
  dim): ``2 S h d (2 n_q + 2 n_kv)`` for the Q, K, V, O projections plus ``2 n_q d S (S + 1)`` for causal
  ``QK^T`` and ``PV``. The backward pass costs ``BACKWARD_FACTOR`` = 2 times the forward.
- **MoE** (one micro-batch and layer, with ``comp = max_g comp[g]`` and ``comm = max_g comm[g]`` of the
  cost model): forward ``comp + comm`` (= T_MoE); backward ``2 comp + comm`` (dX and dW GEMMs; the
  all-to-all is the mirror image of the forward one); together ``3 comp + 2 comm``.
- **Overlap** (``ClusterSpec.overlap``, one rule for the simulator and the planners: ``layer_step_seconds``): the
  forward + backward seconds of one (micro-batch, layer) cell, attention included, with ``a`` = A_fwd,
  ``c`` = max_g comp, ``D = C = comm / 2`` (dispatch, combine): ``none`` ``a + 2a + 3c + 2 comm``;
  ``megatron`` (Megatron-LM's ``overlap_moe_expert_parallel_comm``, ``TransformerLayerSchedulePlan.run``: the
  forward of one micro-batch beside the backward of another, compute and communication on two streams)
  ``max(a, C) + max(max(c, D) + D, max(2c, D) + c) + max(2a, C)`` (``_megatron_pair``); ``dualpipe``
  (DeepSeek-V3's full overlap) ``max(3a + 3c, 2 comm)``. Each is convex, positively homogeneous and non-decreasing in
  ``(a, c, comm)``, which the bound (``sim.bound_step``) needs. The planners' linear objective takes its weights
  from the rule (``step_weights``).
- **Transfers** (alpha-beta): point-to-point moves counted on the link class of (src, dst) at the sender's tx
  and the receiver's rx; a group of concurrent transfers (one round) takes ``max_g max(nv_tx, nv_rx) / B_nv`` or
  ``max(rdma_tx, rdma_rx) / B_rdma``, whichever is larger, plus the largest per-message latency ``alpha`` among
  its messages (``message_latency``: ``alpha_nv`` on NVLink, ``alpha_rdma`` on RDMA, both for a cross-rail
  message that hops over NVLink then RDMA). One message alone: ``alpha + bytes / B``. A round pays alpha once:
  its messages are posted together (one grouped NCCL launch, one DeepEP kernel, pipelined RDMA writes on the
  NIC's queue pairs), so their start-up latencies overlap, and the round ends when the most loaded link has
  drained, at least ``alpha`` after the start.
- **MoE all-to-all latency**: each (micro-batch, layer) cell runs ``ALL_TO_ALL_ROUNDS`` = 2 all-to-all rounds per
  pass (forward: dispatch and combine; backward: their mirror images), each paying the largest alpha among the
  (source, target) pairs that exchange tokens (``all_to_all_latency``); ``moe_comm_seconds`` adds them to
  ``max_g comm`` of the cost model. The planners' cost model (numba annealers) leaves them out: for a fixed
  EP group nearly every cell has traffic on every link class, so the term is the same for every plan.
- **Expert GEMMs by rows per expert**: with a measured ``ClusterSpec.gemm_curve`` the simulator charges GPU g's
  expert compute in a cell as ``sum_e rows_e x 6 h h' / F(rows_e)`` (``expert_compute_seconds``; rows_e: the
  (token, expert) pairs of expert e served on g, replicas included); without a curve ``6 h h' L_g / F``.
- **Expert moves** carry weights and optimizer state: ``3 h h' (dtype_bytes + optimizer_bytes_per_param)``
  bytes, ``DEFAULT_OPTIMIZER_BYTES_PER_PARAM`` = 12 (fp32 master weights, Adam's exp_avg and exp_avg_sq).
- **Replica transfers** (one rule, ``replica_push_overlap``, for the planners' pricing and the simulator
  alike): the gradient pull (same bytes as the push, other direction) hides behind the attention backward;
  the push hides behind the forward work it overlaps, which depends on when it can start
  (``REPLICA_FETCHES``): ``after-router`` (online replication without replay: the replicas are chosen from
  the router's output) behind the token dispatch only, half of ``max_g comm`` (dispatch and combine cost the
  same); ``per-layer`` (replay: the plan is known before the layer runs) behind
  ``max(attention forward, comm / 2)``: the push may start with the layer's attention, and a fetch known
  in advance can always be issued at least as late as the router's, so it is never charged more than an
  after-router fetch of the same bytes. The window is a max, not the sum ``A_fwd + comm / 2``: the weights
  must have arrived before the expert GEMMs, which start when the dispatch has delivered the tokens, and the
  dispatch shares the links the push uses. Only the excess is exposed.
"""

from __future__ import annotations

import numpy as np

from .cost_terms import on_nvlink, on_rdma, t_moe_seconds
from .errors import PlanError
from .specs import OVERLAPS, ClusterSpec, ModelSpec

__all__ = ["DEFAULT_OPTIMIZER_BYTES_PER_PARAM", "BACKWARD_FACTOR", "attention_flops", "local_stage",
           "attention_forward", "attention_backward", "moe_forward_seconds", "moe_backward_seconds",
           "moe_step_seconds", "STEP_COMP_WEIGHT", "OVERLAPS", "layer_step_seconds", "step_weights",
           "step_comp_weight", "MIN_STEP_WEIGHT", "exposed_seconds", "REPLICA_FETCHES", "REPLICA_MODES",
           "replica_push_overlap",
           "cell_step_seconds", "transfer_seconds", "move_bytes", "message_latency", "ALL_TO_ALL_ROUNDS",
           "all_to_all_latency", "moe_comm_seconds", "expert_compute_seconds"]

DEFAULT_OPTIMIZER_BYTES_PER_PARAM = 12.0
"""Optimizer-state bytes that move with each expert parameter: fp32 master weight + Adam's two moments."""

BACKWARD_FACTOR = 2.0
"""Backward FLOPs over forward FLOPs (attention and expert GEMMs: dX and dW)."""


def attention_flops(lengths: np.ndarray, model: ModelSpec) -> np.ndarray:
    """float64 ``[N]``: forward FLOPs of one attention layer for sequences of ``lengths`` tokens.

    ``2 S h d (2 n_q + 2 n_kv)`` (Q, K, V, O projections) ``+ 2 n_q d S (S + 1)`` (causal QK^T and PV).
    """
    s = np.asarray(lengths, dtype=np.float64)
    h, d, nq, nkv = float(model.hidden), float(model.head_dim), float(model.num_heads), float(model.num_kv_heads)
    return 2.0 * s * h * d * (2.0 * nq + 2.0 * nkv) + 2.0 * nq * d * s * (s + 1.0)


def local_stage(lengths: np.ndarray, micro_batch: np.ndarray, gpu: np.ndarray, num_micro_batches: int,
                model: ModelSpec, cluster: ClusterSpec) -> np.ndarray:
    """float64 ``[M, G]``: seconds of one layer's local stage (attention + shared experts) per micro-batch and GPU.

    ``local[m, g] = sum_{n on g in m} attn_flops(S_n) / F_attn + 6 h h'_s n_s T[m, g] / F`` (``n_s`` shared
    experts of width ``h'_s``, ``T[m, g]`` tokens on g).
    """
    lengths = np.asarray(lengths)
    mb = np.asarray(micro_batch, dtype=np.int64)
    gpu = np.asarray(gpu, dtype=np.int64)
    M, G = int(num_micro_batches), cluster.num_gpus
    attn = np.zeros((M, G))
    rates = cluster.rates(model)
    np.add.at(attn, (mb, gpu), attention_flops(lengths, model) / rates.attention_flops)
    if model.shared_experts:
        toks = np.zeros((M, G))
        np.add.at(toks, (mb, gpu), lengths.astype(np.float64))
        shared_ffn = model.shared_ffn or model.ffn
        attn += 6.0 * model.hidden * shared_ffn * model.shared_experts * toks / rates.expert_flops
    return attn


def attention_forward(lengths: np.ndarray, micro_batch: np.ndarray, gpu: np.ndarray, num_micro_batches: int,
                      model: ModelSpec, cluster: ClusterSpec) -> np.ndarray:
    """float64 ``[M]``: ``A_fwd[m] = max_g local[m, g]``, the per-layer attention forward the replica push overlaps."""
    attn = local_stage(lengths, micro_batch, gpu, num_micro_batches, model, cluster)
    return attn.max(axis=1) if attn.shape[0] else np.zeros(0)


def attention_backward(a_fwd: np.ndarray | float) -> np.ndarray | float:
    """``A_bwd = BACKWARD_FACTOR x A_fwd`` (seconds, any shape)."""
    return BACKWARD_FACTOR * a_fwd


def moe_forward_seconds(comp: np.ndarray | float, comm: np.ndarray | float) -> np.ndarray | float:
    """Forward MoE seconds of a cell: ``max_g comp + max_g comm`` (= T_MoE, ``cost_terms.t_moe_seconds``); arguments
    are the two maxima."""
    return t_moe_seconds.py_func(comp, comm)


def moe_backward_seconds(comp: np.ndarray | float, comm: np.ndarray | float) -> np.ndarray | float:
    """Backward MoE seconds of a cell: ``2 max_g comp + max_g comm`` (dX + dW GEMMs, mirrored all-to-all)."""
    return BACKWARD_FACTOR * comp + comm


def moe_step_seconds(comp: np.ndarray | float, comm: np.ndarray | float) -> np.ndarray | float:
    """Forward + backward MoE seconds of a cell: ``3 max_g comp + 2 max_g comm``."""
    return (1.0 + BACKWARD_FACTOR) * comp + 2.0 * comm


STEP_COMP_WEIGHT = (1.0 + BACKWARD_FACTOR) / 2.0
"""Compute weight of the planners' step objective ``STEP_COMP_WEIGHT x max_g comp + max_g comm``: half of
``moe_step_seconds`` (``3 comp + 2 comm``), so it ranks plans as the step's MoE time does; 1 gives T_MoE."""


def _megatron_pair(a: np.ndarray | float, c: np.ndarray | float, comm: np.ndarray | float) -> np.ndarray | float:
    """Seconds of one layer's forward beside one layer's backward under Megatron-LM's EP overlap (two streams).

    ``TransformerLayerSchedulePlan.run`` (megatron/core/models/common/model_chunk_schedule_plan.py) issues
    ``comm: combine_bwd | dispatch_fwd -> dispatch_bwd | combine_fwd`` and
    ``comp: attn_fwd | mlp_bwd (dX) -> mlp_bwd_dw -> mlp_fwd | attn_bwd``; each stream runs its nodes in that
    order and a node also waits for the one before it in its own pass (forward: attn -> dispatch -> mlp ->
    combine; backward: combine -> mlp dX -> dispatch, and attn after dispatch; the dW GEMM delayed,
    ``delay_wgrad_compute``). With ``X = max(a, C)`` (phase 1: attention forward beside the backward combine),
    the forward MLP, the backward dispatch and the forward combine all start ``X + max(max(dX, D) + D,
    max(dX + dW, D) + c)`` in, and the step ends ``max(C, 2a)`` after that (phase 3: attention backward beside
    the forward combine). Both passes' loads are the cell's own (the steady state of equal micro-batches).
    """
    half = 0.5 * comm  # dispatch = combine
    dx = c
    dw = (BACKWARD_FACTOR - 1.0) * c
    mid = np.maximum(np.maximum(dx, half) + half, np.maximum(dx + dw, half) + c)
    return np.maximum(a, half) + mid + np.maximum(attention_backward(a), half)


def layer_step_seconds(attn_fwd: np.ndarray | float, comp: np.ndarray | float, comm: np.ndarray | float,
                       overlap: str = "none") -> np.ndarray | float:
    """Forward + backward seconds of one (micro-batch, layer) cell, its local stage included, under the trainer's
    compute / all-to-all ``overlap`` (``OVERLAPS``; any shapes, broadcast): the one overlap rule of the simulator
    and the planners (docs/method.md, "Overlap").

    ``attn_fwd``: A_fwd (slowest GPU's local stage); ``comp``: max_g forward expert GEMM seconds; ``comm``:
    max_g dispatch + combine seconds of one pass. ``none``: ``A_fwd + A_bwd + moe_step_seconds`` (back to back);
    ``megatron``: ``_megatron_pair``; ``dualpipe``: ``max(A_fwd + A_bwd + 3 comp, 2 comm)`` (every all-to-all
    hidden behind the other pass's compute where there is enough of it; the SMs DeepEP takes from the GEMMs are
    not charged). Every rule is convex, positively homogeneous and non-decreasing in each argument.
    """
    if overlap == "none":
        return attn_fwd + attention_backward(attn_fwd) + moe_step_seconds(comp, comm)
    if overlap == "megatron":
        return _megatron_pair(attn_fwd, comp, comm)
    if overlap == "dualpipe":
        compute = attn_fwd + attention_backward(attn_fwd) + (1.0 + BACKWARD_FACTOR) * comp
        return np.maximum(compute, 2.0 * comm)
    raise PlanError(f"overlap {overlap!r} is not one of {OVERLAPS}")


MIN_STEP_WEIGHT = 0.05
"""Floor of either weight relative to the other in ``step_comp_weight``: where the overlap hides all of a cell's
all-to-all (or all of its expert compute), a plan must still not buy the other term with an unbounded amount of
the hidden one, which would stop being hidden."""


def step_weights(overlap: str, attn_fwd: float = 1.0, comp: float = 1.0, comm: float = 1.0) -> tuple[float, float]:
    """``(w_comp, w_comm)``: seconds of ``layer_step_seconds`` per second of ``comp`` and of ``comm`` around the
    operating point ``(attn_fwd, comp, comm)``: the secant slopes from 0 to twice the point's value (exact for
    the linear ``none`` rule: ``(3, 2)``)."""
    def f(c: float, m: float) -> float:
        return float(layer_step_seconds(attn_fwd, c, m, overlap))

    w_comp = (f(2.0 * comp, comm) - f(0.0, comm)) / (2.0 * comp) if comp > 0 else 0.0
    w_comm = (f(comp, 2.0 * comm) - f(comp, 0.0)) / (2.0 * comm) if comm > 0 else 0.0
    return w_comp, w_comm


def step_comp_weight(overlap: str = "none", attn_fwd: float = 1.0, comp: float = 1.0, comm: float = 1.0) -> float:
    """The planners' compute weight (their objective is ``w x max_g comp + max_g comm``): ``w_comp / w_comm`` of
    ``step_weights`` at the operating point, clipped to ``[MIN_STEP_WEIGHT, 1 / MIN_STEP_WEIGHT]``. ``none`` is
    linear, so every point gives ``STEP_COMP_WEIGHT`` (evaluated at the unit point, exactly 1.5)."""
    if overlap == "none":
        attn_fwd = comp = comm = 1.0
    w_comp, w_comm = step_weights(overlap, attn_fwd, comp, comm)
    if w_comp <= 0 and w_comm <= 0:
        return STEP_COMP_WEIGHT
    return float(np.clip(w_comp / max(w_comm, 1e-300), MIN_STEP_WEIGHT, 1.0 / MIN_STEP_WEIGHT))


def exposed_seconds(transfer: np.ndarray | float, overlap: np.ndarray | float) -> np.ndarray | float:
    """The part of a transfer not hidden behind work it overlaps: ``max(0, transfer - overlap)`` (seconds)."""
    return np.maximum(0.0, transfer - overlap)


REPLICA_FETCHES = ("per-layer", "after-router")
"""When a cell's replica push can start: with the layer (``per-layer``, the plan is known ahead from the replay),
or once the layer's router has run (``after-router``, online replication without replay)."""

REPLICA_MODES = ("auto", "per-layer", "persistent", "after-router")
"""The simulator's replica modes (``sim.simulate_loads``, ``relibra simulate --replica-mode``): the two fetches
above, refilled per (micro-batch, layer); ``persistent`` (EPLB-style redundant experts pushed once per batch);
``auto`` (chosen from the plan)."""


def replica_push_overlap(attn_fwd: np.ndarray | float, comm: np.ndarray | float,
                         fetch: str = "per-layer") -> np.ndarray | float:
    """Seconds of forward work a cell's replica push hides behind (any shape, broadcast): the one fetch-window
    rule of the planners and the simulator.

    ``after-router`` (the push starts after the router, so it cannot overlap the attention): the token dispatch,
    ``comm / 2`` (``comm`` is ``max_g comm``, dispatch + combine). ``per-layer`` (replay: the replicas are known
    before the layer runs): ``max(attn_fwd, comm / 2)``, the attention forward or, where the dispatch is longer,
    the same window as the after-router fetch (a fetch known in advance can start at least as late as the
    router's), so a replay-driven fetch is never charged more than an after-router one of the same bytes.
    """
    if fetch == "per-layer":
        return np.maximum(attn_fwd, 0.5 * comm)
    if fetch == "after-router":
        return 0.5 * comm
    raise PlanError(f"replica fetch {fetch!r} is not one of {REPLICA_FETCHES}")


def cell_step_seconds(comp: float, comm: float, push: float, attn_fwd: float, fetch: str = "per-layer",
                      overlap: str = "none") -> float:
    """Forward + backward seconds of one (micro-batch, layer) cell beyond its local stage, as the simulator charges
    them: ``moe_step_seconds`` (under the trainer's ``overlap``: ``layer_step_seconds`` less the local stage
    ``A_fwd + A_bwd``, which the overlap rule may hide MoE work behind) plus the replica push not hidden behind
    ``replica_push_overlap(attn_fwd, comm, fetch)`` and the gradient pull (same time) not hidden behind the
    backward ``attention_backward(attn_fwd)``."""
    if overlap == "none":
        moe = moe_step_seconds(comp, comm)
    else:
        moe = layer_step_seconds(attn_fwd, comp, comm, overlap) - attn_fwd - attention_backward(attn_fwd)
    return float(moe + exposed_seconds(push, replica_push_overlap(attn_fwd, comm, fetch))
                 + exposed_seconds(push, attention_backward(attn_fwd)))


def message_latency(link_class: np.ndarray, cluster: ClusterSpec) -> np.ndarray:
    """float64, the shape of ``link_class`` (codes ``specs.LOC / NV / SR / CR``): seconds one message pays before
    its bytes flow: 0 on the same GPU, ``alpha_nv`` (``nvlink_latency``) over NVLink, ``alpha_rdma``
    (``rdma_latency``) over RDMA to the same rail, ``alpha_nv + alpha_rdma`` across rails (the NVLink hop to the
    rail GPU, then RDMA, one after the other)."""
    a_nv, a_rdma = float(cluster.nvlink_latency), float(cluster.rdma_latency)
    table = np.array([0.0, a_nv, a_rdma, a_nv + a_rdma])
    return table[np.asarray(link_class, dtype=np.int64)]


ALL_TO_ALL_ROUNDS = 2
"""All-to-all rounds of one MoE pass per (micro-batch, layer): the dispatch and the combine (forward), their
mirror images (backward). Each pays its latency once (``all_to_all_latency``)."""


def all_to_all_latency(flow: np.ndarray, cluster: ClusterSpec) -> np.ndarray:
    """float64 ``[...]``: latency seconds of one all-to-all round per cell of ``flow`` ``[..., G, G]`` (tokens
    j -> g): the largest ``message_latency`` among the (j, g) pairs with tokens (0 where none cross a link).
    Every GPU posts its messages to all peers at once (Megatron's grouped NCCL send / recv, DeepEP's kernels), so
    their latencies overlap and the round pays the slowest message's alpha once."""
    flow = np.asarray(flow)
    lat = message_latency(cluster.link_classes, cluster)  # [G, G]
    if not lat.any():
        return np.zeros(flow.shape[:-2])
    return np.where(flow > 0, lat, 0.0).max(axis=(-2, -1), initial=0.0)


def moe_comm_seconds(comm_max: np.ndarray | float, flow: np.ndarray, cluster: ClusterSpec) -> np.ndarray | float:
    """Communication seconds of one MoE pass per cell: the cost model's ``max_g comm`` (dispatch + combine bytes
    at bandwidth) plus ``ALL_TO_ALL_ROUNDS x all_to_all_latency(flow)``; exactly ``comm_max`` when the cluster's
    latencies are 0."""
    if not (cluster.nvlink_latency or cluster.rdma_latency):
        return comm_max
    return comm_max + ALL_TO_ALL_ROUNDS * all_to_all_latency(flow, cluster)


def expert_compute_seconds(rows: np.ndarray, model: ModelSpec, cluster: ClusterSpec) -> np.ndarray:
    """float64 ``[...]``: forward expert-GEMM seconds of a GPU from the rows of each expert it serves, ``rows``
    ``[..., E]`` ((token, expert) pairs): ``sum_e rows_e x 6 h h' / F(rows_e)``, ``F`` =
    ``ClusterSpec.expert_flops_at`` (the measured ``gemm_curve``; ``flops`` without one). Experts with no rows
    cost nothing."""
    rows = np.asarray(rows, dtype=np.float64)
    rate = cluster.expert_flops_at(rows)
    return (rows * model.flops_per_token_expert / rate).sum(axis=-1)


def transfer_seconds(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray | float, group: np.ndarray | None,
                     num_groups: int, cluster: ClusterSpec) -> np.ndarray:
    """float64 ``[num_groups]``: time of point-to-point transfers that run concurrently within a group.

    Transfer i moves ``nbytes[i]`` from GPU ``src[i]`` to ``dst[i]``; it is counted on the link class
    of (src, dst) as in the cost model (nv: NVLink, sr: RDMA, cr: both; loc: nothing) at the sender's
    tx and the receiver's rx. A group's time is ``max_g max(nv_tx, nv_rx) / B_nv`` or
    ``max(rdma_tx, rdma_rx) / B_rdma``, whichever is larger, plus the largest ``message_latency`` of its
    transfers (one round: their latencies overlap; the module docstring). One transfer: ``alpha + bytes / B``.
    """
    src = np.asarray(src, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst, dtype=np.int64).reshape(-1)
    nb = np.broadcast_to(np.asarray(nbytes, dtype=np.float64), src.shape)
    grp = np.zeros_like(src) if group is None else np.asarray(group, dtype=np.int64).reshape(-1)
    G = cluster.num_gpus
    cls = cluster.link_classes[src, dst] if len(src) else np.zeros(0, np.int8)
    on_nv = on_nvlink.py_func(cls)
    on_rd = on_rdma.py_func(cls)
    acc = np.zeros((4, num_groups, G))
    np.add.at(acc[0], (grp[on_nv], src[on_nv]), nb[on_nv])
    np.add.at(acc[1], (grp[on_nv], dst[on_nv]), nb[on_nv])
    np.add.at(acc[2], (grp[on_rd], src[on_rd]), nb[on_rd])
    np.add.at(acc[3], (grp[on_rd], dst[on_rd]), nb[on_rd])
    nv = np.maximum(acc[0], acc[1]).max(axis=-1, initial=0.0) / cluster.nvlink_bw
    rdma = np.maximum(acc[2], acc[3]).max(axis=-1, initial=0.0) / cluster.rdma_bw
    out = np.maximum(nv, rdma)
    if cluster.nvlink_latency or cluster.rdma_latency:
        lat = np.zeros(num_groups)
        np.maximum.at(lat, grp, message_latency(cls, cluster))
        out = out + lat
    return out


def move_bytes(model: ModelSpec, optimizer_bytes_per_param: float = DEFAULT_OPTIMIZER_BYTES_PER_PARAM) -> float:
    """Bytes one expert's move carries: ``3 h h' (dtype_bytes + optimizer_bytes_per_param)``, weights + optimizer."""
    return float(model.expert_params * (model.dtype_bytes + float(optimizer_bytes_per_param)))
