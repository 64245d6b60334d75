"""Cross-node locality replicas: global-scope copies that keep a node's tokens in the node (docs/method.md,
"Locality replicas").

relibra's own replicas (``replicate``, Algorithm 2) stay in the home's node: they balance compute but save no
RDMA traffic. On several nodes most of relibra's remaining T_MoE is the all-to-all across nodes, and a copy of an
expert homed on another node, in the node of the tokens that route to it, turns those tokens' RDMA hop into an
NVLink one (or none). This module builds such plans on fixed homes and samples (EPLB's ``"global"`` replica scope):

1. **Slots** (``locality_slots``), per layer, from the loads of the cells that share them: each node has
   ``P x r`` slots. Greedily, the (node, remote expert) copy that most lowers the sum over the cells of the
   largest per-GPU RDMA load (``max(max_j tx_j, max_h rx_h)`` in tokens, every source of the node sending the
   expert's tokens to the copy) is taken, ties by the tokens it keeps in the node (the traffic saved per slot),
   then by (node, expert); copies that save no traffic are never taken; then a taken copy is exchanged for an
   untaken one of its node while that lowers the objective. A node's slots left over hold copies of
   its own hottest experts (a second holder in the node, for compute balance). Inside a node the copies go
   largest first to the GPU with the least expected compute (its homes' tokens plus the copies it was given)
   that has a free slot and neither homes nor holds the expert; then, for the slots of one cell (the
   per-micro-batch version), slots of one node swap their experts while a proxy of the split's cost falls
   (``_swap_slots``: a copy beside the samples that use it, beside homes of little load).
2. **Cells** (``relocate_cells``, per-micro-batch version, when the planner places the samples): per
   micro-batch, whole (micro-batch, GPU) cells swap GPUs across nodes, best swap first, while the largest
   cross-node send or receive left after each node's copies of most tokens falls (summed over the layers); a
   cell's local stage moves with it, so the attention is unchanged.
3. **Split** (``locality_split``), per cell: the exact LP of ``split.solve_split_lp`` over the holders (home
   first, then the copies by GPU): every source's pairs of a replicated expert are shared between the home and
   the copies so that ``max_g comp + max_g comm`` is least (never worse than sending everything home).

Two versions (``locality_replicas``): ``resident=True`` chooses one set of slots per layer from the whole batch's
loads and keeps it in every micro-batch (``ReplicaPlan.resident``: the simulator charges it ``persistent``, the
layer keeps the copies resident; memory: every GPU holds ``L x r`` extra experts' weights and their gradients
for the whole batch, ``L x r x specs.expert_bytes`` each, against ``r`` experts of the per-layer buffer);
``resident=False`` chooses the slots per micro-batch and layer (charged ``per-layer``: every copy is pushed
across nodes in every cell). relibra's portfolio offers both (``portfolio``; option ``resident_replicas``).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from ..cost import DEFAULT_BETA
from ..plan import ReplicaPlan
from ..specs import ClusterSpec, ModelSpec
from ..validate import check_int
from .executor import TaskExecutor, TaskFailed, default_executor
from .split import SplitSolution, add_flow, cell_weights, check_loads_homes, lp_split_for_holders, smooth_units

__all__ = ["locality_slots", "global_holders", "locality_split", "locality_replicas", "locality_layers_task",
           "relocate_cells", "node_copies", "node_left", "slot_swap_moves", "SLOT_SWAP_PASSES",
           "MAX_LOADS_ENTRIES", "RESIDENT_MAX_LOADS_ENTRIES", "RELOCATE_MAX_GPUS"]

MAX_LOADS_ENTRIES = 4_000_000
"""The portfolio offers the per-micro-batch locality candidate only for loads ``[M, L, G, E]`` of at most this many
entries: an exact split LP and a slot greedy per cell, and the cell relocation; on the paper-scale qwen3-235b batch
(32 x 94 x 32 x 128 = 12.3M entries, EP 4 x 8) it took ~150 s on 2 cores against relibra's ~17 s plan."""
RESIDENT_MAX_LOADS_ENTRIES = 16_000_000
"""The portfolio offers the resident locality candidates for loads of at most this many entries: the whole
Qwen3-235B (94 layers, 32 micro-batches, EP 32) is 12.3M; its resident candidate takes ~55-60 s of planning on
2 cores (``workers=2``; the exact split LP per cell is most of it; BENCHMARKS.md). The per-micro-batch one, which
also places the slots per cell and relocates the cells (~150 s there), stays within ``MAX_LOADS_ENTRIES``."""
SLOT_SWAP_PASSES = 8
"""``locality_slots`` ends with at most this many passes of in-node slot swaps (``_swap_slots``); each pass tries
every pair of slots on two GPUs of one node once, and a pass that improves nothing ends the search."""
RELOCATE_MAX_GPUS = 16
"""``relocate_cells`` runs for at most this many GPUs (its swaps grow as ``G^3`` per micro-batch)."""


def _pick_remote(x: np.ndarray, expert_gpu: np.ndarray, node: np.ndarray, capacity: int) -> list[tuple[int, int]]:
    """The greedy of step 1 (module docstring) on loads ``x [C, G, E]``, homes ``expert_gpu [E]``, GPU ``g`` on
    node ``node[g]``: the ``(node, expert)`` copies in the order taken, at most ``capacity`` per node, each keeping
    tokens in its node. A copy of ``e`` in node ``n`` takes ``x[c, j, e]`` (j in n) off source j's RDMA send and
    their sum off the home's RDMA receive."""
    G, nodes = len(node), int(node.max()) + 1
    hn = node[expert_gpu]
    in_node = (node[None, :] == np.arange(nodes)[:, None]).astype(np.float64)  # [nodes, G]
    keep_c = np.einsum("ng,cge->cne", in_node, x)  # [C, nodes, E] tokens a copy keeps in its node
    remote = hn[None, :] != node[:, None]  # [G, E]
    tx = (x * remote[None]).sum(axis=2)  # [C, G]
    home = (expert_gpu[:, None] == np.arange(G)[None, :]).astype(np.float64)  # [E, G]
    rx = np.einsum("cne,eg->cg", keep_c * (hn[None, None, :] != np.arange(nodes)[None, :, None]), home)
    cn, ce = np.nonzero((hn[None, :] != np.arange(nodes)[:, None]) & (keep_c.sum(axis=0) > 0))
    alive = np.ones(len(cn), bool)
    used = np.zeros(nodes, np.int64)
    taken_k: list[int] = []
    d_tx = x[:, :, ce] * in_node[cn].T[None]  # [C, G, K]: what each candidate takes off each source's send
    d_rx = keep_c[:, cn, ce][:, None, :] * home[ce].T[None]  # [C, G, K]: and off its home's receive
    kept = keep_c[:, cn, ce].sum(axis=0)
    while True:
        alive &= used[cn] < capacity
        if not alive.any():
            return _exchange(taken_k, cn, tx, rx, d_tx, d_rx, cn_e=ce)
        now = np.maximum(tx.max(axis=1), rx.max(axis=1)).sum()
        after = np.maximum((tx[:, :, None] - d_tx).max(axis=1), (rx[:, :, None] - d_rx).max(axis=1)).sum(axis=0)
        gain = np.round(now - after, 9)  # ties within float noise go to the tokens kept
        order = np.lexsort((ce, cn, -kept, -gain))
        k = int(order[alive[order]][0])
        tx -= d_tx[:, :, k]
        rx -= d_rx[:, :, k]
        alive[k] = False
        used[cn[k]] += 1
        taken_k.append(k)


def _exchange(taken: list[int], cn: np.ndarray, tx: np.ndarray, rx: np.ndarray, d_tx: np.ndarray, d_rx: np.ndarray,
              cn_e: np.ndarray) -> list[tuple[int, int]]:
    """The greedy's copies (candidate indices ``taken``) improved by exchanges: a taken copy of node n is swapped
    for an untaken candidate of n while that lowers ``sum_c max(max tx, max rx)`` (best exchange first, at most
    ``2 x len(taken)``); ``tx`` / ``rx [C, G]`` are the loads left with ``taken``, ``d_tx`` / ``d_rx [C, G, K]``
    what each candidate takes off them. Returns the ``(node, expert)`` pairs."""
    taken = list(taken)
    for _ in range(2 * len(taken)):
        held = np.asarray(taken, dtype=np.int64)
        rest = np.setdiff1d(np.arange(len(cn)), held)
        # every (taken, untaken) pair of one node, taken-major in the order of ``taken`` (argmin's ties below)
        ia, ib = np.nonzero(cn[held][:, None] == cn[rest][None, :])
        if not len(ia):
            break
        a, b = held[ia], rest[ib]
        val = _exchange_values(tx, rx, d_tx, d_rx, a, b)
        now = float(np.maximum(tx.max(axis=1), rx.max(axis=1)).sum())
        i = int(np.argmin(val))
        if not val[i] < now - 1e-9 * max(now, 1.0):
            break
        tx = tx + d_tx[:, :, a[i]] - d_tx[:, :, b[i]]
        rx = rx + d_rx[:, :, a[i]] - d_rx[:, :, b[i]]
        taken[taken.index(int(a[i]))] = int(b[i])
    return [(int(cn[k]), int(cn_e[k])) for k in taken]


@njit(cache=True)
def _exchange_values(tx: np.ndarray, rx: np.ndarray, d_tx: np.ndarray, d_rx: np.ndarray, a: np.ndarray,
                     b: np.ndarray) -> np.ndarray:
    """float64 ``[Q]``: ``sum_c max(max_g tx', max_g rx')`` after exchanging candidate ``a[q]`` for ``b[q]``
    (``tx' = tx + d_tx[:, :, a] - d_tx[:, :, b]``, the same for rx; ``tx`` / ``rx [C, G]``, ``d_* [C, G, K]``),
    summed over c in order as numpy's reduction over the cells does, without the ``[C, G, Q]`` temporaries."""
    C, G = tx.shape
    out = np.empty(a.shape[0])
    for q in range(a.shape[0]):
        ka, kb = a[q], b[q]
        total = 0.0
        for c in range(C):
            mt = -np.inf
            mr = -np.inf
            for g in range(G):
                vt = tx[c, g] + d_tx[c, g, ka] - d_tx[c, g, kb]
                vr = rx[c, g] + d_rx[c, g, ka] - d_rx[c, g, kb]
                if vt > mt:
                    mt = vt
                if vr > mr:
                    mr = vr
            total += max(mt, mr)
        out[q] = total
    return out


def locality_slots(x: np.ndarray, expert_gpu: np.ndarray, model: ModelSpec, cluster: ClusterSpec,
                   replica_slots: int, max_passes: int = SLOT_SWAP_PASSES) -> np.ndarray:
    """int32 ``[G, r]``: one layer's slots from the loads ``x [C, G, E]`` (tokens) of the C cells that share them,
    homes ``expert_gpu [E]`` (module docstring, step 1: the greedy, then ``max_passes`` passes of in-node slot
    swaps, ``_swap_slots``); -1 where a slot stays empty. PlanError unless ``max_passes`` is an int >= 0."""
    max_passes = check_int("max_passes", max_passes, 0)
    x = np.asarray(x, dtype=np.float64)
    expert_gpu = np.asarray(expert_gpu, dtype=np.int64)
    G, P, r = cluster.num_gpus, cluster.gpus_per_node, int(replica_slots)
    node = np.arange(G) // P
    rep = np.full((G, r), -1, np.int32)
    if r == 0:
        return rep
    served = x.sum(axis=(0, 1))  # [E] tokens of each expert
    load = np.bincount(expert_gpu, weights=served, minlength=G).astype(np.float64)  # expected compute per GPU
    taken = _pick_remote(x, expert_gpu, node, P * r)
    for n in range(cluster.nodes):
        mine = [(float(x[:, node == n, e].sum()), e) for m, e in taken if m == n]
        room = P * r - len(mine)
        homed = np.flatnonzero((node[expert_gpu] == n) & (served > 0))
        hot = homed[np.argsort(-served[homed], kind="stable")][:room]
        mine += [(float(served[e]) / 2.0, int(e)) for e in hot]  # a second holder takes about half
        for w, e in sorted(mine, key=lambda t: (-t[0], t[1])):
            gs = [g for g in range(n * P, (n + 1) * P)
                  if g != expert_gpu[e] and (rep[g] == -1).any() and not (rep[g] == e).any()]
            if not gs:
                continue
            g = min(gs, key=lambda k: (load[k], k))
            rep[g, int(np.argmax(rep[g] == -1))] = e
            load[g] += w
            load[expert_gpu[e]] -= w
    if max_passes > 0:
        w8 = cell_weights(model, cluster)
        _swap_slots(x, expert_gpu, rep, node, cluster.link_classes.astype(np.int64), w8.w_nv, w8.w_rdma,
                    DEFAULT_BETA, max_passes)
    return rep


@njit(cache=True)
def _expert_holders(e, expert_gpu, rep, out):
    """Fill ``out`` with the GPUs holding expert ``e`` (its home, then the slots of ``rep [G, r]`` that hold it, by
    GPU) and return how many."""
    out[0] = expert_gpu[e]
    n = 1
    for g in range(rep.shape[0]):
        for s in range(rep.shape[1]):
            if rep[g, s] == e:
                out[n] = g
                n += 1
    return n


@njit(cache=True)
def _route_expert(agg, xc, e, hold, nh, node, cls, sign):
    """Add ``sign`` x expert ``e``'s tokens of one cell (``xc [G, E]``) to ``agg [5, G]`` (``split.aggregates``'
    comp / link rows) as the slot swaps' proxy routes them: a source that holds ``e`` keeps its tokens; else they
    are shared evenly among the holders in its node; else they go to the home ``hold[0]``."""
    for j in range(xc.shape[0]):
        a = xc[j, e]
        if a == 0.0:
            continue
        own, near = False, 0
        for k in range(nh):
            own = own or hold[k] == j
            near += node[hold[k]] == node[j]
        if own:
            add_flow(agg, cls, j, j, sign * a)
        elif near > 0:
            for k in range(nh):
                if node[hold[k]] == node[j]:
                    add_flow(agg, cls, j, hold[k], sign * a / near)
        else:
            add_flow(agg, cls, j, hold[0], sign * a)


@njit(cache=True)
def _route_experts(agg, x, experts, expert_gpu, rep, hold, node, cls, sign):
    """``_route_expert`` of every expert of ``experts`` (-1: none) in every cell of ``x [C, G, E]`` into ``agg [C, 5,
    G]``, with the holders ``rep`` gives it now (``hold``: scratch of ``G r + 1``)."""
    for e in experts:
        if e >= 0:
            nh = _expert_holders(e, expert_gpu, rep, hold)
            for c in range(x.shape[0]):
                _route_expert(agg[c], x[c], e, hold, nh, node, cls, sign)


@njit(cache=True)
def _slots_objective(agg, w_nv, w_rdma, beta):
    """The proxy summed over the cells: ``split.smooth_units`` (LSE-smoothed ``max comp + max comm``) of each
    ``agg [C, 5, G]``."""
    v = 0.0
    for c in range(agg.shape[0]):
        v += smooth_units(agg[c], w_nv, w_rdma, beta)
    return v


@njit(cache=True)
def _swap_allowed(rep, expert_gpu, a, sa, b, sb):
    """Whether slot ``sa`` of GPU ``a`` and slot ``sb`` of GPU ``b`` may exchange their experts (-1: empty): they
    differ, and neither GPU would then hold its own home's expert or the same expert twice."""
    ea, eb = rep[a, sa], rep[b, sb]
    if ea == eb or (ea >= 0 and expert_gpu[ea] == b) or (eb >= 0 and expert_gpu[eb] == a):
        return False
    for s in range(rep.shape[1]):
        if (ea >= 0 and rep[b, s] == ea) or (eb >= 0 and rep[a, s] == eb):
            return False
    return True


@njit(cache=True)
def _slot_pairs(node, r):
    """int64 ``[K, 4]``: every ``(a, sa, b, sb)``, slot ``sa`` of GPU ``a`` and slot ``sb`` of GPU ``b > a`` on the
    same node (``node [G]``), in the order ``_swap_slots`` tries them."""
    G = node.shape[0]
    out = np.empty((G * G * r * r, 4), np.int64)
    k = 0
    for a in range(G):
        for b in range(a + 1, G):
            if node[a] == node[b]:
                for sa in range(r):
                    for sb in range(r):
                        out[k, 0], out[k, 1], out[k, 2], out[k, 3] = a, sa, b, sb
                        k += 1
    return out[:k]


@njit(cache=True)
def slot_swap_moves(rep, expert_gpu, node):
    """int64 ``[K, 4]``: every ``(a, sa, b, sb)`` exchange ``_swap_slots`` may take on slots ``rep [G, r]`` now
    (``_slot_pairs`` that ``_swap_allowed``; homes ``expert_gpu [E]``), in its order."""
    pairs = _slot_pairs(node, rep.shape[1])
    keep = np.zeros(pairs.shape[0], np.bool_)
    for i in range(pairs.shape[0]):
        keep[i] = _swap_allowed(rep, expert_gpu, pairs[i, 0], pairs[i, 1], pairs[i, 2], pairs[i, 3])
    return pairs[keep]


@njit(cache=True)
def _swap_slots(x, expert_gpu, rep, node, cls, w_nv, w_rdma, beta, max_passes):
    """In-node slot swaps of ``rep [G, r]`` (in place) for loads ``x [C, G, E]`` and homes ``expert_gpu [E]``:
    which GPU of a node holds which of its copies. The greedy places the copies by expected compute only; the
    split LP then shares each expert's tokens among its holders, and where the copies sit decides what that LP
    can balance (a copy on the GPU whose own samples route to it most, beside homes of little load). A proxy of
    the LP's cell cost routes every token by ``_route_expert`` and sums the LSE-smoothed ``max comp + max comm``
    of the cells (``_slots_objective``); two slots on different GPUs of one node (one may be empty: a move)
    exchange their experts, first improvement in (GPU, GPU, slot, slot) order, while a pass improves, at most
    ``max_passes`` passes. Only the two experts' routes change, so a candidate costs ``O(C G)``."""
    C, G, E = x.shape
    r = rep.shape[1]
    agg = np.zeros((C, 5, G))
    hold = np.empty(G * r + 1, np.int64)
    _route_experts(agg, x, np.arange(E), expert_gpu, rep, hold, node, cls, 1.0)
    cur = _slots_objective(agg, w_nv, w_rdma, beta)
    trial = np.empty_like(agg)
    moved = np.empty(2, np.int64)  # the two experts of the exchange tried
    pairs = _slot_pairs(node, r)
    for _ in range(max_passes):
        improved = False
        for i in range(pairs.shape[0]):
            a, sa, b, sb = pairs[i, 0], pairs[i, 1], pairs[i, 2], pairs[i, 3]
            if not _swap_allowed(rep, expert_gpu, a, sa, b, sb):
                continue
            ea, eb = rep[a, sa], rep[b, sb]
            moved[0], moved[1] = ea, eb
            trial[:] = agg
            _route_experts(trial, x, moved, expert_gpu, rep, hold, node, cls, -1.0)
            rep[a, sa], rep[b, sb] = eb, ea
            _route_experts(trial, x, moved, expert_gpu, rep, hold, node, cls, 1.0)
            val = _slots_objective(trial, w_nv, w_rdma, beta)
            if val < cur - 1e-12 * abs(cur):
                cur = val
                agg[:] = trial
                improved = True
            else:
                rep[a, sa], rep[b, sb] = ea, eb
        if not improved:
            break


def global_holders(expert_gpu: np.ndarray, replica_expert: np.ndarray) -> np.ndarray:
    """int64 ``[E, H]``: the GPUs holding each expert, home first, then its copies by GPU, -1 padded (``H`` one
    more than the most copies of an expert, at least 1); copies may sit on any GPU but the home."""
    expert_gpu = np.asarray(expert_gpu, dtype=np.int64)
    replica_expert = np.asarray(replica_expert, dtype=np.int64)
    E = expert_gpu.shape[0]
    copies: list[list[int]] = [[] for _ in range(E)]
    for g, s in zip(*np.nonzero(replica_expert >= 0)):
        copies[int(replica_expert[g, s])].append(int(g))
    out = np.full((E, 1 + max((len(c) for c in copies), default=0)), -1, np.int64)
    out[:, 0] = expert_gpu
    for e, c in enumerate(copies):
        out[e, 1:1 + len(c)] = sorted(c)
    return out


def locality_split(x: np.ndarray, expert_gpu: np.ndarray, replica_expert: np.ndarray, model: ModelSpec,
                   cluster: ClusterSpec) -> SplitSolution:
    """The exact split of one cell (loads ``x [G, E]``, homes ``expert_gpu [E]``, global-scope slots
    ``replica_expert [G, r]``): rows ``(j, e, g)`` and shares of the replicated experts, and the cell's T_MoE."""
    x, expert_gpu = check_loads_homes(x, expert_gpu, cluster)
    return lp_split_for_holders(x, expert_gpu, global_holders(expert_gpu, replica_expert), model, cluster)


def _rdma_proxy(xc: np.ndarray, hn: np.ndarray, home: np.ndarray, node: np.ndarray, capacity: int) -> float:
    """The relocation's objective for one micro-batch's loads ``xc [L, G, E]`` (homes on nodes ``hn [L, E]``, one-hot
    ``home [L, E, G]``): per layer each node copies its ``capacity`` remote experts of most tokens, and the largest
    per-GPU cross-node send or receive left (tokens) is summed over the layers."""
    nodes = int(node.max()) + 1
    xn = np.stack([xc[:, node == n].sum(axis=1) for n in range(nodes)], axis=1)  # [L, nodes, E]
    remote = hn[:, None, :] != np.arange(nodes)[None, :, None]
    left = remote & ~node_copies(xn, remote, capacity)  # [L, nodes, E]: a node's tokens of e cross nodes
    tx = (xc * left[:, node, :]).sum(axis=-1)  # [L, G]
    rx = np.einsum("lne,leg->lg", xn * left, home)
    return float(np.maximum(tx.max(axis=-1), rx.max(axis=-1)).sum())


def node_copies(xn: np.ndarray, remote: np.ndarray, capacity: int) -> np.ndarray:
    """bool ``[..., nodes, E]``: the experts each node copies when it copies the ``capacity`` remote experts its
    tokens route to most (node tokens ``xn [..., nodes, E]``, ``remote`` the experts homed on other nodes, the two
    broadcast together; ties by expert index), only those with tokens."""
    xn, remote = np.broadcast_arrays(np.asarray(xn, dtype=np.float64), np.asarray(remote, dtype=bool))
    order = np.argsort(-np.where(remote, xn, -1.0), axis=-1, kind="stable")[..., :capacity]
    copied = np.zeros(xn.shape, bool)
    np.put_along_axis(copied, order, True, axis=-1)
    return copied & remote & (xn > 0)


def node_left(xn: np.ndarray, remote: np.ndarray, capacity: int) -> np.ndarray:
    """float64 ``[..., nodes]``: each node's tokens of remote experts outside the ``capacity`` remote experts it
    routes most to (node tokens ``xn [..., nodes, E]``, ``remote`` bool, broadcast together): what still crosses
    nodes when the node copies those (``node_copies``), and at least what crosses under any ``capacity`` copies."""
    v = np.where(remote, xn, 0.0)
    return v.sum(-1) - np.sort(v, axis=-1)[..., max(v.shape[-1] - capacity, 0):].sum(-1) if capacity else v.sum(-1)


def relocate_cells(x: np.ndarray, expert_gpu: np.ndarray, cluster: ClusterSpec, replica_slots: int,
                   cell_counts: np.ndarray | None = None, max_swaps: int | None = None) -> np.ndarray:
    """int64 ``[M, G]``: where each micro-batch's (micro-batch, GPU) cells run for per-micro-batch locality copies:
    the cell on GPU g of micro-batch m moves to GPU ``out[m, g]``. Per micro-batch, swaps of two cells on different
    nodes are taken best first while they lower ``_rdma_proxy`` (each node copying its ``P x r`` remote experts of
    most tokens), at most ``max_swaps`` (default G) per micro-batch. A whole cell moves, so every GPU's local stage
    (attention) and the micro-batch's slowest one stay; ``cell_counts [M, G]`` (samples per cell): only cells of
    equal counts swap (``keep_cell_sizes``). Loads ``x [M, L, G, E]`` of the current cells, homes ``[L, E]``."""
    x = np.asarray(x, dtype=np.float64)
    expert_gpu = np.asarray(expert_gpu, dtype=np.int64)
    M, L, G, _ = x.shape
    node = np.arange(G) // cluster.gpus_per_node
    hn, home = node[expert_gpu], (expert_gpu[:, :, None] == np.arange(G)).astype(np.float64)
    cap = cluster.gpus_per_node * int(replica_slots)
    pairs = [(a, b) for a in range(G) for b in range(a + 1, G)]
    counts = np.zeros((M, G)) if cell_counts is None else np.asarray(cell_counts)
    out = np.tile(np.arange(G), (M, 1))
    for m in range(M):
        cur, gmap = _rdma_proxy(x[m], hn, home, node, cap), np.arange(G)
        for _ in range(G if max_swaps is None else max_swaps):
            best = None
            for a, b in pairs:
                if node[gmap[a]] == node[gmap[b]] or counts[m, a] != counts[m, b]:
                    continue
                g2 = gmap.copy()
                g2[a], g2[b] = gmap[b], gmap[a]
                xc = np.empty_like(x[m])
                xc[:, g2] = x[m]
                val = _rdma_proxy(xc, hn, home, node, cap)
                if val < cur - 1e-9 and (best is None or val < best[0]):
                    best = (val, g2)
            if best is None:
                break
            cur, gmap = best
        out[m] = gmap
    return out


def locality_layers_task(x: np.ndarray, expert_gpu: np.ndarray, model: ModelSpec, cluster: ClusterSpec,
                         replica_slots: int, resident: bool) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """One executor task: for each layer i of loads ``x [M, C, G, E]`` (homes ``expert_gpu [C, E]``) its slots
    ``[M, G, r]``, split rows ``(m, j, e, g)`` int32 ``[Z, 4]`` and shares ``[Z]`` (``locality_replicas``)."""
    out = []
    for i in range(x.shape[1]):
        M = x.shape[0]
        rep = np.full((M, x.shape[2], int(replica_slots)), -1, np.int32)
        if resident:
            # no slot swaps for a slot set shared by every micro-batch: the proxy's even split misjudges what the
            # LP balances over many cells (docs/method.md, "Locality replicas")
            rep[:] = locality_slots(x[:, i], expert_gpu[i], model, cluster, replica_slots, max_passes=0)[None]
        rows, share = [], []
        for m in range(M):
            if not resident:
                rep[m] = locality_slots(x[m, i][None], expert_gpu[i], model, cluster, replica_slots)
            sol = locality_split(x[m, i], expert_gpu[i], rep[m], model, cluster)
            rows.append(np.concatenate([np.full((len(sol.rows), 1), m, np.int32), sol.rows], axis=1))
            share.append(sol.share)
        out.append((rep, np.concatenate(rows).reshape(-1, 4), np.concatenate(share)))
    return out


def locality_replicas(x: np.ndarray, expert_gpu: np.ndarray, model: ModelSpec, cluster: ClusterSpec,
                      replica_slots: int, resident: bool, executor: TaskExecutor | None = None) -> ReplicaPlan:
    """The locality-replica plan (scope ``"global"``) of loads ``x [M, L, G, E]`` on homes ``expert_gpu [L, E]``:
    per layer one set of slots for every micro-batch (``resident``) or per (micro-batch, layer) cell, each cell
    split by ``locality_split`` (module docstring). The layers run in chunks on ``executor`` (default inline); a
    chunk that fails leaves its layers without replicas (every token at home)."""
    x = np.asarray(x, dtype=np.float64)
    expert_gpu = np.asarray(expert_gpu)
    M, L, G, _ = x.shape
    executor = executor or default_executor(1)
    step = max(1, math.ceil(L / (2 * executor.workers)))
    chunks = [np.arange(a, min(a + step, L)) for a in range(0, L, step)]
    results = executor.map(locality_layers_task,
                           [(x[:, c], expert_gpu[c], model, cluster, replica_slots, resident) for c in chunks],
                           [("locality-replicas", tuple(int(l) for l in c)) for c in chunks])
    rep = np.full((M, L, G, int(replica_slots)), -1, np.int32)
    idx, share = [np.zeros((0, 5), np.int32)], [np.zeros(0)]
    for c, res in zip(chunks, results):
        if isinstance(res, TaskFailed):
            continue
        for l, (rep_l, rows, sh) in zip(c, res):
            rep[:, l] = rep_l
            idx.append(np.concatenate([rows[:, :1], np.full((len(rows), 1), l, np.int32), rows[:, 1:]], axis=1))
            share.append(sh)
    order = np.lexsort(np.concatenate(idx).T[::-1])  # rows by (m, l, j, e, g): the same bytes for any chunking
    return ReplicaPlan(rep, np.concatenate(idx)[order], np.concatenate(share)[order], scope="global")
