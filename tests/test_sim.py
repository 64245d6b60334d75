"""Step-time simulator: hand-computed cases for every formula of relibra_moe/sim.py, plus invariants."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from relibra_moe.cost import flow_matrix
from relibra_moe.errors import PlanError
from relibra_moe.evaluate import plan_expert_rows, plan_flow
from relibra_moe.plan import BatchPlan, Placement, ReplicaPlan, SamplePlacement
from relibra_moe.sim import reorder_traffic, simulate_loads
from relibra_moe.specs import ClusterSpec, ModelSpec
from relibra_moe.timing import attention_flops, expert_compute_seconds, transfer_seconds

# Round numbers: one (token, expert) pair costs 6*4*8 = 192 FLOPs = 1 s at 192 FLOP/s; a token is
# 4 * 2 = 8 bytes = 1 s on NVLink (8 B/s) and 2 s on RDMA (4 B/s); an expert is 3*4*8*2 = 192 bytes.
MODEL = ModelSpec("tiny", hidden=4, ffn=8, num_experts=4, top_k=2, num_layers=1, dtype_bytes=2,
                  num_heads=2, num_kv_heads=1, head_dim=2)
CLUSTER = ClusterSpec(nodes=2, gpus_per_node=2, nvlink_bw=8.0, rdma_bw=4.0, flops=192.0, attn_flops=384.0)


def _plan(sample_gpu, sample_mb, expert_gpu=None, replica_expert=None, rows=(), shares=(), scope="node",
          model=MODEL, cluster=CLUSTER) -> BatchPlan:
    L, E, G = model.num_layers, model.num_experts, cluster.num_gpus
    M = int(max(sample_mb)) + 1
    placement = Placement(expert_gpu if expert_gpu is not None else Placement.static(L, E, G).expert_gpu)
    if replica_expert is None:
        replicas = ReplicaPlan.empty(M, L, G, 0)
    else:
        replicas = ReplicaPlan(np.asarray(replica_expert), np.asarray(rows, np.int32).reshape(-1, 5),
                               np.asarray(shares, np.float32), scope)
    return BatchPlan(placement, SamplePlacement(np.asarray(sample_mb), np.asarray(sample_gpu), M), replicas,
                     G, cluster.gpus_per_node, {})


def test_attention_flops_hand_and_loop():
    # S=3, h=4, d=2, n_q=2, n_kv=1: projections 2*3*4*2*(4+2) = 288; causal 2*2*2*3*4 = 96.
    assert attention_flops(np.array([3]), MODEL)[0] == pytest.approx(384.0)
    # Independent reference: count every GEMM and every (query, key) pair in loops.
    for s in (1, 5, 17):
        h, d, nq, nkv = MODEL.hidden, MODEL.head_dim, MODEL.num_heads, MODEL.num_kv_heads
        ref = 0.0
        for _ in range(s):
            ref += 2 * h * nq * d + 2 * 2 * h * nkv * d + 2 * nq * d * h  # q, k, v, o
        for i in range(s):
            for _ in range(i + 1):
                ref += nq * (2 * d + 2 * d)  # q.k and p*v
        assert attention_flops(np.array([s]), MODEL)[0] == pytest.approx(ref)


def test_static_step_hand_computed():
    # One sequence of 3 tokens on GPU 0; each token goes to experts 0 (GPU 0, loc) and 1 (GPU 1, nv).
    x = np.zeros((1, 1, 4, 4))
    x[0, 0, 0, :2] = 3
    st_ = simulate_loads(_plan([0], [0]), np.array([3]), x, MODEL, CLUSTER)
    # A_fwd = 384 / 384 = 1 s, A_bwd = 2 s; comp max = 3 s; NVLink tx of GPU 0 = 24 B = 3 s,
    # dispatch + combine = 6 s. T_fwd = 9, T_bwd = 2*3 + 6 = 12. Step = 1 + 9 + 2 + 12 = 24 s.
    assert st_.attention_fwd_s == pytest.approx(1.0)
    assert st_.attention_bwd_s == pytest.approx(2.0)
    assert st_.moe_fwd_comp_s == pytest.approx(3.0)
    assert st_.moe_fwd_comm_s == pytest.approx(6.0)
    assert st_.moe_bwd_comp_s == pytest.approx(6.0)
    assert st_.moe_bwd_comm_s == pytest.approx(6.0)
    assert st_.step_s == pytest.approx(24.0)
    assert st_.tokens == 3 and st_.tokens_per_s == pytest.approx(3 / 24)
    assert st_.reorder_s == 0 and st_.experts_moved == 0 and st_.replica_exposed_s == 0
    assert sum(st_.breakdown.values()) == pytest.approx(st_.step_s)
    assert st_.t_moe[0, 0] == pytest.approx(9.0)
    assert st_.rank_skew[0, 0] == pytest.approx(3 / 1.5)


def test_rdma_step_hand_computed():
    # Tokens from GPU 0 to expert 2 (GPU 2: other node, same rail: sr) and expert 3 (GPU 3: cr).
    x = np.zeros((1, 1, 4, 4))
    x[0, 0, 0, 2:] = 3
    st_ = simulate_loads(_plan([0], [0]), np.array([3]), x, MODEL, CLUSTER)
    # comp max 3 s. RDMA tx of GPU 0: 6 tokens * 8 B / 4 B/s = 12 s; NVLink tx (cr only) 3 s.
    # comm = 2 * 12 = 24; T_fwd = 27, T_bwd = 30; step = 1 + 27 + 2 + 30 = 60.
    assert st_.moe_fwd_comm_s == pytest.approx(24.0)
    assert st_.step_s == pytest.approx(60.0)


def test_replica_push_exposed_hand_computed():
    # As the static case, plus a replica of expert 1 on GPU 0 that serves all of GPU 0's tokens.
    x = np.zeros((1, 1, 4, 4))
    x[0, 0, 0, :2] = 3
    rep = np.full((1, 1, 4, 1), -1)
    rep[0, 0, 0, 0] = 1
    plan = _plan([0], [0], replica_expert=rep, rows=[(0, 0, 0, 1, 0)], shares=[1.0])
    st_ = simulate_loads(plan, np.array([3]), x, MODEL, CLUSTER)
    # Flow: 6 tokens stay on GPU 0: comp 6 s, comm 0. T_fwd = 6, T_bwd = 12. Push: 192 B over
    # NVLink at 8 B/s = 24 s; exposed 24 - 1 = 23 forward and 24 - 2 = 22 backward.
    assert st_.replica_mode == "per-layer"
    assert st_.replica_push_s == pytest.approx(24.0)
    assert st_.replica_exposed_s == pytest.approx(45.0)
    assert st_.step_s == pytest.approx(1 + 6 + 23 + 2 + 12 + 22)
    # Faster NVLink hides the push behind attention entirely: 192 B at 384 B/s = 0.5 s < 1 s.
    fast = CLUSTER.with_(nvlink_bw=384.0)
    st2 = simulate_loads(plan, np.array([3]), x, MODEL, fast)
    assert st2.replica_push_s == pytest.approx(0.5)
    assert st2.replica_exposed_s == 0.0


def test_persistent_replicas_hand_computed():
    # Two micro-batches (one sample each, both on GPU 0), the same replica in both: persistent mode.
    x = np.zeros((2, 1, 4, 4))
    x[:, 0, 0, :2] = 3
    rep = np.full((2, 1, 4, 1), -1)
    rep[:, 0, 0, 0] = 1
    plan = _plan([0, 0], [0, 1], replica_expert=rep, rows=[(0, 0, 0, 1, 0), (1, 0, 0, 1, 0)], shares=[1.0, 1.0])
    st_ = simulate_loads(plan, np.array([3, 3]), x, MODEL, CLUSTER)
    # Push once (24 s) and pull once (24 s); each micro-batch: 1 + 6 + 2 + 12 = 21 s.
    assert st_.replica_mode == "persistent"
    assert st_.replica_exposed_s == pytest.approx(48.0)
    assert st_.step_s == pytest.approx(2 * 21 + 48)
    per_layer = simulate_loads(plan, np.array([3, 3]), x, MODEL, CLUSTER, replica_mode="per-layer")
    assert per_layer.step_s == pytest.approx(2 * (21 + 45))


@pytest.mark.parametrize("other, seconds", [(1, 1344 / 8), (2, 1344 / 4), (3, 1344 / 4)])
def test_reorder_traffic_hand_computed(other, seconds):
    # Swap expert 0 (GPU 0) with expert `other` (GPU other): nv, sr, cr. Each moves
    # 3*4*8 params * (2 + 12) bytes = 1344 B each way.
    static = Placement.static(1, 4, 4)
    row = static.expert_gpu[0].copy()
    row[0], row[other] = row[other], row[0]
    t, moved, nbytes = reorder_traffic(static, Placement(row[None]), MODEL, CLUSTER)
    assert moved == 2 and nbytes == pytest.approx(2 * 1344)
    assert t == pytest.approx(seconds)
    # Through simulate_loads: the re-layout adds exactly that once.
    x = np.zeros((1, 1, 4, 4))
    base = simulate_loads(_plan([0], [0], expert_gpu=row[None]), np.array([0]), x, MODEL, CLUSTER)
    assert base.reorder_s == pytest.approx(seconds) and base.step_s == pytest.approx(seconds)
    same = simulate_loads(_plan([0], [0], expert_gpu=row[None]), np.array([0]), x, MODEL, CLUSTER,
                          previous=Placement(row[None]))
    assert same.reorder_s == 0


def test_shared_experts_and_slowest_gpu():
    # Two sequences (3 and 1 tokens) on GPUs 0 and 1; one shared expert of width 8 adds
    # 6*4*8 = 192 FLOPs per token = 1 s per token. GPU 0: 384/384 + 3 = 4 s; GPU 1: 24/384 + 1.
    model = MODEL.with_(shared_experts=1)
    x = np.zeros((1, 1, 4, 4))
    st_ = simulate_loads(_plan([0, 1], [0, 0], model=model), np.array([3, 1]), x, model, CLUSTER)
    assert st_.attention_fwd[0] == pytest.approx(4.0)
    assert st_.step_s == pytest.approx(4.0 + 8.0)


def test_transfer_seconds_groups():
    # Two groups: group 0 has two nv sends into GPU 1 (rx 2*10 B / 8 B/s), group 1 one sr send.
    t = transfer_seconds(np.array([0, 3, 0]), np.array([1, 1, 2]), np.array([10.0, 10.0, 8.0]),
                         np.array([0, 0, 1]), 2, CLUSTER)
    # GPU 3 -> GPU 1 is cr: it counts on NVLink (rx of GPU 1: 20 B / 8 B/s) and on RDMA (10 B / 4 B/s).
    assert t[0] == pytest.approx(max(20 / 8, 10 / 4))
    assert t[1] == pytest.approx(8 / 4)


@given(st.integers(0, 2**31 - 1))
def test_plan_flow_matches_dense_shares(seed):
    rng = np.random.default_rng(seed)
    model = MODEL.with_(num_experts=8, num_layers=2)
    M, L, G, E = 2, 2, 4, 8
    expert_gpu = np.stack([rng.permutation(np.repeat(np.arange(G), E // G)) for _ in range(L)])
    rep = np.full((M, L, G, 1), -1)
    rows, shares = [], []
    for m in range(M):
        for l in range(L):
            e = int(rng.integers(E))
            h = expert_gpu[l, e]
            g = h ^ 1  # the other GPU of the node
            rep[m, l, g, 0] = e
            for j in range(G):
                if rng.random() < 0.7:
                    s = float(rng.random())
                    rows += [(m, l, j, e, h), (m, l, j, e, g)]
                    shares += [s, 1 - s]
    plan = BatchPlan(Placement(expert_gpu), SamplePlacement(np.array([0, 1]), np.array([0, 1]), M),
                     ReplicaPlan(rep, np.array(rows, np.int32).reshape(-1, 5), np.array(shares, np.float32)),
                     G, 2, {})
    plan.validate(model, CLUSTER, 2)
    x = rng.integers(0, 20, size=(M, L, G, E)).astype(np.float64)
    got = plan_flow(plan, x)
    for m in range(M):
        ref = flow_matrix(x[m], shares=plan.replicas.shares(plan.placement, m))
        np.testing.assert_allclose(got[m], ref, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(got.sum(axis=(-1, -2)), x.sum(axis=(-1, -2)), rtol=1e-6)


@given(st.integers(0, 2**31 - 1))
def test_breakdown_sums_and_scales(seed):
    # Invariants: the breakdown adds up to the step; doubling every bandwidth and FLOP rate halves it.
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 30, size=(2, 1, 4, 4)).astype(np.float64)
    lengths = rng.integers(1, 50, size=4)
    plan = _plan(rng.integers(0, 4, size=4), [0, 0, 1, 1])
    a = simulate_loads(plan, lengths, x, MODEL, CLUSTER)
    assert sum(a.breakdown.values()) == pytest.approx(a.step_s)
    fast = CLUSTER.with_(nvlink_bw=16.0, rdma_bw=8.0, flops=384.0, attn_flops=768.0)
    b = simulate_loads(plan, lengths, x, MODEL, fast)
    assert b.step_s == pytest.approx(a.step_s / 2)
    assert a.micro_batch_s.sum() == pytest.approx(a.step_s)


def test_bad_inputs_raise_plan_error():
    plan = _plan([0], [0])
    with pytest.raises(PlanError, match=r"loads x has shape \(1, 1, 4, 3\)"):
        simulate_loads(plan, np.array([3]), np.zeros((1, 1, 4, 3)), MODEL, CLUSTER)
    with pytest.raises(PlanError, match="lengths has shape"):
        simulate_loads(plan, np.array([3, 4]), np.zeros((1, 1, 4, 4)), MODEL, CLUSTER)
    with pytest.raises(PlanError, match="negative length -1"):
        simulate_loads(plan, np.array([-1]), np.zeros((1, 1, 4, 4)), MODEL, CLUSTER)
    with pytest.raises(PlanError, match="replica_mode 'sometimes'"):
        simulate_loads(plan, np.array([3]), np.zeros((1, 1, 4, 4)), MODEL, CLUSTER, replica_mode="sometimes")
    x1 = np.zeros((1, 1, 4, 4))
    bad = x1.copy()
    bad[0, 0, 2, 1] = np.nan
    with pytest.raises(PlanError, match=r"x\[0, 0, 2, 1\] = nan: token counts must be finite and >= 0"):
        simulate_loads(plan, np.array([3]), bad, MODEL, CLUSTER)
    with pytest.raises(PlanError, match=r"previous placement: expert_gpu has shape \(2, 4\)"):
        simulate_loads(plan, np.array([3]), x1, MODEL, CLUSTER, previous=Placement.static(2, 4, 4))
    with pytest.raises(PlanError, match=r"previous placement: expert_gpu\[0, 0\] = 7 is outside \[0, 4\)"):
        simulate_loads(plan, np.array([3]), x1, MODEL, CLUSTER, previous=Placement(np.array([[7, 1, 2, 3]])))
    with pytest.raises(PlanError, match="previous must be a Placement.*ndarray"):
        simulate_loads(plan, np.array([3]), x1, MODEL, CLUSTER, previous=np.zeros((1, 4), dtype=np.int64))
    for bad in (-1.0, float("nan"), "12"):
        with pytest.raises(PlanError, match=f"optimizer_bytes_per_param={bad!r}"):
            simulate_loads(plan, np.array([3]), x1, MODEL, CLUSTER, optimizer_bytes_per_param=bad)
    with pytest.raises(PlanError, match=r"plan is for 4 GPUs \(2 per node\), the cluster has 4 \(4 per node\)"):
        simulate_loads(plan, np.array([3]), x1, MODEL, CLUSTER.with_(nodes=1, gpus_per_node=4))


def test_simulate_step_matches_score_plan_including_balanced():
    # The simulator's forward T_MoE is the planners' exact score, for a real plan and for Balanced.
    from relibra_moe.evaluate import score_plan
    from relibra_moe.planners.strategies import plan_batch
    from relibra_moe.sim import StepResult, simulate_step
    from relibra_moe.trace import TraceBatch

    rng = np.random.default_rng(3)
    model = MODEL.with_(num_experts=8, num_layers=2)
    counts = np.zeros((6, 2, 8), np.int64)
    for n in range(6):
        s = int(rng.integers(3, 20))
        for l in range(2):
            for _ in range(s):
                counts[n, l, rng.choice(8, 2, replace=False)] += 1
    batch = TraceBatch.from_counts(counts, 2, micro_batch=np.array([0, 0, 0, 1, 1, 1]))
    for strategy in ("static", "balanced", "relibra"):
        plan = plan_batch(batch, model, CLUSTER, strategy, replica_slots=1, seed=5)
        st_ = simulate_step(plan, batch, model, CLUSTER)
        score = score_plan(plan, batch, model, CLUSTER)
        assert st_.t_moe.sum() == pytest.approx(score.t_moe_s) and st_.t_moe_s == pytest.approx(score.t_moe_s)
        assert st_.tokens == int(counts[:, 0].sum() // 2)
        # one name per figure: the score's and the step's shared figures agree under the same names
        assert score.moe_fwd_comp_s == pytest.approx(st_.moe_fwd_comp_s)
        assert score.moe_fwd_comm_s == pytest.approx(st_.moe_fwd_comm_s)
        assert score.rank_skew_mean == pytest.approx(st_.rank_skew_mean)
        d = score.to_dict()
        assert "t_moe" not in d and "percent_of_bound" not in d and d["t_moe_s"] == score.t_moe_s
        row = StepResult.of(plan, st_, 1.5).to_dict()
        assert row["solve_s"] == 1.5 and row["strategy"] == strategy and row["replica_slots"] == plan.replica_slots
        assert {k: v for k, v in row.items() if k in st_.to_dict()} == st_.to_dict()
        assert ("portfolio" in row) == (plan.stats.portfolio is not None)
    half = score_plan(plan, batch, model, CLUSTER, bound_t_moe_s=score.t_moe_s / 2)
    assert half.percent_of_bound == pytest.approx(50.0) and half.to_dict()["percent_of_bound"] == 50.0
    with pytest.raises(PlanError, match=r"batch has L=2, E=8; model tiny has L=2, E=16"):
        simulate_step(plan, batch, model.with_(num_experts=16), CLUSTER)
    with pytest.raises(PlanError, match=r"plan has L=2, E=8; model tiny has L=2, E=16"):
        simulate_step(plan, TraceBatch.from_counts(np.ones((6, 2, 16), np.int64), 2), model.with_(num_experts=16),
                      CLUSTER)
    with pytest.raises(PlanError, match="the plan places 6 samples, the batch has 5"):
        simulate_step(plan, batch.subset(np.arange(5)), model, CLUSTER)


# ------------------------------------------------------- a measured expert-GEMM curve (calibrated profiles)
# One (token, expert) pair: 6 x 4 x 8 = 192 FLOPs. Curve: 96 FLOP/s at 1 row per expert, 480 at 16 rows;
# interpolated in log(rows): +96 FLOP/s per doubling, 192 at 2 rows, 384 at 8. The profile's one rate: 192 FLOP/s.
CURVE_MODEL = ModelSpec("tiny", hidden=4, ffn=8, num_experts=4, top_k=2, num_layers=1, dtype_bytes=2,
                        num_heads=2, num_kv_heads=1, head_dim=2)
FLAT_RATE = ClusterSpec(nodes=2, gpus_per_node=2, nvlink_bw=8.0, rdma_bw=4.0, flops=192.0, attn_flops=384.0)
CURVE = FLAT_RATE.with_(gemm_curve=((1.0, 96.0), (16.0, 480.0)))


def _curve_plan(replica_expert=None, rows=(), shares=()) -> BatchPlan:
    reps = (ReplicaPlan.empty(1, 1, 4, 0) if replica_expert is None else
            ReplicaPlan(np.asarray(replica_expert), np.asarray(rows, np.int32).reshape(-1, 5),
                        np.asarray(shares, np.float32), "node"))
    return BatchPlan(Placement(Placement.static(1, 4, 4).expert_gpu), SamplePlacement(np.zeros(1, np.int64),
                     np.zeros(1, np.int64), 1), reps, 4, 2, {})


def test_curve_interpolation():
    assert CURVE.expert_flops_at(2) == pytest.approx(192.0)
    assert CURVE.expert_flops_at(np.array([0.5, 1, 4, 8, 16, 100])) == pytest.approx([96, 96, 288, 384, 480, 480])
    assert FLAT_RATE.expert_flops_at(np.array([1.0, 7.0])).tolist() == [192.0, 192.0]
    # two experts with 8 and 1 rows on one GPU: 8 x 192 / 384 + 1 x 192 / 96 = 4 + 2 = 6 s
    assert expert_compute_seconds(np.array([[8.0, 1.0, 0.0]]), CURVE_MODEL, CURVE) == pytest.approx([6.0])


def test_static_cell_charges_each_experts_rows():
    # GPU 0 serves expert 0 with 8 rows (8 x 192 / 384 = 4 s); GPU 1 expert 1 with 1 row (192 / 96 = 2 s).
    # One rate (192 FLOP/s): 8 s and 1 s.
    x = np.zeros((1, 1, 4, 4))
    x[0, 0, 0, 0] = 8
    x[0, 0, 0, 1] = 1
    lengths = np.array([3])
    flat = simulate_loads(_curve_plan(), lengths, x, CURVE_MODEL, FLAT_RATE)
    curve = simulate_loads(_curve_plan(), lengths, x, CURVE_MODEL, CURVE)
    assert flat.moe_fwd_comp_s == 8.0 and curve.moe_fwd_comp_s == pytest.approx(4.0)
    assert curve.moe_bwd_comp_s == pytest.approx(8.0)
    # the rest of the step is the same: the difference is 3 x (8 - 4) s of forward + backward compute
    assert flat.step_s - curve.step_s == pytest.approx(12.0)
    assert curve.moe_fwd_comm_s == flat.moe_fwd_comm_s


def test_replica_rows_count_on_the_serving_gpu():
    # Expert 0's 16 rows from GPU 0 split half / half with a replica on GPU 1, which also serves expert 1's 1 row:
    # GPU 0: 8 x 192 / 384 = 4 s; GPU 1: 8 x 192 / 384 + 192 / 96 = 4 + 2 = 6 s (one rate: 8 and 9 s).
    x = np.zeros((1, 1, 4, 4))
    x[0, 0, 0, 0] = 16
    x[0, 0, 0, 1] = 1
    rep = np.full((1, 1, 4, 1), -1)
    rep[0, 0, 1, 0] = 0
    plan = _curve_plan(rep, [(0, 0, 0, 0, 0), (0, 0, 0, 0, 1)], [0.5, 0.5])
    rows = plan_expert_rows(plan, x)
    assert rows[0, 0, 0].tolist() == [8.0, 0, 0, 0] and rows[0, 0, 1].tolist() == [8.0, 1.0, 0, 0]
    np.testing.assert_allclose(rows.sum(-1), plan_flow(plan, x).sum(-2))
    assert simulate_loads(plan, np.array([3]), x, CURVE_MODEL, CURVE).moe_fwd_comp_s == pytest.approx(6.0)
    assert simulate_loads(plan, np.array([3]), x, CURVE_MODEL, FLAT_RATE).moe_fwd_comp_s == pytest.approx(9.0)
