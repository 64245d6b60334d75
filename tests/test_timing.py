"""Per-message latency (alpha-beta): transfers, the MoE all-to-all rounds and the presets, on hand-computed cells;
alpha = 0 gives the bandwidth-only figures exactly. The calibrate fit of alpha on synthetic and gloo sizes."""

from __future__ import annotations

import numpy as np
import pytest

from relibra_moe.commands.calibrate import fit_alpha_beta, measure_all_to_all_latency
from relibra_moe.errors import PlanError
from relibra_moe.plan import BatchPlan, Placement, ReplicaPlan, SamplePlacement
from relibra_moe.sim import reorder_traffic, simulate_loads
from relibra_moe.specs import ClusterSpec, ModelSpec, cluster_from_profile, cluster_preset, cluster_profile
from relibra_moe.timing import all_to_all_latency, message_latency, transfer_seconds

# One (token, expert) pair: 192 FLOPs = 1 s; a token 8 B = 1 s on NVLink, 2 s on RDMA; an expert 192 B.
MODEL = ModelSpec("tiny", hidden=4, ffn=8, num_experts=4, top_k=2, num_layers=1, dtype_bytes=2,
                  num_heads=2, num_kv_heads=1, head_dim=2)
BW = ClusterSpec(nodes=2, gpus_per_node=2, nvlink_bw=8.0, rdma_bw=4.0, flops=192.0, attn_flops=384.0)
LAT = BW.with_(nvlink_latency=0.5, rdma_latency=2.0)


def _plan(replica_expert=None, rows=(), shares=(), M=1) -> BatchPlan:
    L, E, G = 1, 4, 4
    reps = (ReplicaPlan.empty(M, L, G, 0) if replica_expert is None else
            ReplicaPlan(np.asarray(replica_expert), np.asarray(rows, np.int32).reshape(-1, 5),
                        np.asarray(shares, np.float32), "node"))
    return BatchPlan(Placement(Placement.static(L, E, G).expert_gpu), SamplePlacement(np.zeros(1, np.int64),
                     np.zeros(1, np.int64), M), reps, G, 2, {})


def test_message_latency_by_link_class():
    # loc, nv, sr, cr from GPU 0 of a 2 x 2 cluster.
    assert message_latency(LAT.link_classes[0], LAT).tolist() == [0.0, 0.5, 2.0, 2.5]
    assert not message_latency(BW.link_classes, BW).any()


def test_transfer_seconds_alpha_beta_hand_computed():
    # One NVLink message of 16 B: 0.5 + 16 / 8 = 2.5 s; one cross-rail message: max(16/8, 16/4) + 0.5 + 2 = 6.5 s.
    assert transfer_seconds(np.array([0]), np.array([1]), 16.0, None, 1, LAT)[0] == 2.5
    assert transfer_seconds(np.array([0]), np.array([3]), 16.0, None, 1, LAT)[0] == 6.5
    # Two groups: {0->1 (nv), 0->2 (sr)} pays the largest alpha once: max(2, 4) + 2 = 6; {1->0 (nv)}: 2 + 0.5.
    t = transfer_seconds(np.array([0, 0, 1]), np.array([1, 2, 0]), 16.0, np.array([0, 0, 1]), 2, LAT)
    assert t.tolist() == [6.0, 2.5]
    # alpha = 0: the bandwidth-only figures, exactly.
    t0 = transfer_seconds(np.array([0, 0, 1]), np.array([1, 2, 0]), 16.0, np.array([0, 0, 1]), 2, BW)
    assert t0.tolist() == [4.0, 2.0]


def test_all_to_all_latency_per_cell():
    flow = np.zeros((3, 4, 4))
    flow[0, 0, 0] = 5  # local only: no message
    flow[1, 0, 1] = 1  # nv
    flow[2, 0, 1] = flow[2, 1, 3] = 1  # nv and sr
    assert all_to_all_latency(flow, LAT).tolist() == [0.0, 0.5, 2.0]
    assert all_to_all_latency(flow, BW).tolist() == [0.0, 0.0, 0.0]


def test_simulated_step_pays_two_rounds_per_pass():
    # 3 tokens on GPU 0 to experts 0 (loc) and 1 (nv): bandwidth-only step 1 + (3 + 6) + 2 + (6 + 6) = 24 s
    # (tests/test_sim.py). Latency: dispatch + combine pay alpha_nv each, forward and backward: comm 6 + 1 = 7,
    # step 1 + 10 + 2 + 13 = 26.
    x = np.zeros((1, 1, 4, 4))
    x[0, 0, 0, :2] = 3
    assert simulate_loads(_plan(), np.array([3]), x, MODEL, BW).step_s == 24.0
    st = simulate_loads(_plan(), np.array([3]), x, MODEL, LAT)
    assert st.moe_fwd_comm_s == 7.0 and st.moe_bwd_comm_s == 7.0 and st.step_s == 26.0
    assert st.t_moe[0, 0] == 9.0  # the cost model's T_MoE (the planners' metric) has no latency
    # Experts 2 (sr) and 3 (cr): comm 24 + 2 x 2.5 = 29; step 1 + 32 + 2 + 35 = 70 (60 without latency).
    x2 = np.zeros((1, 1, 4, 4))
    x2[0, 0, 0, 2:] = 3
    assert simulate_loads(_plan(), np.array([3]), x2, MODEL, BW).step_s == 60.0
    assert simulate_loads(_plan(), np.array([3]), x2, MODEL, LAT).step_s == 70.0


def test_replica_push_and_reorder_pay_alpha():
    # A replica of expert 1 on GPU 0 serves all of GPU 0's tokens: no all-to-all message; the push is one NVLink
    # message of 192 B: 0.5 + 24 = 24.5 s, exposed 24.5 - 1 forward and 24.5 - 2 backward.
    x = np.zeros((1, 1, 4, 4))
    x[0, 0, 0, :2] = 3
    rep = np.full((1, 1, 4, 1), -1)
    rep[0, 0, 0, 0] = 1
    st = simulate_loads(_plan(rep, [(0, 0, 0, 1, 0)], [1.0]), np.array([3]), x, MODEL, LAT)
    assert st.replica_push_s == 24.5 and st.replica_exposed_s == 23.5 + 22.5
    assert st.step_s == 1 + 6 + 23.5 + 2 + 12 + 22.5
    # Moving expert 1 from GPU 1 to GPU 2 (cross rail): 3 x 4 x 8 x (2 + 12) = 1344 B, max(1344/8, 1344/4) + 2.5.
    old = Placement.static(1, 4, 4)
    new = Placement(np.array([[0, 2, 1, 3]]))
    assert reorder_traffic(old, new, MODEL, LAT)[0] == 336.0 + 2.5
    assert reorder_traffic(old, new, MODEL, BW)[0] == 336.0


def test_presets_latencies_and_profile_round_trip():
    hr = cluster_preset("hopper-rail", nodes=2)
    assert (hr.nvlink_latency, hr.rdma_latency) == (0.0, 0.0) and hr.rates(MODEL).rdma_latency == 0.0
    for name in ("h100", "h200", "h800"):
        c = cluster_preset(name, nodes=2)
        assert (c.nvlink_latency, c.rdma_latency) == (4e-6, 12.5e-6)
        assert c.rates(MODEL).nvlink_latency == 4e-6
    prof = cluster_profile(LAT, "test")
    assert (prof["nvlink_latency"], prof["rdma_latency"]) == (0.5, 2.0)
    assert cluster_from_profile(prof, nodes=2) == LAT
    old = {k: v for k, v in prof.items() if not k.endswith("_latency")}  # a profile written before latency
    assert cluster_from_profile(old, nodes=2).nvlink_latency == 0.0
    with pytest.raises(PlanError, match="nvlink_latency must be a finite number >= 0.*-1"):
        cluster_from_profile({**prof, "nvlink_latency": -1.0}, nodes=2)


def test_fit_alpha_beta_synthetic():
    b = np.array([4e3, 16e3, 64e3, 256e3])
    alpha, bw = fit_alpha_beta(b, 5e-6 + b / 200e9)
    assert alpha == pytest.approx(5e-6, rel=1e-9) and bw == pytest.approx(200e9, rel=1e-9)
    with pytest.raises(PlanError, match="distinct sizes"):
        fit_alpha_beta([4e3, 4e3], [1e-5, 1e-5])
    with pytest.raises(PlanError, match="do not grow"):
        fit_alpha_beta([4e3, 8e3], [2e-5, 1e-5])


@pytest.mark.timeout(120)
def test_all_to_all_latency_measurement_gloo():
    # sizes 4 KiB .. 16 MiB: wide enough apart that the times grow with the bytes on a loaded CPU box
    sizes = (1 << 12, 1 << 22, 1 << 24)
    res = measure_all_to_all_latency(2, sizes=sizes, iters=3, backend="gloo", timeout_s=90)
    pts = res["points"]
    assert [p["bytes_per_gpu"] for p in pts] == list(sizes)
    # the fit is the least-squares line through the measured points (an independent np.linalg.lstsq)
    sent = np.array([p["bytes_per_gpu"] / 2 for p in pts])
    a = np.stack([np.ones(3), sent], axis=1)
    (alpha, slope), *_ = np.linalg.lstsq(a, np.array([p["seconds"] for p in pts]), rcond=None)
    assert res["alpha"] == pytest.approx(alpha, rel=1e-6, abs=1e-12) and res["bw"] == pytest.approx(1 / slope)


def test_planner_cell_pricing_matches_the_simulator():
    """The replication pricing (``replicate.cell_step_terms``) charges the cell's all-to-all latency and the push's
    alpha as the simulator does: comm 6 + 2 x 0.5 = 7 s; a replica of expert 1 on GPU 0 pushes 192 B over NVLink,
    0.5 + 24 = 24.5 s."""
    from relibra_moe.planners.replicate import CellResult, cell_step_terms

    x = np.zeros((4, 4))
    x[0, :2] = 3
    eg = np.arange(4)
    none = CellResult(np.full((4, 1), -1, np.int32), np.zeros((0, 3), np.int32), np.zeros(0), 0.0)
    assert cell_step_terms(x, eg, none, MODEL, LAT) == (3.0, 7.0, 0.0)
    assert cell_step_terms(x, eg, none, MODEL, BW) == (3.0, 6.0, 0.0)
    rep = np.full((4, 1), -1, np.int32)
    rep[0, 0] = 1
    moved = CellResult(rep, np.array([[0, 1, 0]], np.int32), np.array([1.0]), 0.0)
    assert cell_step_terms(x, eg, moved, MODEL, LAT) == (6.0, 0.0, 24.5)
