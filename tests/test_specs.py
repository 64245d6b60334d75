"""Specs: presets match the public model configs, link classes on a rail-optimized fabric."""

from __future__ import annotations

import numpy as np
import pytest

from relibra_moe.specs import (
    CR,
    LOC,
    NV,
    SR,
    ClusterSpec,
    ModelSpec,
    cluster_preset,
    model_preset,
    replica_buffer_bytes,
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
