"""Token split with the replicas fixed: the exact LP (z fixed) and a fast heuristic.

The method: docs/method.md, "Replication and the token split".

One *cell* is one micro-batch x one MoE layer. Inputs of a cell:

- ``x``: float ``[G, E]`` tokens whose attention runs on GPU j and that are routed to expert e;
- ``expert_gpu``: int ``[E]`` home GPU of each expert;
- ``replica_expert``: int ``[G, r]`` the expert held in each replica slot (-1 empty). Replicas live in
  the node of the expert's home (the caller guarantees it; ``holders`` checks it).

A replicated expert ``e`` has *holders* ``H(e)`` (its home first, then its replica GPUs). The split
decides, for every source j, which share ``y[j, e, g]`` (g in H(e)) of ``x[j, e]`` each holder serves;
experts without replicas send everything home. The objective is the cost model of ``relibra_moe.cost``
literally: ``T_MoE = max_g comp_g + max_g comm_g`` with
``comm_g = 2 max(nvlink_tx, nvlink_rx, rdma_tx, rdma_rx) / bandwidth`` (a cross-rail token counts on
NVLink and RDMA at its source and at its target).

Two solvers:

- :func:`solve_split_lp` is exact: an LP over the free flows only (``f[j, e, g] = x[j, e] y[j, e, g]``
  for replicated experts), two epigraph variables ``a >= comp_g`` and ``b >= comm terms``, every row
  without a free variable folded into the bounds of ``a`` and ``b``; solved by HiGHS (highspy, or
  scipy's ``linprog(method="highs")`` when highspy is missing).
- the numba kernels below (:func:`waterfill_expert` and friends) are a fast heuristic: per replicated
  expert, water-fill its tokens over its holders to level their compute, sources placed by link cost
  (own GPU, then same rail, then the holder with the lowest receive load). The greedy replication of
  ``replicate.py`` runs on them and polishes the final split of each cell with the exact LP.

Internally costs are in *token units*: seconds divided by the compute seconds of one token-expert
pair, so ``comp_g`` is a token count and a token on NVLink (RDMA) costs ``w_nv`` (``w_rdma``) units.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba as nb
import numpy as np

from ..cost_terms import comm_seconds, dispatch_seconds, link_masks, on_nvlink, on_rdma, t_moe_seconds
from ..errors import PlanError
from ..specs import ClusterSpec, ModelSpec
from ..validate import check_index_range, check_token_counts

__all__ = [
    "CellWeights", "SplitSolution", "cell_weights", "holders", "shares_from_flows", "solve_split_lp",
    "split_cost", "fast_split", "lower_bound", "lp_split_for_holders",
]


@dataclass(frozen=True)
class CellWeights:
    """Per-token costs of one cell in token units (see the module docstring).

    Attributes:
        sec_per_token: compute seconds of one (token, expert) pair (``6 h h' / F``).
        w_nv: dispatch + combine cost of one token on NVLink, in token units.
        w_rdma: the same on RDMA.
    """

    sec_per_token: float
    w_nv: float
    w_rdma: float


def cell_weights(model: ModelSpec, cluster: ClusterSpec) -> CellWeights:
    """Token-unit weights of the cost model for ``model`` on ``cluster``."""
    r = cluster.rates(model)
    spt = r.sec_per_pair
    # comm_seconds is linear: its factor on the per-pair rates is its factor on every GPU's dispatch
    return CellWeights(spt, comm_seconds(r.nvlink_sec_per_pair) / spt, comm_seconds(r.rdma_sec_per_pair) / spt)


@dataclass(frozen=True)
class SplitSolution:
    """A token split of one cell.

    Attributes:
        rows: int32 ``[Z, 3]`` rows ``(j, e, g)`` of the replicated experts' split.
        share: float64 ``[Z]`` share of ``x[j, e]`` served on GPU g (per (j, e) the shares sum to 1).
        t_moe: seconds, the exact T_MoE of the cell under this split.
    """

    rows: np.ndarray
    share: np.ndarray
    t_moe: float


def check_loads_homes(x: np.ndarray, expert_gpu: np.ndarray, cluster: ClusterSpec) -> tuple[np.ndarray, np.ndarray]:
    """One cell's inputs as contiguous float64 ``x [G, E]`` (tokens) and int64 ``expert_gpu [E]``; PlanError
    naming the field and value unless shapes fit the cluster, counts are finite >= 0 and homes in ``[0, G)``."""
    x = np.ascontiguousarray(x, dtype=np.float64)
    expert_gpu = np.ascontiguousarray(expert_gpu, dtype=np.int64)
    G = cluster.num_gpus
    if x.ndim != 2 or x.shape[0] != G:
        raise PlanError(f"x has shape {x.shape}, expected [G={G}, E]")
    E = x.shape[1]
    check_token_counts("x", x)
    if expert_gpu.shape != (E,):
        raise PlanError(f"expert_gpu has shape {expert_gpu.shape}, expected [E={E}]")
    check_index_range("expert_gpu", expert_gpu, 0, G)
    return x, expert_gpu


def _check_cell(x: np.ndarray, expert_gpu: np.ndarray, replica_expert: np.ndarray,
                cluster: ClusterSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x, expert_gpu = check_loads_homes(x, expert_gpu, cluster)
    replica_expert = np.asarray(replica_expert, dtype=np.int64)
    G, E = x.shape
    if replica_expert.ndim != 2 or replica_expert.shape[0] != G:
        raise PlanError(f"replica_expert has shape {replica_expert.shape}, expected [G={G}, r]")
    check_index_range("replica_expert", replica_expert, -1, E)
    return x, expert_gpu, replica_expert


def holders(expert_gpu: np.ndarray, replica_expert: np.ndarray, gpus_per_node: int) -> np.ndarray:
    """int64 ``[E, P]``: the GPUs holding each expert (home first, then replicas ascending), -1 padded.

    Raises PlanError when a replica sits outside its home's node, on its home GPU, or twice on one GPU.
    """
    expert_gpu = np.asarray(expert_gpu, dtype=np.int64)
    replica_expert = np.asarray(replica_expert, dtype=np.int64)
    E, P = expert_gpu.shape[0], gpus_per_node
    out = np.full((E, P), -1, np.int64)
    out[:, 0] = expert_gpu
    count = np.ones(E, np.int64)
    for g, s in zip(*np.nonzero(replica_expert >= 0)):
        e = int(replica_expert[g, s])
        h = int(expert_gpu[e])
        if h // P != g // P:
            raise PlanError(f"replica_expert[{g}, {s}] = expert {e}: GPU {g} is not in the node of its home GPU {h}")
        if h == g:
            raise PlanError(f"replica_expert[{g}, {s}] = expert {e}, which is homed on GPU {g} already")
        if (out[e, :count[e]] == g).any():
            raise PlanError(f"replica_expert[{g}] holds expert {e} twice")
        out[e, count[e]] = g
        count[e] += 1
    return out


# ----------------------------------------------------------------------------------------------
# numba kernels (token units). Aggregates per GPU: comp, nvtx, nvrx, rdtx, rdrx  ->  agg [5, G].
# ----------------------------------------------------------------------------------------------

@nb.njit(cache=True, inline="always")
def add_flow(agg, cls, j, g, a):
    """Add ``a`` tokens from source ``j`` to server ``g`` (link class ``cls[j, g]``) to ``agg [5, G]``: g's compute,
    and j's tx / g's rx on the links that carry the pair (``cost_terms.on_nvlink`` / ``on_rdma``)."""
    c = cls[j, g]
    agg[0, g] += a
    if on_nvlink(c):
        agg[1, j] += a
        agg[2, g] += a
    if on_rdma(c):
        agg[3, j] += a
        agg[4, g] += a


@nb.njit(cache=True)
def aggregates(x, hold, flows, cls):
    """``agg [5, G]`` (comp, nvlink tx, nvlink rx, rdma tx, rdma rx tokens) of flows ``[G, E, P]``."""
    G, E = x.shape
    P = hold.shape[1]
    agg = np.zeros((5, G))
    for j in range(G):
        for e in range(E):
            for k in range(P):
                g = hold[e, k]
                if g < 0:
                    break
                a = flows[j, e, k]
                if a != 0.0:
                    add_flow(agg, cls, j, g, a)
    return agg


@nb.njit(cache=True)
def t_units(agg, w_nv, w_rdma):
    """Exact T_MoE in token units: ``max comp + max comm`` (``cost_terms``: comp_g is the load itself, comm_g the
    ``dispatch_seconds`` at the comm weights of ``cell_weights``)."""
    G = agg.shape[1]
    mc = 0.0
    mm = 0.0
    for g in range(G):
        if agg[0, g] > mc:
            mc = agg[0, g]
        v = dispatch_seconds(agg[1, g], agg[2, g], agg[3, g], agg[4, g], w_nv, w_rdma)
        if v > mm:
            mm = v
    return t_moe_seconds(mc, mm)


@nb.njit(cache=True)
def smooth_units(agg, w_nv, w_rdma, beta):
    """LSE-smoothed ``max comp + max comm`` (scale: the mean compute load), a tie-breaker."""
    G = agg.shape[1]
    s = 0.0
    for g in range(G):
        s += agg[0, g]
    s = max(s / G, 1e-12)
    mc = 0.0
    mm = 0.0
    for g in range(G):
        mc = max(mc, agg[0, g])
        mm = max(mm, dispatch_seconds(agg[1, g], agg[2, g], agg[3, g], agg[4, g], w_nv, w_rdma))
    sc = 0.0
    sm = 0.0
    for g in range(G):
        sc += np.exp(beta * (agg[0, g] - mc) / s)
        for t in range(1, 5):
            w = w_nv if t <= 2 else w_rdma
            sm += np.exp(beta * (w * agg[t, g] - mm) / s)
    return mc + s / beta * np.log(sc) + mm + s / beta * np.log(sm)


@nb.njit(cache=True)
def waterfill_expert(x, hold, flows, agg, cls, P, e):
    """Re-split expert ``e`` over its holders in place (flows and agg updated).

    Levels the compute of the holders (the others' loads fixed), then places sources: a source that is
    a holder serves itself first, a remote source goes to its same-rail holder next, the rest go to the
    holder with the lowest receive load of the matching link (RDMA for remote sources, NVLink else).
    """
    G = x.shape[0]
    nh = 0
    for k in range(hold.shape[1]):
        if hold[e, k] < 0:
            break
        nh += 1
    if nh <= 1:
        return
    tot = 0.0
    for j in range(G):
        tot += x[j, e]
        for k in range(nh):
            a = flows[j, e, k]
            if a != 0.0:
                add_flow(agg, cls, j, hold[e, k], -a)
                flows[j, e, k] = 0.0
    if tot <= 0.0:
        return
    # water-filling: amounts cap[k] so that agg_comp + cap is level where cap > 0
    lev = np.empty(nh)
    for k in range(nh):
        lev[k] = agg[0, hold[e, k]]
    order = np.argsort(lev)
    lam = 0.0
    used = 0.0
    cnt = 0
    for i in range(nh):
        cnt = i + 1
        used += lev[order[i]]
        lam = (tot + used) / cnt
        if i + 1 < nh and lam <= lev[order[i + 1]]:
            break
    cap = np.zeros(nh)
    for k in range(nh):
        cap[k] = max(0.0, lam - lev[k])
    s = cap.sum()
    if s > 0:
        for k in range(nh):
            cap[k] *= tot / s
    rem = np.empty(G)
    for j in range(G):
        rem[j] = x[j, e]
    home_node = hold[e, 0] // P
    # pass 1: a holder serves its own tokens
    for k in range(nh):
        g = hold[e, k]
        a = min(rem[g], cap[k])
        if a > 0:
            flows[g, e, k] += a
            rem[g] -= a
            cap[k] -= a
    # pass 2: remote sources to their same-rail holder (RDMA only, no NVLink hop)
    for j in range(G):
        if rem[j] <= 0 or j // P == home_node:
            continue
        for k in range(nh):
            if hold[e, k] % P == j % P:
                a = min(rem[j], cap[k])
                if a > 0:
                    flows[j, e, k] += a
                    rem[j] -= a
                    cap[k] -= a
                break
    # commit passes 1-2 to agg so pass 3 sees receive loads
    for j in range(G):
        for k in range(nh):
            a = flows[j, e, k]
            if a != 0.0:
                add_flow(agg, cls, j, hold[e, k], a)
    # pass 3: the rest, to the holder with the lowest matching receive load
    for j in range(G):
        while rem[j] > 1e-12 * max(1.0, x[j, e]):
            remote = j // P != home_node
            best = -1
            bv = 0.0
            for k in range(nh):
                if cap[k] <= 1e-12 * max(1.0, tot):
                    continue
                g = hold[e, k]
                v = agg[4, g] if remote else agg[2, g]
                if best < 0 or v < bv:
                    best = k
                    bv = v
            if best < 0:
                # rounding leftovers: give them home
                best = 0
                a = rem[j]
            else:
                a = min(rem[j], cap[best])
                cap[best] -= a
            flows[j, e, best] += a
            add_flow(agg, cls, j, hold[e, best], a)
            rem[j] -= a


@nb.njit(cache=True)
def sweep(x, hold, flows, agg, cls, P, experts, passes):
    """``passes`` rounds of :func:`waterfill_expert` over ``experts`` (in the given order)."""
    for _ in range(passes):
        for i in range(experts.shape[0]):
            waterfill_expert(x, hold, flows, agg, cls, P, experts[i])


def home_flows(x: np.ndarray, P: int) -> np.ndarray:
    """float64 ``[G, E, P]`` flows with every token at home (slot 0)."""
    G, E = x.shape
    flows = np.zeros((G, E, P))
    flows[:, :, 0] = x
    return flows


def shares_from_flows(x: np.ndarray, hold: np.ndarray, flows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split rows ``(j, e, g)`` int32 ``[Z, 3]`` and shares float64 ``[Z]`` of the replicated experts.

    Only sources with tokens get rows; zero shares are dropped and each (j, e) renormalized to 1.
    """
    nh = (hold >= 0).sum(axis=1)
    js, es = np.nonzero((x > 0) & (nh > 1)[None, :])
    if not len(js):
        return np.zeros((0, 3), np.int32), np.zeros(0)
    P = hold.shape[1]
    valid = np.arange(P)[None, :] < nh[es][:, None]
    f = np.where(valid, np.clip(flows[js, es, :], 0.0, None), 0.0)
    tot = f.sum(axis=1, keepdims=True)
    f = np.where(tot > 0, f / np.where(tot > 0, tot, 1.0), (np.arange(P) == 0)[None, :])
    f = np.where(f > 1e-9, f, 0.0)
    f /= f.sum(axis=1, keepdims=True)
    ii, kk = np.nonzero(f)
    rows = np.stack([js[ii], es[ii], hold[es[ii], kk]], axis=1).astype(np.int32)
    order = np.lexsort((rows[:, 2], rows[:, 0], rows[:, 1]))
    return rows[order], f[ii, kk][order]


def split_cost(x: np.ndarray, expert_gpu: np.ndarray, rows: np.ndarray, share: np.ndarray,
               model: ModelSpec, cluster: ClusterSpec) -> float:
    """Exact T_MoE seconds of a cell under split rows (j, e, g) -> share (float64 reference path)."""
    x = np.asarray(x, dtype=np.float64)
    G = cluster.num_gpus
    flow = x @ (np.asarray(expert_gpu)[:, None] == np.arange(G)).astype(np.float64)
    rows = np.asarray(rows).reshape(-1, 3)
    if len(rows):
        j, e, g = rows.T
        pairs = np.unique(np.stack([j, e], axis=1), axis=0)
        for jj, ee in pairs:  # remove the home flow of split (j, e) pairs
            flow[jj, expert_gpu[ee]] -= x[jj, ee]
        np.add.at(flow, (j, g), x[j, e] * np.asarray(share, dtype=np.float64))
    from ..cost import cost_from_flow
    return float(cost_from_flow(flow, model, cluster).t_moe)


def fast_split(x: np.ndarray, expert_gpu: np.ndarray, replica_expert: np.ndarray, model: ModelSpec,
               cluster: ClusterSpec, passes: int = 3) -> SplitSolution:
    """Heuristic split of one cell (water-filling sweeps); never worse than sending everything home."""
    x, expert_gpu, replica_expert = _check_cell(x, expert_gpu, replica_expert, cluster)
    P = cluster.gpus_per_node
    hold = holders(expert_gpu, replica_expert, P)
    w = cell_weights(model, cluster)
    cls = cluster.link_classes.astype(np.int64)
    flows = home_flows(x, P)
    agg = aggregates(x, hold, flows, cls)
    t0 = t_units(agg, w.w_nv, w.w_rdma)
    rep = np.flatnonzero((hold >= 0).sum(axis=1) > 1)
    rep = rep[np.argsort(-x[:, rep].sum(axis=0), kind="stable")].astype(np.int64)
    sweep(x, hold, flows, agg, cls, P, rep, passes)
    t1 = t_units(agg, w.w_nv, w.w_rdma)
    if t1 > t0:
        flows = home_flows(x, P)
        t1 = t0
    rows, share = shares_from_flows(x, hold, flows)
    return SplitSolution(rows, share, t1 * w.sec_per_token)


def lower_bound(x: np.ndarray, expert_gpu: np.ndarray, model: ModelSpec, cluster: ClusterSpec) -> float:
    """A lower bound (seconds) on T_MoE of a cell under *any* intra-node replication and split.

    Replicas stay in the home's node, so per node n the tokens of the experts it homes are computed by
    its P GPUs (``comp >= max_n load_n / P``), every source's cross-node tokens are fixed
    (``rdma_tx_j``), and node n's incoming cross-node tokens land on its P GPUs
    (``rdma_rx >= R_n / P``). ``LB = comp bound + w_rdma x max(tx bound, rx bound)`` in token units.
    """
    x = np.asarray(x, dtype=np.float64)
    expert_gpu = np.asarray(expert_gpu, dtype=np.int64)
    G, P = cluster.num_gpus, cluster.gpus_per_node
    w = cell_weights(model, cluster)
    nodes = cluster.nodes
    node_of_e = cluster.node_of(expert_gpu)
    xn = np.zeros((G, nodes))
    np.add.at(xn.T, node_of_e, x.T)  # xn[j, n]: tokens of source j for experts homed in node n
    comp = xn.sum(axis=0).max() / P
    src_node = cluster.node_of(np.arange(G))
    remote = xn.copy()
    remote[np.arange(G), src_node] = 0.0
    tx = remote.sum(axis=1).max()
    rx = remote.sum(axis=0).max() / P
    return float((comp + w.w_rdma * max(tx, rx)) * w.sec_per_token)


def lower_bound_terms(x: np.ndarray, expert_gpu: np.ndarray, model: ModelSpec, cluster: ClusterSpec
                      ) -> tuple[np.ndarray, np.ndarray]:
    """``(comp_lb, comm_lb)`` seconds ``[...]``: the two terms of ``lower_bound`` apart, for cells ``x [..., G, E]``
    with homes ``expert_gpu [..., E]`` (broadcast over the leading axes), so that a weighted sum such as the
    step's ``3 comp + 2 comm`` can be bounded too: ``max_g comp >= comp_lb`` and ``max_g comm >= comm_lb`` under
    any intra-node replication and split."""
    x = np.asarray(x, dtype=np.float64)
    eg = np.broadcast_to(np.asarray(expert_gpu, dtype=np.int64), x.shape[:-2] + x.shape[-1:])
    G, P = cluster.num_gpus, cluster.gpus_per_node
    w = cell_weights(model, cluster)
    nodes = cluster.nodes
    onehot = (cluster.node_of(eg)[..., None] == np.arange(nodes)).astype(np.float64)  # [..., E, nodes]
    xn = x @ onehot  # [..., G, nodes]: tokens of source j for experts homed in node n
    comp = xn.sum(axis=-2).max(axis=-1) / P
    remote = xn * (cluster.node_of(np.arange(G))[:, None] != np.arange(nodes)[None, :])
    tx = remote.sum(axis=-1).max(axis=-1)
    rx = remote.sum(axis=-2).max(axis=-1) / P
    return comp * w.sec_per_token, w.w_rdma * np.maximum(tx, rx) * w.sec_per_token


# ----------------------------------------------------------------------------------------------
# exact LP
# ----------------------------------------------------------------------------------------------

def _lp_arrays(x: np.ndarray, hold: np.ndarray, cls: np.ndarray, w: CellWeights):
    """Build the LP ``min a + b`` over the free flows; see :func:`solve_split_lp`.

    Returns ``(J, Ex, K, cost, A (csc parts), row bounds, col bounds, pairs)`` or None when no expert
    is replicated.
    """
    G, E = x.shape
    nh = (hold >= 0).sum(axis=1)
    rep = nh > 1
    # base aggregates of the fixed (non-replicated) flows
    xf = np.where(rep[None, :], 0.0, x)
    base_flow = xf @ (hold[:, 0][:, None] == np.arange(G)).astype(np.float64)
    nvm, rdm = link_masks(cls)
    base = np.stack([base_flow.sum(axis=0), (base_flow * nvm).sum(axis=1), (base_flow * nvm).sum(axis=0),
                     (base_flow * rdm).sum(axis=1), (base_flow * rdm).sum(axis=0)])
    wt = np.array([1.0, w.w_nv, w.w_nv, w.w_rdma, w.w_rdma])
    js, es = np.nonzero((x > 0) & rep[None, :])
    if not len(js):
        return None, base, wt
    npair = len(js)
    # one column per (pair, holder)
    reps = nh[es]
    pair_of = np.repeat(np.arange(npair), reps)
    k_of = np.arange(len(pair_of)) - np.repeat(np.cumsum(reps) - reps, reps)
    J = js[pair_of]
    Ex = es[pair_of]
    Gt = hold[Ex, k_of]
    c = cls[J, Gt]
    n = len(J)
    # term rows: (term t, gpu) -> row id, for the entries each column touches
    ent_t, ent_g, ent_col = [np.zeros(n, np.int64)], [Gt], [np.arange(n)]  # comp at the target
    m_nv = on_nvlink.py_func(c)
    m_rd = on_rdma.py_func(c)
    cols = np.arange(n)
    for t, gpu, msk in ((1, J, m_nv), (2, Gt, m_nv), (3, J, m_rd), (4, Gt, m_rd)):
        ent_t.append(np.full(int(msk.sum()), t, np.int64))
        ent_g.append(gpu[msk])
        ent_col.append(cols[msk])
    et = np.concatenate(ent_t)
    eg = np.concatenate(ent_g)
    ec = np.concatenate(ent_col)
    key = et * G + eg
    ukey, rid = np.unique(key, return_inverse=True)
    return (npair, J, Ex, Gt, k_of, pair_of, js, es, et, eg, ec, ukey, rid), base, wt


def solve_split_lp(x: np.ndarray, expert_gpu: np.ndarray, replica_expert: np.ndarray, model: ModelSpec,
                   cluster: ClusterSpec) -> SplitSolution:
    """The exact token split of one cell with the replicas fixed (docs/method.md, "Replication and the token split").

    Args:
        x: ``[G, E]`` tokens per (source GPU, expert).
        expert_gpu: ``[E]`` home GPU of every expert.
        replica_expert: ``[G, r]`` expert in each replica slot, -1 empty; replicas in the home's node.
        model, cluster: the cost model's specs.

    Returns:
        The optimal split (rows of replicated experts only) and its T_MoE in seconds.
    """
    x, expert_gpu, replica_expert = _check_cell(x, expert_gpu, replica_expert, cluster)
    return lp_split_for_holders(x, expert_gpu, holders(expert_gpu, replica_expert, cluster.gpus_per_node), model,
                                cluster)


def lp_split_for_holders(x: np.ndarray, expert_gpu: np.ndarray, hold: np.ndarray, model: ModelSpec,
                         cluster: ClusterSpec) -> SplitSolution:
    """:func:`solve_split_lp` on checked inputs (``x`` float64 ``[G, E]``, ``expert_gpu`` int64 ``[E]``) and the
    holders ``hold`` int64 ``[E, H]`` (home first, -1 padded; anywhere in the cluster: the LP reads the link class
    of every (source, holder) pair, so ``locality_replicas``' cross-node copies use it too)."""
    G = cluster.num_gpus
    w = cell_weights(model, cluster)
    cls = cluster.link_classes.astype(np.int64)
    scale = max(x.sum() / G, 1e-12)
    xs = x / scale
    built, base, wt = _lp_arrays(xs, hold, cls, w)
    wbase = base * wt[:, None]
    a_lo = float(wbase[0].max())
    b_lo = float(wbase[1:].max())
    if built is None:
        return SplitSolution(np.zeros((0, 3), np.int32), np.zeros(0), (a_lo + b_lo) * scale * w.sec_per_token)
    npair, J, Ex, Gt, k_of, pair_of, js, es, et, eg, ec, ukey, rid = built
    n = len(J)
    nrow_t = len(ukey)
    rt = ukey // G
    rg = ukey % G
    # rows: [pairs equality] + [term rows]; cols: [flows] + a + b
    # term row r: wt[t] * (base + sum f) - (a if t == 0 else b) <= 0  ->  wt f - a|b <= -wt base
    row_idx = np.concatenate([pair_of, npair + rid, npair + np.arange(nrow_t)])
    col_idx = np.concatenate([np.arange(n), ec, np.where(rt == 0, n, n + 1)])
    vals = np.concatenate([np.ones(n), wt[et], -np.ones(nrow_t)])
    row_lo = np.concatenate([xs[js, es], np.full(nrow_t, -np.inf)])
    row_hi = np.concatenate([xs[js, es], -wt[rt] * base[rt, rg]])
    col_lo = np.concatenate([np.zeros(n), [a_lo, b_lo]])
    col_hi = np.full(n + 2, np.inf)
    cost = np.concatenate([np.zeros(n), [1.0, 1.0]])
    sol = _highs_lp(cost, row_idx, col_idx, vals, row_lo, row_hi, col_lo, col_hi, npair + nrow_t)
    f = np.clip(sol[:n], 0.0, None)
    flows = np.zeros((G, x.shape[1], hold.shape[1]))
    flows[:, :, 0] = xs
    flows[js, es, 0] = 0.0
    np.add.at(flows, (J, Ex, k_of), f)
    rows, share = shares_from_flows(xs, hold, flows)
    t = split_cost(x, expert_gpu, rows, share, model, cluster)
    return SplitSolution(rows, share, t)


_HIGHS_QUIET = False


def quiet_highs(highspy):
    """A ``highspy.Highs()`` with output off. HiGHS prints its banner to the process's stdout (fd 1, from C++)
    when the first instance is created; that first creation runs with fd 1 pointed at /dev/null."""
    global _HIGHS_QUIET
    if _HIGHS_QUIET:
        h = highspy.Highs()
    else:
        import os
        import sys

        sys.stdout.flush()
        saved = os.dup(1)
        try:
            with open(os.devnull, "wb") as null:
                os.dup2(null.fileno(), 1)
                h = highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        _HIGHS_QUIET = True
    h.setOptionValue("output_flag", False)
    return h


def _highs_lp(cost, row_idx, col_idx, vals, row_lo, row_hi, col_lo, col_hi, nrow) -> np.ndarray:
    """Solve ``min cost.x, row_lo <= A x <= row_hi, col_lo <= x <= col_hi``; return x. Raises PlanError."""
    import scipy.sparse as sp

    ncol = len(cost)
    A = sp.csc_matrix((vals, (row_idx, col_idx)), shape=(nrow, ncol))
    try:
        import highspy
    except ImportError:  # pragma: no cover - scipy ships HiGHS too
        highspy = None
    if highspy is not None:
        h = quiet_highs(highspy)
        lp = highspy.HighsLp()
        lp.num_col_ = ncol
        lp.num_row_ = nrow
        lp.col_cost_ = np.asarray(cost, dtype=np.float64)
        lp.col_lower_ = np.asarray(col_lo, dtype=np.float64)
        lp.col_upper_ = np.where(np.isinf(col_hi), highspy.kHighsInf, col_hi).astype(np.float64)
        lp.row_lower_ = np.where(np.isinf(row_lo), -highspy.kHighsInf, row_lo).astype(np.float64)
        lp.row_upper_ = np.where(np.isinf(row_hi), highspy.kHighsInf, row_hi).astype(np.float64)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = A.indptr.astype(np.int32)
        lp.a_matrix_.index_ = A.indices.astype(np.int32)
        lp.a_matrix_.value_ = A.data.astype(np.float64)
        lp.a_matrix_.num_col_ = ncol
        lp.a_matrix_.num_row_ = nrow
        h.passModel(lp)
        h.run()
        status = h.getModelStatus()
        if status != highspy.HighsModelStatus.kOptimal:
            raise PlanError(f"split LP: HiGHS returned {h.modelStatusToString(status)}")
        return np.asarray(h.getSolution().col_value)
    from scipy.optimize import linprog

    eq = row_lo == row_hi
    A = A.tocsr()
    res = linprog(cost, A_ub=A[~eq], b_ub=row_hi[~eq], A_eq=A[eq], b_eq=row_hi[eq],
                  bounds=list(zip(col_lo, col_hi)), method="highs")
    if res.status != 0:
        raise PlanError(f"split LP: {res.message}")
    return res.x

