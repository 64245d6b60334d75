"""Step-time simulator: how long one training step of a global batch takes under a ``BatchPlan``.

The simulator walks the step the way the trainer runs it (docs/architecture.md, "The data flow of one RL
step"): once per global batch the experts are re-laid out, then for every micro-batch m and MoE layer l
the forward pass and, later, the backward pass run. The arithmetic of each term (attention FLOPs, the
MoE forward / backward formula, transfer times, move bytes) is defined once in ``relibra_moe.timing``;
this module assembles it over the plan (docs/method.md, "Step time").

**Local stage.** On GPU g in micro-batch m one layer's attention plus shared experts take
``local[m, g]`` (``timing.local_stage``); the slowest GPU gates the all-to-all:
``A_fwd[m] = max_g local[m, g]`` and ``A_bwd[m] = 2 A_fwd[m]``.

**MoE (per micro-batch and layer).** ``x[m, l, j, e]`` tokens of source GPU j routed to expert e; the
plan's placement and replica shares turn it into the flow ``F[m, l, j, g]`` (tokens j -> g, see
``evaluate.plan_flow``), and ``relibra_moe.cost.cost_from_flow`` gives ``comp[m, l, g]`` and ``comm[m, l, g]``
(dispatch + combine; docs/method.md, "Cost model"). With per-message latencies (``ClusterSpec.nvlink_latency`` /
``rdma_latency``) ``comm`` also pays the dispatch's and the combine's latency (``timing.moe_comm_seconds``); with a
measured ``ClusterSpec.gemm_curve`` ``comp[m, l, g]`` charges each expert's rows on g at the curve's rate for that
many rows (``timing.expert_compute_seconds`` over ``evaluate.plan_expert_rows``) instead of one rate.
Forward: ``T_fwd = max_g comp + max_g comm`` (= ``T_MoE``).
Backward: the expert GEMMs cost twice the forward (dX and dW) and the all-to-all is the mirror image
of the forward one (the same bytes with tx and rx swapped, so the same time):
``T_bwd = 2 max_g comp + max_g comm``.

**Replica transfers (docs/method.md, "Replica traffic").** A filled replica slot of GPU g holding expert e (home h)
moves ``expert_bytes = 3 h h' x dtype_bytes``: forward, the weights h -> g; backward, the weight
gradient g -> h. Each transfer is counted on the link class of (h, g) like a token in the cost model
(nv on NVLink, sr on RDMA, cr on both, at the sender's tx and the receiver's rx), and the transfer
time of a group of transfers is ``max_g max(nv_tx/B_nv, nv_rx/B_nv, rdma_tx/B_rdma, rdma_rx/B_rdma)``
(``timing.transfer_seconds``).
Two modes:

- ``per-layer`` (the layer-shared replica buffer, replicas known from the replay): the slots are refilled for
  every (m, l); the push overlaps ``max(A_fwd[m], comm[m, l] / 2)`` (``timing.replica_push_overlap``: the
  attention forward, or where the dispatch is longer the after-router window, so a replayed fetch is never
  charged more than an after-router one) and the gradient pull the attention backward, so only the excess
  counts: ``max(0, push[m, l] - max(A_fwd[m], comm[m, l] / 2))`` and ``max(0, pull[m, l] - A_bwd[m])``.
- ``persistent`` (EPLB-style redundant experts that stay resident for the whole batch): every
  layer's replicas are pushed once before the first micro-batch and their gradients pulled once after
  the last: ``2 x transfer(all replicas of all layers)``, not overlapped.
- ``after-router`` (online replication without replay, ``planners.online``): the slots are refilled for
  every (m, l) as in ``per-layer``, but the push starts only once the layer's router has run, so it overlaps
  the token dispatch (half of ``max_g comm``) and not the attention: ``max(0, push[m, l] - comm[m, l] / 2)``
  (``timing.replica_push_overlap``);
  the gradient pull overlaps the attention backward as in ``per-layer``.

``replica_mode="auto"`` picks ``after-router`` for plans whose ``stats.replica_fetch`` says so,
``persistent`` when there are several micro-batches and the replica
slots hold the same experts in every micro-batch, else ``per-layer``.

**Reorder (once per batch).** Expert (l, e) moves when the plan's home differs from the previous
placement (default: the static Megatron placement). It carries its weights and optimizer state,
``timing.move_bytes`` = ``3 h h' (dtype_bytes + optimizer_bytes_per_param)`` bytes (default 12
bytes/param: fp32 master weights, Adam's exp_avg and exp_avg_sq), from the old home to the new one; the
time is the transfer time above over all moved experts, not overlapped.

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
from .evaluate import (
    bound_micro_batch,
    bound_terms,
    check_batch_model,
    check_batch_type,
    check_plan_batch,
    micro_batch_rows,
    plan_expert_rows,
    plan_flow,
    plan_loads,
    token_shares,
)
from .plan import BatchPlan, Placement
from .specs import ClusterSpec, ModelSpec
from .timing import (
    DEFAULT_OPTIMIZER_BYTES_PER_PARAM,
    REPLICA_MODES,
    attention_backward,
    attention_forward,
    expert_compute_seconds,
    exposed_seconds,
    layer_step_seconds,
    local_stage,
    moe_backward_seconds,
    moe_comm_seconds,
    moe_forward_seconds,
    move_bytes,
    replica_push_overlap,
    transfer_seconds,
)
from .validate import check_nonnegative, check_token_counts

ReplicaMode = Literal["auto", "per-layer", "persistent", "after-router"]


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
    per_expert = move_bytes(model, optimizer_bytes_per_param)
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
        replica_exposed_s: the part of the replica transfers not hidden behind their window (per-layer and
            after-router modes) or the whole once-per-batch transfer (persistent mode).
        reorder_s: once-per-batch expert re-layout (weights + optimizer state).
        experts_moved, reorder_bytes: what the re-layout moves.
        replica_mode: "per-layer", "persistent" or "after-router".
        overlap_hidden_s: seconds the trainer's compute / all-to-all overlap (``ClusterSpec.overlap``) hides:
            the back-to-back sum of the cells minus ``timing.layer_step_seconds`` (0 without overlap).
        micro_batch_s: ``[M]`` seconds of each micro-batch (forward + backward, all layers).
        t_moe: ``[M, L]`` forward T_MoE of the cost model (one GEMM rate, no latency: the planners' metric);
            rank_skew: ``[M, L]`` max GPU load / mean GPU load.
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
    overlap_hidden_s: float = 0.0

    @property
    def breakdown(self) -> dict[str, float]:
        """Seconds per component; they add up to ``step_s`` (``overlap_hidden``, negative, only where the
        overlap hides something)."""
        out = {
            "attention_fwd": self.attention_fwd_s, "attention_bwd": self.attention_bwd_s,
            "moe_fwd_comp": self.moe_fwd_comp_s, "moe_fwd_comm": self.moe_fwd_comm_s,
            "moe_bwd_comp": self.moe_bwd_comp_s, "moe_bwd_comm": self.moe_bwd_comm_s,
            "replica_exposed": self.replica_exposed_s, "reorder": self.reorder_s,
        }
        if self.overlap_hidden_s:
            out["overlap_hidden"] = -self.overlap_hidden_s
        return out

    @property
    def t_moe_s(self) -> float:
        """Sum of the forward T_MoE over micro-batches and layers (moves free: the paper's metric; the same
        figure as ``evaluate.PlanScore.t_moe_s``)."""
        return float(self.t_moe.sum())

    @property
    def rank_skew_mean(self) -> float:
        """Mean over cells of max GPU load / mean GPU load."""
        return float(self.rank_skew.mean())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (arrays as lists, ``breakdown`` included)."""
        return {
            "step_s": self.step_s, "tokens": self.tokens, "tokens_per_s": self.tokens_per_s,
            "breakdown": self.breakdown, "replica_mode": self.replica_mode,
            "replica_push_s": self.replica_push_s, "replica_pull_s": self.replica_pull_s,
            "replica_exposed_s": self.replica_exposed_s, "reorder_s": self.reorder_s,
            "experts_moved": self.experts_moved, "reorder_bytes": self.reorder_bytes,
            "t_moe_s": self.t_moe_s, "rank_skew_mean": self.rank_skew_mean, "overlap_hidden_s": self.overlap_hidden_s,
            "micro_batch_s": self.micro_batch_s.tolist(),
        }


@dataclass(frozen=True)
class StepResult:
    """One plan's simulated step beside the facts of the plan that made it: the row of every step evaluation
    (``relibra simulate``, ``relibra compare``, the demo, ``steady.plan_steady``).

    Attributes:
        strategy: ``plan.stats.strategy`` (None when absent).
        replica_slots: the plan's r.
        solve_s: seconds the planner took (wall clock; nan when unknown).
        step: the simulated ``StepTime``.
        portfolio: relibra's chosen portfolio candidate (``plan.stats.portfolio.chosen``), None elsewhere.
    """

    strategy: str | None
    replica_slots: int
    solve_s: float
    step: StepTime
    portfolio: str | None = None

    @classmethod
    def of(cls, plan: BatchPlan, step: StepTime, solve_s: float | None = None) -> StepResult:
        """The result of ``plan``'s simulated ``step``; ``solve_s`` defaults to ``plan.stats.solve_seconds``."""
        st = plan.stats
        return cls(strategy=st.strategy, replica_slots=plan.replica_slots,
                   solve_s=float((float("nan") if st.solve_seconds is None else st.solve_seconds) if solve_s is None
                                 else solve_s),
                   step=step,
                   portfolio=st.portfolio.chosen if st.portfolio is not None else None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``strategy``, ``replica_slots``, ``solve_s``, the step's ``StepTime.to_dict`` figures and
        ``portfolio`` where set."""
        out = {"strategy": self.strategy, "replica_slots": self.replica_slots, "solve_s": self.solve_s,
               **self.step.to_dict()}
        if self.portfolio is not None:
            out["portfolio"] = self.portfolio
        return out


def _resolve_replica_mode(plan: BatchPlan, mode: str) -> str:
    if mode not in REPLICA_MODES:
        raise PlanError(f"replica_mode {mode!r} is not one of {REPLICA_MODES}")
    if mode != "auto":
        return mode
    if plan.stats.replica_fetch == "after-router":
        return "after-router"
    if plan.replicas.resident:
        return "persistent"
    return "per-layer"


def _check_step_inputs(plan: BatchPlan, lengths: np.ndarray, x: np.ndarray, model: ModelSpec, cluster: ClusterSpec,
                       previous: Placement | None, optimizer_bytes_per_param: float, validate: bool
                       ) -> tuple[np.ndarray, np.ndarray]:
    """``simulate_loads``'s argument checks (PlanError naming the argument); returns ``(lengths, x)`` as arrays."""
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
    check_token_counts("x", x)
    if validate:
        plan.validate(model, cluster, lengths.shape[0])
    check_nonnegative("optimizer_bytes_per_param", optimizer_bytes_per_param)
    if previous is not None:
        if not isinstance(previous, Placement):
            raise PlanError(f"previous must be a Placement (or None for static), got {type(previous).__name__}")
        try:
            previous.validate(model, cluster)
        except PlanError as exc:
            raise PlanError(f"previous placement: {exc}") from None
    return lengths, x


def _replica_transfers(plan: BatchPlan, mode: str, a_fwd: np.ndarray, a_bwd: np.ndarray, comm_max: np.ndarray,
                       model: ModelSpec, cluster: ClusterSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """The replica traffic of ``plan`` fetched by ``mode``: ``(push [M, L], exposed_fwd [M, L], exposed_bwd [M, L],
    persistent_s)`` seconds; ``a_fwd`` / ``a_bwd`` ``[M]`` attention seconds, ``comm_max`` ``[M, L]`` the forward
    all-to-all (module docstring, "Replica transfers")."""
    M, L = plan.num_micro_batches, model.num_layers
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
            fetch = "after-router" if mode == "after-router" else "per-layer"
            exposed_fwd = exposed_seconds(push, replica_push_overlap(a_fwd[:, None], comm_max, fetch))
            exposed_bwd = exposed_seconds(push, a_bwd[:, None])
        else:
            once = fm == 0
            persistent_s = 2.0 * float(transfer_seconds(fh[once], fg[once], model.expert_bytes, None, 1,
                                                        cluster)[0])
    return push, exposed_fwd, exposed_bwd, persistent_s


def simulate_loads(plan: BatchPlan, lengths: np.ndarray, x: np.ndarray, model: ModelSpec, cluster: ClusterSpec,
                   *, previous: Placement | None = None,
                   optimizer_bytes_per_param: float = DEFAULT_OPTIMIZER_BYTES_PER_PARAM,
                   replica_mode: ReplicaMode = "auto", validate: bool = True) -> StepTime:
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
        validate: check the plan against the specs (``BatchPlan.validate``); False only for plans the caller
            built and validates itself (relibra's portfolio candidates: the one it returns is validated).
    """
    G, L, E = cluster.num_gpus, model.num_layers, model.num_experts
    lengths, x = _check_step_inputs(plan, lengths, x, model, cluster, previous, optimizer_bytes_per_param, validate)
    M = plan.num_micro_batches

    # Local stage: attention (+ shared experts) per (m, g); the slowest GPU counts.
    a_fwd = attention_forward(lengths, plan.samples.micro_batch, plan.samples.gpu, M, model, cluster)  # [M]
    a_bwd = attention_backward(a_fwd)

    # MoE forward / backward from the plan's flow.
    flow = plan_flow(plan, x)
    cost = cost_from_flow(flow, model, cluster)
    if cluster.gemm_curve:  # expert GEMMs at the measured rate of each expert's rows
        comp_max = expert_compute_seconds(plan_expert_rows(plan, x), model, cluster).max(axis=-1)  # [M, L]
    else:
        comp_max = cost.comp.max(axis=-1)  # [M, L]
    comm_max = moe_comm_seconds(cost.comm.max(axis=-1), flow, cluster)  # + all-to-all latency
    t_fwd = moe_forward_seconds(comp_max, comm_max)
    t_bwd = moe_backward_seconds(comp_max, comm_max)

    # Replica transfers.
    mode = _resolve_replica_mode(plan, replica_mode)
    push, exposed_fwd, exposed_bwd, persistent_s = _replica_transfers(plan, mode, a_fwd, a_bwd, comm_max, model,
                                                                      cluster)
    pull = push  # the gradient has the weights' size and goes the other way: same link time

    prev = previous if previous is not None else Placement.static(L, E, G)
    reorder_s, moved, moved_bytes = reorder_traffic(prev, plan.placement, model, cluster, optimizer_bytes_per_param)

    per_mb = (L * (a_fwd + a_bwd) + (t_fwd + t_bwd + exposed_fwd + exposed_bwd).sum(axis=1))
    hidden = 0.0
    if cluster.overlap != "none":  # the same cells under the trainer's overlap (timing.layer_step_seconds)
        back_to_back = per_mb
        cells = layer_step_seconds(a_fwd[:, None], comp_max, comm_max, cluster.overlap)
        per_mb = (cells + exposed_fwd + exposed_bwd).sum(axis=1)
        hidden = float(back_to_back.sum() - per_mb.sum())
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
        gpu_load=cost.load, overlap_hidden_s=hidden)


def _attention_bound(lengths: np.ndarray, micro_batch: np.ndarray | None, model: ModelSpec,
                     cluster: ClusterSpec) -> float:
    """Seconds: a lower bound of ``sum_m A_fwd[m]`` (one layer's local stage, slowest GPU) over every sample
    placement: per micro-batch the larger of its local work over G, its longest sample's, and (with more than G
    samples) the G-th plus the (G+1)-th longest (two of the G+1 longest share a GPU), summed; with K packings
    (``micro_batch`` int ``[K, N]``, ``evaluate.bound_micro_batch``) the least of the K sums; without fixed
    micro-batches (``micro_batch`` None) the larger of the batch's work over G and its longest sample's."""
    G, N = cluster.num_gpus, len(lengths)
    own = local_stage(lengths, np.arange(N), np.zeros(N, np.int64), N, model, cluster)[:, 0]  # [N] each alone
    if micro_batch is None:
        return max(float(own.sum()) / G, float(own.max(initial=0.0)))
    sums = []
    for mb in micro_batch_rows(micro_batch, N):
        total = 0.0
        for m in np.unique(mb):
            w = np.sort(own[mb == m])[::-1]
            pair = w[G - 1] + w[G] if len(w) > G else 0.0
            total += max(float(w.sum()) / G, float(w[0]), float(pair))
        sums.append(total)
    return min(sums)


def bound_step(batch: Any, model: ModelSpec, cluster: ClusterSpec, replica_slots: int = 0,
               micro_batch: np.ndarray | None = None, num_micro_batches: int | None = None, *,
               layout: np.ndarray | None = None) -> StepTime:
    """A lower bound of the simulated step of every plan of ``batch`` with at most ``replica_slots`` replica slots
    (docs/method.md, "The bound"): no strategy, expert or sample placement or option beats it on this cluster.
    ``micro_batch`` int ``[N]``: the plans keep these micro-batches; int ``[K, N]``: one of these K packings
    (``evaluate.bound_micro_batch``); None: any packing (``repack``).

    Local stage: ``_attention_bound``. MoE: ``evaluate.bound_terms`` at the fastest GEMM rate
    (``ClusterSpec.gemm_curve``'s peak, else ``flops``); the all-to-all latency and the replica, reorder and
    persistent transfers are >= 0. ``timing.layer_step_seconds`` is convex, positively homogeneous and
    non-decreasing, so the sum over cells is at least the rule applied to the sums, which is at least the rule
    applied to these lower bounds. The result's figures are those bounds (``t_moe``, ``attention_fwd`` and
    ``micro_batch_s`` spread over the micro-batches of ``layout`` (int ``[N]``; default ``micro_batch``'s first
    packing, else the batch's own) by their tokens, ``evaluate.token_shares``, padded to ``num_micro_batches``;
    rank skew 1; no moves).
    """
    check_batch_type(batch)
    check_batch_model(batch, model)
    L = model.num_layers
    peak = max([float(cluster.flops)] if not cluster.gemm_curve else [f for _, f in cluster.gemm_curve])
    b = bound_terms(batch, model, cluster, replica_slots, micro_batch=micro_batch, peak_flops=peak)
    lengths = np.asarray(batch.lengths)
    attn = _attention_bound(lengths, micro_batch, model, cluster)
    comp, comm = float(b.comp.sum()), float(b.comm.sum())
    step = float(layer_step_seconds(L * attn, comp, comm, cluster.overlap))
    back_to_back = float(layer_step_seconds(L * attn, comp, comm, "none"))
    if layout is None:
        layout = micro_batch_rows(micro_batch, len(lengths))[0] if micro_batch is not None else \
            batch.resolve_micro_batch()
    M = int(np.max(layout)) + 1 if num_micro_batches is None else int(num_micro_batches)
    w = token_shares(batch, layout, M)
    tokens = int(lengths.sum())
    return StepTime(
        step_s=step, tokens=tokens, tokens_per_s=tokens / step if step > 0 else 0.0,
        attention_fwd_s=L * attn, attention_bwd_s=float(attention_backward(L * attn)),
        moe_fwd_comp_s=comp, moe_fwd_comm_s=comm, moe_bwd_comp_s=float(moe_backward_seconds(comp, 0.0)),
        moe_bwd_comm_s=comm, replica_push_s=0.0, replica_pull_s=0.0, replica_exposed_s=0.0, reorder_s=0.0,
        experts_moved=0, reorder_bytes=0.0, replica_mode="bound", micro_batch_s=w * step,
        t_moe=w[:, None] * (b.comp + b.comm)[None, :], rank_skew=np.ones((M, L)), attention_fwd=w * attn,
        overlap_hidden_s=back_to_back - step)


def simulate_step(plan: BatchPlan, batch: Any, model: ModelSpec, cluster: ClusterSpec, *,
                  balanced: bool | None = None, allow_missing_fingerprint: bool = False, **kwargs: Any) -> StepTime:
    """Simulate one step of ``batch`` (a ``TraceBatch``) under ``plan``; keyword args as ``simulate_loads``.

    The loads follow the plan's sample placement (``evaluate.plan_loads``). ``balanced`` (default: whether
    ``plan.stats.strategy == "balanced"``) returns the bound instead (``bound_step`` for the plan's
    ``stats.replica_slots``, micro-batches (``evaluate.bound_micro_batch``) and micro-batch count), as
    ``score_plan`` scores a Balanced plan as the bound.
    ``allow_missing_fingerprint``: simulate a plan without ``stats.batch_sha1`` (``check_plan_batch``).
    """
    check_plan_batch(plan, batch, model, allow_missing_fingerprint=allow_missing_fingerprint)
    if balanced is None:
        balanced = plan.stats.strategy == "balanced"
    if balanced:
        return bound_step(batch, model, cluster, plan.planned_replica_slots,
                          bound_micro_batch(plan, batch), plan.num_micro_batches, layout=plan.samples.micro_batch)
    x = plan_loads(plan, batch, cluster.num_gpus)
    return simulate_loads(plan, batch.lengths, x, model, cluster, **kwargs)
