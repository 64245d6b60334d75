"""online: per-micro-batch replicas from the live loads on static homes, the replica fetch after the router
(sim replica mode "after-router", hand-computed), and the planner's choice per cell vs. the simulator."""

from __future__ import annotations

import numpy as np
import pytest

from relibra_moe.errors import PlanError
from relibra_moe.plan import BatchPlan, Placement, ReplicaPlan, SamplePlacement
from relibra_moe.planners.baselines import static_placement
from relibra_moe.planners.online import REPLICA_FETCH, online_step_seconds
from relibra_moe.planners.strategies import plan_batch
from relibra_moe.sim import attention_forward, simulate_loads, simulate_step
from relibra_moe.specs import cluster_preset, model_preset
from relibra_moe.trace import TraceBatch


def _skewed_batch(model, n: int = 16, mbs: int = 8, seed: int = 0) -> TraceBatch:
    rng = np.random.default_rng(seed)
    L, E, k = model.num_layers, model.num_experts, model.top_k
    counts = np.zeros((n, L, E), np.int64)
    for i in range(n):
        s = int(rng.integers(200, 400))
        p = np.ones(E)
        p[rng.integers(0, E, size=2)] = 30.0  # two hot experts per sample
        p /= p.sum()
        for l in range(L):
            for _ in range(s):
                counts[i, l, rng.choice(E, k, replace=False, p=p)] += 1
    return TraceBatch.from_counts(counts, k, micro_batch=np.arange(n) // mbs)


@pytest.fixture
def setup():
    model = model_preset("gpt-oss-20b").with_(num_layers=2)
    cluster = cluster_preset("hopper-rail", nodes=2, gpus_per_node=4)
    return model, cluster, _skewed_batch(model)


def test_online_plan_shape_and_mode(setup):
    model, cluster, batch = setup
    # a small batch dispatches in microseconds: a fast NVLink lets the fetch hide behind it, so replicas pay
    cluster = cluster.with_(nvlink_bw=cluster.nvlink_bw * 1000)
    plan = plan_batch(batch, model, cluster, "online", replica_slots=2)
    np.testing.assert_array_equal(plan.placement.expert_gpu,
                                  static_placement(model.num_layers, model.num_experts, cluster.num_gpus))
    assert plan.stats.replica_fetch == REPLICA_FETCH == "after-router"
    assert plan.replicas.scope == "node"  # validated by plan_batch: replicas inside the home's node
    assert (plan.replicas.replica_expert >= 0).any(), "a skewed batch should get replicas"
    step = simulate_step(plan, batch, model, cluster)
    assert step.replica_mode == "after-router" and step.experts_moved == 0 and step.reorder_s == 0.0
    # the planner's per-cell price and the simulator agree: step = attention + sum over cells
    x = batch.loads(plan.samples.gpu, cluster.num_gpus, plan.samples.micro_batch)
    a = attention_forward(batch.lengths, plan.samples.micro_batch, plan.samples.gpu, plan.num_micro_batches, model,
                          cluster)
    from relibra_moe.planners.replicate import CellResult, cell_step_terms

    total = 3.0 * model.num_layers * a.sum()  # A_fwd + A_bwd = 3 A_fwd per layer
    for m in range(plan.num_micro_batches):
        for l in range(model.num_layers):
            rows = plan.replicas.rows_of(m, l)
            res = CellResult(plan.replicas.replica_expert[m, l], plan.replicas.split_index[rows, 2:],
                             plan.replicas.split_share[rows].astype(np.float64), 0.0)
            comp, comm, push = cell_step_terms(x[m, l].astype(np.float64), plan.placement.expert_gpu[l], res, model,
                                               cluster)
            total += online_step_seconds(comp, comm, push, float(a[m]))
    assert step.step_s == pytest.approx(total, rel=1e-5)


def test_online_never_slower_than_no_replicas_or_all_replicas(setup):
    """Per cell the planner takes the cheapest of 0..r slots, so its simulated step is at most that of the
    static plan without replicas and of the same greedy with every slot filled (both under after-router)."""
    model, cluster, batch = setup
    slow = cluster.with_(nvlink_bw=cluster.nvlink_bw / 2000)  # fetches that the dispatch cannot hide
    online = plan_batch(batch, model, slow, "online", replica_slots=2)
    static = plan_batch(batch, model, slow, "static")
    from relibra_moe.planners.replicate import replicate_batch

    full = replicate_batch(online.placement, online.samples, batch, model, slow, 2)
    full_plan = BatchPlan(online.placement, online.samples, full, slow.num_gpus, slow.gpus_per_node,
                          {"strategy": "greedy-all", "replica_fetch": "after-router",
                           "batch_sha1": online.stats.batch_sha1})
    t_online = simulate_step(online, batch, model, slow).step_s
    t_static = simulate_step(static, batch, model, slow).step_s
    t_full = simulate_step(full_plan, batch, model, slow).step_s
    assert t_online <= t_static * (1 + 1e-9) and t_online <= t_full * (1 + 1e-9)
    assert t_full > t_static, "with a slow fetch, filling every slot should cost more than it saves"


def test_after_router_mode_hand_computed():
    """One micro-batch, one layer, one replica on the other GPU of the node: the fetch is exposed by
    push - dispatch (dispatch = comm / 2) in the forward and push - 2 A_fwd in the backward."""
    model = model_preset("gpt-oss-20b").with_(num_layers=1)
    cluster = cluster_preset("hopper-rail", nodes=1, gpus_per_node=2).with_(nvlink_bw=1e9)
    E = model.num_experts
    eg = static_placement(1, E, 2)
    lengths = np.array([40, 40])
    x = np.zeros((1, 1, 2, E))
    x[0, 0, 0, 0] = 40  # GPU 0's tokens all pick expert 0 (home GPU 0) ... k = 4 experts per token
    x[0, 0, 0, 1:4] = 40
    x[0, 0, 1, 0] = 40
    x[0, 0, 1, 1:4] = 40
    rep = np.full((1, 1, 2, 1), -1)
    rep[0, 0, 1, 0] = 0  # a replica of expert 0 on GPU 1
    split = np.array([[0, 0, 1, 0, 0], [0, 0, 1, 0, 1]])
    plan = BatchPlan(Placement(eg), SamplePlacement(np.array([0, 0]), np.array([0, 1]), 1),
                     ReplicaPlan(rep, split, np.array([0.0, 1.0])), 2, 2, {"replica_fetch": "after-router"})
    st = simulate_loads(plan, lengths, x, model, cluster)
    assert st.replica_mode == "after-router"
    push = model.expert_bytes / 1e9  # one NVLink transfer GPU 0 -> GPU 1
    a_fwd = float(st.attention_fwd[0])
    comm = st.moe_fwd_comm_s
    expected = max(0.0, push - comm / 2) + max(0.0, push - 2 * a_fwd)
    assert push > comm / 2, "the test needs an exposed fetch"
    assert st.replica_exposed_s == pytest.approx(expected, rel=1e-9)
    per_layer = simulate_loads(plan, lengths, x, model, cluster, replica_mode="per-layer")
    # replayed: the push hides behind max(A_fwd, comm / 2), never less than after the router
    window = max(a_fwd, comm / 2)
    assert per_layer.replica_exposed_s == pytest.approx(max(0.0, push - window) + max(0.0, push - 2 * a_fwd))
    assert per_layer.replica_exposed_s <= st.replica_exposed_s
    assert st.step_s - st.replica_exposed_s == pytest.approx(per_layer.step_s - per_layer.replica_exposed_s)
    with pytest.raises(PlanError, match="after-router"):
        simulate_loads(plan, lengths, x, model, cluster, replica_mode="later")


def test_online_without_slots_is_static(setup):
    model, cluster, batch = setup
    plan = plan_batch(batch, model, cluster, "online")
    assert plan.replica_slots == 0
    ref = simulate_step(plan_batch(batch, model, cluster, "static"), batch, model, cluster)
    assert simulate_step(plan, batch, model, cluster).step_s == pytest.approx(ref.step_s)


def test_saved_online_plan_keeps_its_fetch_mode(setup, tmp_path):
    model, cluster, batch = setup
    cluster = cluster.with_(nvlink_bw=cluster.nvlink_bw * 1000)
    plan = plan_batch(batch, model, cluster, "online", replica_slots=2)
    plan.save(tmp_path / "online.npz")
    back = BatchPlan.load(tmp_path / "online.npz")
    assert back.stats.replica_fetch == "after-router"
    a, b = simulate_step(plan, batch, model, cluster), simulate_step(back, batch, model, cluster)
    assert b.replica_mode == "after-router" and b.step_s == pytest.approx(a.step_s)


def test_the_fetch_formula_is_timings_hand_computed():
    """timing.cell_step_seconds, the one definition the planner (online_step_seconds) and sim charge:
    comp 1, comm 2, push 3, attention forward 0.5 s (backward 1 s)."""
    from relibra_moe.timing import cell_step_seconds, replica_push_overlap

    # 3 comp + 2 comm = 7; after the router the push hides only behind the dispatch comm / 2 = 1 -> 2 exposed;
    # the gradient pull behind the attention backward 1 -> 2 exposed
    assert cell_step_seconds(1.0, 2.0, 3.0, 0.5, fetch="after-router") == pytest.approx(11.0)
    assert online_step_seconds(1.0, 2.0, 3.0, 0.5) == pytest.approx(11.0)
    # replayed (per-layer): the push hides behind max(attention forward 0.5, dispatch 1) = 1 -> 2 exposed
    assert cell_step_seconds(1.0, 2.0, 3.0, 0.5) == pytest.approx(11.0)
    assert replica_push_overlap(0.5, 2.0, "after-router") == 1.0 and replica_push_overlap(0.5, 2.0) == 1.0
    # where the attention forward is the longer window (1.5 > 1), it is the one: 3 - 1.5 exposed, pull 0
    assert cell_step_seconds(1.0, 2.0, 3.0, 1.5) == pytest.approx(7.0 + 1.5)
    assert replica_push_overlap(1.5, 2.0) == 1.5
    with pytest.raises(PlanError, match="replica fetch 'later' is not one of"):
        replica_push_overlap(0.5, 2.0, "later")


def test_simulate_cli_offers_every_replica_mode():
    from relibra_moe.cli import build_parser
    from relibra_moe.timing import REPLICA_MODES

    args = build_parser().parse_args(["simulate", "t.npz", "p.npz", "--model", "gpt-oss-20b",
                                      "--replica-mode", "after-router"])
    assert args.replica_mode == "after-router" and "after-router" in REPLICA_MODES
