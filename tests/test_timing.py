"""Per-message latency (alpha-beta): transfers, the MoE all-to-all rounds and the presets, on hand-computed cells;
alpha = 0 gives the bandwidth-only figures exactly. The calibrate fit of alpha on synthetic and gloo sizes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

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


# ------------------------------------------------------------------ compute / all-to-all overlap
def _two_stream_schedule(a: float, c: float, comm: float) -> float:
    """Finish time of Megatron-LM's one-forward-one-backward layer schedule (``TransformerLayerSchedulePlan.run``),
    played node by node: each stream runs its nodes in issue order, each node also waits for its pass's
    predecessor (the dW GEMM delayed: the backward dispatch waits for the dX GEMM only)."""
    d = comm / 2
    nodes = {  # name: (stream, seconds, predecessor in its own pass)
        "combine_bwd": ("comm", d, None), "attn_fwd": ("comp", a, None),
        "mlp_bwd": ("comp", c, "combine_bwd"), "dispatch_fwd": ("comm", d, "attn_fwd"),
        "mlp_bwd_dw": ("comp", c, "mlp_bwd"), "dispatch_bwd": ("comm", d, "mlp_bwd"),
        "mlp_fwd": ("comp", c, "dispatch_fwd"), "combine_fwd": ("comm", d, "mlp_fwd"),
        "attn_bwd": ("comp", 2 * a, "dispatch_bwd"),
    }
    issue = {"comp": ["attn_fwd", "mlp_bwd", "mlp_bwd_dw", "mlp_fwd", "attn_bwd"],
             "comm": ["combine_bwd", "dispatch_fwd", "dispatch_bwd", "combine_fwd"]}
    end: dict[str, float] = {}
    free = {"comp": 0.0, "comm": 0.0}
    pending = {k: list(v) for k, v in issue.items()}
    while any(pending.values()):
        for stream, queue in pending.items():
            if queue and (nodes[queue[0]][2] is None or nodes[queue[0]][2] in end):
                name = queue.pop(0)
                _, t, pred = nodes[name]
                start = max(free[stream], end[pred] if pred else 0.0)
                end[name] = free[stream] = start + t
    return max(end.values())


def test_overlap_rules_hand_computed():
    from relibra_moe.timing import layer_step_seconds

    # a = 1, c = 1, comm = 4 (dispatch = combine = 2):
    # none: 1 + 2 + 3 + 2 x 4 = 14; dualpipe: max(1 + 2 + 3, 8) = 8; megatron: attention fwd beside the backward
    # combine (2), then the dispatches (2 + 2) beside the MLP backward and forward (3), then the forward combine (2)
    # beside the attention backward (2): 2 + 4 + 2 = 8.
    assert layer_step_seconds(1.0, 1.0, 4.0, "none") == pytest.approx(14.0)
    assert layer_step_seconds(1.0, 1.0, 4.0, "megatron") == pytest.approx(8.0)
    assert layer_step_seconds(1.0, 1.0, 4.0, "dualpipe") == pytest.approx(8.0)
    # compute-bound: a = 2, c = 1, comm = 1: megatron 2 + 3 + 4 = 9 (all comm hidden), dualpipe 9, none 11
    assert layer_step_seconds(2.0, 1.0, 1.0, "megatron") == pytest.approx(9.0)
    assert layer_step_seconds(2.0, 1.0, 1.0, "dualpipe") == pytest.approx(9.0)
    assert layer_step_seconds(2.0, 1.0, 1.0, "none") == pytest.approx(11.0)
    # arrays broadcast
    np.testing.assert_allclose(layer_step_seconds(np.array([1.0, 2.0])[:, None], 1.0, np.array([4.0, 1.0]),
                                                  "megatron"), [[8.0, 6.0], [10.0, 9.0]])
    with pytest.raises(PlanError, match="overlap 'full' is not one of"):
        layer_step_seconds(1.0, 1.0, 1.0, "full")
    with pytest.raises(ValueError, match="ClusterSpec.overlap must be one of"):
        BW.with_(overlap="full")
    assert cluster_preset("h100", overlap="megatron").overlap == "megatron" and cluster_preset("h100").overlap == "none"


def test_megatron_rule_is_the_two_stream_schedule():
    from relibra_moe.timing import layer_step_seconds

    rng = np.random.default_rng(0)
    for a, c, comm in rng.uniform(0.0, 3.0, size=(300, 3)):
        assert layer_step_seconds(a, c, comm, "megatron") == pytest.approx(_two_stream_schedule(a, c, comm))


@given(u=st.tuples(*[st.floats(0, 10)] * 3), v=st.tuples(*[st.floats(0, 10)] * 3), lam=st.floats(0, 5))
def test_overlap_rules_are_sublinear_monotone_and_ordered(u, v, lam):
    # what the bound (sim.bound_step) needs of every rule: f(u + v) <= f(u) + f(v), f(lam u) = lam f(u),
    # non-decreasing; and none >= megatron >= dualpipe >= max(compute, communication)
    from relibra_moe.timing import OVERLAPS, layer_step_seconds

    uv = tuple(x + y for x, y in zip(u, v))
    for o in OVERLAPS:
        f = lambda p, o=o: float(layer_step_seconds(*p, o))  # noqa: E731
        assert f(uv) <= f(u) + f(v) + 1e-9
        assert f(tuple(lam * x for x in u)) == pytest.approx(lam * f(u), abs=1e-9)
        assert f(uv) >= f(u) - 1e-9
    a, c, m = u
    none, meg, dual = (float(layer_step_seconds(a, c, m, o)) for o in ("none", "megatron", "dualpipe"))
    assert none + 1e-9 >= meg >= dual - 1e-9 and dual >= max(3 * a + 3 * c, 2 * m) - 1e-9


def test_step_weights_derived_from_the_rule():
    from relibra_moe.timing import MIN_STEP_WEIGHT, STEP_COMP_WEIGHT, step_comp_weight, step_weights

    assert step_comp_weight("none") == STEP_COMP_WEIGHT == 1.5  # exactly: plans without overlap are unchanged
    assert step_comp_weight("none", 0.3, 7.0, 0.01) == 1.5  # a linear rule: any point
    assert step_weights("none", 0.3, 7.0, 0.01) == pytest.approx((3.0, 2.0))
    # megatron at a = 0.2, c = 1, comm = 3: f(c, m) = max(0.2, m/2) + max(max(c, m/2) + m/2, max(2c, m/2) + c)
    # + max(0.4, m/2); w_comp = (f(2, 3) - f(0, 3)) / 2 = (9 - 6) / 2 = 1.5, w_comm = (f(1, 6) - f(1, 0)) / 6 =
    # (12 - 3.6) / 6 = 1.4
    assert step_weights("megatron", 0.2, 1.0, 3.0) == pytest.approx((1.5, 1.4))
    assert step_comp_weight("megatron", 0.2, 1.0, 3.0) == pytest.approx(1.5 / 1.4)
    # dualpipe, compute-bound: communication hidden entirely -> its weight floors at MIN_STEP_WEIGHT of compute's;
    # megatron, communication-bound (c = 0.1, comm = 4): compute hidden -> its weight floors the other way
    assert step_comp_weight("dualpipe", 1.0, 1.0, 0.5) == pytest.approx(1.0 / MIN_STEP_WEIGHT)
    assert step_weights("megatron", 0.1, 0.1, 4.0)[0] == 0.0
    assert step_comp_weight("megatron", 0.1, 0.1, 4.0) == pytest.approx(MIN_STEP_WEIGHT)


def test_simulated_step_under_overlap():
    from relibra_moe.timing import attention_forward, layer_step_seconds

    plan = _plan()
    x = np.zeros((1, 1, 4, 4))
    x[0, 0, 0] = [2, 1, 1, 0]
    lengths = np.array([2])
    none = simulate_loads(plan, lengths, x, MODEL, BW)
    a = float(attention_forward(lengths, np.zeros(1, np.int64), np.zeros(1, np.int64), 1, MODEL, BW)[0])
    for overlap in ("megatron", "dualpipe"):
        st_ = simulate_loads(plan, lengths, x, MODEL, BW.with_(overlap=overlap))
        want = float(layer_step_seconds(a, none.moe_fwd_comp_s, none.moe_fwd_comm_s, overlap))
        assert st_.step_s == pytest.approx(want)
        assert st_.overlap_hidden_s == pytest.approx(none.step_s - want) and st_.overlap_hidden_s > 0
        assert sum(st_.breakdown.values()) == pytest.approx(st_.step_s)
        assert st_.breakdown["overlap_hidden"] == pytest.approx(-st_.overlap_hidden_s)
        assert st_.to_dict()["overlap_hidden_s"] == st_.overlap_hidden_s
    assert none.overlap_hidden_s == 0.0 and "overlap_hidden" not in none.breakdown
