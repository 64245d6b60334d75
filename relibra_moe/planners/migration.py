"""Migration-aware inter-batch placement: price the once-per-batch expert moves (docs/method.md, "Migration").

Moving expert (l, e) from its previous home to a new one carries its weights and optimizer state
(``timing.move_bytes``: ``model.expert_params x (dtype_bytes + optimizer_bytes_per_param)`` bytes), once
per batch, not overlapped. Two steps lower that traffic after the reorder:

1. **Relabel by the fabric's symmetries** (free): on a rail-optimized cluster the link class of (i, j)
   only depends on whether the nodes and the rails of i and j match, so permuting the nodes, and the
   rails consistently in every node, maps a plan to one of exactly the same cost (expert homes and sample
   GPUs relabelled together). ``relabel_to_previous`` picks the symmetry that keeps the most experts where
   they were (alternating assignment problems over node and rail permutations, from several starts).
2. **Keep the previous placement of a layer** (``keep_previous_layers``) when the new placement's gain in
   step time does not pay for moving that layer's experts. The gain is the layer's forward + backward
   MoE time summed over micro-batches (``timing.moe_step_seconds``: ``3 max comp + 2 max comm``, as the
   simulator charges it); the price is the transfer time of the layer's moved experts on their own (an
   upper bound of their share of the concurrent re-layout).

``migrate`` runs both for relibra-inter (``annealing.finish_inter``), the relabelling not free when the trainer
owns the samples.

Option ``move_horizon`` H > 1 with ``previous_loads`` (docs/method.md, "Moves that pay over several batches"):
step 2 values a layer's move at its gain plus ``(H - 1) x horizon_gains``, the lesser of what the new homes save
on this batch and on the previous one; ``carry_over`` is the same evidence as a share, for the portfolio's credit.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.optimize import linear_sum_assignment

from ..cost import moe_cost
from ..errors import PlanError
from ..evaluate import placement_loads
from ..plan_stats import MigrationStats
from ..specs import ClusterSpec, ModelSpec
from ..timing import DEFAULT_OPTIMIZER_BYTES_PER_PARAM, moe_step_seconds, move_bytes, transfer_seconds
from ..trace import TraceBatch
from .context import previous_expert_gpu
from .options import PlanOptions


def symmetry_perm(node_perm: np.ndarray, rail_perm: np.ndarray, gpus_per_node: int) -> np.ndarray:
    """int64 ``[G]``: GPU ``n P + p`` -> ``node_perm[n] P + rail_perm[p]``."""
    P = int(gpus_per_node)
    n = np.arange(len(node_perm) * P) // P
    p = np.arange(len(node_perm) * P) % P
    return np.asarray(node_perm, np.int64)[n] * P + np.asarray(rail_perm, np.int64)[p]


def is_symmetry(perm: np.ndarray, cluster: ClusterSpec) -> bool:
    """Whether relabelling GPU g as ``perm[g]`` leaves every link class unchanged."""
    cls = cluster.link_classes
    return bool(np.array_equal(cls[np.ix_(perm, perm)], cls))


def relabel_to_previous(expert_gpu: np.ndarray, previous: np.ndarray, cluster: ClusterSpec,
                        starts: int = 4, seed: int = 0) -> np.ndarray:
    """The cost-preserving GPU relabelling that keeps the most experts at their previous homes.

    Args:
        expert_gpu: ``[L, E]`` new homes; previous: ``[L, E]`` homes before this batch.
        starts: random starting rail permutations (plus the identity) of the alternating search.

    Returns:
        int64 ``[G]`` permutation ``perm`` (GPU g of the new plan becomes ``perm[g]``); the identity when no
        relabelling keeps more experts in place, or when the fabric lacks the symmetry.
    """
    eg = np.asarray(expert_gpu, dtype=np.int64)
    prev = np.asarray(previous, dtype=np.int64)
    if eg.shape != prev.shape:
        raise PlanError(f"previous placement has shape {prev.shape}, the new one {eg.shape}")
    G, P, N = cluster.num_gpus, cluster.gpus_per_node, cluster.nodes
    C = np.zeros((G, G))  # C[g_new, g_prev]: experts homed on g_new now and on g_prev before
    np.add.at(C, (eg.ravel(), prev.ravel()), 1.0)
    C4 = C.reshape(N, P, N, P)  # [n_new, p_new, n_prev, p_prev]
    ident = np.arange(G)
    best_perm, best_val = ident, float(np.trace(C))
    rng = np.random.default_rng(seed)
    rails = [np.arange(P)] + [rng.permutation(P) for _ in range(max(0, starts))]
    for tau in rails:
        sigma = np.arange(N)
        val = -1.0
        for _ in range(20):
            # nodes for fixed rails: W[n, n'] = sum_p C[(n, p), (n', tau p)]
            W = C4[:, np.arange(P), :, tau].sum(axis=0) if N else np.zeros((0, 0))
            _, sigma = linear_sum_assignment(-W)
            # rails for fixed nodes: V[p, p'] = sum_n C[(n, p), (sigma n, p')]
            V = C4[np.arange(N), :, sigma, :].sum(axis=0)
            _, tau = linear_sum_assignment(-V)
            new = float(V[np.arange(P), tau].sum())
            if new <= val + 1e-9:
                break
            val = new
        perm = symmetry_perm(sigma, tau, P)
        v = float(C[np.arange(G), perm].sum())
        if v > best_val + 1e-9 and is_symmetry(perm, cluster):
            best_perm, best_val = perm, v
    return best_perm


def layer_move_seconds(old: np.ndarray, new: np.ndarray, model: ModelSpec, cluster: ClusterSpec,
                       optimizer_bytes_per_param: float = DEFAULT_OPTIMIZER_BYTES_PER_PARAM) -> float:
    """Seconds to move one layer's experts from homes ``old [E]`` to ``new [E]`` (``timing.transfer_seconds``)."""
    moved = np.asarray(old) != np.asarray(new)
    if not moved.any():
        return 0.0
    return float(transfer_seconds(np.asarray(old)[moved], np.asarray(new)[moved],
                                  move_bytes(model, optimizer_bytes_per_param), None, 1, cluster)[0])


def step_moe_seconds(x_layer: np.ndarray, expert_gpu: np.ndarray, model: ModelSpec, cluster: ClusterSpec,
                     node_comp: bool = False) -> float:
    """Forward + backward MoE seconds of one layer summed over micro-batches: ``sum_m 3 max comp + 2 max comm``.

    x_layer: ``[M, G, E]``. ``node_comp``: the compute term is the busiest node's mean GPU compute (what
    intra-node replicas can level it to), as in ``reorder.batch_cost``.
    """
    c = moe_cost(np.asarray(x_layer, dtype=np.float64), np.asarray(expert_gpu), model, cluster)
    comp = c.comp
    if node_comp and cluster.nodes > 1:
        comp = comp.reshape(comp.shape[:-1] + (cluster.nodes, cluster.gpus_per_node)).mean(axis=-1)
    return float(moe_step_seconds(comp.max(axis=-1), c.comm.max(axis=-1)).sum())


def homes_savings(loads: np.ndarray, expert_gpu: np.ndarray, previous: np.ndarray, model: ModelSpec,
                  cluster: ClusterSpec, node_comp: bool = False) -> np.ndarray:
    """float64 ``[L]``: per layer, the step seconds that the homes ``expert_gpu [L, E]`` save over ``previous [L, E]``
    on the loads ``loads [M, L, G, E]`` (``step_moe_seconds``: ``sum_m 3 max comp + 2 max comm``; negative where they
    cost more, 0 where a layer's homes did not move).

    Raises:
        PlanError: ``loads`` whose layers, GPUs or experts are not the model's and cluster's.
    """
    eg, prev = np.asarray(expert_gpu), np.asarray(previous)
    L, E = eg.shape
    x = np.asarray(loads)
    if x.ndim != 4 or x.shape[1:] != (L, cluster.num_gpus, E):
        raise PlanError(f"loads of shape {x.shape}: expected [M, L={L}, G={cluster.num_gpus}, E={E}] on this model "
                        "and cluster")
    out = np.zeros(L)
    for l in range(L):
        if not np.array_equal(eg[l], prev[l]):
            out[l] = (step_moe_seconds(x[:, l], prev[l], model, cluster, node_comp)
                      - step_moe_seconds(x[:, l], eg[l], model, cluster, node_comp))
    return out


def horizon_gains(now: np.ndarray, previous_loads: np.ndarray, expert_gpu: np.ndarray, previous: np.ndarray,
                  model: ModelSpec, cluster: ClusterSpec, node_comp: bool = False) -> np.ndarray:
    """float64 ``[L]``: step seconds per later batch that the homes ``expert_gpu`` are expected to save over
    ``previous`` (option ``move_horizon``): per layer, the lesser of ``now`` (float ``[L]``, their
    ``homes_savings`` on this batch) and their ``homes_savings`` on the previous batch (``previous_loads
    [M', L, G, E]``, which the homes were not planned for), and at least 0.

    Homes planned for one batch always save something on it; what they save on a batch they did not see is what
    carries over, and taking the lesser of the two keeps the credit from chasing either batch's noise (a move
    whose saving does not carry over gets none, so relibra does not re-lay its experts out batch after batch).
    """
    before = homes_savings(previous_loads, expert_gpu, previous, model, cluster, node_comp)
    return np.maximum(0.0, np.minimum(now, before))


def carry_over(x: np.ndarray, previous_loads: np.ndarray, expert_gpu: np.ndarray, previous: np.ndarray,
               model: ModelSpec, cluster: ClusterSpec, node_comp: bool = False) -> float:
    """The share of what the homes ``expert_gpu`` save over ``previous`` on this batch (loads ``x [M, L, G, E]``)
    that they are expected to save on a later one, in [0, 1]: ``sum_l horizon_gains / sum_l homes_savings(x)`` (0
    where they save nothing on this batch). The portfolio scales a candidate's simulated saving by it
    (``PlanOptions.move_horizon``).
    """
    now = homes_savings(x, expert_gpu, previous, model, cluster, node_comp)
    total = float(now.sum())
    if total <= 0.0:
        return 0.0
    gains = horizon_gains(now, previous_loads, expert_gpu, previous, model, cluster, node_comp)
    return float(min(1.0, max(0.0, gains.sum() / total)))


def keep_previous_layers(x: np.ndarray, expert_gpu: np.ndarray, previous: np.ndarray, model: ModelSpec,
                         cluster: ClusterSpec, node_comp: bool = False,
                         optimizer_bytes_per_param: float = DEFAULT_OPTIMIZER_BYTES_PER_PARAM,
                         move_horizon: int = 1, previous_loads: np.ndarray | None = None) -> tuple[np.ndarray, dict]:
    """Per layer, keep the previous homes unless the new ones save more step time than their move costs.

    Greedy on the joint re-layout: layers in decreasing order of ``value / standalone move time``; a layer's
    new homes are taken when its value exceeds the increase of the re-layout time of all taken moves
    (``timing.transfer_seconds``: the moves run concurrently, so a layer whose moves load other links costs
    less than on its own). A layer's value is its gain on this batch plus, with ``move_horizon`` H > 1 and
    ``previous_loads``, ``(H - 1) x horizon_gains`` (its expected saving on each later batch).

    Args:
        x: ``[M, L, G, E]`` loads under the final sample placement.
        expert_gpu, previous: ``[L, E]`` new and previous homes.
        move_horizon, previous_loads: the options of that name (``PlanOptions``).

    Returns:
        (int64 ``[L, E]`` homes, info with ``layers_kept`` (sorted list), per-layer ``gain_s`` (step seconds
        saved by the new homes) and ``move_s`` (standalone move seconds), ``relayout_s`` (the taken
        moves together) and, with a credit, per-layer ``credit_s`` (``(H - 1) x horizon_gains``)).
    """
    x = np.asarray(x)
    eg = np.asarray(expert_gpu, dtype=np.int64).copy()
    prev = np.asarray(previous, dtype=np.int64)
    if x.ndim != 4 or eg.shape != prev.shape or x.shape[1] != eg.shape[0]:
        raise PlanError(f"x {x.shape}, expert_gpu {eg.shape} and previous {prev.shape} do not match")
    L = eg.shape[0]
    nbytes = move_bytes(model, optimizer_bytes_per_param)
    moves = np.array([layer_move_seconds(prev[l], eg[l], model, cluster, optimizer_bytes_per_param)
                      for l in range(L)])
    gains = homes_savings(x, eg, prev, model, cluster, node_comp)
    credit = np.zeros(L)
    if move_horizon > 1 and previous_loads is not None:
        credit = (move_horizon - 1) * horizon_gains(gains, previous_loads, eg, prev, model, cluster, node_comp)
    value = gains + credit
    cand = [l for l in range(L) if moves[l] > 0.0 and gains[l] > 0.0]
    cand.sort(key=lambda l: (-value[l] / moves[l], l))
    src: list[np.ndarray] = []
    dst: list[np.ndarray] = []
    taken: set[int] = set()
    cur = 0.0
    for l in cand:
        m = prev[l] != eg[l]
        s2, d2 = np.concatenate(src + [prev[l][m]]), np.concatenate(dst + [eg[l][m]])
        t = float(transfer_seconds(s2, d2, nbytes, None, 1, cluster)[0])
        if value[l] > t - cur:
            src.append(prev[l][m])
            dst.append(eg[l][m])
            taken.add(l)
            cur = t
    kept = [l for l in range(L) if moves[l] > 0.0 and l not in taken]
    eg[kept] = prev[kept]
    info = {"layers_kept": kept, "gain_s": gains.tolist(), "move_s": moves.tolist(), "relayout_s": cur}
    if credit.any():
        info["credit_s"] = [float(credit[l]) if l in taken else 0.0 for l in range(L)]
    return eg, info


def migrate(expert_gpu: np.ndarray, micro_batch: np.ndarray, sample_gpu: np.ndarray, batch: TraceBatch,
            num_micro_batches: int, model: ModelSpec, cluster: ClusterSpec, options: PlanOptions, node_comp: bool,
            samples_fixed: bool = False, credit: bool = False) -> tuple[np.ndarray, np.ndarray, MigrationStats]:
    """Migration-aware finish of relibra-inter (this module): relabel GPUs by the fabric's
    symmetries to keep the most experts at their previous homes (cost unchanged), then keep a layer's
    previous homes where the new ones do not pay for their move. Option ``migration=False`` skips both.

    ``samples_fixed`` (the trainer owns the samples): the relabelling may not move samples, so it is no longer
    free. Both the identity and the relabelling of the experts alone go through ``keep_previous_layers``; the
    one with the lower ``sum_l step_moe_seconds + relayout_s`` (forward + backward MoE seconds of the kept
    homes plus the re-layout, less the ``move_horizon`` credit of the layers moved) wins, the identity on ties.
    ``sample_gpu`` is returned unchanged.

    ``credit``: value each layer's move with option ``move_horizon``'s credit (``keep_previous_layers``; relibra's
    portfolio candidate ``relibra-horizon`` and the strategy relibra-inter); False prices every move against this
    batch alone.

    Returns (expert_gpu [L, E], sample_gpu [N], ``MigrationStats``).
    """
    if not options.migration:
        return expert_gpu, sample_gpu, MigrationStats(enabled=False)
    prev = previous_expert_gpu(options, model, cluster)
    perm = relabel_to_previous(expert_gpu, prev, cluster)
    obpp = float(options.optimizer_bytes_per_param)
    horizon = {"move_horizon": options.move_horizon, "previous_loads": options.previous_loads} if credit else {}
    if samples_fixed:
        sg = np.asarray(sample_gpu, dtype=np.int64)
        x = placement_loads(batch, micro_batch, sg, num_micro_batches, cluster.num_gpus)
        best: tuple[float, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]] | None = None
        for p in (np.arange(cluster.num_gpus), perm):
            eg_p = p[expert_gpu]
            kept, inf = keep_previous_layers(x, eg_p, prev, model, cluster, node_comp=node_comp,
                                             optimizer_bytes_per_param=obpp, **horizon)
            total = sum(step_moe_seconds(x[:, l], kept[l], model, cluster, node_comp) for l in range(x.shape[1]))
            total += inf["relayout_s"] - sum(inf.get("credit_s", ()))
            if best is None or total < best[0] * (1 - 1e-12):
                best = (total, p, eg_p, kept, inf)
        _, perm, eg_p, eg, info = best
        moved_before = int((eg_p != prev).sum())
        info["samples_fixed"] = True
    else:
        eg, sg = perm[expert_gpu], perm[np.asarray(sample_gpu, dtype=np.int64)]
        x = placement_loads(batch, micro_batch, sg, num_micro_batches, cluster.num_gpus)
        moved_before = int((eg != prev).sum())
        eg, info = keep_previous_layers(x, eg, prev, model, cluster, node_comp=node_comp,
                                        optimizer_bytes_per_param=obpp, **horizon)
    return eg, sg, MigrationStats(enabled=True, relabel=perm.tolist(), moved_after_relabel=moved_before,
                                  moved=int((eg != prev).sum()), **info)

