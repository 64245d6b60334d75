"""Evaluate a plan: the loads it induces, the sum of T_MoE, and the bound no plan can beat.

One evaluation for every strategy (docs/architecture.md, "Contracts"). ``score_plan`` rebuilds the loads
``x [M, L, G, E]`` from the batch and the plan's sample placement (``plan_loads``), routes them with the plan
(homes, plus the replica split rows where present, as ``ReplicaPlan.shares`` defines them: ``plan_flow``)
and evaluates ``cost.cost_from_flow`` (docs/method.md, "Cost model"). A plan whose ``stats.strategy`` is
``"balanced"`` scores as the bound instead (``bound_terms``: a proven lower bound of the sum of T_MoE of every
plan of the batch with at most ``stats.replica_slots`` replica slots, docs/method.md, "The bound"). The
simulated step (moves, replica and reorder traffic charged) is ``relibra_moe.sim``, on the same loads.

Importable without the planners: the planners, the simulator and the CLI all evaluate through this module.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from .cost import DEFAULT_BETA, cost_from_flow
from .errors import PlanError
from .plan import BatchPlan
from .sample_placements import place_samples
from .specs import ClusterSpec, ModelSpec
from .trace import TraceBatch
from .validate import check_int, check_positive

__all__ = ["batch_sha1", "check_batch_type", "check_batch_model", "check_plan_batch", "placement_loads", "plan_loads",
           "plan_flow", "Bound", "bound_terms", "bound_t_moe", "bound_micro_batch", "micro_batch_rows", "token_shares",
           "PlanScore", "score_plan"]


def batch_sha1(batch: TraceBatch) -> str:
    """Fingerprint of a batch's routing: SHA-1 (hex) of its lengths int64 ``[N]`` and
    ``sample_expert_counts()`` int64 ``[N, L, E]`` (not of its micro-batch assignment: the plan carries its own).

    ``plan_batch`` and ``Planner`` store it as ``stats.batch_sha1``; ``check_plan_batch`` compares it.
    """
    h = hashlib.sha1(np.asarray(batch.lengths, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(batch.sample_expert_counts(), dtype=np.int64).data)
    return h.hexdigest()


def check_batch_type(batch: object) -> None:
    """Raise PlanError unless ``batch`` is a ``TraceBatch`` (not, say, a loads array)."""
    if not isinstance(batch, TraceBatch):
        raise PlanError(f"batch must be a TraceBatch, got {type(batch).__name__}")


def check_batch_model(batch: TraceBatch, model: ModelSpec, where: str = "batch") -> None:
    """Raise PlanError unless ``batch``'s L and E are ``model``'s; ``where`` names the batch in the message
    (e.g. ``"trace FILE"``)."""
    if (batch.num_layers, batch.num_experts) != (model.num_layers, model.num_experts):
        raise PlanError(f"{where} has L={batch.num_layers}, E={batch.num_experts}; model {model.name} has "
                        f"L={model.num_layers}, E={model.num_experts}")


def check_plan_batch(plan: BatchPlan, batch: TraceBatch, model: ModelSpec, *,
                     allow_missing_fingerprint: bool = False) -> None:
    """Raise PlanError unless ``plan`` is a BatchPlan and ``batch`` a TraceBatch that fits ``model`` and is the batch
    ``plan`` was made for: same L and E, same sample count, and the same fingerprint (``stats.batch_sha1``,
    which ``plan_batch`` and ``Planner`` record). A plan without a fingerprint (a hand-built plan, or a file
    whose ``stats_json`` lost it) cannot prove it was made for ``batch``: ``PlanError`` saying so, unless
    ``allow_missing_fingerprint=True`` (the CLI's ``--allow-unfingerprinted``)."""
    if not isinstance(plan, BatchPlan):
        raise PlanError(f"plan must be a BatchPlan, got {type(plan).__name__}")
    check_batch_type(batch)
    check_batch_model(batch, model)
    if (plan.num_layers, plan.num_experts) != (model.num_layers, model.num_experts):
        raise PlanError(f"plan has L={plan.num_layers}, E={plan.num_experts}; model {model.name} has "
                        f"L={model.num_layers}, E={model.num_experts}")
    if batch.num_sequences != plan.samples.num_samples:
        raise PlanError(f"the plan places {plan.samples.num_samples} samples, the batch has {batch.num_sequences}")
    want = plan.stats.batch_sha1
    if want is None and not allow_missing_fingerprint:
        at = f"plan file {plan.origin}" if plan.origin is not None else "the plan"
        raise PlanError(f"{at} has no batch fingerprint (stats batch_sha1), so it cannot be checked against this "
                        "batch; pass allow_missing_fingerprint=True (CLI: --allow-unfingerprinted) to use it anyway")
    if want is not None and want != batch_sha1(batch):
        raise PlanError(f"plan was made for another batch: its stats batch_sha1={want!r}, this batch's is "
                        f"{batch_sha1(batch)!r} (same {batch.num_sequences} samples, different routing or lengths)")


def placement_loads(batch: TraceBatch, micro_batch: np.ndarray, sample_gpu: np.ndarray, num_micro_batches: int,
                    num_gpus: int) -> np.ndarray:
    """int64 ``[M, L, G, E]``: ``TraceBatch.loads`` for a sample placement (sample n in micro-batch
    ``micro_batch[n]`` on GPU ``sample_gpu[n]``), with M = ``num_micro_batches`` (trailing empty ones zero)."""
    x = np.asarray(batch.loads(sample_gpu, num_gpus, micro_batch))
    M = int(num_micro_batches)
    if x.shape[0] < M:
        x = np.concatenate([x, np.zeros((M - x.shape[0],) + x.shape[1:], x.dtype)])
    return x


def plan_loads(plan: BatchPlan, batch: TraceBatch, num_gpus: int) -> np.ndarray:
    """int64 ``[M, L, G, E]``: the batch's loads under the plan's sample placement (M = the plan's; trailing
    empty micro-batches are zero). A sample placed outside ``[0, M)`` / ``[0, num_gpus)`` is the plan's
    fault: ``PlanError`` naming ``sample_micro_batch[i]`` / ``sample_gpu[i]`` (and the plan file)."""
    if batch.num_sequences != plan.samples.num_samples:
        raise PlanError(f"the plan places {plan.samples.num_samples} samples, the batch has {batch.num_sequences}")
    at = f"plan file {plan.origin}: " if plan.origin is not None else ""
    for name, arr, hi in (("sample_micro_batch", plan.samples.micro_batch, plan.num_micro_batches),
                          ("sample_gpu", plan.samples.gpu, num_gpus)):
        bad = np.flatnonzero((arr < 0) | (arr >= hi))
        if len(bad):
            i = int(bad[0])
            raise PlanError(f"{at}{name}[{i}] = {int(arr[i])} is outside [0, {int(hi)})")
    return placement_loads(batch, plan.samples.micro_batch, plan.samples.gpu, plan.num_micro_batches, num_gpus)


def plan_flow(plan: BatchPlan, x: np.ndarray) -> np.ndarray:
    """float64 ``[M, L, G, G]``: tokens sent from source GPU j to serving GPU g under the plan.

    ``x`` is ``[M, L, G, E]`` (tokens of source j routed to expert e). Pairs without split rows go to
    the expert's home; the (m, l, j, e) pairs that have split rows are served as the rows say (the
    same rule as ``ReplicaPlan.shares``), without building the dense ``[M, L, G, E, G]`` shares.
    """
    x = np.asarray(x, dtype=np.float64)
    M, L, G, E = x.shape
    home = plan.placement.expert_gpu.astype(np.int64)  # [L, E]
    onehot = (home[:, :, None] == np.arange(G)).astype(np.float64)  # [L, E, G]
    flow = np.matmul(x, onehot[None])  # [M, L, G, E] @ [1, L, E, G]
    split = _split_rows(plan, L, G, E)
    if split is not None:
        (m, l, j, e, g, share), (um, ul, uj, ue) = split
        np.subtract.at(flow, (um, ul, uj, home[ul, ue]), x[um, ul, uj, ue])
        np.add.at(flow, (m, l, j, g), x[m, l, j, e] * share)
    return flow


def _split_rows(plan: BatchPlan, L: int, G: int, E: int
                ) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]] | None:
    """The plan's split rows as int64 columns ``(m, l, j, e, g, share)`` and the first row of each split
    (m, l, j, e) pair ``(m, l, j, e)`` (whose tokens leave the home), or None without split rows."""
    idx = plan.replicas.split_index.astype(np.int64)
    if not len(idx):
        return None
    m, l, j, e, g = idx.T
    share = plan.replicas.split_share.astype(np.float64)
    _, first = np.unique(((m * L + l) * G + j) * E + e, return_index=True)
    return (m, l, j, e, g, share), (m[first], l[first], j[first], e[first])


def plan_expert_rows(plan: BatchPlan, x: np.ndarray) -> np.ndarray:
    """float64 ``[M, L, G, E]``: (token, expert) pairs of expert e each GPU g serves under the plan, replicas
    included (the rows of its grouped GEMM). The same rule as ``plan_flow``: pairs go to the expert's home unless
    the plan splits their (m, l, j, e) row, then as its shares say. ``rows.sum(-1)`` is ``plan_flow``'s
    ``flow.sum(-2)``, the load ``L_g`` of the cost model."""
    x = np.asarray(x, dtype=np.float64)
    M, L, G, E = x.shape
    home = plan.placement.expert_gpu.astype(np.int64)  # [L, E]
    rows = np.zeros((M, L, G, E))
    li, ei = np.meshgrid(np.arange(L), np.arange(E), indexing="ij")  # [L, E]
    rows[:, li, home, ei] = x.sum(axis=2)
    split = _split_rows(plan, L, G, E)
    if split is not None:
        (m, l, j, e, g, share), (um, ul, uj, ue) = split
        np.subtract.at(rows, (um, ul, home[ul, ue], ue), x[um, ul, uj, ue])
        np.add.at(rows, (m, l, g, e), x[m, l, j, e] * share)
    return rows


@dataclass(frozen=True)
class PlanScore:
    """The cost-model score of one plan on its batch (``score_plan``). Seconds; sums run over (m, l).

    Attributes:
        strategy: ``plan.stats.strategy`` ("unknown" when absent).
        t_moe_s: sum over micro-batches and layers of the exact forward T_MoE (the paper's metric; the
            simulator's ``StepTime.t_moe_s`` is the same figure).
        t_moe_smooth_s: the same sum of the smooth (log-sum-exp, ``beta``) T_MoE.
        moe_fwd_comp_s, moe_fwd_comm_s: ``sum max_g comp`` and ``sum max_g comm`` (the simulator's names).
        rank_skew_mean, rank_skew_max: max GPU load / mean GPU load, mean and max over cells.
        num_micro_batches: M of the plan.
        percent_of_bound: ``100 * bound / t_moe_s`` (the bound's sum of T_MoE over the plan's, ``bound_t_moe``;
            at most 100), None when the bound was not given.
        t_moe: float64 ``[M, L]`` forward T_MoE per cell.
    """

    strategy: str
    t_moe_s: float
    t_moe_smooth_s: float
    moe_fwd_comp_s: float
    moe_fwd_comm_s: float
    rank_skew_mean: float
    rank_skew_max: float
    num_micro_batches: int
    percent_of_bound: float | None = None
    t_moe: np.ndarray = field(repr=False, default_factory=lambda: np.zeros((0, 0)))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready figures (``t_moe`` left out; ``percent_of_bound`` only when known)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "t_moe"}
        if out["percent_of_bound"] is None:
            del out["percent_of_bound"]
        return out


def score_plan(plan: BatchPlan, batch: TraceBatch, model: ModelSpec, cluster: ClusterSpec, *,
               bound_t_moe_s: float | None = None, beta: float = DEFAULT_BETA,
               allow_missing_fingerprint: bool = False) -> PlanScore:
    """Exact cost of a plan on a batch.

    Args:
        plan: a BatchPlan for ``model`` and ``cluster`` (validated here).
        batch: the TraceBatch the plan was made for (same samples; ``check_plan_batch``).
        bound_t_moe_s: the bound's sum of T_MoE (``bound_t_moe``); when given, the result's
            ``percent_of_bound = 100 * bound / t_moe_s``.
        allow_missing_fingerprint: score a plan without ``stats.batch_sha1`` (``check_plan_batch``).

    Returns:
        the ``PlanScore``.

    Raises:
        PlanError: the plan or batch does not fit the model / cluster, or was made for another batch.
    """
    check_plan_batch(plan, batch, model, allow_missing_fingerprint=allow_missing_fingerprint)
    plan.validate(model, cluster, num_samples=batch.num_sequences)
    check_positive("beta", beta)
    if bound_t_moe_s is not None:
        check_positive("bound_t_moe_s", bound_t_moe_s)
    if plan.stats.strategy == "balanced":
        return _bound_score(plan, batch, model, cluster, bound_t_moe_s)
    x = plan_loads(plan, batch, cluster.num_gpus)
    cost = cost_from_flow(plan_flow(plan, x), model, cluster, beta)
    t_moe_s = float(cost.t_moe.sum())
    return PlanScore(
        strategy=plan.stats.strategy or "unknown", t_moe_s=t_moe_s,
        t_moe_smooth_s=float(cost.t_moe_smooth.sum()),
        moe_fwd_comp_s=float(cost.comp.max(axis=-1).sum()), moe_fwd_comm_s=float(cost.comm.max(axis=-1).sum()),
        rank_skew_mean=float(cost.rank_skew.mean()), rank_skew_max=float(cost.rank_skew.max()),
        num_micro_batches=plan.num_micro_batches,
        percent_of_bound=None if bound_t_moe_s is None else 100.0 * float(bound_t_moe_s) / t_moe_s,
        t_moe=cost.t_moe)




@dataclass(frozen=True)
class Bound:
    """Per-layer lower bounds of the MoE terms every plan of a batch pays (``bound_terms``; docs/method.md,
    "The bound"). Seconds, float64 ``[L]``; each bounds a sum over the micro-batches of that layer.

    Attributes:
        comp: ``sum_m max_g comp`` is at least this: the layer's (token, expert) pairs spread evenly over the G
            GPUs at the peak GEMM rate.
        comm: ``sum_m max_g comm`` (dispatch + combine) is at least this: the pairs no placement can keep on
            their source GPU (node), spread evenly over the GPUs' links.
        off_gpu, off_node: float64 ``[L]`` (token, expert) pairs that must leave their source GPU / node (at least).
    """

    comp: np.ndarray
    comm: np.ndarray
    off_gpu: np.ndarray
    off_node: np.ndarray

    @property
    def t_moe_s(self) -> float:
        """Lower bound of the sum over micro-batches and layers of T_MoE (``max_g comp + max_g comm``)."""
        return float(self.comp.sum() + self.comm.sum())


def _link_seconds(off_gpu: np.ndarray, off_node: np.ndarray, cluster: ClusterSpec, model: ModelSpec) -> np.ndarray:
    """Seconds (any shape): the least ``max(a t_nv, b t_rdma)`` over NVLink pairs ``a`` and RDMA pairs ``b`` with
    ``a + b >= off_gpu`` and ``b >= off_node`` (a cross-rail pair counts on both links, which only adds), on one
    GPU's links; ``t_*``: seconds of one pair on that link, the dispatcher's copies included."""
    rates = cluster.rates(model)
    t_nv, t_rdma = rates.nvlink_sec_per_pair, rates.rdma_sec_per_pair
    if cluster.nodes == 1:  # every crossing pair is on NVLink
        return off_gpu * t_nv
    if cluster.gpus_per_node == 1:  # no NVLink peer: every crossing pair is on RDMA
        return off_gpu * t_rdma
    return np.maximum(off_gpu * t_nv * t_rdma / (t_nv + t_rdma), off_node * t_rdma)


def bound_terms(batch: TraceBatch, model: ModelSpec, cluster: ClusterSpec, replica_slots: int = 0, *,
                micro_batch: np.ndarray | None = None, peak_flops: float | None = None) -> Bound:
    """Lower bounds of the MoE terms of every plan of ``batch`` with at most ``replica_slots`` replica slots per
    GPU, whatever its expert homes, replicas, splits and sample placement (docs/method.md, "The bound", has the
    proof). ``micro_batch`` int ``[N]`` or ``[K, N]``: the plans keep these micro-batches (no repacking), or one of
    the K packings (``bound_micro_batch``), which tightens the communication term; None: any packing.

    Compute: a layer's pairs ``P_l`` are served somewhere, so ``sum_m max_g comp >= P_l c / G`` with ``c`` the
    seconds of one pair at ``peak_flops`` (default ``cluster.flops``, the cost model's single rate; the simulator
    passes the fastest rate of its GEMM curve). Communication: a GPU serves at most ``S = E/G + r`` experts in a
    cell (its homes and its replica slots), and a sample runs on one GPU, so at most its ``S`` largest expert
    counts stay on that GPU and at most its ``S x gpus_per_node`` largest on that node; the rest leave from its
    GPU over NVLink or RDMA (off the node: RDMA), at least ``_link_seconds`` of that GPU's links, dispatch and
    combine alike. Per micro-batch ``max_g comm`` is at least twice the larger of that time for the
    micro-batch's worst sample and for its total spread evenly over the G GPUs; the layer's bound sums these
    (without fixed micro-batches: the larger of the batch's worst sample and its total over G; with K packings:
    the least of the K sums, per layer).

    Raises:
        PlanError: a batch for another model, ``replica_slots`` < 0, a ``micro_batch`` of another length.
    """
    check_batch_type(batch)
    check_batch_model(batch, model)
    check_int("replica_slots", replica_slots, 0)
    G, P = cluster.num_gpus, cluster.gpus_per_node
    counts = np.asarray(batch.sample_expert_counts(), dtype=np.int64)  # [N, L, E]
    pairs = counts.sum(axis=(0, 2)).astype(np.float64)
    flops = float(cluster.flops if peak_flops is None else peak_flops)
    comp = pairs * model.flops_per_token_expert / flops / G
    slots = model.num_experts // G + int(replica_slots)
    off_gpu = _pairs_beyond(counts, slots) if G > 1 else np.zeros(counts.shape[:2])  # [N, L]
    off_node = _pairs_beyond(counts, slots * P) if cluster.nodes > 1 else np.zeros(counts.shape[:2])
    worst = _link_seconds(off_gpu, off_node, cluster, model)  # [N, L]: one sample's pairs leave from one GPU
    if micro_batch is None:
        comm = np.maximum(_link_seconds(off_gpu.sum(0), off_node.sum(0), cluster, model) / G, worst.max(0))
    else:
        comm = np.min([_packed_comm(mb, off_gpu, off_node, worst, cluster, model)
                       for mb in micro_batch_rows(micro_batch, counts.shape[0])], axis=0)
    return Bound(comp=comp, comm=2.0 * comm, off_gpu=off_gpu.sum(0), off_node=off_node.sum(0))


def micro_batch_rows(micro_batch: np.ndarray, num_samples: int) -> np.ndarray:
    """int64 ``[K, N]``: ``micro_batch`` (int ``[N]``, one packing, or ``[K, N]``, K of them) as rows.

    Raises:
        PlanError: a ``micro_batch`` whose last axis is not the batch's ``num_samples``, or of more than 2 axes.
    """
    mb = np.asarray(micro_batch, dtype=np.int64)
    if mb.ndim not in (1, 2) or mb.shape[-1] != num_samples or mb.shape[0] == 0:
        raise PlanError(f"micro_batch has shape {mb.shape}, the batch has {num_samples} samples")
    return mb.reshape(-1, num_samples)


def _packed_comm(mb: np.ndarray, off_gpu: np.ndarray, off_node: np.ndarray, worst: np.ndarray, cluster: ClusterSpec,
                 model: ModelSpec) -> np.ndarray:
    """float64 ``[L]``: the dispatch half of the communication bound for the micro-batches ``mb`` int ``[N]``: per
    micro-batch the larger of its worst sample's link seconds and its off pairs spread over the G GPUs, summed."""
    M, L = int(mb.max(initial=-1)) + 1, off_gpu.shape[1]
    tot_gpu, tot_node, top = np.zeros((M, L)), np.zeros((M, L)), np.zeros((M, L))
    np.add.at(tot_gpu, mb, off_gpu)
    np.add.at(tot_node, mb, off_node)
    np.maximum.at(top, mb, worst)
    return np.maximum(_link_seconds(tot_gpu, tot_node, cluster, model) / cluster.num_gpus, top).sum(0)


def _pairs_beyond(counts: np.ndarray, slots: int) -> np.ndarray:
    """float64 ``[N, L]``: each sample's pairs outside its ``slots`` largest experts (``counts`` int ``[N, L, E]``):
    the pairs of a sample that no set of ``slots`` experts can serve."""
    E = counts.shape[-1]
    if slots >= E:
        return np.zeros(counts.shape[:2])
    return np.partition(counts, E - slots - 1, axis=-1)[..., : E - slots].sum(axis=-1).astype(np.float64)


def bound_t_moe(batch: TraceBatch, model: ModelSpec, cluster: ClusterSpec, replica_slots: int = 0,
                micro_batch: np.ndarray | None = None) -> float:
    """Seconds: a lower bound of the sum over micro-batches and layers of T_MoE (the cost model's, one GEMM rate)
    of every plan of ``batch`` with at most ``replica_slots`` replica slots (and the micro-batches ``micro_batch``
    when given; ``bound_terms``)."""
    return bound_terms(batch, model, cluster, replica_slots, micro_batch=micro_batch).t_moe_s


def bound_micro_batch(plan: BatchPlan, batch: TraceBatch) -> np.ndarray | None:
    """int64 ``[K, N]``: the packings the Balanced ``plan`` bounds plans for, or None (any packing) when it was made
    with ``repack`` (``stats.repack``).

    Without repacking a plan keeps the micro-batches of its sample placement (``sample_placements``): round-robin,
    longest-first and a trainer's own keep the batch's, verl's length-balanced regroups them. So the rows are the
    Balanced plan's own micro-batches, the batch's (when it has them, with the same count), and the length-balanced
    regrouping of the plan's (``place_samples``; it reads only their count); the bound takes the least over them.
    """
    if plan.stats.repack:
        return None
    own = np.asarray(plan.samples.micro_batch, dtype=np.int64)
    rows = [own, place_samples("length-balanced", np.asarray(batch.lengths), own, plan.num_gpus)[0]]
    if batch.micro_batch is not None:
        mb = np.asarray(batch.micro_batch, dtype=np.int64)
        if mb.shape == own.shape and mb.min(initial=0) >= 0 and mb.max(initial=-1) + 1 == plan.num_micro_batches:
            rows.append(mb)
    return np.unique(np.stack(rows), axis=0)


def token_shares(batch: TraceBatch, micro_batch: np.ndarray, num_micro_batches: int) -> np.ndarray:
    """float64 ``[M]``: each micro-batch's share of the batch's tokens (uniform when it has none): how the bound's
    per-layer figures are spread over micro-batches for display (an empty micro-batch gets 0)."""
    tok = np.bincount(np.asarray(micro_batch, dtype=np.int64), weights=np.asarray(batch.lengths, np.float64),
                      minlength=int(num_micro_batches))[: int(num_micro_batches)]
    return tok / tok.sum() if tok.sum() > 0 else np.full(int(num_micro_batches), 1.0 / max(int(num_micro_batches), 1))


def _bound_score(plan: BatchPlan, batch: TraceBatch, model: ModelSpec, cluster: ClusterSpec,
                 bound_t_moe_s: float | None) -> PlanScore:
    """The ``PlanScore`` of the bound for the replica slots ``plan.stats.replica_slots`` (the Balanced plan's):
    ``t_moe`` spreads each layer's bound over the plan's micro-batches by their tokens (``token_shares``); rank
    skew 1."""
    b = bound_terms(batch, model, cluster, plan.planned_replica_slots,
                    micro_batch=bound_micro_batch(plan, batch))
    M = plan.num_micro_batches
    t = token_shares(batch, plan.samples.micro_batch, M)[:, None] * (b.comp + b.comm)[None, :]
    total = b.t_moe_s
    return PlanScore(strategy="balanced", t_moe_s=total, t_moe_smooth_s=total, moe_fwd_comp_s=float(b.comp.sum()),
                     moe_fwd_comm_s=float(b.comm.sum()), rank_skew_mean=1.0, rank_skew_max=1.0, num_micro_batches=M,
                     percent_of_bound=None if bound_t_moe_s is None else 100.0 * float(bound_t_moe_s) / total,
                     t_moe=t)
