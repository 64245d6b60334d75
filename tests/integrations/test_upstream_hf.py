"""The Hugging Face adapter (relibra_moe/integrations/upstream_hf.py) against the installed transformers: the version
it was written for, and each contract it relies on, on the real classes of every layer family."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from relibra_moe.integrations import upstream_hf as uh  # noqa: E402
from relibra_moe.integrations.hf_families import family_of  # noqa: E402
from relibra_moe.integrations.hf_layer import LAYER_FAMILIES  # noqa: E402
from relibra_moe.integrations.hf_tiny import tiny_model  # noqa: E402
from relibra_moe.layers.upstream_torch import version_in_range  # noqa: E402


def _block(fam: str):
    model = tiny_model(fam)
    return model, next(m for m in model.modules() if family_of(m) is not None)


def test_installed_transformers_is_a_tested_version():
    import transformers

    assert version_in_range(transformers.__version__, uh.TESTED), (
        f"transformers {transformers.__version__} is outside the range upstream_hf.py was tested against {uh.TESTED}:"
        " check each contract there against it, then widen TESTED")


@pytest.mark.parametrize("fam", LAYER_FAMILIES)
def test_router_contract(fam):
    """``forward(hidden [T, H]) -> (logits [T, E], gates [T, k], ids [T, k])`` with ``top_k`` and ``num_experts``;
    the ids are the top-k of the logits' scores."""
    _, block = _block(fam)
    router = getattr(block, family_of(block).router_attr)
    E, k = int(router.num_experts), int(router.top_k)
    assert (E, k) == (8, 2)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = router(x)
    assert isinstance(out, tuple) and len(out) == 3
    logits, gates, ids = out
    assert logits.shape == (5, E) and gates.shape == (5, k) and ids.shape == (5, k)
    assert ids.dtype in (torch.int64, torch.int32) and bool(((ids >= 0) & (ids < E)).all())
    if fam != "deepseek_v3":  # (DeepSeek-V3 selects with a bias and group limits: ids are not logits' top-k)
        assert set(map(tuple, ids.sort(-1).values.tolist())) == set(
            map(tuple, logits.topk(k, dim=-1).indices.sort(-1).values.tolist()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fam", LAYER_FAMILIES)
def test_router_logits_are_the_router_forwards_first_output(fam, dtype):
    """:func:`router_logits` computes HF's router logits without the rest of its forward: the same values and dtype
    (DeepSeek-V3's fp32 router in a bf16 model included; GPT-OSS's bias), and the same gradients w.r.t. the input
    and every router parameter, bit for bit."""
    _, block = _block(fam)
    block = block.to(dtype)
    fam_ = family_of(block)
    router = getattr(block, fam_.router_attr)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 32, generator=g).to(dtype).requires_grad_()
    for p in router.parameters():  # HF initializes routers to zero: random weights (and GPT-OSS's bias)
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=g))
    ref = router(x)[0]
    got = uh.router_logits(router, x, fam_.router_fp32)
    assert got.dtype == ref.dtype == (torch.float32 if fam == "deepseek_v3" else dtype)
    assert torch.equal(got, ref)
    dy = torch.randn(ref.shape, generator=g).to(ref.dtype)
    leaves = [x, *router.parameters()]
    assert len(leaves) == (3 if fam == "gpt_oss" else 2)
    for a, b in zip(torch.autograd.grad((got * dy).sum(), leaves), torch.autograd.grad((ref * dy).sum(), leaves),
                    strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fam", LAYER_FAMILIES)
def test_experts_contract(fam):
    """Fused experts, expert dimension first, in the layout the layer's mixins read."""
    _, block = _block(fam)
    ex = block.experts
    E, H = 8, 32
    if fam == "gpt_oss":
        I2 = ex.gate_up_proj.shape[2]
        assert ex.gate_up_proj.shape == (E, H, I2) and ex.down_proj.shape == (E, I2 // 2, H)
        assert ex.gate_up_proj_bias.shape == (E, I2) and ex.down_proj_bias.shape == (E, H)
        assert float(ex.alpha) > 0 and float(ex.limit) > 0
    else:
        I2 = ex.gate_up_proj.shape[1]
        assert ex.gate_up_proj.shape == (E, I2, H) and ex.down_proj.shape == (E, H, I2 // 2)
        assert callable(ex.act_fn)


@pytest.mark.parametrize("fam", ["qwen3_moe", "gpt_oss"])
def test_router_logits_are_recorded_by_router_class_and_survive_the_mixin(fam):
    """HF records ``router_logits`` from every module of its router class (``_can_record_outputs``): a router given
    a mixin by :func:`replay_router` keeps ``isinstance`` and is still recorded, with the same logits."""
    from relibra_moe.integrations.hf_layer import HFReplayMoE

    model, block = _block(fam)
    fam_ = family_of(block)
    router = getattr(block, fam_.router_attr)
    spec = type(model.model)._can_record_outputs[uh.ROUTER_LOGITS_KEY]
    assert spec.target_class is type(router) and spec.index == 0
    ids = torch.tensor([[3, 5, 7, 9, 11, 13]])
    with torch.no_grad():
        ref = model(ids, output_router_logits=True).router_logits
    mixin = type("Mixin", (), {"forward": lambda self, h: super(mixin, self).forward(h)})
    uh.replay_router(router, mixin, fam_)
    assert isinstance(router, spec.target_class) and router._family is fam_
    with torch.no_grad():
        out = model(ids, output_router_logits=True).router_logits
    assert len(out) == len(ref)
    for a, b in zip(out, ref, strict=True):
        torch.testing.assert_close(a, b)
    assert HFReplayMoE  # the layer applies the same adapter (tests/integrations/test_hf_layer.py)


def test_as_grouped_experts_keeps_the_parameters():
    _, block = _block("qwen3_moe")
    ex = block.experts
    params = dict(ex.named_parameters())
    mixin = type("Mixin", (), {"tagged": True})
    assert uh.as_grouped_experts(ex, mixin) is ex and ex.tagged
    assert dict(ex.named_parameters()) == params


@pytest.mark.parametrize("fam, default", [("qwen3_moe", True), ("gpt_oss", False)])
def test_experts_implementation_leaves_a_gate_and_an_ep_flag(fam, default):
    """What ``@use_experts_implementation`` leaves on the module, read by the ``"relibra"`` experts forward: the
    gate activation (HF's default ``act_fn(gate) * up``, or GPT-OSS's own) and HF's expert-parallel flag."""
    _, block = _block(fam)
    ex = block.experts
    apply_gate, is_default = uh.gate_activation(ex)
    assert is_default is default
    h = torch.randn(3, 2 * 16, generator=torch.Generator().manual_seed(0))
    if default:
        gate, up = h.chunk(2, dim=-1)
        torch.testing.assert_close(apply_gate(h), ex.act_fn(gate) * up)
    else:
        assert apply_gate(h).shape == (3, 16)
    assert "_is_expert_parallel" in vars(ex) and uh.hf_expert_parallel(ex) is False
    ex._is_expert_parallel = True
    assert uh.hf_expert_parallel(ex) is True
