"""Trainer-owned sample placement (``sample_owner="trainer"``): every strategy keeps the trainer's assignment of
samples to micro-batches and ranks, chooses only homes, replicas and splits, and never changes the math."""

from __future__ import annotations

import numpy as np
import pytest

from relibra_moe.cost import cost_from_flow
from relibra_moe.errors import PlanError
from relibra_moe.evaluate import plan_flow, plan_loads, score_plan
from relibra_moe.plan import Placement, round_robin_gpus
from relibra_moe.planners.migration import symmetry_perm
from relibra_moe.planners.options import PlanOptions
from relibra_moe.planners.service import Planner
from relibra_moe.planners.strategies import STRATEGIES, plan_batch
from relibra_moe.sim import simulate_step
from relibra_moe.specs import ClusterSpec, ModelSpec
from relibra_moe.synthetic import rl_batch

MODEL = ModelSpec("t", hidden=256, ffn=128, num_experts=16, top_k=2, num_layers=3)
CLUSTER = ClusterSpec(nodes=2, gpus_per_node=2)  # G = 4, 4 experts per GPU
FAST = dict(iters=200, locality_iters=100, num_seeds=1, rounds=1)


def _batch():
    """16 samples in 2 micro-batches of 8 (skewed synthetic routing)."""
    return rl_batch(MODEL, "mixed", 4, responses_per_prompt=4, seed=3, micro_batch_size=8, max_len=96)


def _trainer_ranks(n: int) -> np.ndarray:
    """A deliberately uneven assignment (not round-robin): ranks 0 and 3 hold most samples."""
    return np.random.default_rng(7).choice([0, 0, 1, 2, 3, 3, 3], size=n).astype(np.int64)


def _opts(strategy: str) -> dict:
    kw = dict(FAST) if strategy in ("relibra", "relibra-inter") else {}
    if strategy == "eplb-history":
        kw["history"] = np.random.default_rng(0).integers(0, 50, size=(2, MODEL.num_layers, MODEL.num_experts))
    return kw


def _hand_loads(batch, micro_batch, sample_gpu, M, G) -> np.ndarray:
    """float64 [M, L, G, E] by a loop over samples and tokens of the per-token routing ids (independent of
    ``placement_loads`` / ``sample_expert_counts``)."""
    x = np.zeros((M, MODEL.num_layers, G, MODEL.num_experts))
    for n, tr in enumerate(batch.traces):
        ids = np.asarray(tr.experts)  # [T, L, k]
        for t in range(ids.shape[0]):
            for l in range(ids.shape[1]):
                for e in ids[t, l]:
                    if e >= 0:
                        x[micro_batch[n], l, sample_gpu[n], e] += 1.0
    return x


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_every_strategy_keeps_the_trainers_samples(strategy):
    batch = _batch()
    sg = _trainer_ranks(batch.num_sequences)
    plan = plan_batch(batch, MODEL, CLUSTER, strategy, replica_slots=1, sample_owner="trainer", sample_gpu=sg,
                      **_opts(strategy))
    mb = batch.resolve_micro_batch()
    np.testing.assert_array_equal(plan.samples.gpu, sg)
    np.testing.assert_array_equal(plan.samples.micro_batch, mb)
    plan.validate(MODEL, CLUSTER, num_samples=batch.num_sequences)
    assert plan.stats.sample_owner == "trainer"
    assert plan.stats.options["sample_owner"] == "trainer"
    assert plan.stats.options["sample_gpu"].endswith("shape [16]")
    # the loads every figure is computed from are the trainer's assignment's, counted by hand
    M, G = plan.num_micro_batches, CLUSTER.num_gpus
    x_hand = _hand_loads(batch, mb, sg, M, G)
    x = plan_loads(plan, batch, G)
    np.testing.assert_array_equal(x, x_hand)
    # every (token, expert) pair is served exactly once: the flow out of each source is its routed tokens
    flow = plan_flow(plan, x)
    np.testing.assert_allclose(flow.sum(axis=-1), x_hand.sum(axis=-1), rtol=1e-6)  # float32 shares
    assert (flow >= -1e-9).all()
    # score and simulator read the same plan and loads
    s = score_plan(plan, batch, MODEL, CLUSTER)
    if strategy != "balanced":  # balanced is scored on uniform routing (its own loads)
        want = cost_from_flow(plan_flow(plan, x_hand), MODEL, CLUSTER).t_moe.sum()
        assert s.t_moe_s == pytest.approx(float(want), rel=1e-12)
    step = simulate_step(plan, batch, MODEL, CLUSTER)
    assert step.step_s > 0


@pytest.mark.parametrize("strategy", ["static", "lpt", "eplb", "lplb", "balanced", "online"])
def test_strategies_that_never_move_samples_plan_the_same_for_round_robin(strategy):
    """The trainer's default ranks are the round-robin the baselines start from: same homes, samples, replicas.
    (eplb-history is left out: in planner mode its relabelling moves the samples with the experts.)"""
    batch = _batch()
    a = plan_batch(batch, MODEL, CLUSTER, strategy, replica_slots=1, **_opts(strategy))
    b = plan_batch(batch, MODEL, CLUSTER, strategy, replica_slots=1, sample_owner="trainer", **_opts(strategy))
    np.testing.assert_array_equal(b.samples.gpu, round_robin_gpus(batch.resolve_micro_batch(), CLUSTER.num_gpus))
    np.testing.assert_array_equal(a.placement.expert_gpu, b.placement.expert_gpu)
    np.testing.assert_array_equal(a.samples.gpu, b.samples.gpu)
    np.testing.assert_array_equal(a.replicas.replica_expert, b.replicas.replica_expert)
    np.testing.assert_array_equal(a.replicas.split_index, b.replicas.split_index)
    np.testing.assert_array_equal(a.replicas.split_share, b.replicas.split_share)
    assert a.stats.sample_owner is None and b.stats.sample_owner == "trainer"


def test_relibra_plans_homes_and_replicas_for_the_given_samples():
    """relibra's reorder and replication still run in trainer mode and pay off on the trainer's samples."""
    batch = _batch()
    sg = _trainer_ranks(batch.num_sequences)
    kw = dict(sample_owner="trainer", sample_gpu=sg, replica_slots=1)
    static = score_plan(plan_batch(batch, MODEL, CLUSTER, "static", **kw), batch, MODEL, CLUSTER)
    inter = plan_batch(batch, MODEL, CLUSTER, "relibra-inter", migration=False, **kw, **FAST)
    # without the portfolio, relibra is relibra-inter's homes plus replicas, which only lower T_MoE
    rel = plan_batch(batch, MODEL, CLUSTER, "relibra", migration=False, price_replicas=False, portfolio=False,
                     **kw, **FAST)
    assert all(r["locality"] == {"skipped": "sample_owner=trainer"} for r in inter.stats.rounds)
    t_inter = score_plan(inter, batch, MODEL, CLUSTER).t_moe_s
    t_rel = score_plan(rel, batch, MODEL, CLUSTER).t_moe_s
    assert t_inter < static.t_moe_s
    assert len(rel.replicas.split_index) > 0 and t_rel <= t_inter * (1 + 1e-9)
    # with it (the default), the trainer's samples are kept by every candidate and the simulated step (moves
    # charged) is never above relibra-inter's or static's
    full = plan_batch(batch, MODEL, CLUSTER, "relibra", **kw, **FAST)
    np.testing.assert_array_equal(full.samples.gpu, sg)
    step = simulate_step(full, batch, MODEL, CLUSTER).step_s
    for other in (inter, plan_batch(batch, MODEL, CLUSTER, "static", **kw)):
        assert step <= simulate_step(other, batch, MODEL, CLUSTER).step_s * (1 + 1e-9)


def test_migration_never_relabels_the_trainers_samples():
    """previous = a symmetry of static: planner mode relabels samples with the experts; trainer mode may not."""
    batch = _batch()
    perm = symmetry_perm(np.array([1, 0]), np.array([1, 0]), CLUSTER.gpus_per_node)  # swap nodes and rails
    prev = perm[Placement.static(MODEL.num_layers, MODEL.num_experts, CLUSTER.num_gpus).expert_gpu]
    sg = _trainer_ranks(batch.num_sequences)
    plan = plan_batch(batch, MODEL, CLUSTER, "relibra", replica_slots=1, previous=prev, sample_owner="trainer",
                      sample_gpu=sg, **FAST)
    np.testing.assert_array_equal(plan.samples.gpu, sg)
    info = plan.stats.migration
    assert info.enabled and info.samples_fixed
    assert sorted(info.relabel) == list(range(CLUSTER.num_gpus))


def test_planner_service_takes_per_batch_ranks():
    batch = _batch()
    sg = _trainer_ranks(batch.num_sequences)
    ref = plan_batch(batch, MODEL, CLUSTER, "relibra", replica_slots=1, sample_owner="trainer", sample_gpu=sg, **FAST)
    with Planner(MODEL, CLUSTER, "relibra", replica_slots=1, workers=1, executor="inline", sample_owner="trainer",
                 **FAST) as planner:
        plan = planner.plan(batch, sample_gpu=sg)
        np.testing.assert_array_equal(plan.samples.gpu, sg)
        np.testing.assert_array_equal(plan.placement.expert_gpu, ref.placement.expert_gpu)
        np.testing.assert_array_equal(plan.replicas.split_index, ref.replicas.split_index)
        assert plan.stats.options["sample_gpu"] == ref.stats.options["sample_gpu"]
        sg2 = (sg + 1) % CLUSTER.num_gpus
        nxt = planner.submit(batch, sample_gpu=sg2).result(timeout=120)
        np.testing.assert_array_equal(nxt.samples.gpu, sg2)
        np.testing.assert_array_equal(planner.plan(batch).samples.gpu,  # no ranks: round-robin
                                      round_robin_gpus(batch.resolve_micro_batch(), CLUSTER.num_gpus))
        with pytest.raises(PlanError, match=r"sample_gpu\[2\] = 9 is outside \[0, 4\)"):
            bad = sg.copy()
            bad[2] = 9
            planner.plan(batch, sample_gpu=bad)
    with Planner(MODEL, CLUSTER, "static", replica_slots=0, workers=1, executor="inline") as planner:
        with pytest.raises(PlanError, match="sample_gpu=.*only applies with sample_owner='trainer', not 'planner'"):
            planner.submit(batch, sample_gpu=sg)


@pytest.mark.parametrize("kw, match", [
    (dict(sample_owner="data"), r"sample_owner='data' is not one of \('planner', 'trainer'\)"),
    (dict(sample_gpu=np.zeros(16, np.int64)), r"sample_gpu= .*shape \(16,\).* only applies with "
                                               r"sample_owner='trainer', not 'planner'"),
    (dict(sample_owner="trainer", repack=True), r"repack=True .* sample_owner='trainer'"),
    (dict(sample_owner="trainer", sample_gpu=np.zeros(16) + 0.5), r"sample_gpu must be an int \[N\] array .*float64"),
    (dict(sample_owner="trainer", sample_gpu=np.zeros((4, 4), np.int64)), r"sample_gpu must be an int \[N\] array"),
])
def test_bad_options_name_the_field(kw, match):
    with pytest.raises(PlanError, match=match):
        PlanOptions(**kw)
    with pytest.raises(PlanError, match=match):
        plan_batch(_batch(), MODEL, CLUSTER, "static", **kw)


@pytest.mark.parametrize("sg, match", [
    (np.zeros(15, np.int64), r"sample_gpu has 15 entries, the batch has N=16 samples"),
    (np.r_[np.zeros(5, np.int64), [4], np.zeros(10, np.int64)], r"sample_gpu\[5\] = 4 is outside \[0, 4\)"),
    (np.r_[np.zeros(3, np.int64), [-1], np.zeros(12, np.int64)], r"sample_gpu\[3\] = -1 is outside \[0, 4\)"),
])
def test_bad_ranks_name_the_index_and_value(sg, match):
    with pytest.raises(PlanError, match=match):
        plan_batch(_batch(), MODEL, CLUSTER, "relibra", replica_slots=1, sample_owner="trainer", sample_gpu=sg)
