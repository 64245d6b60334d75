"""Step-time simulator: how long one training step of a global batch takes under a ``BatchPlan``.

The simulator walks the step the way the trainer runs it (DESIGN.md, "The data flow of one RL step"):
once per global batch the experts are re-laid out, then for every micro-batch m and MoE layer l the
forward pass and, later, the backward pass run. Every constant comes from ``ModelSpec`` and
``ClusterSpec`` (``F`` = ``cluster.flops``, ``F_attn`` = ``cluster.attention_flops``, ``B_nv`` =
``cluster.nvlink_bw``, ``B_rdma`` = ``cluster.rdma_bw``); the formulas:

**Attention (per layer, per sequence of S tokens, forward FLOPs).** With h hidden, n_q query heads,
n_kv key/value heads, d head dim:

- projections: Q and O are ``h x n_q d`` GEMMs, K and V are ``h x n_kv d``:
  ``2 S h d (2 n_q + 2 n_kv)``;
- causal attention: S(S+1)/2 (query, key) pairs, each costs a dot product for ``QK^T`` and an axpy
  for ``PV`` over d elements in each of the n_q heads: ``2 n_q d S (S+1)``.

On GPU g in micro-batch m the *local* stage of one layer takes
``local[m, g] = sum_{n on g in m} attn_flops(S_n) / F_attn + shared[m, g]``, where
``shared[m, g] = 6 h h'_s n_s T[m, g] / F`` is the always-on shared experts' forward (``n_s``
shared experts of width ``h'_s``; ``T[m, g]`` tokens on g). The slowest GPU gates the all-to-all:
``A_fwd[m] = max_g local[m, g]``. The backward pass costs twice the forward FLOPs:
``A_bwd[m] = 2 A_fwd[m]``.

**MoE (per micro-batch and layer).** ``x[m, l, j, e]`` tokens of source GPU j routed to expert e; the
plan's placement and replica shares turn it into the flow ``F[m, l, j, g]`` (tokens j -> g, see
``plan_flow``), and ``relibra_moe.cost.cost_from_flow`` gives ``comp[m, l, g]`` and ``comm[m, l, g]``
(dispatch + combine) of RELIBRA.md §4. Forward: ``T_fwd = max_g comp + max_g comm`` (= ``T_MoE``).
Backward: the expert GEMMs cost twice the forward (dX and dW) and the all-to-all is the mirror image
of the forward one (the same bytes with tx and rx swapped, so the same time):
``T_bwd = 2 max_g comp + max_g comm``.

**Replica transfers (RELIBRA.md §7).** A filled replica slot of GPU g holding expert e (home h)
moves ``expert_bytes = 3 h h' x dtype_bytes``: forward, the weights h -> g; backward, the weight
gradient g -> h. Each transfer is counted on the link class of (h, g) like a token in the cost model
(nv on NVLink, sr on RDMA, cr on both, at the sender's tx and the receiver's rx), and the transfer
time of a group of transfers is ``max_g max(nv_tx/B_nv, nv_rx/B_nv, rdma_tx/B_rdma, rdma_rx/B_rdma)``.
Two modes:

- ``per-layer`` (the layer-shared replica buffer): the slots are refilled for every (m, l); the push
  overlaps with that layer's attention forward and the gradient pull with its attention backward,
  so only the excess counts: ``max(0, push[m, l] - A_fwd[m])`` and ``max(0, pull[m, l] - A_bwd[m])``.
- ``persistent`` (EPLB-style redundant experts that stay resident for the whole batch): every
  layer's replicas are pushed once before the first micro-batch and their gradients pulled once after
  the last: ``2 x transfer(all replicas of all layers)``, not overlapped.
- ``after-router`` (online replication without replay, ``planners.online``): the slots are refilled for
  every (m, l) as in ``per-layer``, but the push starts only once the layer's router has run, so it overlaps
  the token dispatch (half of ``max_g comm``) and not the attention: ``max(0, push[m, l] - comm[m, l] / 2)``;
  the gradient pull overlaps the attention backward as in ``per-layer``.

``replica_mode="auto"`` picks ``after-router`` for plans whose ``stats["replica_fetch"]`` says so,
``persistent`` when there are several micro-batches and the replica
slots hold the same experts in every micro-batch, else ``per-layer``.

**Reorder (once per batch).** Expert (l, e) moves when the plan's home differs from the previous
placement (default: the static Megatron placement). It carries its weights and optimizer state,
``3 h h' (dtype_bytes + optimizer_bytes_per_param)`` bytes (default 12 bytes/param: fp32 master
weights, Adam's exp_avg and exp_avg_sq), from the old home to the new one; the time is the transfer
time above over all moved experts, not overlapped.

**Step.** ``step = sum_m sum_l (A_fwd[m] + T_fwd[m, l] + push_exposed[m, l]
+ A_bwd[m] + T_bwd[m, l] + pull_exposed[m, l]) + persistent + reorder``; ``tokens_per_s`` is the
batch's token count over ``step``.

Not modelled: dense (non-MoE) layers, router GEMMs, norms, embeddings and the LM head (the same for
every plan), pipeline parallelism (one EP group runs all L MoE layers), the optimizer step itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from .cost import cost_from_flow
from .errors import PlanError
from .plan import BatchPlan, Placement
from .specs import CR, NV, SR, ClusterSpec, ModelSpec

ReplicaMode = Literal["auto", "per-layer", "persistent", "after-router"]
DEFAULT_OPTIMIZER_BYTES_PER_PARAM = 12.0


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

    ``local[m, g] = sum_{n on g in m} attn_flops(S_n) / F_attn + 6 h h'_s n_s T[m, g] / F`` (module docstring).
    """
    lengths = np.asarray(lengths)
    mb = np.asarray(micro_batch, dtype=np.int64)
    gpu = np.asarray(gpu, dtype=np.int64)
    M, G = int(num_micro_batches), cluster.num_gpus
    attn = np.zeros((M, G))
    np.add.at(attn, (mb, gpu), attention_flops(lengths, model) / cluster.attention_flops)
    if model.shared_experts:
        toks = np.zeros((M, G))
        np.add.at(toks, (mb, gpu), lengths.astype(np.float64))
        shared_ffn = model.shared_ffn or model.ffn
        attn += 6.0 * model.hidden * shared_ffn * model.shared_experts * toks / cluster.flops
    return attn


def attention_forward(lengths: np.ndarray, micro_batch: np.ndarray, gpu: np.ndarray, num_micro_batches: int,
                      model: ModelSpec, cluster: ClusterSpec) -> np.ndarray:
    """float64 ``[M]``: ``A_fwd[m] = max_g local[m, g]``, the per-layer attention forward the replica push overlaps."""
    attn = local_stage(lengths, micro_batch, gpu, num_micro_batches, model, cluster)
    return attn.max(axis=1) if attn.shape[0] else np.zeros(0)


def plan_flow(plan: BatchPlan, x: np.ndarray) -> np.ndarray:
    """float64 ``[M, L, G, G]``: tokens sent from source GPU j to serving GPU g under the plan, for loads
    ``x [M, L, G, E]`` (``planners.scoring.plan_flow``, the one implementation ``relibra score`` uses too)."""
    from .planners.scoring import plan_flow as _plan_flow

    return _plan_flow(plan, x)


def uniform_loads(x: np.ndarray) -> np.ndarray:
    """float64 ``[M, L, G, E]``: the Balanced ideal of the same batch (RELIBRA.md §8).

    Every (micro-batch, layer) keeps its total of (token, expert) pairs, spread evenly over the G
    sources and the E experts, as if every token's k experts were drawn uniformly and every GPU ran
    the same number of tokens: ``x'[m, l, j, e] = sum_{j, e} x[m, l, j, e] / (G E)``.
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 4:
        raise PlanError(f"loads x must be [M, L, G, E], got shape {x.shape}")
    G, E = x.shape[2:]
    return np.broadcast_to(x.sum(axis=(2, 3), keepdims=True) / (G * E), x.shape).copy()


def transfer_seconds(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray | float, group: np.ndarray | None,
                     num_groups: int, cluster: ClusterSpec) -> np.ndarray:
    """float64 ``[num_groups]``: time of point-to-point transfers that run concurrently within a group.

    Transfer i moves ``nbytes[i]`` from GPU ``src[i]`` to ``dst[i]``; it is counted on the link class
    of (src, dst) as in the cost model (nv: NVLink, sr: RDMA, cr: both; loc: nothing) at the sender's
    tx and the receiver's rx. A group's time is ``max_g max(nv_tx, nv_rx) / B_nv`` or
    ``max(rdma_tx, rdma_rx) / B_rdma``, whichever is larger.
    """
    src = np.asarray(src, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst, dtype=np.int64).reshape(-1)
    nb = np.broadcast_to(np.asarray(nbytes, dtype=np.float64), src.shape)
    grp = np.zeros_like(src) if group is None else np.asarray(group, dtype=np.int64).reshape(-1)
    G = cluster.num_gpus
    cls = cluster.link_classes[src, dst] if len(src) else np.zeros(0, np.int8)
    on_nv = (cls == NV) | (cls == CR)
    on_rdma = (cls == SR) | (cls == CR)
    acc = np.zeros((4, num_groups, G))
    np.add.at(acc[0], (grp[on_nv], src[on_nv]), nb[on_nv])
    np.add.at(acc[1], (grp[on_nv], dst[on_nv]), nb[on_nv])
    np.add.at(acc[2], (grp[on_rdma], src[on_rdma]), nb[on_rdma])
    np.add.at(acc[3], (grp[on_rdma], dst[on_rdma]), nb[on_rdma])
    nv = np.maximum(acc[0], acc[1]).max(axis=-1, initial=0.0) / cluster.nvlink_bw
    rdma = np.maximum(acc[2], acc[3]).max(axis=-1, initial=0.0) / cluster.rdma_bw
    return np.maximum(nv, rdma)


def reorder_traffic(previous: Placement, placement: Placement, model: ModelSpec, cluster: ClusterSpec,
                    optimizer_bytes_per_param: float = DEFAULT_OPTIMIZER_BYTES_PER_PARAM) -> tuple[float, int, float]:
    """Once-per-batch re-layout: ``(seconds, experts moved, bytes moved)``.

    Each moved expert carries ``3 h h' (dtype_bytes + optimizer_bytes_per_param)`` bytes from its old
    home to its new one; the time is ``transfer_seconds`` of all moves together.
    """
    if previous.expert_gpu.shape != placement.expert_gpu.shape:
        raise PlanError(f"previous placement has shape {previous.expert_gpu.shape}, the plan's "
                        f"{placement.expert_gpu.shape}")
    moved = previous.expert_gpu != placement.expert_gpu
    n = int(moved.sum())
    per_expert = model.expert_params * (model.dtype_bytes + float(optimizer_bytes_per_param))
    if n == 0:
        return 0.0, 0, 0.0
    t = transfer_seconds(previous.expert_gpu[moved], placement.expert_gpu[moved], per_expert, None, 1, cluster)
    return float(t[0]), n, n * per_expert


@dataclass(frozen=True)
class StepTime:
    """Simulated time of one training step. Seconds unless said otherwise; sums run over (m, l).

    Attributes:
        step_s: the whole step.
        tokens: tokens in the batch (sum of sequence lengths).
        tokens_per_s: ``tokens / step_s``.
        attention_fwd_s, attention_bwd_s: local stage (attention + shared experts), slowest GPU.
        moe_fwd_comp_s, moe_fwd_comm_s: ``sum max_g comp`` and ``sum max_g comm`` of the forward MoE.
        moe_bwd_comp_s, moe_bwd_comm_s: the same for the backward (2x compute, mirrored all-to-all).
        replica_push_s, replica_pull_s: per-layer replica transfers before overlap (0 when persistent).
        replica_exposed_s: the part of the replica transfers not hidden behind attention (per-layer
            mode) or the whole once-per-batch transfer (persistent mode).
        reorder_s: once-per-batch expert re-layout (weights + optimizer state).
        experts_moved, reorder_bytes: what the re-layout moves.
        replica_mode: "per-layer", "persistent" or "after-router".
        micro_batch_s: ``[M]`` seconds of each micro-batch (forward + backward, all layers).
        t_moe: ``[M, L]`` forward T_MoE; rank_skew: ``[M, L]`` max GPU load / mean GPU load.
        gpu_load: ``[M, L, G]`` (token, expert) pairs computed on each GPU (L_g of the cost model).
        attention_fwd: ``[M]`` A_fwd per layer.
    """

    step_s: float
    tokens: int
    tokens_per_s: float
    attention_fwd_s: float
    attention_bwd_s: float
    moe_fwd_comp_s: float
    moe_fwd_comm_s: float
    moe_bwd_comp_s: float
    moe_bwd_comm_s: float
    replica_push_s: float
    replica_pull_s: float
    replica_exposed_s: float
    reorder_s: float
    experts_moved: int
    reorder_bytes: float
    replica_mode: str
    micro_batch_s: np.ndarray = field(repr=False)
    t_moe: np.ndarray = field(repr=False)
    rank_skew: np.ndarray = field(repr=False)
    attention_fwd: np.ndarray = field(repr=False)
    gpu_load: np.ndarray = field(repr=False, default_factory=lambda: np.zeros((0, 0, 0)))

    @property
    def breakdown(self) -> dict[str, float]:
        """Seconds per component; they add up to ``step_s``."""
        return {
            "attention_fwd": self.attention_fwd_s, "attention_bwd": self.attention_bwd_s,
            "moe_fwd_comp": self.moe_fwd_comp_s, "moe_fwd_comm": self.moe_fwd_comm_s,
            "moe_bwd_comp": self.moe_bwd_comp_s, "moe_bwd_comm": self.moe_bwd_comm_s,
            "replica_exposed": self.replica_exposed_s, "reorder": self.reorder_s,
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (arrays as lists, ``breakdown`` included)."""
        return {
            "step_s": self.step_s, "tokens": self.tokens, "tokens_per_s": self.tokens_per_s,
            "breakdown": self.breakdown, "replica_mode": self.replica_mode,
            "replica_push_s": self.replica_push_s, "replica_pull_s": self.replica_pull_s,
            "experts_moved": self.experts_moved, "reorder_bytes": self.reorder_bytes,
            "t_moe_fwd_s": float(self.t_moe.sum()), "rank_skew_mean": float(self.rank_skew.mean()),
            "micro_batch_s": self.micro_batch_s.tolist(),
        }


def _resolve_replica_mode(plan: BatchPlan, mode: str) -> str:
    if mode not in ("auto", "per-layer", "persistent", "after-router"):
        raise PlanError(f"replica_mode {mode!r} is not one of ('auto', 'per-layer', 'persistent', 'after-router')")
    if mode != "auto":
        return mode
    if plan.stats.get("replica_fetch") == "after-router":
        return "after-router"
    rep = plan.replicas.replica_expert
    if rep.shape[0] > 1 and (rep >= 0).any() and bool((rep == rep[:1]).all()):
        return "persistent"
    return "per-layer"


def simulate_loads(plan: BatchPlan, lengths: np.ndarray, x: np.ndarray, model: ModelSpec, cluster: ClusterSpec,
                   *, previous: Placement | None = None,
                   optimizer_bytes_per_param: float = DEFAULT_OPTIMIZER_BYTES_PER_PARAM,
                   replica_mode: ReplicaMode = "auto") -> StepTime:
    """Simulate one step from sequence lengths and loads (see the module docstring for the formulas).

    Args:
        plan: the batch's plan (placement, sample placement, replicas); checked against the specs.
        lengths: int ``[N]`` tokens of each sequence (sample n runs on ``plan.samples.gpu[n]`` in
            micro-batch ``plan.samples.micro_batch[n]``).
        x: ``[M, L, G, E]`` tokens of source GPU j routed to expert e per micro-batch and MoE layer,
            for that same sample placement (``TraceBatch.loads``).
        previous: placement before this batch (default: static); the re-layout moves the difference.
        optimizer_bytes_per_param: optimizer-state bytes that move with each expert parameter.
        replica_mode: "auto", "per-layer", "persistent" or "after-router" (see the module docstring).
    """
    G, L, E = cluster.num_gpus, model.num_layers, model.num_experts
    lengths = np.asarray(lengths)
    x = np.asarray(x)
    if lengths.ndim != 1 or lengths.shape[0] != plan.samples.num_samples:
        raise PlanError(f"lengths has shape {lengths.shape}, the plan places {plan.samples.num_samples} samples")
    if lengths.size and lengths.min() < 0:
        raise PlanError(f"lengths holds a negative length {int(lengths.min())}")
    M = plan.num_micro_batches
    if x.shape != (M, L, G, E):
        raise PlanError(f"loads x has shape {x.shape}, expected [M={M}, L={L}, G={G}, E={E}] for this plan")
    from .planners.split import check_token_counts

    check_token_counts("x", x)
    plan.validate(model, cluster, lengths.shape[0])
    opt = optimizer_bytes_per_param
    if isinstance(opt, bool) or not isinstance(opt, (int, float, np.number)) or not (np.isfinite(opt) and opt >= 0):
        raise PlanError(f"optimizer_bytes_per_param={opt!r} must be a finite number >= 0")
    if previous is not None:
        if not isinstance(previous, Placement):
            raise PlanError(f"previous must be a Placement (or None for static), got {type(previous).__name__}")
        try:
            previous.validate(model, cluster)
        except PlanError as exc:
            raise PlanError(f"previous placement: {exc}") from None

    # Local stage: attention (+ shared experts) per (m, g); the slowest GPU counts.
    a_fwd = attention_forward(lengths, plan.samples.micro_batch, plan.samples.gpu, M, model, cluster)  # [M]
    a_bwd = 2.0 * a_fwd

    # MoE forward / backward from the plan's flow.
    cost = cost_from_flow(plan_flow(plan, x), model, cluster)
    comp_max = cost.comp.max(axis=-1)  # [M, L]
    comm_max = cost.comm.max(axis=-1)
    t_fwd = comp_max + comm_max
    t_bwd = 2.0 * comp_max + comm_max

    # Replica transfers.
    mode = _resolve_replica_mode(plan, replica_mode)
    rep = plan.replicas.replica_expert  # [M, L, G, r]
    filled = np.argwhere(rep >= 0)
    push = np.zeros((M, L))
    exposed_fwd = np.zeros((M, L))
    exposed_bwd = np.zeros((M, L))
    persistent_s = 0.0
    if len(filled):
        fm, fl, fg, fs = filled.T
        fe = rep[fm, fl, fg, fs]
        fh = plan.placement.expert_gpu[fl, fe]
        if mode in ("per-layer", "after-router"):
            push = transfer_seconds(fh, fg, model.expert_bytes, fm * L + fl, M * L, cluster).reshape(M, L)
            hidden_fwd = a_fwd[:, None] if mode == "per-layer" else 0.5 * comm_max
            exposed_fwd = np.maximum(0.0, push - hidden_fwd)
            exposed_bwd = np.maximum(0.0, push - a_bwd[:, None])
        else:
            once = fm == 0
            persistent_s = 2.0 * float(transfer_seconds(fh[once], fg[once], model.expert_bytes, None, 1,
                                                        cluster)[0])
    pull = push  # the gradient has the weights' size and goes the other way: same link time

    prev = previous if previous is not None else Placement.static(L, E, G)
    reorder_s, moved, moved_bytes = reorder_traffic(prev, plan.placement, model, cluster, optimizer_bytes_per_param)

    per_mb = (L * (a_fwd + a_bwd) + (t_fwd + t_bwd + exposed_fwd + exposed_bwd).sum(axis=1))
    step = float(per_mb.sum()) + persistent_s + reorder_s
    tokens = int(lengths.sum())
    return StepTime(
        step_s=step, tokens=tokens, tokens_per_s=tokens / step if step > 0 else 0.0,
        attention_fwd_s=float(L * a_fwd.sum()), attention_bwd_s=float(L * a_bwd.sum()),
        moe_fwd_comp_s=float(comp_max.sum()), moe_fwd_comm_s=float(comm_max.sum()),
        moe_bwd_comp_s=float(2.0 * comp_max.sum()), moe_bwd_comm_s=float(comm_max.sum()),
        replica_push_s=float(push.sum()), replica_pull_s=float(pull.sum()),
        replica_exposed_s=float(exposed_fwd.sum() + exposed_bwd.sum()) + persistent_s,
        reorder_s=reorder_s, experts_moved=moved, reorder_bytes=moved_bytes, replica_mode=mode,
        micro_batch_s=per_mb, t_moe=cost.t_moe, rank_skew=cost.rank_skew, attention_fwd=a_fwd,
        gpu_load=cost.load)


def balanced_ideal_loads(plan: BatchPlan, batch: Any, model: ModelSpec, cluster: ClusterSpec) -> np.ndarray:
    """int64 ``[M, L, G, E]``: the Balanced ideal of ``batch`` (RELIBRA.md §8), as ``relibra score`` defines it
    (``planners.scoring.balanced_plan_loads``: uniform random experts seeded by ``plan.stats["seed"]``, each
    source keeping the plan's tokens, or an even split with ``stats["balanced_sources"] == "even"``)."""
    from .planners.scoring import balanced_plan_loads

    return balanced_plan_loads(plan, batch, model, cluster.num_gpus)


def plan_loads(plan: BatchPlan, batch: Any, cluster: ClusterSpec) -> np.ndarray:
    """int64 ``[M, L, G, E]``: the batch's loads under the plan's sample placement (M = the plan's;
    ``planners.scoring.plan_loads``)."""
    from .planners.scoring import plan_loads as _plan_loads

    return _plan_loads(plan, batch, cluster.num_gpus)


def simulate_step(plan: BatchPlan, batch: Any, model: ModelSpec, cluster: ClusterSpec, *,
                  balanced: bool | None = None, **kwargs: Any) -> StepTime:
    """Simulate one step of ``batch`` (a ``TraceBatch``) under ``plan``; keyword args as ``simulate_loads``.

    The loads follow the plan's sample placement (``plan_loads``). ``balanced`` (default: whether
    ``plan.stats["strategy"] == "balanced"``) replaces them by the Balanced ideal's
    (``balanced_ideal_loads``), as ``relibra score`` does; attention still runs the real sequences.
    """
    from .planners.scoring import check_plan_batch

    check_plan_batch(plan, batch, model)
    if balanced is None:
        balanced = plan.stats.get("strategy") == "balanced"
    x = plan_loads(plan, batch, cluster)
    if balanced:
        x = balanced_ideal_loads(plan, batch, model, cluster)
    return simulate_loads(plan, batch.lengths, x, model, cluster, **kwargs)
