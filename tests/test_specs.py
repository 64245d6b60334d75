"""Specs: presets match the public model configs, link classes on a rail-optimized fabric.

The dispatcher's traffic (Megatron all-to-all vs DeepEP), the rates accessor and cluster profiles.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from relibra_moe.cost import moe_cost
from relibra_moe.errors import PlanError
from relibra_moe.planners import _kernels as K
from relibra_moe.planners.reorder import cluster_constants
from relibra_moe.planners.split import cell_weights
from relibra_moe.specs import (
    CLUSTER_PRESETS,
    CR,
    LOC,
    NV,
    SR,
    ClusterSpec,
    ModelSpec,
    cluster_from_profile,
    cluster_preset,
    cluster_profile,
    dispatch_copies_per_pair,
    dispatch_traffic,
    load_cluster_profile,
    model_preset,
    replica_buffer_bytes,
    save_cluster_profile,
)


@pytest.mark.parametrize(
    "name, hidden, ffn, experts, top_k, layers",
    [
        ("qwen3-30b-a3b", 2048, 768, 128, 8, 48),
        ("glm4.5-106b-a12b", 4096, 1408, 128, 8, 45),
        ("qwen3-235b-a22b", 4096, 1536, 128, 8, 94),
        ("gpt-oss-20b", 2880, 2880, 32, 4, 24),
        ("olmoe-1b-7b", 2048, 1024, 64, 8, 16),
    ],
)
def test_model_presets(name, hidden, ffn, experts, top_k, layers):
    m = model_preset(name)
    assert (m.hidden, m.ffn, m.num_experts, m.top_k, m.num_layers) == (hidden, ffn, experts, top_k, layers)
    assert m.token_bytes == hidden * 2


def test_replica_buffer_matches_paper_figures():
    # the ReLibra paper, execution: r = 2, bf16: 18 MiB (Qwen3-30B-A3B), 72 MiB (Qwen3-235B-A22B)
    assert replica_buffer_bytes(model_preset("qwen3-30b-a3b"), 2) / 2**20 == pytest.approx(18.0)
    assert replica_buffer_bytes(model_preset("qwen3-235b-a22b"), 2) / 2**20 == pytest.approx(72.0)


def test_link_classes_2x2():
    c = ClusterSpec(nodes=2, gpus_per_node=2)
    expected = np.array([[LOC, NV, SR, CR], [NV, LOC, CR, SR], [SR, CR, LOC, NV], [CR, SR, NV, LOC]])
    np.testing.assert_array_equal(c.link_classes, expected)
    assert c.link_class(0, 3) == "cr" and c.link_class(1, 3) == "sr"


def test_node_and_rail_of_a_gpu():
    c = ClusterSpec(nodes=3, gpus_per_node=4)  # GPU g is on node g // 4, rail g % 4
    assert (c.node_of(0), c.node_of(3), c.node_of(4), c.node_of(11)) == (0, 0, 1, 2)
    assert (c.rail_of(0), c.rail_of(5), c.rail_of(11)) == (0, 1, 3)
    np.testing.assert_array_equal(c.node_of(np.arange(12)), [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
    np.testing.assert_array_equal(c.rail_of(np.array([[4, 9], [10, 3]])), [[0, 1], [2, 3]])


def test_link_classes_are_symmetric_and_counted():
    c = cluster_preset(nodes=4, gpus_per_node=8)
    lc = c.link_classes
    assert (lc == lc.T).all()
    # per source: 7 nv peers, 3 same-rail remote, 3 x 7 = 21 cross-rail remote
    for cls, n in ((NV, 7), (SR, 3), (CR, 21), (LOC, 1)):
        assert ((lc == cls).sum(axis=1) == n).all()


def test_hopper_rail_defaults():
    c = cluster_preset("hopper-rail", nodes=2, gpus_per_node=8)
    assert (c.num_gpus, c.nvlink_bw, c.rdma_bw, c.flops) == (16, 450e9, 50e9, 700e12)


def test_bad_specs_raise():
    with pytest.raises(ValueError, match="unknown model preset"):
        model_preset("nope")
    with pytest.raises(ValueError, match="unknown cluster preset"):
        cluster_preset("nope")
    with pytest.raises(ValueError, match="gpus_per_node"):
        ClusterSpec(nodes=1, gpus_per_node=0)
    with pytest.raises(ValueError, match="top_k"):
        ModelSpec("x", 4, 4, 2, 3, 1)
    with pytest.raises(ValueError, match=r"ClusterSpec.rdma_bw must be a finite number > 0, got 0"):
        ClusterSpec(nodes=1, gpus_per_node=2, rdma_bw=0)
    with pytest.raises(ValueError, match=r"ClusterSpec.flops must be a finite number > 0, got nan"):
        ClusterSpec(nodes=1, gpus_per_node=2, flops=float("nan"))
    with pytest.raises(ValueError, match=r"ClusterSpec.attn_flops must be a finite number > 0, got -1.0"):
        ClusterSpec(nodes=1, gpus_per_node=2, attn_flops=-1.0)
    with pytest.raises(ValueError, match=r"ClusterSpec.nodes must be a positive int, got True"):
        ClusterSpec(nodes=True, gpus_per_node=2)
    with pytest.raises(ValueError, match=r"ModelSpec.hidden must be a positive int, got 4.0"):
        ModelSpec("x", 4.0, 4, 2, 1, 1)
    with pytest.raises(ValueError, match=r"ModelSpec.num_kv_heads must be a positive int, got 0"):
        ModelSpec("x", 4, 4, 2, 1, 1, num_kv_heads=0)
    with pytest.raises(ValueError, match=r"ModelSpec.shared_experts must be an int >= 0, got -1"):
        ModelSpec("x", 4, 4, 2, 1, 1, shared_experts=-1)
    with pytest.raises(ValueError, match=r"ModelSpec.shared_ffn must be a positive int or None, got 0"):
        ModelSpec("x", 4, 4, 2, 1, 1, shared_ffn=0)
    with pytest.raises(ValueError, match=r"ModelSpec.top_k=3 exceeds num_experts=2"):
        model_preset("olmoe-1b-7b").with_(num_experts=2, top_k=3)


TINY = ModelSpec("tiny", hidden=16, ffn=8, num_experts=8, top_k=3, num_layers=1)


def test_hand_case_token_to_three_experts_on_one_remote_node():
    """2 nodes x 2 GPUs; a token on GPU 0 (node 0, rail 0) goes to experts on GPU 2 (node 1, rail 0) and twice
    to GPU 3 (node 1, rail 1). Megatron's all-to-all: 3 RDMA copies (one per pair) and the two cross-rail pairs
    also on NVLink (the PXN hop, counted at source and target). DeepEP: 1 RDMA copy to GPU 2 (the rail-0 GPU of
    node 1), then 1 NVLink forward 2 -> 3 (GPU 3 gets the token once for its two experts)."""
    src, tg = np.array([0]), np.array([[2, 3, 3]])
    a2a = dispatch_traffic(src, tg, cluster_preset("h100", nodes=2, gpus_per_node=2))
    assert a2a["rdma_tx"].tolist() == [3, 0, 0, 0]
    assert a2a["rdma_rx"].tolist() == [0, 0, 1, 2]
    assert a2a["nvlink_tx"].tolist() == [2, 0, 0, 0]
    assert a2a["nvlink_rx"].tolist() == [0, 0, 0, 2]
    dep = dispatch_traffic(src, tg, cluster_preset("h100", nodes=2, gpus_per_node=2, dispatcher="deepep"))
    assert dep["rdma_tx"].tolist() == [1, 0, 0, 0]
    assert dep["rdma_rx"].tolist() == [0, 0, 1, 0]
    assert dep["nvlink_tx"].tolist() == [0, 0, 1, 0]
    assert dep["nvlink_rx"].tolist() == [0, 0, 0, 1]


def _enumerated(cluster):
    """Every source GPU sends one token for every 3-subset of the 8 experts (expert e on GPU e // 2): the loads x
    [G, E] and the exact token-level traffic totals."""
    G = cluster.num_gpus
    sets = list(itertools.combinations(range(8), 3))
    x = np.zeros((G, 8))
    src, tg = [], []
    for j in range(G):
        for s in sets:
            x[j, list(s)] += 1
            src.append(j)
            tg.append([e // 2 for e in s])
    return x, dispatch_traffic(np.array(src), np.array(tg), cluster)


@pytest.mark.parametrize("dispatcher", ["alltoall", "deepep"])
def test_pair_model_matches_token_count_in_expectation(dispatcher):
    """Over uniform routing (all C(8, 3) expert sets from every source), the cost model's traffic (pairs x copies
    per pair) equals the token-level count: per GPU for all-to-all, in total for DeepEP (whose forwards leave
    from the rail GPU, not the source)."""
    cluster = cluster_preset("h100", nodes=2, gpus_per_node=2, dispatcher=dispatcher)
    x, exact = _enumerated(cluster)
    c = moe_cost(x, np.arange(8) // 2, TINY, cluster)
    tb = TINY.token_bytes
    for key in ("nvlink_tx", "nvlink_rx", "rdma_tx", "rdma_rx"):
        got = getattr(c, key) / tb
        if dispatcher == "alltoall":
            np.testing.assert_allclose(got, exact[key], rtol=0, atol=1e-9)
        else:
            assert got.sum() == pytest.approx(exact[key].sum(), rel=1e-12)
    nv, rdma = dispatch_copies_per_pair(TINY, cluster)
    if dispatcher == "alltoall":
        assert (nv, rdma) == (1.0, 1.0)
    else:
        # hand: a node holds 4 of 8 experts: P(miss) = C(4,3)/C(8,3) = 4/56; copies per pair = (52/56) * 2 / 3
        assert rdma == pytest.approx((52 / 56) * 2 / 3, rel=1e-12)
        # a GPU holds 2 of 8: P(miss) = C(6,3)/C(8,3) = 20/56; copies per pair = (36/56) * 4 / 3
        assert nv == pytest.approx((36 / 56) * 4 / 3, rel=1e-12)


def test_kernels_and_split_weights_use_the_dispatcher():
    """The numba state objective and the split LP's weights charge the same DeepEP traffic as cost.py."""
    rng = np.random.default_rng(0)
    model = ModelSpec("m", hidden=64, ffn=32, num_experts=16, top_k=4, num_layers=1)
    for dispatcher in ("alltoall", "deepep"):
        cluster = cluster_preset("h800", nodes=2, gpus_per_node=4, dispatcher=dispatcher)
        x = rng.integers(0, 50, size=(8, 16)).astype(np.float64)
        homes = rng.permutation(np.arange(16) % 8).astype(np.int64)
        nvm, rdm, cc, tnv, trd = cluster_constants(model, cluster)
        st = np.zeros((5, 8))
        K.init_state(x, homes, nvm, rdm, st)
        got = K.layer_objective(st[0], st[1], st[2], st[3], st[4], cc, tnv, trd, 20.0, False, np.zeros(8))
        ref = moe_cost(x, homes, model, cluster)
        assert got == pytest.approx(float(ref.t_moe), rel=1e-12)
        w = cell_weights(model, cluster)
        r = cluster.rates(model)
        assert w.w_rdma == pytest.approx(2 * model.token_bytes * r.rdma_copies / cluster.rdma_bw / w.sec_per_token)
    a2a = moe_cost(x, homes, model, cluster_preset("h800", nodes=2, gpus_per_node=4))
    dep = moe_cost(x, homes, model, cluster)
    assert dep.rdma_tx.sum() < a2a.rdma_tx.sum()


def test_presets_and_default():
    for name in CLUSTER_PRESETS:
        for d in ("alltoall", "deepep"):
            c = cluster_preset(name, nodes=2, dispatcher=d)
            assert c.dispatcher == d and c.name == name
    old = cluster_preset("hopper-rail", nodes=2)
    assert (old.nvlink_bw, old.rdma_bw, old.flops, old.attn_flops) == (450e9, 50e9, 700e12, None)
    assert cluster_preset(nodes=2).name == "h100"
    with pytest.raises(ValueError, match="dispatcher"):
        cluster_preset("h100", dispatcher="nccl")


def test_gemm_curve_interpolation():
    c = cluster_preset("h100").with_(gemm_curve=((128, 100e12), (2048, 400e12)))
    assert c.expert_flops_at(128) == 100e12
    assert c.expert_flops_at(4096) == 400e12
    assert c.expert_flops_at(512) == pytest.approx(250e12)  # halfway in log2 rows
    with pytest.raises(ValueError, match="gemm_curve"):
        cluster_preset("h100").with_(gemm_curve=((2048, 1e12), (128, 1e12)))


def test_profile_round_trip(tmp_path):
    c = cluster_preset("h800", nodes=1, gpus_per_node=8, dispatcher="deepep").with_(
        flops=321e12, gemm_curve=((64, 50e12), (4096, 321e12)))
    p = tmp_path / "prof.json"
    save_cluster_profile(p, cluster_profile(c, "measured", {"note": 1}))
    back = load_cluster_profile(p, nodes=4)
    assert back == c.with_(nodes=4, attn_flops=c.attention_flops)
    bad = json.loads(p.read_text())
    bad["nvlink_bw"] = -1
    with pytest.raises(PlanError, match="nvlink_bw"):
        cluster_from_profile(bad, 1)
    with pytest.raises(PlanError, match="gpus_per_node is 8"):
        load_cluster_profile(p, nodes=1, gpus_per_node=4)
    with pytest.raises(PlanError, match="format"):
        cluster_from_profile({"format": "x"}, 1)
