"""The torchtitan adapter (relibra_moe/integrations/upstream_torchtitan.py) against the installed torchtitan: the
version it was written for, and each contract it relies on, on torchtitan's real ``MoE``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan")

from relibra_moe.integrations import upstream_torchtitan as ut  # noqa: E402
from relibra_moe.integrations.torchtitan import is_titan_moe  # noqa: E402
from relibra_moe.layers.upstream_torch import version_in_range  # noqa: E402
from tests.integrations.test_torchtitan import qwen3_moe  # noqa: E402


def _block():
    return next(m for m in qwen3_moe().modules() if is_titan_moe(m))


def test_installed_torchtitan_is_a_tested_version():
    from importlib.metadata import version

    v = version("torchtitan")
    assert version_in_range(v, ut.TESTED), (
        f"torchtitan {v} is outside the range upstream_torchtitan.py was tested against {ut.TESTED}: check each "
        "contract there against it, then widen TESTED")


def test_router_contract():
    """``forward(x [B, L, D], expert_bias [E] | None) -> (topk_scores [B, L, K], topk_ids [B, L, K], scores
    [B, L, E])``; the top-k scores are the scores at the ids (softmax, no renormalization in this config)."""
    router = _block().router
    E, k = int(router.num_experts), int(router.top_k)
    assert (E, k) == (8, 2) and hasattr(router, "route_norm") and hasattr(router, "route_scale")
    x = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        topk_scores, topk_ids, scores = router(x, None)
    assert topk_scores.shape == topk_ids.shape == (1, 5, k) and scores.shape == (1, 5, E)
    g = scores.gather(-1, topk_ids)
    if router.route_norm:
        g = g / g.sum(-1, keepdim=True)
    torch.testing.assert_close(topk_scores.float(), (g * router.route_scale).float(), rtol=1e-5, atol=1e-6)


def test_experts_contract():
    ex = _block().routed_experts.inner_experts
    assert ex.w1_EFD.shape == ex.w3_EFD.shape == (8, 16, 32) and ex.w2_EDF.shape == (8, 32, 16)


def test_as_titan_module_makes_the_block_a_torchtitan_module():
    from torchtitan.protocols.module import Module

    lin = torch.nn.Linear(2, 2)
    assert ut.as_titan_module(lin) is lin and isinstance(lin, Module) and type(lin).__mro__[1] is torch.nn.Linear
    assert callable(lin.init_states)


def test_replay_router_and_grouped_experts_keep_the_instances():
    block = _block()
    router, ex = block.router, block.routed_experts.inner_experts
    cls_r, cls_e = type(router), type(ex)
    mixin = type("Mixin", (), {"tagged": True})
    assert ut.replay_router(router, mixin) is router and isinstance(router, cls_r) and router.tagged
    assert ut.as_grouped_experts(ex, mixin) is ex and isinstance(ex, cls_e) and ex.tagged


def test_forces_load_balance_reads_the_routers_debug_flag():
    router = _block().router
    assert ut.forces_load_balance(router) is False
    router._debug_force_load_balance = True  # what torchtitan's config sets (router._debug_force_load_balance)
    assert ut.forces_load_balance(router) is True
