"""Evaluate a plan: the loads it induces, the sum of T_MoE, and the Balanced reference.

One evaluation for every strategy (docs/architecture.md, "Contracts"). ``score_plan`` rebuilds the loads
``x [M, L, G, E]`` from the batch and the plan's sample placement (``plan_loads``), routes them with the plan
(homes, plus the replica split rows where present, as ``ReplicaPlan.shares`` defines them: ``plan_flow``)
and evaluates ``cost.cost_from_flow`` (docs/method.md, "Cost model"). A plan whose ``stats["strategy"]`` is
``"balanced"`` is scored on the Balanced ideal's loads instead (``balanced_plan_loads``: uniform random
routing, each source GPU keeping its tokens, or an even split when ``stats["balanced_sources"]`` is "even";
seeded by ``stats["seed"]``), so that it scores as the ideal. The simulated step (moves, replica and
reorder traffic charged) is ``relibra_moe.sim``, on the same loads.

Importable without the planners: the planners, the simulator and the CLI all evaluate through this module.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
from numba import njit

from .cost import DEFAULT_BETA, cost_from_flow, moe_cost
from .errors import PlanError
from .plan import BatchPlan, Placement, round_robin_gpus
from .specs import ClusterSpec, ModelSpec
from .trace import TraceBatch
from .validate import check_positive

__all__ = ["batch_sha1", "check_batch_type", "check_batch_model", "check_plan_batch", "placement_loads", "plan_loads",
           "plan_flow", "balanced_loads", "balanced_sources", "balanced_plan_loads", "balanced_t_moe", "uniform_loads",
           "PlanScore", "score_plan"]


def batch_sha1(batch: TraceBatch) -> str:
    """Fingerprint of a batch's routing: SHA-1 (hex) of its lengths int64 ``[N]`` and
    ``sample_expert_counts()`` int64 ``[N, L, E]`` (not of its micro-batch assignment: the plan carries its own).

    ``plan_batch`` and ``Planner`` store it as ``stats["batch_sha1"]``; ``check_plan_batch`` compares it.
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
    ``plan`` was made for: same L and E, same sample count, and the same fingerprint (``stats["batch_sha1"]``,
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
    want = plan.stats.get("batch_sha1")
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


def balanced_plan_loads(plan: BatchPlan, batch: TraceBatch, model: ModelSpec, num_gpus: int) -> np.ndarray:
    """int64 ``[M, L, G, E]``: the Balanced ideal of ``batch`` for the plan's sample placement (docs/method.md,
    "Balanced reference").

    Every token draws its k experts uniformly at random (seeded by ``plan.stats["seed"]``); each source GPU
    keeps the tokens the plan gives it, or, when ``plan.stats["balanced_sources"] == "even"``, every
    micro-batch's tokens are split evenly over the G sources (``balanced_sources`` / ``balanced_loads``).
    """
    src = balanced_sources(batch.lengths, plan.samples.micro_batch, plan.samples.gpu, plan.num_micro_batches,
                           num_gpus, plan.stats.get("balanced_sources", "batch"))
    return balanced_loads(src, model, int(plan.stats.get("seed", 0)))


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
        strategy: ``plan.stats["strategy"]`` ("unknown" when absent).
        t_moe_s: sum over micro-batches and layers of the exact forward T_MoE (the paper's metric; the
            simulator's ``StepTime.t_moe_s`` is the same figure).
        t_moe_smooth_s: the same sum of the smooth (log-sum-exp, ``beta``) T_MoE.
        moe_fwd_comp_s, moe_fwd_comm_s: ``sum max_g comp`` and ``sum max_g comm`` (the simulator's names).
        rank_skew_mean, rank_skew_max: max GPU load / mean GPU load, mean and max over cells.
        num_micro_batches: M of the plan.
        percent_of_balanced: ``100 * balanced / t_moe_s`` (the Balanced ideal's sum over the plan's), None when
            the Balanced total was not given.
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
    percent_of_balanced: float | None = None
    t_moe: np.ndarray = field(repr=False, default_factory=lambda: np.zeros((0, 0)))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready figures (``t_moe`` left out; ``percent_of_balanced`` only when known)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "t_moe"}
        if out["percent_of_balanced"] is None:
            del out["percent_of_balanced"]
        return out


def score_plan(plan: BatchPlan, batch: TraceBatch, model: ModelSpec, cluster: ClusterSpec, *,
               balanced_t_moe_s: float | None = None, beta: float = DEFAULT_BETA,
               allow_missing_fingerprint: bool = False) -> PlanScore:
    """Exact cost of a plan on a batch.

    Args:
        plan: a BatchPlan for ``model`` and ``cluster`` (validated here).
        batch: the TraceBatch the plan was made for (same samples; ``check_plan_batch``).
        balanced_t_moe_s: the Balanced ideal's sum of T_MoE (``balanced_t_moe``); when given, the result's
            ``percent_of_balanced = 100 * balanced / t_moe_s``.
        allow_missing_fingerprint: score a plan without ``stats["batch_sha1"]`` (``check_plan_batch``).

    Returns:
        the ``PlanScore``.

    Raises:
        PlanError: the plan or batch does not fit the model / cluster, or was made for another batch.
    """
    check_plan_batch(plan, batch, model, allow_missing_fingerprint=allow_missing_fingerprint)
    plan.validate(model, cluster, num_samples=batch.num_sequences)
    check_positive("beta", beta)
    if balanced_t_moe_s is not None:
        check_positive("balanced_t_moe_s", balanced_t_moe_s)
    G = cluster.num_gpus
    if plan.stats.get("strategy") == "balanced":
        x = balanced_plan_loads(plan, batch, model, G)
    else:
        x = plan_loads(plan, batch, G)
    cost = cost_from_flow(plan_flow(plan, x), model, cluster, beta)
    t_moe_s = float(cost.t_moe.sum())
    return PlanScore(
        strategy=plan.stats.get("strategy", "unknown"), t_moe_s=t_moe_s,
        t_moe_smooth_s=float(cost.t_moe_smooth.sum()),
        moe_fwd_comp_s=float(cost.comp.max(axis=-1).sum()), moe_fwd_comm_s=float(cost.comm.max(axis=-1).sum()),
        rank_skew_mean=float(cost.rank_skew.mean()), rank_skew_max=float(cost.rank_skew.max()),
        num_micro_batches=plan.num_micro_batches,
        percent_of_balanced=None if balanced_t_moe_s is None else 100.0 * float(balanced_t_moe_s) / t_moe_s,
        t_moe=cost.t_moe)


def uniform_loads(x: np.ndarray) -> np.ndarray:
    """float64 ``[M, L, G, E]``: the Balanced ideal of the same batch (docs/method.md, "Balanced reference").

    Every (micro-batch, layer) keeps its total of (token, expert) pairs, spread evenly over the G
    sources and the E experts, as if every token's k experts were drawn uniformly and every GPU ran
    the same number of tokens: ``x'[m, l, j, e] = sum_{j, e} x[m, l, j, e] / (G E)``.
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 4:
        raise PlanError(f"loads x must be [M, L, G, E], got shape {x.shape}")
    G, E = x.shape[2:]
    return np.broadcast_to(x.sum(axis=(2, 3), keepdims=True) / (G * E), x.shape).copy()


@njit(cache=True)
def balanced_counts(tokens, num_experts, top_k, num_layers, seed):
    """Uniform routing: for each entry of ``tokens [K]`` draw that many tokens' k distinct experts per layer.

    Returns int64 ``[K, L, E]`` counts (partial Fisher-Yates per token).
    """
    np.random.seed(seed)
    K = tokens.shape[0]
    out = np.zeros((K, num_layers, num_experts), np.int64)
    perm = np.arange(num_experts)
    for i in range(K):
        for l in range(num_layers):
            for _ in range(tokens[i]):
                for s in range(top_k):
                    r = s + np.random.randint(num_experts - s)
                    t = perm[s]
                    perm[s] = perm[r]
                    perm[r] = t
                    out[i, l, perm[s]] += 1
    return out


def balanced_loads(tokens_per_source: np.ndarray, model: ModelSpec, seed: int = 0) -> np.ndarray:
    """The Balanced ideal's loads: int64 ``[M, L, G, E]``.

    Args:
        tokens_per_source: int ``[M, G]`` tokens whose attention runs on each source GPU in each
            micro-batch (the batch's own, or an even split: see ``balanced_sources``).

    Every token draws its k experts uniformly at random (distinct), independently per layer.
    """
    t = np.asarray(tokens_per_source, dtype=np.int64)
    if t.ndim != 2 or (t < 0).any():
        raise PlanError(f"tokens_per_source must be a non-negative [M, G] array, got shape {t.shape}")
    M, G = t.shape
    counts = balanced_counts(t.ravel(), model.num_experts, model.top_k, model.num_layers,
                                      int(seed) & 0x7FFFFFFF)
    return counts.reshape(M, G, model.num_layers, model.num_experts).transpose(0, 2, 1, 3).copy()


def balanced_sources(lengths: np.ndarray, micro_batch: np.ndarray, sample_gpu: np.ndarray, num_micro_batches: int,
                     num_gpus: int, mode: str = "batch") -> np.ndarray:
    """int64 ``[M, G]`` tokens per (micro-batch, source GPU) for the Balanced ideal.

    mode "batch": each source keeps the tokens the sample placement gives it (only the routing is made
    uniform; the paper's setting, where each data-parallel rank keeps its samples); "even": every
    micro-batch's tokens split evenly over the G sources (the first ``T mod G`` get one more).
    """
    mb = np.asarray(micro_batch, dtype=np.int64)
    t = np.zeros((num_micro_batches, num_gpus), np.int64)
    np.add.at(t, (mb, np.asarray(sample_gpu, dtype=np.int64)), np.asarray(lengths, dtype=np.int64))
    if mode == "batch":
        return t
    if mode != "even":
        raise PlanError(f"balanced sources mode {mode!r} is not 'batch' or 'even'")
    tot = t.sum(axis=1, keepdims=True)
    return tot // num_gpus + (np.arange(num_gpus)[None, :] < tot % num_gpus)


def balanced_t_moe(batch: TraceBatch, model: ModelSpec, cluster: ClusterSpec, seed: int = 0, mode: str = "batch",
                   micro_batch: np.ndarray | None = None) -> float:
    """Sum over micro-batches and layers of the exact T_MoE (seconds) of the Balanced ideal of ``batch``
    (a TraceBatch with a micro-batch assignment, or ``micro_batch [N]``): uniform routing, static
    placement, samples round-robin, sources per ``mode`` (see ``balanced_sources``)."""
    mb = batch.resolve_micro_batch(micro_batch)
    M, G = int(mb.max()) + 1, cluster.num_gpus
    x = balanced_loads(balanced_sources(batch.lengths, mb, round_robin_gpus(mb, G), M, G, mode), model, seed)
    eg = Placement.static(model.num_layers, model.num_experts, G).expert_gpu.astype(np.int64)
    return float(moe_cost(x, eg, model, cluster).t_moe.sum())
