"""Invariants of the per-pair destinations a ReplayBalancedMoE computes from a plan (hypothesis; no
communication: each rank's view is built with a stand-in dispatcher that only reports rank and size).

For random valid node-scoped plans and random routing (with padding): every routed pair gets exactly
one destination, which is its expert's home or a rank holding a replica of it; the local slot on that
rank holds that expert; per (source, expert) the counts per destination equal the largest-remainder
materialization of the plan's shares (checked against a loop written here); unrouted pairs go nowhere.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from relibra_moe.layers.dispatch import LocalDispatcher
from relibra_moe.layers.moe import ReplayBalancedMoE
from relibra_moe.layers.replay import LayerReplay
from relibra_moe.layers.replica_buffer import LayerSharedReplicaBuffer
from relibra_moe.plan import Placement, ReplicaPlan
from relibra_moe.specs import ClusterSpec, ModelSpec


class _View(LocalDispatcher):
    """Rank ``rank`` of a group of ``world`` (never communicates: only destinations are computed)."""

    def __init__(self, rank: int, world: int, gpus_per_node: int) -> None:
        super().__init__(gpus_per_node)
        self.rank, self.world_size = rank, world


def _loop_round(n: int, s: np.ndarray) -> np.ndarray:
    s = s / s.sum()
    q = n * s
    out = np.floor(q).astype(np.int64)
    for _, i in sorted((-(q[i] - out[i]), i) for i in range(len(s)) if s[i] > 0)[:n - out.sum()]:
        out[i] += 1
    return out


@st.composite
def cases(draw):
    nodes, P = draw(st.sampled_from([(1, 2), (2, 2), (1, 4), (2, 4)]))
    G = nodes * P
    E = G * draw(st.integers(1, 3))
    k = draw(st.integers(1, min(3, E)))
    r = draw(st.integers(1, 2))
    seed = draw(st.integers(0, 2**20))
    rng = np.random.default_rng(seed)
    home = rng.permutation(np.arange(E) // (E // G))
    rep = np.full((G, r), -1)
    for g in range(G):
        cand = [e for e in range(E) if home[e] // P == g // P and home[e] != g]
        pick = list(rng.permutation(cand))[:draw(st.integers(0, r))]
        rep[g, :len(pick)] = pick
    idx, share = [], []
    for e in np.unique(rep[rep >= 0]):
        holders = [int(home[e])] + [g for g in range(G) if e in rep[g]]
        for j in range(G):
            if rng.random() < 0.25:
                continue
            s = rng.dirichlet(np.ones(len(holders))) * (rng.random(len(holders)) < 0.8)
            if s.sum() == 0:
                s[0] = 1.0
            s = s / s.sum()
            idx += [(0, 0, j, int(e), h) for h in holders]
            share += list(s)
    plan = ReplicaPlan(rep[None, None], np.array(idx, np.int64).reshape(-1, 5), np.array(share, np.float32))
    plan.validate(Placement(home[None]), ModelSpec("t", 4, 4, E, k, 1), ClusterSpec(nodes=nodes, gpus_per_node=P))
    T = draw(st.integers(0, 40))
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]) if T else np.zeros((0, k), np.int64)
    if T and draw(st.booleans()):
        ids[rng.random(ids.shape) < 0.2] = -1  # padding
    hot = draw(st.booleans())
    if T and hot and rep.max() >= 0:
        ids[:, 0] = rep[rep >= 0][0]  # all tokens on one replicated expert
        ids = np.where((ids == ids[:, :1]) & (np.arange(k) > 0), -1, ids)
    return G, P, E, k, r, home, plan, ids


@given(cases())
def test_destinations_follow_the_plan(case):
    import torch

    G, P, E, k, r, home, plan, ids = case
    buf = LayerSharedReplicaBuffer(4, 4, r)
    rep = plan.replica_expert[0, 0]
    for j in range(G):
        layer = ReplayBalancedMoE(4, 4, E, k, gpus_per_node=P, replica_buffer=buf, layer_index=0,
                                  dispatcher=_View(j, G, P))
        layer.set_placement_row(home)
        state = layer.plan_slice(LayerReplay(replicas=plan, expert_gpu=home))
        dest, slot = layer.destinations(torch.as_tensor(ids, dtype=torch.int64), state)
        dest, slot = dest.numpy(), slot.numpy()
        routed = ids >= 0
        assert ((dest >= 0) == routed).all() and ((slot >= 0) == routed).all()
        for (t, c) in zip(*np.nonzero(routed)):
            e, g, s = ids[t, c], dest[t, c], slot[t, c]
            if s < E // G:
                assert home[e] == g and np.flatnonzero(home == g)[s] == e
            else:
                assert rep[g, s - E // G] == e
        for e in range(E):
            n = int((ids == e).sum())
            s = np.zeros(G)
            s[home[e]] = 1.0
            rows = [z for z in range(len(plan.split_share)) if tuple(plan.split_index[z, 2:4]) == (j, e)]
            if rows:
                s[:] = 0
                for z in rows:
                    s[plan.split_index[z, 4]] += plan.split_share[z]
            got = np.bincount(dest[ids == e], minlength=G)
            assert (got == _loop_round(n, s)).all(), (j, e, got, s)


def test_plan_slice_rejects_what_the_layer_cannot_follow():
    import pytest

    from relibra_moe.errors import PlanError

    home = np.arange(4) // 2
    rep = np.array([[-1], [0]])  # expert 0 (home 0) replicated on rank 1
    plan = ReplicaPlan(rep[None, None], np.zeros((0, 5), np.int64), np.zeros(0))

    def state(buf, placement=home, p=plan):
        layer = ReplayBalancedMoE(4, 4, 4, 2, gpus_per_node=2, replica_buffer=buf, layer_index=0,
                                  dispatcher=_View(1, 2, 2))
        return layer.plan_slice(LayerReplay(replicas=p, expert_gpu=placement))

    with pytest.raises(PlanError, match="no replica_buffer"):
        state(None)
    with pytest.raises(PlanError, match="r=1 replica slots per rank, the layer's buffer 2"):
        state(LayerSharedReplicaBuffer(4, 4, 2))
    with pytest.raises(PlanError, match="apply relayout"):
        state(LayerSharedReplicaBuffer(4, 4, 1), placement=np.array([1, 1, 0, 0]))
    bad = ReplicaPlan(np.array([[0], [-1]])[None, None], np.zeros((0, 5), np.int64), np.zeros(0))
    with pytest.raises(PlanError, match=r"layer moe\[0\], micro-batch 0: .*homed on GPU 0"):
        state(LayerSharedReplicaBuffer(4, 4, 1), p=bad)
    st = state(LayerSharedReplicaBuffer(4, 4, 1))
    assert st.transfer is not None and st.transfer.recv_slots.tolist() == [0] and st.slot_table[0, 1] == 2
