"""Score a BatchPlan on a batch with the exact cost model (RELIBRA.md §4).

``score_plan`` rebuilds the loads ``x [M, L, G, E]`` from the batch and the plan's sample placement,
routes them with the plan (homes, plus the replica split rows where present, as
``ReplicaPlan.shares`` defines them) and evaluates ``cost.cost_from_flow``. A plan whose
``stats["strategy"]`` is ``"balanced"`` is scored on the Balanced ideal's loads instead (uniform random
routing, each source GPU keeping its tokens, or an even split when ``stats["balanced_sources"]`` is
"even"; seeded by ``stats["seed"]``), so that it scores as the ideal.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import numpy as np

from ..cost import DEFAULT_BETA, cost_from_flow
from ..errors import PlanError
from ..plan import BatchPlan
from ..specs import ClusterSpec, ModelSpec
from .baselines import balanced_loads, balanced_sources
from .split import check_positive

if TYPE_CHECKING:
    from ..trace import TraceBatch


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
    from ..trace import TraceBatch

    if not isinstance(batch, TraceBatch):
        raise PlanError(f"batch must be a TraceBatch, got {type(batch).__name__}")


def check_plan_batch(plan: BatchPlan, batch: TraceBatch, model: ModelSpec) -> None:
    """Raise PlanError unless ``plan`` is a BatchPlan and ``batch`` a TraceBatch that fits ``model`` and is the batch
    ``plan`` was made for: same L and E, same sample count, and (for plans that record it) the same ``batch_sha1``."""
    if not isinstance(plan, BatchPlan):
        raise PlanError(f"plan must be a BatchPlan, got {type(plan).__name__}")
    check_batch_type(batch)
    if (batch.num_layers, batch.num_experts) != (model.num_layers, model.num_experts):
        raise PlanError(f"batch has L={batch.num_layers}, E={batch.num_experts}; model {model.name} has "
                        f"L={model.num_layers}, E={model.num_experts}")
    if (plan.num_layers, plan.num_experts) != (model.num_layers, model.num_experts):
        raise PlanError(f"plan has L={plan.num_layers}, E={plan.num_experts}; model {model.name} has "
                        f"L={model.num_layers}, E={model.num_experts}")
    if batch.num_sequences != plan.samples.num_samples:
        raise PlanError(f"the plan places {plan.samples.num_samples} samples, the batch has {batch.num_sequences}")
    want = plan.stats.get("batch_sha1")
    if want is not None and want != batch_sha1(batch):
        raise PlanError(f"plan was made for another batch: its stats batch_sha1={want!r}, this batch's is "
                        f"{batch_sha1(batch)!r} (same {batch.num_sequences} samples, different routing or lengths)")


def plan_loads(plan: BatchPlan, batch: TraceBatch, num_gpus: int) -> np.ndarray:
    """int64 ``[M, L, G, E]``: the batch's loads under the plan's sample placement (M = the plan's; trailing
    empty micro-batches are zero)."""
    if batch.num_sequences != plan.samples.num_samples:
        raise PlanError(f"the plan places {plan.samples.num_samples} samples, the batch has {batch.num_sequences}")
    M = plan.num_micro_batches
    x = np.asarray(batch.loads(plan.samples.gpu, num_gpus, plan.samples.micro_batch))
    if x.shape[0] < M:
        x = np.concatenate([x, np.zeros((M - x.shape[0],) + x.shape[1:], x.dtype)])
    return x


def balanced_plan_loads(plan: BatchPlan, batch: TraceBatch, model: ModelSpec, num_gpus: int) -> np.ndarray:
    """int64 ``[M, L, G, E]``: the Balanced ideal of ``batch`` (RELIBRA.md §8) for the plan's sample placement.

    Every token draws its k experts uniformly at random (seeded by ``plan.stats["seed"]``); each source GPU
    keeps the tokens the plan gives it, or, when ``plan.stats["balanced_sources"] == "even"``, every
    micro-batch's tokens are split evenly over the G sources (``baselines.balanced_sources`` /
    ``balanced_loads``).
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
    idx = plan.replicas.split_index.astype(np.int64)
    if len(idx):
        m, l, j, e, g = idx.T
        share = plan.replicas.split_share.astype(np.float64)
        key = ((m * L + l) * G + j) * E + e
        _, first = np.unique(key, return_index=True)
        um, ul, uj, ue = m[first], l[first], j[first], e[first]
        np.subtract.at(flow, (um, ul, uj, home[ul, ue]), x[um, ul, uj, ue])
        np.add.at(flow, (m, l, j, g), x[m, l, j, e] * share)
    return flow


def score_plan(plan: BatchPlan, batch: TraceBatch, model: ModelSpec, cluster: ClusterSpec, *,
               balanced_total_s: float | None = None, beta: float = DEFAULT_BETA) -> dict[str, Any]:
    """Exact cost of a plan on a batch.

    Args:
        plan: a BatchPlan for ``model`` and ``cluster`` (validated here).
        batch: the TraceBatch the plan was made for (same samples; ``check_plan_batch``).
        balanced_total_s: the Balanced ideal's total (``baselines.balanced_t_moe``); when given, the
            result has ``percent_of_balanced = 100 * balanced / t_moe_total_s``.

    Returns:
        dict with ``strategy``, ``t_moe_total_s`` (sum over micro-batches and layers of the exact T_MoE,
        seconds), ``t_moe`` float64 ``[M, L]`` seconds, ``t_moe_smooth_total_s``, ``comp_total_s`` /
        ``comm_total_s`` (sums of the max-GPU compute / communication terms), ``rank_skew_mean`` /
        ``rank_skew_max`` (max GPU load / mean GPU load over cells), ``num_micro_batches``, and
        ``percent_of_balanced`` when asked.

    Raises:
        PlanError: the plan or batch does not fit the model / cluster, or was made for another batch.
    """
    check_plan_batch(plan, batch, model)
    plan.validate(model, cluster, num_samples=batch.num_sequences)
    check_positive("beta", beta)
    if balanced_total_s is not None:
        check_positive("balanced_total_s", balanced_total_s)
    G = cluster.num_gpus
    if plan.stats.get("strategy") == "balanced":
        x = balanced_plan_loads(plan, batch, model, G)
    else:
        x = plan_loads(plan, batch, G)
    cost = cost_from_flow(plan_flow(plan, x), model, cluster, beta)
    out: dict[str, Any] = {
        "strategy": plan.stats.get("strategy", "unknown"),
        "t_moe_total_s": float(cost.t_moe.sum()),
        "t_moe": cost.t_moe,
        "t_moe_smooth_total_s": float(cost.t_moe_smooth.sum()),
        "comp_total_s": float(cost.comp.max(axis=-1).sum()),
        "comm_total_s": float(cost.comm.max(axis=-1).sum()),
        "rank_skew_mean": float(cost.rank_skew.mean()),
        "rank_skew_max": float(cost.rank_skew.max()),
        "num_micro_batches": plan.num_micro_batches,
    }
    if balanced_total_s is not None:
        out["percent_of_balanced"] = 100.0 * float(balanced_total_s) / out["t_moe_total_s"]
    return out


def json_summary(score: dict[str, Any]) -> dict[str, Any]:
    """The JSON-serializable part of a ``score_plan`` result (arrays dropped)."""
    return {k: v for k, v in score.items() if not isinstance(v, np.ndarray)}
