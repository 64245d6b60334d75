"""The simulator charges a measured expert-GEMM curve per expert's rows (replicas included), hand-computed on a
2-point curve; without a curve the one-rate figures are unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from relibra_moe.evaluate import plan_expert_rows, plan_flow
from relibra_moe.plan import BatchPlan, Placement, ReplicaPlan, SamplePlacement
from relibra_moe.sim import simulate_loads
from relibra_moe.specs import ClusterSpec, ModelSpec
from relibra_moe.timing import expert_compute_seconds

# One (token, expert) pair: 6 x 4 x 8 = 192 FLOPs. Curve: 96 FLOP/s at 1 row per expert, 480 at 16 rows;
# interpolated in log(rows): +96 FLOP/s per doubling, 192 at 2 rows, 384 at 8. The profile's one rate: 192 FLOP/s.
MODEL = ModelSpec("tiny", hidden=4, ffn=8, num_experts=4, top_k=2, num_layers=1, dtype_bytes=2,
                  num_heads=2, num_kv_heads=1, head_dim=2)
FLAT = ClusterSpec(nodes=2, gpus_per_node=2, nvlink_bw=8.0, rdma_bw=4.0, flops=192.0, attn_flops=384.0)
CURVE = FLAT.with_(gemm_curve=((1.0, 96.0), (16.0, 480.0)))


def _plan(replica_expert=None, rows=(), shares=()) -> BatchPlan:
    reps = (ReplicaPlan.empty(1, 1, 4, 0) if replica_expert is None else
            ReplicaPlan(np.asarray(replica_expert), np.asarray(rows, np.int32).reshape(-1, 5),
                        np.asarray(shares, np.float32), "node"))
    return BatchPlan(Placement(Placement.static(1, 4, 4).expert_gpu), SamplePlacement(np.zeros(1, np.int64),
                     np.zeros(1, np.int64), 1), reps, 4, 2, {})


def test_curve_interpolation():
    assert CURVE.expert_flops_at(2) == pytest.approx(192.0)
    assert CURVE.expert_flops_at(np.array([0.5, 1, 4, 8, 16, 100])) == pytest.approx([96, 96, 288, 384, 480, 480])
    assert FLAT.expert_flops_at(np.array([1.0, 7.0])).tolist() == [192.0, 192.0]
    # two experts with 8 and 1 rows on one GPU: 8 x 192 / 384 + 1 x 192 / 96 = 4 + 2 = 6 s
    assert expert_compute_seconds(np.array([[8.0, 1.0, 0.0]]), MODEL, CURVE) == pytest.approx([6.0])


def test_static_cell_charges_each_experts_rows():
    # GPU 0 serves expert 0 with 8 rows (8 x 192 / 384 = 4 s); GPU 1 expert 1 with 1 row (192 / 96 = 2 s).
    # One rate (192 FLOP/s): 8 s and 1 s.
    x = np.zeros((1, 1, 4, 4))
    x[0, 0, 0, 0] = 8
    x[0, 0, 0, 1] = 1
    lengths = np.array([3])
    flat = simulate_loads(_plan(), lengths, x, MODEL, FLAT)
    curve = simulate_loads(_plan(), lengths, x, MODEL, CURVE)
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
    plan = _plan(rep, [(0, 0, 0, 0, 0), (0, 0, 0, 0, 1)], [0.5, 0.5])
    rows = plan_expert_rows(plan, x)
    assert rows[0, 0, 0].tolist() == [8.0, 0, 0, 0] and rows[0, 0, 1].tolist() == [8.0, 1.0, 0, 0]
    np.testing.assert_allclose(rows.sum(-1), plan_flow(plan, x).sum(-2))
    assert simulate_loads(plan, np.array([3]), x, MODEL, CURVE).moe_fwd_comp_s == pytest.approx(6.0)
    assert simulate_loads(plan, np.array([3]), x, MODEL, FLAT).moe_fwd_comp_s == pytest.approx(9.0)
