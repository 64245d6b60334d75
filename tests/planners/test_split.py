"""The split LP with replicas fixed: against an independent cvxpy LP, hand cases, invariants, errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from relibra_moe.cost import moe_cost
from relibra_moe.errors import PlanError
from relibra_moe.planners.exact import split_lp_reference
from relibra_moe.planners.split import cell_weights, fast_split, holders, lower_bound, solve_split_lp, split_cost
from relibra_moe.specs import ClusterSpec, ModelSpec

MODEL = ModelSpec("tiny", hidden=1024, ffn=512, num_experts=16, top_k=2, num_layers=1)


def random_cell(rng, nodes, P, E, r, skew=0.4, tokens=400):
    G = nodes * P
    cluster = ClusterSpec(nodes=nodes, gpus_per_node=P)
    pop = rng.dirichlet(np.full(E, skew))
    x = np.stack([rng.multinomial(tokens, rng.dirichlet(pop * 10 + 0.05)) for _ in range(G)]).astype(float)
    eg = rng.permutation(np.repeat(np.arange(G), E // G))
    rep = np.full((G, r), -1)
    for g in range(G):
        cand = [e for e in range(E) if eg[e] // P == g // P and eg[e] != g]
        k = rng.integers(0, r + 1)
        rep[g, :k] = rng.choice(cand, k, replace=False)
    return x, eg, rep, cluster


def dense_shares(x, eg, rows, share, G):
    E = x.shape[1]
    sh = np.zeros((G, E, G))
    sh[:, np.arange(E), eg] = 1.0
    for j, e in {(int(j), int(e)) for j, e, _ in rows}:
        sh[j, e, :] = 0.0
    np.add.at(sh, (rows[:, 0], rows[:, 1], rows[:, 2]), share)
    return sh


@pytest.mark.parametrize("nodes,P,E,r,seed", [(2, 4, 32, 2, 0), (2, 4, 32, 1, 1), (1, 4, 16, 2, 2),
                                              (2, 2, 16, 2, 3), (4, 2, 16, 1, 4), (2, 4, 16, 2, 5)])
def test_lp_matches_cvxpy_reference(nodes, P, E, r, seed):
    rng = np.random.default_rng(seed)
    model = MODEL.with_(num_experts=E)
    for _ in range(3):
        x, eg, rep, cluster = random_cell(rng, nodes, P, E, r)
        sol = solve_split_lp(x, eg, rep, model, cluster)
        ref, _ = split_lp_reference(x, eg, rep, model, cluster)
        assert sol.t_moe == pytest.approx(ref, rel=1e-6)
        # the reported T equals the cost model's on the dense shares
        sh = dense_shares(x, eg, sol.rows, sol.share, cluster.num_gpus)
        assert float(moe_cost(x, None, model, cluster, shares=sh).t_moe) == pytest.approx(sol.t_moe, rel=1e-9)


def test_hand_case_replica_serves_local_tokens():
    # one node of 2 GPUs; expert 0 homed on GPU 0, 100 tokens from each GPU; replica of 0 on GPU 1
    cluster = ClusterSpec(nodes=1, gpus_per_node=2)
    model = MODEL.with_(num_experts=2)
    x = np.array([[100.0, 0.0], [100.0, 0.0]])
    eg = np.array([0, 1])
    spt = cell_weights(model, cluster).sec_per_token
    w = cell_weights(model, cluster)
    none = solve_split_lp(x, eg, np.full((2, 1), -1), model, cluster)
    assert none.t_moe == pytest.approx((200 + w.w_nv * 100) * spt)
    sol = solve_split_lp(x, eg, np.array([[-1], [0]]), model, cluster)
    assert sol.t_moe == pytest.approx(100 * spt)
    got = {(int(j), int(e), int(g)): s for (j, e, g), s in zip(sol.rows, sol.share) if s > 1e-9}
    assert got == pytest.approx({(0, 0, 0): 1.0, (1, 0, 1): 1.0})


def test_cross_node_tokens_take_the_same_rail_replica():
    # 2 nodes x 2 GPUs; expert 0 homed on GPU 0 (node 0); all tokens from GPU 3 (node 1, rail 1)
    cluster = ClusterSpec(nodes=2, gpus_per_node=2)
    model = MODEL.with_(num_experts=4)
    x = np.zeros((4, 4))
    x[3, 0] = 80.0
    eg = np.array([0, 1, 2, 3])
    w = cell_weights(model, cluster)
    sol = solve_split_lp(x, eg, np.array([[-1], [0], [-1], [-1]]), model, cluster)
    # best: split compute 40/40; cr to GPU 0 costs NVLink at both ends, sr to GPU 1 only RDMA.
    # rdma tx of GPU 3 is 80 whatever the split: comm = w_rdma * 80, comp = 40
    assert sol.t_moe == pytest.approx((40 + w.w_rdma * 80) * w.sec_per_token, rel=1e-9)


@given(seed=st.integers(0, 10_000), r=st.integers(1, 2))
def test_fast_split_between_lp_and_no_replicas(seed, r):
    rng = np.random.default_rng(seed)
    x, eg, rep, cluster = random_cell(rng, 2, 2, 8, r, tokens=100)
    model = MODEL.with_(num_experts=8)
    base = float(moe_cost(x, eg, model, cluster).t_moe)
    lp = solve_split_lp(x, eg, rep, model, cluster)
    fast = fast_split(x, eg, rep, model, cluster)
    assert lp.t_moe <= fast.t_moe * (1 + 1e-9)
    assert lower_bound(x, eg, model, cluster) <= lp.t_moe * (1 + 1e-9)
    assert fast.t_moe <= base * (1 + 1e-12)
    assert lp.t_moe <= base * (1 + 1e-9)
    for sol in (lp, fast):
        assert split_cost(x, eg, sol.rows, sol.share, model, cluster) == pytest.approx(sol.t_moe, rel=1e-9)
        if len(sol.rows):
            key = sol.rows[:, 0] * 8 + sol.rows[:, 1]
            sums = np.bincount(np.unique(key, return_inverse=True)[1], weights=sol.share)
            assert np.allclose(sums, 1.0)
            hold = holders(eg, rep, cluster.gpus_per_node)
            for _j, e, g in sol.rows:
                assert g in hold[e]


def test_no_replicas_equals_cost_model():
    rng = np.random.default_rng(7)
    x, eg, _, cluster = random_cell(rng, 2, 4, 32, 1)
    model = MODEL.with_(num_experts=32)
    sol = solve_split_lp(x, eg, np.full((8, 2), -1), model, cluster)
    assert len(sol.rows) == 0
    assert sol.t_moe == pytest.approx(float(moe_cost(x, eg, model, cluster).t_moe), rel=1e-12)


def test_errors_name_the_field():
    cluster = ClusterSpec(nodes=2, gpus_per_node=2)
    model = MODEL.with_(num_experts=4)
    x = np.ones((4, 4))
    eg = np.arange(4)
    with pytest.raises(PlanError, match=r"replica_expert\[0, 0\] = expert 2: GPU 0 is not in the node of its "
                                        r"home GPU 2"):
        solve_split_lp(x, eg, np.array([[2], [-1], [-1], [-1]]), model, cluster)
    with pytest.raises(PlanError, match=r"replica_expert\[0, 0\] = expert 0, which is homed on GPU 0 already"):
        solve_split_lp(x, eg, np.array([[0], [-1], [-1], [-1]]), model, cluster)
    with pytest.raises(PlanError, match=r"x has shape \(3, 4\), expected \[G=4, E\]"):
        solve_split_lp(np.ones((3, 4)), eg, np.full((4, 1), -1), model, cluster)
    with pytest.raises(PlanError, match=r"x\[0, 0\] = -.*: token counts must be finite and >= 0"):
        solve_split_lp(-x, eg, np.full((4, 1), -1), model, cluster)
    with pytest.raises(PlanError, match=r"replica_expert has shape \(3, 1\), expected \[G=4, r\]"):
        fast_split(x, eg, np.full((3, 1), -1), model, cluster)
    with pytest.raises(PlanError, match=r"expert_gpu\[3\] = 9 is outside \[0, 4\)"):
        fast_split(x, np.array([0, 1, 2, 9]), np.full((4, 1), -1), model, cluster)
