"""The cost model of docs/method.md, "Cost model" on hand-computed 2-node x 2-GPU cases, one per link class."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from relibra_moe.cost import flow_matrix, moe_cost, peak_comp_comm, smooth_max
from relibra_moe.errors import PlanError
from relibra_moe.specs import ClusterSpec, ModelSpec

# h = 4, h' = 2, bf16: a token is 8 bytes, a (token, expert) pair costs 6*4*2 = 48 FLOPs.
MODEL = ModelSpec("tiny", hidden=4, ffn=2, num_experts=4, top_k=2, num_layers=1, dtype_bytes=2)
# GPUs 0, 1 on node 0 and 2, 3 on node 1; rails: 0 and 2 share rail 0, 1 and 3 share rail 1.
CLUSTER = ClusterSpec(nodes=2, gpus_per_node=2, nvlink_bw=4.0, rdma_bw=2.0, flops=12.0)
STATIC = np.array([0, 1, 2, 3])  # expert e homed on GPU e


def one_token(src: int, expert: int, count: float = 1.0) -> np.ndarray:
    x = np.zeros((4, 4))
    x[src, expert] = count
    return x


def test_local_token_costs_compute_only():
    c = moe_cost(one_token(0, 0, 3), STATIC, MODEL, CLUSTER)
    assert c.comp[0] == pytest.approx(3 * 48 / 12.0)
    assert np.all(c.comm == 0)
    assert c.t_moe == pytest.approx(12.0)


def test_nvlink_token():
    # 0 -> 1 is nv: 8 bytes on NVLink tx of GPU 0 and rx of GPU 1; comm = dispatch + combine = 2 * 8 / 4
    c = moe_cost(one_token(0, 1), STATIC, MODEL, CLUSTER)
    assert c.nvlink_tx.tolist() == [8, 0, 0, 0]
    assert c.nvlink_rx.tolist() == [0, 8, 0, 0]
    assert np.all(c.rdma_tx == 0) and np.all(c.rdma_rx == 0)
    assert c.comm.tolist() == [4.0, 4.0, 0.0, 0.0]
    assert c.comp.tolist() == [0.0, 4.0, 0.0, 0.0]
    assert c.t_moe == pytest.approx(4.0 + 4.0)


def test_same_rail_token_uses_rdma_only():
    # 1 -> 3: other node, same rail (rail 1): RDMA only, 2 * 8 / 2 = 8 s
    c = moe_cost(one_token(1, 3), STATIC, MODEL, CLUSTER)
    assert np.all(c.nvlink_tx == 0) and np.all(c.nvlink_rx == 0)
    assert c.rdma_tx.tolist() == [0, 8, 0, 0]
    assert c.rdma_rx.tolist() == [0, 0, 0, 8]
    assert c.comm.tolist() == [0.0, 8.0, 0.0, 8.0]
    assert c.t_moe == pytest.approx(4.0 + 8.0)


def test_cross_rail_token_counts_on_nvlink_and_rdma_at_both_ends():
    # 0 -> 3: other node, other rail; the paper's formulas count it on both link types, source and target
    c = moe_cost(one_token(0, 3), STATIC, MODEL, CLUSTER)
    assert c.nvlink_tx.tolist() == [8, 0, 0, 0]
    assert c.rdma_tx.tolist() == [8, 0, 0, 0]
    assert c.nvlink_rx.tolist() == [0, 0, 0, 8]
    assert c.rdma_rx.tolist() == [0, 0, 0, 8]
    # max(8/4, 8/2) = 4, doubled for the combine
    assert c.comm.tolist() == [8.0, 0.0, 0.0, 8.0]


def test_mixed_case_takes_max_over_gpus_of_each_term():
    x = one_token(0, 1, 2) + one_token(2, 2, 5) + one_token(3, 0, 1)
    c = moe_cost(x, STATIC, MODEL, CLUSTER)
    # loads: GPU0 1 (from 3), GPU1 2, GPU2 5 -> max comp 5*4 = 20
    assert c.load.tolist() == [1, 2, 5, 0]
    # GPU0: nv tx 16 B (4 s), rdma rx 8 B from 3 (cr: also nv rx 8 B) -> max(16/4, 8/4, 8/2)=4 -> comm 8
    # GPU3: cr tx 8 B: nv 2 s, rdma 4 s -> comm 8
    assert c.comm.tolist() == [8.0, 8.0, 0.0, 8.0]
    assert c.t_moe == pytest.approx(20.0 + 8.0)


def test_replica_shares_split_tokens():
    x = one_token(0, 3, 4)
    shares = np.zeros((4, 4, 4))
    shares[:, np.arange(4), STATIC] = 1.0
    shares[0, 3] = [0.0, 0.0, 0.5, 0.5]  # half to the replica on GPU 2 (same rail as GPU 0)
    c = moe_cost(x, None, MODEL, CLUSTER, shares=shares)
    assert c.load.tolist() == [0, 0, 2, 2]
    # GPU 0: rdma tx = 4 tokens * 8 B = 32 B -> 16 s; nv tx = 2 tokens (cr) = 16 B -> 4 s; comm 32
    assert c.rdma_tx[0] == 32 and c.nvlink_tx[0] == 16
    assert c.t_moe == pytest.approx(2 * 4.0 + 32.0)


def test_vectorized_over_layers_and_micro_batches_matches_per_cell():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, size=(3, 2, 4, 4))
    homes = np.array([[3, 2, 1, 0], [0, 2, 1, 3]])
    batched = moe_cost(x, homes, MODEL.with_(num_layers=2), CLUSTER)
    for m in range(3):
        for l in range(2):
            cell = moe_cost(x[m, l], homes[l], MODEL, CLUSTER)
            assert batched.t_moe[m, l] == pytest.approx(cell.t_moe)
            np.testing.assert_allclose(batched.comm[m, l], cell.comm)


def loop_cost(x, home, shares, model: ModelSpec, nodes: int, per_node: int, nv_bw, rdma_bw, flops):
    """Float64 loops over (source j, expert e, target g), link class from node and rail ids directly."""
    G, E = x.shape
    load, comm = np.zeros(G), np.zeros(G)
    nv_tx, nv_rx, rd_tx, rd_rx = (np.zeros(G) for _ in range(4))
    for j in range(G):
        for e in range(E):
            for g in range(G):
                y = shares[j, e, g] if shares is not None else float(home[e] == g)
                f = float(x[j, e]) * y
                load[g] += f
                if j == g:
                    continue
                same_node, same_rail = j // per_node == g // per_node, j % per_node == g % per_node
                nvlink = same_node or not same_rail  # nv, or cross-rail (cr) which also uses NVLink
                rdma = not same_node  # sr or cr
                b = f * model.hidden * model.dtype_bytes
                if nvlink:
                    nv_tx[j] += b
                    nv_rx[g] += b
                if rdma:
                    rd_tx[j] += b
                    rd_rx[g] += b
    for g in range(G):
        comm[g] = 2 * max(nv_tx[g] / nv_bw, nv_rx[g] / nv_bw, rd_tx[g] / rdma_bw, rd_rx[g] / rdma_bw)
    comp = load * 6 * model.hidden * model.ffn / flops
    return load, comp, comm, comp.max() + comm.max()


@pytest.mark.parametrize("seed", range(4))
def test_random_layers_match_loop_reference(seed):
    """2 nodes x 4 GPUs, 8 experts, random homes and random replica shares: every output against loops."""
    rng = np.random.default_rng(seed)
    model = ModelSpec("t8", hidden=6, ffn=5, num_experts=8, top_k=2, num_layers=1, dtype_bytes=2)
    cluster = ClusterSpec(nodes=2, gpus_per_node=4, nvlink_bw=3.0e3, rdma_bw=0.7e3, flops=2.0e4)
    x = rng.integers(0, 40, size=(8, 8)).astype(float)
    home = rng.integers(0, 8, size=8)  # any homes (the cost model does not need E/G per GPU)
    shares = rng.random((8, 8, 8)) * (rng.random((8, 8, 8)) < 0.3)
    shares[np.arange(8)[:, None], np.arange(8)[None, :], home[None, :]] += 0.5
    shares /= shares.sum(axis=2, keepdims=True)
    for sh in (None, shares):
        c = moe_cost(x, home, model, cluster, shares=sh)
        load, comp, comm, t = loop_cost(x, home, sh, model, 2, 4, 3.0e3, 0.7e3, 2.0e4)
        np.testing.assert_allclose(c.load, load, rtol=1e-12)
        np.testing.assert_allclose(c.comp, comp, rtol=1e-12)
        np.testing.assert_allclose(c.comm, comm, rtol=1e-12, atol=1e-15)
        assert c.t_moe == pytest.approx(t, rel=1e-12)
        # the peaks without the smoothed terms: the loop's maxima, and exactly cost_from_flow's
        peak = peak_comp_comm(flow_matrix(x, home, sh), model, cluster)
        assert peak == pytest.approx((comp.max(), comm.max()), rel=1e-12)
        assert peak == (float(c.comp.max()), float(c.comm.max()))
        # LSE bound: comm smooths 4 terms then G GPUs, comp smooths G GPUs, scale = mean comp
        s = comp.mean()
        assert t - 1e-12 <= c.t_moe_smooth <= t + s * (2 * np.log(4) + 2 * np.log(8)) / 20.0 + 1e-12


@given(st.lists(st.floats(0, 100), min_size=1, max_size=16), st.floats(1, 100))
def test_smooth_max_bounds(values, beta):
    z = np.array(values)
    s = smooth_max(z, beta, 1.0)
    assert z.max() - 1e-9 <= s <= z.max() + np.log(len(z)) / beta + 1e-9


def test_smoothed_objective_upper_bounds_exact():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 100, size=(5, 4, 4))
    c = moe_cost(x, STATIC, MODEL.with_(num_layers=5), CLUSTER)
    assert np.all(c.t_moe_smooth >= c.t_moe - 1e-12)


def test_flow_matrix_conserves_tokens():
    rng = np.random.default_rng(2)
    x = rng.integers(0, 10, size=(4, 4))
    f = flow_matrix(x, STATIC)
    assert f.sum() == x.sum()
    assert f.sum(axis=1).tolist() == x.sum(axis=1).tolist()


def test_bad_shapes_raise_plan_error():
    with pytest.raises(PlanError, match="expected"):
        moe_cost(np.zeros((3, 4)), STATIC, MODEL, CLUSTER)
    with pytest.raises(PlanError, match="experts"):
        moe_cost(np.zeros((4, 5)), STATIC, MODEL, CLUSTER)
    with pytest.raises(PlanError, match="GPU 7"):
        moe_cost(np.zeros((4, 4)), np.array([0, 1, 2, 7]), MODEL, CLUSTER)
    with pytest.raises(PlanError, match="shares has shape"):
        moe_cost(np.zeros((4, 4)), None, MODEL, CLUSTER, shares=np.zeros((4, 4, 3)))
    with pytest.raises(PlanError, match=r"x\[1, 2\] = -1.0: token counts must be finite and >= 0"):
        moe_cost(one_token(1, 2, -1.0), STATIC, MODEL, CLUSTER)
    with pytest.raises(PlanError, match=r"x\[0, 0\] = nan"):
        moe_cost(one_token(0, 0, np.nan), STATIC, MODEL, CLUSTER)
    # a fractional home would match no GPU: its tokens would silently vanish from the cost
    with pytest.raises(PlanError, match=r"expert_gpu must hold integer GPU ids, got dtype float64"):
        moe_cost(np.ones((4, 4)), np.array([0, 1.5, 2, 3]), MODEL, CLUSTER)
    assert moe_cost(np.ones((4, 4)), np.array([0.0, 1, 2, 3]), MODEL, CLUSTER).load.sum() == 16
    with pytest.raises(PlanError, match="needs expert_gpu or shares"):
        flow_matrix(np.zeros((4, 4)))
