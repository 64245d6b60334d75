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


def test_destinations_of_a_split_expert_hand_computed():
    """Rank 0 of 2 (homes [0, 0, 1, 1]); expert 0 has a replica in rank 1's slot 0 and rank 0 splits its pairs
    of expert 0 half and half. Three pairs of expert 0: largest remainder gives (2, 1) (the tie goes to the
    lower rank), in pair order: tokens 0, 1 stay home (local slot 0), token 2 goes to rank 1's replica slot
    (E_loc + 0 = 2); expert 1 stays at rank 0 slot 1, expert 2 goes to rank 1 slot 0; padding goes nowhere."""
    import torch

    split = np.array([[0, 0, 0, 0, 0], [0, 0, 0, 0, 1]])
    plan = ReplicaPlan(np.array([[-1], [0]])[None, None], split, np.array([0.5, 0.5]))
    layer = ReplayBalancedMoE(4, 4, 4, 1, gpus_per_node=2, replica_buffer=LayerSharedReplicaBuffer(4, 4, 1),
                              layer_index=0, dispatcher=_View(0, 2, 2))
    lp = layer.plan_slice(LayerReplay(replicas=plan))
    np.testing.assert_array_equal(lp.slot_table, [[0, 2], [1, -1], [-1, 0], [-1, 1]])
    np.testing.assert_array_equal(lp.shares, [[0.5, 0.5], [1, 0], [0, 1], [0, 1]])
    dest, slot = layer.destinations(torch.tensor([[0], [0], [0], [1], [2], [-1]]), lp)
    assert dest.view(-1).tolist() == [0, 0, 1, 0, 1, -1]
    assert slot.view(-1).tolist() == [0, 0, 2, 1, 0, -1]
    # rank 1 splits nothing of its own: every pair at its expert's home
    other = ReplayBalancedMoE(4, 4, 4, 1, gpus_per_node=2, replica_buffer=LayerSharedReplicaBuffer(4, 4, 1),
                              layer_index=0, dispatcher=_View(1, 2, 2))
    lp1 = other.plan_slice(LayerReplay(replicas=plan))
    assert lp1.shares is None
    assert other.destinations(torch.tensor([[0], [3]]), lp1)[0].view(-1).tolist() == [0, 1]


def test_route_and_place_keeps_the_error_for_agree():
    """A bad replay is not raised by the local stages (the EP group must hear of it first): agree raises it."""
    import pytest
    import torch

    from relibra_moe.errors import ReplayError

    layer = ReplayBalancedMoE(4, 4, 4, 2, layer_index=0)
    x = torch.randn(3, 4)
    pairs = layer.route_and_place(x, LayerReplay(ids=torch.tensor([[0, 1]] * 2)))
    assert isinstance(pairs.error, ReplayError) and pairs.route is None and pairs.dest is None
    with pytest.raises(ReplayError, match="cover 2 tokens, the batch has 3"):
        layer.agree(pairs, x.device)
    assert pairs.error is None
    good = layer.route_and_place(x, LayerReplay(ids=torch.tensor([[0, 1], [3, -1], [2, 3]])))
    assert good.error is None and good.dest.tolist() == [[0, 0], [0, -1], [0, 0]]
    assert layer.agree(good, x.device) == ([5], [5])


def test_validate_layer_reads_only_its_slice():
    """ReplicaPlan.validate_layer checks one (micro-batch, layer) against that layer's homes: a bad slice
    elsewhere in the plan does not matter, the same rules as ReplicaPlan.validate apply to the slice."""
    import pytest

    from relibra_moe.errors import PlanError

    rep = np.full((2, 2, 2, 1), -1)
    rep[0, 0, 1, 0] = 0  # fine: expert 0 (home 0) on GPU 1
    rep[1, 1, 0, 0] = 0  # bad: expert 0 on its home GPU 0
    split = np.array([[0, 0, 0, 0, 0], [0, 0, 0, 0, 1], [1, 1, 1, 3, 1]])
    plan = ReplicaPlan(rep, split, np.array([0.25, 0.75, 1.0]))
    home = np.array([0, 0, 1, 1])
    plan.validate_layer(0, 0, home, 2)
    plan.validate_layer(0, 1, home, 2)
    with pytest.raises(PlanError, match="homed on GPU 0 already"):
        plan.validate_layer(1, 1, home, 2)
    with pytest.raises(PlanError, match="on node 1, the home GPU 0 on node 0"):
        plan.validate_layer(0, 0, home, 1)  # one GPU per node: the replica left its home's node
    with pytest.raises(PlanError, match=r"outside replica_expert's \[M=2, L=2\]"):
        plan.validate_layer(2, 0, home, 2)
    uneven = ReplicaPlan(rep[:1, :1], split[:2], np.array([0.25, 0.5]))
    with pytest.raises(PlanError, match="sums to 0.75"):
        uneven.validate_layer(0, 0, home, 2)
    # the whole-plan check agrees on the good slice
    ReplicaPlan(rep[:1, :1], split[:2], np.array([0.25, 0.75])).validate(
        Placement(home[None]), ModelSpec("t", 4, 4, 4, 1, 1), ClusterSpec(nodes=1, gpus_per_node=2))
