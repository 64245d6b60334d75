"""Co-located homes and cells: homes and sample cells chosen together for cross-node locality replicas
(docs/method.md, "Co-located homes").

With locality replicas (``locality_replicas``) each node copies the ``P x r`` remote experts its tokens route to
most; what still crosses nodes is a node's tokens for the other remote experts. relibra's homes are annealed for the
all-to-all without such copies, and its cells (a micro-batch's samples on one GPU) are placed for attention and for
locality with its own homes, so neither is chosen for what the copies leave. Here both are, from the loads
``x [M, L, G, E]`` of a plan's cells (tokens whose attention runs on GPU g of micro-batch m, routed to expert e):

1. **Nodes.** Alternately, until a round lowers nothing (at most ``rounds``): per layer, two experts homed on
   different nodes swap nodes while that lowers ``sum_m max_n left[m, n]`` (first improvement, whole sweeps),
   ``left`` being node n's tokens of micro-batch m for the experts homed on other nodes less the ``P x r`` of most
   tokens (the copies it would hold); then per micro-batch, Kernighan-Lin passes of whole-cell swaps across nodes
   on the same sum over the layers (a pass swaps the best pair not yet moved in it, even at a cost, and keeps its
   best prefix; passes repeat while one gains; with ``cell_counts``, only cells of equal counts swap).
2. **GPUs.** Per layer, each node's experts go ``E / G`` to a GPU, largest first snaking over its GPUs; then two
   experts on different GPUs of a node swap while that lowers ``sum_m (w_rdma max_g max(tx_g, rx_g) + max_g
   comp_g)`` in tokens (``split.cell_weights``): each node copying as in step 1, ``tx_g`` the cell's tokens for the
   remote experts its node does not copy, ``rx_g`` the other nodes' such tokens for the experts g homes, ``comp_g``
   the tokens g's homes serve (all of their own node's and the other nodes' not copied there) plus an even share
   of its node's copies.
3. **Cells on GPUs.** ``locality_replicas.relocate_cells`` (its per-GPU send / receive objective) on the new homes,
   for at most ``RELOCATE_MAX_GPUS`` GPUs.

A whole cell moves with its samples, so every GPU's local stage (attention) and each micro-batch's slowest one stay
what they were. Everything is deterministic (no random draws; ties keep the earlier swap). The portfolio offers
locality replicas on the result (``colocated-per-micro-batch``, ``colocated-resident``) beside the other locality
candidates and judges them like every candidate: where moves are charged, the re-layout to the new homes is.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..errors import PlanError
from ..plan import Placement
from ..specs import ClusterSpec, ModelSpec
from ..validate import check_int, check_token_counts
from .locality_replicas import RELOCATE_MAX_GPUS, node_copies, node_left, relocate_cells
from .split import cell_weights

__all__ = ["colocate", "colocation_work", "COLOCATE_MAX_WORK"]

COLOCATE_MAX_WORK = 2.0e9
"""The portfolio co-locates only where ``colocation_work`` (an estimate of one round's inner-loop steps) is at most
this. Measured on 2 cores: GPT-OSS-20B at EP 2 x 4 (32 micro-batches, 24 layers) is 0.02e9 (0.3 s once compiled),
qwen3-30b at EP 16 (16 micro-batches, 48 layers) 0.63e9 (6-7 s), a 4-layer Qwen3-235B at EP 4 x 8 (32
micro-batches) 0.57e9; the whole 94-layer Qwen3-235B there, 13.5e9, is above it (its loads also exceed
``MAX_LOADS_ENTRIES``)."""


def colocation_work(num_micro_batches: int, num_layers: int, num_gpus: int, num_experts: int,
                    replica_slots_per_node: int) -> float:
    """An estimate (inner-loop steps) of one round of step 1: per layer ``E^2 / 2`` expert swaps, each re-scoring two
    nodes' top ``P x r`` in every micro-batch; per micro-batch up to ``G`` best-swap passes over ``G^2 / 2`` cell
    pairs, each re-scoring two nodes in every layer."""
    M, L, G, E, K = num_micro_batches, num_layers, num_gpus, num_experts, replica_slots_per_node
    return float(L * E * E / 2 * M * 2 * (K + 2) + M * G * G * G / 2 * L * 2 * E)


@njit(cache=True)
def _top_sum(v: np.ndarray, k: int) -> float:
    """Sum of the ``k`` largest positive entries of ``v`` (float64 ``[n]``)."""
    best = np.zeros(max(k, 1))
    if k == 0:
        return 0.0
    for i in range(v.shape[0]):
        a = v[i]
        if a <= best[k - 1]:
            continue
        j = k - 1
        while j > 0 and best[j - 1] < a:
            best[j] = best[j - 1]
            j -= 1
        best[j] = a
    s = 0.0
    for j in range(k):
        s += best[j]
    return s


@njit(cache=True)
def _node_left(xn: np.ndarray, hn: np.ndarray, n: int, k: int, buf: np.ndarray) -> float:
    """Node ``n``'s tokens (``xn [E]``) for experts homed on other nodes (``hn [E]``), less the ``k`` largest."""
    total = 0.0
    for e in range(xn.shape[0]):
        if hn[e] != n:
            buf[e] = xn[e]
            total += xn[e]
        else:
            buf[e] = 0.0
    return total - _top_sum(buf, k)


@njit(cache=True)
def _sorted_remote(xn: np.ndarray, hn: np.ndarray, n: int) -> np.ndarray:
    """Node ``n``'s tokens for its remote experts, largest first (float64 ``[E]``, zero padded)."""
    out = np.zeros(xn.shape[0])
    c = 0
    for e in range(xn.shape[0]):
        if hn[e] != n:
            out[c] = xn[e]
            c += 1
    return -np.sort(-out)


@njit(cache=True)
def _top_after(s: np.ndarray, k: int, out_v: float, in_v: float) -> float:
    """The sum of the ``k`` largest of the sorted (descending) ``s`` with one ``out_v`` taken out and ``in_v`` put
    in."""
    total, taken, skipped, placed, i = 0.0, 0, False, False, 0
    while taken < k:
        if i < s.shape[0] and not skipped and s[i] == out_v:
            skipped = True
            i += 1
            continue
        nxt = s[i] if i < s.shape[0] else 0.0
        if not placed and in_v >= nxt:
            total += in_v
            placed = True
        else:
            if i >= s.shape[0]:
                break
            total += nxt
            i += 1
        taken += 1
    return total


@njit(cache=True)
def _sum_row_max(a: np.ndarray) -> float:
    """``sum_i max_j a[i, j]`` of a float64 ``[I, J]``."""
    total = 0.0
    for i in range(a.shape[0]):
        total += a[i].max()
    return total


@njit(cache=True)
def _homes_node_sweeps(xn: np.ndarray, hn: np.ndarray, k: int, max_sweeps: int) -> float:
    """Step 1's expert swaps for one layer: ``xn [M, nodes, E]`` node tokens, ``hn [E]`` home nodes (updated in
    place). Returns ``sum_m max_n left``."""
    M, nodes, E = xn.shape
    srt = np.zeros((M, nodes, E))
    rem = np.zeros((M, nodes))
    left = np.zeros((M, nodes))
    for m in range(M):
        for n in range(nodes):
            srt[m, n] = _sorted_remote(xn[m, n], hn, n)
            for e in range(E):
                if hn[e] != n:
                    rem[m, n] += xn[m, n, e]
            left[m, n] = rem[m, n] - _top_sum(srt[m, n], k)
    cur = _sum_row_max(left)
    new_a = np.zeros(M)
    new_b = np.zeros(M)
    for _ in range(max_sweeps):
        improved = False
        for e1 in range(E):
            for e2 in range(e1 + 1, E):
                a, b = hn[e1], hn[e2]
                if a == b:
                    continue
                # after the swap e1 is homed on b (remote for a), e2 on a (remote for b)
                tot = 0.0
                for m in range(M):
                    new_a[m] = rem[m, a] + xn[m, a, e1] - xn[m, a, e2] - _top_after(
                        srt[m, a], k, xn[m, a, e2], xn[m, a, e1])
                    new_b[m] = rem[m, b] + xn[m, b, e2] - xn[m, b, e1] - _top_after(
                        srt[m, b], k, xn[m, b, e1], xn[m, b, e2])
                    mx = max(new_a[m], new_b[m])
                    for n in range(nodes):
                        if n != a and n != b and left[m, n] > mx:
                            mx = left[m, n]
                    tot += mx
                if tot < cur - 1e-9 * max(cur, 1.0):
                    hn[e1], hn[e2] = b, a
                    for m in range(M):
                        rem[m, a] += xn[m, a, e1] - xn[m, a, e2]
                        rem[m, b] += xn[m, b, e2] - xn[m, b, e1]
                        srt[m, a] = _sorted_remote(xn[m, a], hn, a)
                        srt[m, b] = _sorted_remote(xn[m, b], hn, b)
                        left[m, a], left[m, b] = new_a[m], new_b[m]
                    cur = tot
                    improved = True
        if not improved:
            break
    return cur


@njit(cache=True)
def _swap_cells(x: np.ndarray, xn: np.ndarray, left: np.ndarray, where: np.ndarray, hn: np.ndarray, c1: int, c2: int,
                P: int, k: int, buf: np.ndarray) -> None:
    """Swap the GPUs of cells ``c1`` and ``c2`` (``_cells_node_swaps``' state, updated in place: node loads ``xn
    [L, nodes, E]``, ``left [L, nodes]``, ``where [G]``)."""
    a, b = where[c1] // P, where[c2] // P
    for layer in range(x.shape[0]):
        for e in range(x.shape[2]):
            d = x[layer, c2, e] - x[layer, c1, e]
            xn[layer, a, e] += d
            xn[layer, b, e] -= d
        left[layer, a] = _node_left(xn[layer, a], hn[layer], a, k, buf)
        left[layer, b] = _node_left(xn[layer, b], hn[layer], b, k, buf)
    where[c1], where[c2] = where[c2], where[c1]


@njit(cache=True)
def _cells_node_swaps(x: np.ndarray, where: np.ndarray, hn: np.ndarray, counts: np.ndarray, P: int, k: int,
                      max_passes: int) -> float:
    """Step 1's cell swaps for one micro-batch, Kernighan-Lin passes: ``x [L, G, E]`` the loads of its cells (by
    original GPU), ``where [G]`` the GPU each cell runs on (updated in place), ``hn [L, E]`` home nodes, ``counts
    [G]`` samples per cell (only equal ones swap; all zero: any). A pass swaps the best pair of cells on different
    nodes not yet moved in it, even when that costs, until none is left, and keeps the best prefix of its swaps;
    passes repeat while one lowers ``sum_l max_n left``. Returns it."""
    L, G, E = x.shape
    nodes = G // P
    xn = np.zeros((L, nodes, E))
    for c in range(G):
        xn[:, where[c] // P] += x[:, c]
    buf = np.zeros(E)
    left = np.zeros((L, nodes))
    for layer in range(L):
        for n in range(nodes):
            left[layer, n] = _node_left(xn[layer, n], hn[layer], n, k, buf)
    cur = _sum_row_max(left)
    va = np.zeros(E)
    vb = np.zeros(E)
    for _ in range(max_passes):
        locked = np.zeros(G, np.bool_)
        best_val, best_len = cur, 0
        sw1 = np.empty(G, np.int64)
        sw2 = np.empty(G, np.int64)
        steps = 0
        while True:
            top, bc1, bc2 = np.inf, -1, -1
            for c1 in range(G):
                for c2 in range(c1 + 1, G):
                    a, b = where[c1] // P, where[c2] // P
                    if a == b or locked[c1] or locked[c2] or counts[c1] != counts[c2]:
                        continue
                    tot = 0.0
                    for layer in range(L):
                        for e in range(E):
                            d = x[layer, c2, e] - x[layer, c1, e]
                            va[e] = xn[layer, a, e] + d
                            vb[e] = xn[layer, b, e] - d
                        mx = max(_node_left(va, hn[layer], a, k, buf), _node_left(vb, hn[layer], b, k, buf))
                        for n in range(nodes):
                            if n != a and n != b and left[layer, n] > mx:
                                mx = left[layer, n]
                        tot += mx
                    if tot < top:
                        top, bc1, bc2 = tot, c1, c2
            if bc1 < 0:
                break
            _swap_cells(x, xn, left, where, hn, bc1, bc2, P, k, buf)
            locked[bc1] = locked[bc2] = True
            sw1[steps], sw2[steps] = bc1, bc2
            steps += 1
            if top < best_val - 1e-9 * max(best_val, 1.0):
                best_val, best_len = top, steps
        for i in range(steps - 1, best_len - 1, -1):  # undo the swaps after the best prefix
            _swap_cells(x, xn, left, where, hn, sw1[i], sw2[i], P, k, buf)
        if best_len == 0:
            break
        cur = best_val
    return cur


@njit(cache=True)
def _cell_score(tx: np.ndarray, rx: np.ndarray, comp: np.ndarray, w_rdma: float) -> float:
    """One cell's step-2 objective (tokens) from its per-GPU ``tx``, ``rx``, ``comp [G]``."""
    c, t = 0.0, 0.0
    for g in range(tx.shape[0]):
        c = max(c, tx[g], rx[g])
        t = max(t, comp[g])
    return w_rdma * c + t


@njit(cache=True)
def _gpu_homes_sweeps(rx_e: np.ndarray, comp_e: np.ndarray, tx: np.ndarray, base: np.ndarray, gpu: np.ndarray,
                      P: int, w_rdma: float, max_sweeps: int) -> float:
    """Step 2's swaps for one layer: per micro-batch and expert the cross-node tokens its home receives
    (``rx_e [M, E]``) and the tokens its home computes (``comp_e [M, E]``); per GPU its cross-node send ``tx [M, G]``
    and its compute besides its homes ``base [M, G]``; ``gpu [E]`` the home GPUs (updated in place; two experts
    swap only between GPUs of one node, ``P`` consecutive GPUs a node). Returns the objective."""
    M, E = rx_e.shape
    G = tx.shape[1]
    rx = np.zeros((M, G))
    comp = base.copy()
    for m in range(M):
        for e in range(E):
            rx[m, gpu[e]] += rx_e[m, e]
            comp[m, gpu[e]] += comp_e[m, e]
    cur = 0.0
    for m in range(M):
        cur += _cell_score(tx[m], rx[m], comp[m], w_rdma)
    for _ in range(max_sweeps):
        improved = False
        for e1 in range(E):
            for e2 in range(e1 + 1, E):
                g1, g2 = gpu[e1], gpu[e2]
                if g1 == g2 or g1 // P != g2 // P:
                    continue
                tot = 0.0
                for m in range(M):
                    dr = rx_e[m, e2] - rx_e[m, e1]
                    dc = comp_e[m, e2] - comp_e[m, e1]
                    c, t = 0.0, 0.0
                    for g in range(G):
                        r_g, c_g = rx[m, g], comp[m, g]
                        if g == g1:
                            r_g, c_g = r_g + dr, c_g + dc
                        elif g == g2:
                            r_g, c_g = r_g - dr, c_g - dc
                        c = max(c, tx[m, g], r_g)
                        t = max(t, c_g)
                    tot += w_rdma * c + t
                if tot < cur - 1e-9 * max(cur, 1.0):
                    for m in range(M):
                        dr = rx_e[m, e2] - rx_e[m, e1]
                        dc = comp_e[m, e2] - comp_e[m, e1]
                        rx[m, g1] += dr
                        rx[m, g2] -= dr
                        comp[m, g1] += dc
                        comp[m, g2] -= dc
                    gpu[e1], gpu[e2] = g2, g1
                    cur = tot
                    improved = True
        if not improved:
            break
    return cur


def colocate(x: np.ndarray, expert_gpu: np.ndarray, model: ModelSpec, cluster: ClusterSpec, replica_slots: int, *,
             cell_counts: np.ndarray | None = None, move_cells: bool = True, move_homes: bool = True, rounds: int = 8,
             max_sweeps: int = 50) -> tuple[np.ndarray, np.ndarray]:
    """Co-located homes and cells (module docstring) from the loads ``x [M, L, G, E]`` of a plan's cells and its
    homes ``expert_gpu [L, E]`` (the start), for ``replica_slots`` locality slots per GPU.

    Args:
        cell_counts: int ``[M, G]`` samples per cell: only cells of equal counts swap (``keep_cell_sizes``); None:
            any two.
        move_cells: False keeps every cell on its GPU (the trainer owns the samples): only the homes change.
        move_homes: False keeps ``expert_gpu`` (no expert moves): only the cells move.
        rounds: at most this many rounds of step 1; max_sweeps: sweeps of one layer's expert swaps per round.

    Returns:
        ``(homes, where)``: int64 ``[L, E]`` the new homes (``E / G`` per GPU), int64 ``[M, G]`` the GPU each
        cell (micro-batch m, GPU g of ``x``) runs on: a permutation of its micro-batch's GPUs (identity with
        ``move_cells=False``).

    Raises:
        PlanError: ``x`` not ``[M, L, G, E]`` of the model and cluster or not finite counts >= 0, homes not ``[L,
            E]`` with ``E / G`` on every GPU, ``cell_counts`` not ``[M, G]``, ``replica_slots`` < 0, ``rounds`` < 1
            or ``max_sweeps`` < 0 (each named with its value)."""
    x = np.ascontiguousarray(x, dtype=np.float64)
    expert_gpu = np.asarray(expert_gpu, dtype=np.int64)
    L, E, G = model.num_layers, model.num_experts, cluster.num_gpus
    if x.ndim != 4 or x.shape[1:] != (L, G, E):
        raise PlanError(f"x has shape {x.shape}, expected [M, L={L}, G={G}, E={E}]")
    check_token_counts("x", x)
    Placement(expert_gpu).validate(model, cluster)
    check_int("replica_slots", replica_slots, 0)
    check_int("rounds", rounds, 1)
    check_int("max_sweeps", max_sweeps, 0)
    M = x.shape[0]
    if cell_counts is not None and np.shape(cell_counts) != (M, G):
        raise PlanError(f"cell_counts has shape {np.shape(cell_counts)}, expected [M={M}, G={G}]")
    P, nodes = cluster.gpus_per_node, cluster.nodes
    K = P * int(replica_slots)
    where = np.tile(np.arange(G, dtype=np.int64), (M, 1))
    hn = np.ascontiguousarray(expert_gpu // P)
    counts = np.zeros((M, G), np.int64) if cell_counts is None else np.asarray(cell_counts, np.int64)
    best = np.inf
    xn = _node_loads(x, where, P, nodes)  # [M, L, nodes, E]
    for _ in range(int(rounds)):
        for layer in range(L if move_homes else 0):
            _homes_node_sweeps(np.ascontiguousarray(xn[:, layer]), hn[layer], K, max_sweeps)
        if move_cells and nodes > 1:
            for m in range(M):
                _cells_node_swaps(x[m], where[m], hn, counts[m], P, K, G)
            xn = _node_loads(x, where, P, nodes)
        obj = _node_objective(xn, hn, K)
        if obj >= best - 1e-9 * max(best, 1.0):
            break
        best = obj
    xg = np.empty_like(x)  # the cells at their new GPUs
    xg[np.arange(M)[:, None], :, where] = x.transpose(0, 2, 1, 3)
    homes = _gpu_homes(xg, hn, model, cluster, K, max_sweeps) if move_homes else expert_gpu
    if move_cells and nodes > 1 and G <= RELOCATE_MAX_GPUS:
        moved = np.empty_like(counts)
        moved[np.arange(M)[:, None], where] = counts
        out = relocate_cells(xg, homes, cluster, replica_slots, moved if cell_counts is not None else None)
        where = np.take_along_axis(out, where, axis=1)
    return homes, where


def _node_loads(x: np.ndarray, where: np.ndarray, P: int, nodes: int) -> np.ndarray:
    """float64 ``[M, L, nodes, E]``: each node's tokens, the cells of ``x [M, L, G, E]`` on the GPUs ``where``."""
    M, L, G, E = x.shape
    out = np.zeros((M, L, nodes, E))
    for n in range(nodes):
        on = (where // P == n).astype(np.float64)  # [M, G]
        out[:, :, n] = np.einsum("mlge,mg->mle", x, on)
    return out


def _node_objective(xn: np.ndarray, hn: np.ndarray, K: int) -> float:
    """Step 1's objective ``sum_{m, l} max_n left`` of node loads ``xn [M, L, nodes, E]``, home nodes ``hn [L, E]``."""
    remote = hn[None, :, None, :] != np.arange(xn.shape[2])[None, None, :, None]
    return float(node_left(xn, remote, K).max(axis=-1).sum())


def _gpu_homes(x: np.ndarray, hn: np.ndarray, model: ModelSpec, cluster: ClusterSpec, K: int, max_sweeps: int
               ) -> np.ndarray:
    """Step 2: int64 ``[L, E]`` home GPUs for the home nodes ``hn [L, E]`` (``E / G`` a GPU), the cells ``x [M, L,
    G, E]`` at their GPUs; each node copying its ``K`` remote experts of most tokens."""
    M, L, G, E = x.shape
    P, nodes = cluster.gpus_per_node, cluster.nodes
    w_rdma = cell_weights(model, cluster).w_rdma
    node = np.arange(G) // P
    xn = x.reshape(M, L, nodes, P, E).sum(axis=3)  # [M, L, nodes, E]
    remote = hn[None, :, None, :] != np.arange(nodes)[None, None, :, None]  # [1, L, nodes, E]
    copied = node_copies(xn, remote, K)  # [M, L, nodes, E]
    cross = np.where(remote & ~copied, xn, 0.0)  # [M, L, nodes, E]: node n's tokens of e that cross to e's home
    homes = np.empty((L, E), np.int64)
    for layer in range(L):
        rx_e = cross[:, layer].sum(axis=1)  # [M, E]
        own = np.take_along_axis(xn[:, layer], hn[layer][None, None, :], axis=1)[:, 0]  # [M, E]
        comp_e = own + rx_e
        leaves = remote[0, layer][None] & ~copied[:, layer]  # [M, nodes, E]
        tx = (x[:, layer] * leaves[:, node, :]).sum(-1)  # [M, G]: a cell's tokens that cross nodes
        base = np.repeat((xn[:, layer] * copied[:, layer]).sum(-1) / P, P, axis=1)  # [M, G]
        gpu = np.empty(E, np.int64)
        total = comp_e.sum(axis=0)
        for n in range(nodes):
            mine = np.flatnonzero(hn[layer] == n)
            mine = mine[np.argsort(-total[mine], kind="stable")]
            lap = np.arange(len(mine)) % (2 * P)
            gpu[mine] = n * P + np.where(lap < P, lap, 2 * P - 1 - lap)
        _gpu_homes_sweeps(rx_e, comp_e, np.ascontiguousarray(tx), np.ascontiguousarray(base), gpu, P, w_rdma,
                          max_sweeps)
        homes[layer] = gpu
    return homes
