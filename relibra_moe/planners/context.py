"""What every strategy receives and the helpers they share: ``PlanContext``, ``make_plan``,
``baseline_samples`` and ``previous_expert_gpu``.

Every strategy module (``strategies``, ``history``, ``online``) builds its plans with these; ``history`` and
``online`` import this module, never ``strategies``, so the registry (``strategies.STRATEGIES``) imports them at
its top without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import PlanError
from ..evaluate import placement_loads
from ..plan import BatchPlan, Placement, ReplicaPlan, SamplePlacement, round_robin_gpus
from ..plan_stats import PlanStats
from ..sample_placements import place_samples
from ..specs import ClusterSpec, ModelSpec
from ..trace import TraceBatch
from . import baselines
from .evaluation import SIMULATED_STEP, StepEvaluator
from .executor import FallbackLog, TaskExecutor, TaskFailed
from .locality import anneal_locality
from .options import PlanOptions
from .params import LocalityParams, ReorderParams, baseline_locality_params, locality_params, reorder_params

__all__ = ["PlanContext", "make_plan", "baseline_samples", "previous_expert_gpu", "start_samples", "eplb_task",
           "fallback_homes", "eplb_layout", "eplb_parts"]


@dataclass
class PlanContext:
    """Inputs of one planning call (arrays derived once from the batch).

    Attributes:
        batch: the TraceBatch, with its micro-batch assignment.
        counts: int64 ``[N, L, E]`` tokens per sample, layer and expert.
        lengths: int64 ``[N]`` tokens per sample.
        micro_batch, sample_gpu: int64 ``[N]`` the samples' start (``start_samples``: the placement of
            ``options.placement_for(strategy)``, or the trainer's ranks; with ``options.sample_owner == "trainer"``
            kept as given by every strategy); num_micro_batches: M, the batch's.
        options: the call's ``PlanOptions``.
        executor: where the planning tasks run.
        fallback_expert_gpu: int64 ``[L, E]`` homes a reorder layer keeps when its tasks fail (None: its start).
        stats: the plan's ``stats`` being built; fallbacks: cells that fell back (``FallbackLog``).
        evaluator: the judge of finished candidates (the portfolio's; default the step simulator).
    """

    batch: TraceBatch
    model: ModelSpec
    cluster: ClusterSpec
    counts: np.ndarray
    lengths: np.ndarray
    micro_batch: np.ndarray
    num_micro_batches: int
    sample_gpu: np.ndarray
    options: PlanOptions
    executor: TaskExecutor
    fallback_expert_gpu: np.ndarray | None = None
    stats: PlanStats = field(default_factory=PlanStats)
    fallbacks: FallbackLog = field(default_factory=FallbackLog)
    evaluator: StepEvaluator = field(default=SIMULATED_STEP, repr=False)
    _comp_weight: float | None = field(default=None, repr=False)

    @property
    def replica_slots(self) -> int:
        return self.options.replica_slots

    @property
    def seed(self) -> int:
        return self.options.seed

    @property
    def repack(self) -> bool:
        return self.options.repack

    @property
    def trainer_owned(self) -> bool:
        """Whether the trainer owns the sample placement (``micro_batch`` / ``sample_gpu`` are kept as given)."""
        return self.options.sample_owner == "trainer"

    @property
    def migration_node_comp(self) -> bool:
        """Whether relibra's migration pricing and its ``move_horizon`` credit judge homes by the replication-aware
        step estimate (compute levelled inside each node, ``migration.step_moe_seconds``): in rank-balance mode,
        or where replicas follow (r > 0)."""
        return self.options.rank_balance[0] or self.replica_slots > 0

    @property
    def comp_weight(self) -> float:
        """Compute weight of relibra*'s objectives: ``options.comp_weight`` without overlap (or without
        ``step_objective``); with the cluster's overlap, ``timing.step_comp_weight`` at this batch's operating
        point (the start placement on the static homes: mean A_fwd, mean max_g comp and max_g comm per cell)."""
        if self.cluster.overlap == "none" or not self.options.step_objective:
            return self.options.comp_weight
        if self._comp_weight is None:
            from ..cost import cost_from_flow, flow_matrix
            from ..timing import attention_forward, step_comp_weight

            L, E, G = self.model.num_layers, self.model.num_experts, self.cluster.num_gpus
            x = self.loads(self.micro_batch, self.sample_gpu)
            cost = cost_from_flow(flow_matrix(x, Placement.static(L, E, G).expert_gpu.astype(np.int64)), self.model,
                                  self.cluster)
            a = attention_forward(self.lengths, self.micro_batch, self.sample_gpu, self.num_micro_batches, self.model,
                                  self.cluster)
            self._comp_weight = step_comp_weight(self.cluster.overlap, float(a.mean()),
                                                          float(cost.comp.max(axis=-1).mean()),
                                                          float(cost.comm.max(axis=-1).mean()))
        return float(self._comp_weight)

    @property
    def reorder_params(self) -> ReorderParams:
        """The reorder parameters of one round of the planning loop (``params.reorder_params`` of the options,
        ``comp_weight`` from the cluster's overlap)."""
        return reorder_params(self.options, self.model.num_experts, self.cluster.num_gpus, self.num_micro_batches,
                              self.model.num_layers, self.comp_weight)

    @property
    def locality_params(self) -> LocalityParams:
        """The sample-placement parameters of one round of the planning loop and of ``relocate``
        (``params.locality_params`` of the options, ``comp_weight`` from the cluster's overlap)."""
        return locality_params(self.options, len(self.lengths), self.model.num_layers, self.cluster.num_gpus,
                               self.comp_weight)

    def loads(self, micro_batch: np.ndarray, sample_gpu: np.ndarray) -> np.ndarray:
        """int64 ``[M, L, G, E]`` for a sample placement."""
        return placement_loads(self.batch, micro_batch, sample_gpu, self.num_micro_batches, self.cluster.num_gpus)

    def batch_for(self, micro_batch: np.ndarray) -> TraceBatch:
        """The batch with micro-batch assignment ``micro_batch`` (for replicate / lplb)."""
        return self.batch.with_micro_batch(np.asarray(micro_batch, dtype=np.int32))


def make_plan(ctx: PlanContext, expert_gpu: np.ndarray, micro_batch: np.ndarray, sample_gpu: np.ndarray,
          replicas: ReplicaPlan | None = None) -> BatchPlan:
    """The strategy's BatchPlan: homes ``[L, E]``, samples ``[N]`` (micro-batch, GPU), replicas (default none);
    ``stats`` is ``ctx.stats``."""
    G, L = ctx.cluster.num_gpus, ctx.model.num_layers
    if replicas is None:
        replicas = ReplicaPlan.empty(ctx.num_micro_batches, L, G, 0)
    return BatchPlan(placement=Placement(expert_gpu),
                     samples=SamplePlacement(micro_batch, sample_gpu, ctx.num_micro_batches),
                     replicas=replicas, num_gpus=G, gpus_per_node=ctx.cluster.gpus_per_node, stats=ctx.stats)


def start_samples(options: PlanOptions, strategy: str, lengths: np.ndarray, micro_batch: np.ndarray,
                  num_gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """int64 ``(micro_batch [N], gpu [N])``: every sample's place before planning: the trainer's ranks (option
    ``sample_gpu``, checked here against the batch) in the batch's micro-batches when given, else the placement
    ``options.placement_for(strategy)`` (``sample_placements.place_samples``; round-robin keeps the batch's
    micro-batches).

    Raises:
        PlanError: ``sample_gpu`` of another length than the batch's N, or a rank outside ``[0, G)`` (naming
            the index and the value).
    """
    mb = np.asarray(micro_batch, dtype=np.int64)
    if options.sample_owner != "trainer" or options.sample_gpu is None:
        placement = options.placement_for(strategy)
        if placement == "round-robin":
            return mb, round_robin_gpus(mb, num_gpus)
        return place_samples(placement, lengths, mb, num_gpus)
    sg = np.asarray(options.sample_gpu)
    if sg.shape != mb.shape:
        raise PlanError(f"sample_gpu has {sg.shape[0] if sg.ndim == 1 else sg.shape} entries, the batch has "
                        f"N={mb.shape[0]} samples: give the trainer's rank of every sample")
    bad = np.flatnonzero((sg < 0) | (sg >= num_gpus))
    if len(bad):
        i = int(bad[0])
        raise PlanError(f"sample_gpu[{i}] = {int(sg[i])} is outside [0, {num_gpus}): the trainer's rank of every "
                        f"sample must be a GPU of the EP group")
    return mb, sg.astype(np.int64)


def baseline_samples(ctx: PlanContext, expert_gpu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Samples for a baseline: its start (``ctx.micro_batch`` / ``ctx.sample_gpu``), or annealed with repacking
    when ``ctx.repack``."""
    if not ctx.repack:
        return ctx.micro_batch, ctx.sample_gpu
    mb, sg, info = anneal_locality(ctx.counts, ctx.lengths, ctx.micro_batch, ctx.sample_gpu, expert_gpu, ctx.model,
                                   ctx.cluster, baseline_locality_params(ctx.options),
                                   num_micro_batches=ctx.num_micro_batches, seed=ctx.seed)
    ctx.stats.locality = info
    return mb, sg


def previous_expert_gpu(options: PlanOptions, model: ModelSpec, cluster: ClusterSpec) -> np.ndarray:
    """int64 ``[L, E]``: the placement before this batch (option ``previous``: a Placement or array; default
    the static Megatron placement, what the trainer starts from)."""
    prev = options.previous
    if prev is None:
        return baselines.static_placement(model.num_layers, model.num_experts, cluster.num_gpus)
    prev = np.asarray(getattr(prev, "expert_gpu", prev), dtype=np.int64)
    if prev.shape != (model.num_layers, model.num_experts):
        raise PlanError(f"previous placement must be [L={model.num_layers}, E={model.num_experts}] GPUs in "
                        f"[0, {cluster.num_gpus}), got shape {prev.shape}")
    try:
        Placement(prev).validate(model, cluster)
    except PlanError as exc:
        raise PlanError(f"previous placement: {exc}") from None
    return prev


def eplb_task(ctx: PlanContext, weights: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray] | None:
    """``baselines.eplb(weights [L, E], ...)`` as one task on ``ctx.executor`` (so ``deadline_s`` holds for the
    EPLB strategies too): ``(expert_gpu [L, E], slots [L, G, r])``, or ``None`` when the task failed (counted in
    ``ctx.fallbacks.strategy``; the caller keeps the fallback homes)."""
    args = (weights, ctx.cluster.num_gpus, ctx.cluster.gpus_per_node, ctx.replica_slots, ctx.options.num_groups)
    (res,) = ctx.executor.map(baselines.eplb, [args], [(kind, 0)])
    if isinstance(res, TaskFailed):
        ctx.fallbacks.strategy += 1
        return None
    return res


def fallback_homes(ctx: PlanContext) -> np.ndarray:
    """int64 ``[L, E]``: the homes a whole-strategy fallback keeps (``ctx.fallback_expert_gpu``, else static)."""
    if ctx.fallback_expert_gpu is not None:
        return np.asarray(ctx.fallback_expert_gpu, dtype=np.int64)
    return baselines.static_placement(ctx.model.num_layers, ctx.model.num_experts, ctx.cluster.num_gpus)


def eplb_layout(ctx: PlanContext, x: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """EPLB+'s layout (``eplb_task``) on the batch's true per-layer loads: ``(expert_gpu [L, E], slots [L, G, r])``,
    None when the task failed. ``x`` is ``ctx.loads(ctx.micro_batch, ctx.sample_gpu)`` when the caller has it
    (the per-expert sums it reads are the same on every sample placement)."""
    if x is None:
        x = ctx.loads(ctx.micro_batch, ctx.sample_gpu)
    return eplb_task(ctx, x.sum(axis=(0, 2)), "eplb")


def eplb_parts(ctx: PlanContext, layout: tuple[np.ndarray, np.ndarray] | None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, ReplicaPlan | None]:
    """EPLB+'s plan from its ``layout`` (``eplb_layout``): (homes [L, E], micro_batch [N], gpu [N], replicas or
    None); with r > 0 the slots' copies take equal shares of their expert's tokens (``baselines.even_split_replicas``)
    and ``ctx.stats.eplb_replicas_dropped`` counts the slots left empty. A failed layout (None) keeps
    ``fallback_homes`` without replicas."""
    if layout is None:
        eg = fallback_homes(ctx)
        return (eg, *baseline_samples(ctx, eg), None)
    eg, slots = layout
    mb, sg = baseline_samples(ctx, eg)
    replicas = None
    if ctx.replica_slots > 0:
        replicas = baselines.even_split_replicas(eg, slots, ctx.loads(mb, sg))
        ctx.stats.eplb_replicas_dropped = int(ctx.replica_slots * ctx.cluster.num_gpus * ctx.model.num_layers
                                              - (slots >= 0).sum())
    return eg, mb, sg, replicas
