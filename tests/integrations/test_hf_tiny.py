"""The tiny HF models (relibra_moe/integrations/hf_tiny.py): each family's config as documented, seeded weights,
the zero-initialized router parts filled."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from relibra_moe.integrations.hf_families import family_of  # noqa: E402
from relibra_moe.integrations.hf_tiny import FAMILIES, tiny_config, tiny_model  # noqa: E402


@pytest.mark.parametrize("fam", FAMILIES)
def test_each_family_builds_a_small_float32_eval_model_of_that_family(fam):
    model = tiny_model(fam, num_layers=2, num_experts=4, top_k=2)
    assert model.config.model_type == fam and model.config.hidden_size == 32
    assert model.config.num_hidden_layers == 2 and not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    blocks = [m for m in model.modules() if family_of(m) is not None]
    assert blocks and all(family_of(b).name == fam for b in blocks)
    router = getattr(blocks[0], family_of(blocks[0]).router_attr)
    assert (int(router.num_experts), int(router.top_k)) == (4, 2)
    with torch.no_grad():
        logits = model(torch.tensor([[3, 4, 5]])).logits
    assert logits.shape == (1, 3, 97) and bool(torch.isfinite(logits).all())


def test_weights_are_drawn_from_the_seed():
    a, b, c = tiny_model("qwen3_moe", seed=3), tiny_model("qwen3_moe", seed=3), tiny_model("qwen3_moe", seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


@pytest.mark.parametrize("fam, suffixes", [("deepseek_v3", ("e_score_correction_bias",)),
                                           ("gpt_oss", ("gate_up_proj_bias", "down_proj_bias", "router.bias"))])
def test_zero_initialized_router_and_expert_biases_are_filled(fam, suffixes):
    model = tiny_model(fam)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    for suffix in suffixes:
        hit = [t for n, t in tensors.items() if n.endswith(suffix)]
        assert hit and all(float(t.detach().abs().sum()) > 0 for t in hit), suffix


def test_config_details_and_overrides():
    assert tiny_config("qwen3_moe", num_layers=3).mlp_only_layers == [1]  # one dense layer
    assert tiny_config("deepseek_v3").first_k_dense_replace == 1
    assert tiny_config("mixtral", router_aux_loss_coef=0.25).router_aux_loss_coef == 0.25
    with pytest.raises(ValueError, match="family 'llama'"):
        tiny_config("llama")
