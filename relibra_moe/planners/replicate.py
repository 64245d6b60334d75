"""Greedy intra-node replication with token splitting (Algorithm 2), per micro-batch x layer.

The method: docs/method.md, "Replication and the token split".

For one cell (loads ``x [G, E]``, homes ``expert_gpu [E]``, ``r`` slots per GPU):

1. start with no replicas (every token served at home);
2. while some GPU has a free slot: take the compute-bottleneck GPU under the current split and its
   heaviest expert (the one it serves most tokens of); open a replica of it on the least-loaded GPU of
   the home's node that has a free slot and does not hold it; re-split the tokens with z fixed;
3. stop when no move lowers T_MoE.

Improvements over the paper's loop, all only *adding* candidates, so the result is never worse than
the paper's move sequence at each step: every move evaluates the paper's candidate plus (a) the next
heaviest experts of the compute bottleneck, (b) for the communication bottleneck, the experts whose
tokens load its binding link, with the replica that turns their NVLink / cross-rail hop into a local
or same-rail one; the best candidate by exact T_MoE (LSE-smoothed T_MoE breaks ties, so a tie at the
maximum does not stop the loop) is taken. The split inside the loop is the water-filling heuristic of
``split.py``; with ``polish=True`` the final split is re-solved with the exact LP and the better of the
two is kept. Two variants run per cell (the paper's single candidate, and the widened candidate set);
the better wins, so the result is never worse than the paper's loop with the same split solver.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, NamedTuple

import numba as nb
import numpy as np

from ..cost import moe_cost, peak_comp_comm
from ..cost_terms import on_nvlink, on_rdma
from ..errors import PlanError
from ..plan import Placement, ReplicaPlan, SamplePlacement
from ..specs import ClusterSpec, ModelSpec
from ..timing import attention_backward, cell_step_seconds, moe_comm_seconds, replica_push_overlap, transfer_seconds
from ..validate import check_int
from .executor import FallbackLog, TaskExecutor, TaskFailed, default_executor
from .options import DEFAULT_CANDIDATES, ReplicateOptions
from .split import (
    aggregates,
    cell_weights,
    check_loads_homes,
    lower_bound,
    shares_from_flows,
    smooth_units,
    solve_split_lp,
    t_units,
    waterfill_expert,
)

if TYPE_CHECKING:
    from ..trace import TraceBatch

__all__ = ["CellResult", "replicate_cell", "replicate_cell_greedy", "replicate_cell_lp", "replicate_batch",
           "slot_count_variants", "DEFAULT_CANDIDATES"]

_BETA = 20.0
_EPS = 1e-12


@nb.njit(cache=True)
def _nholders(hold, e):
    n = 0
    for k in range(hold.shape[1]):
        if hold[e, k] < 0:
            break
        n += 1
    return n


@nb.njit(cache=True)
def _holds(hold, e, g):
    for k in range(hold.shape[1]):
        if hold[e, k] < 0:
            return False
        if hold[e, k] == g:
            return True
    return False


@nb.njit(cache=True)
def _best_target(hold, used, agg, P, slots, e):
    """Least-loaded GPU of e's home node with a free slot that does not hold e; -1 if none."""
    node = hold[e, 0] // P
    best = -1
    for g in range(node * P, node * P + P):
        if used[g] >= slots or _holds(hold, e, g):
            continue
        if best < 0 or agg[0, g] < agg[0, best]:
            best = g
    return best


@nb.njit(cache=True)
def _try(x, hold, flows, agg, cls, P, e, t, w_nv, w_rdma, buf):
    """T and smoothed T after adding a replica of e on t and water-filling e; state restored after."""
    G = x.shape[0]
    n = _nholders(hold, e)
    for j in range(G):
        for k in range(P):
            buf[j, k] = flows[j, e, k]
    aggs = agg.copy()
    hold[e, n] = t
    waterfill_expert(x, hold, flows, agg, cls, P, e)
    tt = t_units(agg, w_nv, w_rdma)
    ss = smooth_units(agg, w_nv, w_rdma, _BETA)
    hold[e, n] = -1
    for j in range(G):
        for k in range(P):
            flows[j, e, k] = buf[j, k]
    agg[:, :] = aggs
    return tt, ss


@nb.njit(cache=True)
def _append_candidates(score, tgt, hold, used, agg, P, slots, ncand, out_e, out_t, nout):
    """Append up to ``ncand`` (expert, target) moves to ``out_e`` / ``out_t`` after their first ``nout``, experts by
    descending ``score`` (those > 0): the target ``tgt[e]``, or where it is -1 the least-loaded free GPU of e's
    node (``_best_target``); an expert without a target, or a move already listed, is skipped. Returns the count."""
    order = np.argsort(-score)
    taken = 0
    for i in range(score.shape[0]):
        e = order[i]
        if score[e] <= 0 or taken >= ncand:
            break
        t = tgt[e]
        if t < 0:
            t = _best_target(hold, used, agg, P, slots, e)
        if t < 0:
            continue
        dup = False
        for q in range(nout):
            if out_e[q] == e and out_t[q] == t:
                dup = True
        if dup:
            continue
        out_e[nout] = e
        out_t[nout] = t
        nout += 1
        taken += 1
    return nout


@nb.njit(cache=True)
def _cands_comp(x, hold, flows, agg, used, P, slots, ncand, out_e, out_t, nout):
    """The compute bottleneck's heaviest experts (paper's candidate first)."""
    G, E = x.shape
    gs = 0
    for g in range(G):
        if agg[0, g] > agg[0, gs]:
            gs = g
    served = np.zeros(E)
    for e in range(E):
        for k in range(P):
            g = hold[e, k]
            if g < 0:
                break
            if g == gs:
                s = 0.0
                for j in range(G):
                    s += flows[j, e, k]
                served[e] = s
    return _append_candidates(served, np.full(E, -1), hold, used, agg, P, slots, ncand, out_e, out_t, nout)


@nb.njit(cache=True)
def _cands_comm(x, hold, flows, agg, cls, used, P, slots, ncand, w_nv, w_rdma, out_e, out_t, nout):
    """Experts loading the binding communication term, with a replica that shortens their hop."""
    G, E = x.shape
    bg = 0
    bt = 1
    bv = -1.0
    for g in range(G):
        for t in range(1, 5):
            w = w_nv if t <= 2 else w_rdma
            if w * agg[t, g] > bv:
                bv = w * agg[t, g]
                bg = g
                bt = t
    # score[e]: tokens of e on the binding link; tgt[e]: replica GPU that removes (part of) it
    score = np.zeros(E)
    tgt = np.full(E, -1)
    src_term = bt == 1 or bt == 3
    for e in range(E):
        node = hold[e, 0] // P
        for k in range(P):
            g = hold[e, k]
            if g < 0:
                break
            if not src_term and g != bg:
                continue
            j0 = bg if src_term else 0
            j1 = bg + 1 if src_term else G
            for j in range(j0, j1):
                a = flows[j, e, k]
                if a <= 0:
                    continue
                c = cls[j, g]
                if bt == 1 or bt == 2:
                    on = on_nvlink(c)
                else:
                    on = on_rdma(c)
                if not on:
                    continue
                # where would j's tokens of e ideally go: j itself (same node) or j's rail in e's node
                ideal = j if j // P == node else node * P + j % P
                if ideal != g and used[ideal] < slots and not _holds(hold, e, ideal):
                    score[e] += a
                    tgt[e] = ideal
                elif not src_term:
                    # receive-bound target: any other GPU of the node helps
                    score[e] += a
    return _append_candidates(score, tgt, hold, used, agg, P, slots, ncand, out_e, out_t, nout)


@nb.njit(cache=True)
def greedy_cell(x, home, P, slots, cls, w_nv, w_rdma, ncand, comm_cands, passes):
    """Algorithm 2 on one cell in token units. Returns (hold [E, P], rep [G, slots], flows [G, E, P], T)."""
    G, E = x.shape
    hold = np.full((E, P), -1, np.int64)
    for e in range(E):
        hold[e, 0] = home[e]
    rep = np.full((G, slots), -1, np.int64)
    used = np.zeros(G, np.int64)
    flows = np.zeros((G, E, P))
    for j in range(G):
        for e in range(E):
            flows[j, e, 0] = x[j, e]
    agg = aggregates(x, hold, flows, cls)
    T = t_units(agg, w_nv, w_rdma)
    S = smooth_units(agg, w_nv, w_rdma, _BETA)
    buf = np.zeros((G, P))
    ce = np.zeros(4 * ncand + 4, np.int64)
    ct = np.zeros(4 * ncand + 4, np.int64)
    snap = np.zeros((E + 1, G, P))
    touched = np.zeros(E + 1, np.int64)
    if slots <= 0:
        return hold, rep, flows, T
    while True:
        nout = _cands_comp(x, hold, flows, agg, used, P, slots, max(ncand, 1), ce, ct, 0)
        if comm_cands:
            nout = _cands_comm(x, hold, flows, agg, cls, used, P, slots, ncand, w_nv, w_rdma, ce, ct, nout)
        if nout == 0:
            break
        bi = -1
        bT = T
        bS = S
        for i in range(nout):
            tt, ss = _try(x, hold, flows, agg, cls, P, ce[i], ct[i], w_nv, w_rdma, buf)
            if tt < bT * (1 - _EPS) or (tt <= bT * (1 + _EPS) and ss < bS * (1 - _EPS)):
                bi = i
                bT = tt
                bS = ss
        if bi < 0:
            break
        e = ce[bi]
        t = ct[bi]
        n = _nholders(hold, e)
        hold[e, n] = t
        rep[t, used[t]] = e
        used[t] += 1
        waterfill_expert(x, hold, flows, agg, cls, P, e)
        T = t_units(agg, w_nv, w_rdma)
        S = smooth_units(agg, w_nv, w_rdma, _BETA)
        # re-level the other replicated experts of the node (kept only if it does not hurt)
        node = home[e] // P
        nt = 0
        ne = _nholders(hold, e)
        for f in range(E):
            if f == e or home[f] // P != node:
                continue
            nf = _nholders(hold, f)
            if nf < 2:
                continue
            share = False
            for a in range(nf):  # re-level only experts sharing a GPU with e's holders
                for b in range(ne):
                    if hold[f, a] == hold[e, b]:
                        share = True
            if share:
                touched[nt] = f
                nt += 1
        if nt > 0 and passes > 0:
            touched[nt] = e  # e is re-levelled last in each pass, so it is snapshotted too
            for i in range(nt + 1):
                for j in range(G):
                    for k in range(P):
                        snap[i, j, k] = flows[j, touched[i], k]
            aggs = agg.copy()
            for _ in range(passes):
                for i in range(nt + 1):
                    waterfill_expert(x, hold, flows, agg, cls, P, touched[i])
            T2 = t_units(agg, w_nv, w_rdma)
            S2 = smooth_units(agg, w_nv, w_rdma, _BETA)
            if T2 < T * (1 - _EPS) or (T2 <= T * (1 + _EPS) and S2 < S):
                T = T2
                S = S2
            else:
                agg[:, :] = aggs
                for i in range(nt + 1):
                    f = touched[i]
                    for j in range(G):
                        for k in range(P):
                            flows[j, f, k] = snap[i, j, k]
    return hold, rep, flows, T


class CellResult(NamedTuple):
    """One cell's replicas and split.

    Attributes:
        replica_expert: int32 ``[G, r]`` expert in each replica slot (-1 empty).
        rows: int32 ``[Z, 3]`` split rows ``(j, e, g)`` of the replicated experts.
        share: float64 ``[Z]`` share of ``x[j, e]`` served on g (each (j, e) sums to 1).
        t_moe: seconds, the cell's exact T_MoE under this plan.
    """

    replica_expert: np.ndarray
    rows: np.ndarray
    share: np.ndarray
    t_moe: float


def cell_step_terms(x: np.ndarray, expert_gpu: np.ndarray, res: CellResult, model: ModelSpec,
                    cluster: ClusterSpec) -> tuple[float, float, float]:
    """``(max comp, max comm, replica push)`` seconds of one cell under ``res`` (float64 reference path).

    The push is the time to fill the cell's replica slots from the homes (``timing.transfer_seconds`` of
    ``model.expert_bytes`` per filled slot); the gradient pull takes the same time the other way. ``max comm``
    includes the all-to-all latency (``timing.moe_comm_seconds``), as the simulator charges it.
    """
    G = cluster.num_gpus
    flow = x @ (np.asarray(expert_gpu)[:, None] == np.arange(G)).astype(np.float64)
    if len(res.rows):
        j, e, g = (res.rows[:, c].astype(np.int64) for c in range(3))
        split = np.zeros(x.shape, dtype=bool)
        split[j, e] = True
        pj, pe = np.nonzero(split)  # the distinct split (j, e) pairs, in lexicographic order
        np.subtract.at(flow, (pj, expert_gpu[pe]), x[pj, pe])
        np.add.at(flow, (j, g), x[j, e] * res.share)
    comp, comm = peak_comp_comm(flow, model, cluster)
    push = replica_push_seconds(expert_gpu, res.replica_expert, model, cluster)
    return comp, float(moe_comm_seconds(comm, flow, cluster)), push


def replica_push_seconds(expert_gpu: np.ndarray, replica_expert: np.ndarray, model: ModelSpec,
                         cluster: ClusterSpec) -> float:
    """Seconds to fill a cell's replica slots ``replica_expert`` ``[G, r]`` (-1 empty) from the homes
    ``expert_gpu`` ``[E]``: ``timing.transfer_seconds`` of ``model.expert_bytes`` per filled slot."""
    tg, ts = np.nonzero(replica_expert >= 0)
    if not len(tg):
        return 0.0
    src = expert_gpu[replica_expert[tg, ts]]
    return float(transfer_seconds(src, tg, model.expert_bytes, None, 1, cluster)[0])


def slot_count_variants(x: np.ndarray, expert_gpu: np.ndarray, model: ModelSpec, cluster: ClusterSpec,
                        replica_slots: int, counts: Iterable[int], **kw
                        ) -> Iterator[tuple[int, CellResult, float, float, float]]:
    """``(c, result, comp, comm, push)`` for each count ``c`` of ``counts``: the greedy with ``c`` slots per GPU
    (``replicate_cell_greedy`` with ``kw``; 0: no replicas, ``t_moe`` 0), padded to ``replica_slots`` slots, and
    its ``cell_step_terms`` seconds, one count at a time (lazily: a caller may stop early). The variants that
    ``replicate_cell`` and ``online.online_cell`` choose from: one definition, so that they compare like with
    like. ``x [G, E]`` tokens, ``expert_gpu [E]`` int64 homes."""
    G = cluster.num_gpus
    for c in counts:
        if c == 0:
            cand = CellResult(np.full((G, replica_slots), -1, np.int32), np.zeros((0, 3), np.int32), np.zeros(0), 0.0)
        else:
            r = replicate_cell_greedy(x, expert_gpu, model, cluster, c, **kw)
            pad = np.full((G, replica_slots), -1, np.int32)
            pad[:, :c] = r.replica_expert
            cand = CellResult(pad, r.rows, r.share, r.t_moe)
        yield (c, cand, *cell_step_terms(x, expert_gpu, cand, model, cluster))


def replicate_cell(x: np.ndarray, expert_gpu: np.ndarray, model: ModelSpec, cluster: ClusterSpec,
                   replica_slots: int, *, attn_fwd: float | None = None, **kw) -> CellResult:
    """Greedy replication + token split of one cell (Algorithm 2), priced for its replica traffic.

    Without ``attn_fwd`` this is ``replicate_cell_greedy``. With ``attn_fwd`` (seconds of the micro-batch's
    attention forward; the per-layer replica push overlaps ``timing.replica_push_overlap(attn_fwd, comm)`` =
    ``max(attn_fwd, comm / 2)``, the gradient pull the backward), the greedy is also run with r - 1 .. 0 replica
    slots per GPU and the result with the lowest ``timing.cell_step_seconds`` under the cluster's overlap (the
    simulator's charge of the cell) wins; ties keep more replicas. A replica set whose transfers are not hidden
    is so kept only where it pays, and fewer slots can also end lower because the greedy is not monotone in them
    (a full GPU turns it to other moves). The smaller counts are skipped only where the full set's push and pull
    hide behind the dispatch alone (the ``after-router`` window, the shortest) and the attention backward: then
    ``online.online_cell`` keeps the full set too. So with the default ``ReplicateOptions`` the result is never
    charged more than ``online_cell``'s on the same homes and cell (the same greedy per count, judged by the
    simulator's charge with a window never shorter), which lets the portfolio skip that baseline.
    """
    res = replicate_cell_greedy(x, expert_gpu, model, cluster, replica_slots, **kw)
    if attn_fwd is None or replica_slots == 0 or not (res.replica_expert >= 0).any():
        return res
    x = np.ascontiguousarray(x, dtype=np.float64)
    eg = np.ascontiguousarray(expert_gpu, dtype=np.int64)
    comp, comm, push = cell_step_terms(x, eg, res, model, cluster)
    if push <= replica_push_overlap(attn_fwd, comm, "after-router") and push <= attention_backward(attn_fwd):
        return res  # push and gradient pull hidden even behind the shortest window: nothing to trade
    best, best_t = res, cell_step_seconds(comp, comm, push, attn_fwd, overlap=cluster.overlap)
    for _, cand, cc_, cm_, cp_ in slot_count_variants(x, eg, model, cluster, replica_slots,
                                                   range(replica_slots - 1, -1, -1), **kw):
        t = cell_step_seconds(cc_, cm_, cp_, attn_fwd, overlap=cluster.overlap)
        if t < best_t * (1 - 1e-12):
            best, best_t = cand, t
    if best is not res and not len(best.rows) and not (best.replica_expert >= 0).any():
        best = best._replace(t_moe=float(moe_cost(x, eg, model, cluster).t_moe))
    return best


def replicate_cell_greedy(x: np.ndarray, expert_gpu: np.ndarray, model: ModelSpec, cluster: ClusterSpec,
                          replica_slots: int,
                          *, candidates: int | None = None, comm_candidates: bool = True, passes: int = 0,
                          polish: bool | None = None, polish_tol: float = 0.005) -> CellResult:
    """Greedy replication + token split of one cell (Algorithm 2).

    Args:
        x: ``[G, E]`` tokens per (source GPU, expert) of one micro-batch and layer.
        expert_gpu: ``[E]`` home GPU of every expert.
        model, cluster: specs of the cost model.
        replica_slots: r, replica slots per GPU.
        candidates: experts tried per move on each bottleneck (1 and ``comm_candidates=False`` is the
            paper's loop: only the compute bottleneck's heaviest expert). None: ``DEFAULT_CANDIDATES``
            (4) up to 16 GPUs, 2 beyond (same quality within 0.1% on the bench scenarios, half the time).
        comm_candidates: also try replicas that relieve the communication bottleneck.
        passes: water-filling passes, after each move, over the replicated experts sharing a GPU with the
            moved expert's holders (kept only when they lower T_MoE). 0 by default: on the bench scenarios
            they change T_MoE by < 0.01% for 1.5x the time.
        polish: re-solve the final split of each variant with the exact LP and keep the better. None:
            only on cells of at most 16 GPUs (where the LP takes milliseconds) whose greedy T_MoE is more
            than ``polish_tol`` above ``split.lower_bound`` (elsewhere nothing is left to gain).

    Returns:
        ``CellResult(replica_expert [G, r], rows [Z, 3] (j, e, g), share [Z], t_moe seconds)``.
    """
    x, expert_gpu = check_loads_homes(x, expert_gpu, cluster)
    G, E = x.shape
    check_int("replica_slots", replica_slots, 0)
    if candidates is None:
        candidates = DEFAULT_CANDIDATES if G <= 16 else 2
    P = cluster.gpus_per_node
    w = cell_weights(model, cluster)
    cls = cluster.link_classes.astype(np.int64)
    scale = max(x.sum() / G, 1e-12)
    xs = x / scale
    # the widened candidate sets, then the paper's loop unless the first already reached the lower
    # bound (nothing can beat it); the best final split wins
    configs = []
    if candidates > 1 or comm_candidates:
        configs.append((int(candidates), bool(comm_candidates)))
    configs.append((1, False))
    lb = lower_bound(x, expert_gpu, model, cluster)
    runs = []
    seen = set()
    auto = polish is None
    if auto:
        polish = G <= 16 and bool(replica_slots)
    for ncand, comm in configs:
        if runs and min(r[0] for r in runs) <= lb * (1 + 1e-9):
            break
        hold, rep, flows, T = greedy_cell(xs, expert_gpu, P, int(replica_slots), cls, w.w_nv, w.w_rdma, ncand, comm,
                                          int(passes))
        key = rep.tobytes()
        if key not in seen:
            seen.add(key)
            runs.append((T * scale * w.sec_per_token, hold, rep, flows))
    if auto and polish and min(r[0] for r in runs) <= lb * (1 + polish_tol):
        polish = False
    best = None
    for t, hold, rep, flows in sorted(runs, key=lambda r: r[0]) if polish else [min(runs, key=lambda r: r[0])]:
        rows, share = shares_from_flows(xs, hold, flows)
        if polish and len(rows):
            lp = solve_split_lp(x, expert_gpu, rep, model, cluster)
            if lp.t_moe < t:
                rows, share, t = lp.rows, lp.share, lp.t_moe
        if best is None or t < best[3]:
            best = (rep, rows, share, t)
    rep, rows, share, t = best
    return CellResult(rep.astype(np.int32), rows, share, float(t))


def replicate_cell_lp(x: np.ndarray, expert_gpu: np.ndarray, model: ModelSpec, cluster: ClusterSpec,
                      replica_slots: int,
                      *, candidates: int = 1) -> CellResult:
    """Algorithm 2 literally, with the exact split LP re-solved after every move (slow: small cells only).

    Each move: the compute-bottleneck GPU under the current (LP-optimal) split, its heaviest expert (most
    tokens served there), a replica on the least-loaded GPU of the home's node with a free slot that does
    not hold it, the LP re-solved with z fixed; the move is kept if T_MoE drops, else the loop stops.
    ``candidates > 1`` tries that many of the bottleneck's heaviest experts per move and keeps the best.
    """
    x = np.ascontiguousarray(x, dtype=np.float64)
    expert_gpu = np.ascontiguousarray(expert_gpu, dtype=np.int64)
    G, P = cluster.num_gpus, cluster.gpus_per_node
    if x.ndim != 2 or x.shape[0] != G or expert_gpu.shape != (x.shape[1],):
        raise PlanError(f"x {x.shape} / expert_gpu {expert_gpu.shape} do not match G={G}")
    check_int("replica_slots", replica_slots, 0)
    rep = np.full((G, replica_slots), -1, np.int64)
    used = np.zeros(G, np.int64)
    sol = solve_split_lp(x, expert_gpu, rep, model, cluster)
    while replica_slots > 0:
        served = x * 0.0  # [G(target), E]: tokens of e served on each GPU under the current split
        np.add.at(served.T, (np.arange(x.shape[1]), expert_gpu), x.sum(axis=0))
        if len(sol.rows):
            j, e, g = sol.rows.T
            pairs = np.unique(np.stack([j, e], 1), axis=0)
            np.add.at(served, (expert_gpu[pairs[:, 1]], pairs[:, 1]), -x[pairs[:, 0], pairs[:, 1]])
            np.add.at(served, (g, e), x[j, e] * sol.share)
        load = served.sum(axis=1)
        gs = int(np.argmax(load))
        best = None
        tried = 0
        for e in np.argsort(-served[gs], kind="stable"):
            if served[gs, e] <= 0 or tried >= candidates:
                break
            node = expert_gpu[e] // P
            free = [g for g in range(node * P, node * P + P)
                    if used[g] < replica_slots and g != expert_gpu[e] and not (rep[g] == e).any()]
            if not free:
                continue
            t = min(free, key=lambda g: (load[g], g))
            tried += 1
            trial = rep.copy()
            trial[t, used[t]] = e
            cand = solve_split_lp(x, expert_gpu, trial, model, cluster)
            if best is None or cand.t_moe < best[0].t_moe:
                best = (cand, trial, t)
        if best is None or best[0].t_moe >= sol.t_moe * (1 - 1e-12):
            break
        sol, rep, t = best
        used[t] += 1
    return CellResult(rep.astype(np.int32), sol.rows, sol.share, float(sol.t_moe))


def replicate_cells_task(loads: np.ndarray, expert_gpu: np.ndarray, model: ModelSpec, cluster: ClusterSpec,
                         replica_slots: int, options: ReplicateOptions, attn_fwd: np.ndarray | None = None
                         ) -> list[CellResult]:
    """One replication task for an executor: ``replicate_cell`` with ``options`` on cells ``loads [C, G, E]`` with
    homes ``expert_gpu [C, E]`` (and ``attn_fwd [C]`` seconds when replicas are priced)."""
    kw = options.kwargs()
    return [replicate_cell(loads[i], expert_gpu[i], model, cluster, replica_slots,
                           attn_fwd=None if attn_fwd is None else float(attn_fwd[i]), **kw) for i in range(len(loads))]


def assemble(results: dict[tuple[int, int], CellResult], num_micro_batches: int, num_layers: int,
             num_gpus: int, replica_slots: int) -> ReplicaPlan:
    """Build a ReplicaPlan from per-(m, l) cell results (missing cells: no replicas)."""
    rep = np.full((num_micro_batches, num_layers, num_gpus, replica_slots), -1, np.int32)
    idx, sh = [], []
    for (m, l), res in sorted(results.items()):
        rep[m, l] = res.replica_expert
        if len(res.rows):
            idx.append(np.concatenate([np.full((len(res.rows), 2), (m, l), np.int32), res.rows], axis=1))
            sh.append(res.share)
    split_index = np.concatenate(idx) if idx else np.zeros((0, 5), np.int32)
    split_share = np.concatenate(sh) if sh else np.zeros(0)
    return ReplicaPlan(rep, split_index, split_share, scope="node")


def map_cells(executor: TaskExecutor, task: Callable[..., list[CellResult]], cells: list[tuple[int, int]],
              chunks: Iterable[np.ndarray], task_args: Callable[[np.ndarray, np.ndarray], tuple],
              fallbacks: FallbackLog | None, num_micro_batches: int, num_layers: int, num_gpus: int,
              replica_slots: int) -> ReplicaPlan:
    """Run ``task`` on ``executor`` once per chunk of ``cells`` and assemble the ReplicaPlan.

    Args:
        cells: the ``(m, l)`` cells; chunks: index arrays into ``cells``, one per task (empty ones are skipped).
        task_args: ``(ms, ls) -> args`` of the chunk whose cells are ``zip(ms, ls)``; ``task(*args)`` returns one
            CellResult per cell, in order. Every task is of kind ``"replicate"`` (keyed by its cells).
        fallbacks: a chunk that fails (or misses the executor's deadline) leaves its cells without replicas, so
            every token stays at its home; they are listed in ``fallbacks.replicate``.
    """
    args, keys = [], []
    for ch in chunks:
        if not len(ch):
            continue
        cs = tuple(cells[i] for i in ch)
        args.append(task_args(np.array([c[0] for c in cs]), np.array([c[1] for c in cs])))
        keys.append(("replicate", cs))
    results: dict[tuple[int, int], CellResult] = {}
    for (_, cs), res in zip(keys, executor.map(task, args, keys)):
        if isinstance(res, TaskFailed):
            if fallbacks is not None:
                fallbacks.replicate.extend([list(c) for c in cs])
            continue
        results.update(zip(cs, res))
    return assemble(results, num_micro_batches, num_layers, num_gpus, replica_slots)


def replicate_batch(placement: Placement, samples: SamplePlacement, batch: TraceBatch, model: ModelSpec,
                    cluster: ClusterSpec, replica_slots: int, workers: int = 1,
                    attn_fwd: np.ndarray | None = None, *, executor: TaskExecutor | None = None,
                    cell_chunk: int | None = None, fallbacks: FallbackLog | None = None,
                    options: ReplicateOptions | None = None, **cell_kw) -> ReplicaPlan:
    """Algorithm 2 for every micro-batch x layer of a batch.

    Args:
        placement: homes ``[L, E]``; samples: where each sample runs (its GPU is the tokens' source).
        batch: a ``TraceBatch`` (``loads(sample_gpu, G, micro_batch) -> [M, L, G, E]``).
        replica_slots: r per GPU (0: an empty ReplicaPlan).
        workers: processes for the cells when no ``executor`` is given (1: in this process).
        attn_fwd: optional ``[M]`` seconds of each micro-batch's attention forward (``timing.attention_forward``):
            replicas are then priced for their exposed push / pull (:func:`replicate_cell`).
        executor: runs the chunks of cells (``executor.TaskExecutor``; default ``default_executor(workers)``);
            a chunk that does not finish leaves its cells without replicas, recorded in ``fallbacks``.
        cell_chunk: cells per task (default: about 16 tasks per worker).
        options: how each cell is replicated (``options.ReplicateOptions``; default its defaults).
        cell_kw: ``ReplicateOptions`` fields as keywords instead of ``options`` (e.g. ``candidates=2``): checked
            here, so a misspelt one is a PlanError naming it before any cell runs; not together with ``options``.
    """
    if options is not None and cell_kw:
        raise PlanError(f"give options= (ReplicateOptions) or its fields as keywords, not both: got {sorted(cell_kw)}")
    options = ReplicateOptions.of(cell_kw if options is None else options, "replicate_batch")
    G = cluster.num_gpus
    if placement.expert_gpu.shape != (model.num_layers, model.num_experts):
        raise PlanError(f"placement expert_gpu has shape {placement.expert_gpu.shape}, expected "
                        f"[{model.num_layers}, {model.num_experts}]")
    M = int(samples.num_micro_batches)
    loads = np.asarray(batch.loads(samples.gpu, G, samples.micro_batch), dtype=np.float64)
    if loads.shape[0] < M:
        loads = np.concatenate([loads, np.zeros((M - loads.shape[0],) + loads.shape[1:])])
    L = placement.num_layers
    check_int("replica_slots", replica_slots, 0)
    if executor is None:
        executor = default_executor(workers)
    if replica_slots == 0:
        return ReplicaPlan.empty(M, L, G, 0)
    cells = [(m, l) for l in range(L) for m in range(M)]
    chunk = check_int("cell_chunk", cell_chunk, 1) if cell_chunk is not None else \
        max(1, math.ceil(len(cells) / (16 * executor.workers)))
    chunks = (np.arange(i, min(i + chunk, len(cells))) for i in range(0, len(cells), chunk))
    return map_cells(executor, replicate_cells_task, cells, chunks,
                     lambda ms, ls: (loads[ms, ls], placement.expert_gpu[ls], model, cluster, replica_slots, options,
                                     None if attn_fwd is None else np.asarray(attn_fwd)[ms]),
                     fallbacks, M, L, G, replica_slots)
