"""cvxpy references for one cell (micro-batch x layer): the split LP with z fixed and the full MILP.

Both follow the problem of docs/method.md ("Replication and the token split") literally, on dense
variables, independently of ``split.py``:

- ``y[j, e, g] in [0, 1]`` share of ``x[j, e]`` served on GPU g, ``sum_g y[j, e, g] = 1``;
- ``y[j, e, g] <= z[e, g]`` with ``z[e, home(e)] = 1`` and ``z[e, g] = 0`` outside the home's node;
- ``sum_{e not homed on g} z[e, g] <= r``;
- ``T_MoE = max_g comp_g + max_g comm_g``, both maxima linearized with epigraph variables ``a, b``:
  ``a >= comp_g`` for every g, ``b >= 2 C_g^{link,dir} / B_link`` for every g, link and direction.

The flow matrix is ``F[j, g] = sum_e x[j, e] y[j, e, g]``. Costs are expressed in token units (seconds
divided by the compute seconds of one token-expert pair, see ``split.cell_weights``) and the loads are
scaled to a mean of 1 token per GPU, which keeps HiGHS well conditioned; results are returned in seconds.

Intended for small instances (G <= 8, E <= 32, r <= 2): the MILP's LP relaxation is weak (max terms),
so it is a reference for tests and the optimality-gap study, not a planner.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import PlanError
from ..specs import CR, NV, SR, ClusterSpec, ModelSpec
from ..validate import check_int
from .split import cell_weights, holders

__all__ = ["MilpSolution", "split_lp_reference", "solve_milp"]


@dataclass(frozen=True)
class MilpSolution:
    """Result of :func:`solve_milp`.

    Attributes:
        t_moe: seconds, T_MoE of the best integer solution found (recomputed from its split).
        bound: seconds, HiGHS's lower bound on the optimum (== t_moe within the gap when optimal).
        optimal: True when HiGHS proved optimality (within ``mip_rel_gap``).
        replica_expert: int32 ``[G, r]`` replicas of the solution (-1 empty).
        shares: float64 ``[G, E, G]`` the solution's split.
    """

    t_moe: float
    bound: float
    optimal: bool
    replica_expert: np.ndarray
    shares: np.ndarray


def _model(x: np.ndarray, allowed: np.ndarray, model: ModelSpec, cluster: ClusterSpec):
    import cvxpy as cp

    G, E = x.shape
    w = cell_weights(model, cluster)
    scale = max(x.sum() / G, 1e-12)
    xs = x / scale
    cls = cluster.link_classes
    nvm = ((cls == NV) | (cls == CR)).astype(np.float64)
    rdm = ((cls == SR) | (cls == CR)).astype(np.float64)
    # Y rows are (j, e) pairs, j-major; F = B @ Y with B[j, (j, e)] = x[j, e]
    Y = cp.Variable((G * E, G), nonneg=True)
    import scipy.sparse as sp

    B = sp.csr_matrix((xs.reshape(-1), (np.repeat(np.arange(G), E), np.arange(G * E))), shape=(G, G * E))
    F = B @ Y
    a = cp.Variable()
    b = cp.Variable()
    cons = [cp.sum(Y, axis=1) == 1, cp.multiply(Y, 1.0 - np.tile(allowed, (G, 1))) == 0]
    comp = cp.sum(F, axis=0)
    nvtx = cp.sum(cp.multiply(F, nvm), axis=1)
    nvrx = cp.sum(cp.multiply(F, nvm), axis=0)
    rdtx = cp.sum(cp.multiply(F, rdm), axis=1)
    rdrx = cp.sum(cp.multiply(F, rdm), axis=0)
    cons += [comp <= a, w.w_nv * nvtx <= b, w.w_nv * nvrx <= b, w.w_rdma * rdtx <= b, w.w_rdma * rdrx <= b]
    return cp, Y, a, b, cons, scale, w


def _shares_cost(x: np.ndarray, shares: np.ndarray, model: ModelSpec, cluster: ClusterSpec) -> float:
    from ..cost import cost_from_flow, flow_matrix

    return float(cost_from_flow(flow_matrix(x, shares=shares), model, cluster).t_moe)


def split_lp_reference(x: np.ndarray, expert_gpu: np.ndarray, replica_expert: np.ndarray, model: ModelSpec,
                       cluster: ClusterSpec) -> tuple[float, np.ndarray]:
    """Optimal T_MoE (seconds) and shares ``[G, E, G]`` of one cell with the replicas fixed (cvxpy LP)."""
    x = np.asarray(x, dtype=np.float64)
    G, E = x.shape
    hold = holders(expert_gpu, replica_expert, cluster.gpus_per_node)
    allowed = np.zeros((E, G))
    for e in range(E):
        allowed[e, hold[e][hold[e] >= 0]] = 1.0
    cp, Y, a, b, cons, scale, w = _model(x, allowed, model, cluster)
    prob = cp.Problem(cp.Minimize(a + b), cons)
    prob.solve(solver=cp.HIGHS)
    if prob.status != cp.OPTIMAL:
        raise PlanError(f"split LP reference: cvxpy status {prob.status}")
    shares = np.clip(Y.value.reshape(G, E, G), 0, None)
    shares /= shares.sum(axis=2, keepdims=True)
    return float(prob.value) * scale * w.sec_per_token, shares


def solve_milp(x: np.ndarray, expert_gpu: np.ndarray, model: ModelSpec, cluster: ClusterSpec, replica_slots: int,
               time_limit: float = 60.0, mip_rel_gap: float = 1e-4) -> MilpSolution:
    """The full replication MILP of one cell (docs/method.md, "Replication and the token split"), by HiGHS via cvxpy.

    Args:
        x: ``[G, E]`` tokens per (source GPU, expert); expert_gpu: ``[E]`` homes.
        replica_slots: r, replica slots per GPU.
        time_limit: seconds HiGHS may spend; when hit, ``optimal`` is False and ``bound`` is the best bound.
        mip_rel_gap: relative gap at which HiGHS stops.
    """
    import cvxpy as cp

    x = np.asarray(x, dtype=np.float64)
    expert_gpu = np.asarray(expert_gpu, dtype=np.int64)
    G, E = x.shape
    if G != cluster.num_gpus or expert_gpu.shape != (E,):
        raise PlanError(f"x {x.shape} / expert_gpu {expert_gpu.shape} do not match G={cluster.num_gpus}")
    check_int("replica_slots", replica_slots, 0)
    node = cluster.node_of(np.arange(G))
    in_node = (node[expert_gpu][:, None] == node[None, :]).astype(np.float64)  # [E, G]
    home = (expert_gpu[:, None] == np.arange(G)[None, :]).astype(np.float64)
    cp_, Y, a, b, cons, scale, w = _model(x, in_node, model, cluster)
    Z = cp.Variable((E, G), boolean=True)
    R = np.kron(np.ones((G, 1)), np.eye(E))  # row (j, e) -> e
    cons += [Y <= R @ Z, Z >= home, cp.multiply(Z, 1.0 - in_node) == 0,
             cp.sum(cp.multiply(Z, 1.0 - home), axis=0) <= replica_slots]
    prob = cp.Problem(cp.Minimize(a + b), cons)
    prob.solve(solver=cp.HIGHS, time_limit=float(time_limit), mip_rel_gap=float(mip_rel_gap))
    if Y.value is None:
        raise PlanError(f"MILP: no solution (cvxpy status {prob.status})")
    shares = np.nan_to_num(np.clip(Y.value.reshape(G, E, G), 0, None)) * in_node[None, :, :]
    tot = shares.sum(axis=2, keepdims=True)
    # a time-limited solve may hand back rows that serve nothing: send those tokens home
    shares = np.where(tot > 1e-9, shares / np.where(tot > 1e-9, tot, 1.0), home[None, :, :])
    zr = np.round(Z.value) * (1.0 - home)
    rep = np.full((G, max(replica_slots, 0)), -1, np.int32)
    for g in range(G):
        es = np.flatnonzero(zr[:, g] > 0.5)[:replica_slots]
        rep[g, :len(es)] = es
    t = _shares_cost(x, shares, model, cluster)
    bound = t
    info = getattr(prob.solver_stats, "extra_stats", None)  # highspy's HighsInfo
    dual = getattr(info, "mip_dual_bound", None)
    if dual is not None and np.isfinite(dual):
        bound = float(dual) * scale * w.sec_per_token
    return MilpSolution(t_moe=t, bound=min(bound, t), optimal=prob.status == cp.OPTIMAL and bound >= t * (1 - 1e-3),
                        replica_expert=rep, shares=shares)
