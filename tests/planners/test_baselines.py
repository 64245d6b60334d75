"""Baselines: static, EPLB on hand cases, the even split of replicated experts, the Balanced ideal."""

from __future__ import annotations

import numpy as np
import pytest

from relibra_moe.cost import moe_cost
from relibra_moe.errors import PlanError
from relibra_moe.evaluate import plan_flow
from relibra_moe.plan import Placement
from relibra_moe.planners.baselines import (
    eplb,
    eplb_layer,
    even_split_replicas,
    replicate_counts,
    static_placement,
)
from relibra_moe.specs import ClusterSpec, ModelSpec


def test_static_placement():
    np.testing.assert_array_equal(static_placement(2, 8, 4), [[0, 0, 1, 1, 2, 2, 3, 3]] * 2)


def test_eplb_without_replicas_is_balanced_packing():
    # 8 -> g0, 7 -> g1, 6 -> g1, 5 -> g0, 4 -> g0 (tie 13/13: lowest id), 3 -> g1, 2 -> g1, 1 -> g0: 18 / 18
    home, slots = eplb_layer(np.array([8, 7, 6, 5, 4, 3, 2, 1]), num_gpus=2, gpus_per_node=1)
    np.testing.assert_array_equal(home, [0, 1, 1, 0, 0, 1, 1, 0])
    assert slots.shape == (2, 0)


def test_eplb_replication_hand_case():
    # copies: e0 gets the first extra copy (10/1); it cannot get a third on 2 GPUs, so e1 (1/1, lowest id)
    np.testing.assert_array_equal(replicate_counts(np.array([10, 1, 1, 1]), 2, max_copies=2), [2, 2, 1, 1])
    # items by load per copy: e0 (5) home -> g0; e0 (5) replica -> g1; e2 (1) home -> g0 (tie);
    # e3 (1) home -> g1; e1 (.5) home -> g1 (g0's home slots full); e1 (.5) replica -> g0
    home, slots = eplb_layer(np.array([10, 1, 1, 1]), num_gpus=2, gpus_per_node=1, replica_slots=1)
    np.testing.assert_array_equal(home, [0, 1, 0, 1])
    np.testing.assert_array_equal(slots, [[1], [0]])


def test_eplb_hierarchical_keeps_groups_on_nodes():
    rng = np.random.default_rng(0)
    w = rng.integers(1, 100, size=16)
    home, slots = eplb_layer(w, num_gpus=4, gpus_per_node=2, replica_slots=1, num_groups=4)
    node = home // 2
    for grp in range(4):
        assert len(set(node[grp * 4:(grp + 1) * 4])) == 1  # a group lives on one node
    assert (np.bincount(home, minlength=4) == 4).all()
    for g in range(4):  # replicas stay in the home's node (hierarchical policy)
        for e in slots[g][slots[g] >= 0]:
            assert home[e] // 2 == g // 2 and home[e] != g
    # node loads are balanced: the two nodes' group sums differ by at most the lightest group
    gw = w.reshape(4, 4).sum(1)
    node_load = [w[node == n].sum() for n in range(2)]
    assert abs(node_load[0] - node_load[1]) <= gw.max()


def test_eplb_global_policy_when_groups_do_not_divide_nodes():
    w = np.arange(1, 13)
    a = eplb_layer(w, num_gpus=6, gpus_per_node=2, replica_slots=1, num_groups=4)  # 3 nodes do not divide 4
    b = eplb_layer(w, num_gpus=6, gpus_per_node=2, replica_slots=1, num_groups=None)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


def test_eplb_errors_and_all_layers():
    with pytest.raises(PlanError, match="num_experts=6 is not divisible by num_gpus=4"):
        eplb_layer(np.ones(6), num_gpus=4, gpus_per_node=2)
    with pytest.raises(PlanError, match=r"weights must be \[L, E\], got shape \(8,\)"):
        eplb(np.ones(8), 4, 2)
    homes, slots = eplb(np.ones((3, 8)), 4, 2, replica_slots=2)
    assert homes.shape == (3, 8) and slots.shape == (3, 4, 2)


def test_even_split_replicas_validate_and_cost():
    """Expert 0 (home GPU 0) with a replica on GPU 1: its tokens split 50/50, hand-checked flow."""
    model = ModelSpec("t", hidden=64, ffn=32, num_experts=4, top_k=1, num_layers=1)
    cluster = ClusterSpec(nodes=1, gpus_per_node=2)
    eg = np.array([[0, 0, 1, 1]])
    slots = np.array([[[-1], [0]]], np.int32)
    x = np.zeros((2, 1, 2, 4), np.int64)
    x[0, 0, 0, 0] = 10  # 10 tokens of source 0 for expert 0
    x[1, 0, 1, 2] = 4
    rep = even_split_replicas(eg, slots, x)
    assert rep.scope == "global"
    rep.validate(Placement(eg), model, cluster, 2)
    np.testing.assert_array_equal(rep.split_index, [[0, 0, 0, 0, 0], [0, 0, 0, 0, 1]])
    np.testing.assert_allclose(rep.split_share, [0.5, 0.5])

    class _P:  # the two attributes plan_flow reads
        placement = Placement(eg)
        replicas = rep

    flow = plan_flow(_P, x)
    np.testing.assert_allclose(flow[0, 0], [[5, 5], [0, 0]])
    np.testing.assert_allclose(flow[1, 0], [[0, 0], [0, 4]])
    shares = rep.shares(Placement(eg), 0)
    ref = moe_cost(x[0], None, model, cluster, shares=shares)
    np.testing.assert_allclose(ref.load[0], [5, 5])


def test_low_level_planners_name_bad_arguments():
    """The building blocks refuse bad scalars and loads with the field and the value (no numpy error from inside)."""
    from relibra_moe.planners.locality import anneal_locality
    from relibra_moe.planners.lplb import lplb_copies
    from relibra_moe.planners.reorder import lpt_placement, reorder
    from relibra_moe.specs import ClusterSpec, ModelSpec

    eg = np.repeat(np.arange(4), 2)
    with pytest.raises(PlanError, match="^replica_slots=-1 must be an int >= 0"):
        lplb_copies(eg, np.ones(8), 4, 2, -1)
    with pytest.raises(PlanError, match="replica_slots=-1 must be an int >= 0"):
        eplb(np.ones((2, 8)), 4, 2, -1)
    with pytest.raises(PlanError, match=r"weight\[3\] = -2.0: token counts must be finite and >= 0"):
        eplb_layer(np.array([1, 1, 1, -2, 1, 1, 1, 1.0]), 4, 2)
    with pytest.raises(PlanError, match=r"expert_load\[1\] = nan: token counts must be finite and >= 0"):
        lpt_placement(np.array([1.0, np.nan, 1.0, 1.0]), 2)
    with pytest.raises(PlanError, match="num_gpus=0 must be an int >= 1"):
        static_placement(2, 8, 0)
    model = ModelSpec("t", hidden=64, ffn=32, num_experts=8, top_k=2, num_layers=1)
    cluster = ClusterSpec(nodes=2, gpus_per_node=2)
    x = np.ones((2, 1, 4, 8))
    for kw, msg in (({"iters": -1}, "iters=-1 must be an int >= 0"), ({"num_seeds": 0}, "num_seeds=0 must be"),
                    ({"workers": 0}, "workers=0 must be an int >= 1"), ({"beta": 0.0}, "beta=0.0 must be a finite")):
        with pytest.raises(PlanError, match=msg):
            reorder(x, model, cluster, **kw)
    counts = np.ones((2, 1, 8), np.int64)
    homes = eg[None]
    with pytest.raises(PlanError, match=r"sample_gpu\[1\] = 4 is outside \[0, 4\)"):
        anneal_locality(counts, np.full(2, 4), np.zeros(2), np.array([0, 4]), homes, model, cluster)
    with pytest.raises(PlanError, match=r"expert_gpu\[0, 7\] = 9 is outside \[0, 4\)"):
        anneal_locality(counts, np.full(2, 4), np.zeros(2), np.zeros(2), np.array([[0, 0, 1, 1, 2, 2, 3, 9]]), model,
                        cluster)
