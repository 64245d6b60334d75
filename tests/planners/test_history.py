"""eplb-history: EPLB from past loads (hand-computed packing, equivalence with EPLB+ on those loads, the GPU
relabel towards the previous placement, the re-balance schedule) and its bad inputs."""

from __future__ import annotations

import numpy as np
import pytest

from relibra_moe.cost import moe_cost
from relibra_moe.errors import PlanError
from relibra_moe.planners.baselines import eplb, static_placement
from relibra_moe.planners.history import EplbSchedule, history_weights
from relibra_moe.planners.strategies import plan_batch
from relibra_moe.specs import cluster_preset, model_preset
from relibra_moe.trace import TraceBatch


def _batch(seed: int, model, n: int = 16, mbs: int = 4, hot: int = 0) -> TraceBatch:
    """Count-built batch: n samples of 20..60 tokens, expert ``hot`` 8x more likely in every layer."""
    rng = np.random.default_rng(seed)
    L, E, k = model.num_layers, model.num_experts, model.top_k
    p = np.ones(E)
    p[hot] = 8.0
    p /= p.sum()
    counts = np.zeros((n, L, E), np.int64)
    for i in range(n):
        s = int(rng.integers(20, 60))
        for l in range(L):
            for _ in range(s):
                counts[i, l, rng.choice(E, k, replace=False, p=p)] += 1
    return TraceBatch.from_counts(counts, k, micro_batch=np.arange(n) // mbs)


@pytest.fixture
def setup():
    model = model_preset("gpt-oss-20b").with_(num_layers=2)
    cluster = cluster_preset("hopper-rail", nodes=2, gpus_per_node=2)
    return model, cluster


def test_history_weights_shapes_and_window_sum():
    a, b = np.arange(6.0).reshape(2, 3), np.ones((2, 3))
    assert history_weights(None, 2, 3) is None
    np.testing.assert_array_equal(history_weights(a, 2, 3), a)
    np.testing.assert_array_equal(history_weights(np.stack([a, b]), 2, 3), a + b)
    with pytest.raises(PlanError, match=r"history must be \[L=2, E=3\]"):
        history_weights(np.ones((3, 2)), 2, 3)
    with pytest.raises(PlanError, match=r"history\[0, 1, 2\] = -1"):
        history_weights(np.array([[[0, 0, 0], [0, 0, -1.0]]]), 2, 3)


def test_hand_computed_packing_one_node():
    """G = 2 on one node, E = 4, r = 0, loads [10, 1, 1, 1]: heaviest first onto the lightest GPU with a free home
    slot: e0 -> GPU 0, e1 -> GPU 1, e2 -> GPU 1 (1 < 10), e3 -> GPU 0 (GPU 1 full)."""
    model = model_preset("gpt-oss-20b").with_(num_layers=1, num_experts=4, top_k=2)
    cluster = cluster_preset("hopper-rail", nodes=1, gpus_per_node=2)
    batch = TraceBatch.from_counts(np.array([[[3, 3, 2, 2]], [[1, 1, 2, 2]]]), 2, micro_batch=[0, 0])
    plan = plan_batch(batch, model, cluster, "eplb-history", history=np.array([[10.0, 1, 1, 1]]))
    np.testing.assert_array_equal(plan.placement.expert_gpu, [[0, 1, 1, 0]])
    assert plan.stats.eplb_history.window == 1


def test_no_history_is_the_trivial_layout(setup):
    model, cluster = setup
    batch = _batch(0, model)
    plan = plan_batch(batch, model, cluster, "eplb-history", replica_slots=2)
    np.testing.assert_array_equal(plan.placement.expert_gpu,
                                  static_placement(model.num_layers, model.num_experts, cluster.num_gpus))
    assert (plan.replicas.replica_expert == -1).all() and len(plan.replicas.split_index) == 0
    assert plan.stats.eplb_history.layout.startswith("trivial")


def test_history_plan_is_eplb_on_the_past_loads_relabelled(setup):
    """eplb-history on batch B with batch A's loads = EPLB on A's loads up to a cost-preserving GPU relabel, and
    EPLB+ (strategy eplb) on batch A sees the same loads: same placement up to that relabel."""
    model, cluster = setup
    a, b = _batch(1, model, hot=3), _batch(2, model, hot=5)
    hist = a.sample_expert_counts().sum(axis=0)
    plan = plan_batch(b, model, cluster, "eplb-history", replica_slots=1, history=hist)
    raw_homes, raw_slots = eplb(hist.astype(np.float64), cluster.num_gpus, cluster.gpus_per_node, 1)
    perm = np.array(plan.stats.eplb_history.relabel)
    np.testing.assert_array_equal(plan.placement.expert_gpu, perm[raw_homes])
    rep = plan.replicas.replica_expert
    for g in range(cluster.num_gpus):
        np.testing.assert_array_equal(rep[0, :, perm[g]], raw_slots[:, g])
    assert (rep == rep[:1]).all(), "EPLB's redundant experts are fixed for the batch"
    oracle = plan_batch(a, model, cluster, "eplb", replica_slots=1)
    np.testing.assert_array_equal(oracle.placement.expert_gpu, raw_homes)
    # the history decides the placement, not the batch planned
    other = plan_batch(a, model, cluster, "eplb-history", replica_slots=1, history=hist)
    np.testing.assert_array_equal(other.placement.expert_gpu, plan.placement.expert_gpu)


def test_relabel_keeps_more_experts_and_the_same_cost(setup):
    model, cluster = setup
    a, b = _batch(3, model, hot=1), _batch(4, model, hot=6)
    hist = a.sample_expert_counts().sum(axis=0)
    raw_homes, _ = eplb(hist.astype(np.float64), cluster.num_gpus, cluster.gpus_per_node, 0)
    # a previous placement that is the raw EPLB layout with nodes swapped: the relabel must undo the swap
    swap = np.array([2, 3, 0, 1])
    prev = swap[raw_homes]
    plan = plan_batch(b, model, cluster, "eplb-history", history=hist, previous=prev)
    assert (plan.placement.expert_gpu == prev).all()
    # same cost as the un-relabelled layout with its samples round-robin
    mb = b.resolve_micro_batch()
    rr = np.arange(len(mb)) % cluster.num_gpus  # round-robin within each micro-batch of 4 samples
    x_raw = b.loads(rr, cluster.num_gpus)
    x_new = b.loads(plan.samples.gpu, cluster.num_gpus)
    t_raw = moe_cost(x_raw, raw_homes, model, cluster).t_moe.sum()
    t_new = moe_cost(x_new, plan.placement.expert_gpu, model, cluster).t_moe.sum()
    assert t_new == pytest.approx(t_raw, rel=1e-12)


def test_schedule_window_and_interval():
    s = EplbSchedule(rebalance_every=2, window=2)
    a = [np.full((1, 2), float(i)) for i in range(5)]
    assert s.history_for(0) is None
    s.observe(a[0])
    assert s.history_for(1) is None  # no re-balance yet: the trivial layout stays
    s.observe(a[1])
    np.testing.assert_array_equal(s.history_for(2), np.stack([a[0], a[1]]))
    s.observe(a[2])
    np.testing.assert_array_equal(s.history_for(3), np.stack([a[0], a[1]]))  # unchanged between re-balances
    s.observe(a[3])
    np.testing.assert_array_equal(s.history_for(4), np.stack([a[2], a[3]]))
    one = EplbSchedule()
    one.observe(a[0])
    np.testing.assert_array_equal(one.history_for(1), a[0][None])


def test_bad_inputs(setup):
    model, cluster = setup
    batch = _batch(5, model)
    with pytest.raises(PlanError, match="rebalance_every"):
        EplbSchedule(rebalance_every=0)
    with pytest.raises(PlanError, match="window"):
        EplbSchedule(window=0)
    with pytest.raises(PlanError, match="observed loads must be"):
        EplbSchedule().observe(np.ones(3))
    with pytest.raises(PlanError, match="only applies to strategy 'eplb-history' and 'relibra', not 'eplb'"):
        plan_batch(batch, model, cluster, "eplb", history=np.ones((2, 32)))
    with pytest.raises(PlanError, match=r"history must be \[L=2, E=32\]"):
        plan_batch(batch, model, cluster, "eplb-history", history=np.ones((3, 32)))


def _traced(seed: int, n: int = 8):
    """A saveable batch of real RoutingTraces for gpt-oss-20b (24 layers, 32 experts, k = 4), hot experts."""
    from relibra_moe.trace import RoutingTrace

    rng = np.random.default_rng(seed)
    traces = []
    for _ in range(n):
        s = int(rng.integers(20, 50))
        p = np.ones(32)
        p[rng.integers(0, 32, size=2)] = 10.0
        g = np.log(p) + rng.gumbel(size=(s, 24, 32))
        traces.append(RoutingTrace(np.argpartition(-g, 3, axis=2)[:, :, :4], np.arange(24), 32, 4, source="test"))
    return TraceBatch(traces, micro_batch=np.arange(n) // 4)


def test_cli_history_is_the_option(tmp_path, capsys):
    from relibra_moe.cli import main
    from relibra_moe.plan import BatchPlan

    model, cluster = model_preset("gpt-oss-20b"), cluster_preset("hopper-rail", nodes=2, gpus_per_node=2)
    past, now = _traced(1), _traced(2)
    past_f, now_f, out = tmp_path / "past.npz", tmp_path / "now.npz", tmp_path / "plan.npz"
    past.save(past_f)
    now.save(now_f)
    argv = ["plan", str(now_f), "--model", "gpt-oss-20b", "--nodes", "2", "--gpus-per-node", "2", "--out", str(out)]
    assert main(argv + ["--strategy", "eplb-history", "--replica-slots", "1", "--history", str(past_f)]) == 0
    got = BatchPlan.load(out)
    ref = plan_batch(now, model, cluster, "eplb-history", replica_slots=1,
                     history=past.sample_expert_counts().sum(axis=0)[None])
    np.testing.assert_array_equal(got.placement.expert_gpu, ref.placement.expert_gpu)
    np.testing.assert_array_equal(got.replicas.replica_expert, ref.replicas.replica_expert)
    assert got.stats.eplb_history.window == 1 and got.stats.options["history"].startswith("sha1:")
    assert not (got.placement.expert_gpu == static_placement(24, 32, 4)).all()  # it re-balanced on the past
    capsys.readouterr()
    assert main(argv + ["--strategy", "eplb", "--history", str(past_f)]) == 1
    err = capsys.readouterr().err
    assert "only applies to strategy 'eplb-history' and 'relibra', not 'eplb'" in err


@pytest.mark.parametrize("history, match", [
    (np.ones(3), r"history must be \[L, E\] or \[W, L, E\]"),
    (np.ones((2, 3), bool), "of dtype bool"),
    (np.full((2, 3), -1.0), r"history\[0, 0\] = -1.0: token counts must be finite and >= 0"),
])
def test_history_option_checks(history, match):
    from relibra_moe.planners.options import PlanOptions

    with pytest.raises(PlanError, match=match):
        PlanOptions(history=history)
