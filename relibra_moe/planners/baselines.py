"""Baselines: static (Megatron-LM) and EPLB (DeepSeek's expert-parallelism load balancer, given the batch's
true loads: the paper's EPLB+). The Balanced ideal, a reference rather than a plan, is in ``relibra_moe.evaluate``.

EPLB follows its published description (github.com/deepseek-ai/EPLB, README): with expert groups that
the nodes divide, the *hierarchical* policy packs groups onto nodes with balanced packing, replicates the
heaviest experts of each node (repeatedly the expert with the highest load per copy gets one more copy),
then packs the physical experts of a node onto its GPUs with balanced packing (heaviest first onto the
lightest GPU that still has room); otherwise the *global* policy does the same with one group and one
node. Balanced packing gives every GPU the same number of physical experts.

Our plans home exactly E/G experts on every GPU and hold redundant copies in ``r`` replica slots per
GPU, so the packing step here fills two kinds of slots: the first copy of an expert takes a home slot
(E/G per GPU) and its other copies replica slots (r per GPU), a GPU never holding two copies of one
expert. With ``r = 0`` EPLB only reorders (it is then LPT with an exact-count constraint). The tokens of
a replicated expert are split evenly over its copies (home included) for every source GPU, in every
micro-batch (EPLB's replicas are fixed for the batch), as EPLB-based serving systems do.
"""

from __future__ import annotations

import numpy as np

from ..errors import PlanError
from ..plan import Placement, ReplicaPlan
from ..validate import check_int, check_token_counts


def static_placement(num_layers: int, num_experts: int, num_gpus: int) -> np.ndarray:
    """Megatron-LM: int64 ``[L, E]`` with expert e on GPU ``e // (E / G)``."""
    check_int("num_gpus", num_gpus, 1)
    return Placement.static(num_layers, num_experts, num_gpus).expert_gpu.astype(np.int64)


def replicate_counts(weight: np.ndarray, extra: int, max_copies: int) -> np.ndarray:
    """EPLB's redundant experts: int64 ``[E]`` copies per expert after adding ``extra`` copies, each to
    the expert with the highest load per copy (ties: lowest id), never above ``max_copies`` copies."""
    w = np.asarray(weight, dtype=np.float64)
    cnt = np.ones(w.shape[0], np.int64)
    for _ in range(int(extra)):
        per = np.where(cnt < max_copies, w / cnt, -np.inf)
        e = int(np.argmax(per))
        if not np.isfinite(per[e]):
            break
        cnt[e] += 1
    return cnt


def pack_physical(weight: np.ndarray, copies: np.ndarray, gpus: np.ndarray, home_slots: int,
                  replica_slots: int) -> tuple[dict[int, int], dict[int, list[int]]]:
    """Balanced packing of the physical experts of ``weight [E']`` onto ``gpus`` (global GPU ids).

    Items (expert, copy) of weight ``weight / copies``, heaviest first (ties: expert id, copy index),
    each onto the lightest GPU (ties: lowest id) that has a free slot of its kind (copy 0: home slot,
    else replica slot) and does not hold the expert yet.

    Returns:
        (home GPU of each local expert index, replica GPUs of each local expert index). A copy that
        finds no GPU is dropped (its tokens stay with the other copies).
    """
    w = np.asarray(weight, dtype=np.float64)
    items = [(-w[e] / copies[e], e, c) for e in range(len(w)) for c in range(int(copies[e]))]
    items.sort()
    load = {int(g): 0.0 for g in gpus}
    used_home = {int(g): 0 for g in gpus}
    used_rep = {int(g): 0 for g in gpus}
    holds: dict[int, set[int]] = {int(g): set() for g in gpus}
    home: dict[int, int] = {}
    reps: dict[int, list[int]] = {e: [] for e in range(len(w))}
    for negw, e, c in items:
        is_home = c == 0
        best = None
        for g in sorted(load):
            if e in holds[g]:
                continue
            if is_home and used_home[g] >= home_slots:
                continue
            if not is_home and used_rep[g] >= replica_slots:
                continue
            if best is None or load[g] < load[best]:
                best = g
        if best is None:
            if is_home:
                raise PlanError(f"EPLB packing found no home slot for expert {e}")
            continue
        load[best] += -negw
        holds[best].add(e)
        if is_home:
            used_home[best] += 1
            home[e] = best
        else:
            used_rep[best] += 1
            reps[e].append(best)
    return home, reps


def eplb_layer(weight: np.ndarray, num_gpus: int, gpus_per_node: int, replica_slots: int = 0,
               num_groups: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """EPLB for one layer.

    Args:
        weight: ``[E]`` tokens of each expert (the batch's true loads for EPLB+).
        num_gpus, gpus_per_node: the EP group (G = nodes x P).
        replica_slots: r redundant experts per GPU (r G in all).
        num_groups: expert groups (contiguous ids); the hierarchical policy runs when the number of nodes
            divides it, the global policy otherwise (and when None).

    Returns:
        (int64 ``[E]`` home GPU of each expert, int32 ``[G, r]`` expert held in each replica slot, -1 empty).
    """
    w = np.asarray(weight, dtype=np.float64)
    check_token_counts("weight", w)
    check_int("replica_slots", replica_slots, 0)
    E = w.shape[0]
    G, P = check_int("num_gpus", num_gpus, 1), check_int("gpus_per_node", gpus_per_node, 1)
    if G % P:
        raise PlanError(f"num_gpus={G} is not a multiple of gpus_per_node={P}")
    if E % G:
        raise PlanError(f"num_experts={E} is not divisible by num_gpus={G}")
    nodes = G // P
    per_gpu = E // G
    home = np.empty(E, np.int64)
    slots = np.full((G, replica_slots), -1, np.int32)
    fill = np.zeros(G, np.int64)
    if num_groups is not None and num_groups > 0 and E % num_groups == 0 and num_groups % nodes == 0:
        gsize = E // num_groups
        gw = w.reshape(num_groups, gsize).sum(axis=1)
        per_node = num_groups // nodes
        order = np.lexsort((np.arange(num_groups), -gw))
        nload = np.zeros(nodes)
        ncount = np.zeros(nodes, np.int64)
        node_groups: list[list[int]] = [[] for _ in range(nodes)]
        for grp in order:
            free = np.flatnonzero(ncount < per_node)
            n = int(free[np.argmin(nload[free])])
            node_groups[n].append(int(grp))
            nload[n] += gw[grp]
            ncount[n] += 1
        parts = [(np.concatenate([np.arange(gr * gsize, (gr + 1) * gsize) for gr in sorted(node_groups[n])]),
                  np.arange(n * P, (n + 1) * P)) for n in range(nodes)]
    else:
        parts = [(np.arange(E), np.arange(G))]
    for experts, gpus in parts:
        ww = w[experts]
        copies = replicate_counts(ww, replica_slots * len(gpus), len(gpus))
        h, reps = pack_physical(ww, copies, gpus, per_gpu, replica_slots)
        for i, e in enumerate(experts):
            home[e] = h[i]
            for g in reps[i]:
                slots[g, fill[g]] = e
                fill[g] += 1
    return home, slots


def eplb(weights: np.ndarray, num_gpus: int, gpus_per_node: int, replica_slots: int = 0,
         num_groups: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """EPLB for every layer: ``weights [L, E]`` -> (int64 homes ``[L, E]``, int32 replica slots ``[L, G, r]``)."""
    weights = np.asarray(weights)
    if weights.ndim != 2:
        raise PlanError(f"weights must be [L, E], got shape {weights.shape}")
    out = [eplb_layer(w, num_gpus, gpus_per_node, replica_slots, num_groups) for w in weights]
    return np.stack([o[0] for o in out]), np.stack([o[1] for o in out])


def even_split_replicas(expert_gpu: np.ndarray, replica_expert: np.ndarray, x: np.ndarray) -> ReplicaPlan:
    """ReplicaPlan (scope "global") with the same replica slots in every micro-batch and the tokens of a
    replicated expert split evenly over its copies (home included).

    Args:
        expert_gpu: ``[L, E]`` homes; replica_expert: ``[L, G, r]`` expert in each replica slot (-1 empty), the
            same in every micro-batch.
        x: ``[M, L, G, E]`` loads; split rows are written only where ``x > 0`` (other sources send nothing).
    """
    x = np.asarray(x)
    M, L, G, E = x.shape
    r = replica_expert.shape[2]
    rep = np.broadcast_to(replica_expert[None], (M, L, G, r)).copy()
    rows: list[np.ndarray] = []
    shares: list[np.ndarray] = []
    for l in range(L):
        for e in np.unique(replica_expert[l][replica_expert[l] >= 0]):
            holders = np.concatenate([[expert_gpu[l, e]], np.flatnonzero((replica_expert[l] == e).any(axis=1))])
            ms, js = np.nonzero(x[:, l, :, e] > 0)
            if len(ms) == 0:
                continue
            k = len(holders)
            idx = np.empty((len(ms) * k, 5), np.int32)
            idx[:, 0] = np.repeat(ms, k)
            idx[:, 1] = l
            idx[:, 2] = np.repeat(js, k)
            idx[:, 3] = e
            idx[:, 4] = np.tile(holders, len(ms))
            rows.append(idx)
            shares.append(np.full(len(idx), 1.0 / k, np.float32))
    if rows:
        index = np.concatenate(rows)
        share = np.concatenate(shares)
        order = np.lexsort(index.T[::-1])
        index, share = index[order], share[order]
    else:
        index, share = np.zeros((0, 5), np.int32), np.zeros(0, np.float32)
    return ReplicaPlan(rep, index, share, scope="global")
