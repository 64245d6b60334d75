"""The annealers' parameter objects: derived once from PlanOptions (budgets by hand), validated, and what the planning
loop hands to ``reorder`` / ``anneal_locality`` (the proposals it records)."""

from __future__ import annotations

import numpy as np
import pytest

from relibra_moe.cost import DEFAULT_BETA
from relibra_moe.errors import PlanError
from relibra_moe.plan import round_robin_gpus
from relibra_moe.planners.locality import anneal_locality
from relibra_moe.planners.options import DEFAULT_TOL, PlanOptions
from relibra_moe.planners.params import (
    LocalityParams,
    ReorderParams,
    baseline_locality_params,
    default_iters,
    default_locality_iters,
    locality_params,
    reorder_params,
)
from relibra_moe.planners.reorder import reorder
from relibra_moe.planners.strategies import plan_batch
from relibra_moe.specs import ClusterSpec, ModelSpec
from relibra_moe.synthetic import rl_batch

MODEL = ModelSpec("t", hidden=256, ffn=128, num_experts=16, top_k=2, num_layers=3)
CLUSTER = ClusterSpec(nodes=2, gpus_per_node=2)  # G = 4


def test_default_budgets_by_hand():
    # 40 per expert pair on different GPUs: E=16, G=4 -> 16 * 12 / 2 = 96 pairs -> 3840; floor 1000; cap 5e7 / (L M G)
    assert default_iters(16, 4, 2, 3) == 3840
    assert default_iters(8, 4) == 1000
    assert default_iters(128, 8, 4, 48) == int(5e7 / (48 * 4 * 8))
    # 60 per sample (120 with repack), floor 200, cap 4.5e7 / (L G)
    assert default_locality_iters(16, 3, 4, False) == 960
    assert default_locality_iters(16, 3, 4, True) == 1920
    assert default_locality_iters(2, 3, 4, False) == 200
    assert default_locality_iters(10**6, 10, 10, False) == 450000


def test_round_params_split_the_budget_over_the_rounds():
    p = reorder_params(PlanOptions(), 16, 4, 2, 3)
    assert p.iters == 3840 // 2 and p.objective == "batch" and p.beta == DEFAULT_BETA
    assert (p.node_comp, p.skew_cap, p.smoothed) == (False, None, False)
    assert reorder_params(PlanOptions(rounds=20), 16, 4, 2, 3).iters == 300  # the per-round floor
    assert reorder_params(PlanOptions(iters=77, rounds=3), 16, 4, 2, 3).iters == 77  # given: not split
    # aggregate: one micro-batch's budget (a proposal costs O(G)): E=128, G=8, L=48 -> cap 5e7 / (48 * 8)
    agg = reorder_params(PlanOptions(objective="aggregate", rounds=1), 128, 8, 4, 48)
    assert agg.iters == int(5e7 / (48 * 8)) and agg.smoothed
    rb = reorder_params(PlanOptions(skew_cap=0.1), 16, 4, 2, 3)
    assert (rb.node_comp, rb.skew_cap) == (True, 0.1)
    assert reorder_params(PlanOptions(step_objective=False), 16, 4, 2, 3).comp_weight == 1.0
    assert reorder_params(PlanOptions(), 16, 4, 2, 3).comp_weight == PlanOptions().comp_weight

    q = locality_params(PlanOptions(), 16, 3, 4)
    assert (q.iters, q.tol, q.repack, q.smooth) == (480, DEFAULT_TOL, False, False)
    assert locality_params(PlanOptions(repack=True), 16, 3, 4).iters == 960
    assert locality_params(PlanOptions(rounds=3), 2, 3, 4).iters == 100  # 200 // 3 = 66, floor 100
    assert locality_params(PlanOptions(locality_iters=5), 16, 3, 4).iters == 5
    b = baseline_locality_params(PlanOptions(repack=True, token_cap=500, tol=0.2))
    assert (b.repack, b.token_cap, b.tol, b.iters, b.comp_weight) == (True, 500, 0.2, None, 1.0)
    assert b.iters_for(16, 3, 4) == 1920  # the whole budget, not split


@pytest.mark.parametrize("make, match", [
    (lambda: ReorderParams(objective="fast"), "objective='fast' is not one of"),
    (lambda: ReorderParams(iters=-1), "iters=-1 must be an int >= 0"),
    (lambda: ReorderParams(beta=0.0), "beta=0.0 must be a finite number > 0"),
    (lambda: LocalityParams(tol=-1), "tol=-1 must be a finite number >= 0"),
    (lambda: LocalityParams(iters=True), "iters=True must be an int >= 0"),
    (lambda: LocalityParams(token_cap=100, keep_cell_sizes=True), "token_cap=100 moves samples"),
    (lambda: LocalityParams(token_cap=0), "token_cap=0 must be an int >= 1"),
    (lambda: LocalityParams(repack="yes"), "repack must be a bool, got 'yes'"),
    (lambda: ReorderParams(smooth=1), "smooth must be a bool, got 1"),
    (lambda: ReorderParams(skew_cap=-0.1), "skew_cap=-0.1 must be a finite number >= 0"),
    (lambda: ReorderParams(t0_frac=0.0), "t0_frac=0.0 must be a finite number > 0"),
    (lambda: LocalityParams(comp_weight=float("inf")), "comp_weight=inf must be a finite number > 0"),
])
def test_bad_params_name_the_field(make, match):
    with pytest.raises(PlanError, match=match):
        make()


def test_params_object_and_keywords_anneal_alike():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 40, size=(2, 3, 4, 16))
    a = reorder(x, MODEL, CLUSTER, ReorderParams(iters=300, objective="aggregate"), seed=3, num_seeds=1)
    b = reorder(x, MODEL, CLUSTER, seed=3, num_seeds=1, iters=300, objective="aggregate")
    np.testing.assert_array_equal(a[0], b[0])
    assert a[1] == b[1] and a[1]["iters"] == 300 and a[1]["objective_name"] == "aggregate"
    with pytest.raises(PlanError, match=r"give params= \(ReorderParams\) or its fields as keywords, not both"):
        reorder(x, MODEL, CLUSTER, ReorderParams(), iters=300)
    counts = rng.integers(0, 5, size=(8, 3, 16))
    lengths = counts.sum(axis=(1, 2)) // 2 + 1
    mb = np.repeat(np.arange(2), 4)
    eg = np.repeat(np.arange(4), 4)[None].repeat(3, axis=0)
    c = anneal_locality(counts, lengths, mb, round_robin_gpus(mb, 4), eg, MODEL, CLUSTER,
                        LocalityParams(iters=400, repack=True), seed=2)
    d = anneal_locality(counts, lengths, mb, round_robin_gpus(mb, 4), eg, MODEL, CLUSTER, iters=400, repack=True,
                        seed=2)
    np.testing.assert_array_equal(c[0], d[0])
    np.testing.assert_array_equal(c[1], d[1])
    with pytest.raises(PlanError, match=r"LocalityParams"):
        anneal_locality(counts, lengths, mb, round_robin_gpus(mb, 4), eg, MODEL, CLUSTER, LocalityParams(), tol=0.1)


def test_the_planning_loop_runs_the_derived_budgets():
    """relibra-inter with default iters: every round's reorder runs (E=16, G=4, M=2, L=3) 3840 // 2 proposals, the
    final reorder 8x that (``FINAL_ITERS_FACTOR``)."""
    batch = rl_batch(MODEL, "mixed", 4, responses_per_prompt=4, seed=3, micro_batch_size=8, max_len=96)
    plan = plan_batch(batch, MODEL, CLUSTER, "relibra-inter", num_seeds=1, final_reorder=True)
    assert [r["reorder"]["iters"] for r in plan.stats.rounds] == [1920, 1920]
    assert plan.stats.final_reorder["iters"] == 8 * 1920


def test_overlap_sets_the_objectives_compute_weight():
    """Under the cluster's overlap the reorder and locality objectives weigh compute by the overlap rule's secant
    slopes at the batch's operating point (the static plan's mean A_fwd, max_g comp and max_g comm per cell, read
    here off the simulator); without overlap by exactly STEP_COMP_WEIGHT (plans unchanged)."""
    from relibra_moe.planners.executor import InlineExecutor
    from relibra_moe.planners.strategies import make_context
    from relibra_moe.sim import simulate_step
    from relibra_moe.timing import STEP_COMP_WEIGHT, step_comp_weight

    batch = rl_batch(MODEL, "mixed", 4, responses_per_prompt=4, seed=3, micro_batch_size=8, max_len=96)
    opts = PlanOptions()
    for overlap in ("none", "megatron", "dualpipe"):
        cluster = CLUSTER.with_(overlap=overlap)
        ctx = make_context(batch, MODEL, cluster, "relibra", opts, InlineExecutor())
        static = simulate_step(plan_batch(batch, MODEL, cluster, "static"), batch, MODEL, cluster)
        M, L = static.t_moe.shape
        want = step_comp_weight(overlap, float(static.attention_fwd.mean()), static.moe_fwd_comp_s / (M * L),
                                static.moe_fwd_comm_s / (M * L))
        assert ctx.comp_weight == pytest.approx(want, rel=1e-12)
        assert ctx.reorder_params.comp_weight == ctx.locality_params.comp_weight == ctx.comp_weight
        if overlap == "none":
            assert ctx.comp_weight == STEP_COMP_WEIGHT and ctx.stats.overlap is None
        else:
            assert ctx.comp_weight != STEP_COMP_WEIGHT and ctx.stats.overlap == overlap
    ctx = make_context(batch, MODEL, CLUSTER.with_(overlap="megatron"), "relibra", PlanOptions(step_objective=False),
                       InlineExecutor())  # step_objective=False: T_MoE whatever the overlap
    assert ctx.comp_weight == 1.0
    plan = plan_batch(batch, MODEL, CLUSTER.with_(overlap="megatron"), "relibra", replica_slots=1, iters=100,
                      locality_iters=50, num_seeds=1, rounds=1)
    assert plan.stats.overlap == "megatron"
