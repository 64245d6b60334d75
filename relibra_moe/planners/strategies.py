"""The planning strategies by name, and ``plan_batch``: a TraceBatch in, a validated BatchPlan out.

========================  ======================================================================
name                      plan
========================  ======================================================================
``static``                Megatron-LM: expert e on GPU e // (E/G), samples round-robin
``lpt``                   greedy LPT reorder on the batch's true loads (Algorithm 1's start)
``eplb``                  DeepSeek EPLB on the true loads (EPLB+), r redundant experts per GPU
``balanced``              the ideal: uniform random routing, same tokens per source (scored as such)
``relibra-inter``         reorder (LPT + annealing) + sample locality (+ repacking), migration-aware
``lplb``                  LPLB+: EPLB+ reorder, per-micro-batch LP split over <= 1 copy per expert
``relibra``               relibra-inter + intra-node replication and token split (Algorithm 2), replicas
                          priced for their exposed push / pull; ``skew_cap``: rank-balance mode
``eplb-history``          EPLB from past batches' loads (option ``history``), as engines run it (``history``)
``online``                static homes + per-micro-batch replicas from the live loads, fetched after the
                          router (``online``; no replay)
========================  ======================================================================

Every strategy takes ``(ctx: PlanContext) -> BatchPlan``. ``repack=True`` lets the non-ReLibra
strategies repack samples too (routing-aware packing alone, experts as the strategy placed them), so
the effect of packing can be measured on its own.

Pricing what the plan moves (options, defaults on): ``migration`` (``migrate``: relabel GPUs by the fabric's
symmetries towards the ``previous`` placement, default static, and keep a layer's previous homes where the
new ones do not pay for their move in step time) and ``price_replicas`` (``replica_pricing``: a cell's
replicas must pay for their push / pull not hidden behind attention). The sum of T_MoE alone charges
neither; ``migration=False, price_replicas=False`` plan for it (bench/planners.py's cost-model rows).

``stats`` hold strategy, seed, objective values and
fallbacks; wall-clock values go under ``stats["timing"]`` / ``stats["solve_seconds"]``, which
``BatchPlan.save`` leaves out of the file unless asked, so same inputs and seed give the same bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..cost import DEFAULT_BETA
from ..errors import PlanError
from ..plan import BatchPlan, Placement, ReplicaPlan, SamplePlacement
from ..specs import ClusterSpec, ModelSpec
from . import baselines
from .locality import anneal_locality, default_locality_iters, loads_from_counts, round_robin_gpus
from .reorder import default_iters, lpt_placement, reorder
from .scoring import batch_sha1, check_batch_type
from .split import check_int, check_positive

if TYPE_CHECKING:
    from ..trace import TraceBatch


@dataclass
class PlanContext:
    """Inputs of one planning call (arrays derived once from the batch).

    Attributes:
        batch: the TraceBatch, with its micro-batch assignment.
        counts: int64 ``[N, L, E]`` tokens per sample, layer and expert.
        lengths: int64 ``[N]`` tokens per sample.
        micro_batch: int64 ``[N]``; num_micro_batches: M.
        sample_gpu: int64 ``[N]`` round-robin start.
        options: strategy-specific keyword options (e.g. ``iters``, ``num_seeds``, ``objective``).
    """

    batch: Any
    model: ModelSpec
    cluster: ClusterSpec
    counts: np.ndarray
    lengths: np.ndarray
    micro_batch: np.ndarray
    num_micro_batches: int
    sample_gpu: np.ndarray
    replica_slots: int = 0
    seed: int = 0
    workers: int = 1
    repack: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)

    def loads(self, micro_batch: np.ndarray, sample_gpu: np.ndarray) -> np.ndarray:
        """int64 ``[M, L, G, E]`` for a sample placement."""
        return loads_from_counts(self.counts, micro_batch, sample_gpu, self.num_micro_batches,
                                 self.cluster.num_gpus)

    def batch_for(self, micro_batch: np.ndarray) -> Any:
        """The batch with micro-batch assignment ``micro_batch`` (for replicate / lplb)."""
        return self.batch.with_micro_batch(np.asarray(micro_batch, dtype=np.int32))


def _plan(ctx: PlanContext, expert_gpu: np.ndarray, micro_batch: np.ndarray, sample_gpu: np.ndarray,
          replicas: ReplicaPlan | None = None) -> BatchPlan:
    G, L = ctx.cluster.num_gpus, ctx.model.num_layers
    if replicas is None:
        replicas = ReplicaPlan.empty(ctx.num_micro_batches, L, G, 0)
    return BatchPlan(placement=Placement(expert_gpu),
                     samples=SamplePlacement(micro_batch, sample_gpu, ctx.num_micro_batches),
                     replicas=replicas, num_gpus=G, gpus_per_node=ctx.cluster.gpus_per_node, stats=ctx.stats)


def _maybe_repack(ctx: PlanContext, expert_gpu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Samples for a baseline: round-robin, or annealed with repacking when ``ctx.repack``."""
    if not ctx.repack:
        return ctx.micro_batch, ctx.sample_gpu
    mb, sg, info = anneal_locality(ctx.counts, ctx.lengths, ctx.micro_batch, ctx.sample_gpu, expert_gpu, ctx.model,
                                   ctx.cluster, num_micro_batches=ctx.num_micro_batches, repack=True,
                                   token_cap=ctx.options.get("token_cap"), tol=ctx.options.get("tol", 0.05),
                                   seed=ctx.seed, iters=ctx.options.get("locality_iters"))
    ctx.stats["locality"] = info
    return mb, sg


def strategy_static(ctx: PlanContext) -> BatchPlan:
    """Megatron-LM: expert e on GPU e // (E/G) in every layer; samples round-robin (or repacked)."""
    eg = baselines.static_placement(ctx.model.num_layers, ctx.model.num_experts, ctx.cluster.num_gpus)
    return _plan(ctx, eg, *_maybe_repack(ctx, eg))


def strategy_lpt(ctx: PlanContext) -> BatchPlan:
    """Greedy LPT per layer on the batch-aggregated loads ``x.sum(m, j)`` (Algorithm 1's start)."""
    x = ctx.loads(ctx.micro_batch, ctx.sample_gpu)
    eg = np.stack([lpt_placement(x[:, l].sum(axis=(0, 1)), ctx.cluster.num_gpus) for l in range(x.shape[1])])
    return _plan(ctx, eg, *_maybe_repack(ctx, eg))


def strategy_eplb(ctx: PlanContext) -> BatchPlan:
    """EPLB+ on the true per-layer loads; with r > 0, r redundant experts per GPU split evenly per copy."""
    x = ctx.loads(ctx.micro_batch, ctx.sample_gpu)
    eg, slots = baselines.eplb(x.sum(axis=(0, 2)), ctx.cluster.num_gpus, ctx.cluster.gpus_per_node,
                               ctx.replica_slots, ctx.options.get("num_groups"))
    mb, sg = _maybe_repack(ctx, eg)
    replicas = None
    if ctx.replica_slots > 0:
        xx = ctx.loads(mb, sg)
        replicas = baselines.even_split_replicas(eg, slots, xx)
        ctx.stats["eplb_replicas_dropped"] = int(ctx.replica_slots * ctx.cluster.num_gpus * ctx.model.num_layers
                                                 - (slots >= 0).sum())
    return _plan(ctx, eg, mb, sg, replicas)


def strategy_balanced(ctx: PlanContext) -> BatchPlan:
    """The Balanced ideal: a static plan that ``score_plan`` scores on uniform random routing."""
    ctx.stats["balanced_sources"] = ctx.options.get("balanced_sources", "batch")
    eg = baselines.static_placement(ctx.model.num_layers, ctx.model.num_experts, ctx.cluster.num_gpus)
    return _plan(ctx, eg, ctx.micro_batch, ctx.sample_gpu)


DEFAULT_ROUNDS = 2
FINAL_ITERS_FACTOR = 8


def rank_balance_options(options: dict[str, Any]) -> tuple[bool, float | None]:
    """``(node_comp, skew_cap)`` of the reorder from the plan options (default: off, ``(False, None)``).

    ``skew_cap=c`` (a float >= 0) asks for rank-level balance: the reorder anneals the replication-aware cost
    (``node_comp``: compute term = the busiest node's mean GPU load, what intra-node replicas can level it
    to) plus a soft cap ``c`` on the node-level compute skew, from node-balanced starts. ``node_comp=True``
    alone uses that cost without the cap.

    Off by default because on multi-node clusters it buys rank balance with communication: qwen3-30b-a3b
    mixed (bench/replication.py --only skew), the sum of T_MoE with ``skew_cap=0.05`` vs without:
    EP16 6.36 vs 6.02 s, EP32 9.14 vs 8.20 s, EP64 10.70 vs 9.72 s (rank skew 1.03 / 1.06 / 1.13 vs
    1.10 / 1.35 / 1.69); qwen3-235b-a22b EP32 37.5 vs 34.1 s. ``repack=True`` gets both (see BENCHMARKS.md).
    """
    skew_cap = options.get("skew_cap")
    node_comp = options.get("node_comp")
    node_comp = skew_cap is not None if node_comp is None else bool(node_comp)
    if skew_cap is not None and not node_comp:
        raise PlanError(f"skew_cap={skew_cap!r} caps the node-level compute skew of node_comp: it needs "
                        "node_comp=True (or leave node_comp unset)")
    if skew_cap is not None and (isinstance(skew_cap, bool) or not isinstance(skew_cap, (int, float, np.number))
                                 or not (np.isfinite(skew_cap) and skew_cap >= 0)):
        raise PlanError(f"skew_cap={skew_cap!r} must be a finite number >= 0 (or None)")
    return node_comp, None if skew_cap is None else float(skew_cap)


def final_iters(options: dict[str, Any], iters: int) -> int:
    """Proposals of the ``final_reorder`` pass: option ``final_iters``, default ``FINAL_ITERS_FACTOR`` x a
    round's (qwen3-30b-a3b mixed EP64 + repack, bench/replication.py --only skew: rank skew 1.081 with 1x,
    1.074 with 8x)."""
    return int(options.get("final_iters") or FINAL_ITERS_FACTOR * iters)


def relibra_inter(ctx: PlanContext, replicated: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reorder + locality (+ repacking), ``rounds`` times: returns (homes [L, E], micro_batch [N], gpu [N]).

    Each round re-anneals the experts for the sample placement of the previous round, then the samples
    for the new homes. The default budgets (``default_iters``, ``default_locality_iters``) are split over
    the rounds: two rounds at half the proposals each beat one round at the full budget on 7 of the 8
    bench rows (relibra-inter with and without repacking, four scenarios; the 8th is +0.03%), at about the
    same solve time.

    Rank-balance mode (options ``skew_cap`` / ``node_comp``, ``rank_balance_options``; off by default): the
    reorder anneals the replication-aware cost (compute term = the busiest node's mean GPU load, with a soft
    cap ``skew_cap`` on that node-level skew; ``reorder.batch_cost``) from node-balanced starts: intra-node
    replicas level each node, so the node balance of the homes is what bounds relibra's rank skew
    (qwen3-30b-a3b mixed, bench/replication.py --only skew). Option ``final_reorder=True`` re-anneals
    the homes once more after the last locality pass (useful with ``repack``, which changes what each
    micro-batch routes), with ``final_iters`` proposals.

    ``replicated``: replicas follow (relibra with r > 0), so the migration pricing judges each layer's move
    by the replication-aware step estimate (compute levelled inside each node), whatever the reorder's
    objective: without it, a move looks worth its traffic for compute imbalance that the replicas would
    remove anyway (GPT-OSS EP8 demo: relibra 1.20x static with the plain estimate, see BENCHMARKS.md).
    """
    o = ctx.options
    node_comp, skew_cap = rank_balance_options(o)
    mb, sg = ctx.micro_batch, ctx.sample_gpu
    eg = None
    objectives: list[dict[str, Any]] = []
    timing = ctx.stats.setdefault("timing", {})
    rounds = int(DEFAULT_ROUNDS if o.get("rounds") is None else o["rounds"])
    if rounds < 1:
        raise PlanError(f"rounds={rounds} must be >= 1")
    L, E, G = ctx.model.num_layers, ctx.model.num_experts, ctx.cluster.num_gpus
    objective = o.get("objective", "batch")
    iters = o.get("iters")
    if iters is None:
        iters = max(default_iters(E, G, ctx.num_micro_batches if objective == "batch" else 1, L) // rounds, 300)
    loc_iters = o.get("locality_iters")
    if loc_iters is None:
        loc_iters = max(default_locality_iters(len(ctx.lengths), L, G, ctx.repack) // rounds, 100)
    for rnd in range(rounds):
        t0 = time.perf_counter()
        x = ctx.loads(mb, sg)
        eg, rinfo = reorder(x, ctx.model, ctx.cluster, seed=ctx.seed + rnd, num_seeds=o.get("num_seeds"),
                            workers=ctx.workers, init=eg, objective=objective,
                            beta=o.get("beta", DEFAULT_BETA), iters=iters, smooth=o.get("smooth"),
                            node_comp=node_comp, skew_cap=skew_cap)
        t1 = time.perf_counter()
        mb, sg, linfo = anneal_locality(ctx.counts, ctx.lengths, mb, sg, eg, ctx.model, ctx.cluster,
                                        num_micro_batches=ctx.num_micro_batches, repack=ctx.repack,
                                        token_cap=o.get("token_cap"), tol=o.get("tol", 0.05), seed=ctx.seed + rnd,
                                        iters=loc_iters, beta=o.get("beta", DEFAULT_BETA),
                                        smooth=bool(o.get("locality_smooth", False)))
        t2 = time.perf_counter()
        timing[f"reorder_s_{rnd}"] = t1 - t0
        timing[f"locality_s_{rnd}"] = t2 - t1
        objectives.append({"reorder": rinfo, "locality": linfo})
    if o.get("final_reorder", False):
        t0 = time.perf_counter()
        eg, rinfo = reorder(ctx.loads(mb, sg), ctx.model, ctx.cluster, seed=ctx.seed + rounds,
                            num_seeds=o.get("num_seeds"), workers=ctx.workers, init=eg, objective=objective,
                            beta=o.get("beta", DEFAULT_BETA), iters=final_iters(o, iters),
                            smooth=o.get("smooth"), node_comp=node_comp, skew_cap=skew_cap)
        timing["reorder_s_final"] = time.perf_counter() - t0
        ctx.stats["final_reorder"] = rinfo
    ctx.stats["rounds"] = objectives
    ctx.stats["objective"] = objectives[-1]["locality"]["objective"]
    t0 = time.perf_counter()
    eg, sg, ctx.stats["migration"] = migrate(eg, mb, sg, ctx.counts, ctx.num_micro_batches, ctx.model, ctx.cluster,
                                             o, node_comp or replicated)
    timing["migration_s"] = time.perf_counter() - t0
    return eg, mb, sg


def previous_homes(options: dict[str, Any], model: ModelSpec, cluster: ClusterSpec) -> np.ndarray:
    """int64 ``[L, E]``: the placement before this batch (option ``previous``: a Placement or array; default
    the static Megatron placement, what the trainer starts from)."""
    prev = options.get("previous")
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


def migrate(eg: np.ndarray, mb: np.ndarray, sg: np.ndarray, counts: np.ndarray, num_micro_batches: int,
            model: ModelSpec, cluster: ClusterSpec, options: dict[str, Any], node_comp: bool
            ) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Migration-aware finish of relibra-inter (``planners.migration``): relabel GPUs by the fabric's
    symmetries to keep the most experts at their previous homes (cost unchanged), then keep a layer's
    previous homes where the new ones do not pay for their move. Option ``migration=False`` skips both.

    Returns (homes [L, E], sample GPUs [N], info).
    """
    from .migration import keep_previous_layers, relabel_to_previous

    if not options.get("migration", True):
        return eg, sg, {"enabled": False}
    prev = previous_homes(options, model, cluster)
    perm = relabel_to_previous(eg, prev, cluster)
    eg, sg = perm[eg], perm[np.asarray(sg, dtype=np.int64)]
    x = loads_from_counts(counts, mb, sg, num_micro_batches, cluster.num_gpus)
    moved_before = int((eg != prev).sum())
    eg, info = keep_previous_layers(x, eg, prev, model, cluster, node_comp=node_comp,
                                    optimizer_bytes_per_param=float(options.get("optimizer_bytes_per_param", 12.0)))
    info.update({"enabled": True, "relabel": perm.tolist(), "moved_after_relabel": moved_before,
                 "moved": int((eg != prev).sum())})
    return eg, sg, info


def strategy_relibra_inter(ctx: PlanContext) -> BatchPlan:
    """Reorder + locality (+ repacking) with migration pricing (``relibra_inter``), no replicas."""
    return _plan(ctx, *relibra_inter(ctx))


def strategy_relibra(ctx: PlanContext) -> BatchPlan:
    """relibra-inter's reorder and locality (its migration pricing aware that replicas follow), then Algorithm 2
    per micro-batch and layer, replicas priced for their exposed push / pull (``replica_pricing``). Replication
    only lowers each cell's T_MoE, so without migration pricing the plan is relibra-inter's plus replicas, never
    slower; ``skew_cap`` asks for rank-level balance instead (``rank_balance_options``)."""
    from .replicate import replicate_batch

    eg, mb, sg = relibra_inter(ctx, replicated=ctx.replica_slots > 0)
    placement = Placement(eg)
    samples = SamplePlacement(mb, sg, ctx.num_micro_batches)
    t0 = time.perf_counter()
    replicas = replicate_batch(placement, samples, ctx.batch_for(mb), ctx.model, ctx.cluster, ctx.replica_slots,
                               workers=ctx.workers, seed=ctx.seed, attn_fwd=replica_pricing(ctx.options, ctx.lengths,
                                                                                            samples, ctx.model,
                                                                                            ctx.cluster))
    ctx.stats.setdefault("timing", {})["replicate_s"] = time.perf_counter() - t0
    return _plan(ctx, eg, mb, sg, replicas)


def strategy_lplb(ctx: PlanContext) -> BatchPlan:
    """LPLB+: EPLB+ homes (no redundant experts), at most one copy per expert on the intra-node ring, an
    exact LP split per micro-batch and layer."""
    from .lplb import lplb_replicas

    x = ctx.loads(ctx.micro_batch, ctx.sample_gpu)
    eg, _ = baselines.eplb(x.sum(axis=(0, 2)), ctx.cluster.num_gpus, ctx.cluster.gpus_per_node, 0,
                           ctx.options.get("num_groups"))
    mb, sg = _maybe_repack(ctx, eg)
    placement = Placement(eg)
    samples = SamplePlacement(mb, sg, ctx.num_micro_batches)
    replicas = lplb_replicas(placement, samples, ctx.batch_for(mb), ctx.model, ctx.cluster,
                             replica_slots=ctx.replica_slots, workers=ctx.workers)
    return _plan(ctx, eg, mb, sg, replicas)


def replica_pricing(options: dict[str, Any], lengths: np.ndarray, samples: SamplePlacement, model: ModelSpec,
                    cluster: ClusterSpec) -> np.ndarray | None:
    """``[M]`` attention-forward seconds that the replica transfers overlap (``sim.attention_forward``), so that
    replication prices its exposed push / pull; None with option ``price_replicas=False``."""
    if not options.get("price_replicas", True):
        return None
    from ..sim import attention_forward

    return attention_forward(lengths, samples.micro_batch, samples.gpu, samples.num_micro_batches, model, cluster)


STRATEGIES: dict[str, Callable[[PlanContext], BatchPlan]] = {
    "static": strategy_static,
    "lpt": strategy_lpt,
    "eplb": strategy_eplb,
    "balanced": strategy_balanced,
    "relibra-inter": strategy_relibra_inter,
    "lplb": strategy_lplb,
    "relibra": strategy_relibra,
}
from .history import strategy_eplb_history  # noqa: E402  (the module imports helpers defined above)
from .online import strategy_online  # noqa: E402

STRATEGIES.update({"eplb-history": strategy_eplb_history, "online": strategy_online})


REPLICA_STRATEGIES = ("eplb", "lplb", "relibra", "eplb-history", "online")
"""The strategies that place replicas (read ``replica_slots``)."""
RELIBRA_STRATEGIES = ("relibra", "relibra-inter")
"""The ReLibra strategies: reorder + locality (+ replication); they read ``skew_cap`` / ``node_comp``."""

PLAN_OPTIONS = frozenset({
    "balanced_sources", "beta", "final_iters", "final_reorder", "history", "iters", "locality_iters",
    "locality_smooth", "migration", "node_comp", "num_groups", "num_seeds", "objective", "optimizer_bytes_per_param",
    "previous", "price_replicas", "rounds", "skew_cap", "smooth", "token_cap", "tol"})
"""The keyword options ``plan_batch`` understands (see its docstring); anything else is a PlanError."""


def check_plan_args(*, replica_slots: Any = 0, seed: Any = 0, workers: Any = 1,
                    options: dict[str, Any] | None = None) -> None:
    """Raise PlanError naming the argument and its value unless ``replica_slots`` (int >= 0), ``seed``
    (int >= 0), ``workers`` (int >= 1) and the strategy ``options`` (known names; ``iters``,
    ``locality_iters``, ``final_iters`` ints >= 0, ``num_seeds`` / ``rounds`` ints >= 1, ``beta`` > 0,
    ``objective`` / ``balanced_sources`` one of their values) are valid."""
    check_int("replica_slots", replica_slots, 0)
    check_int("seed", seed, 0)
    check_int("workers", workers, 1)
    options = options or {}
    unknown = sorted(set(options) - PLAN_OPTIONS)
    if unknown:
        raise PlanError(f"unknown plan option {unknown[0]}={options[unknown[0]]!r}; known: {sorted(PLAN_OPTIONS)}")
    for name, lo in (("iters", 0), ("locality_iters", 0), ("final_iters", 0), ("num_seeds", 1), ("rounds", 1),
                     ("num_groups", 1)):
        if options.get(name) is not None:
            check_int(name, options[name], lo)
    if options.get("beta") is not None:
        check_positive("beta", options["beta"])
    for name, allowed in (("objective", ("batch", "aggregate")), ("balanced_sources", ("batch", "even"))):
        if name in options and options[name] not in allowed:
            raise PlanError(f"{name}={options[name]!r} is not one of {allowed}")
    rank_balance_options(options)


def plan_batch(batch: TraceBatch, model: ModelSpec, cluster: ClusterSpec, strategy: str, *, replica_slots: int = 0,
               seed: int = 0, workers: int = 1, repack: bool = False, micro_batch_size: int | None = None,
               **options: Any) -> BatchPlan:
    """Plan one global batch with a named strategy.

    Args:
        batch: a TraceBatch (with a micro-batch assignment unless ``micro_batch_size`` is given).
        strategy: a key of ``STRATEGIES``.
        replica_slots: r replica slots per GPU (eplb, lplb, relibra).
        seed: plan seed (same inputs and seed -> same plan).
        workers: processes for the parallel parts.
        repack: let samples change micro-batch (equal sample counts per micro-batch unless
            ``token_cap`` is in options).
        micro_batch_size: re-assign micro-batches as sample i -> i // B first.
        options: strategy options: ``iters``, ``num_seeds``, ``objective`` ("batch" | "aggregate"),
            ``smooth``, ``locality_iters``, ``locality_smooth``, ``rounds`` (default 2), ``tol``, ``token_cap``,
            ``num_groups`` (EPLB), ``beta``, ``balanced_sources`` ("batch" | "even"), and the pricing options of
            the module docstring (``migration``, ``previous``, ``optimizer_bytes_per_param``, ``price_replicas``,
            ``node_comp``, ``skew_cap``, ``final_reorder``, ``final_iters``): ``PLAN_OPTIONS``.

    Raises:
        PlanError: unknown strategy or option, a bad argument value (``check_plan_args``), a batch for
            another model, or E not divisible by G (the message names the field and the value).

    Returns:
        A validated BatchPlan; ``stats`` has ``strategy``, ``seed``, ``replica_slots``, ``repack``,
        objective values, ``fallbacks`` and (kept out of saved files) ``solve_seconds`` and ``timing``.
    """
    if strategy not in STRATEGIES:
        raise PlanError(f"unknown strategy {strategy!r}; known: {sorted(STRATEGIES)}")
    check_plan_args(replica_slots=replica_slots, seed=seed, workers=workers, options=options)
    for name in ("skew_cap", "node_comp"):
        if options.get(name) is not None and strategy not in RELIBRA_STRATEGIES:
            raise PlanError(f"{name}={options[name]!r} only applies to {' and '.join(RELIBRA_STRATEGIES)}, not "
                            f"strategy {strategy!r}")
    if options.get("history") is not None and strategy != "eplb-history":
        raise PlanError(f"history= (past loads) only applies to strategy 'eplb-history', not {strategy!r}")
    if options.get("token_cap") is not None and not repack:
        raise PlanError(f"token_cap={options['token_cap']!r} only applies with repack=True (--repack)")
    check_batch_type(batch)
    if batch.num_experts != model.num_experts or batch.num_layers != model.num_layers:
        raise PlanError(f"batch has L={batch.num_layers}, E={batch.num_experts}; model {model.name} has "
                        f"L={model.num_layers}, E={model.num_experts}")
    if model.num_experts % cluster.num_gpus:
        raise PlanError(f"num_experts={model.num_experts} is not divisible by num_gpus={cluster.num_gpus}")
    t0 = time.perf_counter()
    if micro_batch_size is not None:
        batch = batch.with_micro_batch_size(int(micro_batch_size))
    mb = batch.resolve_micro_batch()
    M = int(mb.max()) + 1
    ctx = PlanContext(batch=batch, model=model, cluster=cluster, counts=batch.sample_expert_counts(),
                      lengths=np.asarray(batch.lengths, dtype=np.int64), micro_batch=mb, num_micro_batches=M,
                      sample_gpu=round_robin_gpus(mb, cluster.num_gpus), replica_slots=int(replica_slots),
                      seed=int(seed), workers=max(1, int(workers)), repack=bool(repack), options=dict(options))
    ctx.stats.update({"strategy": strategy, "seed": int(seed), "replica_slots": int(replica_slots),
                      "repack": bool(repack), "fallbacks": 0,
                      "options": {k: v for k, v in sorted(options.items())}})
    plan = STRATEGIES[strategy](ctx)
    plan.stats["solve_seconds"] = time.perf_counter() - t0
    plan.stats["batch_sha1"] = batch_sha1(batch)
    plan.validate(model, cluster, num_samples=batch.num_sequences)
    return plan
