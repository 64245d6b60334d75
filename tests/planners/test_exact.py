"""The cvxpy MILP against brute force over all replica sets, and the greedy heuristic against the MILP."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from relibra_moe.cost import moe_cost
from relibra_moe.errors import PlanError
from relibra_moe.planners.exact import solve_milp, split_lp_reference
from relibra_moe.planners.replicate import replicate_cell
from relibra_moe.planners.split import lower_bound, solve_split_lp
from relibra_moe.specs import ClusterSpec, ModelSpec

MODEL = ModelSpec("tiny", hidden=1024, ffn=512, num_experts=8, top_k=2, num_layers=1)
CLUSTER = ClusterSpec(nodes=2, gpus_per_node=2)


def skewed(rng, G, E, tokens=200):
    pop = rng.dirichlet(np.full(E, 0.3))
    return np.stack([rng.multinomial(tokens, rng.dirichlet(pop * 10 + 0.05)) for _ in range(G)]).astype(float)


def brute_force(x, eg, model, cluster):
    """min over every replica set with one slot per GPU of the exact split LP."""
    G, P = cluster.num_gpus, cluster.gpus_per_node
    options = [[-1] + [e for e in range(len(eg)) if eg[e] // P == g // P and eg[e] != g] for g in range(G)]
    best = np.inf
    for combo in itertools.product(*options):
        rep = np.array(combo).reshape(G, 1)
        best = min(best, solve_split_lp(x, eg, rep, model, cluster).t_moe)
    return best


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_milp_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    x = skewed(rng, 4, 8)
    eg = rng.permutation(np.repeat(np.arange(4), 2))
    sol = solve_milp(x, eg, MODEL, CLUSTER, replica_slots=1)
    assert sol.optimal
    assert sol.t_moe == pytest.approx(brute_force(x, eg, MODEL, CLUSTER), rel=1e-6)
    # its replicas with the exact split reproduce its value
    assert solve_split_lp(x, eg, sol.replica_expert, MODEL, CLUSTER).t_moe == pytest.approx(sol.t_moe, rel=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_greedy_close_to_milp(seed):
    rng = np.random.default_rng(100 + seed)
    model = MODEL.with_(num_experts=16)
    cluster = ClusterSpec(nodes=2, gpus_per_node=4)
    x = skewed(rng, 8, 16, tokens=300)
    eg = rng.permutation(np.repeat(np.arange(8), 2))
    r = 1 + seed % 2
    opt = solve_milp(x, eg, model, cluster, replica_slots=r)
    got = replicate_cell(x, eg, model, cluster, r)
    base = float(moe_cost(x, eg, model, cluster).t_moe)
    assert opt.t_moe <= got.t_moe * (1 + 1e-6)  # nothing beats the optimum
    assert lower_bound(x, eg, model, cluster) <= opt.t_moe * (1 + 1e-6)
    assert got.t_moe <= base * (1 + 1e-12)
    assert got.t_moe <= opt.t_moe * 1.10


def test_split_reference_hand_case():
    cluster = ClusterSpec(nodes=1, gpus_per_node=2)
    model = MODEL.with_(num_experts=2)
    x = np.array([[100.0, 0.0], [100.0, 0.0]])
    t, shares = split_lp_reference(x, np.array([0, 1]), np.array([[-1], [0]]), model, cluster)
    spt = model.flops_per_token_expert / cluster.flops
    assert t == pytest.approx(100 * spt)
    assert shares[1, 0, 1] == pytest.approx(1.0)


def test_milp_rejects_bad_input():
    with pytest.raises(PlanError, match="replica_slots=-1 must be an int >= 0"):
        solve_milp(np.ones((4, 8)), np.repeat(np.arange(4), 2), MODEL, CLUSTER, replica_slots=-1)
    with pytest.raises(PlanError, match=r"x \(3, 8\) / expert_gpu \(8,\) do not match G=4"):
        solve_milp(np.ones((3, 8)), np.repeat(np.arange(4), 2), MODEL, CLUSTER, replica_slots=1)


@pytest.mark.parametrize("seed", range(3))
def test_literal_paper_loop_is_valid_and_bounded(seed):
    from relibra_moe.planners.replicate import replicate_cell_lp
    from relibra_moe.planners.split import split_cost

    rng = np.random.default_rng(200 + seed)
    model = MODEL.with_(num_experts=16)
    cluster = ClusterSpec(nodes=2, gpus_per_node=4)
    x = skewed(rng, 8, 16, tokens=300)
    eg = rng.permutation(np.repeat(np.arange(8), 2))
    lit = replicate_cell_lp(x, eg, model, cluster, 2)
    opt = solve_milp(x, eg, model, cluster, replica_slots=2)
    base = float(moe_cost(x, eg, model, cluster).t_moe)
    assert opt.t_moe * (1 - 1e-6) <= lit.t_moe <= base * (1 + 1e-12)
    assert split_cost(x, eg, lit.rows, lit.share, model, cluster) == pytest.approx(lit.t_moe, rel=1e-9)
    # each move is an LP re-solve: the split is LP-optimal for the final replicas
    assert solve_split_lp(x, eg, lit.replica_expert, model, cluster).t_moe == pytest.approx(lit.t_moe, rel=1e-9)
    for g in range(8):
        for e in lit.replica_expert[g][lit.replica_expert[g] >= 0]:
            assert eg[e] != g and eg[e] // 4 == g // 4
